//! [`Engine`]: an agent bound to a provider and a store, able to start and re-drive runs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::{
    AgentDef, Clock, Concurrency, Decision, ErrorCode, LimitOverrides, Message, OpenRun, PendingInput,
    Provider, RunFailure, RunId, RunState, SessionId, Store,
};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::driver::{self, Plan};
use crate::handle::RunHandle;
use crate::shared::Shared;

/// How an engine is set up, beyond its agent, provider and store.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// How long a run's lease lasts without a heartbeat: how soon a process on another machine
    /// may take over a run whose process died (on the same machine, a dead process is noticed
    /// at once). Default: `KEEL_RUN_LEASE`, else 30 s.
    pub lease_ttl: Duration,
    /// Where time comes from (approval expiries, lease messages). Default: the system clock.
    pub clock: Arc<dyn Clock>,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions { lease_ttl: lease_ttl_from_env(), clock: keel_core::clock::system() }
    }
}

/// How one run differs from the agent's defaults ([`Engine::start_with`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOptions {
    /// Limits and budgets of this run that differ from the agent's `limits`.
    pub limits: LimitOverrides,
}

/// What [`Engine::cancel`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancellation {
    /// The session had no unfinished run.
    NoRun,
    /// This call cancelled the run.
    Cancelled,
    /// The run was being cancelled already (by a concurrent call, another process, or a
    /// `replace` input); it ends all the same. `by`: who asked first, when the store knows.
    AlreadyCancelling {
        /// Who asked first.
        by: Option<String>,
    },
}

impl Cancellation {
    /// Whether there was a run to cancel (by this call or an earlier one).
    pub fn had_run(&self) -> bool {
        !matches!(self, Cancellation::NoRun)
    }
}

/// The lease length when `KEEL_RUN_LEASE` does not say.
const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// How often an engine with runs in flight looks for cancellations asked by other processes.
const CANCEL_POLL: Duration = Duration::from_millis(500);

/// `KEEL_RUN_LEASE` (a duration such as `30s`).
fn lease_ttl_from_env() -> Duration {
    let Ok(text) = std::env::var(keel_core::env::RUN_LEASE.name) else { return DEFAULT_LEASE_TTL };
    match humantime::parse_duration(text.trim()) {
        Ok(ttl) if !ttl.is_zero() => ttl,
        _ => {
            tracing::warn!(value = %text, "KEEL_RUN_LEASE is not a duration like `30s` or `500ms`; using 30s");
            DEFAULT_LEASE_TTL
        }
    }
}

/// A new run id: a UUIDv7 (time-ordered), whose 74 "random" bits are a per-process random
/// seed plus a counter. Unique across processes like a random UUIDv7, but without drawing
/// random numbers for every run.
fn new_run_id() -> RunId {
    use std::sync::OnceLock;
    use std::sync::atomic::AtomicU64;
    static SEED: OnceLock<u128> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| uuid::Uuid::new_v4().as_u128());
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Big-endian, last 10 bytes: the counter's low bits land at the end, away from the bits the
    // version and variant overwrite (the top 4 bits of the first byte, 2 of the third).
    let random = seed.wrapping_add(u128::from(count)).to_be_bytes();
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut random_bytes = [0u8; 10];
    random_bytes.copy_from_slice(&random[6..]);
    let id = uuid::Builder::from_unix_timestamp_millis(millis, &random_bytes).into_uuid();
    let mut buffer = uuid::Uuid::encode_buffer();
    RunId::from_suffix(id.simple().encode_lower(&mut buffer))
}

/// A new delayed run's id ([`RunId::delayed`]): unique like [`Engine::start`]'s run ids.
pub fn new_delayed_run_id() -> RunId {
    let id = new_run_id();
    RunId::delayed(&id.as_str()[RunId::PREFIX.len()..])
}

/// Who does something, for the record (decisions, cancellations): `what (pid N on host H)`.
pub fn who(what: &str) -> String {
    format!("{what} (pid {} on host {})", std::process::id(), crate::process::host())
}

/// Records a human's decision on pending input `id` in `store` (checking that it fits what is
/// asked), without driving the run: it goes on when a process re-drives it (see
/// [`Engine::recover`]). `by` says who decided, for whoever comes second. What `keel approvals`
/// does without an agent. Returns what was decided.
pub async fn record_decision(
    store: &dyn Store,
    id: &str,
    decision: Decision,
    by: &str,
) -> Result<PendingInput, RunFailure> {
    let failure = |error: keel_core::StoreError| RunFailure::new(error.code(), error.to_string());
    let Some(found) = store.pending_input(id).await.map_err(failure)? else {
        // Say what became of it, not only that it is gone.
        return Err(failure(
            store
                .decide(id, &decision, by)
                .await
                .err()
                .unwrap_or_else(|| keel_core::StoreError::not_pending(id)),
        ));
    };
    keel_core::human::check_decision(&found, &decision)?;
    store.decide(id, &decision, by).await.map_err(failure)
}

/// An agent bound to a model provider and a store.
///
/// Cheap to clone; clones share the same "session busy" bookkeeping.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl Engine {
    /// Binds an agent to a provider and a store, with default [`EngineOptions`].
    pub fn new(agent: Arc<AgentDef>, provider: Arc<dyn Provider>, store: Arc<dyn Store>) -> Engine {
        Engine::with_options(agent, provider, store, EngineOptions::default())
    }

    /// Like [`Engine::new`], with the lease length given (see [`EngineOptions::lease_ttl`]).
    pub fn with_lease_ttl(
        agent: Arc<AgentDef>,
        provider: Arc<dyn Provider>,
        store: Arc<dyn Store>,
        lease_ttl: Duration,
    ) -> Engine {
        Engine::with_options(agent, provider, store, EngineOptions { lease_ttl, ..EngineOptions::default() })
    }

    /// Binds an agent to a provider and a store, set up by `options`.
    pub fn with_options(
        agent: Arc<AgentDef>,
        provider: Arc<dyn Provider>,
        store: Arc<dyn Store>,
        options: EngineOptions,
    ) -> Engine {
        Engine {
            shared: Arc::new(Shared {
                agent: std::sync::RwLock::new(agent),
                provider,
                store,
                clock: options.clock,
                owner: crate::process::lease_owner().into(),
                lease_ttl: options.lease_ttl,
                sessions: Arc::default(),
                stopping: CancellationToken::new(),
                active: AtomicUsize::new(0),
                idle: tokio::sync::Notify::new(),
                watching: AtomicBool::new(false),
                observer: Mutex::new(None),
                timed_out: Default::default(),
            }),
        }
    }

    /// How many approvals and how many questions this engine has timed out so far (nobody
    /// decided within `approvals.timeout`).
    pub fn timed_out_inputs(&self) -> (u64, u64) {
        let [approvals, questions] = &self.shared.timed_out;
        (approvals.load(Ordering::Relaxed), questions.load(Ordering::Relaxed))
    }

    /// The agent definition runs starting now use.
    pub fn agent(&self) -> Arc<AgentDef> {
        self.shared.agent()
    }

    /// Replaces the agent definition (its tools changed: an MCP server's list did). Runs
    /// started or resumed from now on use it; runs in flight keep the one they started with.
    pub fn set_agent(&self, agent: Arc<AgentDef>) {
        *self.shared.agent.write().unwrap_or_else(std::sync::PoisonError::into_inner) = agent;
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.shared.store
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.shared.clock
    }

    /// Gives `observer` every run this engine drives on its own: runs it recovers, a run it
    /// finishes before a new input of the same session, a cancellation it completes. A server
    /// forwards their events to the session's observers; without one, they run unobserved.
    pub fn set_observer(&self, observer: impl Fn(RunHandle) + Send + Sync + 'static) {
        *self.shared.observer.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(observer));
    }

    /// Starts a run: one turn of `session` answering `input`. The run goes on in a Tokio task
    /// even if the handle is dropped; [`RunHandle::admitted`] says when it is stored (or why it
    /// is refused).
    ///
    /// Fails at once with `KEEL_SESSION_BUSY` when the session has a run in flight in this
    /// process and its `concurrency` is `reject`, and with `KEEL_INTERNAL` outside a Tokio
    /// runtime. An unfinished run of the session in the store is finished first when nobody
    /// drives it (interrupted, or decided since its pause); one driven by another process, or
    /// waiting for a human, refuses the input (`KEEL_SESSION_BUSY`) unless `concurrency` says
    /// to wait (`queue`) or to cancel it (`replace`).
    pub fn start(&self, session: SessionId, input: Message) -> Result<RunHandle, RunFailure> {
        self.start_with_id(new_run_id(), session, input)
    }

    /// [`Engine::start`] for a run with its own options (limits and budgets other than the
    /// agent's). The options are stored with the run: a re-driven run keeps them.
    pub fn start_with(
        &self,
        session: SessionId,
        input: Message,
        options: RunOptions,
    ) -> Result<RunHandle, RunFailure> {
        let mode = self.shared.agent().concurrency;
        self.start_in_mode(new_run_id(), session, input, mode, options.limits, Drive::Spawned)
    }

    /// [`Engine::start`] with a run id the caller chose: one it can derive again later, to find
    /// the run (a subagent's run for a tool call). The id must be new to the store: look it up
    /// with `Store::load_run` first, and re-drive a stored run with [`Engine::resume`].
    pub fn start_with_id(
        &self,
        run_id: RunId,
        session: SessionId,
        input: Message,
    ) -> Result<RunHandle, RunFailure> {
        let mode = self.shared.agent().concurrency;
        self.start_in_mode(run_id, session, input, mode, LimitOverrides::default(), Drive::Spawned)
    }

    /// [`Engine::start_with_id`] for an input nobody waits on (a delayed run, a schedule's
    /// fire, a channel's event): refused with `KEEL_SESSION_BUSY` while the session has a run
    /// in flight anywhere, whatever the agent's `concurrency` says, so that the caller decides
    /// what to do (try again later, or tell the sender).
    pub fn start_exclusive(
        &self,
        run_id: RunId,
        session: SessionId,
        input: Message,
    ) -> Result<RunHandle, RunFailure> {
        self.start_in_mode(
            run_id,
            session,
            input,
            Concurrency::Reject,
            LimitOverrides::default(),
            Drive::Spawned,
        )
    }

    /// [`Engine::start_with`] for a caller that awaits the run at once: the run works in the
    /// task that polls the returned handle (its stream, [`RunHandle::admitted`] or
    /// [`RunHandle::result`]) instead of a task of its own. Nothing passes between tasks on
    /// the way, so on a multi-thread runtime no other worker thread is woken; a run that waits
    /// on nothing (an in-memory store, a fast tool) ends within one poll.
    ///
    /// The run only moves on while its handle is polled, or once the handle is dropped: then
    /// the rest of the run goes on in a task of its own, so an inline run ends all the same.
    /// Do not hold an inline run's handle unpolled while you wait on something that needs the
    /// run to move on (its approval showing up in [`Engine::pending`], say): use
    /// [`Engine::start_with`] there. [`Engine::shutdown`] waits for an inline run as for any
    /// other.
    pub fn start_inline(
        &self,
        session: SessionId,
        input: Message,
        options: RunOptions,
    ) -> Result<RunHandle, RunFailure> {
        let mode = self.shared.agent().concurrency;
        self.start_in_mode(new_run_id(), session, input, mode, options.limits, Drive::Inline)
    }

    fn start_in_mode(
        &self,
        run_id: RunId,
        session: SessionId,
        input: Message,
        mode: Concurrency,
        limits: LimitOverrides,
        drive: Drive,
    ) -> Result<RunHandle, RunFailure> {
        let cancel = CancellationToken::new();
        let admission = self.shared.sessions.admit(&session, &run_id, &cancel, mode)?;
        let plan = Plan::Fresh { run_id: run_id.clone(), session, input, admission, mode, limits };
        Ok(self.launch(run_id, plan, cancel, None, drive))
    }

    /// Re-drives a run from its journal (after a crash, a restart, or to replay it). Journaled
    /// steps are not executed again; the run continues from the first step without a record.
    pub fn resume(&self, run_id: RunId) -> RunHandle {
        self.resume_taking_over(run_id, None)
    }

    fn resume_taking_over(&self, run_id: RunId, takeover: Option<String>) -> RunHandle {
        let plan = Plan::Resume { run_id: run_id.clone(), session_held: false, takeover };
        self.spawn(run_id, plan, CancellationToken::new())
    }

    /// Re-drives every unfinished run that nobody drives: all of them, or `session`'s. That is a
    /// run whose lease expired, whose pause a human decided (or a cancellation ended), and one
    /// whose process is provably gone (same machine, process no longer alive), taken over at
    /// once without waiting for its lease. Approvals and questions past their expiry are
    /// decided first (an approval is rejected, a question unanswered), so their runs go on too.
    /// Each run gets a handle, like [`Engine::resume`]. A run leased to a live process (or to a
    /// process on another machine, until its lease expires) is left alone: see
    /// [`Engine::open_runs`].
    pub async fn recover(&self, session: Option<&SessionId>) -> Result<Vec<RunHandle>, RunFailure> {
        self.expire_overdue(session).await?;
        let now = self.shared.now_ms();
        Ok(self
            .open_runs(session)
            .await?
            .into_iter()
            .filter_map(|run| match crate::shared::nobody_drives(&run, now) {
                Some(takeover) => Some(self.resume_taking_over(run.run_id, takeover)),
                None => None,
            })
            .collect())
    }

    /// The unfinished runs of the store (all, or `session`'s), with who drives them.
    pub async fn open_runs(&self, session: Option<&SessionId>) -> Result<Vec<OpenRun>, RunFailure> {
        self.shared
            .store
            .open_runs(session)
            .await
            .map_err(|error| RunFailure::new(error.code(), format!("cannot list unfinished runs: {error}")))
    }

    /// The approvals and questions waiting for a human: all, or `session`'s; oldest first.
    pub async fn pending(&self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, RunFailure> {
        self.shared
            .store
            .pending_inputs(session)
            .await
            .map_err(|error| RunFailure::new(error.code(), format!("cannot list pending approvals: {error}")))
    }

    /// Decides a pending approval or question (as `by`, for the record) and continues its run,
    /// returning its handle.
    ///
    /// The decision is recorded first, durably: if the run is driven by another process at the
    /// moment (it still had other calls to finish), that process applies it and the handle
    /// ends with `KEEL_RUN_LEASED`. Fails with `KEEL_NOT_PENDING` when `id` is not pending
    /// (saying who decided it first; a second decision changes nothing) and
    /// `KEEL_DECISION_INVALID` when the decision does not fit (an answer to an approval).
    pub async fn decide(&self, id: &str, decision: Decision, by: &str) -> Result<RunHandle, RunFailure> {
        let pending = record_decision(self.shared.store.as_ref(), id, decision, by).await?;
        Ok(self.resume(pending.run_id))
    }

    /// Whether `session` has a run in flight in this process.
    pub fn is_running(&self, session: &SessionId) -> bool {
        self.shared.sessions.is_busy(session)
    }

    /// Cancels `session`'s unfinished run, wherever it is: in flight here (its model call or
    /// tool is abandoned, open calls get "cancelled" results), in another process (which stops
    /// it within a second), paused for a human or interrupted (ended here, now). `by` says who,
    /// for the record. Answers once a run in flight here or ended here has stopped: whether
    /// there was a run, and whether this call is the one that cancelled it (of several
    /// concurrent calls, one is).
    pub async fn cancel(&self, session: &SessionId, by: &str) -> Result<Cancellation, RunFailure> {
        match self.shared.sessions.cancel_and_wait(session).await {
            Some(true) => return Ok(Cancellation::Cancelled),
            Some(false) => return Ok(Cancellation::AlreadyCancelling { by: None }),
            None => {}
        }
        let requested = self.shared.store.request_cancel(session, by).await.map_err(|error| {
            RunFailure::new(error.code(), format!("cannot cancel the run of session {session}: {error}"))
        })?;
        let Some(run) = requested else { return Ok(Cancellation::NoRun) };
        let answer = match run.cancel_requested_by.clone() {
            Some(first) => Cancellation::AlreadyCancelling { by: Some(first) },
            None => Cancellation::Cancelled,
        };
        // Paused runs became re-drivable with the request: end those nobody drives, here, and
        // wait for that (it runs nothing new), so that the session is free when this returns.
        let run = OpenRun { state: RunState::Running, lease_expires_ms: 0, ..run };
        if let Some(takeover) = crate::shared::nobody_drives(&run, self.shared.now_ms()) {
            let plan = Plan::Resume { run_id: run.run_id.clone(), session_held: false, takeover };
            let (copy, ended) = oneshot::channel();
            let handle = self.spawn_with(run.run_id, plan, CancellationToken::new(), Some(copy));
            match self.shared.observer() {
                Some(observer) => observer(handle),
                None => drop(handle),
            }
            match ended.await {
                // This process's recovery got to it first: it ends it here; wait for that.
                Ok(Err(failure)) if failure.code == ErrorCode::RunLeased => {
                    self.shared.sessions.cancel_and_wait(session).await;
                }
                Ok(Err(failure)) => tracing::warn!(%failure, "could not end a cancelled run yet"),
                Ok(Ok(_)) | Err(_) => {}
            }
        }
        Ok(answer)
    }

    /// Stops this engine's runs for a process shutdown: each stops at its next step boundary
    /// (the step in progress finishes and is committed) and is left resumable, its lease
    /// released so that the next process takes it over at once; its stream ends with
    /// `run.error` `KEEL_SHUTTING_DOWN`. Waits up to `grace`; returns how many runs were still
    /// going then (they are resumable too, once their lease expires).
    pub async fn shutdown(&self, grace: Duration) -> usize {
        self.shared.stopping.cancel();
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let idle = self.shared.idle.notified();
            let active = self.shared.active.load(Ordering::SeqCst);
            if active == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.shared.active.load(Ordering::SeqCst);
            }
        }
    }

    /// Decides the approvals and questions of `session` (or all) whose expiry has passed, as
    /// [`Decision::TimedOut`]. Returns how many.
    async fn expire_overdue(&self, session: Option<&SessionId>) -> Result<usize, RunFailure> {
        let now = self.shared.now_ms();
        let mut expired = 0;
        for pending in self.pending(session).await? {
            if pending.expires_at_ms > now {
                continue;
            }
            match self.shared.store.decide(&pending.id, &Decision::TimedOut, "approvals.timeout").await {
                Ok(_) => {
                    tracing::info!(id = %pending.id, run = %pending.run_id, "nobody decided in time: timed out");
                    let counter =
                        usize::from(matches!(pending.kind, keel_core::PendingKind::Question { .. }));
                    self.shared.timed_out[counter].fetch_add(1, Ordering::Relaxed);
                    expired += 1;
                }
                // A human decided first.
                Err(keel_core::StoreError::NotPending(_)) => {}
                Err(error) => {
                    return Err(RunFailure::new(
                        error.code(),
                        format!("cannot time out {}: {error}", pending.id),
                    ));
                }
            }
        }
        Ok(expired)
    }

    /// Keeps recovering interrupted runs in the background: now, then about every `every` (up
    /// to a fifth less, at random, so that instances do not scan a shared store in step). For
    /// long-lived processes (a server): a run whose process died is taken over at once when
    /// that process is provably gone, else once its lease expires; a paused run once a human
    /// decided it. Each re-driven run's handle goes to `on_run` (a server forwards its events to
    /// observers; dropping it is fine: the run goes on and its outcome is in the store). Stop
    /// the loop by aborting the returned task.
    pub fn recover_periodically(
        &self,
        every: Duration,
        on_run: impl Fn(RunHandle) + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            // Each pass waits `every` less up to a fifth, drawn anew: instances started together
            // (a deployment) drift apart instead of scanning the shared store in step.
            let random = std::collections::hash_map::RandomState::new();
            let mut pass: u64 = 0;
            loop {
                if pass > 0 {
                    let fifth = u64::try_from(every.as_millis() / 5).unwrap_or(u64::MAX).max(1);
                    let jitter =
                        Duration::from_millis(std::hash::BuildHasher::hash_one(&random, pass) % fifth);
                    tokio::time::sleep(every.saturating_sub(jitter)).await;
                }
                pass += 1;
                match engine.recover(None).await {
                    Ok(handles) => {
                        for handle in handles {
                            tracing::info!(run = %handle.run_id(), "re-driving an interrupted run");
                            on_run(handle);
                        }
                    }
                    Err(failure) => tracing::warn!(%failure, "could not look for interrupted runs"),
                }
            }
        })
    }

    fn spawn(&self, run_id: RunId, plan: Plan, cancel: CancellationToken) -> RunHandle {
        self.spawn_with(run_id, plan, cancel, None)
    }

    /// [`Engine::spawn`], also sending the run's result to `copy` (for a caller that gives the
    /// handle away and still waits for the end).
    fn spawn_with(
        &self,
        run_id: RunId,
        plan: Plan,
        cancel: CancellationToken,
        copy: Option<oneshot::Sender<Result<crate::handle::RunResult, RunFailure>>>,
    ) -> RunHandle {
        self.launch(run_id, plan, cancel, copy, Drive::Spawned)
    }

    /// Makes a run's handle and its work, which goes to a task of its own (`Drive::Spawned`) or
    /// stays with the handle (`Drive::Inline`).
    fn launch(
        &self,
        run_id: RunId,
        plan: Plan,
        cancel: CancellationToken,
        copy: Option<oneshot::Sender<Result<crate::handle::RunResult, RunFailure>>>,
        drive: Drive,
    ) -> RunHandle {
        // futures' channel, not tokio's: tokio's allocates a block of 32 events (3.4 KB) when it is
        // made, which is most of what a run in flight holds; this one allocates per event sent.
        let (event_tx, event_rx) = futures::channel::mpsc::unbounded();
        let (result_tx, result_rx) = oneshot::channel();
        let (admitted_tx, admitted_rx) = oneshot::channel();
        let handle = RunHandle::new(run_id, event_rx, result_rx, admitted_rx, cancel.clone());
        let shared = Arc::clone(&self.shared);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let failure = RunFailure::new(
                ErrorCode::Internal,
                "keel runs need a Tokio runtime: call this from within `#[tokio::main]` or a runtime",
            );
            let _ = admitted_tx.send(Err(failure.clone()));
            if let Some(copy) = copy {
                let _ = copy.send(Err(failure.clone()));
            }
            let _ = result_tx.send(Err(failure));
            return handle;
        };
        shared.active.fetch_add(1, Ordering::SeqCst);
        if !shared.watching.swap(true, Ordering::SeqCst) {
            runtime.spawn(watch_cancellations(Arc::downgrade(&shared)));
        }
        // The caller's trace context (a request's `traceparent`), for the run's span.
        let parent = crate::spans::parent();
        let work = async move {
            let result =
                driver::run_guarded(Arc::clone(&shared), plan, event_tx, Some(admitted_tx), cancel, parent)
                    .await;
            if let Some(copy) = copy {
                let _ = copy.send(result.clone());
            }
            // The caller may have dropped the handle: the run's outcome is in the store.
            let _ = result_tx.send(result);
            if shared.active.fetch_sub(1, Ordering::SeqCst) == 1 {
                shared.idle.notify_waiters();
            }
        };
        match drive {
            Drive::Spawned => {
                // Boxed: the task then holds a pointer, which Tokio moves into the task and out
                // again as it finishes, instead of the whole future (about 1 KB) each time.
                runtime.spawn(Box::pin(work));
                handle
            }
            Drive::Inline => handle.driving(crate::handle::Inline::new(Box::pin(work), runtime)),
        }
    }
}

/// Where a run's work is done: see [`Engine::start_inline`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Drive {
    /// In a Tokio task of its own, from the start.
    Spawned,
    /// In the task that polls its handle; in a task of its own once the handle is dropped.
    Inline,
}

/// While the engine has runs in flight: polls the store for cancellations other processes
/// asked for, and cancels those runs here. It holds the engine weakly: a dropped engine (and its
/// store) is freed at once, not at the next poll.
async fn watch_cancellations(shared: std::sync::Weak<Shared>) {
    loop {
        tokio::time::sleep(CANCEL_POLL).await;
        let Some(shared) = shared.upgrade() else { return };
        if shared.active.load(Ordering::SeqCst) == 0 {
            shared.watching.store(false, Ordering::SeqCst);
            // A run may have started since and seen the flag still set: go on for it, unless
            // it started a watcher of its own.
            if shared.active.load(Ordering::SeqCst) == 0 || shared.watching.swap(true, Ordering::SeqCst) {
                return;
            }
        }
        match shared.store.cancel_requests(&shared.owner).await {
            Ok(runs) if !runs.is_empty() => {
                tracing::info!(?runs, "cancelling runs another process asked to cancel");
                shared.sessions.cancel_runs(&runs);
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "could not look for cancellation requests"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_unique_even_within_one_millisecond() {
        let ids: std::collections::HashSet<RunId> = (0..200_000).map(|_| new_run_id()).collect();
        assert_eq!(ids.len(), 200_000);
        let id = new_run_id();
        assert_eq!(RunId::parse(id.as_str()), Some(id.clone()));
        assert_eq!(id.as_str().len(), 4 + 32);
    }
}
