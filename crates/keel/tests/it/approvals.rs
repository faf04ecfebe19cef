//! Approvals and questions end to end: the real binary, a real SQLite file, decisions from
//! other processes, kills at every step around a pause.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::support::{agent_dir, keel_on_store as keel};

/// One model turn calls three tools at once; `pay` and `ship` need approval, `note` does not.
const AGENT: &str = "model: mock
approvals:
  tools: [pay, ship]
  timeout: TIMEOUT
mock:
  script:
    - tool_calls:
        - { name: note, input: { text: hello } }
        - { name: pay, input: { amount: 5 } }
        - { name: ship, input: { to: home } }
    - text: finished
";

/// Records `<tool> <input>` in log.txt once per idempotency key, and every execution in
/// calls.txt.
const RECORD_PY: &str = r#"import json, os, sys
tool = sys.argv[1]
data = json.load(sys.stdin)
key = os.environ["KEEL_IDEMPOTENCY_KEY"]
seen = open("keys.txt").read().split() if os.path.exists("keys.txt") else []
if key not in seen:
    with open("log.txt", "a") as log:
        log.write(tool + " " + json.dumps(data, sort_keys=True) + "\n")
    with open("keys.txt", "a") as keys:
        keys.write(key + "\n")
with open("calls.txt", "a") as calls:
    calls.write(key + "\n")
print(tool + " ok")
"#;

fn tool(name: &str) -> String {
    format!("description = \"{name}\"\ncommand = [\"python3\", \"record.py\", \"{name}\"]\n")
}

fn approvals_agent(timeout: &str) -> tempfile::TempDir {
    let spec = AGENT.replace("TIMEOUT", timeout);
    let (note, pay, ship) = (tool("note"), tool("pay"), tool("ship"));
    agent_dir(&[
        ("agent.yaml", &spec),
        ("record.py", RECORD_PY),
        ("tools/note.toml", &note),
        ("tools/pay.toml", &pay),
        ("tools/ship.toml", &ship),
    ])
}

fn agent(dir: &Path) -> &str {
    dir.to_str().unwrap()
}

fn store_arg(dir: &Path) -> String {
    format!("sqlite:{}", dir.join("keel.db").display())
}

/// `keel run <dir> go --session s --json`.
fn run_go(dir: &Path) -> Command {
    let mut command = keel(dir, &["run"]);
    command.arg(dir).args(["go", "--session", "s", "--json"]);
    command
}

/// The pending inputs, as `keel approvals list --json` prints them.
fn pending(dir: &Path) -> Vec<Value> {
    let output = keel(dir, &["approvals", "list", "--json"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn pending_id(dir: &Path, tool: &str) -> String {
    let pending = pending(dir);
    let found =
        pending.iter().find(|p| p["tool"] == tool).unwrap_or_else(|| panic!("{tool} not in {pending:#?}"));
    found["id"].as_str().unwrap().to_owned()
}

fn events(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap_or_default()
}

/// The session's messages, each as JSON text (`keel sessions show --json`, the shape of
/// `GET /chat/:id`).
fn transcript(dir: &Path) -> Vec<String> {
    let output = keel(dir, &["sessions", "show", "s", "--json"]).output().unwrap();
    let document: Value = serde_json::from_slice(&output.stdout).unwrap_or_default();
    document["messages"].as_array().into_iter().flatten().map(Value::to_string).collect()
}

#[test]
fn parallel_approvals_are_decided_from_other_processes_in_any_order_and_never_asked_twice() {
    let dir = approvals_agent("3d");
    let dir = dir.path();

    // The run calls three tools; `note` runs, the other two wait, and the process exits.
    let first = run_go(dir).output().unwrap();
    assert_eq!(first.status.code(), Some(5), "{first:?}");
    let requested: Vec<Value> =
        events(&first).into_iter().filter(|e| e["type"] == "approval.requested").collect();
    assert_eq!(requested.len(), 2, "{requested:#?}");
    assert_eq!(read(dir, "log.txt"), "note {\"text\": \"hello\"}\n");
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(stderr.contains("keel approvals approve ap_"), "{stderr}");
    let (pay, ship) = (pending_id(dir, "pay"), pending_id(dir, "ship"));
    assert!(requested.iter().any(|e| e["approvalId"] == pay.as_str() && e["input"]["amount"] == 5));
    let pending_now = pending(dir);
    assert_eq!(pending_now.len(), 2);
    assert!(pending_now.iter().all(|p| p["kind"] == "approval" && p["sessionId"] == "s"));

    // A new input to the session is refused while it waits.
    let busy = keel(dir, &["run"]).arg(dir).args(["again", "--session", "s"]).output().unwrap();
    assert_eq!(busy.status.code(), Some(6), "{busy:?}");
    assert!(String::from_utf8_lossy(&busy.stderr).contains("KEEL_SESSION_BUSY"), "{busy:?}");

    // The second approval is decided first, from another process, without the agent.
    let reject = keel(dir, &["approvals", "reject", &ship, "--note", "not today"]).output().unwrap();
    assert!(reject.status.success(), "{reject:?}");
    // A second decision is refused and changes nothing.
    let again = keel(dir, &["approvals", "approve", &ship]).output().unwrap();
    assert_eq!(again.status.code(), Some(3), "{again:?}");
    assert!(String::from_utf8_lossy(&again.stderr).contains("KEEL_NOT_PENDING"), "{again:?}");
    // An answer to an approval does not fit.
    let answer = keel(dir, &["approvals", "answer", &pay, "yes"]).output().unwrap();
    assert!(String::from_utf8_lossy(&answer.stderr).contains("KEEL_DECISION_INVALID"), "{answer:?}");
    assert_eq!(pending(dir).len(), 1);

    // The first is approved by yet another process, which continues the run to its end.
    let approve =
        keel(dir, &["approvals", "approve", &pay, "--json", "--agent", agent(dir)]).output().unwrap();
    assert!(approve.status.success(), "{approve:?}");
    let continued = events(&approve);
    assert!(!continued.iter().any(|e| e["type"] == "approval.requested"), "re-asked: {continued:#?}");
    assert!(continued.iter().any(|e| e["type"] == "tool.done" && e["output"] == "pay ok"), "{continued:#?}");
    let rejected = continued.iter().find(|e| e["type"] == "tool.error").expect("the rejection is shown");
    assert!(rejected["error"].as_str().unwrap().contains("not today"), "{rejected}");
    assert_eq!(continued.last().unwrap()["type"], "run.done", "{continued:#?}");
    assert_eq!(continued.last().unwrap()["text"], "finished");

    assert_eq!(
        read(dir, "log.txt"),
        "note {\"text\": \"hello\"}\npay {\"amount\": 5}\n",
        "ship must not run"
    );
    assert_eq!(read(dir, "calls.txt").lines().count(), 2, "a tool ran twice");
    assert!(pending(dir).is_empty());
    let stored = transcript(dir);
    assert_eq!(stored.len(), 4, "user, assistant (3 calls), tool results, answer: {stored:#?}");
    // Each decision reached its own call: results in call order, the rejection as an error.
    let results: Value = serde_json::from_str(&stored[2]).unwrap();
    let parts = results["content"].as_array().unwrap();
    assert_eq!(parts.len(), 3, "{parts:#?}");
    assert_eq!((parts[0]["name"].as_str(), parts[0]["isError"].as_bool()), (Some("note"), Some(false)));
    assert_eq!((parts[1]["name"].as_str(), parts[1]["output"].as_str()), (Some("pay"), Some("pay ok")));
    assert_eq!((parts[2]["name"].as_str(), parts[2]["isError"].as_bool()), (Some("ship"), Some(true)));
    assert!(parts[2]["output"].as_str().unwrap().contains("the user rejected this call: not today"));

    // Deciding after the end: not pending.
    let late = keel(dir, &["approvals", "approve", &pay]).output().unwrap();
    assert!(String::from_utf8_lossy(&late.stderr).contains("KEEL_NOT_PENDING"), "{late:?}");
    // The conversation goes on.
    let next = keel(dir, &["run"]).arg(dir).args(["thanks", "--session", "s"]).output().unwrap();
    assert!(next.status.success(), "{next:?}");
}

/// A rejection ends its call with no new work: the run that continues still shows it (a
/// `tool.error` in the stream, a ✗ line on the terminal), as docs/protocol.md says.
#[test]
fn a_rejected_call_is_shown_as_failed_by_the_run_that_continues() {
    let dir = approvals_agent("1h");
    let dir = dir.path();
    let first = run_go(dir).output().unwrap();
    assert_eq!(first.status.code(), Some(5), "{first:?}");
    let (pay, ship) = (pending_id(dir, "pay"), pending_id(dir, "ship"));
    // A paused run's stream ends with what it waits for.
    let streamed = events(&first);
    let last = streamed.last().unwrap();
    assert_eq!(last["type"], "run.paused", "{streamed:#?}");
    let waiting: Vec<&str> =
        last["pending"].as_array().unwrap().iter().map(|p| p["id"].as_str().unwrap()).collect();
    assert_eq!(waiting.len(), 2, "{last}");
    assert!(waiting.contains(&pay.as_str()) && waiting.contains(&ship.as_str()), "{last}");
    assert!(last["usage"]["outputTokens"].as_u64().unwrap() > 0, "{last}");
    let decided = keel(dir, &["approvals", "reject", &pay, "--note", "too much"]).output().unwrap();
    assert!(decided.status.success(), "{decided:?}");
    // The other decision continues the run here, on the terminal's renderer.
    let continued = keel(dir, &["approvals", "reject", &ship]).arg("--agent").arg(dir).output().unwrap();
    assert!(continued.status.success(), "{continued:?}");
    let said = String::from_utf8_lossy(&continued.stderr);
    let failed: Vec<&str> = said.lines().filter(|line| line.starts_with("✗ ")).collect();
    assert_eq!(failed.len(), 2, "both rejections shown: {said}");
    assert!(failed.iter().any(|line| line.contains("the user rejected this call: too much")), "{said}");

    // The same through a continuing `keel run --json`.
    let dir2 = approvals_agent("1h");
    let dir2 = dir2.path();
    assert_eq!(run_go(dir2).output().unwrap().status.code(), Some(5));
    for tool in ["pay", "ship"] {
        let id = pending_id(dir2, tool);
        assert!(keel(dir2, &["approvals", "reject", &id]).output().unwrap().status.success());
    }
    let resumed = keel(dir2, &["run"]).arg(dir2).args(["--session", "s", "--json"]).output().unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    let said = String::from_utf8_lossy(&resumed.stderr);
    assert!(!said.contains("nothing to continue"), "a run was continued: {said}");
    let events = events(&resumed);
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let errors: Vec<&Value> = events.iter().filter(|e| e["type"] == "tool.error").collect();
    assert_eq!(errors.len(), 2, "{kinds:?}");
    assert!(errors.iter().all(|e| e["error"].as_str().unwrap().contains("rejected")), "{errors:?}");
    let first_error = kinds.iter().position(|k| *k == "tool.error").unwrap();
    let next_turn = kinds.iter().position(|k| *k == "turn.start").unwrap();
    assert!(first_error < next_turn, "the outcomes come before the next turn: {kinds:?}");
    assert_eq!(kinds.last(), Some(&"run.done"));
}

/// A rejection is shown once: a run re-driven again later (its process died in a later turn)
/// does not show it a second time.
#[test]
fn a_rejection_shown_by_one_process_is_not_shown_again_by_the_next() {
    let spec = "model: mock\napprovals: { tools: [pay] }\nmock:\n  script:\n    - tool_calls: [{ name: pay, input: { amount: 5 } }]\n    - tool_calls: [{ name: note, input: { text: after } }]\n    - text: finished\n";
    let (note, pay) = (tool("note"), tool("pay"));
    let dir = agent_dir(&[
        ("agent.yaml", spec),
        ("record.py", RECORD_PY),
        ("tools/note.toml", &note),
        ("tools/pay.toml", &pay),
    ]);
    let dir = dir.path();
    assert_eq!(run_go(dir).output().unwrap().status.code(), Some(5));
    let pay_id = pending_id(dir, "pay");
    assert!(keel(dir, &["approvals", "reject", &pay_id]).output().unwrap().status.success());
    // This process shows the rejection, runs `note`, and dies right after committing it.
    let crashed = keel(dir, &["run"])
        .arg(dir)
        .args(["--session", "s", "--json"])
        .env("KEEL_FAULT", "after_commit:tool:note:call_1_0")
        .env("KEEL_RUN_LEASE", "200ms")
        .output()
        .unwrap();
    assert!(!crashed.status.success(), "the fault stopped it: {crashed:?}");
    let shown = events(&crashed);
    assert_eq!(shown.iter().filter(|e| e["type"] == "tool.error").count(), 1, "{shown:#?}");
    std::thread::sleep(Duration::from_millis(300));
    let resumed = keel(dir, &["run"]).arg(dir).args(["--session", "s", "--json"]).output().unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    let again = events(&resumed);
    assert!(!again.iter().any(|e| e["type"] == "tool.error"), "the rejection again: {again:#?}");
    assert_eq!(again.last().unwrap()["text"], "finished");
    assert_eq!(read(dir, "log.txt"), "note {\"text\": \"after\"}\n", "note ran once, pay never");
}

#[test]
fn an_approval_nobody_decides_in_time_is_rejected_and_the_run_goes_on() {
    let dir = approvals_agent("1s");
    let dir = dir.path();
    let first = run_go(dir).output().unwrap();
    assert_eq!(first.status.code(), Some(5), "{first:?}");
    let expires =
        pending(dir)[0]["expiresAtMs"].as_u64().unwrap() - pending(dir)[0]["createdAtMs"].as_u64().unwrap();
    assert_eq!(expires, 1000, "approvals.timeout sets the expiry");
    std::thread::sleep(Duration::from_millis(1100));
    // The next process that drives the session times the approvals out and finishes the run.
    let resumed = keel(dir, &["run"]).arg(dir).args(["--session", "s", "--json"]).output().unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    let done = events(&resumed).into_iter().find(|e| e["type"] == "run.done").expect("the run finished");
    assert_eq!(done["text"], "finished");
    assert_eq!(read(dir, "log.txt"), "note {\"text\": \"hello\"}\n", "a timed-out call ran");
    let stored = transcript(dir);
    assert_eq!(stored.iter().filter(|m| m.contains("approval timed out")).count(), 1, "{stored:#?}");
    assert!(pending(dir).is_empty());
}

const QUESTION_AGENT: &str = "model: mock
tools: [ask_question]
mock:
  script:
    - tool_calls: [{ name: ask_question, input: { question: Which city? } }]
    - text: 'Booked for {{last_tool_output}}'
";

#[test]
fn a_question_pauses_the_run_until_someone_answers() {
    let dir = agent_dir(&[("agent.yaml", QUESTION_AGENT)]);
    let dir = dir.path();
    let first = run_go(dir).output().unwrap();
    assert_eq!(first.status.code(), Some(5), "{first:?}");
    let asked = events(&first).into_iter().find(|e| e["type"] == "question.asked").expect("asked");
    assert_eq!(asked["question"], "Which city?");
    let id = asked["questionId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("qu_"));
    let listed = pending(dir);
    assert_eq!(
        (listed[0]["kind"].as_str(), listed[0]["question"].as_str()),
        (Some("question"), Some("Which city?"))
    );

    let approve = keel(dir, &["approvals", "approve", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&approve.stderr).contains("KEEL_DECISION_INVALID"), "{approve:?}");
    let answer = keel(dir, &["approvals", "answer", &id, "Lisbon", "--agent", agent(dir)]).output().unwrap();
    assert!(answer.status.success(), "{answer:?}");
    assert_eq!(String::from_utf8_lossy(&answer.stdout), "Booked for Lisbon\n");
}

#[test]
fn on_a_terminal_keel_run_asks_the_human_directly() {
    let dir = approvals_agent("3d");
    let dir = dir.path();
    let command = format!(
        "{} run {} go --session s --store {}",
        crate::support::keel_binary().display(),
        dir.display(),
        store_arg(dir)
    );
    // `script` gives the command a pseudo-terminal; the answers are typed on it: approve `pay`,
    // refuse `ship` with a reason.
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .current_dir(dir)
        .env("KEEL_LOG", "error")
        .env_remove("KEEL_STORE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("`script` (util-linux) runs commands on a pseudo-terminal");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"y\nwrong address\n").unwrap();
        // Keep stdin open until the command ends: EOF on a terminal would read as "no answer".
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(20));
            drop(stdin);
        });
    }
    let output = child.wait_with_output().unwrap();
    let screen = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{screen}");
    assert!(screen.contains("Allow pay {\"amount\":5}?"), "{screen}");
    assert!(screen.contains("finished"), "{screen}");
    assert_eq!(read(dir, "log.txt"), "note {\"text\": \"hello\"}\npay {\"amount\": 5}\n");
    let stored = transcript(dir);
    assert!(stored.iter().any(|m| m.contains("the user rejected this call: wrong address")), "{stored:#?}");
}

/// Runs the approval flow (run, approve `pay`, reject `ship`) with `fault` injected into every
/// command until one crashes; then recovers with commands that have no fault.
fn flow_with_fault(fault: &str) -> (tempfile::TempDir, bool) {
    let dir = approvals_agent("3d");
    let path = dir.path();
    let with_fault = |mut command: Command| {
        command
            .env("KEEL_FAULT", fault)
            .env("KEEL_RUN_LEASE", "200ms")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        command.status().unwrap()
    };
    let mut crashed = false;
    let status = with_fault(run_go(path));
    if status.code().is_none() {
        crashed = true;
    }
    // Decide what is pending (each decision continues the run here), until nothing is.
    for _ in 0..6 {
        if crashed {
            // Wait out the dead process's lease, then let the next process re-drive the run.
            std::thread::sleep(Duration::from_millis(250));
            let resumed = keel(path, &["run"]).arg(path).args(["--session", "s"]).output().unwrap();
            assert!(matches!(resumed.status.code(), Some(0 | 5)), "{fault}: {resumed:?}");
        }
        let Some(next) = pending(path).into_iter().next() else { break };
        let verb = if next["tool"] == "pay" { "approve" } else { "reject" };
        let mut decide =
            keel(path, &["approvals", verb, next["id"].as_str().unwrap(), "--agent", agent(path)]);
        if crashed {
            let output = decide.output().unwrap();
            assert!(matches!(output.status.code(), Some(0 | 5)), "{fault}: {output:?}");
        } else if with_fault(decide).code().is_none() {
            crashed = true;
        }
    }
    if crashed {
        std::thread::sleep(Duration::from_millis(250));
        let resumed = keel(path, &["run"]).arg(path).args(["--session", "s"]).output().unwrap();
        assert!(resumed.status.success(), "{fault}: {resumed:?}");
    }
    (dir, crashed)
}

#[test]
fn a_crash_at_every_step_around_a_pause_is_recovered_without_repeating_work() {
    let (reference, _) = flow_with_fault("none");
    let expected = transcript(reference.path());
    assert_eq!(expected.len(), 4, "{expected:#?}");
    let log = read(reference.path(), "log.txt");
    assert_eq!(log, "note {\"text\": \"hello\"}\npay {\"amount\": 5}\n");
    for point in ["before_commit", "after_commit"] {
        for step in
            ["llm:turn:0", "tool:note:call_0_0", "approval:call_0_1", "tool:pay:call_0_1", "llm:turn:1"]
        {
            let fault = format!("{point}:{step}");
            let (dir, crashed) = flow_with_fault(&fault);
            assert!(crashed, "{fault}: the fault did not fire");
            assert_eq!(
                transcript(dir.path()),
                expected,
                "{fault}: the transcript differs from a run never killed"
            );
            assert_eq!(read(dir.path(), "log.txt"), log, "{fault}");
            assert!(pending(dir.path()).is_empty(), "{fault}");
            // A tool that finished but was not committed runs again (its idempotency key stops
            // the repeat); every other runs once.
            let expected_calls = if point == "before_commit" && step.starts_with("tool:") { 3 } else { 2 };
            assert_eq!(read(dir.path(), "calls.txt").lines().count(), expected_calls, "{fault}");
        }
    }
}

/// `--session` decides what a session waits for without its id, when that is one input; with
/// none or several it says so and decides nothing.
#[test]
fn a_session_s_one_approval_is_decided_by_naming_the_session() {
    let dir = approvals_agent("3d");
    let dir = dir.path();
    assert_eq!(run_go(dir).output().unwrap().status.code(), Some(5));
    // Two approvals wait (`pay`, `ship`): naming the session is ambiguous.
    let both = keel(dir, &["approvals", "approve", "--session", "s"]).output().unwrap();
    assert_eq!(both.status.code(), Some(2), "{both:?}");
    let said = String::from_utf8_lossy(&both.stderr);
    let (pay, ship) = (pending_id(dir, "pay"), pending_id(dir, "ship"));
    assert!(said.contains("waits for 2 approvals") && said.contains(&pay) && said.contains(&ship), "{said}");
    assert_eq!(pending(dir).len(), 2, "nothing was decided");
    // Once one is decided by its id, the session names the other.
    keel(dir, &["approvals", "reject", &pay]).output().unwrap();
    let one = keel(dir, &["approvals", "approve", "--session", "s"]).output().unwrap();
    assert!(one.status.success(), "{one:?}");
    assert!(String::from_utf8_lossy(&one.stderr).contains(&format!("approved {ship}")), "{one:?}");
    // Now nothing waits; nor was a question ever asked.
    let approve: &[&str] = &["approvals", "approve", "--session", "s"];
    let answer: &[&str] = &["approvals", "answer", "--session", "s", "Paris"];
    for args in [approve, answer] {
        let none = keel(dir, args).output().unwrap();
        assert_eq!(none.status.code(), Some(3), "{none:?}");
        let said = String::from_utf8_lossy(&none.stderr);
        assert!(said.contains("error[KEEL_NOT_PENDING]: session s waits for no"), "{said}");
    }
}
