//! The in-memory store: one mutex over plain maps.
//!
//! Operations never await while holding the lock, so a std mutex is right (and faster than an
//! async one). Domain values are kept as they are, without encoding: this store is the
//! baseline the runtime's overhead is measured on. The maps use foldhash: keys come from users,
//! so the hasher is seeded per process (minimally DoS-resistant) yet much cheaper than SipHash.

use foldhash::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel_core::journal::JournalEntry;
use keel_core::journal::JournalRecord;
use keel_core::{
    BoxFuture, Decision, Message, PendingInput, RunId, RunRecord, RunState, SessionId, SessionSummary,
    StepCommit, Store, StoreError, Usage,
};

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

/// Who drives a run, until when, at which epoch.
struct LeaseState {
    owner: String,
    expires_ms: u64,
    epoch: u64,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<SessionId, SessionData>,
    leases: HashMap<RunId, LeaseState>,
    /// Each schedule's last fired tick.
    schedules: HashMap<String, u64>,
    runs: HashMap<RunId, RunRecord>,
    /// Each session's runs that are not finished (usually none or one): what the "one run per
    /// session" check looks at, so that it does not scan every run of the store.
    open_runs: HashMap<SessionId, Vec<RunId>>,
    journals: HashMap<RunId, Vec<JournalEntry>>,
    /// Approvals and questions waiting for a human, by id, with the order they were asked in.
    pending: HashMap<String, (u64, PendingInput)>,
    pending_asked: u64,
}

impl Inner {
    /// Checks that appending `messages` at `first_position` is a valid (possibly repeated) append.
    fn check_messages(
        &self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
    ) -> Result<(), StoreError> {
        let list = self.sessions.get(session).map_or(&[][..], |data| &data.messages[..]);
        for offset in 0..messages.len() {
            let position = first_position as usize + offset;
            match list.get(position) {
                Some((writer, _)) if writer == run => {}
                Some((writer, _)) => {
                    return Err(StoreError::Conflict(format!(
                        "position {position} of session {session} was written by {writer}, not {run}"
                    )));
                }
                None if position <= list.len() + offset => {}
                None => {
                    return Err(StoreError::Conflict(format!(
                        "position {position} of session {session} is past its end ({})",
                        list.len()
                    )));
                }
            }
        }
        Ok(())
    }

    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
    ) -> Result<(), StoreError> {
        self.check_messages(session, run, first_position, messages)?;
        let data = self.sessions.entry(session.clone()).or_default();
        data.updated_at_ms = crate::now_ms();
        for (offset, message) in messages.iter().enumerate() {
            if first_position as usize + offset == data.messages.len() {
                data.messages.push((run.clone(), Arc::clone(message)));
            }
        }
        Ok(())
    }

    /// A run of `session` in flight under a live lease, or paused for a human.
    fn live_run(&self, session: &SessionId) -> Option<&RunRecord> {
        let now = crate::now_ms();
        self.open_runs.get(session)?.iter().filter_map(|run| self.runs.get(run)).find(|r| {
            r.state == RunState::AwaitingInput
                || self.leases.get(&r.run_id).is_some_and(|l| l.expires_ms > now)
        })
    }

    fn has_step(&self, run: &RunId, step: &keel_core::StepName) -> bool {
        self.journals.get(run).is_some_and(|journal| journal.iter().any(|e| &e.step == step))
    }

    /// Records a journal entry; the first record of a step wins. Returns whether it was new.
    fn append_journal(&mut self, run: &RunId, entry: &JournalEntry) -> bool {
        let journal = self.journals.entry(run.clone()).or_default();
        if journal.iter().any(|existing| existing.step == entry.step) {
            return false;
        }
        journal.push(entry.clone());
        true
    }

    fn summary(&self, id: &SessionId, data: &SessionData) -> SessionSummary {
        SessionSummary {
            id: id.clone(),
            messages: data.messages.len() as u64,
            runs: self.runs.values().filter(|r| &r.session_id == id).count() as u64,
            updated_at_ms: data.updated_at_ms,
            usage: data.usage,
        }
    }
}

/// A store in process memory.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that matters
        // more than losing the store, so recover the guard.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn ready<'a, T: Send + 'a>(value: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

impl Store for MemoryStore {
    fn load_messages<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Vec<Arc<Message>>, StoreError>> {
        let inner = self.lock();
        let messages = inner
            .sessions
            .get(session)
            .map(|data| data.messages.iter().map(|(_, m)| Arc::clone(m)).collect())
            .unwrap_or_default();
        ready(Ok(messages))
    }

    fn commit_step<'a>(&'a self, commit: StepCommit<'a>) -> BoxFuture<'a, Result<(), StoreError>> {
        let mut inner = self.lock();
        // Check everything first, so that a failed commit changes nothing.
        let result = inner
            .check_messages(commit.session, commit.run, commit.first_position, commit.messages)
            .and_then(|()| match commit.new_run {
                Some(run) if inner.runs.contains_key(&run.run_id) => {
                    Err(StoreError::Conflict(format!("run {} already exists", run.run_id)))
                }
                Some(run) => match inner.live_run(&run.session_id) {
                    Some(other) => Err(crate::busy_error(&run.session_id, &other.run_id, other.state)),
                    None => Ok(()),
                },
                None if commit.state.is_some() && !inner.runs.contains_key(commit.run) => {
                    Err(StoreError::NotFound(format!("run {}", commit.run)))
                }
                None => Ok(()),
            })
            .and_then(|()| match (commit.fence, commit.new_run) {
                (Some(fence), None) => match inner.leases.get(commit.run) {
                    Some(lease) if lease.owner == fence.owner && lease.epoch == fence.epoch => Ok(()),
                    _ => Err(StoreError::LeaseLost(format!(
                        "run {} is no longer leased to {} at epoch {}",
                        commit.run, fence.owner, fence.epoch
                    ))),
                },
                _ => Ok(()),
            })
            .and_then(|()| {
                if let Some(run) = commit.new_run {
                    inner.runs.insert(run.run_id.clone(), run.clone());
                    if !run.state.is_terminal() {
                        inner.open_runs.entry(run.session_id.clone()).or_default().push(run.run_id.clone());
                    }
                }
                if let Some(fence) = commit.fence {
                    let expires_ms = crate::now_ms().saturating_add(fence.ttl.as_millis() as u64);
                    match inner.leases.get_mut(commit.run) {
                        // The usual case: extend the lease held, without allocating.
                        Some(lease) if lease.owner == fence.owner && lease.epoch == fence.epoch => {
                            lease.expires_ms = expires_ms;
                        }
                        _ => {
                            let lease =
                                LeaseState { owner: fence.owner.to_owned(), expires_ms, epoch: fence.epoch };
                            inner.leases.insert(commit.run.clone(), lease);
                        }
                    }
                }
                if let Some(entry) = commit.entry
                    && inner.append_journal(commit.run, entry)
                    && let JournalRecord::ModelReply(reply) = &entry.record
                {
                    inner.sessions.entry(commit.session.clone()).or_default().usage.add(reply.usage);
                }
                inner.append_messages(commit.session, commit.run, commit.first_position, commit.messages)?;
                if let Some(state) = commit.session_state {
                    let data = inner.sessions.entry(commit.session.clone()).or_default();
                    data.state = Some(state.clone());
                    data.updated_at_ms = crate::now_ms();
                }
                for pending in commit.pending {
                    if !inner.pending.contains_key(&pending.id)
                        && !inner.has_step(commit.run, &pending.step())
                    {
                        inner.pending_asked += 1;
                        let asked = inner.pending_asked;
                        inner.pending.insert(pending.id.clone(), (asked, pending.clone()));
                    }
                }
                if let Some(state) = commit.state
                    && let Some(record) = inner.runs.get_mut(commit.run)
                {
                    record.state = state;
                    let session = record.session_id.clone();
                    if state != RunState::Running
                        && let Some(lease) = inner.leases.get_mut(commit.run)
                    {
                        lease.expires_ms = 0;
                    }
                    if state.is_terminal() {
                        if let Some(open) = inner.open_runs.get_mut(&session) {
                            open.retain(|run| run != commit.run);
                            if open.is_empty() {
                                inner.open_runs.remove(&session);
                            }
                        }
                    }
                    if state.is_terminal() && !inner.pending.is_empty() {
                        inner.pending.retain(|_, (_, p)| &p.run_id != commit.run);
                    }
                }
                Ok(())
            });
        ready(result)
    }

    fn load_session_state<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, StoreError>> {
        ready(Ok(self.lock().sessions.get(session).and_then(|data| data.state.clone())))
    }

    fn load_run<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Option<RunRecord>, StoreError>> {
        ready(Ok(self.lock().runs.get(run).cloned()))
    }

    fn load_journal<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Vec<JournalEntry>, StoreError>> {
        ready(Ok(self.lock().journals.get(run).cloned().unwrap_or_default()))
    }

    fn claim_run<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let mut inner = self.lock();
        let result = match inner.runs.get(run) {
            None => Err(StoreError::NotFound(format!("run {run}"))),
            Some(record) if record.state.is_terminal() => Ok(None),
            Some(_) => {
                let now = crate::now_ms();
                let free = inner.leases.get(run).is_none_or(|l| l.expires_ms <= now || l.owner == owner);
                if free {
                    let epoch = inner.leases.get(run).map_or(0, |l| l.epoch) + 1;
                    let expires_ms = now.saturating_add(ttl.as_millis() as u64);
                    inner
                        .leases
                        .insert(run.clone(), LeaseState { owner: owner.to_owned(), expires_ms, epoch });
                    Ok(Some(epoch))
                } else {
                    Ok(None)
                }
            }
        };
        ready(result)
    }

    fn renew_lease<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        epoch: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let mut inner = self.lock();
        let renewed = match inner.leases.get_mut(run) {
            Some(lease) if lease.owner == owner && lease.epoch == epoch => {
                lease.expires_ms = crate::now_ms().saturating_add(ttl.as_millis() as u64);
                true
            }
            _ => false,
        };
        ready(Ok(renewed))
    }

    fn interrupted_runs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<RunId>, StoreError>> {
        let inner = self.lock();
        let now = crate::now_ms();
        let mut runs: Vec<RunId> = inner
            .runs
            .values()
            .filter(|r| r.state == RunState::Running)
            .filter(|r| session.is_none_or(|s| &r.session_id == s))
            .filter(|r| inner.leases.get(&r.run_id).is_none_or(|l| l.expires_ms <= now))
            .map(|r| r.run_id.clone())
            .collect();
        // Run ids are time-ordered.
        runs.sort();
        ready(Ok(runs))
    }

    fn pending_inputs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<PendingInput>, StoreError>> {
        let inner = self.lock();
        let mut pending: Vec<&(u64, PendingInput)> =
            inner.pending.values().filter(|(_, p)| session.is_none_or(|s| &p.session_id == s)).collect();
        pending.sort_by_key(|(asked, p)| (p.created_at_ms, *asked));
        ready(Ok(pending.into_iter().map(|(_, p)| p.clone()).collect()))
    }

    fn pending_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<PendingInput>, StoreError>> {
        ready(Ok(self.lock().pending.get(id).map(|(_, p)| p.clone())))
    }

    fn decide<'a>(
        &'a self,
        id: &'a str,
        decision: &'a Decision,
    ) -> BoxFuture<'a, Result<PendingInput, StoreError>> {
        let mut inner = self.lock();
        let Some((_, pending)) = inner.pending.remove(id) else {
            return ready(Err(StoreError::not_pending(id)));
        };
        let entry = JournalEntry { step: pending.step(), record: JournalRecord::Decision(decision.clone()) };
        let _ = inner.append_journal(&pending.run_id, &entry);
        if let Some(record) = inner.runs.get_mut(&pending.run_id)
            && record.state == RunState::AwaitingInput
        {
            record.state = RunState::Running;
            if let Some(lease) = inner.leases.get_mut(&pending.run_id) {
                lease.expires_ms = 0;
            }
        }
        ready(Ok(pending))
    }

    fn claim_schedule_tick<'a>(
        &'a self,
        name: &'a str,
        tick_ms: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let mut inner = self.lock();
        let last = inner.schedules.entry(name.to_owned()).or_insert(0);
        let claimed = *last < tick_ms;
        if claimed {
            *last = tick_ms;
        }
        ready(Ok(claimed))
    }

    fn schedule_last_fire<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        ready(Ok(self.lock().schedules.get(name).copied().filter(|&tick| tick > 0)))
    }

    fn compact_journals(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        let mut inner = self.lock();
        let Inner { runs, journals, .. } = &mut *inner;
        let mut removed = 0;
        for (run, journal) in journals.iter_mut() {
            if runs.get(run).is_some_and(|r| r.state.is_terminal()) {
                removed += journal.len() as u64;
                journal.clear();
            }
        }
        journals.retain(|_, journal| !journal.is_empty());
        ready(Ok(removed))
    }

    fn list_sessions(&self) -> BoxFuture<'_, Result<Vec<SessionSummary>, StoreError>> {
        let inner = self.lock();
        let mut sessions: Vec<SessionSummary> =
            inner.sessions.iter().map(|(id, data)| inner.summary(id, data)).collect();
        sessions.sort_by(|a, b| b.updated_at_ms.cmp(&a.updated_at_ms).then_with(|| a.id.cmp(&b.id)));
        ready(Ok(sessions))
    }

    fn session_summary<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<SessionSummary>, StoreError>> {
        let inner = self.lock();
        ready(Ok(inner.sessions.get(session).map(|data| inner.summary(session, data))))
    }

    fn delete_session<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<bool, StoreError>> {
        let mut inner = self.lock();
        let existed = inner.sessions.remove(session).is_some();
        let runs: Vec<RunId> =
            inner.runs.values().filter(|r| &r.session_id == session).map(|r| r.run_id.clone()).collect();
        for run in &runs {
            inner.runs.remove(run);
            inner.journals.remove(run);
            inner.leases.remove(run);
        }
        inner.pending.retain(|_, (_, p)| &p.session_id != session);
        inner.open_runs.remove(session);
        ready(Ok(existed || !runs.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_conforms() {
        crate::conformance::run_all(&MemoryStore::new()).await;
    }
}
