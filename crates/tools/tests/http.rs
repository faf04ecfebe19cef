//! `http_request` against hostile input: every way of naming an internal address is refused
//! before a byte is sent, redirects are checked again, and a resolver cannot smuggle a private
//! address in. A real local server stands behind the loopback targets to prove nothing reaches
//! it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, SessionState, Tool, ToolContext, ToolError};
use keel_testkit::{Reply, WireServer};
use keel_tools::GuardedClient;
use keel_tools::http::HttpTool;
use keel_tools::net::{Lookup, NetPolicy};
use serde_json::{Value, json};

/// A resolver with fixed answers, in order.
struct FakeLookup(HashMap<&'static str, Vec<IpAddr>>);

impl Lookup for FakeLookup {
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        let answer = self
            .0
            .get(host.trim_end_matches('.'))
            .cloned()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such host"));
        Box::pin(async move { answer })
    }
}

fn lookup() -> Arc<FakeLookup> {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    Arc::new(FakeLookup(HashMap::from([
        ("internal.test", vec![ip("127.0.0.1")]),
        ("rebind.test", vec![ip("93.184.216.34"), ip("10.0.0.5")]),
        ("metadata.test", vec![ip("169.254.169.254")]),
        ("mapped.test", vec![ip("::ffff:10.0.0.1")]),
        ("127.0.0.1.nip.io", vec![ip("127.0.0.1")]),
        ("api.example.com", vec![ip("127.0.0.1")]),
        ("public.test", vec![ip("93.184.216.34")]),
    ])))
}

fn tool(policy: NetPolicy) -> HttpTool {
    HttpTool::new(GuardedClient::with_lookup(policy, lookup()))
}

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("t"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "c".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

async fn call(tool: &HttpTool, input: Value) -> Result<Value, ToolError> {
    tool.call(input, &ctx()).await
}

#[tokio::test]
async fn forty_and_more_hostile_targets_are_refused_and_nothing_reaches_the_server() {
    let server = WireServer::start(vec![Reply::new(200, "text/plain", "secret")]).await;
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let targets: Vec<String> = [
        "http://127.0.0.1/",
        "http://127.1/",
        "http://0/",
        "http://0.0.0.0/",
        "http://2130706433/",
        "http://0x7f000001/",
        "http://0x7f.0.0.1/",
        "http://0177.0.0.1/",
        "http://017700000001/",
        "http://%31%32%37.0.0.1/",
        "HTTP://127.0.0.1/",
        "http://[::1]/",
        "http://[::]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:7f00:1]/",
        "http://[0:0:0:0:0:ffff:127.0.0.1]/",
        "http://[::127.0.0.1]/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://localhost/",
        "http://localhost./",
        "http://LOCALHOST/",
        "http://foo.localhost/",
        "http://evil@127.0.0.1/",
        "http://user:pass@169.254.169.254/",
        "http://127.0.0.1#@evil.com/",
        "http://169.254.169.254/latest/meta-data/",
        "http://169.254.170.2/v2/credentials",
        "http://[fd00:ec2::254]/",
        "http://100.100.100.200/latest/meta-data/",
        "http://10.0.0.1/",
        "http://172.16.0.1/",
        "http://192.168.0.1/",
        "http://[fe80::1]/",
        "http://[fc00::1]/",
        "http://[64:ff9b::7f00:1]/",
        "http://224.0.0.1/",
        "http://255.255.255.255/",
        "http://240.0.0.1/",
        "http://198.18.0.1/",
        "http://192.0.2.1/",
        "http://[2001:db8::1]/",
        "http://[fec0::1]/",
        "http://[ff02::1]/",
        "http://internal.test/",
        "http://internal.test./",
        "http://rebind.test/",
        "http://metadata.test/latest/meta-data/",
        "http://mapped.test/",
        "http://127.0.0.1.nip.io/",
        "file:///etc/passwd",
        "ftp://example.com/",
        "gopher://127.0.0.1:70/",
        "data:text/plain,hello",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(
        [
            "http://127.0.0.1:PORT/",
            "http://localhost:PORT/",
            "http://[::ffff:127.0.0.1]:PORT/",
            "http://0x7f.1:PORT/",
            "http://evil.com@127.0.0.1:PORT/",
            "http://internal.test:PORT/",
        ]
        .map(|t| t.replace("PORT", &port)),
    )
    .collect();
    assert!(targets.len() >= 40);
    let tool = tool(NetPolicy::default());
    for target in &targets {
        let error = call(&tool, json!({ "url": target })).await.expect_err(target);
        assert_eq!(error.code, ErrorCode::ToolRefused, "{target}: {}", error.message);
        assert!(error.message.starts_with("refused: "), "{target}: {}", error.message);
    }
    assert!(server.requests().is_empty(), "a hostile target reached the server");

    // The reasons say what was wrong.
    let metadata = call(&tool, json!({"url": "http://metadata.test/"})).await.unwrap_err().message;
    assert!(
        metadata.contains("169.254.169.254 (the address of metadata.test) is a link-local address"),
        "{metadata}"
    );
    let rebind = call(&tool, json!({"url": "http://rebind.test/"})).await.unwrap_err().message;
    assert!(rebind.contains("10.0.0.5"), "one private address among public ones is enough: {rebind}");
    let loopback = call(&tool, json!({"url": "http://127.0.0.1/"})).await.unwrap_err().message;
    assert!(loopback.contains("http.allow_loopback"), "{loopback}");
}

#[tokio::test]
async fn requests_go_out_and_responses_come_back_capped() {
    let server = WireServer::start(vec![
        Reply::json(201, &json!({"id": 7})).header("x-request-id", "abc"),
        Reply::new(200, "text/plain; charset=utf-8", "é".repeat(100)),
        Reply::new(200, "application/octet-stream", vec![0u8, 159, 146, 150]),
    ])
    .await;
    let tool = tool(NetPolicy { allow_loopback: true, ..NetPolicy::default() });
    let created = call(
        &tool,
        json!({"url": format!("{}/items?x=1", server.url()), "method": "POST", "body": {"name": "tea"},
               "headers": {"Authorization": "Bearer t", "Host": "evil.internal"}}),
    )
    .await
    .unwrap();
    assert_eq!(created["status"], 201);
    assert_eq!(created["headers"]["x-request-id"], "abc");
    assert_eq!(serde_json::from_str::<Value>(created["body"].as_str().unwrap()).unwrap(), json!({"id": 7}));
    let sent = &server.requests()[0];
    assert_eq!((sent.method.as_str(), sent.path.as_str()), ("POST", "/items?x=1"));
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(sent.header("authorization"), Some("Bearer t"));
    assert_ne!(sent.header("host"), Some("evil.internal"), "the Host header is not the model's to set");
    assert_eq!(sent.json(), json!({"name": "tea"}));

    // 201 bytes of "é" cut at 51 bytes: the text up to the last whole character.
    let cut = call(&tool, json!({"url": server.url(), "max_bytes": 51})).await.unwrap();
    assert_eq!(cut["body"], "é".repeat(25));
    assert!(cut["truncated"].as_str().unwrap().contains("51 bytes"));

    let binary = call(&tool, json!({"url": server.url()})).await.unwrap();
    assert_eq!(binary["body_base64"], "AJ+Slg==");
}

#[tokio::test]
async fn redirects_are_checked_again() {
    let server = WireServer::start(vec![
        Reply::new(302, "text/plain", "").header("location", "http://169.254.169.254/latest/meta-data/"),
        Reply::new(301, "text/plain", "").header("location", "http://metadata.test/"),
        Reply::new(302, "text/plain", "").header("location", "file:///etc/passwd"),
        Reply::new(302, "text/plain", "").header("location", "/next"),
        Reply::new(200, "text/plain", "followed"),
    ])
    .await;
    let tool = tool(NetPolicy { allow_loopback: true, ..NetPolicy::default() });
    for expected in ["169.254.169.254", "metadata.test"] {
        let error = call(&tool, json!({"url": server.url()})).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "{}", error.message);
        assert!(error.message.contains(expected), "{}", error.message);
    }
    // A redirect to another scheme is not followed: the model gets the 302 itself.
    let not_followed = call(&tool, json!({"url": server.url()})).await.unwrap();
    assert_eq!(not_followed["status"], 302);
    assert_eq!(not_followed["headers"]["location"], "file:///etc/passwd");
    let followed = call(&tool, json!({"url": server.url()})).await.unwrap();
    assert_eq!((followed["status"].as_u64(), followed["body"].as_str()), (Some(200), Some("followed")));
    assert!(followed["url"].as_str().unwrap().ends_with("/next"));
}

#[tokio::test]
async fn the_allowlist_admits_named_hosts_only() {
    let server = WireServer::start(vec![Reply::new(200, "text/plain", "hello from api")]).await;
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let tool = tool(NetPolicy { allow: vec!["*.example.com".into()], allow_loopback: true });
    let ok = call(&tool, json!({"url": format!("http://api.example.com:{port}/")})).await.unwrap();
    assert_eq!(ok["body"], "hello from api");
    for outside in [
        "http://example.com/",
        "http://public.test/",
        "http://api.example.com.evil.test/",
        "http://127.0.0.1/",
    ] {
        let error = call(&tool, json!({"url": outside})).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "{outside}");
        assert!(error.message.contains("http.allow"), "{outside}: {}", error.message);
    }
}

#[tokio::test]
async fn a_slow_server_times_out_and_bad_input_is_explained() {
    let server = WireServer::start(vec![Reply::new(200, "text/plain", "never").hang_after(0)]).await;
    let tool = tool(NetPolicy { allow_loopback: true, ..NetPolicy::default() });
    let error = call(&tool, json!({"url": server.url(), "timeout_ms": 200})).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::ToolTimeout, "{}", error.message);
    let error = call(&tool, json!({"url": "not a url"})).await.unwrap_err();
    assert!(error.message.contains("invalid URL"), "{}", error.message);
    let error = call(&tool, json!({"url": server.url(), "headers": {"X-Bad": "a\nb"}})).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::ToolInputInvalid);
    let unknown = call(&tool, json!({"url": "http://nowhere.invalid/"})).await.unwrap_err();
    assert!(unknown.message.contains("cannot resolve nowhere.invalid"), "{}", unknown.message);
}
