//! The store alone: durable tool-loop runs per second by backend, without the runtime.
//!
//! Each run is the store traffic of one run of keel's tool-loop benchmark (`cargo bench -p keel
//! --bench tool_loop`): the session is read, then four steps are committed (the new run with its
//! input, the model's tool call, the tool's result, the answer ending the run), each under the
//! run's lease, each awaited before the next as the runtime does. A tenth of the runs go one at a
//! time, then all of them 1000 at a time on a multi-thread runtime. What is left of the tool-loop figure beside this one
//! is the runtime's own cost.
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
use keel_core::{
    Fence, LimitOverrides, Message, ModelReply, Part, Role, RunId, RunRecord, RunState, SessionId,
    StepCommit, StepName, Store, Usage,
};
use serde_json::json;

const OWNER: &str = "keel/bench/machine/1/1/bench";
const LEASE: Duration = Duration::from_secs(60);

/// One run's store traffic, as the tool-loop run makes it.
async fn one_run(store: &dyn Store, session: &str) {
    let session = SessionId::new(session).expect("a session id");
    let snapshot = store.load_session(&session).await.expect("the session reads");
    assert!(snapshot.open_run.is_none());
    let run = RunId::from_suffix(&format!("{}-{}", session.as_str(), fastrand::u32(..)));
    let fence = Some(Fence { owner: OWNER, epoch: 1, ttl: LEASE });
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
    let commit = StepCommit::new(&session, &run);
    store
        .commit_step(StepCommit { new_run: Some(&record), messages: &input, fence, ..commit })
        .await
        .expect("the run starts");

    let call = ToolCall { call_id: "call_0_0".into(), name: "add".into(), input: json!({"a": 2, "b": 3}) };
    let usage = Usage { input_tokens: 12, output_tokens: 5 };
    let reply = ModelReply { parts: vec![Part::ToolCall(call)], usage };
    let asked = [Arc::new(Message { role: Role::Assistant, parts: reply.parts.clone() })];
    let turn =
        Arc::new(JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ModelReply(reply) });
    store
        .commit_step(StepCommit { entry: Some(&turn), first_position: 1, messages: &asked, fence, ..commit })
        .await
        .expect("the model's call commits");

    let result =
        ToolResult { call_id: "call_0_0".into(), name: "add".into(), output: json!(5), is_error: false };
    let answered = [Arc::new(Message { role: Role::Tool, parts: vec![Part::ToolResult(result)] })];
    let tool = Arc::new(JournalEntry {
        step: StepName::Tool { name: "add".into(), call_id: "call_0_0".into() },
        record: JournalRecord::ToolResult(Ok(json!(5))),
    });
    store
        .commit_step(StepCommit {
            entry: Some(&tool),
            first_position: 2,
            messages: &answered,
            fence,
            ..commit
        })
        .await
        .expect("the tool's result commits");

    let reply = ModelReply { parts: vec![Part::Text("5".into())], usage };
    let answer = [Arc::new(Message::assistant("5"))];
    let last =
        Arc::new(JournalEntry { step: StepName::ModelTurn(1), record: JournalRecord::ModelReply(reply) });
    store
        .commit_step(StepCommit {
            entry: Some(&last),
            first_position: 3,
            messages: &answer,
            state: Some(RunState::Done),
            fence,
            ..commit
        })
        .await
        .expect("the answer commits");
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
