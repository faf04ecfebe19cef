//! `keel approvals list|approve|reject|answer`: decide, from any process, what paused runs
//! wait for.
//!
//! A decision is recorded in the store at once. With `--agent`, the run then continues here,
//! streamed like `keel run`; without, it continues the next time a process drives the session
//! (`keel run` on it, or a `keel serve` on the store).

use std::io::Write;
use std::path::PathBuf;

use keel::{Decision, PendingKind, SessionId, record_decision};

use super::run::follow;
use super::{ApprovalsCommand, StoreArgs, exit};

pub(crate) fn approvals(command: ApprovalsCommand) -> std::io::Result<u8> {
    super::run_async(async {
        match command {
            ApprovalsCommand::List { session, json, store } => list(session.as_deref(), json, &store).await,
            ApprovalsCommand::Approve { id, note, target } => {
                decide(&id, Decision::Approve { note }, &target).await
            }
            ApprovalsCommand::Reject { id, note, target } => {
                decide(&id, Decision::Reject { note }, &target).await
            }
            ApprovalsCommand::Answer { id, answer, target } => {
                decide(&id, Decision::Answer(answer), &target).await
            }
        }
    })?
}

/// Where a decision goes, and whether to continue the run here.
#[derive(clap::Args)]
pub(crate) struct DecisionTarget {
    /// Continue the run here, with this agent (a directory or spec file), streaming it like
    /// `keel run`. Without it the decision is recorded and the run continues the next time the
    /// session is driven.
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Print the continued run's events as JSON lines (with --agent).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: StoreArgs,
}

async fn list(session: Option<&str>, json: bool, args: &StoreArgs) -> std::io::Result<u8> {
    let session = match session.map(SessionId::new).transpose() {
        Ok(session) => session,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(2);
        }
    };
    let store = match keel_store::open(&args.store) {
        Ok(store) => store,
        Err(error) => {
            eprintln!("error[{}]: {error}", error.code());
            return Ok(exit::INVALID_AGENT);
        }
    };
    let pending = match store.pending_inputs(session.as_ref()).await {
        Ok(pending) => pending,
        Err(error) => {
            eprintln!("error[{}]: {error}", error.code());
            return Ok(exit::RUN_FAILED);
        }
    };
    let mut out = std::io::stdout().lock();
    if json {
        for input in &pending {
            writeln!(out, "{}", keel_core::wire::pending_to_json(input))?;
        }
        return Ok(exit::OK);
    }
    if pending.is_empty() {
        writeln!(std::io::stderr(), "nothing is pending in {}", args.store)?;
        return Ok(exit::OK);
    }
    for input in &pending {
        let expires = jiff::Timestamp::from_millisecond(input.expires_at_ms as i64)
            .map(|t| t.strftime("%Y-%m-%d %H:%M UTC").to_string())
            .unwrap_or_default();
        let what = match &input.kind {
            PendingKind::Approval { tool, input } => format!("approve {tool} {input}"),
            PendingKind::Question { question } => format!("answer: {question}"),
        };
        writeln!(out, "{}  session {}  {what}  (expires {expires})", input.id, input.session_id)?;
    }
    Ok(exit::OK)
}

async fn decide(id: &str, decision: Decision, target: &DecisionTarget) -> std::io::Result<u8> {
    let store = match keel_store::open(&target.store.store) {
        Ok(store) => store,
        Err(error) => {
            eprintln!("error[{}]: {error}", error.code());
            return Ok(exit::INVALID_AGENT);
        }
    };
    let verb = match decision {
        Decision::Approve { .. } => "approved",
        Decision::Reject { .. } => "rejected",
        Decision::Answer(_) | Decision::TimedOut => "answered",
    };
    let Some(agent_path) = &target.agent else {
        return match record_decision(store.as_ref(), id, decision, &keel::who("keel approvals")).await {
            Ok(pending) => {
                eprintln!(
                    "{verb} {id}; run {} of session {} continues the next time the session is driven \
                     (`keel run <agent> --session {} ...` or a `keel serve` on this store), or now with --agent",
                    pending.run_id, pending.session_id, pending.session_id
                );
                Ok(exit::OK)
            }
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                Ok(exit::RUN_FAILED)
            }
        };
    };
    drop(store);
    let agent = match super::run::load_agent(agent_path, None, &target.store.store).await? {
        Ok(agent) => agent,
        Err(code) => return Ok(code),
    };
    let handle = match agent.decide_as(id, decision, &keel::who("keel approvals")).await {
        Ok(handle) => handle,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(exit::RUN_FAILED);
        }
    };
    eprintln!("{verb} {id}; continuing run {}", handle.run_id());
    let (code, pending) = follow(handle, target.json, agent.store().event_log()).await?;
    if !pending.is_empty() {
        let ids: Vec<&str> = pending.iter().map(|p| p.id.as_str()).collect();
        eprintln!("paused again: still waiting for {}", ids.join(", "));
    }
    Ok(code)
}
