//! The SQLite backend: one embedded database file, in WAL mode.
//!
//! Durability: every store call is one transaction, committed before the call returns, with
//! `journal_mode=WAL` and `synchronous=NORMAL`: a committed step survives the process being
//! killed (SIGKILL) at any point; a power loss can lose the last commits (not corrupt the file).
//! Several processes may open the same file (a paused run decided from another process);
//! writers wait up to 5 s for each other (`busy_timeout`), then fail with `KEEL_STORE_LOCKED`.
//!
//! Writes have one connection. A write that finds nobody else writing is committed by its caller,
//! on the caller's thread, after one turn of the scheduler where other tasks' writes may join
//! it then (see [`gather_first`]): one run going step by step never waits for another thread.
//! Writes that arrive while a commit is under way queue, and a writer thread commits whatever has
//! queued up since its last commit in one transaction (group commit), each write in its own
//! savepoint so that one failing write fails alone: under load many runs' steps share a commit.
//! The writer's connection remembers, across its transactions, what every commit checks first
//! (a run's lease and fence, a session's message count), and reads them again as soon as another
//! connection has committed ([`Known`]).
//! The write-ahead log is folded into the database by a checkpoint thread on its own connection,
//! never inside a commit; every few thousand pages the writer thread makes the log start over
//! between two commits, so that it stays bounded however long writes go on without a pause
//! (see [`RESTART_PAGES`]). Connections open the file through a VFS that writes each frame of
//! the log in one system call instead of two ([`crate::wal_frames`]). Reads run on the
//! caller's task and see every write whose call has returned: on the writer's connection when
//! nobody writes (its cache holds what was just written), else on a second connection (WAL
//! lets them run beside the writer).
//! Statements are prepared once and held by their connection ([`crate::held`]). One shape is
//! avoided: `WHERE column = ?1 ... ORDER BY ...` (and `MAX(...)`), whose plan SQLite ties to
//! the bound value, so that it prepares such a statement again whenever the value changes (at
//! every execution: a third of a run's work, measured). Those statements compare with
//! `CAST(?1 AS TEXT)`, which keeps the index and the order and drops the tie; per-step reads
//! are index seeks (a session's message count is its last message's position, and its row is
//! written when a run of it starts and when a step adds tokens, not at every step). Two more
//! shapes make SQLite build a temporary B-tree at every execution, even for no rows: an index
//! seek through `IN (...)`, and an `ORDER BY` the index does not give. Per-run queries use one
//! lookup per value (`UNION ALL`) and are sorted in Rust instead (10% of a durable run's
//! instructions, measured).
//!
//! Records are stored in keel-core's versioned formats ([`keel_core::persist`]); the schema has
//! its own version (`PRAGMA user_version`), moved forward by [`MIGRATIONS`] inside a write
//! transaction (so processes opening a new file together migrate it once). A database from a
//! newer keel is refused before anything is written.
//!
//! This module implements storage operations only ([`Tx`]); the rules are `crate::rules`.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use keel_core::journal::JournalEntry;
use keel_core::memory::{MemoryItem, MemoryOwner};
use keel_core::persist::{
    decode_message, decode_pending_kind, decode_record, encode_message, encode_pending_kind, encode_record,
};
use keel_core::{
    BoxFuture, Clock, DecidedInput, DelayedRun, DelayedRunRecord, Message, PendingInput, RunId, RunRecord,
    SessionFilter, SessionId, SessionSummary, StepName, StoreError, Usage,
};
use rusqlite::{Connection, ErrorCode as SqliteCode, OptionalExtension, params};

use crate::held::HeldConnection;

use crate::backend::{
    Backend, Ruled, RunControl, SessionRows, Tx, Work, corrupt, memory_item, memory_owner_rows, read_limits,
    scope_parameters, signed, stored_delayed_state, stored_limits, stored_run_id, stored_state,
};

/// The schema, one migration per version (index 0 makes version 1).
const MIGRATIONS: &[&str] = &[
    // Version 1: sessions, their messages, runs, journals.
    "CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        message_count INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE messages (
        session_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (session_id, position)
    ) WITHOUT ROWID;
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        input TEXT NOT NULL,
        history_len INTEGER NOT NULL,
        call_base INTEGER NOT NULL,
        state TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX runs_by_session ON runs (session_id);
    CREATE INDEX runs_by_state ON runs (state);
    CREATE TABLE journal (
        run_id TEXT NOT NULL,
        step TEXT NOT NULL,
        seq INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (run_id, step)
    ) WITHOUT ROWID;",
    // Version 2: run leases (who drives a run, until when; the epoch fences stale writers).
    "ALTER TABLE runs ADD COLUMN lease_owner TEXT;
    ALTER TABLE runs ADD COLUMN lease_expires_at INTEGER;
    ALTER TABLE runs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0;",
    // Version 3: schedules' last fired tick.
    "CREATE TABLE schedules (
        name TEXT PRIMARY KEY,
        last_fire INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // Version 4: approvals and questions waiting for a human (a rowid table: the rowid keeps the
    // order they were asked in, which is the calls' order within a turn).
    "CREATE TABLE pending_inputs (
        id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        session_id TEXT NOT NULL,
        call_id TEXT NOT NULL,
        step TEXT NOT NULL,
        body TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    );
    CREATE INDEX pending_by_session ON pending_inputs (session_id);
    CREATE INDEX pending_by_run ON pending_inputs (run_id);",
    // Version 5: the session's state object (JSON), which tools read and replace.
    "ALTER TABLE sessions ADD COLUMN state TEXT;",
    // Version 6: tokens of the session's model calls, summed as their steps are journaled.
    "ALTER TABLE sessions ADD COLUMN input_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sessions ADD COLUMN output_tokens INTEGER NOT NULL DEFAULT 0;",
    // Version 7: claims since the last commit (poison runs), cancellation requests, what became
    // of inputs that are no longer pending, and indexes for a session's unfinished runs and an
    // owner's runs. Not partial indexes: to tell whether one applies, SQLite compares the bound
    // parameters of every statement on `runs` with the index's condition, and then re-prepares
    // the statement each time they change (a third of all the work of a run, measured).
    "ALTER TABLE runs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN cancel_requested_by TEXT;
    CREATE INDEX runs_open ON runs (session_id, state);
    CREATE INDEX runs_leased ON runs (state, lease_owner);
    CREATE TABLE decided_inputs (
        id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        session_id TEXT NOT NULL,
        outcome TEXT NOT NULL,
        by_whom TEXT NOT NULL,
        at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX decided_by_session ON decided_inputs (session_id);",
    // Version 8: delayed runs (`POST /runs`, `keel run --after`, schedules' fires), stored
    // until they start.
    "CREATE TABLE delayed_runs (
        run_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        input TEXT NOT NULL,
        due_at INTEGER NOT NULL,
        source TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        held_until INTEGER NOT NULL,
        attempts INTEGER NOT NULL,
        note TEXT
    ) WITHOUT ROWID;
    CREATE INDEX delayed_due ON delayed_runs (state, due_at);",
    // Version 9: a run's own limits (`persist::encode_overrides`; NULL for the agent's).
    "ALTER TABLE runs ADD COLUMN limits TEXT;",
    // Version 10: what agents remember about their owners (episodes, entities, relations).
    "CREATE TABLE memories (
        owner TEXT NOT NULL,
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (owner, kind, key)
    ) WITHOUT ROWID;
    CREATE INDEX memories_recent ON memories (owner, kind, updated_at);",
    // Version 11: two indexes fewer on `runs`, which every new run and every change of state
    // wrote: `runs_open` (session_id, state) and `runs_leased` (state, lease_owner) begin with
    // what they indexed, and serve the same queries.
    "DROP INDEX runs_by_session;
    DROP INDEX runs_by_state;",
    // Version 12: one index on `runs`, led by the state. A new run wrote a key in both of
    // version 11's, and its end moved it in both (about a tenth of the pages a tool-loop run's
    // commits wrote, measured); one index serves all the queries: the unfinished runs (by
    // state), a session's (state and session), an owner's cancellations (the running runs)
    // and, through the list of every state, a session's runs (see `every_state!`).
    "DROP INDEX runs_open;
    DROP INDEX runs_leased;
    CREATE INDEX runs_by_state ON runs (state, session_id);",
    // Version 13: a session's message count is its messages' (the last position, one index
    // seek), no longer a column of its row, which every step then wrote with its messages: a
    // step that adds messages and no tokens (a tool's result) writes no session row now (one
    // page fewer in its commit, measured).
    "ALTER TABLE sessions DROP COLUMN message_count;",
];

/// Every run state as an SQL list, for the statements that find a session's runs through
/// `runs_by_state` (its first column is the state): `state IN every_state!() AND session_id
/// = ?` is one seek per state. A test checks that it names every [`RunState`].
macro_rules! every_state {
    () => {
        "('running', 'awaiting_input', 'done', 'failed', 'cancelled')"
    };
}

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The SQLite backend. See the module docs.
pub struct Sqlite {
    /// The connection reads use.
    connection: Mutex<HeldConnection>,
    /// Where writes go.
    writer: Arc<Writer>,
    path: PathBuf,
}

impl Drop for Sqlite {
    fn drop(&mut self) {
        // The writer thread finishes what is queued, then ends.
        self.writer.queue().closed = true;
        self.writer.wake.notify_one();
    }
}

/// A store in an SQLite file. See the module docs.
pub type SqliteStore = Ruled<Sqlite>;

/// One write, run by the writer thread inside its batch's transaction; its caller hears of it
/// only once the batch is committed.
trait Job: Send {
    /// Runs the work; `Err` rolls its savepoint back.
    fn run(&mut self, connection: &WriterConnection) -> Result<(), StoreError>;
    /// Tells the caller: its result, unless the commit failed.
    fn deliver(self: Box<Self>, commit: Result<(), StoreError>);
}

struct TypedJob<T> {
    work: Option<Work<T>>,
    result: Option<Result<T, StoreError>>,
    reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> Job for TypedJob<T> {
    fn run(&mut self, connection: &WriterConnection) -> Result<(), StoreError> {
        let Some(mut work) = self.work.take() else { return Ok(()) };
        let mut tx = SqliteTx::writing(connection);
        let result = work(&mut tx);
        let outcome = result.as_ref().map(drop).map_err(Clone::clone);
        self.result = Some(result);
        outcome
    }

    fn deliver(self: Box<Self>, commit: Result<(), StoreError>) {
        let result = match (self.result, commit) {
            (Some(Err(error)), _) | (_, Err(error)) => Err(error),
            (Some(Ok(value)), Ok(())) => Ok(value),
            (None, Ok(())) => Err(StoreError::Unavailable("a write was never run".into())),
        };
        // The caller may have stopped waiting; the write is done either way.
        let _ = self.reply.send(result);
    }
}

/// The most writes one commit takes.
const MAX_BATCH: usize = 512;

/// The writer's connection and the writes waiting for it.
///
/// One committer at a time holds the connection: a caller whose write found nobody else
/// writing (it commits that one write itself, on its own thread: no hand-off to wait for), or
/// the writer thread, which commits whatever queued meanwhile in one transaction (group
/// commit), or makes the log start over. A write arriving while a commit is under way queues,
/// and the writer thread takes it. A read that finds nobody committing holds the connection as
/// a caller does ([`Writer::read_alone`]).
struct Writer {
    connection: Mutex<WriterConnection>,
    queue: Mutex<Queue>,
    /// Wakes the writer thread when it is handed the queue (or the store closes).
    wake: std::sync::Condvar,
    /// The checkpointer thread's wake-ups (the log's hook on `connection` holds another): it
    /// ends, closing its connection, when every one is gone. Declared after `connection`, so
    /// dropped once that connection is closed: the checkpointer's then closes last and alone,
    /// folding the log into the database and deleting it. Closing both at once, each found the
    /// other still open and neither deleted the log (a test found it left after a store was
    /// dropped, on a busy machine).
    _checkpoints: std::sync::mpsc::SyncSender<()>,
}

#[derive(Default)]
struct Queue {
    jobs: Vec<Box<dyn Job>>,
    /// Who commits now.
    committer: Committer,
    closed: bool,
    /// When a write last arrived while another caller's was committed, or several were
    /// (see `Backend::write`): writes come together, and a lone one is worth waiting for
    /// company (see [`gather_first`]).
    contended_at: Option<Instant>,
    /// The log is to start over before the next commit (see [`RESTART_PAGES`]): the writer
    /// thread's to do, so writes queue for it meanwhile.
    restart_due: bool,
    /// How many writes the writer thread is committing now (0 while it makes the log start over
    /// or waits): more than one came together; one is a caller's handed over (behind a restart
    /// of the log, or another process's write lock), which is no sign of company.
    thread_batch: usize,
}

#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Committer {
    /// Nobody: the next write commits itself.
    #[default]
    Nobody,
    /// A caller, committing its lone write (or about to).
    Caller,
    /// A caller reading on the connection ([`Writer::read_alone`]).
    Reader,
    /// The writer thread, until the queue is empty and no restart of the log is due.
    Thread,
}

impl Writer {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Has the writer thread make the log start over before the next commit: now if nobody
    /// commits, else once the commit under way is done.
    fn restart_log_soon(&self) {
        let mut queue = self.queue();
        queue.restart_due = true;
        if queue.committer == Committer::Nobody {
            self.hand_to_thread(&mut queue);
        }
    }

    /// The writer's connection for a read, when nobody commits (and no restart of the log is
    /// due): its page cache holds what the last commits wrote, where the reader's connection,
    /// finding the database changed since its last read, drops its whole cache and reads those
    /// pages back from the log (seven `pread` calls a tool-loop run). Writes made meanwhile
    /// queue, and go to the writer thread once the read is done.
    fn read_alone(&self) -> Option<Reading<'_>> {
        let mut queue = self.queue();
        if queue.committer != Committer::Nobody || queue.restart_due {
            return None;
        }
        queue.committer = Committer::Reader;
        drop(queue);
        let connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
        Some(Reading { writer: self, connection: Some(connection) })
    }

    /// Gives the queue to the writer thread (the caller committing stops being the committer).
    fn hand_to_thread(&self, queue: &mut Queue) {
        queue.committer = Committer::Thread;
        self.wake.notify_one();
    }

    /// Commits `batch` on this thread, and tells each caller.
    fn commit(&self, mut batch: Vec<Box<dyn Job>>) {
        let commit = {
            let connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
            begin(&connection).and_then(|()| run_batch(&connection, &mut batch))
        };
        deliver(batch, commit);
    }

    /// A caller's lone write: commits it here when nothing else is queued by the time the caller
    /// is polled again, else hands everything (this write too) to the writer thread. So does a
    /// write lock held by another process: the caller's thread never waits for one (the writer
    /// thread does, up to the busy timeout).
    fn commit_alone(&self) {
        let mut queue = self.queue();
        if queue.jobs.len() == 1 && !queue.restart_due {
            let connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
            if begin_now(&connection) {
                let mut batch = std::mem::take(&mut queue.jobs);
                drop(queue);
                let commit = run_batch(&connection, &mut batch);
                drop(connection);
                deliver(batch, commit);
                queue = self.queue();
                if queue.jobs.is_empty() && !queue.restart_due {
                    queue.committer = Committer::Nobody;
                    return;
                }
            }
        }
        self.hand_to_thread(&mut queue);
    }
}

/// A read on the writer's connection ([`Writer::read_alone`]); when dropped, writes that queued
/// meanwhile go to the writer thread.
struct Reading<'w> {
    writer: &'w Writer,
    /// Always `Some` until dropped: let go of before the queue is handed on.
    connection: Option<MutexGuard<'w, WriterConnection>>,
}

impl Reading<'_> {
    fn connection(&self) -> &HeldConnection {
        self.connection.as_deref().expect("held until the read is dropped")
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        drop(self.connection.take());
        let mut queue = self.writer.queue();
        if queue.jobs.is_empty() && !queue.restart_due {
            queue.committer = Committer::Nobody;
        } else {
            self.writer.hand_to_thread(&mut queue);
        }
    }
}

/// Tells every job of a batch how its commit went.
fn deliver(batch: Vec<Box<dyn Job>>, commit: Result<(), StoreError>) {
    for job in batch {
        job.deliver(commit.clone());
    }
}

/// How long a writer waits for another process's write lock before `KEEL_STORE_LOCKED`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the write transaction. `BEGIN IMMEDIATE` takes the write lock up front (waiting out
/// other processes' writers with the busy timeout) instead of failing mid-transaction.
fn begin(connection: &HeldConnection) -> Result<(), StoreError> {
    connection.with_statement("BEGIN IMMEDIATE", |s| s.execute([])).map(drop).map_err(map_error)
}

/// [`begin`] if the write lock is free now, without waiting. Whether it began.
fn begin_now(connection: &HeldConnection) -> bool {
    if connection.busy_timeout(Duration::ZERO).is_err() {
        return false;
    }
    let began = begin(connection).is_ok();
    // Cannot fail with a valid connection; the thread's commits would then not wait at all.
    let _ = connection.busy_timeout(BUSY_TIMEOUT);
    began
}

/// How long after writes last came together a lone write still waits for company.
const CONTENTION_WINDOW: Duration = Duration::from_secs(1);

/// Whether a caller's lone write first lets the scheduler run the other tasks that are ready, so
/// that their writes join its commit. Always where one worker runs every task (a current-thread
/// runtime, a multi-thread one with one worker, or outside Tokio): that turn is the only way
/// other runs' steps can reach the queue, since a run whose model and tools answer at once never
/// lets go of the thread (1000 runs in flight committed one by one without it: a third of the
/// throughput, measured). With more workers, only while writes have been coming together
/// (`contended_at`, within [`CONTENTION_WINDOW`] of `now`): served turns were 6-8% fewer
/// without the turn. A run alone gathers nothing by it and pays a cross-thread wake-up for
/// it: the worker that ran dry of tasks starts searching for work, and when it finds the
/// yielded task it wakes an idle worker to search on (Tokio's scheduler; 84-194 parks of the
/// workers for 200 writes one at a time, against one).
fn gather_first(contended_at: Option<Instant>, now: Instant) -> bool {
    let one_worker = tokio::runtime::Handle::try_current().map_or(true, |runtime| {
        runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread
            || runtime.metrics().num_workers() < 2
    });
    one_worker || contended_at.is_some_and(|at| now.saturating_duration_since(at) < CONTENTION_WINDOW)
}

/// The caller committing its own write; if its future is dropped before it did, the writer
/// thread takes over (the write is done either way, as any write whose call was made).
struct CallerCommit(Option<Arc<Writer>>);

impl CallerCommit {
    fn run(mut self) {
        if let Some(writer) = self.0.take() {
            writer.commit_alone();
        }
    }
}

impl Drop for CallerCommit {
    fn drop(&mut self) {
        if let Some(writer) = self.0.take() {
            let mut queue = writer.queue();
            writer.hand_to_thread(&mut queue);
        }
    }
}

/// The writer thread: when handed the queue, commits what is in it (up to [`MAX_BATCH`] writes
/// per transaction) until it is empty. Ends when the store is dropped and nothing is queued.
fn writer_loop(writer: Arc<Writer>) {
    let mut queue = writer.queue();
    loop {
        if queue.committer == Committer::Thread {
            if queue.restart_due {
                queue.restart_due = false;
                drop(queue);
                restart_log(&writer.connection.lock().unwrap_or_else(|p| p.into_inner()));
                queue = writer.queue();
                continue;
            }
            if queue.jobs.is_empty() {
                queue.committer = Committer::Nobody;
            } else {
                let rest = queue.jobs.len().saturating_sub(MAX_BATCH);
                let batch: Vec<_> = if rest == 0 {
                    std::mem::take(&mut queue.jobs)
                } else {
                    queue.jobs.drain(..MAX_BATCH).collect()
                };
                queue.thread_batch = batch.len();
                drop(queue);
                writer.commit(batch);
                queue = writer.queue();
                queue.thread_batch = 0;
                continue;
            }
        }
        if queue.closed && queue.committer == Committer::Nobody {
            return;
        }
        queue = writer.wake.wait(queue).unwrap_or_else(|p| p.into_inner());
    }
}

/// How many pages the write-ahead log may hold before the checkpointer folds it into the
/// database (SQLite's own default for its automatic checkpoints).
const CHECKPOINT_PAGES: i32 = 1000;

/// How long the log may grow before the writer makes it start over. The log starts over (its
/// next write goes to its beginning) only when a write finds all of it copied into the database.
/// The checkpointer's `PASSIVE` checkpoints hold no writer up, so while writes never pause (a
/// busy server) each one ended with newer frames behind it, and the log grew for as long as
/// they went on: 100 MB in 3,000 commits of the test below, a gigabyte in five seconds of the
/// store benchmark. Past this length the writer thread, between two commits, runs a `RESTART`
/// checkpoint on its own connection: it copies what the last `PASSIVE` one left and syncs
/// (milliseconds, once per this many pages; the writes that arrive meanwhile queue for the next
/// commit), and the commit after it writes from the log's beginning. (A `RESTART` checkpoint
/// from the checkpointer's connection never ran: it waits for the write lock, which a store
/// committing without pause frees only for microseconds at a time.)
const RESTART_PAGES: i32 = 4 * CHECKPOINT_PAGES;

/// The size the log's file is cut back to when the log starts over (`journal_size_limit`):
/// above what [`RESTART_PAGES`] lets it reach, so a log that starts over as it should keeps its
/// file, whose pages its next writes reuse (a file cut back and grown again costs the kernel a
/// new page of cache per frame); a longer one (a large transaction, a file an older keel let
/// grow) is cut back.
const LOG_SIZE_LIMIT: i64 = 32 << 20;

/// How long the writer's `RESTART` checkpoint waits for readers of older snapshots (another
/// process's, which keel's are for milliseconds at most) before it gives up, leaving the log
/// to grow until the next try. A reader that keeps its snapshot (a shell left in a transaction,
/// a replication tool) must not hold the write lock, and every process's commits, for
/// the 5 s of [`BUSY_TIMEOUT`] each time.
const RESTART_PATIENCE: Duration = Duration::from_millis(100);

/// When the checkpointer asks for the log to start over: at [`RESTART_PAGES`], then, while a
/// reader keeps it from starting over, again each time it has grown as much again.
#[derive(Debug)]
struct RestartSchedule {
    /// The log's length at the checkpoint before.
    last: i64,
    /// The length that asks for the next restart.
    next: i64,
}

impl RestartSchedule {
    fn new() -> RestartSchedule {
        RestartSchedule { last: 0, next: i64::from(RESTART_PAGES) }
    }

    /// Whether the log, `pages` long after a checkpoint, is to start over now.
    fn due(&mut self, pages: i64) -> bool {
        if pages < self.last {
            // It started over since.
            self.next = i64::from(RESTART_PAGES);
        }
        self.last = pages;
        let due = pages >= self.next;
        if due {
            self.next = pages.saturating_add(i64::from(RESTART_PAGES));
        }
        due
    }
}

/// The checkpointer thread: on each wake-up, copies the write-ahead log into the database file
/// on a connection of its own (`PASSIVE`: writers and readers go on meanwhile), and asks the
/// writer to make the log start over when it is long ([`RestartSchedule`]). The writer's
/// connection does not checkpoint by itself, so that no commit (one a caller makes on its own
/// thread above all) waits for the file system's syncs a checkpoint does.
///
/// It holds the writer weakly: the writer's connection holds the sender of its wake-ups, and the
/// thread ends when that connection closes with the store.
fn checkpoint_loop(
    connection: Connection,
    writer: std::sync::Weak<Writer>,
    wakes: std::sync::mpsc::Receiver<()>,
) {
    let mut schedule = RestartSchedule::new();
    while wakes.recv().is_ok() {
        // `(busy, pages in the log, pages copied)`.
        match connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get::<_, i64>(1)) {
            Ok(pages) => {
                if schedule.due(pages)
                    && let Some(writer) = writer.upgrade()
                {
                    writer.restart_log_soon();
                }
            }
            Err(error) => tracing::warn!(%error, "the SQLite checkpoint failed; the next one will try again"),
        }
    }
}

/// The writer thread's `RESTART` checkpoint (see [`RESTART_PAGES`]), waiting for readers at most
/// [`RESTART_PATIENCE`]. One that finds a reader still on an older snapshot has copied what it
/// could and leaves the log as it is (`busy`, not an error).
fn restart_log(connection: &Connection) {
    let checkpoint = connection
        .busy_timeout(RESTART_PATIENCE)
        .and_then(|()| connection.query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(())));
    // Cannot fail with a valid connection; its commits would then not wait at all.
    let _ = connection.busy_timeout(BUSY_TIMEOUT);
    if let Err(error) = checkpoint {
        tracing::warn!(%error, "the SQLite checkpoint failed; the next one will try again");
    }
}

/// Runs a batch in the transaction [`begin`] opened, each job in its own savepoint so that one
/// failing job fails alone, and commits. Returns how the commit went. A batch of one needs no
/// savepoint (its failure rolls the whole transaction back): a savepoint makes SQLite copy every
/// page it changes into a sub-journal first, which was a sixth of a lone commit's work.
/// What the connection knows from earlier transactions is checked first ([`Known::revalidate`]),
/// and forgotten when anything is rolled back.
fn run_batch(connection: &WriterConnection, batch: &mut [Box<dyn Job>]) -> Result<(), StoreError> {
    let exec = |sql: &'static str| connection.with_statement(sql, |s| s.execute([])).map_err(map_error);
    let forget = || connection.known.borrow_mut().forget();
    connection.known.borrow_mut().revalidate(connection);
    if let [job] = batch {
        if job.run(connection).is_err() {
            // The job's own error is what its caller hears; nothing of it stays.
            forget();
            return exec("ROLLBACK").map(drop);
        }
    } else {
        for job in batch.iter_mut() {
            let outcome = exec("SAVEPOINT write").and_then(|_| job.run(connection));
            let undo = match outcome {
                Ok(()) => exec("RELEASE write"),
                Err(_) => {
                    forget();
                    exec("ROLLBACK TO write").and(exec("RELEASE write"))
                }
            };
            if let Err(error) = undo {
                forget();
                let _ = exec("ROLLBACK");
                return Err(error);
            }
        }
    }
    if let Err(error) = exec("COMMIT") {
        forget();
        let _ = exec("ROLLBACK");
        return Err(error);
    }
    connection.known.borrow_mut().changes = connection.total_changes();
    Ok(())
}

/// The writer's connection, and what it knows of the rows that every commit reads.
struct WriterConnection {
    held: HeldConnection,
    known: RefCell<Known>,
}

impl std::ops::Deref for WriterConnection {
    type Target = HeldConnection;

    fn deref(&self) -> &HeldConnection {
        &self.held
    }
}

/// The most runs (and sessions) [`Known`] keeps: more than a process has in flight, as a rule;
/// past it, it starts again from nothing.
const MAX_KNOWN: usize = 4096;

/// What the writer's connection read or wrote of the rows every commit checks before it writes
/// (a run's control row: its state, lease and fence; a session's message count), kept from one
/// transaction to the next: a tool-loop run read them eight times, 38,000 of its instructions.
/// Kept only while no other connection commits: `PRAGMA data_version`, read once per
/// transaction under its write lock, moves when one did (another process's decision, a
/// takeover, another store on the same file, a `VACUUM`), and then everything known is
/// forgotten. So is everything when a write fails or is rolled back, since it may have been
/// learnt from what was undone. Reads made outside the writer's transactions use none of it.
#[derive(Default)]
struct Known {
    /// `PRAGMA data_version` at this connection's last transaction; `None`: not read.
    data_version: Option<i64>,
    /// The rows this connection had changed when its last write transaction committed: more
    /// at the next one means something else wrote on it (a read that wrote), and what is known
    /// is forgotten then too.
    changes: u64,
    controls: HashMap<RunId, RunControl>,
    message_counts: HashMap<SessionId, u64>,
}

impl Known {
    /// At the start of a write transaction (the write lock held: nobody else commits until it
    /// ends): forgets everything if another connection committed since the last one.
    fn revalidate(&mut self, connection: &HeldConnection) {
        let version = connection.with_statement("PRAGMA data_version", |s| s.query_row([], |row| row.get(0)));
        match version {
            Ok(version)
                if self.data_version == Some(version) && self.changes == connection.total_changes() => {}
            Ok(version) => {
                self.forget();
                self.data_version = Some(version);
            }
            Err(_) => {
                self.forget();
                self.data_version = None;
            }
        }
    }

    fn forget(&mut self) {
        self.controls.clear();
        self.message_counts.clear();
    }

    fn learn_control(&mut self, run: &RunId, control: &RunControl) {
        if control.state.is_terminal() {
            // Read again if ever needed (a late commit of a finished run): not worth keeping.
            self.controls.remove(run);
            return;
        }
        if self.controls.len() >= MAX_KNOWN && !self.controls.contains_key(run) {
            self.controls.clear();
        }
        self.controls.insert(run.clone(), control.clone());
    }

    fn learn_message_count(&mut self, session: &SessionId, count: u64) {
        if self.message_counts.len() >= MAX_KNOWN && !self.message_counts.contains_key(session) {
            self.message_counts.clear();
        }
        self.message_counts.insert(session.clone(), count);
    }
}

fn map_error(error: rusqlite::Error) -> StoreError {
    let message = error.to_string();
    match error.sqlite_error_code() {
        Some(SqliteCode::DatabaseBusy | SqliteCode::DatabaseLocked) => StoreError::Locked(message),
        Some(SqliteCode::ReadOnly) => StoreError::ReadOnly(message),
        Some(SqliteCode::NotADatabase | SqliteCode::DatabaseCorrupt) => StoreError::Corrupt(message),
        Some(SqliteCode::ConstraintViolation) => StoreError::Conflict(message),
        _ => match error {
            // A value of the wrong type where keel wrote its own: not what keel stores.
            rusqlite::Error::InvalidColumnType(..) | rusqlite::Error::FromSqlConversionFailure(..) => {
                StoreError::Corrupt(message)
            }
            _ => StoreError::Unavailable(message),
        },
    }
}

/// How long opening waits out other processes opening (and migrating) the same file.
const OPEN_PATIENCE: Duration = Duration::from_secs(15);

impl Ruled<Sqlite> {
    /// Opens (or creates) the database at `path`, creating its directory, and brings its schema
    /// up to date. Time comes from the system clock.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with_clock(path, keel_core::clock::system())
    }

    /// [`SqliteStore::open`], reading time from `clock`.
    pub fn open_with_clock(path: &Path, clock: Arc<dyn Clock>) -> Result<SqliteStore, StoreError> {
        Ok(Ruled::with_backend(Sqlite::open(path)?, clock))
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.backend.path
    }

    /// The database's size in bytes, after folding the write-ahead log into it.
    pub fn size_bytes(&self) -> Result<u64, StoreError> {
        let connection = self.backend.lock();
        connection.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").map_err(map_error)?;
        let pages: i64 =
            connection.query_row("PRAGMA page_count", [], |row| row.get(0)).map_err(map_error)?;
        let page_size: i64 =
            connection.query_row("PRAGMA page_size", [], |row| row.get(0)).map_err(map_error)?;
        Ok((pages * page_size) as u64)
    }

    /// Rebuilds the database file without its free pages (after compaction or pruning).
    pub fn vacuum(&self) -> Result<(), StoreError> {
        self.backend.lock().execute_batch("VACUUM").map_err(map_error)
    }
}

impl Sqlite {
    fn open(path: &Path) -> Result<Sqlite, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
                    StoreError::ReadOnly(format!("cannot create {}: {e}", dir.display()))
                }
                _ => StoreError::Unavailable(format!("cannot create {}: {e}", dir.display())),
            })?;
        }
        // Processes opening a new file together contend for it while one switches it to WAL and
        // migrates it; some of those lock conflicts bypass the busy handler. Wait them out.
        let deadline = std::time::Instant::now() + OPEN_PATIENCE;
        let connection = loop {
            match open_writer(path) {
                Err(StoreError::Locked(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20 + u64::from(std::process::id() % 30)));
                }
                other => break other?,
            }
        };
        // The writer gets this connection; reads get a second one, checkpoints a third.
        let reader = connect(path).map_err(|e| with_path(map_error(e), path))?;
        reader.busy_timeout(BUSY_TIMEOUT).map_err(map_error)?;
        let checkpointer = connect(path).map_err(|e| with_path(map_error(e), path))?;
        checkpointer.busy_timeout(BUSY_TIMEOUT).map_err(map_error)?;
        let (checkpoints, wakes) = std::sync::mpsc::sync_channel(1);
        let due = checkpoints.clone();
        let mut connection = connection;
        // Replaces the automatic checkpoints (`wal_autocheckpoint` is this same hook).
        // Once per CHECKPOINT_PAGES pages written: until the checkpoint is done and a commit
        // starts the log over, every commit finds it as long.
        let mut next_at = CHECKPOINT_PAGES;
        let mut last = 0;
        connection
            .wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, pages: std::ffi::c_int| {
                if pages < last {
                    next_at = CHECKPOINT_PAGES;
                }
                last = pages;
                if pages >= next_at {
                    next_at = pages.saturating_add(CHECKPOINT_PAGES);
                    // Full: a wake-up is pending already.
                    let _ = due.try_send(());
                }
                Ok(())
            }))
            .map_err(map_error)?;
        let writer = Arc::new(Writer {
            connection: Mutex::new(WriterConnection {
                held: HeldConnection::new(connection),
                known: RefCell::default(),
            }),
            queue: Mutex::default(),
            wake: std::sync::Condvar::new(),
            _checkpoints: checkpoints,
        });
        let thread_writer = Arc::clone(&writer);
        std::thread::Builder::new()
            .name("keel-sqlite-writer".into())
            .spawn(move || writer_loop(thread_writer))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the SQLite writer thread: {e}")))?;
        let checkpoint_writer = Arc::downgrade(&writer);
        std::thread::Builder::new()
            .name("keel-sqlite-checkpoint".into())
            .spawn(move || checkpoint_loop(checkpointer, checkpoint_writer, wakes))
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the SQLite checkpoint thread: {e}"))
            })?;
        Ok(Sqlite { connection: Mutex::new(HeldConnection::new(reader)), writer, path: path.to_owned() })
    }

    fn lock(&self) -> MutexGuard<'_, HeldConnection> {
        self.connection.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Opens a connection to the file, through the VFS that writes each frame of the log in one call
/// ([`crate::wal_frames`]).
fn connect(path: &Path) -> rusqlite::Result<Connection> {
    match crate::wal_frames::vfs() {
        Some(vfs) => Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs),
        None => Connection::open(path),
    }
}

/// Opens the writer's connection: WAL mode, pragmas, and the schema brought up to date.
fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    let connection = connect(path).map_err(|e| match map_error(e) {
        StoreError::Unavailable(m) => StoreError::Unavailable(format!("cannot open {}: {m}", path.display())),
        other => other,
    })?;
    connection.busy_timeout(BUSY_TIMEOUT).map_err(map_error)?;
    // The first statement that reads the file tells a non-database from a database; another
    // application's database is refused before anything (even the journal mode) changes in it.
    refuse_foreign(&connection, path)?;
    let mode: String = connection
        .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
        .map_err(|e| with_path(map_error(e), path))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::ReadOnly(format!(
            "{} could not be put in WAL mode (it stays {mode:?}); is it on a read-only or network file system?",
            path.display()
        )));
    }
    connection
        .execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;")
        .map_err(map_error)?;
    connection.pragma_update(None, "journal_size_limit", LOG_SIZE_LIMIT).map_err(map_error)?;
    migrate(&connection, path)?;
    Ok(connection)
}

/// Refuses a database that keel did not create: no keel schema version, yet tables (another
/// application's file, given to `--store` by mistake). keel would add its tables to it.
fn refuse_foreign(connection: &Connection, path: &Path) -> Result<(), StoreError> {
    // One statement, one snapshot: another process may be migrating this new file right now,
    // and its tables and version appear together.
    let (version, tables): (i64, Option<String>) = connection
        .query_row(
            "SELECT (SELECT user_version FROM pragma_user_version), \
                    (SELECT group_concat(name, ', ') FROM \
                        (SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name LIMIT 4))",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .map_err(|e| with_path(map_error(e), path))?;
    match tables {
        Some(tables) if version == 0 => Err(StoreError::Corrupt(format!(
            "{} is another application's database (it has the tables {tables}, and no keel schema); keel \
             keeps its state in a file of its own and changed nothing in this one: give --store a new path",
            path.display(),
        ))),
        _ => Ok(()),
    }
}

fn user_version(connection: &Connection) -> Result<i64, StoreError> {
    connection.query_row("PRAGMA user_version", [], |row| row.get(0)).map_err(map_error)
}

/// Brings the schema up to date, or refuses a newer one. The version is read again under the
/// write lock: of several processes migrating a new file at once, one migrates, the others find
/// it done.
fn migrate(connection: &Connection, path: &Path) -> Result<(), StoreError> {
    let check = |version: i64| {
        if version > SCHEMA_VERSION {
            return Err(StoreError::NewerSchema { found: version, supported: SCHEMA_VERSION });
        }
        Ok(version == SCHEMA_VERSION)
    };
    if check(user_version(connection)?)? {
        return Ok(());
    }
    write(connection, |c| {
        let version = user_version(c)?;
        if check(version)? {
            return Ok(());
        }
        for (index, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            c.execute_batch(migration).map_err(map_error)?;
            c.pragma_update(None, "user_version", index as i64 + 1).map_err(map_error)?;
        }
        Ok(())
    })
    .map_err(|e| with_path(e, path))
}

/// Runs `work` in a write transaction. `BEGIN IMMEDIATE` takes the write lock up front (waiting
/// out other writers with the busy timeout) instead of failing mid-transaction; the statements
/// are cached, unlike rusqlite's `Transaction`, which parses them on every use.
fn write<T>(
    connection: &Connection,
    work: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    connection.prepare_cached("BEGIN IMMEDIATE").and_then(|mut s| s.execute([])).map_err(map_error)?;
    match work(connection) {
        Ok(value) => {
            if let Err(error) = connection.prepare_cached("COMMIT").and_then(|mut s| s.execute([])) {
                let _ = connection.prepare_cached("ROLLBACK").and_then(|mut s| s.execute([]));
                return Err(map_error(error));
            }
            Ok(value)
        }
        Err(error) => {
            let _ = connection.prepare_cached("ROLLBACK").and_then(|mut s| s.execute([]));
            Err(error)
        }
    }
}

fn with_path(error: StoreError, path: &Path) -> StoreError {
    let at = path.display();
    match error {
        StoreError::Corrupt(m) => StoreError::Corrupt(format!("{at}: {m} (is it a keel database?)")),
        StoreError::ReadOnly(m) => StoreError::ReadOnly(format!("{at}: {m}")),
        StoreError::Locked(m) => StoreError::Locked(format!("{at}: {m}")),
        StoreError::Unavailable(m) => StoreError::Unavailable(format!("{at}: {m}")),
        other => other,
    }
}

impl Backend for Sqlite {
    fn write<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = TypedJob { work: Some(work), result: None, reply };
        let mut queue = self.writer.queue();
        if queue.closed {
            return Box::pin(std::future::ready(Err(StoreError::Unavailable(
                "the SQLite store is closed".into(),
            ))));
        }
        queue.jobs.push(Box::new(job));
        let now = Instant::now();
        let alone = queue.committer == Committer::Nobody;
        let gather = if alone {
            queue.committer = Committer::Caller;
            gather_first(queue.contended_at, now)
        } else {
            // Writes come together when this one arrived while another caller's was committed,
            // or while the writer thread commits several. Not while the connection is read on,
            // or the thread makes the log start over or commits the one write that waited for
            // that: a run alone meets these (the engine looks for other processes'
            // cancellations every half second; the log starts over every few hundred runs), and
            // taken for company they had every commit of the next second yield first, each
            // waking the idle worker (three wake-ups a tool-loop run on two workers, measured).
            let together = match queue.committer {
                Committer::Caller => true,
                Committer::Thread => queue.thread_batch > 1,
                Committer::Reader | Committer::Nobody => false,
            };
            if together {
                queue.contended_at = Some(now);
            }
            false
        };
        drop(queue);
        let own = alone.then(|| CallerCommit(Some(Arc::clone(&self.writer))));
        Box::pin(async move {
            if let Some(own) = own {
                if gather {
                    // One turn of the scheduler first: writes that are ready to be made now
                    // (other runs' steps, under load) queue meanwhile, and then go to the writer
                    // thread together with this one, in one transaction.
                    tokio::task::yield_now().await;
                }
                // Alone, it commits here.
                own.run();
            }
            answer
                .await
                .unwrap_or_else(|_| Err(StoreError::Unavailable("the SQLite writer thread stopped".into())))
        })
    }

    fn read<T: Send + 'static>(&self, mut work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        // On the caller's thread: WAL lets reads run beside the writer.
        Box::pin(std::future::ready(self.read_now(|tx| work(tx))))
    }

    fn read_here<T, F: FnOnce(&mut dyn Tx) -> Result<T, StoreError>>(
        &self,
        work: F,
    ) -> Result<Result<T, StoreError>, F> {
        Ok(self.read_now(|tx| work(tx)))
    }

    fn read_session(
        &self,
        session: SessionId,
    ) -> keel_core::StoreFuture<'static, Result<SessionRows, StoreError>> {
        keel_core::StoreFuture::ready(self.read_now(|tx| tx.session_rows(&session)))
    }
}

impl Sqlite {
    /// Runs `work` as one read transaction: its statements see one snapshot (and take the
    /// database's read lock once, not once each).
    ///
    /// On the writer's connection when nobody is writing (see [`Writer::read_alone`]), else on
    /// the reader's.
    fn read_now<T>(
        &self,
        work: impl FnOnce(&mut SqliteTx<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self.writer.read_alone() {
            Some(reading) => read_on(reading.connection(), work),
            None => read_on(&self.lock(), work),
        }
    }
}

/// [`Sqlite::read_now`] on `connection`.
fn read_on<T>(
    connection: &HeldConnection,
    work: impl FnOnce(&mut SqliteTx<'_>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let exec = |sql: &'static str| connection.with_statement(sql, |s| s.execute([])).map_err(map_error);
    exec("BEGIN")?;
    let mut tx = SqliteTx::new(connection);
    let result = work(&mut tx);
    // A read transaction has nothing to commit; ending it cannot lose anything.
    if exec("COMMIT").is_err() {
        let _ = exec("ROLLBACK");
    }
    result
}

/// Storage operations on one connection (inside the writer's transaction, or a read).
struct SqliteTx<'c> {
    c: &'c HeldConnection,
    /// What the writer knows ([`Known`]), in a write transaction; `None` in a read.
    known: Option<&'c RefCell<Known>>,
}

impl<'c> SqliteTx<'c> {
    fn new(c: &'c HeldConnection) -> SqliteTx<'c> {
        SqliteTx { c, known: None }
    }

    /// In the writer's transaction, with what it knows.
    fn writing(c: &'c WriterConnection) -> SqliteTx<'c> {
        SqliteTx { c, known: Some(&c.known) }
    }

    /// Tells [`Known`], in a write transaction.
    fn learn(&self, learn: impl FnOnce(&mut Known)) {
        if let Some(known) = self.known {
            learn(&mut known.borrow_mut());
        }
    }

    fn execute(&self, sql: &'static str, params: impl rusqlite::Params) -> Result<usize, StoreError> {
        self.c.with_statement(sql, |s| s.execute(params)).map_err(map_error)
    }

    /// The first row `sql` gives for `params`, as `map` makes it; `None` if it gives none.
    fn query_row<T>(
        &self,
        sql: &'static str,
        params: impl rusqlite::Params,
        map: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Option<T>, StoreError> {
        self.c.with_statement(sql, |s| s.query_row(params, map).optional()).map_err(map_error)
    }

    /// Every row `sql` gives for `params`, as `map` makes them.
    fn query_rows<T>(
        &self,
        sql: &'static str,
        params: impl rusqlite::Params,
        map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, StoreError> {
        self.c.with_statement(sql, |s| s.query_map(params, map)?.collect()).map_err(map_error)
    }

    /// What a new run of `session` starts from ([`SessionRows`]), in as few statements as the
    /// session needs: its row first ([`SESSION_HEAD`]: message count, state, whether a run of
    /// it is unfinished), then its messages and its unfinished run only where there are some.
    /// A new session, the most common kind `keel serve` sees, is one statement instead of three.
    fn session_rows(&mut self, session: &SessionId) -> Result<SessionRows, StoreError> {
        let (count, state, open): (Option<i64>, Option<String>, bool) = self
            .c
            .with_statement(SESSION_HEAD, |s| {
                s.query_row([session.as_str()], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            })
            .map_err(map_error)?;
        let messages = if count.unwrap_or(0) > 0 { self.messages(session)? } else { Vec::new() };
        let state = decode_state(state)?;
        let open_run = if open { self.open_runs(Some(session))?.into_iter().next() } else { None };
        Ok(SessionRows { messages, state, open_run })
    }
}

/// A session's state object as `sessions.state` holds it (JSON text; `NULL`: none).
fn decode_state(stored: Option<String>) -> Result<Option<serde_json::Value>, StoreError> {
    stored.map(|json| serde_json::from_str(&json).map_err(corrupt)).transpose()
}

/// A run's [`RunControl`], read by [`control_row`]. A whole statement rather than a list of
/// columns to format into one: a commit reads its run's control up to four times, and a
/// statement is held only for SQL that is `'static` ([`crate::held`]).
const CONTROL_SELECT: &str = "SELECT session_id, state, lease_owner, lease_expires_at, lease_epoch, attempts,
       cancel_requested_by FROM runs WHERE id = ?1";

/// A row of [`CONTROL_SELECT`]'s columns, starting at column `at`.
fn control_row(row: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<Result<RunControl, StoreError>> {
    let session: String = row.get(at)?;
    let state: String = row.get(at + 1)?;
    let owner: Option<String> = row.get(at + 2)?;
    let expires: Option<i64> = row.get(at + 3)?;
    let epoch: i64 = row.get(at + 4)?;
    let attempts: i64 = row.get(at + 5)?;
    let cancel: Option<String> = row.get(at + 6)?;
    Ok((|| {
        Ok(RunControl {
            session: SessionId::from_store(session).map_err(corrupt)?,
            state: stored_state(&state)?,
            owner: owner.map(Arc::from),
            lease_expires_ms: expires.unwrap_or(0).max(0) as u64,
            epoch: epoch.max(0) as u64,
            attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
            cancel_requested_by: cancel,
        })
    })())
}

impl Tx for SqliteTx<'_> {
    fn message_count(&mut self, session: &SessionId) -> Result<u64, StoreError> {
        if let Some(count) = self.known.and_then(|known| known.borrow().message_counts.get(session).copied())
        {
            return Ok(count);
        }
        let count = self.query_row(MESSAGE_COUNT, [session.as_str()], |row| row.get::<_, Option<i64>>(0))?;
        let count = count.flatten().unwrap_or(0).max(0) as u64;
        self.learn(|known| known.learn_message_count(session, count));
        Ok(count)
    }

    fn message_writer(&mut self, session: &SessionId, position: u64) -> Result<Option<RunId>, StoreError> {
        let writer: Option<String> = self.query_row(
            "SELECT run_id FROM messages WHERE session_id = ?1 AND position = ?2",
            params![session.as_str(), position as i64],
            |row| row.get(0),
        )?;
        writer.map(|w| stored_run_id(&w)).transpose()
    }

    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
        _now_ms: u64,
    ) -> Result<(), StoreError> {
        // The session's row is not written: its message count is its messages' (version 13),
        // and its time moves on when a run starts and when a step adds tokens.
        for (offset, message) in messages.iter().enumerate() {
            self.execute(
                "INSERT INTO messages (session_id, position, run_id, body) VALUES (?1, ?2, ?3, ?4)",
                params![
                    session.as_str(),
                    (first_position + offset as u64) as i64,
                    run.as_str(),
                    encode_message(message)
                ],
            )?;
        }
        let count = first_position + messages.len() as u64;
        self.learn(|known| known.learn_message_count(session, count));
        Ok(())
    }

    fn messages(&mut self, session: &SessionId) -> Result<Vec<Arc<Message>>, StoreError> {
        // Decoded as read, from the text SQLite holds: no copy of it.
        let decode = |row: &rusqlite::Row<'_>| {
            Ok(decode_message(row.get_ref(0)?.as_str()?).map(Arc::new).map_err(corrupt))
        };
        self.query_rows(
            "SELECT body FROM messages WHERE session_id = CAST(?1 AS TEXT) ORDER BY position",
            [session.as_str()],
            decode,
        )?
        .into_iter()
        .collect()
    }

    fn add_usage(&mut self, session: &SessionId, usage: Usage, now_ms: u64) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO sessions (id, created_at, updated_at, input_tokens, output_tokens) VALUES (?1, ?2, ?2, ?3, ?4)
             ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at,
               input_tokens = input_tokens + excluded.input_tokens, output_tokens = output_tokens + excluded.output_tokens",
            params![session.as_str(), now_ms as i64, signed(usage.input_tokens), signed(usage.output_tokens)],
        )
        .map(drop)
    }

    fn set_session_state(
        &mut self,
        session: &SessionId,
        state: &serde_json::Value,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO sessions (id, created_at, updated_at, state) VALUES (?1, ?2, ?2, ?3)
             ON CONFLICT (id) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            params![session.as_str(), now_ms as i64, state.to_string()],
        )
        .map(drop)
    }

    fn session_state(&mut self, session: &SessionId) -> Result<Option<serde_json::Value>, StoreError> {
        let state: Option<Option<String>> =
            self.query_row("SELECT state FROM sessions WHERE id = ?1", [session.as_str()], |row| row.get(0))?;
        decode_state(state.flatten())
    }

    fn session_summary(&mut self, session: &SessionId) -> Result<Option<SessionSummary>, StoreError> {
        self.c
            .prepare_cached(&format!("{SUMMARY_SELECT} WHERE s.id = ?1"))
            .and_then(|mut s| s.query_row([session.as_str()], summary_row).optional())
            .map_err(map_error)
            .and_then(Option::transpose)
    }

    fn sessions(&mut self, filter: &SessionFilter) -> Result<Vec<SessionSummary>, StoreError> {
        let (kind, prefix) = scope_parameters(&filter.scope);
        let limit = filter.limit.map_or(-1, |limit| i64::try_from(limit).unwrap_or(i64::MAX));
        let mut statement = self
            .c
            .prepare_cached(&format!(
                "{SUMMARY_SELECT} WHERE ?1 = 0 OR (?1 = 1 AND instr(s.id, '{separator}') = 0)
                   OR (?1 = 2 AND substr(s.id, 1, length(?2)) = ?2)
                 ORDER BY s.updated_at DESC, s.id LIMIT ?3",
                separator = SessionId::SCOPE_SEPARATOR
            ))
            .map_err(map_error)?;
        let rows = statement.query_map(params![kind, prefix, limit], summary_row).map_err(map_error)?;
        rows.map(|row| row.map_err(map_error)?).collect()
    }

    fn delete_session(&mut self, session: &SessionId) -> Result<bool, StoreError> {
        let id = session.as_str();
        self.execute(DELETE_SESSION_JOURNALS, [id])?;
        self.execute("DELETE FROM pending_inputs WHERE session_id = ?1", [id])?;
        self.execute("DELETE FROM decided_inputs WHERE session_id = ?1", [id])?;
        let runs = self.execute(DELETE_SESSION_RUNS, [id])?;
        self.execute("DELETE FROM messages WHERE session_id = ?1", [id])?;
        let sessions = self.execute("DELETE FROM sessions WHERE id = ?1", [id])?;
        self.learn(Known::forget);
        Ok(runs + sessions > 0)
    }

    fn insert_run(
        &mut self,
        record: &RunRecord,
        control: &RunControl,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at,
               lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by, limits)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            params![
                record.run_id.as_str(),
                record.session_id.as_str(),
                encode_message(&record.input),
                record.history_len as i64,
                record.call_base as i64,
                control.state.as_str(),
                now_ms as i64,
                control.owner.as_deref(),
                control.lease_expires_ms as i64,
                control.epoch as i64,
                i64::from(control.attempts),
                control.cancel_requested_by,
                stored_limits(record),
            ],
        )?;
        // The session's row: made by its first run, its time moved on by each run that starts.
        self.execute(
            "INSERT INTO sessions (id, created_at, updated_at) VALUES (?1, ?2, ?2)
             ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at",
            params![record.session_id.as_str(), now_ms as i64],
        )?;
        self.learn(|known| known.learn_control(&record.run_id, control));
        Ok(())
    }

    fn run(&mut self, run: &RunId) -> Result<Option<RunRecord>, StoreError> {
        let row = self.query_row(
            "SELECT session_id, input, history_len, call_base, state, limits FROM runs WHERE id = ?1",
            [run.as_str()],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, i64>(3)?,
                    row.get::<_, String>(4)?,
                    row.get::<_, Option<String>>(5)?,
                ))
            },
        )?;
        let Some((session, input, history_len, call_base, state, limits)) = row else { return Ok(None) };
        Ok(Some(RunRecord {
            run_id: run.clone(),
            session_id: SessionId::from_store(session).map_err(corrupt)?,
            input: Arc::new(decode_message(&input).map_err(corrupt)?),
            history_len: history_len.max(0) as u64,
            call_base: call_base.max(0) as u64,
            state: stored_state(&state)?,
            limits: read_limits(limits.as_deref())?,
        }))
    }

    fn control(&mut self, run: &RunId) -> Result<Option<RunControl>, StoreError> {
        if let Some(control) = self.known.and_then(|known| known.borrow().controls.get(run).cloned()) {
            return Ok(Some(control));
        }
        let control = self
            .query_row(CONTROL_SELECT, [run.as_str()], |row| control_row(row, 0))
            .and_then(Option::transpose)?;
        if let Some(control) = &control {
            self.learn(|known| known.learn_control(run, control));
        }
        Ok(control)
    }

    fn set_control(&mut self, run: &RunId, control: &RunControl, now_ms: u64) -> Result<(), StoreError> {
        let changed = self.execute(
            "UPDATE runs SET state = ?2, lease_owner = ?3, lease_expires_at = ?4, lease_epoch = ?5,
               attempts = ?6, cancel_requested_by = ?7, updated_at = ?8
             WHERE id = ?1",
            params![
                run.as_str(),
                control.state.as_str(),
                control.owner.as_deref(),
                control.lease_expires_ms as i64,
                control.epoch as i64,
                i64::from(control.attempts),
                control.cancel_requested_by,
                now_ms as i64,
            ],
        )?;
        if changed == 1 {
            self.learn(|known| known.learn_control(run, control));
        }
        Ok(())
    }

    fn cancel_requested(&mut self, owner: &str) -> Result<Vec<RunId>, StoreError> {
        let ids = self.query_rows(CANCEL_REQUESTED, [owner], |row| row.get::<_, String>(0))?;
        let mut runs = ids.iter().map(|id| stored_run_id(id)).collect::<Result<Vec<_>, _>>()?;
        // Sorted here: `runs_by_state` gives them by session (see `open_runs`).
        runs.sort_unstable();
        Ok(runs)
    }

    fn open_runs(&mut self, session: Option<&SessionId>) -> Result<Vec<(RunId, RunControl)>, StoreError> {
        // Two statements, not one with `?1 IS NULL OR session_id = ?1`: that form keeps SQLite
        // from the per-session index, and a new run's busy check would scan every open run.
        let (sql, session) = match session {
            Some(session) => (OPEN_RUNS_OF_SESSION, Some(session.as_str())),
            None => (OPEN_RUNS, None),
        };
        let row = |row: &rusqlite::Row<'_>| Ok((row.get::<_, String>(0)?, control_row(row, 1)?));
        let rows = match session {
            Some(session) => self.query_rows(sql, [session], row)?,
            None => self.query_rows(sql, [], row)?,
        };
        let mut open = rows
            .into_iter()
            .map(|(id, control)| Ok((stored_run_id(&id)?, control?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        // Sorted here, not by `ORDER BY`: across the two lookups of the query SQLite would sort
        // in a temporary B-tree, which it builds at every execution, even for no rows. Run ids
        // are time-ordered, and compare as SQL's `BINARY` collation does.
        open.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(open)
    }

    fn has_step(&mut self, run: &RunId, step: &StepName) -> Result<bool, StoreError> {
        self.c
            .with_statement("SELECT 1 FROM journal WHERE run_id = ?1 AND step = ?2", |s| {
                s.exists(params![run.as_str(), step.to_string()])
            })
            .map_err(map_error)
    }

    fn append_journal(&mut self, run: &RunId, entry: &Arc<JournalEntry>) -> Result<bool, StoreError> {
        self.execute(
            "INSERT INTO journal (run_id, step, seq, body)
             VALUES (?1, ?2, (SELECT COUNT(*) FROM journal WHERE run_id = ?1), ?3)
             ON CONFLICT (run_id, step) DO NOTHING",
            params![run.as_str(), entry.step.to_string(), encode_record(&entry.record)],
        )
        .map(|inserted| inserted == 1)
    }

    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError> {
        let mut rows = self.query_rows(
            "SELECT seq, step, body FROM journal WHERE run_id = CAST(?1 AS TEXT)",
            [run.as_str()],
            |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?, row.get::<_, String>(2)?)),
        )?;
        // In write order; sorted here for the reason given in `open_runs`.
        rows.sort_unstable_by_key(|(seq, _, _)| *seq);
        rows.into_iter()
            .map(|(_, step, body)| {
                let step =
                    StepName::parse(&step).ok_or_else(|| corrupt(format!("bad step name {step:?}")))?;
                Ok(JournalEntry { step, record: decode_record(&body).map_err(corrupt)? })
            })
            .collect()
    }

    fn compact_journals(&mut self) -> Result<u64, StoreError> {
        self.execute(COMPACT_JOURNALS, []).map(|removed| removed as u64)
    }

    fn pending(&mut self, id: &str) -> Result<Option<PendingInput>, StoreError> {
        self.query_row(
            "SELECT id, run_id, session_id, call_id, body, created_at, expires_at FROM pending_inputs
                 WHERE id = ?1",
            [id],
            pending_from_row,
        )
        .and_then(Option::transpose)
    }

    fn pending_list(&mut self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, StoreError> {
        // Two statements, for the index (see `open_runs`).
        let (sql, session) = match session {
            Some(session) => (PENDING_OF_SESSION, Some(session.as_str())),
            None => (PENDING, None),
        };
        let row = |row: &rusqlite::Row<'_>| Ok((row.get::<_, i64>(7)?, pending_from_row(row)?));
        let rows = match session {
            Some(session) => self.query_rows(sql, [session], row)?,
            None => self.query_rows(sql, [], row)?,
        };
        let mut pending = rows
            .into_iter()
            .map(|(rowid, pending)| Ok((rowid, pending?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        // Oldest first, ties in the order they were stored; sorted here for the reason given in
        // `open_runs`.
        pending.sort_unstable_by_key(|(rowid, p)| (p.created_at_ms, *rowid));
        Ok(pending.into_iter().map(|(_, p)| p).collect())
    }

    fn insert_pending(&mut self, pending: &PendingInput) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO pending_inputs (id, run_id, session_id, call_id, step, body, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                pending.id,
                pending.run_id.as_str(),
                pending.session_id.as_str(),
                pending.call_id,
                pending.step().to_string(),
                encode_pending_kind(&pending.kind),
                pending.created_at_ms as i64,
                pending.expires_at_ms as i64,
            ],
        )
        .map(drop)
    }

    fn delete_pending(&mut self, id: &str) -> Result<(), StoreError> {
        self.execute("DELETE FROM pending_inputs WHERE id = ?1", [id]).map(drop)
    }

    fn decided(&mut self, id: &str) -> Result<Option<DecidedInput>, StoreError> {
        let row = self.query_row(
            "SELECT run_id, session_id, outcome, by_whom, at FROM decided_inputs WHERE id = ?1",
            [id],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, i64>(4)?,
                ))
            },
        )?;
        let Some((run, session, outcome, by, at)) = row else { return Ok(None) };
        Ok(Some(DecidedInput {
            id: id.to_owned(),
            run_id: stored_run_id(&run)?,
            session_id: SessionId::from_store(session).map_err(corrupt)?,
            outcome,
            by,
            at_ms: at.max(0) as u64,
        }))
    }

    fn insert_decided(&mut self, decided: &DecidedInput) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO decided_inputs (id, run_id, session_id, outcome, by_whom, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (id) DO UPDATE SET outcome = excluded.outcome, by_whom = excluded.by_whom, at = excluded.at",
            params![
                decided.id,
                decided.run_id.as_str(),
                decided.session_id.as_str(),
                decided.outcome,
                decided.by,
                decided.at_ms as i64,
            ],
        )
        .map(drop)
    }

    fn schedule_last_fire(&mut self, name: &str) -> Result<Option<u64>, StoreError> {
        let tick = self.query_row("SELECT last_fire FROM schedules WHERE name = ?1", [name], |row| {
            row.get::<_, i64>(0)
        })?;
        Ok(tick.map(|t| t.max(0) as u64))
    }

    fn set_schedule_last_fire(&mut self, name: &str, tick_ms: u64) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO schedules (name, last_fire) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET last_fire = excluded.last_fire",
            params![name, tick_ms as i64],
        )
        .map(drop)
    }

    fn delayed_run(&mut self, run: &RunId) -> Result<Option<DelayedRunRecord>, StoreError> {
        let row = self.query_row(
            "SELECT session_id, input, due_at, source, state, created_at, held_until, attempts, note
                 FROM delayed_runs WHERE run_id = ?1",
            [run.as_str()],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, String>(4)?,
                    row.get::<_, i64>(5)?,
                    row.get::<_, i64>(6)?,
                    row.get::<_, i64>(7)?,
                    row.get::<_, Option<String>>(8)?,
                ))
            },
        )?;
        let Some((session, input, due, source, state, created, held, attempts, note)) = row else {
            return Ok(None);
        };
        Ok(Some(DelayedRunRecord {
            run: DelayedRun {
                run_id: run.clone(),
                session_id: SessionId::from_store(session).map_err(corrupt)?,
                input: decode_message(&input).map_err(corrupt)?,
                due_ms: due.max(0) as u64,
                source,
            },
            state: stored_delayed_state(&state)?,
            created_ms: created.max(0) as u64,
            held_until_ms: held.max(0) as u64,
            attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
            note,
        }))
    }

    fn put_delayed_run(&mut self, record: &DelayedRunRecord) -> Result<(), StoreError> {
        let run = &record.run;
        self.execute(
            "INSERT INTO delayed_runs (run_id, session_id, input, due_at, source, state, created_at, held_until,
             attempts, note) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
             ON CONFLICT (run_id) DO UPDATE SET state = excluded.state, held_until = excluded.held_until,
             attempts = excluded.attempts, note = excluded.note",
            params![
                run.run_id.as_str(),
                run.session_id.as_str(),
                encode_message(&run.input),
                run.due_ms as i64,
                run.source,
                record.state.as_str(),
                record.created_ms as i64,
                record.held_until_ms as i64,
                i64::from(record.attempts),
                record.note,
            ],
        )
        .map(drop)
    }

    fn due_delayed_runs(&mut self, now_ms: u64, limit: usize) -> Result<Vec<RunId>, StoreError> {
        let ids = self.query_rows(
            "SELECT run_id FROM delayed_runs WHERE state = 'waiting' AND due_at <= ?1 AND held_until <= ?1
                 ORDER BY due_at, run_id LIMIT ?2",
            params![now_ms as i64, limit as i64],
            |row| row.get::<_, String>(0),
        )?;
        ids.iter().map(|id| stored_run_id(id)).collect()
    }

    fn memory_item(&mut self, owner: &str, kind: &str, key: &str) -> Result<Option<MemoryItem>, StoreError> {
        let row = self.query_row(
            "SELECT value, updated_at FROM memories WHERE owner = ?1 AND kind = ?2 AND key = ?3",
            [owner, kind, key],
            |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
        )?;
        row.map(|(value, at)| memory_item(kind.to_owned(), key.to_owned(), &value, at)).transpose()
    }

    fn put_memory_item(&mut self, owner: &str, item: &MemoryItem) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO memories (owner, kind, key, value, updated_at) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (owner, kind, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            params![owner, item.kind, item.key, item.value.to_string(), item.updated_ms as i64],
        )
        .map(drop)
    }

    fn memory_items(&mut self, owner: &str, kind: Option<&str>) -> Result<Vec<MemoryItem>, StoreError> {
        let rows = self.query_rows(
            "SELECT kind, key, value, updated_at FROM memories WHERE owner = ?1 AND (?2 IS NULL OR kind = ?2)
                 ORDER BY updated_at DESC, key",
            params![owner, kind],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, i64>(3)?,
                ))
            },
        )?;
        rows.into_iter().map(|(kind, key, value, at)| memory_item(kind, key, &value, at)).collect()
    }

    fn delete_memory(
        &mut self,
        owner: &str,
        kind: Option<&str>,
        key: Option<&str>,
    ) -> Result<u64, StoreError> {
        self.execute(
            "DELETE FROM memories WHERE owner = ?1 AND (?2 IS NULL OR kind = ?2) AND (?3 IS NULL OR key = ?3)",
            params![owner, kind, key],
        )
        .map(|n| n as u64)
    }

    fn memory_owners(&mut self) -> Result<Vec<MemoryOwner>, StoreError> {
        let rows = self.query_rows("SELECT owner, kind, count(*), max(updated_at) FROM memories GROUP BY owner, kind ORDER BY owner, kind", [], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, i64>(3)?,
                ))
            })?;
        Ok(memory_owner_rows(rows.into_iter().map(|(o, k, n, at)| (o, k, n.max(0) as u64, at.max(0) as u64))))
    }
}

/// Every unfinished run, with its control columns (in no order: see `open_runs`). One lookup
/// per state, not `state IN (...)`: SQLite seeks an index through an `IN` list by first building
/// a temporary B-tree of its values, at every execution (a tenth of a durable run's work,
/// measured).
const OPEN_RUNS: &str = "SELECT id, session_id, state, lease_owner, lease_expires_at, lease_epoch, attempts,
    cancel_requested_by FROM runs WHERE state = 'running'
    UNION ALL SELECT id, session_id, state, lease_owner, lease_expires_at, lease_epoch, attempts,
    cancel_requested_by FROM runs WHERE state = 'awaiting_input'";

/// A session's unfinished runs (the `runs_by_state` index; see the module docs for the `CAST`),
/// as [`OPEN_RUNS`].
const OPEN_RUNS_OF_SESSION: &str = "SELECT id, session_id, state, lease_owner, lease_expires_at, lease_epoch,
    attempts, cancel_requested_by FROM runs WHERE session_id = CAST(?1 AS TEXT) AND state = 'running'
    UNION ALL SELECT id, session_id, state, lease_owner, lease_expires_at, lease_epoch,
    attempts, cancel_requested_by FROM runs WHERE session_id = CAST(?1 AS TEXT) AND state = 'awaiting_input'";

/// The running runs leased to an owner whose cancellation was requested (the running runs,
/// through `runs_by_state`; in no order: see `cancel_requested`).
const CANCEL_REQUESTED: &str =
    "SELECT id FROM runs WHERE state = 'running' AND lease_owner = CAST(?1 AS TEXT)
    AND cancel_requested_by IS NOT NULL";

/// The journals of a session's runs, and its runs (`runs_by_state`, one seek per state), for
/// `delete_session`.
const DELETE_SESSION_JOURNALS: &str = concat!(
    "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE state IN ",
    every_state!(),
    " AND session_id = ?1)"
);
const DELETE_SESSION_RUNS: &str =
    concat!("DELETE FROM runs WHERE state IN ", every_state!(), " AND session_id = ?1");

/// The journals of finished runs, for `compact_journals`.
const COMPACT_JOURNALS: &str = "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE state IN ('done', 'failed', 'cancelled'))";

/// A session's row as [`SqliteTx::session_rows`] reads it: one row whether the session exists
/// or not (its columns `NULL` if not): its message count ([`MESSAGE_COUNT`]), its state, and
/// whether it has an unfinished run (`runs_by_state`, one seek per unfinished state).
const SESSION_HEAD: &str =
    "SELECT (SELECT MAX(position) + 1 FROM messages WHERE session_id = CAST(?1 AS TEXT)),
    (SELECT state FROM sessions WHERE id = ?1),
    EXISTS (SELECT 1 FROM runs WHERE state = 'running' AND session_id = CAST(?1 AS TEXT))
    OR EXISTS (SELECT 1 FROM runs WHERE state = 'awaiting_input' AND session_id = CAST(?1 AS TEXT))";

/// A session's message count: one past its last message's position (`NULL`: none), one seek at
/// the end of its messages' range of the primary key. (`CAST`: see the module docs.)
const MESSAGE_COUNT: &str = "SELECT MAX(position) + 1 FROM messages WHERE session_id = CAST(?1 AS TEXT)";

/// Every pending input, with its rowid (the order it was stored in); sorted by `pending_list`.
const PENDING: &str =
    "SELECT id, run_id, session_id, call_id, body, created_at, expires_at, rowid FROM pending_inputs";

/// A session's pending inputs (the `pending_by_session` index; see the module docs for the
/// `CAST`), as [`PENDING`].
const PENDING_OF_SESSION: &str = "SELECT id, run_id, session_id, call_id, body, created_at, expires_at, rowid
    FROM pending_inputs WHERE session_id = CAST(?1 AS TEXT)";

/// The columns of a [`SessionSummary`], for [`summary_row`].
const SUMMARY_SELECT: &str = concat!(
    "SELECT s.id, s.updated_at, (SELECT COALESCE(MAX(m.position) + 1, 0) FROM messages m WHERE m.session_id = s.id),
    (SELECT COUNT(*) FROM runs r WHERE r.state IN ",
    every_state!(),
    " AND r.session_id = s.id), s.input_tokens, s.output_tokens
    FROM sessions s"
);

/// A row of [`SUMMARY_SELECT`]; the inner error is a stored id that does not decode.
fn summary_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Result<SessionSummary, StoreError>> {
    let id: String = row.get(0)?;
    let count = |i: usize| row.get::<_, i64>(i).map(|n| n.max(0) as u64);
    let (updated_at, messages, runs, input, output) = (count(1)?, count(2)?, count(3)?, count(4)?, count(5)?);
    Ok(SessionId::from_store(id).map_err(corrupt).map(|id| SessionSummary {
        id,
        messages,
        runs,
        updated_at_ms: updated_at,
        usage: Usage { input_tokens: input, output_tokens: output },
    }))
}

/// Reads a `pending_inputs` row (the columns of [`Tx::pending_list`]'s query).
fn pending_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Result<PendingInput, StoreError>> {
    let (id, run, session, call_id, body): (String, String, String, String, String) =
        (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?);
    let (created_at, expires_at): (i64, i64) = (row.get(5)?, row.get(6)?);
    Ok((|| {
        Ok(PendingInput {
            id,
            run_id: stored_run_id(&run)?,
            session_id: SessionId::from_store(session).map_err(corrupt)?,
            call_id,
            kind: decode_pending_kind(&body).map_err(corrupt)?,
            created_at_ms: created_at.max(0) as u64,
            expires_at_ms: expires_at.max(0) as u64,
        })
    })())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::Store;

    #[tokio::test]
    async fn sqlite_store_conforms() {
        let dir = tempfile::tempdir().unwrap();
        let clock = keel_core::ManualClock::starting_now();
        let store =
            SqliteStore::open_with_clock(&dir.path().join("keel.db"), Arc::new(clock.clone())).unwrap();
        crate::conformance::run_all(&store, &clock).await;
    }

    #[tokio::test]
    async fn data_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/dir/keel.db");
        let session = SessionId::new("s").unwrap();
        {
            let store = SqliteStore::open(&path).unwrap();
            let record = crate::conformance::run_record("r", &session, 0);
            crate::conformance::create_run(&store, &record).await.unwrap();
            crate::conformance::append_messages(
                &store,
                &session,
                &record.run_id,
                0,
                &[Arc::new(Message::user("hello"))],
            )
            .await
            .unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(store.load_messages(&session).await.unwrap(), [Arc::new(Message::user("hello"))]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_stores_on_one_file_fire_each_schedule_tick_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let stores =
            [Arc::new(SqliteStore::open(&path).unwrap()), Arc::new(SqliteStore::open(&path).unwrap())];
        let tasks: Vec<_> = stores
            .iter()
            .map(|store| {
                let store = Arc::clone(store);
                tokio::spawn(async move {
                    let mut won = 0;
                    for tick in 1..=200u64 {
                        won += u64::from(
                            store.claim_schedule_tick("every-minute", tick * 60_000, None).await.unwrap(),
                        );
                    }
                    won
                })
            })
            .collect();
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        assert_eq!(total, 200, "each tick must fire exactly once across both stores");
    }

    /// Another process's commits between two of this store's are seen by its next commit,
    /// though its writer keeps the run's lease and the session's length from one transaction
    /// to the next ([`Known`]): a takeover fences it off, and a new run of the session appends
    /// after what the other process wrote.
    #[tokio::test]
    async fn what_another_connection_commits_is_seen_by_the_next_commit() {
        use keel_core::{Claim, Fence, RunState, StepCommit};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let (here, there) = (SqliteStore::open(&path).unwrap(), SqliteStore::open(&path).unwrap());
        let session = SessionId::new("shared").unwrap();
        let first = crate::conformance::run_record("first", &session, 0);
        let run = &first.run_id;
        let minute = Duration::from_secs(60);
        let a = Fence { owner: "process-a", epoch: 1, ttl: minute };
        let b = Fence { owner: "process-b", epoch: 2, ttl: minute };
        let (question, answer) = ([Arc::new(Message::user("q"))], [Arc::new(Message::assistant("a"))]);
        let step = |position: u64, messages, fence| StepCommit {
            first_position: position,
            messages,
            fence: Some(fence),
            ..StepCommit::new(&session, run)
        };
        here.commit_step(StepCommit { new_run: Some(&first), ..step(0, &question, a) }).await.unwrap();
        here.commit_step(step(1, &answer, a)).await.unwrap();

        let claim = there.claim_run(run, "process-b", minute, Some("process-a")).await.unwrap();
        assert!(matches!(claim, Claim::Claimed { epoch: 2, .. }), "{claim:?}");
        there.commit_step(StepCommit { state: Some(RunState::Done), ..step(2, &question, b) }).await.unwrap();

        let stale = here.commit_step(step(3, &answer, a)).await.unwrap_err();
        assert!(matches!(stale, StoreError::LeaseLost(_)), "the taken-over writer still wrote: {stale:?}");
        let second = crate::conformance::run_record("second", &session, 3);
        let next = StepCommit {
            new_run: Some(&second),
            first_position: 3,
            messages: &question,
            fence: Some(a),
            ..StepCommit::new(&session, &second.run_id)
        };
        here.commit_step(next).await.unwrap();
        let texts: Vec<String> =
            here.load_messages(&session).await.unwrap().iter().map(|m| m.text()).collect();
        assert_eq!(texts, ["q", "a", "q", "q"]);
    }

    /// The most parks of the workers [`lone_runs_after`]'s 150 commits may cause. Committing at
    /// once, they cause two on an idle machine; yielding first, one or nearly one per commit
    /// (89-146, measured). A loaded machine adds some: 30 seen once, with the whole suite and a
    /// profiler sharing the two cores (most likely commits that found the writer thread, which
    /// the kernel had set aside, still holding the connection, and waited for it).
    const MOST_PARKS: u64 = 50;

    /// How many times the runtime's workers have parked so far (each park after a wake-up).
    fn parks(runtime: &tokio::runtime::Handle) -> u64 {
        let metrics = runtime.metrics();
        (0..metrics.num_workers()).map(|worker| metrics.worker_park_count(worker)).sum()
    }

    #[test]
    fn a_lone_run_on_a_multi_thread_runtime_wakes_no_idle_worker() {
        // A commit that yields first makes its worker run dry of tasks and wake the idle one
        // (89 and 119 parks for these 150 commits, measured); committing at once leaves the idle
        // worker asleep (two parks in all, measured).
        let parked = lone_runs_after(Meeting::Nothing);
        assert!(parked <= MOST_PARKS, "{parked} parks of the workers for 150 commits one at a time");
    }

    /// What a run alone meets on its store before [`lone_runs_after`] counts the wake-ups of
    /// its commits.
    #[derive(Clone, Copy, Debug)]
    enum Meeting {
        /// Nothing: its writes were the only ones.
        Nothing,
        /// Its write queued behind a restart of the log.
        RestartOfTheLog,
        /// Its write arrived while another task read on the writer's connection.
        ReadOnTheWritersConnection,
    }

    /// Parks of a two-worker runtime's workers while 50 runs commit one at a time (three commits
    /// each), after a write that met `meeting`.
    fn lone_runs_after(meeting: Meeting) -> u64 {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let store = Arc::new(SqliteStore::open(&path).unwrap());
        runtime.block_on(async {
            store.claim_schedule_tick("warm-up", 60_000, None).await.unwrap();
            match meeting {
                Meeting::Nothing => {}
                Meeting::RestartOfTheLog => {
                    // Another process's reader keeping a snapshot that the log has moved past:
                    // the writer thread's restart waits `RESTART_PATIENCE` for it, so the write
                    // below surely queues behind the restart.
                    let reader = Connection::open(&path).unwrap();
                    reader.execute_batch("BEGIN; SELECT count(*) FROM schedules;").unwrap();
                    store.claim_schedule_tick("moved-on", 60_000, None).await.unwrap();
                    store.backend().writer.restart_log_soon();
                    store.claim_schedule_tick("behind-the-restart", 60_000, None).await.unwrap();
                    reader.execute_batch("COMMIT").unwrap();
                }
                Meeting::ReadOnTheWritersConnection => {
                    let writer = Arc::clone(&store.backend().writer);
                    let reading = writer.read_alone().expect("nobody writes");
                    let shared = Arc::clone(&store);
                    let write = runtime.spawn(async move {
                        shared.claim_schedule_tick("during-a-read", 60_000, None).await
                    });
                    while writer.queue().jobs.is_empty() {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    drop(reading);
                    assert!(write.await.unwrap().unwrap());
                }
            }
        });
        runtime
            .block_on(runtime.spawn(async move {
                let before = parks(&tokio::runtime::Handle::current());
                for n in 0..50 {
                    // A run's commits, one at a time: its first step (creating it), a step, its end.
                    let session = SessionId::new(format!("s{n}")).unwrap();
                    let record = crate::conformance::run_record(&format!("r{n}"), &session, 0);
                    let run = &record.run_id;
                    crate::conformance::create_run(&*store, &record).await.unwrap();
                    let said = [Arc::new(Message::assistant("hello"))];
                    crate::conformance::append_messages(&*store, &session, run, 0, &said).await.unwrap();
                    crate::conformance::set_run_state(&*store, &session, run, keel_core::RunState::Done)
                        .await
                        .unwrap();
                }
                parks(&tokio::runtime::Handle::current()) - before
            }))
            .unwrap()
    }

    #[test]
    fn a_write_that_met_no_other_write_does_not_make_the_next_ones_wait_for_company() {
        // Taken for writes coming together, such a write had each of the next commits yield
        // first and wake the idle worker (146 parks for these 150 commits after a restart of
        // the log, measured); committing at once leaves the idle worker asleep.
        for meeting in [Meeting::RestartOfTheLog, Meeting::ReadOnTheWritersConnection] {
            let parked = lone_runs_after(meeting);
            assert!(
                parked <= MOST_PARKS,
                "{parked} parks of the workers for 150 commits one at a time after {meeting:?}"
            );
        }
    }

    /// Makes 100 schedule-tick writes at once on a new store, each in a task of its own, and
    /// checks that they shared commits.
    async fn writes_made_together_share_commits() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("keel.db")).unwrap());
        let writes = 100;
        // Each commit appends the pages it changed to the write-ahead log: one commit per write
        // would append at least one frame (a page and its 24-byte header) per write. The log
        // already holds the schema's pages.
        let frame = 24
            + store.backend().lock().query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0)).unwrap()
                as u64;
        let log = dir.path().join("keel.db-wal");
        let frames = || std::fs::metadata(&log).unwrap().len().saturating_sub(32) / frame;
        let before = frames();
        // One task spawns them all before any of them runs: a task spawned in a worker waits in
        // that worker's queue until the spawning task lets go of the thread. (Spawned from the
        // test's own thread, the worker would start the first ones while the rest are spawned.)
        // (The test keeps its store: the last connection to close deletes the log.)
        let shared = Arc::clone(&store);
        let spawner = tokio::spawn(async move {
            let tasks: Vec<_> = (0..writes)
                .map(|n| {
                    let store = Arc::clone(&shared);
                    tokio::spawn(async move {
                        store.claim_schedule_tick(&format!("schedule-{n}"), 60_000, None).await
                    })
                })
                .collect();
            for task in tasks {
                assert!(task.await.unwrap().unwrap());
            }
        });
        spawner.await.unwrap();
        let appended = frames() - before;
        assert!(
            appended < writes / 10,
            "{appended} frames appended to the log by {writes} writes made together"
        );
    }

    /// A store written without a pause (every run one step after the other, as a busy server's
    /// are) keeps its write-ahead log bounded: checkpoints fold the log into the database, and
    /// the log starts over from its beginning instead of growing for as long as writes go on.
    #[tokio::test]
    async fn a_log_written_without_pause_starts_over_instead_of_growing() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("keel.db")).unwrap();
        let page = store.backend().lock().query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0)).unwrap();
        let frame = 24 + page as u64;
        let log = dir.path().join("keel.db-wal");
        let session = SessionId::new("busy").unwrap();
        let record = crate::conformance::run_record("busy", &session, 0);
        crate::conformance::create_run(&store, &record).await.unwrap();
        // A tool's long output per step: its body spans several pages, each a frame of the log.
        let output = [Arc::new(Message::assistant("a long tool output ".repeat(1000)))];
        let commits = 3_000;
        let (mut per_commit, mut longest) = (0, 0);
        for position in 0..commits {
            let before = std::fs::metadata(&log).unwrap().len();
            crate::conformance::append_messages(&store, &session, &record.run_id, position, &output)
                .await
                .unwrap();
            let after = std::fs::metadata(&log).unwrap().len();
            if position == 0 {
                per_commit = (after - before) / frame;
            }
            longest = longest.max(after / frame);
        }
        assert!(commits * per_commit > 5 * RESTART_PAGES as u64, "{per_commit} frames a commit");
        // Every CHECKPOINT_PAGES frames a checkpoint runs; at most RESTART_PAGES frames (and what
        // the writes add while one waits for its turn) before the log must start over.
        let bound = (RESTART_PAGES + 2 * CHECKPOINT_PAGES) as u64;
        assert!(
            longest <= bound,
            "the log reached {longest} frames ({} MB) in {commits} commits; it may hold {bound}",
            longest * frame / 1_000_000
        );
        // The threads let go of the file with the store: the last connection to close folds the
        // log into the database and deletes it (syncing the file: slow on a busy disk).
        drop(store);
        let deadline = Instant::now() + Duration::from_secs(60);
        while log.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!log.exists(), "a connection to the database outlived its store");
    }

    #[test]
    fn the_log_is_asked_to_start_over_when_long_and_again_only_as_it_grows_on() {
        let restart = i64::from(RESTART_PAGES);
        let mut schedule = RestartSchedule::new();
        assert!(!schedule.due(1_000));
        assert!(!schedule.due(restart - 1));
        assert!(schedule.due(restart + 10));
        // A reader kept it from starting over: not at every checkpoint after.
        assert!(!schedule.due(restart + 1_000));
        assert!(!schedule.due(2 * restart));
        assert!(schedule.due(2 * restart + 10));
        // It started over: the next long log asks again at the first length.
        assert!(!schedule.due(1_000));
        assert!(schedule.due(restart));
    }

    /// A reader that keeps its snapshot keeps the log from starting over; commits go on, and a
    /// second store on the file (another process's) still gets the write lock in time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_keeping_its_snapshot_holds_no_writer_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let store = SqliteStore::open(&path).unwrap();
        let other = SqliteStore::open(&path).unwrap();
        let reader = Connection::open(&path).unwrap();
        reader.execute_batch("BEGIN; SELECT count(*) FROM sessions;").unwrap();
        let session = SessionId::new("busy").unwrap();
        let record = crate::conformance::run_record("busy", &session, 0);
        crate::conformance::create_run(&store, &record).await.unwrap();
        let output = [Arc::new(Message::assistant("a long tool output ".repeat(1000)))];
        let page = reader.query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0)).unwrap();
        let frame = 24 + page as u64;
        let log = dir.path().join("keel.db-wal");
        let (mut position, mut slowest) = (0, Duration::ZERO);
        // Past two restarts' worth of log, each asked for and refused for the reader.
        while std::fs::metadata(&log).unwrap().len() / frame < 3 * RESTART_PAGES as u64 {
            crate::conformance::append_messages(&store, &session, &record.run_id, position, &output)
                .await
                .unwrap();
            position += 1;
            let started = Instant::now();
            let tick = other.claim_schedule_tick(&format!("tick-{position}"), 60_000, None).await;
            assert!(tick.is_ok(), "commit {position} of the other store: {tick:?}");
            slowest = slowest.max(started.elapsed());
        }
        // A restart that waited out the reader would have held the lock for the busy timeout,
        // and the other store's commit with it (or failed it, `KEEL_STORE_LOCKED`). One that
        // gives up waits 100 ms, and its sync (seconds at worst, on a busy disk).
        assert!(slowest < BUSY_TIMEOUT * 4 / 5, "a commit of the other store waited {slowest:?}");
        reader.execute_batch("COMMIT").unwrap();
    }

    /// Reads take the writer's connection when nobody writes: writes made meanwhile wait for the
    /// read, then commit; each read sees every write whose call returned before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_and_writes_from_many_tasks_all_finish_and_reads_see_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("keel.db")).unwrap());
        let tasks: Vec<_> = (0..16)
            .map(|task| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let session = SessionId::new(format!("s{task}")).unwrap();
                    let record = crate::conformance::run_record(&format!("r{task}"), &session, 0);
                    crate::conformance::create_run(&*store, &record).await.unwrap();
                    for position in 0..50u64 {
                        let said = [Arc::new(Message::assistant(format!("{task}/{position}")))];
                        crate::conformance::append_messages(
                            &*store,
                            &session,
                            &record.run_id,
                            position,
                            &said,
                        )
                        .await
                        .unwrap();
                        let messages = store.load_messages(&session).await.unwrap();
                        assert_eq!(messages.len() as u64, position + 1, "task {task}");
                        assert_eq!(messages.last().unwrap(), &said[0]);
                        // Reads of other sessions, beside other tasks' writes.
                        store.list_sessions(SessionFilter::default()).await.unwrap();
                    }
                })
            })
            .collect();
        let all = async {
            for task in tasks {
                task.await.unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(120), all).await.expect("every read and write finished");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_made_during_a_read_on_the_writers_connection_commits_once_the_read_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("keel.db")).unwrap());
        let writer = Arc::clone(&store.backend().writer);
        let reading = writer.read_alone().expect("nobody writes");
        assert!(writer.read_alone().is_none(), "one read at a time on the writer's connection");
        let shared = Arc::clone(&store);
        let write = tokio::spawn(async move { shared.claim_schedule_tick("tick", 60_000, None).await });
        while writer.queue().jobs.is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(reading);
        let claimed =
            tokio::time::timeout(Duration::from_secs(60), write).await.expect("the write committed");
        assert!(claimed.unwrap().unwrap());
        // The writer thread answers the write, then lets go of the connection.
        let deadline = Instant::now() + Duration::from_secs(60);
        while writer.read_alone().is_none() {
            assert!(Instant::now() < deadline, "the writer thread kept the connection after its last write");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn writes_in_flight_together_share_commits_on_a_current_thread_runtime() {
        writes_made_together_share_commits().await;
    }

    // One worker: every task the test spawns waits for it, so none can queue its write while
    // another commits unless the one committing first lets them run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn writes_in_flight_together_share_commits_on_a_one_worker_multi_thread_runtime() {
        writes_made_together_share_commits().await;
    }

    #[test]
    fn a_lone_write_waits_for_company_where_one_worker_runs_everything_or_writes_came_together() {
        let now = Instant::now();
        let recently = Some(now - CONTENTION_WINDOW / 2);
        let long_ago = Some(now - CONTENTION_WINDOW * 2);
        assert!(gather_first(None, now), "outside a runtime");
        let current = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let one = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        for runtime in [&current, &one] {
            let _entered = runtime.enter();
            assert!(gather_first(None, now));
        }
        let two = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        let _entered = two.enter();
        assert!(!gather_first(None, now), "a write that never had company");
        assert!(!gather_first(long_ago, now), "writes came together, but not lately");
        assert!(gather_first(recently, now));
    }

    #[tokio::test]
    async fn an_older_schema_is_migrated_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.db");
        {
            // A database as version 1 left it, with a run in it.
            let connection = Connection::open(&path).unwrap();
            connection.execute_batch(MIGRATIONS[0]).unwrap();
            connection.pragma_update(None, "user_version", 1).unwrap();
            connection
                .execute(
                    "INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at)
                     VALUES ('run_old', 's', ?1, 0, 0, 'running', 0, 0)",
                    [encode_message(&Message::user("hi"))],
                )
                .unwrap();
            // And a session of two messages, its count in its row as version 1 kept it.
            connection
                .execute(
                    "INSERT INTO sessions (id, message_count, created_at, updated_at) VALUES ('t', 2, 5, 5)",
                    [],
                )
                .unwrap();
            for (position, text) in [(0, "hello"), (1, "hi there")] {
                connection
                    .execute(
                        "INSERT INTO messages (session_id, position, run_id, body) VALUES ('t', ?1, 'run_t', ?2)",
                        params![position, encode_message(&Message::user(text))],
                    )
                    .unwrap();
            }
        }
        let store = SqliteStore::open(&path).unwrap();
        let version: i64 = store.backend().lock().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let names = |sql: &str| -> Vec<String> {
            let connection = store.backend().lock();
            let mut statement = connection.prepare(sql).unwrap();
            statement.query_map([], |row| row.get(0)).unwrap().map(Result::unwrap).collect()
        };
        let indexes = names(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'runs' AND sql IS NOT NULL",
        );
        assert_eq!(indexes, ["runs_by_state"]);
        // The count is the messages' now: the column is gone, the session reads as it was.
        let columns = names("SELECT name FROM pragma_table_info('sessions')");
        assert!(!columns.iter().any(|c| c == "message_count"), "{columns:?}");
        let session = SessionId::new("t").unwrap();
        let summary = store.session_summary(&session).await.unwrap().unwrap();
        assert_eq!((summary.messages, summary.updated_at_ms), (2, 5));
        let said = store.load_session(&session).await.unwrap().messages;
        assert_eq!(said, [Arc::new(Message::user("hello")), Arc::new(Message::user("hi there"))]);
        let run = RunId::parse("run_old").unwrap();
        assert_eq!(store.load_run(&run).await.unwrap().unwrap().input, Arc::new(Message::user("hi")));
        // The old run has no lease: it is interrupted, and can be claimed.
        let open = store.open_runs(None).await.unwrap();
        assert_eq!(open.len(), 1);
        assert!(open[0].is_interrupted(keel_core::clock::SystemClock.now_ms()));
        let claim = store.claim_run(&run, "me", Duration::from_secs(5), None).await.unwrap();
        assert_eq!(claim, keel_core::Claim::Claimed { epoch: 1, attempt: 1, cancel_requested: false });
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        // Not a database.
        let garbage = dir.path().join("garbage.db");
        std::fs::write(&garbage, vec![0x42u8; 8192]).unwrap();
        let error = SqliteStore::open(&garbage).err().unwrap();
        assert_eq!(error.code(), keel_core::ErrorCode::StoreCorrupt, "{error}");
        // A newer schema: refused, and left as it was.
        let newer = dir.path().join("newer.db");
        drop(SqliteStore::open(&newer).unwrap());
        Connection::open(&newer).unwrap().pragma_update(None, "user_version", SCHEMA_VERSION + 1).unwrap();
        let error = SqliteStore::open(&newer).err().unwrap();
        assert_eq!(error.code(), keel_core::ErrorCode::StoreSchemaNewer, "{error}");
        assert!(error.to_string().contains("upgrade keel"), "{error}");
        let version: i64 =
            Connection::open(&newer).unwrap().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION + 1);
    }

    #[test]
    fn another_applications_database_is_refused_and_left_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let foreign = dir.path().join("app.db");
        let app = Connection::open(&foreign).unwrap();
        app.execute_batch("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO customers (name) VALUES ('Ada');")
            .unwrap();
        drop(app);
        let before = std::fs::read(&foreign).unwrap();
        let error = SqliteStore::open(&foreign).err().unwrap();
        assert_eq!(error.code(), keel_core::ErrorCode::StoreCorrupt, "{error}");
        assert!(
            error.to_string().contains("another application's database (it has the tables customers"),
            "{error}"
        );
        assert_eq!(std::fs::read(&foreign).unwrap(), before, "the file was changed");
        assert!(!dir.path().join("app.db-wal").exists());
    }

    #[tokio::test]
    async fn a_value_of_the_wrong_type_is_corrupt_not_a_store_failure() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let session = SessionId::new("s").unwrap();
        {
            let store = SqliteStore::open(&path).unwrap();
            let record = crate::conformance::run_record("r", &session, 0);
            crate::conformance::create_run(&store, &record).await.unwrap();
            let hello = [Arc::new(Message::user("hello"))];
            crate::conformance::append_messages(&store, &session, &record.run_id, 0, &hello).await.unwrap();
        }
        let tamper = Connection::open(&path).unwrap();
        let changed = tamper.execute("UPDATE messages SET body = x'00ff00ff'", []).unwrap();
        assert_eq!(changed, 1);
        drop(tamper);
        let store = SqliteStore::open(&path).unwrap();
        let error = store.load_messages(&session).await.unwrap_err();
        assert_eq!(error.code(), keel_core::ErrorCode::StoreCorrupt, "{error}");
    }

    #[test]
    fn every_state_lists_every_run_state() {
        let listed: Vec<&str> =
            every_state!().trim_matches(['(', ')']).split(", ").map(|name| name.trim_matches('\'')).collect();
        let all: Vec<&str> = keel_core::RunState::ALL.iter().map(|state| state.as_str()).collect();
        assert_eq!(listed, all);
    }

    /// Every statement that finds runs by state, session or owner seeks `runs_by_state`: none
    /// reads the whole table (or a whole index), which grows with every run ever made.
    #[test]
    fn statements_on_runs_seek_their_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.db");
        drop(SqliteStore::open(&path).unwrap());
        let connection = Connection::open(&path).unwrap();
        for sql in [
            SESSION_HEAD,
            OPEN_RUNS,
            OPEN_RUNS_OF_SESSION,
            CANCEL_REQUESTED,
            SUMMARY_SELECT,
            DELETE_SESSION_JOURNALS,
            DELETE_SESSION_RUNS,
            COMPACT_JOURNALS,
        ] {
            let mut plan = connection.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let steps: Vec<String> = plan
                .query_map(
                    rusqlite::params_from_iter(std::iter::repeat_n("x", plan.parameter_count())),
                    |row| row.get::<_, String>(3),
                )
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let on_runs: Vec<&String> =
                steps.iter().filter(|step| step.contains(" runs") || step.contains(" r ")).collect();
            assert!(!on_runs.is_empty(), "{sql}: {steps:?}");
            for step in on_runs {
                assert!(
                    step.starts_with("SEARCH") && step.contains("runs_by_state"),
                    "{sql}\n  reads runs with: {step} ({steps:?})"
                );
            }
        }
    }

    /// The SQLite store reads a session's starting point in fewer statements than the storage
    /// operations would ([`SqliteTx::session_rows`]); it reads the same.
    #[tokio::test]
    async fn a_session_is_read_at_once_as_its_storage_operations_read_it() {
        use crate::conformance::{append_messages, create_run, run_record, set_run_state};
        use keel_core::StepCommit;
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("rows.db")).unwrap();
        let id = |name: &str| SessionId::new(name).unwrap();
        let said = [Arc::new(Message::user("hello")), Arc::new(Message::assistant("hi"))];

        // A run with no messages: no session row, one unfinished run.
        create_run(&store, &run_record("bare", &id("bare"), 0)).await.unwrap();
        // A finished conversation.
        let talk = run_record("talk", &id("talk"), 0);
        create_run(&store, &talk).await.unwrap();
        append_messages(&store, &id("talk"), &talk.run_id, 0, &said).await.unwrap();
        set_run_state(&store, &id("talk"), &talk.run_id, keel_core::RunState::Done).await.unwrap();
        // A run paused for a human, with messages and a state object.
        let paused = run_record("paused", &id("paused"), 0);
        let cart = serde_json::json!({"cart": ["tea"]});
        let commit = StepCommit {
            new_run: Some(&paused),
            messages: &said,
            session_state: Some(&cart),
            ..StepCommit::new(&paused.session_id, &paused.run_id)
        };
        store.commit_step(commit).await.unwrap();
        set_run_state(&store, &id("paused"), &paused.run_id, keel_core::RunState::AwaitingInput)
            .await
            .unwrap();

        for name in ["unknown", "bare", "talk", "paused"] {
            let session = id(name);
            let at_once = store.backend().read_now(|tx| tx.session_rows(&session)).unwrap();
            let by_operations =
                store.backend().read_now(|tx| crate::backend::session_rows(tx, &session)).unwrap();
            assert_eq!(at_once.messages, by_operations.messages, "{name}");
            assert_eq!(at_once.state, by_operations.state, "{name}");
            assert_eq!(at_once.open_run, by_operations.open_run, "{name}");
        }
        let paused = store.backend().read_now(|tx| tx.session_rows(&id("paused"))).unwrap();
        assert_eq!((paused.messages.len(), paused.state, paused.open_run.is_some()), (2, Some(cart), true));
        let bare = store.backend().read_now(|tx| tx.session_rows(&id("bare"))).unwrap();
        assert!(bare.messages.is_empty() && bare.open_run.is_some());
    }
}
