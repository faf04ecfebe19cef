//! Stable error codes and the failure value a run ends with.
//!
//! Every error a user can see carries an [`ErrorCode`]: a stable `KEEL_...` string that the CLI
//! prints, the HTTP API returns and `docs/errors.md` explains. Codes are never reused or renamed.

use std::fmt;

/// A stable error code. `docs/errors.md` has a section for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// A spec file or agent directory could not be read (missing, unreadable).
    SpecNotFound,
    /// A spec file is not valid YAML, TOML or JSON.
    SpecSyntax,
    /// A spec has an unknown key, a value of the wrong type or an invalid value.
    SpecInvalid,
    /// A spec uses a feature this build does not support yet.
    SpecUnsupported,
    /// A session id is not 1-128 characters of `A-Za-z0-9_-`.
    SessionIdInvalid,
    /// The session already has a run in flight.
    SessionBusy,
    /// No run with this id exists in the store.
    RunNotFound,
    /// No session with this id exists in the store.
    SessionNotFound,
    /// The model provider failed (server error, bad reply); may be transient.
    ProviderError,
    /// The model provider rate-limited the request.
    ProviderRateLimited,
    /// The model call took longer than `limits.provider_timeout`.
    ProviderTimeout,
    /// The provider rejected the credentials.
    ProviderAuth,
    /// The provider rejected the request as invalid.
    ProviderBadRequest,
    /// The model cannot be set up: an unknown provider, no model name, no or a bad base URL.
    ProviderUnavailable,
    /// The provider's API key variable is not set.
    ProviderKeyMissing,
    /// The provider accepted the credentials but refused access (HTTP 403).
    ProviderPermission,
    /// The provider does not know the model or the endpoint (HTTP 404).
    ProviderNotFound,
    /// The conversation is longer than the model's context window.
    ProviderContextTooLong,
    /// The provider is overloaded (HTTP 529, or 503); may be transient.
    ProviderOverloaded,
    /// The provider answered something that is not its protocol (HTML, a truncated or malformed
    /// stream, an error inside a 200).
    ProviderBadResponse,
    /// The model called a tool the agent does not have.
    ToolNotFound,
    /// The model's tool input does not match the tool's JSON Schema.
    ToolInputInvalid,
    /// A tool call took longer than `limits.tool_timeout`.
    ToolTimeout,
    /// A tool reported an error.
    ToolFailed,
    /// A tool panicked.
    ToolPanicked,
    /// A tool call was not run because the run's `max_tool_calls` budget was spent.
    ToolBudgetExhausted,
    /// A tool call was not run because the run was cancelled.
    ToolCancelled,
    /// A tool call was not run because a human rejected it (or nobody approved it in time).
    ToolRejected,
    /// A built-in tool refused what the call asked for: a private address, a host outside
    /// `http.allow`, a path outside the workspace...
    ToolRefused,
    /// An approval or question id is not pending (unknown, already decided, or its run ended).
    NotPending,
    /// A decision does not fit what is pending (an answer to an approval, a verdict on a question).
    DecisionInvalid,
    /// The final answer does not match `output.schema`.
    OutputInvalid,
    /// The store failed.
    Store,
    /// The store's database is locked by another process for longer than the busy timeout.
    StoreLocked,
    /// The store's database cannot be written (read-only file or directory).
    StoreReadOnly,
    /// The store's database was written by a newer keel (a newer schema version).
    StoreSchemaNewer,
    /// The store's database is damaged or not a keel database.
    StoreCorrupt,
    /// A journal record could not be decoded (corrupt, or written by a newer keel).
    JournalCorrupt,
    /// The run is being driven by another process (its lease is held and not expired).
    RunLeased,
    /// The run is finished and its journal no longer holds a step a re-drive needs (it was
    /// compacted): nothing is executed again.
    RunFinished,
    /// This process lost the run's lease (it stalled past the lease's expiry and another process
    /// took the run over); it stopped without writing over the new owner's work.
    LeaseLost,
    /// The process is shutting down: the run stopped between two steps and is resumable.
    ShuttingDown,
    /// An HTTP request is malformed: not JSON, a missing field, a value of the wrong type.
    RequestInvalid,
    /// An HTTP request body is over the limit (1 MB).
    BodyTooLarge,
    /// An HTTP request has no valid credentials.
    Unauthorized,
    /// No such route (or the resource is not visible to the caller).
    NotFound,
    /// The route exists but not with this HTTP method.
    MethodNotAllowed,
    /// An HTTP request took longer than the server's request timeout.
    RequestTimeout,
    /// The caller made more requests than the server's per-identity rate limit allows.
    RateLimited,
    /// A bug in keel: please report it.
    Internal,
}

impl ErrorCode {
    /// Every code, in documentation order.
    pub const ALL: &'static [ErrorCode] = &[
        ErrorCode::SpecNotFound,
        ErrorCode::SpecSyntax,
        ErrorCode::SpecInvalid,
        ErrorCode::SpecUnsupported,
        ErrorCode::SessionIdInvalid,
        ErrorCode::SessionBusy,
        ErrorCode::RunNotFound,
        ErrorCode::SessionNotFound,
        ErrorCode::ProviderError,
        ErrorCode::ProviderRateLimited,
        ErrorCode::ProviderTimeout,
        ErrorCode::ProviderAuth,
        ErrorCode::ProviderBadRequest,
        ErrorCode::ProviderUnavailable,
        ErrorCode::ProviderKeyMissing,
        ErrorCode::ProviderPermission,
        ErrorCode::ProviderNotFound,
        ErrorCode::ProviderContextTooLong,
        ErrorCode::ProviderOverloaded,
        ErrorCode::ProviderBadResponse,
        ErrorCode::ToolNotFound,
        ErrorCode::ToolInputInvalid,
        ErrorCode::ToolTimeout,
        ErrorCode::ToolFailed,
        ErrorCode::ToolPanicked,
        ErrorCode::ToolBudgetExhausted,
        ErrorCode::ToolCancelled,
        ErrorCode::ToolRejected,
        ErrorCode::ToolRefused,
        ErrorCode::NotPending,
        ErrorCode::DecisionInvalid,
        ErrorCode::OutputInvalid,
        ErrorCode::Store,
        ErrorCode::StoreLocked,
        ErrorCode::StoreReadOnly,
        ErrorCode::StoreSchemaNewer,
        ErrorCode::StoreCorrupt,
        ErrorCode::JournalCorrupt,
        ErrorCode::RunLeased,
        ErrorCode::RunFinished,
        ErrorCode::LeaseLost,
        ErrorCode::ShuttingDown,
        ErrorCode::RequestInvalid,
        ErrorCode::BodyTooLarge,
        ErrorCode::Unauthorized,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::RequestTimeout,
        ErrorCode::RateLimited,
        ErrorCode::Internal,
    ];

    /// The stable `KEEL_...` string.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::SpecNotFound => "KEEL_SPEC_NOT_FOUND",
            ErrorCode::SpecSyntax => "KEEL_SPEC_SYNTAX",
            ErrorCode::SpecInvalid => "KEEL_SPEC_INVALID",
            ErrorCode::SpecUnsupported => "KEEL_SPEC_UNSUPPORTED",
            ErrorCode::SessionIdInvalid => "KEEL_SESSION_ID_INVALID",
            ErrorCode::SessionBusy => "KEEL_SESSION_BUSY",
            ErrorCode::RunNotFound => "KEEL_RUN_NOT_FOUND",
            ErrorCode::SessionNotFound => "KEEL_SESSION_NOT_FOUND",
            ErrorCode::ProviderError => "KEEL_PROVIDER_ERROR",
            ErrorCode::ProviderRateLimited => "KEEL_PROVIDER_RATE_LIMITED",
            ErrorCode::ProviderTimeout => "KEEL_PROVIDER_TIMEOUT",
            ErrorCode::ProviderAuth => "KEEL_PROVIDER_AUTH",
            ErrorCode::ProviderBadRequest => "KEEL_PROVIDER_BAD_REQUEST",
            ErrorCode::ProviderUnavailable => "KEEL_PROVIDER_UNAVAILABLE",
            ErrorCode::ProviderKeyMissing => "KEEL_PROVIDER_KEY_MISSING",
            ErrorCode::ProviderPermission => "KEEL_PROVIDER_PERMISSION",
            ErrorCode::ProviderNotFound => "KEEL_PROVIDER_NOT_FOUND",
            ErrorCode::ProviderContextTooLong => "KEEL_PROVIDER_CONTEXT_TOO_LONG",
            ErrorCode::ProviderOverloaded => "KEEL_PROVIDER_OVERLOADED",
            ErrorCode::ProviderBadResponse => "KEEL_PROVIDER_BAD_RESPONSE",
            ErrorCode::ToolNotFound => "KEEL_TOOL_NOT_FOUND",
            ErrorCode::ToolInputInvalid => "KEEL_TOOL_INPUT_INVALID",
            ErrorCode::ToolTimeout => "KEEL_TOOL_TIMEOUT",
            ErrorCode::ToolFailed => "KEEL_TOOL_FAILED",
            ErrorCode::ToolPanicked => "KEEL_TOOL_PANICKED",
            ErrorCode::ToolBudgetExhausted => "KEEL_TOOL_BUDGET_EXHAUSTED",
            ErrorCode::ToolCancelled => "KEEL_TOOL_CANCELLED",
            ErrorCode::ToolRejected => "KEEL_TOOL_REJECTED",
            ErrorCode::ToolRefused => "KEEL_TOOL_REFUSED",
            ErrorCode::NotPending => "KEEL_NOT_PENDING",
            ErrorCode::DecisionInvalid => "KEEL_DECISION_INVALID",
            ErrorCode::OutputInvalid => "KEEL_OUTPUT_INVALID",
            ErrorCode::Store => "KEEL_STORE",
            ErrorCode::StoreLocked => "KEEL_STORE_LOCKED",
            ErrorCode::StoreReadOnly => "KEEL_STORE_READ_ONLY",
            ErrorCode::StoreSchemaNewer => "KEEL_STORE_SCHEMA_NEWER",
            ErrorCode::StoreCorrupt => "KEEL_STORE_CORRUPT",
            ErrorCode::JournalCorrupt => "KEEL_JOURNAL_CORRUPT",
            ErrorCode::RunLeased => "KEEL_RUN_LEASED",
            ErrorCode::RunFinished => "KEEL_RUN_FINISHED",
            ErrorCode::LeaseLost => "KEEL_LEASE_LOST",
            ErrorCode::ShuttingDown => "KEEL_SHUTTING_DOWN",
            ErrorCode::RequestInvalid => "KEEL_REQUEST_INVALID",
            ErrorCode::BodyTooLarge => "KEEL_BODY_TOO_LARGE",
            ErrorCode::Unauthorized => "KEEL_UNAUTHORIZED",
            ErrorCode::NotFound => "KEEL_NOT_FOUND",
            ErrorCode::MethodNotAllowed => "KEEL_METHOD_NOT_ALLOWED",
            ErrorCode::RequestTimeout => "KEEL_REQUEST_TIMEOUT",
            ErrorCode::RateLimited => "KEEL_RATE_LIMITED",
            ErrorCode::Internal => "KEEL_INTERNAL",
        }
    }

    /// Parses a `KEEL_...` string.
    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == code)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a run (or a request to start one) failed: a code and a message that says what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RunFailure {
    /// The stable code.
    pub code: ErrorCode,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl RunFailure {
    /// A failure with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> RunFailure {
        RunFailure { code, message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_parse_back() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(code.as_str().starts_with("KEEL_"));
            assert!(seen.insert(code.as_str()), "duplicate {code}");
            assert_eq!(ErrorCode::parse(code.as_str()), Some(*code));
        }
    }
}
