//! The [`Store`] trait: where sessions, runs and journals live.
//!
//! Backends live in `keel-store` (memory now; SQLite and PostgreSQL join the same conformance
//! suite). Every write is idempotent so that a re-driven run can repeat it safely.

use std::sync::Arc;

use crate::BoxFuture;
use crate::error::ErrorCode;
use crate::human::{Decision, PendingInput};
use crate::ids::{RunId, SessionId};
use crate::journal::JournalEntry;
use crate::message::Message;

/// The state of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunState {
    /// In flight (or interrupted, waiting to be re-driven).
    Running,
    /// Paused for a human (approval or question).
    AwaitingInput,
    /// Finished.
    Done,
    /// Failed with an error.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl RunState {
    /// The persisted name.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::AwaitingInput => "awaiting_input",
            RunState::Done => "done",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    /// Whether the run is over.
    pub fn is_terminal(self) -> bool {
        matches!(self, RunState::Done | RunState::Failed | RunState::Cancelled)
    }
}

/// What a store keeps about a run: enough to re-drive it from its journal.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// The user's input message.
    pub input: Message,
    /// How many session messages came before the run (its input sits at this position).
    pub history_len: u64,
    /// How many model calls the session made before the run.
    pub call_base: u64,
    /// Where the run is.
    pub state: RunState,
}

/// A store failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A write would contradict what is stored (another run wrote that message position).
    #[error("store conflict: {0}")]
    Conflict(String),
    /// The record does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// Stored data could not be decoded.
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
    /// The backend failed (I/O, connection).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// Another process holds the database's lock for longer than the busy timeout.
    #[error("the store is locked by another process: {0}")]
    Locked(String),
    /// The database cannot be written.
    #[error("the store is read-only: {0}")]
    ReadOnly(String),
    /// The writer's lease on the run is gone (expired and claimed by another owner).
    #[error("lease lost: {0}")]
    LeaseLost(String),
    /// The session has another run in flight (with a live lease), perhaps in another process.
    #[error("{0}")]
    Busy(String),
    /// The approval or question is not pending (unknown id, already decided, or its run ended).
    #[error("{0}")]
    NotPending(String),
    /// The database was written by a newer keel.
    #[error(
        "the store's schema version {found} is newer than this keel supports ({supported}); upgrade keel"
    )]
    NewerSchema {
        /// The version in the database.
        found: i64,
        /// The newest version this build knows.
        supported: i64,
    },
}

impl StoreError {
    /// The error for a decision on `id`, which is not pending.
    pub fn not_pending(id: &str) -> StoreError {
        StoreError::NotPending(format!(
            "{id} is not pending: it was decided already, its run ended, or no approval or question has \
             this id (`keel approvals list` shows what is pending)"
        ))
    }

    /// The stable code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::Corrupt(_) => ErrorCode::StoreCorrupt,
            StoreError::Locked(_) => ErrorCode::StoreLocked,
            StoreError::ReadOnly(_) => ErrorCode::StoreReadOnly,
            StoreError::NewerSchema { .. } => ErrorCode::StoreSchemaNewer,
            StoreError::LeaseLost(_) => ErrorCode::LeaseLost,
            StoreError::Busy(_) => ErrorCode::SessionBusy,
            StoreError::NotPending(_) => ErrorCode::NotPending,
            StoreError::Conflict(_) | StoreError::NotFound(_) | StoreError::Unavailable(_) => {
                ErrorCode::Store
            }
        }
    }
}

/// A session, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionSummary {
    /// The session.
    pub id: SessionId,
    /// How many messages its transcript has.
    pub messages: u64,
    /// How many runs it had.
    pub runs: u64,
    /// When it was last written, in milliseconds since the Unix epoch.
    pub updated_at_ms: u64,
    /// Tokens used by every model call of the session, summed as their steps were journaled
    /// (a replayed step is not counted again).
    pub usage: crate::event::Usage,
}

/// What one step of a run writes: its journal entry (when the step produced a fresh result),
/// the messages it appended, and the run's new state (when the run ended). Written atomically by
/// [`Store::commit_step`].
#[derive(Clone, Copy, Debug)]
pub struct StepCommit<'a> {
    /// The session.
    pub session: &'a SessionId,
    /// The run.
    pub run: &'a RunId,
    /// The run's record, when this is its first step and the run is not stored yet (a new run is
    /// created with its first messages, in the same commit). Refused with [`StoreError::Busy`]
    /// while another run of the session is in flight with a live lease: one session runs one
    /// turn at a time, across processes too.
    pub new_run: Option<&'a RunRecord>,
    /// The step's journal entry, if it is new.
    pub entry: Option<&'a JournalEntry>,
    /// The session position of the first message.
    pub first_position: u64,
    /// The messages to append (idempotently, as [`Store::append_messages`]).
    pub messages: &'a [Arc<Message>],
    /// The run's new state, if it changes. Leaving `running` (pausing or ending) releases the
    /// lease; ending also drops the run's pending inputs.
    pub state: Option<RunState>,
    /// The session's new state object, written by the step's tool call (see
    /// `tool::SessionState`).
    pub session_state: Option<&'a serde_json::Value>,
    /// Inputs the run now waits for (with a pause): stored unless already stored or decided
    /// (a decision journaled for their step), so a repeated pause never re-asks.
    pub pending: &'a [PendingInput],
    /// The writer's lease: the commit is refused ([`StoreError::LeaseLost`]) unless the run's lease
    /// still has this owner and epoch. A new run is created holding it.
    pub fence: Option<Fence<'a>>,
}

/// Who may write a run: the owner of its lease, at an epoch. Every claim bumps the epoch, so a
/// writer that stalled past its lease's expiry cannot commit over the new owner's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence<'a> {
    /// The lease holder (one per process or engine).
    pub owner: &'a str,
    /// The epoch of the claim.
    pub epoch: u64,
    /// How long the lease lasts from now (a new run's lease, or an extension with the commit).
    pub ttl: std::time::Duration,
}

/// Persistence for sessions, runs and journals.
pub trait Store: Send + Sync {
    /// The session's whole transcript, in order (empty for a new session).
    ///
    /// Messages are immutable once stored, so they are shared (`Arc`): a backend that keeps them
    /// in memory hands out references instead of copies.
    fn load_messages<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Vec<Arc<Message>>, StoreError>>;

    /// The session's state object (`None` when no tool ever set one).
    fn load_session_state<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, StoreError>>;

    /// Reads a run.
    fn load_run<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Option<RunRecord>, StoreError>>;

    /// The run's journal, in the order it was written.
    fn load_journal<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Vec<JournalEntry>, StoreError>>;

    /// Writes one step atomically, all of it or nothing: the new run (its id must be new), the
    /// journal entry (the first record of a step wins; a repeat is ignored), the messages at
    /// session positions `first_position..` (idempotent: a position already written by the same
    /// run is skipped; one written by another run, or a gap, is a [`StoreError::Conflict`]) and the
    /// state change. With a [`Fence`], nothing is written unless the lease still matches, and the
    /// lease is extended. This is the only way runs, messages and journals are written.
    fn commit_step<'a>(&'a self, commit: StepCommit<'a>) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Claims a run's lease for `owner`, for `ttl` from now, when the run is not finished and its
    /// lease is free, expired, or already `owner`'s. Returns the new epoch, or `None` when another
    /// owner holds a live lease. Fails with [`StoreError::NotFound`] for an unknown run.
    fn claim_run<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, StoreError>>;

    /// Extends a held lease by `ttl` from now. Returns `false` when the lease is no longer this
    /// owner's at this epoch.
    fn renew_lease<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        epoch: u64,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// The approvals and questions waiting for a human: all of them, or `session`'s; oldest
    /// first.
    fn pending_inputs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<PendingInput>, StoreError>>;

    /// The pending input `id`, if it is pending.
    fn pending_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<PendingInput>, StoreError>>;

    /// Records a human's decision, atomically: the pending input `id` is removed, the decision
    /// is journaled as its step, and a run paused in `awaiting_input` becomes `running` with an
    /// expired lease (so any process may re-drive it; [`Store::interrupted_runs`] lists it).
    /// Fails with [`StoreError::NotPending`] when `id` is not pending (never pending, decided
    /// already, or its run ended): a second decision changes nothing.
    fn decide<'a>(
        &'a self,
        id: &'a str,
        decision: &'a Decision,
    ) -> BoxFuture<'a, Result<PendingInput, StoreError>>;

    /// Runs still `running` whose lease has expired (their process died or stalled, or a
    /// decision arrived for a paused run): the runs to re-drive. Only `session`'s when given;
    /// oldest first.
    fn interrupted_runs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<RunId>, StoreError>>;

    /// Compacts the journals of finished runs (done, failed, cancelled) to what their
    /// transcripts need: nothing, as the messages hold the results. Returns how many journal
    /// entries were removed. A compacted run can no longer be replayed step by step.
    fn compact_journals(&self) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Records that schedule `name` fires for the tick at `tick_ms` (milliseconds since the Unix
    /// epoch), unless that tick (or a later one) was already recorded. Returns whether this call
    /// recorded it: of several processes sharing a store, exactly one fires each tick.
    fn claim_schedule_tick<'a>(
        &'a self,
        name: &'a str,
        tick_ms: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// The last tick schedule `name` fired for, if any.
    fn schedule_last_fire<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>>;

    /// One session's summary; `None` when the store has no such session.
    fn session_summary<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<SessionSummary>, StoreError>>;

    /// Every session, most recently written first.
    fn list_sessions(&self) -> BoxFuture<'_, Result<Vec<SessionSummary>, StoreError>>;

    /// Deletes a session with its messages, runs and journals. Returns whether it existed.
    fn delete_session<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<bool, StoreError>>;
}
