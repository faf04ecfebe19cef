//! `keel run`: one turn of an agent, streamed to the terminal (or as JSON lines).

use std::io::{IsTerminal, Write};

use futures::StreamExt;
use keel::{Agent, Decision, ErrorCode, PendingInput, PendingKind, RunHandle, StopReason};

use super::RunArgs;
use super::exit;
use super::render::{HumanRenderer, JsonRenderer, Render};

pub(crate) fn run(args: RunArgs) -> std::io::Result<u8> {
    let agent = match load_agent(&args.agent, args.model.as_deref(), &args.store)? {
        Ok(agent) => agent,
        Err(code) => return Ok(code),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(drive(&agent, &args))
}

/// Loads an agent with its store, printing the spec's diagnostics; `Err(exit code)` when it
/// cannot be set up.
pub(crate) fn load_agent(
    path: &std::path::Path,
    model: Option<&str>,
    store: &str,
) -> std::io::Result<Result<Agent, u8>> {
    let mut stderr = std::io::stderr().lock();
    let options = keel_spec::LoadOptions {
        builtin_tools: keel_tools::BUILTIN_NAMES,
        providers: keel_providers::PROVIDER_NAMES,
        tool_name: keel_tools::tool_name,
    };
    let loaded = keel_spec::load(path, &options);
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    let Some(mut spec) = loaded.spec else {
        writeln!(stderr, "the agent has errors; `keel check {}` lists them", path.display())?;
        return Ok(Err(exit::INVALID_AGENT));
    };
    if let Some(model) = model {
        spec.model = model.to_owned();
    }
    let store = match keel_store::open(store) {
        Ok(store) => store,
        Err(error) => {
            writeln!(stderr, "error[{}]: {error}", error.code())?;
            return Ok(Err(exit::INVALID_AGENT));
        }
    };
    Ok(match Agent::from_spec(spec, store) {
        Ok(agent) => Ok(agent),
        Err(keel::LoadError::Setup(failure)) => {
            writeln!(stderr, "error[{}]: {}", failure.code, failure.message)?;
            Err(exit::INVALID_AGENT)
        }
        Err(error) => {
            writeln!(stderr, "error[{}]: {}", error.code(), error)?;
            Err(exit::INVALID_AGENT)
        }
    })
}

async fn drive(agent: &Agent, args: &RunArgs) -> std::io::Result<u8> {
    // A turn of this session that a dead process left unfinished (or whose approvals were
    // decided since) completes first, from its journal, so the new input sees a whole
    // conversation.
    let interrupted = match agent.recover(Some(&args.session)).await {
        Ok(handles) => handles,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(if failure.code == ErrorCode::SessionIdInvalid { 2 } else { exit::RUN_FAILED });
        }
    };
    let context = Context { agent, args };
    for handle in interrupted {
        eprintln!("resuming run {} of session {}", handle.run_id(), args.session);
        let code = context.follow_through(handle).await?;
        if code != exit::OK {
            return Ok(code);
        }
    }
    let Some(input) = &args.input else {
        // Only continuing: say what the session still waits for, if anything.
        let pending = match agent.pending(Some(&args.session)).await {
            Ok(pending) => pending,
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                return Ok(exit::RUN_FAILED);
            }
        };
        if pending.is_empty() {
            return Ok(exit::OK);
        }
        explain_pause(&pending, &args.store, &args.agent)?;
        return Ok(exit::AWAITING_INPUT);
    };
    let handle = match agent.run(&args.session, input.as_str()) {
        Ok(handle) => handle,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(if failure.code == ErrorCode::SessionIdInvalid { 2 } else { exit::RUN_FAILED });
        }
    };
    context.follow_through(handle).await
}

/// What following a run needs: the agent, and the command's arguments (for the store and
/// agent paths that explain a pause).
pub(crate) struct Context<'a> {
    pub(crate) agent: &'a Agent,
    pub(crate) args: &'a RunArgs,
}

impl Context<'_> {
    /// Follows a run to its end. When it pauses for a human: on a terminal, asks and continues;
    /// otherwise says how to decide and exits with [`exit::AWAITING_INPUT`].
    pub(crate) async fn follow_through(&self, mut handle: RunHandle) -> std::io::Result<u8> {
        let interactive =
            !self.args.json && std::io::stdin().is_terminal() && std::io::stderr().is_terminal();
        loop {
            let (code, pending) = follow(handle, self.args.json).await?;
            if pending.is_empty() {
                return Ok(code);
            }
            if !interactive {
                explain_pause(&pending, &self.args.store, &self.args.agent)?;
                return Ok(exit::AWAITING_INPUT);
            }
            // Every decision is recorded, then the run continues once with all of them.
            for input in &pending {
                let Some(decision) = ask(input).await? else {
                    explain_pause(&pending, &self.args.store, &self.args.agent)?;
                    return Ok(exit::AWAITING_INPUT);
                };
                if let Err(failure) =
                    keel::record_decision(self.agent.store().as_ref(), &input.id, decision).await
                {
                    eprintln!("error[{}]: {}", failure.code, failure.message);
                    return Ok(exit::RUN_FAILED);
                }
            }
            handle = self.agent.resume(pending[0].run_id.clone());
        }
    }
}

/// Asks the human on the terminal. `None` when stdin ends (the decision is left for later).
async fn ask(input: &PendingInput) -> std::io::Result<Option<Decision>> {
    let prompt = match &input.kind {
        PendingKind::Approval { tool, input: tool_input } => {
            format!("Allow {tool} {tool_input}? [y/N, or a reason to refuse] ")
        }
        PendingKind::Question { question } => format!("{question}\n> "),
    };
    let is_question = matches!(input.kind, PendingKind::Question { .. });
    tokio::task::spawn_blocking(move || {
        let mut stderr = std::io::stderr().lock();
        write!(stderr, "{prompt}")?;
        stderr.flush()?;
        let mut line = String::new();
        if std::io::stdin().read_line(&mut line)? == 0 {
            return Ok(None);
        }
        let line = line.trim().to_owned();
        let lower = line.to_ascii_lowercase();
        Ok(Some(if is_question {
            Decision::Answer(line)
        } else if matches!(lower.as_str(), "y" | "yes") {
            Decision::Approve { note: None }
        } else {
            // Anything but a plain "no" is the reason, and the model sees it.
            Decision::Reject { note: (!matches!(lower.as_str(), "" | "n" | "no")).then_some(line) }
        }))
    })
    .await
    .unwrap_or_else(|join| Err(std::io::Error::other(join)))
}

/// Says what the paused run waits for and how to decide it.
fn explain_pause(pending: &[PendingInput], store: &str, agent: &std::path::Path) -> std::io::Result<()> {
    let mut err = std::io::stderr().lock();
    writeln!(err, "paused: the run waits for a human")?;
    if store == "memory" {
        writeln!(
            err,
            "note: the memory store ends with this command, and the run with it; use \
             `--store sqlite:PATH` to decide later"
        )?;
        return Ok(());
    }
    let agent = agent.display();
    for input in pending {
        match &input.kind {
            PendingKind::Approval { tool, input: tool_input } => {
                writeln!(err, "  {}: {tool} {tool_input}", input.id)?;
                writeln!(err, "    keel approvals approve {} --store {store} --agent {agent}", input.id)?;
                writeln!(
                    err,
                    "    keel approvals reject {} --note \"why\" --store {store} --agent {agent}",
                    input.id
                )?;
            }
            PendingKind::Question { question } => {
                writeln!(err, "  {}: {question}", input.id)?;
                writeln!(
                    err,
                    "    keel approvals answer {} \"...\" --store {store} --agent {agent}",
                    input.id
                )?;
            }
        }
    }
    Ok(())
}

/// Shows a run as it goes (Ctrl-C cancels it); returns its exit code and, when it paused,
/// what it waits for.
pub(crate) async fn follow(mut handle: RunHandle, json: bool) -> std::io::Result<(u8, Vec<PendingInput>)> {
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
            StopReason::Final | StopReason::StopCondition => (exit::OK, Vec::new()),
            StopReason::MaxTurns | StopReason::Budget => (exit::STOPPED_AT_LIMIT, Vec::new()),
            StopReason::Cancelled => (exit::INTERRUPTED, Vec::new()),
            StopReason::AwaitingInput => (exit::AWAITING_INPUT, result.pending),
        },
        // Another process drives the run now (it took the decision over): not a failure here.
        Err(failure) if failure.code == ErrorCode::RunLeased => {
            eprintln!("the run continues in another process: {}", failure.message);
            (exit::OK, Vec::new())
        }
        Err(_) => (exit::RUN_FAILED, Vec::new()),
    })
}
