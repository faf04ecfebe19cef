//! A model-based concurrency test: random interleavings of inputs, approvals, rejections,
//! answers, cancels and SIGKILLs across up to three `keel` processes on one SQLite file, with
//! the store's and the session's invariants checked after every operation.
//!
//! Each iteration draws its operations, and the agent's `concurrency` mode, from a seed (printed
//! on failure; `KEEL_MODEL_SEED` replays one). `KEEL_MODEL_ITERATIONS` sets how many iterations run (a few in the default
//! suite; run it with hundreds before trusting a change to the store or the runtime).
//!
//! Checked after each operation:
//! - at most one unfinished run per session;
//! - every tool call is answered by exactly one result before the next model or user message
//!   (only the tail may wait, and only while the session has an unfinished run);
//! - no input is stored twice, and an input whose command finished its run (exit 0) is stored;
//! - a tool that completed in a process that then exited normally never runs again, and no
//!   process runs one tool call twice (a re-run needs the first process to have been killed).
//!
//! At the end of each iteration every process has ended on its own (none hangs), the session is
//! brought to rest (pending inputs decided, unfinished runs resumed) and takes a new input.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::{RunState, SessionId, Store};

use crate::support::{KEEL_PID, agent_dir};

const SESSIONS: [&str; 2] = ["m1", "m2"];
const MAX_LIVE: usize = 3;

/// One model turn's patterns, cycled through the script: parallel calls with an approval, a slow
/// call, a question, a plain answer, all three tools at once.
const PATTERNS: &[&str] = &[
    "{ tool_calls: [{ name: note, input: { n: 1 } }, { name: pay, input: { amount: 5 } }] }",
    "{ text: 'paid' }",
    "{ tool_calls: [{ name: slow, input: {} }] }",
    "{ text: 'slept' }",
    "{ tool_calls: [{ name: ask_question, input: { question: 'why?' } }] }",
    "{ text: 'understood' }",
    "{ text: 'just text' }",
    "{ tool_calls: [{ name: note, input: { n: 2 } }, { name: slow, input: {} }, { name: pay, input: { amount: 7 } }] }",
    "{ text: 'all done' }",
];

/// Logs each execution's start and end with its idempotency key and its keel process.
fn tool(name: &str, seconds: &str) -> String {
    format!(
        "description = \"{name}\"\ncommand = [\"sh\", \"-c\", \"{KEEL_PID}; echo start $KEEL_IDEMPOTENCY_KEY $keel >> calls.log; \
         sleep {seconds}; echo done $KEEL_IDEMPOTENCY_KEY $keel >> calls.log; echo {name} ok\"]\n"
    )
}

/// The agent, with the iteration's `concurrency` mode.
fn model_agent(concurrency: &str) -> tempfile::TempDir {
    let mut spec = format!(
        "model: mock\nconcurrency: {concurrency}\ntools: [ask_question]\napprovals: {{ tools: [pay] }}\nmock:\n  script:\n"
    );
    for index in 0..400 {
        spec.push_str(&format!("    - {}\n", PATTERNS[index % PATTERNS.len()]));
    }
    let (note, pay, slow) = (tool("note", "0"), tool("pay", "0"), tool("slow", "0.3"));
    agent_dir(&[
        ("agent.yaml", &spec),
        ("tools/note.toml", &note),
        ("tools/pay.toml", &pay),
        ("tools/slow.toml", &slow),
    ])
}

/// A process the harness started, until it ends.
struct Live {
    child: Child,
    what: String,
    /// The input it sends, for `keel run` with one.
    input: Option<String>,
}

/// How a process ended.
struct Ended {
    what: String,
    input: Option<String>,
    pid: u32,
    /// `None`: killed by a signal.
    code: Option<i32>,
    killed_by_harness: bool,
}

struct World {
    dir: PathBuf,
    /// The `--store` of every process.
    store_spec: String,
    store: Arc<dyn Store>,
    rng: fastrand::Rng,
    live: Vec<Live>,
    ended: Vec<Ended>,
    /// Pids the harness killed.
    killed: HashSet<u32>,
    next_input: u32,
    log: Vec<String>,
    seed: u64,
}

impl World {
    fn new(dir: &Path, seed: u64, store_spec: String) -> World {
        let store = keel_store::open(&store_spec).unwrap();
        World {
            dir: dir.to_owned(),
            store_spec,
            store,
            rng: fastrand::Rng::with_seed(seed),
            live: Vec::new(),
            ended: Vec::new(),
            killed: HashSet::new(),
            next_input: 0,
            log: Vec::new(),
            seed,
        }
    }

    fn fail(&self, why: &str) -> ! {
        panic!(
            "model test failed (seed {seed}; replay with KEEL_MODEL_SEED={seed} KEEL_MODEL_ITERATIONS=1): {why}\n\
             operations:\n  {}\ncalls.log:\n{}",
            self.log.join("\n  "),
            std::fs::read_to_string(self.dir.join("calls.log")).unwrap_or_default(),
            seed = self.seed,
        )
    }

    fn keel(&self, args: &[&str]) -> Command {
        let mut command = crate::support::keel_with_store(&self.dir, args, &self.store_spec);
        command.stdout(Stdio::null()).stderr(Stdio::null());
        command
    }

    fn spawn(&mut self, args: &[&str], input: Option<String>) {
        let what = args.join(" ");
        let child = self.keel(args).spawn().unwrap();
        self.log.push(format!("start [{}] {what}", child.id()));
        self.live.push(Live { child, what, input });
    }

    fn session(&mut self) -> &'static str {
        SESSIONS[self.rng.usize(..SESSIONS.len())]
    }

    async fn pending(&self) -> Vec<keel::PendingInput> {
        self.store.pending_inputs(None).await.unwrap_or_default()
    }

    /// One random operation.
    async fn step(&mut self) {
        let agent = self.dir.to_str().unwrap().to_owned();
        let pending = self.pending().await;
        let choice = self.rng.u32(..100);
        match choice {
            0..=24 if self.live.len() < MAX_LIVE => {
                let session = self.session();
                self.next_input += 1;
                let input = format!("input-{}", self.next_input);
                self.spawn(&["run", &agent, &input, "--session", session], Some(input.clone()));
            }
            25..=44 if !pending.is_empty() && self.live.len() < MAX_LIVE => {
                let target = &pending[self.rng.usize(..pending.len())];
                let id = target.id.clone();
                let continue_here = self.rng.bool();
                let mut args: Vec<String> = match &target.kind {
                    keel::PendingKind::Question { .. } => {
                        vec!["approvals".into(), "answer".into(), id, "because".into()]
                    }
                    keel::PendingKind::Approval { .. } if self.rng.u8(..4) == 0 => {
                        vec!["approvals".into(), "reject".into(), id, "--note".into(), "no".into()]
                    }
                    keel::PendingKind::Approval { .. } => vec!["approvals".into(), "approve".into(), id],
                };
                if continue_here {
                    args.extend(["--agent".into(), agent.clone()]);
                }
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                self.spawn(&args, None);
            }
            45..=51 if self.live.len() < MAX_LIVE => {
                let session = self.session();
                self.spawn(&["cancel", session], None);
            }
            52..=71 if !self.live.is_empty() => {
                let index = self.rng.usize(..self.live.len());
                let pid = self.live[index].child.id();
                self.log.push(format!("kill [{pid}]"));
                let _ = self.live[index].child.kill();
                self.killed.insert(pid);
            }
            72..=81 if self.live.len() < MAX_LIVE => {
                let session = self.session();
                self.spawn(&["run", &agent, "--session", session], None);
            }
            _ => {}
        }
        let pause = self.rng.u64(..150);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        self.reap();
    }

    /// Collects the processes that ended.
    fn reap(&mut self) {
        let mut index = 0;
        while index < self.live.len() {
            match self.live[index].child.try_wait().unwrap() {
                Some(status) => {
                    let live = self.live.remove(index);
                    let pid = live.child.id();
                    self.log.push(format!("ended [{pid}] {:?}", status.code()));
                    self.ended.push(Ended {
                        what: live.what,
                        input: live.input,
                        pid,
                        code: status.code(),
                        killed_by_harness: self.killed.contains(&pid),
                    });
                }
                None => index += 1,
            }
        }
    }

    /// Waits for every process to end on its own; one that does not is a hang.
    async fn wait_all(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.live.is_empty() {
            if Instant::now() > deadline {
                let hung: Vec<String> =
                    self.live.iter().map(|l| format!("[{}] {}", l.child.id(), l.what)).collect();
                for live in &mut self.live {
                    let _ = live.child.kill();
                }
                self.fail(&format!("processes hung: {hung:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.reap();
        }
    }

    /// The invariants that hold at any moment.
    async fn check(&self) {
        for session in SESSIONS {
            let id = SessionId::new(session).unwrap();
            let open = self.store.open_runs(Some(&id)).await.unwrap();
            if open.len() > 1 {
                self.fail(&format!("session {session} has {} unfinished runs: {open:?}", open.len()));
            }
            let messages = self.store.load_messages(&id).await.unwrap();
            if let Err(why) = check_transcript(&messages, !open.is_empty()) {
                self.fail(&format!("session {session}: {why}"));
            }
        }
        self.check_inputs().await;
        self.check_executions();
    }

    async fn check_inputs(&self) {
        let mut stored: HashMap<String, usize> = HashMap::new();
        for session in SESSIONS {
            let id = SessionId::new(session).unwrap();
            for message in self.store.load_messages(&id).await.unwrap() {
                if message.role == keel::Role::User {
                    *stored.entry(message.text()).or_default() += 1;
                }
            }
        }
        if let Some((input, count)) = stored.iter().find(|(_, count)| **count > 1) {
            self.fail(&format!("input {input:?} is stored {count} times"));
        }
        for ended in &self.ended {
            if let (Some(input), Some(0)) = (&ended.input, ended.code)
                && !stored.contains_key(input)
            {
                self.fail(&format!(
                    "[{}] {} finished its run, but {input:?} is not stored",
                    ended.pid, ended.what
                ));
            }
        }
    }

    fn check_executions(&self) {
        let log = std::fs::read_to_string(self.dir.join("calls.log")).unwrap_or_default();
        // Per call: the processes that completed it, in order.
        let mut completed: HashMap<&str, Vec<u32>> = HashMap::new();
        for line in log.lines() {
            let mut fields = line.split_whitespace();
            let (Some(event), Some(key), Some(pid)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            let Ok(pid) = pid.parse::<u32>() else { continue };
            let before = completed.entry(key).or_default();
            if event == "start" {
                if let Some(&first) = before.last() {
                    let ended_normally =
                        self.ended.iter().any(|e| e.pid == first && e.code.is_some() && !e.killed_by_harness);
                    if first == pid || ended_normally {
                        self.fail(&format!(
                            "tool call {key} ran again in [{pid}] after [{first}] completed it{}",
                            if first == pid { " (the same process)" } else { " and exited normally" }
                        ));
                    }
                }
            } else if event == "done" {
                before.push(pid);
            }
        }
    }

    /// Brings every session to rest and checks that each takes a new input.
    async fn settle(&mut self) {
        let agent = self.dir.to_str().unwrap().to_owned();
        for _ in 0..12 {
            for pending in self.pending().await {
                let args: Vec<&str> = match &pending.kind {
                    keel::PendingKind::Question { .. } => vec!["approvals", "answer", &pending.id, "settled"],
                    keel::PendingKind::Approval { .. } => vec!["approvals", "approve", &pending.id],
                };
                let _ = self.keel(&args).status();
            }
            let mut busy = false;
            for session in SESSIONS {
                let status = self.keel(&["run", &agent, "--session", session]).status().unwrap();
                busy |= !status.success();
            }
            if !busy && self.pending().await.is_empty() {
                break;
            }
        }
        for session in SESSIONS {
            let input = format!("final-{session}");
            let output = self
                .keel(&["run", &agent, &input, "--session", session])
                .stderr(Stdio::piped())
                .output()
                .unwrap();
            self.log.push(format!("final {session}: {:?}", output.status.code()));
            // The script may pause the final input for a human: that is a session in use, fine.
            if !matches!(output.status.code(), Some(0 | 5)) {
                self.fail(&format!(
                    "session {session} does not take a new input at rest: {:?} {}",
                    output.status.code(),
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
    }
}

/// Every call answered by exactly one result before the next model or user message; the tail
/// may wait for results only while `open` (the session has an unfinished run).
fn check_transcript(messages: &[Arc<keel::Message>], open: bool) -> Result<(), String> {
    let mut waiting: Vec<String> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        if message.role != keel::Role::Tool && !waiting.is_empty() {
            return Err(format!("message {index} ({:?}) follows unanswered calls {waiting:?}", message.role));
        }
        for part in &message.parts {
            match part {
                keel::Part::ToolResult(result) => match waiting.iter().position(|c| *c == result.call_id) {
                    Some(at) => {
                        waiting.remove(at);
                    }
                    None => {
                        return Err(format!("message {index} answers {}, which is not open", result.call_id));
                    }
                },
                keel::Part::ToolCall(call) => waiting.push(call.call_id.clone()),
                _ => {}
            }
        }
    }
    if !waiting.is_empty() && !open {
        return Err(format!("calls {waiting:?} have no result and no run will give them one"));
    }
    Ok(())
}

#[allow(clippy::print_stderr, reason = "a test's summary for whoever runs it")]
pub(crate) fn summarize(summary: &str) {
    eprintln!("{summary}");
}

fn iterations() -> u64 {
    std::env::var(keel_core::env::MODEL_ITERATIONS.name).ok().and_then(|n| n.parse().ok()).unwrap_or(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_across_processes_keep_every_session_whole() {
    explore(Backing::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_across_processes_on_postgres_keep_every_session_whole() {
    explore(Backing::Postgres).await;
}

/// The store the processes share.
#[derive(Clone, Copy)]
enum Backing {
    Sqlite,
    Postgres,
}

async fn explore(backing: Backing) {
    let first_seed = std::env::var(keel_core::env::MODEL_SEED.name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    let started = Instant::now();
    let mut totals: HashMap<String, usize> = HashMap::new();
    for iteration in 0..iterations() {
        let seed = first_seed.wrapping_add(iteration);
        let concurrency = ["reject", "queue", "replace"][(seed % 3) as usize];
        let dir = model_agent(concurrency);
        let database = matches!(backing, Backing::Postgres)
            .then(|| keel_testkit::postgres::ScratchDatabase::create("model"));
        let spec = match &database {
            Some(database) => database.url.clone(),
            None => format!("sqlite:{}", dir.path().join("keel.db").display()),
        };
        let mut world = World::new(dir.path(), seed, spec);
        world.log.push(format!("concurrency: {concurrency}"));
        for _ in 0..14 {
            world.step().await;
            world.check().await;
        }
        world.wait_all().await;
        world.check().await;
        world.settle().await;
        world.check().await;
        // At rest, a run may wait for a human (the final input's script may ask), never run.
        let open = world.store.open_runs(None).await.unwrap();
        if open.iter().any(|run| run.state == RunState::Running) {
            world.fail(&format!("runs left running at rest: {open:?}"));
        }
        for ended in &world.ended {
            let verb = ended.what.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            let verb = if verb.starts_with("run ") { "run".to_owned() } else { verb };
            let outcome = match ended.code {
                Some(code) => format!("exit {code}"),
                None => "killed".to_owned(),
            };
            *totals.entry(format!("{verb}: {outcome}")).or_default() += 1;
        }
        let executions = std::fs::read_to_string(dir.path().join("calls.log")).unwrap_or_default();
        *totals.entry("tool executions completed".into()).or_default() +=
            executions.lines().filter(|l| l.starts_with("done")).count();
    }
    let mut totals: Vec<(String, usize)> = totals.into_iter().collect();
    totals.sort();
    // What the iterations did, to see that they explored (`--nocapture` shows it).
    summarize(&format!(
        "model test: {} iterations from seed {first_seed} in {:.1} s; {totals:?}",
        iterations(),
        started.elapsed().as_secs_f64()
    ));
}
