//! `browser`: web pages in a real headless Chromium, for the pages `web_fetch` cannot read (they
//! are built by scripts), and for screenshots and PDFs.
//!
//! One browser per process ([`Chromium`], started at the first call, again if it died), at most
//! `KEEL_BROWSER_PAGES` pages at once. Each call gets a fresh browser context (no cookies or
//! storage from another call) whose every connection goes through a proxy of its own that
//! applies `http_request`'s SSRF guard ([`proxy`]), and counts the bytes of the page against its
//! cap. The call's page is closed when it ends, whatever happens.
//!
//! Ops: `content` (the page's main content as Markdown, as `web_fetch` gives it), `scrape` (the
//! text of what CSS selectors match), `screenshot` (PNG) and `pdf`, both written into the
//! workspace (`browser/...`) and answered as `{key, mediaType, bytes}`; without a writable
//! workspace they are refused.

mod cdp;
mod proxy;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::{Value, json};
use url::Url;

use crate::net::{Lookup, NetPolicy, SystemLookup};
use crate::workspace::Workspace;
use cdp::{CdpError, Chromium};
use proxy::GuardProxy;

/// How long a page may take to load when the call does not say.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// The most a call may give a page.
pub const MAX_TIMEOUT_MS: u64 = 120_000;
/// The bytes a page may download (itself and everything it loads) when the call does not say.
pub const DEFAULT_MAX_BYTES: u64 = 10 * 1024 * 1024;
/// The most a call may allow.
pub const MAX_BYTES: u64 = 50 * 1024 * 1024;
/// The Markdown returned by `content` when the call sets no `max_chars`.
pub const DEFAULT_MAX_CHARS: usize = 20_000;
/// How many elements `scrape` returns per selector, and how long each text may be.
const SCRAPE_MATCHES: usize = 100;
const SCRAPE_TEXT: usize = 2_000;
/// The tallest full-page screenshot, in CSS pixels.
const MAX_SCREENSHOT_HEIGHT: f64 = 16_384.0;
/// The viewport every page gets.
const VIEWPORT: (u32, u32) = (1280, 800);

/// The `browser` tool.
pub struct BrowserTool {
    spec: ToolSpec,
    policy: Arc<NetPolicy>,
    lookup: Arc<dyn Lookup>,
    /// Where screenshots and PDFs go (a writable workspace), if anywhere.
    artifacts: Option<Workspace>,
}

impl BrowserTool {
    /// The tool's name.
    pub const NAME: &'static str = "browser";

    /// The tool: pages reached under `policy` (the spec's `http`), screenshots and PDFs written
    /// into `artifacts`.
    pub fn new(policy: NetPolicy, artifacts: Option<Workspace>) -> BrowserTool {
        BrowserTool::with_lookup(policy, Arc::new(SystemLookup), artifacts)
    }

    /// The same with another resolver (tests).
    pub fn with_lookup(
        policy: NetPolicy,
        lookup: Arc<dyn Lookup>,
        artifacts: Option<Workspace>,
    ) -> BrowserTool {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Opens a web page (a public http(s) URL) in a headless browser that runs its scripts. op `content`: the main content as Markdown; `scrape`: the text of the elements CSS `selectors` match; `screenshot` (PNG) and `pdf`: saved into the workspace, answered with their key.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "op": { "enum": ["content", "scrape", "screenshot", "pdf"] },
                    "url": { "type": "string", "description": "An http:// or https:// URL" },
                    "selectors": {
                        "type": "array", "items": { "type": "string", "minLength": 1 }, "minItems": 1, "maxItems": 20,
                        "description": "scrape: CSS selectors"
                    },
                    "full_page": { "type": "boolean", "description": "screenshot: the whole page, not just the viewport" },
                    "max_chars": { "type": "integer", "minimum": 100, "maximum": crate::web_fetch::MAX_CHARS, "description": "content: default 20000" },
                    "timeout_ms": { "type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_MS, "description": "Default 30000" },
                    "max_bytes": { "type": "integer", "minimum": 1024, "maximum": MAX_BYTES, "description": "What the page may download in all; default 10 MiB" }
                },
                "required": ["op", "url"],
                "additionalProperties": false
            }),
        };
        BrowserTool { spec, policy: Arc::new(policy), lookup, artifacts }
    }
}

impl Tool for BrowserTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let op = input["op"].as_str().unwrap_or_default().to_owned();
            let url = Url::parse(input["url"].as_str().unwrap_or_default()).map_err(|error| {
                ToolError::with_code(ErrorCode::ToolInputInvalid, format!("invalid URL: {error}"), false)
            })?;
            // Refused at once, before any browser starts, when the address says so already.
            self.policy.check_url(&url).map_err(|refusal| refused(&refusal.0))?;
            if matches!(op.as_str(), "screenshot" | "pdf") && self.artifacts.is_none() {
                return Err(refused(&format!(
                    "a {op} is saved into the workspace, and this agent has no writable one (set `workspace: {{ path: ..., mode: writable }}`)"
                )));
            }
            if op == "scrape" && !input["selectors"].is_array() {
                return Err(ToolError::with_code(
                    ErrorCode::ToolInputInvalid,
                    "`scrape` needs `selectors`: CSS selectors".to_owned(),
                    false,
                ));
            }
            let timeout = Duration::from_millis(input["timeout_ms"].as_u64().unwrap_or(DEFAULT_TIMEOUT_MS));
            let cap = input["max_bytes"].as_u64().unwrap_or(DEFAULT_MAX_BYTES);
            let _permit =
                pages().acquire().await.map_err(|_| ToolError::failed("the browser is shutting down"))?;
            let chromium = browser().await?;
            let started = Instant::now();
            let page = Page::open(chromium, self.policy.clone(), self.lookup.clone(), cap).await?;
            let outcome = tokio::time::timeout(timeout, async {
                page.navigate(&url, &started, timeout).await?;
                match op.as_str() {
                    "content" => {
                        page.content(input["max_chars"].as_u64().map_or(DEFAULT_MAX_CHARS, |n| n as usize))
                            .await
                    }
                    "scrape" => page.scrape(&input["selectors"]).await,
                    "screenshot" => {
                        let png = page.screenshot(input["full_page"].as_bool().unwrap_or(false)).await?;
                        self.store(ctx, "png", "image/png", png, &page).await
                    }
                    _ => {
                        let pdf = page.pdf().await?;
                        self.store(ctx, "pdf", "application/pdf", pdf, &page).await
                    }
                }
            })
            .await
            .unwrap_or_else(|_| {
                Err(ToolError::with_code(
                    ErrorCode::ToolTimeout,
                    format!("the page did not finish within {} ms (`timeout_ms`)", timeout.as_millis()),
                    true,
                ))
            });
            let outcome = outcome.and_then(|mut output| {
                page.check_cap()?;
                let blocked = page.blocked();
                if !blocked.is_empty() {
                    output["blocked"] = json!(blocked);
                }
                Ok(output)
            });
            page.close().await;
            outcome
        })
    }
}

impl BrowserTool {
    /// Writes an artifact into the workspace: `browser/<run>-<call>.<ext>`, named by the step, so
    /// a call replayed after a crash writes the same file again rather than a second one.
    async fn store(
        &self,
        ctx: &ToolContext,
        ext: &str,
        media_type: &str,
        bytes: Vec<u8>,
        page: &Page,
    ) -> ToolOutcome {
        let workspace = self.artifacts.as_ref().expect("checked before the page opened");
        let name: String = format!("{}-{}", ctx.run_id.as_str(), ctx.call_id)
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
            .collect();
        let key = PathBuf::from("browser").join(format!("{name}.{ext}"));
        let size = bytes.len();
        workspace.store(key.clone(), bytes).await?;
        Ok(json!({
            "key": key.to_string_lossy(),
            "mediaType": media_type,
            "bytes": size,
            "url": page.location().await.unwrap_or_default(),
        }))
    }
}

/// The Chromium the tool starts: `KEEL_BROWSER`, else the first of the usual names on `PATH`.
pub fn executable() -> Option<PathBuf> {
    cdp::find_executable()
}

/// How many pages the process's browser has open (each call's own context); `None` when no
/// browser runs.
pub async fn open_pages() -> Option<usize> {
    let chromium = running().await?;
    let contexts = chromium.call(None, "Target.getBrowserContexts", json!({})).await.ok()?;
    Some(contexts["browserContextIds"].as_array().map_or(0, Vec::len))
}

/// The pages open at once, process-wide.
fn pages() -> &'static tokio::sync::Semaphore {
    static PAGES: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    PAGES.get_or_init(|| {
        let pages = std::env::var(keel_core::env::BROWSER_PAGES.name)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| (1..=64).contains(n))
            .unwrap_or(4);
        tokio::sync::Semaphore::new(pages)
    })
}

/// The running browser, with the proxy of its default context (which refuses everything: pages
/// have their own).
struct Running {
    chromium: Arc<Chromium>,
    _refuse_all: GuardProxy,
}

fn running_browser() -> &'static tokio::sync::Mutex<Option<Running>> {
    static BROWSER: OnceLock<tokio::sync::Mutex<Option<Running>>> = OnceLock::new();
    BROWSER.get_or_init(Default::default)
}

/// The browser if one runs.
async fn running() -> Option<Arc<Chromium>> {
    running_browser().lock().await.as_ref().filter(|r| r.chromium.is_alive()).map(|r| r.chromium.clone())
}

/// The process's browser, started when needed: at the first call, or when the last one died.
async fn browser() -> Result<Arc<Chromium>, ToolError> {
    let mut running = running_browser().lock().await;
    if let Some(alive) = running.as_ref().filter(|r| r.chromium.is_alive()) {
        return Ok(alive.chromium.clone());
    }
    *running = None;
    let Some(executable) = cdp::find_executable() else {
        return Err(ToolError::failed(format!(
            "the browser tool needs Chromium: install it (Debian: `apt-get install chromium`) or set {} to its executable",
            keel_core::env::BROWSER.name
        )));
    };
    let refuse_all = GuardProxy::refusing()
        .await
        .map_err(|e| ToolError::failed(format!("cannot start the browser's proxy: {e}")))?;
    let chromium =
        Chromium::launch(executable, refuse_all.url()).await.map_err(|e| ToolError::failed(e.0))?;
    let chromium = Arc::new(chromium);
    *running = Some(Running { chromium: chromium.clone(), _refuse_all: refuse_all });
    Ok(chromium)
}

fn refused(why: &str) -> ToolError {
    let message = if why.starts_with("refused") { why.to_owned() } else { format!("refused: {why}") };
    ToolError::with_code(ErrorCode::ToolRefused, message, false)
}

fn failed(error: CdpError) -> ToolError {
    ToolError::failed(format!("the browser: {error}"))
}

/// One call's page: its own browser context, behind its own proxy.
struct Page {
    chromium: Arc<Chromium>,
    context: String,
    session: String,
    events: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Value>>,
    proxy: GuardProxy,
    cap: u64,
    closed: std::sync::atomic::AtomicBool,
}

impl Page {
    async fn open(
        chromium: Arc<Chromium>,
        policy: Arc<NetPolicy>,
        lookup: Arc<dyn Lookup>,
        cap: u64,
    ) -> Result<Page, ToolError> {
        let proxy = GuardProxy::start(policy, lookup, cap)
            .await
            .map_err(|e| ToolError::failed(format!("cannot start the page's proxy: {e}")))?;
        let context = chromium
            .call(None, "Target.createBrowserContext", json!({ "disposeOnDetach": true, "proxyServer": proxy.url(), "proxyBypassList": "<-loopback>" }))
            .await
            .map_err(failed)?;
        let context = context["browserContextId"].as_str().unwrap_or_default().to_owned();
        let opened = async {
            chromium
                .call(
                    None,
                    "Browser.setDownloadBehavior",
                    json!({ "behavior": "deny", "browserContextId": context }),
                )
                .await?;
            let target = chromium
                .call(
                    None,
                    "Target.createTarget",
                    json!({ "url": "about:blank", "browserContextId": context }),
                )
                .await?;
            let attached = chromium
                .call(
                    None,
                    "Target.attachToTarget",
                    json!({ "targetId": target["targetId"], "flatten": true }),
                )
                .await?;
            Ok::<_, CdpError>(attached["sessionId"].as_str().unwrap_or_default().to_owned())
        }
        .await;
        let session = match opened {
            Ok(session) => session,
            Err(error) => {
                let _ = chromium
                    .call(None, "Target.disposeBrowserContext", json!({ "browserContextId": context }))
                    .await;
                return Err(failed(error));
            }
        };
        let events = chromium.events(&session);
        let page = Page {
            chromium,
            context,
            session,
            events: tokio::sync::Mutex::new(events),
            proxy,
            cap,
            closed: std::sync::atomic::AtomicBool::new(false),
        };
        page.call("Page.enable", json!({})).await?;
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": VIEWPORT.0, "height": VIEWPORT.1, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await?;
        Ok(page)
    }

    async fn call(&self, method: &str, params: Value) -> Result<Value, ToolError> {
        self.chromium.call(Some(&self.session), method, params).await.map_err(failed)
    }

    /// Goes to `url` and waits for its `load` event.
    async fn navigate(&self, url: &Url, started: &Instant, timeout: Duration) -> Result<(), ToolError> {
        let navigated = self.call("Page.navigate", json!({ "url": url.as_str() })).await?;
        if let Some(error) = navigated["errorText"].as_str().filter(|e| !e.is_empty()) {
            self.check_cap()?;
            if let Some(refusal) = url.host_str().and_then(|host| self.proxy.traffic.refusal_of(host)) {
                return Err(refused(&refusal.0));
            }
            return Err(ToolError::failed(format!("the page did not load: {error}")));
        }
        let mut events = self.events.lock().await;
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            // Woken now and then to see whether the proxy cut the page off.
            let tick = left.min(Duration::from_millis(100));
            let event = match tokio::time::timeout(tick, events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => return Err(ToolError::failed("the browser has exited")),
                Err(_) if left > tick => {
                    self.check_cap()?;
                    continue;
                }
                Err(_) => {
                    return Err(ToolError::with_code(
                        ErrorCode::ToolTimeout,
                        format!(
                            "the page did not finish loading within {} ms (`timeout_ms`)",
                            timeout.as_millis()
                        ),
                        true,
                    ));
                }
            };
            if event["method"] == "Page.loadEventFired" {
                break;
            }
        }
        drop(events);
        self.check_cap()?;
        // A plain-HTTP page the proxy refused (the first URL, or where a redirect went) is the
        // proxy's answer, not the page: the refusal is the outcome.
        let location = self.location().await?;
        let host = Url::parse(&location).ok().and_then(|url| url.host_str().map(str::to_owned));
        if let Some(refusal) = host.and_then(|host| self.proxy.traffic.refusal_of(&host)) {
            return Err(refused(&refusal.0));
        }
        Ok(())
    }

    /// The page went past its byte cap?
    fn check_cap(&self) -> Result<(), ToolError> {
        if self.proxy.traffic.over_cap.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(refused(&format!(
                "the page downloads more than {} bytes (`max_bytes`); it was cut off",
                self.cap
            )));
        }
        Ok(())
    }

    /// What the proxy refused the page, as `host:port (why)`.
    fn blocked(&self) -> Vec<String> {
        let refused = self.proxy.traffic.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        refused.iter().map(|(target, refusal)| format!("{target} ({})", refusal.0)).collect()
    }

    /// `expression` evaluated in the page, its value (JSON).
    async fn evaluate(&self, expression: &str) -> Result<Value, ToolError> {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await?;
        if let Some(exception) = result.get("exceptionDetails") {
            let text = exception["exception"]["description"]
                .as_str()
                .or(exception["text"].as_str())
                .unwrap_or("an exception");
            return Err(ToolError::failed(format!("the page's script failed: {text}")));
        }
        Ok(result["result"]["value"].clone())
    }

    async fn location(&self) -> Result<String, ToolError> {
        Ok(self.evaluate("location.href").await?.as_str().unwrap_or_default().to_owned())
    }

    async fn content(&self, max_chars: usize) -> ToolOutcome {
        let mut page =
            self.evaluate("({ html: document.documentElement.outerHTML, url: location.href })").await?;
        let mut text = |key: &str| match page[key].take() {
            Value::String(text) => text,
            _ => String::new(),
        };
        let (html, url) = (text("html"), text("url"));
        // Parsing a large page takes a while: off the async workers, as `web_fetch` does.
        let page = {
            let url = url.clone();
            tokio::task::spawn_blocking(move || crate::web_fetch::readable_markdown(&html, &url))
                .await
                .map_err(|error| ToolError::failed(format!("reading the page stopped: {error}")))?
                .map_err(|error| ToolError::failed(format!("cannot read the page: {error}")))?
        };
        let mut output = json!({ "url": url, "title": page.title });
        let mut notes: Vec<String> = page.nesting_note().into_iter().collect();
        match page.markdown.char_indices().nth(max_chars) {
            Some((at, _)) => {
                output["markdown"] = json!(&page.markdown[..at]);
                notes.push(format!("cut at {max_chars} characters (`max_chars`)"));
            }
            None => output["markdown"] = json!(page.markdown),
        }
        if !notes.is_empty() {
            output["truncated"] = json!(notes.join("; "));
        }
        Ok(output)
    }

    async fn scrape(&self, selectors: &Value) -> ToolOutcome {
        let expression = format!(
            "(() => {{ const out = {{}}; for (const s of {selectors}) {{ let nodes; try {{ nodes = document.querySelectorAll(s); }} catch (e) {{ out[s] = {{ error: String(e.message) }}; continue; }} out[s] = Array.from(nodes).slice(0, {SCRAPE_MATCHES}).map((n) => (n.innerText ?? n.textContent ?? '').trim().slice(0, {SCRAPE_TEXT})); }} return {{ url: location.href, results: out }}; }})()"
        );
        self.evaluate(&expression).await
    }

    async fn screenshot(&self, full_page: bool) -> Result<Vec<u8>, ToolError> {
        let mut params = json!({ "format": "png" });
        if full_page {
            let metrics = self.call("Page.getLayoutMetrics", json!({})).await?;
            let size = &metrics["cssContentSize"];
            let width = size["width"].as_f64().unwrap_or(f64::from(VIEWPORT.0));
            let height = size["height"].as_f64().unwrap_or(f64::from(VIEWPORT.1)).min(MAX_SCREENSHOT_HEIGHT);
            params["captureBeyondViewport"] = json!(true);
            params["clip"] = json!({ "x": 0, "y": 0, "width": width, "height": height, "scale": 1 });
        }
        decode(&self.call("Page.captureScreenshot", params).await?)
    }

    async fn pdf(&self) -> Result<Vec<u8>, ToolError> {
        decode(&self.call("Page.printToPDF", json!({ "printBackground": true })).await?)
    }

    /// Closes the page: its context, its target, its proxy.
    async fn close(&self) {
        if self.closed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        self.chromium.forget(&self.session);
        let _ = self
            .chromium
            .call(None, "Target.disposeBrowserContext", json!({ "browserContextId": self.context }))
            .await;
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // A call abandoned midway (its run cancelled, its step timed out) still closes its page.
        if !self.closed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let (chromium, context, session) =
                (self.chromium.clone(), self.context.clone(), self.session.clone());
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    chromium.forget(&session);
                    let _ = chromium
                        .call(None, "Target.disposeBrowserContext", json!({ "browserContextId": context }))
                        .await;
                });
            }
        }
    }
}

fn decode(reply: &Value) -> Result<Vec<u8>, ToolError> {
    let data = reply["data"].as_str().unwrap_or_default();
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|error| ToolError::failed(format!("the browser's image is not base64: {error}")))
}
