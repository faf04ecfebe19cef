//! OpenTelemetry through the real binary: a tool-loop run's spans decoded by an OTLP receiver
//! built on the official protobuf definitions (PyPI opentelemetry-proto,
//! `tests/peers/otlp_receiver.py`), the caller's `traceparent` continued and passed on to the
//! model and to an HTTP tool, content only when asked, and a collector that is down.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel_testkit::{Reply, WireServer};
use serde_json::{Value, json};

use crate::memory::text_reply;
use crate::providers::{Wire, tool_call_stream};
use crate::serve::{Served, client, read_sse};
use crate::support::{agent_dir, keel, repo_root};

/// The receiver, stopped when dropped.
struct Receiver {
    child: Child,
    port: u16,
    spans: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    fn start() -> Receiver {
        let output = Command::new(repo_root().join("scripts/otel-peers.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("scripts/otel-peers.sh runs");
        assert!(
            output.status.success(),
            "scripts/otel-peers.sh failed: the test needs python3 -m venv and PyPI"
        );
        let python = Path::new(String::from_utf8(output.stdout).unwrap().trim()).join("bin/python");
        let dir = tempfile::tempdir().unwrap();
        let spans = dir.path().join("spans.jsonl");
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/peers/otlp_receiver.py"))
            .arg(&spans)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().strip_prefix("listening on ").unwrap().parse().unwrap();
        Receiver { child, port, spans, _dir: dir }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The spans received, waiting until at least `count` have come.
    fn wait_for(&self, count: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let spans: Vec<Value> = std::fs::read_to_string(&self.spans)
                .unwrap_or_default()
                .lines()
                .map(|line| serde_json::from_str(line).unwrap())
                .collect();
            if spans.len() >= count || Instant::now() > deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|span| span["name"] == name).collect()
}

/// OTLP's span kinds and status codes.
const INTERNAL: u64 = 1;
const CLIENT: u64 = 3;
const STATUS_ERROR: u64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_tool_loop_exports_its_span_tree_under_the_callers_trace_and_passes_it_on() {
    let receiver = Receiver::start();
    let page = WireServer::start(vec![Reply::new(200, "text/plain", "hello from the page")]).await;
    let page_url = format!("{}/page", page.url());
    let model = WireServer::start(vec![
        tool_call_stream(Wire::OpenAi, "call_page", "http_request", &json!({ "url": page_url }).to_string()),
        tool_call_stream(Wire::OpenAi, "call_fail", "fail", "{}"),
        text_reply("The page says hello."),
    ])
    .await;
    let dir = agent_dir(&[
        (
            "agent.yaml",
            &format!(
                "name: reader\nmodel: openai/fake\nprovider: {{ base_url: '{}/v1' }}\nretry: {{ max_attempts: 1 }}\n\
                 tools: [http_request]\nhttp: {{ allow_loopback: true }}\n",
                model.url()
            ),
        ),
        (
            "tools/fail.toml",
            "description = \"Fails\"\ncommand = [\"sh\", \"-c\", \"echo broken >&2; exit 7\"]\n",
        ),
    ]);
    let store = crate::serve::sqlite(dir.path());
    let served = Served::start(
        dir.path(),
        &store,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OPENAI_API_KEY", "sk-fake"),
        ],
    );
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller = "00f067aa0ba902b7";
    let response = client()
        .post(served.url("/chat"))
        .header("traceparent", format!("00-{trace}-{caller}-01"))
        .json(&json!({"sessionId": "s1", "input": "What does the page say?"}))
        .send()
        .await
        .unwrap();
    let events = read_sse(response).await;
    let done = events.iter().map(crate::serve::Sse::json).find(|e| e["type"] == "run.done").unwrap();
    assert_eq!(done["text"], "The page says hello.");

    let spans = receiver.wait_for(6);
    assert_eq!(spans.len(), 6, "one invoke_agent, three chats, two tools: {spans:#?}");
    assert!(spans.iter().all(|span| span["trace_id"] == trace), "one trace, the caller's: {spans:#?}");
    assert!(spans.iter().all(|span| span["service"] == "keel"));

    let agent = named(&spans, "invoke_agent reader");
    assert_eq!(agent.len(), 1, "{spans:#?}");
    let agent = agent[0];
    assert_eq!(agent["parent_span_id"], caller, "the run continues the caller's span");
    assert_eq!(agent["kind"], INTERNAL);
    let attributes = &agent["attributes"];
    assert_eq!(attributes["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(attributes["gen_ai.agent.name"], "reader");
    assert_eq!(attributes["gen_ai.conversation.id"], "s1");
    assert_eq!(attributes["gen_ai.system"], "openai");
    assert_eq!(attributes["gen_ai.usage.input_tokens"], 90, "40 + 40 + 10");
    assert_eq!(attributes["gen_ai.usage.output_tokens"], 19, "7 + 7 + 5");

    let chats = named(&spans, "chat fake");
    assert_eq!(chats.len(), 3, "{spans:#?}");
    let reasons: Vec<&Value> =
        chats.iter().map(|chat| &chat["attributes"]["gen_ai.response.finish_reasons"]).collect();
    assert_eq!(reasons, [&json!(["tool_calls"]), &json!(["tool_calls"]), &json!(["stop"])]);
    for chat in &chats {
        assert_eq!(chat["parent_span_id"], agent["span_id"]);
        assert_eq!(chat["kind"], CLIENT);
        let attributes = &chat["attributes"];
        assert_eq!(attributes["gen_ai.operation.name"], "chat");
        assert_eq!(attributes["gen_ai.request.model"], "fake");
        assert_eq!(attributes["gen_ai.provider.name"], "openai");
        assert!(attributes.get("gen_ai.input.messages").is_none(), "no content by default: {attributes}");
        assert!(attributes.get("gen_ai.output.messages").is_none(), "{attributes}");
    }
    assert_eq!(chats[2]["attributes"]["gen_ai.response.model"], "fake");
    assert_eq!(chats[2]["attributes"]["gen_ai.usage.input_tokens"], 10);
    assert_eq!(chats[2]["attributes"]["gen_ai.usage.output_tokens"], 5);

    let fetch = named(&spans, "execute_tool http_request");
    assert_eq!(fetch.len(), 1, "{spans:#?}");
    let fetch = fetch[0];
    assert_eq!(fetch["parent_span_id"], agent["span_id"]);
    assert_eq!(fetch["attributes"]["gen_ai.tool.name"], "http_request");
    assert_eq!(fetch["attributes"]["gen_ai.tool.call.id"], "call_page");
    assert_ne!(fetch["status_code"], STATUS_ERROR);
    assert!(fetch["attributes"].get("gen_ai.tool.call.arguments").is_none(), "no content by default");
    let failed = named(&spans, "execute_tool fail");
    assert_eq!(failed.len(), 1, "{spans:#?}");
    assert_eq!(failed[0]["status_code"], STATUS_ERROR, "{:#?}", failed[0]);
    assert_eq!(failed[0]["attributes"]["error.type"], "KEEL_TOOL_FAILED");
    assert!(failed[0]["status_message"].as_str().unwrap().contains("broken"), "{:#?}", failed[0]);

    // Each model request carried its own chat span's context; the page request, the tool's.
    let sent: Vec<String> = model
        .requests()
        .iter()
        .map(|request| request.header("traceparent").unwrap_or_default().to_owned())
        .collect();
    let expected: Vec<String> =
        chats.iter().map(|chat| format!("00-{trace}-{}-01", chat["span_id"].as_str().unwrap())).collect();
    assert_eq!(sent, expected);
    let page_request = page.only_request();
    assert_eq!(
        page_request.header("traceparent"),
        Some(format!("00-{trace}-{}-01", fetch["span_id"].as_str().unwrap()).as_str())
    );
}

#[test]
fn content_is_recorded_only_when_asked_and_a_protocol_keel_cannot_speak_stops_it_at_start() {
    let receiver = Receiver::start();
    let output = keel()
        .args(["run"])
        .arg(repo_root().join("examples/assistant"))
        .arg("What day is it?")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("KEEL_OTEL_RECORD_CONTENT", "true")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    // `keel run` sends its spans as it exits: they are there already.
    let spans = receiver.wait_for(4);
    let tool = named(&spans, "execute_tool day_name");
    assert_eq!(tool.len(), 1, "{spans:#?}");
    assert_eq!(tool[0]["attributes"]["gen_ai.tool.call.arguments"], "{}");
    let weekday = tool[0]["attributes"]["gen_ai.tool.call.result"].as_str().unwrap().to_owned();
    assert!(crate::support::weekdays_now().iter().any(|day| weekday.contains(day.as_str())), "{weekday}");
    let chats = named(&spans, "chat mock");
    assert_eq!(chats.len(), 2, "{spans:#?}");
    let input = chats[0]["attributes"]["gen_ai.input.messages"].as_str().unwrap();
    assert!(input.contains("What day is it?"), "{input}");
    let output_messages = chats[1]["attributes"]["gen_ai.output.messages"].as_str().unwrap();
    assert!(output_messages.contains("Today is"), "{output_messages}");
    assert_eq!(chats[1]["attributes"]["gen_ai.response.model"], "mock");

    let grpc = keel()
        .args(["run"])
        .arg(repo_root().join("examples/assistant"))
        .arg("hi")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .output()
        .unwrap();
    assert_eq!(grpc.status.code(), Some(1), "{grpc:?}");
    let said = String::from_utf8_lossy(&grpc.stderr);
    assert!(said.contains("error[KEEL_CONFIG_INVALID]: OTEL_EXPORTER_OTLP_PROTOCOL=grpc"), "{said}");
    assert!(said.contains("http/protobuf"), "what to do: {said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_one_warning_and_counted_spans_never_a_run() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("http://127.0.0.1:{closed}");
    let output = keel()
        .args(["run"])
        .arg(repo_root().join("examples/assistant"))
        .arg("What day is it?")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("KEEL_LOG", "warn")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("Today is "), "{output:?}");
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(said.matches("cannot send spans to the OTLP collector").count(), 1, "one warning: {said}");

    let dir = agent_dir(&[("agent.yaml", "model: mock\n")]);
    let served = Served::start(
        dir.path(),
        &crate::serve::sqlite(dir.path()),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    for session in ["a", "b"] {
        let response = client()
            .post(served.url("/chat"))
            .json(&json!({"sessionId": session, "input": "hi"}))
            .send()
            .await
            .unwrap();
        let events = read_sse(response).await;
        assert!(events.iter().any(|e| e.json()["type"] == "run.done"), "the run is unaffected: {events:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let dropped = loop {
        let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let dropped: u64 = metrics
            .lines()
            .find_map(|line| line.strip_prefix("keel_otel_spans_dropped_total "))
            .map_or(0, |value| value.trim().parse().unwrap());
        if dropped >= 4 || Instant::now() > deadline {
            break dropped;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(dropped >= 4, "two runs' spans (an agent and a chat each) counted as dropped: {dropped}");
}
