//! `keel serve` over real HTTP: the real binary on a free port, a real client.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::agent_dir;

/// A `keel serve` process, killed when dropped.
pub(crate) struct Served {
    pub(crate) child: Child,
    base: String,
}

impl Served {
    pub(crate) fn start(agent: &Path, store: &str, env: &[(&str, &str)]) -> Served {
        Served::start_with_args(agent, &["--store", store], env)
    }

    /// `keel serve <agent> --port 0 <args>`.
    pub(crate) fn start_with_args(agent: &Path, args: &[&str], env: &[(&str, &str)]) -> Served {
        let mut command = Command::new(crate::support::served_keel_binary());
        command
            .arg("serve")
            .arg(agent)
            .args(["--port", "0"])
            .args(args)
            .current_dir(agent)
            .env_remove("KEEL_API_TOKEN")
            .env_remove("KEEL_STORE")
            .env_remove("HOST")
            .env_remove("PORT")
            .env("KEEL_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        Served::spawn(command)
    }

    /// Starts `command`, a `keel serve` (or an artifact of `keel build` serving), and waits
    /// for the address it prints.
    pub(crate) fn spawn(mut command: Command) -> Served {
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut base = None;
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(at) = line.find("http://").filter(|_| line.starts_with("keel serve: agent")) {
                // A server on every address is reached on this machine's.
                let address = line[at..].split_whitespace().next().unwrap().replace("0.0.0.0", "127.0.0.1");
                base = Some(address);
                break;
            }
        }
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Served { child, base: base.expect("keel serve printed its address") }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `POST path` to `served` declaring a `content-length` of `length` but sending one byte of it:
/// the server's raw answer. Over a raw socket because the server answers an oversized body
/// and closes the connection without reading it, and a client still writing it would see a
/// broken pipe instead of the answer.
pub(crate) async fn post_declaring(served: &Served, path: &str, length: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = served.base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n{{"
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// One SSE message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sse {
    pub(crate) id: Option<String>,
    pub(crate) event: Option<String>,
    data: String,
}

impl Sse {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap()
    }
    /// The data as sent (`[DONE]` ends an OpenAI stream, and is no JSON).
    pub(crate) fn data(&self) -> &str {
        &self.data
    }
    pub(crate) fn kind(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// Parses complete SSE messages out of `buffer`, leaving an incomplete tail.
pub(crate) fn parse_sse(buffer: &mut String) -> Vec<Sse> {
    let mut messages = Vec::new();
    while let Some(end) = buffer.find("\n\n") {
        let block: String = buffer.drain(..end + 2).collect();
        let mut message = Sse { id: None, event: None, data: String::new() };
        let mut has_data = false;
        for line in block.lines() {
            if let Some(id) = line.strip_prefix("id: ").or_else(|| line.strip_prefix("id:")) {
                message.id = Some(id.to_owned());
            } else if let Some(event) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
                message.event = Some(event.to_owned());
            } else if let Some(data) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
                if has_data {
                    message.data.push('\n');
                }
                message.data.push_str(data);
                has_data = true;
            }
        }
        if has_data {
            messages.push(message);
        }
    }
    messages
}

/// Reads a whole SSE response.
pub(crate) async fn read_sse(response: reqwest::Response) -> Vec<Sse> {
    let mut text = response.text().await.unwrap();
    parse_sse(&mut text)
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

pub(crate) async fn error_of(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {text:?}"));
    (status, body["error"]["code"].as_str().unwrap().to_owned())
}

const DAY_AGENT: &str = "model: mock
tools: [day_name]
mock:
  script:
    - tool_calls: [{ name: day_name, input: {} }]
    - text: 'Today is {{last_tool_output}}.'
";

pub(crate) fn sqlite(dir: &Path) -> String {
    format!("sqlite:{}", dir.join("keel.db").display())
}

#[tokio::test]
async fn a_turn_streams_as_sse_and_the_transcript_follows() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().text().await.unwrap(), "ok");

    let response = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "s1", "input": "What day is it?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let messages = read_sse(response).await;
    let (last, events) = messages.split_last().unwrap();
    assert_eq!(last.event.as_deref(), Some("done"), "{messages:#?}");
    let kinds: Vec<String> = events.iter().map(Sse::kind).collect();
    assert_eq!(kinds.first().map(String::as_str), Some("run.start"));
    assert_eq!(kinds.last().map(String::as_str), Some("run.done"));
    assert!(kinds.contains(&"tool.done".to_owned()) && kinds.contains(&"text.delta".to_owned()), "{kinds:?}");
    let ids: Vec<u64> = events.iter().map(|m| m.id.as_deref().unwrap().parse().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids must increase: {ids:?}");
    let done = events.last().unwrap().json();
    assert!(done["text"].as_str().unwrap().starts_with("Today is "), "{done}");
    let tool_done = events.iter().find(|m| m.kind() == "tool.done").unwrap().json();
    assert!(tool_done["durationMs"].is_u64(), "how long the call ran: {tool_done}");

    let transcript: Value = http.get(server.url("/chat/s1")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["sessionId"], "s1");
    let roles: Vec<&str> =
        transcript["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(transcript["messages"][0]["content"][0], json!({"type": "text", "text": "What day is it?"}));
    assert_eq!(transcript["pending"], json!([]));
}

#[tokio::test]
async fn bad_requests_get_json_errors_with_codes_and_never_a_500() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let chat = server.url("/chat");
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        ("not declared JSON", http.post(&chat).body(r#"{"sessionId": "s", "input": "hi"}"#), 415, "KEEL_UNSUPPORTED_MEDIA_TYPE"),
        ("declared as text", http.post(&chat).header("content-type", "text/plain").body("{}"), 415, "KEEL_UNSUPPORTED_MEDIA_TYPE"),
        ("not JSON", http.post(&chat).header("content-type", "application/json").body("{nope"), 400, "KEEL_REQUEST_INVALID"),
        (
            "invalid UTF-8",
            http.post(&chat).header("content-type", "application/json; charset=utf-8").body(vec![b'{', 0xff, 0xfe, b'}']),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        ("no body", http.post(&chat).header("content-type", "application/json"), 400, "KEEL_REQUEST_INVALID"),
        ("an array", http.post(&chat).json(&json!([1])), 400, "KEEL_REQUEST_INVALID"),
        ("no session", http.post(&chat).json(&json!({"input": "hi"})), 400, "KEEL_REQUEST_INVALID"),
        ("no input", http.post(&chat).json(&json!({"sessionId": "s"})), 400, "KEEL_REQUEST_INVALID"),
        ("session a number", http.post(&chat).json(&json!({"sessionId": 7, "input": "hi"})), 400, "KEEL_REQUEST_INVALID"),
        ("input a number", http.post(&chat).json(&json!({"sessionId": "s", "input": 7})), 400, "KEEL_REQUEST_INVALID"),
        ("empty input", http.post(&chat).json(&json!({"sessionId": "s", "input": ""})), 400, "KEEL_REQUEST_INVALID"),
        (
            "unknown part",
            http.post(&chat).json(&json!({"sessionId": "s", "input": [{"type": "video"}]})),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        (
            "image not base64",
            http.post(&chat).json(&json!({"sessionId": "s", "input": [{"type": "image", "mediaType": "image/png", "data": "%%%"}]})),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        ("bad session id", http.post(&chat).json(&json!({"sessionId": "a b", "input": "hi"})), 400, "KEEL_SESSION_ID_INVALID"),
        (
            "huge session id",
            http.post(&chat).json(&json!({"sessionId": "x".repeat(100_000), "input": "hi"})),
            400,
            "KEEL_SESSION_ID_INVALID",
        ),
        ("unknown session", http.get(server.url("/chat/nobody")), 404, "KEEL_SESSION_NOT_FOUND"),
        ("bad id in path", http.get(server.url("/chat/a%20b")), 400, "KEEL_SESSION_ID_INVALID"),
        ("bad Last-Event-ID", http.get(server.url("/chat/s/events")).header("last-event-id", "x"), 400, "KEEL_REQUEST_INVALID"),
        ("no such route", http.get(server.url("/nope")), 404, "KEEL_NOT_FOUND"),
        ("wrong method", http.get(&chat), 405, "KEEL_METHOD_NOT_ALLOWED"),
        ("not pending", http.post(server.url("/chat/s/approvals/ap_1")).json(&json!({"approved": true})), 404, "KEEL_NOT_PENDING"),
        ("decision of the wrong type", http.post(server.url("/chat/s/approvals/ap_1")).json(&json!({"approved": "yes"})), 400, "KEEL_REQUEST_INVALID"),
        ("no run to cancel", http.delete(server.url("/chat/s/run")), 404, "KEEL_RUN_NOT_FOUND"),
        (
            "a verdict and an answer",
            http.post(server.url("/chat/s/approvals/ap_1")).json(&json!({"approved": true, "answer": "x"})),
            400,
            "KEEL_REQUEST_INVALID",
        ),
    ];
    for (what, request, status, code) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(error_of(response).await, (status, code.to_owned()), "{what}");
    }
    // Over 1 MB: answered from the declared length, before the body is read.
    let answer = post_declaring(&server, "/chat", 1_100_000).await;
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("KEEL_BODY_TOO_LARGE"), "{answer}");
}

#[tokio::test]
async fn a_body_that_ends_early_is_a_400_and_the_server_stays_up() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let address = server.base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
    socket
        .write_all(b"POST /chat HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"sessionId\":")
        .await
        .unwrap();
    socket.shutdown().await.unwrap();
    let mut reply = String::new();
    socket.read_to_string(&mut reply).await.unwrap();
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(reply.contains("KEEL_REQUEST_INVALID"), "{reply}");
    assert_eq!(client().get(server.url("/health")).send().await.unwrap().status(), 200);
}

/// Three turns, each after a pause: a run that lasts long enough to watch.
pub(crate) const SLOW_AGENT: &str = "model: mock
tools: [day_name]
mock:
  script:
    - { delay_ms: 300, tool_calls: [{ name: day_name, input: {} }] }
    - { delay_ms: 300, tool_calls: [{ name: day_name, input: {} }] }
    - { delay_ms: 300, text: 'It is still {{last_tool_output}}.' }
";

#[tokio::test]
async fn a_busy_session_is_409_and_a_run_can_be_cancelled() {
    let dir = agent_dir(&[("agent.yaml", SLOW_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let first =
        http.post(server.url("/chat")).json(&json!({"sessionId": "s", "input": "go"})).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "s", "input": "again"}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(second).await, (409, "KEEL_SESSION_BUSY".to_owned()));
    let cancelled = http.delete(server.url("/chat/s/run")).send().await.unwrap();
    assert_eq!(cancelled.status(), 200);
    let messages = read_sse(first).await;
    let done = messages.iter().find(|m| m.event.is_none() && m.kind() == "run.done").expect("run.done");
    assert_eq!(done.json()["stopped"], "cancelled");
    assert_eq!(messages.last().unwrap().event.as_deref(), Some("done"));
}

#[tokio::test]
async fn observers_see_every_event_once_and_a_reconnect_resumes_without_gaps() {
    let dir = agent_dir(&[("agent.yaml", SLOW_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    // Observer A watches the whole run; observer B drops out after two events and reconnects.
    let a = http.get(server.url("/chat/s/events")).send().await.unwrap();
    assert_eq!(a.status(), 200);
    let b = http.get(server.url("/chat/s/events")).send().await.unwrap();
    let run =
        http.post(server.url("/chat")).json(&json!({"sessionId": "s", "input": "go"})).send().await.unwrap();

    let mut b_seen = Vec::new();
    let mut buffer = String::new();
    let mut stream = b.bytes_stream();
    while b_seen.len() < 2 {
        let chunk = stream.next().await.unwrap().unwrap();
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        b_seen.extend(parse_sse(&mut buffer));
    }
    b_seen.truncate(2);
    drop(stream);
    // B is gone while the run goes on; it comes back with the last id it saw.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let last = b_seen.last().unwrap().id.clone().unwrap();
    let b_again = http.get(server.url("/chat/s/events")).header("last-event-id", &last).send().await.unwrap();

    let run_messages = read_sse(run).await;
    let run_events: Vec<Sse> = run_messages.into_iter().filter(|m| m.event.is_none()).collect();
    assert_eq!(run_events.last().unwrap().kind(), "run.done");

    let collect = |response: reqwest::Response, count: usize| async move {
        let mut seen = Vec::new();
        let mut buffer = String::new();
        let mut stream = response.bytes_stream();
        while seen.len() < count {
            let chunk =
                tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().unwrap().unwrap();
            buffer.push_str(std::str::from_utf8(&chunk).unwrap());
            seen.extend(parse_sse(&mut buffer));
        }
        seen
    };
    let a_seen = collect(a, run_events.len()).await;
    assert_eq!(a_seen, run_events, "an observer sees exactly the run's events");
    let b_rest = collect(b_again, run_events.len() - 2).await;
    let mut b_all = b_seen.clone();
    b_all.extend(b_rest);
    assert_eq!(b_all, run_events, "the reconnect has no gap and no duplicate");
}

pub(crate) const APPROVAL_AGENT: &str = "model: mock
tools: [day_name]
approvals: { tools: [day_name] }
mock:
  script:
    - tool_calls: [{ name: day_name, input: {} }]
    - text: 'Today is {{last_tool_output}}.'
";

#[tokio::test]
async fn an_approval_is_decided_over_http_and_the_continued_run_streams() {
    let dir = agent_dir(&[("agent.yaml", APPROVAL_AGENT)]);
    let store = sqlite(dir.path());
    let http = client();
    let approval_id = {
        let server = Served::start(dir.path(), &store, &[]);
        let messages = read_sse(
            http.post(server.url("/chat"))
                .json(&json!({"sessionId": "s", "input": "day?"}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        let requested =
            messages.iter().find(|m| m.event.is_none() && m.kind() == "approval.requested").unwrap().json();
        assert_eq!(
            messages.last().unwrap().event.as_deref(),
            Some("done"),
            "the stream ends while the run waits"
        );
        let metrics = http.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(
            metrics.contains("keel_human_inputs_total{kind=\"approval\",outcome=\"requested\"} 1"),
            "{metrics}"
        );
        requested["approvalId"].as_str().unwrap().to_owned()
        // The server stops here: the approval must outlive it.
    };
    let server = Served::start(dir.path(), &store, &[]);
    let transcript: Value = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["pending"][0]["id"], approval_id.as_str());
    assert_eq!(transcript["pending"][0]["tool"], "day_name");
    let url = server.url(&format!("/chat/s/approvals/{approval_id}"));
    let answer = http.post(&url).json(&json!({"answer": "yes"})).send().await.unwrap();
    assert_eq!(error_of(answer).await, (400, "KEEL_DECISION_INVALID".to_owned()));
    let continued =
        read_sse(http.post(&url).json(&json!({"approved": true, "note": "fine"})).send().await.unwrap())
            .await;
    let kinds: Vec<String> = continued.iter().filter(|m| m.event.is_none()).map(Sse::kind).collect();
    assert!(kinds.contains(&"tool.done".to_owned()), "{kinds:?}");
    assert!(!kinds.contains(&"approval.requested".to_owned()), "re-asked: {kinds:?}");
    assert_eq!(kinds.last().map(String::as_str), Some("run.done"));
    let again = http.post(&url).json(&json!({"approved": true})).send().await.unwrap();
    assert_eq!(error_of(again).await, (404, "KEEL_NOT_PENDING".to_owned()));
    // This server decided it (the request was made by the one before); refused decisions
    // are not counted.
    let metrics = http.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("keel_human_inputs_total{kind=\"approval\",outcome=\"approved\"} 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("outcome=\"requested\""), "{metrics}");
}

/// An approval nobody decides is timed out by the server's periodic recovery (its first pass
/// comes at once, the next within 10 s), counted in `/metrics`, and the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_that_times_out_on_a_server_is_counted() {
    let spec = APPROVAL_AGENT
        .replace("approvals: { tools: [day_name] }", "approvals: { tools: [day_name], timeout: 1s }");
    let dir = agent_dir(&[("agent.yaml", &spec)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let messages = read_sse(
        http.post(server.url("/chat"))
            .json(&json!({"sessionId": "s", "input": "day?"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(messages.iter().any(|m| m.event.is_none() && m.kind() == "approval.requested"), "{messages:?}");
    let line = "keel_human_inputs_total{kind=\"approval\",outcome=\"timed_out\"} 1";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let metrics = http.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
        if metrics.contains(line) || std::time::Instant::now() > deadline {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(metrics.contains(line), "{metrics}");
    assert!(
        metrics.contains("keel_human_inputs_total{kind=\"question\",outcome=\"timed_out\"} 0"),
        "{metrics}"
    );
    // The timed-out call was refused, and the run finished without it.
    let transcript: Value = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
    assert!(transcript["pending"].as_array().unwrap().is_empty(), "{transcript}");
    assert!(transcript.to_string().contains("approval timed out"), "{transcript}");
}

#[tokio::test]
async fn the_legacy_body_answers_with_json_and_a_deprecation_header() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let response =
        client().post(server.url("/chat")).json(&json!({"message": "What day?"})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["deprecation"], "true");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["stopped"], "final");
    assert!(body["text"].as_str().unwrap().starts_with("Today is "), "{body}");
}

#[tokio::test]
async fn input_can_be_content_parts_with_an_image() {
    let dir = agent_dir(&[("agent.yaml", "model: mock\n")]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let input = json!([
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "mediaType": "image/png", "data": "iVBORw0KGgo="}
    ]);
    let messages = read_sse(
        http.post(server.url("/chat")).json(&json!({"sessionId": "p", "input": input})).send().await.unwrap(),
    )
    .await;
    assert_eq!(messages.last().unwrap().event.as_deref(), Some("done"));
    let transcript: Value = http.get(server.url("/chat/p")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["messages"][0]["content"], input, "the parts are stored as sent");
}

#[tokio::test]
async fn with_a_token_every_route_but_health_needs_it() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_API_TOKEN", "s3cret-token")]);
    let http = client();
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().status(), 200);
    // The playground page holds no data: it loads without the token (and asks for it).
    let page = http.get(server.url("/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(page.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
    assert!(page.text().await.unwrap().contains("<title>keel playground</title>"));
    assert_eq!(error_of(http.post(server.url("/")).send().await.unwrap()).await.0, 401, "only GET / is open");
    let none = http.get(server.url("/chat/s")).send().await.unwrap();
    assert_eq!(none.headers()["www-authenticate"], "Bearer");
    assert_eq!(error_of(none).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    let wrong = http.get(server.url("/chat/s")).bearer_auth("s3cret-tokem").send().await.unwrap();
    assert_eq!(error_of(wrong).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    let prefix = http.get(server.url("/chat/s")).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(error_of(prefix).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    let chat = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "s", "input": "hi"}))
        .bearer_auth("s3cret-token")
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    assert_eq!(read_sse(chat).await.last().unwrap().event.as_deref(), Some("done"));
    let right = http.get(server.url("/chat/s")).bearer_auth("s3cret-token").send().await.unwrap();
    assert_eq!(right.status(), 200);
}

#[tokio::test]
async fn a_body_left_unread_closes_its_connection_and_the_answer_says_so() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_API_TOKEN", "s3cret-token")]);
    // One connection, kept alive between requests, as SDKs and proxies keep theirs.
    let http = reqwest::Client::builder().http1_only().pool_max_idle_per_host(1).build().unwrap();
    let large = json!({"sessionId": "s", "input": "x".repeat(300_000)});
    for turn in 0..5 {
        // Refused by auth before its 300 KB are read: more than hyper drains, so the server
        // closes the connection after answering, and must say so...
        let refused = http.post(server.url("/chat")).json(&large).send().await.unwrap();
        assert_eq!(refused.headers().get("connection").map(|v| v.to_str().unwrap()), Some("close"));
        assert_eq!(error_of(refused).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
        // ...or the client's next request goes down the closing connection and is lost.
        let chat = http
            .post(server.url("/chat"))
            .bearer_auth("s3cret-token")
            .json(&json!({"sessionId": format!("s{turn}"), "input": "hi"}))
            .send()
            .await
            .unwrap_or_else(|error| panic!("turn {turn}: the request after the refusal was lost: {error:?}"));
        assert_eq!(chat.headers().get("connection"), None, "a chat whose body was read keeps its connection");
        assert_eq!(read_sse(chat).await.last().unwrap().event.as_deref(), Some("done"));
    }
    // A body that was read, even one refused for what it holds, keeps the connection.
    let unreadable = http
        .post(server.url("/chat"))
        .bearer_auth("s3cret-token")
        .header("content-type", "application/json")
        .body(format!("{{\"sessionId\": \"s\", \"input\": \"{}\"", "y".repeat(300_000)))
        .send()
        .await
        .unwrap();
    assert_eq!(unreadable.headers().get("connection"), None);
    assert_eq!(error_of(unreadable).await.0, 400);
}

#[test]
fn a_public_address_without_auth_is_refused() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let output = crate::support::keel()
        .arg("serve")
        .arg(dir.path())
        .args(["--host", "0.0.0.0", "--port", "0", "--store", "memory"])
        .env_remove("KEEL_API_TOKEN")
        .timeout(Duration::from_secs(10))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to listen on 0.0.0.0") && stderr.contains("KEEL_API_TOKEN"),
        "{stderr}"
    );
}

/// A tool that takes a while: SIGTERM arrives while it runs.
const NAP_TOML: &str =
    "description = \"Naps\"\ncommand = [\"sh\", \"-c\", \"sleep 1; echo nap >> naps.txt; echo rested\"]\n";
const NAP_AGENT: &str = "model: mock
mock:
  script:
    - tool_calls: [{ name: nap, input: {} }]
    - text: 'Done: {{last_tool_output}}'
";

#[tokio::test]
async fn sigterm_stops_at_a_step_boundary_and_the_next_server_finishes_the_run() {
    let dir = agent_dir(&[("agent.yaml", NAP_AGENT), ("tools/nap.toml", NAP_TOML)]);
    let store = sqlite(dir.path());
    let http = client();
    let mut server = Served::start(dir.path(), &store, &[]);
    let stream =
        http.post(server.url("/chat")).json(&json!({"sessionId": "s", "input": "nap"})).send().await.unwrap();
    // Wait until the tool runs, then ask the server to stop.
    let mut buffer = String::new();
    let mut body = stream.bytes_stream();
    'started: while let Some(chunk) = body.next().await {
        buffer.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        for message in parse_sse(&mut buffer) {
            if message.event.is_none() && message.kind() == "tool.start" {
                break 'started;
            }
        }
    }
    nix::sys::signal::kill(server.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
    let started = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let status = server.child.wait().unwrap();
        drop(server);
        status
    })
    .await
    .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(8), "the shutdown took {:?}", started.elapsed());
    // The tool's step finished and was committed before the stop: the next server finishes the
    // run from its journal, without running the tool again.
    let server = Served::start(dir.path(), &store, &[]);
    let mut transcript = Value::Null;
    for _ in 0..100 {
        transcript = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
        if transcript["messages"].as_array().is_some_and(|m| m.len() == 4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let messages = transcript["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 4, "{transcript:#}");
    assert_eq!(messages[2]["content"][0]["output"], "rested");
    assert_eq!(messages[3]["content"][0]["text"], "Done: rested");
    assert_eq!(std::fs::read_to_string(dir.path().join("naps.txt")).unwrap(), "nap\n", "the tool ran twice");
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_leaves_the_run_going_and_can_replay_the_rest() {
    let dir = agent_dir(&[("agent.yaml", SLOW_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let response =
        http.post(server.url("/chat")).json(&json!({"sessionId": "s", "input": "go"})).send().await.unwrap();
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut first = Vec::new();
    while first.is_empty() {
        buffer.push_str(std::str::from_utf8(&stream.next().await.unwrap().unwrap()).unwrap());
        first = parse_sse(&mut buffer);
    }
    drop(stream);
    // The run goes on without its client; the rest of its events are replayed on request.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let last = first[0].id.clone().unwrap();
    let replay = http.get(server.url("/chat/s/events")).header("last-event-id", last).send().await.unwrap();
    let mut stream = replay.bytes_stream();
    let mut rest = Vec::new();
    while !rest.iter().any(|m: &Sse| m.kind() == "run.done") {
        let chunk =
            tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().unwrap().unwrap();
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        rest.extend(parse_sse(&mut buffer));
    }
    assert_eq!(first[0].kind(), "run.start");
    assert_eq!(
        rest[0].kind(),
        "turn.start",
        "the replay continues right after the last event seen: {rest:#?}"
    );
    let done = rest.last().unwrap().json();
    assert_eq!(done["stopped"], "final");
    let transcript: Value = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 6);
}

#[tokio::test]
async fn metrics_count_runs_calls_tokens_and_requests_and_requests_carry_an_id() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let response = http
        .post(server.url("/chat"))
        .header("x-request-id", "client-chosen-42")
        .json(&json!({"sessionId": "m", "input": "day?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-request-id"], "client-chosen-42");
    read_sse(response).await;
    let generated = http.get(server.url("/health")).send().await.unwrap();
    assert!(generated.headers()["x-request-id"].to_str().unwrap().starts_with("req-"));
    let metrics = http.get(server.url("/metrics")).send().await.unwrap();
    assert!(metrics.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = metrics.text().await.unwrap();
    for line in [
        "keel_runs_total{outcome=\"final\"} 1",
        "keel_model_calls_total 2",
        "keel_tool_calls_total{outcome=\"ok\"} 1",
        "keel_http_requests_total{route=\"/chat\",status=\"200\"} 1",
        "keel_open_streams 0",
        "keel_runs_in_flight 0",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    assert!(text.contains("keel_tokens_total{direction=\"input\"}"), "{text}");
    assert!(text.contains("keel_run_duration_seconds_bucket"), "{text}");
    assert!(text.contains("keel_http_request_duration_seconds_count{route=\"/health\"} 1"), "{text}");
}

#[tokio::test]
async fn the_openapi_document_describes_exactly_the_routes_the_server_has() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let doc: Value = http.get(server.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    let methods = ["get", "post", "put", "patch", "delete"];
    for (path, operations) in paths {
        let concrete = path.replace("{sessionId}", "s").replace("{id}", "ap_0");
        for method in methods {
            let documented = operations.get(method).is_some();
            let request = http.request(method.to_uppercase().parse().unwrap(), server.url(&concrete));
            let request = if method == "post" { request.json(&json!({})) } else { request };
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let code = if response.headers().get("content-type").is_some_and(|t| t == "application/json") {
                response
                    .json::<Value>()
                    .await
                    .ok()
                    .and_then(|b| b["error"]["code"].as_str().map(str::to_owned))
            } else {
                None
            };
            if documented {
                assert_ne!(
                    code.as_deref(),
                    Some("KEEL_NOT_FOUND"),
                    "{method} {path} is documented but not routed"
                );
                assert_ne!(status, 405, "{method} {path} is documented but not routed");
                let declared = operations[method]["responses"].as_object().unwrap();
                if status != 200 {
                    assert!(
                        declared.contains_key(&status.to_string()),
                        "{method} {path} answered {status}, not documented"
                    );
                }
            } else {
                assert_eq!(status, 405, "{method} {path} is routed but not documented");
            }
        }
    }
    // Every route the server has is in the document.
    for (method, path) in
        [("get", "/health"), ("get", "/metrics"), ("post", "/chat"), ("get", "/chat/{sessionId}/events")]
    {
        assert!(paths.get(path).and_then(|p| p.get(method)).is_some(), "{method} {path} is not documented");
    }
}

pub(crate) fn jwt(
    algorithm: jsonwebtoken::Algorithm,
    kid: Option<&str>,
    key: &jsonwebtoken::EncodingKey,
    claims: Value,
) -> String {
    let mut header = jsonwebtoken::Header::new(algorithm);
    header.kid = kid.map(str::to_owned);
    jsonwebtoken::encode(&header, &claims, key).unwrap()
}

pub(crate) fn in_an_hour() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600
}

#[tokio::test]
async fn jwt_subjects_own_their_sessions_and_see_nobody_elses() {
    let dir = agent_dir(&[("agent.yaml", APPROVAL_AGENT)]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(
        dir.path(),
        "memory",
        &[("KEEL_JWT_SECRET", secret), ("KEEL_JWT_ISSUER", "https://id.example")],
    );
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token = |sub: &str| {
        jwt(
            jsonwebtoken::Algorithm::HS256,
            None,
            &key,
            json!({"sub": sub, "exp": in_an_hour(), "iss": "https://id.example"}),
        )
    };
    let (alice, bob) = (token("alice"), token("bob"));
    let http = client();

    let messages = read_sse(
        http.post(server.url("/chat"))
            .bearer_auth(&alice)
            .json(&json!({"sessionId": "shared-name", "input": "day?"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let start = messages[0].json();
    assert_eq!(start["sessionId"], "shared-name", "clients see their own session id: {start}");
    let requested =
        messages.iter().find(|m| m.event.is_none() && m.kind() == "approval.requested").unwrap().json();
    let approval = requested["approvalId"].as_str().unwrap().to_owned();

    // Alice sees her session; Bob, asking for the same id, finds nothing of hers.
    let mine: Value = http
        .get(server.url("/chat/shared-name"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(mine["sessionId"], "shared-name");
    assert_eq!(mine["pending"][0]["sessionId"], "shared-name");
    let theirs = http.get(server.url("/chat/shared-name")).bearer_auth(&bob).send().await.unwrap();
    assert_eq!(error_of(theirs).await, (404, "KEEL_SESSION_NOT_FOUND".to_owned()));
    let steal = http
        .post(server.url(&format!("/chat/shared-name/approvals/{approval}")))
        .bearer_auth(&bob)
        .json(&json!({"approved": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(steal).await, (404, "KEEL_NOT_PENDING".to_owned()), "another user's approval");
    let cancel = http.delete(server.url("/chat/shared-name/run")).bearer_auth(&bob).send().await.unwrap();
    assert_eq!(error_of(cancel).await, (404, "KEEL_RUN_NOT_FOUND".to_owned()));
    // Bob's own session of that name is his: his turn runs while Alice's waits.
    let bobs = read_sse(
        http.post(server.url("/chat"))
            .bearer_auth(&bob)
            .json(&json!({"sessionId": "shared-name", "input": "hi"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(bobs.iter().any(|m| m.event.is_none() && m.kind() == "approval.requested"));

    // Bad tokens: expired, wrong issuer, wrong secret, not a JWT, `alg: none`.
    let past = in_an_hour() - 7200;
    let bad = [
        jwt(
            jsonwebtoken::Algorithm::HS256,
            None,
            &key,
            json!({"sub": "alice", "exp": past, "iss": "https://id.example"}),
        ),
        jwt(
            jsonwebtoken::Algorithm::HS256,
            None,
            &key,
            json!({"sub": "alice", "exp": in_an_hour(), "iss": "https://evil.example"}),
        ),
        jwt(
            jsonwebtoken::Algorithm::HS256,
            None,
            &jsonwebtoken::EncodingKey::from_secret(b"another-secret").unwrap(),
            json!({"sub": "alice", "exp": in_an_hour(), "iss": "https://id.example"}),
        ),
        "not-a-jwt".to_owned(),
        // {"alg":"none"}.{"sub":"alice","exp":9999999999}.
        "eyJhbGciOiJub25lIn0.eyJzdWIiOiJhbGljZSIsImV4cCI6OTk5OTk5OTk5OX0.".to_owned(),
    ];
    for token in bad {
        let response = http.get(server.url("/chat/shared-name")).bearer_auth(&token).send().await.unwrap();
        assert_eq!(error_of(response).await, (401, "KEEL_UNAUTHORIZED".to_owned()), "{token}");
    }
}

#[tokio::test]
async fn each_caller_lists_its_own_sessions_newest_first() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(
        dir.path(),
        &sqlite(dir.path()),
        &[("KEEL_JWT_SECRET", secret), ("KEEL_API_TOKEN", "the-api-token")],
    );
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token =
        |sub: &str| jwt(jsonwebtoken::Algorithm::HS256, None, &key, json!({"sub": sub, "exp": in_an_hour()}));
    let (alice, bob) = (token("alice"), token("bob"));
    let http = client();
    let chat = |who: String, session: &'static str| {
        let request = http.post(server.url("/chat")).bearer_auth(who);
        async move {
            let response =
                request.json(&json!({"sessionId": session, "input": "day?"})).send().await.unwrap();
            let messages = read_sse(response).await;
            assert!(messages.iter().any(|m| m.event.is_none() && m.kind() == "run.done"), "{session}");
        }
    };
    chat(alice.clone(), "first").await;
    chat(bob.clone(), "first").await;
    chat(alice.clone(), "second").await;
    chat("the-api-token".to_owned(), "shared").await;

    let list = |who: &str, query: &str| {
        let request = http.get(server.url(&format!("/sessions{query}"))).bearer_auth(who);
        async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            let body: Value = response.json().await.unwrap();
            body["sessions"].as_array().unwrap().clone()
        }
    };
    let ids = |sessions: &[Value]| -> Vec<String> {
        sessions.iter().map(|s| s["sessionId"].as_str().unwrap().to_owned()).collect()
    };
    let alices = list(&alice, "").await;
    assert_eq!(ids(&alices), ["second", "first"], "Alice's, newest first, and nobody else's");
    assert_eq!(alices[0]["messages"], 4, "{alices:?}");
    assert_eq!(alices[0]["runs"], 1);
    assert!(alices[0]["usage"]["inputTokens"].as_u64().unwrap() > 0);
    assert!(alices[0]["updatedAtMs"].as_u64().unwrap() >= alices[1]["updatedAtMs"].as_u64().unwrap());
    assert_eq!(ids(&list(&bob, "").await), ["first"]);
    assert_eq!(
        ids(&list("the-api-token", "").await),
        ["shared"],
        "the token reaches the sessions no subject owns"
    );
    assert_eq!(ids(&list(&alice, "?limit=1").await), ["second"]);

    for query in ["?limit=0", "?limit=1001", "?limit=many", "?owner=bob"] {
        let response =
            http.get(server.url(&format!("/sessions{query}"))).bearer_auth(&alice).send().await.unwrap();
        assert_eq!(error_of(response).await, (400, "KEEL_REQUEST_INVALID".to_owned()), "{query}");
    }
    let anonymous = http.get(server.url("/sessions")).send().await.unwrap();
    assert_eq!(error_of(anonymous).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
}

#[tokio::test]
async fn the_agent_route_names_the_agent_and_its_tools_but_not_its_instructions() {
    let dir = agent_dir(&[(
        "agent.yaml",
        "name: front-desk
description: Answers the door.
instructions: The secret handshake is 7-7-3.
model: mock
tools: [day_name, current_date]
approvals: { tools: [day_name] }
",
    )]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_API_TOKEN", "the-api-token")]);
    let http = client();
    let response = http.get(server.url("/agent")).send().await.unwrap();
    assert_eq!(error_of(response).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    let response = http.get(server.url("/agent")).bearer_auth("the-api-token").send().await.unwrap();
    let text = response.text().await.unwrap();
    assert!(!text.contains("7-7-3"), "the instructions leaked: {text}");
    let agent: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(agent["name"], "front-desk");
    assert_eq!(agent["description"], "Answers the door.");
    assert_eq!(agent["model"], "mock");
    assert_eq!(agent["outputSchema"], Value::Null);
    let tools = agent["tools"].as_array().unwrap();
    let tool =
        |name: &str| tools.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("{name}: {agent}"));
    assert_eq!(tool("day_name")["approval"], "always");
    assert_eq!(tool("current_date")["approval"], "never");
    assert!(tool("current_date")["description"].as_str().unwrap().len() > 10);
    assert_eq!(tool("current_date")["inputSchema"]["type"], "object");
}

#[tokio::test]
async fn rs256_and_es256_tokens_are_checked_against_a_jwks_file() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures");
    let jwks = fixtures.join("jwks.json");
    let server = Served::start(dir.path(), "memory", &[("KEEL_JWT_JWKS", jwks.to_str().unwrap())]);
    let rsa =
        jsonwebtoken::EncodingKey::from_rsa_pem(&std::fs::read(fixtures.join("rsa.pem")).unwrap()).unwrap();
    let ec =
        jsonwebtoken::EncodingKey::from_ec_pem(&std::fs::read(fixtures.join("ec.pem")).unwrap()).unwrap();
    let claims = json!({"sub": "carol", "exp": in_an_hour()});
    let http = client();
    for (what, token) in [
        ("RS256", jwt(jsonwebtoken::Algorithm::RS256, Some("rsa-1"), &rsa, claims.clone())),
        ("ES256", jwt(jsonwebtoken::Algorithm::ES256, Some("ec-1"), &ec, claims.clone())),
        ("ES256 without kid", jwt(jsonwebtoken::Algorithm::ES256, None, &ec, claims.clone())),
    ] {
        let response = http
            .post(server.url("/chat"))
            .bearer_auth(&token)
            .json(&json!({"sessionId": "c", "input": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{what}");
        read_sse(response).await;
    }
    // A key id the set does not have, and the RSA key claimed as the EC one, are refused.
    for token in [
        jwt(jsonwebtoken::Algorithm::RS256, Some("rsa-2"), &rsa, claims.clone()),
        jwt(jsonwebtoken::Algorithm::RS256, Some("ec-1"), &rsa, claims.clone()),
    ] {
        let response = http.get(server.url("/chat/c")).bearer_auth(&token).send().await.unwrap();
        assert_eq!(error_of(response).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    }
}

#[tokio::test]
async fn a_rate_limit_answers_429_with_retry_after() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_RATE_LIMIT", "5")]);
    let http = client();
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let response = http.get(server.url("/chat/nobody")).send().await.unwrap();
        if response.status() == 429 {
            let retry: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=60).contains(&retry), "{retry}");
            assert_eq!(error_of(response).await, (429, "KEEL_RATE_LIMITED".to_owned()));
            statuses.push(429);
        } else {
            statuses.push(response.status().as_u16());
        }
    }
    assert_eq!(statuses, [404, 404, 404, 404, 404, 429, 429, 429], "5 a minute, then refused");
    assert_eq!(
        http.get(server.url("/health")).send().await.unwrap().status(),
        200,
        "health is never limited"
    );
}

/// Serves a JWKS over HTTP: the RSA key alone at first, both keys once the EC key "rotates in".
/// Returns the URL and the count of fetches.
async fn jwks_server(fixtures: &Path) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let full: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("jwks.json")).unwrap()).unwrap();
    let rsa_only = json!({"keys": [full["keys"][0].clone()]});
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
    let fetches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&fetches);
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 4096];
            let _ = socket.read(&mut request).await;
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let body = if n == 0 { rsa_only.to_string() } else { full.to_string() };
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
        }
    });
    (url, fetches)
}

// Multi-threaded: the JWKS server must answer while this test blocks on starting keel serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_url_is_fetched_at_start_and_again_when_a_new_key_appears() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures");
    let (url, fetches) = jwks_server(&fixtures).await;
    let server = Served::start(dir.path(), "memory", &[("KEEL_JWT_JWKS", url.as_str())]);
    assert_eq!(fetches.load(std::sync::atomic::Ordering::SeqCst), 1, "fetched at start");
    let rsa =
        jsonwebtoken::EncodingKey::from_rsa_pem(&std::fs::read(fixtures.join("rsa.pem")).unwrap()).unwrap();
    let ec =
        jsonwebtoken::EncodingKey::from_ec_pem(&std::fs::read(fixtures.join("ec.pem")).unwrap()).unwrap();
    let claims = json!({"sub": "dana", "exp": in_an_hour()});
    let http = client();
    let with_rsa = jwt(jsonwebtoken::Algorithm::RS256, Some("rsa-1"), &rsa, claims.clone());
    let response = http.get(server.url("/chat/d")).bearer_auth(&with_rsa).send().await.unwrap();
    assert_eq!(error_of(response).await, (404, "KEEL_SESSION_NOT_FOUND".to_owned()), "authenticated");
    // The EC key is new to the server: the JWKS is fetched again, and now it verifies.
    let with_ec = jwt(jsonwebtoken::Algorithm::ES256, Some("ec-1"), &ec, claims.clone());
    let response = http.get(server.url("/chat/d")).bearer_auth(&with_ec).send().await.unwrap();
    assert_eq!(
        error_of(response).await,
        (404, "KEEL_SESSION_NOT_FOUND".to_owned()),
        "the rotated-in key is accepted"
    );
    assert_eq!(fetches.load(std::sync::atomic::Ordering::SeqCst), 2);
    // An unknown key id does not make the server fetch again and again.
    let unknown = jwt(jsonwebtoken::Algorithm::RS256, Some("rsa-9"), &rsa, claims);
    for _ in 0..3 {
        let response = http.get(server.url("/chat/d")).bearer_auth(&unknown).send().await.unwrap();
        assert_eq!(error_of(response).await, (401, "KEEL_UNAUTHORIZED".to_owned()));
    }
    assert_eq!(fetches.load(std::sync::atomic::Ordering::SeqCst), 2, "refetches are rate-limited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_carries_many_event_streams_on_one_connection() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    // 300 observers of one session, multiplexed on one HTTP/2 connection.
    let mut observers = Vec::new();
    for _ in 0..300 {
        let response = h2.get(server.url("/chat/h2/events")).send().await.unwrap();
        assert_eq!(response.version(), reqwest::Version::HTTP_2);
        assert_eq!(response.status(), 200);
        observers.push(response);
    }
    let run =
        h2.post(server.url("/chat")).json(&json!({"sessionId": "h2", "input": "day?"})).send().await.unwrap();
    assert_eq!(run.version(), reqwest::Version::HTTP_2);
    let messages = read_sse(run).await;
    assert_eq!(messages.last().unwrap().event.as_deref(), Some("done"));
    let expected = messages.len() - 1;
    for observer in observers {
        let mut stream = observer.bytes_stream();
        let mut buffer = String::new();
        let mut seen = Vec::new();
        while seen.len() < expected {
            let chunk =
                tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().unwrap().unwrap();
            buffer.push_str(std::str::from_utf8(&chunk).unwrap());
            seen.extend(parse_sse(&mut buffer));
        }
        assert_eq!(seen.last().unwrap().kind(), "run.done");
    }
}

/// `keel serve 2> serve.log`: the log file holds plain text, its info lines included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_log_written_to_a_file_has_no_colour_codes() {
    let dir = agent_dir(&[("agent.yaml", DAY_AGENT)]);
    let log = dir.path().join("serve.log");
    let mut child = Command::new(crate::support::served_keel_binary())
        .args(["serve", ".", "--port", "0", "--store", &sqlite(dir.path())])
        .current_dir(dir.path())
        .env_remove("KEEL_LOG")
        .env_remove("HOST")
        .env_remove("PORT")
        .env_remove("KEEL_API_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let base = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(at) = text.find("http://") {
            break text[at..].split_whitespace().next().unwrap().to_owned();
        }
        assert!(std::time::Instant::now() < deadline, "keel serve did not start: {text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let response = client()
        .post(format!("{base}/chat"))
        .json(&json!({"sessionId": "s1", "input": "What day is it?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let _ = read_sse(response).await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("INFO") && text.contains("route=/chat"), "info lines by default: {text}");
    assert!(!text.contains('\u{1b}'), "colour codes in the file: {text:?}");
}
