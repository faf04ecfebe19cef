//! One run per session, everywhere: decisions from other processes reach a waiting chat, a
//! killed server resumes its runs at once, busy sessions are refused before any stream, poison
//! runs end, `keel cancel` reaches any process, and processes opening one store together all
//! start. Real binaries, a real SQLite file, real kills.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::serve::{Served, client, read_sse, sqlite};
use crate::support::{agent_dir, keel_on_store as keel};

/// One tool that needs approval, then an answer that quotes it; a third entry for the next turn.
const CONVERT_AGENT: &str = "model: mock
approvals: { tools: [convert] }
mock:
  script:
    - tool_calls: [{ name: convert, input: { km: 10 } }]
    - text: '10 km is {{last_tool_output}}.'
    - text: 'hello to you'
    - text: 'and again'
";

/// Logs each execution (its idempotency key) in calls.txt, then answers.
const CONVERT_TOML: &str = "description = \"Converts kilometres to miles\"
command = [\"sh\", \"-c\", \"echo $KEEL_IDEMPOTENCY_KEY >> calls.txt; echo 6.2 miles\"]
";

/// A tool that marks its start, sleeps, and logs its end.
const SLOW_TOML: &str = "description = \"Takes its time\"
command = [\"sh\", \"-c\", \"echo start >> started.txt; sleep SECONDS; echo $KEEL_IDEMPOTENCY_KEY >> calls.txt; echo slept\"]
";

const SLOW_AGENT: &str = "model: mock
mock:
  script:
    - tool_calls: [{ name: slow, input: {} }]
    - text: 'Done: {{last_tool_output}}'
    - text: 'next answer'
";

fn slow_agent(seconds: u32) -> tempfile::TempDir {
    agent_dir(&[
        ("agent.yaml", SLOW_AGENT),
        ("tools/slow.toml", &SLOW_TOML.replace("SECONDS", &seconds.to_string())),
    ])
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap_or_default()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The session's stored messages, as `keel sessions show --json` prints them.
fn messages(dir: &Path, session: &str) -> Vec<Value> {
    let output = keel(dir, &["sessions", "show", session, "--json"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let document: Value = serde_json::from_slice(&output.stdout).unwrap();
    document["messages"].as_array().unwrap().clone()
}

/// The tool call ids in a message's parts of `kind` (`toolCall` or `toolResult`).
fn call_ids(message: &Value, kind: &str) -> Vec<String> {
    message["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|part| part["type"] == kind)
        .map(|part| part["callId"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Checks a transcript the way a provider would: every tool call is answered by exactly one
/// result before the next model message or user message, and no result answers nothing.
pub(crate) fn assert_whole(messages: &[Value]) {
    let mut open: Vec<String> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        let results = call_ids(message, "toolResult");
        if role != "tool" {
            assert!(
                open.is_empty(),
                "message {index} ({role}) follows unanswered calls {open:?}: {messages:#?}"
            );
        }
        for result in results {
            let at = open.iter().position(|c| *c == result);
            assert!(at.is_some(), "message {index} answers {result}, which is not open: {messages:#?}");
            open.remove(at.unwrap());
        }
        open.extend(call_ids(message, "toolCall"));
    }
}

/// A pseudo-terminal session (`script`), its screen collected as it comes.
struct Terminal {
    child: std::process::Child,
    input: std::process::ChildStdin,
    screen: Arc<Mutex<String>>,
}

impl Terminal {
    fn start(dir: &Path, command_line: &str) -> Terminal {
        let mut child = Command::new("script")
            .args(["-qec", command_line, "/dev/null"])
            .current_dir(dir)
            .env("KEEL_LOG", "error")
            .env_remove("KEEL_STORE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("`script` (util-linux) runs commands on a pseudo-terminal");
        let input = child.stdin.take().unwrap();
        let mut output = child.stdout.take().unwrap();
        let screen = Arc::new(Mutex::new(String::new()));
        let collected = Arc::clone(&screen);
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(read) = output.read(&mut buffer) {
                if read == 0 {
                    break;
                }
                collected.lock().unwrap().push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
        });
        Terminal { child, input, screen }
    }

    fn screen(&self) -> String {
        self.screen.lock().unwrap().clone()
    }

    /// Waits until the screen shows `text` after `from` (a length of the screen seen before).
    fn wait_for(&self, text: &str, from: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let screen = self.screen();
            if let Some(at) = screen.get(from..).and_then(|tail| tail.find(text)) {
                return from + at + text.len();
            }
            assert!(Instant::now() < deadline, "the terminal never showed {text:?}:\n{screen}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn type_line(&mut self, line: &str) {
        self.input.write_all(format!("{line}\n").as_bytes()).unwrap();
        self.input.flush().unwrap();
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_decision_made_elsewhere_reaches_a_waiting_chat_and_the_session_stays_whole() {
    let dir = agent_dir(&[("agent.yaml", CONVERT_AGENT), ("tools/convert.toml", CONVERT_TOML)]);
    let dir = dir.path();
    let chat = format!(
        "{} chat {} --session c2 --store {}",
        crate::support::keel_binary().display(),
        dir.display(),
        sqlite(dir)
    );
    let mut terminal = Terminal::start(dir, &chat);
    let seen = terminal.wait_for("you> ", 0);
    terminal.type_line("convert 10 km");
    let seen = terminal.wait_for("Allow convert", seen);
    // From another shell, while the chat waits at its prompt.
    let listed = keel(dir, &["approvals", "list", "--json"]).output().unwrap();
    let pending: Value =
        serde_json::from_slice(listed.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    let id = pending["id"].as_str().unwrap();
    let approved = keel(dir, &["approvals", "approve", id]).output().unwrap();
    assert!(approved.status.success(), "{approved:?}");
    // The chat notices, without anyone typing, and shows the run continuing.
    let seen = terminal.wait_for("approved elsewhere", seen);
    let seen = terminal.wait_for("10 km is 6.2 miles.", seen);
    let seen = terminal.wait_for("you> ", seen);
    terminal.type_line("hello");
    let seen = terminal.wait_for("hello to you", seen);
    terminal.wait_for("you> ", seen);
    terminal.type_line("/exit");
    let status = terminal.child.wait().unwrap();
    assert!(status.success(), "{}", terminal.screen());

    assert_eq!(read(dir, "calls.txt").lines().count(), 1, "the approved tool must run exactly once");
    let stored = messages(dir, "c2");
    assert_whole(&stored);
    let roles: Vec<&str> = stored.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant", "user", "assistant"], "{stored:#?}");
    // The session goes on from any process.
    let next = keel(dir, &["run", dir.to_str().unwrap(), "again", "--session", "c2"]).output().unwrap();
    assert!(next.status.success(), "{next:?}");
    assert_eq!(String::from_utf8_lossy(&next.stdout), "and again\n");
}

#[test]
fn a_waiting_terminal_follows_a_run_that_another_process_continues() {
    let dir = agent_dir(&[("agent.yaml", CONVERT_AGENT), ("tools/convert.toml", CONVERT_TOML)]);
    let dir = dir.path();
    let run = format!(
        "{} run {} 'convert 10 km' --session t --store {}",
        crate::support::keel_binary().display(),
        dir.display(),
        sqlite(dir)
    );
    let terminal = Terminal::start(dir, &run);
    let seen = terminal.wait_for("Allow convert", 0);
    let listed = keel(dir, &["approvals", "list", "--json"]).output().unwrap();
    let pending: Value =
        serde_json::from_slice(listed.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    let id = pending["id"].as_str().unwrap();
    // Decided, and continued, by another process.
    let elsewhere =
        keel(dir, &["approvals", "approve", id, "--agent", dir.to_str().unwrap()]).output().unwrap();
    assert!(elsewhere.status.success(), "{elsewhere:?}");
    assert_eq!(String::from_utf8_lossy(&elsewhere.stdout), "10 km is 6.2 miles.\n");
    // The terminal stops asking, says so, and shows how the run ended, without running it again.
    let seen = terminal.wait_for("approved elsewhere", seen);
    terminal.wait_for("10 km is 6.2 miles.", seen);
    let mut terminal = terminal;
    let status = terminal.child.wait().unwrap();
    assert!(status.success(), "{}", terminal.screen());
    assert_eq!(read(dir, "calls.txt").lines().count(), 1);
    assert_whole(&messages(dir, "t"));
}

#[test]
fn a_second_decision_is_refused_saying_who_decided_first_and_changes_nothing() {
    let dir = agent_dir(&[("agent.yaml", CONVERT_AGENT), ("tools/convert.toml", CONVERT_TOML)]);
    let dir = dir.path();
    let paused = keel(dir, &["run", dir.to_str().unwrap(), "go", "--session", "s"]).output().unwrap();
    assert_eq!(paused.status.code(), Some(5), "{paused:?}");
    let listed = keel(dir, &["approvals", "list", "--json"]).output().unwrap();
    let pending: Value =
        serde_json::from_slice(listed.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    let id = pending["id"].as_str().unwrap();
    let first = keel(dir, &["approvals", "approve", id]).output().unwrap();
    assert!(first.status.success(), "{first:?}");
    let second = keel(dir, &["approvals", "reject", id, "--note", "too late"]).output().unwrap();
    assert!(!second.status.success());
    let message = stderr(&second);
    assert!(message.contains("KEEL_NOT_PENDING"), "{message}");
    assert!(message.contains("approved") && message.contains("keel approvals"), "who decided? {message}");
    // The first decision stands: the tool runs once, and the model never hears of "too late".
    let resumed = keel(dir, &["run", dir.to_str().unwrap(), "--session", "s"]).output().unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    assert_eq!(read(dir, "calls.txt").lines().count(), 1);
    let stored = messages(dir, "s");
    assert_whole(&stored);
    assert!(!serde_json::to_string(&stored).unwrap().contains("too late"));
}

#[tokio::test]
async fn a_killed_server_resumes_its_runs_as_soon_as_it_starts_again() {
    let dir = slow_agent(1);
    let store = sqlite(dir.path());
    let http = client();
    // A lease of an hour: only knowing that the old process is gone can free the run.
    let env = [("KEEL_RUN_LEASE", "1h")];
    let server = Served::start(dir.path(), &store, &env);
    let stream =
        http.post(server.url("/chat")).json(&json!({"sessionId": "s", "input": "go"})).send().await.unwrap();
    assert_eq!(stream.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    while read(dir.path(), "started.txt").is_empty() {
        assert!(Instant::now() < deadline, "the tool never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(stream);
    drop(server); // SIGKILL
    let server = Served::start(dir.path(), &store, &env);
    let mut transcript = Value::Null;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        transcript = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
        if transcript["messages"].as_array().is_some_and(|m| m.len() == 4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let messages = transcript["messages"].as_array().expect("a transcript");
    assert_eq!(messages.len(), 4, "the run was not resumed: {transcript:#}");
    assert_eq!(messages[3]["content"][0]["text"], "Done: slept");
}

#[tokio::test]
async fn a_session_busy_in_another_process_is_a_409_before_any_stream() {
    let dir = slow_agent(3);
    let path = dir.path();
    let mut other = keel(path, &["run", path.to_str().unwrap(), "go", "--session", "s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while read(path, "started.txt").is_empty() {
        assert!(Instant::now() < deadline, "the tool never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let server = Served::start(path, &sqlite(path), &[]);
    let response = client()
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "s", "input": "me too"}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert_eq!(status, 409, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "KEEL_SESSION_BUSY", "{body}");
    assert!(other.wait().unwrap().success());
    // The refused input was not stored, and the session is whole.
    let stored = messages(path, "s");
    assert_whole(&stored);
    assert!(!serde_json::to_string(&stored).unwrap().contains("me too"));
    // The CLI says "busy" with its own exit code too.
    let mut other = keel(path, &["run", path.to_str().unwrap(), "go", "--session", "t"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while read(path, "started.txt").lines().count() < 2 {
        assert!(Instant::now() < deadline + Duration::from_secs(20), "the tool never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let busy = keel(path, &["run", path.to_str().unwrap(), "me too", "--session", "t"]).output().unwrap();
    assert_eq!(busy.status.code(), Some(6), "{busy:?}");
    assert!(stderr(&busy).contains("KEEL_SESSION_BUSY"), "{}", stderr(&busy));
    assert!(!stderr(&busy).contains("the store failed"), "{}", stderr(&busy));
    assert!(other.wait().unwrap().success());
}

const REPLACE_AGENT: &str = "model: mock
concurrency: replace
mock:
  script:
    - { delay_ms: 200, text: 'one' }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_under_replace_is_stored_or_refused_whole_and_the_line_is_bounded() {
    let dir = agent_dir(&[("agent.yaml", REPLACE_AGENT)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let requests = (0..10).map(|i| {
        let (http, url) = (http.clone(), server.url("/chat"));
        tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&json!({"sessionId": "s", "input": format!("m{i}")}))
                .send()
                .await
                .unwrap();
            match response.status().as_u16() {
                200 => Ok((i, read_sse(response).await)),
                status => Err((status, response.text().await.unwrap())),
            }
        })
    });
    let (mut accepted, mut outcomes) = (Vec::new(), Vec::new());
    for request in requests.collect::<Vec<_>>() {
        match request.await.unwrap() {
            Ok((i, messages)) => {
                accepted.push(format!("m{i}"));
                outcomes.push(messages.iter().rev().find(|m| m.event.is_none()).expect("an event").json());
            }
            // Past the run in flight and the 5 inputs a session holds waiting: refused, whole.
            Err((status, body)) => {
                assert_eq!(status, 409, "{body}");
                assert!(body.contains("KEEL_SESSION_BUSY") && body.contains("inputs waiting"), "{body}");
            }
        }
    }
    assert!(accepted.len() >= 6, "the run in flight and 5 waiting are always accepted: {accepted:?}");
    for outcome in &outcomes {
        assert_eq!(outcome["type"], "run.done", "an accepted input was dropped: {outcomes:#?}");
    }
    assert!(outcomes.iter().any(|o| o["stopped"] == "final"), "{outcomes:#?}");
    // Every accepted input is stored, and no refused one.
    let stored = messages(dir.path(), "s");
    let mut inputs: Vec<String> = stored
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    inputs.sort_unstable();
    accepted.sort_unstable();
    assert_eq!(inputs, accepted, "{stored:#?}");
}

#[test]
fn a_run_that_crashes_at_the_same_step_every_time_is_failed_and_the_session_goes_on() {
    let dir = slow_agent(0);
    let path = dir.path();
    let agent = path.to_str().unwrap();
    let crash = |command: &mut Command| {
        command.env("KEEL_FAULT", "before_commit:tool:slow:call_0_0").output().unwrap()
    };
    let first = crash(&mut keel(path, &["run", agent, "go", "--session", "s"]));
    assert_eq!(first.status.code(), None, "the fault aborts the process: {first:?}");
    let mut poisoned = None;
    for attempt in 0..8 {
        let output = crash(&mut keel(path, &["run", agent, "--session", "s"]));
        if output.status.code().is_some() {
            poisoned = Some((attempt, output));
            break;
        }
    }
    let (attempts, output) = poisoned.expect("recovery kept re-driving a run that crashes every time");
    assert!(attempts <= 4, "{attempts} re-drives");
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(stderr(&output).contains("KEEL_RUN_POISONED"), "{}", stderr(&output));
    // Recovery no longer picks it up, and the session takes new input.
    let next = keel(path, &["run", agent, "next", "--session", "s"]).output().unwrap();
    assert!(next.status.success(), "{next:?}");
    let stored = messages(path, "s");
    assert_whole(&stored);
    assert!(serde_json::to_string(&stored).unwrap().contains("KEEL_RUN_POISONED"), "{stored:#?}");
}

#[test]
fn processes_opening_a_new_store_together_all_start_and_migrate_it_once() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..6 {
        let store = format!("sqlite:{}", dir.path().join(format!("new-{round}.db")).display());
        let children: Vec<_> = (0..8)
            .map(|_| {
                Command::new(crate::support::keel_binary())
                    .args(["sessions", "list", "--store", &store])
                    .env("KEEL_LOG", "error")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in children {
            let output = child.wait_with_output().unwrap();
            assert!(output.status.success(), "round {round}: {}", stderr(&output));
        }
    }
}

#[test]
fn keel_cancel_stops_a_run_in_another_process_and_a_paused_one() {
    let dir = slow_agent(30);
    let path = dir.path();
    let agent = path.to_str().unwrap();
    let started = Instant::now();
    let running = keel(path, &["run", agent, "go", "--session", "s"]).stderr(Stdio::piped()).spawn().unwrap();
    while read(path, "started.txt").is_empty() {
        assert!(started.elapsed() < Duration::from_secs(20), "the tool never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let cancel = keel(path, &["cancel", "s"]).output().unwrap();
    assert!(cancel.status.success(), "{cancel:?}");
    let output = running.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(130), "{output:?}");
    assert!(started.elapsed() < Duration::from_secs(25), "the run went on for {:?}", started.elapsed());
    assert_eq!(read(path, "calls.txt"), "", "the cancelled tool finished anyway");
    let stored = messages(path, "s");
    assert_whole(&stored);

    // A run paused for a human, with nobody driving it.
    let convert = agent_dir(&[("agent.yaml", CONVERT_AGENT), ("tools/convert.toml", CONVERT_TOML)]);
    let path = convert.path();
    let agent = path.to_str().unwrap();
    let paused = keel(path, &["run", agent, "go", "--session", "p"]).output().unwrap();
    assert_eq!(paused.status.code(), Some(5), "{paused:?}");
    let cancel = keel(path, &["cancel", "p"]).output().unwrap();
    assert!(cancel.status.success(), "{cancel:?}");
    let listed = keel(path, &["approvals", "list", "--json"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&listed.stdout), "", "a cancelled run's approval is still pending");
    let next = keel(path, &["run", agent, "after", "--session", "p"]).output().unwrap();
    assert!(next.status.success(), "{next:?}");
    assert_eq!(read(path, "calls.txt"), "", "the cancelled call ran");
    let stored = messages(path, "p");
    assert_whole(&stored);
    let text = serde_json::to_string(&stored).unwrap();
    assert!(text.contains("cancelled: the run was cancelled"), "{stored:#?}");
    assert_eq!(
        String::from_utf8_lossy(&next.stdout),
        "10 km is cancelled: the run was cancelled before this call finished.\n"
    );
    // Nothing to cancel: said, with its own exit code.
    let nothing = keel(path, &["cancel", "p"]).output().unwrap();
    assert!(!nothing.status.success());
    assert!(stderr(&nothing).contains("KEEL_RUN_NOT_FOUND"), "{}", stderr(&nothing));
}

#[tokio::test]
async fn a_run_leased_by_a_process_on_another_host_is_never_taken_over() {
    let dir = slow_agent(0);
    let path = dir.path();
    let agent = path.to_str().unwrap();
    // A run in flight on another machine: its owner names a kernel this host cannot check.
    {
        let store = keel::SqliteStore::open(&path.join("keel.db")).unwrap();
        let session = keel::SessionId::new("s").unwrap();
        let record = keel_core::RunRecord {
            run_id: keel::RunId::from_suffix("elsewhere"),
            session_id: session.clone(),
            input: std::sync::Arc::new(keel::Message::user("go")),
            history_len: 0,
            call_base: 0,
            state: keel::RunState::Running,
            limits: Default::default(),
        };
        let owner = "keel/otherhost/0123456789abcdef/4242/99/nonce";
        let input = [Arc::new(keel::Message::user("go"))];
        let commit = keel_core::StepCommit {
            new_run: Some(&record),
            messages: &input,
            fence: Some(keel_core::Fence { owner, epoch: 1, ttl: Duration::from_secs(3600) }),
            ..keel_core::StepCommit::new(&session, &record.run_id)
        };
        keel::Store::commit_step(&store, commit).await.unwrap();
    }
    for args in [vec!["run", agent, "--session", "s"], vec!["run", agent, "more", "--session", "s"]] {
        let output = keel(path, &args).output().unwrap();
        assert_eq!(output.status.code(), Some(6), "{output:?}");
        let message = stderr(&output);
        assert!(message.contains("keel process 4242 on host otherhost"), "{message}");
        assert!(message.contains("in 60 min"), "when it can be taken over: {message}");
    }
    assert_eq!(read(path, "started.txt"), "", "the other host's run was driven here");
    let stored = messages(path, "s");
    assert_eq!(stored.len(), 1, "{stored:#?}");
}

#[tokio::test]
async fn a_run_whose_journal_cannot_be_read_fails_alone_and_the_others_go_on() {
    let dir = slow_agent(0);
    let path = dir.path();
    let agent = path.to_str().unwrap();
    // Two sessions, each with a run killed after its tool's step was committed.
    for session in ["a", "b"] {
        let output = keel(path, &["run", agent, "go", "--session", session])
            .env("KEEL_FAULT", "after_commit:tool:slow:call_0_0")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), None, "the fault aborts the process: {output:?}");
    }
    // Session a's journal is damaged.
    let damaged = Command::new("python3")
        .arg("-c")
        .arg(
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); \
             c.execute(\"UPDATE journal SET body = '{not json' WHERE step = 'llm:turn:0' AND run_id IN \
             (SELECT id FROM runs WHERE session_id = 'a')\"); c.commit()",
        )
        .arg(path.join("keel.db"))
        .status()
        .unwrap();
    assert!(damaged.success());
    // A server recovers both at start: a fails with a code, b finishes.
    let server = Served::start(path, &sqlite(path), &[]);
    let http = client();
    let deadline = Instant::now() + Duration::from_secs(20);
    let finished = loop {
        let transcript: Value = http.get(server.url("/chat/b")).send().await.unwrap().json().await.unwrap();
        if transcript["messages"].as_array().is_some_and(|m| m.len() == 4) {
            break transcript;
        }
        assert!(Instant::now() < deadline, "session b was not recovered: {transcript:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(finished["messages"][3]["content"][0]["text"], "Done: slept");
    drop(server);
    let failed = Command::new("python3")
        .arg("-c")
        .arg(
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); \
             print(c.execute(\"SELECT state FROM runs WHERE session_id = 'a'\").fetchone()[0])",
        )
        .arg(path.join("keel.db"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&failed.stdout).trim(), "failed", "{failed:?}");
    // Session a takes new input; the call its failed run left open is answered first.
    let next = keel(path, &["run", agent, "again", "--session", "a"]).output().unwrap();
    assert!(next.status.success(), "{next:?}");
    assert_whole(&messages(path, "a"));
}
