//! Crash tests: the real binary, a real SQLite file, a real SIGKILL.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use keel::{Agent, RunId, RunState, SessionId, SqliteStore};
use serde_json::Value;

use crate::support::agent_dir;

const AGENT: &str = "model: mock
mock:
  script:
    - tool_calls: [{ name: append, input: { line: one } }]
    - tool_calls: [{ name: nap, input: {} }]
    - text: 'done: {{last_tool_output}}'
";

/// Appends its input line to log.txt: a side effect that must happen exactly once.
const APPEND: &str = "description = \"Appends a line to log.txt\"
command = [\"sh\", \"-c\", \"python3 -c 'import json,sys; print(json.load(sys.stdin)[\\\"line\\\"])' >> log.txt; echo appended\"]
";

/// Hangs on its first run (the process is killed meanwhile), answers on the next.
const NAP: &str = "description = \"Naps\"
command = [\"sh\", \"-c\", \"if [ -f nap.pid ]; then echo rested; else echo $$ > nap.pid; exec sleep 60; fi\"]
";

/// Starts `keel run` on the crash agent, waits until `nap` hangs, SIGKILLs it. Returns the run id.
fn run_and_kill(dir: &std::path::Path, db: &std::path::Path) -> RunId {
    let mut child = std::process::Command::new(crate::support::keel_binary())
        .arg("run")
        .arg(dir)
        .args(["go", "--json", "--session", "crash"])
        .arg("--store")
        .arg(format!("sqlite:{}", db.display()))
        .current_dir(dir)
        // A short lease, so that the run counts as interrupted soon after the kill.
        .env("KEEL_RUN_LEASE", "2s")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Read events until the second tool is running.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut run_id = None;
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if event["type"] == "run.start" {
            run_id = Some(event["runId"].as_str().unwrap().to_owned());
        }
        if event["type"] == "tool.start" && event["name"] == "nap" {
            break;
        }
    }
    let pid_file = dir.join("nap.pid");
    for _ in 0..500 {
        if std::fs::read_to_string(&pid_file).is_ok_and(|s| s.ends_with('\n')) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Kill -9: no destructor, no cleanup, no chance to write anything more.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    child.wait().unwrap();
    // The orphaned `sleep` is not ours to keep.
    let sleeper: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sleeper), nix::sys::signal::Signal::SIGKILL);
    RunId::parse(&run_id.expect("a run.start event")).unwrap()
}

#[tokio::test]
async fn a_run_killed_mid_tool_resumes_from_its_sqlite_journal_without_repeating_work() {
    let dir = agent_dir(&[("agent.yaml", AGENT), ("tools/append.toml", APPEND), ("tools/nap.toml", NAP)]);
    let db = dir.path().join("keel.db");
    let run_id = run_and_kill(dir.path(), &db);

    // What the killed process left: the run, still running, and its committed steps.
    let store = std::sync::Arc::new(SqliteStore::open(&db).unwrap());
    let record = keel::Store::load_run(&*store, &run_id).await.unwrap().expect("the run was stored");
    assert_eq!(record.state, RunState::Running);
    let before = keel::Store::load_messages(&*store, &SessionId::new("crash").unwrap()).await.unwrap();
    assert_eq!(before.len(), 4, "user, call append, its result, call nap: {before:#?}");

    // Another process (here: this test) re-drives it from the journal, once its lease expired.
    let spec = keel::load_spec(dir.path()).unwrap();
    let agent = Agent::from_spec(spec, store.clone()).await.unwrap();
    let early = agent.resume(run_id.clone()).result().await.unwrap_err();
    assert_eq!(early.code, keel::ErrorCode::RunLeased, "{early:?}");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let result = agent.resume(run_id.clone()).result().await.unwrap();
    assert_eq!(result.text, "done: rested");
    // `append` had completed before the kill: it did not run again.
    assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "one\n");
    let after = keel::Store::load_messages(&*store, &SessionId::new("crash").unwrap()).await.unwrap();
    assert_eq!(&after[..4], &before[..], "the resumed run rewrote history");
    assert_eq!(after.len(), 6, "{after:#?}");
    assert_eq!(after.iter().filter(|m| m.role == keel::Role::User).count(), 1, "a duplicated message");
    let record = keel::Store::load_run(&*store, &run_id).await.unwrap().unwrap();
    assert_eq!(record.state, RunState::Done);
}

#[test]
fn the_next_keel_run_of_the_session_finishes_the_interrupted_turn_first() {
    let dir = agent_dir(&[("agent.yaml", AGENT), ("tools/append.toml", APPEND), ("tools/nap.toml", NAP)]);
    let db = dir.path().join("keel.db");
    run_and_kill(dir.path(), &db);
    std::thread::sleep(Duration::from_millis(2100));
    let output = crate::support::keel()
        .arg("run")
        .arg(dir.path())
        .args(["and now?", "--session", "crash"])
        .arg("--store")
        .arg(format!("sqlite:{}", db.display()))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("resuming run run_"), "{stderr}");
    // The interrupted turn's answer, then the new input's (the mock's script is used up: echo).
    assert_eq!(String::from_utf8(output.stdout).unwrap(), "done: rested\nand now?\n");
    assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "one\n", "append ran twice");
}

const STEPS_AGENT: &str = "model: mock
mock:
  script:
    - { delay_ms: DELAY, tool_calls: [{ name: append, input: { line: one } }] }
    - { delay_ms: DELAY, text: 'done: {{last_tool_output}}' }
";

/// Appends once per idempotency key (the pattern keel documents for side effects), and counts
/// every execution in calls.txt.
const APPEND_PY: &str = r#"import json, os, sys, time
data = json.load(sys.stdin)
key = os.environ["KEEL_IDEMPOTENCY_KEY"]
time.sleep(float(os.environ.get("NAP", "0")))
seen = open("keys.txt").read().split() if os.path.exists("keys.txt") else []
if key not in seen:
    with open("log.txt", "a") as log:
        log.write(data["line"] + "\n")
    with open("keys.txt", "a") as keys:
        keys.write(key + "\n")
with open("calls.txt", "a") as calls:
    calls.write(key + "\n")
print("appended")
"#;

const APPEND_TOML: &str = "description = \"Appends a line to log.txt, once per idempotency key\"
command = [\"python3\", \"append.py\"]
";

fn steps_agent(delay_ms: u64) -> tempfile::TempDir {
    let spec = STEPS_AGENT.replace("DELAY", &delay_ms.to_string());
    agent_dir(&[("agent.yaml", &spec), ("tools/append.toml", APPEND_TOML), ("append.py", APPEND_PY)])
}

fn keel_in(dir: &std::path::Path) -> std::process::Command {
    let mut command = std::process::Command::new(crate::support::keel_binary());
    command.current_dir(dir).env_remove("KEEL_FAULT").env("KEEL_LOG", "error");
    command.arg("run").arg(dir).arg("--store").arg(format!("sqlite:{}", dir.join("keel.db").display()));
    command
}

/// The session's messages as stored (JSON lines, without ids that vary between runs).
fn transcript(dir: &std::path::Path) -> Vec<String> {
    let output = crate::support::keel()
        .args(["sessions", "show", "s", "--json", "--store"])
        .arg(format!("sqlite:{}", dir.join("keel.db").display()))
        .output()
        .unwrap();
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_default();
    document["messages"].as_array().into_iter().flatten().map(serde_json::Value::to_string).collect()
}

fn lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |text| text.lines().count())
}

#[test]
fn a_crash_at_every_step_boundary_is_recovered_without_repeating_committed_work() {
    // The reference: the same two turns, never interrupted.
    let reference_dir = steps_agent(0);
    for input in ["go", "next"] {
        let status = keel_in(reference_dir.path()).args([input, "--session", "s"]).status().unwrap();
        assert!(status.success());
    }
    let reference = transcript(reference_dir.path());
    assert_eq!(reference.len(), 6, "{reference:#?}");

    for point in ["before_commit", "after_commit"] {
        for step in ["llm:turn:0", "tool:append:call_0_0", "llm:turn:1"] {
            let case = format!("{point}:{step}");
            let dir = steps_agent(0);
            let crashed = keel_in(dir.path())
                .args(["go", "--session", "s"])
                .env("KEEL_FAULT", &case)
                .env("KEEL_RUN_LEASE", "200ms")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            assert!(!crashed.success(), "{case}: the fault did not fire");
            std::thread::sleep(Duration::from_millis(250));
            let next = keel_in(dir.path()).args(["next", "--session", "s"]).output().unwrap();
            assert!(next.status.success(), "{case}: {next:?}");
            assert_eq!(
                transcript(dir.path()),
                reference,
                "{case}: the transcript differs from an uninterrupted run"
            );
            assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "one\n", "{case}");
            // A tool whose result was committed never runs again; one that finished but was not
            // committed runs again (at least once), and its idempotency key stops the repeat.
            let expected_calls = if case == "before_commit:tool:append:call_0_0" { 2 } else { 1 };
            assert_eq!(lines(&dir.path().join("calls.txt")), expected_calls, "{case}");
        }
    }
}

#[test]
fn random_sigkills_over_many_runs_never_lose_or_repeat_committed_work() {
    let reference_dir = steps_agent(20);
    for input in ["go", "next"] {
        assert!(
            keel_in(reference_dir.path())
                .args([input, "--session", "s"])
                .env("NAP", "0.02")
                .status()
                .unwrap()
                .success()
        );
    }
    let reference = transcript(reference_dir.path());
    // A small deterministic generator: the seed is printed with any failure.
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut state = seed | 1;
    let mut next_random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for iteration in 0..8 {
        let kill_after = Duration::from_millis(next_random() % 160);
        let dir = steps_agent(20);
        let mut child = keel_in(dir.path())
            .args(["go", "--session", "s"])
            .env("KEEL_RUN_LEASE", "200ms")
            .env("NAP", "0.02")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(kill_after);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        child.wait().unwrap();
        let context = format!("seed {seed}, iteration {iteration}, killed after {kill_after:?}");
        let stored_before = transcript(dir.path());
        std::thread::sleep(Duration::from_millis(250));
        let next = keel_in(dir.path()).args(["next", "--session", "s"]).env("NAP", "0.02").output().unwrap();
        assert!(next.status.success(), "{context}: {next:?}");
        let after = transcript(dir.path());
        if stored_before.is_empty() {
            // Killed before the run's first commit: it never happened, and "next" is the session's
            // first turn (the mock plays its script from the start: call, result, answer).
            assert_eq!(after.len(), 4, "{context}: {after:#?}");
            assert!(after[0].contains("\"text\":\"next\""), "{context}: {after:#?}");
            continue;
        }
        assert_eq!(after, reference, "{context}");
        assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "one\n", "{context}");
        assert!(lines(&dir.path().join("calls.txt")) <= 2, "{context}");
    }
}
