//! Hostile requests to `keel serve`: every route, with and without the token, random methods,
//! path parameters that try to escape, JSON bodies of hostile values (nested past the parser's
//! limit, cut short, not UTF-8, of the wrong types), wrong content types and odd headers. No
//! answer is a 5xx, every refusal says why with a stable code, and the server keeps serving.
//!
//! The server keeps its default store, a SQLite file. The requests come from a fixed seed, so
//! a failure repeats; `KEEL_HTTP_CASES=5000` sends more. The earlier stops' hand-run fuzzing of
//! 5,500 requests, kept.

use std::time::Duration;

use reqwest::{Method, header};
use serde_json::{Value, json};

use crate::serve::{APPROVAL_AGENT, Served, client, read_sse, sqlite};
use crate::support::agent_dir;

const TOKEN: &str = "hostile-test-token";

const CHANNEL: &str = "type: github\nsecret_env: HOSTILE_GH_SECRET\nevents: [issues.opened]\n";

/// Path parameters that try to reach something else.
const SEGMENTS: &[&str] = &[
    "s",
    "..",
    "..%2f..%2fetc%2fpasswd",
    "%00",
    "%ff%fe",
    "a%20b",
    "run_00000000000000000000000000000000",
    "%F0%9F%92%A5",
    "%E2%80%AE",
    "-",
    "x.json",
    "{session}",
    "*",
];

/// Routes and the method each answers, with `{}` for a path parameter.
const ROUTES: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/agent"),
    ("GET", "/sessions"),
    ("POST", "/chat"),
    ("GET", "/chat/{}"),
    ("GET", "/chat/{}/state"),
    ("DELETE", "/chat/{}/run"),
    ("GET", "/chat/{}/events"),
    ("POST", "/chat/{}/approvals/{}"),
    ("POST", "/runs"),
    ("GET", "/runs/{}"),
    ("DELETE", "/runs/{}"),
    ("POST", "/channels/{}"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/ai-sdk/chat"),
    ("POST", "/mcp"),
    ("GET", "/nowhere"),
];

/// A JSON value of hostile content, `depth` levels at most.
fn hostile_value(rng: &mut fastrand::Rng, depth: usize) -> Value {
    match rng.u8(..14) {
        0 => Value::Null,
        1 => json!(rng.bool()),
        2 => json!(rng.i64(..)),
        3 => json!(f64::MAX),
        4 => json!("\u{0}\u{202e}\u{feff}"),
        5 => json!("x".repeat(rng.usize(..100_000))),
        6 => json!("../../../etc/passwd"),
        7 => json!("{{payload}}"),
        8 => json!(""),
        9 if depth > 0 => Value::Array((0..rng.usize(..4)).map(|_| hostile_value(rng, depth - 1)).collect()),
        10 | 11 if depth > 0 => {
            let keys = ["input", "sessionId", "messages", "role", "content", "model", "stream", "id", "x"];
            let mut object = serde_json::Map::new();
            for _ in 0..rng.usize(..5) {
                object.insert(keys[rng.usize(..keys.len())].to_owned(), hostile_value(rng, depth - 1));
            }
            Value::Object(object)
        }
        _ => json!(rng.u32(..)),
    }
}

/// A request body: JSON that is almost right, or wrong in a way a parser must survive.
fn hostile_body(rng: &mut fastrand::Rng) -> Vec<u8> {
    match rng.u8(..10) {
        0 => Vec::new(),
        1 => {
            let levels = [127, 129, 100_000][rng.usize(..3)];
            format!("{{\"input\": {}1{}}}", "[".repeat(levels), "]".repeat(levels)).into_bytes()
        }
        2 => b"{\"input\": \"\xff\xfe not UTF-8\"}".to_vec(),
        3 => {
            let whole = serde_json::to_vec(&hostile_value(rng, 4)).unwrap();
            let cut = rng.usize(..=whole.len());
            whole[..cut].to_vec()
        }
        // Almost right: a chat, a decision, a completion, with one field hostile.
        4..=6 => {
            let mut body = [
                json!({"sessionId": "s", "input": "hello"}),
                json!({"decision": "approve"}),
                json!({"model": "keel", "messages": [{"role": "user", "content": "hi"}]}),
                json!({"messages": [{"id": "m", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}),
                json!({"input": "later", "at": "2030-01-01T00:00:00Z", "sessionId": "d"}),
            ][rng.usize(..5)]
            .clone();
            let keys: Vec<String> = body.as_object().unwrap().keys().cloned().collect();
            let key = &keys[rng.usize(..keys.len())];
            body[key] = hostile_value(rng, 3);
            serde_json::to_vec(&body).unwrap()
        }
        _ => serde_json::to_vec(&hostile_value(rng, 5)).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_coded_4xx_answers_and_the_server_keeps_serving() {
    let cases: usize = std::env::var("KEEL_HTTP_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(600);
    let dir = agent_dir(&[("agent.yaml", APPROVAL_AGENT), ("channels/issues.yaml", CHANNEL)]);
    // The store `keel serve` keeps by default: a SQLite file.
    let server = Served::start(
        dir.path(),
        &sqlite(dir.path()),
        &[("KEEL_API_TOKEN", TOKEN), ("HOSTILE_GH_SECRET", "s3cret"), ("KEEL_LOG", "off")],
    );
    // Connections kept alive between requests, as a client's are: one whose request body the
    // server left unread (a refusal before it) is closed, and the answer must say so, or the
    // next request sent down it is lost.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::HEAD,
    ];
    let content_types = [
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "",
        "application/json; charset=latin1",
    ];
    let mut rng = fastrand::Rng::with_seed(0x6b65656c_68747470);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..cases {
        let (route_method, route) = ROUTES[rng.usize(..ROUTES.len())];
        let mut path = route.to_owned();
        while path.contains("{}") {
            path = path.replacen("{}", SEGMENTS[rng.usize(..SEGMENTS.len())], 1);
        }
        if rng.u8(..5) == 0 {
            path.push_str(
                ["?after=-1", "?limit=99999999999", "?x=%00", "?state=running&state=done"][rng.usize(..4)],
            );
        }
        // Mostly the route's own method, to reach its handler; sometimes any.
        let method = if rng.u8(..5) == 0 {
            methods[rng.usize(..methods.len())].clone()
        } else {
            Method::from_bytes(route_method.as_bytes()).unwrap()
        };
        let body = hostile_body(&mut rng);
        let mut request = http.request(method.clone(), server.url(&path)).body(body.clone());
        let content_type = content_types[rng.usize(..content_types.len())];
        if !content_type.is_empty() {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        match rng.u8(..10) {
            0 => {}
            1 => request = request.header(header::AUTHORIZATION, "Bearer wrong-token"),
            2 => request = request.header(header::AUTHORIZATION, "Basic aG9zdGlsZQ=="),
            _ => request = request.bearer_auth(TOKEN),
        }
        if rng.u8(..4) == 0 {
            request = request
                .header("last-event-id", ["-1", "99999999999999999999999", "abc", "1,2"][rng.usize(..4)]);
        }
        if rng.u8(..6) == 0 {
            request = request.header("x-github-event", "issues").header("x-hub-signature-256", "sha256=00");
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(error) => {
                let alive =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.child.id() as i32), None)
                        .is_ok();
                panic!("case {case}: {method} {path}: {error:?}; the server is alive: {alive}")
            }
        };
        let status = response.status().as_u16();
        *statuses.entry(status).or_default() += 1;
        let is_json = response
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.to_str().unwrap_or_default().starts_with("application/json"));
        let is_stream = response
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.to_str().unwrap_or_default().starts_with("text/event-stream"));
        let shown = format!("case {case}: {method} {path} ({} bytes of body) -> {status}", body.len());
        if is_stream {
            // A chat that started (its events end when it waits for approval) or a session's
            // live events (they never end): read for a while, then hang up.
            assert_eq!(status, 200, "{shown}");
            let _ = tokio::time::timeout(Duration::from_secs(2), response.bytes()).await;
            continue;
        }
        let text = response.text().await.unwrap_or_default();
        assert!(status < 500, "{shown}: {text}");
        if status >= 400 && is_json && method != Method::HEAD {
            let error: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{shown}: {e}: {text}"));
            // keel's own routes give a `KEEL_` code; the OpenAI-compatible ones OpenAI's form.
            let code = error["error"]["code"].as_str().unwrap_or_default();
            let openai = path.starts_with("/v1/") && error["error"]["message"].is_string();
            assert!(code.starts_with("KEEL_") || openai, "{shown}: {text}");
        }
    }
    // Refusals of each kind, and some chats that ran.
    for expected in [400, 401, 404, 405] {
        assert!(statuses.get(&expected).is_some_and(|n| *n > 0), "no {expected} in {statuses:?}");
    }
    // Alive and not wedged: a plain chat runs to its approval.
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().status(), 200);
    let chat = client()
        .post(server.url("/chat"))
        .bearer_auth(TOKEN)
        .json(&json!({"sessionId": "after-the-storm", "input": "what day is it?"}))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    let events = read_sse(chat).await;
    assert!(events.iter().any(|e| e.kind() == "approval.requested"), "{events:?}");
}
