//! The "tool-loop" benchmark: keel's own overhead per run, with a model that costs nothing.
//!
//! Workload: the mock model calls `add(a=2, b=3)` (a Rust function tool), then answers "5"; no
//! delays; in-memory store. Each run is a new session (the mock picks its reply by the session's
//! model-call count).
//!
//! Reports:
//! - microseconds per run, sequential, after warm-up: the median of several batches, on a
//!   current-thread and on a multi-thread Tokio runtime, for runs in a task of their own
//!   (`Agent::run`) and inline runs (`Agent::run_inline`, driven by the loop's task);
//! - 1000 concurrent runs: wall time, and peak heap (counted by a tracking allocator) and peak
//!   RSS growth during the burst;
//! - runs per second with the SQLite store (every step committed), sequentially (spawned runs,
//!   then inline ones) and 1000 at a time, and the bytes stored per run;
//! - the same with the PostgreSQL store on a scratch database of the local server: one instance,
//!   then three on one database (with `KEEL_STORE_POOL` connections each, then half as many), with
//!   the statements and bytes per run (`-- --postgres` for these alone; `-- --sqlite` for the
//!   SQLite figures alone).
//!
//! - 1,000,000 runs one at a time on the default (bounded) memory store, with the process's RSS
//!   every 100,000;
//! - instructions per run for the memory, SQLite and PostgreSQL stores, counted by callgrind
//!   (when valgrind is installed): the bench runs itself twice under callgrind (`--count BACKEND
//!   N`, with two N) and divides the difference of the totals by the difference of the runs, so
//!   that start-up and warm-up cancel out. Every thread of the process counts; the PostgreSQL
//!   server's work does not.
//!
//! The allocator is the `keel` binary's ([`keel::allocator::Mimalloc`]), wrapped to count heap
//! bytes.
//!
//! Run with `cargo bench -p keel --bench tool_loop` (`-- --quick` for a smoke run; `--
//! --instructions` for the instruction counts alone, which `scripts/bench-instructions.sh` runs;
//! `-- --profile` runs only the current-thread loop, `KEEL_BENCH_RUNS` times, for callgrind or
//! perf; `-- --profile-multi` the same loop on a multi-thread runtime; add `--inline` to either
//! for inline runs; `-- --profile-sqlite` and `-- --profile-sqlite-multi`, with `--inline` or
//! not, run 10,000 runs one at a time on the SQLite store and nothing else).
#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![allow(missing_docs)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use keel::{Agent, MockEntry, MockScript, MockToolCall};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// The binary's allocator, counting live heap bytes and their peak.
struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

#[allow(unsafe_code, reason = "a global allocator wrapper is unsafe by definition")]
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwards to mimalloc with the caller's layout.
        let ptr = unsafe { keel::allocator::Mimalloc.alloc(layout) };
        if !ptr.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { keel::allocator::Mimalloc.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    // Forwarded, as the binary's allocator does: the default would allocate, copy and free.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        let new = unsafe { keel::allocator::Mimalloc.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                let live =
                    LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

#[derive(Deserialize, JsonSchema)]
struct AddInput {
    a: i64,
    b: i64,
}

fn agent() -> Agent {
    agent_with(Arc::new(keel::MemoryStore::new()))
}

fn agent_with(store: Arc<dyn keel::Store>) -> Agent {
    let add = keel::function_tool("add", "Adds two integers", |input: AddInput| async move {
        Ok::<_, std::convert::Infallible>(input.a + input.b)
    });
    let script = MockScript::new(vec![
        MockEntry {
            tool_calls: vec![MockToolCall { name: "add".into(), input: json!({"a": 2, "b": 3}) }],
            ..MockEntry::default()
        },
        MockEntry { text: Some("{{last_tool_output}}".into()), ..MockEntry::default() },
    ]);
    Agent::builder()
        .name("bench")
        .model("mock")
        .mock_script(script)
        .tool(add)
        .store(store)
        .build()
        .expect("the agent builds")
}

async fn one_run(agent: &Agent, session: &str) {
    one_run_driven(agent, session, Drive::Spawned).await;
}

/// Where the sequential loop's runs work: in a task of their own (`Agent::run`), or in the
/// loop's task (`Agent::run_inline`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Drive {
    Spawned,
    Inline,
}

async fn one_run_driven(agent: &Agent, session: &str, drive: Drive) {
    let handle = match drive {
        Drive::Spawned => agent.run(session, "What is 2 + 3?"),
        Drive::Inline => agent.run_inline(session, "What is 2 + 3?"),
    };
    let result = handle.expect("starts").result().await.expect("runs");
    assert_eq!(result.text, "5");
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn sequential(
    runtime: &tokio::runtime::Runtime,
    drive: Drive,
    warmup: usize,
    batches: usize,
    per_batch: usize,
) -> f64 {
    // The loop runs as a task, as a server's request handler would: on a multi-thread runtime,
    // awaiting from `block_on`'s thread would measure cross-thread wake-ups instead of keel.
    let task = runtime.spawn(async move {
        let agent = agent();
        for i in 0..warmup {
            one_run_driven(&agent, &format!("w{i}"), drive).await;
        }
        let mut per_run = Vec::with_capacity(batches);
        for batch in 0..batches {
            // A fresh agent per batch keeps the in-memory store from growing across batches.
            let agent = self::agent();
            let sessions: Vec<String> = (0..per_batch).map(|i| format!("b{batch}-{i}")).collect();
            let start = Instant::now();
            for session in &sessions {
                one_run_driven(&agent, session, drive).await;
            }
            per_run.push(start.elapsed().as_secs_f64() * 1e6 / per_batch as f64);
        }
        median(per_run)
    });
    runtime.block_on(task).expect("the benchmark task panicked")
}

/// Runs one at a time against a fresh SQLite file, and nothing else: what `--profile-sqlite`
/// and `--profile-sqlite-multi` give perf or callgrind to look at.
fn durable_sequential(runtime: &tokio::runtime::Runtime, drive: Drive, runs: usize) -> f64 {
    let task = runtime.spawn(async move {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store =
            Arc::new(keel::SqliteStore::open(&dir.path().join("bench.db")).expect("the database opens"));
        let agent = agent_with(store);
        for i in 0..200 {
            one_run_driven(&agent, &format!("w{i}"), drive).await;
        }
        let start = Instant::now();
        for i in 0..runs {
            one_run_driven(&agent, &format!("s{i}"), drive).await;
        }
        runs as f64 / start.elapsed().as_secs_f64()
    });
    runtime.block_on(task).expect("the benchmark task panicked")
}

struct Durable {
    sequential_per_second: f64,
    /// The same, each run driven by the loop's task (`Agent::run_inline`).
    inline_per_second: f64,
    concurrent_per_second: f64,
    bytes_per_run: f64,
    compacted_bytes_per_run: f64,
    /// The peak heap of a round of 1000 runs in flight, per run (the median round's).
    peak_heap_per_run: f64,
}

/// Runs against a fresh SQLite file (WAL, synchronous=NORMAL: every step committed before the
/// loop moves on), sequentially and 1000 at a time.
fn durable(runtime: &tokio::runtime::Runtime, runs: usize) -> Durable {
    let task = runtime.spawn(async move {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store =
            Arc::new(keel::SqliteStore::open(&dir.path().join("bench.db")).expect("the database opens"));
        let agent = agent_with(store.clone());
        for i in 0..200 {
            one_run(&agent, &format!("w{i}")).await;
        }
        let start = Instant::now();
        for i in 0..runs {
            one_run(&agent, &format!("s{i}")).await;
        }
        let sequential_per_second = runs as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for i in 0..runs {
            one_run_driven(&agent, &format!("i{i}"), Drive::Inline).await;
        }
        let inline_per_second = runs as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut done = 0;
        let mut heaps = Vec::new();
        for round in 0..runs.div_ceil(1000) {
            let base = LIVE.load(Ordering::Relaxed);
            PEAK.store(base, Ordering::Relaxed);
            let handles: Vec<_> = (0..1000)
                .map(|i| agent.run(&format!("c{round}-{i}"), "What is 2 + 3?").expect("starts"))
                .collect();
            for handle in handles {
                assert_eq!(handle.result().await.expect("runs").text, "5");
                done += 1;
            }
            heaps.push(PEAK.load(Ordering::Relaxed).saturating_sub(base) as f64 / 1000.0);
        }
        let concurrent_per_second = done as f64 / start.elapsed().as_secs_f64();
        let peak_heap_per_run = median(heaps);
        let total_runs = 200 + 2 * runs + done;
        let bytes_per_run = store.size_bytes().expect("the size") as f64 / total_runs as f64;
        keel::Store::compact_journals(&*store).await.expect("compaction");
        // Freed pages are reused, not returned: VACUUM shows the smaller file.
        store.vacuum().expect("vacuum");
        let compacted_bytes_per_run = store.size_bytes().expect("the size") as f64 / total_runs as f64;
        Durable {
            sequential_per_second,
            inline_per_second,
            concurrent_per_second,
            bytes_per_run,
            compacted_bytes_per_run,
            peak_heap_per_run,
        }
    });
    runtime.block_on(task).expect("the benchmark task panicked")
}

struct PostgresFigures {
    sequential_per_second: f64,
    concurrent_per_second: f64,
    bytes_per_run: f64,
    round_trips_per_run: f64,
}

/// Runs against a fresh PostgreSQL database (`KEEL_TEST_POSTGRES`'s server), sequentially and
/// 1000 at a time, with `instances` stores of `options` on it sharing the concurrent runs (as
/// `keel serve` instances would).
fn durable_postgres(
    runtime: &tokio::runtime::Runtime,
    runs: usize,
    instances: usize,
    options: &keel_store::PostgresOptions,
) -> PostgresFigures {
    let database = keel_testkit::postgres::ScratchDatabase::create("bench");
    let url = database.url.clone();
    let options = options.clone();
    let task = runtime.spawn(async move {
        let stores: Vec<Arc<keel::PostgresStore>> = (0..instances)
            .map(|_| {
                Arc::new(keel::PostgresStore::connect(&url, options.clone()).expect("the database opens"))
            })
            .collect();
        let agents: Vec<Agent> = stores.iter().map(|store| agent_with(store.clone())).collect();
        for i in 0..200 {
            one_run(&agents[0], &format!("w{i}")).await;
        }
        let start = Instant::now();
        for i in 0..runs / 5 {
            one_run(&agents[0], &format!("s{i}")).await;
        }
        let sequential_per_second = (runs / 5) as f64 / start.elapsed().as_secs_f64();
        let trips_before: u64 = stores.iter().map(|s| s.backend().round_trips()).sum();
        let start = Instant::now();
        let mut done = 0;
        for round in 0..runs.div_ceil(1000) {
            let handles: Vec<_> = (0..1000)
                .map(|i| {
                    agents[i % instances].run(&format!("c{round}-{i}"), "What is 2 + 3?").expect("starts")
                })
                .collect();
            for handle in handles {
                assert_eq!(handle.result().await.expect("runs").text, "5");
                done += 1;
            }
        }
        let concurrent_per_second = done as f64 / start.elapsed().as_secs_f64();
        let trips: u64 = stores.iter().map(|s| s.backend().round_trips()).sum::<u64>() - trips_before;
        (sequential_per_second, concurrent_per_second, trips as f64 / done as f64, 200 + runs / 5 + done)
    });
    let (sequential_per_second, concurrent_per_second, round_trips_per_run, total_runs) =
        runtime.block_on(task).expect("the benchmark task panicked");
    let mut client = postgres::Client::connect(&database.url, postgres::NoTls).expect("connects");
    let bytes: i64 = client
        .query_one(
            "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0)::BIGINT FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'keel' AND c.relkind = 'r'",
            &[],
        )
        .expect("sizes")
        .get(0);
    PostgresFigures {
        sequential_per_second,
        concurrent_per_second,
        bytes_per_run: bytes as f64 / total_runs as f64,
        round_trips_per_run,
    }
}

fn rss_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

struct Burst {
    wall: Duration,
    peak_heap_bytes: usize,
}

fn concurrent(runtime: &tokio::runtime::Runtime, runs: usize, round: usize) -> Burst {
    let task = runtime.spawn(async move {
        let agent = agent();
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let start = Instant::now();
        let handles: Vec<_> = (0..runs)
            .map(|i| agent.run(&format!("c{round}-{i}"), "What is 2 + 3?").expect("starts"))
            .collect();
        for handle in handles {
            assert_eq!(handle.result().await.expect("runs").text, "5");
        }
        let wall = start.elapsed();
        Burst { wall, peak_heap_bytes: PEAK.load(Ordering::Relaxed) - base }
    });
    runtime.block_on(task).expect("the benchmark task panicked")
}

/// The store a counted run uses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Memory,
    Sqlite,
    Postgres,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }

    fn parse(name: &str) -> Option<Backend> {
        [Backend::Memory, Backend::Sqlite, Backend::Postgres].into_iter().find(|b| b.name() == name)
    }
}

/// `--count BACKEND N`: 200 runs to warm up, then `N` runs one at a time on a current-thread
/// runtime, and nothing else: what [`print_instructions`] runs under callgrind, twice.
fn count_runs(backend: Backend, runs: usize) {
    let current = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database =
        (backend == Backend::Postgres).then(|| keel_testkit::postgres::ScratchDatabase::create("count"));
    let store: Arc<dyn keel::Store> = match backend {
        Backend::Memory => Arc::new(keel::MemoryStore::new()),
        Backend::Sqlite => Arc::new(keel::SqliteStore::open(&dir.path().join("count.db")).expect("opens")),
        Backend::Postgres => {
            let url = &database.as_ref().expect("a database").url;
            let options = keel_store::postgres_options().expect("the pool settings");
            Arc::new(keel::PostgresStore::connect(url, options).expect("connects"))
        }
    };
    current.block_on(async move {
        let agent = agent_with(store);
        let mut name = String::new();
        for i in 0..200 {
            one_run(&agent, session_name(&mut name, 'w', i)).await;
        }
        for i in 0..runs {
            one_run(&agent, session_name(&mut name, 's', i)).await;
        }
    });
}

/// `prefix` and `n` (`s42`), written into `name`: each run gets a session of its own without
/// `format!`, whose 600 or so instructions are the harness's, not keel's, and which the
/// difference of two counts would otherwise charge to every run.
fn session_name(name: &mut String, prefix: char, n: usize) -> &str {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = n;
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    name.clear();
    name.push(prefix);
    name.push_str(std::str::from_utf8(&digits[start..]).expect("ASCII digits"));
    name
}

/// Instructions per run for each backend (`--count BACKEND N` under callgrind, twice), printed.
fn print_instructions(backends: &[Backend], quick: bool) {
    for &backend in backends {
        let (small, large) = match (backend, quick) {
            (Backend::Memory, false) => (2_000, 12_000),
            (_, false) => (1_000, 3_000),
            (_, true) => (200, 600),
        };
        match keel_testkit::callgrind::instructions_per_iteration(&["--count", backend.name()], small, large)
        {
            Some(count) => println!(
                "instructions per run, {} store (callgrind, {large} runs less {small}, one at a time, current-thread runtime): {count:.0}",
                backend.name()
            ),
            None => {
                println!(
                    "instructions per run: valgrind is not installed (or failed); `apt install valgrind`"
                );
                return;
            }
        }
    }
}

/// Runs 1,000,000 runs (100,000 with `--quick`) one at a time on the default memory store and
/// prints the process's RSS as they go: a bounded store holds it flat.
fn soak(runtime: &tokio::runtime::Runtime, runs: usize) {
    let task = runtime.spawn(async move {
        let agent = agent();
        let mut marks = Vec::new();
        for i in 0..runs {
            one_run(&agent, &format!("soak{i}")).await;
            if (i + 1) % (runs / 10) == 0 {
                marks.push(((i + 1) / 1000, rss_kib().unwrap_or(0) / 1024));
            }
        }
        marks
    });
    let marks = runtime.block_on(task).expect("the benchmark task panicked");
    let text: Vec<String> = marks.iter().map(|(k, mib)| format!("{k}k: {mib}")).collect();
    println!(
        "memory store (default bounds: {} sessions), {runs} runs one at a time, process RSS in MiB after: {}",
        keel_store::MemoryLimits::DEFAULT.max_sessions,
        text.join(", ")
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(at) = args.iter().position(|a| a == "--count") {
        let backend =
            args.get(at + 1).and_then(|b| Backend::parse(b)).expect("--count memory|sqlite|postgres N");
        let runs = args.get(at + 2).and_then(|n| n.parse().ok()).expect("--count BACKEND N");
        count_runs(backend, runs);
        return;
    }
    if args.iter().any(|a| a == "--instructions") {
        print_instructions(&[Backend::Memory, Backend::Sqlite, Backend::Postgres], quick);
        return;
    }
    if let Some(flag) = args.iter().find(|a| *a == "--profile-sqlite" || *a == "--profile-sqlite-multi") {
        let runtime = if flag == "--profile-sqlite" {
            tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
        } else {
            tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap()
        };
        let drive = if args.iter().any(|a| a == "--inline") { Drive::Inline } else { Drive::Spawned };
        println!("{:.0} runs/s", durable_sequential(&runtime, drive, 10_000));
        return;
    }
    if args.iter().any(|a| a == "--sqlite") {
        // Only the SQLite figures, on both runtimes.
        let runs = if quick { 1_000 } else { 10_000 };
        for (name, runtime) in [
            ("current-thread", tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()),
            ("multi-thread", tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap()),
        ] {
            let figures = durable(&runtime, runs);
            println!(
                "sqlite store ({name} runtime), {runs} runs: {:.0} runs/s sequential ({:.0} inline), {:.0} runs/s 1000 at a time",
                figures.sequential_per_second, figures.inline_per_second, figures.concurrent_per_second,
            );
        }
        return;
    }
    if args.iter().any(|a| a == "--postgres") {
        // Only the PostgreSQL figures: one store, then three on the same database.
        let multi = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        let runs = if quick { 2_000 } else { 10_000 };
        postgres_figures(&multi, runs);
        return;
    }
    if let Some(flag) = args.iter().find(|a| *a == "--profile" || *a == "--profile-multi") {
        // Just the sequential loop, for a profiler (callgrind, perf): on a current-thread
        // runtime, or (`--profile-multi`) on the default multi-thread one.
        let runtime = if flag == "--profile" {
            tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
        } else {
            tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap()
        };
        let runs =
            std::env::var(keel_core::env::BENCH_RUNS.name).ok().and_then(|n| n.parse().ok()).unwrap_or(2_000);
        let drive = if args.iter().any(|a| a == "--inline") { Drive::Inline } else { Drive::Spawned };
        println!("{:.2} µs/run", sequential(&runtime, drive, 100, 1, runs));
        return;
    }
    let (warmup, batches, per_batch, rounds) =
        if quick { (1_000, 5, 5_000, 2) } else { (5_000, 9, 10_000, 7) };
    let current = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();

    println!("tool-loop benchmark (add(2, 3) then \"5\"; mock model; memory store)");
    println!("machine: {} cores", std::thread::available_parallelism().map_or(0, |n| n.get()));
    // The bursts run first, so that the peak RSS is theirs and not the sequential batches'.
    let rss_before = rss_kib().unwrap_or(0);
    let mut walls = Vec::new();
    let mut heaps = Vec::new();
    for round in 0..rounds {
        let burst = concurrent(&multi, 1000, round);
        walls.push(burst.wall.as_secs_f64() * 1e3);
        heaps.push(burst.peak_heap_bytes as f64);
    }
    let hwm = rss_hwm_kib().unwrap_or(0);
    println!(
        "1000 concurrent runs, multi-thread runtime: {:.2} ms wall (median of {rounds}), peak heap {:.2} MiB ({:.1} KiB per run in flight), process peak RSS {:.1} MiB (RSS before the bursts {:.1} MiB)",
        median(walls),
        median(heaps.clone()) / (1024.0 * 1024.0),
        median(heaps) / 1024.0 / 1000.0,
        hwm as f64 / 1024.0,
        rss_before as f64 / 1024.0,
    );
    let seq_current = sequential(&current, Drive::Spawned, warmup, batches, per_batch);
    println!(
        "sequential, current-thread runtime: {seq_current:.2} µs/run (median of {batches} batches of {per_batch})"
    );
    let seq_multi = sequential(&multi, Drive::Spawned, warmup, batches, per_batch);
    println!(
        "sequential, multi-thread runtime:   {seq_multi:.2} µs/run (median of {batches} batches of {per_batch}; {:+.0}% against current-thread)",
        (seq_multi / seq_current - 1.0) * 100.0
    );
    let inline_current = sequential(&current, Drive::Inline, warmup, batches, per_batch);
    let inline_multi = sequential(&multi, Drive::Inline, warmup, batches, per_batch);
    println!(
        "sequential inline runs (Agent::run_inline): {inline_current:.2} µs/run current-thread, {inline_multi:.2} µs/run multi-thread ({:+.0}% against current-thread spawned runs)",
        (inline_multi / seq_current - 1.0) * 100.0
    );
    soak(&multi, if quick { 100_000 } else { 1_000_000 });
    let durable_runs = if quick { 1_000 } else { 10_000 };
    let memory_per_second = 1e6 / seq_current;
    let sqlite = durable(&current, durable_runs);
    let sqlite_multi = durable(&multi, durable_runs);
    println!(
        "sqlite store (WAL, synchronous=NORMAL), {durable_runs} runs: {:.0} runs/s sequential ({:.0} inline), {:.0} runs/s 1000 at a time (current-thread runtime); {:.0} ({:.0} inline) and {:.0} runs/s (multi-thread); memory store: {memory_per_second:.0} runs/s sequential",
        sqlite.sequential_per_second,
        sqlite.inline_per_second,
        sqlite.concurrent_per_second,
        sqlite_multi.sequential_per_second,
        sqlite_multi.inline_per_second,
        sqlite_multi.concurrent_per_second,
    );
    println!(
        "sqlite bytes stored per run: {:.0}; {:.0} once finished runs' journals are compacted (database size / runs); peak Rust heap {:.1} KiB per run in flight (1000 at a time; SQLite's own page cache not counted)",
        sqlite.bytes_per_run,
        sqlite.compacted_bytes_per_run,
        sqlite_multi.peak_heap_per_run / 1024.0,
    );
    postgres_figures(&multi, durable_runs);
    print_instructions(&[Backend::Memory, Backend::Sqlite, Backend::Postgres], quick);
}

/// One instance with the pool of `KEEL_STORE_POOL` (4 by default), three with it each, and three
/// with half of it each (a database's connections shared out among its instances, as
/// docs/scaling.md advises).
fn postgres_figures(runtime: &tokio::runtime::Runtime, runs: usize) {
    let options = keel_store::postgres_options().expect("the pool settings");
    let half = keel_store::PostgresOptions { pool_size: options.pool_size.div_ceil(2), ..options.clone() };
    for (instances, options) in [(1, &options), (3, &options), (3, &half)] {
        let figures = durable_postgres(runtime, runs, instances, options);
        println!(
            "postgres store ({instances} instance{} × {} connections on one database, multi-thread runtime), {runs} runs: {:.0} runs/s sequential, {:.0} runs/s 1000 at a time; {:.1} round trips and {:.0} bytes stored per run",
            if instances == 1 { "" } else { "s" },
            options.pool_size,
            figures.sequential_per_second,
            figures.concurrent_per_second,
            figures.round_trips_per_run,
            figures.bytes_per_run,
        );
    }
}
