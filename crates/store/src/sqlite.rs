//! The SQLite store: one embedded database file, in WAL mode.
//!
//! Durability: every store call is one transaction, committed before the call returns, with
//! `journal_mode=WAL` and `synchronous=NORMAL`: a committed step survives the process being
//! killed (SIGKILL) at any point; a power loss can lose the last commits (not corrupt the file).
//! Several processes may open the same file (a paused run decided from another process);
//! writers wait up to 5 s for each other (`busy_timeout`), then fail with `KEEL_STORE_LOCKED`.
//!
//! Writes go to one writer thread, which commits whatever has queued up since its last commit in
//! one transaction (group commit), each write in its own savepoint so that one failing write
//! fails alone. Under load many runs' steps share a commit; a lone write waits only for a thread
//! hand-off. Reads use a second connection on the caller's task (WAL lets them run beside the
//! writer) and see every write whose call has returned.
//! Statements are prepared once and cached; they are shaped as primary-key lookups where they
//! run per step (a session's message count lives in `sessions`), because SQLite re-prepares
//! statements like `SELECT MAX(position) ... WHERE session_id = ?` on every execution.
//!
//! Records are stored in keel-core's versioned formats ([`keel_core::persist`]); the schema has
//! its own version (`PRAGMA user_version`), moved forward by [`MIGRATIONS`]. A database from a
//! newer keel is refused before anything is written.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use keel_core::journal::JournalEntry;
use keel_core::journal::JournalRecord;
use keel_core::persist::{
    decode_message, decode_pending_kind, decode_record, encode_message, encode_pending_kind, encode_record,
};
use keel_core::{
    BoxFuture, Decision, Message, PendingInput, RunId, RunRecord, RunState, SessionId, SessionSummary,
    StepCommit, StepName, Store, StoreError, Usage,
};
use rusqlite::{Connection, ErrorCode as SqliteCode, OptionalExtension, params};

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
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// A store in an SQLite file. See the module docs.
pub struct SqliteStore {
    /// The connection reads use.
    connection: Mutex<Connection>,
    /// The writer thread's queue.
    writer: std::sync::mpsc::Sender<WriteJob>,
    path: PathBuf,
}

/// One write, run by the writer thread inside its batch's transaction.
type Work = Box<dyn FnOnce(&Connection) -> Result<u64, StoreError> + Send>;

struct WriteJob {
    work: Work,
    reply: tokio::sync::oneshot::Sender<Result<u64, StoreError>>,
}

/// The most writes one commit takes.
const MAX_BATCH: usize = 512;

/// The writer thread: waits for a write, takes every other write queued by then, and commits
/// them together. Ends when the store is dropped.
fn writer_loop(connection: Connection, jobs: std::sync::mpsc::Receiver<WriteJob>) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let results = run_batch(&connection, &mut batch);
        for (job, result) in batch.into_iter().zip(results) {
            // The caller may have stopped waiting; the write is done either way.
            let _ = job.reply.send(result);
        }
    }
}

fn run_batch(connection: &Connection, batch: &mut [WriteJob]) -> Vec<Result<u64, StoreError>> {
    let exec = |sql: &str| connection.prepare_cached(sql).and_then(|mut s| s.execute([])).map_err(map_error);
    if let Err(error) = exec("BEGIN IMMEDIATE") {
        return batch.iter().map(|_| Err(error.clone())).collect();
    }
    let mut results = Vec::with_capacity(batch.len());
    for job in batch.iter_mut() {
        let work = std::mem::replace(&mut job.work, Box::new(|_| Ok(0)));
        let result = exec("SAVEPOINT write").and_then(|_| work(connection));
        let undo = if result.is_ok() {
            exec("RELEASE write")
        } else {
            exec("ROLLBACK TO write").and(exec("RELEASE write"))
        };
        results.push(match (result, undo) {
            (Ok(value), Ok(_)) => Ok(value),
            (Err(error), _) | (Ok(_), Err(error)) => Err(error),
        });
    }
    if let Err(error) = exec("COMMIT") {
        let _ = exec("ROLLBACK");
        return results.into_iter().map(|r| r.and(Err(error.clone()))).collect();
    }
    results
}

fn map_error(error: rusqlite::Error) -> StoreError {
    let message = error.to_string();
    match error.sqlite_error_code() {
        Some(SqliteCode::DatabaseBusy | SqliteCode::DatabaseLocked) => StoreError::Locked(message),
        Some(SqliteCode::ReadOnly) => StoreError::ReadOnly(message),
        Some(SqliteCode::NotADatabase | SqliteCode::DatabaseCorrupt) => StoreError::Corrupt(message),
        Some(SqliteCode::ConstraintViolation) => StoreError::Conflict(message),
        _ => StoreError::Unavailable(message),
    }
}

fn ready<'a, T: Send + 'a>(value: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

fn parse_state(name: &str) -> Result<RunState, StoreError> {
    Ok(match name {
        "running" => RunState::Running,
        "awaiting_input" => RunState::AwaitingInput,
        "done" => RunState::Done,
        "failed" => RunState::Failed,
        "cancelled" => RunState::Cancelled,
        other => return Err(StoreError::Corrupt(format!("unknown run state {other:?}"))),
    })
}

fn corrupt(error: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(error.to_string())
}

impl SqliteStore {
    /// Opens (or creates) the database at `path`, creating its directory, and brings its schema
    /// up to date.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
                    StoreError::ReadOnly(format!("cannot create {}: {e}", dir.display()))
                }
                _ => StoreError::Unavailable(format!("cannot create {}: {e}", dir.display())),
            })?;
        }
        let connection = Connection::open(path).map_err(|e| match map_error(e) {
            StoreError::Unavailable(m) => {
                StoreError::Unavailable(format!("cannot open {}: {m}", path.display()))
            }
            other => other,
        })?;
        connection.busy_timeout(Duration::from_secs(5)).map_err(map_error)?;
        connection.set_prepared_statement_cache_capacity(64);
        // The first statement that reads the file tells a non-database from a database.
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
            .execute_batch(
                "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;",
            )
            .map_err(map_error)?;
        migrate(&connection, path)?;
        // The writer gets this connection; reads get a second one.
        let reader = Connection::open(path).map_err(|e| with_path(map_error(e), path))?;
        reader.busy_timeout(Duration::from_secs(5)).map_err(map_error)?;
        reader.set_prepared_statement_cache_capacity(64);
        let (writer, jobs) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("keel-sqlite-writer".into())
            .spawn(move || writer_loop(connection, jobs))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the SQLite writer thread: {e}")))?;
        Ok(SqliteStore { connection: Mutex::new(reader), writer, path: path.to_owned() })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The database's size in bytes, after folding the write-ahead log into it.
    pub fn size_bytes(&self) -> Result<u64, StoreError> {
        let connection = self.lock();
        connection.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").map_err(map_error)?;
        let pages: i64 =
            connection.query_row("PRAGMA page_count", [], |row| row.get(0)).map_err(map_error)?;
        let page_size: i64 =
            connection.query_row("PRAGMA page_size", [], |row| row.get(0)).map_err(map_error)?;
        Ok((pages * page_size) as u64)
    }

    /// Rebuilds the database file without its free pages (after compaction or pruning).
    pub fn vacuum(&self) -> Result<(), StoreError> {
        self.lock().execute_batch("VACUUM").map_err(map_error)
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.connection.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pending input `id`, read with the reader connection.
    fn find_pending(&self, id: &str) -> Result<Option<PendingInput>, StoreError> {
        let connection = self.lock();
        let row = connection
            .prepare_cached(
                "SELECT id, run_id, session_id, call_id, body, created_at, expires_at FROM pending_inputs
                 WHERE id = ?1",
            )
            .and_then(|mut s| s.query_row([id], pending_from_row).optional())
            .map_err(map_error)?;
        row.transpose()
    }

    /// Queues a write for the writer thread and waits for its commit.
    fn submit(&self, work: Work) -> BoxFuture<'static, Result<u64, StoreError>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.writer.send(WriteJob { work, reply }).is_err() {
            return ready(Err(StoreError::Unavailable("the SQLite writer thread stopped".into())));
        }
        Box::pin(async move {
            answer
                .await
                .unwrap_or_else(|_| Err(StoreError::Unavailable("the SQLite writer thread stopped".into())))
        })
    }
}

/// Brings the schema up to date, or refuses a newer one.
fn migrate(connection: &Connection, path: &Path) -> Result<(), StoreError> {
    let version: i64 =
        connection.query_row("PRAGMA user_version", [], |row| row.get(0)).map_err(map_error)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema { found: version, supported: SCHEMA_VERSION });
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    write(connection, |c| {
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

impl Store for SqliteStore {
    fn load_messages<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Vec<Arc<Message>>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let mut statement = connection
                .prepare_cached("SELECT body FROM messages WHERE session_id = ?1 ORDER BY position")
                .map_err(map_error)?;
            let rows =
                statement.query_map([session.as_str()], |row| row.get::<_, String>(0)).map_err(map_error)?;
            rows.map(|body| {
                let body = body.map_err(map_error)?;
                decode_message(&body).map(Arc::new).map_err(corrupt)
            })
            .collect()
        })();
        ready(result)
    }

    fn commit_step<'a>(&'a self, commit: StepCommit<'a>) -> BoxFuture<'a, Result<(), StoreError>> {
        let session = commit.session.clone();
        let run = commit.run.clone();
        let new_run = commit.new_run.cloned();
        let entry = commit.entry.cloned();
        let messages = commit.messages.to_vec();
        let (first_position, state) = (commit.first_position, commit.state);
        let fence = commit.fence.map(|f| (f.owner.to_owned(), f.epoch, f.ttl));
        let pending = commit.pending.to_vec();
        let session_state = commit.session_state.map(serde_json::Value::to_string);
        let write = self.submit(Box::new(move |c| {
            if let Some(record) = &new_run {
                refuse_if_busy(c, &record.session_id)?;
                insert_run(c, record)?;
            }
            if let Some((owner, epoch, ttl)) = &fence {
                hold_lease(c, &run, owner, *epoch, *ttl, new_run.is_some())?;
            }
            let new_entry = match &entry {
                Some(entry) => insert_journal(c, &run, entry)?,
                None => false,
            };
            if !messages.is_empty() {
                insert_messages(c, &session, &run, first_position, &messages)?;
            }
            if new_entry
                && let Some(JournalEntry { record: JournalRecord::ModelReply(reply), .. }) = &entry
            {
                add_usage(c, &session, reply.usage)?;
            }
            for pending in &pending {
                insert_pending(c, pending)?;
            }
            if let Some(state) = &session_state {
                c.prepare_cached(
                    "INSERT INTO sessions (id, message_count, created_at, updated_at, state) VALUES (?1, 0, ?2, ?2, ?3)
                     ON CONFLICT (id) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
                )
                .and_then(|mut s| s.execute(params![session.as_str(), crate::now_ms() as i64, state]))
                .map_err(map_error)?;
            }
            if let Some(state) = state {
                update_state(c, &run, state)?;
            }
            Ok(0)
        }));
        Box::pin(async move { write.await.map(drop) })
    }

    fn load_session_state<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, StoreError>> {
        let connection = self.lock();
        let result = connection
            .prepare_cached("SELECT state FROM sessions WHERE id = ?1")
            .and_then(|mut s| {
                s.query_row([session.as_str()], |row| row.get::<_, Option<String>>(0)).optional()
            })
            .map_err(map_error)
            .and_then(|state| match state.flatten() {
                Some(json) => serde_json::from_str(&json).map(Some).map_err(corrupt),
                None => Ok(None),
            });
        ready(result)
    }

    fn load_run<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Option<RunRecord>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let row = connection
                .prepare_cached(
                    "SELECT session_id, input, history_len, call_base, state FROM runs WHERE id = ?1",
                )
                .and_then(|mut s| {
                    s.query_row([run.as_str()], |row| {
                        Ok((
                            row.get::<_, String>(0)?,
                            row.get::<_, String>(1)?,
                            row.get::<_, i64>(2)?,
                            row.get::<_, i64>(3)?,
                            row.get::<_, String>(4)?,
                        ))
                    })
                    .optional()
                })
                .map_err(map_error)?;
            let Some((session, input, history_len, call_base, state)) = row else { return Ok(None) };
            Ok(Some(RunRecord {
                run_id: run.clone(),
                session_id: SessionId::from_store(session).map_err(corrupt)?,
                input: decode_message(&input).map_err(corrupt)?,
                history_len: history_len as u64,
                call_base: call_base as u64,
                state: parse_state(&state)?,
            }))
        })();
        ready(result)
    }

    fn load_journal<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Vec<JournalEntry>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let mut statement = connection
                .prepare_cached("SELECT step, body FROM journal WHERE run_id = ?1 ORDER BY seq")
                .map_err(map_error)?;
            let rows = statement
                .query_map([run.as_str()], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
                .map_err(map_error)?;
            rows.map(|row| {
                let (step, body) = row.map_err(map_error)?;
                let step =
                    StepName::parse(&step).ok_or_else(|| corrupt(format!("bad step name {step:?}")))?;
                Ok(JournalEntry { step, record: decode_record(&body).map_err(corrupt)? })
            })
            .collect()
        })();
        ready(result)
    }

    fn claim_run<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let (run, owner) = (run.clone(), owner.to_owned());
        let write = self.submit(Box::new(move |c| {
            let now = crate::now_ms() as i64;
            let epoch: Option<i64> = c
                .prepare_cached(
                    "UPDATE runs SET lease_owner = ?2, lease_expires_at = ?3, lease_epoch = lease_epoch + 1
                     WHERE id = ?1 AND state IN ('running', 'awaiting_input')
                       AND (lease_owner IS NULL OR lease_expires_at <= ?4 OR lease_owner = ?2)
                     RETURNING lease_epoch",
                )
                .and_then(|mut s| {
                    s.query_row(params![run.as_str(), owner, now + ttl.as_millis() as i64, now], |row| {
                        row.get(0)
                    })
                    .optional()
                })
                .map_err(map_error)?;
            if let Some(epoch) = epoch {
                return Ok(epoch as u64);
            }
            let exists = c
                .prepare_cached("SELECT 1 FROM runs WHERE id = ?1")
                .and_then(|mut s| s.exists([run.as_str()]))
                .map_err(map_error)?;
            if exists { Ok(0) } else { Err(StoreError::NotFound(format!("run {run}"))) }
        }));
        // Epochs start at 1: 0 means "not claimed".
        Box::pin(async move { write.await.map(|epoch| (epoch > 0).then_some(epoch)) })
    }

    fn renew_lease<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        epoch: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let (run, owner) = (run.clone(), owner.to_owned());
        let write = self.submit(Box::new(move |c| {
            c.prepare_cached(
                "UPDATE runs SET lease_expires_at = ?4 WHERE id = ?1 AND lease_owner = ?2 AND lease_epoch = ?3",
            )
            .and_then(|mut s| {
                s.execute(params![run.as_str(), owner, epoch as i64, crate::now_ms() as i64 + ttl.as_millis() as i64])
            })
            .map(|changed| changed as u64)
            .map_err(map_error)
        }));
        Box::pin(async move { write.await.map(|changed| changed > 0) })
    }

    fn interrupted_runs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<RunId>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let mut statement = connection
                .prepare_cached(
                    "SELECT id FROM runs WHERE state = 'running'
                       AND (lease_owner IS NULL OR lease_expires_at <= ?1)
                       AND (?2 IS NULL OR session_id = ?2)
                     ORDER BY id",
                )
                .map_err(map_error)?;
            let rows = statement
                .query_map(params![crate::now_ms() as i64, session.map(SessionId::as_str)], |row| {
                    row.get::<_, String>(0)
                })
                .map_err(map_error)?;
            rows.map(|id| {
                let id = id.map_err(map_error)?;
                RunId::parse(&id).ok_or_else(|| corrupt(format!("bad run id {id:?}")))
            })
            .collect()
        })();
        ready(result)
    }

    fn pending_inputs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<PendingInput>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let mut statement = connection
                .prepare_cached(
                    "SELECT id, run_id, session_id, call_id, body, created_at, expires_at FROM pending_inputs
                     WHERE ?1 IS NULL OR session_id = ?1 ORDER BY created_at, rowid",
                )
                .map_err(map_error)?;
            let rows = statement
                .query_map(params![session.map(SessionId::as_str)], pending_from_row)
                .map_err(map_error)?;
            rows.map(|row| row.map_err(map_error)?).collect()
        })();
        ready(result)
    }

    fn pending_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<PendingInput>, StoreError>> {
        ready(self.find_pending(id))
    }

    fn decide<'a>(
        &'a self,
        id: &'a str,
        decision: &'a Decision,
    ) -> BoxFuture<'a, Result<PendingInput, StoreError>> {
        // Read the pending input first: rows never change, they are only deleted, and the write
        // below deletes it only if it is still there, so two racing decisions cannot both win.
        let pending = match self.find_pending(id) {
            Ok(Some(pending)) => pending,
            Ok(None) => return ready(Err(StoreError::not_pending(id))),
            Err(error) => return ready(Err(error)),
        };
        let entry = JournalEntry { step: pending.step(), record: JournalRecord::Decision(decision.clone()) };
        let run = pending.run_id.clone();
        let id = id.to_owned();
        let write = self.submit(Box::new(move |c| {
            let removed = c
                .prepare_cached("DELETE FROM pending_inputs WHERE id = ?1")
                .and_then(|mut s| s.execute([id.as_str()]))
                .map_err(map_error)?;
            if removed == 0 {
                return Err(StoreError::not_pending(&id));
            }
            insert_journal(c, &run, &entry)?;
            c.prepare_cached(
                "UPDATE runs SET state = 'running', lease_expires_at = 0, updated_at = ?2
                 WHERE id = ?1 AND state = 'awaiting_input'",
            )
            .and_then(|mut s| s.execute(params![run.as_str(), crate::now_ms() as i64]))
            .map_err(map_error)?;
            Ok(0)
        }));
        Box::pin(async move { write.await.map(|_| pending) })
    }

    fn claim_schedule_tick<'a>(
        &'a self,
        name: &'a str,
        tick_ms: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let name = name.to_owned();
        let write = self.submit(Box::new(move |c| {
            c.prepare_cached(
                "INSERT INTO schedules (name, last_fire) VALUES (?1, ?2)
                 ON CONFLICT (name) DO UPDATE SET last_fire = excluded.last_fire
                 WHERE schedules.last_fire < excluded.last_fire",
            )
            .and_then(|mut s| s.execute(params![name, tick_ms as i64]))
            .map(|changed| changed as u64)
            .map_err(map_error)
        }));
        Box::pin(async move { write.await.map(|changed| changed > 0) })
    }

    fn schedule_last_fire<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let connection = self.lock();
        let result = connection
            .prepare_cached("SELECT last_fire FROM schedules WHERE name = ?1")
            .and_then(|mut s| s.query_row([name], |row| row.get::<_, i64>(0)).optional())
            .map(|tick| tick.map(|t| t as u64))
            .map_err(map_error);
        ready(result)
    }

    fn compact_journals(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        let write = self.submit(Box::new(|c| {
            c.execute(
                "DELETE FROM journal WHERE run_id IN
                   (SELECT id FROM runs WHERE state IN ('done', 'failed', 'cancelled'))",
                [],
            )
            .map(|removed| removed as u64)
            .map_err(map_error)
        }));
        Box::pin(write)
    }

    fn list_sessions(&self) -> BoxFuture<'_, Result<Vec<SessionSummary>, StoreError>> {
        let connection = self.lock();
        let result = (|| {
            let mut statement = connection
                .prepare_cached(&format!("{SUMMARY_SELECT} ORDER BY s.updated_at DESC, s.id"))
                .map_err(map_error)?;
            let rows = statement.query_map([], summary_row).map_err(map_error)?;
            rows.map(|row| row.map_err(map_error)?).collect()
        })();
        ready(result)
    }

    fn session_summary<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<SessionSummary>, StoreError>> {
        let connection = self.lock();
        let result = connection
            .prepare_cached(&format!("{SUMMARY_SELECT} WHERE s.id = ?1"))
            .and_then(|mut s| s.query_row([session.as_str()], summary_row).optional())
            .map_err(map_error)
            .and_then(Option::transpose);
        ready(result)
    }

    fn delete_session<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<bool, StoreError>> {
        let session = session.clone();
        let write = self.submit(Box::new(move |c| {
            let id = session.as_str();
            c.execute(
                "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE session_id = ?1)",
                [id],
            )
            .map_err(map_error)?;
            c.execute("DELETE FROM pending_inputs WHERE session_id = ?1", [id]).map_err(map_error)?;
            let runs = c.execute("DELETE FROM runs WHERE session_id = ?1", [id]).map_err(map_error)?;
            c.execute("DELETE FROM messages WHERE session_id = ?1", [id]).map_err(map_error)?;
            let sessions = c.execute("DELETE FROM sessions WHERE id = ?1", [id]).map_err(map_error)?;
            Ok((runs + sessions) as u64)
        }));
        Box::pin(async move { write.await.map(|deleted| deleted > 0) })
    }
}

/// The columns of a [`SessionSummary`], for [`summary_row`].
const SUMMARY_SELECT: &str = "SELECT s.id, s.updated_at, s.message_count,
    (SELECT COUNT(*) FROM runs r WHERE r.session_id = s.id), s.input_tokens, s.output_tokens
    FROM sessions s";

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

/// Appends messages idempotently (see [`Store::append_messages`]) within a transaction.
fn insert_messages(
    connection: &Connection,
    session: &SessionId,
    run: &RunId,
    first_position: u64,
    messages: &[Arc<Message>],
) -> Result<(), StoreError> {
    let next: i64 = connection
        .prepare_cached("SELECT message_count FROM sessions WHERE id = ?1")
        .and_then(|mut s| s.query_row([session.as_str()], |row| row.get(0)).optional())
        .map_err(map_error)?
        .unwrap_or(0);
    let mut next = next as u64;
    let before = next;
    for (offset, message) in messages.iter().enumerate() {
        let position = first_position + offset as u64;
        if position < next {
            let writer: String = connection
                .prepare_cached("SELECT run_id FROM messages WHERE session_id = ?1 AND position = ?2")
                .and_then(|mut s| s.query_row(params![session.as_str(), position as i64], |row| row.get(0)))
                .map_err(map_error)?;
            if writer != run.as_str() {
                return Err(StoreError::Conflict(format!(
                    "position {position} of session {session} was written by {writer}, not {run}"
                )));
            }
            continue;
        }
        if position > next {
            return Err(StoreError::Conflict(format!(
                "position {position} of session {session} is past its end ({next})"
            )));
        }
        connection
            .prepare_cached(
                "INSERT INTO messages (session_id, position, run_id, body) VALUES (?1, ?2, ?3, ?4)",
            )
            .and_then(|mut s| {
                s.execute(params![session.as_str(), position as i64, run.as_str(), encode_message(message)])
            })
            .map_err(map_error)?;
        next += 1;
    }
    if next == before {
        // A replayed append: nothing new, nothing to write.
        return Ok(());
    }
    connection
        .prepare_cached(
            "INSERT INTO sessions (id, message_count, created_at, updated_at) VALUES (?1, ?2, ?3, ?3)
             ON CONFLICT (id) DO UPDATE SET message_count = excluded.message_count, updated_at = excluded.updated_at",
        )
        .and_then(|mut s| s.execute(params![session.as_str(), next as i64, crate::now_ms() as i64]))
        .map_err(map_error)?;
    Ok(())
}

/// Refuses a new run while another run of the session is in flight under a live lease, or
/// paused for a human.
fn refuse_if_busy(connection: &Connection, session: &SessionId) -> Result<(), StoreError> {
    let other: Option<(String, String)> = connection
        .prepare_cached(
            "SELECT id, state FROM runs WHERE session_id = ?1 AND (state = 'awaiting_input'
               OR (state = 'running' AND lease_owner IS NOT NULL AND lease_expires_at > ?2)) LIMIT 1",
        )
        .and_then(|mut s| {
            s.query_row(params![session.as_str(), crate::now_ms() as i64], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()
        })
        .map_err(map_error)?;
    match other {
        Some((other, state)) => {
            let other = RunId::parse(&other).ok_or_else(|| corrupt(format!("bad run id {other:?}")))?;
            Err(crate::busy_error(session, &other, parse_state(&state)?))
        }
        None => Ok(()),
    }
}

/// Stores a pending input, unless it is stored already or its decision is journaled.
fn insert_pending(connection: &Connection, pending: &PendingInput) -> Result<(), StoreError> {
    connection
        .prepare_cached(
            "INSERT INTO pending_inputs (id, run_id, session_id, call_id, step, body, created_at, expires_at)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8
             WHERE NOT EXISTS (SELECT 1 FROM journal WHERE run_id = ?2 AND step = ?5)
             ON CONFLICT (id) DO NOTHING",
        )
        .and_then(|mut s| {
            s.execute(params![
                pending.id,
                pending.run_id.as_str(),
                pending.session_id.as_str(),
                pending.call_id,
                pending.step().to_string(),
                encode_pending_kind(&pending.kind),
                pending.created_at_ms as i64,
                pending.expires_at_ms as i64,
            ])
        })
        .map(drop)
        .map_err(map_error)
}

/// Reads a `pending_inputs` row (the columns of [`Store::pending_inputs`]'s query).
fn pending_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Result<PendingInput, StoreError>> {
    let (id, run, session, call_id, body): (String, String, String, String, String) =
        (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?);
    let (created_at, expires_at): (i64, i64) = (row.get(5)?, row.get(6)?);
    Ok((|| {
        Ok(PendingInput {
            id,
            run_id: RunId::parse(&run).ok_or_else(|| corrupt(format!("bad run id {run:?}")))?,
            session_id: SessionId::from_store(session).map_err(corrupt)?,
            call_id,
            kind: decode_pending_kind(&body).map_err(corrupt)?,
            created_at_ms: created_at as u64,
            expires_at_ms: expires_at as u64,
        })
    })())
}

fn insert_run(connection: &Connection, run: &RunRecord) -> Result<(), StoreError> {
    connection
        .prepare_cached(
            "INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
        )
        .and_then(|mut s| {
            s.execute(params![
                run.run_id.as_str(),
                run.session_id.as_str(),
                encode_message(&run.input),
                run.history_len as i64,
                run.call_base as i64,
                run.state.as_str(),
                crate::now_ms() as i64
            ])
        })
        .map(|_| ())
        .map_err(|e| match map_error(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("run {} already exists", run.run_id)),
            other => other,
        })
}

/// Checks that `owner` still holds the run's lease at `epoch` (or takes it, for a run this commit
/// creates), and extends it by `ttl`.
fn hold_lease(
    connection: &Connection,
    run: &RunId,
    owner: &str,
    epoch: u64,
    ttl: Duration,
    new_run: bool,
) -> Result<(), StoreError> {
    let expires = crate::now_ms() as i64 + ttl.as_millis() as i64;
    let changed = if new_run {
        connection
            .prepare_cached("UPDATE runs SET lease_owner = ?2, lease_epoch = ?3, lease_expires_at = ?4 WHERE id = ?1")
            .and_then(|mut s| s.execute(params![run.as_str(), owner, epoch as i64, expires]))
    } else {
        connection
            .prepare_cached(
                "UPDATE runs SET lease_expires_at = ?4 WHERE id = ?1 AND lease_owner = ?2 AND lease_epoch = ?3",
            )
            .and_then(|mut s| s.execute(params![run.as_str(), owner, epoch as i64, expires]))
    }
    .map_err(map_error)?;
    if changed == 0 {
        return Err(StoreError::LeaseLost(format!(
            "run {run} is no longer leased to {owner} at epoch {epoch}"
        )));
    }
    Ok(())
}

/// Records a journal entry; the first record of a step wins. Returns whether it was new.
fn insert_journal(connection: &Connection, run: &RunId, entry: &JournalEntry) -> Result<bool, StoreError> {
    connection
        .prepare_cached(
            "INSERT INTO journal (run_id, step, seq, body)
             VALUES (?1, ?2, (SELECT COUNT(*) FROM journal WHERE run_id = ?1), ?3)
             ON CONFLICT (run_id, step) DO NOTHING",
        )
        .and_then(|mut s| {
            s.execute(params![run.as_str(), entry.step.to_string(), encode_record(&entry.record)])
        })
        .map(|inserted| inserted == 1)
        .map_err(map_error)
}

/// Adds a model call's tokens to its session's totals.
fn add_usage(connection: &Connection, session: &SessionId, usage: Usage) -> Result<(), StoreError> {
    let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    connection
        .prepare_cached(
            "INSERT INTO sessions (id, message_count, created_at, updated_at, input_tokens, output_tokens)
             VALUES (?1, 0, ?2, ?2, ?3, ?4)
             ON CONFLICT (id) DO UPDATE SET input_tokens = input_tokens + excluded.input_tokens,
               output_tokens = output_tokens + excluded.output_tokens",
        )
        .and_then(|mut s| {
            s.execute(params![
                session.as_str(),
                crate::now_ms() as i64,
                tokens(usage.input_tokens),
                tokens(usage.output_tokens)
            ])
        })
        .map(drop)
        .map_err(map_error)
}

/// Sets a run's state; leaving `running` releases its lease, ending drops its pending inputs.
fn update_state(connection: &Connection, run: &RunId, state: RunState) -> Result<(), StoreError> {
    let changed = connection
        .prepare_cached(
            "UPDATE runs SET state = ?2, updated_at = ?3,
               lease_expires_at = CASE WHEN ?2 = 'running' THEN lease_expires_at ELSE 0 END
             WHERE id = ?1",
        )
        .and_then(|mut s| s.execute(params![run.as_str(), state.as_str(), crate::now_ms() as i64]))
        .map_err(map_error)?;
    if changed == 0 {
        return Err(StoreError::NotFound(format!("run {run}")));
    }
    if state.is_terminal() {
        connection
            .prepare_cached("DELETE FROM pending_inputs WHERE run_id = ?1")
            .and_then(|mut s| s.execute([run.as_str()]))
            .map_err(map_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sqlite_store_conforms() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("keel.db")).unwrap();
        crate::conformance::run_all(&store).await;
    }

    #[tokio::test]
    async fn data_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/dir/keel.db");
        let session = SessionId::new("s").unwrap();
        let run = RunId::from_suffix("r");
        {
            let store = SqliteStore::open(&path).unwrap();
            crate::conformance::append_messages(
                &store,
                &session,
                &run,
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
                            store.claim_schedule_tick("every-minute", tick * 60_000).await.unwrap(),
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
        }
        let store = SqliteStore::open(&path).unwrap();
        let version: i64 = store.lock().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let run = RunId::parse("run_old").unwrap();
        assert_eq!(store.load_run(&run).await.unwrap().unwrap().input, Message::user("hi"));
        // The old run has no lease: it is interrupted, and can be claimed.
        assert_eq!(store.interrupted_runs(None).await.unwrap(), std::slice::from_ref(&run));
        assert_eq!(store.claim_run(&run, "me", Duration::from_secs(5)).await.unwrap(), Some(1));
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
}
