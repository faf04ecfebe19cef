//! The [`Provider`] trait: how the runtime asks a model for the next message.
//!
//! A provider streams text through a [`DeltaSink`] as it arrives and returns the whole reply at
//! the end. The reply, not the deltas, is what the journal records: a replay re-emits the text in
//! one piece and never calls the provider again.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::BoxFuture;
use crate::agent::ToolChoice;
use crate::error::ErrorCode;
use crate::event::Usage;
use crate::message::{Message, Part};
use crate::tool::ToolSpec;

/// What one model call is given. Borrowed from the run's state: nothing is copied per call.
#[derive(Clone, Copy, Debug)]
pub struct ModelRequest<'a> {
    /// The model name, without the provider prefix (`gpt-4o-mini` for `openai/gpt-4o-mini`).
    pub model: &'a str,
    /// The system prompt.
    pub instructions: &'a str,
    /// The transcript so far: the session's history and this run's messages.
    pub messages: &'a [Arc<Message>],
    /// The tools the model may call.
    pub tools: &'a [ToolSpec],
    /// The schema the final answer must match, when structured output is wanted.
    pub output_schema: Option<&'a Value>,
    /// The number of model calls the session made before this one. Deterministic across
    /// replays, so scripted providers pick the same reply.
    pub call_index: u64,
    /// The attempt number of this call, from 1 (retries of transient errors count up).
    pub attempt: u32,
    /// Whether and which tool the model must call, when this call says (else the provider's
    /// `tool_choice` setting applies).
    pub tool_choice: Option<&'a ToolChoice>,
    /// What the call is for.
    pub purpose: CallPurpose,
}

/// What a model call is for: a turn of the conversation, or work keel does for the agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CallPurpose {
    /// A turn of the run (`llm:turn:N`).
    #[default]
    Turn,
    /// Writing a compaction brief (`llm:compact:N`); `call_index` counts the session's briefs.
    Compact,
    /// Summarising a run into an episode (`memory:episode`); `call_index` is the run's last
    /// turn's.
    Episode,
    /// Extracting entities and relations from a run (`memory:extract`); `call_index` is the
    /// run's last turn's.
    Extract,
}

/// A model's reply: its message content and what it cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelReply {
    /// Text and tool-call parts, in the order the model produced them.
    pub parts: Vec<Part>,
    /// Tokens used by this call.
    pub usage: Usage,
}

/// What a provider said of its reply besides its content: for traces (`gen_ai.response.*`),
/// never journaled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplyInfo<'a> {
    /// The model that answered, as the provider names it (`gpt-4o-mini-2024-07-18`).
    pub response_model: Option<&'a str>,
    /// Why it stopped, in the provider's words (`stop`, `tool_calls`, `end_turn`, `length`).
    pub finish_reason: Option<&'a str>,
}

/// Receives text as the model streams it. Called on the task driving the run.
pub trait DeltaSink: Send {
    /// A new piece of the answer's text.
    fn text_delta(&mut self, delta: &str);

    /// A new piece of the model's reasoning (thinking), for models that show it.
    fn reasoning_delta(&mut self, _delta: &str) {}

    /// Once the reply is complete: what the provider said of it.
    fn reply_info(&mut self, _info: ReplyInfo<'_>) {}
}

/// A sink that drops every delta (for callers that only want the final reply).
pub struct DiscardDeltas;

impl DeltaSink for DiscardDeltas {
    fn text_delta(&mut self, _delta: &str) {}
}

/// What kind of failure a provider had; decides whether the runtime retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProviderErrorKind {
    /// Too many requests (HTTP 429). Transient.
    RateLimited,
    /// The provider is overloaded (Anthropic's 529, HTTP 503). Transient.
    Overloaded,
    /// A server error (HTTP 5xx, 409) or a dropped connection. Transient.
    Transient,
    /// The call took longer than `limits.provider_timeout`, or the provider said 408. Transient.
    Timeout,
    /// The answer did not follow the provider's protocol (HTML, a truncated or malformed stream,
    /// an error inside a 200). Transient: the turn is tried again as a whole.
    BadResponse,
    /// The credentials were rejected (HTTP 401).
    Auth,
    /// The credentials lack access (HTTP 403).
    Permission,
    /// The model or endpoint does not exist (HTTP 404).
    NotFound,
    /// The conversation does not fit the model's context window.
    ContextTooLong,
    /// The request was rejected as invalid: retrying will not help.
    BadRequest,
    /// The provider's API key variable is not set (found before any request).
    KeyMissing,
    /// The model cannot be set up: an unknown provider, no model name, no or a bad base URL.
    Unavailable,
}

impl ProviderErrorKind {
    /// The kind whose failures carry `code` (see [`ProviderError::code`]).
    pub fn from_code(code: ErrorCode) -> Option<ProviderErrorKind> {
        Some(match code {
            ErrorCode::ProviderRateLimited => ProviderErrorKind::RateLimited,
            ErrorCode::ProviderOverloaded => ProviderErrorKind::Overloaded,
            ErrorCode::ProviderError => ProviderErrorKind::Transient,
            ErrorCode::ProviderTimeout => ProviderErrorKind::Timeout,
            ErrorCode::ProviderBadResponse => ProviderErrorKind::BadResponse,
            ErrorCode::ProviderAuth => ProviderErrorKind::Auth,
            ErrorCode::ProviderPermission => ProviderErrorKind::Permission,
            ErrorCode::ProviderNotFound => ProviderErrorKind::NotFound,
            ErrorCode::ProviderContextTooLong => ProviderErrorKind::ContextTooLong,
            ErrorCode::ProviderBadRequest => ProviderErrorKind::BadRequest,
            ErrorCode::ProviderKeyMissing => ProviderErrorKind::KeyMissing,
            ErrorCode::ProviderUnavailable => ProviderErrorKind::Unavailable,
            _ => return None,
        })
    }
}

/// A failed model call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    /// What kind of failure.
    pub kind: ProviderErrorKind,
    /// The HTTP status, when there was one.
    pub status: Option<u16>,
    /// What went wrong (never contains credentials).
    pub message: String,
    /// How long the provider asked to wait before trying again (`Retry-After`,
    /// `retry-after-ms`), when it said.
    pub retry_after: Option<Duration>,
}

impl ProviderError {
    /// Classifies an HTTP status the way every provider adapter does. Adapters refine the
    /// kind from the error body (a context-window error is a 400 on most providers).
    pub fn from_status(status: u16, message: impl Into<String>) -> ProviderError {
        let kind = match status {
            401 => ProviderErrorKind::Auth,
            403 => ProviderErrorKind::Permission,
            404 => ProviderErrorKind::NotFound,
            408 => ProviderErrorKind::Timeout,
            409 => ProviderErrorKind::Transient,
            413 => ProviderErrorKind::ContextTooLong,
            429 => ProviderErrorKind::RateLimited,
            503 | 529 => ProviderErrorKind::Overloaded,
            400..=499 => ProviderErrorKind::BadRequest,
            _ => ProviderErrorKind::Transient,
        };
        ProviderError { kind, status: Some(status), message: message.into(), retry_after: None }
    }

    /// A failure of the given kind with no HTTP status.
    pub fn new(kind: ProviderErrorKind, message: impl Into<String>) -> ProviderError {
        ProviderError { kind, status: None, message: message.into(), retry_after: None }
    }

    /// The same error, with the wait the provider asked for.
    #[must_use]
    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> ProviderError {
        self.retry_after = retry_after;
        self
    }

    /// Whether retrying may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            ProviderErrorKind::RateLimited
                | ProviderErrorKind::Overloaded
                | ProviderErrorKind::Transient
                | ProviderErrorKind::Timeout
                | ProviderErrorKind::BadResponse
        )
    }

    /// The stable code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self.kind {
            ProviderErrorKind::RateLimited => ErrorCode::ProviderRateLimited,
            ProviderErrorKind::Overloaded => ErrorCode::ProviderOverloaded,
            ProviderErrorKind::Transient => ErrorCode::ProviderError,
            ProviderErrorKind::Timeout => ErrorCode::ProviderTimeout,
            ProviderErrorKind::BadResponse => ErrorCode::ProviderBadResponse,
            ProviderErrorKind::Auth => ErrorCode::ProviderAuth,
            ProviderErrorKind::Permission => ErrorCode::ProviderPermission,
            ProviderErrorKind::NotFound => ErrorCode::ProviderNotFound,
            ProviderErrorKind::ContextTooLong => ErrorCode::ProviderContextTooLong,
            ProviderErrorKind::BadRequest => ErrorCode::ProviderBadRequest,
            ProviderErrorKind::KeyMissing => ErrorCode::ProviderKeyMissing,
            ProviderErrorKind::Unavailable => ErrorCode::ProviderUnavailable,
        }
    }
}

/// A model provider.
pub trait Provider: Send + Sync {
    /// Asks the model for its next message, streaming text into `sink`.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the call; nothing is journaled for it, so a later attempt
    /// starts over.
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>>;

    /// The embedding model this provider uses when the agent names none (`memory: { kind:
    /// semantic, embeddings: auto }`); `None` when it has no embeddings to offer by default.
    fn default_embedding_model(&self) -> Option<&str> {
        None
    }

    /// Embeds `inputs` with `model`: one vector per input, in order. A provider without
    /// embeddings answers [`ProviderErrorKind::Unavailable`].
    fn embed<'a>(
        &'a self,
        model: &'a str,
        inputs: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, ProviderError>> {
        let _ = (model, inputs);
        Box::pin(async {
            Err(ProviderError::new(ProviderErrorKind::Unavailable, "this provider has no embeddings"))
        })
    }
}

impl<P: Provider + ?Sized> Provider for std::sync::Arc<P> {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        (**self).complete(request, sink)
    }

    fn default_embedding_model(&self) -> Option<&str> {
        (**self).default_embedding_model()
    }

    fn embed<'a>(
        &'a self,
        model: &'a str,
        inputs: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, ProviderError>> {
        (**self).embed(model, inputs)
    }
}

/// The provider a bare model name is usually served by (`gpt-4o` → `openai`), to suggest.
pub fn usual_provider(model: &str) -> Option<&'static str> {
    let model = model.to_ascii_lowercase();
    let starts = |prefixes: &[&str]| prefixes.iter().any(|prefix| model.starts_with(prefix));
    if starts(&["gpt-", "o1", "o3", "o4", "chatgpt", "text-embedding", "davinci"]) {
        Some("openai")
    } else if starts(&["claude"]) {
        Some("anthropic")
    } else if starts(&["llama", "mistral", "mixtral", "qwen", "gemma", "phi", "deepseek", "nomic-embed"]) {
        Some("ollama")
    } else {
        None
    }
}
