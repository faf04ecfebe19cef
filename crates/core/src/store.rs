//! The [`Store`] trait: where sessions, runs and journals live, and the values it speaks in.
//!
//! `keel-store` implements it once, over backends that only know storage operations (memory,
//! SQLite; PostgreSQL joins the same conformance suite): the rules every write obeys (one run
//! per session, lease fencing, a decision taken once, a finished run drops what it waited for,
//! a run that never gets past a step is poisoned) live there, above the backends. Every write is
//! idempotent so that a re-driven run can repeat it safely.

use std::sync::Arc;

use crate::BoxFuture;
use crate::error::ErrorCode;
use crate::human::{Decision, PendingInput};
use crate::ids::{RunId, SessionId};
use crate::journal::JournalEntry;
use crate::memory::{MemoryItem, MemoryOwner, MemoryWrite};
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
    /// Every state, in the order a run can reach them.
    pub const ALL: [RunState; 5] =
        [RunState::Running, RunState::AwaitingInput, RunState::Done, RunState::Failed, RunState::Cancelled];

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

    /// The state a persisted name ([`RunState::as_str`]) stands for.
    pub fn parse(name: &str) -> Option<RunState> {
        RunState::ALL.into_iter().find(|state| state.as_str() == name)
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
    /// The user's input message (shared with the transcript the run appends it to).
    pub input: Arc<Message>,
    /// How many session messages came before the run (its input sits at this position).
    pub history_len: u64,
    /// How many model calls the session made before the run.
    pub call_base: u64,
    /// Where the run is.
    pub state: RunState,
    /// The run's own limits and budgets, where they differ from the agent's (kept so that a
    /// re-driven run keeps them).
    pub limits: crate::agent::LimitOverrides,
}

/// A run that starts later: a delayed run (`POST /runs`, `keel run --after`) or a schedule's
/// fire. Stored before it starts, it starts once, whichever process takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedRun {
    /// The run it becomes ([`RunId::delayed`]).
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// Its input.
    pub input: Message,
    /// When it is due, in milliseconds since the Unix epoch.
    pub due_ms: u64,
    /// Who asked for it: `POST /runs`, `keel run --after`, `schedule <agent>/<name>`.
    pub source: String,
}

/// Where a delayed run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DelayedState {
    /// Not started yet: it can be cancelled.
    Waiting,
    /// Its run was created (see the run for how it went).
    Started,
    /// Cancelled before it started.
    Cancelled,
}

impl DelayedState {
    /// The persisted name.
    pub fn as_str(self) -> &'static str {
        match self {
            DelayedState::Waiting => "waiting",
            DelayedState::Started => "started",
            DelayedState::Cancelled => "cancelled",
        }
    }

    /// The state a persisted name stands for.
    pub fn parse(name: &str) -> Option<DelayedState> {
        [DelayedState::Waiting, DelayedState::Started, DelayedState::Cancelled]
            .into_iter()
            .find(|state| state.as_str() == name)
    }
}

/// A delayed run as stored: what it runs, and where it is.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedRunRecord {
    /// The run to start.
    pub run: DelayedRun,
    /// Where it is.
    pub state: DelayedState,
    /// When it was stored, in milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// No process takes it before this time (one took it, or its session was busy).
    pub held_until_ms: u64,
    /// How many times a process took it to start it.
    pub attempts: u32,
    /// Why its last start did not happen (its session was busy...), or who cancelled it.
    pub note: Option<String>,
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
    /// Stored data could not be decoded (or is not a keel database's).
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
    /// The error for a decision on `id`, which is not pending and never was (as far as the store
    /// remembers: see [`DecidedInput`] for the ones that were).
    pub fn not_pending(id: &str) -> StoreError {
        StoreError::NotPending(format!(
            "{id} is not pending: no approval or question waits under this id (`keel approvals list` \
             shows what is pending)"
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

/// Which sessions [`Store::list_sessions`] lists: those of one owner scope, or all; at most
/// `limit` of them, most recently written first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionFilter {
    /// The owner scope.
    pub scope: SessionScope,
    /// At most this many (`None`: all).
    pub limit: Option<usize>,
}

/// An owner scope of sessions (see [`crate::SessionId::scoped`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SessionScope {
    /// Every session.
    #[default]
    Any,
    /// The sessions no owner scope holds: those named without per-user auth.
    Unscoped,
    /// The sessions of one owner scope (a JWT subject's digest).
    Scoped(String),
}

impl SessionScope {
    /// Whether `session` is in this scope.
    pub fn holds(&self, session: &crate::SessionId) -> bool {
        let scope = session.as_str().split_once(crate::SessionId::SCOPE_SEPARATOR).map(|(scope, _)| scope);
        match self {
            SessionScope::Any => true,
            SessionScope::Unscoped => scope.is_none(),
            SessionScope::Scoped(wanted) => scope == Some(wanted.as_str()),
        }
    }

    /// The prefix every id of a scoped scope starts with (`<scope>~`).
    pub fn prefix(&self) -> Option<String> {
        match self {
            SessionScope::Scoped(scope) => Some(format!("{scope}{}", crate::SessionId::SCOPE_SEPARATOR)),
            _ => None,
        }
    }
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
    /// The step's journal entry, if it is new. Shared: a store that keeps entries in memory
    /// keeps this one without copying it.
    pub entry: Option<&'a Arc<JournalEntry>>,
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
    /// (a decision journaled for their step), so a repeated pause never re-asks; never for a
    /// run whose cancellation was requested.
    pub pending: &'a [PendingInput],
    /// The writer's lease: the commit is refused ([`StoreError::LeaseLost`]) unless the run's lease
    /// still has this owner and epoch. A new run is created holding it.
    pub fence: Option<Fence<'a>>,
}

impl<'a> StepCommit<'a> {
    /// A commit of `run` that writes nothing yet, to fill in with struct update syntax.
    pub fn new(session: &'a SessionId, run: &'a RunId) -> StepCommit<'a> {
        StepCommit {
            session,
            run,
            new_run: None,
            entry: None,
            first_position: 0,
            messages: &[],
            state: None,
            session_state: None,
            pending: &[],
            fence: None,
        }
    }
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

/// How many times a run may be re-driven without committing a step before it is poisoned: the
/// runtime then ends it (its open calls get error results, the run fails with
/// `KEEL_RUN_POISONED`) instead of running the step that keeps killing its process again.
pub const MAX_REDRIVES: u32 = 3;

/// The store's own last resort: a run claimed this many times without progress (the runtime's
/// attempts to end it cleanly crashed too) is marked failed by the claim itself.
pub const MAX_CLAIMS_WITHOUT_PROGRESS: u32 = MAX_REDRIVES + 2;

/// What [`Store::commit_step`] tells the writer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// Someone asked (maybe from another process) to cancel the run: stop at once.
    pub cancel_requested: bool,
}

/// The outcome of [`Store::claim_run`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The caller drives the run now, writing under this epoch.
    Claimed {
        /// The new epoch: every claim bumps it, fencing the previous owner.
        epoch: u64,
        /// How many times the run was claimed since it last committed a step, this claim
        /// included: above [`MAX_REDRIVES`], the run keeps dying at the same step.
        attempt: u32,
        /// Someone asked to cancel the run: drive it only to its cancellation.
        cancel_requested: bool,
    },
    /// Another owner holds a live lease.
    Held {
        /// Who.
        owner: String,
        /// Until when (milliseconds since the Unix epoch), unless it renews it.
        expires_ms: u64,
    },
    /// The run is over (done, failed, cancelled): there is nothing to drive, only to replay.
    Finished,
    /// The run was claimed [`MAX_CLAIMS_WITHOUT_PROGRESS`] times without committing anything: the
    /// store marked it failed (`KEEL_RUN_POISONED`).
    Poisoned,
}

/// The outcome of [`Store::renew_lease`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Still the caller's, extended.
    Held {
        /// Someone asked to cancel the run.
        cancel_requested: bool,
    },
    /// Another owner claimed it (or the run ended): the caller must stop writing.
    Lost,
}

/// A run that is not finished, with its lease: what recovery, busy checks and `keel cancel`
/// look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenRun {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// `Running` or `AwaitingInput`.
    pub state: RunState,
    /// Who holds (or last held) its lease.
    pub owner: Option<String>,
    /// Until when, in milliseconds since the Unix epoch (0: released).
    pub lease_expires_ms: u64,
    /// Who asked to cancel it, if someone did.
    pub cancel_requested_by: Option<String>,
    /// Claims since it last committed a step.
    pub attempts: u32,
}

impl OpenRun {
    /// Whether an owner holds it at `now_ms` (a paused run is held by nobody: humans move it on).
    pub fn is_leased(&self, now_ms: u64) -> bool {
        self.state == RunState::Running && self.owner.is_some() && self.lease_expires_ms > now_ms
    }

    /// Whether it waits to be re-driven at `now_ms`: running with no live lease (its process
    /// died or stopped, or a decision or a cancellation just arrived for it).
    pub fn is_interrupted(&self, now_ms: u64) -> bool {
        self.state == RunState::Running && !self.is_leased(now_ms)
    }

    /// Why a new run of its session is refused while this one is unfinished, for people.
    pub fn busy_message(&self, now_ms: u64) -> String {
        let session = self.session_id.external();
        let run = &self.run_id;
        let cancel = format!("`keel cancel {session}`");
        match (self.state, &self.owner) {
            (RunState::AwaitingInput, _) => format!(
                "session {session} has a run waiting for a human ({run}); decide its pending approvals or \
                 questions first (`keel approvals list`), or cancel it ({cancel})"
            ),
            (_, Some(owner)) if self.is_leased(now_ms) => format!(
                "session {session} already has a run in flight ({run}), driven by {}; wait for it to \
                 finish, or cancel it ({cancel}). If that process is gone and this machine cannot tell \
                 (another host), its lease lets another process take the run over {}",
                crate::owner::describe(owner),
                crate::clock::relative(self.lease_expires_ms, now_ms),
            ),
            _ => format!(
                "session {session} has an unfinished run ({run}) whose process stopped; it must be resumed \
                 first (`keel run <agent> --session {session}` does that), or cancelled ({cancel})"
            ),
        }
    }
}

/// What became of an approval or question that is no longer pending: kept so that a late
/// decision can be told who decided first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecidedInput {
    /// The approval or question id.
    pub id: String,
    /// Its run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// What happened to it: `approved`, `rejected`, `answered`, `timed out`, `cancelled`, or
    /// `closed` (its run ended without it).
    pub outcome: String,
    /// Who: `keel approvals (pid 42 on host h)`, `HTTP API (...)`, `approvals.timeout`...
    pub by: String,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
}

impl DecidedInput {
    /// Why a decision on it is refused, for people.
    pub fn refusal(&self, now_ms: u64) -> String {
        let when = crate::clock::relative(self.at_ms, now_ms);
        if self.outcome == "closed" {
            format!(
                "{} is not pending: its run {} ended without it ({when}, {})",
                self.id, self.run_id, self.by
            )
        } else {
            format!(
                "{} is not pending: it was {} {when} by {}; run {} of session {} went on with that decision",
                self.id,
                self.outcome,
                self.by,
                self.run_id,
                self.session_id.external()
            )
        }
    }
}

/// The outcome word of a decision, as [`DecidedInput::outcome`] records it.
pub fn decision_outcome(decision: &Decision) -> &'static str {
    match decision {
        Decision::Approve { .. } => "approved",
        Decision::Reject { .. } => "rejected",
        Decision::Answer(_) => "answered",
        Decision::TimedOut => "timed out",
    }
}

/// A session as a new run starts from it, read at once: its transcript, its state object, and
/// its unfinished run, if it has one.
#[derive(Clone, Debug, Default)]
pub struct SessionSnapshot {
    /// The whole transcript.
    pub messages: Vec<Arc<Message>>,
    /// The state object (`None` when no tool ever set one).
    pub state: Option<serde_json::Value>,
    /// The session's unfinished run.
    pub open_run: Option<OpenRun>,
}

/// What the calls every run makes ([`Store::commit_step`], [`Store::load_session`]) return: the
/// answer itself when the store gave it in the caller's thread (a store in memory does), else a
/// boxed future for a store that waits on I/O. A run commits at every step, and a boxed future
/// for an answer already in hand would cost an allocation each time.
pub enum StoreFuture<'a, T> {
    /// Answered at once.
    Ready(std::future::Ready<T>),
    /// To be awaited.
    Boxed(BoxFuture<'a, T>),
}

impl<'a, T> StoreFuture<'a, T> {
    /// An answer in hand.
    pub fn ready(value: T) -> StoreFuture<'a, T> {
        StoreFuture::Ready(std::future::ready(value))
    }
}

impl<'a, T> From<BoxFuture<'a, T>> for StoreFuture<'a, T> {
    fn from(future: BoxFuture<'a, T>) -> StoreFuture<'a, T> {
        StoreFuture::Boxed(future)
    }
}

impl<T> std::future::Future for StoreFuture<'_, T> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        // Both variants are `Unpin` (a `Ready`, a pinned box), and so is the enum.
        match self.get_mut() {
            StoreFuture::Ready(ready) => std::pin::Pin::new(ready).poll(cx),
            StoreFuture::Boxed(future) => future.as_mut().poll(cx),
        }
    }
}

/// Persistence for sessions, runs and journals.
///
/// Implemented once, in `keel-store`, over storage backends; the runtime, the server and the CLI
/// only ever see this trait.
pub trait Store: Send + Sync {
    /// The session's whole transcript, in order (empty for a new session).
    ///
    /// Messages are immutable once stored, so they are shared (`Arc`): a backend that keeps them
    /// in memory hands out references instead of copies.
    fn load_messages<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Vec<Arc<Message>>, StoreError>>;

    /// The session's transcript, state object and unfinished run, in one consistent read: what
    /// a new run starts from.
    fn load_session<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> StoreFuture<'a, Result<SessionSnapshot, StoreError>>;

    /// The session's state object (`None` when no tool ever set one).
    fn load_session_state<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, StoreError>>;

    /// Reads a run.
    fn load_run<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Option<RunRecord>, StoreError>>;

    /// The run's journal, in the order it was written.
    fn load_journal<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Vec<JournalEntry>, StoreError>>;

    /// Writes one step atomically, all of it or nothing: the new run (its id must be new, and its
    /// session must have no other unfinished run: [`StoreError::Busy`]), the journal entry (the
    /// first record of a step wins; a repeat is ignored), the messages at session positions
    /// `first_position..` (idempotent: a position already written by the same run is skipped;
    /// one written by another run, or a gap, is a [`StoreError::Conflict`]) and the state change.
    /// With a [`Fence`], nothing is written unless the lease still matches, and the lease is
    /// extended. This is the only way runs, messages and journals are written.
    fn commit_step<'a>(&'a self, commit: StepCommit<'a>) -> StoreFuture<'a, Result<Committed, StoreError>>;

    /// Claims a run's lease for `owner`, for `ttl` from now, when the run is not finished and its
    /// lease is free, expired, already `owner`'s, or held by `takeover` (an owner the caller
    /// proved dead). Fails with [`StoreError::NotFound`] for an unknown run.
    fn claim_run<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        ttl: std::time::Duration,
        takeover: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;

    /// Extends a held lease by `ttl` from now (zero releases it: any process may take the run
    /// over at once).
    fn renew_lease<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        epoch: u64,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<LeaseStatus, StoreError>>;

    /// The runs that are not finished (running, or paused for a human): all of them, or
    /// `session`'s (at most one); oldest first.
    fn open_runs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<OpenRun>, StoreError>>;

    /// The runs leased to `owner` whose cancellation was requested: what an engine polls to
    /// stop its runs when another process cancels them.
    fn cancel_requests<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Result<Vec<RunId>, StoreError>>;

    /// Asks `session`'s unfinished run to stop, for whoever drives it: its owner sees the request
    /// at its next lease renewal or commit (engines also poll for it). A run paused for a human
    /// stops waiting: its pending inputs are closed (`cancelled` by `by`) and it becomes
    /// re-drivable at once, so that the next process to drive it ends it. Returns the run as it
    /// was, or `None` when the session has no unfinished run.
    fn request_cancel<'a>(
        &'a self,
        session: &'a SessionId,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Option<OpenRun>, StoreError>>;

    /// The approvals and questions waiting for a human: all of them, or `session`'s; oldest
    /// first.
    fn pending_inputs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<PendingInput>, StoreError>>;

    /// The pending input `id`, if it is pending.
    fn pending_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<PendingInput>, StoreError>>;

    /// What became of `id`, once it is no longer pending (decided, cancelled, or closed by the
    /// end of its run).
    fn decided_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<DecidedInput>, StoreError>>;

    /// Records a human's decision, atomically: the pending input `id` is removed (remembered as
    /// decided `by` whom), the decision is journaled as its step, and a run paused in
    /// `awaiting_input` becomes `running` with an expired lease (so any process may re-drive it).
    /// Fails with [`StoreError::NotPending`] when `id` is not pending (never pending, decided
    /// already, or its run ended), saying what became of it: a second decision changes nothing.
    fn decide<'a>(
        &'a self,
        id: &'a str,
        decision: &'a Decision,
        by: &'a str,
    ) -> BoxFuture<'a, Result<PendingInput, StoreError>>;

    /// Compacts the journals of finished runs (done, failed, cancelled) to what their
    /// transcripts need: nothing, as the messages hold the results. Returns how many journal
    /// entries were removed. A compacted run can no longer be replayed step by step.
    fn compact_journals(&self) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Records that schedule `name` fires for the tick at `tick_ms` (milliseconds since the Unix
    /// epoch), unless that tick (or a later one) was already recorded, and stores `run`, the
    /// fire's delayed run, in the same transaction: a process that dies right after still
    /// leaves the fire to start. Without `run`, only records the tick (a tick skipped, or the
    /// point a new schedule counts from). Returns whether this call recorded it: of several
    /// processes sharing a store, exactly one fires each tick.
    fn claim_schedule_tick<'a>(
        &'a self,
        name: &'a str,
        tick_ms: u64,
        run: Option<&'a DelayedRun>,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Stores a delayed run, waiting for its time. Storing the same run again changes nothing
    /// and returns it as stored; another run under its id is a [`StoreError::Conflict`].
    fn schedule_run<'a>(&'a self, run: &'a DelayedRun)
    -> BoxFuture<'a, Result<DelayedRunRecord, StoreError>>;

    /// A delayed run, whatever its state.
    fn delayed_run<'a>(
        &'a self,
        run: &'a RunId,
    ) -> BoxFuture<'a, Result<Option<DelayedRunRecord>, StoreError>>;

    /// Takes up to `limit` waiting delayed runs that are due, oldest first, holding each for
    /// `hold` (no other process takes it meanwhile): the caller starts them. A run whose start
    /// never happens (its process died) is taken again once the hold ends. The run's first
    /// commit marks it started; a cancelled one can no longer start.
    fn take_due_runs<'a>(
        &'a self,
        hold: std::time::Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DelayedRun>, StoreError>>;

    /// Puts off a waiting delayed run until `until_ms`, saying why (its session was busy).
    fn defer_delayed_run<'a>(
        &'a self,
        run: &'a RunId,
        until_ms: u64,
        note: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Cancels a waiting delayed run (`by` whom, for the record). Returns the record as it is
    /// after the call: `Cancelled` (now, or before), or `Started` when it was too late; `None`
    /// for an unknown id.
    fn cancel_delayed_run<'a>(
        &'a self,
        run: &'a RunId,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Option<DelayedRunRecord>, StoreError>>;

    /// The last tick schedule `name` fired for, if any.
    fn schedule_last_fire<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>>;

    /// One session's summary; `None` when the store has no such session.
    fn session_summary<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<SessionSummary>, StoreError>>;

    /// The sessions `filter` names, most recently written first.
    fn list_sessions(&self, filter: SessionFilter) -> BoxFuture<'_, Result<Vec<SessionSummary>, StoreError>>;

    /// Deletes a session with its messages, runs and journals. Returns whether it existed.
    fn delete_session<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Writes records of `owner`'s memory of `kind`, in one transaction (see [`MemoryWrite`]:
    /// how an existing record is merged, and how many of the kind are kept).
    fn write_memory<'a>(
        &'a self,
        owner: &'a str,
        kind: &'a str,
        write: MemoryWrite,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// `owner`'s memory records (of `kind`, or all), most recently written first.
    fn load_memory<'a>(
        &'a self,
        owner: &'a str,
        kind: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<MemoryItem>, StoreError>>;

    /// Every owner with memory, most recently written first.
    fn memory_owners(&self) -> BoxFuture<'_, Result<Vec<MemoryOwner>, StoreError>>;

    /// Erases `owner`'s memory: all of it, one kind, or one record. Returns how many records
    /// were erased.
    fn forget<'a>(
        &'a self,
        owner: &'a str,
        kind: Option<&'a str>,
        key: Option<&'a str>,
    ) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// The log where the processes sharing this store publish their runs' events, when other
    /// processes can share it (`None`: this process sees every run of the store itself).
    fn event_log(&self) -> Option<Arc<dyn crate::EventLog>> {
        None
    }
}
