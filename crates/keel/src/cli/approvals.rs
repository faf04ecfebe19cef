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
                decide(id, Decision::Approve { note }, &target).await
            }
            ApprovalsCommand::Reject { id, note, target } => {
                decide(id, Decision::Reject { note }, &target).await
            }
            // With `--session`, the one argument given is the answer.
            ApprovalsCommand::Answer { id, answer, target } => match (id, answer) {
                (Some(id), Some(answer)) if target.session.is_none() => {
                    decide(Some(id), Decision::Answer(answer), &target).await
                }
                (Some(answer), None) if target.session.is_some() => {
                    decide(None, Decision::Answer(answer), &target).await
                }
                _ => {
                    eprintln!(
                        "error: give the question's id and the answer (`keel approvals answer qu_... \"Paris\"`), \
                         or `--session <id>` and the answer"
                    );
                    Ok(exit::USAGE)
                }
            },
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
    /// Decide what this session waits for, instead of naming its id: there must be exactly one
    /// approval (or, for `answer`, one question) pending in it.
    #[arg(long)]
    session: Option<String>,
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
    let store = match keel_store::open_existing(&args.store) {
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

async fn decide(id: Option<String>, decision: Decision, target: &DecisionTarget) -> std::io::Result<u8> {
    let store = match keel_store::open_existing(&target.store.store) {
        Ok(store) => store,
        Err(error) => {
            eprintln!("error[{}]: {error}", error.code());
            return Ok(exit::INVALID_AGENT);
        }
    };
    let id = match (id, &target.session) {
        (Some(id), None) => id,
        (None, Some(session)) => match pending_of(store.as_ref(), session, &decision).await {
            Ok(id) => id,
            Err(code) => return Ok(code),
        },
        _ => {
            eprintln!("error: name the approval by its id or by `--session`, not both");
            return Ok(exit::USAGE);
        }
    };
    let id = id.as_str();
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

/// The id of the one input `session` waits for that `decision` decides (an approval, or a
/// question for an answer); a clear error when there is none or more than one.
async fn pending_of(store: &dyn keel::Store, session: &str, decision: &Decision) -> Result<String, u8> {
    let session = SessionId::new(session).map_err(|failure| {
        eprintln!("error[{}]: {}", failure.code, failure.message);
        exit::USAGE
    })?;
    let pending = store.pending_inputs(Some(&session)).await.map_err(|error| {
        eprintln!("error[{}]: {error}", error.code());
        exit::RUN_FAILED
    })?;
    let question = matches!(decision, Decision::Answer(_));
    let (what, kind) = if question { ("question", "questions") } else { ("approval", "approvals") };
    let matching: Vec<_> =
        pending.iter().filter(|p| matches!(p.kind, PendingKind::Question { .. }) == question).collect();
    match matching.as_slice() {
        [one] => Ok(one.id.clone()),
        [] => {
            eprintln!(
                "error[{}]: session {} waits for no {what}",
                keel::ErrorCode::NotPending,
                session.external()
            );
            Err(exit::RUN_FAILED)
        }
        several => {
            let ids: Vec<&str> = several.iter().map(|p| p.id.as_str()).collect();
            eprintln!(
                "error: session {} waits for {} {kind} ({}): name the one to decide by its id",
                session.external(),
                several.len(),
                ids.join(", ")
            );
            Err(exit::USAGE)
        }
    }
}
