//! The caller's side of a run: its event stream, its result, and a way to cancel it.
//!
//! Dropping a [`RunHandle`] does not stop the run: a run is durable work, and the handle is only
//! a view of it. Use [`RunHandle::cancel`] to stop it.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use keel_core::{ErrorCode, Event, PendingInput, RunFailure, RunId, SessionId, StopReason, Usage};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// What a finished run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RunResult {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// The final text.
    pub text: String,
    /// The structured output, when the agent has an output schema (or a stop tool ended it).
    pub output: Option<Value>,
    /// Why the run stopped: [`StopReason::AwaitingInput`] when it paused for a human.
    pub stopped: StopReason,
    /// Tokens used by the run (so far, when it paused).
    pub usage: Usage,
    /// What a paused run waits for (empty unless `stopped` is `AwaitingInput`): decide each with
    /// `Engine::decide`, from this process or any other sharing the store.
    pub pending: Vec<PendingInput>,
}

/// A run in flight: a [`Stream`] of its [`Event`]s, then its result.
pub struct RunHandle {
    run_id: RunId,
    events: mpsc::UnboundedReceiver<Event>,
    result: oneshot::Receiver<Result<RunResult, RunFailure>>,
    cancel: CancellationToken,
}

impl RunHandle {
    pub(crate) fn new(
        run_id: RunId,
        events: mpsc::UnboundedReceiver<Event>,
        result: oneshot::Receiver<Result<RunResult, RunFailure>>,
        cancel: CancellationToken,
    ) -> RunHandle {
        RunHandle { run_id, events, result, cancel }
    }

    /// The run's id.
    pub fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// Asks the run to stop. The in-flight model call or tool is abandoned (a command tool's
    /// process group is killed), every open tool call gets a "cancelled" result, and the run
    /// ends with `stopped: cancelled`.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Waits for the run to end, discarding the events not yet read.
    ///
    /// # Cancel safety
    /// Dropping this future does not stop the run.
    pub async fn result(self) -> Result<RunResult, RunFailure> {
        // Closing the event channel discards what is buffered and makes further sends fail at
        // once: a caller that only wants the result pays for no event delivery.
        drop(self.events);
        match self.result.await {
            Ok(result) => result,
            Err(_) => Err(RunFailure::new(
                ErrorCode::Internal,
                "the run's task ended without a result (it panicked); please report this bug",
            )),
        }
    }
}

impl Stream for RunHandle {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.events.poll_recv(cx)
    }
}

impl std::fmt::Debug for RunHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHandle").field("run_id", &self.run_id).finish_non_exhaustive()
    }
}
