//! The in-memory backend: one mutex over plain maps.
//!
//! Operations never await while holding the lock, so a std mutex is right (and faster than an
//! async one). Domain values are kept as they are, without encoding: this store is the
//! baseline the runtime's overhead is measured on. The maps use foldhash: keys come from users,
//! so the hasher is seeded per process (minimally DoS-resistant) yet much cheaper than SipHash.
//! None of its writes can fail, which is what lets it run the rules without a rollback.

use foldhash::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

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
}

struct RunData {
    record: RunRecord,
    control: RunControl,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<SessionId, SessionData>,
    runs: HashMap<RunId, RunData>,
    /// How many runs each session had.
    run_counts: HashMap<SessionId, u64>,
    /// Each session's runs that are not finished (usually none or one): what the "one run per
    /// session" check looks at, so that it does not scan every run of the store.
    open_runs: HashMap<SessionId, Vec<RunId>>,
    journals: HashMap<RunId, Vec<JournalEntry>>,
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
}

impl Inner {
    fn summary(&self, id: &SessionId, data: &SessionData) -> SessionSummary {
        SessionSummary {
            id: id.clone(),
            messages: data.messages.len() as u64,
            runs: self.run_counts.get(id).copied().unwrap_or(0),
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
        let data = self.sessions.entry(session.clone()).or_default();
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
        let data = self.sessions.entry(session.clone()).or_default();
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
        let data = self.sessions.entry(session.clone()).or_default();
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
        let existed = self.sessions.remove(session).is_some();
        let runs: Vec<RunId> = self
            .runs
            .iter()
            .filter(|(_, data)| &data.record.session_id == session)
            .map(|(id, _)| id.clone())
            .collect();
        for run in &runs {
            self.runs.remove(run);
            self.journals.remove(run);
        }
        self.pending.retain(|_, (_, p)| &p.session_id != session);
        self.decided.retain(|_, d| &d.session_id != session);
        self.open_runs.remove(session);
        self.run_counts.remove(session);
        Ok(existed || !runs.is_empty())
    }

    fn insert_run(
        &mut self,
        record: &RunRecord,
        control: &RunControl,
        _now_ms: u64,
    ) -> Result<(), StoreError> {
        if !control.state.is_terminal() {
            self.open_runs.entry(record.session_id.clone()).or_default().push(record.run_id.clone());
        }
        *self.run_counts.entry(record.session_id.clone()).or_default() += 1;
        self.runs.insert(record.run_id.clone(), RunData { record: record.clone(), control: control.clone() });
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
        Ok(self.journals.get(run).is_some_and(|journal| journal.iter().any(|e| &e.step == step)))
    }

    fn append_journal(&mut self, run: &RunId, entry: &JournalEntry) -> Result<bool, StoreError> {
        let journal = self.journals.entry(run.clone()).or_default();
        if journal.iter().any(|existing| existing.step == entry.step) {
            return Ok(false);
        }
        journal.push(entry.clone());
        Ok(true)
    }

    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError> {
        Ok(self.journals.get(run).cloned().unwrap_or_default())
    }

    fn compact_journals(&mut self) -> Result<u64, StoreError> {
        let Inner { runs, journals, .. } = self;
        let mut removed = 0;
        journals.retain(|run, journal| {
            let finished = runs.get(run).is_some_and(|r| r.control.state.is_terminal());
            if finished {
                removed += journal.len() as u64;
            }
            !finished && !journal.is_empty()
        });
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

/// The memory backend. See the module docs.
#[derive(Default)]
pub struct Memory {
    inner: Mutex<Inner>,
}

impl Memory {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that matters
        // more than losing the store, so recover the guard.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Backend for Memory {
    fn write<T: Send + 'static>(&self, mut work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        let result = work(&mut *self.lock());
        Box::pin(std::future::ready(result))
    }

    fn read<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        self.write(work)
    }

    fn write_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Ok(work(&mut *self.lock()))
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
    /// An empty store on the system clock.
    pub fn new() -> MemoryStore {
        MemoryStore::with_clock(keel_core::clock::system())
    }

    /// An empty store reading time from `clock`.
    pub fn with_clock(clock: Arc<dyn Clock>) -> MemoryStore {
        Ruled::with_backend(Memory::default(), clock)
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

    #[tokio::test]
    async fn memory_store_conforms() {
        let clock = keel_core::ManualClock::starting_now();
        crate::conformance::run_all(&MemoryStore::with_clock(Arc::new(clock.clone())), &clock).await;
    }
}
