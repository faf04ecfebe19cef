//! Load benchmark of `keel serve`: the real binary, driven over loopback by a light client.
//!
//! - **streams**: opens N live SSE streams (`GET /chat/:id/events`, one session each) and reports
//!   the server's resident memory (VmRSS) with all of them open: over HTTP/2 (4 connections),
//!   then over HTTP/1.1 (a connection each, as many as the open-file limit allows);
//! - **turns**: short turns (`POST /chat`, the mock model echoes, a new session per turn) from C
//!   keep-alive connections for a few seconds, with the memory and then the SQLite store: turns
//!   per second and latency percentiles (to `event: done`); with `--postgres`, on a scratch
//!   PostgreSQL database (events then go through the shared event log too);
//! - **soak**: many turns over a fixed set of sessions (SQLite store), sampling the server's RSS
//!   as it goes: it must stay flat once warm.
//!
//! - **live events** (PostgreSQL): two instances on one scratch database; each run executes on
//!   instance A, with one observer of its session on A and one on B. Its tool prints the clock
//!   (ns) when it finishes; the latency of each `tool.done` is its arrival at an observer minus
//!   that stamp (it includes the tool step's commit). Runs one at a time, then 16 at a time.
//!   Needs the local PostgreSQL (`KEEL_TEST_POSTGRES`, default `127.0.0.1:5432`).
//!
//! The client speaks HTTP/1.1 by hand on raw sockets, so that it costs the 2-core machine as
//! little as possible; the server is the release binary. File-descriptor limits are raised (as
//! root) for the 20,000 streams.
//!
//! `cargo bench -p keel --bench load` (the full run: 20,000 streams, 10 s of turns per store,
//! 200,000 soak turns, 2,000 live-event samples per phase); `-- --quick` for a smoke run;
//! `-- --postgres` for PostgreSQL only (turns, then the live-event latency). Sizes: `KEEL_LOAD_STREAMS`,
//! `KEEL_LOAD_SECONDS`, `KEEL_LOAD_CONNECTIONS`, `KEEL_LOAD_SOAK_TURNS`, `KEEL_LOAD_SOAK_SESSIONS`.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "a benchmark reports on stdout")]
#![allow(missing_docs)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A `keel serve` process.
struct Server {
    child: Child,
    address: String,
}

impl Server {
    fn start(agent: &Path, store: &str) -> Server {
        let binary = env!("CARGO_BIN_EXE_keel");
        // As root, lift the descriptor limit for tens of thousands of connections.
        let script = format!(
            "ulimit -Hn 200000 2>/dev/null; ulimit -n 200000 2>/dev/null || ulimit -n $(ulimit -Hn); exec '{binary}' serve '{}' --port 0 --store '{store}'",
            agent.display()
        );
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .env(keel_core::env::LOG.name, "error")
            // Every client here is 127.0.0.1, holding thousands of connections.
            .env(keel_core::env::MAX_CONNECTIONS_PER_CLIENT.name, "0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start keel serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut address = None;
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(at) = line.find("http://") {
                address = Some(line[at + 7..].split_whitespace().next().unwrap().to_owned());
                break;
            }
        }
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("server: {line}");
            }
        });
        Server { child, address: address.expect("the server's address") }
    }

    /// Resident memory, in KiB.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn raise_fd_limit(wanted: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    // Raising the hard limit needs root; fall back to the hard limit.
    if setrlimit(Resource::RLIMIT_NOFILE, wanted, wanted.max(hard)).is_err() {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Reads until `done(buffer)`; errors on EOF.
async fn read_until(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    done: impl Fn(&[u8]) -> bool,
) -> std::io::Result<()> {
    let mut chunk = [0u8; 16 * 1024];
    while !done(buffer) {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ));
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// One short turn on a keep-alive connection: POST /chat, read to the end of the chunked SSE body.
async fn turn(stream: &mut TcpStream, buffer: &mut Vec<u8>, session: &str) -> std::io::Result<()> {
    let body = format!("{{\"sessionId\":\"{session}\",\"input\":\"hello there, keel\"}}");
    let request = format!(
        "POST /chat HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    buffer.clear();
    read_until(stream, buffer, |b| b.ends_with(b"\r\n0\r\n\r\n")).await?;
    if !buffer.starts_with(b"HTTP/1.1 200") || !contains(buffer, b"event: done") {
        return Err(std::io::Error::other(
            String::from_utf8_lossy(&buffer[..buffer.len().min(300)]).into_owned(),
        ));
    }
    Ok(())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Opens `count` live event streams and reports the server's memory with all of them open.
async fn streams(agent: &Path, wanted: u64) {
    // Each stream is a descriptor here and one in the server: stay under this process's limit,
    // with room for the files the benchmark itself opens.
    let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft);
    let count = wanted.min(limit.saturating_sub(64));
    if count < wanted {
        println!("streams: {wanted} wanted, {count} fit under the open-file limit ({limit}) of one process");
    }
    let mut server = Server::start(agent, "memory");
    let before = server.rss_kib();
    let started = Instant::now();
    let mut open = Vec::with_capacity(count as usize);
    for i in 0..count {
        let mut stream = match TcpStream::connect(&server.address).await {
            Ok(stream) => stream,
            Err(error) => {
                println!("streams: could only open {i} connections: {error}");
                break;
            }
        };
        let request = format!("GET /chat/watch-{i}/events HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        open.push(stream);
    }
    // Every stream must have been answered with a 200 and headers.
    let mut answered = 0;
    for stream in &mut open {
        let mut buffer = Vec::new();
        if read_until(stream, &mut buffer, |b| contains(b, b"\r\n\r\n")).await.is_ok()
            && buffer.starts_with(b"HTTP/1.1 200")
        {
            answered += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = server.rss_kib();
    if during == 0 {
        println!("streams: cannot read the server's memory: {:?}", server.child.try_wait());
    }
    println!(
        "streams: {answered} of {count} SSE streams open in {:.1?}; server RSS {:.1} MiB with them open ({:.1} MiB before, {:.2} KiB per stream)",
        started.elapsed(),
        during as f64 / 1024.0,
        before as f64 / 1024.0,
        (during.saturating_sub(before)) as f64 / answered.max(1) as f64
    );
    drop(open);
}

/// Opens `count` live event streams over HTTP/2 (a few connections, thousands of streams on
/// each) and reports the server's memory with all of them open.
async fn h2_streams(agent: &Path, count: u64, connections: u64) {
    let server = Server::start(agent, "memory");
    let before = server.rss_kib();
    let started = Instant::now();
    let clients: Vec<reqwest::Client> = (0..connections)
        .map(|_| reqwest::Client::builder().http2_prior_knowledge().build().unwrap())
        .collect();
    let mut open = Vec::with_capacity(count as usize);
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in 0..count {
        let client = &clients[(i % connections) as usize];
        pending.push(client.get(format!("http://{}/chat/watch-{i}/events", server.address)).send());
        // Keep a bounded number of requests in flight while opening.
        while pending.len() >= 512 {
            if let Some(response) = futures::StreamExt::next(&mut pending).await {
                open.push(response);
            }
        }
    }
    while let Some(response) = futures::StreamExt::next(&mut pending).await {
        open.push(response);
    }
    let answered = open.iter().filter(|r| r.as_ref().is_ok_and(|r| r.status() == 200)).count();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = server.rss_kib();
    println!(
        "streams (HTTP/2, {connections} connections): {answered} of {count} SSE streams open in {:.1?}; server RSS {:.1} MiB with them open ({:.1} MiB before, {:.2} KiB per stream)",
        started.elapsed(),
        during as f64 / 1024.0,
        before as f64 / 1024.0,
        (during.saturating_sub(before)) as f64 / answered.max(1) as f64
    );
    drop(open);
}

/// Short turns from `connections` keep-alive connections for `seconds`.
async fn turns(agent: &Path, store: &str, label: &str, connections: u64, seconds: u64) {
    let server = Server::start(agent, store);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..connections {
        let (address, stop, errors) = (server.address.clone(), Arc::clone(&stop), Arc::clone(&errors));
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut stream = TcpStream::connect(&address).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let mut buffer = Vec::with_capacity(4096);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let session = format!("w{worker}-{n}");
                n += 1;
                let started = Instant::now();
                match turn(&mut stream, &mut buffer, &session).await {
                    Ok(()) => latencies.push(started.elapsed()),
                    Err(error) => {
                        if errors.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("turns: first error: {error}");
                        }
                        stream = TcpStream::connect(&address).await.unwrap();
                    }
                }
            }
            latencies
        }));
    }
    // Warm up for a second, then measure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let measured_from = Instant::now();
    let rss_warm = server.rss_kib();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = measured_from.elapsed() + Duration::from_secs(1);
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    latencies.sort();
    println!(
        "turns ({label}): {:.0} turns/s over {:.1?} with {connections} connections; latency p50 {:.2?}, p99 {:.2?}, max {:.2?}; {} errors; server RSS {:.1} MiB -> {:.1} MiB",
        latencies.len() as f64 / elapsed.as_secs_f64(),
        elapsed,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
        errors.load(Ordering::Relaxed),
        rss_warm as f64 / 1024.0,
        server.rss_kib() as f64 / 1024.0,
    );
}

/// `total` turns over `sessions` sessions (SQLite store), sampling the server's RSS.
async fn soak(agent: &Path, store: &str, total: u64, sessions: u64, connections: u64) {
    let server = Server::start(agent, store);
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..connections {
        let (address, done, errors) = (server.address.clone(), Arc::clone(&done), Arc::clone(&errors));
        workers.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(&address).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let mut buffer = Vec::with_capacity(4096);
            // Each worker cycles through its own share of the sessions: one turn per session
            // at a time, every session many turns long.
            let mine: Vec<u64> = (0..sessions).filter(|s| s % connections == worker).collect();
            let mut i = 0usize;
            loop {
                let n = done.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let session = format!("soak-{}", mine[i % mine.len()]);
                i += 1;
                if turn(&mut stream, &mut buffer, &session).await.is_err() {
                    errors.fetch_add(1, Ordering::Relaxed);
                    stream = TcpStream::connect(&address).await.unwrap();
                }
            }
        }));
    }
    let mut samples = Vec::new();
    while workers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        samples.push((done.load(Ordering::Relaxed).min(total), server.rss_kib()));
    }
    let took = started.elapsed();
    // "Warm": after the first quarter of the turns.
    let warm: Vec<u64> = samples.iter().filter(|(n, _)| *n >= total / 4).map(|(_, rss)| *rss).collect();
    let (min, max) = (warm.iter().min().copied().unwrap_or(0), warm.iter().max().copied().unwrap_or(0));
    let last = samples.last().map_or(0, |(_, rss)| *rss);
    println!(
        "soak ({store}): {total} turns over {sessions} sessions in {took:.1?} ({:.0} turns/s), {} errors; server RSS once warm: min {:.1} MiB, max {:.1} MiB, at the end {:.1} MiB",
        total as f64 / took.as_secs_f64(),
        errors.load(Ordering::Relaxed),
        min as f64 / 1024.0,
        max as f64 / 1024.0,
        last as f64 / 1024.0,
    );
    let curve: Vec<String> = samples
        .iter()
        .step_by((samples.len() / 10).max(1))
        .map(|(n, rss)| format!("{}k:{:.0}MiB", n / 1000, *rss as f64 / 1024.0))
        .collect();
    println!("soak RSS by turns done: {}", curve.join(" "));
}

/// An agent whose runs call `stamp` (it prints the clock in ns) `calls` times, then answer.
fn stamp_agent(dir: &Path, calls: usize) -> std::path::PathBuf {
    let agent = dir.join("stamp-agent");
    std::fs::create_dir_all(agent.join("tools")).unwrap();
    let mut spec = format!(
        "name: stamp\nmodel: mock\ntools: [stamp]\nlimits: {{max_turns: {}}}\nmock:\n  script:\n",
        calls + 2
    );
    for _ in 0..calls {
        spec.push_str("    - tool_calls: [{ name: stamp, input: {} }]\n");
    }
    spec.push_str("    - text: done\n");
    std::fs::write(agent.join("agent.yaml"), spec).unwrap();
    std::fs::write(
        agent.join("tools/stamp.toml"),
        "description = \"The clock\"\ncommand = [\"date\", \"+%s%N\"]\n",
    )
    .unwrap();
    agent
}

/// Reads one session's event stream until `run.done`; the latency of each `tool.done` (arrival
/// minus the stamp in its output).
async fn observe(response: reqwest::Response) -> Vec<Duration> {
    use futures::StreamExt;
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut latencies = Vec::new();
    while let Some(Ok(chunk)) = stream.next().await {
        let arrived = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let message: String = buffer.drain(..end + 2).collect();
            let Some(data) = message.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            let event: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            match event["type"].as_str() {
                Some("tool.done") => {
                    // The output is the number the tool printed (or its text, had it not parsed).
                    let output = &event["output"];
                    let stamp =
                        output.as_u64().map(u128::from).or_else(|| output.as_str()?.trim().parse().ok());
                    let stamp = stamp.expect("the stamp tool's output is a clock reading");
                    latencies.push(Duration::from_nanos(
                        u64::try_from(arrived.as_nanos().saturating_sub(stamp)).unwrap_or(u64::MAX),
                    ));
                }
                Some("run.done") => return latencies,
                _ => {}
            }
        }
    }
    latencies
}

/// The live-event latency across instances (see the module docs).
async fn live_events(dir: &Path, samples: usize) {
    let database = keel_testkit::postgres::ScratchDatabase::create("live_events");
    let calls = 20;
    let agent = stamp_agent(dir, calls);
    let a = Arc::new(Server::start(&agent, &database.url));
    let b = Arc::new(Server::start(&agent, &database.url));
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicU64::new(0));
    for parallel in [1usize, 16] {
        let runs = (samples / calls).max(parallel);
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                let (a, b, http, next) = (Arc::clone(&a), Arc::clone(&b), http.clone(), Arc::clone(&next));
                tokio::spawn(async move {
                    let (mut here, mut there) = (Vec::new(), Vec::new());
                    for _ in 0..runs / parallel {
                        let session = format!("live-{}", next.fetch_add(1, Ordering::Relaxed));
                        let watch = |server: &Server| {
                            http.get(format!("http://{}/chat/{session}/events", server.address)).send()
                        };
                        let (on_a, on_b) = (watch(&a).await.unwrap(), watch(&b).await.unwrap());
                        let observers = (tokio::spawn(observe(on_a)), tokio::spawn(observe(on_b)));
                        let run = http
                            .post(format!("http://{}/chat", a.address))
                            .json(&serde_json::json!({"sessionId": session, "input": "go"}))
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(run.status(), 200);
                        run.bytes().await.unwrap();
                        here.extend(observers.0.await.unwrap());
                        there.extend(observers.1.await.unwrap());
                    }
                    (here, there)
                })
            })
            .collect();
        let (mut here, mut there) = (Vec::new(), Vec::new());
        for worker in workers {
            let (h, t) = worker.await.unwrap();
            here.extend(h);
            there.extend(t);
        }
        here.sort();
        there.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for (label, sorted) in
            [("observer on the executing instance", &here), ("observer on another instance", &there)]
        {
            println!(
                "live events, {parallel} run(s) at a time, {label}: {} events, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                sorted.len(),
                ms(percentile(sorted, 0.50)),
                ms(percentile(sorted, 0.99)),
                ms(percentile(sorted, 1.0)),
            );
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--postgres") {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agent");
        std::fs::create_dir_all(&agent).unwrap();
        std::fs::write(agent.join("agent.yaml"), "name: load\nmodel: mock\n").unwrap();
        let seconds = env_or(keel_core::env::LOAD_SECONDS.name, if quick { 2 } else { 10 });
        let connections = env_or(keel_core::env::LOAD_CONNECTIONS.name, 32);
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        runtime.block_on(async {
            let database = keel_testkit::postgres::ScratchDatabase::create("load_turns");
            turns(&agent, &database.url, "postgres store", connections, seconds).await;
            live_events(dir.path(), if quick { 400 } else { 2_000 }).await;
        });
        return;
    }
    raise_fd_limit(200_000);
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("agent");
    std::fs::create_dir_all(&agent).unwrap();
    // No script: the mock echoes the input, a short turn.
    std::fs::write(agent.join("agent.yaml"), "name: load\nmodel: mock\n").unwrap();
    let streams_count = env_or(keel_core::env::LOAD_STREAMS.name, if quick { 500 } else { 20_000 });
    let seconds = env_or(keel_core::env::LOAD_SECONDS.name, if quick { 2 } else { 10 });
    let connections = env_or(keel_core::env::LOAD_CONNECTIONS.name, 32);
    let soak_turns = env_or(keel_core::env::LOAD_SOAK_TURNS.name, if quick { 5_000 } else { 200_000 });
    let soak_sessions = env_or(keel_core::env::LOAD_SOAK_SESSIONS.name, if quick { 200 } else { 2_000 });
    println!(
        "keel serve load benchmark (mock model, loopback, {} cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    runtime.block_on(async {
        h2_streams(&agent, streams_count, 4).await;
        streams(&agent, streams_count).await;
        turns(&agent, "memory", "memory store", connections, seconds).await;
        let db = dir.path().join("turns.db");
        turns(&agent, &format!("sqlite:{}", db.display()), "sqlite store", connections, seconds).await;
        let db = dir.path().join("soak.db");
        soak(&agent, &format!("sqlite:{}", db.display()), soak_turns, soak_sessions, connections).await;
        live_events(dir.path(), if quick { 400 } else { 2_000 }).await;
    });
}
