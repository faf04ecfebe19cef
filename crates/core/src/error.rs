//! Stable error codes and the failure value a run ends with.
//!
//! Every error a user can see carries an [`ErrorCode`]: a stable `KEEL_...` string that the CLI
//! prints, the HTTP API returns and `docs/errors.md` explains. Codes are never reused or renamed.

use std::fmt;

/// Declares every code once: its variant, its stable string and its documentation. The enum,
/// [`ErrorCode::ALL`] and [`ErrorCode::as_str`] are generated from this one list.
macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $name:ident = $code:literal,)*) => {
        /// A stable error code. `docs/errors.md` has a section for each.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $($(#[doc = $doc])* $name,)*
        }

        impl ErrorCode {
            /// Every code, in documentation order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];

            /// The stable `KEEL_...` string.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$name => $code,)*
                }
            }
        }
    };
}

error_codes! {
    /// A spec file or agent directory could not be read (missing, unreadable).
    SpecNotFound = "KEEL_SPEC_NOT_FOUND",
    /// A spec file is not valid YAML, TOML or JSON.
    SpecSyntax = "KEEL_SPEC_SYNTAX",
    /// A spec has an unknown key, a value of the wrong type or an invalid value.
    SpecInvalid = "KEEL_SPEC_INVALID",
    /// A spec uses something this build cannot do: a capability it was compiled without (a
    /// cargo feature), or a key this version does not implement.
    SpecUnsupported = "KEEL_SPEC_UNSUPPORTED",
    /// A session id is not 1-128 characters of `A-Za-z0-9_-`.
    SessionIdInvalid = "KEEL_SESSION_ID_INVALID",
    /// The session already has a run in flight.
    SessionBusy = "KEEL_SESSION_BUSY",
    /// No run with this id exists in the store.
    RunNotFound = "KEEL_RUN_NOT_FOUND",
    /// An inbound webhook's signature is missing, wrong, or too old.
    SignatureInvalid = "KEEL_SIGNATURE_INVALID",
    /// No channel of this name is mounted.
    ChannelNotFound = "KEEL_CHANNEL_NOT_FOUND",
    /// A delayed run cannot be cancelled as such: it already started.
    RunStarted = "KEEL_RUN_STARTED",
    /// No session with this id exists in the store.
    SessionNotFound = "KEEL_SESSION_NOT_FOUND",
    /// The model provider failed (server error, bad reply); may be transient.
    ProviderError = "KEEL_PROVIDER_ERROR",
    /// The model provider rate-limited the request.
    ProviderRateLimited = "KEEL_PROVIDER_RATE_LIMITED",
    /// The model call took longer than `limits.provider_timeout`.
    ProviderTimeout = "KEEL_PROVIDER_TIMEOUT",
    /// The provider rejected the credentials.
    ProviderAuth = "KEEL_PROVIDER_AUTH",
    /// The provider rejected the request as invalid.
    ProviderBadRequest = "KEEL_PROVIDER_BAD_REQUEST",
    /// The model cannot be set up: an unknown provider, no model name, no or a bad base URL.
    ProviderUnavailable = "KEEL_PROVIDER_UNAVAILABLE",
    /// The provider's API key variable is not set.
    ProviderKeyMissing = "KEEL_PROVIDER_KEY_MISSING",
    /// The provider accepted the credentials but refused access (HTTP 403).
    ProviderPermission = "KEEL_PROVIDER_PERMISSION",
    /// The provider does not know the model or the endpoint (HTTP 404).
    ProviderNotFound = "KEEL_PROVIDER_NOT_FOUND",
    /// The conversation is longer than the model's context window.
    ProviderContextTooLong = "KEEL_PROVIDER_CONTEXT_TOO_LONG",
    /// The provider is overloaded (HTTP 529, or 503); may be transient.
    ProviderOverloaded = "KEEL_PROVIDER_OVERLOADED",
    /// The provider answered something that is not its protocol (HTML, a truncated or malformed
    /// stream, an error inside a 200).
    ProviderBadResponse = "KEEL_PROVIDER_BAD_RESPONSE",
    /// The model called a tool the agent does not have.
    ToolNotFound = "KEEL_TOOL_NOT_FOUND",
    /// The model's tool input does not match the tool's JSON Schema.
    ToolInputInvalid = "KEEL_TOOL_INPUT_INVALID",
    /// A tool call took longer than `limits.tool_timeout`.
    ToolTimeout = "KEEL_TOOL_TIMEOUT",
    /// A tool reported an error.
    ToolFailed = "KEEL_TOOL_FAILED",
    /// A tool panicked.
    ToolPanicked = "KEEL_TOOL_PANICKED",
    /// A tool call was not run because the run's `max_tool_calls` budget was spent.
    ToolBudgetExhausted = "KEEL_TOOL_BUDGET_EXHAUSTED",
    /// A tool call was not run because the run was cancelled.
    ToolCancelled = "KEEL_TOOL_CANCELLED",
    /// A tool call was not run because a human rejected it (or nobody approved it in time).
    ToolRejected = "KEEL_TOOL_REJECTED",
    /// A built-in tool refused what the call asked for: a private address, a host outside
    /// `http.allow`, a path outside the workspace...
    ToolRefused = "KEEL_TOOL_REFUSED",
    /// The search backend of `web_search` rejected its API key, or the key's variable is not
    /// set.
    SearchAuth = "KEEL_SEARCH_AUTH",
    /// The search backend kept answering "too many requests" after the retries, or its plan's
    /// quota is spent.
    SearchThrottled = "KEEL_SEARCH_THROTTLED",
    /// The search backend answered something that is not its API (an HTML page, JSON of another
    /// shape).
    SearchBadResponse = "KEEL_SEARCH_BAD_RESPONSE",
    /// The search backend could not be reached, timed out, or failed (HTTP 5xx, another error).
    SearchUnavailable = "KEEL_SEARCH_UNAVAILABLE",
    /// An MCP server did not start, did not finish `initialize` in time, or its tool list could
    /// not be read.
    McpStartFailed = "KEEL_MCP_START_FAILED",
    /// An MCP server is unreachable or died while a call was in flight (it is restarted).
    McpUnavailable = "KEEL_MCP_UNAVAILABLE",
    /// An MCP server broke the protocol: an invalid message, an unexpected answer, a result
    /// over the size limit.
    McpProtocol = "KEEL_MCP_PROTOCOL",
    /// An MCP tool's name here collides with another tool's (a built-in, another server's).
    McpToolConflict = "KEEL_MCP_TOOL_CONFLICT",
    /// An approval or question id is not pending (unknown, already decided, or its run ended).
    NotPending = "KEEL_NOT_PENDING",
    /// A decision does not fit what is pending (an answer to an approval, a verdict on a question).
    DecisionInvalid = "KEEL_DECISION_INVALID",
    /// The final answer does not match `output.schema`.
    OutputInvalid = "KEEL_OUTPUT_INVALID",
    /// The store failed.
    Store = "KEEL_STORE",
    /// The store's database is locked by another process for longer than the busy timeout.
    StoreLocked = "KEEL_STORE_LOCKED",
    /// The store's database cannot be written (read-only file or directory).
    StoreReadOnly = "KEEL_STORE_READ_ONLY",
    /// The store's database was written by a newer keel (a newer schema version).
    StoreSchemaNewer = "KEEL_STORE_SCHEMA_NEWER",
    /// The store's database is damaged or not a keel database.
    StoreCorrupt = "KEEL_STORE_CORRUPT",
    /// A journal record could not be decoded (corrupt, or written by a newer keel).
    JournalCorrupt = "KEEL_JOURNAL_CORRUPT",
    /// The run is being driven by another process (its lease is held and not expired).
    RunLeased = "KEEL_RUN_LEASED",
    /// The run is finished and its journal no longer holds a step a re-drive needs (it was
    /// compacted): nothing is executed again.
    RunFinished = "KEEL_RUN_FINISHED",
    /// The run kept dying at one step (its process was killed or crashed every time it got
    /// there), so it was ended instead of being re-driven again.
    RunPoisoned = "KEEL_RUN_POISONED",
    /// This process lost the run's lease (it stalled past the lease's expiry and another process
    /// took the run over); it stopped without writing over the new owner's work.
    LeaseLost = "KEEL_LEASE_LOST",
    /// The process is shutting down: the run stopped between two steps and is resumable.
    ShuttingDown = "KEEL_SHUTTING_DOWN",
    /// An HTTP request is malformed: not JSON, a missing field, a value of the wrong type.
    RequestInvalid = "KEEL_REQUEST_INVALID",
    /// A setting of keel's environment is not usable (`KEEL_CA_BUNDLE` is not a PEM file).
    ConfigInvalid = "KEEL_CONFIG_INVALID",
    /// The owner has no memory of that kind or key (`keel memory show|rm`).
    MemoryNotFound = "KEEL_MEMORY_NOT_FOUND",
    /// An HTTP request body is over the limit (1 MB).
    BodyTooLarge = "KEEL_BODY_TOO_LARGE",
    /// An HTTP request has no valid credentials.
    Unauthorized = "KEEL_UNAUTHORIZED",
    /// A server without auth was addressed by a name that is not a loopback one (DNS
    /// rebinding: a web page pointing its own name at 127.0.0.1).
    HostNotAllowed = "KEEL_HOST_NOT_ALLOWED",
    /// A request came from a web page of another origin than the server's, and that origin is
    /// not in `KEEL_CORS_ORIGINS`.
    OriginNotAllowed = "KEEL_ORIGIN_NOT_ALLOWED",
    /// A JSON route was sent a body that is not declared `Content-Type: application/json`.
    UnsupportedMediaType = "KEEL_UNSUPPORTED_MEDIA_TYPE",
    /// No such route (or the resource is not visible to the caller).
    NotFound = "KEEL_NOT_FOUND",
    /// The route exists but not with this HTTP method.
    MethodNotAllowed = "KEEL_METHOD_NOT_ALLOWED",
    /// An HTTP request took longer than the server's request timeout.
    RequestTimeout = "KEEL_REQUEST_TIMEOUT",
    /// The caller made more requests than the server's per-identity rate limit allows.
    RateLimited = "KEEL_RATE_LIMITED",
    /// A bug in keel: please report it.
    Internal = "KEEL_INTERNAL",
}

impl ErrorCode {
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

    /// `KEEL_SPEC_UNSUPPORTED` for `what` (the `js` tool, an MCP server, a folder of
    /// documents), which needs a cargo feature this build of keel was compiled without.
    pub fn not_built(what: &str, feature: &str) -> RunFailure {
        RunFailure::new(
            ErrorCode::SpecUnsupported,
            format!("{what}: this keel was built without the `{feature}` cargo feature, which it needs"),
        )
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
