//! `browser` with a real headless Chromium (Debian's `chromium`, or `KEEL_BROWSER`): a page built
//! by its script read as Markdown, scraped, saved as a screenshot and a PDF; every way out of the
//! page checked by the SSRF guard (sub-resources, iframes, `fetch`, WebSockets, redirects, names
//! resolving inside), with nothing ever reaching a loopback listener; hostile pages (one that
//! never loads, one too large, an endless redirect chain) failing cleanly, the browser still
//! serving afterwards.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, SessionState, Tool, ToolContext, ToolError};
use keel_testkit::{Recorded, Reply, WireServer};
use keel_tools::browser::BrowserTool;
use keel_tools::net::{Lookup, NetPolicy};
use keel_tools::workspace::Workspace;
use serde_json::{Value, json};

/// Names the tests use, resolved without DNS.
struct FakeLookup(HashMap<&'static str, Vec<IpAddr>>);

impl Lookup for FakeLookup {
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        let found = self.0.get(host).cloned();
        Box::pin(async move { found.ok_or_else(|| std::io::Error::other(format!("no such host {host}"))) })
    }
}

fn lookup() -> Arc<FakeLookup> {
    let ip = |text: &str| text.parse::<IpAddr>().unwrap();
    Arc::new(FakeLookup(HashMap::from([
        ("site.test", vec![ip("127.0.0.1")]),
        ("loop.test", vec![ip("127.0.0.1")]),
        ("metadata.test", vec![ip("169.254.169.254")]),
        ("private.test", vec![ip("10.0.0.5")]),
    ])))
}

/// The tool as a page on `site.test` (the test server, on loopback) may be read: only the hosts
/// listed, so the loopback listener of the tests stays out of reach. `metadata.test` and
/// `private.test` are listed too: their addresses are refused by range, whatever the list says.
fn tool(artifacts: Option<Workspace>) -> BrowserTool {
    let policy = NetPolicy {
        allow: vec!["site.test".into(), "metadata.test".into(), "private.test".into()],
        allow_loopback: true,
    };
    BrowserTool::with_lookup(policy, lookup(), artifacts)
}

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("browsertest"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "call_1".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

/// The tests share the process's browser; one at a time, so that what one counts (the pages
/// open) is its own.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn call(tool: &BrowserTool, input: Value) -> Result<Value, ToolError> {
    assert!(
        keel_tools::browser::executable().is_some(),
        "these tests need Chromium: apt-get install chromium (or set KEEL_BROWSER)"
    );
    tool.call(input, &ctx()).await
}

/// A listener on loopback that counts every connection made to it: nothing may reach it.
struct Canary {
    port: u16,
    connections: Arc<AtomicUsize>,
}

async fn canary() -> Canary {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    Canary { port, connections }
}

fn port(server: &WireServer) -> String {
    server.url().rsplit(':').next().unwrap().to_owned()
}

const BUILT_BY_SCRIPT: &str = r#"<!doctype html><html><head><title>Built late</title></head><body>
<main id="app">Loading…</main>
<script>
  document.getElementById("app").innerHTML =
    "<article><h1>Durable agents</h1><p class='lead'>Every step is journaled before the next begins, so a crash repeats no paid call.</p>" +
    "<p>A risky tool waits for a human as long as it takes.</p><ul><li class='price'>$10</li><li class='price'>$20</li></ul></article>";
  document.title = "Built by script";
</script></body></html>"#;

#[tokio::test]
async fn a_page_built_by_its_script_is_read_scraped_and_saved() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server =
        WireServer::responding(|_| Reply::new(200, "text/html; charset=utf-8", BUILT_BY_SCRIPT)).await;
    let url = format!("http://site.test:{}/", port(&server));
    let dir = tempfile::tempdir().unwrap();
    let tool = tool(Some(Workspace::open(dir.path()).unwrap()));

    let page = call(&tool, json!({"op": "content", "url": url})).await.unwrap();
    assert_eq!(page["title"], "Built by script");
    let markdown = page["markdown"].as_str().unwrap();
    assert!(
        markdown.contains("Durable agents") && markdown.contains("a crash repeats no paid call"),
        "{markdown}"
    );
    assert!(!markdown.contains("Loading"), "{markdown}");

    let scraped =
        call(&tool, json!({"op": "scrape", "url": url, "selectors": [".price", "h1", "nothing", "[["]}))
            .await
            .unwrap();
    assert_eq!(scraped["results"][".price"], json!(["$10", "$20"]));
    assert_eq!(scraped["results"]["h1"], json!(["Durable agents"]));
    assert_eq!(scraped["results"]["nothing"], json!([]));
    assert!(scraped["results"]["[["]["error"].is_string(), "a bad selector says so: {scraped}");

    let shot = call(&tool, json!({"op": "screenshot", "url": url, "full_page": true})).await.unwrap();
    assert_eq!(shot["mediaType"], "image/png");
    let key = shot["key"].as_str().unwrap();
    assert!(key.starts_with("browser/") && key.ends_with(".png"), "{key}");
    let png = std::fs::read(dir.path().join(key)).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(shot["bytes"], png.len());
    let pdf = call(&tool, json!({"op": "pdf", "url": url})).await.unwrap();
    let saved = std::fs::read(dir.path().join(pdf["key"].as_str().unwrap())).unwrap();
    assert!(saved.starts_with(b"%PDF-"), "not a PDF");

    // Without a writable workspace there is nowhere to put them.
    let error = call(&self::tool(None), json!({"op": "screenshot", "url": url})).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::ToolRefused, "{}", error.message);
    assert!(error.message.contains("workspace"), "{}", error.message);
}

#[tokio::test]
async fn nothing_a_page_does_reaches_what_the_guard_refuses() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let canary = canary().await;
    let c = canary.port;
    let hostile = format!(
        r#"<!doctype html><html><head><title>Hostile</title>
<link rel="stylesheet" href="http://127.0.0.1:{c}/style.css">
<script src="http://localhost:{c}/script.js"></script></head><body>
<p>Hello.</p>
<img src="http://127.0.0.1:{c}/pixel.png">
<img src="http://169.254.169.254/latest/meta-data/">
<img src="http://metadata.test/latest/meta-data/">
<img src="http://private.test:{c}/">
<img src="http://loop.test:{c}/">
<iframe src="http://127.0.0.1:{c}/frame"></iframe>
<iframe src="http://[::1]:{c}/frame6"></iframe>
<script>
  fetch("http://127.0.0.1:{c}/fetch").catch(() => {{}});
  fetch("https://127.0.0.1:{c}/tls").catch(() => {{}});
  try {{ new WebSocket("ws://127.0.0.1:{c}/ws"); }} catch (e) {{}}
  navigator.sendBeacon("http://127.0.0.1:{c}/beacon", "x");
  setTimeout(() => {{ document.title = "Hostile, done"; }}, 300);
</script></body></html>"#
    );
    let server = WireServer::responding(move |request: &Recorded| match request.path.as_str() {
        "/to-loopback" => {
            Reply::new(302, "text/plain", "").header("location", &format!("http://127.0.0.1:{c}/"))
        }
        "/to-metadata" => Reply::new(302, "text/plain", "").header("location", "http://169.254.169.254/"),
        _ => Reply::new(200, "text/html; charset=utf-8", hostile.clone()),
    })
    .await;
    let site = format!("http://site.test:{}", port(&server));
    let tool = tool(None);

    let page = call(&tool, json!({"op": "content", "url": format!("{site}/")})).await.unwrap();
    assert!(page["markdown"].as_str().unwrap().contains("Hello."), "{page}");
    let blocked = page["blocked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap().to_owned())
        .collect::<Vec<_>>();
    let said = |needle: &str| blocked.iter().any(|b| b.contains(needle));
    assert!(said(&format!("127.0.0.1:{c}")), "{blocked:?}");
    assert!(said("169.254.169.254"), "{blocked:?}");
    assert!(
        said("metadata.test:80 (refused: 169.254.169.254 (the address of metadata.test) is a link-local"),
        "{blocked:?}"
    );
    assert!(said("private.test"), "{blocked:?}");
    assert!(said("loop.test"), "{blocked:?}");

    // A redirect out of the allowed hosts is refused as the first URL would be.
    for path in ["/to-loopback", "/to-metadata"] {
        let error = call(&tool, json!({"op": "content", "url": format!("{site}{path}")})).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "{path}: {}", error.message);
    }
    // Under the default policy loopback is out of reach, by address or by a name resolving there.
    let strict = BrowserTool::with_lookup(NetPolicy::default(), lookup(), None);
    for url in [
        format!("http://127.0.0.1:{c}/"),
        format!("http://loop.test:{c}/"),
        "http://metadata.test/".to_owned(),
        "file:///etc/passwd".to_owned(),
    ] {
        let error = call(&strict, json!({"op": "content", "url": url})).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "{url}: {}", error.message);
    }
    assert_eq!(canary.connections.load(Ordering::SeqCst), 0, "something reached the loopback listener");
}

#[tokio::test]
async fn hostile_pages_fail_cleanly_and_the_browser_serves_on() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = WireServer::responding(|request: &Recorded| match request.path.as_str() {
        "/never" => Reply::new(200, "text/html", "<html><body>Still loading".repeat(10)).hang_after(30),
        "/huge" => Reply::new(200, "text/html", vec![b'a'; 8 * 1024 * 1024]),
        "/deep" => Reply::new(
            200,
            "text/html",
            format!("<html><body><h1>Deep</h1><p>Read this.</p>{}trap</body></html>", "<div>".repeat(20_000)),
        ),
        path if path.starts_with("/loop") => {
            Reply::new(302, "text/plain", "").header("location", &format!("{path}x"))
        }
        _ => Reply::new(
            200,
            "text/html",
            "<html><head><title>Fine</title></head><body><p>All is well here.</p></body></html>",
        ),
    })
    .await;
    let site = format!("http://site.test:{}", port(&server));
    let tool = tool(None);
    let never = call(&tool, json!({"op": "content", "url": format!("{site}/never"), "timeout_ms": 1500}))
        .await
        .unwrap_err();
    assert_eq!(never.code, ErrorCode::ToolTimeout, "{}", never.message);
    let huge = call(&tool, json!({"op": "content", "url": format!("{site}/huge"), "max_bytes": 1048576}))
        .await
        .unwrap_err();
    assert_eq!(huge.code, ErrorCode::ToolRefused, "{}", huge.message);
    assert!(huge.message.contains("more than 1048576 bytes"), "{}", huge.message);
    let redirects = call(&tool, json!({"op": "content", "url": format!("{site}/loop")})).await.unwrap_err();
    assert!(redirects.message.contains("ERR_TOO_MANY_REDIRECTS"), "{}", redirects.message);
    // Chromium keeps 512 levels of a page nested deeper; keel reads 256 of them.
    let deep = call(&tool, json!({"op": "content", "url": format!("{site}/deep")})).await.unwrap();
    assert!(deep["markdown"].as_str().unwrap().contains("Read this."), "{deep}");
    assert!(!deep["markdown"].as_str().unwrap().contains("trap"), "{deep}");
    assert!(deep["truncated"].as_str().unwrap().contains("more than 256 levels deep"), "{deep}");
    let bad = call(&tool, json!({"op": "scrape", "url": format!("{site}/")})).await.unwrap_err();
    assert_eq!(bad.code, ErrorCode::ToolInputInvalid, "{}", bad.message);

    // The browser is still there, and kept no page of those calls open.
    let fine = call(&tool, json!({"op": "content", "url": format!("{site}/")})).await.unwrap();
    assert!(fine["markdown"].as_str().unwrap().contains("All is well"), "{fine}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(keel_tools::browser::open_pages().await, Some(0));
}
