//! The built-in tools in agent runs through `keel run` (mock-scripted model), with real
//! targets: a local HTTP server, a workspace directory, real processes.

use std::path::Path;
use std::time::Duration;

use keel_testkit::{Reply, WireServer};
use serde_json::Value;

use crate::support::{agent_dir, keel};

/// Runs `keel run DIR INPUT --json` off the async runtime; the events and the exit code.
async fn run_json(dir: &Path, input: &str) -> (Vec<Value>, Option<i32>) {
    let dir = dir.to_owned();
    let input = input.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        keel()
            .current_dir(&dir)
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
tools: [http]
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
tools: [http]
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
