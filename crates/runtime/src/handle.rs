//! The caller's side of a run: its event stream, its result, and a way to cancel it.
//!
//! Dropping a [`RunHandle`] does not stop the run: a run is durable work, and the handle is only
//! a view of it. Use [`RunHandle::cancel`] to stop it.
//!
//! Most runs work in a Tokio task of their own. An inline run ([`Engine::start_inline`]) works in
//! the task that polls its handle instead: a caller that awaits the run at once then pays no
//! hand-off between tasks, which on a multi-thread runtime means no wake-up of another worker
//! thread. Its handle carries the run's work ([`Inline`]) and gives it to a task of its own when
//! it is dropped before the run ends, so that an inline run ends all the same.
//!
//! [`Engine::start_inline`]: crate::Engine::start_inline

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::channel::mpsc;
use futures::{FutureExt, Stream, StreamExt};
use keel_core::{ErrorCode, Event, PendingInput, RunFailure, RunId, SessionId, StopReason, Usage};
use serde_json::Value;
use sync_wrapper::SyncWrapper;
use tokio::sync::oneshot;
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
    admitted: Option<oneshot::Receiver<Result<(), RunFailure>>>,
    cancel: CancellationToken,
    /// The run's work, for an inline run that has not ended yet.
    inline: Option<Inline>,
}

/// An inline run's work: polled by its handle, spawned when the handle lets go of it unfinished.
pub(crate) struct Inline {
    /// Only ever reached through `&mut`, so the handle stays `Sync` around a future that is not.
    work: SyncWrapper<Option<Work>>,
    runtime: tokio::runtime::Handle,
}

type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

impl Inline {
    pub(crate) fn new(work: Work, runtime: tokio::runtime::Handle) -> Inline {
        Inline { work: SyncWrapper::new(Some(work)), runtime }
    }
}

impl Future for Inline {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let slot = self.work.get_mut();
        let Some(work) = slot.as_mut() else { return Poll::Ready(()) };
        let done = work.as_mut().poll(cx);
        if done.is_ready() {
            // Ended: nothing is left to hand over, and a finished future must not be polled again.
            *slot = None;
        }
        done
    }
}

impl Drop for Inline {
    fn drop(&mut self) {
        if let Some(work) = self.work.get_mut().take() {
            // The holder stopped driving the run before its end: a run is durable work, so the
            // rest goes on in a task of its own, as a spawned run's would.
            drop(self.runtime.spawn(work));
        }
    }
}

/// The driver's side of [`RunHandle::admitted`]: said once, when the run is admitted or refused.
pub(crate) type Admitted = Option<oneshot::Sender<Result<(), RunFailure>>>;

/// Says whether the run was admitted, the first time only.
pub(crate) fn tell_admitted(admitted: &mut Admitted, outcome: Result<(), &RunFailure>) {
    if let Some(sender) = admitted.take() {
        let _ = sender.send(outcome.map_err(Clone::clone));
    }
}

impl RunHandle {
    pub(crate) fn new(
        run_id: RunId,
        events: mpsc::UnboundedReceiver<Event>,
        result: oneshot::Receiver<Result<RunResult, RunFailure>>,
        admitted: oneshot::Receiver<Result<(), RunFailure>>,
        cancel: CancellationToken,
    ) -> RunHandle {
        RunHandle { run_id, events, result, admitted: Some(admitted), cancel, inline: None }
    }

    /// Makes this the handle of an inline run: its methods and its stream drive `work`.
    pub(crate) fn driving(mut self, work: Inline) -> RunHandle {
        self.inline = Some(work);
        self
    }

    /// Moves an inline run on as far as it goes without waiting (nothing for a spawned run).
    fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(inline) = self.inline.as_mut()
            && Pin::new(inline).poll(cx).is_ready()
        {
            self.inline = None;
        }
    }

    /// Waits until the run is admitted: a new run stored with its first step (its session was
    /// free, here and in every other process), or lined up behind the session's run in flight,
    /// in this process or another (`concurrency: queue` or `replace`); a resumed run claimed. Fails with the reason
    /// it will not run (`KEEL_SESSION_BUSY`, `KEEL_RUN_LEASED`, a store failure...), which also
    /// ends its stream. A server calls this before it answers, so that a refusal is an error
    /// status rather than an error inside a stream.
    pub async fn admitted(&mut self) -> Result<(), RunFailure> {
        let Some(mut admitted) = self.admitted.take() else { return Ok(()) };
        std::future::poll_fn(|cx| {
            self.drive(cx);
            admitted.poll_unpin(cx).map(|said| said.unwrap_or(Ok(())))
        })
        .await
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

    /// Waits for the run to end, discarding the events not yet read. From then on the run
    /// builds no events at all (nobody could read them).
    ///
    /// # Cancel safety
    /// Dropping this future does not stop the run.
    pub async fn result(self) -> Result<RunResult, RunFailure> {
        let RunHandle { events, result, inline, .. } = self;
        // Closing the event channel discards what is buffered, and the driver mutes the run's
        // machine when it sees the channel closed: a caller that only wants the result pays for
        // no event.
        drop(events);
        if let Some(inline) = inline {
            inline.await;
        }
        match result.await {
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
        self.drive(cx);
        self.events.poll_next_unpin(cx)
    }
}

impl std::fmt::Debug for RunHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHandle").field("run_id", &self.run_id).finish_non_exhaustive()
    }
}
