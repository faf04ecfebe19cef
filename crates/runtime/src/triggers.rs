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
            .map(|def| Tracked {
                key: def.store_key(&agent.name),
                def: def.clone(),
                next_ms: None,
                ready: false,
            })
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
        let mut failed = false;
        for index in 0..self.schedules.len() {
            if let Err(error) = self.fire_if_due(index, now).await {
                let schedule = &self.schedules[index];
                tracing::warn!(schedule = %schedule.key, %error, "could not fire the schedule; trying again");
                failed = true;
            }
        }
        self.start_due().await;
        let now = clock.now_ms();
        let next = self.schedules.iter().filter_map(|s| s.next_ms).min();
        match next {
            // A store that fails is not asked again at once.
            _ if failed => POLL,
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
        let def = tracked.def.clone();
        let key = tracked.key.clone();
        // The ticks since the last one recorded: those of the last `ON_TIME` fire, each in turn
        // (a loop a little late still fires every tick); older ones passed while no process ran.
        let on_time_from = now.saturating_sub(ON_TIME.as_millis() as u64);
        let mut recent = Vec::new();
        let mut old = 0u64;
        let mut latest_old = None;
        let mut tick = next;
        while tick <= now {
            if tick >= on_time_from {
                recent.push(tick);
            } else if old < MAX_COUNTED_MISSES {
                old += 1;
                latest_old = Some(tick);
            } else {
                // Too many to count one by one: jump to the last old one.
                let last = def.cron.latest_at_or_before(on_time_from.saturating_sub(1)).unwrap_or(tick);
                latest_old = Some(last.max(tick));
                tick = latest_old.unwrap_or(tick);
            }
            match def.cron.next_after(tick) {
                Some(following) => tick = following,
                None => break,
            }
        }
        // After downtime with nothing on time, the latest missed tick fires once (`latest`) or
        // none does (`skip`); with a tick on time, that one fires and the old ones are missed.
        let mut fires: Vec<(u64, bool)> = recent.iter().map(|&tick| (tick, true)).collect();
        let mut missed = old;
        if let (true, Some(last)) = (fires.is_empty(), latest_old) {
            fires.push((last, def.missed == Missed::Latest));
            if def.missed == Missed::Latest {
                missed -= 1;
            }
        } else if let Some(last) = latest_old {
            // Record the old ones as passed before the first recent one fires.
            store.claim_schedule_tick(&key, last, None).await?;
        }
        let mut counted_missed = false;
        for (tick, fire) in fires {
            let run = fire.then(|| DelayedRun {
                run_id: ScheduleDef::run_id_for(&key, tick),
                session_id: def.session_for(tick),
                input: keel_core::Message::user(def.input.clone()),
                due_ms: tick,
                source: format!("schedule {key}"),
            });
            let claimed = store.claim_schedule_tick(&key, tick, run.as_ref()).await?;
            self.schedules[index].next_ms = def.cron.next_after(tick);
            if !claimed {
                // Another process recorded this tick (or a later one) first.
                continue;
            }
            let missed_now = if counted_missed { 0 } else { missed };
            counted_missed = true;
            let local = def.cron.local_time(tick);
            match &run {
                Some(run) => {
                    crate::fault::point_here("after_schedule_claim");
                    self.stats.count(&def.name, 1, missed_now);
                    tracing::info!(schedule = %key, tick = %local, run = %run.run_id, session = %run.session_id, missed = missed_now, "schedule fired");
                }
                None => {
                    self.stats.count(&def.name, 0, missed_now);
                    tracing::info!(schedule = %key, tick = %local, missed = missed_now, "missed ticks skipped (`missed: skip`)");
                }
            }
        }
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

/// The longest `after` of a delayed run: a year.
pub const MAX_DELAY: Duration = Duration::from_secs(366 * 24 * 3600);

/// When a delayed run asked for `at` (an RFC 3339 time with its offset) or `after` (a duration
/// such as `10m`, `2h` or `3d`) from `now_ms` is due, in milliseconds since the Unix epoch.
/// Exactly one of them; a time in the past is due at once; `after` is at most [`MAX_DELAY`].
pub fn due_time(at: Option<&str>, after: Option<&str>, now_ms: u64) -> Result<u64, String> {
    let due = match (at, after) {
        (Some(_), Some(_)) => return Err("give `at` or `after`, not both".into()),
        (None, None) => {
            return Err("say when: `at` (an RFC 3339 time such as 2026-12-24T09:00:00+01:00) or `after` (a duration such as 10m)".into());
        }
        (Some(at), None) => {
            let at: jiff::Timestamp = at.trim().parse().map_err(|error| {
                format!(
                    "`at` {at:?} is not an RFC 3339 time with an offset, such as 2026-12-24T09:00:00+01:00 or \
                     2026-12-24T08:00:00Z ({error})"
                )
            })?;
            u64::try_from(at.as_millisecond()).unwrap_or(0)
        }
        (None, Some(after)) => {
            let after = humantime::parse_duration(after.trim()).map_err(|error| {
                format!("`after` {after:?} is not a duration such as 30s, 10m, 2h or 3d ({error})")
            })?;
            if after > MAX_DELAY {
                return Err(format!("`after` is more than a year ({})", humantime::format_duration(after)));
            }
            now_ms.saturating_add(after.as_millis() as u64)
        }
    };
    Ok(due.max(now_ms))
}

/// A delayed run that could not start now: tried again later, unless it can never start.
async fn defer(
    engine: &Engine,
    stats: &TriggerStats,
    run: &keel_core::RunId,
    failure: &keel_core::RunFailure,
) {
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
