//! The handlers of DESIGN.md §5, and how they read requests and stream runs.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, FromRequest, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures::Stream;
use keel_core::human::check_decision;
use keel_core::wire::pending_to_json;
use keel_core::{Decision, ErrorCode, LimitOverrides, Limits, Message, Part, Role, RunId, SessionId};
use keel_runtime::{Cancellation, RunOptions};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::AppState;
use crate::auth::Identity;
use crate::error::ApiError;
use crate::feed::{Item, Subscriber};
use crate::metrics::StreamGuard;

/// The largest request body the API reads.
pub const MAX_BODY: usize = 1024 * 1024;

/// A JSON request body: declared `application/json` (else 415), at most [`MAX_BODY`] bytes
/// (else 413), valid UTF-8 JSON (else 400).
pub(crate) struct JsonBody(pub(crate) Value);

/// Whether a `Content-Type` is JSON's (`application/json`, any parameters).
fn is_json(content_type: Option<&HeaderValue>) -> bool {
    content_type.and_then(|value| value.to_str().ok()).is_some_and(|value| {
        value.split(';').next().is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
    })
}

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<JsonBody, ApiError> {
        // A browser sends `text/plain` and form bodies to any origin without a preflight; a JSON
        // body it can only send after one, which keel answers for allowed origins only.
        let content_type = request.headers().get(axum::http::header::CONTENT_TYPE);
        if !is_json(content_type) {
            let given =
                content_type.and_then(|v| v.to_str().ok()).map_or("none".to_owned(), |v| format!("{v:?}"));
            return Err(ApiError::new(
                ErrorCode::UnsupportedMediaType,
                format!(
                    "send the body as JSON with `Content-Type: application/json` (the request's is {given})"
                ),
            ));
        }
        let too_large = || {
            ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("the request body is over {MAX_BODY} bytes (1 MB)"),
            )
        };
        let declared = request
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|length| length > MAX_BODY as u64) {
            return Err(too_large());
        }
        let bytes = axum::body::to_bytes(request.into_body(), MAX_BODY).await.map_err(|error| {
            let over_limit = std::error::Error::source(&error)
                .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
            if over_limit {
                too_large()
            } else {
                ApiError::invalid(format!("the request body could not be read (it ended early?): {error}"))
            }
        })?;
        if bytes.is_empty() {
            return Err(ApiError::invalid("the request has no body: send a JSON object"));
        }
        let value = serde_json::from_slice(&bytes)
            .map_err(|error| ApiError::invalid(format!("the request body is not valid JSON: {error}")))?;
        Ok(JsonBody(value))
    }
}

/// Base64 as clients write it: padded or not, with any trailing bits.
const LENIENT_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_allow_trailing_bits(true)
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// A session id from the path: 400 when invalid.
fn session_id(path: Result<Path<String>, PathRejection>) -> Result<SessionId, ApiError> {
    let Path(id) = path.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    Ok(SessionId::new(id)?)
}

/// A string field of a JSON object body.
pub(crate) fn string_field<'a>(body: &'a Value, name: &str) -> Result<Option<&'a str>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(ApiError::invalid(format!("`{name}` must be a string, not {}", json_type(other)))),
    }
}

pub(crate) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn require_object(body: &Value) -> Result<(), ApiError> {
    if body.is_object() {
        Ok(())
    } else {
        Err(ApiError::invalid(format!("the request body must be a JSON object, not {}", json_type(body))))
    }
}

/// `input`: a string, or an array of content parts (text, image or file with base64 data).
pub(crate) fn parse_input(input: &Value) -> Result<Message, ApiError> {
    let parts = match input {
        Value::String(text) if text.is_empty() => return Err(ApiError::invalid("`input` is empty")),
        Value::String(text) => vec![Part::Text(text.clone())],
        Value::Array(items) if items.is_empty() => return Err(ApiError::invalid("`input` has no parts")),
        Value::Array(items) => {
            items.iter().enumerate().map(|(i, item)| parse_part(i, item)).collect::<Result<_, _>>()?
        }
        other => {
            return Err(ApiError::invalid(format!(
                "`input` must be a string or an array of content parts, not {}",
                json_type(other)
            )));
        }
    };
    Ok(Message { role: Role::User, parts })
}

fn parse_part(index: usize, item: &Value) -> Result<Part, ApiError> {
    let at = format!("input[{index}]");
    let field = |name: &str| -> Result<&str, ApiError> {
        match item.get(name) {
            Some(Value::String(text)) => Ok(text),
            Some(other) => {
                Err(ApiError::invalid(format!("`{at}.{name}` must be a string, not {}", json_type(other))))
            }
            None => Err(ApiError::invalid(format!("`{at}` has no `{name}`"))),
        }
    };
    let data = |media_type: &str| -> Result<std::sync::Arc<[u8]>, ApiError> {
        let encoded = field("data")?;
        let bytes = LENIENT_BASE64.decode(encoded.trim()).map_err(|error| {
            ApiError::invalid(format!(
                "`{at}.data` is not base64 ({error}); send the {media_type} bytes base64-encoded"
            ))
        })?;
        Ok(bytes.into())
    };
    match field("type")? {
        "text" => Ok(Part::Text(field("text")?.to_owned())),
        "image" => {
            let media_type = field("mediaType")?;
            if !media_type.starts_with("image/") {
                return Err(ApiError::invalid(format!(
                    "`{at}.mediaType` must be an image type such as image/png, not {media_type:?}"
                )));
            }
            Ok(Part::Image { media_type: media_type.to_owned(), data: data(media_type)? })
        }
        "file" => {
            let media_type = field("mediaType")?;
            let name = match item.get("name") {
                Some(Value::String(name)) => Some(name.clone()),
                None | Some(Value::Null) => None,
                Some(other) => {
                    return Err(ApiError::invalid(format!(
                        "`{at}.name` must be a string, not {}",
                        json_type(other)
                    )));
                }
            };
            Ok(Part::File { media_type: media_type.to_owned(), name, data: data(media_type)? })
        }
        other => Err(ApiError::invalid(format!("`{at}.type` {other:?} is not one of text, image, file"))),
    }
}

/// `GET /health`: `ok` while the store answers; `503` with the store's error while it does
/// not (a load balancer then sends traffic to instances that can run turns).
pub(crate) async fn health(State(state): State<Arc<AppState>>) -> Response {
    let probe = SessionId::new("keel-health").expect("a valid session id");
    let store = state.engine.store();
    let answer = tokio::time::timeout(std::time::Duration::from_secs(3), store.session_summary(&probe)).await;
    match answer {
        Ok(Ok(_)) => "ok".into_response(),
        Ok(Err(error)) => {
            let mut response = ApiError::from(error).into_response();
            *response.status_mut() = axum::http::StatusCode::SERVICE_UNAVAILABLE;
            response
        }
        Err(_) => {
            let mut response =
                ApiError::new(ErrorCode::StoreLocked, "the store did not answer within 3 s").into_response();
            *response.status_mut() = axum::http::StatusCode::SERVICE_UNAVAILABLE;
            response
        }
    }
}

/// `POST /chat`: one turn, streamed as SSE; or, with the legacy `{ "message" }` body, its result
/// as JSON.
pub(crate) async fn chat(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    require_object(&body)?;
    let session = string_field(&body, "sessionId")?;
    let input = body.get("input").filter(|v| !v.is_null());
    if input.is_none()
        && let Some(message) = string_field(&body, "message")?
    {
        return legacy_chat(&state, &identity, &headers, session, message).await;
    }
    let session = SessionId::new(session.ok_or_else(|| ApiError::invalid("missing `sessionId`"))?)?;
    let session = identity.session(session);
    let input =
        parse_input(input.ok_or_else(|| ApiError::invalid("missing `input` (a string or content parts)"))?)?;
    let limits = match body.get("limits").filter(|v| !v.is_null()) {
        Some(limits) => parse_limits(limits, &state.engine.agent().limits)?,
        None => LimitOverrides::default(),
    };
    let (subscriber, run) = start_run(&state, &headers, &session, input, RunOptions { limits }).await?;
    Ok(run_stream(&state, subscriber, run))
}

/// Starts a run of `session` whose events the returned subscriber reads from the first. The run's
/// span continues the client's trace (`traceparent`); a refusal (a busy session, here or in
/// another process) is an error, before any byte of an answer.
pub(crate) async fn start_run(
    state: &AppState,
    headers: &HeaderMap,
    session: &SessionId,
    input: Message,
    options: RunOptions,
) -> Result<(Subscriber, RunId), ApiError> {
    // Subscribe before the run starts: its first event is not missed.
    let subscriber = state.feeds.subscribe(session, None).await?;
    let mut handle = {
        let _trace = crate::observe::trace_parent(headers).map(opentelemetry::Context::attach);
        state.engine.start_with(session.clone(), input, options)?
    };
    handle.admitted().await?;
    let run = handle.run_id().clone();
    drop(state.feeds.forward(session, handle));
    Ok((subscriber, run))
}

/// The request's `limits`: `{ maxTurns, maxTotalTokens, maxToolCalls, maxToolOutputChars,
/// toolTimeoutMs, providerTimeoutMs }`, each optional, each at most the agent's (a budget is
/// the operator's to raise, not the caller's).
fn parse_limits(value: &Value, agent: &Limits) -> Result<LimitOverrides, ApiError> {
    const KEYS: [&str; 6] = [
        "maxTurns",
        "maxTotalTokens",
        "maxToolCalls",
        "maxToolOutputChars",
        "toolTimeoutMs",
        "providerTimeoutMs",
    ];
    // The same limits by their spec keys, in the same order.
    const SPEC_KEYS: [&str; 6] = [
        "max_turns",
        "max_total_tokens",
        "max_tool_calls",
        "max_tool_output_chars",
        "tool_timeout",
        "provider_timeout",
    ];
    let Value::Object(map) = value else {
        return Err(ApiError::invalid(format!("`limits` must be an object, not {}", json_type(value))));
    };
    if let Some(unknown) = map.keys().find(|key| !KEYS.contains(&key.as_str())) {
        return Err(ApiError::invalid(format!(
            "unknown key `limits.{unknown}`; known keys: {}",
            KEYS.join(", ")
        )));
    }
    // JSON's largest exact integer: a larger (or fractional) number is no count of anything.
    const MAX_SAFE: u64 = (1 << 53) - 1;
    let number = |key: &str| -> Result<Option<u64>, ApiError> {
        let whole = |value: &Value| {
            value
                .as_u64()
                .or_else(|| value.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0).map(|f| f as u64))
        };
        match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => match whole(value) {
                Some(n) if (1..=MAX_SAFE).contains(&n) => Ok(Some(n)),
                _ => Err(ApiError::invalid(format!(
                    "`limits.{key}` must be a whole number from 1 to {MAX_SAFE}"
                ))),
            },
        }
    };
    let small = |key: &str| -> Result<Option<u32>, ApiError> {
        number(key)?
            .map(|n| u32::try_from(n).map_err(|_| ApiError::invalid(format!("`limits.{key}` is too large"))))
            .transpose()
    };
    let overrides = LimitOverrides {
        max_turns: small("maxTurns")?,
        max_total_tokens: number("maxTotalTokens")?,
        max_tool_calls: small("maxToolCalls")?,
        max_tool_output_chars: number("maxToolOutputChars")?
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        tool_timeout: number("toolTimeoutMs")?.map(std::time::Duration::from_millis),
        provider_timeout: number("providerTimeoutMs")?.map(std::time::Duration::from_millis),
    };
    if let Some(loosened) = overrides.loosened(agent) {
        let key =
            KEYS[SPEC_KEYS.iter().position(|k| *k == loosened.key).expect("every limit has an HTTP name")];
        return Err(ApiError::invalid(format!(
            "`limits.{key}` is {} here, more than the agent's {}: a request may only lower limits",
            loosened.asked, loosened.agent
        )));
    }
    Ok(overrides)
}

/// The deprecated single-turn form: waits for the run and answers with its result.
async fn legacy_chat(
    state: &AppState,
    identity: &Identity,
    headers: &axum::http::HeaderMap,
    session: Option<&str>,
    message: &str,
) -> Result<Response, ApiError> {
    if message.is_empty() {
        return Err(ApiError::invalid("`message` is empty"));
    }
    let session = match session {
        Some(id) => SessionId::new(id)?,
        // A single turn with no session: a fresh one, so that it sees no earlier conversation.
        None => SessionId::new(state.legacy_session_id())?,
    };
    let session = identity.session(session);
    let mut handle = {
        let _trace = crate::observe::trace_parent(headers).map(opentelemetry::Context::attach);
        state.engine.start(session.clone(), Message::user(message))?
    };
    handle.admitted().await?;
    let forwarded = state.feeds.forward(&session, handle);
    let result = tokio::time::timeout(state.request_timeout, forwarded)
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::RequestTimeout,
                format!(
                    "the run did not finish within {:?}; it goes on: GET /chat/{session} shows its result later",
                    state.request_timeout
                ),
            )
        })?
        .map_err(|error| ApiError::new(ErrorCode::Internal, format!("the run's task failed: {error}")))??;
    let mut body = json!({
        "runId": result.run_id.as_str(),
        "sessionId": result.session_id.external(),
        "text": result.text,
        "stopped": result.stopped.as_str(),
        "usage": { "inputTokens": result.usage.input_tokens, "outputTokens": result.usage.output_tokens },
        "pending": result.pending.iter().map(pending_to_json).collect::<Vec<_>>(),
    });
    if let Some(output) = result.output {
        body["output"] = output;
    }
    let mut response = axum::Json(body).into_response();
    response.headers_mut().insert("deprecation", HeaderValue::from_static("true"));
    Ok(response)
}

/// `GET /chat/:sessionId`: the transcript and what the session waits for.
pub(crate) async fn transcript(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let session = identity.session(session_id(path)?);
    let store = state.engine.store();
    let messages = store.load_messages(&session).await?;
    let pending = state.engine.pending(Some(&session)).await?;
    if messages.is_empty() && pending.is_empty() {
        return Err(ApiError::new(ErrorCode::SessionNotFound, format!("no session {}", session.external())));
    }
    let usage = store.session_summary(&session).await?.map(|s| s.usage).unwrap_or_default();
    let body = keel_core::wire::transcript_to_json(
        session.external(),
        usage,
        messages.iter().map(|m| &**m),
        &pending,
    );
    Ok(axum::Json(body).into_response())
}

/// `GET /chat/:sessionId/state`: the session's state object (`null` when it has none).
pub(crate) async fn session_state(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let session = identity.session(session_id(path)?);
    let store = state.engine.store();
    if store.session_summary(&session).await?.is_none() {
        return Err(ApiError::new(ErrorCode::SessionNotFound, format!("no session {}", session.external())));
    }
    let value = store.load_session_state(&session).await?.unwrap_or(Value::Null);
    Ok(axum::Json(json!({ "sessionId": session.external(), "state": value })).into_response())
}

/// How many sessions `GET /sessions` lists when the request does not say, and at most.
const SESSIONS_LISTED: usize = 50;
const MOST_SESSIONS_LISTED: usize = 1000;

/// The query of `GET /sessions`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionsQuery {
    limit: Option<usize>,
}

/// `GET /sessions`: the caller's sessions, most recently written first. A JWT subject sees its
/// own; a caller without per-user auth, the sessions no subject owns.
pub(crate) async fn sessions(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    query: Result<axum::extract::Query<SessionsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let query = query.map_err(|rejection| {
        ApiError::invalid(format!(
            "the query must be at most `limit=N` (1 to {MOST_SESSIONS_LISTED}): {}",
            rejection.body_text()
        ))
    })?;
    let limit = query.limit.unwrap_or(SESSIONS_LISTED);
    if !(1..=MOST_SESSIONS_LISTED).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "`limit` must be 1 to {MOST_SESSIONS_LISTED} (it is {limit})"
        )));
    }
    let filter = keel_core::SessionFilter { scope: identity.scope(), limit: Some(limit) };
    let sessions = state.engine.store().list_sessions(filter).await?;
    let sessions: Vec<Value> = sessions.iter().map(keel_core::wire::session_summary_to_json).collect();
    Ok(axum::Json(json!({ "sessions": sessions })).into_response())
}

/// `GET /agent`: who answers: the agent's name, description, model, tools (with whether they
/// wait for approval) and output schema. What a client shows; the instructions stay private.
pub(crate) async fn agent(State(state): State<Arc<AppState>>) -> Response {
    let agent = state.engine.agent();
    let tools: Vec<Value> = agent
        .tools
        .specs()
        .iter()
        .map(|spec| {
            let approval = match agent.tools.approval_rule(&spec.name) {
                None => "never",
                Some(keel_core::ApprovalRule::Always) => "always",
                Some(keel_core::ApprovalRule::When(_)) => "sometimes",
            };
            json!({
                "name": spec.name,
                "description": spec.description,
                "inputSchema": spec.input_schema,
                "approval": approval,
            })
        })
        .collect();
    axum::Json(json!({
        "name": agent.name,
        "description": agent.description,
        "model": agent.model,
        "tools": tools,
        "outputSchema": agent.output_schema.as_ref().map(keel_core::agent::OutputSchema::schema),
    }))
    .into_response()
}

/// `GET /chat/:sessionId/events`: the session's live events, resumable with `Last-Event-ID`.
pub(crate) async fn events(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let session = identity.session(session_id(path)?);
    let after = match headers.get("last-event-id") {
        None => None,
        Some(value) => {
            Some(value.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).ok_or_else(|| {
                ApiError::invalid("`Last-Event-ID` must be the id of an event this API sent (a number)")
            })?)
        }
    };
    let subscriber = state.feeds.subscribe(&session, after).await?;
    Ok(sse(subscription(&state, subscriber, None)))
}

/// `POST /chat/:sessionId/approvals/:id`: decides a pending approval or answers a question, and
/// streams the continued run.
pub(crate) async fn decide(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let Path((session, id)) = path.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    let session = identity.session(SessionId::new(session)?);
    require_object(&body)?;
    // `null` means absent, as for every optional field.
    let present = |name: &str| body.get(name).filter(|v| !v.is_null());
    let decision = match (present("answer"), present("approved")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "give either `approved` (for an approval) or `answer` (for a question), not both",
            ));
        }
        (Some(Value::String(answer)), None) => Decision::Answer(answer.clone()),
        (Some(other), None) => {
            return Err(ApiError::invalid(format!("`answer` must be a string, not {}", json_type(other))));
        }
        (None, Some(Value::Bool(approved))) => {
            let note = string_field(&body, "note")?.map(str::to_owned);
            if *approved { Decision::Approve { note } } else { Decision::Reject { note } }
        }
        (None, Some(other)) => {
            return Err(ApiError::invalid(format!(
                "`approved` must be true or false, not {}",
                json_type(other)
            )));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "give `approved` (true or false, with an optional `note`) or `answer`",
            ));
        }
    };
    let (subscriber, run) = decide_input(&state, &identity, &session, &[(id, decision)]).await?;
    Ok(run_stream(&state, subscriber, run))
}

/// Decides inputs `session` waits for, in order, and continues its run once they are taken: the
/// returned subscriber reads the continued run's events (its id is returned) from the first.
/// Every decision is checked before any is taken; a pending input of another session (another
/// user's) is "not pending" here, like an unknown one.
pub(crate) async fn decide_input(
    state: &AppState,
    identity: &Identity,
    session: &SessionId,
    decisions: &[(String, Decision)],
) -> Result<(Subscriber, RunId), ApiError> {
    let mut run = None;
    for (id, decision) in decisions {
        let pending = state.engine.store().pending_input(id).await?.filter(|p| &p.session_id == session);
        let Some(pending) = pending else {
            return Err(keel_core::StoreError::not_pending(id).into());
        };
        check_decision(&pending, decision)?;
        run = Some(pending.run_id);
    }
    let Some(run) = run else {
        return Err(ApiError::invalid("there is no decision to take"));
    };
    let subscriber = state.feeds.subscribe(session, None).await?;
    let by = identity.describe();
    let store = state.engine.store();
    let (last, first) = decisions.split_last().expect("not empty: a run was found");
    for (id, decision) in first {
        keel_runtime::record_decision(store.as_ref(), id, decision.clone(), &by).await?;
        state.metrics.human_input(decision_kind(decision), decision_outcome(decision));
    }
    let (id, decision) = last;
    if state.engine.is_running(session) {
        // The run is still busy with its other calls here: it applies the decision itself.
        keel_runtime::record_decision(store.as_ref(), id, decision.clone(), &by).await?;
    } else {
        let handle = state.engine.decide(id, decision.clone(), &by).await?;
        drop(state.feeds.forward(session, handle));
    }
    state.metrics.human_input(decision_kind(decision), decision_outcome(decision));
    Ok((subscriber, run))
}

fn decision_kind(decision: &Decision) -> &'static str {
    if matches!(decision, Decision::Answer(_)) { "question" } else { "approval" }
}

fn decision_outcome(decision: &Decision) -> &'static str {
    match decision {
        Decision::Approve { .. } => "approved",
        Decision::Reject { .. } => "rejected",
        Decision::Answer(_) => "answered",
        Decision::TimedOut => "timed_out",
    }
}

/// `DELETE /chat/:sessionId/run`: cancels the session's run in flight (or paused).
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let session = identity.session(session_id(path)?);
    match state.engine.cancel(&session, &identity.describe()).await? {
        Cancellation::Cancelled => Ok(axum::Json(json!({ "cancelled": true })).into_response()),
        // Of several concurrent requests, one cancelled the run; the others say so.
        Cancellation::AlreadyCancelling { by } => {
            let mut body = json!({ "cancelled": false, "alreadyCancelling": true });
            if let Some(by) = by {
                body["by"] = json!(by);
            }
            Ok(axum::Json(body).into_response())
        }
        Cancellation::NoRun => Err(ApiError::new(
            ErrorCode::RunNotFound,
            format!("session {} has no unfinished run to cancel", session.external()),
        )),
    }
}

/// The OpenAPI document of this API (`assets/openapi.json`, checked against the routes by the
/// end-to-end tests).
pub const OPENAPI: &str = include_str!("../assets/openapi.json");

/// `GET /openapi.json`: the document, with this agent's limits as the most a `POST /chat`
/// body's `limits` may ask for.
pub(crate) async fn openapi(State(state): State<Arc<AppState>>) -> Response {
    let body = match serde_json::from_str::<Value>(OPENAPI) {
        Ok(mut document) => {
            with_agent_limits(&mut document, &state.engine.agent().limits);
            document.to_string()
        }
        Err(_) => OPENAPI.to_owned(),
    };
    ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Sets the `maximum` of each `limits` field of the chat request to the agent's limit.
fn with_agent_limits(document: &mut Value, limits: &Limits) {
    let pointer = "/components/schemas/ChatRequest/oneOf/0/properties/limits/anyOf/0/properties";
    let Some(Value::Object(fields)) = document.pointer_mut(pointer) else { return };
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let maxima = [
        ("maxTurns", Some(u64::from(limits.max_turns))),
        ("maxTotalTokens", limits.max_total_tokens),
        ("maxToolCalls", limits.max_tool_calls.map(u64::from)),
        ("maxToolOutputChars", Some(limits.max_tool_output_chars as u64)),
        ("toolTimeoutMs", Some(millis(limits.tool_timeout))),
        ("providerTimeoutMs", Some(millis(limits.provider_timeout))),
    ];
    for (key, maximum) in maxima {
        if let (Some(field), Some(maximum)) = (fields.get_mut(key), maximum) {
            field["maximum"] = maximum.into();
        }
    }
}

/// `GET /`: the playground page (embedded; no data in it, so it needs no auth: the page asks
/// for the token and sends it with its API calls).
pub(crate) async fn playground() -> Response {
    let mut response = axum::response::Html(include_str!("../assets/playground.html")).into_response();
    let headers = response.headers_mut();
    headers.insert(
        axum::http::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
             frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    headers.insert(axum::http::header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(axum::http::header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response
}

/// `GET /metrics`: Prometheus text.
pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let (approvals, questions) = state.engine.timed_out_inputs();
    state.metrics.timed_out(approvals, questions);
    let mut response = state.metrics.render().into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

pub(crate) async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such route; see docs/http.md for the API")
}

/// `/mcp` in a build without the `mcp` cargo feature: not served, and saying why.
#[cfg(not(feature = "mcp"))]
pub(crate) async fn mcp_not_built() -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        "this keel was built without the `mcp` cargo feature, so it does not serve the agent over MCP",
    )
}

pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::new(ErrorCode::MethodNotAllowed, "this route does not take this HTTP method")
}

/// What a client reads: the feed's entries after its cursor, in id order; only `run`'s when
/// given, ending with its end (`event: done`); ended on shutdown, or when the client fell behind.
struct Subscription {
    subscriber: Subscriber,
    run: Option<RunId>,
    closing: CancellationToken,
    done: bool,
    /// Counts the stream as open while it lives.
    _open: StreamGuard,
}

fn subscription(
    app: &AppState,
    subscriber: Subscriber,
    run: Option<RunId>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    let state = Subscription {
        subscriber,
        run,
        closing: app.closing.clone(),
        done: false,
        _open: app.metrics.stream_opened(),
    };
    futures::stream::unfold(state, |mut sub| async move {
        loop {
            if sub.done {
                return None;
            }
            let entry = tokio::select! {
                biased;
                () = sub.closing.cancelled() => return None,
                // `None`: fell behind (a slow client): cut; it resumes with Last-Event-ID.
                entry = sub.subscriber.next() => entry?,
            };
            if sub.run.as_ref().is_some_and(|run| run != &entry.run) {
                continue;
            }
            match &entry.item {
                Item::Event(json) => {
                    let event = SseEvent::default().id(entry.id.to_string()).data(&**json);
                    return Some((Ok(event), sub));
                }
                Item::RunEnded => {
                    // The end of a run's stream: from then on it holds its session no longer.
                    // A session's feed tells each run's; a run's own stream ends with it. It has
                    // its id, as every message: a reconnect after it does not repeat it.
                    let data = json!({ "runId": entry.run.as_str() }).to_string();
                    let done = SseEvent::default().id(entry.id.to_string()).event("done").data(data);
                    sub.done = sub.run.is_some();
                    return Some((Ok(done), sub));
                }
            }
        }
    })
}

/// A stream fed by `produce`, which runs as its own task and sends events while the client
/// listens (`send` returns false once it has gone).
pub(crate) fn async_stream<F, Fut>(
    produce: F,
) -> impl futures::Stream<Item = Result<SseEvent, Infallible>> + Send + 'static
where
    F: FnOnce(Sender) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(produce(Sender(tx)));
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|event| (Ok(event), rx)) })
}

/// The sending side of an answer's stream.
pub(crate) struct Sender(tokio::sync::mpsc::Sender<SseEvent>);

impl Sender {
    /// Sends, waiting while the client is slow; false once it has gone.
    pub(crate) async fn send(&self, event: SseEvent) -> bool {
        self.0.send(event).await.is_ok()
    }
}

/// The SSE answer of one run's events (`POST /chat`, a decision). Its headers name the run
/// (`X-Keel-Run-Id`) and the session feed's position before its first event
/// (`X-Keel-Last-Event-ID`): a client whose stream is cut before it read any event id reads the
/// run from its start with that as `Last-Event-ID` on `GET /chat/:id/events`.
fn run_stream(state: &AppState, subscriber: Subscriber, run: RunId) -> Response {
    let position = subscriber.position();
    let mut response = sse(subscription(state, subscriber, Some(run.clone())));
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(run.as_str()) {
        headers.insert("x-keel-run-id", value);
    }
    headers.insert("x-keel-last-event-id", HeaderValue::from(position));
    response
}

pub(crate) fn sse(stream: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static) -> Response {
    let mut response = Sse::new(stream).keep_alive(KeepAlive::default()).into_response();
    // Proxies must not buffer the stream.
    response.headers_mut().insert("x-accel-buffering", HeaderValue::from_static("no"));
    response.headers_mut().insert(axum::http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
