//! The built-in tools in agent runs through `keel run` (mock-scripted model), with real
//! targets: a local HTTP server, a workspace directory, real processes.

use std::path::Path;
use std::time::Duration;

use keel_testkit::{Reply, WireServer};
use serde_json::Value;

use crate::support::{KEEL_PID, agent_dir, keel};

/// Runs `keel run DIR INPUT --json` off the async runtime; the events and the exit code.
async fn run_json(dir: &Path, input: &str) -> (Vec<Value>, Option<i32>) {
    run_json_with(dir, input, &[]).await
}

/// [`run_json`] with extra environment variables for keel.
async fn run_json_with(dir: &Path, input: &str, env: &[(&str, &str)]) -> (Vec<Value>, Option<i32>) {
    let dir = dir.to_owned();
    let input = input.to_owned();
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let output = tokio::task::spawn_blocking(move || {
        keel()
            .current_dir(&dir)
            .envs(env)
            .arg("run")
            .arg(&dir)
            .arg(&input)
            .arg("--json")
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let events = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (events, output.status.code())
}

fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_request_reaches_an_allowed_server_and_is_refused_the_metadata_address() {
    let server = WireServer::start(vec![Reply::json(200, &serde_json::json!({"temp": 21}))]).await;
    let spec = format!(
        "model: mock
tools: [http_request]
http: {{ allow_loopback: true }}
mock:
  script:
    - tool_calls:
        - {{ name: http_request, input: {{ url: '{}/weather?city=Paris' }} }}
        - {{ name: http_request, input: {{ url: 'http://169.254.169.254/latest/meta-data/' }} }}
    - text: 'Done.'
",
        server.url()
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let (events, code) = run_json(dir.path(), "weather?").await;
    assert_eq!(code, Some(0), "{events:?}");
    let done = of_type(&events, "tool.done");
    assert_eq!(done.len(), 1, "{events:?}");
    assert_eq!(done[0]["output"]["status"], 200);
    assert_eq!(done[0]["output"]["body"], "{\"temp\":21}");
    let errors = of_type(&events, "tool.error");
    assert_eq!(errors.len(), 1, "{events:?}");
    let message = errors[0]["error"].as_str().unwrap();
    assert!(message.starts_with("refused: 169.254.169.254 is a link-local address"), "{message}");
    assert_eq!(server.requests().len(), 1);
    assert_eq!(server.requests()[0].path, "/weather?city=Paris");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_allow_loopback_the_local_server_is_out_of_reach() {
    let server = WireServer::start(vec![Reply::new(200, "text/plain", "secret")]).await;
    let spec = format!(
        "model: mock
tools: [http_request]
approvals: {{ tools: [] }}
mock:
  script:
    - tool_calls: [{{ name: http_request, input: {{ url: '{}' }} }}]
    - text: 'Done.'
",
        server.url()
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let (events, code) = run_json(dir.path(), "go").await;
    assert_eq!(code, Some(0));
    let errors = of_type(&events, "tool.error");
    assert!(errors[0]["error"].as_str().unwrap().contains("http.allow_loopback"), "{events:?}");
    assert!(server.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_tools_read_list_write_and_edit_in_their_directory_only() {
    let spec = "model: mock
workspace: { path: ./data, mode: writable, approve_writes: false }
mock:
  script:
    - tool_calls:
        - { name: list_files, input: {} }
        - { name: read_file, input: { path: notes.md } }
        - { name: read_file, input: { path: ../agent.yaml } }
    - tool_calls: [{ name: write_file, input: { path: out/summary.md, content: 'two notes' } }]
    - tool_calls: [{ name: edit_file, input: { path: out/summary.md, old_text: two, new_text: three } }]
    - text: 'Done.'
";
    let dir = agent_dir(&[("agent.yaml", spec), ("data/notes.md", "tea\ncoffee\n")]);
    let (events, code) = run_json(dir.path(), "summarise").await;
    assert_eq!(code, Some(0), "{events:?}");
    // Parallel calls finish in any order: match results to calls by id.
    let output_of = |tool: &str| {
        let call =
            of_type(&events, "tool.start").into_iter().find(|e| e["name"] == tool).unwrap()["callId"].clone();
        of_type(&events, "tool.done").into_iter().find(|e| e["callId"] == call).unwrap()["output"].clone()
    };
    assert_eq!(output_of("list_files")["entries"][0]["path"], "notes.md");
    assert_eq!(output_of("read_file")["content"], "tea\ncoffee\n");
    let refused = of_type(&events, "tool.error");
    assert_eq!(refused.len(), 1, "{events:?}");
    assert!(refused[0]["error"].as_str().unwrap().contains("`..`"));
    assert_eq!(std::fs::read_to_string(dir.path().join("data/out/summary.md")).unwrap(), "three notes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_writes_wait_for_approval_by_default_and_readonly_has_no_writes() {
    let spec = "model: mock
workspace: { path: ./data, mode: writable }
mock:
  script:
    - tool_calls: [{ name: write_file, input: { path: x.md, content: 'hello' } }]
    - text: 'Written.'
";
    let dir = agent_dir(&[("agent.yaml", spec), ("data/.keep", "")]);
    let (events, code) = run_json(dir.path(), "write").await;
    assert_eq!(code, Some(5), "the run waits for a human: {events:?}");
    assert_eq!(of_type(&events, "approval.requested")[0]["tool"], "write_file");
    assert!(!dir.path().join("data/x.md").exists(), "nothing is written before the approval");

    let readonly = "model: mock
workspace: { path: ./data }
mock:
  script:
    - tool_calls: [{ name: write_file, input: { path: x.md, content: 'hello' } }]
    - text: 'Could not.'
";
    let dir = agent_dir(&[("agent.yaml", readonly), ("data/.keep", "")]);
    let (events, code) = run_json(dir.path(), "write").await;
    assert_eq!(code, Some(0));
    let error = of_type(&events, "tool.error")[0]["error"].as_str().unwrap().to_owned();
    assert!(
        error.starts_with("unknown tool `write_file`; available tools: read_file, list_files"),
        "{error}"
    );
    assert!(!dir.path().join("data/x.md").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_runs_in_the_workspace_without_keels_secrets_and_asks_first_by_default() {
    let spec = |extra: &str| {
        format!(
            "model: mock
tools: [shell]
workspace: {{ path: ./work, mode: writable, approve_writes: false }}
{extra}
mock:
  script:
    - tool_calls: [{{ name: shell, input: {{ command: 'echo hi > made.txt; env' }} }}]
    - text: 'Done.'
"
        )
    };
    let secret = [("OPENAI_API_KEY", "sk-keel-test-secret")];
    let dir = agent_dir(&[("agent.yaml", &spec("shell: { approve: false }")), ("work/.keep", "")]);
    let (events, code) = run_json_with(dir.path(), "go", &secret).await;
    assert_eq!(code, Some(0), "{events:?}");
    let output = &of_type(&events, "tool.done")[0]["output"];
    assert_eq!(output["exit_code"], 0);
    assert!(
        !output["stdout"].as_str().unwrap().contains("sk-keel-test-secret"),
        "a secret reached the shell"
    );
    assert_eq!(std::fs::read_to_string(dir.path().join("work/made.txt")).unwrap(), "hi\n");

    let dir = agent_dir(&[
        ("agent.yaml", &spec("shell: { approve: false, inherit_env: true }")),
        ("work/.keep", ""),
    ]);
    let (events, _) =
        run_json_with(dir.path(), "go", &[secret[0], ("KEEL_API_TOKEN", "keel-token"), ("MY_SETTING", "on")])
            .await;
    let stdout = of_type(&events, "tool.done")[0]["output"]["stdout"].as_str().unwrap().to_owned();
    assert!(stdout.contains("MY_SETTING=on"), "inherit_env passes keel's environment: {stdout}");
    assert!(
        !stdout.contains("sk-keel-test-secret") && !stdout.contains("keel-token"),
        "inherit_env passed keel's own secrets: {stdout}"
    );

    let dir = agent_dir(&[("agent.yaml", &spec("")), ("work/.keep", "")]);
    let (events, code) = run_json(dir.path(), "go").await;
    assert_eq!(code, Some(5), "shell waits for approval by default: {events:?}");
    assert_eq!(of_type(&events, "approval.requested")[0]["tool"], "shell");
    assert!(!dir.path().join("work/made.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_fetch_reads_a_page_as_markdown_in_a_run() {
    let page = "<html><head><title>Release notes</title></head><body><nav>Menu</nav><article><h1>Release 2.0</h1>\
                <p>This release makes every tool call a durable step, so that a crash never repeats a payment. \
                Read the <a href='/docs/durability'>durability guide</a> for the details of the journal.</p>\
                <p>It also adds approvals that survive restarts, and a playground page for trying agents out in a browser.</p>\
                </article></body></html>";
    let server = WireServer::start(vec![Reply::new(200, "text/html", page)]).await;
    let spec = format!(
        "model: mock
tools: [web_fetch]
http: {{ allow_loopback: true }}
mock:
  script:
    - tool_calls: [{{ name: web_fetch, input: {{ url: '{}/releases/2.0' }} }}]
    - text: 'Read it.'
",
        server.url()
    );
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let (events, code) = run_json(dir.path(), "what changed?").await;
    assert_eq!(code, Some(0), "{events:?}");
    let output = &of_type(&events, "tool.done")[0]["output"];
    assert_eq!(output["title"], "Release notes");
    let content = output["content"].as_str().unwrap();
    assert!(content.contains("a crash never repeats a payment"), "{content}");
    assert!(content.contains(&format!("[durability guide]({}/docs/durability)", server.url())), "{content}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_computes_in_a_run_and_a_runaway_script_becomes_a_tool_error() {
    let spec = "model: mock
tools: [js]
mock:
  script:
    - tool_calls:
        - { name: js, input: { code: 'const prices = [12.5, 7.25, 30]; console.log(prices.length, \"items\"); return prices.reduce((a, b) => a + b, 0);' } }
        - { name: js, input: { code: 'while (true) {}', cpu_ms: 200 } }
    - text: 'Total computed.'
";
    let dir = agent_dir(&[("agent.yaml", spec)]);
    let (events, code) = run_json(dir.path(), "sum it").await;
    assert_eq!(code, Some(0), "{events:?}");
    let done = of_type(&events, "tool.done");
    assert_eq!(done[0]["output"], serde_json::json!({"value": 49.75, "logs": ["3 items"]}));
    let errors = of_type(&events, "tool.error");
    assert!(errors[0]["error"].as_str().unwrap().contains("more than 200 ms of CPU time"), "{events:?}");
    assert_eq!(events.last().unwrap()["text"], "Total computed.");
}

const ECHO_TOOL: &str =
    "description = \"Echoes its input\"\ncommand = [\"cat\"]\n[input_schema]\ntype = \"object\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_runs_a_data_flow_script_of_tools_in_one_call() {
    let steps: Vec<String> =
        (0..17).map(|i| format!("{{ id: s{i}, tool: day_name, input: {{}} }}")).collect();
    let spec = format!(
        "model: mock
tools: [compose, current_date, day_name, ask_question]
approvals: {{ tools: [echo_secret] }}
mock:
  script:
    - tool_calls:
        - name: compose
          input:
            steps:
              - {{ id: today, tool: current_date, input: {{}} }}
              - {{ id: shout, tool: echo, input: {{ day: {{ $from: today, $path: weekday }}, all: {{ $from: today }} }} }}
        - name: compose
          input: {{ steps: [{}] }}
        - name: compose
          input: {{ steps: [{{ id: a, tool: echo_secret, input: {{}} }}] }}
        - name: compose
          input:
            steps:
              - {{ id: a, tool: echo, input: {{ n: 1 }} }}
              - {{ id: b, tool: echo, input: {{ m: {{ $from: a, $path: missing.field }} }} }}
    - text: 'Composed.'
",
        steps.join(", ")
    );
    let dir = agent_dir(&[
        ("agent.yaml", &spec),
        ("tools/echo.toml", ECHO_TOOL),
        ("tools/echo_secret.toml", ECHO_TOOL),
    ]);
    let (events, code) = run_json(dir.path(), "go").await;
    assert_eq!(code, Some(0), "{events:?}");
    let result_of = |call_id: &str| {
        events
            .iter()
            .find(|e| (e["type"] == "tool.done" || e["type"] == "tool.error") && e["callId"] == call_id)
            .unwrap_or_else(|| panic!("no result for {call_id}: {events:?}"))
            .clone()
    };
    let starts: Vec<&Value> = of_type(&events, "tool.start");
    let first = starts[0]["callId"].as_str().unwrap().to_owned();
    // Each step is a call of its own, announced and answered under `<call>.<step>`.
    let shout = result_of(&format!("{first}.shout"));
    let today = result_of(&format!("{first}.today"));
    assert_eq!(shout["output"]["day"], today["output"]["weekday"]);
    assert_eq!(shout["output"]["all"], today["output"]);
    let composed = result_of(&first);
    assert_eq!(composed["output"]["result"], shout["output"]);
    assert_eq!(composed["output"]["steps"]["today"], today["output"]);

    let errors: Vec<String> =
        of_type(&events, "tool.error").iter().map(|e| e["error"].as_str().unwrap().to_owned()).collect();
    assert!(
        errors.iter().any(|e| e.contains("has more than 16 items")),
        "a long script is refused whole: {errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("\"echo_secret\" is not one of")),
        "a tool that needs approval is not composable: {errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("the output of `a` has nothing at `missing.field`")),
        "{errors:?}"
    );
    assert_eq!(events.last().unwrap()["text"], "Composed.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_script_resumes_without_rerunning_the_steps_that_finished() {
    let append = "description = \"Counts its runs\"\ncommand = [\"sh\", \"-c\", \"echo run >> count.txt; echo '{\\\"n\\\": 7}'\"]\n[input_schema]\ntype = \"object\"\n";
    // Kills keel (its parent) the first time, like a crash in the middle of the script.
    let crash = &format!(
        "description = \"Crashes once\"\ncommand = [\"sh\", \"-c\", \"if [ ! -f crashed ]; then touch crashed; {KEEL_PID}; kill -9 $keel; sleep 5; fi; cat\"]\n[input_schema]\ntype = \"object\"\n"
    );
    let spec = "model: mock
tools: [compose]
mock:
  script:
    - tool_calls:
        - name: compose
          input:
            steps:
              - { id: count, tool: append, input: {} }
              - { id: crash, tool: crash, input: { v: { $from: count, $path: n } } }
    - text: 'Survived.'
";
    let dir = agent_dir(&[("agent.yaml", spec), ("tools/append.toml", append), ("tools/crash.toml", crash)]);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let run = |args: Vec<String>| {
        let dir = dir.path().to_owned();
        let store = store.clone();
        tokio::task::spawn_blocking(move || {
            keel()
                .current_dir(&dir)
                .env("KEEL_RUN_LEASE", "200ms")
                .arg("run")
                .arg(&dir)
                .args(&args)
                .args(["--session", "s", "--store", &store, "--json"])
                .timeout(Duration::from_secs(60))
                .output()
                .unwrap()
        })
    };
    let crashed = run(vec!["go".into()]).await.unwrap();
    assert_eq!(crashed.status.code(), None, "keel was killed mid-script");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resumed = run(Vec::new()).await.unwrap();
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(resumed.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&resumed.stderr));
    let events: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let crash_step = events
        .iter()
        .find(|e| e["type"] == "tool.done" && e["callId"].as_str().unwrap().ends_with(".crash"))
        .unwrap();
    assert_eq!(crash_step["output"], serde_json::json!({"v": 7}));
    assert_eq!(events.last().unwrap()["text"], "Survived.");
    let runs = std::fs::read_to_string(dir.path().join("count.txt")).unwrap();
    assert_eq!(runs.lines().count(), 1, "the finished step did not run again after the crash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subagent_answers_as_a_tool_and_a_crash_resumes_its_run_instead_of_starting_another() {
    let append = "description = \"Counts its runs\"\ncommand = [\"sh\", \"-c\", \"echo run >> count.txt; echo counted\"]\n[input_schema]\ntype = \"object\"\n";
    let crash = &format!(
        "description = \"Crashes once\"\ncommand = [\"sh\", \"-c\", \"if [ ! -f crashed ]; then touch crashed; {KEEL_PID}; kill -9 $keel; sleep 5; fi; echo fine\"]\n[input_schema]\ntype = \"object\"\n"
    );
    let parent = "model: mock
mock:
  script:
    - tool_calls: [{ name: researcher, input: { input: 'Find the capital of France.' } }]
    - text: 'The researcher says: {{last_tool_output}}'
";
    let child = "description: Looks facts up.
model: mock
mock:
  script:
    - tool_calls: [{ name: append, input: {} }]
    - tool_calls: [{ name: crash, input: {} }]
    - text: 'Paris.'
";
    let dir = agent_dir(&[
        ("agent.yaml", parent),
        ("subagents/researcher/agent.yaml", child),
        ("subagents/researcher/tools/append.toml", append),
        ("subagents/researcher/tools/crash.toml", crash),
    ]);
    let store = format!("sqlite:{}", dir.path().join("keel.db").display());
    let keel_in = |args: Vec<String>| {
        let dir = dir.path().to_owned();
        tokio::task::spawn_blocking(move || {
            keel()
                .current_dir(&dir)
                .env("KEEL_RUN_LEASE", "200ms")
                .args(&args)
                .timeout(Duration::from_secs(60))
                .output()
                .unwrap()
        })
    };
    let run = |extra: Vec<&str>| {
        let mut args: Vec<String> = vec!["run".into(), dir.path().display().to_string()];
        args.extend(extra.into_iter().map(str::to_owned));
        args.extend(["--session".into(), "s".into(), "--store".into(), store.clone(), "--json".into()]);
        keel_in(args)
    };
    let crashed = run(vec!["What is the capital of France?"]).await.unwrap();
    assert_eq!(crashed.status.code(), None, "the child's tool killed keel mid-run");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resumed = run(Vec::new()).await.unwrap();
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(resumed.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&resumed.stderr));
    let events: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.last().unwrap()["text"], "The researcher says: Paris.");
    let counted = std::fs::read_to_string(dir.path().join("subagents/researcher/count.txt")).unwrap();
    assert_eq!(counted.lines().count(), 1, "the child's finished step did not run again");

    // One child session, with one run: the replayed call resumed it rather than start another.
    let listed =
        keel_in(vec!["sessions".into(), "list".into(), "--store".into(), store.clone()]).await.unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    let children: Vec<&str> = listed.lines().filter(|l| l.starts_with("sub-researcher-")).collect();
    assert_eq!(children.len(), 1, "{listed}");
    let runs: Vec<&str> = children[0].split_whitespace().collect();
    assert_eq!(runs[2], "1", "the child session has one run: {listed}");
}

/// A page that only its script fills in: what `web_fetch` cannot read, and `browser` can.
const SCRIPTED_PAGE: &str = "<html><head><title>Loading</title></head><body><div id='app'>Loading…</div><script>\
    document.getElementById('app').innerHTML = '<article><h1>Status</h1><p>All systems are running, and every run so far resumed after its crash.</p></article>';\
    document.title = 'Status page';</script></body></html>";

fn browser_agent(url: &str) -> String {
    format!(
        "model: mock
tools: [browser]
http: {{ allow_loopback: true }}
workspace: {{ path: ./files, mode: writable }}
mock:
  script:
    - tool_calls:
        - {{ name: browser, input: {{ op: content, url: '{url}/status' }} }}
        - {{ name: browser, input: {{ op: screenshot, url: '{url}/status' }} }}
    - text: 'Read it.'
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_reads_a_scripted_page_and_saves_a_screenshot_in_a_run_and_over_http() {
    let server = WireServer::responding(|_| Reply::new(200, "text/html; charset=utf-8", SCRIPTED_PAGE)).await;
    let dir = agent_dir(&[("agent.yaml", &browser_agent(&server.url())), ("files/.keep", "")]);
    let (events, code) = run_json(dir.path(), "how is it going?").await;
    assert_eq!(code, Some(0), "{events:?}");
    let done = of_type(&events, "tool.done");
    let page = done.iter().find(|e| e["output"]["markdown"].is_string()).expect("the content call");
    assert_eq!(page["output"]["title"], "Status page");
    assert!(page["output"]["markdown"].as_str().unwrap().contains("every run so far resumed"), "{page}");
    let shot = done.iter().find(|e| e["output"]["key"].is_string()).expect("the screenshot call");
    let png = std::fs::read(dir.path().join("files").join(shot["output"]["key"].as_str().unwrap())).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");

    // The same agent served: the call's outcome in the turn's stream.
    let server_dir = agent_dir(&[("agent.yaml", &browser_agent(&server.url())), ("files/.keep", "")]);
    let served = crate::serve::Served::start(server_dir.path(), "memory", &[]);
    let response = crate::serve::client()
        .post(served.url("/chat"))
        .json(&serde_json::json!({"sessionId": "b", "input": "how is it going?"}))
        .send()
        .await
        .unwrap();
    let messages = crate::serve::read_sse(response).await;
    let outputs: Vec<Value> = messages
        .iter()
        .filter(|m| m.event.is_none() && m.kind() == "tool.done")
        .map(|m| m.json()["output"].clone())
        .collect();
    assert!(
        outputs.iter().any(|o| o["markdown"].as_str().is_some_and(|m| m.contains("All systems are running"))),
        "{outputs:?}"
    );
    assert!(outputs.iter().any(|o| o["mediaType"] == "image/png"), "{outputs:?}");
    assert!(messages.iter().any(|m| m.event.is_none() && m.kind() == "run.done"));
}

fn search_agent(url: &str) -> String {
    format!(
        "model: mock
tools: [web_search]
web_search: {{ backend: brave, url: '{url}', api_key_env: SEARCH_KEY }}
mock:
  script:
    - tool_calls:
        - {{ name: web_search, input: {{ query: durable agents, limit: 2 }} }}
    - text: 'Found them.'
"
    )
}

/// A local Brave Search API: the key `k-123`, two results per query.
async fn brave_server() -> WireServer {
    WireServer::responding(|request| {
        if request.header("x-subscription-token") != Some("k-123") {
            return Reply::new(401, "application/json", r#"{"type":"ErrorResponse","error":{"code":"UNAUTHORIZED"}}"#);
        }
        Reply::new(
            200,
            "application/json",
            r#"{"type":"search","web":{"type":"search","results":[
                {"title":"Durable <strong>agents</strong>","url":"https://a.example/1","description":"Runs that resume."},
                {"title":"Steps","url":"https://a.example/2","description":"Nothing twice."},
                {"title":"Third","url":"https://a.example/3"}]}}"#,
        )
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_search_answers_from_the_configured_backend_in_a_run_and_over_http() {
    let server = brave_server().await;
    let dir = agent_dir(&[("agent.yaml", &search_agent(&server.url()))]);
    let (events, code) = run_json_with(dir.path(), "find it", &[("SEARCH_KEY", "k-123")]).await;
    assert_eq!(code, Some(0), "{events:?}");
    let done = of_type(&events, "tool.done");
    assert_eq!(
        done[0]["output"],
        serde_json::json!([
            {"url": "https://a.example/1", "title": "Durable agents", "description": "Runs that resume."},
            {"url": "https://a.example/2", "title": "Steps", "description": "Nothing twice."}
        ])
    );
    // Without its key the call is an error result coded for it, and the run goes on.
    let (events, code) = run_json_with(dir.path(), "find it", &[("SEARCH_KEY", "")]).await;
    assert_eq!(code, Some(0), "{events:?}");
    let error = of_type(&events, "tool.error")[0];
    assert_eq!(error["code"], "KEEL_SEARCH_AUTH", "{error}");
    assert!(error["error"].as_str().unwrap().contains("SEARCH_KEY is not set"), "{error}");

    let served = crate::serve::Served::start(dir.path(), "memory", &[("SEARCH_KEY", "k-123")]);
    let response = crate::serve::client()
        .post(served.url("/chat"))
        .json(&serde_json::json!({"sessionId": "s", "input": "find it"}))
        .send()
        .await
        .unwrap();
    let messages = crate::serve::read_sse(response).await;
    let output = messages
        .iter()
        .find(|m| m.event.is_none() && m.kind() == "tool.done")
        .map(|m| m.json()["output"].clone())
        .expect("the search's outcome");
    assert_eq!(output[1]["url"], "https://a.example/2", "{output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_request_asks_before_a_method_that_changes_things_and_compose_cannot_skip_the_question() {
    let server = WireServer::responding(|_| Reply::new(200, "text/plain", "ok")).await;
    let url = server.url();
    let spec = |http_extra: &str| {
        format!(
            "model: mock
tools: [http_request]
http: {{ allow_loopback: true{http_extra} }}
mock:
  script:
    - tool_calls:
        - {{ name: http_request, input: {{ url: '{url}/read' }} }}
        - {{ name: http_request, input: {{ url: '{url}/orders', method: POST, body: {{ item: tea }} }} }}
    - text: 'Done.'
"
        )
    };
    // By default the GET runs and the POST waits for a human.
    let dir = agent_dir(&[("agent.yaml", &spec(""))]);
    let (events, code) = run_json(dir.path(), "order tea").await;
    assert_eq!(code, Some(5), "the run waits for a human: {events:?}");
    let asked = of_type(&events, "approval.requested");
    assert_eq!((asked.len(), asked[0]["input"]["method"].as_str()), (1, Some("POST")), "{asked:?}");
    let paths: Vec<String> = server.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/read"], "nothing is posted before the approval");

    // `http.approve_methods: []`: nothing asks.
    let dir = agent_dir(&[("agent.yaml", &spec(", approve_methods: []"))]);
    let (events, code) = run_json(dir.path(), "order tea").await;
    assert_eq!(code, Some(0), "{events:?}");
    assert!(of_type(&events, "approval.requested").is_empty());
    assert_eq!(server.requests().iter().filter(|r| r.method == "POST").count(), 1);

    // In a compose script the GET step runs; the POST step is refused, never run.
    let compose = format!(
        "model: mock
tools: [http_request, compose]
http: {{ allow_loopback: true }}
mock:
  script:
    - tool_calls:
        - name: compose
          input:
            steps:
              - {{ id: look, tool: http_request, input: {{ url: '{url}/composed-read' }} }}
              - {{ id: buy, tool: http_request, input: {{ url: '{url}/composed-order', method: POST }} }}
    - text: 'Could not.'
"
    );
    let dir = agent_dir(&[("agent.yaml", &compose)]);
    let (events, code) = run_json(dir.path(), "order tea").await;
    assert_eq!(code, Some(0), "{events:?}");
    let error = of_type(&events, "tool.error").into_iter().find(|e| e["callId"] == "call_0_0").cloned();
    let error = error.expect("the script's error");
    assert_eq!(error["code"], "KEEL_TOOL_REFUSED", "{error}");
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("step `buy`: this call of `http_request` needs a human's approval"),
        "{error}"
    );
    let paths: Vec<String> = server.requests().iter().map(|r| r.path.clone()).collect();
    assert!(
        paths.contains(&"/composed-read".to_owned()) && !paths.contains(&"/composed-order".to_owned()),
        "{paths:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_file_and_stat_work_in_the_workspace_and_a_delete_waits_for_approval() {
    let spec = |approve: bool| {
        format!(
            "model: mock
workspace: {{ path: ./data, mode: writable, approve_writes: {approve} }}
mock:
  script:
    - tool_calls: [{{ name: stat, input: {{ path: old.md }} }}]
    - tool_calls: [{{ name: delete_file, input: {{ path: old.md }} }}]
    - tool_calls: [{{ name: stat, input: {{ path: old.md }} }}]
    - text: 'Gone.'
"
        )
    };
    let dir = agent_dir(&[("agent.yaml", &spec(true)), ("data/old.md", "old notes\n")]);
    let (events, code) = run_json(dir.path(), "clean up").await;
    assert_eq!(code, Some(5), "the delete waits for a human: {events:?}");
    assert_eq!(of_type(&events, "approval.requested")[0]["tool"], "delete_file");
    let stat = &of_type(&events, "tool.done")[0]["output"];
    assert_eq!((stat["type"].as_str(), stat["size"].as_u64()), (Some("file"), Some(10)), "{stat}");
    assert!(dir.path().join("data/old.md").exists(), "nothing is deleted before the approval");

    let dir = agent_dir(&[("agent.yaml", &spec(false)), ("data/old.md", "old notes\n")]);
    let (events, code) = run_json(dir.path(), "clean up").await;
    assert_eq!(code, Some(0), "{events:?}");
    let outputs: Vec<&Value> = of_type(&events, "tool.done").iter().map(|e| &e["output"]).collect();
    assert_eq!(outputs[1]["deleted"], true, "{outputs:?}");
    assert_eq!(outputs[2]["exists"], false, "{outputs:?}");
    assert!(!dir.path().join("data/old.md").exists());

    // Served: the delete waits for a decision, and runs once it is approved.
    let dir = agent_dir(&[("agent.yaml", &spec(true)), ("data/old.md", "old notes\n")]);
    let served = crate::serve::Served::start(dir.path(), "memory", &[]);
    let http = crate::serve::client();
    let response = http
        .post(served.url("/chat"))
        .json(&serde_json::json!({"sessionId": "w", "input": "clean up"}))
        .send()
        .await
        .unwrap();
    let messages = crate::serve::read_sse(response).await;
    let asked = messages
        .iter()
        .find(|m| m.event.is_none() && m.kind() == "approval.requested")
        .map(|m| m.json())
        .expect("the delete asks");
    assert_eq!(asked["tool"], "delete_file");
    assert!(dir.path().join("data/old.md").exists());
    let decided = http
        .post(served.url(&format!("/chat/w/approvals/{}", asked["approvalId"].as_str().unwrap())))
        .json(&serde_json::json!({"approved": true}))
        .send()
        .await
        .unwrap();
    assert!(decided.status().is_success(), "{}", decided.text().await.unwrap());
    let messages = crate::serve::read_sse(decided).await;
    let outputs: Vec<Value> = messages
        .iter()
        .filter(|m| m.event.is_none() && m.kind() == "tool.done")
        .map(|m| m.json()["output"].clone())
        .collect();
    assert!(outputs.iter().any(|o| o["deleted"] == true), "{outputs:?}");
    assert!(!dir.path().join("data/old.md").exists());
}
