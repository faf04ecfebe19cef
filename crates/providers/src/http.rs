//! The HTTP side every provider shares: one client, sending a request, turning an error
//! response into a classified [`ProviderError`], and reading a streamed body.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use keel_core::ProviderError;
use keel_core::provider::ProviderErrorKind;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

/// The most of an error body kept for its message.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// The process-wide client: one connection pool, TLS (rustls) checked against the system's CA
/// certificates and those of `KEEL_CA_BUNDLE`; through the proxy `HTTPS_PROXY`/`HTTP_PROXY`/
/// `ALL_PROXY` name, except for the hosts of `NO_PROXY` (reqwest reads them). Certificate
/// verification cannot be turned off.
pub fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let roots = match ca_bundle() {
            Ok(roots) => roots.to_vec(),
            Err(error) => {
                // The CLI refuses to start with a bad bundle; a library caller is told here.
                tracing::error!("{error}: only the system's certificates are trusted");
                Vec::new()
            }
        };
        reqwest::Client::builder()
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .tls_certs_merge(roots)
            .build()
            .expect("the HTTP client builds with static settings")
    })
}

/// The proxy variables the client reads, upper and lower case as curl accepts them.
const PROXY_VARIABLES: [&str; 6] =
    ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"];

/// Checks the proxy variables ([`client`]): reqwest skips a value it cannot parse, and requests
/// then go out directly, past the proxy that was meant to carry them. An error names the
/// variable, never its value (a proxy URL may hold a password).
pub fn check_proxy_environment() -> Result<(), String> {
    check_proxies(|variable| std::env::var_os(variable))
}

fn check_proxies(lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<(), String> {
    for variable in PROXY_VARIABLES {
        let Some(value) = lookup(variable).filter(|value| !value.is_empty()) else { continue };
        let Some(value) = value.to_str() else {
            return Err(format!("{variable} is not UTF-8 text"));
        };
        if let Err(error) = reqwest::Proxy::all(value) {
            // reqwest says only "builder error"; the URL parser says what is wrong (without
            // the value), reading it as reqwest does: `host:port` is `http://host:port`.
            let url = if value.contains("://") { value.to_owned() } else { format!("http://{value}") };
            let reason = reqwest::Url::parse(&url).err().map_or_else(|| error.to_string(), |e| e.to_string());
            return Err(format!(
                "{variable} is not a proxy URL ({reason}): write `http://host:port` (the value is not shown: it may hold a password)"
            ));
        }
    }
    Ok(())
}

/// The extra root certificates `KEEL_CA_BUNDLE` names (a PEM file), read once; none when it is
/// not set. An error names the file and what is wrong with it.
pub fn ca_bundle() -> Result<&'static [reqwest::Certificate], String> {
    static ROOTS: OnceLock<Result<Vec<reqwest::Certificate>, String>> = OnceLock::new();
    let roots = ROOTS.get_or_init(|| {
        let variable = keel_core::env::CA_BUNDLE.name;
        let Some(path) = std::env::var_os(variable).filter(|p| !p.is_empty()) else { return Ok(Vec::new()) };
        let shown = std::path::Path::new(&path).display().to_string();
        let bytes = std::fs::read(&path).map_err(|e| format!("{variable}={shown} cannot be read: {e}"))?;
        let roots = reqwest::Certificate::from_pem_bundle(&bytes)
            .map_err(|e| format!("{variable}={shown} is not a PEM bundle of certificates: {e}"))?;
        if roots.is_empty() {
            return Err(format!(
                "{variable}={shown} holds no certificate: expected PEM blocks `-----BEGIN CERTIFICATE-----`"
            ));
        }
        Ok(roots)
    });
    roots.as_deref().map_err(Clone::clone)
}

/// Builds the header map of a request, refusing names and values HTTP cannot carry (a key
/// with a newline in it, say) with a message that does not repeat the value.
pub(crate) fn headers(
    provider: &str,
    pairs: &[(&str, &str)],
    extra: &[(String, String)],
) -> Result<HeaderMap, ProviderError> {
    let mut map = HeaderMap::new();
    let all = pairs.iter().copied().chain(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    for (name, value) in all {
        let header = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ProviderError::new(
                ProviderErrorKind::BadRequest,
                format!("{provider}: `{name}` is not a valid HTTP header name"),
            )
        })?;
        let mut value = HeaderValue::from_str(value).map_err(|_| {
            ProviderError::new(
                ProviderErrorKind::BadRequest,
                format!("{provider}: the value of header `{name}` has characters HTTP cannot carry (a stray newline?)"),
            )
        })?;
        if name.eq_ignore_ascii_case("authorization") || name.eq_ignore_ascii_case("x-api-key") {
            value.set_sensitive(true);
        }
        map.insert(header, value);
    }
    Ok(map)
}

/// Posts `body` as JSON and returns the response when it is a success; an error response is
/// read and classified.
pub(crate) async fn post(
    provider: &str,
    url: &str,
    headers: HeaderMap,
    body: &Value,
) -> Result<reqwest::Response, ProviderError> {
    let body = serde_json::to_vec(body).expect("a JSON value always serializes");
    let mut request = client().post(url).headers(headers).header(CONTENT_TYPE, "application/json");
    // The call's trace context (`traceparent`), when spans are on: the provider's own traces
    // join the run's.
    for (name, value) in keel_core::telemetry::trace_headers() {
        request = request.header(name, value);
    }
    let response = request.body(body).send().await.map_err(|error| transport_error(provider, url, &error))?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = retry_after(response.headers());
    let html = is_html(response.headers());
    let body = read_capped(response, ERROR_BODY_LIMIT).await;
    Err(error_response(provider, Some(status.as_u16()), &body, html).with_retry_after(retry_after))
}

/// A failure to reach the server or to read from it.
pub(crate) fn transport_error(provider: &str, url: &str, error: &reqwest::Error) -> ProviderError {
    // The URL never holds a key (keys go in headers), so it is safe to show.
    let detail =
        std::error::Error::source(error).map_or_else(|| error.to_string(), |source| source.to_string());
    if error.is_timeout() {
        return ProviderError::new(
            ProviderErrorKind::Timeout,
            format!("{provider}: {url} timed out: {detail}"),
        );
    }
    if error.is_connect() {
        return ProviderError::new(
            ProviderErrorKind::Transient,
            format!("{provider}: could not connect to {url}: {detail}{}", connect_hint(provider)),
        );
    }
    ProviderError::new(
        ProviderErrorKind::Transient,
        format!("{provider}: the request to {url} failed: {detail}"),
    )
}

/// Reads the next piece of a streamed body; `None` at its end.
pub(crate) async fn next_chunk(
    provider: &str,
    response: &mut reqwest::Response,
) -> Result<Option<bytes::Bytes>, ProviderError> {
    response.chunk().await.map_err(|error| {
        let detail = std::error::Error::source(&error).map_or_else(|| error.to_string(), |s| s.to_string());
        ProviderError::new(
            ProviderErrorKind::Transient,
            format!("{provider}: the connection dropped in the middle of the reply ({detail})"),
        )
    })
}

/// Removes the API key from an error's message, in case a server echoed it back: error
/// messages end up in logs, events and terminals.
pub(crate) fn redact(mut error: ProviderError, key: Option<&str>) -> ProviderError {
    if let Some(key) = key.filter(|k| k.len() >= 4)
        && error.message.contains(key)
    {
        error.message = error.message.replace(key, "[redacted]");
    }
    error
}

/// Whether the response says it is HTML (a proxy's error page, a wrong base URL).
pub(crate) fn is_html(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("text/html"))
}

/// The response's media type, lower-cased, without parameters.
pub(crate) fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase())
        .unwrap_or_default()
}

/// Reads up to `limit` bytes of a body; a body that fails midway gives what was read.
pub(crate) async fn read_capped(mut response: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = limit.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= limit {
            break;
        }
    }
    body
}

/// How long the server asked to wait: `retry-after-ms` (OpenAI), else `Retry-After` in seconds
/// or as an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = header("retry-after")?;
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// What an error body says: its message, and the type and code providers put beside it.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct ErrorInfo {
    pub(crate) kind: Option<String>,
    pub(crate) code: Option<String>,
    pub(crate) message: Option<String>,
}

/// Reads the error shapes of the providers: OpenAI `{"error":{"message","type","code"}}`,
/// Anthropic `{"type":"error","error":{"type","message"}}`, Ollama `{"error":"..."}`, and a
/// bare `{"message"}`.
pub(crate) fn error_info(value: &Value) -> ErrorInfo {
    let text = |v: Option<&Value>| match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    match value.get("error") {
        Some(Value::String(message)) => ErrorInfo { message: Some(message.clone()), ..ErrorInfo::default() },
        Some(error @ Value::Object(_)) => ErrorInfo {
            kind: text(error.get("type")),
            code: text(error.get("code")),
            message: text(error.get("message")),
        },
        _ => ErrorInfo { message: text(value.get("message")), ..ErrorInfo::default() },
    }
}

/// Classifies an error response (or an error object found in a stream, `status` `None`).
pub(crate) fn error_response(provider: &str, status: Option<u16>, body: &[u8], html: bool) -> ProviderError {
    let shown = match status {
        Some(status) => format!("{provider} answered HTTP {status}"),
        None => format!("{provider} reported an error"),
    };
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let Some(json) = json.filter(Value::is_object) else {
        let snippet = snippet(body);
        let (kind, what) = if html || snippet.starts_with('<') {
            (
                ProviderErrorKind::BadResponse,
                "an HTML page instead of JSON (a proxy's error page, or a wrong `provider.base_url`?)",
            )
        } else {
            (ProviderErrorKind::BadResponse, "a body that is not JSON")
        };
        let mut error = ProviderError::new(kind, format!("{shown} with {what}: {snippet}"));
        if let Some(status) = status {
            // The status still says the most: a 502 page is a transient server error.
            let by_status = ProviderError::from_status(status, String::new()).kind;
            if by_status != ProviderErrorKind::Transient {
                error.kind = by_status;
            } else if status >= 500 {
                error.kind = ProviderErrorKind::Transient;
            }
            error.status = Some(status);
        }
        return error;
    };
    let info = error_info(&json);
    let message = info.message.clone().unwrap_or_else(|| snippet(body));
    let label = match (&info.kind, &info.code) {
        (Some(kind), _) => format!(" ({kind})"),
        (None, Some(code)) => format!(" ({code})"),
        (None, None) => String::new(),
    };
    let mut error = match status {
        Some(status) => ProviderError::from_status(status, format!("{shown}{label}: {message}")),
        None => {
            // An error inside a 200 or a stream: a numeric code may say what it is (OpenRouter).
            let code = info.code.as_deref().and_then(|c| c.parse::<u16>().ok());
            let mut error = match code {
                Some(code @ 400..=599) => ProviderError::from_status(code, String::new()),
                _ => ProviderError::new(ProviderErrorKind::BadResponse, String::new()),
            };
            error.message = format!("{shown}{label}: {message}");
            error
        }
    };
    if let Some(kind) = refine(&info, &message) {
        error.kind = kind;
    }
    error.message.push_str(status_hint(provider, error.kind));
    error
}

/// What to check when a provider's server cannot be reached, by provider.
fn connect_hint(provider: &str) -> &'static str {
    match provider {
        "ollama" => {
            " (is Ollama running? start it with `ollama serve`, or set OLLAMA_HOST to where it listens)"
        }
        "openai-compatible" => {
            " (is the server running? check `provider.base_url` or OPENAI_BASE_URL: its host, port and `/v1`)"
        }
        _ => " (check the network, a proxy, and the provider's base URL if you set one)",
    }
}

/// What to check after an answer that says the key or the address is wrong, by provider.
fn status_hint(provider: &str, kind: ProviderErrorKind) -> &'static str {
    match (kind, provider) {
        (ProviderErrorKind::Auth, "openai" | "openai-compatible") => " (check OPENAI_API_KEY)",
        (ProviderErrorKind::Auth, "openrouter") => " (check OPENROUTER_API_KEY)",
        (ProviderErrorKind::Auth, "anthropic") => " (check ANTHROPIC_API_KEY)",
        (ProviderErrorKind::Auth, "ollama") => " (check OLLAMA_API_KEY)",
        (ProviderErrorKind::NotFound, "ollama") => " (is the model pulled? `ollama pull <model>`)",
        (ProviderErrorKind::NotFound, _) => {
            " (check the model's name, and `provider.base_url` if you set one)"
        }
        _ => "",
    }
}

/// What the error's type, code or message say beyond the status.
fn refine(info: &ErrorInfo, message: &str) -> Option<ProviderErrorKind> {
    let names = [info.kind.as_deref(), info.code.as_deref()];
    let has = |wanted: &[&str]| names.iter().flatten().any(|name| wanted.contains(name));
    if has(&["insufficient_quota", "billing_hard_limit_reached"]) {
        // A 429 that waiting will not fix: the account is out of credit.
        return Some(ProviderErrorKind::Permission);
    }
    if has(&["context_length_exceeded", "string_above_max_length"]) || is_context_message(message) {
        return Some(ProviderErrorKind::ContextTooLong);
    }
    if has(&["overloaded_error"]) {
        return Some(ProviderErrorKind::Overloaded);
    }
    if has(&["rate_limit_error", "rate_limit_exceeded"]) {
        return Some(ProviderErrorKind::RateLimited);
    }
    if has(&["authentication_error", "invalid_api_key"]) {
        return Some(ProviderErrorKind::Auth);
    }
    if has(&["permission_error"]) {
        return Some(ProviderErrorKind::Permission);
    }
    if has(&["not_found_error", "model_not_found"]) {
        return Some(ProviderErrorKind::NotFound);
    }
    if has(&["api_error", "server_error"]) {
        return Some(ProviderErrorKind::Transient);
    }
    if has(&["timeout_error"]) {
        return Some(ProviderErrorKind::Timeout);
    }
    None
}

/// The wordings providers use when a conversation does not fit the context window.
fn is_context_message(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    [
        "context length",
        "context_length",
        "context window",
        "prompt is too long",
        "maximum context",
        "exceeds the available context",
        "too many tokens",
    ]
    .iter()
    .any(|pattern| message.contains(pattern))
}

/// The start of a body, as readable text on one line (an HTML page's title when it has one).
pub(crate) fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let lower = text.to_ascii_lowercase();
    if let (Some(start), Some(end)) = (lower.find("<title>"), lower.find("</title>"))
        && start + 7 <= end
    {
        return format!("\"{}\"", text[start + 7..end].trim());
    }
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.is_empty() {
        return "(empty body)".into();
    }
    let mut cut: String = flat.chars().take(300).collect();
    if cut.len() < flat.len() {
        cut.push('…');
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        headers("test", pairs, &[]).unwrap()
    }

    #[test]
    fn a_proxy_variable_that_is_not_a_url_is_named_without_its_value() {
        let only = |name: &'static str, value: &'static str| {
            move |variable: &str| (variable == name).then(|| std::ffi::OsString::from(value))
        };
        assert_eq!(check_proxies(|_| None), Ok(()));
        for good in
            ["http://proxy.corp:3128", "proxy.corp:3128", "socks5://127.0.0.1:1080", "http://u:p@proxy:8080"]
        {
            assert_eq!(check_proxies(only("HTTPS_PROXY", good)), Ok(()), "{good}");
        }
        let error = check_proxies(only("http_proxy", "http://us:hunter2@[::bad")).unwrap_err();
        assert!(error.starts_with("http_proxy is not a proxy URL ("), "{error}");
        assert!(!error.contains("hunter2"), "the password shows: {error}");
        assert!(check_proxies(only("ALL_PROXY", "::bad")).is_err());
    }

    #[test]
    fn retry_after_in_every_form() {
        assert_eq!(retry_after(&map(&[("retry-after", "7")])), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&map(&[("retry-after", "1.5")])), Some(Duration::from_millis(1500)));
        assert_eq!(
            retry_after(&map(&[("retry-after-ms", "250"), ("retry-after", "9")])),
            Some(Duration::from_millis(250))
        );
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
        let wait = retry_after(&map(&[("retry-after", &later)])).unwrap();
        assert!(wait > Duration::from_secs(27) && wait <= Duration::from_secs(30), "{wait:?}");
        let past = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(30));
        assert_eq!(retry_after(&map(&[("retry-after", &past)])), Some(Duration::ZERO));
        assert_eq!(retry_after(&map(&[("retry-after", "soon")])), None);
        assert_eq!(retry_after(&map(&[("retry-after", "-3")])), None);
        assert_eq!(retry_after(&map(&[])), None);
    }

    #[test]
    fn error_bodies_are_classified() {
        let kind = |status, body: &str| error_response("p", status, body.as_bytes(), false).kind;
        use ProviderErrorKind::*;
        assert_eq!(
            kind(
                Some(401),
                r#"{"error":{"message":"bad key","type":"invalid_request_error","code":"invalid_api_key"}}"#
            ),
            Auth
        );
        assert_eq!(
            kind(Some(403), r#"{"type":"error","error":{"type":"permission_error","message":"no"}}"#),
            Permission
        );
        assert_eq!(kind(Some(404), r#"{"error":"model 'x' not found"}"#), NotFound);
        assert_eq!(
            kind(Some(429), r#"{"error":{"message":"slow","type":"requests","code":"rate_limit_exceeded"}}"#),
            RateLimited
        );
        assert_eq!(
            kind(
                Some(429),
                r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota"}}"#
            ),
            Permission
        );
        assert_eq!(
            kind(
                Some(400),
                r#"{"error":{"message":"This model's maximum context length is 128000 tokens","code":"context_length_exceeded"}}"#
            ),
            ContextTooLong
        );
        assert_eq!(
            kind(
                Some(400),
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#
            ),
            ContextTooLong
        );
        assert_eq!(kind(Some(400), r#"{"error":{"message":"bad tool schema"}}"#), BadRequest);
        assert_eq!(
            kind(Some(529), r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#),
            Overloaded
        );
        assert_eq!(kind(Some(503), "upstream down"), Overloaded);
        assert_eq!(
            kind(Some(500), r#"{"type":"error","error":{"type":"api_error","message":"boom"}}"#),
            Transient
        );
        assert_eq!(kind(Some(502), "<html><title>502 Bad Gateway</title></html>"), Transient);
        assert_eq!(kind(Some(409), "{}"), Transient);
        assert_eq!(kind(Some(408), "{}"), Timeout);
        // An error object inside a 200 or a stream.
        assert_eq!(kind(None, r#"{"error":{"message":"Overloaded","code":502}}"#), Transient);
        assert_eq!(kind(None, r#"{"error":{"message":"weird"}}"#), BadResponse);
        assert_eq!(
            kind(None, r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#),
            Overloaded
        );
    }

    #[test]
    fn messages_name_the_provider_status_and_reason() {
        let error = error_response(
            "anthropic",
            Some(529),
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            false,
        );
        assert_eq!(error.message, "anthropic answered HTTP 529 (overloaded_error): Overloaded");
        let html = error_response(
            "openai",
            Some(200),
            b"<!doctype html><html><head><title>Sign in</title></head></html>",
            true,
        );
        assert_eq!(html.kind, ProviderErrorKind::BadResponse);
        assert!(
            html.message.contains("HTML page instead of JSON") && html.message.contains("\"Sign in\""),
            "{}",
            html.message
        );
    }

    #[test]
    fn sensitive_headers_are_marked_and_bad_values_refused() {
        let map = map(&[("authorization", "Bearer sk-1"), ("x-api-key", "k")]);
        assert!(map.get("authorization").unwrap().is_sensitive());
        assert!(map.get("x-api-key").unwrap().is_sensitive());
        let error = headers("openai", &[("authorization", "Bearer sk\nsecret")], &[]).unwrap_err();
        assert!(!error.message.contains("secret"), "{}", error.message);
    }
}
