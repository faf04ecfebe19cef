//! `POST /ai-sdk/chat`: the Vercel AI SDK's UI message stream protocol (version 1), so that
//! `useChat` from `@ai-sdk/react` (with its default transport) talks to a keel agent unchanged.
//!
//! The request is what `useChat` sends: `{ id, messages, trigger, messageId }`. `id` (the chat's
//! id) names the session, and only the last message is read, since the session holds the
//! conversation before it:
//!
//! - a user message is the input of a new run; when the session waits for an answer to a
//!   question (`ask_question`), its text is that answer instead;
//! - an assistant message whose tool parts carry approval responses (`addToolApprovalResponse`,
//!   then `sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses`) decides
//!   those approvals, and the continued run streams into that same message.
//!
//! The answer maps keel's events onto the protocol's chunks: a model call is a step (`start-step`
//! ... `finish-step`) with its text and reasoning parts, a call is a dynamic tool part (the tools
//! are the agent's, unknown to the page) from `tool-input-available` to its output, an approval
//! is a `tool-approval-request` with keel's approval id, a retried model call is a `reset-step`,
//! and keel's own facts travel as data parts (`data-keel-question`, `data-keel-state`) and message
//! metadata (`sessionId`, `runId`, `status`, `usage`, `output`).

use std::collections::HashSet;
use std::sync::Arc;

use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use axum::response::sse::Event as SseEvent;
use base64::Engine as _;
use keel_core::{Decision, Message, Part, PendingKind, Role, RunId, SessionId};
use keel_runtime::RunOptions;
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::Identity;
use crate::error::ApiError;
use crate::feed::RunEvents;
use crate::routes::{
    JsonBody, Sender, async_stream, decide_input, json_type, require_object, sse, start_run,
};

/// The header that tells the AI SDK the answer speaks its protocol.
const PROTOCOL_HEADER: &str = "x-vercel-ai-ui-message-stream";

/// `POST /ai-sdk/chat`.
pub(crate) async fn chat(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    headers: HeaderMap,
    body: Result<JsonBody, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(body) = body?;
    require_object(&body)?;
    let session = match body.get("id") {
        Some(Value::String(id)) => identity.session(SessionId::new(id.clone())?),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "`id` (the chat's id, keel's session) must be a string, not {}",
                json_type(other)
            )));
        }
        None => return Err(ApiError::invalid("missing `id`: the chat's id, which names keel's session")),
    };
    match body.get("trigger").filter(|t| !t.is_null()).map(|t| t.as_str().ok_or(t)) {
        None | Some(Ok("submit-message")) => {}
        Some(Err(other)) => {
            return Err(ApiError::invalid(format!("`trigger` must be a string, not {}", json_type(other))));
        }
        Some(Ok("regenerate-message")) => {
            return Err(ApiError::invalid(
                "keel keeps every turn of a session: a reply cannot be regenerated; send a new message instead",
            ));
        }
        Some(Ok(other)) => return Err(ApiError::invalid(format!("unknown `trigger` {other:?}"))),
    }
    if let Some(id) = body.get("messageId").filter(|id| !id.is_null() && !id.is_string()) {
        return Err(ApiError::invalid(format!("`messageId` must be a string, not {}", json_type(id))));
    }
    let last = match body.get("messages") {
        Some(Value::Array(messages)) => {
            messages.iter().enumerate().try_for_each(|(index, message)| check_message(index, message))?;
            messages.last()
        }
        _ => None,
    };
    let Some(last) = last else {
        return Err(ApiError::invalid("`messages` must be a non-empty array of UI messages"));
    };
    let parts = last.get("parts").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let (subscriber, run, continued) = match last.get("role").and_then(Value::as_str) {
        Some("user") => {
            let input = user_message(parts)?;
            match waiting_question(&state, &session).await? {
                // The session waits for an answer: this message is it.
                Some(question) => {
                    let text = plain_text(&input);
                    if text.trim().is_empty() {
                        return Err(ApiError::invalid(format!(
                            "the session waits for an answer to its question ({question}): write it as text"
                        )));
                    }
                    let answer = Decision::Answer(text);
                    let decisions = [(question.clone(), answer)];
                    let (subscriber, run) = decide_input(&state, &identity, &session, &decisions).await?;
                    // The run goes on in a new message, after the user's: an id of its own.
                    let suffix = run.as_str().trim_start_matches(RunId::PREFIX);
                    let continued = Continued {
                        message_id: Some(format!("msg_{suffix}_{question}")),
                        known_calls: HashSet::new(),
                        rejected: HashSet::new(),
                        resumes_step: false,
                    };
                    (subscriber, run, Some(continued))
                }
                None => {
                    let (subscriber, run) =
                        start_run(&state, &headers, &session, input, RunOptions::default()).await?;
                    (subscriber, run, None)
                }
            }
        }
        Some("assistant") => {
            let decisions = approval_responses(parts)?;
            if decisions.is_empty() {
                return Err(ApiError::invalid(
                    "the last message is the assistant's, with no approval response in it: send the user's message, or answer the pending approvals (addToolApprovalResponse)",
                ));
            }
            let (subscriber, run) = decide_input(&state, &identity, &session, &decisions).await?;
            let rejected = decisions
                .iter()
                .filter(|(_, decision)| matches!(decision, Decision::Reject { .. }))
                .filter_map(|(id, _)| call_of_approval(parts, id))
                .collect();
            let continued = Continued {
                message_id: last.get("id").and_then(Value::as_str).map(str::to_owned),
                known_calls: parts.iter().filter_map(tool_call_id).map(str::to_owned).collect(),
                rejected,
                resumes_step: true,
            };
            (subscriber, run, Some(continued))
        }
        _ => return Err(ApiError::invalid("the last message must be the user's or the assistant's")),
    };
    let mut chunks = Chunks::new(session.clone(), run.clone(), continued);
    let mut reader = RunEvents::new(subscriber, run, state.closing.clone());
    let stream = async_stream(move |tx: Sender| async move {
        if !send(&tx, chunks.start()).await {
            return;
        }
        // The chunks of the run's end wait for the end of its stream: only then has the run let go
        // of the session, so that the chat's next request (sent at once by `useChat` after an
        // approval response) is not refused as busy.
        let mut end = None;
        while let Some(event) = reader.next().await {
            let chunks = chunks.on_event(&event);
            if matches!(event["type"].as_str(), Some("run.done" | "run.paused" | "run.error")) {
                end = Some(chunks);
                continue;
            }
            for chunk in chunks {
                if !send(&tx, chunk).await {
                    return;
                }
            }
        }
        for chunk in end.unwrap_or_else(|| vec![chunks.cut()]) {
            send(&tx, chunk).await;
        }
        tx.send(SseEvent::default().data("[DONE]")).await;
    });
    let mut response = sse(stream);
    response.headers_mut().insert(PROTOCOL_HEADER, HeaderValue::from_static("v1"));
    Ok(response)
}

/// A UI message's shape: `role` (user, assistant or system) and `parts`, each with a `type`.
/// Only the last message is read, but a malformed one anywhere is a client's bug, said at once.
fn check_message(index: usize, message: &Value) -> Result<(), ApiError> {
    let at = format!("messages[{index}]");
    match message.get("role").and_then(Value::as_str) {
        Some("user" | "assistant" | "system") => {}
        _ => return Err(ApiError::invalid(format!("`{at}.role` must be user, assistant or system"))),
    }
    if let Some(id) = message.get("id").filter(|id| !id.is_string()) {
        return Err(ApiError::invalid(format!("`{at}.id` must be a string, not {}", json_type(id))));
    }
    let Some(parts) = message.get("parts").and_then(Value::as_array) else {
        return Err(ApiError::invalid(format!("`{at}` has no `parts` array")));
    };
    for (i, part) in parts.iter().enumerate() {
        if !part.get("type").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(format!("`{at}.parts[{i}]` has no `type`")));
        }
    }
    Ok(())
}

async fn send(tx: &Sender, chunk: Value) -> bool {
    tx.send(SseEvent::default().data(chunk.to_string())).await
}

/// The question `session` waits for, if it waits for one.
async fn waiting_question(state: &AppState, session: &SessionId) -> Result<Option<String>, ApiError> {
    let pending = state.engine.store().pending_inputs(Some(session)).await?;
    Ok(pending.into_iter().find(|p| matches!(p.kind, PendingKind::Question { .. })).map(|p| p.id))
}

/// The text of a message's text parts, as one answer.
fn plain_text(message: &Message) -> String {
    let texts: Vec<&str> = message
        .parts
        .iter()
        .filter_map(|part| if let Part::Text(text) = part { Some(text.as_str()) } else { None })
        .collect();
    texts.join("\n")
}

/// A user message's parts: text, and files as `data:` URLs (keel fetches no address a request
/// names). Parts the model does not read (`step-start`, `data-*`, sources) are skipped.
fn user_message(parts: &[Value]) -> Result<Message, ApiError> {
    let mut message = Vec::new();
    for (index, part) in parts.iter().enumerate() {
        let at = format!("messages[-1].parts[{index}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") => match part.get("text").and_then(Value::as_str) {
                Some(text) if !text.is_empty() => message.push(Part::Text(text.to_owned())),
                Some(_) => {}
                None => return Err(ApiError::invalid(format!("`{at}` is a text part without `text`"))),
            },
            Some("file") => message.push(file_part(&at, part)?),
            Some(_) => {}
            None => return Err(ApiError::invalid(format!("`{at}` has no `type`"))),
        }
    }
    if message.is_empty() {
        return Err(ApiError::invalid("the user's message has no text and no file"));
    }
    Ok(Message { role: Role::User, parts: message })
}

fn file_part(at: &str, part: &Value) -> Result<Part, ApiError> {
    let refused = || {
        ApiError::invalid(format!(
            "`{at}.url` must be a `data:<media type>;base64,...` URL: keel does not fetch addresses a request names"
        ))
    };
    let url = part.get("url").and_then(Value::as_str).ok_or_else(refused)?;
    let (meta, data) = url.strip_prefix("data:").and_then(|rest| rest.split_once(',')).ok_or_else(refused)?;
    let declared = meta.strip_suffix(";base64").ok_or_else(refused)?;
    let media_type = part.get("mediaType").and_then(Value::as_str).unwrap_or(declared).to_owned();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|error| ApiError::invalid(format!("`{at}.url` is not base64: {error}")))?;
    if media_type.starts_with("image/") {
        Ok(Part::Image { media_type, data: bytes.into() })
    } else {
        let name = part.get("filename").and_then(Value::as_str).map(str::to_owned);
        Ok(Part::File { media_type, name, data: bytes.into() })
    }
}

/// Whether a part is a tool part (`tool-<name>`, or `dynamic-tool` as keel sends them).
fn is_tool_part(part: &Value) -> bool {
    part.get("type").and_then(Value::as_str).is_some_and(|t| t == "dynamic-tool" || t.starts_with("tool-"))
}

fn tool_call_id(part: &Value) -> Option<&str> {
    if is_tool_part(part) { part.get("toolCallId").and_then(Value::as_str) } else { None }
}

/// The call an approval of `parts` is of.
fn call_of_approval(parts: &[Value], approval: &str) -> Option<String> {
    parts
        .iter()
        .find(|part| is_tool_part(part) && part["approval"]["id"].as_str() == Some(approval))
        .and_then(tool_call_id)
        .map(str::to_owned)
}

/// The approval responses of an assistant message's tool parts, as keel's decisions.
fn approval_responses(parts: &[Value]) -> Result<Vec<(String, Decision)>, ApiError> {
    let mut decisions = Vec::new();
    for part in parts.iter().filter(|part| is_tool_part(part)) {
        if part.get("state").and_then(Value::as_str) != Some("approval-responded") {
            continue;
        }
        let approval = &part["approval"];
        let Some(id) = approval["id"].as_str() else {
            return Err(ApiError::invalid("an approval response has no `approval.id`"));
        };
        let note = approval["reason"].as_str().filter(|r| !r.is_empty()).map(str::to_owned);
        let decision = match approval["approved"] {
            Value::Bool(true) => Decision::Approve { note },
            Value::Bool(false) => Decision::Reject { note },
            _ => {
                return Err(ApiError::invalid(format!(
                    "the response to approval {id} has no `approved` boolean"
                )));
            }
        };
        decisions.push((id.to_owned(), decision));
    }
    Ok(decisions)
}

/// What an answer that continues a paused run knows of the message it goes on in.
struct Continued {
    /// The message's id: the continued run's chunks go into it.
    message_id: Option<String>,
    /// The calls the message shows already (a re-driven run announces them again).
    known_calls: HashSet<String>,
    /// The calls whose approval this request rejected.
    rejected: HashSet<String>,
    /// The run goes on in the step the message ends with (an approval's), not in a new one.
    resumes_step: bool,
}

/// Turns a run's events into the protocol's chunks.
struct Chunks {
    session: SessionId,
    run: RunId,
    continued: Option<Continued>,
    /// A step is open (a `start-step` was sent, its `finish-step` not yet).
    in_step: bool,
    /// The id of the open text part, and of the open reasoning part.
    text: Option<String>,
    reasoning: Option<String>,
    /// Parts made so far, for their ids.
    parts: u32,
    /// The first `turn.start` of a continued run is the step the message ends with.
    resumed_turn_pending: bool,
    /// The calls this answer announced (`tool-input-available`).
    announced: HashSet<String>,
}

impl Chunks {
    fn new(session: SessionId, run: RunId, continued: Option<Continued>) -> Chunks {
        let resumed_turn_pending = continued.as_ref().is_some_and(|c| c.resumes_step);
        Chunks {
            session,
            run,
            continued,
            in_step: false,
            text: None,
            reasoning: None,
            parts: 0,
            resumed_turn_pending,
            announced: HashSet::new(),
        }
    }

    fn metadata(&self) -> Value {
        json!({ "sessionId": self.session.external(), "runId": self.run.as_str() })
    }

    fn start(&self) -> Value {
        let message_id = match self.continued.as_ref().and_then(|c| c.message_id.clone()) {
            Some(id) => id,
            None => format!("msg_{}", self.run.as_str().trim_start_matches(RunId::PREFIX)),
        };
        json!({ "type": "start", "messageId": message_id, "messageMetadata": self.metadata() })
    }

    /// The chunks of a stream cut before its run ended (the server is stopping): the run goes
    /// on, and the chat's next request (or `GET /chat/:id`) finds its result.
    fn cut(&self) -> Value {
        json!({
            "type": "error",
            "errorText": "KEEL_SHUTTING_DOWN: the answer was cut before the run ended; the run goes on, and the session shows its result",
        })
    }

    fn next_id(&mut self, kind: &str) -> String {
        self.parts += 1;
        format!("{kind}_{}", self.parts)
    }

    /// Ends the open text and reasoning parts.
    fn close_parts(&mut self, out: &mut Vec<Value>) {
        if let Some(id) = self.reasoning.take() {
            out.push(json!({ "type": "reasoning-end", "id": id }));
        }
        if let Some(id) = self.text.take() {
            out.push(json!({ "type": "text-end", "id": id }));
        }
    }

    fn close_step(&mut self, out: &mut Vec<Value>) {
        self.close_parts(out);
        if std::mem::take(&mut self.in_step) {
            out.push(json!({ "type": "finish-step" }));
        }
    }

    /// Whether the message this answer streams into has call `call`: announced by this answer,
    /// or already in the continued message. A question answered by a new user message is
    /// continued in a new message, which never showed the `ask_question` call: its outcome is
    /// not shown there (the user's message is the answer).
    fn shows(&self, call: &str) -> bool {
        self.announced.contains(call) || self.continued.as_ref().is_some_and(|c| c.known_calls.contains(call))
    }

    fn on_event(&mut self, event: &Value) -> Vec<Value> {
        let field = |name: &str| event.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
        let mut out = Vec::new();
        match event["type"].as_str().unwrap_or_default() {
            "turn.start" => {
                if std::mem::take(&mut self.resumed_turn_pending) {
                    // The step the continued message ends with goes on.
                    return out;
                }
                self.close_step(&mut out);
                out.push(json!({ "type": "start-step" }));
                self.in_step = true;
            }
            "text.delta" => {
                let id = match &self.text {
                    Some(id) => id.clone(),
                    None => {
                        let id = self.next_id("text");
                        out.push(json!({ "type": "text-start", "id": id }));
                        self.text = Some(id.clone());
                        id
                    }
                };
                out.push(json!({ "type": "text-delta", "id": id, "delta": field("delta") }));
            }
            "reasoning.delta" => {
                let id = match &self.reasoning {
                    Some(id) => id.clone(),
                    None => {
                        let id = self.next_id("reasoning");
                        out.push(json!({ "type": "reasoning-start", "id": id }));
                        self.reasoning = Some(id.clone());
                        id
                    }
                };
                out.push(json!({ "type": "reasoning-delta", "id": id, "delta": field("delta") }));
            }
            // The text of the failed attempt (or of the answer that missed the schema) is void:
            // the step's parts so far are dropped.
            "turn.retry" | "output.repair" => {
                self.text = None;
                self.reasoning = None;
                out.push(json!({ "type": "reset-step" }));
            }
            "tool.start" => {
                let call = field("callId");
                if self.shows(&call) {
                    return out;
                }
                self.close_parts(&mut out);
                self.announced.insert(call.clone());
                out.push(json!({
                    "type": "tool-input-available",
                    "toolCallId": call,
                    "toolName": field("name"),
                    "input": event["input"],
                    "dynamic": true,
                }));
            }
            "approval.requested" | "tool.done" | "tool.error" if !self.shows(&field("callId")) => {}
            "approval.requested" => out.push(json!({
                "type": "tool-approval-request",
                "approvalId": field("approvalId"),
                "toolCallId": field("callId"),
            })),
            "tool.done" => out.push(json!({
                "type": "tool-output-available",
                "toolCallId": field("callId"),
                "output": event["output"],
                "dynamic": true,
            })),
            "tool.error" => {
                let call = field("callId");
                if self.continued.as_ref().is_some_and(|c| c.rejected.contains(&call)) {
                    out.push(json!({ "type": "tool-output-denied", "toolCallId": call }));
                } else {
                    out.push(json!({
                        "type": "tool-output-error",
                        "toolCallId": call,
                        "errorText": field("error"),
                        "dynamic": true,
                    }));
                }
            }
            "question.asked" => out.push(json!({
                "type": "data-keel-question",
                "id": field("questionId"),
                "data": { "questionId": field("questionId"), "question": field("question") },
            })),
            "state.updated" => {
                out.push(json!({ "type": "data-keel-state", "data": event["state"], "transient": true }));
            }
            "run.done" => {
                self.close_step(&mut out);
                let stopped = field("stopped");
                let mut metadata = self.metadata();
                metadata["status"] = json!("finished");
                metadata["stopped"] = json!(stopped);
                metadata["usage"] = event["usage"].clone();
                if let Some(output) = event.get("output").filter(|v| !v.is_null()) {
                    metadata["output"] = output.clone();
                }
                let reason = match stopped.as_str() {
                    "final" | "stop_condition" => "stop",
                    "max_turns" | "budget" => "length",
                    _ => "other",
                };
                out.push(json!({ "type": "finish", "finishReason": reason, "messageMetadata": metadata }));
            }
            "run.paused" => {
                self.close_step(&mut out);
                let mut metadata = self.metadata();
                metadata["status"] = json!("awaiting_input");
                metadata["pending"] = event["pending"].clone();
                metadata["usage"] = event["usage"].clone();
                out.push(json!({ "type": "finish", "finishReason": "other", "messageMetadata": metadata }));
            }
            "run.error" => {
                self.close_step(&mut out);
                out.push(json!({ "type": "error", "errorText": format!("{}: {}", field("code"), field("message")) }));
            }
            _ => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(continued: Option<Continued>) -> Chunks {
        Chunks::new(
            SessionId::new("s").unwrap(),
            RunId::parse("run_0123456789abcdef0123456789abcdef").unwrap(),
            continued,
        )
    }

    fn types(out: &[Value]) -> Vec<&str> {
        out.iter().map(|c| c["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn a_retried_turn_resets_its_step_and_its_text_starts_again() {
        let mut chunks = chunks(None);
        let mut all = Vec::new();
        for event in [
            json!({"type": "turn.start", "turn": 0}),
            json!({"type": "text.delta", "delta": "It is Mon"}),
            json!({"type": "turn.retry", "turn": 0}),
            json!({"type": "text.delta", "delta": "It is Tuesday."}),
            json!({"type": "run.done", "text": "It is Tuesday.", "stopped": "final", "usage": {}}),
        ] {
            all.extend(chunks.on_event(&event));
        }
        assert_eq!(
            types(&all),
            [
                "start-step",
                "text-start",
                "text-delta",
                "reset-step",
                "text-start",
                "text-delta",
                "text-end",
                "finish-step",
                "finish"
            ]
        );
        assert_ne!(all[1]["id"], all[4]["id"], "a new text part after the reset");
        assert_eq!(all[8]["finishReason"], "stop");
    }

    #[test]
    fn a_continued_message_goes_on_in_its_step_and_a_rejection_is_a_denial() {
        let continued = Continued {
            message_id: Some("m1".into()),
            known_calls: ["call_0_0".to_owned()].into(),
            rejected: ["call_0_0".to_owned()].into(),
            resumes_step: true,
        };
        let mut chunks = chunks(Some(continued));
        assert_eq!(chunks.start()["messageId"], "m1");
        let mut all = Vec::new();
        for event in [
            json!({"type": "run.start"}),
            json!({"type": "turn.start", "turn": 0}),
            json!({"type": "tool.start", "callId": "call_0_0", "name": "pay", "input": {}}),
            json!({"type": "tool.error", "callId": "call_0_0", "error": "rejected"}),
            json!({"type": "turn.start", "turn": 1}),
            json!({"type": "text.delta", "delta": "OK."}),
        ] {
            all.extend(chunks.on_event(&event));
        }
        assert_eq!(types(&all), ["tool-output-denied", "start-step", "text-start", "text-delta"]);
    }
}
