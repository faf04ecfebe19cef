//! The in-memory backend: one mutex over plain maps.
//!
//! Operations never await while holding the lock, so a std mutex is right (and faster than an
//! async one). Domain values are kept as they are, without encoding: this store is the
//! baseline the runtime's overhead is measured on. The maps use foldhash: keys come from users,
//! so the hasher is seeded per process (minimally DoS-resistant) yet much cheaper than SipHash.
//! None of the writes the rules make can fail, which is what lets it run them without a
//! rollback (a journal append for a run it does not hold is refused, and the rules never make
//! one).
//!
//! The store is bounded ([`MemoryLimits`]): a session nobody runs, whose last write is older
//! than `max_idle` or that is the least recently written of more than `max_sessions`, is
//! forgotten with everything of it (transcript, runs, journals, decided inputs). A session with
//! an unfinished run (in flight, or paused for a human) is never forgotten. Sessions are kept in
//! the order they were last written (a queue of touches, stale ones skipped as they come to the
//! front), and the bounds are checked after every write, so a process doing a million runs
//! holds at most `max_sessions` of them.

use foldhash::HashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel_core::journal::JournalEntry;
use keel_core::memory::{MemoryItem, MemoryOwner};
use keel_core::{
    BoxFuture, Clock, DecidedInput, DelayedRunRecord, DelayedState, Message, PendingInput, RunId, RunRecord,
    SessionFilter, SessionId, SessionSummary, StepName, StoreError, Usage,
};

use crate::backend::{Backend, Ruled, RunControl, Tx, Work, memory_owner_rows};

#[derive(Default)]
struct SessionData {
    /// The transcript, with the run that wrote each message.
    messages: Vec<(RunId, Arc<Message>)>,
    updated_at_ms: u64,
    /// The session's state object.
    state: Option<serde_json::Value>,
    /// Tokens of the session's journaled model calls.
    usage: Usage,
    /// The session's runs, oldest first.
    runs: Vec<RunId>,
    /// Inputs of its runs that were decided or closed.
    decided: Vec<String>,
    /// The number of its latest entry in [`Inner::recency`].
    touched: u64,
}

struct RunData {
    record: RunRecord,
    control: RunControl,
    /// The run's journal, in write order: kept with the run, so that a step's commit finds both
    /// with one lookup.
    journal: Vec<Arc<JournalEntry>>,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<SessionId, SessionData>,
    runs: HashMap<RunId, RunData>,
    /// Each session's runs that are not finished (usually none or one): what the "one run per
    /// session" check looks at, so that it does not scan every run of the store.
    open_runs: HashMap<SessionId, Vec<RunId>>,
    /// Approvals and questions waiting for a human, by id, with the order they were asked in.
    pending: HashMap<String, (u64, PendingInput)>,
    pending_asked: u64,
    decided: HashMap<String, DecidedInput>,
    /// Each schedule's last fired tick.
    schedules: HashMap<String, u64>,
    /// Delayed runs, by run id.
    delayed: HashMap<RunId, DelayedRunRecord>,
    /// Each owner's memory records, by kind and key.
    memories: HashMap<String, std::collections::BTreeMap<(String, String), MemoryItem>>,
    /// Sessions in the order they were written: (session, touch number, when). An entry whose
    /// number is not its session's latest is stale, and skipped.
    recency: VecDeque<(SessionId, u64, u64)>,
    touches: u64,
    /// The latest time a write carried: what idleness is measured against.
    now_ms: u64,
}

impl Inner {
    /// The session's data, created if needed, marked as written at `now_ms`.
    fn touch(&mut self, session: &SessionId, now_ms: u64) -> &mut SessionData {
        self.touches += 1;
        self.now_ms = self.now_ms.max(now_ms);
        match self.recency.back_mut() {
            // The same session written again (a run's steps one after another): its newest entry
            // moves on, rather than a stale one piling up for the next rebuild to sweep.
            Some(last) if last.0 == *session => {
                last.1 = self.touches;
                last.2 = now_ms;
            }
            _ => self.recency.push_back((session.clone(), self.touches, now_ms)),
        }
        let data = self.sessions.entry(session.clone()).or_default();
        data.touched = self.touches;
        data
    }

    /// Forgets the sessions past `limits`, least recently written first; sessions with an
    /// unfinished run stay (and are looked at again once idle for `max_idle` more).
    fn evict(&mut self, limits: &MemoryLimits) {
        let max_idle = u64::try_from(limits.max_idle.as_millis()).unwrap_or(u64::MAX);
        // Each entry is looked at once per call: a store full of paused sessions cannot spin.
        let mut budget = self.recency.len();
        while budget > 0 {
            let Some(&(_, touch, at_ms)) = self.recency.front() else { break };
            let over = self.sessions.len() > limits.max_sessions;
            let idle = self.now_ms.saturating_sub(at_ms) > max_idle;
            if !over && !idle {
                // Nothing to evict: a stale entry at the front waits for a later pass (or the
                // rebuild below), which spares every write a lookup of the oldest session.
                break;
            }
            let stale = self
                .recency
                .front()
                .is_some_and(|(id, _, _)| self.sessions.get(id).is_none_or(|data| data.touched != touch));
            budget -= 1;
            let Some((session, _, _)) = self.recency.pop_front() else { break };
            if stale {
                continue;
            }
            if self.open_runs.contains_key(&session) {
                // In use: keep it, as if written now.
                let now_ms = self.now_ms;
                self.touch(&session, now_ms);
                continue;
            }
            self.forget(&session);
        }
        // Touches of sessions written again and again pile up as stale entries: rebuild the
        // queue when they outnumber the sessions.
        if self.recency.len() > 2 * self.sessions.len() + 1024 {
            let sessions = &self.sessions;
            self.recency.retain(|(id, touch, _)| sessions.get(id).is_some_and(|data| data.touched == *touch));
        }
    }

    /// Removes a session and everything of it. Returns whether there was anything.
    fn forget(&mut self, session: &SessionId) -> bool {
        let Some(data) = self.sessions.remove(session) else { return false };
        for run in &data.runs {
            self.runs.remove(run);
            self.delayed.remove(run);
        }
        for id in &data.decided {
            self.decided.remove(id);
        }
        self.pending.retain(|_, (_, p)| &p.session_id != session);
        self.open_runs.remove(session);
        true
    }

    fn summary(&self, id: &SessionId, data: &SessionData) -> SessionSummary {
        SessionSummary {
            id: id.clone(),
            messages: data.messages.len() as u64,
            runs: data.runs.len() as u64,
            updated_at_ms: data.updated_at_ms,
            usage: data.usage,
        }
    }

    fn close_open(&mut self, session: &SessionId, run: &RunId) {
        if let Some(open) = self.open_runs.get_mut(session) {
            open.retain(|r| r != run);
            if open.is_empty() {
                self.open_runs.remove(session);
            }
        }
    }
}

impl Tx for Inner {
    fn message_count(&mut self, session: &SessionId) -> Result<u64, StoreError> {
        Ok(self.sessions.get(session).map_or(0, |data| data.messages.len() as u64))
    }

    fn message_writer(&mut self, session: &SessionId, position: u64) -> Result<Option<RunId>, StoreError> {
        Ok(self
            .sessions
            .get(session)
            .and_then(|data| data.messages.get(position as usize))
            .map(|(run, _)| run.clone()))
    }

    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        _first_position: u64,
        messages: &[Arc<Message>],
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let data = self.touch(session, now_ms);
        data.updated_at_ms = now_ms;
        data.messages.extend(messages.iter().map(|message| (run.clone(), Arc::clone(message))));
        Ok(())
    }

    fn messages(&mut self, session: &SessionId) -> Result<Vec<Arc<Message>>, StoreError> {
        Ok(self
            .sessions
            .get(session)
            .map(|data| data.messages.iter().map(|(_, m)| Arc::clone(m)).collect())
            .unwrap_or_default())
    }

    fn add_usage(&mut self, session: &SessionId, usage: Usage, now_ms: u64) -> Result<(), StoreError> {
        let data = self.touch(session, now_ms);
        data.usage.add(usage);
        if data.updated_at_ms == 0 {
            data.updated_at_ms = now_ms;
        }
        Ok(())
    }

    fn set_session_state(
        &mut self,
        session: &SessionId,
        state: &serde_json::Value,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let data = self.touch(session, now_ms);
        data.state = Some(state.clone());
        data.updated_at_ms = now_ms;
        Ok(())
    }

    fn session_state(&mut self, session: &SessionId) -> Result<Option<serde_json::Value>, StoreError> {
        Ok(self.sessions.get(session).and_then(|data| data.state.clone()))
    }

    fn session_summary(&mut self, session: &SessionId) -> Result<Option<SessionSummary>, StoreError> {
        Ok(self.sessions.get(session).map(|data| self.summary(session, data)))
    }

    fn sessions(&mut self, filter: &SessionFilter) -> Result<Vec<SessionSummary>, StoreError> {
        let mut sessions: Vec<SessionSummary> = self
            .sessions
            .iter()
            .filter(|(id, _)| filter.scope.holds(id))
            .map(|(id, data)| self.summary(id, data))
            .collect();
        sessions.sort_by(|a, b| b.updated_at_ms.cmp(&a.updated_at_ms).then_with(|| a.id.cmp(&b.id)));
        sessions.truncate(filter.limit.unwrap_or(usize::MAX));
        Ok(sessions)
    }

    fn delete_session(&mut self, session: &SessionId) -> Result<bool, StoreError> {
        Ok(self.forget(session))
    }

    fn insert_run(
        &mut self,
        record: &RunRecord,
        control: &RunControl,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        if !control.state.is_terminal() {
            self.open_runs.entry(record.session_id.clone()).or_default().push(record.run_id.clone());
        }
        self.touch(&record.session_id, now_ms).runs.push(record.run_id.clone());
        let data = RunData { record: record.clone(), control: control.clone(), journal: Vec::new() };
        self.runs.insert(record.run_id.clone(), data);
        Ok(())
    }

    fn run(&mut self, run: &RunId) -> Result<Option<RunRecord>, StoreError> {
        Ok(self.runs.get(run).map(|data| RunRecord { state: data.control.state, ..data.record.clone() }))
    }

    fn control(&mut self, run: &RunId) -> Result<Option<RunControl>, StoreError> {
        Ok(self.runs.get(run).map(|data| data.control.clone()))
    }

    fn set_control(&mut self, run: &RunId, control: &RunControl, _now_ms: u64) -> Result<(), StoreError> {
        let Some(data) = self.runs.get_mut(run) else { return Ok(()) };
        let ended = control.state.is_terminal() && !data.control.state.is_terminal();
        data.control.clone_from(control);
        if ended {
            let session = control.session.clone();
            self.close_open(&session, run);
        }
        Ok(())
    }

    fn cancel_requested(&mut self, owner: &str) -> Result<Vec<RunId>, StoreError> {
        let mut runs: Vec<RunId> = self
            .open_runs
            .values()
            .flatten()
            .filter(|run| {
                self.runs.get(*run).is_some_and(|data| {
                    data.control.cancel_requested_by.is_some()
                        && data.control.state == keel_core::RunState::Running
                        && data.control.owner.as_deref() == Some(owner)
                })
            })
            .cloned()
            .collect();
        runs.sort();
        Ok(runs)
    }

    fn open_runs(&mut self, session: Option<&SessionId>) -> Result<Vec<(RunId, RunControl)>, StoreError> {
        let ids: Vec<&RunId> = match session {
            Some(session) => {
                self.open_runs.get(session).map(|runs| runs.iter().collect()).unwrap_or_default()
            }
            None => self.open_runs.values().flatten().collect(),
        };
        let mut open: Vec<(RunId, RunControl)> = ids
            .into_iter()
            .filter_map(|id| self.runs.get(id).map(|data| (id.clone(), data.control.clone())))
            .collect();
        // Run ids are time-ordered.
        open.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(open)
    }

    fn has_step(&mut self, run: &RunId, step: &StepName) -> Result<bool, StoreError> {
        Ok(self.runs.get(run).is_some_and(|data| data.journal.iter().any(|e| &e.step == step)))
    }

    fn append_journal(&mut self, run: &RunId, entry: &Arc<JournalEntry>) -> Result<bool, StoreError> {
        // The rules journal only a run they found or created in the same transaction, so this
        // error is never met (a pending input's run is forgotten only with the input).
        let Some(data) = self.runs.get_mut(run) else {
            return Err(StoreError::NotFound(format!("run {run}")));
        };
        if data.journal.iter().any(|existing| existing.step == entry.step) {
            return Ok(false);
        }
        data.journal.push(Arc::clone(entry));
        Ok(true)
    }

    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError> {
        Ok(self
            .runs
            .get(run)
            .map(|data| data.journal.iter().map(|entry| JournalEntry::clone(entry)).collect())
            .unwrap_or_default())
    }

    fn compact_journals(&mut self) -> Result<u64, StoreError> {
        let mut removed = 0;
        for data in self.runs.values_mut().filter(|data| data.control.state.is_terminal()) {
            removed += data.journal.len() as u64;
            data.journal = Vec::new();
        }
        Ok(removed)
    }

    fn pending(&mut self, id: &str) -> Result<Option<PendingInput>, StoreError> {
        Ok(self.pending.get(id).map(|(_, p)| p.clone()))
    }

    fn pending_list(&mut self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, StoreError> {
        let mut pending: Vec<&(u64, PendingInput)> =
            self.pending.values().filter(|(_, p)| session.is_none_or(|s| &p.session_id == s)).collect();
        pending.sort_by_key(|(asked, p)| (p.created_at_ms, *asked));
        Ok(pending.into_iter().map(|(_, p)| p.clone()).collect())
    }

    fn insert_pending(&mut self, pending: &PendingInput) -> Result<(), StoreError> {
        self.pending_asked += 1;
        self.pending.insert(pending.id.clone(), (self.pending_asked, pending.clone()));
        Ok(())
    }

    fn delete_pending(&mut self, id: &str) -> Result<(), StoreError> {
        self.pending.remove(id);
        Ok(())
    }

    fn decided(&mut self, id: &str) -> Result<Option<DecidedInput>, StoreError> {
        Ok(self.decided.get(id).cloned())
    }

    fn insert_decided(&mut self, decided: &DecidedInput) -> Result<(), StoreError> {
        if let Some(data) = self.sessions.get_mut(&decided.session_id) {
            data.decided.push(decided.id.clone());
        }
        self.decided.insert(decided.id.clone(), decided.clone());
        Ok(())
    }

    fn schedule_last_fire(&mut self, name: &str) -> Result<Option<u64>, StoreError> {
        Ok(self.schedules.get(name).copied())
    }

    fn set_schedule_last_fire(&mut self, name: &str, tick_ms: u64) -> Result<(), StoreError> {
        self.schedules.insert(name.to_owned(), tick_ms);
        Ok(())
    }

    fn delayed_run(&mut self, run: &RunId) -> Result<Option<DelayedRunRecord>, StoreError> {
        Ok(self.delayed.get(run).cloned())
    }

    fn put_delayed_run(&mut self, record: &DelayedRunRecord) -> Result<(), StoreError> {
        self.delayed.insert(record.run.run_id.clone(), record.clone());
        Ok(())
    }

    fn due_delayed_runs(&mut self, now_ms: u64, limit: usize) -> Result<Vec<RunId>, StoreError> {
        let mut due: Vec<_> = self
            .delayed
            .values()
            .filter(|r| {
                r.state == DelayedState::Waiting && r.run.due_ms <= now_ms && r.held_until_ms <= now_ms
            })
            .map(|r| (r.run.due_ms, r.run.run_id.clone()))
            .collect();
        due.sort();
        Ok(due.into_iter().take(limit).map(|(_, id)| id).collect())
    }

    fn memory_item(&mut self, owner: &str, kind: &str, key: &str) -> Result<Option<MemoryItem>, StoreError> {
        let found = self.memories.get(owner).and_then(|items| items.get(&(kind.to_owned(), key.to_owned())));
        Ok(found.cloned())
    }

    fn put_memory_item(&mut self, owner: &str, item: &MemoryItem) -> Result<(), StoreError> {
        let items = self.memories.entry(owner.to_owned()).or_default();
        items.insert((item.kind.clone(), item.key.clone()), item.clone());
        Ok(())
    }

    fn memory_items(&mut self, owner: &str, kind: Option<&str>) -> Result<Vec<MemoryItem>, StoreError> {
        let Some(items) = self.memories.get(owner) else { return Ok(Vec::new()) };
        let mut found: Vec<MemoryItem> =
            items.values().filter(|item| kind.is_none_or(|kind| item.kind == kind)).cloned().collect();
        found.sort_by(|a, b| b.updated_ms.cmp(&a.updated_ms).then_with(|| a.key.cmp(&b.key)));
        Ok(found)
    }

    fn delete_memory(
        &mut self,
        owner: &str,
        kind: Option<&str>,
        key: Option<&str>,
    ) -> Result<u64, StoreError> {
        let Some(items) = self.memories.get_mut(owner) else { return Ok(0) };
        let before = items.len();
        items
            .retain(|(k, name), _| !(kind.is_none_or(|kind| k == kind) && key.is_none_or(|key| name == key)));
        let erased = (before - items.len()) as u64;
        if items.is_empty() {
            self.memories.remove(owner);
        }
        Ok(erased)
    }

    fn memory_owners(&mut self) -> Result<Vec<MemoryOwner>, StoreError> {
        // The rows a database would give: (owner, kind, count, last written), by owner and kind.
        let mut rows: Vec<(String, String, u64, u64)> = Vec::new();
        let mut owners: Vec<&String> = self.memories.keys().collect();
        owners.sort();
        for owner in owners {
            for item in self.memories[owner].values() {
                match rows.last_mut() {
                    Some((o, kind, count, at)) if o == owner && *kind == item.kind => {
                        *count += 1;
                        *at = (*at).max(item.updated_ms);
                    }
                    _ => rows.push((owner.clone(), item.kind.clone(), 1, item.updated_ms)),
                }
            }
        }
        Ok(memory_owner_rows(rows.into_iter()))
    }
}

/// How much a memory store keeps (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The most sessions kept: past it, the least recently written idle ones are forgotten.
    pub max_sessions: usize,
    /// How long a session nobody runs is kept after its last write.
    pub max_idle: Duration,
}

impl MemoryLimits {
    /// 10,000 sessions, each kept a day after its last write.
    pub const DEFAULT: MemoryLimits =
        MemoryLimits { max_sessions: 10_000, max_idle: Duration::from_secs(24 * 60 * 60) };

    /// No bound: every session is kept until the process ends (or it is deleted).
    pub const UNBOUNDED: MemoryLimits = MemoryLimits { max_sessions: usize::MAX, max_idle: Duration::MAX };

    /// The defaults, with `KEEL_MEMORY_MAX_SESSIONS` and `KEEL_MEMORY_MAX_IDLE` applied.
    pub fn from_env() -> Result<MemoryLimits, StoreError> {
        use keel_core::env;
        let mut limits = MemoryLimits::DEFAULT;
        if let Some(count) = crate::env_count(&env::MEMORY_MAX_SESSIONS, "a number of sessions, like 10000")?
        {
            limits.max_sessions = count;
        }
        if let Some(idle) = crate::env_duration(&env::MEMORY_MAX_IDLE, "a duration like `24h` or `30m`")? {
            limits.max_idle = idle;
        }
        Ok(limits)
    }
}

impl Default for MemoryLimits {
    fn default() -> MemoryLimits {
        MemoryLimits::DEFAULT
    }
}

/// The memory backend. See the module docs.
#[derive(Default)]
pub struct Memory {
    inner: Mutex<Inner>,
    limits: MemoryLimits,
}

impl Memory {
    /// An empty backend that keeps at most what `limits` allow.
    pub fn with_limits(limits: MemoryLimits) -> Memory {
        Memory { inner: Mutex::default(), limits }
    }

    /// How many sessions it holds.
    pub fn session_count(&self) -> usize {
        self.lock().sessions.len()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that matters
        // more than losing the store, so recover the guard.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs a write, then forgets what the limits no longer allow.
    fn write_now<T>(&self, work: impl FnOnce(&mut dyn Tx) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut inner = self.lock();
        let result = work(&mut *inner);
        inner.evict(&self.limits);
        result
    }
}

impl Backend for Memory {
    fn write<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        let result = self.write_now(work);
        Box::pin(std::future::ready(result))
    }

    fn read<T: Send + 'static>(&self, mut work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        let result = work(&mut *self.lock());
        Box::pin(std::future::ready(result))
    }

    fn write_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Ok(self.write_now(work))
    }

    fn read_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Ok(work(&mut *self.lock()))
    }
}

/// A store in process memory: nothing survives the process.
pub type MemoryStore = Ruled<Memory>;

impl Ruled<Memory> {
    /// An empty store on the system clock, with the default [`MemoryLimits`].
    pub fn new() -> MemoryStore {
        MemoryStore::with_clock(keel_core::clock::system())
    }

    /// An empty store reading time from `clock`, with the default [`MemoryLimits`].
    pub fn with_clock(clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore::with_limits(MemoryLimits::DEFAULT, clock)
    }

    /// An empty store that keeps at most what `limits` allow, reading time from `clock`.
    pub fn with_limits(limits: MemoryLimits, clock: Arc<dyn Clock>) -> MemoryStore {
        Ruled::with_backend(Memory::with_limits(limits), clock)
    }
}

impl Default for Ruled<Memory> {
    fn default() -> MemoryStore {
        MemoryStore::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::conformance::{create_run, run_record};
    use keel_core::{ManualClock, RunState, StepCommit, Store};

    /// A finished run of `session` with one message, after what the session has.
    async fn finished_run(store: &MemoryStore, run: &str, session: &SessionId) {
        let first_position = store.session_summary(session).await.unwrap().map_or(0, |s| s.messages);
        let record = run_record(run, session, 0);
        create_run(store, &record).await.expect("the run is created");
        let message = [Arc::new(Message::user("hi"))];
        store
            .commit_step(StepCommit {
                first_position,
                messages: &message,
                state: Some(RunState::Done),
                ..StepCommit::new(session, &record.run_id)
            })
            .await
            .expect("the run finishes");
    }

    fn session(name: &str) -> SessionId {
        SessionId::new(name).expect("a valid id")
    }

    #[tokio::test]
    async fn past_its_session_bound_the_least_recently_written_idle_sessions_go() {
        let clock = ManualClock::starting_now();
        let limits = MemoryLimits { max_sessions: 3, max_idle: Duration::from_secs(3600) };
        let store = MemoryStore::with_limits(limits, Arc::new(clock.clone()));
        // A run paused for a human (unfinished) in the oldest session: never forgotten.
        let paused = session("paused");
        create_run(&store, &run_record("p", &paused, 0)).await.expect("created");
        for i in 0..10 {
            finished_run(&store, &format!("r{i}"), &session(&format!("s{i}"))).await;
        }
        assert_eq!(store.backend().session_count(), 3, "the bound holds");
        // The paused session and the two most recently written are what is left.
        for (name, kept) in [("paused", true), ("s9", true), ("s8", true), ("s7", false), ("s0", false)] {
            let summary = store.session_summary(&session(name)).await.expect("reads");
            assert_eq!(summary.is_some(), kept, "{name} kept: {kept}");
        }
        let gone = RunId::from_suffix("r0");
        assert!(store.load_run(&gone).await.expect("reads").is_none(), "a forgotten session's runs go too");
        assert!(store.load_journal(&gone).await.expect("reads").is_empty());
        assert!(store.load_run(&RunId::from_suffix("p")).await.expect("reads").is_some());
        // Writing to an old session makes it the most recent one.
        finished_run(&store, "again", &session("s8")).await;
        finished_run(&store, "r10", &session("s10")).await;
        assert!(store.session_summary(&session("s8")).await.expect("reads").is_some());
        assert!(store.session_summary(&session("s9")).await.expect("reads").is_none());
        assert_eq!(store.session_summary(&session("s8")).await.unwrap().unwrap().runs, 2);
    }

    #[tokio::test]
    async fn an_idle_session_goes_after_max_idle_and_a_busy_one_stays() {
        let clock = ManualClock::starting_now();
        let limits = MemoryLimits { max_sessions: 1000, max_idle: Duration::from_secs(60) };
        let store = MemoryStore::with_limits(limits, Arc::new(clock.clone()));
        finished_run(&store, "old", &session("old")).await;
        let busy = session("busy");
        create_run(&store, &run_record("busy", &busy, 0)).await.expect("created");
        clock.advance(Duration::from_secs(61));
        // The next write notices the time.
        finished_run(&store, "new", &session("new")).await;
        assert!(store.session_summary(&session("old")).await.expect("reads").is_none());
        assert!(store.session_summary(&session("new")).await.expect("reads").is_some());
        assert!(
            store.load_run(&RunId::from_suffix("busy")).await.expect("reads").is_some(),
            "unfinished runs stay"
        );
        // Thousands of writes to one session leave the queue the size of the sessions, not of the
        // writes.
        for i in 0..5_000 {
            finished_run(&store, &format!("n{i}"), &session("new")).await;
        }
        assert!(store.backend().lock().recency.len() < 2 * 3 + 1024 + 8);
    }

    #[tokio::test]
    async fn memory_store_conforms() {
        let clock = keel_core::ManualClock::starting_now();
        crate::conformance::run_all(&MemoryStore::with_clock(Arc::new(clock.clone())), &clock).await;
    }
}
