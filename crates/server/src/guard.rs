//! Browser safety: what a web page open in the user's browser cannot make keel do.
//!
//! A browser sends requests wherever a page tells it to, `http://127.0.0.1:3000` included, and
//! some without asking the server first (a `text/plain` POST is a "simple" request: no CORS
//! preflight). A keel without auth on the user's machine would run such a page's input, and a
//! page that points its own domain at 127.0.0.1 (DNS rebinding) could even read the answers. Two
//! checks close that, before auth and before any route:
//!
//! - **Host**: a server without auth answers only requests addressed to a loopback name
//!   (`localhost`, `*.localhost`, a loopback IP) or one listed in `KEEL_ALLOWED_HOSTS`. A rebound
//!   domain still sends its own name in `Host`, so it is refused (`KEEL_HOST_NOT_ALLOWED`).
//! - **Origin**: a request that says which page sent it (`Origin`) is refused unless that page is
//!   the server's own origin (the playground) or listed in `KEEL_CORS_ORIGINS`
//!   (`KEEL_ORIGIN_NOT_ALLOWED`).
//!
//! The third check is in the JSON routes' body extractor: they take only
//! `Content-Type: application/json` (`415` otherwise), which a browser cannot send across origins
//! without a preflight, and the preflight is answered (by `tower-http`'s CORS layer) only for the
//! listed origins.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_core::ErrorCode;

use crate::AppState;
use crate::error::ApiError;

/// Which hosts and origins a server accepts.
#[derive(Clone, Debug)]
pub(crate) struct BrowserPolicy {
    /// The `Host` names (lower case, no port) accepted besides loopback ones; `None`: any host
    /// (the server has auth, or `KEEL_ALLOWED_HOSTS` is `*`).
    hosts: Option<Vec<String>>,
    /// The origins (`scheme://host[:port]`, lower case) allowed besides the server's own.
    origins: Vec<String>,
}

impl BrowserPolicy {
    pub(crate) fn new(has_auth: bool, allowed_hosts: &[String], cors_origins: &[String]) -> BrowserPolicy {
        let any_host = has_auth || allowed_hosts.iter().any(|host| host.trim() == "*");
        let hosts = (!any_host).then(|| {
            allowed_hosts
                .iter()
                .map(|host| strip_port(&host.trim().to_ascii_lowercase()).to_owned())
                .filter(|host| !host.is_empty())
                .collect()
        });
        let origins = cors_origins.iter().map(|origin| normalize_origin(origin)).collect();
        BrowserPolicy { hosts, origins }
    }

    /// Whether `origin` is listed in `KEEL_CORS_ORIGINS`.
    pub(crate) fn lists_origin(&self, origin: &str) -> bool {
        let origin = normalize_origin(origin);
        self.origins.contains(&origin)
    }

    fn check(&self, request: &Request) -> Result<(), ApiError> {
        // HTTP/2 (and absolute-form HTTP/1.1) name the host in the URI; HTTP/1.1 in `Host`.
        // Compared without copying: this runs on every request.
        let authority = match request.uri().authority() {
            Some(authority) => Some(authority.as_str()),
            None => request.headers().get(header::HOST).and_then(|host| host.to_str().ok()).map(str::trim),
        };
        if let (Some(allowed), Some(authority)) = (&self.hosts, authority) {
            let host = strip_port(authority);
            if !is_loopback_name(host) && !allowed.iter().any(|name| name.eq_ignore_ascii_case(host)) {
                return Err(ApiError::new(
                    ErrorCode::HostNotAllowed,
                    format!(
                        "this server has no auth, so it answers only requests addressed to localhost, not to \
                         {host:?} (a web page can point its own name at 127.0.0.1 to reach it). If that name \
                         is yours, add it to KEEL_ALLOWED_HOSTS; or set KEEL_API_TOKEN"
                    ),
                ));
            }
        }
        if let Some(origin) = request.headers().get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("(not text)");
            let same_origin = authority.is_some_and(|authority| {
                let origin = origin.trim().trim_end_matches('/');
                origin.split_once("://").is_some_and(|(_, host)| host.eq_ignore_ascii_case(authority))
            });
            if !same_origin && !self.lists_origin(origin) {
                return Err(ApiError::new(
                    ErrorCode::OriginNotAllowed,
                    format!(
                        "requests from the web page at {origin:?} are refused: only this server's own pages and \
                         the origins in KEEL_CORS_ORIGINS may call it"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `host` without a `:port` (an IPv6 literal keeps its brackets).
fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    authority.rsplit_once(':').map_or(authority, |(host, _)| host)
}

/// `localhost`, a name under `.localhost` (browsers resolve them to loopback themselves, never
/// through DNS), or a loopback IP address.
fn is_loopback_name(host: &str) -> bool {
    let host = host.trim_end_matches('.');
    const LOCALHOST: &str = "localhost";
    let under_localhost = host.len() > LOCALHOST.len()
        && host.is_char_boundary(host.len() - LOCALHOST.len() - 1)
        && host[host.len() - LOCALHOST.len() - 1..].eq_ignore_ascii_case(".localhost");
    if host.eq_ignore_ascii_case(LOCALHOST) || under_localhost {
        return true;
    }
    let ip = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// An origin as compared: lower case, no trailing slash.
fn normalize_origin(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// Refuses requests that a web page could have sent without the user meaning to.
pub(crate) async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match state.browser.check(&request) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

/// The CORS layer for `KEEL_CORS_ORIGINS`: preflights answered for those origins only, and the
/// headers a page needs on the answers (no credentials mode: the API takes bearer tokens, not
/// cookies).
pub(crate) fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderName, HeaderValue, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    // As browsers send them (and as the guard compares them): lower case, no trailing slash.
    let origins: Vec<HeaderValue> =
        origins.iter().filter_map(|origin| HeaderValue::from_str(&normalize_origin(origin)).ok()).collect();
    if origins.is_empty() {
        return None;
    }
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            // The listed origins may send any header they ask for (OpenAI's browser SDK sends
            // its own `x-stainless-*` ones): the origin list is what keeps other pages out.
            .allow_headers(tower_http::cors::AllowHeaders::mirror_request())
            .expose_headers([
                HeaderName::from_static("x-request-id"),
                HeaderName::from_static("x-keel-session"),
                HeaderName::from_static("x-keel-run-id"),
                HeaderName::from_static("x-keel-last-event-id"),
            ])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(host: &str, origin: Option<&str>) -> Request {
        let mut builder = Request::builder().uri("/chat").header(header::HOST, host);
        if let Some(origin) = origin {
            builder = builder.header(header::ORIGIN, origin);
        }
        builder.body(axum::body::Body::empty()).unwrap()
    }

    fn code(policy: &BrowserPolicy, host: &str, origin: Option<&str>) -> Option<ErrorCode> {
        policy.check(&request(host, origin)).err().map(|error| error.code)
    }

    #[test]
    fn without_auth_only_loopback_names_and_listed_hosts_pass() {
        let policy = BrowserPolicy::new(false, &["keel.internal".into()], &[]);
        for host in
            ["127.0.0.1:3000", "localhost:3000", "LOCALHOST", "app.localhost:8080", "[::1]:3000", "127.9.9.9"]
        {
            assert_eq!(code(&policy, host, None), None, "{host}");
        }
        assert_eq!(code(&policy, "keel.internal:3000", None), None);
        for host in
            ["rebind.evil.example:3000", "evil.example", "localhost.evil.example", "10.0.0.1:3000", "[::2]"]
        {
            assert_eq!(code(&policy, host, None), Some(ErrorCode::HostNotAllowed), "{host}");
        }
        let any = BrowserPolicy::new(true, &[], &[]);
        assert_eq!(code(&any, "rebind.evil.example", None), None);
    }

    #[test]
    fn origins_other_than_the_servers_own_need_listing() {
        let policy = BrowserPolicy::new(false, &[], &["https://app.example.com/".into()]);
        assert_eq!(code(&policy, "127.0.0.1:3000", Some("http://127.0.0.1:3000")), None);
        assert_eq!(code(&policy, "127.0.0.1:3000", Some("https://App.Example.com")), None);
        for origin in ["https://evil.example", "http://127.0.0.1:4000", "null", "http://localhost:3000"] {
            assert_eq!(
                code(&policy, "127.0.0.1:3000", Some(origin)),
                Some(ErrorCode::OriginNotAllowed),
                "{origin}"
            );
        }
    }
}
