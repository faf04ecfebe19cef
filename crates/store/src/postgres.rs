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
//! transactions: one consistent snapshot per read, taking no lock; what a new run starts from
//! (the session's transcript, state and unfinished run) is one statement, so one snapshot.
//!
//! **Step commits go together.** A statement costs the database far more than the row it
//! writes, and a commit costs a WAL flush. So the commits waiting when a connection is free go
//! in one transaction (up to [`MAX_BATCH`]): it locks all their sessions in one statement (in
//! one order, so that two such transactions never wait on each other in a cycle), reads what
//! their rules need in one statement, runs each commit's rules, writes what they wrote in one
//! statement, and commits once (see `tx`). A commit the rules refuse is refused alone: the
//! rules refuse before they write. Idle, a commit goes alone at once, in five statements.
//! Under load the batches grow by themselves; nothing waits to fill them.
//!
//! **Plans.** keel's statements find and write rows by key. The connections forbid sequential
//! scans and hash and merge joins, and use generic plans: a young database's statistics (a
//! deployment's first minute, a benchmark's whole run) would otherwise make PostgreSQL scan and
//! hash whole tables, and keep that plan as they grow.
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

use keel_core::{BoxFuture, Clock, RunId, SessionId, StoreError, StoreFuture};
use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{Client, IsolationLevel, NoTls, Row, Statement};

pub use crate::backend::CommitSubject;
use crate::backend::{Backend, Ruled, SessionRows, Tx, Work};
pub use schema::SCHEMA_VERSION;
use schema::migrate;
use tx::PgTx;
use tx::get;

mod events;
mod schema;
mod tx;

/// Parameters of a statement.
type Params<'p> = &'p [&'p (dyn ToSql + Sync)];

/// How many times a transaction PostgreSQL aborted as a deadlock (or could not serialize) is run.
pub const MAX_ATTEMPTS: u32 = 12;

/// How a [`Postgres`] backend connects.
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    /// Connections (and worker threads). Default 4: with step commits batched, a few carry
    /// what the database can (see docs/scaling.md).
    pub pool_size: usize,
    /// How long one statement may run before PostgreSQL cancels it. Default 30 s.
    pub statement_timeout: Duration,
    /// How long connecting may take. Default 10 s.
    pub connect_timeout: Duration,
}

impl Default for PostgresOptions {
    fn default() -> PostgresOptions {
        PostgresOptions {
            pool_size: 4,
            statement_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// The PostgreSQL backend. See the module docs.
pub struct Postgres {
    jobs: Jobs,
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
        let (jobs, queue) = std::sync::mpsc::channel::<Queued>();
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
        self.send(Queued::Alone(Box::new(TypedJob { work, write, reply })), answer)
    }

    /// Queues `job`, whose answer comes on `answer`.
    fn send<T: Send + 'static>(
        &self,
        job: Queued,
        answer: tokio::sync::oneshot::Receiver<Result<T, StoreError>>,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        if self.jobs.send(job).is_err() {
            return Box::pin(std::future::ready(Err(workers_stopped())));
        }
        Box::pin(async move { answer.await.unwrap_or_else(|_| Err(workers_stopped())) })
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

    fn write_commit<T: Send + 'static>(
        &self,
        subject: CommitSubject,
        work: Work<T>,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Queued::Commit(Box::new(TypedCommit { subject, work, outcome: None, reply })), answer)
    }

    fn read_session(&self, session: SessionId) -> StoreFuture<'static, Result<SessionRows, StoreError>> {
        submit_raw(&self.jobs, Box::new(move |connection| tx::read_session(connection, &session))).into()
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
        // Key lookups only, and generic plans (see the module docs, "Plans");
        // `plan_cache_mode` is PostgreSQL 12's: older servers plan as they do.
        client
            .batch_execute(&format!(
                "SET search_path TO keel; SET statement_timeout = {timeout};
                 SET enable_seqscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
                 SELECT set_config('plan_cache_mode', 'force_generic_plan', false)
                 FROM pg_settings WHERE name = 'plan_cache_mode'"
            ))
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

/// What a worker is handed.
enum Queued {
    /// Work that runs alone: in a transaction of its own, or on the connection itself.
    Alone(Box<dyn Job>),
    /// A step's commit: it runs in one transaction with the other commits queued with it.
    Commit(Box<dyn CommitJob>),
}

/// The queue the workers take their jobs from.
type Jobs = std::sync::mpsc::Sender<Queued>;

/// Work that runs alone.
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

/// A step's commit, run with others in one transaction (see [`Worker::run_batch`]).
trait CommitJob: Send {
    /// What it is about, locked and read with the batch's other commits before any runs.
    fn subject(&self) -> &CommitSubject;
    /// Runs its work in `tx`, keeping the outcome for [`CommitJob::answer`]. Returns whether
    /// the work failed (the rules refused it, or a statement failed).
    fn work(&mut self, tx: &mut dyn Tx) -> bool;
    /// Answers the caller: the kept outcome once the transaction committed, else `failure`.
    fn answer(self: Box<Self>, failure: Option<StoreError>);
}

struct TypedCommit<T> {
    subject: CommitSubject,
    work: Work<T>,
    outcome: Option<Result<T, StoreError>>,
    reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> CommitJob for TypedCommit<T> {
    fn subject(&self) -> &CommitSubject {
        &self.subject
    }

    fn work(&mut self, tx: &mut dyn Tx) -> bool {
        let outcome = (self.work)(tx);
        let failed = outcome.is_err();
        self.outcome = Some(outcome);
        failed
    }

    fn answer(self: Box<Self>, failure: Option<StoreError>) {
        let stopped = || StoreError::Unavailable("the PostgreSQL workers stopped".into());
        let result = match failure {
            Some(failure) => Err(failure),
            None => self.outcome.unwrap_or_else(|| Err(stopped())),
        };
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

    /// The database, as messages show it.
    fn shown(&self) -> &str {
        &self.setup.shown
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
fn submit_raw<T: Send + 'static>(jobs: &Jobs, work: RawWork<T>) -> BoxFuture<'static, Result<T, StoreError>> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    if jobs.send(Queued::Alone(Box::new(RawJob { work, reply }))).is_err() {
        return Box::pin(std::future::ready(Err(workers_stopped())));
    }
    Box::pin(async move { answer.await.unwrap_or_else(|_| Err(workers_stopped())) })
}

fn workers_stopped() -> StoreError {
    StoreError::Unavailable("the PostgreSQL workers stopped".into())
}

/// The most step commits one transaction holds.
pub const MAX_BATCH: usize = 64;

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

    /// Takes jobs until the store is dropped. A step commit takes the commits queued behind it
    /// into its transaction: under load, commits share their `BEGIN`, locks, reads, writes and
    /// `COMMIT` (one WAL flush), and idle, a commit runs alone at once.
    fn serve(mut self, queue: &Mutex<std::sync::mpsc::Receiver<Queued>>) {
        loop {
            let (commits, alone) = {
                let queue = queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let Ok(first) = queue.recv() else {
                    // The store was dropped.
                    return;
                };
                let (mut commits, mut alone) = (Vec::new(), Vec::new());
                let mut sort = |job| match job {
                    Queued::Commit(commit) => commits.push(commit),
                    Queued::Alone(job) => alone.push(job),
                };
                let batching = matches!(first, Queued::Commit(_));
                sort(first);
                if batching {
                    for _ in 1..MAX_BATCH {
                        match queue.try_recv() {
                            Ok(job) => sort(job),
                            Err(_) => break,
                        }
                    }
                }
                (commits, alone)
            };
            if !commits.is_empty() {
                self.run_batch(commits);
            }
            for job in alone {
                job.run(&mut self);
            }
        }
    }

    /// Opens the connection if it is not open.
    fn connect(&mut self) -> Result<(), StoreError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.statements.clear();
            self.client = Some(self.setup.open()?);
        }
        Ok(())
    }

    /// Runs raw `work` on this worker's connection (opened first if needed).
    fn run_raw<T>(&mut self, work: RawWork<T>) -> Result<T, StoreError> {
        self.connect()?;
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
            self.connect()?;
            let Worker { setup, client, statements } = self;
            let client = client.as_mut().expect("connected above");
            let (outcome, retry) = run_once(client, statements, setup, work, write);
            if client.is_closed() {
                self.client = None;
            }
            if retry && attempt < MAX_ATTEMPTS {
                back_off(attempt);
                continue;
            }
            return outcome;
        }
    }

    /// Runs step commits in one transaction, and answers each. A commit the rules refuse is
    /// refused alone (the rules refuse before they write, so it leaves nothing to undo). When
    /// the transaction fails otherwise, it runs again while PostgreSQL aborted it as a deadlock;
    /// a broken connection fails every commit (their callers try again, and a commit that did
    /// reach the database is recognised then); any other failure runs the commits one by one,
    /// so that it is the failing commit's alone.
    fn run_batch(&mut self, mut commits: Vec<Box<dyn CommitJob>>) {
        let mut attempt = 0;
        let failure = loop {
            attempt += 1;
            if let Err(error) = self.connect() {
                break error;
            }
            let Worker { setup, client, statements } = self;
            let client = client.as_mut().expect("connected above");
            let outcome = run_batch_once(client, statements, setup, &mut commits);
            let broken = client.is_closed();
            if broken {
                self.client = None;
            }
            match outcome {
                Ok(()) => {
                    for commit in commits {
                        commit.answer(None);
                    }
                    return;
                }
                Err((_, true)) if attempt < MAX_ATTEMPTS => back_off(attempt),
                Err((error, _)) if broken || commits.len() == 1 => break error,
                Err(_) => {
                    for commit in commits {
                        self.run_batch(vec![commit]);
                    }
                    return;
                }
            }
        };
        for commit in commits {
            commit.answer(Some(failure.clone()));
        }
    }
}

/// Sleeps before attempt `attempt + 1` of a transaction PostgreSQL aborted: jittered and
/// growing, so that the racing transactions do not collide again in step.
fn back_off(attempt: u32) {
    let jitter = u64::from(std::process::id() ^ attempt.wrapping_mul(2_654_435_761)) % 5;
    std::thread::sleep(Duration::from_millis(u64::from(attempt) * 2 + jitter));
}

fn begin<'c>(client: &'c mut Client, write: bool) -> Result<postgres::Transaction<'c>, postgres::Error> {
    let isolation = if write { IsolationLevel::ReadCommitted } else { IsolationLevel::RepeatableRead };
    client.build_transaction().isolation_level(isolation).read_only(!write).start()
}

/// Runs `work` in one transaction. Also says whether running it again may succeed.
fn run_once<T>(
    client: &mut Client,
    statements: &mut HashMap<String, Statement>,
    setup: &Setup,
    work: &mut Work<T>,
    write: bool,
) -> (Result<T, StoreError>, bool) {
    let shown = &*setup.shown;
    // BEGIN and COMMIT.
    setup.round_trips.fetch_add(2, Ordering::Relaxed);
    let mut transaction = match begin(client, write) {
        Ok(transaction) => transaction,
        Err(error) => return (Err(map_error(&error, shown)), is_retryable(&error)),
    };
    let mut tx = PgTx::new(&mut transaction, statements, setup, write);
    let result = work(&mut tx).and_then(|value| tx.flush().map(|()| value));
    let (failure, retry) = (tx.failure.take(), tx.retry);
    drop(tx);
    match (result, failure) {
        // A statement failed (and the work went on): PostgreSQL would answer `COMMIT` with a
        // rollback.
        (_, Some(failure)) => (Err(failure), retry),
        (Ok(value), None) => match transaction.commit() {
            Ok(()) => (Ok(value), false),
            Err(error) => (Err(map_error(&error, shown)), is_retryable(&error)),
        },
        // Dropping the transaction rolls it back.
        (Err(error), None) => (Err(error), retry),
    }
}

/// One transaction of step commits (see [`Worker::run_batch`]): lock and read for all, run each
/// commit's rules, write what they held in one statement, commit. `Err` carries whether running
/// it again may succeed; commits the rules refused keep their refusal as their outcome.
fn run_batch_once(
    client: &mut Client,
    statements: &mut HashMap<String, Statement>,
    setup: &Setup,
    commits: &mut [Box<dyn CommitJob>],
) -> Result<(), (StoreError, bool)> {
    let shown = &*setup.shown;
    setup.round_trips.fetch_add(2, Ordering::Relaxed);
    let mut transaction =
        begin(client, true).map_err(|error| (map_error(&error, shown), is_retryable(&error)))?;
    let mut tx = PgTx::new(&mut transaction, statements, setup, true);
    let subjects: Vec<CommitSubject> = commits.iter().map(|commit| commit.subject().clone()).collect();
    tx.prefetch(&subjects).map_err(|error| (error, tx.retry))?;
    for commit in commits.iter_mut() {
        let writes = tx.writes;
        let failed = commit.work(&mut tx);
        if let Some(failure) = &tx.failure {
            return Err((failure.clone(), tx.retry));
        }
        if failed && tx.writes != writes {
            // Refused after it wrote: not undone inside a shared transaction, so the batch is
            // not committed (alone, the refusal is the commit's answer and nothing is written).
            return if commits.len() == 1 {
                Ok(())
            } else {
                Err((StoreError::Conflict("a refused step commit wrote before its refusal".into()), false))
            };
        }
    }
    tx.flush().map_err(|error| (error, tx.retry))?;
    drop(tx);
    transaction.commit().map_err(|error| (map_error(&error, shown), is_retryable(&error)))
}

#[cfg(test)]
mod tests {
    use keel_core::{Message, Store};
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
    async fn commits_queued_together_share_a_transaction_and_are_answered_each_alone() {
        let database = ScratchDatabase::create("together");
        // One connection: the commits queued while it works go together in its next transaction.
        let options = PostgresOptions { pool_size: 1, ..PostgresOptions::default() };
        let store = PostgresStore::connect(&database.url, options).unwrap();
        let records: Vec<_> = (0..40)
            .map(|i| {
                let session = SessionId::new(format!("batched-{i}")).unwrap();
                crate::conformance::run_record(&format!("batched-{i}"), &session, 0)
            })
            .collect();
        let before = store.backend().round_trips();
        let created = futures::future::join_all(
            records.iter().map(|record| crate::conformance::create_run(&store, record)),
        )
        .await;
        assert!(created.iter().all(Result::is_ok), "{created:?}");
        // Alone, each commit takes five statements (BEGIN, lock, read, write, COMMIT): 200.
        let statements = store.backend().round_trips() - before;
        assert!(statements <= 20, "{statements} statements for 40 commits: they were not batched");
        // Batched with refusals among them, each commit still gets its own answer.
        crate::conformance::commits_made_together_are_each_applied_or_refused_alone(&store).await;
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
                    schema::MIGRATIONS[0]
                ))
                .unwrap();
        })
        .join()
        .unwrap();
        let store = store(&database);
        let sessions = store.list_sessions(keel_core::SessionFilter::default()).await.unwrap();
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
