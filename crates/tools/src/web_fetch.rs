//! `web_fetch`: a web page as readable Markdown.
//!
//! The page is fetched with `http_request`'s guarded client (the same SSRF rules, the same
//! `http.allow`), then its main content is extracted by `dom_smoothie` (a port of Mozilla's
//! Readability, the reader view of Firefox) and rendered as Markdown with its links kept. Text
//! and JSON bodies come back as they are; other media types are refused with a reason.

use std::time::Duration;

use dom_smoothie::{Config, ParsePolicy, Readability, TextMode};
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use reqwest::header::{ACCEPT, HeaderMap, HeaderValue};
use serde_json::{Value, json};

use crate::http::GuardedClient;

/// The most of a page downloaded.
pub const MAX_PAGE_BYTES: usize = 5 * 1024 * 1024;
/// The length of the Markdown returned when the call sets none.
pub const DEFAULT_MAX_CHARS: usize = 20_000;
/// The longest Markdown a call may ask for.
pub const MAX_CHARS: usize = 200_000;
/// How many HTML elements the extractor looks at (a bound on hostile pages).
const MAX_ELEMENTS: usize = 100_000;

/// The `web_fetch` tool.
pub struct WebFetch {
    spec: ToolSpec,
    client: GuardedClient,
}

impl WebFetch {
    /// The tool's name.
    pub const NAME: &'static str = "web_fetch";

    /// The tool, fetching through `client`.
    pub fn new(client: GuardedClient) -> WebFetch {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Fetches a web page (a public http(s) URL) and returns its main content as Markdown, links kept.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "url": { "type": "string", "description": "An http:// or https:// URL" },
                    "max_chars": { "type": "integer", "minimum": 100, "maximum": MAX_CHARS, "description": "Default 20000" },
                    "timeout_ms": { "type": "integer", "minimum": 1, "maximum": 120000, "description": "Default 30000" }
                },
                "required": ["url"],
                "additionalProperties": false
            }),
        };
        WebFetch { spec, client }
    }
}

/// A page's title and main content.
#[derive(Debug)]
pub struct Readable {
    /// The title.
    pub title: String,
    /// The main content as Markdown.
    pub markdown: String,
    /// Whether only the start of the page was read: its elements nest deeper than
    /// [`crate::html::MAX_NESTING`] further on.
    pub cut_at_nesting: bool,
}

impl Readable {
    /// What the tool's `truncated` says when the page was read only in part.
    pub fn nesting_note(&self) -> Option<String> {
        self.cut_at_nesting.then(|| {
            format!(
                "the page nests its elements more than {} levels deep; it was read up to there",
                crate::html::MAX_NESTING
            )
        })
    }
}

/// The page's title and main content as Markdown.
pub fn readable_markdown(html: &str, url: &str) -> Result<Readable, String> {
    let (html, cut_at_nesting) = crate::html::within_nesting(html);
    let config =
        Config { text_mode: TextMode::Markdown, max_elements_to_parse: MAX_ELEMENTS, ..Config::default() };
    let mut readability = Readability::new(html, Some(url), Some(config)).map_err(|e| e.to_string())?;
    // Readability's heuristics give up on pages with little prose; the raw policy then keeps
    // the whole body rather than nothing.
    let article = match readability.parse() {
        Ok(article) => article,
        Err(_) => readability.parse_with_policy(ParsePolicy::Raw).map_err(|e| e.to_string())?,
    };
    Ok(Readable { title: article.title, markdown: article.text_content.to_string(), cut_at_nesting })
}

fn cut(text: &str, max_chars: usize) -> (String, bool) {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => (text[..at].to_owned(), true),
        None => (text.to_owned(), false),
    }
}

impl Tool for WebFetch {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let url = input["url"].as_str().unwrap_or_default();
            let max_chars =
                input["max_chars"].as_u64().map_or(DEFAULT_MAX_CHARS, |n| (n as usize).min(MAX_CHARS));
            let timeout =
                input["timeout_ms"].as_u64().map_or(crate::http::DEFAULT_TIMEOUT, Duration::from_millis);
            let mut headers = HeaderMap::new();
            headers.insert(
                ACCEPT,
                HeaderValue::from_static("text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"),
            );
            let page =
                self.client.fetch(reqwest::Method::GET, url, headers, None, timeout, MAX_PAGE_BYTES).await?;
            if !(200..300).contains(&page.status) {
                return Err(ToolError::failed(format!("{} answered HTTP {}", page.url, page.status)));
            }
            let media_type = page
                .headers
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase())
                .unwrap_or_default();
            let body = String::from_utf8_lossy(&page.body).into_owned();
            let final_url = page.url.to_string();
            let (title, content, nesting_note) = match media_type.as_str() {
                "text/html" | "application/xhtml+xml" | "" => {
                    let url = final_url.clone();
                    let page = tokio::task::spawn_blocking(move || readable_markdown(&body, &url))
                        .await
                        .map_err(|e| ToolError::failed(format!("reading the page stopped: {e}")))?
                        .map_err(|e| ToolError::failed(format!("could not read the page: {e}")))?;
                    let note = page.nesting_note();
                    (page.title, page.markdown, note)
                }
                t if t.starts_with("text/") || t.ends_with("json") || t.ends_with("xml") => {
                    (String::new(), body, None)
                }
                other => {
                    return Err(ToolError::failed(format!(
                        "{final_url} is {other}, not a web page; web_fetch reads HTML and text (use http_request for other content)"
                    )));
                }
            };
            let (content, truncated) = cut(content.trim(), max_chars);
            let mut output = json!({ "url": final_url, "title": title, "content": content });
            let cut_note = (truncated || page.truncated)
                .then(|| format!("the content was cut at {max_chars} characters"));
            let notes: Vec<String> = nesting_note.into_iter().chain(cut_note).collect();
            if !notes.is_empty() {
                output["truncated"] = json!(notes.join("; "));
            }
            Ok(output)
        })
    }
}
