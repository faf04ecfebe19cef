//! MCP client end to end: the `keel` binary using tools of real MCP servers (the official
//! `server-everything` over stdio, a server on the official Python SDK over stdio and
//! Streamable HTTP), with the mock model scripting the calls. The peers are installed by
//! `scripts/mcp-peers.sh` (npm and PyPI) on first use.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{agent_dir, keel_binary, repo_root};

/// Where `scripts/mcp-peers.sh` installed the peers (installing them the first time).
fn peers() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let output = Command::new(repo_root().join("scripts/mcp-peers.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("scripts/mcp-peers.sh runs");
        assert!(
            output.status.success(),
            "scripts/mcp-peers.sh failed: the MCP tests need npm and python3 -m venv"
        );
        PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
    })
}

fn everything() -> String {
    peers().join("npm/node_modules/.bin/mcp-server-everything").display().to_string()
}

fn python() -> String {
    peers().join("venv/bin/python").display().to_string()
}

fn test_server() -> String {
    repo_root().join("tests/peers/mcp_server.py").display().to_string()
}

/// The Python SDK test server over stdio, as a spec's `command`.
fn python_stdio() -> String {
    format!("[{}, {}, stdio]", python(), test_server())
}

/// The Python SDK test server over Streamable HTTP, killed when dropped.
struct HttpServer {
    child: Child,
    url: String,
}

impl HttpServer {
    fn start(calls: &Path) -> HttpServer {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(python())
            .args([test_server().as_str(), "http", &port.to_string()])
            .env("KEEL_TEST_CALLS", calls)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the Python MCP server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        HttpServer { child, url: format!("http://127.0.0.1:{port}/mcp") }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An agent whose one MCP server is the Python SDK test server over stdio (named `shop`), and
/// whose mock model plays `script` (YAML entries, indented by four spaces).
fn shop_agent(script: &str) -> tempfile::TempDir {
    let spec = format!(
        "model: mock\nmcp: [ {{ name: shop, command: {}, inherit_env: [KEEL_TEST_CALLS] }} ]\nmock:\n  script:\n{script}",
        python_stdio()
    );
    agent_dir(&[("agent.yaml", &spec)])
}

/// `keel run <dir> <input> --json` on a SQLite store in the directory.
fn keel_run(dir: &Path, calls: &Path) -> Command {
    let mut command = Command::new(keel_binary());
    command
        .current_dir(dir)
        .env_remove("KEEL_FAULT")
        .env("KEEL_LOG", "error")
        .env("KEEL_TEST_CALLS", calls)
        .arg("run")
        .arg(dir)
        .args(["go", "--session", "s", "--json", "--store"])
        .arg(format!("sqlite:{}", dir.join("keel.db").display()));
    command
}

/// The JSON events a `--json` run printed.
fn events(stdout: &[u8]) -> Vec<Value> {
    BufReader::new(stdout).lines().map(|line| serde_json::from_str(&line.unwrap()).unwrap()).collect()
}

/// The `tool.done` and `tool.error` events, in order.
fn tool_results(events: &[Value]) -> Vec<&Value> {
    events.iter().filter(|event| event["type"] == "tool.done" || event["type"] == "tool.error").collect()
}

/// The message of a `tool.error` event.
fn error_of(event: &Value) -> &str {
    assert_eq!(event["type"], "tool.error", "{event:#}");
    event["error"].as_str().unwrap()
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).map(|text| text.lines().map(str::to_owned).collect()).unwrap_or_default()
}

#[test]
fn an_agent_uses_tools_of_a_stdio_server_and_an_http_server_in_one_run() {
    let state = tempfile::tempdir().unwrap();
    let calls = state.path().join("calls.txt");
    let http = HttpServer::start(&calls);
    let spec = format!(
        r#"name: shop
model: mock
mcp:
  - {{ name: everything, command: [{everything}, stdio], only: [echo, get-sum] }}
  - {{ name: shop, url: "{url}" }}
mock:
  script:
    - tool_calls:
        - {{ name: everything_echo, input: {{ message: hi }} }}
        - {{ name: shop_charge, input: {{ order: A-1, amount: 30 }} }}
        - {{ name: shop_fail, input: {{ message: card declined }} }}
    - text: "done"
"#,
        everything = everything(),
        url = http.url
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let output = keel_run(dir.path(), &calls).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    let results = tool_results(&events);
    assert_eq!(results.len(), 3, "{events:#?}");
    let by_call = |id: &str| results.iter().find(|r| r["callId"] == id).copied().unwrap();
    assert_eq!(by_call("call_0_0")["output"], "Echo: hi");
    assert_eq!(
        by_call("call_0_1")["output"],
        serde_json::json!({"order": "A-1", "charged": 30, "status": "ok"})
    );
    // `isError: true` is a tool error the model sees, not a failed run.
    assert!(error_of(by_call("call_0_2")).contains("card declined"), "{events:#?}");
    // The server got the call once, with the step's idempotency key in `_meta`.
    let run_id = events[0]["runId"].as_str().unwrap();
    assert_eq!(lines(&calls), vec![format!("A-1 {run_id}:tool:shop_charge:call_0_1")]);
}

#[test]
fn a_replayed_mcp_call_never_reaches_the_server_again() {
    let state = tempfile::tempdir().unwrap();
    let calls = state.path().join("calls.txt");
    let dir = shop_agent(
        r#"    - tool_calls: [ { name: shop_charge, input: { order: B-2, amount: 5 } } ]
    - text: "charged: {{last_tool_output}}"
"#,
    );
    // keel dies right after the call's result is committed.
    let crashed = keel_run(dir.path(), &calls)
        .env("KEEL_FAULT", "after_commit:tool:shop_charge:call_0_0")
        .env("KEEL_RUN_LEASE", "200ms")
        .output()
        .unwrap();
    assert!(!crashed.status.success(), "the fault did not fire");
    assert_eq!(lines(&calls).len(), 1);
    std::thread::sleep(Duration::from_millis(300));
    // The next `keel run` finishes the run from its journal: the server is not called again.
    let resumed = keel_run(dir.path(), &calls).output().unwrap();
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(stderr.contains("resuming run"), "{stderr}");
    let done = events(&resumed.stdout);
    let finished: Vec<&Value> = done.iter().filter(|e| e["type"] == "run.done").collect();
    assert!(finished[0]["text"].as_str().unwrap().contains(r#""charged":5"#), "{done:#?}");
    assert_eq!(lines(&calls).len(), 1, "the replay called the server again: {:?}", lines(&calls));
}

#[test]
fn a_server_killed_mid_call_is_a_tool_error_and_is_restarted_for_the_next_call() {
    let state = tempfile::tempdir().unwrap();
    let calls = state.path().join("calls.txt");
    let dir = shop_agent(
        r#"    - tool_calls: [ { name: shop_die, input: {} } ]
    - tool_calls: [ { name: shop_charge, input: { order: C-3, amount: 7 } } ]
    - text: "after the restart: {{last_tool_output}}"
"#,
    );
    let started = Instant::now();
    let output = keel_run(dir.path(), &calls).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    let results = tool_results(&events);
    assert!(
        error_of(results[0]).contains("MCP server `shop`: the server stopped during the call"),
        "{events:#?}"
    );
    assert_eq!(results[1]["output"]["status"], "ok", "{events:#?}");
    assert_eq!(lines(&calls).len(), 1);
    // Never a hung run: the death is noticed at once, not at the tool timeout (60 s).
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

#[test]
fn a_result_over_the_size_limit_is_a_tool_error_and_the_run_goes_on() {
    let state = tempfile::tempdir().unwrap();
    let calls = state.path().join("calls.txt");
    let dir = shop_agent(
        r#"    - tool_calls: [ { name: shop_huge, input: { megabytes: 20 } } ]
    - tool_calls: [ { name: shop_slow, input: { seconds: 0 } } ]
    - text: "still here"
"#,
    );
    let output = keel_run(dir.path(), &calls).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    let results = tool_results(&events);
    assert!(error_of(results[0]).contains("the server sent a message over 16 MiB"), "{:#?}", results[0]);
    // The Python SDK gives a `str` result as `structuredContent: {"result": ...}` too.
    assert_eq!(results[1]["output"], serde_json::json!({"result": "waited 0.0s"}));
    assert_eq!(events.last().unwrap()["text"], "still here");
}

/// `keel run` of an agent whose spec is `spec`: (exit success, stderr).
fn run_failing(spec: &str) -> (bool, String) {
    let dir = agent_dir(&[("agent.yaml", spec)]);
    let calls = dir.path().join("calls.txt");
    let output = keel_run(dir.path(), &calls).output().unwrap();
    (output.status.success(), String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
fn servers_that_will_not_start_are_named_with_their_stderr() {
    // Not a program.
    let (ok, stderr) =
        run_failing("model: mock\nmcp: [ { name: ghost, command: [/nonexistent/mcp-server] } ]\n");
    assert!(!ok);
    assert!(stderr.contains("error[KEEL_MCP_START_FAILED]"), "{stderr}");
    assert!(stderr.contains("MCP server `ghost`: cannot start \"/nonexistent/mcp-server\""), "{stderr}");
    // Exits at once, saying why on stderr.
    let (ok, stderr) = run_failing(
        "model: mock\nmcp: [ { name: broken, command: [sh, -c, 'echo missing API key >&2; exit 3'] } ]\n",
    );
    assert!(!ok);
    assert!(stderr.contains("MCP server `broken` (sh -c"), "{stderr}");
    assert!(stderr.contains("missing API key"), "{stderr}");
    // Prints garbage and never answers `initialize`.
    let (ok, stderr) = run_failing(
        "model: mock\nmcp: [ { name: chatty, command: [sh, -c, 'echo hello there; echo \"{not json\"; sleep 30'], startup_timeout: 2s } ]\n",
    );
    assert!(!ok);
    assert!(stderr.contains("MCP server `chatty`"), "{stderr}");
    assert!(stderr.contains("no answer to `initialize` within 2.0 s"), "{stderr}");
}

#[test]
fn a_tool_name_two_servers_share_is_refused_naming_both() {
    let spec = format!(
        "model: mock\nmcp:\n  - {{ name: a, command: [{e}, stdio], prefix: x_, only: [echo] }}\n  - {{ name: b, command: [{e}, stdio], prefix: x_, only: [echo] }}\n",
        e = everything()
    );
    let (ok, stderr) = run_failing(&spec);
    assert!(!ok);
    assert!(stderr.contains("error[KEEL_MCP_TOOL_CONFLICT]"), "{stderr}");
    assert!(
        stderr.contains("two tools would be named `x_echo`: tool `echo` of MCP server `b` and tool `echo` of MCP server `a`"),
        "{stderr}"
    );
}

#[test]
fn an_http_server_redirecting_to_a_private_address_is_refused() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The target a redirect points at: it must never be asked anything.
    let target = runtime.block_on(keel_testkit::WireServer::start(vec![]));
    let target_url = target.url().replace("127.0.0.1", "localhost");
    let redirect = runtime.block_on(keel_testkit::WireServer::start(vec![
        keel_testkit::Reply::new(307, "text/plain", "moved").header("Location", &format!("{target_url}/mcp")),
        keel_testkit::Reply::new(307, "text/plain", "moved").header("Location", &format!("{target_url}/mcp")),
    ]));
    let metadata = runtime.block_on(keel_testkit::WireServer::start(vec![
        keel_testkit::Reply::new(307, "text/plain", "moved")
            .header("Location", "http://169.254.169.254/latest/meta-data"),
        keel_testkit::Reply::new(307, "text/plain", "moved")
            .header("Location", "http://169.254.169.254/latest/meta-data"),
    ]));
    for (server, to) in [(&redirect, "localhost"), (&metadata, "169.254.169.254")] {
        let spec = format!(
            "model: mock\nmcp: [ {{ name: sneaky, url: \"{}/mcp\", startup_timeout: 5s }} ]\n",
            server.url()
        );
        let (ok, stderr) = run_failing(&spec);
        assert!(!ok);
        assert!(stderr.contains("error[KEEL_MCP_START_FAILED]"), "{stderr}");
        assert!(stderr.contains("refused") && stderr.contains(to), "{stderr}");
    }
    assert!(target.requests().is_empty(), "the redirect target was reached");
}

#[test]
fn keel_check_lists_each_servers_tools_and_offline_skips_them() {
    let spec = format!(
        "model: mock\nmcp: [ {{ name: everything, command: [{}, stdio], only: [echo, get-sum] }} ]\n",
        everything()
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let checked = Command::new(keel_binary()).arg("check").arg(dir.path()).output().unwrap();
    assert!(checked.status.success(), "{}", String::from_utf8_lossy(&checked.stderr));
    let stdout = String::from_utf8_lossy(&checked.stdout);
    assert!(stdout.contains("mcp `everything`: 2 tools: everything_echo, everything_get-sum"), "{stdout}");
    // Offline: the server is not started (its command would fail).
    let broken = agent_dir(&[(
        "agent.yaml",
        "model: mock\nmcp: [ { name: ghost, command: [/nonexistent/server] } ]\n",
    )]);
    let offline =
        Command::new(keel_binary()).args(["check", "--offline"]).arg(broken.path()).output().unwrap();
    assert!(offline.status.success(), "{}", String::from_utf8_lossy(&offline.stderr));
    assert!(String::from_utf8_lossy(&offline.stdout).contains("MCP servers not checked (--offline): ghost"));
    let online = Command::new(keel_binary()).arg("check").arg(broken.path()).output().unwrap();
    assert!(!online.status.success());
    assert!(String::from_utf8_lossy(&online.stderr).contains("error[KEEL_MCP_START_FAILED]"));
}

#[test]
fn the_notes_example_reads_its_notes_through_the_official_filesystem_server() {
    let output = Command::new(keel_binary())
        .env("KEEL_LOG", "error")
        .arg("run")
        .arg(repo_root().join("examples/notes"))
        .arg("What is on my grocery list?")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.starts_with("From your notes:"), "{stdout}");
    assert!(stdout.contains("coffee beans (the dark roast)"), "{stdout}");
}
