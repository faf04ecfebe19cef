//! `http_request`: one HTTP request to a public address, with the SSRF guard of [`crate::net`],
//! a timeout and a response size cap.

use std::sync::Arc;
use std::time::Duration;

use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Map, Value, json};

use crate::net::{GuardedResolver, Lookup, NetPolicy, SystemLookup, refusal_in};

/// The most redirects followed (each one checked again).
pub const MAX_REDIRECTS: usize = 5;
/// The response size cap when the call sets none.
pub const DEFAULT_MAX_BYTES: usize = 1024 * 1024;
/// The largest cap a call may ask for.
pub const MAX_BYTES: usize = 10 * 1024 * 1024;
/// The timeout when the call sets none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// An HTTP client that only reaches what its [`NetPolicy`] allows.
#[derive(Clone)]
pub struct GuardedClient {
    client: reqwest::Client,
    policy: Arc<NetPolicy>,
}

/// A response, read up to a cap.
pub struct Fetched {
    /// The final URL (after redirects).
    pub url: Url,
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: HeaderMap,
    /// The body, up to the cap.
    pub body: Vec<u8>,
    /// Whether the body was longer than the cap.
    pub truncated: bool,
}

impl GuardedClient {
    /// A client enforcing `policy`, resolving names with the system resolver.
    pub fn new(policy: NetPolicy) -> GuardedClient {
        GuardedClient::with_lookup(policy, Arc::new(SystemLookup))
    }

    /// A client enforcing `policy`, resolving names with `lookup` (tests use a fake resolver).
    pub fn with_lookup(policy: NetPolicy, lookup: Arc<dyn Lookup>) -> GuardedClient {
        let policy = Arc::new(policy);
        let redirect_policy = policy.clone();
        let client = reqwest::Client::builder()
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            // A proxy from the environment would be asked to reach the address instead, past
            // the guard.
            .no_proxy()
            .dns_resolver(Arc::new(GuardedResolver::new(policy.clone(), lookup)))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() >= MAX_REDIRECTS {
                    return attempt
                        .error(crate::net::Refusal(format!("refused: more than {MAX_REDIRECTS} redirects")));
                }
                // A host name in the new URL is checked by the resolver when it connects.
                match redirect_policy.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refusal) => {
                        let to = attempt.url().to_string();
                        attempt.error(crate::net::Refusal(format!("{refusal} (a redirect to {to})")))
                    }
                }
            }))
            .connect_timeout(Duration::from_secs(10))
            .build()
            .expect("the HTTP client builds with static settings");
        GuardedClient { client, policy }
    }

    /// Sends a request to `url` and reads the response up to `max_bytes`.
    pub async fn fetch(
        &self,
        method: reqwest::Method,
        url: &str,
        headers: HeaderMap,
        body: Option<Vec<u8>>,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Fetched, ToolError> {
        let url = Url::parse(url).map_err(|error| {
            ToolError::with_code(ErrorCode::ToolFailed, format!("invalid URL {url:?}: {error}"), false)
        })?;
        self.policy.check_url(&url).map_err(refused)?;
        // The tool call's trace context, when spans are on (a header the caller set wins).
        let trace: Vec<(String, String)> = keel_core::telemetry::trace_headers()
            .into_iter()
            .filter(|(name, _)| !headers.contains_key(name.as_str()))
            .collect();
        let mut request = self.client.request(method, url).headers(headers).timeout(timeout);
        for (name, value) in trace {
            request = request.header(name, value);
        }
        if let Some(body) = body {
            request = request.body(body);
        }
        let mut response = request.send().await.map_err(|error| transport(&error, timeout))?;
        let status = response.status().as_u16();
        let final_url = response.url().clone();
        let headers = response.headers().clone();
        let mut body = Vec::new();
        let mut truncated = false;
        while let Some(chunk) = response.chunk().await.map_err(|error| transport(&error, timeout))? {
            let room = max_bytes.saturating_sub(body.len());
            if chunk.len() > room {
                body.extend_from_slice(&chunk[..room]);
                truncated = true;
                break;
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Fetched { url: final_url, status, headers, body, truncated })
    }
}

fn refused(refusal: crate::net::Refusal) -> ToolError {
    ToolError::with_code(ErrorCode::ToolRefused, refusal.0, false)
}

/// A client error as the model sees it: the guard's refusal when it caused it.
fn transport(error: &reqwest::Error, timeout: Duration) -> ToolError {
    if let Some(refusal) = refusal_in(error) {
        return refused(refusal);
    }
    if error.is_timeout() {
        return ToolError::with_code(
            ErrorCode::ToolTimeout,
            format!("the request took longer than {} ms", timeout.as_millis()),
            true,
        );
    }
    let detail = std::error::Error::source(error).map_or_else(|| error.to_string(), ToString::to_string);
    ToolError::with_code(ErrorCode::ToolFailed, format!("the request failed: {detail}"), true)
}

/// The `http_request` tool.
pub struct HttpTool {
    spec: ToolSpec,
    client: GuardedClient,
}

impl HttpTool {
    /// The tool's name.
    pub const NAME: &'static str = "http_request";

    /// The tool, reaching what `client`'s policy allows.
    pub fn new(client: GuardedClient) -> HttpTool {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Sends an HTTP request to a public http(s) URL and returns the status, headers and body (text, cut at max_bytes). Private and internal addresses are refused.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "url": { "type": "string", "description": "An http:// or https:// URL" },
                    "method": { "type": "string", "enum": ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"], "default": "GET" },
                    "headers": { "type": "object", "additionalProperties": { "type": "string" }, "description": "Request headers" },
                    "body": { "description": "The request body: a string, or any JSON value (sent as application/json)" },
                    "timeout_ms": { "type": "integer", "minimum": 1, "maximum": 120000, "description": "Default 30000" },
                    "max_bytes": { "type": "integer", "minimum": 1, "maximum": MAX_BYTES, "description": "Response body cap; default 1048576" }
                },
                "required": ["url"],
                "additionalProperties": false
            }),
        };
        HttpTool { spec, client }
    }
}

impl Tool for HttpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let url = input["url"].as_str().unwrap_or_default();
            let method = input["method"].as_str().unwrap_or("GET");
            let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|_| {
                ToolError::with_code(ErrorCode::ToolInputInvalid, format!("unknown method {method}"), false)
            })?;
            let mut headers = HeaderMap::new();
            if let Some(given) = input["headers"].as_object() {
                for (name, value) in given {
                    let value = value.as_str().unwrap_or_default();
                    let (Ok(name), Ok(value)) =
                        (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value))
                    else {
                        return Err(ToolError::with_code(
                            ErrorCode::ToolInputInvalid,
                            format!("header {name:?} has a name or value HTTP cannot carry"),
                            false,
                        ));
                    };
                    // The connection goes to the checked address whatever `Host` says; keep
                    // the header honest anyway.
                    if name != reqwest::header::HOST {
                        headers.insert(name, value);
                    }
                }
            }
            let body = match &input["body"] {
                Value::Null => None,
                Value::String(text) => Some(text.clone().into_bytes()),
                json => {
                    headers
                        .entry(reqwest::header::CONTENT_TYPE)
                        .or_insert(HeaderValue::from_static("application/json"));
                    Some(json.to_string().into_bytes())
                }
            };
            let timeout = input["timeout_ms"].as_u64().map_or(DEFAULT_TIMEOUT, Duration::from_millis);
            let max_bytes =
                input["max_bytes"].as_u64().map_or(DEFAULT_MAX_BYTES, |n| (n as usize).min(MAX_BYTES));
            let fetched = self.client.fetch(method, url, headers, body, timeout, max_bytes).await?;
            let mut headers = Map::new();
            for (name, value) in &fetched.headers {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                match headers.get_mut(name.as_str()) {
                    Some(Value::String(existing)) => {
                        existing.push_str(", ");
                        existing.push_str(&value);
                    }
                    _ => {
                        headers.insert(name.as_str().to_owned(), Value::String(value));
                    }
                }
            }
            let mut output = json!({
                "status": fetched.status,
                "url": fetched.url.as_str(),
                "headers": headers,
            });
            match std::str::from_utf8(&fetched.body) {
                Ok(text) => output["body"] = json!(text),
                // A cut in the middle of a character: the text up to it.
                Err(error) if fetched.truncated && error.error_len().is_none() => {
                    output["body"] = json!(String::from_utf8_lossy(&fetched.body[..error.valid_up_to()]));
                }
                Err(_) => {
                    use base64::Engine as _;
                    output["body_base64"] =
                        json!(base64::engine::general_purpose::STANDARD.encode(&fetched.body));
                }
            }
            if fetched.truncated {
                output["truncated"] = json!(format!("the body was cut at {max_bytes} bytes"));
            }
            Ok(output)
        })
    }
}
