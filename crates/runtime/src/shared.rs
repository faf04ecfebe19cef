//! What every run of an engine shares: the agent, provider, store and clock, the lease owner
//! name, the sessions in flight, and the hooks of a process (shutdown, observers).

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::{AgentDef, Clock, OpenRun, Provider, Store};
use tokio_util::sync::CancellationToken;

use crate::admission::Sessions;
use crate::handle::RunHandle;

/// Where an engine sends the runs it drives on its own (recovery, a run finished before a new
/// input, a cancellation completed): a server forwards their events to the session's observers.
pub(crate) type Observer = Arc<dyn Fn(RunHandle) + Send + Sync>;

pub(crate) struct Shared {
    /// The agent new and resumed runs use; replaced when its tools change (an MCP server's
    /// list changed). A run keeps the definition it started with.
    pub(crate) agent: std::sync::RwLock<Arc<AgentDef>>,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) clock: Arc<dyn Clock>,
    /// This engine's name as a lease holder: unique per engine, and telling another process on
    /// the same machine how to check that this one is gone (see `process`).
    pub(crate) owner: Arc<str>,
    /// How long a run's lease lasts without a heartbeat.
    pub(crate) lease_ttl: Duration,
    /// Sessions with a run in flight in this process, and the inputs waiting for them.
    pub(crate) sessions: Arc<Sessions>,
    /// Set when the process shuts down: runs stop at their next step boundary, resumable.
    pub(crate) stopping: CancellationToken,
    /// Runs whose task is alive in this process, and a way to wait for them to end.
    pub(crate) active: AtomicUsize,
    pub(crate) idle: tokio::sync::Notify,
    /// Whether a task polls the store for cancellations of this engine's runs.
    pub(crate) watching: AtomicBool,
    pub(crate) observer: Mutex<Option<Observer>>,
    /// Approvals and questions this engine timed out (`approvals.timeout`), for metrics.
    pub(crate) timed_out: [std::sync::atomic::AtomicU64; 2],
}

impl Shared {
    /// The agent definition a run starting now uses.
    pub(crate) fn agent(&self) -> Arc<AgentDef> {
        Arc::clone(&self.agent.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// The observer, if one is set.
    pub(crate) fn observer(&self) -> Option<Observer> {
        self.observer.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Milliseconds since the Unix epoch, from the engine's clock.
    pub(crate) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }
}

/// Whether nobody drives `run` at `now_ms`, so that this process may: `Some(None)` when its
/// lease is free or expired, `Some(Some(owner))` when its owner is provably dead (take it over
/// by name), `None` when a live owner (or one that cannot be checked) holds it, or it waits for
/// a human.
pub(crate) fn nobody_drives(run: &OpenRun, now_ms: u64) -> Option<Option<String>> {
    if run.is_interrupted(now_ms) {
        return Some(None);
    }
    match &run.owner {
        Some(owner) if run.is_leased(now_ms) && crate::process::is_provably_dead(owner) => {
            Some(Some(owner.clone()))
        }
        _ => None,
    }
}
