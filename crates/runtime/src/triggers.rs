//! What starts runs on their own: an agent's cron schedules, and delayed runs coming due.
//!
//! Both go through the store's delayed runs. A schedule's tick is recorded together with its
//! fire's delayed run, in one transaction (`Store::claim_schedule_tick`): of the processes
//! sharing a store, one records each tick, and a process killed right after still leaves the
//! fire to start. Due delayed runs are taken with a hold (`Store::take_due_runs`), so that one
//! process starts each; the run's first commit marks it started, so a start lost with its
//! process is taken again once the hold lapses, and a run never starts twice (its id is fixed
//! when it is stored). A delayed run whose session is busy waits and is tried again: nobody is
//! there to be told "busy".
//!
//! After downtime, a schedule fires once for its latest missed tick (`missed: latest`, the
//! default) or not at all (`missed: skip`); the ticks in between are counted as missed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::schedule::{Missed, ScheduleDef};
use keel_core::{DelayedRun, ErrorCode, StoreError};

use crate::engine::Engine;
use crate::handle::RunHandle;

/// How often the store is asked for due delayed runs (other processes store them too).
pub const POLL: Duration = Duration::from_secs(1);
/// How long a taken delayed run is held before another process may take it again.
const HOLD: Duration = Duration::from_secs(30);
/// How long a delayed run whose session is busy waits before it is tried again.
const BUSY_RETRY: Duration = Duration::from_secs(5);
/// How late a tick may be fired and still count as on time, not missed (a process that is up
/// fires within a poll; a loaded one, a little later).
const ON_TIME: Duration = Duration::from_secs(30);
/// The most ticks counted as missed for one schedule at once (a per-second schedule after a
/// month of downtime is not worth counting one by one).
const MAX_COUNTED_MISSES: u64 = 100_000;
/// The most due delayed runs one pass starts.
const BATCH: usize = 64;

/// Counters of what the triggers did, for metrics.
#[derive(Debug, Default)]
pub struct TriggerStats {
    /// By schedule name: fires, and ticks missed.
    schedules: Mutex<BTreeMap<String, (u64, u64)>>,
    /// Delayed runs (and fires) started by this process.
    pub delayed_started: AtomicU64,
    /// Starts put off because the run's session was busy.
    pub delayed_deferred: AtomicU64,
}

impl TriggerStats {
    /// Every schedule with its fires and missed ticks, by name.
    pub fn schedules(&self) -> Vec<(String, u64, u64)> {
        let map = self.schedules.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.iter().map(|(name, (fires, missed))| (name.clone(), *fires, *missed)).collect()
    }

    fn count(&self, schedule: &str, fires: u64, missed: u64) {
        let mut map = self.schedules.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = map.entry(schedule.to_owned()).or_default();
        entry.0 += fires;
        entry.1 += missed;
    }
}

/// One schedule as the loop tracks it.
struct Tracked {
    def: ScheduleDef,
    /// Its key in the store (`<agent>/<name>`).
    key: String,
    /// Its next tick; `None` until its last fire was read, or when it never fires again.
    next_ms: Option<u64>,
    /// Whether `next_ms` was read from the store yet.
    ready: bool,
}

/// The trigger loop of one engine: fires its agent's schedules and starts due delayed runs.
/// [`Triggers::spawn`] runs it in a task; tests call [`Triggers::pass`] with a manual clock.
pub struct Triggers {
    engine: Engine,
    schedules: Vec<Tracked>,
    stats: Arc<TriggerStats>,
    on_run: Arc<dyn Fn(RunHandle) + Send + Sync>,
}

impl Triggers {
    /// The triggers of `engine`'s agent. `on_run` gets every run they start, once it is
    /// stored (a server forwards its events to the session's observers).
    pub fn new(engine: &Engine, on_run: impl Fn(RunHandle) + Send + Sync + 'static) -> Triggers {
        let agent = engine.agent();
        let schedules = agent
            .schedules
            .iter()
            .map(|def| Tracked { key: def.store_key(&agent.name), def: def.clone(), next_ms: None, ready: false })
            .collect();
        Triggers { engine: engine.clone(), schedules, stats: Arc::default(), on_run: Arc::new(on_run) }
    }

    /// The counters, shared with whoever reports them.
    pub fn stats(&self) -> Arc<TriggerStats> {
        Arc::clone(&self.stats)
    }

    /// Runs the loop in a task until the engine shuts down.
    pub fn spawn(mut self) -> tokio::task::JoinHandle<()> {
        let stopping = self.engine.shared().stopping.clone();
        tokio::spawn(async move {
            loop {
                let wait = self.pass().await;
                tokio::select! {
                    () = stopping.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        })
    }

    /// One pass: fires the schedules whose tick came, then starts the delayed runs that are
    /// due. Returns how long to wait before the next pass.
    pub async fn pass(&mut self) -> Duration {
        let clock = Arc::clone(self.engine.clock());
        let now = clock.now_ms();
        for index in 0..self.schedules.len() {
            if let Err(error) = self.fire_if_due(index, now).await {
                let schedule = &self.schedules[index];
                tracing::warn!(schedule = %schedule.key, %error, "could not fire the schedule; trying again");
            }
        }
        self.start_due().await;
        let now = clock.now_ms();
        let next = self.schedules.iter().filter_map(|s| s.next_ms).min();
        match next {
            Some(next) if next <= now => Duration::ZERO,
            Some(next) => POLL.min(Duration::from_millis(next - now)),
            None => POLL,
        }
    }

    async fn fire_if_due(&mut self, index: usize, now: u64) -> Result<(), StoreError> {
        let store = Arc::clone(self.engine.store());
        let tracked = &mut self.schedules[index];
        if !tracked.ready {
            let last = match store.schedule_last_fire(&tracked.key).await? {
                Some(last) => last,
                // A new schedule counts from now: it does not fire for ticks before it existed.
                None => {
                    store.claim_schedule_tick(&tracked.key, now, None).await?;
                    store.schedule_last_fire(&tracked.key).await?.unwrap_or(now)
                }
            };
            tracked.next_ms = tracked.def.cron.next_after(last);
            tracked.ready = true;
        }
        let Some(next) = tracked.next_ms else { return Ok(()) };
        if next > now {
            return Ok(());
        }
        let def = &tracked.def;
        let latest = def.cron.latest_at_or_before(now).unwrap_or(next).max(next);
        // Ticks after `next` and before `latest` were missed (no process was running).
        let mut missed = 0;
        let mut tick = next;
        while tick < latest && missed < MAX_COUNTED_MISSES {
            missed += 1;
            match def.cron.next_after(tick) {
                Some(following) => tick = following,
                None => break,
            }
        }
        let late = now - latest > ON_TIME.as_millis() as u64;
        let fire = !(late && def.missed == Missed::Skip);
        let run = fire.then(|| DelayedRun {
            run_id: ScheduleDef::run_id_for(&tracked.key, latest),
            session_id: def.session_for(latest),
            input: keel_core::Message::user(def.input.clone()),
            due_ms: latest,
            source: format!("schedule {}", tracked.key),
        });
        let claimed = store.claim_schedule_tick(&tracked.key, latest, run.as_ref()).await?;
        let local = def.cron.local_time(latest);
        match (&run, claimed) {
            (Some(run), true) => {
                self.stats.count(&def.name, 1, missed);
                tracing::info!(schedule = %tracked.key, tick = %local, run = %run.run_id, session = %run.session_id, missed, "schedule fired");
            }
            (None, true) => {
                self.stats.count(&def.name, 0, missed + 1);
                tracing::info!(schedule = %tracked.key, tick = %local, missed = missed + 1, "missed ticks skipped (`missed: skip`)");
            }
            // Another process recorded this tick (or a later one) first.
            (_, false) => {}
        }
        tracked.next_ms = def.cron.next_after(latest);
        Ok(())
    }

    /// Starts the delayed runs that are due (in this process or stored by any other).
    async fn start_due(&self) {
        let store = Arc::clone(self.engine.store());
        let due = match store.take_due_runs(HOLD, BATCH).await {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "could not look for due delayed runs");
                return;
            }
        };
        for run in due {
            let DelayedRun { run_id, session_id, input, .. } = run;
            let engine = self.engine.clone();
            let stats = Arc::clone(&self.stats);
            let on_run = Arc::clone(&self.on_run);
            match engine.start_exclusive(run_id.clone(), session_id.clone(), input) {
                Ok(mut handle) => {
                    tokio::spawn(async move {
                        match handle.admitted().await {
                            Ok(()) => {
                                stats.delayed_started.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(run = %run_id, session = %session_id, "delayed run started");
                                on_run(handle);
                            }
                            Err(failure) => defer(&engine, &stats, &run_id, &failure).await,
                        }
                    });
                }
                Err(failure) => defer(&engine, &stats, &run_id, &failure).await,
            }
        }
    }
}

/// A delayed run that could not start now: tried again later, unless it can never start.
async fn defer(engine: &Engine, stats: &TriggerStats, run: &keel_core::RunId, failure: &keel_core::RunFailure) {
    let store = engine.store();
    // A start refused because the run already started (a lost answer) or was cancelled
    // meanwhile is not tried again: the store says so.
    if let Ok(Some(record)) = store.delayed_run(run).await
        && record.state != keel_core::DelayedState::Waiting
    {
        return;
    }
    let busy = failure.code == ErrorCode::SessionBusy;
    if busy {
        stats.delayed_deferred.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%run, reason = %failure.message, "a delayed run's session is busy; trying again in 5s");
    } else {
        tracing::warn!(%run, %failure, "a delayed run could not start; trying again in 5s");
    }
    let until = engine.clock().now_ms() + BUSY_RETRY.as_millis() as u64;
    if let Err(error) = store.defer_delayed_run(run, until, &failure.message).await {
        tracing::warn!(%run, %error, "could not put off a delayed run (it is tried again when its hold lapses)");
    }
}
