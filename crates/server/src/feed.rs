//! Live session events: each session's recent events with their SSE ids, broadcast to every
//! observer.
//!
//! Every event a run of this process emits is published to its session's [`Feed`] with an id
//! from one process-wide counter (seeded with the clock, so ids keep growing across restarts).
//! A subscriber takes the feed's recent events after its `Last-Event-ID` and the live ones after
//! that, both under the feed's lock: no gap, no duplicate. Each subscriber reads from a bounded
//! broadcast channel; one that falls too far behind is cut (it reconnects with `Last-Event-ID`)
//! instead of slowing the run or the other subscribers down.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use futures::StreamExt;
use keel_core::wire::event_to_json;
use keel_core::{Event, RunFailure, RunId, SessionId};
use keel_runtime::{RunHandle, RunResult};
use tokio::sync::broadcast;

use crate::metrics::Metrics;

/// How many recent events a session keeps for reconnecting subscribers.
pub(crate) const RECENT_EVENTS: usize = 1024;

/// How many events a subscriber may fall behind before it is cut.
const SUBSCRIBER_BUFFER: usize = 1024;

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
    sessions: Mutex<HashMap<SessionId, Arc<Feed>>>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
}

impl Feeds {
    pub(crate) fn new(metrics: Arc<Metrics>) -> Feeds {
        // Seeded with the clock (microseconds): a client's Last-Event-ID from before a restart is
        // older than every id this process hands out.
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Feeds { sessions: Mutex::default(), next_id: AtomicU64::new(start), metrics }
    }

    /// The session's feed, created on first use.
    pub(crate) fn feed(&self, session: &SessionId) -> Arc<Feed> {
        let mut sessions = lock(&self.sessions);
        let feed = sessions.entry(session.clone()).or_insert_with(|| {
            let (sender, _) = broadcast::channel(SUBSCRIBER_BUFFER);
            Arc::new(Feed {
                state: Mutex::new(FeedState { recent: VecDeque::new(), runs: 0, last_used: Instant::now() }),
                sender,
            })
        });
        Arc::clone(feed)
    }

    /// Drops the feeds nobody watches, with no run publishing, unused for `idle`: a server's
    /// memory stays flat however many sessions it has served.
    pub(crate) fn sweep(&self, idle: Duration) -> usize {
        let mut sessions = lock(&self.sessions);
        let before = sessions.len();
        sessions.retain(|_, feed| {
            let state = lock(&feed.state);
            state.runs > 0 || feed.sender.receiver_count() > 0 || state.last_used.elapsed() < idle
        });
        before - sessions.len()
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
        &self,
        feed: Arc<Feed>,
        mut handle: RunHandle,
        first: Option<Event>,
    ) -> Result<RunResult, RunFailure> {
        let run = handle.run_id().clone();
        let started = Instant::now();
        self.metrics.run_started();
        if let Some(event) = first {
            self.metrics.event(&event);
            feed.publish(&self.next_id, &run, Item::Event(event_json(&event)));
        }
        while let Some(event) = handle.next().await {
            self.metrics.event(&event);
            feed.publish(&self.next_id, &run, Item::Event(event_json(&event)));
        }
        feed.publish(&self.next_id, &run, Item::RunEnded);
        lock(&feed.state).runs -= 1;
        let result = handle.result().await;
        let outcome = match &result {
            Ok(result) => result.stopped.as_str(),
            Err(_) => "failed",
        };
        self.metrics.run_ended(outcome, started.elapsed());
        result
    }
}

fn event_json(event: &Event) -> Arc<str> {
    event_to_json(event).into()
}

/// One session's recent events and live broadcast.
pub(crate) struct Feed {
    state: Mutex<FeedState>,
    sender: broadcast::Sender<Arc<Entry>>,
}

struct FeedState {
    recent: VecDeque<Arc<Entry>>,
    /// Runs publishing to this feed now.
    runs: usize,
    last_used: Instant,
}

impl Feed {
    fn publish(&self, ids: &AtomicU64, run: &RunId, item: Item) {
        let mut state = lock(&self.state);
        // The id is taken under the lock, so the order of ids is the order of publication.
        let entry = Arc::new(Entry { id: ids.fetch_add(1, Ordering::Relaxed), run: run.clone(), item });
        if state.recent.len() == RECENT_EVENTS {
            state.recent.pop_front();
        }
        state.recent.push_back(Arc::clone(&entry));
        state.last_used = Instant::now();
        // No subscriber is fine: the entry stays in `recent`.
        let _ = self.sender.send(entry);
    }

    /// Subscribes: the recent entries after `after` (none when `None`), then a receiver of every
    /// later one.
    pub(crate) fn subscribe(&self, after: Option<u64>) -> (Vec<Arc<Entry>>, broadcast::Receiver<Arc<Entry>>) {
        let mut state = lock(&self.state);
        state.last_used = Instant::now();
        let backlog = match after {
            Some(after) => state.recent.iter().filter(|e| e.id > after).cloned().collect(),
            None => Vec::new(),
        };
        (backlog, self.sender.subscribe())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
