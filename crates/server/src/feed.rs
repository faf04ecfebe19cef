//! Live session events: each session's recent events with their SSE ids, broadcast to every
//! observer.
//!
//! Every event a run of this process emits is published to its session's [`Feed`] with an id
//! from one process-wide counter (seeded with the clock, so ids keep growing across restarts).
//! A subscriber reads the feed's recent events after its `Last-Event-ID`, then waits for new
//! ones: one cursor over one ordered ring, so no gap and no duplicate. The ring is bounded; a
//! subscriber that falls behind its end is cut (it reconnects with `Last-Event-ID`) instead of
//! slowing the run or the other subscribers down.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use futures::StreamExt;
use keel_core::wire::event_to_json;
use keel_core::{Event, RunFailure, RunId, SessionId};
use keel_runtime::{RunHandle, RunResult};

use crate::metrics::Metrics;

/// How many recent events a session keeps for reconnecting subscribers: a few turns' worth.
/// Kept small because every active session holds them (the memory of a busy server).
pub(crate) const RECENT_EVENTS: usize = 256;

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
        let feed = sessions.entry(session.clone()).or_insert_with(|| Arc::new(Feed::new()));
        Arc::clone(feed)
    }

    /// Drops the feeds nobody watches, with no run publishing, unused for `idle`: a server's
    /// memory stays flat however many sessions it has served.
    pub(crate) fn sweep(&self, idle: Duration) -> usize {
        let mut sessions = lock(&self.sessions);
        let before = sessions.len();
        sessions.retain(|_, feed| {
            let state = lock(&feed.state);
            state.runs > 0 || state.subscribers > 0 || state.last_used.elapsed() < idle
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

/// One session's recent events, which are also its broadcast: a subscriber keeps a cursor (the
/// last id it sent) and waits for the next entry; one whose next entry was already evicted from
/// the ring fell too far behind and is cut. No per-subscriber or per-session channel is
/// allocated, so an idle stream or a quiet session costs almost nothing.
pub(crate) struct Feed {
    state: Mutex<FeedState>,
    published: tokio::sync::Notify,
}

struct FeedState {
    recent: VecDeque<Arc<Entry>>,
    /// The id of the newest entry evicted from `recent` (0: none).
    evicted_up_to: u64,
    /// Runs publishing to this feed now.
    runs: usize,
    /// Subscribers reading it now.
    subscribers: usize,
    last_used: Instant,
}

impl Feed {
    fn new() -> Feed {
        Feed {
            state: Mutex::new(FeedState {
                recent: VecDeque::new(),
                evicted_up_to: 0,
                runs: 0,
                subscribers: 0,
                last_used: Instant::now(),
            }),
            published: tokio::sync::Notify::new(),
        }
    }

    fn publish(&self, ids: &AtomicU64, run: &RunId, item: Item) {
        {
            let mut state = lock(&self.state);
            // The id is taken under the lock, so the order of ids is the order of publication.
            let entry = Arc::new(Entry { id: ids.fetch_add(1, Ordering::Relaxed), run: run.clone(), item });
            if state.recent.len() == RECENT_EVENTS
                && let Some(evicted) = state.recent.pop_front()
            {
                state.evicted_up_to = evicted.id;
            }
            state.recent.push_back(entry);
            state.last_used = Instant::now();
        }
        self.published.notify_waiters();
    }

    /// Subscribes after `after` (the client's `Last-Event-ID`: the recent entries after it come
    /// first), or, with `None`, from now on.
    pub(crate) fn subscribe(self: &Arc<Self>, after: Option<u64>) -> Subscriber {
        let mut state = lock(&self.state);
        state.last_used = Instant::now();
        state.subscribers += 1;
        let cursor = match after {
            // Entries older than the ring are gone: start with the oldest kept.
            Some(after) => after.max(state.evicted_up_to),
            None => state.recent.back().map_or(state.evicted_up_to, |e| e.id),
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

/// A reader of a feed: the entries after its cursor, as they come.
pub(crate) struct Subscriber {
    feed: Arc<Feed>,
    cursor: u64,
}

impl Subscriber {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(feed: &Feed, ids: &AtomicU64, count: usize) {
        let run = RunId::from_suffix("r");
        for _ in 0..count {
            feed.publish(ids, &run, Item::Event("{}".into()));
        }
    }

    #[tokio::test]
    async fn subscribers_resume_after_their_last_id_and_a_slow_one_is_cut() {
        let ids = AtomicU64::new(1);
        let feed = Arc::new(Feed::new());
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
}
