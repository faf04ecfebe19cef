//! The store alone: durable tool-loop runs per second by backend, without the runtime.
//!
//! Each run is the store traffic of one run of keel's tool-loop benchmark (`cargo bench -p keel
//! --bench tool_loop`): the session is read, then four steps are committed (the new run with its
//! input, the model's tool call, the tool's result, the answer ending the run), each under the
//! run's lease, each awaited before the next as the runtime does. A tenth of the runs go one at a
//! time, then all of them 1000 at a time on a multi-thread runtime. What is left of the tool-loop
//! figure beside this one is the runtime's own cost.
//!
//! `-- --instructions` counts instructions per run with callgrind instead (valgrind installed),
//! for the SQLite store and for the SQLite floor: the same rows written by SQLite alone (see
//! [`floor_runs`]). The difference between the two is the store's own work (its reads, checks,
//! statements and writer hand-off); the floor is what no change to that work goes under.
//! A third figure is the floor of another way to store the same run: one row per step (see
//! [`one_row_runs`]), what a store that writes fewer rows could come down to; a fourth, that
//! way with what keel's rules still need beside the steps (a run's state and lease, indexed by
//! state, and a session's row; see [`one_row_kept_runs`]).
//!
//! Run with `cargo bench -p keel-store --bench commits` (`-- --quick` for fewer runs,
//! `-- --postgres` for PostgreSQL alone). PostgreSQL is the local server of the tests
//! (`KEEL_TEST_POSTGRES`); each run of the bench creates and drops its own database.
#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::journal::{JournalEntry, JournalRecord};
use keel_core::message::{ToolCall, ToolResult};
use keel_core::persist::{encode_message, encode_record};
use keel_core::{
    Fence, LimitOverrides, Message, ModelReply, Part, Role, RunId, RunRecord, RunState, SessionId,
    StepCommit, StepName, Store, Usage,
};
use rusqlite::{OptionalExtension, params};
use serde_json::json;

const OWNER: &str = "keel/bench/machine/1/1/bench";
const LEASE: Duration = Duration::from_secs(60);

/// What one tool-loop run commits: its record and, per step, the journal entry and messages.
struct Steps {
    session: SessionId,
    run: RunId,
    record: RunRecord,
    input: [Arc<Message>; 1],
    turn: Arc<JournalEntry>,
    asked: [Arc<Message>; 1],
    tool: Arc<JournalEntry>,
    answered: [Arc<Message>; 1],
    last: Arc<JournalEntry>,
    answer: [Arc<Message>; 1],
}

/// A run id as the runtime makes them: a UUIDv7 in hex, time-ordered, so that a new run's rows
/// go to the end of the tables keyed by run (ids that fell anywhere among the others, as
/// the session name with a random number did, wrote about two more pages a run).
fn new_run_id() -> RunId {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64);
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    RunId::from_suffix(&format!("{millis:012x}7{count:019x}"))
}

impl Steps {
    fn new(session: &str) -> Steps {
        let session = SessionId::new(session).expect("a session id");
        let run = new_run_id();
        let record = RunRecord {
            run_id: run.clone(),
            session_id: session.clone(),
            input: Arc::new(Message::user("What is 2 + 3?")),
            history_len: 0,
            call_base: 0,
            state: RunState::Running,
            limits: LimitOverrides::default(),
        };
        let input = [Arc::clone(&record.input)];
        let call =
            ToolCall { call_id: "call_0_0".into(), name: "add".into(), input: json!({"a": 2, "b": 3}) };
        let reply = ModelReply { parts: vec![Part::ToolCall(call)], usage: USAGE };
        let asked = [Arc::new(Message { role: Role::Assistant, parts: reply.parts.clone() })];
        let turn = Arc::new(JournalEntry {
            step: StepName::ModelTurn(0),
            record: JournalRecord::ModelReply(reply.into()),
        });
        let result =
            ToolResult { call_id: "call_0_0".into(), name: "add".into(), output: json!(5), is_error: false };
        let answered = [Arc::new(Message { role: Role::Tool, parts: vec![Part::ToolResult(result)] })];
        let tool = Arc::new(JournalEntry {
            step: StepName::Tool { name: "add".into(), call_id: "call_0_0".into() },
            record: JournalRecord::ToolResult(Ok(json!(5))),
        });
        let reply = ModelReply { parts: vec![Part::Text("5".into())], usage: USAGE };
        let answer = [Arc::new(Message::assistant("5"))];
        let last = Arc::new(JournalEntry {
            step: StepName::ModelTurn(1),
            record: JournalRecord::ModelReply(reply.into()),
        });
        Steps { session, run, record, input, turn, asked, tool, answered, last, answer }
    }
}

const USAGE: Usage = Usage { input_tokens: 12, output_tokens: 5 };

/// One run's store traffic, as the tool-loop run makes it.
async fn one_run(store: &dyn Store, session: &str) {
    let steps = Steps::new(session);
    let (session, run) = (&steps.session, &steps.run);
    let snapshot = store.load_session(session).await.expect("the session reads");
    assert!(snapshot.open_run.is_none());
    let fence = Some(Fence { owner: OWNER, epoch: 1, ttl: LEASE });
    let commit = StepCommit::new(session, run);
    store
        .commit_step(StepCommit { new_run: Some(&steps.record), messages: &steps.input, fence, ..commit })
        .await
        .expect("the run starts");
    store
        .commit_step(StepCommit {
            entry: Some(&steps.turn),
            first_position: 1,
            messages: &steps.asked,
            fence,
            ..commit
        })
        .await
        .expect("the model's call commits");
    store
        .commit_step(StepCommit {
            entry: Some(&steps.tool),
            first_position: 2,
            messages: &steps.answered,
            fence,
            ..commit
        })
        .await
        .expect("the tool's result commits");
    store
        .commit_step(StepCommit {
            entry: Some(&steps.last),
            first_position: 3,
            messages: &steps.answer,
            state: Some(RunState::Done),
            fence,
            ..commit
        })
        .await
        .expect("the answer commits");
}

/// The SQLite floor: the rows the SQLite store writes for `runs` runs (its tables, its
/// statements' SQL, the bodies it encodes), written in the same four transactions per run with
/// nothing else: the statements prepared once and held, no reads, no checks, no lease, on this
/// thread. What SQLite itself costs for those rows, so the floor under the store's figure for
/// as long as a run writes them.
fn floor_runs(path: &std::path::Path, runs: usize) {
    // The store creates the file, its schema and WAL mode; dropping it ends its threads.
    drop(keel_store::SqliteStore::open(path).expect("the database opens"));
    let c = rusqlite::Connection::open(path).expect("the database opens");
    c.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;")
        .expect("the store's pragmas");
    let prepare = |sql: &str| c.prepare(sql).expect("a statement of the store");
    let (mut begin, mut commit) = (prepare("BEGIN IMMEDIATE"), prepare("COMMIT"));
    let mut insert_run = prepare(
        "INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at,
           lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by, limits)
         VALUES (?1, ?2, ?3, 0, 0, 'running', ?4, ?4, ?5, ?6, 1, 0, NULL, NULL)",
    );
    let mut journal = prepare(
        "INSERT INTO journal (run_id, step, seq, body)
         VALUES (?1, ?2, (SELECT COUNT(*) FROM journal WHERE run_id = ?1), ?3)
         ON CONFLICT (run_id, step) DO NOTHING",
    );
    let mut message =
        prepare("INSERT INTO messages (session_id, position, run_id, body) VALUES (?1, ?2, ?3, ?4)");
    // The session's row, as the store writes it: when a run starts, and with a model step's
    // tokens.
    let mut start_session = prepare(
        "INSERT INTO sessions (id, created_at, updated_at) VALUES (?1, ?2, ?2)
         ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at",
    );
    let mut tokens_row = prepare(
        "INSERT INTO sessions (id, created_at, updated_at, input_tokens, output_tokens) VALUES (?1, ?2, ?2, ?3, ?4)
         ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at,
           input_tokens = input_tokens + excluded.input_tokens, output_tokens = output_tokens + excluded.output_tokens",
    );
    let mut end_run = prepare(
        "UPDATE runs SET state = 'done', lease_owner = ?2, lease_expires_at = 0, lease_epoch = 1,
           attempts = 0, cancel_requested_by = NULL, updated_at = ?3 WHERE id = ?1",
    );
    let now = 1_800_000_000_000_i64;
    for i in 0..runs {
        let steps = Steps::new(&format!("f{i}"));
        let (session, run) = (steps.session.as_str(), steps.run.as_str());
        let usage = (USAGE.input_tokens as i64, USAGE.output_tokens as i64);
        let mut step = |entry: Option<&JournalEntry>, position: i64, said: &Message, last: bool| {
            begin.execute([]).expect("BEGIN");
            match entry {
                None => {
                    let input = encode_message(said);
                    insert_run
                        .execute(params![run, session, input, now, OWNER, now + 60_000])
                        .expect("a run");
                    start_session.execute(params![session, now]).expect("the session");
                }
                Some(entry) => {
                    let body = encode_record(&entry.record);
                    journal.execute(params![run, entry.step.to_string(), body]).expect("a journal entry");
                    if matches!(entry.record, JournalRecord::ModelReply(_)) {
                        tokens_row.execute(params![session, now, usage.0, usage.1]).expect("the tokens");
                    }
                }
            }
            message.execute(params![session, position, run, encode_message(said)]).expect("a message");
            if last {
                end_run.execute(params![run, OWNER, now]).expect("the run ends");
            }
            commit.execute([]).expect("COMMIT");
        };
        step(None, 0, &steps.input[0], false);
        step(Some(&steps.turn), 1, &steps.asked[0], false);
        step(Some(&steps.tool), 2, &steps.answered[0], false);
        step(Some(&steps.last), 3, &steps.answer[0], true);
    }
}

/// The steps' table of the one-row floors: a run's steps in order, each its journal entry and
/// the message it adds.
const STEPS_TABLE: &str =
    "CREATE TABLE steps (run_id TEXT NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)) WITHOUT ROWID;";

/// A one-row floor's database: the store's pragmas and `schema`.
fn floor_database(path: &std::path::Path, schema: &str) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).expect("the database opens");
    c.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA temp_store = MEMORY;")
        .expect("the store's pragmas");
    c.execute_batch(schema).expect("the tables");
    c
}

/// A one-row floor's step: its journal entry, if any, then the message it adds, as the store
/// encodes them.
fn step_body(entry: Option<&JournalEntry>, said: &Message) -> Vec<u8> {
    let mut body = Vec::new();
    if let Some(entry) = entry {
        body.extend_from_slice(encode_record(&entry.record).as_bytes());
    }
    body.extend_from_slice(encode_message(said).as_bytes());
    body
}

/// The floor of a SQLite store built otherwise: each step one row, in one table keyed by run and
/// step number (the run's record and input; then each step's journal entry with its messages),
/// and before each step's write one read of the run's first row, as a lease check would read
/// the run; the same bodies, keys and pragmas as [`floor_runs`], in the same four transactions.
/// Nothing else: no session row, no index, no message count. What SQLite's part of a run
/// would come to in a store redesigned around one row per step, committed before the next as
/// keel commits them: a design's floor to compare with the rows keel writes now.
fn one_row_runs(path: &std::path::Path, runs: usize) {
    let c = floor_database(path, STEPS_TABLE);
    let prepare = |sql: &str| c.prepare(sql).expect("a statement");
    let (mut begin, mut commit) = (prepare("BEGIN IMMEDIATE"), prepare("COMMIT"));
    let mut insert = prepare("INSERT INTO steps (run_id, seq, body) VALUES (?1, ?2, ?3)");
    let mut fence = prepare("SELECT length(body) FROM steps WHERE run_id = ?1 AND seq = 0");
    for i in 0..runs {
        let steps = Steps::new(&format!("f{i}"));
        let run = steps.run.as_str();
        let mut step = |seq: i64, entry: Option<&JournalEntry>, said: &Message| {
            begin.execute([]).expect("BEGIN");
            // The first row is the run's record, whose input is the message; a step's row, its
            // journal entry and the message it adds.
            if entry.is_some() {
                let _: i64 = fence.query_row([run], |row| row.get(0)).expect("the run's row");
            }
            insert.execute(params![run, seq, step_body(entry, said)]).expect("a step");
            commit.execute([]).expect("COMMIT");
        };
        step(0, None, &steps.input[0]);
        step(1, Some(&steps.turn), &steps.asked[0]);
        step(2, Some(&steps.tool), &steps.answered[0]);
        step(3, Some(&steps.last), &steps.answer[0]);
    }
}

/// The floor of that one-row design with what keel's rules need of a store besides the steps,
/// each in its least costly form: the run's session, state and lease on its first row (its
/// input), in a partial index by state over first rows, which finds the unfinished runs to
/// resume and a session's run in progress; the check of that index before a run starts (one
/// run per session); the lease read before each later step; and the session's row, written
/// when a run starts and when it ends (its tokens summed then, from the steps), not at each
/// step. No message count and no message positions (a session's transcript would be read
/// through its runs' steps). The same bodies, pragmas and four transactions as
/// [`one_row_runs`]: where a store redesigned around one row per step, keeping today's
/// guarantees, would start from. (A separate table of runs, indexed the same way, came to
/// 4,000 instructions more a run.)
fn one_row_kept_runs(path: &std::path::Path, runs: usize) {
    let c = floor_database(
        path,
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL,
           updated_at INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL)
           WITHOUT ROWID;
         CREATE TABLE steps (run_id TEXT NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,
           session_id TEXT, state TEXT, lease_owner TEXT, lease_expires_at INTEGER, lease_epoch INTEGER,
           PRIMARY KEY (run_id, seq)) WITHOUT ROWID;
         CREATE INDEX open_runs ON steps (state, session_id) WHERE seq = 0;",
    );
    let prepare = |sql: &str| c.prepare(sql).expect("a statement");
    let (mut begin, mut commit) = (prepare("BEGIN IMMEDIATE"), prepare("COMMIT"));
    let mut open_run =
        prepare("SELECT run_id FROM steps WHERE seq = 0 AND state = 'running' AND session_id = ?1");
    let mut start_run = prepare(
        "INSERT INTO steps (run_id, seq, body, session_id, state, lease_owner, lease_expires_at, lease_epoch)
         VALUES (?1, 0, ?2, ?3, 'running', ?4, ?5, 1)",
    );
    let mut start_session = prepare(
        "INSERT INTO sessions (id, created_at, updated_at, input_tokens, output_tokens) VALUES (?1, ?2, ?2, 0, 0)
         ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at",
    );
    let mut fence = prepare("SELECT lease_owner, lease_epoch FROM steps WHERE run_id = ?1 AND seq = 0");
    let mut insert = prepare("INSERT INTO steps (run_id, seq, body) VALUES (?1, ?2, ?3)");
    let mut end_run =
        prepare("UPDATE steps SET state = 'done', lease_expires_at = 0 WHERE run_id = ?1 AND seq = 0");
    let mut end_session = prepare(
        "UPDATE sessions SET updated_at = ?2, input_tokens = input_tokens + ?3,
           output_tokens = output_tokens + ?4 WHERE id = ?1",
    );
    let now = 1_800_000_000_000_i64;
    let tokens = (2 * USAGE.input_tokens as i64, 2 * USAGE.output_tokens as i64);
    for i in 0..runs {
        let steps = Steps::new(&format!("k{i}"));
        let (session, run) = (steps.session.as_str(), steps.run.as_str());
        let mut step = |seq: i64, entry: Option<&JournalEntry>, said: &Message, last: bool| {
            begin.execute([]).expect("BEGIN");
            let body = step_body(entry, said);
            if entry.is_none() {
                let open: Option<String> =
                    open_run.query_row([session], |row| row.get(0)).optional().expect("the check");
                assert!(open.is_none(), "one run per session");
                start_run.execute(params![run, body, session, OWNER, now + 60_000]).expect("a run");
                start_session.execute(params![session, now]).expect("the session");
            } else {
                let (owner, epoch): (String, i64) =
                    fence.query_row([run], |row| Ok((row.get(0)?, row.get(1)?))).expect("the lease");
                assert!(owner == OWNER && epoch == 1, "the lease holds");
                insert.execute(params![run, seq, body]).expect("a step");
            }
            if last {
                end_run.execute([run]).expect("the run ends");
                end_session.execute(params![session, now, tokens.0, tokens.1]).expect("the session");
            }
            commit.execute([]).expect("COMMIT");
        };
        step(0, None, &steps.input[0], false);
        step(1, Some(&steps.turn), &steps.asked[0], false);
        step(2, Some(&steps.tool), &steps.answered[0], false);
        step(3, Some(&steps.last), &steps.answer[0], true);
    }
}

/// `--count sqlite|floor|one-row|one-row-kept N`: 200 runs to warm up, then `N` runs one at a
/// time, the SQLite store's (on a current-thread runtime), the floor's ([`floor_runs`]) or the
/// one-row floors' ([`one_row_runs`], [`one_row_kept_runs`]); what `--instructions` runs under
/// callgrind, twice.
fn count_runs(what: &str, runs: usize) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("count.db");
    match what {
        "floor" => floor_runs(&path, 200 + runs),
        "one-row" => one_row_runs(&path, 200 + runs),
        "one-row-kept" => one_row_kept_runs(&path, 200 + runs),
        "sqlite" => {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            let store = keel_store::SqliteStore::open(&path).expect("the database opens");
            runtime.block_on(async {
                for i in 0..200 + runs {
                    one_run(&store, &format!("c{i}")).await;
                }
            });
        }
        other => panic!("--count sqlite|floor|one-row|one-row-kept N, not {other:?}"),
    }
}

/// Runs per second: `runs / 10` one at a time, then `runs` 1000 at a time, spread over
/// `stores` (instances of one store) in turn.
fn measure(
    runtime: &tokio::runtime::Runtime,
    stores: &[Arc<dyn Store>],
    runs: usize,
    tag: &str,
) -> (f64, f64) {
    runtime.block_on(async {
        let start = Instant::now();
        let one_by_one = runs / 10;
        for i in 0..one_by_one {
            one_run(stores[i % stores.len()].as_ref(), &format!("{tag}-s{i}")).await;
        }
        let sequential = one_by_one as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for round in 0..runs.div_ceil(1000) {
            let tasks: Vec<_> = (0..1000)
                .map(|i| {
                    let store = Arc::clone(&stores[i % stores.len()]);
                    let session = format!("{tag}-c{round}-{i}");
                    tokio::spawn(async move { one_run(store.as_ref(), &session).await })
                })
                .collect();
            for task in tasks {
                task.await.expect("a run");
            }
        }
        let concurrent = (runs.div_ceil(1000) * 1000) as f64 / start.elapsed().as_secs_f64();
        (sequential, concurrent)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(at) = args.iter().position(|a| a == "--count") {
        let what = args.get(at + 1).expect("--count sqlite|floor|one-row|one-row-kept N");
        let runs = args
            .get(at + 2)
            .and_then(|n| n.parse().ok())
            .expect("--count sqlite|floor|one-row|one-row-kept N");
        count_runs(what, runs);
        return;
    }
    if args.iter().any(|a| a == "--instructions") {
        let (small, large) = if quick { (200, 600) } else { (1_000, 3_000) };
        for (what, said) in [
            ("sqlite", "the SQLite store"),
            ("floor", "the SQLite floor (the same rows, SQLite alone)"),
            ("one-row", "one row per step and a read of the run before each (SQLite alone)"),
            (
                "one-row-kept",
                "one row per step, the run's state and lease indexed, a session row (SQLite alone)",
            ),
        ] {
            match keel_testkit::callgrind::instructions_per_iteration(&["--count", what], small, large) {
                Some(count) => println!(
                    "instructions per run, {said} (callgrind, {large} runs less {small}): {count:.0}"
                ),
                None => {
                    println!(
                        "instructions per run: valgrind is not installed (or failed); `apt install valgrind`"
                    );
                    return;
                }
            }
        }
        return;
    }
    let postgres_only = args.iter().any(|a| a == "--postgres");
    let runs = if quick { 5000 } else { 20_000 };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    if !postgres_only {
        let memory: Arc<dyn Store> = Arc::new(keel_store::MemoryStore::new());
        let (sequential, concurrent) = measure(&runtime, &[memory], runs, "memory");
        println!("memory store: {sequential:.0} runs/s one at a time, {concurrent:.0} runs/s 1000 at a time");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sqlite = keel_store::SqliteStore::open(&dir.path().join("bench.db")).expect("the database opens");
        let (sequential, concurrent) = measure(&runtime, &[Arc::new(sqlite)], runs, "sqlite");
        println!("sqlite store: {sequential:.0} runs/s one at a time, {concurrent:.0} runs/s 1000 at a time");
    }
    let options = keel_store::postgres_options().expect("KEEL_STORE_POOL and KEEL_STORE_STATEMENT_TIMEOUT");
    for instances in [1, 3] {
        let database = keel_testkit::postgres::ScratchDatabase::create("commits");
        let stores: Vec<Arc<keel_store::PostgresStore>> = (0..instances)
            .map(|_| {
                let store = keel_store::PostgresStore::connect(&database.url, options.clone());
                Arc::new(store.expect("the database connects"))
            })
            .collect();
        let statements = || stores.iter().map(|store| store.backend().round_trips()).sum::<u64>();
        let before = statements();
        let dyn_stores: Vec<Arc<dyn Store>> =
            stores.iter().map(|s| Arc::clone(s) as Arc<dyn Store>).collect();
        let (sequential, concurrent) = measure(&runtime, &dyn_stores, runs, "pg");
        let per_run = (statements() - before) as f64 / (runs / 10 + runs.div_ceil(1000) * 1000) as f64;
        println!(
            "postgres store, {instances} instance(s) of {} connections: {sequential:.0} runs/s one at a time, \
             {concurrent:.0} runs/s 1000 at a time; {per_run:.1} statements per run",
            options.pool_size
        );
    }
}
