//! Bearer-token auth: with `KEEL_API_TOKEN` set, every route but `/health` needs
//! `Authorization: Bearer <token>`, compared in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_core::ErrorCode;
use subtle::ConstantTimeEq;

use crate::AppState;
use crate::error::ApiError;

pub(crate) async fn require_token(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = &state.api_token else {
        return next.run(request).await;
    };
    // The health check, and the playground page, which holds no data (its API calls carry the
    // token the user gives it).
    if matches!(request.uri().path(), "/health" | "/") && request.method() == axum::http::Method::GET {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")))
        .map(str::trim);
    match given {
        Some(token) if token_matches(token, expected) => next.run(request).await,
        Some(_) => ApiError::new(ErrorCode::Unauthorized, "the bearer token is not valid").into_response(),
        None => ApiError::new(
            ErrorCode::Unauthorized,
            "this server needs `Authorization: Bearer <token>` (the server's KEEL_API_TOKEN)",
        )
        .into_response(),
    }
}

/// Compares without leaking, through timing, how much of the token matched.
fn token_matches(given: &str, expected: &str) -> bool {
    // `ct_eq` on slices of different lengths returns early; the length is not the secret.
    given.as_bytes().ct_eq(expected.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn tokens_match_exactly() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cre", "s3cret"));
        assert!(!token_matches("s3cret!", "s3cret"));
        assert!(!token_matches("", "s3cret"));
    }
}
