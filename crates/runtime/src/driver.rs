//! The driver: executes a [`Machine`]'s actions, journals each completed step, replays journaled
//! steps instead of executing them again.
//!
//! The loop has a closed set of inputs (see [`Input`]): it takes the next queued input or, when
//! none is queued, waits for the first of "a tool call finished" and "the run was cancelled".
//! Before it starts new work (a model call, a tool, a question to a human) it checks whether it
//! must stop instead: cancelled (here, or by another process through the store), or poisoned
//! (the run's process died at this step too many times in a row).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc::UnboundedSender;
use futures::stream::FuturesUnordered;
use keel_core::journal::{JournalEntry, JournalRecord, JournaledReply};
use keel_core::loop_control::StepFinished;
use keel_core::machine::{Action, Input, Machine, RunOutcome};
use keel_core::memory::{MemoryRequest, MemoryScope};
use keel_core::message::ToolCall;
use keel_core::provider::{CallPurpose, ProviderErrorKind};
use keel_core::store::MAX_REDRIVES;
use keel_core::{
    AgentDef, BoxFuture, Claim, Concurrency, DeltaSink, ErrorCode, Event, Fence, LeaseStatus, LimitOverrides,
    Message, ModelReply, PendingInput, PendingKind, ProviderError, Role, RunFailure, RunId, RunRecord,
    RunState, SessionId, SessionSnapshot, SessionState, StepCommit, StepName, StopReason, StoreError,
    ToolContext, ToolError, ToolOutcome,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, SessionClaim};
use crate::handle::{Admitted, RunHandle, RunResult, tell_admitted};
use crate::shared::{Shared, nobody_drives};
use crate::spans;

/// How a run begins.
pub(crate) enum Plan {
    /// A new run of `session` answering `input`; `mode` says what it does when the session is
    /// busy in another process (the agent's `concurrency`, or `reject` for inputs nobody waits
    /// on).
    /// `limits`: the run's own limits and budgets, stored with it.
    Fresh {
        run_id: RunId,
        session: SessionId,
        input: Message,
        admission: Admission,
        mode: Concurrency,
        limits: LimitOverrides,
    },
    /// Re-drive a stored run from its journal. `session_held`: the caller already holds the
    /// run's session in this process (a new input finishing the session's unfinished run
    /// first). `takeover`: the run's lease holder, proven dead by the caller.
    Resume { run_id: RunId, session_held: bool, takeover: Option<String> },
}

impl Plan {
    fn run_id(&self) -> &RunId {
        match self {
            Plan::Fresh { run_id, .. } | Plan::Resume { run_id, .. } => run_id,
        }
    }
}

/// A tool call in flight: its step, call id, outcome and, when it succeeded and replaced the
/// session's state object, the new state.
type ToolFuture = BoxFuture<'static, ToolFinished>;

/// A run's tool calls in flight. The set is made for the first call that does not finish at
/// once: most calls do, and their runs never pay for it.
#[derive(Default)]
struct Running(Option<FuturesUnordered<ToolFuture>>);

impl Running {
    fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(FuturesUnordered::is_empty)
    }

    fn push(&mut self, call: ToolFuture) {
        self.0.get_or_insert_with(FuturesUnordered::new).push(call);
    }

    /// Drops every call in flight (which aborts their tasks).
    fn clear(&mut self) {
        if let Some(set) = &mut self.0 {
            set.clear();
        }
    }

    /// The next call to finish; `None` when none is in flight.
    async fn next(&mut self) -> Option<ToolFinished> {
        match &mut self.0 {
            Some(set) => set.next().await,
            None => None,
        }
    }
}

/// The machine's next input. A fresh result comes with its journal entry, committed with what
/// the machine makes of it; a tool call's, with the session state the call set.
struct Next {
    input: Input,
    entry: Option<Arc<JournalEntry>>,
    state: Option<Value>,
}

impl Next {
    /// An input with nothing to commit: the run's start, a replayed result, a decision, a stop.
    fn bare(input: Input) -> Next {
        Next { input, entry: None, state: None }
    }

    /// A fresh result, journaled as `entry`.
    fn fresh((input, entry): (Input, Option<Arc<JournalEntry>>)) -> Next {
        Next { input, entry, state: None }
    }

    /// A tool call that ran.
    fn tool(done: ToolFinished) -> Next {
        let ToolFinished { step, call_id, outcome, state, duration } = done;
        let entry = Arc::new(JournalEntry { step, record: JournalRecord::ToolResult(outcome.clone()) });
        Next {
            input: Input::ToolDone { call_id, outcome, duration: Some(duration) },
            entry: Some(entry),
            state,
        }
    }
}

/// A tool call that ran.
struct ToolFinished {
    step: StepName,
    call_id: String,
    outcome: ToolOutcome,
    /// The session state the call set (committed with its result).
    state: Option<Value>,
    /// How long it ran.
    duration: Duration,
}

/// A tool call started by the run. It is polled first in the run's own task: a call that
/// finishes at once (a pure function, a cached answer) costs no task, no wake-up of another
/// thread and no future of its own. One that waits goes on in a task of its own, which the run
/// awaits with the tool's timeout. A panic in either is the call's failure
/// (`KEEL_TOOL_PANICKED`), not the run's. A tool that blocks its thread in that first poll holds
/// the run up meanwhile; async tools (every built-in one) never do, and blocking work belongs in
/// `spawn_blocking`.
struct StartedTool {
    step: StepName,
    call_id: String,
    name: String,
    /// The tool's own future, boxed to be moved into a task if it waits.
    work: BoxFuture<'static, ToolOutcome>,
    span: Option<opentelemetry::Context>,
    /// The call's view of the session state, holding what the call staged.
    state: SessionState,
    started: tokio::time::Instant,
}

impl StartedTool {
    /// The first poll, in the run's task.
    fn poll_first(&mut self, cx: &mut std::task::Context<'_>) -> Poll<ToolOutcome> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work.as_mut().poll(cx))) {
            Ok(poll) => poll,
            Err(panic) => Poll::Ready(crashed(&self.name, format!("it panicked: {}", panic_text(&*panic)))),
        }
    }

    /// The rest of a call that did not finish at its first poll: its task is spawned now, so
    /// that it runs while the run carries on with the step; the future awaits it.
    fn finish_in_task(mut self, timeout: Duration) -> impl Future<Output = ToolFinished> + Send + 'static {
        let work = std::mem::replace(&mut self.work, Box::pin(std::future::pending()));
        let task = AbortOnDrop(tokio::spawn(work));
        self.await_task(task, timeout)
    }

    /// Waits for the call's task, at most until its timeout from the call's start.
    async fn await_task(self, mut task: AbortOnDrop<ToolOutcome>, timeout: Duration) -> ToolFinished {
        let outcome = match tokio::time::timeout_at(self.started + timeout, &mut task.0).await {
            Ok(Ok(outcome)) => outcome,
            // The run aborts a tool's task only by dropping it, so a cancelled task that the run
            // still awaits means the runtime is shutting down (the process is going away). The
            // call did not finish: nothing about it may be journaled, and a re-driven run calls it
            // again. Wait to be dropped.
            Ok(Err(join_error)) if join_error.is_cancelled() => {
                return std::future::pending::<ToolFinished>().await;
            }
            Ok(Err(join_error)) => crashed(&self.name, panic_message(join_error)),
            Err(_elapsed) => Err(ToolError::with_code(
                ErrorCode::ToolTimeout,
                format!(
                    "tool `{}` did not finish within {timeout:?} (`limits.tool_timeout`) and was stopped",
                    self.name
                ),
                true,
            )),
        };
        self.finish(outcome)
    }

    /// The call's end: its span closed, and the state it staged taken when it succeeded (a
    /// failed call's state replacement is dropped with it).
    fn finish(self, outcome: ToolOutcome) -> ToolFinished {
        let StartedTool { step, call_id, span, state, started, .. } = self;
        spans::end_tool(span, &outcome);
        let state = if outcome.is_ok() { state.commit_staged() } else { None };
        ToolFinished { step, call_id, outcome, state, duration: started.elapsed() }
    }
}

/// A tool call's crash (a panic, an aborted task) as its outcome.
fn crashed(name: &str, why: String) -> ToolOutcome {
    Err(ToolError::with_code(ErrorCode::ToolPanicked, format!("tool `{name}` crashed: {why}"), false))
}

/// Runs a run to its end and returns its result, like [`run`], but a panic in the run's task
/// (a bug in keel, a provider, a hook) becomes a `KEEL_INTERNAL` failure: the run's lease is
/// released so that it is re-driven (a run that keeps panicking at one step ends poisoned).
pub(crate) async fn run_guarded(
    shared: Arc<Shared>,
    plan: Plan,
    events: UnboundedSender<Event>,
    admitted: Admitted,
    cancel: CancellationToken,
    parent: Option<opentelemetry::Context>,
) -> Result<RunResult, RunFailure> {
    use futures::FutureExt;
    use opentelemetry::trace::FutureExt as _;
    let run_id = plan.run_id().clone();
    let epoch = AtomicU64::new(0);
    // Boxed: the run's future is large, and boxing it once is cheaper than moving it through
    // the panic guard and into the task.
    let future = Box::pin(run(Arc::clone(&shared), plan, events.clone(), admitted, cancel, &epoch));
    let guarded = std::panic::AssertUnwindSafe(future).catch_unwind();
    let span = spans::invoke_agent(parent.as_ref(), &shared.agent(), &run_id);
    let outcome = match span.clone() {
        Some(context) => guarded.with_context(context).await,
        None => guarded.await,
    };
    let result = guarded_result(&shared, &run_id, &epoch, &events, outcome).await;
    spans::end_run(
        span,
        match &result {
            Ok(done) => Ok(done.usage),
            Err(failure) => Err((failure.code, &failure.message)),
        },
    );
    result
}

/// The result of a run's task, a panic turned into a failure (its lease released).
async fn guarded_result(
    shared: &Shared,
    run_id: &RunId,
    epoch: &AtomicU64,
    events: &UnboundedSender<Event>,
    outcome: std::thread::Result<Result<RunResult, RunFailure>>,
) -> Result<RunResult, RunFailure> {
    match outcome {
        Ok(result) => result,
        Err(panic) => {
            let message = panic_text(&*panic);
            tracing::error!(run = %run_id, %message, "the run's task panicked");
            let held = epoch.load(Ordering::SeqCst);
            if held > 0 {
                let release = shared.store.renew_lease(run_id, &shared.owner, held, Duration::ZERO).await;
                if let Err(error) = release {
                    tracing::warn!(run = %run_id, %error, "could not release the crashed run's lease");
                }
            }
            let failure = RunFailure::new(
                ErrorCode::Internal,
                format!(
                    "run {run_id} crashed ({message}); it is left to be re-driven, and ended as poisoned if it \
                     crashes at the same step {MAX_REDRIVES} more times. Please report this bug"
                ),
            );
            let _ = events
                .unbounded_send(Event::RunError { code: failure.code, message: failure.message.clone() });
            Err(failure)
        }
    }
}

/// Runs a run to its end and returns its result. Every failure is also sent as `run.error`.
/// `epoch` tells [`run_guarded`] the lease epoch the run writes under.
async fn run(
    shared: Arc<Shared>,
    plan: Plan,
    events: UnboundedSender<Event>,
    mut admitted: Admitted,
    cancel: CancellationToken,
    epoch: &AtomicU64,
) -> Result<RunResult, RunFailure> {
    // The run's future lives on the heap for as long as the run does, so its size is memory per
    // run in flight: what `prepare` returns is moved into the driver by a plain function, and
    // no copy of it (or of the machine) is kept across the run's awaits.
    let (mut driver, mut machine) = match prepare(&shared, plan, &cancel, &mut admitted).await {
        Ok(prepared) => Driver::start(shared, prepared, epoch, &events, cancel, admitted.take()),
        Err(failure) => return ended(&mut admitted, &events, Err(failure), false),
    };
    let result = driver.drive(&mut machine).await;
    let mut admitted = driver.admitted.take();
    ended(&mut admitted, &events, result, driver.reported)
}

/// What a run ends with: tells a caller still waiting for admission, and sends `run.error` for
/// a failure of the driver itself (the store, the journal), which the machine never saw.
fn ended(
    admitted: &mut Admitted,
    events: &UnboundedSender<Event>,
    result: Result<RunResult, RunFailure>,
    reported: bool,
) -> Result<RunResult, RunFailure> {
    tell_admitted(admitted, result.as_ref().map(drop));
    if let Err(failure) = &result
        && !reported
    {
        let _ =
            events.unbounded_send(Event::RunError { code: failure.code, message: failure.message.clone() });
    }
    result
}

/// Drives another run to its end from within this one (the session's unfinished run, before a
/// new input): its events go to the engine's observer, if any.
fn drive_nested(shared: &Arc<Shared>, plan: Plan) -> BoxFuture<'static, Result<RunResult, RunFailure>> {
    let shared = Arc::clone(shared);
    Box::pin(async move {
        let (event_tx, event_rx) = futures::channel::mpsc::unbounded();
        let (result_tx, result_rx) = tokio::sync::oneshot::channel();
        let (admitted_tx, admitted_rx) = tokio::sync::oneshot::channel();
        let cancel = CancellationToken::new();
        let handle = RunHandle::new(plan.run_id().clone(), event_rx, result_rx, admitted_rx, cancel.clone());
        if let Some(observer) = shared.observer() {
            observer(handle);
        }
        let result =
            run_guarded(Arc::clone(&shared), plan, event_tx, Some(admitted_tx), cancel, spans::parent())
                .await;
        let _ = result_tx.send(result.clone());
        result
    })
}

struct Prepared {
    run_id: RunId,
    session: SessionId,
    machine: Machine,
    journal: HashMap<StepName, JournalRecord>,
    new_run: Option<RunRecord>,
    /// The lease epoch this driver writes under (`None`: replaying a finished run, which writes
    /// nothing new).
    epoch: Option<u64>,
    /// The claim's attempt, when the run died at its next step too many times in a row.
    poisoned: Option<u32>,
    claim: Option<SessionClaim>,
    /// The session's state object, as stored.
    state: Value,
    /// The agent's initial state, for a new run of a session that has none: stored with the
    /// run's first commit.
    seed_state: Option<Value>,
}

/// A store failure as a run sees it: "busy" and "lost the lease" are what they are, not "the
/// store failed".
fn store_failure(error: StoreError) -> RunFailure {
    match error {
        StoreError::Busy(message) => RunFailure::new(ErrorCode::SessionBusy, message),
        StoreError::NotPending(message) => RunFailure::new(ErrorCode::NotPending, message),
        StoreError::LeaseLost(message) => RunFailure::new(
            ErrorCode::LeaseLost,
            format!("{message}: another process took the run over, and this one stopped without writing"),
        ),
        other => RunFailure::new(other.code(), format!("the store failed: {other}")),
    }
}

/// How long a step's commit waits out a store it cannot reach (a database restarting, a network
/// cut) before the run fails. It is tried again meanwhile, with backoff; the run's lease may
/// lapse in that time, and then its fence makes the late commit fail rather than write over a
/// process that took the run over.
const STORE_OUTAGE_PATIENCE: Duration = Duration::from_secs(60);

/// Commits a step, trying again while the store is unreachable (for up to
/// [`STORE_OUTAGE_PATIENCE`] from the first failure, or until the process stops).
async fn commit_through_outages(
    shared: &Shared,
    commit: StepCommit<'_>,
) -> Result<keel_core::Committed, StoreError> {
    // Counted from the first failure: a commit that succeeds at once reads no clock.
    let mut deadline = None;
    let mut wait = Duration::from_millis(100);
    loop {
        match shared.store.commit_step(commit).await {
            Err(error @ (StoreError::Unavailable(_) | StoreError::Locked(_))) => {
                let now = tokio::time::Instant::now();
                let deadline = *deadline.get_or_insert(now + STORE_OUTAGE_PATIENCE);
                if now + wait >= deadline || shared.stopping.is_cancelled() {
                    return Err(error);
                }
                tracing::warn!(run = %commit.run, %error, retry_in = ?wait, "the store is unreachable: the run waits for it");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            outcome => return outcome,
        }
    }
}

/// How often a new input checks again on a run of its session that another process drives,
/// when `concurrency` says to wait for it (`queue`) or to cancel it (`replace`).
const SETTLE_POLL: Duration = Duration::from_millis(100);

/// Makes `session` free for a new run and returns what the run starts from: its unfinished
/// run, if any, is finished first when nobody drives it (interrupted, decided, cancelled, or its
/// process provably dead); one that waits for a human or runs in another process refuses the
/// new input, unless `concurrency` says to wait for it (`queue`) or to cancel it (`replace`).
/// The caller holds the session in this process.
async fn settle_session(
    shared: &Arc<Shared>,
    session: &SessionId,
    cancel: &CancellationToken,
    admitted: &mut Admitted,
    mode: Concurrency,
) -> Result<SessionSnapshot, RunFailure> {
    let mut asked_to_cancel = false;
    let waiting_since = tokio::time::Instant::now();
    loop {
        let snapshot = shared.store.load_session(session).await.map_err(store_failure)?;
        let Some(run) = &snapshot.open_run else { return Ok(snapshot) };
        let now = shared.now_ms();
        if let Some(takeover) = nobody_drives(run, now) {
            tracing::info!(run = %run.run_id, %session, "finishing the session's unfinished run before a new input");
            let plan = Plan::Resume { run_id: run.run_id.clone(), session_held: true, takeover };
            match drive_nested(shared, plan).await {
                // Another process claimed it first: look again.
                Err(failure) if failure.code == ErrorCode::RunLeased => {}
                Err(failure) if failure.code == ErrorCode::ShuttingDown => return Err(failure),
                Err(failure) => {
                    tracing::warn!(run = %run.run_id, %failure, "the session's unfinished run ended in a failure");
                }
                Ok(_) => {}
            }
            continue;
        }
        match (run.state, mode) {
            (_, Concurrency::Replace) if !asked_to_cancel => {
                let by = "a newer input (`concurrency: replace`)";
                shared.store.request_cancel(session, by).await.map_err(store_failure)?;
                asked_to_cancel = true;
            }
            (RunState::Running, Concurrency::Replace | Concurrency::Queue)
                if waiting_since.elapsed() >= Concurrency::MAX_WAIT =>
            {
                return Err(waited_too_long(session));
            }
            (RunState::Running, Concurrency::Replace | Concurrency::Queue) => {
                // Driven elsewhere: wait for it to end (it was asked to, under `replace`), unless
                // this input is cancelled meanwhile: then it gives up, unstored. Waiting in line
                // is being admitted, as behind a run of this process.
                tell_admitted(admitted, Ok(()));
                tokio::select! {
                    () = shared.stopping.cancelled() => return Err(shutting_down(&run.run_id)),
                    () = cancel.cancelled() => {
                        return Err(RunFailure::new(
                            ErrorCode::SessionBusy,
                            format!(
                                "the input to session {} was cancelled while it waited for run {} in another process",
                                session.external(),
                                run.run_id
                            ),
                        ));
                    }
                    () = tokio::time::sleep(SETTLE_POLL) => {}
                }
            }
            _ => return Err(RunFailure::new(ErrorCode::SessionBusy, run.busy_message(now))),
        }
    }
}

/// An input that waited [`Concurrency::MAX_WAIT`] for its session and gave up.
fn waited_too_long(session: &SessionId) -> RunFailure {
    RunFailure::new(
        ErrorCode::SessionBusy,
        format!(
            "the input to session {} waited {} h for the runs ahead of it and was given up; send it again, or cancel what holds the session (`keel cancel {}`)",
            session.external(),
            Concurrency::MAX_WAIT.as_secs() / 3600,
            session.external()
        ),
    )
}

fn shutting_down(run: &RunId) -> RunFailure {
    RunFailure::new(
        ErrorCode::ShuttingDown,
        format!(
            "the process is shutting down; run {run} stopped between two steps and continues when keel \
             starts again (or on another instance)"
        ),
    )
}

async fn prepare(
    shared: &Arc<Shared>,
    plan: Plan,
    cancel: &CancellationToken,
    admitted: &mut Admitted,
) -> Result<Prepared, RunFailure> {
    let store = &shared.store;
    match plan {
        Plan::Fresh { run_id, session, input, admission, mode, limits } => {
            let claim = match admission {
                Admission::Now(claim) => claim,
                // Queued (or replacing the run in flight): accepted, and waits for the session,
                // at most `MAX_WAIT`. An input cancelled while it waits still waits: it runs
                // cancelled from its start, so that it is stored.
                Admission::Wait(handover) => {
                    tell_admitted(admitted, Ok(()));
                    match tokio::time::timeout(Concurrency::MAX_WAIT, handover).await {
                        Ok(Ok(claim)) => claim,
                        Ok(Err(_)) => {
                            return Err(RunFailure::new(
                                ErrorCode::Internal,
                                "the session was never handed over; please report this bug",
                            ));
                        }
                        // Dropping the receiver gives its place up: the session goes past it.
                        Err(_) => return Err(waited_too_long(&session)),
                    }
                }
            };
            let SessionSnapshot { messages: history, state, .. } =
                settle_session(shared, &session, cancel, admitted, mode).await?;
            let agent = shared.agent();
            // A session without state starts from the agent's `state.initial`, stored with the
            // run's first commit.
            let seed_state = if state.is_none() { agent.initial_state.clone() } else { None };
            let state = state.or_else(|| seed_state.clone()).unwrap_or_default();
            // Each completed model call appends exactly one assistant message.
            let call_base = history.iter().filter(|m| m.role == Role::Assistant).count() as u64;
            let input = Arc::new(input);
            let record = RunRecord {
                run_id: run_id.clone(),
                session_id: session.clone(),
                input: Arc::clone(&input),
                history_len: history.len() as u64,
                call_base,
                state: RunState::Running,
                limits: limits.clone(),
            };
            // The run is stored with its first step's commit (the user's message).
            let machine = Machine::new(agent, run_id.clone(), session.clone(), history, input, call_base)
                .with_overrides(&limits);
            Ok(Prepared {
                run_id,
                session,
                machine,
                journal: HashMap::new(),
                new_run: Some(record),
                epoch: Some(1),
                poisoned: None,
                claim: Some(claim),
                state,
                seed_state,
            })
        }
        Plan::Resume { run_id, session_held, takeover } => {
            let record = store.load_run(&run_id).await.map_err(store_failure)?.ok_or_else(|| {
                RunFailure::new(ErrorCode::RunNotFound, format!("no run {run_id} in the store"))
            })?;
            let claim = if session_held {
                None
            } else {
                Some(shared.sessions.claim(&record.session_id, &run_id, cancel).map_err(|_| {
                    RunFailure::new(
                        ErrorCode::RunLeased,
                        format!(
                            "session {} already has a run in flight in this process; run {run_id} goes on there \
                             (a decision recorded for it is applied when that run gets to it)",
                            record.session_id.external()
                        ),
                    )
                })?)
            };
            let (epoch, poisoned) = match store
                .claim_run(&run_id, &shared.owner, shared.lease_ttl, takeover.as_deref())
                .await
                .map_err(store_failure)?
            {
                Claim::Claimed { epoch, attempt, cancel_requested } => {
                    if cancel_requested {
                        cancel.cancel();
                    }
                    (Some(epoch), (attempt > MAX_REDRIVES).then_some(attempt))
                }
                // A finished run replays from its journal alone: nothing new to write.
                Claim::Finished => (None, None),
                Claim::Held { owner, expires_ms } => {
                    return Err(RunFailure::new(
                        ErrorCode::RunLeased,
                        format!(
                            "run {run_id} is driven by {}; it goes on there (its lease runs out {} if that \
                             process is gone)",
                            keel_core::owner::describe(&owner),
                            keel_core::clock::relative(expires_ms, shared.now_ms()),
                        ),
                    ));
                }
                Claim::Poisoned => {
                    return Err(RunFailure::new(
                        ErrorCode::RunPoisoned,
                        format!(
                            "run {run_id} was claimed again and again without getting past a step, even to be \
                             ended cleanly; the store marked it failed"
                        ),
                    ));
                }
            };
            let mut history = store.load_messages(&record.session_id).await.map_err(store_failure)?;
            let state = store
                .load_session_state(&record.session_id)
                .await
                .map_err(store_failure)?
                .unwrap_or_default();
            let history_len = record.history_len as usize;
            if history.len() < history_len {
                return Err(RunFailure::new(
                    ErrorCode::JournalCorrupt,
                    format!(
                        "run {run_id} started after message {history_len} of session {}, which has only {}",
                        record.session_id,
                        history.len()
                    ),
                ));
            }
            history.truncate(history_len);
            let journal = match store.load_journal(&run_id).await {
                Ok(entries) => entries.into_iter().map(|entry| (entry.step, entry.record)).collect(),
                Err(error @ StoreError::Corrupt(_)) => {
                    // This run cannot be replayed; the others go on. The next run of its session
                    // answers whatever call it left open.
                    let failure = RunFailure::new(
                        ErrorCode::JournalCorrupt,
                        format!("the journal of run {run_id} cannot be read ({error}); the run is failed"),
                    );
                    if let Some(epoch) = epoch {
                        end_unreadable(shared, &record.session_id, &run_id, epoch).await;
                    }
                    return Err(failure);
                }
                Err(error) => return Err(store_failure(error)),
            };
            tracing::debug!(run = %run_id, "re-driving run from its journal");
            let machine = Machine::new(
                shared.agent(),
                run_id.clone(),
                record.session_id.clone(),
                history,
                record.input,
                record.call_base,
            )
            .with_overrides(&record.limits);
            Ok(Prepared {
                run_id,
                session: record.session_id,
                machine,
                journal,
                new_run: None,
                epoch,
                poisoned,
                claim,
                state,
                seed_state: None,
            })
        }
    }
}

/// Marks a run that cannot be replayed failed, under its lease (best effort: if this fails, the
/// run's claims keep counting until the store poisons it).
async fn end_unreadable(shared: &Shared, session: &SessionId, run: &RunId, epoch: u64) {
    let commit = StepCommit {
        state: Some(RunState::Failed),
        fence: Some(Fence { owner: &shared.owner, epoch, ttl: shared.lease_ttl }),
        ..StepCommit::new(session, run)
    };
    if let Err(error) = shared.store.commit_step(commit).await {
        tracing::warn!(%run, %error, "could not mark an unreadable run failed");
    }
}

struct Driver<'a> {
    shared: Arc<Shared>,
    /// The agent definition of this run (the machine's).
    agent: Arc<AgentDef>,
    run_id: RunId,
    session: SessionId,
    /// While a resumed run replays its journal: the events of the turn being replayed, shown
    /// once the run reaches new work (see [`Driver::emit`]). `None` once live.
    replay: Option<Vec<Event>>,
    /// The calls whose human decision the replay fed the machine: their outcome is news to
    /// observers (the decision came after the pause they saw), even in a turn replayed whole.
    decided_in_replay: Vec<String>,
    /// Journaled steps not replayed yet.
    journal: HashMap<StepName, JournalRecord>,
    /// The record of a new run, stored with its first commit.
    new_run: Option<RunRecord>,
    /// The lease epoch commits are fenced with.
    epoch: Option<u64>,
    /// The same, for whoever must release the lease if this task panics.
    epoch_cell: &'a AtomicU64,
    /// When to renew the lease while waiting on a model or tools (`None` without a lease).
    beat: Option<Heartbeat>,
    events: UnboundedSender<Event>,
    cancel: CancellationToken,
    /// The claim's attempt, when the run died at its next new step too many times in a row: it
    /// is aborted there instead (once).
    poisoned: Option<u32>,
    /// Told once the new run is stored.
    admitted: Admitted,
    /// Whether the machine already emitted `run.error` for the run's failure.
    reported: bool,
    /// The session's state object, as this run's tools see it.
    state: SessionState,
    /// The agent's initial state, stored with a new run's first commit.
    seed_state: Option<Value>,
    _claim: Option<SessionClaim>,
}

impl<'a> Driver<'a> {
    /// The driver of a prepared run, and the machine it drives; tells the caller the run is
    /// admitted once a resumed run is claimed (a new one is admitted once stored).
    fn start(
        shared: Arc<Shared>,
        prepared: Prepared,
        epoch_cell: &'a AtomicU64,
        events: &UnboundedSender<Event>,
        cancel: CancellationToken,
        mut admitted: Admitted,
    ) -> (Self, Machine) {
        epoch_cell.store(prepared.epoch.unwrap_or(0), Ordering::SeqCst);
        spans::conversation(&prepared.session);
        if prepared.new_run.is_none() {
            tell_admitted(&mut admitted, Ok(()));
        }
        let beat = prepared.epoch.map(|_| heartbeat(&shared));
        let driver = Driver {
            shared,
            agent: Arc::clone(prepared.machine.agent()),
            run_id: prepared.run_id,
            session: prepared.session,
            replay: (!prepared.journal.is_empty()).then(Vec::new),
            decided_in_replay: Vec::new(),
            journal: prepared.journal,
            new_run: prepared.new_run,
            epoch: prepared.epoch,
            epoch_cell,
            beat,
            events: events.clone(),
            cancel,
            poisoned: prepared.poisoned,
            admitted,
            reported: false,
            state: SessionState::new(prepared.state),
            seed_state: prepared.seed_state,
            _claim: prepared.claim,
        };
        (driver, prepared.machine)
    }
}

impl Driver<'_> {
    async fn drive(&mut self, machine: &mut Machine) -> Result<RunResult, RunFailure> {
        // The machine's next inputs, in order: the results in hand (a model reply, a replayed
        // result, tool calls done at once in the order they started), decisions, stops. Room
        // for a few: made with one, it would grow at the first model call.
        let mut inputs: VecDeque<Next> = VecDeque::with_capacity(4);
        inputs.push_back(Next::bare(Input::Start));
        // Tool calls in flight.
        let mut tools = Running::default();
        // The calls waiting for a human, with no decision journaled yet.
        let mut waiting: Vec<PendingInput> = Vec::new();
        // What the machine asks for at each step, one vector for the whole run.
        let mut actions: Vec<Action> = Vec::new();
        loop {
            // An input with a journal entry is a fresh result: the entry is committed with what
            // the machine makes of it, before any new model call or tool call starts.
            let Next { input, entry, state } = match inputs.pop_front() {
                Some(next) => next,
                // Nothing runs and only humans can move the run on: cancel or pause.
                None if tools.is_empty() && self.cancel.is_cancelled() => Next::bare(Input::Cancel),
                None if tools.is_empty() && !waiting.is_empty() => {
                    match Box::pin(self.pause(&mut waiting)).await? {
                        Pause::Paused(pending) => return Ok(self.paused_result(machine, pending)),
                        Pause::Decided(decisions) => {
                            inputs.extend(decisions.into_iter().map(Next::bare));
                            continue;
                        }
                    }
                }
                None if tools.is_empty() => {
                    return Err(RunFailure::new(
                        ErrorCode::Internal,
                        "the run loop stalled; please report this bug",
                    ));
                }
                None => {
                    // A finished call first: its result is kept even when the run was
                    // cancelled meanwhile (the cancellation is seen before any new step starts),
                    // and a call done at once never registers with the cancellation token.
                    let woken = tokio::select! {
                        biased;
                        Some(done) = tools.next() => Wake::Input(Next::tool(done)),
                        () = self.cancel.cancelled() => {
                            // Dropping the futures aborts the tool tasks.
                            tools.clear();
                            Wake::Input(Next::bare(Input::Cancel))
                        }
                        // After the work: a call done at once never starts the heartbeat's timer.
                        () = next_beat(&mut self.beat) => Wake::Heartbeat,
                    };
                    match woken {
                        Wake::Heartbeat => {
                            self.renew_lease().await;
                            continue;
                        }
                        Wake::Input(next) => next,
                    }
                }
            };
            let mut pending = PendingCommit { entry, messages: None, session_state: state };
            if let (Some(_), Input::Decision { call_id, .. }) = (&self.replay, &input) {
                self.decided_in_replay.push(call_id.clone());
            }
            // A caller that only awaits the outcome closed the event channel: the machine then
            // builds no events (each would clone what it shows, for nobody).
            machine.mute_events(self.events.is_closed());
            machine.step_into(input, &mut actions);
            for action in actions.drain(..) {
                match action {
                    Action::Emit(event) => self.emit(event),
                    Action::Persist { first_position, count } => {
                        if !pending.continues_at(first_position) {
                            self.commit(machine, &mut pending, None).await?;
                        }
                        pending.add_messages(first_position, count);
                    }
                    Action::CallModel { step } => {
                        self.commit(machine, &mut pending, None).await?;
                        inputs.push_back(Next::fresh(self.model_step(machine, step).await?));
                    }
                    Action::CallTool { step, call } => {
                        self.commit(machine, &mut pending, None).await?;
                        match self.replayed(&step) {
                            Some(JournalRecord::ToolResult(outcome)) => {
                                let input =
                                    Input::ToolDone { call_id: call.call_id, outcome, duration: None };
                                inputs.push_back(Next::bare(input));
                            }
                            Some(_) => return Err(self.corrupt(&step).await),
                            None if self.epoch.is_none() => return Err(self.finished(&step)),
                            None => match self.stop_before(&step) {
                                Some(stop) => inputs.push_back(Next::bare(stop)),
                                None => {
                                    self.stop_if_shutting_down().await?;
                                    self.go_live();
                                    let mut tool = self.start_tool(step, call);
                                    // A call done at once (a pure function, a cached answer)
                                    // is taken as it is: no set of calls in flight to join.
                                    match std::future::poll_fn(|cx| Poll::Ready(tool.poll_first(cx))).await {
                                        Poll::Ready(outcome) => {
                                            inputs.push_back(Next::tool(tool.finish(outcome)))
                                        }
                                        Poll::Pending => {
                                            let timeout = machine.limits().tool_timeout;
                                            tools.push(Box::pin(tool.finish_in_task(timeout)));
                                        }
                                    }
                                }
                            },
                        }
                    }
                    Action::AwaitHuman { step, id, call_id, kind } => {
                        self.commit(machine, &mut pending, None).await?;
                        match self.replayed(&step) {
                            Some(JournalRecord::Decision(decision)) => {
                                inputs.push_back(Next::bare(Input::Decision { call_id, decision }));
                            }
                            Some(_) => return Err(self.corrupt(&step).await),
                            None if self.epoch.is_none() => return Err(self.finished(&step)),
                            None => match self.stop_before(&step) {
                                Some(stop) => inputs.push_back(Next::bare(stop)),
                                // Boxed, like the pause: rare paths that should not grow every
                                // run's future.
                                None => waiting.push(Box::pin(self.ask_human(id, call_id, kind)).await?),
                            },
                        }
                    }
                    Action::Memory { step, request } => {
                        self.commit(machine, &mut pending, None).await?;
                        inputs.push_back(Next::fresh(Box::pin(self.memory_step(step, request)).await?));
                    }
                    Action::Finish(outcome) => return self.finish(machine, &mut pending, outcome).await,
                }
            }
            self.commit(machine, &mut pending, None).await?;
        }
    }

    /// The journaled outcome of `step`, taken out of what is left to replay. A new run has
    /// nothing to replay, and then nothing is hashed.
    fn replayed(&mut self, step: &StepName) -> Option<JournalRecord> {
        if self.journal.is_empty() { None } else { self.journal.remove(step) }
    }

    /// A commit of this run under its lease that writes nothing yet, to fill in.
    fn bare_commit(&self) -> StepCommit<'_> {
        let fence =
            self.epoch.map(|epoch| Fence { owner: &self.shared.owner, epoch, ttl: self.shared.lease_ttl });
        StepCommit { fence, ..StepCommit::new(&self.session, &self.run_id) }
    }

    /// Writes what a step produced (journal entry, messages, new state) in one store commit.
    async fn commit(
        &mut self,
        machine: &Machine,
        pending: &mut PendingCommit,
        state: Option<RunState>,
    ) -> Result<(), RunFailure> {
        let entry = pending.entry.take();
        let (first_position, count) = pending.messages.take().unwrap_or((0, 0));
        let new_run = self.new_run.take();
        let tool_state = pending.session_state.take();
        let session_state = match (&tool_state, &new_run) {
            (None, Some(_)) => self.seed_state.take(),
            _ => tool_state.clone(),
        };
        if entry.is_none() && count == 0 && state.is_none() && new_run.is_none() && session_state.is_none() {
            return Ok(());
        }
        let commit = StepCommit {
            new_run: new_run.as_ref(),
            entry: entry.as_ref(),
            first_position: first_position as u64,
            messages: &machine.transcript()[first_position..first_position + count],
            state,
            session_state: session_state.as_ref(),
            ..self.bare_commit()
        };
        let step = entry.as_ref().map(|e| &e.step);
        if let Some(step) = step {
            crate::fault::point("before_commit", step);
        }
        let committed = commit_through_outages(&self.shared, commit).await.map_err(store_failure)?;
        if let Some(step) = step {
            crate::fault::point("after_commit", step);
        }
        if new_run.is_some() {
            tell_admitted(&mut self.admitted, Ok(()));
        }
        if let Some(state) = tool_state {
            self.emit(Event::StateUpdated { state });
        }
        if let (Some(entry), Some(hook)) = (&entry, &self.agent.loop_control.hooks.on_step_finish) {
            hook(&StepFinished {
                run_id: &self.run_id,
                session_id: &self.session,
                step: &entry.step,
                record: &entry.record,
            });
        }
        if committed.cancel_requested {
            // Another process asked; the next step boundary stops the run.
            self.cancel.cancel();
        }
        Ok(())
    }

    /// Before the run starts new work at `step` (a model call, a tool, a question): the input
    /// that ends it instead, when it must end. A poisoned run is aborted (its open calls get
    /// error results, it fails with `KEEL_RUN_POISONED`); a cancelled one is cancelled.
    fn stop_before(&mut self, step: &StepName) -> Option<Input> {
        if let Some(attempt) = self.poisoned.take() {
            let failure = RunFailure::new(
                ErrorCode::RunPoisoned,
                format!(
                    "run {} died {attempt} times in a row at step {step} (its process was killed or crashed \
                     there each time); it is ended instead of running that step again",
                    self.run_id
                ),
            );
            tracing::error!(run = %self.run_id, %step, attempt, "poison run: ending it");
            return Some(Input::Abort(failure));
        }
        self.cancel.is_cancelled().then_some(Input::Cancel)
    }

    /// Asks a human: stores the pending input at once (so it can be decided while the run's
    /// other calls still run), then tells the observers.
    async fn ask_human(
        &mut self,
        id: String,
        call_id: String,
        kind: PendingKind,
    ) -> Result<PendingInput, RunFailure> {
        self.go_live();
        let now = self.shared.now_ms();
        let timeout = u64::try_from(self.agent.approval_timeout.as_millis()).unwrap_or(u64::MAX);
        let asked = PendingInput {
            id,
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            call_id,
            kind,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(timeout),
        };
        let commit = StepCommit { pending: std::slice::from_ref(&asked), ..self.bare_commit() };
        if commit_through_outages(&self.shared, commit).await.map_err(store_failure)?.cancel_requested {
            self.cancel.cancel();
        }
        self.emit(match &asked.kind {
            PendingKind::Approval { tool, input } => Event::ApprovalRequested {
                approval_id: asked.id.clone(),
                call_id: asked.call_id.clone(),
                tool: tool.clone(),
                input: input.clone(),
            },
            PendingKind::Question { question } => {
                Event::QuestionAsked { question_id: asked.id.clone(), question: question.clone() }
            }
        });
        Ok(asked)
    }

    /// Pauses the run for the humans it waits for: the state `awaiting_input`, which releases
    /// the lease (the pending inputs were stored when asked; storing them again is a no-op). A
    /// decision that arrived while the run was still busy continues the run at once.
    async fn pause(&mut self, waiting: &mut Vec<PendingInput>) -> Result<Pause, RunFailure> {
        let store = Arc::clone(&self.shared.store);
        let step = waiting[0].step();
        crate::fault::point("before_commit", &step);
        // The run was stored with its input, before its first model call: no new run here.
        let commit =
            StepCommit { state: Some(RunState::AwaitingInput), pending: waiting, ..self.bare_commit() };
        let committed = commit_through_outages(&self.shared, commit).await.map_err(store_failure)?;
        crate::fault::point("after_commit", &step);
        if committed.cancel_requested {
            // Cancelled by another process meanwhile: the run ends instead of waiting.
            self.cancel.cancel();
            waiting.clear();
            return Ok(Pause::Decided(Vec::new()));
        }

        let mut decisions = Vec::new();
        for entry in store.load_journal(&self.run_id).await.map_err(store_failure)? {
            if let JournalRecord::Decision(decision) = entry.record
                && let Some(index) = waiting.iter().position(|p| p.step() == entry.step)
            {
                let decided = waiting.remove(index);
                decisions.push(Input::Decision { call_id: decided.call_id, decision });
            }
        }
        if !decisions.is_empty() {
            let shared = &self.shared;
            if let Claim::Claimed { epoch, .. } = store
                .claim_run(&self.run_id, &shared.owner, shared.lease_ttl, None)
                .await
                .map_err(store_failure)?
            {
                self.epoch = Some(epoch);
                self.epoch_cell.store(epoch, Ordering::SeqCst);
                let resume = StepCommit { state: Some(RunState::Running), ..self.bare_commit() };
                store.commit_step(resume).await.map_err(store_failure)?;
                return Ok(Pause::Decided(decisions));
            }
            // The process that decided took the run over first; it goes on there.
        }
        let pending = store.pending_inputs(Some(&self.session)).await.map_err(store_failure)?;
        Ok(Pause::Paused(pending.into_iter().filter(|p| p.run_id == self.run_id).collect()))
    }

    fn paused_result(&mut self, machine: &Machine, pending: Vec<PendingInput>) -> RunResult {
        self.go_live();
        self.emit(Event::RunPaused { pending: pending.clone(), usage: machine.usage() });
        RunResult {
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            text: String::new(),
            output: None,
            stopped: StopReason::AwaitingInput,
            usage: machine.usage(),
            pending,
        }
    }

    /// At a step boundary during a shutdown: releases the lease (the next process may take the
    /// run over at once) and stops, leaving the run resumable.
    async fn stop_if_shutting_down(&self) -> Result<(), RunFailure> {
        if !self.shared.stopping.is_cancelled() {
            return Ok(());
        }
        if let Some(epoch) = self.epoch {
            let shared = &self.shared;
            if let Err(error) =
                shared.store.renew_lease(&self.run_id, &shared.owner, epoch, Duration::ZERO).await
            {
                tracing::warn!(run = %self.run_id, %error, "could not release the run's lease");
            }
        }
        Err(shutting_down(&self.run_id))
    }

    /// Renews the run's lease. A lost lease cancels the run here: another process has taken it
    /// over, and this driver's commits would be refused anyway.
    async fn renew_lease(&self) {
        let Some(epoch) = self.epoch else { return };
        let shared = &self.shared;
        match shared.store.renew_lease(&self.run_id, &shared.owner, epoch, shared.lease_ttl).await {
            Ok(LeaseStatus::Held { cancel_requested: false }) => {}
            Ok(LeaseStatus::Held { cancel_requested: true }) => {
                tracing::info!(run = %self.run_id, "another process asked to cancel the run");
                self.cancel.cancel();
            }
            Ok(LeaseStatus::Lost) => {
                tracing::warn!(run = %self.run_id, "lost the run's lease to another process; stopping");
                self.cancel.cancel();
            }
            // A transient store failure: the next beat retries before the lease runs out.
            Err(error) => tracing::warn!(run = %self.run_id, %error, "could not renew the run's lease"),
        }
    }

    /// Sends an event to the run's observers. While a resumed run replays its journal, the
    /// events are held: an observer of the resumed run sees `run.start`, then the calls of the
    /// turn it resumes in (not the older turns, nor text and usage it was shown before), then
    /// the new work.
    fn emit(&mut self, event: Event) {
        if let Some(held) = &mut self.replay {
            match event {
                Event::RunStart { .. } => {}
                Event::RunDone { .. } | Event::RunError { .. } => self.go_live(),
                Event::TextDelta { .. }
                | Event::ReasoningDelta { .. }
                | Event::TurnRetry { .. }
                | Event::Usage(_) => return,
                Event::TurnStart { .. } => {
                    // A turn replayed whole is old news, except the outcome of a call a human
                    // decided in the turn just replayed: the decision came after the pause
                    // observers last saw (a rejection ends the call with no new work, so it
                    // would not be shown). A turn after that one means an earlier process went
                    // on past the decision, and showed its outcome then.
                    let decided = &self.decided_in_replay;
                    let this_turn = held
                        .iter()
                        .rposition(|e| matches!(e, Event::TurnStart { .. }))
                        .map_or(0, |at| at + 1);
                    let kept: Vec<Event> = held
                        .drain(this_turn..)
                        .filter(|event| match event {
                            Event::ToolDone { call_id, .. } | Event::ToolError { call_id, .. } => {
                                decided.contains(call_id)
                            }
                            _ => false,
                        })
                        .collect();
                    held.clear();
                    held.extend(kept);
                    held.push(event);
                    return;
                }
                _ => {
                    held.push(event);
                    return;
                }
            }
        }
        // The caller may have stopped listening; the run goes on.
        let _ = self.events.unbounded_send(event);
    }

    /// Ends the replay: the run reached work that is not in its journal.
    fn go_live(&mut self) {
        for event in self.replay.take().unwrap_or_default() {
            let _ = self.events.unbounded_send(event);
        }
    }

    /// A finished run is only ever replayed: a step missing from its journal (compacted) is not
    /// executed again.
    fn finished(&self, step: &StepName) -> RunFailure {
        RunFailure::new(
            ErrorCode::RunFinished,
            format!(
                "run {} is finished and its journal has no step {step} (it was compacted); nothing is executed again",
                self.run_id
            ),
        )
    }

    /// A journal record of the wrong kind: this run cannot be replayed, so it is failed (the
    /// others go on; the next run of its session answers whatever call it left open).
    async fn corrupt(&self, step: &StepName) -> RunFailure {
        if let Some(epoch) = self.epoch {
            end_unreadable(&self.shared, &self.session, &self.run_id, epoch).await;
        }
        RunFailure::new(
            ErrorCode::JournalCorrupt,
            format!(
                "the journal of run {} has a record of the wrong kind for step {step}; the run is failed",
                self.run_id
            ),
        )
    }

    /// One model call: from the journal when recorded, else from the provider. A fresh reply
    /// comes with its journal entry, for the caller to commit.
    async fn model_step(
        &mut self,
        machine: &Machine,
        step: StepName,
    ) -> Result<(Input, Option<Arc<JournalEntry>>), RunFailure> {
        match self.replayed(&step) {
            Some(JournalRecord::ModelFailed(error)) => {
                tracing::debug!(run = %self.run_id, %step, "a failed call replayed from the journal");
                return Ok((Input::ModelFailed(error), None));
            }
            Some(JournalRecord::ModelReply(reply)) if matches!(step, StepName::Compact(_)) => {
                tracing::debug!(run = %self.run_id, %step, "replayed from the journal");
                return Ok((Input::ModelReply(reply), None));
            }
            Some(JournalRecord::ModelReply(reply)) => {
                tracing::debug!(run = %self.run_id, %step, "replayed from the journal");
                let text = reply.message.text();
                if !text.is_empty() {
                    self.emit(Event::TextDelta { delta: text });
                }
                return Ok((Input::ModelReply(reply), None));
            }
            Some(_) => return Err(self.corrupt(&step).await),
            None => {
                if let Some(stop) = self.start_new_work(&step).await? {
                    return Ok((stop, None));
                }
            }
        }
        let (shared, events) = (Arc::clone(&self.shared), self.events.clone());
        let call = pin!(async move { call_model(&shared, machine, &events).await });
        let Some(result) = self.while_leased(call).await else { return Ok((Input::Cancel, None)) };
        Ok(match result {
            Ok(reply) => {
                // The journal and the machine share the reply's message: no copy of its parts.
                let reply = JournaledReply::from(reply);
                let entry = Arc::new(JournalEntry { step, record: JournalRecord::ModelReply(reply.clone()) });
                (Input::ModelReply(reply), Some(entry))
            }
            // Journaled too: the run may go on from a failure (a failed compaction, a context too
            // long that compaction answers), and a replay must take the same path.
            Err(error) => {
                let entry =
                    Arc::new(JournalEntry { step, record: JournalRecord::ModelFailed(error.clone()) });
                (Input::ModelFailed(error), Some(entry))
            }
        })
    }

    /// Before `step`, which the journal does not hold: fails a finished run's replay (it writes
    /// nothing new), gives the input that ends the run instead when it must end (cancelled,
    /// poisoned), stops for a shutdown; else the run goes live.
    async fn start_new_work(&mut self, step: &StepName) -> Result<Option<Input>, RunFailure> {
        if self.epoch.is_none() {
            return Err(self.finished(step));
        }
        if let Some(stop) = self.stop_before(step) {
            return Ok(Some(stop));
        }
        self.stop_if_shutting_down().await?;
        self.go_live();
        Ok(None)
    }

    /// Waits for `work`, renewing the run's lease meanwhile; `None` when the run is cancelled
    /// first (the work is dropped).
    /// `work` is pinned by the caller: taken by value, an async fn's argument is kept twice in
    /// its future (the argument, and the local it is moved into), and a model call is large.
    async fn while_leased<T>(&mut self, mut work: Pin<&mut impl Future<Output = T>>) -> Option<T> {
        loop {
            // The work first: finished work is kept even when the run was cancelled meanwhile
            // (the cancellation is seen before any new step starts), and work done at once
            // never registers with the cancellation token.
            let finished = tokio::select! {
                biased;
                done = work.as_mut() => Some(done),
                () = self.cancel.cancelled() => return None,
                () = next_beat(&mut self.beat) => None,
            };
            match finished {
                Some(done) => return Some(done),
                None => self.renew_lease().await,
            }
        }
    }

    /// One memory step: from the journal when recorded, else carried out by the agent's memory.
    /// A failure is the step's outcome (journaled too: a replay takes the same path), never the
    /// run's.
    async fn memory_step(
        &mut self,
        step: StepName,
        request: MemoryRequest,
    ) -> Result<(Input, Option<Arc<JournalEntry>>), RunFailure> {
        match self.replayed(&step) {
            Some(JournalRecord::Memory(outcome)) => return Ok((Input::MemoryDone(outcome), None)),
            Some(_) => return Err(self.corrupt(&step).await),
            None => {
                if let Some(stop) = self.start_new_work(&step).await? {
                    return Ok((stop, None));
                }
            }
        }
        let owner = keel_core::memory::owner_of(&self.session);
        let engine = self.agent.memory.engine.clone();
        let (run, session) = (self.run_id.clone(), self.session.clone());
        let call = pin!(async {
            let scope = MemoryScope { owner: &owner, run: &run, session: &session };
            match &engine {
                Some(engine) => engine.call(scope, &request).await,
                None => Err("the agent has memory settings but no memory engine".to_owned()),
            }
        });
        let Some(outcome) = self.while_leased(call).await else { return Ok((Input::Cancel, None)) };
        if let Err(error) = &outcome {
            tracing::warn!(run = %self.run_id, %step, %error, "a memory step failed; the run goes on without it");
        }
        let entry = Arc::new(JournalEntry { step, record: JournalRecord::Memory(outcome.clone()) });
        Ok((Input::MemoryDone(outcome), Some(entry)))
    }

    /// Starts a tool call: [`StartedTool::poll_first`] polls it in the run's own task.
    fn start_tool(&self, step: StepName, call: ToolCall) -> StartedTool {
        let ToolCall { call_id, name, input } = call;
        let state = self.state.for_call();
        let started = tokio::time::Instant::now();
        let Some(tool) = self.agent.tools.get(&name).cloned() else {
            // The machine checked the name; this is a bug, reported to the model as a failure.
            let error = ToolError::with_code(ErrorCode::Internal, format!("tool `{name}` vanished"), false);
            let work = Box::pin(std::future::ready(Err(error)));
            return StartedTool { step, call_id, name, work, span: None, state, started };
        };
        let ctx = ToolContext {
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            call_id: call_id.clone(),
            idempotency_key: step.idempotency_key(&self.run_id),
            state: state.clone(),
        };
        let span = spans::execute_tool(&name, &call_id, &input);
        let work = async move { tool.call(input, &ctx).await };
        let work: BoxFuture<'static, ToolOutcome> = match span.clone() {
            Some(context) => Box::pin(opentelemetry::trace::FutureExt::with_context(work, context)),
            None => Box::pin(work),
        };
        StartedTool { step, call_id, name, work, span, state, started }
    }

    async fn finish(
        &mut self,
        machine: &Machine,
        pending: &mut PendingCommit,
        outcome: RunOutcome,
    ) -> Result<RunResult, RunFailure> {
        match outcome {
            RunOutcome::Done { text, output, stopped, usage } => {
                let state =
                    if stopped == StopReason::Cancelled { RunState::Cancelled } else { RunState::Done };
                self.commit(machine, pending, Some(state)).await?;
                Ok(RunResult {
                    run_id: self.run_id.clone(),
                    session_id: self.session.clone(),
                    text,
                    output,
                    stopped,
                    usage,
                    pending: Vec::new(),
                })
            }
            RunOutcome::Failed(failure) => {
                self.reported = true;
                self.commit(machine, pending, Some(RunState::Failed)).await?;
                Err(failure)
            }
        }
    }
}

/// How a pause ended.
enum Pause {
    /// The run is paused; these are what it waits for.
    Paused(Vec<PendingInput>),
    /// Decisions came while the run was busy: feed them and go on.
    Decided(Vec<Input>),
}

/// Why a driver waiting on tools woke up.
#[allow(clippy::large_enum_variant, reason = "made once per wake-up, on the stack, and taken apart at once")]
enum Wake {
    /// Time to renew the lease.
    Heartbeat,
    /// The next input.
    Input(Next),
}

/// What a step has produced and not yet committed.
struct PendingCommit {
    entry: Option<Arc<JournalEntry>>,
    /// The session's new state object, set by the step's tool call.
    session_state: Option<Value>,
    /// A contiguous range of transcript positions (first, count).
    messages: Option<(usize, usize)>,
}

impl PendingCommit {
    /// Whether messages starting at `position` can join the pending ones in one commit.
    fn continues_at(&self, position: usize) -> bool {
        self.messages.is_none_or(|(first, count)| first + count == position)
    }

    /// Adds messages; the caller checked [`Self::continues_at`].
    fn add_messages(&mut self, first_position: usize, count: usize) {
        self.messages = Some(match self.messages {
            Some((first, existing)) => (first, existing + count),
            None => (first_position, count),
        });
    }
}

/// When a driver waiting on a model or tools renews its lease: a third of the way through it
/// (a commit extends it too, once a third is gone). A timer, not a task: a run costs no extra
/// spawn; and it is started at the run's first wait, so a run that never waits has none.
struct Heartbeat {
    period: Duration,
    interval: Option<tokio::time::Interval>,
}

fn heartbeat(shared: &Shared) -> Heartbeat {
    Heartbeat { period: (shared.lease_ttl / 3).max(Duration::from_millis(10)), interval: None }
}

/// The next heartbeat, or never without a lease.
async fn next_beat(beat: &mut Option<Heartbeat>) {
    match beat {
        Some(Heartbeat { period, interval }) => {
            let period = *period;
            let interval = interval.get_or_insert_with(|| {
                let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                interval
            });
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Aborts a spawned task when dropped (on timeout or cancel).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// "Equal jitter": a uniformly random wait between half the backoff and all of it. Randomness here
/// only spaces retries out; it decides nothing about the run.
fn jitter(backoff: std::time::Duration) -> std::time::Duration {
    backoff.mul_f64(0.5 + fastrand::f64() * 0.5)
}

fn panic_message(error: tokio::task::JoinError) -> String {
    if !error.is_panic() {
        return "it was aborted".into();
    }
    format!("it panicked: {}", panic_text(&*error.into_panic()))
}

/// A panic's message, when it has one.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Streams text deltas to the run's observers.
struct EventSink<'a>(&'a UnboundedSender<Event>);

impl DeltaSink for EventSink<'_> {
    fn text_delta(&mut self, delta: &str) {
        if self.0.is_closed() {
            return;
        }
        let _ = self.0.unbounded_send(Event::TextDelta { delta: delta.to_owned() });
    }

    fn reasoning_delta(&mut self, delta: &str) {
        if self.0.is_closed() {
            return;
        }
        let _ = self.0.unbounded_send(Event::ReasoningDelta { delta: delta.to_owned() });
    }
}

/// A model call's sink that also keeps what the provider said of its reply, for its span.
struct Observed<'a> {
    inner: &'a mut dyn DeltaSink,
    /// `None` while spans are off.
    answered: Option<spans::Answered>,
}

impl DeltaSink for Observed<'_> {
    fn text_delta(&mut self, delta: &str) {
        self.inner.text_delta(delta);
    }

    fn reasoning_delta(&mut self, delta: &str) {
        self.inner.reasoning_delta(delta);
    }

    fn reply_info(&mut self, info: keel_core::ReplyInfo<'_>) {
        if let Some(answered) = &mut self.answered {
            answered.record(info);
        }
    }
}

/// The longest `Retry-After` keel honours when `retry.max_backoff` is shorter.
const LONGEST_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Calls the model with the agent's timeout and retry policy.
///
/// A failed attempt is retried as a whole turn: observers get `turn.retry`, which voids the
/// text they were streamed since `turn.start`, and only the attempt that succeeds is journaled.
/// The wait is the policy's exponential backoff with jitter (so that many runs failing
/// together do not retry together), never shorter than what the provider asked for.
async fn call_model(
    shared: &Shared,
    machine: &Machine,
    events: &UnboundedSender<Event>,
) -> Result<ModelReply, ProviderError> {
    let retry = &machine.agent().retry;
    let timeout = machine.limits().provider_timeout;
    // A compaction's brief is not the answer: observers see `context.compacted`, not its text.
    let compacting = machine.model_request(1).purpose == CallPurpose::Compact;
    let mut events_sink = EventSink(events);
    let mut quiet = keel_core::provider::DiscardDeltas;
    let sink: &mut dyn DeltaSink = if compacting { &mut quiet } else { &mut events_sink };
    let mut attempt = 1;
    loop {
        let request = machine.model_request(attempt);
        // What is asked, by size only: the content stays out of logs.
        tracing::debug!(
            model = request.model,
            call = request.call_index,
            attempt,
            purpose = ?request.purpose,
            messages = request.messages.len(),
            message_chars = request.messages.iter().map(|m| m.text().len()).sum::<usize>(),
            instructions_chars = request.instructions.len(),
            tools = request.tools.len(),
            "model request"
        );
        let started = std::time::Instant::now();
        let span = spans::chat(machine.agent(), &request);
        let mut sink =
            Observed { inner: &mut *sink, answered: span.as_ref().map(|_| spans::Answered::default()) };
        let call = tokio::time::timeout(timeout, shared.provider.complete(request, &mut sink));
        let result = match span.clone() {
            Some(context) => opentelemetry::trace::FutureExt::with_context(call, context).await,
            None => call.await,
        };
        let result = match result {
            Ok(result) => result,
            Err(_elapsed) => Err(ProviderError::new(
                ProviderErrorKind::Timeout,
                format!("no reply within {timeout:?} (`limits.provider_timeout`)"),
            )),
        };
        let answered = sink.answered.unwrap_or_default();
        spans::end_chat(
            span,
            match &result {
                Ok(reply) => Ok((reply, answered)),
                Err(error) => Err((error.code(), &error.message)),
            },
        );
        let error = match result {
            Ok(reply) => {
                let calls = reply.parts.iter().filter(|p| matches!(p, keel_core::Part::ToolCall(_))).count();
                tracing::debug!(
                    ms = started.elapsed().as_millis() as u64,
                    text_chars = reply
                        .parts
                        .iter()
                        .map(|p| if let keel_core::Part::Text(t) = p { t.len() } else { 0 })
                        .sum::<usize>(),
                    tool_calls = calls,
                    input_tokens = reply.usage.input_tokens,
                    output_tokens = reply.usage.output_tokens,
                    "model reply"
                );
                return Ok(reply);
            }
            Err(error) => error,
        };
        let next = attempt + 1;
        let wait = if error.is_transient() { retry.backoff(next) } else { None };
        let Some(mut wait) = wait else {
            let mut error = error;
            if attempt > 1 {
                error.message = format!("{} (after {attempt} attempts)", error.message);
            }
            return Err(error);
        };
        wait = jitter(wait);
        if let Some(after) = error.retry_after {
            // Honour the provider's wait, up to a bound: a run does not sleep for an hour
            // because a rate-limit window says so.
            let longest = retry.max_backoff.max(LONGEST_RETRY_AFTER);
            if after > longest {
                let mut error = error;
                error.message = format!(
                    "{} (the provider asks to wait {:.0} s before trying again, longer than keel waits: {:.0} s, the larger of `retry.max_backoff` and 60 s)",
                    error.message,
                    after.as_secs_f64(),
                    longest.as_secs_f64()
                );
                return Err(error);
            }
            wait = wait.max(after);
        }
        // Info, not a warning: the `turn.retry` event is how a retry is shown (the terminal
        // prints it once); the log keeps it for servers (`keel serve` logs info).
        tracing::info!(attempt, ?wait, %error, compacting, "model call failed; retrying");
        if compacting {
            tokio::time::sleep(wait).await;
            attempt = next;
            continue;
        }
        let _ = events.unbounded_send(Event::TurnRetry {
            turn: machine.turn(),
            attempt: next,
            code: error.code(),
            message: error.message.clone(),
            wait,
        });
        tokio::time::sleep(wait).await;
        attempt = next;
    }
}
