//! `keel run`: one turn of an agent, streamed to the terminal (or as JSON lines).

use futures::StreamExt;
use keel::{Agent, ErrorCode, StopReason};
use std::io::Write;

use super::RunArgs;
use super::exit;
use super::render::{HumanRenderer, JsonRenderer, Render};

pub(crate) fn run(args: RunArgs) -> std::io::Result<u8> {
    let mut stderr = std::io::stderr().lock();
    let options = keel_spec::LoadOptions {
        builtin_tools: keel_tools::BUILTIN_NAMES,
        providers: keel_providers::PROVIDER_NAMES,
    };
    let loaded = keel_spec::load(&args.agent, &options);
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    let Some(mut spec) = loaded.spec else {
        writeln!(stderr, "the agent has errors; `keel check {}` lists them", args.agent.display())?;
        return Ok(exit::INVALID_AGENT);
    };
    if let Some(model) = &args.model {
        spec.model.clone_from(model);
    }
    let store = match keel_store::open(&args.store) {
        Ok(store) => store,
        Err(error) => {
            writeln!(stderr, "error[{}]: {error}", error.code())?;
            return Ok(exit::INVALID_AGENT);
        }
    };
    let agent = match Agent::from_spec(spec, store) {
        Ok(agent) => agent,
        Err(error) => {
            writeln!(stderr, "error[{}]: {}", error.code(), error)?;
            return Ok(exit::INVALID_AGENT);
        }
    };
    drop(stderr);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(drive(&agent, &args))
}

async fn drive(agent: &Agent, args: &RunArgs) -> std::io::Result<u8> {
    // A turn of this session that a dead process left unfinished completes first, from its
    // journal, so the new input sees a whole conversation.
    let interrupted = match agent.recover(Some(&args.session)).await {
        Ok(handles) => handles,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(if failure.code == ErrorCode::SessionIdInvalid { 2 } else { exit::RUN_FAILED });
        }
    };
    for handle in interrupted {
        eprintln!("resuming interrupted run {} of session {}", handle.run_id(), args.session);
        let code = follow(handle, args.json).await?;
        if code != exit::OK {
            return Ok(code);
        }
    }
    let handle = match agent.run(&args.session, args.input.as_str()) {
        Ok(handle) => handle,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(if failure.code == ErrorCode::SessionIdInvalid { 2 } else { exit::RUN_FAILED });
        }
    };
    follow(handle, args.json).await
}

/// Shows a run as it goes (Ctrl-C cancels it) and maps its end to an exit code.
async fn follow(mut handle: keel::RunHandle, json: bool) -> std::io::Result<u8> {
    let mut renderer: Box<dyn Render> =
        if json { Box::new(JsonRenderer::new()) } else { Box::new(HumanRenderer::new()) };
    let mut interrupted = false;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            event = handle.next() => match event {
                Some(event) => renderer.event(&event)?,
                None => break,
            },
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                handle.cancel();
            }
        }
    }
    renderer.finish()?;
    Ok(match handle.result().await {
        Ok(result) => match result.stopped {
            StopReason::Final | StopReason::StopCondition => exit::OK,
            StopReason::MaxTurns | StopReason::Budget => exit::STOPPED_AT_LIMIT,
            StopReason::Cancelled => exit::INTERRUPTED,
        },
        Err(_) => exit::RUN_FAILED,
    })
}
