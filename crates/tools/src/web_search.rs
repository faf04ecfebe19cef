//! `web_search`: a query to a search API, its results as `[{url, title, description?}]`.
//!
//! The API is a [`SearchBackend`]: SearXNG, Brave and Tavily come built in (spec key
//! `web_search`), and a library user can plug another one in with [`WebSearch::new`]. Whatever the
//! backend, the tool does the same around it: one request, retried while the backend says "too
//! many requests" (429, as long as its `Retry-After` asks, bounded) or fails with a 5xx; an auth
//! failure, a throttle that outlasts the retries, an answer that is not the API's (an HTML page)
//! each end the call with their own `KEEL_SEARCH_...` code, so the model (and whoever reads the
//! journal) knows which; results with no http(s) URL are dropped, repeated URLs kept once.
//!
//! The backend's address is the operator's configuration, not the model's input, so it is not
//! held to the SSRF guard (a SearXNG instance on the same host is the usual setup); the model
//! chooses only the query and the number of results.

use std::sync::Arc;
use std::time::Duration;

use keel_core::error::ErrorCode;
use keel_core::{
    BoxFuture, SearchBackendKind, SearchSettings, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec,
};
use serde_json::{Value, json};

/// Results when the call does not say.
pub const DEFAULT_LIMIT: u64 = 5;
/// The most results a call may ask for.
pub const MAX_LIMIT: u64 = 10;
/// The longest query accepted.
const MAX_QUERY_CHARS: u64 = 400;
/// Retries after a 429 or a 5xx.
const RETRIES: u32 = 3;
/// The longest wait between two tries, whatever `Retry-After` says.
const MAX_WAIT: Duration = Duration::from_secs(10);
/// The most of an answer read.
const MAX_BODY: usize = 4 * 1024 * 1024;
/// A description is cut there.
const MAX_DESCRIPTION_CHARS: usize = 500;

/// One search API: how a query is asked, and how its answer is read.
pub trait SearchBackend: Send + Sync {
    /// The backend's name, for messages (`brave`).
    fn name(&self) -> &str;

    /// The request for `query`, asking for `limit` results (a backend that cannot say how many
    /// gets its default, and the tool keeps the first `limit`).
    fn request(
        &self,
        client: &reqwest::Client,
        query: &str,
        limit: u64,
    ) -> Result<reqwest::RequestBuilder, ToolError>;

    /// The results in a successful answer, in the backend's order; `Err` says what is wrong with
    /// its shape.
    fn results(&self, answer: &Value) -> Result<Vec<SearchResult>, String>;
}

/// One result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SearchResult {
    /// The page.
    pub url: String,
    /// Its title.
    pub title: String,
    /// The snippet the backend gives, as plain text.
    pub description: Option<String>,
}

/// The `web_search` tool.
pub struct WebSearch {
    spec: ToolSpec,
    backend: Arc<dyn SearchBackend>,
    client: reqwest::Client,
}

impl WebSearch {
    /// The tool's name.
    pub const NAME: &'static str = "web_search";

    /// The tool over `backend`, each request bounded by `timeout`.
    pub fn new(backend: Arc<dyn SearchBackend>, timeout: Duration) -> WebSearch {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Searches the web. Answers with the results: [{url, title, description}]. Open a result with a tool that reads pages.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "query": { "type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS, "description": "What to search for" },
                    "limit": { "type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "description": "How many results, default 5" }
                },
                "required": ["query"],
                "additionalProperties": false
            }),
        };
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_default();
        WebSearch { spec, backend, client }
    }

    /// The tool a spec's `web_search` key describes, its key read from the environment when
    /// called.
    pub fn from_settings(settings: &SearchSettings) -> WebSearch {
        WebSearch::from_settings_with_env(settings, Arc::new(|name| std::env::var(name).ok()))
    }

    /// The same, its key read through `env` instead of the process's environment (tests).
    pub fn from_settings_with_env(settings: &SearchSettings, env: Arc<Env>) -> WebSearch {
        let key = ApiKey {
            variable: settings.api_key_env.clone().or_else(|| default_key_env(settings.backend)),
            env,
        };
        let url = settings.url.clone();
        let backend: Arc<dyn SearchBackend> = match settings.backend {
            SearchBackendKind::Searxng => Arc::new(Searxng { url: url.unwrap_or_default(), key }),
            SearchBackendKind::Brave => {
                Arc::new(Brave { url: url.unwrap_or_else(|| "https://api.search.brave.com".into()), key })
            }
            SearchBackendKind::Tavily => {
                Arc::new(Tavily { url: url.unwrap_or_else(|| "https://api.tavily.com".into()), key })
            }
        };
        WebSearch::new(backend, settings.timeout)
    }

    async fn search(&self, query: &str, limit: u64) -> Result<Vec<SearchResult>, ToolError> {
        let name = self.backend.name();
        let mut tries = 0;
        let response = loop {
            let request = self.backend.request(&self.client, query, limit)?;
            let response = request.send().await.map_err(|error| {
                let what = if error.is_timeout() { "did not answer in time" } else { "cannot be reached" };
                ToolError::with_code(
                    ErrorCode::SearchUnavailable,
                    format!("the {name} search API {what}: {}", error_chain(&error)),
                    true,
                )
            })?;
            let status = response.status().as_u16();
            let retried = status == 429 || matches!(status, 500 | 502 | 503 | 504);
            if !retried || tries == RETRIES {
                break response;
            }
            tries += 1;
            let wait =
                asked_wait(response.headers()).unwrap_or(Duration::from_millis(500 << tries)).min(MAX_WAIT);
            tracing::debug!(backend = name, status, ?wait, "web_search: retrying");
            tokio::time::sleep(wait).await;
        };
        let status = response.status().as_u16();
        let html = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.to_ascii_lowercase().contains("html"));
        let body = read_capped(response, name).await?;
        let code = match status {
            200..=299 => None,
            401 | 403 => Some((ErrorCode::SearchAuth, false)),
            422 if String::from_utf8_lossy(&body).contains("TOKEN_INVALID") => {
                Some((ErrorCode::SearchAuth, false))
            }
            429 | 432 | 433 => Some((ErrorCode::SearchThrottled, status == 429)),
            _ => Some((ErrorCode::SearchUnavailable, status >= 500)),
        };
        if let Some((code, transient)) = code {
            let why = match (code, status) {
                (ErrorCode::SearchAuth, 403) if self.backend.name() == "searxng" => {
                    " (does the instance serve JSON? `search.formats` in its settings.yml must list `json`)"
                }
                (ErrorCode::SearchAuth, _) => " (check the API key)",
                (ErrorCode::SearchThrottled, 429) => " after 3 retries",
                (ErrorCode::SearchThrottled, _) => " (the plan's quota is spent)",
                _ => "",
            };
            return Err(ToolError::with_code(
                code,
                format!("the {name} search API answered HTTP {status}{why}: {}", excerpt(&body)),
                transient,
            ));
        }
        let answer: Value = serde_json::from_slice(&body).map_err(|_| {
            let what = if html || looks_like_html(&body) { "an HTML page" } else { "something that is not JSON" };
            ToolError::with_code(
                ErrorCode::SearchBadResponse,
                format!("the {name} search API answered {what}, not its JSON (is `web_search.url` the API's root?): {}", excerpt(&body)),
                false,
            )
        })?;
        self.backend.results(&answer).map_err(|problem| {
            ToolError::with_code(
                ErrorCode::SearchBadResponse,
                format!("the {name} search API's answer is not what its API documents: {problem}"),
                false,
            )
        })
    }
}

impl Tool for WebSearch {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let query = input["query"].as_str().unwrap_or_default().trim();
            if query.is_empty() {
                return Err(ToolError::with_code(ErrorCode::ToolInputInvalid, "`query` is empty", false));
            }
            let limit = input["limit"].as_u64().unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
            let results = self.search(query, limit).await?;
            let mut seen = std::collections::HashSet::new();
            let results: Vec<Value> = results
                .into_iter()
                .filter(|r| {
                    url::Url::parse(&r.url).is_ok_and(|u| matches!(u.scheme(), "http" | "https"))
                        && seen.insert(r.url.clone())
                })
                .take(limit as usize)
                .map(|r| {
                    let mut out = json!({ "url": r.url, "title": plain(&r.title, usize::MAX) });
                    if let Some(description) =
                        r.description.map(|d| plain(&d, MAX_DESCRIPTION_CHARS)).filter(|d| !d.is_empty())
                    {
                        out["description"] = json!(description);
                    }
                    out
                })
                .collect();
            Ok(Value::Array(results))
        })
    }
}

/// How a variable of the environment is read.
pub type Env = dyn Fn(&str) -> Option<String> + Send + Sync;

/// Where a backend's key comes from.
struct ApiKey {
    /// The environment variable; `None`: the backend sends none.
    variable: Option<String>,
    env: Arc<Env>,
}

impl ApiKey {
    /// The key, when one is configured; an error when its variable is not set.
    fn get(&self, backend: &str) -> Result<Option<String>, ToolError> {
        let Some(variable) = &self.variable else { return Ok(None) };
        match (self.env)(variable) {
            Some(key) if !key.trim().is_empty() => Ok(Some(key.trim().to_owned())),
            _ => Err(ToolError::with_code(
                ErrorCode::SearchAuth,
                format!("the {backend} search API needs a key, and {variable} is not set"),
                false,
            )),
        }
    }
}

fn default_key_env(backend: SearchBackendKind) -> Option<String> {
    match backend {
        SearchBackendKind::Searxng => None,
        SearchBackendKind::Brave => Some("BRAVE_API_KEY".into()),
        SearchBackendKind::Tavily => Some("TAVILY_API_KEY".into()),
    }
}

/// A SearXNG instance: `GET /search?q=...&format=json` (its JSON format enabled).
struct Searxng {
    url: String,
    key: ApiKey,
}

impl SearchBackend for Searxng {
    fn name(&self) -> &str {
        "searxng"
    }

    fn request(
        &self,
        client: &reqwest::Client,
        query: &str,
        _limit: u64,
    ) -> Result<reqwest::RequestBuilder, ToolError> {
        let mut request = client
            .get(with_query(&format!("{}/search", self.url), &[("q", query), ("format", "json")])?)
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(key) = self.key.get(self.name())? {
            request = request.bearer_auth(key);
        }
        Ok(request)
    }

    fn results(&self, answer: &Value) -> Result<Vec<SearchResult>, String> {
        hits(&answer["results"], "results", "content")
    }
}

/// The Brave Search API: `GET /res/v1/web/search?q=...&count=N`, key in `X-Subscription-Token`.
struct Brave {
    url: String,
    key: ApiKey,
}

impl SearchBackend for Brave {
    fn name(&self) -> &str {
        "brave"
    }

    fn request(
        &self,
        client: &reqwest::Client,
        query: &str,
        limit: u64,
    ) -> Result<reqwest::RequestBuilder, ToolError> {
        let key = self.key.get(self.name())?.unwrap_or_default();
        Ok(client
            .get(with_query(
                &format!("{}/res/v1/web/search", self.url),
                &[("q", query), ("count", &limit.to_string())],
            )?)
            .header(reqwest::header::ACCEPT, "application/json")
            .header("X-Subscription-Token", key))
    }

    fn results(&self, answer: &Value) -> Result<Vec<SearchResult>, String> {
        // A query with no web results has no `web` at all.
        if answer.get("web").is_none() && answer.get("type").is_some_and(|t| t == "search") {
            return Ok(Vec::new());
        }
        hits(&answer["web"]["results"], "web.results", "description")
    }
}

/// Tavily: `POST /search` with `{query, max_results}`, key as a bearer token.
struct Tavily {
    url: String,
    key: ApiKey,
}

impl SearchBackend for Tavily {
    fn name(&self) -> &str {
        "tavily"
    }

    fn request(
        &self,
        client: &reqwest::Client,
        query: &str,
        limit: u64,
    ) -> Result<reqwest::RequestBuilder, ToolError> {
        let key = self.key.get(self.name())?.unwrap_or_default();
        Ok(client
            .post(format!("{}/search", self.url))
            .bearer_auth(key)
            .json(&json!({ "query": query, "max_results": limit, "search_depth": "basic" })))
    }

    fn results(&self, answer: &Value) -> Result<Vec<SearchResult>, String> {
        hits(&answer["results"], "results", "content")
    }
}

/// `endpoint?name=value&...`, encoded.
fn with_query(endpoint: &str, pairs: &[(&str, &str)]) -> Result<url::Url, ToolError> {
    let mut url = url::Url::parse(endpoint).map_err(|error| {
        ToolError::with_code(
            ErrorCode::SearchUnavailable,
            format!("the search API's URL {endpoint:?}: {error}"),
            false,
        )
    })?;
    url.query_pairs_mut().extend_pairs(pairs);
    Ok(url)
}

/// The `[{url, title, <description>}]` at `list` (named `path` in messages).
fn hits(list: &Value, path: &str, description: &str) -> Result<Vec<SearchResult>, String> {
    let Some(items) = list.as_array() else {
        return Err(format!("`{path}` is not a list"));
    };
    Ok(items
        .iter()
        .filter_map(|item| {
            let url = item["url"].as_str()?.trim();
            let title = item["title"].as_str().map(str::trim).filter(|t| !t.is_empty()).unwrap_or(url);
            Some(SearchResult {
                url: url.to_owned(),
                title: title.to_owned(),
                description: item[description].as_str().map(str::to_owned),
            })
        })
        .collect())
}

/// `text` without the markup some backends put in snippets (Brave's `<strong>`), its entities
/// decoded, its white space collapsed, cut at `max` characters.
fn plain(text: &str, max: usize) -> String {
    let mut stripped = String::with_capacity(text.len());
    let mut in_tag = false;
    for c in text.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => stripped.push(c),
            _ => {}
        }
    }
    let decoded = html_escape::decode_html_entities(&stripped);
    let collapsed = decoded.split_whitespace().collect::<Vec<_>>().join(" ");
    match collapsed.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &collapsed[..at]),
        None => collapsed,
    }
}

/// How long the backend asked to wait: `Retry-After` in seconds, else the first window of
/// Brave's `X-RateLimit-Reset` (`1, 1419704`: seconds until the per-second and the monthly
/// windows reset).
fn asked_wait(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let seconds = |name: &str| {
        let value = headers.get(name)?.to_str().ok()?;
        let first = value.split(',').next()?.trim().parse::<f64>().ok()?;
        (first.is_finite() && first >= 0.0).then(|| Duration::from_secs_f64(first))
    };
    seconds("retry-after").or_else(|| seconds("x-ratelimit-reset"))
}

/// The answer's body, at most [`MAX_BODY`] of it.
async fn read_capped(mut response: reqwest::Response, name: &str) -> Result<Vec<u8>, ToolError> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|error| {
        ToolError::with_code(
            ErrorCode::SearchUnavailable,
            format!("the {name} search API's answer broke off: {}", error_chain(&error)),
            true,
        )
    })? {
        if body.len() + chunk.len() > MAX_BODY {
            return Err(ToolError::with_code(
                ErrorCode::SearchBadResponse,
                format!(
                    "the {name} search API answered more than {} MiB: not a page of results",
                    MAX_BODY / (1024 * 1024)
                ),
                false,
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Whether a body is markup: JSON never starts with `<`.
fn looks_like_html(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'<')
}

/// The start of an answer, for a message, as plain text (an HTML page without its markup).
fn excerpt(body: &[u8]) -> String {
    let text = plain(&String::from_utf8_lossy(&body[..body.len().min(4096)]), 300);
    if text.is_empty() { "(an empty body)".into() } else { text }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snippets_lose_their_markup_and_keep_their_text() {
        assert_eq!(
            plain("The <strong>keel</strong> runtime &amp; its\n  journal", 100),
            "The keel runtime & its journal"
        );
        assert_eq!(plain("abcdef", 3), "abc…");
    }
}
