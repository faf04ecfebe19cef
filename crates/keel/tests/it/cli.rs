//! The `keel` binary, driven as a user would.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use predicates::prelude::*;
use serde_json::{Value, json};

use crate::support::{agent_dir, keel, repo_root, weekdays_now};

#[test]
fn the_quick_start_example_answers_with_today() {
    let output = keel()
        .current_dir(repo_root())
        .args(["run", "examples/assistant", "What day is it?"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let expected: Vec<String> = weekdays_now().iter().map(|d| format!("Today is {d}.\n")).collect();
    assert!(expected.contains(&stdout), "stdout {stdout:?}, expected one of {expected:?}");
    // Tool calls are shown on stderr, one compact line each; no spinner when piped.
    let stderr = String::from_utf8(output.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr:?}");
    assert_eq!(lines[0], "→ day_name {}");
    assert!(lines[1].starts_with("✓ day_name "), "{stderr:?}");
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "terminal control codes when piped: {stderr:?}"
    );
}

#[test]
fn json_prints_every_event_as_a_json_line() {
    let output = keel()
        .current_dir(repo_root())
        .args(["run", "examples/assistant", "What day is it?", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let events: Vec<Value> =
        String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "run.start",
            "turn.start",
            "usage",
            "tool.start",
            "tool.done",
            "turn.start",
            "text.delta",
            "text.delta",
            "text.delta",
            "usage",
            "run.done"
        ]
    );
    assert_eq!(events[0]["sessionId"], "default");
    assert!(events[0]["runId"].as_str().unwrap().starts_with("run_"));
    assert_eq!(events[3]["name"], "day_name");
    let done = events.last().unwrap();
    assert_eq!(done["stopped"], "final");
    let text = done["text"].as_str().unwrap();
    assert!(weekdays_now().iter().any(|d| text == format!("Today is {d}.")), "{text}");
    assert!(done["usage"]["inputTokens"].as_u64().unwrap() > 0);
    assert!(
        output.stderr.is_empty(),
        "--json keeps stderr quiet: {:?}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Naming a session means wanting it back: `--session` without `--store` keeps it in the
/// store `keel sessions` reads. Without `--session`, a turn is a one-off.
#[test]
fn a_named_session_is_kept_in_the_default_store_and_an_unnamed_turn_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let assistant = repo_root().join("examples/assistant");
    let run = |args: &[&str]| {
        keel().current_dir(dir.path()).arg("run").arg(&assistant).args(args).output().unwrap()
    };
    // Commands that only look at the store find nothing, and create no database to say so.
    let look = |args: &[&str]| keel().current_dir(dir.path()).args(args).output().unwrap();
    for args in [&["sessions", "list"][..], &["approvals", "list"], &["memory", "list"]] {
        let out = look(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
    }
    let out = look(&["sessions", "show", "mine"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("KEEL_SESSION_NOT_FOUND"), "{out:?}");
    let out = look(&["cancel", "mine"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no unfinished run"), "{out:?}");
    assert!(!dir.path().join(".keel").exists(), "looking created the default store");
    let out = run(&["a one-off"]);
    assert!(out.status.success(), "{out:?}");
    assert!(!dir.path().join(".keel").exists(), "a turn without --session keeps nothing");
    let out = run(&["remember me", "--session", "mine"]);
    assert!(out.status.success(), "{out:?}");
    let list = keel().current_dir(dir.path()).args(["sessions", "list"]).output().unwrap();
    let listed = String::from_utf8_lossy(&list.stdout);
    assert!(listed.lines().any(|line| line.starts_with("mine ")), "{listed}");
    // The next turn sees the first.
    let out = run(&["and again", "--session", "mine", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let show = keel().current_dir(dir.path()).args(["sessions", "show", "mine"]).output().unwrap();
    let shown = String::from_utf8_lossy(&show.stdout);
    assert!(shown.contains("remember me") && shown.contains("and again"), "{shown}");
    // An explicit store still wins.
    let out = run(&["elsewhere", "--session", "other", "--store", "memory"]);
    assert!(out.status.success(), "{out:?}");
    let list = keel().current_dir(dir.path()).args(["sessions", "list"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&list.stdout).contains("other"), "{list:?}");
}

/// `echo "..." | keel run agent` and `keel run agent -` take the input from stdin.
#[test]
fn the_input_comes_from_stdin_when_piped_or_given_as_a_dash() {
    let assistant = repo_root().join("examples/assistant");
    let days = weekdays_now();
    for args in [vec![], vec!["-"]] {
        let out =
            keel().arg("run").arg(&assistant).args(&args).write_stdin("What day is it?\n").output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(days.iter().any(|day| said.trim() == format!("Today is {day}.")), "{args:?}: {said}");
    }
    // The input reaches the model as typed, less the line end (a mock without a script
    // echoes it).
    let dir = agent_dir(&[("agent.yaml", "model: mock\n")]);
    let echo = keel().arg("run").arg(dir.path()).write_stdin("line one\nline two\n").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&echo.stdout).trim_end(), "line one\nline two", "{echo:?}");
    // `-` with nothing on stdin is a usage error, not a turn about nothing.
    let out = keel().arg("run").arg(&assistant).arg("-").write_stdin("").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("stdin was empty"), "{out:?}");
    // No input at all only continues the session, and says so when there was nothing to
    // continue (the question forgotten), rather than ending without a word.
    let store = tempfile::tempdir().unwrap();
    let out = keel()
        .arg("run")
        .arg(&assistant)
        .arg("--store")
        .arg(format!("sqlite:{}", store.path().join("keel.db").display()))
        .write_stdin("")
        .output()
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("nothing to continue in session default: give an input"), "{said}");
}

/// `keel init`: every template makes an agent `keel check` accepts, the offline ones answer at
/// once, and a directory in use is refused unless --force (which names what it replaces).
#[test]
fn keel_init_makes_agents_that_run_offline_and_never_overwrites_silently() {
    let dir = tempfile::tempdir().unwrap();
    let answers = [
        ("assistant", "What day is it?", "Today is "),
        ("tools", "How many words?", "That text has 4 words."),
        ("serve", "Hello!", "It is "),
    ];
    for template in ["assistant", "tools", "approvals", "mcp", "serve"] {
        let target = dir.path().join(format!("my-{template}"));
        let out = keel().arg("init").arg(&target).args(["--template", template]).output().unwrap();
        assert!(out.status.success(), "{template}: {out:?}");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.starts_with(&format!("created the agent `my-{template}`")), "{said}");
        assert!(said.contains(&format!("keel check {}", target.display())), "the next commands: {said}");
        let check = keel().arg("check").arg(&target).arg("--offline").output().unwrap();
        assert!(check.status.success(), "{template}: {check:?}");
        assert_eq!(check.stderr, b"", "{template}: no warning in a fresh agent: {check:?}");
        let text = std::fs::read_to_string(target.join("agent.yaml")).unwrap();
        assert!(text.starts_with("# ") && text.contains("model: mock"), "commented, offline: {text}");
    }
    for (template, question, answer) in answers {
        let out = keel()
            .current_dir(dir.path())
            .arg("run")
            .arg(format!("my-{template}"))
            .arg(question)
            .output()
            .unwrap();
        assert!(out.status.success(), "{template}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with(answer), "{template}: {out:?}");
    }
    // The approvals template pauses for its tool, and runs it once approved.
    let approvals = dir.path().join("my-approvals");
    let paused = keel()
        .current_dir(dir.path())
        .arg("run")
        .arg(&approvals)
        .args(["send it", "--session", "demo"])
        .output()
        .unwrap();
    assert_eq!(paused.status.code(), Some(5), "{paused:?}");
    let list = keel().current_dir(dir.path()).args(["approvals", "list", "--json"]).output().unwrap();
    let pending: Value =
        serde_json::from_str(String::from_utf8_lossy(&list.stdout).lines().next().unwrap()).unwrap();
    let approve = keel()
        .current_dir(dir.path())
        .args(["approvals", "approve", pending["id"].as_str().unwrap(), "--agent"])
        .arg(&approvals)
        .output()
        .unwrap();
    assert!(approve.status.success(), "{approve:?}");
    assert_eq!(
        std::fs::read_to_string(approvals.join("outbox.txt")).unwrap(),
        "to team: The build is green.\n"
    );

    // A directory in use: refused, nothing written.
    let used = dir.path().join("used");
    std::fs::create_dir(&used).unwrap();
    std::fs::write(used.join("agent.yaml"), "mine\n").unwrap();
    let out = keel().arg("init").arg(&used).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not empty"), "{out:?}");
    assert_eq!(std::fs::read_to_string(used.join("agent.yaml")).unwrap(), "mine\n");
    let out = keel().arg("init").arg(&used).arg("--force").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("replacing {}", used.join("agent.yaml").display())),
        "{out:?}"
    );
    assert!(std::fs::read_to_string(used.join("agent.yaml")).unwrap().contains("model: mock"));

    // Where nothing can be written, the error names the place.
    let blocked = dir.path().join("a-file").join("agent");
    std::fs::write(dir.path().join("a-file"), "").unwrap();
    let out = keel().arg("init").arg(&blocked).output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.starts_with(&format!("error: cannot create {}: ", blocked.display())), "{said}");
}

#[test]
fn a_spec_file_in_toml_runs_too() {
    let dir = agent_dir(&[("echo.toml", "model = \"mock\"\ninstructions = \"Echo.\"\n")]);
    keel()
        .args(["run"])
        .arg(dir.path().join("echo.toml"))
        .arg("echo me")
        .assert()
        .success()
        .stdout("echo me\n");
}

#[test]
fn model_can_be_overridden() {
    let dir = agent_dir(&[("agent.yaml", "model: openai/gpt-4o-mini\n")]);
    // The spec names a provider with no key here; --model mock runs it offline.
    keel().env_remove("OPENAI_API_KEY").arg("run").arg(dir.path()).arg("hello").assert().code(1).stderr(
        predicate::str::contains("KEEL_PROVIDER_KEY_MISSING").and(predicate::str::contains("--model mock")),
    );
    keel()
        .arg("run")
        .arg(dir.path())
        .arg("hello")
        .args(["--model", "mock"])
        .assert()
        .success()
        .stdout("hello\n");
    keel()
        .arg("run")
        .arg(dir.path())
        .arg("hello")
        .args(["--model", "nope/x"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("unknown provider `nope`"));
}

#[test]
fn check_prints_every_problem_with_its_place() {
    let dir = agent_dir(&[
        ("bad/agent.yaml", "modle: mock\ntools: [day-nam]\nlimits: { max_turns: many }\n"),
        ("bad/tools/lookup.toml", "description = \"Looks up\"\n[input_schema]\ntype = \"objekt\"\n"),
    ]);
    let assert = keel().current_dir(dir.path()).args(["check", "bad"]).assert().code(1);
    let stderr = String::from_utf8(assert.get_output().stderr.clone()).unwrap();
    // The typo is the one error about the model: no "missing `model`" besides it.
    assert!(!stderr.contains("missing `model`"), "{stderr}");
    for expected in [
        "error[KEEL_SPEC_INVALID]: unknown key `modle`\n  --> bad/agent.yaml:1:1\n  hint: did you mean `model`?",
        "error[KEEL_SPEC_INVALID]: unknown tool `day-nam`\n  --> bad/agent.yaml:2:9\n  hint: did you mean `day_name`?",
        "error[KEEL_SPEC_INVALID]: `limits.max_turns` must be an integer, not a string\n  --> bad/agent.yaml:3:22",
        "`input_schema` is not a valid JSON Schema: at `type`: \"objekt\" is not a type: write one of array,",
        "(or a list of them)\n  --> bad/tools/lookup.toml:3:8",
        "error[KEEL_SPEC_INVALID]: missing `command`\n  --> bad/tools/lookup.toml:1:1",
        "errors found in bad",
    ] {
        assert!(stderr.contains(expected), "missing {expected:?} in:\n{stderr}");
    }
    assert!(!stderr.contains("panicked"));
    // A file nested tens of thousands of levels deep overflowed the loader's stack and
    // aborted keel (exit 134): it is one more error at its place.
    let deep = format!("model: mock\nlimits:\n  x:\n  {}1\n", "- ".repeat(50_000));
    std::fs::create_dir_all(dir.path().join("deep")).unwrap();
    std::fs::write(dir.path().join("deep/agent.yaml"), deep).unwrap();
    keel().current_dir(dir.path()).args(["check", "deep"]).assert().code(1).stderr(predicate::str::contains(
        "error[KEEL_SPEC_SYNTAX]: lists and mappings nest more than 128 levels deep here\n  --> deep/agent.yaml:4:",
    ));
    // `run` refuses the same agent, with the same diagnostics.
    keel()
        .current_dir(dir.path())
        .args(["run", "bad", "hi"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("unknown key `modle`"));
    // A good agent checks clean.
    keel()
        .current_dir(repo_root())
        .args(["check", "examples/assistant"])
        .assert()
        .success()
        .stdout(predicate::str::starts_with("ok: agent `assistant`"));
}

/// `keel check --json`: one document a program can read, the same problems as the text.
#[test]
fn check_json_reports_the_agent_or_every_problem_as_one_document() {
    let good = keel().args(["check", "--json"]).arg(repo_root().join("examples/helpdesk")).output().unwrap();
    assert!(good.status.success(), "{good:?}");
    let report: Value = serde_json::from_slice(&good.stdout).unwrap();
    assert_eq!(report["ok"], true);
    assert_eq!(report["agent"]["name"], "helpdesk");
    assert_eq!(
        report["agent"]["tools"],
        json!(["search_memory", "read_memory", "search_billing", "read_billing"])
    );
    assert_eq!(report["documents"][0]["documents"], 2, "{report:#}");
    assert_eq!(good.stderr, b"", "nothing else is printed");

    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\nmodle: typo\nmemory: { kind: semantic }\nmock: { script: [ { tool_calls: [ { name: weather } ] } ] }\n",
    )]);
    let bad = keel().args(["check", "--json"]).arg(dir.path()).output().unwrap();
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");
    let report: Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(report["ok"], false);
    let diagnostics = report["diagnostics"].as_array().unwrap();
    let typo = diagnostics.iter().find(|d| d["message"] == "unknown key `modle`").expect("the typo");
    assert_eq!(typo["severity"], "error");
    assert_eq!(typo["code"], "KEEL_SPEC_INVALID");
    assert_eq!((typo["line"].as_u64(), typo["column"].as_u64()), (Some(2), Some(1)));
    assert_eq!(typo["hint"], "did you mean `model`?");
    assert!(typo["file"].as_str().unwrap().ends_with("agent.yaml"), "{typo}");
    // The text output says the same; a warning carries no error code.
    let text = keel().arg("check").arg(dir.path()).output().unwrap();
    let said = String::from_utf8_lossy(&text.stderr);
    assert!(said.contains("error[KEEL_SPEC_INVALID]: unknown key `modle`"), "{said}");
    let warnings: Vec<&str> = said.lines().filter(|line| line.starts_with("warning")).collect();
    assert_eq!(
        warnings,
        [
            "warning: the mock script calls `weather`, which the agent does not have (the model will get an error result)"
        ],
        "{said}"
    );
    let warning = diagnostics.iter().find(|d| d["severity"] == "warning").expect("the warning");
    assert!(warning.get("code").is_none(), "{warning}");
}

#[test]
fn a_missing_instructions_file_is_an_error() {
    let dir = agent_dir(&[("a.yaml", "model: mock\ninstructions: { file: missing.md }\n")]);
    keel().current_dir(dir.path()).args(["check", "a.yaml"]).assert().code(1).stderr(
        predicate::str::contains("cannot read the instructions file missing.md")
            .and(predicate::str::contains("--> a.yaml:2:23")),
    );
}

#[test]
fn a_provider_error_fails_the_run_with_its_code() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\nretry: { max_attempts: 2, initial_backoff: 10ms }\nmock:\n  script:\n    - error: { status: 500, message: upstream failed }\n",
    )]);
    keel().arg("run").arg(dir.path()).arg("hi").assert().code(3).stderr(predicate::str::contains(
        "error[KEEL_PROVIDER_ERROR]: the model call failed: upstream failed (after 2 attempts)",
    ));
    let output = keel().arg("run").arg(dir.path()).arg("hi").arg("--json").output().unwrap();
    assert_eq!(output.status.code(), Some(3));
    let last: Value =
        serde_json::from_str(String::from_utf8(output.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "run.error");
    assert_eq!(last["code"], "KEEL_PROVIDER_ERROR");
}

const TOOLS_AGENT: &str = "model: mock
limits: { max_turns: 4 }
mock:
  script:
    - tool_calls:
        - { name: append, input: { line: first } }
        - { name: fail, input: {} }
        - { name: nap, input: {} }
        - { name: append, input: { line: 12 } }
    - text: 'done: {{last_tool_output}}'
";

#[test]
fn command_tools_run_with_json_on_stdin_and_errors_go_back_to_the_model() {
    let dir = agent_dir(&[
        ("agent.yaml", TOOLS_AGENT),
        (
            "tools/append.toml",
            "description = \"Appends a line to log.txt\"\ncommand = [\"python3\", \"-c\", \"import json,sys; d=json.load(sys.stdin); open('log.txt','a').write(d['line']+'\\\\n'); print(json.dumps({'ok': True, 'line': d['line']}))\"]\n[input_schema]\ntype = \"object\"\nrequired = [\"line\"]\nproperties = { line = { type = \"string\" } }\n",
        ),
        (
            "tools/fail.toml",
            "description = \"Always fails\"\ncommand = [\"sh\", \"-c\", \"echo 'no such invoice' >&2; exit 7\"]\n",
        ),
        (
            "tools/nap.toml",
            "description = \"Sleeps too long\"\ncommand = [\"sleep\", \"30\"]\ntimeout = \"300ms\"\n",
        ),
    ]);
    let output = keel().arg("run").arg(dir.path()).arg("go").arg("--json").output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let events: Vec<Value> =
        String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let outcomes: Vec<String> = events
        .iter()
        .filter(|e| e["type"] == "tool.done" || e["type"] == "tool.error")
        .map(|e| {
            format!(
                "{} {}",
                e["callId"],
                if e["type"] == "tool.done" { e["output"].to_string() } else { e["error"].to_string() }
            )
        })
        .collect();
    let mut sorted = outcomes.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            r#""call_0_0" {"line":"first","ok":true}"#,
            r#""call_0_1" "command tool `fail` exited with status 7: no such invoice""#,
            r#""call_0_2" "command tool `nap` did not finish within 300ms (its `timeout`) and was killed""#,
            r#""call_0_3" "invalid input for `append`: /line: 12 is not of type \"string\"""#,
        ]
    );
    // The run went on after the failures, and the one valid call ran exactly once.
    let done = events.last().unwrap();
    assert_eq!(done["stopped"], "final");
    assert_eq!(std::fs::read_to_string(dir.path().join("log.txt")).unwrap(), "first\n");
}

#[test]
fn max_turns_stops_with_exit_code_4() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\ntools: [day_name]\nlimits: { max_turns: 1 }\nmock: { script: [ { tool_calls: [ { name: day_name } ] } ] }\n",
    )]);
    keel()
        .arg("run")
        .arg(dir.path())
        .arg("hi")
        .assert()
        .code(4)
        .stderr(predicate::str::contains("stopped: the run used all its turns"));
}

#[test]
fn usage_errors_exit_2_and_help_and_version_work() {
    keel().arg("run").assert().code(2).stderr(predicate::str::contains("Usage: keel run"));
    keel().args(["run", "x", "y", "--session", "not valid!"]).assert().code(1);
    keel().arg("--version").assert().success().stdout(predicate::str::starts_with("keel "));
    keel().args(["check", "--help"]).assert().success().stdout(predicate::str::contains("Exit codes"));
}

#[test]
fn an_invalid_session_id_is_refused() {
    keel()
        .current_dir(repo_root())
        .args(["run", "examples/assistant", "hi", "--session", "no spaces"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("KEEL_SESSION_ID_INVALID"));
}

#[test]
fn ctrl_c_cancels_the_run_and_kills_the_tool() {
    let dir = agent_dir(&[
        ("agent.yaml", "model: mock\nmock: { script: [ { tool_calls: [ { name: nap } ] } ] }\n"),
        (
            "tools/nap.toml",
            "description = \"Sleeps\"\ncommand = [\"sh\", \"-c\", \"sleep 60 & echo $! > nap.pid; wait\"]\n",
        ),
    ]);
    let mut child = std::process::Command::new(crate::support::keel_binary())
        .arg("run")
        .arg(dir.path())
        .arg("go")
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert_eq!(line, "→ nap {}\n");
    let pid_file = dir.path().join("nap.pid");
    for _ in 0..200 {
        if std::fs::read_to_string(&pid_file).is_ok_and(|s| !s.trim().is_empty()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let grandchild: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT)
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert!(rest.contains("✗ nap failed: cancelled"), "{rest}");
    assert!(rest.contains("stopped: cancelled"), "{rest}");
    let alive = || nix::sys::signal::kill(nix::unistd::Pid::from_raw(grandchild), None).is_ok();
    for _ in 0..100 {
        if !alive() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the tool's process {grandchild} outlived the cancelled run");
}

#[test]
fn a_spinner_shows_on_a_terminal_while_the_model_thinks() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\nmock: { script: [ { delay_ms: 600, text: 'Done thinking.' } ] }\n",
    )]);
    let keel = crate::support::keel_binary();
    // `script` runs the command under a pseudo-terminal, as a person's shell would.
    let command = format!("{} run {} hello", keel.display(), dir.path().display());
    let output = std::process::Command::new("script").args(["-qec", &command, "/dev/null"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let screen = String::from_utf8_lossy(&output.stdout);
    assert!(screen.contains("thinking"), "no spinner on a terminal: {screen:?}");
    assert!(screen.contains("Done thinking."), "{screen:?}");
}

#[test]
fn a_skill_brings_its_tools_and_budgets_stop_the_run() {
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock\nlimits: { max_tool_calls: 2 }\nmock:\n  script:\n    - tool_calls: [{ name: lookup, input: { id: 7 } }]\n    - tool_calls: [{ name: lookup, input: { id: 8 } }, { name: lookup, input: { id: 9 } }]\n    - text: never reached\n",
        ),
        (
            "skills/billing/SKILL.md",
            "---\nname: billing\ndescription: Invoices.\n---\nQuote invoice numbers.\n",
        ),
        (
            "skills/billing/tools/lookup.toml",
            "description = \"Looks up an invoice\"\ncommand = [\"sh\", \"-c\", \"cat; echo\"]\n[input_schema]\ntype = \"object\"\nrequired = [\"id\"]\n",
        ),
    ]);
    keel().arg("check").arg(dir.path()).assert().success().stdout(predicate::str::contains("tools: lookup"));
    let output = keel().arg("run").arg(dir.path()).arg("invoice?").arg("--json").output().unwrap();
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    let events: Vec<Value> =
        String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut results: Vec<String> = events
        .iter()
        .filter(|e| e["type"] == "tool.done" || e["type"] == "tool.error")
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    // Two calls fit the budget; the third is refused (at once, so its event may come first),
    // and the run stops after the turn.
    results.sort();
    assert_eq!(results, ["tool.done", "tool.done", "tool.error"]);
    assert_eq!(events[4]["output"], serde_json::json!({"id": 7}), "the skill's tool got its input on stdin");
    assert_eq!(events.last().unwrap()["stopped"], "budget");
}

#[test]
fn structured_output_comes_out_in_run_done() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\noutput:\n  schema: { type: object, properties: { answer: { type: string } }, required: [answer] }\nmock: { script: [ { text: '{\"answer\": \"5\"}' } ] }\n",
    )]);
    let output = keel().arg("run").arg(dir.path()).arg("2+3").arg("--json").output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let last: Value =
        serde_json::from_str(String::from_utf8(output.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(last["output"], serde_json::json!({"answer": "5"}));
}

#[test]
fn a_sqlite_store_continues_a_conversation_across_processes() {
    let dir = agent_dir(&[]);
    let store = format!("sqlite:{}", dir.path().join("data/keel.db").display());
    let run = |input: &str| {
        keel()
            .current_dir(repo_root())
            .args(["run", "examples/assistant", input, "--session", "chat-1", "--store", &store])
            .output()
            .unwrap()
    };
    let first = run("What day is it?");
    assert!(first.status.success(), "{first:?}");
    // The second process sees the first's history: the mock's script (two model calls) is used
    // up, so it echoes.
    let second = run("thanks!");
    assert!(second.status.success(), "{second:?}");
    assert_eq!(String::from_utf8(second.stdout).unwrap(), "thanks!\n");

    let list = keel().args(["sessions", "list", "--store", &store]).output().unwrap();
    let listing = String::from_utf8(list.stdout).unwrap();
    let row = listing.lines().find(|l| l.starts_with("chat-1")).unwrap_or_else(|| panic!("{listing}"));
    let columns: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&columns[..3], ["chat-1", "6", "2"], "{listing}");

    let show = keel().args(["sessions", "show", "chat-1", "--store", &store]).output().unwrap();
    let transcript = String::from_utf8(show.stdout).unwrap();
    let lines: Vec<&str> = transcript.lines().collect();
    assert_eq!(lines[0], "user: What day is it?");
    assert!(lines[1].starts_with("assistant: → day_name {}"), "{transcript}");
    assert_eq!(lines[4], "user: thanks!");
    assert!(lines[6].starts_with("usage: ") && lines[6].ends_with(" output tokens"), "{transcript}");
    assert_eq!(lines.len(), 7, "{transcript}");
    // The shape of `GET /chat/:id`, camelCase.
    let json = keel().args(["sessions", "show", "chat-1", "--json", "--store", &store]).output().unwrap();
    let document: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(document["sessionId"], "chat-1");
    let messages = document["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 6, "{document:#}");
    assert_eq!(
        messages[0],
        json!({"role": "user", "content": [{"type": "text", "text": "What day is it?"}]})
    );
    assert_eq!(messages[1]["content"][0]["type"], "toolCall");
    assert_eq!(messages[2]["content"][0]["callId"], messages[1]["content"][0]["callId"]);
    assert!(document["usage"]["inputTokens"].as_u64().unwrap() > 0, "{document:#}");
    assert_eq!(document["pending"], json!([]));
    let list = keel().args(["sessions", "list", "--json", "--store", &store]).output().unwrap();
    let listed: Vec<Value> =
        String::from_utf8(list.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0]["sessionId"].as_str(), listed[0]["messages"].as_u64()), (Some("chat-1"), Some(6)));
    assert!(
        listed[0]["updatedAtMs"].as_u64().is_some() && listed[0]["runs"].as_u64() == Some(2),
        "{listed:?}"
    );

    keel().args(["sessions", "rm", "chat-1", "--store", &store]).assert().success();
    keel()
        .args(["sessions", "rm", "chat-1", "--store", &store])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("KEEL_SESSION_NOT_FOUND"));
    keel()
        .args(["sessions", "show", "chat-1", "--store", &store])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("KEEL_SESSION_NOT_FOUND"));
}

#[test]
fn bad_database_files_get_coded_errors_and_are_left_alone() {
    let dir = agent_dir(&[("not-a-db.db", &"garbage ".repeat(1000))]);
    let garbage = dir.path().join("not-a-db.db");
    keel()
        .current_dir(repo_root())
        .args(["run", "examples/assistant", "hi", "--store"])
        .arg(format!("sqlite:{}", garbage.display()))
        .assert()
        .code(1)
        .stderr(predicate::str::contains("error[KEEL_STORE_CORRUPT]"));
    assert_eq!(std::fs::read_to_string(&garbage).unwrap(), "garbage ".repeat(1000), "the file was changed");

    // A database written by a newer keel (schema version 999): refused, not touched.
    let newer = dir.path().join("newer.db");
    let status = std::process::Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('PRAGMA user_version=999'); c.commit()"])
        .arg(&newer)
        .status()
        .unwrap();
    assert!(status.success());
    keel()
        .args(["sessions", "list", "--store"])
        .arg(format!("sqlite:{}", newer.display()))
        .assert()
        .code(1)
        .stderr(
            predicate::str::contains("error[KEEL_STORE_SCHEMA_NEWER]")
                .and(predicate::str::contains("upgrade keel")),
        );
    keel()
        .args(["sessions", "list", "--store", "mysql://x"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("unknown store"));
    // A PostgreSQL server that is not there: named, without the password, with what to check.
    keel()
        .args(["sessions", "list", "--store", "postgres://keel:pa55word@keel-no-such-host.invalid/keel"])
        .assert()
        .code(1)
        .stderr(
            predicate::str::contains("error[KEEL_STORE]")
                .and(predicate::str::contains(
                    "cannot connect to postgres://keel@keel-no-such-host.invalid:5432/keel",
                ))
                .and(predicate::str::contains("pa55word").not()),
        );
}

#[test]
fn prune_removes_sessions_unused_for_longer_than_the_time_to_live() {
    let dir = agent_dir(&[("echo.yaml", "model: mock\n")]);
    let db = dir.path().join("keel.db");
    let store = format!("sqlite:{}", db.display());
    for session in ["old", "fresh"] {
        keel()
            .arg("run")
            .arg(dir.path().join("echo.yaml"))
            .args(["hi", "--session", session, "--store", &store])
            .assert()
            .success();
    }
    // Age one session by a year.
    let status = std::process::Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute(\"UPDATE sessions SET updated_at = updated_at - 31536000000 WHERE id = 'old'\"); c.commit()"])
        .arg(&db)
        .status()
        .unwrap();
    assert!(status.success());
    keel()
        .args(["sessions", "prune", "--older-than", "30d", "--dry-run", "--store", &store])
        .assert()
        .success()
        .stdout("would remove old\n");
    keel()
        .args(["sessions", "prune", "--older-than", "30d", "--store", &store])
        .assert()
        .success()
        .stdout("removed old\n");
    let listing = keel().args(["sessions", "list", "--store", &store]).output().unwrap();
    let listing = String::from_utf8(listing.stdout).unwrap();
    assert!(listing.contains("fresh") && !listing.contains("old "), "{listing}");
    keel()
        .args(["sessions", "prune", "--older-than", "soon", "--store", &store])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("write durations like"));
    keel().args(["sessions", "prune", "--store", &store]).assert().code(2);
    // Compaction drops finished runs' journals and keeps their messages.
    let before = std::fs::metadata(&db).unwrap().len();
    keel()
        .args(["sessions", "prune", "--compact", "--store", &store])
        .assert()
        .success()
        .stderr(predicate::str::contains("compacted: 1 journal entries"));
    let show = keel().args(["sessions", "show", "fresh", "--store", &store]).output().unwrap();
    let shown = String::from_utf8(show.stdout).unwrap();
    assert!(shown.starts_with("user: hi\nassistant: hi\nusage: "), "{shown}");
    assert!(std::fs::metadata(&db).unwrap().len() <= before);
}

#[test]
fn chat_runs_a_turn_per_line_in_one_session() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\ntools: [day_name]\nmock:\n  script:\n    - text: 'Hello!'\n    - tool_calls: [{ name: day_name, input: {} }]\n    - text: 'Today is {{last_tool_output}}.'\n",
    )]);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let chat = |lines: &str| {
        keel()
            .args(["chat"])
            .arg(dir.path())
            .args(["--session", "talk", "--store", &store])
            .write_stdin(lines)
            .output()
            .unwrap()
    };
    let output = chat("hi\n\nwhat day is it?\n/exit\nnot read\n");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let day = weekdays_now();
    assert!(
        day.iter().any(|d| stdout == format!("Hello!\nToday is {d}.\n")),
        "two turns, the empty line skipped, nothing after /exit: {stdout:?}"
    );
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("session talk"), "{stderr}");
    // Both turns are one conversation; a later chat on the same session goes on with it.
    let show = keel().args(["sessions", "show", "talk", "--store", &store]).output().unwrap();
    let transcript = String::from_utf8(show.stdout).unwrap();
    assert!(transcript.starts_with("user: hi\nassistant: Hello!\nuser: what day is it?\n"), "{transcript}");
    let again = chat("and now?\n");
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8(again.stdout).unwrap(),
        "and now?\n",
        "the script is spent: the mock echoes"
    );
    // `/help` and unknown `/word`s are answered here, not sent; `//` and a path are sent.
    let commands = chat("/help\n/nope\n//nope\n/etc/hosts?\n");
    assert!(commands.status.success(), "{commands:?}");
    assert_eq!(
        String::from_utf8(commands.stdout).unwrap(),
        "/nope\n/etc/hosts?\n",
        "the mock echoes what is sent"
    );
    let stderr = String::from_utf8(commands.stderr).unwrap();
    assert!(stderr.contains("/exit, /quit  leave"), "{stderr}");
    assert!(stderr.contains("unknown command /nope; /help lists them"), "{stderr}");
}

#[test]
fn the_desk_example_reads_computes_and_delegates_offline() {
    keel()
        .current_dir(repo_root())
        .args(["check", "examples/desk"])
        .assert()
        .success()
        .stderr("")
        .stdout(predicate::str::starts_with("ok: agent `desk`"));
    let output = keel()
        .current_dir(repo_root())
        .args(["run", "examples/desk", "How much did we spend this month?", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events: Vec<Value> =
        String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let js = events
        .iter()
        .find(|e| e["type"] == "tool.done" && e["output"]["value"]["total"].is_number())
        .expect("the js step ran");
    assert_eq!(
        js["output"]["value"],
        json!({"count": 4, "total": 1234.5}),
        "computed from notes/expenses.csv"
    );
    let done = events.last().unwrap();
    assert_eq!(done["type"], "run.done");
    assert!(done["text"].as_str().unwrap().contains("1,234.50 EUR"), "{done}");
}

#[test]
fn the_concierge_example_remembers_its_guest_and_repairs_an_answer_offline() {
    keel()
        .current_dir(repo_root())
        .args(["check", "examples/concierge"])
        .assert()
        .success()
        .stdout(predicate::str::starts_with("ok: agent `concierge`"));
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let example = repo_root().join("examples/concierge");
    let run = |input: &str| {
        let args = ["run", example.to_str().unwrap(), input, "--session", "ada", "--store", &store, "--json"];
        let output = keel().args(args).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<Value>>()
    };
    let first = run("I'm Ada, I work at Acme.");
    assert_eq!(first.last().unwrap()["output"]["reply"], "Welcome, Ada! Noted that you work at Acme.");
    let second = run("Book me a table.");
    assert!(second.iter().any(|e| e["type"] == "output.repair"), "{second:?}");
    assert_eq!(second.last().unwrap()["output"]["follow_up"], true);
    let shown = keel().args(["memory", "show", "session:ada", "--store", &store]).output().unwrap();
    let shown = String::from_utf8(shown.stdout).unwrap();
    assert!(shown.contains("ada —[works_at]→ acme") && shown.contains("Ada introduced herself"), "{shown}");
}

#[test]
fn the_helpdesk_example_answers_from_its_documents_offline() {
    let index = tempfile::tempdir().unwrap();
    let check = keel()
        .current_dir(repo_root())
        .env("KEEL_INDEX_DIR", index.path())
        .args(["check", "examples/helpdesk"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    assert!(
        stdout.starts_with(
            "ok: agent `helpdesk` (model mock; tools: search_memory, read_memory, search_billing, read_billing)"
        ) && stdout.contains("(2 documents, 5 passages)")
            && stdout.contains("(1 document, 2 passages)"),
        "{stdout}"
    );
    let run = keel()
        .current_dir(repo_root())
        .env("KEEL_INDEX_DIR", index.path())
        .args(["run", "examples/helpdesk", "Can I return a gift card?", "--json"])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let events: Vec<Value> =
        String::from_utf8_lossy(&run.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let done = events.last().unwrap();
    assert_eq!(done["type"], "run.done");
    assert!(
        done["text"]
            .as_str()
            .unwrap()
            .contains("Gift cards, opened software and personalised items cannot be returned"),
        "{done}"
    );
    // The index was built where KEEL_INDEX_DIR says, one library per folder.
    assert_eq!(std::fs::read_dir(index.path()).unwrap().count(), 2);
}

#[test]
fn a_provider_that_is_not_running_is_named_once_per_retry_with_what_to_check_and_logs_are_plain_text() {
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: ollama/llama3.2\nretry: { max_attempts: 2, initial_backoff: 10ms }\n",
    )]);
    let run = |log: &str| {
        keel()
            .current_dir(dir.path())
            .env("OLLAMA_HOST", format!("127.0.0.1:{port}"))
            .env("KEEL_LOG", log)
            .args(["run", ".", "hi"])
            .output()
            .unwrap()
    };
    let out = run("warn");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let retries: Vec<&str> = stderr.lines().filter(|l| l.contains("could not connect")).collect();
    assert_eq!(retries.len(), 2, "one line for the retry, one for the failure: {stderr}");
    assert!(retries[0].starts_with("↻ the model call failed (KEEL_PROVIDER_ERROR"), "{stderr}");
    assert!(stderr.contains("is Ollama running? start it with `ollama serve`"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "colour codes in a file: {stderr:?}");

    // Debug logs say what was asked and answered, by size, never the content.
    let out = run("keel_runtime=debug");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let request = stderr.lines().find(|l| l.contains("model request")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        request.contains("model=\"llama3.2\"")
            && request.contains("messages=1")
            && request.contains("message_chars=2"),
        "{request}"
    );
    assert!(!request.contains("hi\""), "{request}");
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");

    // A filter that does not parse is said, and the default level is used.
    let out = run("keel_runtime==debug");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("warning: KEEL_LOG=\"keel_runtime==debug\" is not a log filter ("),
        "{stderr}"
    );
    assert!(stderr.contains("is Ollama running?") && !stderr.contains("model request"), "{stderr}");
}

#[test]
fn version_completions_and_the_manual_come_from_the_cli_itself() {
    let version = keel().arg("--version").output().unwrap();
    let version = String::from_utf8(version.stdout).unwrap();
    let (first, features) = version.trim().split_once('\n').unwrap_or_else(|| panic!("{version}"));
    // The binary the tests build has every optional capability (the default features).
    assert_eq!(features, "features: mcp, postgres, knowledge, js, otlp", "{version}");
    let revision = first
        .strip_prefix(&format!("keel {} (", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("{version}"));
    let revision = revision.strip_suffix(')').unwrap().trim_end_matches("-dirty");
    assert!(
        revision == "unknown" || (revision.len() == 12 && revision.bytes().all(|b| b.is_ascii_hexdigit())),
        "{version}"
    );
    for (shell, marker) in
        [("bash", "complete -F _keel"), ("zsh", "#compdef keel"), ("fish", "complete -c keel")]
    {
        let script = keel().args(["completions", shell]).output().unwrap();
        assert!(script.status.success());
        let script = String::from_utf8(script.stdout).unwrap();
        assert!(
            script.contains(marker) && script.contains("memory") && script.contains("serve"),
            "{shell}: {script}"
        );
    }
    let man = keel().arg("man").output().unwrap();
    let man = String::from_utf8(man.stdout).unwrap();
    assert!(man.contains(".TH keel 1") && man.contains("serve") && man.contains("Exit codes"), "{man}");
    let bad = keel().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// Where the machine that built it supports packed relative relocations (glibc's DT_RELR), the
/// binary uses them: the table the loader reads at every start is then kilobytes, not the two
/// megabytes of one entry per pointer. The build script says whether it asked for them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn the_binary_packs_its_relative_relocations_where_the_machine_supports_it() {
    let output =
        std::process::Command::new("readelf").arg("--dynamic").arg(crate::support::keel_binary()).output();
    let output = output.expect("readelf (binutils, which links the binary) runs");
    let dynamic = String::from_utf8(output.stdout).unwrap();
    // `0x...8 (RELASZ)  5088 (bytes)`: the size of the unpacked table.
    let rela_bytes = |dynamic: &str| -> u64 {
        let line = dynamic.lines().find(|line| line.contains("(RELASZ)")).unwrap_or_default();
        line.split_whitespace().rev().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    match env!("KEEL_RELOCS_PACKED") {
        "yes" => {
            assert!(dynamic.contains("(RELR)"), "{dynamic}");
            assert!(rela_bytes(&dynamic) < 64 * 1024, "{dynamic}");
        }
        _ => assert!(!dynamic.contains("(RELR)"), "{dynamic}"),
    }
    assert!(keel().arg("--version").output().unwrap().status.success());
}

/// Where the linker takes `crates/keel/startup.ld`, the functions keel runs while it starts are
/// laid out in a section of their own before the rest of its code (an idle `keel serve` then
/// keeps a fraction of its code resident). The build script says whether it asked for it (it
/// does for optimized builds only: a debug build's link took 84 s with the script instead of 5);
/// the patterns come from the `dist` build, of which another build has fewer functions, but
/// still far more than a section of a few pages.
#[cfg(target_os = "linux")]
#[test]
fn the_binary_lays_out_its_start_up_code_together_where_the_linker_can() {
    let output = std::process::Command::new("readelf").arg("-SW").arg(crate::support::keel_binary()).output();
    let output = output.expect("readelf (binutils, which links the binary) runs");
    let sections = String::from_utf8(output.stdout).unwrap();
    // `[16] .text.keel_startup PROGBITS 00000000005f7d90 5f6d90 41ea06 00 AX 0 0 16`
    let startup_bytes = sections.lines().find(|line| line.contains(" .text.keel_startup ")).map(|line| {
        let size = line.split_whitespace().skip_while(|field| *field != "PROGBITS").nth(3);
        u64::from_str_radix(size.unwrap_or("0"), 16).unwrap_or(0)
    });
    match env!("KEEL_STARTUP_LAID_OUT") {
        "yes" => assert!(startup_bytes.is_some_and(|bytes| bytes > 256 * 1024), "{sections}"),
        _ => assert_eq!(startup_bytes, None, "{sections}"),
    }
    assert!(keel().arg("--version").output().unwrap().status.success());
}

#[test]
fn a_retried_turn_is_announced_on_the_terminal_and_in_json() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock\nretry: { initial_backoff: 10ms }\nmock:\n  script:\n    - error: { status: 503, times: 1, partial: 'Hel' }\n      text: 'Hello!'\n",
    )]);
    let output = keel().arg("run").arg(dir.path()).arg("hi").output().unwrap();
    assert!(output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("↻ the model call failed (KEEL_PROVIDER_OVERLOADED: mock provider error (status 503)); retrying in")
            && stderr.contains("(the partial answer above is void)"),
        "{stderr}"
    );
    let json = keel().arg("run").arg(dir.path()).arg("hi").arg("--json").output().unwrap();
    let events: Vec<Value> =
        String::from_utf8(json.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["run.start", "turn.start", "text.delta", "turn.retry", "text.delta", "usage", "run.done"],
        "{events:?}"
    );
    assert_eq!(events[3]["attempt"], 2);
    assert_eq!(events[6]["text"], "Hello!");
}

/// Every built-in is named in snake_case; an agent written with the former names still runs,
/// and `keel check`, `keel run` and `keel test` say the new name once per use.
#[test]
fn built_ins_by_their_former_names_run_with_a_warning_naming_the_new_name() {
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock\ntools: [day-name]\nmock:\n  script:\n    - tool_calls: [{ name: day-name, input: {} }]\n    - text: 'It is {{last_tool_output}}.'\n",
        ),
        (
            "tests/today.yaml",
            "input: What day is it?\nexpect:\n  tool_calls: [day-name]\n  text_contains: It is\n",
        ),
    ]);
    let check = keel().arg("check").arg(dir.path()).output().unwrap();
    assert!(check.status.success(), "{check:?}");
    let said = String::from_utf8_lossy(&check.stderr);
    let warnings: Vec<&str> = said.lines().filter(|line| line.starts_with("warning")).collect();
    assert_eq!(
        warnings,
        [
            "warning: the tool `day-name` is now called `day_name`",
            "warning: the tool `day-name` is now called `day_name`",
            "warning: the tool `day-name` is now called `day_name`",
        ],
        "{said}"
    );
    // The model is offered the tool by its name, and calls it.
    let run = keel().args(["run", "--json"]).arg(dir.path()).arg("What day is it?").output().unwrap();
    assert!(run.status.success(), "{run:?}");
    let events = String::from_utf8_lossy(&run.stdout);
    assert!(events.contains(r#""type":"tool.start","callId":"call_0_0","name":"day_name""#), "{events}");
    assert!(events.contains(r#""type":"tool.done""#), "{events}");
    let test = keel().arg("test").arg(dir.path()).output().unwrap();
    assert!(test.status.success(), "{test:?}");
}
