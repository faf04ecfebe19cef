//! The OpenAI-compatible face of `keel serve` (DESIGN.md §11): `GET /v1/models`,
//! `POST /v1/chat/completions` and `POST /v1/responses`, so that OpenAI's own SDKs and the UIs
//! built on them talk to a keel agent unchanged.
//!
//! The agent stays itself: its instructions and tools are its own (a request's `tools` are
//! refused, its earlier messages are not read: the session holds the conversation), each request
//! is one durable run of the session named by `X-Keel-Session` (or `previous_response_id`), or of
//! a new one, whose id comes back in `X-Keel-Session`. The content of an answer is every piece of
//! text the run said, its turns separated by a blank line, or the structured output's JSON when
//! the agent has `output.schema`; streamed and not, it is the same text. A run that pauses for a
//! human ends with a line that says what it waits for and how to decide it.
//!
//! Parameters are checked as OpenAI checks them: unknown ones are refused, and known ones keel
//! cannot honour are refused unless ignoring them is harmless (sampling settings, `store`,
//! `metadata`, ...): each refusal is a `400` in OpenAI's error shape naming the parameter.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use keel_core::{ErrorCode, Message, Part, Role, RunId, SessionId};
use keel_runtime::RunOptions;
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::auth::Identity;
use crate::error::{ApiError, status_of};
use crate::feed::RunEvents;
use crate::routes::{JsonBody, Sender, async_stream, json_type, sse, start_run};

/// The header that names the session of a request, and tells the client the session of its
/// answer.
const SESSION_HEADER: &str = "x-keel-session";

/// An error in OpenAI's shape: `{ error: { message, type, param, code } }`, `code` keel's.
pub(crate) struct OpenAiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: String,
}

impl OpenAiError {
    fn invalid(param: &str, message: impl Into<String>) -> OpenAiError {
        OpenAiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_owned()),
            code: ErrorCode::RequestInvalid.as_str().to_owned(),
        }
    }
}

impl From<ApiError> for OpenAiError {
    fn from(error: ApiError) -> OpenAiError {
        OpenAiError {
            status: status_of(error.code),
            message: error.message,
            param: None,
            code: error.code.as_str().to_owned(),
        }
    }
}

impl From<keel_core::RunFailure> for OpenAiError {
    fn from(failure: keel_core::RunFailure) -> OpenAiError {
        ApiError::from(failure).into()
    }
}

impl From<keel_core::StoreError> for OpenAiError {
    fn from(error: keel_core::StoreError) -> OpenAiError {
        ApiError::from(error).into()
    }
}

/// OpenAI's `type` of an error with this status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 413 | 415 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        _ => "server_error",
    }
}

fn error_body(status: StatusCode, message: &str, param: Option<&str>, code: &str) -> Value {
    json!({ "error": { "message": message, "type": error_type(status), "param": param, "code": code } })
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = %self.code, message = %self.message, "request failed");
        }
        let body = error_body(self.status, &self.message, self.param.as_deref(), &self.code);
        (self.status, axum::Json(body)).into_response()
    }
}

type Answer = Result<Response, OpenAiError>;

/// `GET /v1/models`: the agent, as the one model this server has.
pub(crate) async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({ "object": "list", "data": [model_card(&state)] })).into_response()
}

/// `GET /v1/models/:model`.
pub(crate) async fn model(State(state): State<Arc<AppState>>, Path(model): Path<String>) -> Answer {
    check_model(&state, Some(&model))?;
    Ok(axum::Json(model_card(&state)).into_response())
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.engine.agent().name,
        "object": "model",
        "created": state.started_ms / 1000,
        "owned_by": "keel",
    })
}

/// The model a request names must be the agent (OpenAI's SDKs require one).
fn check_model(state: &AppState, model: Option<&str>) -> Result<(), OpenAiError> {
    let name = state.engine.agent().name.clone();
    match model {
        Some(model) if model == name => Ok(()),
        Some(model) => Err(OpenAiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{model}` does not exist here: this server runs the agent `{name}`"),
            param: Some("model".to_owned()),
            code: "model_not_found".to_owned(),
        }),
        None => Err(OpenAiError::invalid("model", format!("missing `model`: name the agent, `{name}`"))),
    }
}

/// How a request parameter is treated.
enum Known {
    /// Read by keel.
    Used,
    /// Ignored: it changes nothing a client relies on (sampling, storage, tracking).
    Harmless,
    /// Refused unless `allowed` says its value changes nothing.
    Unless(fn(&Value) -> bool, &'static str),
}

const fn unless(allowed: fn(&Value) -> bool, why: &'static str) -> Known {
    Known::Unless(allowed, why)
}

fn is_null(value: &Value) -> bool {
    value.is_null()
}
fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        _ => false,
    }
}
fn is_false(value: &Value) -> bool {
    matches!(value, Value::Null | Value::Bool(false))
}
fn is_one(value: &Value) -> bool {
    value.is_null() || value.as_u64() == Some(1)
}
fn is_zero(value: &Value) -> bool {
    value.is_null() || value.as_u64() == Some(0)
}
fn is_auto_or_none(value: &Value) -> bool {
    matches!(value, Value::Null) || matches!(value.as_str(), Some("auto" | "none"))
}
fn is_text_only(value: &Value) -> bool {
    value.is_null() || value.as_array().is_some_and(|m| m.iter().all(|m| m == "text"))
}

const TOOLS_REFUSED: &str = "the agent owns its tools, and they run inside keel: a request cannot add any";

/// Checks every parameter of `body` against `known`; the first that is unknown, or known and
/// refused, is the error.
fn check_parameters(body: &Map<String, Value>, known: &[(&'static str, Known)]) -> Result<(), OpenAiError> {
    for (key, value) in body {
        let Some((name, treatment)) = known.iter().find(|(name, _)| name == key) else {
            return Err(OpenAiError::invalid(key, format!("unrecognized request argument supplied: {key}")));
        };
        if let Known::Unless(allowed, why) = treatment
            && !allowed(value)
        {
            return Err(OpenAiError::invalid(name, format!("`{name}` is not supported here: {why}")));
        }
    }
    Ok(())
}

const CHAT_PARAMETERS: &[(&str, Known)] = &[
    ("model", Known::Used),
    ("messages", Known::Used),
    ("stream", Known::Used),
    ("stream_options", Known::Used),
    ("response_format", Known::Used),
    ("temperature", Known::Harmless),
    ("top_p", Known::Harmless),
    ("max_tokens", Known::Harmless),
    ("max_completion_tokens", Known::Harmless),
    ("presence_penalty", Known::Harmless),
    ("frequency_penalty", Known::Harmless),
    ("seed", Known::Harmless),
    ("user", Known::Harmless),
    ("safety_identifier", Known::Harmless),
    ("prompt_cache_key", Known::Harmless),
    ("metadata", Known::Harmless),
    ("store", Known::Harmless),
    ("parallel_tool_calls", Known::Harmless),
    ("service_tier", Known::Harmless),
    ("reasoning_effort", Known::Harmless),
    ("verbosity", Known::Harmless),
    ("prediction", Known::Harmless),
    ("tools", unless(is_empty, TOOLS_REFUSED)),
    ("functions", unless(is_empty, TOOLS_REFUSED)),
    ("tool_choice", unless(is_auto_or_none, TOOLS_REFUSED)),
    ("function_call", unless(is_auto_or_none, TOOLS_REFUSED)),
    ("n", unless(is_one, "a run gives one answer")),
    ("logprobs", unless(is_false, "keel does not return token log probabilities")),
    ("top_logprobs", unless(is_zero, "keel does not return token log probabilities")),
    ("logit_bias", unless(is_empty, "the agent's model settings are its own")),
    ("stop", unless(is_empty, "the agent decides where its answer ends")),
    ("modalities", unless(is_text_only, "the agent answers in text")),
    ("audio", unless(is_null, "the agent answers in text")),
    ("web_search_options", unless(is_null, TOOLS_REFUSED)),
];

const RESPONSES_PARAMETERS: &[(&str, Known)] = &[
    ("model", Known::Used),
    ("input", Known::Used),
    ("stream", Known::Used),
    ("previous_response_id", Known::Used),
    ("text", Known::Used),
    ("temperature", Known::Harmless),
    ("top_p", Known::Harmless),
    ("max_output_tokens", Known::Harmless),
    ("max_tool_calls", Known::Harmless),
    ("user", Known::Harmless),
    ("safety_identifier", Known::Harmless),
    ("prompt_cache_key", Known::Harmless),
    ("metadata", Known::Harmless),
    ("store", Known::Harmless),
    ("parallel_tool_calls", Known::Harmless),
    ("service_tier", Known::Harmless),
    ("reasoning", Known::Harmless),
    ("truncation", Known::Harmless),
    ("include", Known::Harmless),
    ("stream_options", Known::Harmless),
    ("instructions", unless(is_null, "the agent's instructions are its own")),
    ("tools", unless(is_empty, TOOLS_REFUSED)),
    ("tool_choice", unless(is_auto_or_none, TOOLS_REFUSED)),
    ("top_logprobs", unless(is_zero, "keel does not return token log probabilities")),
    (
        "background",
        unless(is_false, "a response is answered in the request (keel's runs are durable anyway)"),
    ),
    (
        "conversation",
        unless(is_null, "keel's sessions hold the conversation: use previous_response_id or X-Keel-Session"),
    ),
    ("prompt", unless(is_null, "the agent's instructions are its own")),
];

/// The session a request names: `X-Keel-Session`, else `previous` (from a previous response),
/// else a new one. Scoped to the caller, as on `/chat`.
fn session_of(
    identity: &Identity,
    headers: &HeaderMap,
    previous: Option<SessionId>,
) -> Result<SessionId, OpenAiError> {
    let named = match headers.get(SESSION_HEADER) {
        None => None,
        Some(value) => {
            let text = value.to_str().map_err(|_| {
                OpenAiError::invalid("X-Keel-Session", "`X-Keel-Session` must be a session id (A-Za-z0-9_-)")
            })?;
            Some(identity.session(SessionId::new(text)?))
        }
    };
    match (named, previous) {
        (Some(named), Some(previous)) if named != previous => Err(OpenAiError::invalid(
            "previous_response_id",
            "`previous_response_id` belongs to another session than `X-Keel-Session` names",
        )),
        (Some(session), _) | (None, Some(session)) => Ok(session),
        (None, None) => {
            let fresh = format!("openai-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
            Ok(identity.session(SessionId::new(fresh)?))
        }
    }
}

/// A `data:` URL's media type and bytes (the only image or file address keel takes: it fetches
/// nothing a request points at).
fn data_url(param: &'static str, url: &str) -> Result<(String, Arc<[u8]>), OpenAiError> {
    let refused = || {
        OpenAiError::invalid(
            param,
            "send the bytes in a `data:<media type>;base64,...` URL: keel does not fetch addresses a request names",
        )
    };
    let rest = url.strip_prefix("data:").ok_or_else(refused)?;
    let (meta, data) = rest.split_once(',').ok_or_else(refused)?;
    let media_type = meta.strip_suffix(";base64").ok_or_else(refused)?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|error| OpenAiError::invalid(param, format!("the data URL is not base64: {error}")))?;
    Ok((media_type.to_owned(), bytes.into()))
}

/// The user's message: a string, or content parts (`text` / `input_text`, `image_url` /
/// `input_image`, `file` / `input_file`, with `data:` URLs).
fn user_message(param: &'static str, content: &Value) -> Result<Message, OpenAiError> {
    let parts = match content {
        Value::String(text) if text.is_empty() => {
            return Err(OpenAiError::invalid(param, "the user's message is empty"));
        }
        Value::String(text) => vec![Part::Text(text.clone())],
        Value::Array(items) if !items.is_empty() => {
            items.iter().map(|item| content_part(param, item)).collect::<Result<Vec<_>, _>>()?
        }
        other => {
            return Err(OpenAiError::invalid(
                param,
                format!("the user's content must be a string or content parts, not {}", json_type(other)),
            ));
        }
    };
    Ok(Message { role: Role::User, parts })
}

fn content_part(param: &'static str, item: &Value) -> Result<Part, OpenAiError> {
    fn string(value: Option<&Value>) -> Option<&str> {
        value.and_then(Value::as_str)
    }
    match string(item.get("type")) {
        Some("text" | "input_text") => match string(item.get("text")) {
            Some(text) => Ok(Part::Text(text.to_owned())),
            None => Err(OpenAiError::invalid(param, "a text part needs `text`, a string")),
        },
        Some("image_url" | "input_image") => {
            let url = string(item.get("image_url").and_then(|v| v.get("url")).or(item.get("image_url")));
            let url = url.ok_or_else(|| OpenAiError::invalid(param, "an image part needs an image URL"))?;
            let (media_type, data) = data_url(param, url)?;
            if !media_type.starts_with("image/") {
                return Err(OpenAiError::invalid(param, format!("{media_type:?} is not an image type")));
            }
            Ok(Part::Image { media_type, data })
        }
        Some("file" | "input_file") => {
            let file = item.get("file").unwrap_or(item);
            let url = string(file.get("file_data"))
                .ok_or_else(|| OpenAiError::invalid(param, "a file part needs `file_data`, a data URL"))?;
            let (media_type, data) = data_url(param, url)?;
            Ok(Part::File { media_type, name: string(file.get("filename")).map(str::to_owned), data })
        }
        other => Err(OpenAiError::invalid(
            param,
            format!(
                "content parts of type {:?} are not supported (text, images and files are)",
                other.unwrap_or("?")
            ),
        )),
    }
}

/// Whether the answer is the structured output: the request asks for JSON, which only an agent
/// with `output.schema` gives.
fn wants_structured(
    state: &AppState,
    param: &'static str,
    format: Option<&Value>,
) -> Result<bool, OpenAiError> {
    let kind = format.and_then(|f| f.get("type")).and_then(Value::as_str);
    let has_schema = state.engine.agent().output_schema.is_some();
    match kind {
        None | Some("text") => Ok(has_schema),
        Some("json_object" | "json_schema") if has_schema => Ok(true),
        Some("json_object" | "json_schema") => Err(OpenAiError::invalid(
            param,
            "this agent has no `output.schema`, so its answers are text: give the agent a schema to get JSON",
        )),
        Some(other) => Err(OpenAiError::invalid(param, format!("unknown format type {other:?}"))),
    }
}

fn object(body: &Value) -> Result<&Map<String, Value>, OpenAiError> {
    body.as_object().ok_or_else(|| {
        OpenAiError::invalid(
            "body",
            format!("the request body must be a JSON object, not {}", json_type(body)),
        )
    })
}

fn flag(body: &Map<String, Value>, name: &'static str) -> Result<bool, OpenAiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(value)) => Ok(*value),
        Some(other) => {
            Err(OpenAiError::invalid(name, format!("`{name}` must be a boolean, not {}", json_type(other))))
        }
    }
}

/// The error of a run that failed (`502`: the model or a tool behind keel failed), or of an
/// answer cut before its run ended (`503`: the server is stopping; the run goes on).
fn failed(code: &str, message: &str) -> OpenAiError {
    let status = if code == ErrorCode::ShuttingDown.as_str() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::BAD_GATEWAY
    };
    OpenAiError { status, message: message.to_owned(), param: None, code: code.to_owned() }
}

/// A started run: what the answer is made from.
struct Started {
    session: SessionId,
    run: RunId,
    reader: RunReader,
}

async fn start(
    state: &AppState,
    headers: &HeaderMap,
    session: SessionId,
    input: Message,
    structured: bool,
    streaming: bool,
) -> Result<Started, OpenAiError> {
    let (subscriber, run) = start_run(state, headers, &session, input, RunOptions::default()).await?;
    let reader = RunReader {
        events: RunEvents::new(subscriber, run.clone(), state.closing.clone()),
        run: run.clone(),
        session: session.clone(),
        text: Assembler::new(streaming),
        structured,
        queue: VecDeque::new(),
        outcome: None,
        done: false,
    };
    Ok(Started { session, run, reader })
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn with_session(mut response: Response, session: &SessionId) -> Response {
    if let Ok(value) = HeaderValue::from_str(session.external()) {
        response.headers_mut().insert(SESSION_HEADER, value);
    }
    response
}

// ---- Chat Completions -------------------------------------------------------------------------

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Result<JsonBody, ApiError>,
) -> Answer {
    let JsonBody(body) = body?;
    let body = object(&body)?;
    check_parameters(body, CHAT_PARAMETERS)?;
    check_model(&state, body.get("model").and_then(Value::as_str))?;
    let stream = flag(body, "stream")?;
    let include_usage = body
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let structured = wants_structured(&state, "response_format", body.get("response_format"))?;
    let messages = match body.get("messages") {
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        _ => return Err(OpenAiError::invalid("messages", "`messages` must be a non-empty array")),
    };
    let last = messages.last().expect("not empty");
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return Err(OpenAiError::invalid(
            "messages",
            "the last message must be the user's: it is the input (the session holds the conversation before it)",
        ));
    }
    let input = user_message("messages", last.get("content").unwrap_or(&Value::Null))?;
    let session = session_of(&identity, &headers, None)?;
    let Started { session, run, mut reader } =
        start(&state, &headers, session, input, structured, stream).await?;
    let id = format!("chatcmpl-{}", run.as_str().trim_start_matches(RunId::PREFIX));
    let model = state.engine.agent().name.clone();
    let created = now_s();
    if !stream {
        let (content, outcome) = reader.whole().await?;
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": { "role": "assistant", "content": content, "refusal": null },
                "finish_reason": outcome.finish_reason(),
                "logprobs": null,
            }],
            "usage": outcome.chat_usage(),
            "system_fingerprint": null,
            "keel": outcome.keel(&session, &run),
        });
        return Ok(with_session(axum::Json(body).into_response(), &session));
    }
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null }],
        })
    };
    let events = async_stream(move |tx| async move {
        let send = |value: Value| tx.send(SseEvent::default().data(value.to_string()));
        if !send(chunk(json!({ "role": "assistant", "content": "" }), None)).await {
            return;
        }
        loop {
            match reader.next().await {
                Some(Piece::Text(text)) => {
                    if !send(chunk(json!({ "content": text }), None)).await {
                        return;
                    }
                }
                Some(Piece::Done(outcome)) => {
                    if let Some((code, message)) = &outcome.error {
                        send(error_body(failed(code, message).status, message, None, code)).await;
                    } else {
                        let mut last = chunk(json!({}), Some(outcome.finish_reason()));
                        last["keel"] = outcome.keel(&reader.session, &reader.run);
                        send(last).await;
                        if include_usage {
                            let mut usage = chunk(json!({}), None);
                            usage["choices"] = json!([]);
                            usage["usage"] = outcome.chat_usage();
                            send(usage).await;
                        }
                    }
                    break;
                }
                None => {
                    let (code, message) = Outcome::cut().error.expect("a cut stream is an error");
                    send(error_body(failed(&code, &message).status, &message, None, &code)).await;
                    break;
                }
            }
        }
        tx.send(SseEvent::default().data("[DONE]")).await;
    });
    Ok(with_session(sse(events), &session))
}

// ---- Responses --------------------------------------------------------------------------------

/// `POST /v1/responses`.
pub(crate) async fn responses(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Result<JsonBody, ApiError>,
) -> Answer {
    let JsonBody(body) = body?;
    let body = object(&body)?;
    check_parameters(body, RESPONSES_PARAMETERS)?;
    check_model(&state, body.get("model").and_then(Value::as_str))?;
    let stream = flag(body, "stream")?;
    let format = body.get("text").and_then(|text| text.get("format"));
    let structured = wants_structured(&state, "text", format)?;
    let input = match body.get("input") {
        Some(input @ Value::String(_)) => user_message("input", input)?,
        Some(Value::Array(items)) => {
            // The last user message among the items is the input.
            let last =
                items.iter().rev().find(|item| item.get("role").and_then(Value::as_str) == Some("user"));
            let Some(last) = last else {
                return Err(OpenAiError::invalid("input", "`input` has no user message: it is the input"));
            };
            user_message("input", last.get("content").unwrap_or(&Value::Null))?
        }
        _ => {
            return Err(OpenAiError::invalid("input", "`input` must be a string or an array of input items"));
        }
    };
    let previous_id = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(other) => {
            return Err(OpenAiError::invalid(
                "previous_response_id",
                format!("`previous_response_id` must be a string, not {}", json_type(other)),
            ));
        }
    };
    let previous = match &previous_id {
        None => None,
        Some(id) => Some(previous_session(&state, &identity, id).await?),
    };
    let session = session_of(&identity, &headers, previous)?;
    let Started { session, run, mut reader } =
        start(&state, &headers, session, input, structured, stream).await?;
    let base = ResponseBase {
        id: format!("resp_{}", run.as_str().trim_start_matches(RunId::PREFIX)),
        message_id: format!("msg_{}", run.as_str().trim_start_matches(RunId::PREFIX)),
        created: now_s(),
        model: state.engine.agent().name.clone(),
        previous: previous_id,
        structured,
    };
    if !stream {
        let (content, outcome) = reader.whole().await?;
        let body = base.response(&outcome, &content, &session, &run);
        return Ok(with_session(axum::Json(body).into_response(), &session));
    }
    let events = async_stream(move |tx| async move {
        let mut events = ResponseEvents { tx, sequence: 0 };
        let in_progress = base.in_progress();
        if !events.send("response.created", json!({ "response": in_progress })).await
            || !events.send("response.in_progress", json!({ "response": in_progress })).await
        {
            return;
        }
        let item = |status: &str, content: Value| json!({ "type": "message", "id": base.message_id, "status": status, "role": "assistant", "content": content });
        // The fields of the events about the answer's one text part, and some more.
        let at = |extra: Value| {
            let mut data = json!({ "item_id": base.message_id, "output_index": 0, "content_index": 0 });
            if let (Some(data), Value::Object(extra)) = (data.as_object_mut(), extra) {
                data.extend(extra);
            }
            data
        };
        events
            .send(
                "response.output_item.added",
                json!({ "output_index": 0, "item": item("in_progress", json!([])) }),
            )
            .await;
        events.send("response.content_part.added", at(json!({ "part": output_text("") }))).await;
        let mut content = String::new();
        let outcome = loop {
            match reader.next().await {
                Some(Piece::Text(text)) => {
                    content.push_str(&text);
                    if !events
                        .send("response.output_text.delta", at(json!({ "delta": text, "logprobs": [] })))
                        .await
                    {
                        return;
                    }
                }
                Some(Piece::Done(outcome)) => break outcome,
                None => break Outcome::cut(),
            }
        };
        events.send("response.output_text.done", at(json!({ "text": content, "logprobs": [] }))).await;
        events.send("response.content_part.done", at(json!({ "part": output_text(&content) }))).await;
        let done = json!({ "output_index": 0, "item": item("completed", json!([output_text(&content)])) });
        events.send("response.output_item.done", done).await;
        let response = base.response(&outcome, &content, &reader.session, &reader.run);
        let kind = match response["status"].as_str() {
            Some("failed") => "response.failed",
            Some("incomplete") => "response.incomplete",
            _ => "response.completed",
        };
        events.send(kind, json!({ "response": response })).await;
    });
    Ok(with_session(sse(events), &session))
}

/// The events of a streamed response, numbered.
struct ResponseEvents {
    tx: Sender,
    sequence: u64,
}

impl ResponseEvents {
    async fn send(&mut self, kind: &str, mut data: Value) -> bool {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.tx.send(SseEvent::default().event(kind).data(data.to_string())).await
    }
}

/// The session of a previous response (`resp_<run suffix>`): the caller's, or not found.
async fn previous_session(state: &AppState, identity: &Identity, id: &str) -> Result<SessionId, OpenAiError> {
    let not_found = || OpenAiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no previous response {id:?}"),
        param: Some("previous_response_id".to_owned()),
        code: ErrorCode::RunNotFound.as_str().to_owned(),
    };
    let run = id
        .strip_prefix("resp_")
        .and_then(|suffix| RunId::parse(&format!("{}{suffix}", RunId::PREFIX)))
        .ok_or_else(not_found)?;
    let record = state.engine.store().load_run(&run).await?.ok_or_else(not_found)?;
    // Another owner's run is as good as absent.
    if !identity.scope().holds(&record.session_id) {
        return Err(not_found());
    }
    Ok(record.session_id)
}

fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [] })
}

/// What every Responses object of one run shares.
struct ResponseBase {
    id: String,
    message_id: String,
    created: u64,
    model: String,
    previous: Option<String>,
    structured: bool,
}

impl ResponseBase {
    fn object(&self, status: &str) -> Value {
        let format =
            if self.structured { json!({ "type": "json_object" }) } else { json!({ "type": "text" }) };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "instructions": null,
            "max_output_tokens": null,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": false,
            "previous_response_id": self.previous,
            "reasoning": { "effort": null, "summary": null },
            "store": true,
            "temperature": null,
            "text": { "format": format },
            "tool_choice": "auto",
            "tools": [],
            "top_p": null,
            "truncation": "disabled",
            "usage": null,
            "user": null,
            "metadata": {},
        })
    }

    fn in_progress(&self) -> Value {
        self.object("in_progress")
    }

    fn response(&self, outcome: &Outcome, content: &str, session: &SessionId, run: &RunId) -> Value {
        let status = match (&outcome.error, outcome.stopped.as_deref()) {
            (Some(_), _) => "failed",
            (None, Some("final" | "stop_condition")) => "completed",
            _ => "incomplete",
        };
        let mut response = self.object(status);
        if let Some((code, message)) = &outcome.error {
            response["error"] = json!({ "code": code, "message": message });
        } else {
            response["output"] = json!([{
                "type": "message",
                "id": self.message_id,
                "status": "completed",
                "role": "assistant",
                "content": [output_text(content)],
            }]);
        }
        if status == "incomplete" {
            response["incomplete_details"] =
                json!({ "reason": outcome.stopped.as_deref().unwrap_or("awaiting_input") });
        }
        response["usage"] = json!({
            "input_tokens": outcome.usage.0,
            "input_tokens_details": { "cached_tokens": 0 },
            "output_tokens": outcome.usage.1,
            "output_tokens_details": { "reasoning_tokens": 0 },
            "total_tokens": outcome.usage.0 + outcome.usage.1,
        });
        response["keel"] = outcome.keel(session, run);
        response
    }
}

// ---- Reading a run ----------------------------------------------------------------------------

/// A piece of an answer.
enum Piece {
    /// Text to append to the content.
    Text(String),
    /// The run ended.
    Done(Outcome),
}

/// How a run ended, as an answer tells it.
struct Outcome {
    /// keel's stop reason (`None`: it paused for a human, or failed).
    stopped: Option<String>,
    usage: (u64, u64),
    output: Option<Value>,
    pending: Vec<Value>,
    /// A failed run's code and message.
    error: Option<(String, String)>,
}

impl Outcome {
    /// The answer of a stream cut before its end (the server is shutting down, or the reader fell
    /// behind): the run goes on, and `GET /chat/:id` shows its result later.
    fn cut() -> Outcome {
        Outcome {
            stopped: None,
            usage: (0, 0),
            output: None,
            pending: Vec::new(),
            error: Some((
                ErrorCode::ShuttingDown.as_str().to_owned(),
                "the answer was cut before the run ended; the run goes on and GET /chat/:sessionId shows its result"
                    .to_owned(),
            )),
        }
    }

    fn finish_reason(&self) -> &'static str {
        match self.stopped.as_deref() {
            Some("max_turns" | "budget") => "length",
            _ => "stop",
        }
    }

    fn chat_usage(&self) -> Value {
        json!({
            "prompt_tokens": self.usage.0,
            "completion_tokens": self.usage.1,
            "total_tokens": self.usage.0 + self.usage.1,
        })
    }

    /// keel's own account of the run, beside OpenAI's fields.
    fn keel(&self, session: &SessionId, run: &RunId) -> Value {
        let mut keel = json!({
            "sessionId": session.external(),
            "runId": run.as_str(),
            "status": if self.pending.is_empty() { "finished" } else { "awaiting_input" },
            "stopped": self.stopped,
            "pending": self.pending,
        });
        if let Some(output) = &self.output {
            keel["output"] = output.clone();
        }
        keel
    }
}

/// Reads one run's events from the session's feed and turns them into pieces of an answer.
struct RunReader {
    events: RunEvents,
    run: RunId,
    session: SessionId,
    text: Assembler,
    /// The answer is the structured output, not the text.
    structured: bool,
    queue: VecDeque<Piece>,
    /// How the run ended, held until its stream has ended too: only then has the run let go of
    /// its session, so that the client's next message is not refused as busy.
    outcome: Option<Outcome>,
    done: bool,
}

impl RunReader {
    /// The whole answer of an unstreamed request, or the run's failure.
    async fn whole(&mut self) -> Result<(String, Outcome), OpenAiError> {
        let mut content = String::new();
        let outcome = loop {
            match self.next().await {
                Some(Piece::Text(text)) => content.push_str(&text),
                Some(Piece::Done(outcome)) => break outcome,
                None => break Outcome::cut(),
            }
        };
        match &outcome.error {
            Some((code, message)) => Err(failed(code, message)),
            None => Ok((content, outcome)),
        }
    }

    /// The next piece; `None` when the feed was cut (shutdown, or the reader fell behind).
    async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(piece) = self.queue.pop_front() {
                return Some(piece);
            }
            if self.done {
                return None;
            }
            let Some(event) = self.events.next().await else {
                // The run's stream ended, or the feed was cut. Without a closing event the run was
                // interrupted (its process stopped it): it resumes later.
                let outcome = self.outcome.take()?;
                self.queue.push_back(Piece::Done(outcome));
                self.done = true;
                continue;
            };
            self.on_event(&event);
        }
    }

    fn on_event(&mut self, event: &Value) {
        let field = |name: &str| event.get(name).and_then(Value::as_str).unwrap_or_default();
        let usage = |event: &Value| {
            let usage = &event["usage"];
            (usage["inputTokens"].as_u64().unwrap_or(0), usage["outputTokens"].as_u64().unwrap_or(0))
        };
        match field("type") {
            "turn.start" => self.text.turn_start(),
            "text.delta" if !self.structured => {
                let text = self.text.delta(field("delta"));
                self.emit(text);
            }
            "turn.retry" | "output.repair" => self.text.void(),
            "run.done" => {
                let output = event.get("output").filter(|v| !v.is_null()).cloned();
                if self.structured {
                    let answer = output.as_ref().map_or_else(|| field("text").to_owned(), Value::to_string);
                    let text = self.text.line(&answer);
                    self.emit(Some(text));
                } else if self.text.is_empty() && !field("text").is_empty() {
                    let text = self.text.line(field("text"));
                    self.emit(Some(text));
                }
                self.end(Outcome {
                    stopped: Some(field("stopped").to_owned()),
                    usage: usage(event),
                    output,
                    pending: Vec::new(),
                    error: None,
                });
            }
            "run.paused" => {
                let pending = event["pending"].as_array().cloned().unwrap_or_default();
                let text = self.text.line(&waiting_line(&self.session, &pending));
                self.emit(Some(text));
                self.end(Outcome { stopped: None, usage: usage(event), output: None, pending, error: None });
            }
            "run.error" => self.end(Outcome {
                stopped: None,
                usage: (0, 0),
                output: None,
                pending: Vec::new(),
                error: Some((field("code").to_owned(), field("message").to_owned())),
            }),
            _ => {}
        }
    }

    /// Sends text at once when streaming; unstreamed, the whole content goes at the end.
    fn emit(&mut self, text: Option<String>) {
        if let Some(text) = text.filter(|_| self.text.streaming) {
            self.queue.push_back(Piece::Text(text));
        }
    }

    fn end(&mut self, outcome: Outcome) {
        if !self.text.streaming {
            self.queue.push_back(Piece::Text(std::mem::take(&mut self.text.sent)));
        }
        self.outcome = Some(outcome);
    }
}

/// What a paused run waits for, and how to decide it.
fn waiting_line(session: &SessionId, pending: &[Value]) -> String {
    let session = session.external();
    let what: Vec<String> = pending
        .iter()
        .map(|p| {
            let id = p["id"].as_str().unwrap_or_default();
            match p["kind"].as_str() {
                Some("question") => format!(
                    "an answer to {:?} (POST /chat/{session}/approvals/{id} {{\"answer\": ...}})",
                    p["question"].as_str().unwrap_or_default()
                ),
                _ => format!(
                    "approval of `{}` (POST /chat/{session}/approvals/{id} {{\"approved\": true}}, or `keel approvals approve --session {session}`)",
                    p["tool"].as_str().unwrap_or_default()
                ),
            }
        })
        .collect();
    format!("[waiting for {}]", what.join("; and "))
}

/// Builds an answer's content from a run's text: every turn's text, turns apart by a blank line.
///
/// A model call retried midway voids the text its failed attempt streamed. Unstreamed, that text
/// is simply dropped. Streamed, it was sent and cannot be taken back: when the new attempt
/// repeats it (as a deterministic model does), only what comes after is sent, so the client's
/// text reads as if nothing happened; when the new attempt says something else, it is sent whole,
/// after a blank line.
struct Assembler {
    streaming: bool,
    /// The content so far.
    sent: String,
    /// `sent`'s length before the current turn's text (and its separator), once it has any.
    turn_cut: Option<usize>,
    /// The text of the current turn in `sent`.
    turn_sent: String,
    /// The current attempt's text of the current turn.
    attempt: String,
}

impl Assembler {
    fn new(streaming: bool) -> Assembler {
        Assembler {
            streaming,
            sent: String::new(),
            turn_cut: None,
            turn_sent: String::new(),
            attempt: String::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }

    fn turn_start(&mut self) {
        self.turn_cut = None;
        self.turn_sent.clear();
        self.attempt.clear();
    }

    fn void(&mut self) {
        self.attempt.clear();
        if !self.streaming
            && let Some(cut) = self.turn_cut.take()
        {
            self.sent.truncate(cut);
            self.turn_sent.clear();
        }
    }

    /// Takes a delta; returns the text to send, if any.
    fn delta(&mut self, delta: &str) -> Option<String> {
        self.attempt.push_str(delta);
        let out = if self.attempt.starts_with(&self.turn_sent) {
            if self.attempt.len() == self.turn_sent.len() {
                return None;
            }
            let new = &self.attempt[self.turn_sent.len()..];
            let mut out = String::new();
            if self.turn_cut.is_none() {
                self.turn_cut = Some(self.sent.len());
                if !self.sent.is_empty() {
                    out.push_str("\n\n");
                }
            }
            out.push_str(new);
            self.turn_sent.push_str(new);
            out
        } else if self.turn_sent.starts_with(&self.attempt) {
            // The new attempt says again what was sent: nothing new yet.
            return None;
        } else {
            // The new attempt says something else: all of it, apart.
            self.turn_sent = self.attempt.clone();
            format!("\n\n{}", self.attempt)
        };
        self.sent.push_str(&out);
        Some(out)
    }

    /// A line of its own after the text (a paused run's note).
    fn line(&mut self, line: &str) -> String {
        let out = if self.sent.is_empty() { line.to_owned() } else { format!("\n\n{line}") };
        self.sent.push_str(&out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_are_apart_and_a_retried_turn_goes_on_where_it_stopped() {
        let mut text = Assembler::new(true);
        text.turn_start();
        assert_eq!(text.delta("Let me "), Some("Let me ".to_owned()));
        assert_eq!(text.delta("look."), Some("look.".to_owned()));
        text.turn_start();
        assert_eq!(text.delta("Today"), Some("\n\nToday".to_owned()));
        text.void();
        // The new attempt says again what was sent: nothing new until it goes past it.
        assert_eq!(text.delta("Tod"), None);
        assert_eq!(text.delta("ay is Sunday."), Some(" is Sunday.".to_owned()));
        assert_eq!(text.sent, "Let me look.\n\nToday is Sunday.");
        assert_eq!(text.line("[waiting]"), "\n\n[waiting]");
    }

    #[test]
    fn a_streamed_attempt_that_says_something_else_is_sent_whole_and_apart() {
        let mut text = Assembler::new(true);
        text.turn_start();
        assert_eq!(text.delta("It is Mon"), Some("It is Mon".to_owned()));
        text.void();
        assert_eq!(text.delta("It is T"), Some("\n\nIt is T".to_owned()));
        assert_eq!(text.delta("uesday."), Some("uesday.".to_owned()));
        assert_eq!(text.sent, "It is Mon\n\nIt is Tuesday.");
    }

    #[test]
    fn unstreamed_the_void_text_is_dropped() {
        let mut text = Assembler::new(false);
        text.turn_start();
        text.delta("Let me look.");
        text.turn_start();
        text.delta("It is Mon");
        text.void();
        text.delta("It is Tuesday.");
        assert_eq!(text.sent, "Let me look.\n\nIt is Tuesday.");
    }
}
