//! `web_fetch`: a page's main content as Markdown, links kept, behind the same guard as
//! `http_request`.

use std::sync::Arc;

use keel_core::error::ErrorCode;
use keel_core::{SessionState, Tool, ToolContext, ToolError};
use keel_testkit::{Reply, WireServer};
use keel_tools::GuardedClient;
use keel_tools::net::{NetPolicy, SystemLookup};
use keel_tools::web_fetch::WebFetch;
use serde_json::{Value, json};

const ARTICLE: &str = r#"<!doctype html>
<html><head><title>Durable agents | Example Blog</title></head>
<body>
  <nav><a href="/">Home</a> <a href="/about">About</a> <a href="/login">Log in</a></nav>
  <div class="sidebar ad">Buy our stuff! <a href="/shop">Shop</a></div>
  <article>
    <h1>Durable agents</h1>
    <p>An agent that crashes in the middle of a tool call should not pay for the same model call twice.
       Each step is journaled before the next one starts, which is what a <a href="https://example.org/journal">journal</a> is for.</p>
    <p>When the process restarts, the run is replayed from the journal: completed steps return their
       recorded results, and only the interrupted step runs again, with an idempotency key.</p>
    <h2>Approvals</h2>
    <p>A risky tool waits for a human. The wait can last days; nothing is lost when the process exits,
       because the pending approval is stored with the run and decided by any process later.</p>
    <ul><li>Approve</li><li>Reject, with a note</li></ul>
  </article>
  <footer>Copyright 2026 · <a href="/privacy">Privacy</a></footer>
  <script>var tracking = "do not show me";</script>
</body></html>"#;

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("t"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "c".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

fn tool(allow_loopback: bool) -> WebFetch {
    WebFetch::new(GuardedClient::with_lookup(
        NetPolicy { allow_loopback, ..NetPolicy::default() },
        Arc::new(SystemLookup),
    ))
}

async fn fetch(tool: &WebFetch, input: Value) -> Result<Value, ToolError> {
    tool.call(input, &ctx()).await
}

#[tokio::test]
async fn a_page_becomes_markdown_of_its_main_content_with_links() {
    let server = WireServer::start(vec![
        Reply::new(200, "text/html; charset=utf-8", ARTICLE),
        Reply::new(200, "text/plain", "plain text stays plain"),
        Reply::new(200, "application/pdf", "%PDF-1.7"),
        Reply::new(404, "text/html", "<h1>Not found</h1>"),
        Reply::new(200, "text/html", ARTICLE),
    ])
    .await;
    let tool = tool(true);
    let page = fetch(&tool, json!({"url": format!("{}/posts/durable", server.url())})).await.unwrap();
    assert_eq!(page["title"], "Durable agents | Example Blog");
    let content = page["content"].as_str().unwrap();
    assert!(content.contains("should not pay for the same model call twice"), "{content}");
    assert!(content.contains("[journal](https://example.org/journal)"), "links are kept: {content}");
    assert!(content.contains("\n## Approvals\n") && content.contains("\n- Reject, with a note"), "{content}");
    assert!(!content.contains("do not show me"), "scripts are dropped: {content}");
    assert!(!content.contains("Buy our stuff"), "the sidebar is not main content: {content}");

    let text = fetch(&tool, json!({"url": server.url()})).await.unwrap();
    assert_eq!(text["content"], "plain text stays plain");
    let pdf = fetch(&tool, json!({"url": server.url()})).await.unwrap_err();
    assert!(pdf.message.contains("application/pdf"), "{}", pdf.message);
    let missing = fetch(&tool, json!({"url": server.url()})).await.unwrap_err();
    assert!(missing.message.contains("HTTP 404"), "{}", missing.message);
    let short = fetch(&tool, json!({"url": server.url(), "max_chars": 100})).await.unwrap();
    assert_eq!(short["content"].as_str().unwrap().chars().count(), 100);
    assert!(short["truncated"].is_string());
}

#[tokio::test]
async fn the_same_guard_as_http_request_applies() {
    let server = WireServer::start(vec![Reply::new(200, "text/html", ARTICLE)]).await;
    let tool = tool(false);
    for url in [server.url(), "http://169.254.169.254/latest/meta-data/".into(), "file:///etc/passwd".into()]
    {
        let error = fetch(&tool, json!({ "url": url })).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "{url}: {}", error.message);
    }
    assert!(server.requests().is_empty());
}

/// A page built to wreck a parser: 20,000 nested tables (300 KB) overflowed the stack of the
/// thread reading it and aborted the process; nested lists came out as hundreds of megabytes
/// of indented Markdown. The page is read up to where it nests too deep.
#[tokio::test]
async fn a_page_nested_to_wreck_the_parser_is_read_up_to_where_it_does() {
    let hostile = |nest: &str, levels: usize| {
        ARTICLE.replace("<footer>", &format!("{}trap</footer>", nest.repeat(levels)))
    };
    let server = WireServer::start(vec![
        Reply::new(200, "text/html", hostile("<table><tr><td>", 20_000)),
        Reply::new(200, "text/html", hostile("<ul><li>x", 8_000)),
        Reply::new(200, "text/html", hostile("<div>", 100_000)),
    ])
    .await;
    let tool = tool(true);
    for _ in 0..3 {
        let page = fetch(&tool, json!({"url": server.url(), "max_chars": 200_000})).await.unwrap();
        let content = page["content"].as_str().unwrap();
        assert!(content.contains("should not pay for the same model call twice"), "{content}");
        assert!(!content.contains("trap"), "{content}");
        assert_eq!(
            page["truncated"],
            "the page nests its elements more than 256 levels deep; it was read up to there"
        );
    }
}
