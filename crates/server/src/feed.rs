//! Live session events: each session's recent events with their SSE ids, broadcast to every
//! observer.
//!
//! A subscriber reads its session's [`Feed`]: the recent events after its `Last-Event-ID`, then
//! new ones as they come: one cursor over one ordered ring, so no gap and no duplicate. The ring
//! is bounded; a subscriber that falls behind its end is cut (it reconnects with
//! `Last-Event-ID`) instead of slowing the run or the other subscribers down.
//!
//! Where the events come from depends on the store:
//!
//! - **This process owns the store** (memory, SQLite): every run of a session runs here, so the
//!   events of this process's runs are the session's events. They are published to the feed at
//!   once, with ids from one process-wide counter (seeded with the clock, so ids keep growing
//!   across restarts).
//! - **Processes share the store** (PostgreSQL, [`keel_core::EventLog`]): a session's runs may
//!   execute on any instance, so the session's events are its log in the database. This
//!   process's runs append their events to it (one writer task, which batches what queued while
//!   its last append was in flight), and a feed holds what it read of the log, by the log's
//!   numbers: the writer delivers what it appended, and a notification that another instance
//!   appended makes the feed read the rest. A subscriber's `Last-Event-ID` is then a number in
//!   the session's log, valid on every instance.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashSet};
use futures::StreamExt;
use keel_core::wire::event_to_json;
use keel_core::{Event, EventLog, LogWake, LoggedEvent, NewEvent, RunFailure, RunId, SessionId, StoreError};
use keel_runtime::{RunHandle, RunResult};

use crate::metrics::Metrics;

/// How many events an append to the shared log carries at most.
const APPEND_BATCH: usize = 4096;

/// How many events a feed reads from the shared log per query.
const READ_BATCH: usize = 1024;

/// How many events of this process's runs may wait for the shared log (while the database is
/// unreachable, say) before the runs wait for it.
const OUTBOX: usize = 65_536;

/// How many recent events a session keeps for reconnecting subscribers: a few turns' worth.
/// Kept small because every active session holds them (the memory of a busy server).
pub(crate) const RECENT_EVENTS: usize = 256;

/// How many feeds nobody watches and no run publishes to are kept at most (the most recently
/// used), for clients that reconnect. A feed is kept a minute after its last use (the sweep),
/// but a server starting thousands of sessions a second would hold a minute's worth of them:
/// about 2 KB each, hundreds of MB. This bounds it to a few MB whatever the rate.
pub(crate) const IDLE_FEEDS: usize = 4096;

/// One published item.
#[derive(Debug)]
pub(crate) struct Entry {
    /// The SSE id.
    pub(crate) id: u64,
    /// The run that emitted it.
    pub(crate) run: RunId,
    /// The event as JSON, or the end of the run's stream.
    pub(crate) item: Item,
}

#[derive(Debug)]
pub(crate) enum Item {
    /// An event, serialized once for every subscriber.
    Event(Arc<str>),
    /// The run's event stream ended (it finished, failed, or paused for a human).
    RunEnded,
}

/// The feeds of every session with recent activity in this process.
pub(crate) struct Feeds {
    sessions: Mutex<Sessions>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    /// The shared log, when processes share the store.
    shared: Option<Shared>,
}

/// A shared log and what this process runs to use it.
struct Shared {
    log: Arc<dyn EventLog>,
    /// Events of this process's runs, to the writer task.
    outbox: tokio::sync::mpsc::Sender<Outgoing>,
    /// The writer's end, until the writer starts (on first use, inside the runtime).
    outbox_reader: Mutex<Option<tokio::sync::mpsc::Receiver<Outgoing>>>,
    /// Whether the tasks were started: checked on every event, so an atomic, not the mutex.
    started: std::sync::Once,
    /// Sessions other instances appended to, since the wake-up task last looked.
    woken: Mutex<Woken>,
    wake: Arc<tokio::sync::Notify>,
    /// How long the log keeps events (for reconnecting subscribers).
    retention: Duration,
}

/// The feeds by session, and the size at which the idle ones are next trimmed.
struct Sessions {
    feeds: HashMap<SessionId, Arc<Feed>>,
    trim_at: usize,
    /// At most this many idle feeds are kept ([`IDLE_FEEDS`]; smaller in tests).
    idle_cap: usize,
}

impl Sessions {
    fn new(idle_cap: usize) -> Sessions {
        Sessions { feeds: HashMap::default(), trim_at: idle_cap + idle_cap / 2, idle_cap }
    }

    /// Drops the least recently used idle feeds beyond the cap. It walks every feed, so it runs
    /// only after half a cap of new ones: amortized O(1) per new session.
    fn trim(&mut self) {
        let mut idle: Vec<(Instant, SessionId)> = self
            .feeds
            .iter()
            .filter_map(|(session, feed)| {
                // Only the map holds it: no run, subscriber or event on its way uses it, and no
                // caller of `feed` is about to (a subscriber reading the shared log first, say),
                // as every new holder takes it from the map under this lock.
                if Arc::strong_count(feed) > 1 {
                    return None;
                }
                let state = lock(&feed.state);
                (state.runs == 0 && state.subscribers == 0).then(|| (state.last_used, session.clone()))
            })
            .collect();
        if idle.len() > self.idle_cap {
            let excess = idle.len() - self.idle_cap;
            idle.select_nth_unstable_by_key(excess - 1, |(used, _)| *used);
            for (_, session) in &idle[..excess] {
                self.feeds.remove(session);
            }
        }
        self.trim_at = self.feeds.len() + self.idle_cap / 2;
    }
}

#[derive(Default)]
struct Woken {
    sessions: HashSet<SessionId>,
    all: bool,
}

impl Drop for Feeds {
    fn drop(&mut self) {
        // The wake-up task sees the feeds gone and ends.
        if let Some(shared) = &self.shared {
            shared.wake.notify_one();
        }
    }
}

/// An event of this process's runs on its way to the shared log.
struct Outgoing {
    feed: Arc<Feed>,
    event: NewEvent,
}

impl Feeds {
    /// Feeds of a store this process owns (`log: None`), or of one shared through `log`, which
    /// keeps events for `retention`.
    pub(crate) fn new(metrics: Arc<Metrics>, log: Option<Arc<dyn EventLog>>, retention: Duration) -> Feeds {
        // Seeded with the clock (microseconds): a client's Last-Event-ID from before a restart is
        // older than every id this process hands out.
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        let shared = log.map(|log| {
            let (outbox, reader) = tokio::sync::mpsc::channel(OUTBOX);
            Shared {
                log,
                outbox,
                outbox_reader: Mutex::new(Some(reader)),
                started: std::sync::Once::new(),
                woken: Mutex::default(),
                wake: Arc::new(tokio::sync::Notify::new()),
                retention,
            }
        });
        Feeds {
            sessions: Mutex::new(Sessions::new(IDLE_FEEDS)),
            next_id: AtomicU64::new(start),
            metrics,
            shared,
        }
    }

    /// The session's feed, created on first use.
    fn feed(&self, session: &SessionId) -> Arc<Feed> {
        let mut sessions = lock(&self.sessions);
        if let Some(feed) = sessions.feeds.get(session) {
            return Arc::clone(feed);
        }
        if sessions.feeds.len() >= sessions.trim_at {
            sessions.trim();
        }
        let feed = Arc::new(Feed::new(session.clone()));
        sessions.feeds.insert(session.clone(), Arc::clone(&feed));
        feed
    }

    /// A subscriber to the session's events after `after` (the client's `Last-Event-ID`), or,
    /// with `None`, from now on. With a shared log, the feed first reads what it lacks of it.
    pub(crate) async fn subscribe(
        self: &Arc<Self>,
        session: &SessionId,
        after: Option<u64>,
    ) -> Result<Subscriber, StoreError> {
        let feed = self.feed(session);
        if let Some(shared) = &self.shared {
            self.start_shared();
            sync(shared.log.as_ref(), &feed).await?;
        }
        Ok(feed.subscribe(after))
    }

    /// Starts, once, the tasks that use the shared log: the writer, the wake-ups from other
    /// instances, and the pruning of old events.
    fn start_shared(self: &Arc<Self>) {
        let Some(shared) = &self.shared else { return };
        shared.started.call_once(|| self.start_tasks(shared));
    }

    /// [`Feeds::start_shared`]'s work, done once.
    fn start_tasks(self: &Arc<Self>, shared: &Shared) {
        let Some(reader) = lock(&shared.outbox_reader).take() else { return };
        tokio::spawn(write_out(Arc::clone(&shared.log), reader, Arc::clone(&self.metrics)));

        // The tasks hold the feeds weakly: they end with them (`Drop` wakes this one).
        let (feeds, wake) = (Arc::downgrade(self), Arc::clone(&shared.wake));
        tokio::spawn(async move {
            loop {
                let notified = wake.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let Some(this) = feeds.upgrade() else { return };
                let woken = this.shared.as_ref().map(|shared| std::mem::take(&mut *lock(&shared.woken)));
                if let Some(woken) = woken.filter(|w| w.all || !w.sessions.is_empty()) {
                    this.read_woken(woken).await;
                    continue;
                }
                drop(this);
                notified.await;
            }
        });

        let feeds = Arc::downgrade(self);
        let on_wake = move |wake: LogWake<'_>| {
            let Some(this) = feeds.upgrade() else { return };
            let Some(shared) = &this.shared else { return };
            {
                let mut woken = lock(&shared.woken);
                match wake {
                    LogWake::All => woken.all = true,
                    // Only sessions someone follows here are read.
                    LogWake::Session(session) => {
                        if lock(&this.sessions).feeds.contains_key(session) {
                            woken.sessions.insert(session.clone());
                        }
                    }
                }
            }
            shared.wake.notify_one();
        };
        if let Err(error) = shared.log.watch(Box::new(on_wake)) {
            tracing::error!(%error, "cannot follow other instances' events: observers here see this instance's runs only");
        }

        let (feeds, retention) = (Arc::downgrade(self), shared.retention);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(60));
            loop {
                tick.tick().await;
                let Some(log) =
                    feeds.upgrade().and_then(|this| this.shared.as_ref().map(|s| Arc::clone(&s.log)))
                else {
                    return;
                };
                let older_than = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
                if let Err(error) = log.prune(older_than).await {
                    tracing::debug!(%error, "could not prune old events; trying again in a minute");
                }
            }
        });
    }

    /// Reads into the followed feeds what other instances appended to their sessions' logs.
    async fn read_woken(&self, woken: Woken) {
        let Some(shared) = &self.shared else { return };
        let feeds: Vec<Arc<Feed>> = {
            let sessions = lock(&self.sessions);
            if woken.all {
                sessions.feeds.values().cloned().collect()
            } else {
                woken.sessions.iter().filter_map(|s| sessions.feeds.get(s).cloned()).collect()
            }
        };
        futures::stream::iter(feeds)
            .for_each_concurrent(8, |feed| async move {
                // A feed that never read the log reads it in full when someone subscribes.
                if !lock(&feed.state).read_log {
                    return;
                }
                if sync(shared.log.as_ref(), &feed).await.is_err() {
                    tokio::spawn(sync_persistently(Arc::clone(&shared.log), feed));
                }
            })
            .await;
    }

    /// Drops the feeds nobody watches, with no run publishing, unused for `idle`: a server's
    /// memory stays flat however many sessions it has served.
    pub(crate) fn sweep(&self, idle: Duration) -> usize {
        let mut sessions = lock(&self.sessions);
        let before = sessions.feeds.len();
        sessions.feeds.retain(|_, feed| {
            let state = lock(&feed.state);
            state.runs > 0 || state.subscribers > 0 || state.last_used.elapsed() < idle
        });
        before - sessions.feeds.len()
    }

    /// Publishes a run's events to its session's feed as they come, then the end of its stream.
    /// Returns the run's result.
    pub(crate) fn forward(
        self: &Arc<Self>,
        session: &SessionId,
        handle: RunHandle,
    ) -> tokio::task::JoinHandle<Result<RunResult, RunFailure>> {
        let feed = self.feed(session);
        let feeds = Arc::clone(self);
        lock(&feed.state).runs += 1;
        tokio::spawn(async move { feeds.pump(feed, handle, None).await })
    }

    /// Like [`Feeds::forward`] for a run whose session is not known yet (a recovered run): its
    /// first event (`run.start`) names it.
    pub(crate) fn forward_recovered(self: &Arc<Self>, mut handle: RunHandle) {
        let feeds = Arc::clone(self);
        tokio::spawn(async move {
            let Some(first) = handle.next().await else {
                return;
            };
            let Event::RunStart { session_id, .. } = &first else {
                return;
            };
            let feed = feeds.feed(session_id);
            lock(&feed.state).runs += 1;
            if let Err(failure) = feeds.pump(feed, handle, Some(first)).await {
                tracing::warn!(%failure, "a recovered run failed");
            }
        });
    }

    /// Publishes the events, counts them, and ends the run's stream.
    async fn pump(
        self: &Arc<Self>,
        feed: Arc<Feed>,
        mut handle: RunHandle,
        first: Option<Event>,
    ) -> Result<RunResult, RunFailure> {
        let run = handle.run_id().clone();
        let started = Instant::now();
        self.metrics.run_started();
        if let Some(event) = first {
            self.metrics.event(&event);
            self.publish(&feed, &run, Some(event_json(&event))).await;
        }
        while let Some(event) = handle.next().await {
            self.metrics.event(&event);
            self.publish(&feed, &run, Some(event_json(&event))).await;
        }
        self.publish(&feed, &run, None).await;
        lock(&feed.state).runs -= 1;
        let result = handle.result().await;
        let outcome = match &result {
            Ok(result) => result.stopped.as_str(),
            Err(_) => "failed",
        };
        self.metrics.run_ended(outcome, started.elapsed());
        result
    }

    /// Publishes one event of this process's run (`None`: the end of its stream): to the feed
    /// at once, or through the shared log.
    async fn publish(self: &Arc<Self>, feed: &Arc<Feed>, run: &RunId, body: Option<Arc<str>>) {
        let Some(shared) = &self.shared else {
            feed.publish_next(&self.next_id, run, body);
            return;
        };
        self.start_shared();
        let event = NewEvent { session: feed.session.clone(), run: run.clone(), body };
        // Waits only when the log has been unreachable for a long stretch of events.
        self.metrics.events_waiting(1);
        if shared.outbox.send(Outgoing { feed: Arc::clone(feed), event }).await.is_err() {
            self.metrics.events_waiting(-1);
            tracing::error!(session = %feed.session, "the event writer stopped; an event is not published");
        }
    }
}

/// The writer of this process's events to the shared log: appends what queued while its last
/// append was in flight, in order, again after a failure until it is stored (events wait, the
/// runs' order is kept, nothing is dropped), then delivers it to the feeds here.
async fn write_out(
    log: Arc<dyn EventLog>,
    mut outbox: tokio::sync::mpsc::Receiver<Outgoing>,
    metrics: Arc<Metrics>,
) {
    let mut queued = Vec::with_capacity(APPEND_BATCH);
    let mut failing_since: Option<Instant> = None;
    while outbox.recv_many(&mut queued, APPEND_BATCH).await > 0 {
        let events: Vec<NewEvent> = queued.iter().map(|out| out.event.clone()).collect();
        let seqs = append_until_stored(log.as_ref(), events, &mut failing_since, Some(&metrics)).await;
        metrics.events_waiting(-i64::try_from(queued.len()).unwrap_or(i64::MAX));
        // Each feed's events of this batch, in order (a run's events are consecutive per feed).
        let mut by_feed: Vec<(Arc<Feed>, Vec<LoggedEvent>)> = Vec::new();
        for (index, out) in queued.drain(..).enumerate() {
            let logged = seqs.as_ref().map(|seqs| LoggedEvent {
                seq: seqs[index],
                run: out.event.run,
                body: out.event.body,
            });
            match by_feed.iter_mut().find(|(feed, _)| Arc::ptr_eq(feed, &out.feed)) {
                Some((_, events)) => events.extend(logged),
                None => by_feed.push((out.feed, logged.into_iter().collect())),
            }
        }
        for (feed, events) in by_feed {
            if !feed.publish_following(events) {
                // Not next in line (another instance appended in between, or a read of the log
                // is under way): the feed reads the log, without holding the writer up.
                tokio::spawn(sync_persistently(Arc::clone(&log), feed));
            }
        }
    }
}

/// Appends `events` to the log as one batch, again after each failure (pausing longer each
/// time) until the log takes them; `failing_since` spans the failures, so that an outage is
/// reported once and its end once.
async fn append_until_stored(
    log: &dyn EventLog,
    events: Vec<NewEvent>,
    failing_since: &mut Option<Instant>,
    metrics: Option<&Metrics>,
) -> Option<Vec<u64>> {
    let batch = fastrand::u64(..);
    let mut backoff = Duration::from_millis(50);
    let seqs = loop {
        match log.append(batch, events.clone()).await {
            Ok(seqs) => break seqs,
            Err(error) => {
                if let Some(metrics) = metrics {
                    metrics.event_append_failed();
                }
                if failing_since.is_none() {
                    tracing::warn!(%error, "cannot store events in the shared log; they wait, in order");
                    *failing_since = Some(Instant::now());
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    };
    if let Some(since) = failing_since.take() {
        tracing::info!(after = ?since.elapsed(), "events flow to the shared log again");
    }
    seqs
}

/// Publishes the events sent on the returned channel to `log`, in order, batching what queues
/// while an append is in flight: how a process that drives runs outside `keel serve` (the CLI
/// deciding an approval, say) lets observers on `keel serve` instances see them. The task ends
/// once the sender is dropped and everything sent is stored.
pub fn publish_to_log(
    log: Arc<dyn EventLog>,
) -> (tokio::sync::mpsc::UnboundedSender<NewEvent>, tokio::task::JoinHandle<()>) {
    let (events, mut queue) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut queued = Vec::new();
        let mut failing_since = None;
        while queue.recv_many(&mut queued, APPEND_BATCH).await > 0 {
            append_until_stored(log.as_ref(), std::mem::take(&mut queued), &mut failing_since, None).await;
        }
    });
    (events, task)
}

/// [`sync`], again after each failure (the database is unreachable for a while), for up to a
/// minute: a feed that missed a read would otherwise wait for the session's next event.
async fn sync_persistently(log: Arc<dyn EventLog>, feed: Arc<Feed>) {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(100);
    while let Err(error) = sync(log.as_ref(), &feed).await {
        if started.elapsed() > Duration::from_secs(60) {
            tracing::warn!(%error, session = %feed.session, "could not read the session's events for a minute; its next event tries again");
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Reads into `feed` what it lacks of its session's log: the recent events on first use, then
/// what came after its last one.
async fn sync(log: &dyn EventLog, feed: &Feed) -> Result<(), StoreError> {
    let _reading = feed.reading.lock().await;
    if !lock(&feed.state).read_log {
        let (head, events) = log.read_recent(&feed.session, RECENT_EVENTS).await?;
        feed.start_at(head, events);
        return Ok(());
    }
    loop {
        let last = lock(&feed.state).last_id;
        let events = log.read_after(&feed.session, last, READ_BATCH).await?;
        let more = events.len() == READ_BATCH;
        for event in events {
            feed.publish_logged(event);
        }
        if !more {
            return Ok(());
        }
    }
}

fn event_json(event: &Event) -> Arc<str> {
    event_to_json(event).into()
}

/// One session's recent events, which are also its broadcast: a subscriber keeps a cursor (the
/// last id it sent) and waits for the next entry; one whose next entry was already evicted from
/// the ring fell too far behind and is cut. No per-subscriber or per-session channel is
/// allocated, so an idle stream or a quiet session costs almost nothing.
pub(crate) struct Feed {
    session: SessionId,
    state: Mutex<FeedState>,
    published: tokio::sync::Notify,
    /// With a shared log: held while the feed reads from it, so that reads do not overlap.
    reading: tokio::sync::Mutex<()>,
}

struct FeedState {
    recent: VecDeque<Arc<Entry>>,
    /// The id of the newest entry evicted from `recent` (0: none).
    evicted_up_to: u64,
    /// The id of the newest entry published.
    last_id: u64,
    /// With a shared log: whether the feed has read it (its ids are then the log's numbers).
    read_log: bool,
    /// Runs publishing to this feed now.
    runs: usize,
    /// Subscribers reading it now.
    subscribers: usize,
    last_used: Instant,
}

impl Feed {
    fn new(session: SessionId) -> Feed {
        Feed {
            session,
            state: Mutex::new(FeedState {
                recent: VecDeque::new(),
                evicted_up_to: 0,
                last_id: 0,
                read_log: false,
                runs: 0,
                subscribers: 0,
                last_used: Instant::now(),
            }),
            published: tokio::sync::Notify::new(),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    /// Publishes with the next id of this process's counter.
    fn publish_next(&self, ids: &AtomicU64, run: &RunId, body: Option<Arc<str>>) {
        {
            let mut state = lock(&self.state);
            // The id is taken under the lock, so the order of ids is the order of publication.
            let id = ids.fetch_add(1, Ordering::Relaxed);
            state.push(Entry { id, run: run.clone(), item: Item::from(body) });
        }
        self.published.notify_waiters();
    }

    /// Publishes an event of the shared log, unless the feed has it already.
    fn publish_logged(&self, event: LoggedEvent) {
        {
            let mut state = lock(&self.state);
            if event.seq <= state.last_id {
                return;
            }
            state.push(Entry { id: event.seq, run: event.run, item: Item::from(event.body) });
        }
        self.published.notify_waiters();
    }

    /// Starts the feed from the shared log: its last number and its recent events.
    fn start_at(&self, head: u64, events: Vec<LoggedEvent>) {
        {
            let mut state = lock(&self.state);
            // What is older than the recent events is gone, for this feed.
            let oldest = events.first().map_or(head, |event| event.seq - 1);
            state.evicted_up_to = state.evicted_up_to.max(oldest);
            state.last_id = state.last_id.max(state.evicted_up_to);
            for event in events {
                if event.seq > state.last_id {
                    state.push(Entry { id: event.seq, run: event.run, item: Item::from(event.body) });
                }
            }
            state.last_id = state.last_id.max(head);
            state.read_log = true;
        }
        self.published.notify_waiters();
    }

    /// Publishes events this process appended to the log when they come right after what the
    /// feed holds (checked and published under one lock, so a read of the log under way only
    /// adds what they lack); `false` when they do not, or carry no numbers (appended by an
    /// earlier attempt whose answer was lost), and the feed must read the log.
    fn publish_following(&self, events: Vec<LoggedEvent>) -> bool {
        {
            let mut state = lock(&self.state);
            let follows = events.first().is_some_and(|first| first.seq == state.last_id + 1);
            if !state.read_log || !follows {
                return false;
            }
            for event in events {
                state.push(Entry { id: event.seq, run: event.run, item: Item::from(event.body) });
            }
        }
        self.published.notify_waiters();
        true
    }

    /// Subscribes after `after` (the client's `Last-Event-ID`: the recent entries after it come
    /// first), or, with `None`, from now on.
    fn subscribe(self: &Arc<Self>, after: Option<u64>) -> Subscriber {
        let mut state = lock(&self.state);
        state.last_used = Instant::now();
        state.subscribers += 1;
        let cursor = match after {
            // Entries older than the ring are gone: start with the oldest kept.
            Some(after) => after.max(state.evicted_up_to),
            None => state.last_id,
        };
        Subscriber { feed: Arc::clone(self), cursor }
    }

    /// The entry after `cursor`, or `Err(())` when it was evicted (the subscriber lagged).
    fn next_after(&self, cursor: u64) -> Result<Option<Arc<Entry>>, ()> {
        let state = lock(&self.state);
        if cursor < state.evicted_up_to {
            return Err(());
        }
        // Entries are in id order; the wanted one is usually at the end.
        let index = state.recent.partition_point(|e| e.id <= cursor);
        Ok(state.recent.get(index).cloned())
    }
}

impl FeedState {
    fn push(&mut self, entry: Entry) {
        if self.recent.len() == RECENT_EVENTS
            && let Some(evicted) = self.recent.pop_front()
        {
            self.evicted_up_to = evicted.id;
        }
        self.last_id = entry.id;
        self.recent.push_back(Arc::new(entry));
        self.last_used = Instant::now();
    }
}

impl From<Option<Arc<str>>> for Item {
    fn from(body: Option<Arc<str>>) -> Item {
        body.map_or(Item::RunEnded, Item::Event)
    }
}

/// A reader of a feed: the entries after its cursor, as they come.
pub(crate) struct Subscriber {
    feed: Arc<Feed>,
    cursor: u64,
}

impl Subscriber {
    /// The id of the last entry before those this subscriber reads.
    pub(crate) fn position(&self) -> u64 {
        self.cursor
    }

    /// The next entry; `None` when the subscriber fell so far behind that entries it did not read
    /// were evicted (it should reconnect with `Last-Event-ID`).
    pub(crate) async fn next(&mut self) -> Option<Arc<Entry>> {
        loop {
            // Register for the wake-up before looking, so a publish in between is not missed.
            let published = self.feed.published.notified();
            tokio::pin!(published);
            published.as_mut().enable();
            match self.feed.next_after(self.cursor) {
                Err(()) => return None,
                Ok(Some(entry)) => {
                    self.cursor = entry.id;
                    return Some(entry);
                }
                Ok(None) => published.await,
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let mut state = lock(&self.feed.state);
        state.subscribers -= 1;
        state.last_used = Instant::now();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One run's events (as JSON) from its session's feed, until the run's stream ends: what the
/// answers that are not keel's own SSE (the OpenAI and AI SDK faces) are made from.
pub(crate) struct RunEvents {
    subscriber: Subscriber,
    run: RunId,
    closing: tokio_util::sync::CancellationToken,
}

impl RunEvents {
    pub(crate) fn new(
        subscriber: Subscriber,
        run: RunId,
        closing: tokio_util::sync::CancellationToken,
    ) -> RunEvents {
        RunEvents { subscriber, run, closing }
    }

    /// The run's next event; `None` once its stream ended (after its closing event, if it had
    /// one: without one its process stopped it, and it resumes later), or when the feed was cut
    /// (the server is stopping, or the reader fell behind).
    pub(crate) async fn next(&mut self) -> Option<serde_json::Value> {
        loop {
            let entry = tokio::select! {
                biased;
                () = self.closing.cancelled() => return None,
                entry = self.subscriber.next() => entry?,
            };
            if entry.run != self.run {
                continue;
            }
            match &entry.item {
                Item::Event(json) => match serde_json::from_str(json) {
                    Ok(event) => return Some(event),
                    Err(_) => continue,
                },
                Item::RunEnded => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(feed: &Feed, ids: &AtomicU64, count: usize) {
        let run = RunId::from_suffix("r");
        for _ in 0..count {
            feed.publish_next(ids, &run, Some("{}".into()));
        }
    }

    #[tokio::test]
    async fn subscribers_resume_after_their_last_id_and_a_slow_one_is_cut() {
        let ids = AtomicU64::new(1);
        let feed = Arc::new(Feed::new(SessionId::new("s").unwrap()));
        publish(&feed, &ids, 3);
        // From the start (Last-Event-ID 1): ids 2 and 3, then what comes live.
        let mut resumed = feed.subscribe(Some(1));
        let mut live = feed.subscribe(None);
        assert_eq!(resumed.next().await.unwrap().id, 2);
        assert_eq!(resumed.next().await.unwrap().id, 3);
        let waiting = tokio::spawn(async move { live.next().await.map(|e| e.id) });
        tokio::task::yield_now().await;
        publish(&feed, &ids, 1);
        assert_eq!(waiting.await.unwrap(), Some(4), "a live subscriber is woken by a publish");
        assert_eq!(resumed.next().await.unwrap().id, 4);

        // A subscriber that reads nothing while more than the ring holds is published is cut,
        // and one that resumes from an evicted id starts at the oldest kept.
        let mut slow = feed.subscribe(None);
        publish(&feed, &ids, RECENT_EVENTS + 1);
        assert!(slow.next().await.is_none(), "a subscriber that fell behind the ring must be cut");
        let mut late = feed.subscribe(Some(1));
        let oldest = late.next().await.unwrap().id;
        assert_eq!(oldest, 4 + 2, "the oldest entry kept after evictions");
        assert_eq!(lock(&feed.state).subscribers, 3);
        drop((slow, late, resumed));
        assert_eq!(lock(&feed.state).subscribers, 0);
    }

    #[tokio::test]
    async fn idle_feeds_beyond_the_cap_are_dropped_oldest_first_and_watched_or_running_ones_never() {
        let feeds = Arc::new(Feeds::new(Arc::new(Metrics::new()), None, Duration::from_secs(60)));
        *lock(&feeds.sessions) = Sessions::new(8);
        let session = |name: String| SessionId::new(name).unwrap();
        let ids = AtomicU64::new(1);
        // The first session is watched and the second has a run publishing: both must stay.
        let watched = feeds.subscribe(&session("watched".into()), None).await.unwrap();
        let running = feeds.feed(&session("running".into()));
        lock(&running.state).runs += 1;
        // And one whose feed a caller holds, before it subscribes (as one reading the log does).
        let held = feeds.feed(&session("held".into()));
        for n in 0..1000 {
            let feed = feeds.feed(&session(format!("s{n}")));
            publish(&feed, &ids, 3);
        }
        let sessions = lock(&feeds.sessions);
        // 8 idle ones kept, half a cap more before the next trim, and the two in use.
        assert!(sessions.feeds.len() <= 8 + 4 + 3, "{} feeds kept", sessions.feeds.len());
        for kept in ["watched", "running", "held", "s999"] {
            assert!(sessions.feeds.contains_key(&session(kept.into())), "{kept} was dropped");
        }
        assert!(!sessions.feeds.contains_key(&session("s0".into())), "the oldest idle feed was kept");
        drop((sessions, watched, held));
    }

    /// A shared log in memory, standing for the database in the feeds' own logic: appends
    /// numbered per session, as `keel.events` numbers them.
    #[derive(Default)]
    struct MemoryLog {
        sessions: Mutex<HashMap<SessionId, Vec<LoggedEvent>>>,
    }

    impl MemoryLog {
        fn append_now(&self, events: Vec<NewEvent>) -> Vec<u64> {
            let mut sessions = lock(&self.sessions);
            events
                .into_iter()
                .map(|event| {
                    let log = sessions.entry(event.session).or_default();
                    let seq = log.len() as u64 + 1;
                    log.push(LoggedEvent { seq, run: event.run, body: event.body });
                    seq
                })
                .collect()
        }
    }

    impl EventLog for MemoryLog {
        fn append(
            &self,
            _batch: u64,
            events: Vec<NewEvent>,
        ) -> keel_core::BoxFuture<'static, Result<Option<Vec<u64>>, StoreError>> {
            let seqs = self.append_now(events);
            Box::pin(async move { Ok(Some(seqs)) })
        }

        fn read_after(
            &self,
            session: &SessionId,
            after: u64,
            limit: usize,
        ) -> keel_core::BoxFuture<'static, Result<Vec<LoggedEvent>, StoreError>> {
            let events: Vec<LoggedEvent> = lock(&self.sessions)
                .get(session)
                .map(|log| log.iter().filter(|e| e.seq > after).take(limit).cloned().collect())
                .unwrap_or_default();
            Box::pin(async move { Ok(events) })
        }

        fn read_recent(
            &self,
            session: &SessionId,
            limit: usize,
        ) -> keel_core::BoxFuture<'static, Result<(u64, Vec<LoggedEvent>), StoreError>> {
            let log = lock(&self.sessions).get(session).cloned().unwrap_or_default();
            let recent = log[log.len().saturating_sub(limit)..].to_vec();
            Box::pin(async move { Ok((log.len() as u64, recent)) })
        }

        fn watch(&self, _on_wake: keel_core::event_log::OnWake) -> Result<(), StoreError> {
            Ok(())
        }

        fn prune(&self, _older_than_ms: u64) -> keel_core::BoxFuture<'static, Result<u64, StoreError>> {
            Box::pin(async { Ok(0) })
        }
    }

    fn other_instance_appends(log: &MemoryLog, session: &SessionId, body: &str) {
        let event =
            NewEvent { session: session.clone(), run: RunId::from_suffix("other"), body: Some(body.into()) };
        log.append_now(vec![event]);
    }

    async fn next_body(subscriber: &mut Subscriber) -> String {
        let entry = tokio::time::timeout(Duration::from_secs(5), subscriber.next()).await.unwrap().unwrap();
        match &entry.item {
            Item::Event(json) => format!("{}:{json}", entry.id),
            Item::RunEnded => format!("{}:end", entry.id),
        }
    }

    #[tokio::test]
    async fn with_a_shared_log_a_feed_shows_every_instances_events_in_the_logs_order() {
        let log = Arc::new(MemoryLog::default());
        let feeds = Arc::new(Feeds::new(
            Arc::new(Metrics::new()),
            Some(Arc::clone(&log) as Arc<dyn EventLog>),
            Duration::from_secs(60),
        ));
        let session = SessionId::new("s").unwrap();
        other_instance_appends(&log, &session, "before");
        // A subscriber from now on starts after what the log holds.
        let mut live = feeds.subscribe(&session, None).await.unwrap();
        // Another instance appends, then this one publishes: its event comes after the other's.
        other_instance_appends(&log, &session, "theirs");
        let feed = feeds.feed(&session);
        feeds.publish(&feed, &RunId::from_suffix("mine"), Some("ours".into())).await;
        assert_eq!(next_body(&mut live).await, "2:theirs");
        assert_eq!(next_body(&mut live).await, "3:ours");
        // A wake-up reads what another instance appended since.
        other_instance_appends(&log, &session, "later");
        let mut woken = Woken::default();
        woken.sessions.insert(session.clone());
        feeds.read_woken(woken).await;
        assert_eq!(next_body(&mut live).await, "4:later");
        feeds.publish(&feed, &RunId::from_suffix("mine"), None).await;
        assert_eq!(next_body(&mut live).await, "5:end");
        // A reconnect with Last-Event-ID on a fresh process's feeds resumes exactly.
        let elsewhere = Arc::new(Feeds::new(
            Arc::new(Metrics::new()),
            Some(Arc::clone(&log) as Arc<dyn EventLog>),
            Duration::from_secs(60),
        ));
        let mut resumed = elsewhere.subscribe(&session, Some(2)).await.unwrap();
        assert_eq!(next_body(&mut resumed).await, "3:ours");
        assert_eq!(next_body(&mut resumed).await, "4:later");
    }
}
