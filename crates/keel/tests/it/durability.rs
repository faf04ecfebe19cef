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
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .arg("run")
        .arg(dir)
        .args(["go", "--json", "--session", "crash"])
        .arg("--store")
        .arg(format!("sqlite:{}", db.display()))
        .current_dir(dir)
        // A short lease, so that the run counts as interrupted soon after the kill.
        .env("KEEL_RUN_LEASE", "1s")
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
    let agent = Agent::from_spec(spec, store.clone()).unwrap();
    let early = agent.resume(run_id.clone()).result().await.unwrap_err();
    assert_eq!(early.code, keel::ErrorCode::RunLeased, "{early:?}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
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
    std::thread::sleep(Duration::from_millis(1100));
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
    assert!(stderr.contains("resuming interrupted run run_"), "{stderr}");
    // The interrupted turn's answer, then the new input's (the mock's script is used up: echo).
    assert_eq!(String::from_utf8(output.stdout).unwrap(), "done: rested\nand now?\n");
    assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "one\n", "append ran twice");
}
