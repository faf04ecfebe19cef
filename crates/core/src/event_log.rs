//! The shared event log: where processes that share a store publish the events of the runs they
//! execute, so that an observer connected to any of them sees every run of a session, live and
//! in order, and resumes after a reconnect to another one without a gap or a duplicate.
//!
//! A store that one process owns (memory, SQLite) has none: that process's own feeds see every
//! run. A store shared by many processes (PostgreSQL) has one ([`crate::Store::event_log`]).
//!
//! Each session's log is numbered on its own (`seq`, 1, 2, 3...): an appended event's number is
//! larger than every number appended to that session before it, and a reader that has seen `n`
//! reads exactly what comes after `n`. Old events are pruned; numbers never go back.

use std::sync::Arc;

use crate::BoxFuture;
use crate::ids::{RunId, SessionId};
use crate::store::StoreError;

/// An event to append to its session's log.
#[derive(Clone, Debug)]
pub struct NewEvent {
    /// The session whose log it joins.
    pub session: SessionId,
    /// The run that emitted it.
    pub run: RunId,
    /// The event as its wire JSON; `None` marks the end of the run's event stream (it finished,
    /// failed, or paused for a human).
    pub body: Option<Arc<str>>,
}

/// An event read back from a session's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedEvent {
    /// Its number in the session's log.
    pub seq: u64,
    /// The run that emitted it.
    pub run: RunId,
    /// As [`NewEvent::body`].
    pub body: Option<Arc<str>>,
}

/// What woke a watcher of the log.
#[derive(Clone, Copy, Debug)]
pub enum LogWake<'a> {
    /// Another process appended to this session's log.
    Session(&'a SessionId),
    /// Appends may have been missed (the watch started, or reconnected after a break): every
    /// session the watcher follows should be read again.
    All,
}

/// Called on each wake-up, from a thread of the log's own.
pub type OnWake = Box<dyn Fn(LogWake<'_>) + Send + Sync>;

/// A log of session events shared by the processes of one store. See the module docs.
pub trait EventLog: Send + Sync {
    /// Appends `events`, in their order, to their sessions' logs, as one batch. Returns each
    /// one's `seq`, in the same order; or `None` when an earlier attempt of the same `batch`
    /// (an id unique to this batch) was appended already (its outcome was lost with its
    /// connection): nothing is appended twice, and the caller reads the logs instead.
    fn append(
        &self,
        batch: u64,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'static, Result<Option<Vec<u64>>, StoreError>>;

    /// At most `limit` events of `session` after `after`, oldest first.
    fn read_after(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> BoxFuture<'static, Result<Vec<LoggedEvent>, StoreError>>;

    /// The session's last `seq` (0: none ever) and its last `limit` events, oldest first, read
    /// at once.
    fn read_recent(
        &self,
        session: &SessionId,
        limit: usize,
    ) -> BoxFuture<'static, Result<(u64, Vec<LoggedEvent>), StoreError>>;

    /// Calls `on_wake` whenever another process appends to a session's log (and with
    /// [`LogWake::All`] when it starts and after each reconnect), until the log is dropped.
    fn watch(&self, on_wake: OnWake) -> Result<(), StoreError>;

    /// Drops the events appended more than `older_than_ms` ago. Returns how many.
    fn prune(&self, older_than_ms: u64) -> BoxFuture<'static, Result<u64, StoreError>>;
}
