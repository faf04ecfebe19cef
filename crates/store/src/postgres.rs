//! The PostgreSQL backend: one database shared by any number of keel processes and machines.
//!
//! **Transactions.** Every write is one transaction that first locks what it is about: the
//! store's rules read, check, then write, and they hold across instances as in one process
//! because no two writes about one session run at once. The lock is a transaction-scoped
//! advisory lock on the session (taken by the first storage operation that names the session,
//! or a run or a pending input of it; a run's session is looked up once and remembered), so
//! two instances starting a run in one session at the same moment queue on it, and the second
//! sees the first's run and is refused. Writes run at `READ COMMITTED`: each statement after the
//! lock sees everything committed before it was granted. Writes about different sessions never
//! wait on each other. (`SERIALIZABLE` was measured first: with 1000 runs in flight its
//! predicate locks failed unrelated sessions' transactions faster than retries could absorb.)
//! A transaction PostgreSQL still aborts (a deadlock) runs again from the start (the work is
//! `FnMut` for this), up to [`MAX_ATTEMPTS`] times. Reads are `REPEATABLE READ READ ONLY`
//! transactions: one consistent snapshot per read, taking no lock.
//!
//! **Connections.** A pool of worker threads, each owning one connection (the `postgres` crate:
//! the blocking face of `tokio-postgres`, because the rules' storage operations ([`Tx`]) are
//! synchronous calls inside one transaction). A store call hands its work to the next free
//! worker and awaits the answer. Statements are prepared once per connection. A connection that
//! breaks is opened again for the next call; the call it broke fails with `KEEL_STORE`
//! (the run stays resumable), and while the database is unreachable every call fails the same
//! way, with the URL (never its password) in the message.
//!
//! **Schema.** Everything lives in the schema `keel` of the database (another application's
//! tables in the same database are never touched), versioned by `keel.schema_version` and
//! migrated under an advisory lock, so that instances starting together migrate once. A
//! database of a newer schema is refused before anything is written. Text keys use the `C`
//! collation: the same order as SQLite and memory, and faster comparisons.
//!
//! This module implements storage operations only ([`Tx`]); the rules are `crate::rules`.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::journal::JournalEntry;
use keel_core::memory::{MemoryItem, MemoryOwner};
use keel_core::persist::{
    decode_message, decode_pending_kind, decode_record, encode_message, encode_pending_kind, encode_record,
};
use keel_core::{
    BoxFuture, Clock, DecidedInput, DelayedRun, DelayedRunRecord, Message, PendingInput, RunId, RunRecord,
    SessionId, SessionSummary, StepName, StoreError, Usage,
};
use postgres::error::SqlState;
use postgres::types::{FromSql, ToSql};
use postgres::{Client, IsolationLevel, NoTls, Row, Statement};

use crate::backend::{
    Backend, Ruled, RunControl, Tx, Work, corrupt, memory_item, memory_owner_rows, read_limits,
    stored_delayed_state, stored_limits, stored_run_id, stored_state,
};

mod events;

/// The schema, one migration per version (index 0 makes version 1).
const MIGRATIONS: &[&str] = &[
    // Version 1: what SQLite's seven versions built, at once.
    r#"CREATE TABLE sessions (
        id TEXT COLLATE "C" PRIMARY KEY,
        message_count BIGINT NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        state TEXT,
        input_tokens BIGINT NOT NULL DEFAULT 0,
        output_tokens BIGINT NOT NULL DEFAULT 0
    );
    CREATE TABLE messages (
        session_id TEXT COLLATE "C" NOT NULL,
        position BIGINT NOT NULL,
        run_id TEXT COLLATE "C" NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (session_id, position)
    );
    CREATE TABLE runs (
        id TEXT COLLATE "C" PRIMARY KEY,
        session_id TEXT COLLATE "C" NOT NULL,
        input TEXT NOT NULL,
        history_len BIGINT NOT NULL,
        call_base BIGINT NOT NULL,
        state TEXT COLLATE "C" NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        lease_owner TEXT COLLATE "C",
        lease_expires_at BIGINT,
        lease_epoch BIGINT NOT NULL DEFAULT 0,
        attempts BIGINT NOT NULL DEFAULT 0,
        cancel_requested_by TEXT
    );
    CREATE INDEX runs_open ON runs (session_id, state);
    CREATE INDEX runs_leased ON runs (state, lease_owner);
    CREATE TABLE journal (
        run_id TEXT COLLATE "C" NOT NULL,
        step TEXT COLLATE "C" NOT NULL,
        seq BIGINT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (run_id, step)
    );
    CREATE TABLE schedules (
        name TEXT COLLATE "C" PRIMARY KEY,
        last_fire BIGINT NOT NULL
    );
    CREATE TABLE pending_inputs (
        seq BIGSERIAL NOT NULL,
        id TEXT COLLATE "C" PRIMARY KEY,
        run_id TEXT COLLATE "C" NOT NULL,
        session_id TEXT COLLATE "C" NOT NULL,
        call_id TEXT NOT NULL,
        step TEXT NOT NULL,
        body TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL
    );
    CREATE INDEX pending_by_session ON pending_inputs (session_id);
    CREATE INDEX pending_by_run ON pending_inputs (run_id);
    CREATE TABLE decided_inputs (
        id TEXT COLLATE "C" PRIMARY KEY,
        run_id TEXT COLLATE "C" NOT NULL,
        session_id TEXT COLLATE "C" NOT NULL,
        outcome TEXT NOT NULL,
        by_whom TEXT NOT NULL,
        at BIGINT NOT NULL
    );
    CREATE INDEX decided_by_session ON decided_inputs (session_id);"#,
    // Version 2: the shared event log (`events.rs`). `event_heads` numbers each session's
    // events and orders its appenders; `event_batches` makes an append idempotent.
    r#"CREATE TABLE event_heads (
        session_id TEXT COLLATE "C" PRIMARY KEY,
        last_seq BIGINT NOT NULL
    );
    CREATE TABLE events (
        session_id TEXT COLLATE "C" NOT NULL,
        seq BIGINT NOT NULL,
        run_id TEXT COLLATE "C" NOT NULL,
        body TEXT,
        at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, seq)
    );
    CREATE INDEX events_at ON events USING brin (at);
    CREATE TABLE event_batches (
        id BIGINT PRIMARY KEY,
        at TIMESTAMPTZ NOT NULL DEFAULT now()
    );"#,
    // Version 3: delayed runs (`POST /runs`, `keel run --after`, schedules' fires), stored
    // until they start.
    r#"CREATE TABLE delayed_runs (
        run_id TEXT COLLATE "C" PRIMARY KEY,
        session_id TEXT COLLATE "C" NOT NULL,
        input TEXT NOT NULL,
        due_at BIGINT NOT NULL,
        source TEXT NOT NULL,
        state TEXT COLLATE "C" NOT NULL,
        created_at BIGINT NOT NULL,
        held_until BIGINT NOT NULL,
        attempts BIGINT NOT NULL,
        note TEXT
    );
    CREATE INDEX delayed_due ON delayed_runs (state, due_at);"#,
    // Version 4: a run's own limits (`persist::encode_overrides`; NULL for the agent's).
    "ALTER TABLE runs ADD COLUMN limits TEXT;",
    // Version 5: what agents remember about their owners (episodes, entities, relations).
    r#"CREATE TABLE memories (
        owner TEXT COLLATE "C" NOT NULL,
        kind TEXT COLLATE "C" NOT NULL,
        key TEXT COLLATE "C" NOT NULL,
        value TEXT NOT NULL,
        updated_at BIGINT NOT NULL,
        PRIMARY KEY (owner, kind, key)
    );
    CREATE INDEX memories_recent ON memories (owner, kind, updated_at);"#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// How many times a transaction PostgreSQL aborted as a deadlock (or could not serialize) is run.
pub const MAX_ATTEMPTS: u32 = 12;

/// The advisory lock migrations take (an arbitrary constant: "keel" in ASCII).
const MIGRATION_LOCK: i64 = 0x6b65_656c;

/// How a [`Postgres`] backend connects.
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    /// Connections (and worker threads). Default 8.
    pub pool_size: usize,
    /// How long one statement may run before PostgreSQL cancels it. Default 30 s.
    pub statement_timeout: Duration,
    /// How long connecting may take. Default 10 s.
    pub connect_timeout: Duration,
}

impl Default for PostgresOptions {
    fn default() -> PostgresOptions {
        PostgresOptions {
            pool_size: 8,
            statement_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// The PostgreSQL backend. See the module docs.
pub struct Postgres {
    jobs: std::sync::mpsc::Sender<Box<dyn Job>>,
    shown: Arc<str>,
    setup: Arc<Setup>,
    events: Arc<events::PgEventLog>,
}

/// A store in a PostgreSQL database. See the module docs.
pub type PostgresStore = Ruled<Postgres>;

impl Ruled<Postgres> {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`),
    /// migrating its `keel` schema if needed.
    pub fn connect(url: &str, options: PostgresOptions) -> Result<PostgresStore, StoreError> {
        Self::connect_with_clock(url, options, Arc::new(keel_core::SystemClock))
    }

    /// [`PostgresStore::connect`] with another clock (tests).
    pub fn connect_with_clock(
        url: &str,
        options: PostgresOptions,
        clock: Arc<dyn Clock>,
    ) -> Result<PostgresStore, StoreError> {
        Ok(Ruled::with_backend(Postgres::connect(url, options)?, clock))
    }
}

/// `url` without its password, for messages and logs.
pub fn redact(url: &str) -> String {
    match postgres::Config::from_str(url) {
        Ok(config) => shown(&config),
        // Not parseable: show the scheme and host part only, never what could be a password.
        Err(_) => {
            let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
            let host = after_scheme.rsplit_once('@').map_or(after_scheme, |(_, host)| host);
            format!("postgres://{host}")
        }
    }
}

fn shown(config: &postgres::Config) -> String {
    let user = config.get_user().map_or(String::new(), |user| format!("{user}@"));
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        Some(postgres::config::Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let database = config.get_dbname().unwrap_or_default();
    format!("postgres://{user}{host}:{port}/{database}")
}

impl Postgres {
    /// Connects the pool and brings the schema up to date.
    pub fn connect(url: &str, options: PostgresOptions) -> Result<Postgres, StoreError> {
        let mut config = postgres::Config::from_str(url).map_err(|error| {
            StoreError::Unavailable(format!("{} is not a PostgreSQL URL: {error}", redact(url)))
        })?;
        config.connect_timeout(options.connect_timeout);
        config.application_name("keel");
        let shown: Arc<str> = Arc::from(shown(&config));
        let setup = Setup {
            config,
            statement_timeout: options.statement_timeout,
            shown: Arc::clone(&shown),
            round_trips: AtomicU64::new(0),
            run_sessions: Mutex::default(),
        };
        let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn Job>>();
        let queue = Arc::new(Mutex::new(queue));
        let setup = Arc::new(setup);
        // Connections are opened on the workers' own threads: the blocking client cannot run
        // on a thread that drives an async runtime. The first one migrates, and is waited for.
        let (ready, migrated) = std::sync::mpsc::channel();
        for index in 0..options.pool_size.max(1) {
            let mut worker = Worker::new(Arc::clone(&setup));
            let queue = Arc::clone(&queue);
            let ready = (index == 0).then(|| ready.clone());
            std::thread::Builder::new()
                .name(format!("keel-postgres-{index}"))
                .spawn(move || {
                    if let Some(ready) = ready {
                        let opened = worker.setup.open().and_then(|mut client| {
                            migrate(&mut client, &worker.setup.shown)?;
                            worker.client = Some(client);
                            Ok(())
                        });
                        let failed = opened.is_err();
                        let _ = ready.send(opened);
                        if failed {
                            return;
                        }
                    }
                    worker.serve(&queue);
                })
                .map_err(|e| {
                    StoreError::Unavailable(format!("cannot start a PostgreSQL worker thread: {e}"))
                })?;
            if index == 0 {
                migrated.recv().unwrap_or_else(|_| {
                    Err(StoreError::Unavailable("the first PostgreSQL worker stopped".into()))
                })?;
            }
        }
        let events = Arc::new(events::PgEventLog::new(jobs.clone(), Arc::clone(&setup)));
        Ok(Postgres { jobs, shown, setup, events })
    }

    fn submit<T: Send + 'static>(
        &self,
        work: Work<T>,
        write: bool,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let stopped = || StoreError::Unavailable("the PostgreSQL workers stopped".into());
        if self.jobs.send(Box::new(TypedJob { work, write, reply })).is_err() {
            return Box::pin(std::future::ready(Err(stopped())));
        }
        Box::pin(async move { answer.await.unwrap_or_else(|_| Err(stopped())) })
    }

    /// The database, as messages show it (no password).
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// How many times this store has waited on the server so far (statements, prepares,
    /// `BEGIN`, `COMMIT`): what a benchmark divides by its runs.
    pub fn round_trips(&self) -> u64 {
        self.setup.round_trips.load(Ordering::Relaxed)
    }
}

impl Backend for Postgres {
    fn write<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        self.submit(work, true)
    }

    fn event_log(&self) -> Option<Arc<dyn keel_core::EventLog>> {
        Some(Arc::clone(&self.events) as Arc<dyn keel_core::EventLog>)
    }

    fn read<T: Send + 'static>(&self, work: Work<T>) -> BoxFuture<'static, Result<T, StoreError>> {
        self.submit(work, false)
    }
}

/// How to open a connection.
struct Setup {
    config: postgres::Config,
    statement_timeout: Duration,
    shown: Arc<str>,
    /// Messages this store waited on the server for (statements, prepares, BEGIN, COMMIT).
    round_trips: AtomicU64,
    /// The sessions of runs this store has seen, for every worker: a write about a run locks
    /// its session without looking it up again.
    run_sessions: Mutex<HashMap<RunId, SessionId>>,
}

impl Setup {
    fn open(&self) -> Result<Client, StoreError> {
        let mut client = self.config.connect(NoTls).map_err(|error| connect_error(&error, &self.shown))?;
        let timeout = u64::try_from(self.statement_timeout.as_millis()).unwrap_or(u64::MAX);
        client
            .batch_execute(&format!("SET search_path TO keel; SET statement_timeout = {timeout}"))
            .map_err(|error| map_error(&error, &self.shown))?;
        Ok(client)
    }
}

/// Why connecting failed, for people: the URL without its password, and what to check.
fn connect_error(error: &postgres::Error, shown: &str) -> StoreError {
    let hint = match error.code() {
        Some(code)
            if *code == SqlState::INVALID_PASSWORD
                || *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
        {
            "check the user and password"
        }
        Some(code) if *code == SqlState::INVALID_CATALOG_NAME => {
            "create it first; keel then creates its tables in it"
        }
        Some(_) => "",
        None => "is PostgreSQL running there, and reachable?",
    };
    let detail = match (error.as_db_error(), std::error::Error::source(error)) {
        (Some(db), _) => db.message().to_owned(),
        (None, Some(source)) => format!("{error}: {source}"),
        (None, None) => error.to_string(),
    };
    let detail = if detail.is_empty() { format!("{error:?}") } else { detail };
    StoreError::Unavailable(format!(
        "cannot connect to {shown}: {detail}{}",
        if hint.is_empty() { String::new() } else { format!(" ({hint})") }
    ))
}

/// Whether running the transaction again may succeed (it lost a race, not an argument).
fn is_retryable(error: &postgres::Error) -> bool {
    error.code().is_some_and(|code| {
        *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
    })
}

fn map_error(error: &postgres::Error, shown: &str) -> StoreError {
    let Some(code) = error.code() else {
        return StoreError::Unavailable(format!("{shown}: {error}"));
    };
    let message = error.as_db_error().map_or_else(|| error.to_string(), |db| db.message().to_owned());
    if is_retryable(error) {
        StoreError::Locked(format!(
            "{shown}: {message} (PostgreSQL aborted the transaction as a deadlock, again and again)"
        ))
    } else if *code == SqlState::UNIQUE_VIOLATION {
        StoreError::Conflict(message)
    } else if *code == SqlState::READ_ONLY_SQL_TRANSACTION {
        StoreError::ReadOnly(format!("{shown}: {message}"))
    } else if *code == SqlState::QUERY_CANCELED {
        StoreError::Unavailable(format!(
            "{shown}: a statement took longer than the statement timeout: {message}"
        ))
    } else {
        StoreError::Unavailable(format!("{shown}: {message}"))
    }
}

/// Creates or brings forward the `keel` schema, once across processes (an advisory lock).
fn migrate(client: &mut Client, shown: &str) -> Result<(), StoreError> {
    let fail = |error: postgres::Error| map_error(&error, shown);
    let mut tx = client.transaction().map_err(fail)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).map_err(fail)?;
    tx.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS keel;
         CREATE TABLE IF NOT EXISTS keel.schema_version (version BIGINT NOT NULL)",
    )
    .map_err(fail)?;
    let version: i64 = tx
        .query_opt("SELECT version FROM keel.schema_version", &[])
        .map_err(fail)?
        .map(|row| row.try_get(0))
        .transpose()
        .map_err(|e| corrupt(format!("{shown}: keel.schema_version: {e}")))?
        .unwrap_or(0);
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema { found: version, supported: SCHEMA_VERSION });
    }
    if version == SCHEMA_VERSION {
        return tx.commit().map_err(fail);
    }
    for migration in MIGRATIONS.iter().skip(usize::try_from(version).unwrap_or(0)) {
        tx.batch_execute(migration).map_err(fail)?;
    }
    tx.execute("DELETE FROM keel.schema_version", &[]).map_err(fail)?;
    tx.execute("INSERT INTO keel.schema_version (version) VALUES ($1)", &[&SCHEMA_VERSION]).map_err(fail)?;
    tx.commit().map_err(fail)
}

/// Work for a worker.
trait Job: Send {
    fn run(self: Box<Self>, worker: &mut Worker);
}

struct TypedJob<T> {
    work: Work<T>,
    write: bool,
    reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> Job for TypedJob<T> {
    fn run(mut self: Box<Self>, worker: &mut Worker) {
        let result = worker.run(&mut self.work, self.write);
        // The caller may have stopped waiting; the transaction is done either way.
        let _ = self.reply.send(result);
    }
}

/// Work on a worker's connection itself, outside the store's transactions (the event log).
type RawWork<T> = Box<dyn FnOnce(&mut Connection<'_>) -> Result<T, StoreError> + Send>;

/// A worker's connection as raw work sees it.
struct Connection<'w> {
    client: &'w mut Client,
    statements: &'w mut HashMap<String, Statement>,
    setup: &'w Setup,
}

impl Connection<'_> {
    /// `sql`, prepared once per connection.
    fn statement(&mut self, sql: &str) -> Result<Statement, StoreError> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        self.setup.round_trips.fetch_add(1, Ordering::Relaxed);
        let statement = self.client.prepare(sql).map_err(|error| self.fail(&error))?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    /// Runs `sql` (prepared once) as a statement of its own, returning its rows.
    fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        let statement = self.statement(sql)?;
        self.setup.round_trips.fetch_add(1, Ordering::Relaxed);
        self.client.query(&statement, params).map_err(|error| self.fail(&error))
    }

    /// Runs `sql` (prepared once) as a statement of its own, returning the rows it changed.
    fn execute(&mut self, sql: &str, params: Params<'_>) -> Result<u64, StoreError> {
        let statement = self.statement(sql)?;
        self.setup.round_trips.fetch_add(1, Ordering::Relaxed);
        self.client.execute(&statement, params).map_err(|error| self.fail(&error))
    }

    fn fail(&self, error: &postgres::Error) -> StoreError {
        map_error(error, &self.setup.shown)
    }
}

struct RawJob<T> {
    work: RawWork<T>,
    reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> Job for RawJob<T> {
    fn run(self: Box<Self>, worker: &mut Worker) {
        let result = worker.run_raw(self.work);
        let _ = self.reply.send(result);
    }
}

/// Hands raw `work` to the next free worker of `jobs`.
fn submit_raw<T: Send + 'static>(
    jobs: &std::sync::mpsc::Sender<Box<dyn Job>>,
    work: RawWork<T>,
) -> BoxFuture<'static, Result<T, StoreError>> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let stopped = || StoreError::Unavailable("the PostgreSQL workers stopped".into());
    if jobs.send(Box::new(RawJob { work, reply })).is_err() {
        return Box::pin(std::future::ready(Err(stopped())));
    }
    Box::pin(async move { answer.await.unwrap_or_else(|_| Err(stopped())) })
}

/// A worker thread's connection.
struct Worker {
    setup: Arc<Setup>,
    client: Option<Client>,
    /// Statements prepared on this connection, by their SQL.
    statements: HashMap<String, Statement>,
}

impl Worker {
    /// A worker that connects on its first job.
    fn new(setup: Arc<Setup>) -> Worker {
        Worker { setup, client: None, statements: HashMap::new() }
    }

    fn serve(mut self, queue: &Mutex<std::sync::mpsc::Receiver<Box<dyn Job>>>) {
        loop {
            let job = {
                let queue = queue.lock().unwrap_or_else(|p| p.into_inner());
                queue.recv()
            };
            match job {
                Ok(job) => job.run(&mut self),
                // The store was dropped.
                Err(_) => return,
            }
        }
    }

    /// Runs raw `work` on this worker's connection (opened first if needed).
    fn run_raw<T>(&mut self, work: RawWork<T>) -> Result<T, StoreError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.statements.clear();
            self.client = Some(self.setup.open()?);
        }
        let client = self.client.as_mut().expect("connected above");
        let result = work(&mut Connection { client, statements: &mut self.statements, setup: &self.setup });
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        result
    }

    /// Runs `work` in one transaction, again while PostgreSQL aborts it as a deadlock.
    fn run<T>(&mut self, work: &mut Work<T>, write: bool) -> Result<T, StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            if self.client.as_ref().is_none_or(Client::is_closed) {
                self.statements.clear();
                self.client = Some(self.setup.open()?);
            }
            let Worker { setup, client, statements } = self;
            let client = client.as_mut().expect("connected above");
            let mut retry = false;
            let outcome = run_once(client, statements, setup, work, write, &mut retry);
            if client.is_closed() {
                self.client = None;
            }
            if retry && attempt < MAX_ATTEMPTS {
                // Jittered, growing: the racing transactions do not collide again in step.
                let jitter = u64::from(std::process::id() ^ attempt.wrapping_mul(2_654_435_761)) % 5;
                std::thread::sleep(Duration::from_millis(u64::from(attempt) * 2 + jitter));
                continue;
            }
            return outcome;
        }
    }
}

fn run_once<T>(
    client: &mut Client,
    statements: &mut HashMap<String, Statement>,
    setup: &Setup,
    work: &mut Work<T>,
    write: bool,
    retry: &mut bool,
) -> Result<T, StoreError> {
    let (shown, round_trips) = (&*setup.shown, &setup.round_trips);
    // BEGIN and COMMIT.
    round_trips.fetch_add(2, Ordering::Relaxed);
    let isolation = if write { IsolationLevel::ReadCommitted } else { IsolationLevel::RepeatableRead };
    let mut tx = client
        .build_transaction()
        .isolation_level(isolation)
        .read_only(!write)
        .start()
        .map_err(|error| map_error(&error, shown))?;
    let mut storage = PgTx {
        tx: &mut tx,
        statements,
        shown,
        retry,
        round_trips,
        write,
        locked: Vec::new(),
        message_count: None,
        usage: None,
        run_sessions: &setup.run_sessions,
    };
    let result = work(&mut storage).and_then(|value| storage.write_usage().map(|()| value));
    drop(storage);
    match result {
        Ok(value) => {
            tx.commit().map_err(|error| {
                *retry |= is_retryable(&error);
                map_error(&error, shown)
            })?;
            Ok(value)
        }
        // Dropping the transaction rolls it back.
        Err(error) => Err(error),
    }
}

/// Storage operations inside one transaction.
struct PgTx<'a, 'c> {
    tx: &'a mut postgres::Transaction<'c>,
    statements: &'a mut HashMap<String, Statement>,
    shown: &'a str,
    /// Set when PostgreSQL aborted the transaction as a deadlock: it runs again whole.
    retry: &'a mut bool,
    round_trips: &'a AtomicU64,
    /// A write transaction (which locks what it touches).
    write: bool,
    /// The lock keys taken in this transaction.
    locked: Vec<String>,
    /// A session's message count read (with a run's control row) or written in this write
    /// transaction, under the session's lock: the rules ask for it right after the control row.
    message_count: Option<(SessionId, u64)>,
    /// Token usage added to a session in this write transaction and not written yet: it joins
    /// the statement that writes the session's messages (a model step adds both), or is written
    /// before anything reads it and before the commit.
    usage: Option<(SessionId, Usage, u64)>,
    run_sessions: &'a Mutex<HashMap<RunId, SessionId>>,
}

/// How many run-to-session entries a store remembers before it starts over.
const REMEMBERED_RUNS: usize = 100_000;

type Params<'p> = &'p [&'p (dyn ToSql + Sync)];

impl PgTx<'_, '_> {
    fn fail(&mut self, error: &postgres::Error) -> StoreError {
        *self.retry |= is_retryable(error);
        map_error(error, self.shown)
    }

    /// Takes the transaction's advisory lock on `key` (once): in a write, before reading
    /// anything the rules decide on.
    fn lock(&mut self, key: String) -> Result<(), StoreError> {
        if !self.write || self.locked.contains(&key) {
            return Ok(());
        }
        self.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", &[&key])?;
        self.locked.push(key);
        Ok(())
    }

    fn lock_session(&mut self, session: &SessionId) -> Result<(), StoreError> {
        self.lock(format!("session:{session}"))
    }

    /// Locks the session of `run` (when the run exists).
    fn lock_run(&mut self, run: &RunId) -> Result<(), StoreError> {
        if !self.write {
            return Ok(());
        }
        let known = lock(self.run_sessions).get(run).cloned();
        let session = match known {
            Some(session) => session,
            None => {
                let row = self.query_opt("SELECT session_id FROM runs WHERE id = $1", &[&run.as_str()])?;
                let Some(row) = row else { return Ok(()) };
                let session = session_id(get(&row, 0)?)?;
                self.remember(run, &session);
                session
            }
        };
        self.lock_session(&session)
    }

    /// Writes the token usage added and not written yet (see `usage`).
    fn write_usage(&mut self) -> Result<(), StoreError> {
        let Some((session, usage, now_ms)) = self.usage.take() else { return Ok(()) };
        self.execute(
            "INSERT INTO sessions (id, message_count, created_at, updated_at, input_tokens, output_tokens)
             VALUES ($1, 0, $2, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET input_tokens = sessions.input_tokens + EXCLUDED.input_tokens,
               output_tokens = sessions.output_tokens + EXCLUDED.output_tokens",
            &[&session.as_str(), &signed(now_ms), &signed(usage.input_tokens), &signed(usage.output_tokens)],
        )
        .map(drop)
    }

    /// Remembers the session of `run` (a run never changes session).
    fn remember(&self, run: &RunId, session: &SessionId) {
        let mut known = lock(self.run_sessions);
        if known.len() >= REMEMBERED_RUNS {
            known.clear();
        }
        known.insert(run.clone(), session.clone());
    }

    /// Locks the session of the pending input `id` (when it exists).
    fn lock_pending(&mut self, id: &str) -> Result<(), StoreError> {
        if !self.write {
            return Ok(());
        }
        let row = self.query_opt("SELECT session_id FROM pending_inputs WHERE id = $1", &[&id])?;
        let Some(row) = row else { return Ok(()) };
        let session = session_id(get(&row, 0)?)?;
        self.lock_session(&session)
    }

    fn statement(&mut self, sql: &str) -> Result<Statement, StoreError> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let statement = self.tx.prepare(sql).map_err(|error| self.fail(&error))?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        let statement = self.statement(sql)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.tx.query(&statement, params).map_err(|error| self.fail(&error))
    }

    fn query_opt(&mut self, sql: &str, params: Params<'_>) -> Result<Option<Row>, StoreError> {
        let statement = self.statement(sql)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.tx.query_opt(&statement, params).map_err(|error| self.fail(&error))
    }

    fn execute(&mut self, sql: &str, params: Params<'_>) -> Result<u64, StoreError> {
        let statement = self.statement(sql)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.tx.execute(&statement, params).map_err(|error| self.fail(&error))
    }
}

/// A column, or `KEEL_STORE_CORRUPT` when it does not hold what keel stores there.
fn get<'r, T: FromSql<'r>>(row: &'r Row, index: usize) -> Result<T, StoreError> {
    row.try_get(index).map_err(corrupt)
}

fn count(row: &Row, index: usize) -> Result<u64, StoreError> {
    Ok(get::<i64>(row, index)?.max(0) as u64)
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn session_id(id: String) -> Result<SessionId, StoreError> {
    SessionId::from_store(id).map_err(corrupt)
}

/// The columns of a [`RunControl`], for [`control_row`].
const CONTROL_COLUMNS: &str =
    "session_id, state, lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by";

fn control_row(row: &Row, at: usize) -> Result<RunControl, StoreError> {
    Ok(RunControl {
        session: session_id(get(row, at)?)?,
        state: stored_state(get(row, at + 1)?)?,
        owner: get::<Option<String>>(row, at + 2)?.map(Arc::from),
        lease_expires_ms: get::<Option<i64>>(row, at + 3)?.unwrap_or(0).max(0) as u64,
        epoch: count(row, at + 4)?,
        attempts: u32::try_from(get::<i64>(row, at + 5)?.max(0)).unwrap_or(u32::MAX),
        cancel_requested_by: get(row, at + 6)?,
    })
}

const SUMMARY_SELECT: &str = "SELECT s.id, s.updated_at, s.message_count,
    (SELECT COUNT(*) FROM runs r WHERE r.session_id = s.id), s.input_tokens, s.output_tokens
    FROM sessions s";

fn summary_row(row: &Row) -> Result<SessionSummary, StoreError> {
    Ok(SessionSummary {
        id: session_id(get(row, 0)?)?,
        updated_at_ms: count(row, 1)?,
        messages: count(row, 2)?,
        runs: count(row, 3)?,
        usage: Usage { input_tokens: count(row, 4)?, output_tokens: count(row, 5)? },
    })
}

const PENDING_COLUMNS: &str = "id, run_id, session_id, call_id, body, created_at, expires_at";

fn pending_row(row: &Row) -> Result<PendingInput, StoreError> {
    Ok(PendingInput {
        id: get(row, 0)?,
        run_id: stored_run_id(get(row, 1)?)?,
        session_id: session_id(get(row, 2)?)?,
        call_id: get(row, 3)?,
        kind: decode_pending_kind(get(row, 4)?).map_err(corrupt)?,
        created_at_ms: count(row, 5)?,
        expires_at_ms: count(row, 6)?,
    })
}

impl Tx for PgTx<'_, '_> {
    fn message_count(&mut self, session: &SessionId) -> Result<u64, StoreError> {
        self.lock_session(session)?;
        if let Some((known, count)) = &self.message_count
            && known == session
        {
            return Ok(*count);
        }
        let row = self.query_opt("SELECT message_count FROM sessions WHERE id = $1", &[&session.as_str()])?;
        row.map_or(Ok(0), |row| count(&row, 0))
    }

    fn message_writer(&mut self, session: &SessionId, position: u64) -> Result<Option<RunId>, StoreError> {
        self.lock_session(session)?;
        let row = self.query_opt(
            "SELECT run_id FROM messages WHERE session_id = $1 AND position = $2",
            &[&session.as_str(), &signed(position)],
        )?;
        row.map(|row| stored_run_id(get(&row, 0)?)).transpose()
    }

    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(session)?;
        // One statement for the messages and the session's count: a statement per message, or
        // one more for the count, would dominate a step.
        let positions: Vec<i64> = (0..messages.len()).map(|i| signed(first_position + i as u64)).collect();
        let bodies: Vec<String> = messages.iter().map(|m| encode_message(m)).collect();
        let count = first_position + messages.len() as u64;
        self.message_count = Some((session.clone(), count));
        // The usage a model step added to this session comes along.
        let usage = match self.usage.take() {
            Some((known, usage, _)) if &known == session => usage,
            other => {
                self.usage = other;
                Usage::default()
            }
        };
        self.execute(
            "WITH added AS (
                 INSERT INTO messages (session_id, position, run_id, body)
                 SELECT $1, position, $2, body FROM UNNEST($3::BIGINT[], $4::TEXT[]) AS m(position, body)
             )
             INSERT INTO sessions (id, message_count, created_at, updated_at, input_tokens, output_tokens)
             VALUES ($1, $5, $6, $6, $7, $8)
             ON CONFLICT (id) DO UPDATE SET message_count = EXCLUDED.message_count, updated_at = EXCLUDED.updated_at,
               input_tokens = sessions.input_tokens + EXCLUDED.input_tokens,
               output_tokens = sessions.output_tokens + EXCLUDED.output_tokens",
            &[
                &session.as_str(),
                &run.as_str(),
                &positions,
                &bodies,
                &signed(count),
                &signed(now_ms),
                &signed(usage.input_tokens),
                &signed(usage.output_tokens),
            ],
        )
        .map(drop)
    }

    fn messages(&mut self, session: &SessionId) -> Result<Vec<Arc<Message>>, StoreError> {
        self.lock_session(session)?;
        let rows = self.query(
            "SELECT body FROM messages WHERE session_id = $1 ORDER BY position",
            &[&session.as_str()],
        )?;
        rows.iter().map(|row| decode_message(get(row, 0)?).map(Arc::new).map_err(corrupt)).collect()
    }

    fn add_usage(&mut self, session: &SessionId, usage: Usage, now_ms: u64) -> Result<(), StoreError> {
        self.lock_session(session)?;
        match &mut self.usage {
            Some((known, added, at)) if known == session => {
                added.input_tokens += usage.input_tokens;
                added.output_tokens += usage.output_tokens;
                *at = now_ms;
            }
            _ => {
                self.write_usage()?;
                self.usage = Some((session.clone(), usage, now_ms));
            }
        }
        Ok(())
    }

    fn set_session_state(
        &mut self,
        session: &SessionId,
        state: &serde_json::Value,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(session)?;
        self.execute(
            "INSERT INTO sessions (id, message_count, created_at, updated_at, state) VALUES ($1, 0, $2, $2, $3)
             ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, updated_at = EXCLUDED.updated_at",
            &[&session.as_str(), &signed(now_ms), &state.to_string()],
        )
        .map(drop)
    }

    fn session_state(&mut self, session: &SessionId) -> Result<Option<serde_json::Value>, StoreError> {
        self.lock_session(session)?;
        let row = self.query_opt("SELECT state FROM sessions WHERE id = $1", &[&session.as_str()])?;
        match row.map(|row| get::<Option<String>>(&row, 0)).transpose()?.flatten() {
            Some(json) => serde_json::from_str(&json).map(Some).map_err(corrupt),
            None => Ok(None),
        }
    }

    fn session_summary(&mut self, session: &SessionId) -> Result<Option<SessionSummary>, StoreError> {
        self.write_usage()?;
        let row = self.query_opt(&format!("{SUMMARY_SELECT} WHERE s.id = $1"), &[&session.as_str()])?;
        row.map(|row| summary_row(&row)).transpose()
    }

    fn sessions(&mut self) -> Result<Vec<SessionSummary>, StoreError> {
        self.write_usage()?;
        let rows = self.query(&format!("{SUMMARY_SELECT} ORDER BY s.updated_at DESC, s.id"), &[])?;
        rows.iter().map(summary_row).collect()
    }

    fn delete_session(&mut self, session: &SessionId) -> Result<bool, StoreError> {
        self.lock_session(session)?;
        self.write_usage()?;
        self.message_count = None;
        let id = session.as_str();
        self.execute(
            "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE session_id = $1)",
            &[&id],
        )?;
        self.execute("DELETE FROM pending_inputs WHERE session_id = $1", &[&id])?;
        self.execute("DELETE FROM decided_inputs WHERE session_id = $1", &[&id])?;
        let runs = self.execute("DELETE FROM runs WHERE session_id = $1", &[&id])?;
        self.execute("DELETE FROM messages WHERE session_id = $1", &[&id])?;
        // Its event log goes too; its head stays, so that a session of the same id numbers its
        // events after the old ones and no client's `Last-Event-ID` skips them.
        self.execute("DELETE FROM events WHERE session_id = $1", &[&id])?;
        let sessions = self.execute("DELETE FROM sessions WHERE id = $1", &[&id])?;
        Ok(runs + sessions > 0)
    }

    fn insert_run(
        &mut self,
        record: &RunRecord,
        control: &RunControl,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(&record.session_id)?;
        self.remember(&record.run_id, &record.session_id);
        self.execute(
            "INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at,
               lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by, limits)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8, $9, $10, $11, $12, $13)",
            &[
                &record.run_id.as_str(),
                &record.session_id.as_str(),
                &encode_message(&record.input),
                &signed(record.history_len),
                &signed(record.call_base),
                &control.state.as_str(),
                &signed(now_ms),
                &control.owner.as_deref(),
                &signed(control.lease_expires_ms),
                &signed(control.epoch),
                &i64::from(control.attempts),
                &control.cancel_requested_by,
                &stored_limits(record),
            ],
        )
        .map(drop)
    }

    fn run(&mut self, run: &RunId) -> Result<Option<RunRecord>, StoreError> {
        self.lock_run(run)?;
        let row = self.query_opt(
            "SELECT session_id, input, history_len, call_base, state, limits FROM runs WHERE id = $1",
            &[&run.as_str()],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(RunRecord {
            run_id: run.clone(),
            session_id: session_id(get(&row, 0)?)?,
            input: decode_message(get(&row, 1)?).map_err(corrupt)?,
            history_len: count(&row, 2)?,
            call_base: count(&row, 3)?,
            state: stored_state(get(&row, 4)?)?,
            limits: read_limits(get(&row, 5)?)?,
        }))
    }

    fn control(&mut self, run: &RunId) -> Result<Option<RunControl>, StoreError> {
        self.lock_run(run)?;
        if !self.write {
            let sql = format!("SELECT {CONTROL_COLUMNS} FROM runs WHERE id = $1");
            let row = self.query_opt(&sql, &[&run.as_str()])?;
            return row.map(|row| control_row(&row, 0)).transpose();
        }
        // In a write, the session's message count comes along: the rules check the transcript
        // next, and the session's lock keeps both as read until the commit.
        let sql = format!(
            "SELECT {CONTROL_COLUMNS}, (SELECT message_count FROM sessions s WHERE s.id = r.session_id)
             FROM runs r WHERE id = $1"
        );
        let Some(row) = self.query_opt(&sql, &[&run.as_str()])? else {
            return Ok(None);
        };
        let control = control_row(&row, 0)?;
        let count = get::<Option<i64>>(&row, 7)?.map_or(0, |n| n.max(0) as u64);
        self.message_count = Some((control.session.clone(), count));
        Ok(Some(control))
    }

    fn set_control(&mut self, run: &RunId, control: &RunControl, now_ms: u64) -> Result<(), StoreError> {
        self.lock_run(run)?;
        self.execute(
            "UPDATE runs SET state = $2, lease_owner = $3, lease_expires_at = $4, lease_epoch = $5,
               attempts = $6, cancel_requested_by = $7, updated_at = $8
             WHERE id = $1",
            &[
                &run.as_str(),
                &control.state.as_str(),
                &control.owner.as_deref(),
                &signed(control.lease_expires_ms),
                &signed(control.epoch),
                &i64::from(control.attempts),
                &control.cancel_requested_by,
                &signed(now_ms),
            ],
        )
        .map(drop)
    }

    fn cancel_requested(&mut self, owner: &str) -> Result<Vec<RunId>, StoreError> {
        let rows = self.query(
            "SELECT id FROM runs WHERE state = 'running' AND lease_owner = $1
               AND cancel_requested_by IS NOT NULL ORDER BY id",
            &[&owner],
        )?;
        rows.iter().map(|row| stored_run_id(get(row, 0)?)).collect()
    }

    fn open_runs(&mut self, session: Option<&SessionId>) -> Result<Vec<(RunId, RunControl)>, StoreError> {
        if let Some(session) = session {
            self.lock_session(session)?;
        }
        let rows = match session {
            Some(session) => self.query(
                &format!(
                    "SELECT id, {CONTROL_COLUMNS} FROM runs WHERE session_id = $1
                       AND state IN ('running', 'awaiting_input') ORDER BY id"
                ),
                &[&session.as_str()],
            )?,
            None => self.query(
                &format!(
                    "SELECT id, {CONTROL_COLUMNS} FROM runs WHERE state IN ('running', 'awaiting_input') ORDER BY id"
                ),
                &[],
            )?,
        };
        rows.iter().map(|row| Ok((stored_run_id(get(row, 0)?)?, control_row(row, 1)?))).collect()
    }

    fn has_step(&mut self, run: &RunId, step: &StepName) -> Result<bool, StoreError> {
        self.lock_run(run)?;
        let row = self.query_opt(
            "SELECT 1 FROM journal WHERE run_id = $1 AND step = $2",
            &[&run.as_str(), &step.to_string()],
        )?;
        Ok(row.is_some())
    }

    fn append_journal(&mut self, run: &RunId, entry: &JournalEntry) -> Result<bool, StoreError> {
        self.lock_run(run)?;
        self.execute(
            "INSERT INTO journal (run_id, step, seq, body)
             VALUES ($1, $2, (SELECT COUNT(*) FROM journal WHERE run_id = $1), $3)
             ON CONFLICT (run_id, step) DO NOTHING",
            &[&run.as_str(), &entry.step.to_string(), &encode_record(&entry.record)],
        )
        .map(|inserted| inserted == 1)
    }

    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError> {
        self.lock_run(run)?;
        let rows =
            self.query("SELECT step, body FROM journal WHERE run_id = $1 ORDER BY seq", &[&run.as_str()])?;
        rows.iter()
            .map(|row| {
                let step: &str = get(row, 0)?;
                let step = StepName::parse(step).ok_or_else(|| corrupt(format!("bad step name {step:?}")))?;
                Ok(JournalEntry { step, record: decode_record(get(row, 1)?).map_err(corrupt)? })
            })
            .collect()
    }

    fn compact_journals(&mut self) -> Result<u64, StoreError> {
        self.execute(
            "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE state IN ('done', 'failed', 'cancelled'))",
            &[],
        )
    }

    fn pending(&mut self, id: &str) -> Result<Option<PendingInput>, StoreError> {
        self.lock_pending(id)?;
        let row =
            self.query_opt(&format!("SELECT {PENDING_COLUMNS} FROM pending_inputs WHERE id = $1"), &[&id])?;
        row.map(|row| pending_row(&row)).transpose()
    }

    fn pending_list(&mut self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, StoreError> {
        if let Some(session) = session {
            self.lock_session(session)?;
        }
        let rows = match session {
            Some(session) => self.query(
                &format!(
                    "SELECT {PENDING_COLUMNS} FROM pending_inputs WHERE session_id = $1 ORDER BY created_at, seq"
                ),
                &[&session.as_str()],
            )?,
            None => self.query(&format!("SELECT {PENDING_COLUMNS} FROM pending_inputs ORDER BY created_at, seq"), &[])?,
        };
        rows.iter().map(pending_row).collect()
    }

    fn insert_pending(&mut self, pending: &PendingInput) -> Result<(), StoreError> {
        self.lock_session(&pending.session_id)?;
        self.execute(
            "INSERT INTO pending_inputs (id, run_id, session_id, call_id, step, body, created_at, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &pending.id,
                &pending.run_id.as_str(),
                &pending.session_id.as_str(),
                &pending.call_id,
                &pending.step().to_string(),
                &encode_pending_kind(&pending.kind),
                &signed(pending.created_at_ms),
                &signed(pending.expires_at_ms),
            ],
        )
        .map(drop)
    }

    fn delete_pending(&mut self, id: &str) -> Result<(), StoreError> {
        self.lock_pending(id)?;
        self.execute("DELETE FROM pending_inputs WHERE id = $1", &[&id]).map(drop)
    }

    fn decided(&mut self, id: &str) -> Result<Option<DecidedInput>, StoreError> {
        let row = self.query_opt(
            "SELECT run_id, session_id, outcome, by_whom, at FROM decided_inputs WHERE id = $1",
            &[&id],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(DecidedInput {
            id: id.to_owned(),
            run_id: stored_run_id(get(&row, 0)?)?,
            session_id: session_id(get(&row, 1)?)?,
            outcome: get(&row, 2)?,
            by: get(&row, 3)?,
            at_ms: count(&row, 4)?,
        }))
    }

    fn insert_decided(&mut self, decided: &DecidedInput) -> Result<(), StoreError> {
        self.lock_session(&decided.session_id)?;
        self.execute(
            "INSERT INTO decided_inputs (id, run_id, session_id, outcome, by_whom, at) VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (id) DO UPDATE SET outcome = EXCLUDED.outcome, by_whom = EXCLUDED.by_whom, at = EXCLUDED.at",
            &[
                &decided.id,
                &decided.run_id.as_str(),
                &decided.session_id.as_str(),
                &decided.outcome,
                &decided.by,
                &signed(decided.at_ms),
            ],
        )
        .map(drop)
    }

    fn schedule_last_fire(&mut self, name: &str) -> Result<Option<u64>, StoreError> {
        self.lock(format!("schedule:{name}"))?;
        let row = self.query_opt("SELECT last_fire FROM schedules WHERE name = $1", &[&name])?;
        row.map(|row| count(&row, 0)).transpose()
    }

    fn set_schedule_last_fire(&mut self, name: &str, tick_ms: u64) -> Result<(), StoreError> {
        self.lock(format!("schedule:{name}"))?;
        self.execute(
            "INSERT INTO schedules (name, last_fire) VALUES ($1, $2)
             ON CONFLICT (name) DO UPDATE SET last_fire = EXCLUDED.last_fire",
            &[&name, &signed(tick_ms)],
        )
        .map(drop)
    }

    fn delayed_run(&mut self, run: &RunId) -> Result<Option<DelayedRunRecord>, StoreError> {
        self.lock(format!("delayed:{run}"))?;
        let row = self.query_opt(
            "SELECT session_id, input, due_at, source, state, created_at, held_until, attempts, note
             FROM delayed_runs WHERE run_id = $1",
            &[&run.as_str()],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(DelayedRunRecord {
            run: DelayedRun {
                run_id: run.clone(),
                session_id: session_id(get(&row, 0)?)?,
                input: decode_message(get(&row, 1)?).map_err(corrupt)?,
                due_ms: count(&row, 2)?,
                source: get(&row, 3)?,
            },
            state: stored_delayed_state(get(&row, 4)?)?,
            created_ms: count(&row, 5)?,
            held_until_ms: count(&row, 6)?,
            attempts: u32::try_from(count(&row, 7)?).unwrap_or(u32::MAX),
            note: get(&row, 8)?,
        }))
    }

    fn put_delayed_run(&mut self, record: &DelayedRunRecord) -> Result<(), StoreError> {
        let run = &record.run;
        self.lock(format!("delayed:{}", run.run_id))?;
        self.execute(
            "INSERT INTO delayed_runs (run_id, session_id, input, due_at, source, state, created_at, held_until,
             attempts, note) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT (run_id) DO UPDATE SET state = EXCLUDED.state, held_until = EXCLUDED.held_until,
             attempts = EXCLUDED.attempts, note = EXCLUDED.note",
            &[
                &run.run_id.as_str(),
                &run.session_id.as_str(),
                &encode_message(&run.input),
                &signed(run.due_ms),
                &run.source,
                &record.state.as_str(),
                &signed(record.created_ms),
                &signed(record.held_until_ms),
                &i64::from(record.attempts),
                &record.note,
            ],
        )
        .map(drop)
    }

    fn due_delayed_runs(&mut self, now_ms: u64, limit: usize) -> Result<Vec<RunId>, StoreError> {
        let rows = self.query(
            "SELECT run_id FROM delayed_runs WHERE state = 'waiting' AND due_at <= $1 AND held_until <= $1
             ORDER BY due_at, run_id LIMIT $2",
            &[&signed(now_ms), &signed(limit as u64)],
        )?;
        rows.iter().map(|row| stored_run_id(get(row, 0)?)).collect()
    }

    fn memory_item(&mut self, owner: &str, kind: &str, key: &str) -> Result<Option<MemoryItem>, StoreError> {
        // A write reads what it merges with under the owner's lock: two runs of one owner
        // merging the same relation take turns.
        self.lock(format!("memory:{owner}"))?;
        let row = self.query_opt(
            "SELECT value, updated_at FROM memories WHERE owner = $1 AND kind = $2 AND key = $3",
            &[&owner, &kind, &key],
        )?;
        row.map(|row| memory_item(kind.to_owned(), key.to_owned(), get(&row, 0)?, get(&row, 1)?)).transpose()
    }

    fn put_memory_item(&mut self, owner: &str, item: &MemoryItem) -> Result<(), StoreError> {
        self.lock(format!("memory:{owner}"))?;
        self.execute(
            "INSERT INTO memories (owner, kind, key, value, updated_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (owner, kind, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            &[&owner, &item.kind, &item.key, &item.value.to_string(), &signed(item.updated_ms)],
        )
        .map(drop)
    }

    fn memory_items(&mut self, owner: &str, kind: Option<&str>) -> Result<Vec<MemoryItem>, StoreError> {
        let rows = self.query(
            "SELECT kind, key, value, updated_at FROM memories WHERE owner = $1 AND ($2::text IS NULL OR kind = $2)
             ORDER BY updated_at DESC, key",
            &[&owner, &kind],
        )?;
        rows.iter().map(|row| memory_item(get(row, 0)?, get(row, 1)?, get(row, 2)?, get(row, 3)?)).collect()
    }

    fn delete_memory(
        &mut self,
        owner: &str,
        kind: Option<&str>,
        key: Option<&str>,
    ) -> Result<u64, StoreError> {
        self.lock(format!("memory:{owner}"))?;
        self.execute(
            "DELETE FROM memories WHERE owner = $1 AND ($2::text IS NULL OR kind = $2) AND ($3::text IS NULL OR key = $3)",
            &[&owner, &kind, &key],
        )
    }

    fn memory_owners(&mut self) -> Result<Vec<MemoryOwner>, StoreError> {
        let rows = self.query(
            "SELECT owner, kind, count(*), max(updated_at) FROM memories GROUP BY owner, kind ORDER BY owner, kind",
            &[],
        )?;
        let rows: Vec<(String, String, u64, u64)> = rows
            .iter()
            .map(|row| Ok((get(row, 0)?, get(row, 1)?, count(row, 2)?, count(row, 3)?)))
            .collect::<Result<_, StoreError>>()?;
        Ok(memory_owner_rows(rows.into_iter()))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use keel_core::Store;
    use keel_testkit::postgres::ScratchDatabase;

    use super::*;

    fn store(database: &ScratchDatabase) -> PostgresStore {
        PostgresStore::connect(&database.url, PostgresOptions::default()).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_store_conforms() {
        let database = ScratchDatabase::create("conforms");
        let clock = keel_core::ManualClock::starting_now();
        let store = PostgresStore::connect_with_clock(
            &database.url,
            PostgresOptions::default(),
            Arc::new(clock.clone()),
        )
        .unwrap();
        crate::conformance::run_all(&store, &clock).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_racing_for_one_session_start_one_run() {
        let database = ScratchDatabase::create("race");
        let instances = [Arc::new(store(&database)), Arc::new(store(&database))];
        let session = SessionId::new("contested").unwrap();
        for round in 0..5 {
            let tasks: Vec<_> = (0..16)
                .map(|i| {
                    let store = Arc::clone(&instances[i % 2]);
                    let record = crate::conformance::run_record(&format!("r{round}x{i}"), &session, 0);
                    tokio::spawn(async move { crate::conformance::create_run(store.as_ref(), &record).await })
                })
                .collect();
            let mut started = 0;
            for task in tasks {
                match task.await.unwrap() {
                    Ok(_) => started += 1,
                    Err(StoreError::Busy(_)) => {}
                    Err(other) => panic!("round {round}: {other}"),
                }
            }
            assert_eq!(started, 1, "round {round}: one run per session, across instances");
            // End it, so that the next round has a free session again.
            let open = instances[0].open_runs(Some(&session)).await.unwrap();
            assert_eq!(open.len(), 1);
            instances[1]
                .commit_step(keel_core::StepCommit {
                    state: Some(keel_core::RunState::Done),
                    ..keel_core::StepCommit::new(&session, &open[0].run_id)
                })
                .await
                .unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_text_comes_back_exactly() {
        let database = ScratchDatabase::create("text");
        let store = store(&database);
        let session = SessionId::new("quotes").unwrap();
        let record = crate::conformance::run_record("lit", &session, 0);
        crate::conformance::create_run(&store, &record).await.unwrap();
        let hostile = "it's '); DROP TABLE runs; -- \\' \\\\ \" $$ $tag$ \u{2028} ünïcödé 😀 \n\t end";
        let message = Arc::new(Message::user(hostile));
        crate::conformance::append_messages(
            &store,
            &session,
            &record.run_id,
            0,
            std::slice::from_ref(&message),
        )
        .await
        .unwrap();
        assert_eq!(store.load_messages(&session).await.unwrap(), [message]);
        assert!(store.load_run(&record.run_id).await.unwrap().is_some(), "the runs table is still there");
    }

    #[test]
    fn a_newer_schema_is_refused_and_left_as_it_was() {
        let database = ScratchDatabase::create("newer");
        drop(store(&database));
        let mut client = Client::connect(&database.url, NoTls).unwrap();
        client.execute("UPDATE keel.schema_version SET version = $1", &[&(SCHEMA_VERSION + 1)]).unwrap();
        let error = PostgresStore::connect(&database.url, PostgresOptions::default()).err().unwrap();
        assert_eq!(error.code(), keel_core::ErrorCode::StoreSchemaNewer, "{error}");
        let version: i64 = client.query_one("SELECT version FROM keel.schema_version", &[]).unwrap().get(0);
        assert_eq!(version, SCHEMA_VERSION + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_of_the_first_schema_is_brought_forward_with_its_sessions() {
        let database = ScratchDatabase::create("upgrade");
        // A database as the first version left it, with a session in it.
        let url = database.url.clone();
        std::thread::spawn(move || {
            let mut client = Client::connect(&url, NoTls).unwrap();
            client
                .batch_execute(&format!(
                    "CREATE SCHEMA keel; SET search_path TO keel; {}
                     CREATE TABLE keel.schema_version (version BIGINT NOT NULL);
                     INSERT INTO keel.schema_version VALUES (1);
                     INSERT INTO keel.sessions (id, message_count, created_at, updated_at) VALUES ('old', 0, 1, 1);",
                    MIGRATIONS[0]
                ))
                .unwrap();
        })
        .join()
        .unwrap();
        let store = store(&database);
        let sessions = store.list_sessions().await.unwrap();
        assert_eq!(sessions.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["old"]);
        // The event log, new in version 2, works.
        let log = store.event_log().unwrap();
        let session = SessionId::new("old").unwrap();
        let event =
            keel_core::NewEvent { session: session.clone(), run: RunId::from_suffix("r"), body: None };
        assert_eq!(log.append(7, vec![event]).await.unwrap(), Some(vec![1]));
        let url = database.url.clone();
        let version: i64 = std::thread::spawn(move || {
            let mut client = Client::connect(&url, NoTls).unwrap();
            client.query_one("SELECT version FROM keel.schema_version", &[]).unwrap().get(0)
        })
        .join()
        .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }

    #[test]
    fn another_applications_tables_in_the_database_are_left_alone() {
        let database = ScratchDatabase::create("shared");
        let mut client = Client::connect(&database.url, NoTls).unwrap();
        client
            .batch_execute("CREATE TABLE sessions (name TEXT); INSERT INTO sessions VALUES ('theirs')")
            .unwrap();
        drop(store(&database));
        let theirs: String = client.query_one("SELECT name FROM public.sessions", &[]).unwrap().get(0);
        assert_eq!(theirs, "theirs");
    }

    #[test]
    fn bad_urls_get_clear_errors_without_the_password() {
        let database = ScratchDatabase::create("urls");
        let missing = database.url.replace(database.name(), "keel_no_such_database");
        let with_password = missing.replacen("postgres://postgres@", "postgres://postgres:hunter2@", 1);
        let error = PostgresStore::connect(&with_password, PostgresOptions::default()).err().unwrap();
        let text = error.to_string();
        assert_eq!(error.code(), keel_core::ErrorCode::Store, "{text}");
        assert!(text.contains("keel_no_such_database") && text.contains("does not exist"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");

        let options =
            PostgresOptions { connect_timeout: Duration::from_secs(2), ..PostgresOptions::default() };
        let unreachable = "postgres://keel:s3cr3t-pw@127.0.0.1:1/keel";
        let error = PostgresStore::connect(unreachable, options.clone()).err().unwrap();
        let text = error.to_string();
        assert!(
            text.contains("postgres://keel@127.0.0.1:1/keel") && text.contains("is PostgreSQL running"),
            "{text}"
        );
        assert!(!text.contains("s3cr3t-pw"), "{text}");

        let error = PostgresStore::connect("postgres://u:pw@[nonsense", options).err().unwrap();
        assert!(!error.to_string().contains("pw@"), "{error}");
        assert_eq!(
            redact("postgres://u:secret@db.example:6543/prod?sslmode=disable"),
            "postgres://u@db.example:6543/prod"
        );
    }
}
