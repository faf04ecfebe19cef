//! [`Engine`]: an agent bound to a provider and a store, able to start and re-drive runs.

use std::collections::VecDeque;

use foldhash::HashMap;
use std::sync::{Arc, Mutex};

use keel_core::{
    AgentDef, Concurrency, Decision, ErrorCode, Message, PendingInput, Provider, RunFailure, RunId,
    SessionId, Store,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::driver::{self, Plan};
use crate::handle::RunHandle;

/// What every run of an engine shares.
pub(crate) struct Shared {
    pub(crate) agent: Arc<AgentDef>,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) store: Arc<dyn Store>,
    /// This engine's name as a lease holder: unique per engine, across processes.
    pub(crate) owner: Arc<str>,
    /// How long a run's lease lasts without a heartbeat.
    pub(crate) lease_ttl: std::time::Duration,
    /// Sessions with a run in flight in this process, and the inputs waiting for them.
    busy: Mutex<HashMap<SessionId, SessionSlot>>,
    /// Set when the process shuts down: runs stop at their next step boundary, resumable.
    pub(crate) stopping: CancellationToken,
    /// Runs whose task is alive in this process, and a way to wait for them to end.
    active: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// A busy session: how to cancel its run, and who waits for it (in `queue` or `replace` mode).
struct SessionSlot {
    cancel: CancellationToken,
    waiting: VecDeque<(oneshot::Sender<SessionClaim>, CancellationToken)>,
}

/// Whether a run may start now, or must wait for the session.
pub(crate) enum Admission {
    /// The session is the run's.
    Now(SessionClaim),
    /// The session will be handed over when the runs before this one end.
    Wait(oneshot::Receiver<SessionClaim>),
}

/// The lease length when `KEEL_RUN_LEASE` does not say.
const DEFAULT_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// `KEEL_RUN_LEASE` (a duration such as `30s`): how long a run's lease lasts without a heartbeat,
/// so how soon another process may take over a run whose process died.
fn lease_ttl_from_env() -> std::time::Duration {
    let Ok(text) = std::env::var("KEEL_RUN_LEASE") else { return DEFAULT_LEASE_TTL };
    match humantime::parse_duration(text.trim()) {
        Ok(ttl) if !ttl.is_zero() => ttl,
        _ => {
            tracing::warn!(value = %text, "KEEL_RUN_LEASE is not a duration like `30s` or `500ms`; using 30s");
            DEFAULT_LEASE_TTL
        }
    }
}

/// Marks a session busy for as long as it lives.
pub(crate) struct SessionClaim {
    shared: Arc<Shared>,
    session: SessionId,
}

impl Shared {
    /// Admits a run to its session according to `mode`: now, after the runs before it (queue,
    /// replace), or not at all (`KEEL_SESSION_BUSY`). `cancel` is the new run's token: a later
    /// `replace` cancels it.
    pub(crate) fn admit(
        self: &Arc<Self>,
        session: &SessionId,
        cancel: &CancellationToken,
        mode: Concurrency,
    ) -> Result<Admission, RunFailure> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let Some(slot) = busy.get_mut(session) else {
            busy.insert(session.clone(), SessionSlot { cancel: cancel.clone(), waiting: VecDeque::new() });
            return Ok(Admission::Now(SessionClaim { shared: Arc::clone(self), session: session.clone() }));
        };
        let busy_error = |why: &str| {
            RunFailure::new(
                ErrorCode::SessionBusy,
                format!("session {session} already has a run in flight{why}"),
            )
        };
        match mode {
            Concurrency::Reject => Err(busy_error("; wait for it to finish or cancel it")),
            Concurrency::Queue if slot.waiting.len() >= Concurrency::MAX_QUEUED => Err(busy_error(&format!(
                " and {} inputs waiting, the most `concurrency: queue` allows",
                Concurrency::MAX_QUEUED
            ))),
            Concurrency::Queue => {
                let (handover, wait) = oneshot::channel();
                slot.waiting.push_back((handover, cancel.clone()));
                Ok(Admission::Wait(wait))
            }
            Concurrency::Replace => {
                // The newest input wins: the run in flight and any input still waiting give way.
                slot.cancel.cancel();
                for (_, waiting) in slot.waiting.drain(..) {
                    waiting.cancel();
                }
                let (handover, wait) = oneshot::channel();
                slot.waiting.push_back((handover, cancel.clone()));
                Ok(Admission::Wait(wait))
            }
        }
    }

    /// Claims the session now, or says it is busy (re-driving a run never waits).
    pub(crate) fn claim(
        self: &Arc<Self>,
        session: &SessionId,
        cancel: &CancellationToken,
    ) -> Result<SessionClaim, RunFailure> {
        match self.admit(session, cancel, Concurrency::Reject)? {
            Admission::Now(claim) => Ok(claim),
            Admission::Wait(_) => unreachable!("reject never waits"),
        }
    }
}

impl Drop for SessionClaim {
    /// Hands the session to the next waiting run, or frees it.
    fn drop(&mut self) {
        let next = {
            let mut busy = self.shared.busy.lock().unwrap_or_else(|p| p.into_inner());
            let Some(slot) = busy.get_mut(&self.session) else { return };
            match slot.waiting.pop_front() {
                Some((handover, cancel)) => {
                    slot.cancel = cancel;
                    Some(handover)
                }
                None => {
                    busy.remove(&self.session);
                    None
                }
            }
        };
        // Outside the lock: a refused claim is dropped here, and hands over to the next in line.
        if let Some(handover) = next {
            let claim = SessionClaim { shared: Arc::clone(&self.shared), session: self.session.clone() };
            drop(handover.send(claim));
        }
    }
}

/// A new run id: a UUIDv7 (time-ordered), whose 74 "random" bits are a per-process random
/// seed plus a counter. Unique across processes like a random UUIDv7, but without drawing
/// random numbers for every run.
fn new_run_id() -> RunId {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
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

/// Records a human's decision on pending input `id` in `store` (checking that it fits what is
/// asked), without driving the run: it goes on when a process re-drives it (see
/// [`Engine::recover`]). What `keel approvals` does without an agent. Returns what was decided.
pub async fn record_decision(
    store: &dyn Store,
    id: &str,
    decision: Decision,
) -> Result<PendingInput, RunFailure> {
    let failure = |error: keel_core::StoreError| RunFailure::new(error.code(), error.to_string());
    let Some(found) = store.pending_input(id).await.map_err(failure)? else {
        return Err(failure(keel_core::StoreError::not_pending(id)));
    };
    keel_core::human::check_decision(&found, &decision)?;
    store.decide(id, &decision).await.map_err(failure)
}

/// An agent bound to a model provider and a store.
///
/// Cheap to clone; clones share the same "session busy" bookkeeping.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl Engine {
    /// Binds an agent to a provider and a store. Runs' leases last `KEEL_RUN_LEASE` (default
    /// 30 s) without a heartbeat.
    pub fn new(agent: Arc<AgentDef>, provider: Arc<dyn Provider>, store: Arc<dyn Store>) -> Engine {
        Engine::with_lease_ttl(agent, provider, store, lease_ttl_from_env())
    }

    /// Like [`Engine::new`], with the lease length given: how long a run's lease lasts without a
    /// heartbeat, so how soon another process may take over a run whose process died.
    pub fn with_lease_ttl(
        agent: Arc<AgentDef>,
        provider: Arc<dyn Provider>,
        store: Arc<dyn Store>,
        lease_ttl: std::time::Duration,
    ) -> Engine {
        let owner =
            format!("keel-{}-{}", std::process::id(), &uuid::Uuid::new_v4().simple().to_string()[..12]);
        Engine {
            shared: Arc::new(Shared {
                agent,
                provider,
                store,
                owner: owner.into(),
                lease_ttl,
                busy: Mutex::default(),
                stopping: CancellationToken::new(),
                active: std::sync::atomic::AtomicUsize::new(0),
                idle: tokio::sync::Notify::new(),
            }),
        }
    }

    /// The agent.
    pub fn agent(&self) -> &AgentDef {
        &self.shared.agent
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.shared.store
    }

    /// Starts a run: one turn of `session` answering `input`. The run goes on in a Tokio task
    /// even if the handle is dropped.
    ///
    /// Fails at once with `KEEL_SESSION_BUSY` when the session has a run in flight, and with
    /// `KEEL_INTERNAL` when called outside a Tokio runtime.
    pub fn start(&self, session: SessionId, input: Message) -> Result<RunHandle, RunFailure> {
        self.start_with_id(new_run_id(), session, input)
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
        let cancel = CancellationToken::new();
        let admission = self.shared.admit(&session, &cancel, self.shared.agent.concurrency)?;
        Ok(self.spawn(run_id.clone(), Plan::Fresh { run_id, session, input, admission }, cancel))
    }

    /// Re-drives a run from its journal (after a crash, a restart, or to replay it). Journaled
    /// steps are not executed again; the run continues from the first step without a record.
    pub fn resume(&self, run_id: RunId) -> RunHandle {
        self.spawn(run_id.clone(), Plan::Resume { run_id, session_held: false }, CancellationToken::new())
    }

    /// Re-drives every run left `running` by a process that died (its lease expired), or whose
    /// pause a human decided: all of them, or `session`'s only. Approvals and questions past
    /// their expiry are decided first (an approval is rejected, a question unanswered), so
    /// their runs go on too. Each run gets a handle, like [`Engine::resume`].
    pub async fn recover(&self, session: Option<&SessionId>) -> Result<Vec<RunHandle>, RunFailure> {
        self.expire_overdue(session).await?;
        let runs = self.shared.store.interrupted_runs(session).await.map_err(|error| {
            RunFailure::new(error.code(), format!("cannot list interrupted runs: {error}"))
        })?;
        Ok(runs.into_iter().map(|run| self.resume(run)).collect())
    }

    /// The approvals and questions waiting for a human: all, or `session`'s; oldest first.
    pub async fn pending(&self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, RunFailure> {
        self.shared
            .store
            .pending_inputs(session)
            .await
            .map_err(|error| RunFailure::new(error.code(), format!("cannot list pending approvals: {error}")))
    }

    /// Decides a pending approval or question and continues its run, returning its handle.
    ///
    /// The decision is recorded first, durably: if the run is driven by another process at the
    /// moment (it still had other calls to finish), that process applies it and the handle
    /// ends with `KEEL_RUN_LEASED`. Fails with `KEEL_NOT_PENDING` when `id` is not pending
    /// (a second decision changes nothing) and `KEEL_DECISION_INVALID` when the decision does
    /// not fit (an answer to an approval).
    pub async fn decide(&self, id: &str, decision: Decision) -> Result<RunHandle, RunFailure> {
        let pending = record_decision(self.shared.store.as_ref(), id, decision).await?;
        Ok(self.resume(pending.run_id))
    }

    /// Whether `session` has a run in flight in this process.
    pub fn is_running(&self, session: &SessionId) -> bool {
        self.shared.busy.lock().unwrap_or_else(|p| p.into_inner()).contains_key(session)
    }

    /// Cancels `session`'s run: the one in flight in this process (its model call or tool is
    /// abandoned, open calls get "cancelled" results) or the one paused for a human. Returns
    /// whether there was one. A run in flight in another process is not reached
    /// (`KEEL_RUN_LEASED`).
    pub async fn cancel(&self, session: &SessionId) -> Result<bool, RunFailure> {
        {
            let busy = self.shared.busy.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(slot) = busy.get(session) {
                slot.cancel.cancel();
                return Ok(true);
            }
        }
        let paused = self.pending(Some(session)).await?;
        if paused.is_empty() {
            return Ok(false);
        }
        let claim_token = CancellationToken::new();
        let _claim = self.shared.claim(session, &claim_token)?;
        driver::cancel_paused_runs(&self.shared, session).await?;
        Ok(true)
    }

    /// Stops this engine's runs for a process shutdown: each stops at its next step boundary
    /// (the step in progress finishes and is committed) and is left resumable, its lease
    /// released so that the next process takes it over at once; its stream ends with
    /// `run.error` `KEEL_SHUTTING_DOWN`. Waits up to `grace`; returns how many runs were still
    /// going then (they are resumable too, once their lease expires).
    pub async fn shutdown(&self, grace: std::time::Duration) -> usize {
        use std::sync::atomic::Ordering;
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
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut expired = 0;
        for pending in self.pending(session).await? {
            if pending.expires_at_ms > now {
                continue;
            }
            match self.shared.store.decide(&pending.id, &Decision::TimedOut).await {
                Ok(_) => {
                    tracing::info!(id = %pending.id, run = %pending.run_id, "nobody decided in time: timed out");
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

    /// Keeps recovering interrupted runs in the background: now, then every `every`. For
    /// long-lived processes (a server): a run whose process died is taken over once its lease
    /// expires, and a paused run once a human decided it. Each re-driven run's handle goes to
    /// `on_run` (a server forwards its events to observers; dropping it is fine: the run goes on
    /// and its outcome is in the store). Stop the loop by aborting the returned task.
    pub fn recover_periodically(
        &self,
        every: std::time::Duration,
        on_run: impl Fn(RunHandle) + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
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
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let (result_tx, result_rx) = oneshot::channel();
        let handle = RunHandle::new(run_id, event_rx, result_rx, cancel.clone());
        let shared = Arc::clone(&self.shared);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                shared.active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                runtime.spawn(async move {
                    let result = driver::run(Arc::clone(&shared), plan, event_tx, cancel).await;
                    // The caller may have dropped the handle: the run's outcome is in the store.
                    let _ = result_tx.send(result);
                    if shared.active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                        shared.idle.notify_waiters();
                    }
                });
            }
            Err(_) => {
                let _ = result_tx.send(Err(RunFailure::new(
                    ErrorCode::Internal,
                    "keel runs need a Tokio runtime: call this from within `#[tokio::main]` or a runtime",
                )));
            }
        }
        handle
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
