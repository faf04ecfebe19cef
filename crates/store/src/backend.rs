//! The seam between keel's store rules and where data lives.
//!
//! A backend implements storage operations only ([`Tx`]: read this row, write that one) and a way
//! to run a batch of them as one transaction ([`Backend`]). It decides nothing: whether a session
//! is busy, whether a lease still fences a writer, whether a decision may be taken, is decided by
//! [`crate::rules`] on top of any backend, and [`Ruled`] puts the two together into a
//! [`keel_core::Store`]. A new backend (PostgreSQL) is a new [`Tx`], run by the same conformance
//! suite; it cannot get the rules wrong because it never sees them.

use std::sync::Arc;

use keel_core::journal::JournalEntry;
use keel_core::memory::{MemoryItem, MemoryOwner};
use keel_core::{
    BoxFuture, Clock, DecidedInput, DelayedRunRecord, DelayedState, Message, PendingInput, RunId, RunRecord,
    RunState, SessionFilter, SessionId, SessionSummary, StepName, StoreError, StoreFuture, Usage,
};

/// What a backend keeps about a run besides its [`RunRecord`]: where it is, who drives it, and
/// whether someone asked it to stop. Read and written whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunControl {
    /// The run's session.
    pub session: SessionId,
    /// Where the run is.
    pub state: RunState,
    /// Who holds (or last held) its lease.
    pub owner: Option<Arc<str>>,
    /// Until when, in milliseconds since the Unix epoch (0: released).
    pub lease_expires_ms: u64,
    /// Bumped by every claim: a commit names the epoch it was claimed at.
    pub epoch: u64,
    /// Claims since the run last committed a step.
    pub attempts: u32,
    /// Who asked to cancel the run, if someone did.
    pub cancel_requested_by: Option<String>,
}

/// Storage operations, inside one transaction (or one consistent read). Every method reads or
/// writes exactly what it says; none checks a rule. Writes are only called after the rules'
/// checks passed, so a backend without rollback (memory) stays consistent as long as its writes
/// cannot fail.
pub trait Tx {
    /// How many messages the session has (0 for an unknown session).
    fn message_count(&mut self, session: &SessionId) -> Result<u64, StoreError>;
    /// The run that wrote the message at `position`, if there is one.
    fn message_writer(&mut self, session: &SessionId, position: u64) -> Result<Option<RunId>, StoreError>;
    /// Appends messages at the end of the session (`first_position` is its message count). A
    /// backend makes a new session here or in [`Tx::insert_run`], which the commit that starts
    /// the session's first run calls first (SQLite's makes it there).
    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
        now_ms: u64,
    ) -> Result<(), StoreError>;
    /// The whole transcript.
    fn messages(&mut self, session: &SessionId) -> Result<Vec<Arc<Message>>, StoreError>;
    /// Adds a model call's tokens to the session's totals, creating the session if needed.
    fn add_usage(&mut self, session: &SessionId, usage: Usage, now_ms: u64) -> Result<(), StoreError>;
    /// Replaces the session's state object, creating the session if needed.
    fn set_session_state(
        &mut self,
        session: &SessionId,
        state: &serde_json::Value,
        now_ms: u64,
    ) -> Result<(), StoreError>;
    /// The session's state object.
    fn session_state(&mut self, session: &SessionId) -> Result<Option<serde_json::Value>, StoreError>;
    /// One session's summary.
    fn session_summary(&mut self, session: &SessionId) -> Result<Option<SessionSummary>, StoreError>;
    /// The sessions `filter` names, most recently written first.
    fn sessions(&mut self, filter: &SessionFilter) -> Result<Vec<SessionSummary>, StoreError>;
    /// Deletes the session and everything of it: messages, runs, journals, pending and decided
    /// inputs. Returns whether there was anything.
    fn delete_session(&mut self, session: &SessionId) -> Result<bool, StoreError>;

    /// Stores a new run (and, in a backend that makes sessions there, its session if new: see
    /// [`Tx::append_messages`]).
    fn insert_run(&mut self, record: &RunRecord, control: &RunControl, now_ms: u64)
    -> Result<(), StoreError>;
    /// A run's record (its state as in its control).
    fn run(&mut self, run: &RunId) -> Result<Option<RunRecord>, StoreError>;
    /// A run's control.
    fn control(&mut self, run: &RunId) -> Result<Option<RunControl>, StoreError>;
    /// Replaces a run's control.
    fn set_control(&mut self, run: &RunId, control: &RunControl, now_ms: u64) -> Result<(), StoreError>;
    /// The running runs leased to `owner` whose cancellation was requested.
    fn cancel_requested(&mut self, owner: &str) -> Result<Vec<RunId>, StoreError>;
    /// The runs not finished: all, or `session`'s; oldest first (run ids are time-ordered).
    fn open_runs(&mut self, session: Option<&SessionId>) -> Result<Vec<(RunId, RunControl)>, StoreError>;

    /// Whether the run's journal has a record for `step`.
    fn has_step(&mut self, run: &RunId, step: &StepName) -> Result<bool, StoreError>;
    /// Appends a record unless the step has one already (the first record of a step wins).
    /// Returns whether it appended.
    fn append_journal(&mut self, run: &RunId, entry: &Arc<JournalEntry>) -> Result<bool, StoreError>;
    /// The run's journal, in write order.
    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError>;
    /// Drops the journals of finished runs; returns how many records went.
    fn compact_journals(&mut self) -> Result<u64, StoreError>;

    /// A pending input.
    fn pending(&mut self, id: &str) -> Result<Option<PendingInput>, StoreError>;
    /// The pending inputs, all or `session`'s, oldest first (ties: the order they were stored).
    fn pending_list(&mut self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, StoreError>;
    /// Stores a pending input (the caller checked that its id is free).
    fn insert_pending(&mut self, pending: &PendingInput) -> Result<(), StoreError>;
    /// Removes a pending input.
    fn delete_pending(&mut self, id: &str) -> Result<(), StoreError>;
    /// What became of an input that is no longer pending.
    fn decided(&mut self, id: &str) -> Result<Option<DecidedInput>, StoreError>;
    /// Remembers what became of an input (replacing what was remembered).
    fn insert_decided(&mut self, decided: &DecidedInput) -> Result<(), StoreError>;

    /// The last tick a schedule fired for.
    fn schedule_last_fire(&mut self, name: &str) -> Result<Option<u64>, StoreError>;
    /// Records a schedule's last tick.
    fn set_schedule_last_fire(&mut self, name: &str, tick_ms: u64) -> Result<(), StoreError>;

    /// A delayed run (in a write, locked until the commit: the rules decide on it).
    fn delayed_run(&mut self, run: &RunId) -> Result<Option<DelayedRunRecord>, StoreError>;
    /// Stores a delayed run, inserting it or replacing it.
    fn put_delayed_run(&mut self, record: &DelayedRunRecord) -> Result<(), StoreError>;
    /// The waiting delayed runs due at `now_ms` and not held then, earliest due first, at most
    /// `limit`.
    fn due_delayed_runs(&mut self, now_ms: u64, limit: usize) -> Result<Vec<RunId>, StoreError>;

    /// One record of an owner's memory.
    fn memory_item(&mut self, owner: &str, kind: &str, key: &str) -> Result<Option<MemoryItem>, StoreError>;
    /// Writes (inserts or replaces) one record of an owner's memory.
    fn put_memory_item(&mut self, owner: &str, item: &MemoryItem) -> Result<(), StoreError>;
    /// An owner's records (of `kind`, or all), most recently written first (then by key).
    fn memory_items(&mut self, owner: &str, kind: Option<&str>) -> Result<Vec<MemoryItem>, StoreError>;
    /// Deletes an owner's records: all, of one kind, or one. Returns how many.
    fn delete_memory(
        &mut self,
        owner: &str,
        kind: Option<&str>,
        key: Option<&str>,
    ) -> Result<u64, StoreError>;
    /// Every owner with memory, with counts by kind.
    fn memory_owners(&mut self) -> Result<Vec<MemoryOwner>, StoreError>;
}

/// The persisted name of a delayed run's state, read back.
pub(crate) fn stored_delayed_state(name: &str) -> Result<DelayedState, StoreError> {
    DelayedState::parse(name)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown delayed run state {name:?}")))
}

/// Work done inside a transaction. `FnMut`: a backend whose transactions can fail for reasons
/// that do not depend on their content (PostgreSQL's serialization failures) runs it again.
pub type Work<T> = Box<dyn FnMut(&mut dyn Tx) -> Result<T, StoreError> + Send>;

/// What a step's commit is about, known before its work runs: the session, the run, and the
/// journal step it records. A backend that runs many commits in one transaction locks and reads
/// what they need together (see [`Backend::write_commit`]).
#[derive(Clone, Debug)]
pub struct CommitSubject {
    /// The commit's session.
    pub session: SessionId,
    /// The run it commits a step of (or creates).
    pub run: RunId,
    /// The journal step it records, if any.
    pub step: Option<StepName>,
}

/// What a new run of a session starts from (see [`Backend::read_session`]).
#[derive(Clone, Debug)]
pub struct SessionRows {
    /// The whole transcript.
    pub messages: Vec<Arc<Message>>,
    /// The state object.
    pub state: Option<serde_json::Value>,
    /// Its first unfinished run (oldest first, as [`Tx::open_runs`]).
    pub open_run: Option<(RunId, RunControl)>,
}

/// Reads [`SessionRows`] through storage operations.
pub(crate) fn session_rows(tx: &mut dyn Tx, session: &SessionId) -> Result<SessionRows, StoreError> {
    Ok(SessionRows {
        messages: tx.messages(session)?,
        state: tx.session_state(session)?,
        open_run: tx.open_runs(Some(session))?.into_iter().next(),
    })
}

/// Where data lives: runs [`Work`] as one transaction.
pub trait Backend: Send + Sync + 'static {
    /// Runs `work` as one write transaction: all of its writes or none. Work that fails leaves
    /// nothing behind. The work owns its data: it may run on another thread (a writer that
    /// batches commits).
    fn write<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>>;

    /// [`Backend::write`] for a step's commit, whose `subject` is known before it runs. A
    /// backend may run it in one transaction with other commits (each refused or applied on its
    /// own: the rules refuse before they write); the default runs it alone.
    fn write_commit<T: Send + 'static>(
        &self,
        subject: CommitSubject,
        work: Work<T>,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let _ = subject;
        self.write(work)
    }

    /// Runs `work` as one read: it sees every write whose call has returned, and writes nothing.
    fn read<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>>;

    /// Runs write `work` here and now, in the caller's thread, when this backend can do that
    /// without waiting on I/O (it keeps its data in memory). The rules then borrow the caller's
    /// data instead of copying it for [`Backend::write`]. Gives `work` back when it cannot
    /// (the default).
    fn write_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Err(work)
    }

    /// Reads what a new run of `session` starts from, in one consistent snapshot: every run
    /// reads it once. By default one read of three storage operations; a backend may read it
    /// at once.
    fn read_session(&self, session: SessionId) -> StoreFuture<'static, Result<SessionRows, StoreError>> {
        let work = move |tx: &mut dyn Tx| session_rows(tx, &session);
        match self.read_here(work) {
            Ok(result) => StoreFuture::ready(result),
            Err(work) => self.read(Box::new(work)).into(),
        }
    }

    /// The event log of a backend that many processes share (see [`keel_core::EventLog`]).
    fn event_log(&self) -> Option<Arc<dyn keel_core::EventLog>> {
        None
    }

    /// [`Backend::write_here`] for reads: a backend whose reads do not wait on another thread
    /// runs them here. Gives `work` back when it cannot (the default).
    fn read_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Err(work)
    }
}

/// A backend under keel's store rules: the [`keel_core::Store`] every backend becomes.
pub struct Ruled<B> {
    pub(crate) backend: B,
    pub(crate) clock: Arc<dyn Clock>,
}

impl<B: Backend> Ruled<B> {
    /// `backend` under the rules, reading time from `clock`.
    pub fn with_backend(backend: B, clock: Arc<dyn Clock>) -> Ruled<B> {
        Ruled { backend, clock }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
}

/// Stored data that does not decode: `KEEL_STORE_CORRUPT`.
/// A count as SQL stores it (a signed 64-bit integer), saturating.
pub(crate) fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) fn corrupt(error: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(error.to_string())
}

/// A stored run id.
pub(crate) fn stored_run_id(id: &str) -> Result<RunId, StoreError> {
    RunId::parse(id).ok_or_else(|| corrupt(format!("bad run id {id:?}")))
}

/// A run's own limits as stored: `None` (SQL NULL) for the agent's.
pub(crate) fn stored_limits(record: &RunRecord) -> Option<String> {
    (!record.limits.is_empty()).then(|| keel_core::persist::encode_overrides(&record.limits))
}

/// A run's own limits from what [`stored_limits`] wrote.
pub(crate) fn read_limits(stored: Option<&str>) -> Result<keel_core::LimitOverrides, StoreError> {
    stored.map_or(Ok(keel_core::LimitOverrides::default()), |json| {
        keel_core::persist::decode_overrides(json).map_err(corrupt)
    })
}

/// A memory record from its stored columns.
pub(crate) fn memory_item(
    kind: String,
    key: String,
    value: &str,
    updated_ms: i64,
) -> Result<MemoryItem, StoreError> {
    let value =
        serde_json::from_str(value).map_err(|e| corrupt(format!("memory record {kind}/{key}: {e}")))?;
    Ok(MemoryItem { kind, key, value, updated_ms: updated_ms.max(0) as u64 })
}

/// Owners with their counts by kind, from `(owner, kind, count, last written)` rows sorted by
/// owner: most recently written first.
pub(crate) fn memory_owner_rows(rows: impl Iterator<Item = (String, String, u64, u64)>) -> Vec<MemoryOwner> {
    let mut owners: Vec<MemoryOwner> = Vec::new();
    for (owner, kind, count, at) in rows {
        match owners.last_mut() {
            Some(last) if last.owner == owner => {
                last.counts.push((kind, count));
                last.updated_ms = last.updated_ms.max(at);
            }
            _ => owners.push(MemoryOwner { owner, counts: vec![(kind, count)], updated_ms: at }),
        }
    }
    owners.sort_by(|a, b| b.updated_ms.cmp(&a.updated_ms).then_with(|| a.owner.cmp(&b.owner)));
    owners
}

/// A stored run state.
pub(crate) fn stored_state(name: &str) -> Result<RunState, StoreError> {
    RunState::parse(name).ok_or_else(|| corrupt(format!("unknown run state {name:?}")))
}

/// A [`SessionScope`] as the parameters of the SQL stores' session listing: its kind (0 any, 1
/// unscoped, 2 one owner's) and, for an owner's, the prefix of its ids (else empty).
pub(crate) fn scope_parameters(scope: &keel_core::SessionScope) -> (i32, String) {
    match scope {
        keel_core::SessionScope::Any => (0, String::new()),
        keel_core::SessionScope::Unscoped => (1, String::new()),
        keel_core::SessionScope::Scoped(_) => (2, scope.prefix().unwrap_or_default()),
    }
}
