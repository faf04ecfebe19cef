//! `keel cancel <session>`: stops a session's unfinished run from any process.
//!
//! The request is recorded in the store. A run in flight in another process stops there within
//! a second (its engine polls for requests; its open calls get "cancelled" results). A run that
//! nobody drives (paused for a human, or interrupted) stops waiting at once; its open calls get
//! their results when a process next drives the session, or here and now with `--agent`.

use std::time::Duration;

use keel::{Clock, ErrorCode, RunState, SessionId};

use super::{CancelArgs, exit};

/// How long `keel cancel` waits to see a run in another process stop, before saying it was
/// asked to.
const CONFIRM_WITHIN: Duration = Duration::from_secs(5);

pub(crate) fn cancel(args: &CancelArgs) -> std::io::Result<u8> {
    let session = match SessionId::new(&args.session) {
        Ok(session) => session,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(2);
        }
    };
    super::run_async(async {
        let by = keel::who("keel cancel");
        if let Some(path) = &args.agent {
            let agent = match super::run::load_agent(path, None, &args.store.store).await? {
                Ok(agent) => agent,
                Err(code) => return Ok(code),
            };
            return Ok(match agent.engine().cancel(&session, &by).await {
                Ok(keel_runtime::Cancellation::Cancelled) => {
                    eprintln!("cancelled the run of session {session}");
                    exit::OK
                }
                Ok(keel_runtime::Cancellation::AlreadyCancelling { by }) => {
                    let by = by.map_or(String::new(), |by| format!(" (asked by {by})"));
                    eprintln!("the run of session {session} was being cancelled already{by}; it has ended");
                    exit::OK
                }
                Ok(keel_runtime::Cancellation::NoRun) => nothing_to_cancel(&session),
                Err(failure) => {
                    eprintln!("error[{}]: {}", failure.code, failure.message);
                    exit::RUN_FAILED
                }
            });
        }
        let store = match keel_store::open_existing(&args.store.store) {
            Ok(store) => store,
            Err(error) => {
                eprintln!("error[{}]: {error}", error.code());
                return Ok(exit::INVALID_AGENT);
            }
        };
        let run = match store.request_cancel(&session, &by).await {
            Ok(Some(run)) => run,
            Ok(None) => return Ok(nothing_to_cancel(&session)),
            Err(error) => {
                eprintln!("error[{}]: {error}", error.code());
                return Ok(exit::RUN_FAILED);
            }
        };
        let now = keel::SystemClock.now_ms();
        let dead = run.owner.as_deref().is_some_and(keel_runtime::is_provably_dead);
        if !run.is_leased(now) || dead {
            eprintln!(
                "cancelled run {} of session {session}: it no longer waits; its open calls get \"cancelled\" \
                 results the next time the session is driven (`keel run <agent> --session {session}`), or now \
                 with `keel cancel {session} --agent <agent>`",
                run.run_id
            );
            return Ok(exit::OK);
        }
        let owner = keel_core::owner::describe(run.owner.as_deref().unwrap_or_default());
        let deadline = tokio::time::Instant::now() + CONFIRM_WITHIN;
        while tokio::time::Instant::now() < deadline {
            match store.load_run(&run.run_id).await {
                Ok(Some(record)) if record.state != RunState::Running => {
                    eprintln!("cancelled run {} of session {session} ({owner} stopped it)", run.run_id);
                    return Ok(exit::OK);
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(error) => {
                    eprintln!("error[{}]: {error}", error.code());
                    return Ok(exit::RUN_FAILED);
                }
            }
        }
        eprintln!(
            "asked {owner} to cancel run {} of session {session}; it has not stopped yet (it stops at its next \
             lease renewal, or its lease runs out {})",
            run.run_id,
            keel_core::clock::relative(run.lease_expires_ms, now)
        );
        Ok(exit::OK)
    })?
}

fn nothing_to_cancel(session: &SessionId) -> u8 {
    eprintln!("error[{}]: session {session} has no unfinished run to cancel", ErrorCode::RunNotFound);
    exit::RUN_FAILED
}
