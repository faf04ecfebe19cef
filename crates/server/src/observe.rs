//! Per-request observability and limits: a request id (the client's `X-Request-Id` when it is
//! sane, else one of ours), a tracing span and one log line per request, metrics by route and
//! status, a timeout for the routes that do not stream, and the W3C trace context a client
//! sends (`traceparent`), which a run it starts continues.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_core::ErrorCode;
use tracing::Instrument;

use crate::AppState;
use crate::error::ApiError;

static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// The trace a request's `traceparent` (and `tracestate`) names, while spans are on: the
/// parent of the runs the request starts.
pub(crate) fn trace_parent(headers: &axum::http::HeaderMap) -> Option<opentelemetry::Context> {
    struct Headers<'a>(&'a axum::http::HeaderMap);
    impl opentelemetry::propagation::Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|value| value.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(axum::http::HeaderName::as_str).collect()
        }
    }
    keel_core::telemetry::tracer()?;
    headers.contains_key("traceparent").then(|| {
        opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Headers(headers)))
    })
}

/// A request id a client may send: short and printable, so it is safe in logs and headers.
fn client_request_id(request: &Request) -> Option<String> {
    let id = request.headers().get("x-request-id")?.to_str().ok()?;
    let sane = !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic());
    sane.then(|| id.to_owned())
}

pub(crate) async fn observe(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = client_request_id(&request).unwrap_or_else(|| {
        format!("req-{:x}-{}", state.started_ms, REQUESTS.fetch_add(1, Ordering::Relaxed))
    });
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_owned();
    let method = request.method().clone();
    let span = tracing::info_span!("request", id = %id, %method, route = %route);
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status().as_u16();
    let took = started.elapsed();
    state.metrics.request(&route, status, took);
    span.in_scope(|| tracing::info!(status, ms = millis(took), "answered"));
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// A duration in milliseconds to the microsecond, for a log line: `ms=0.338`, not
/// `ms=0.33873200000000003` (still a number, for logs written as JSON).
fn millis(took: std::time::Duration) -> f64 {
    took.as_micros() as f64 / 1000.0
}

/// Answers `504 KEEL_REQUEST_TIMEOUT` when a (non-streaming) route takes too long.
pub(crate) async fn timeout(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(state.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            ErrorCode::RequestTimeout,
            format!("the request took longer than {:?}", state.request_timeout),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_request_time_is_logged_to_the_microsecond() {
        assert_eq!(super::millis(Duration::from_nanos(338_732_123)).to_string(), "338.732");
        assert_eq!(super::millis(Duration::from_nanos(338_732)).to_string(), "0.338");
        assert_eq!(super::millis(Duration::from_secs(2)).to_string(), "2000");
    }
}
