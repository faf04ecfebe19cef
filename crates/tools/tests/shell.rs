//! `shell` against hostile commands: background jobs and infinite output, a runaway command,
//! secrets in the environment.

use std::time::{Duration, Instant};

use keel_core::error::ErrorCode;
use keel_core::{SessionState, Tool, ToolContext, ToolError};
use keel_tools::shell::{OUTPUT_CAP, ShellTool};
use serde_json::{Value, json};

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("t"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "c".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

async fn run(tool: &ShellTool, input: Value) -> Result<Value, ToolError> {
    tool.call(input, &ctx()).await
}

/// Whether `pid` still runs (a zombie waiting for a container's init to reap it does not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) != Some("Z"),
        Err(_) => false,
    }
}

#[tokio::test]
async fn commands_run_in_the_workspace_with_a_minimal_environment() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let tool = ShellTool::new(root.clone(), false);
    let out = run(&tool, json!({"command": "pwd; echo \"home=$HOME\"; env | sort | cut -d= -f1 | tr '\\n' ' '; echo oops >&2; exit 3"}))
        .await
        .unwrap();
    assert_eq!(out["exit_code"], 3, "a failing command is a result: {out}");
    let stdout = out["stdout"].as_str().unwrap();
    assert!(stdout.starts_with(&format!("{}\nhome={}\n", root.display(), root.display())), "{stdout}");
    let names: Vec<&str> = stdout.lines().nth(2).unwrap().split_whitespace().collect();
    let allowed = [
        "HOME",
        "KEEL_CALL_ID",
        "KEEL_IDEMPOTENCY_KEY",
        "KEEL_RUN_ID",
        "KEEL_SESSION_ID",
        "LANG",
        "OLDPWD",
        "PATH",
        "PWD",
        "SHLVL",
        "TERM",
        "_",
    ];
    for name in &names {
        assert!(allowed.contains(name), "the command saw {name} from keel's environment: {names:?}");
    }
    assert_eq!(out["stderr"], "oops\n");
}

#[tokio::test]
async fn a_timeout_kills_the_whole_group_and_background_jobs_do_not_hold_the_call() {
    let dir = tempfile::tempdir().unwrap();
    let tool = ShellTool::new(dir.path().to_owned(), false);
    // The shell exits at once; its background job must not keep the call waiting.
    let started = Instant::now();
    let out = run(&tool, json!({"command": "sleep 30 & echo $! > bg.pid; echo started"})).await.unwrap();
    assert_eq!(out["stdout"], "started\n");
    assert!(started.elapsed() < Duration::from_secs(10), "the call waited for a background job");
    let bg: i32 = std::fs::read_to_string(dir.path().join("bg.pid")).unwrap().trim().parse().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!alive(bg), "the background job outlived its shell");

    let error = run(&tool, json!({"command": "sleep 60 & echo $! > bg2.pid; sleep 60", "timeout_ms": 300}))
        .await
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::ToolTimeout, "{}", error.message);
    let bg2: i32 = std::fs::read_to_string(dir.path().join("bg2.pid")).unwrap().trim().parse().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!alive(bg2), "a timeout left a child running");
}

#[tokio::test]
async fn endless_output_is_capped() {
    let dir = tempfile::tempdir().unwrap();
    let tool = ShellTool::new(dir.path().to_owned(), false);
    let out =
        run(&tool, json!({"command": "yes | head -c 5000000; yes err | head -c 300000 >&2"})).await.unwrap();
    let stdout = out["stdout"].as_str().unwrap();
    assert!(
        stdout.len() < OUTPUT_CAP + 100 && stdout.ends_with(&format!("[cut: more than {OUTPUT_CAP} bytes]")),
        "{}",
        stdout.len()
    );
    assert!(out["stderr"].as_str().unwrap().contains("[cut:"));
    let nul = run(&tool, json!({"command": "echo a\u{0}b"})).await.unwrap_err();
    assert_eq!(nul.code, ErrorCode::ToolInputInvalid);
}
