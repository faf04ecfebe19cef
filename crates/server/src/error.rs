//! API errors: a stable code, a message, and the HTTP status the code maps to. Every error the
//! API returns is `{ "error": { "code": "KEEL_...", "message": "..." } }`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel_core::{ErrorCode, RunFailure, StoreError};

/// An error response.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into() }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::RequestInvalid, message)
    }
}

impl From<RunFailure> for ApiError {
    fn from(failure: RunFailure) -> ApiError {
        ApiError { code: failure.code, message: failure.message }
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> ApiError {
        ApiError { code: error.code(), message: error.to_string() }
    }
}

/// The HTTP status of an error code: the only place codes meet statuses.
pub(crate) fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::RequestInvalid | ErrorCode::SessionIdInvalid | ErrorCode::DecisionInvalid => {
            StatusCode::BAD_REQUEST
        }
        ErrorCode::Unauthorized | ErrorCode::SignatureInvalid => StatusCode::UNAUTHORIZED,
        ErrorCode::HostNotAllowed | ErrorCode::OriginNotAllowed => StatusCode::FORBIDDEN,
        ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorCode::NotFound
        | ErrorCode::SessionNotFound
        | ErrorCode::RunNotFound
        | ErrorCode::NotPending
        | ErrorCode::ChannelNotFound => StatusCode::NOT_FOUND,
        ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::SessionBusy | ErrorCode::RunLeased | ErrorCode::RunStarted => StatusCode::CONFLICT,
        ErrorCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::ShuttingDown | ErrorCode::StoreLocked => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::RequestTimeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = status_of(self.code);
        if status.is_server_error() {
            tracing::error!(code = %self.code, message = %self.message, "request failed");
        }
        let body = serde_json::json!({ "error": { "code": self.code.as_str(), "message": self.message } });
        let mut response = (status, axum::Json(body)).into_response();
        if self.code == ErrorCode::Unauthorized {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.code == ErrorCode::BodyTooLarge {
            // The rest of the body is not read: the connection cannot carry another request.
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}
