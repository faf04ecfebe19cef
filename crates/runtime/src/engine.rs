//! [`Engine`]: an agent bound to a provider and a store, able to start and re-drive runs.

use foldhash::HashSet;
use std::sync::{Arc, Mutex};

use keel_core::{AgentDef, ErrorCode, Message, Provider, RunFailure, RunId, SessionId, Store};
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
    /// Sessions with a run in flight in this process.
    busy: Mutex<HashSet<SessionId>>,
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
    /// Claims the session for one run, or says it is busy.
    pub(crate) fn claim(self: &Arc<Self>, session: &SessionId) -> Result<SessionClaim, RunFailure> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if !busy.insert(session.clone()) {
            return Err(RunFailure::new(
                ErrorCode::SessionBusy,
                format!("session {session} already has a run in flight; wait for it to finish or cancel it"),
            ));
        }
        Ok(SessionClaim { shared: Arc::clone(self), session: session.clone() })
    }
}

impl Drop for SessionClaim {
    fn drop(&mut self) {
        let mut busy = self.shared.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.remove(&self.session);
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
        let claim = self.shared.claim(&session)?;
        let run_id = new_run_id();
        Ok(self.spawn(run_id.clone(), Plan::Fresh { run_id, session, input, claim }))
    }

    /// Re-drives a run from its journal (after a crash, a restart, or to replay it). Journaled
    /// steps are not executed again; the run continues from the first step without a record.
    pub fn resume(&self, run_id: RunId) -> RunHandle {
        self.spawn(run_id.clone(), Plan::Resume { run_id })
    }

    /// Re-drives every run left `running` by a process that died (its lease expired): all of
    /// them, or `session`'s only. Each gets a handle, like [`Engine::resume`].
    pub async fn recover(&self, session: Option<&SessionId>) -> Result<Vec<RunHandle>, RunFailure> {
        let runs = self.shared.store.interrupted_runs(session).await.map_err(|error| {
            RunFailure::new(error.code(), format!("cannot list interrupted runs: {error}"))
        })?;
        Ok(runs.into_iter().map(|run| self.resume(run)).collect())
    }

    fn spawn(&self, run_id: RunId, plan: Plan) -> RunHandle {
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let (result_tx, result_rx) = oneshot::channel();
        let cancel = CancellationToken::new();
        let handle = RunHandle::new(run_id, event_rx, result_rx, cancel.clone());
        let shared = Arc::clone(&self.shared);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let result = driver::run(shared, plan, event_tx, cancel).await;
                    // The caller may have dropped the handle: the run's outcome is in the store.
                    let _ = result_tx.send(result);
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
        let ids: HashSet<RunId> = (0..200_000).map(|_| new_run_id()).collect();
        assert_eq!(ids.len(), 200_000);
        let id = new_run_id();
        assert_eq!(RunId::parse(id.as_str()), Some(id.clone()));
        assert_eq!(id.as_str().len(), 4 + 32);
    }
}
