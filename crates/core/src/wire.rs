//! The JSON form of run events (DESIGN.md §5), version 1: what `keel run --json` prints and the
//! HTTP API streams.
//!
//! One JSON object per event, `type` first, camelCase fields:
//!
//! ```json
//! {"type":"run.start","runId":"run_...","sessionId":"s1"}
//! {"type":"turn.start","turn":0}
//! {"type":"tool.start","callId":"call_0_0","name":"add","input":{"a":2,"b":3}}
//! {"type":"tool.done","callId":"call_0_0","output":5}
//! {"type":"tool.error","callId":"call_0_1","code":"KEEL_TOOL_FAILED","error":"..."}
//! {"type":"approval.requested","approvalId":"ap_...","callId":"call_0_2","tool":"shell","input":{}}
//! {"type":"question.asked","questionId":"qu_...","question":"Which city?"}
//! {"type":"output.repair","attempt":1,"problem":"..."}
//! {"type":"context.compacted","summarized":30,"kept":10}
//! {"type":"state.updated","state":{"cart":["tea"]}}
//! {"type":"usage","inputTokens":12,"outputTokens":3}
//! {"type":"text.delta","delta":"5"}
//! {"type":"run.done","text":"5","stopped":"final","usage":{"inputTokens":30,"outputTokens":6}}
//! {"type":"run.error","code":"KEEL_PROVIDER_ERROR","message":"..."}
//! ```
//!
//! `run.done` has `output` only when the agent has an output schema. These types borrow from
//! [`Event`] and are serialize-only: the wire format is pinned by tests, not by the domain enum.

use serde::Serialize;
use serde_json::{Value, json};

use crate::event::{Event, Usage};
use crate::human::{PendingInput, PendingKind};
use crate::message::{Message, Part, Role};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct UsageJson {
    input_tokens: u64,
    output_tokens: u64,
}

impl From<Usage> for UsageJson {
    fn from(usage: Usage) -> UsageJson {
        UsageJson { input_tokens: usage.input_tokens, output_tokens: usage.output_tokens }
    }
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum EventJson<'a> {
    #[serde(rename = "run.start", rename_all = "camelCase")]
    RunStart { run_id: &'a str, session_id: &'a str },
    #[serde(rename = "turn.start")]
    TurnStart { turn: u32 },
    #[serde(rename = "text.delta")]
    TextDelta { delta: &'a str },
    #[serde(rename = "reasoning.delta")]
    ReasoningDelta { delta: &'a str },
    #[serde(rename = "turn.retry", rename_all = "camelCase")]
    TurnRetry { turn: u32, attempt: u32, code: &'static str, message: &'a str, wait_ms: u64 },
    #[serde(rename = "tool.start", rename_all = "camelCase")]
    ToolStart { call_id: &'a str, name: &'a str, input: &'a Value },
    #[serde(rename = "tool.done", rename_all = "camelCase")]
    ToolDone {
        call_id: &'a str,
        output: &'a Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
    },
    #[serde(rename = "tool.error", rename_all = "camelCase")]
    ToolError {
        call_id: &'a str,
        code: &'static str,
        error: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
    },
    #[serde(rename = "approval.requested", rename_all = "camelCase")]
    ApprovalRequested { approval_id: &'a str, call_id: &'a str, tool: &'a str, input: &'a Value },
    #[serde(rename = "question.asked", rename_all = "camelCase")]
    QuestionAsked { question_id: &'a str, question: &'a str },
    #[serde(rename = "output.repair")]
    OutputRepair { attempt: u32, problem: &'a str },
    #[serde(rename = "context.compacted")]
    ContextCompacted { summarized: u64, kept: u64 },
    #[serde(rename = "state.updated")]
    StateUpdated { state: &'a Value },
    #[serde(rename = "usage")]
    Usage(UsageJson),
    #[serde(rename = "run.done")]
    RunDone {
        text: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        output: Option<&'a Value>,
        stopped: &'static str,
        usage: UsageJson,
    },
    #[serde(rename = "run.paused")]
    RunPaused { pending: Vec<Value>, usage: UsageJson },
    #[serde(rename = "run.error")]
    RunError { code: &'static str, message: &'a str },
}

/// The event's wire name (`run.start`, `text.delta`, ...).
pub fn event_type(event: &Event) -> &'static str {
    match event {
        Event::RunStart { .. } => "run.start",
        Event::TurnStart { .. } => "turn.start",
        Event::TextDelta { .. } => "text.delta",
        Event::ReasoningDelta { .. } => "reasoning.delta",
        Event::TurnRetry { .. } => "turn.retry",
        Event::ToolStart { .. } => "tool.start",
        Event::ToolDone { .. } => "tool.done",
        Event::ToolError { .. } => "tool.error",
        Event::ApprovalRequested { .. } => "approval.requested",
        Event::QuestionAsked { .. } => "question.asked",
        Event::OutputRepair { .. } => "output.repair",
        Event::ContextCompacted { .. } => "context.compacted",
        Event::StateUpdated { .. } => "state.updated",
        Event::Usage(_) => "usage",
        Event::RunDone { .. } => "run.done",
        Event::RunPaused { .. } => "run.paused",
        Event::RunError { .. } => "run.error",
    }
}

/// The event as a JSON object.
pub fn event_to_json(event: &Event) -> String {
    let json = match event {
        Event::RunStart { run_id, session_id } => {
            // A client knows its session by its own id, without an owner's scope.
            EventJson::RunStart { run_id: run_id.as_str(), session_id: session_id.external() }
        }
        Event::TurnStart { turn } => EventJson::TurnStart { turn: *turn },
        Event::TextDelta { delta } => EventJson::TextDelta { delta },
        Event::ReasoningDelta { delta } => EventJson::ReasoningDelta { delta },
        Event::TurnRetry { turn, attempt, code, message, wait } => EventJson::TurnRetry {
            turn: *turn,
            attempt: *attempt,
            code: code.as_str(),
            message,
            wait_ms: millis(*wait),
        },
        Event::ToolStart { call_id, name, input } => EventJson::ToolStart { call_id, name, input },
        Event::ToolDone { call_id, output, duration } => {
            EventJson::ToolDone { call_id, output, duration_ms: duration.map(millis) }
        }
        Event::ToolError { call_id, code, error, duration } => {
            EventJson::ToolError { call_id, code: code.as_str(), error, duration_ms: duration.map(millis) }
        }
        Event::ApprovalRequested { approval_id, call_id, tool, input } => {
            EventJson::ApprovalRequested { approval_id, call_id, tool, input }
        }
        Event::QuestionAsked { question_id, question } => EventJson::QuestionAsked { question_id, question },
        Event::OutputRepair { attempt, problem } => EventJson::OutputRepair { attempt: *attempt, problem },
        Event::ContextCompacted { summarized, kept } => {
            EventJson::ContextCompacted { summarized: *summarized, kept: *kept }
        }
        Event::StateUpdated { state } => EventJson::StateUpdated { state },
        Event::Usage(usage) => EventJson::Usage((*usage).into()),
        Event::RunDone { text, output, stopped, usage } => EventJson::RunDone {
            text,
            output: output.as_ref(),
            stopped: stopped.as_str(),
            usage: (*usage).into(),
        },
        Event::RunPaused { pending, usage } => EventJson::RunPaused {
            pending: pending.iter().map(pending_to_json).collect(),
            usage: (*usage).into(),
        },
        Event::RunError { code, message } => EventJson::RunError { code: code.as_str(), message },
    };
    serde_json::to_string(&json).expect("event JSON always serializes")
}

/// A message as the HTTP API shows it: `{ "role", "content": [parts] }`, parts camelCase:
/// `{type:"text",text}`, `{type:"reasoning",text}`, `{type:"image",mediaType,data}` and `{type:"file",mediaType,name?,data}`
/// (data in base64), `{type:"toolCall",callId,name,input}`,
/// `{type:"toolResult",callId,name,output,isError}`, `{type:"summary",text,firstKept}` (a
/// compaction brief: the model saw it instead of the messages before position `firstKept`).
pub fn message_to_json(message: &Message) -> Value {
    use base64::Engine as _;
    let base64 = &base64::engine::general_purpose::STANDARD;
    let role = match message.role {
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let content: Vec<Value> = message
        .parts
        .iter()
        .map(|part| match part {
            Part::Text(text) => json!({ "type": "text", "text": text }),
            Part::Image { media_type, data } => {
                json!({ "type": "image", "mediaType": media_type, "data": base64.encode(data) })
            }
            Part::File { media_type, name, data } => {
                let mut file =
                    json!({ "type": "file", "mediaType": media_type, "data": base64.encode(data) });
                if let Some(name) = name {
                    file["name"] = Value::String(name.clone());
                }
                file
            }
            Part::Reasoning(reasoning) => {
                // The signature and redacted payload are the provider's business, not the
                // client's: only the readable text is shown.
                json!({ "type": "reasoning", "text": reasoning.text })
            }
            Part::ToolCall(call) => {
                json!({ "type": "toolCall", "callId": call.call_id, "name": call.name, "input": call.input })
            }
            Part::ToolResult(result) => json!({
                "type": "toolResult",
                "callId": result.call_id,
                "name": result.name,
                "output": result.output,
                "isError": result.is_error,
            }),
            Part::Summary { text, first_kept } => {
                json!({ "type": "summary", "text": text, "firstKept": first_kept })
            }
        })
        .collect();
    json!({ "role": role, "content": content })
}

/// A pending approval or question as the HTTP API and `keel approvals list --json` show it:
/// `{ id, kind: "approval"|"question", sessionId, runId, callId, tool?, input?, question?,
/// createdAtMs, expiresAtMs }`.
pub fn pending_to_json(pending: &PendingInput) -> Value {
    let mut json = json!({
        "id": pending.id,
        "kind": pending.kind.as_str(),
        "sessionId": pending.session_id.external(),
        "runId": pending.run_id.as_str(),
        "callId": pending.call_id,
        "createdAtMs": pending.created_at_ms,
        "expiresAtMs": pending.expires_at_ms,
    });
    match &pending.kind {
        PendingKind::Approval { tool, input } => {
            json["tool"] = Value::String(tool.clone());
            json["input"] = input.clone();
        }
        PendingKind::Question { question } => json["question"] = Value::String(question.clone()),
    }
    json
}

/// A session's transcript as `GET /chat/:sessionId` and `keel sessions show --json` show it:
/// `{ sessionId, usage: {inputTokens, outputTokens}, messages: [...], pending: [...] }`.
pub fn transcript_to_json<'a>(
    session: &str,
    usage: Usage,
    messages: impl IntoIterator<Item = &'a Message>,
    pending: &[PendingInput],
) -> Value {
    json!({
        "sessionId": session,
        "usage": { "inputTokens": usage.input_tokens, "outputTokens": usage.output_tokens },
        "messages": messages.into_iter().map(message_to_json).collect::<Vec<_>>(),
        "pending": pending.iter().map(pending_to_json).collect::<Vec<_>>(),
    })
}

/// A session as `keel sessions list --json` shows it: `{ sessionId, messages, runs, usage,
/// updatedAtMs }`.
pub fn session_summary_to_json(summary: &crate::store::SessionSummary) -> Value {
    json!({
        "sessionId": summary.id.external(),
        "messages": summary.messages,
        "runs": summary.runs,
        "usage": { "inputTokens": summary.usage.input_tokens, "outputTokens": summary.usage.output_tokens },
        "updatedAtMs": summary.updated_at_ms,
    })
}

/// A duration in whole milliseconds, as the wire shows durations.
fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::event::StopReason;
    use crate::ids::{RunId, SessionId};
    use serde_json::json;

    #[test]
    fn events_have_the_documented_shape() {
        let events = [
            Event::RunStart { run_id: RunId::from_suffix("1"), session_id: SessionId::new("s").unwrap() },
            Event::TurnStart { turn: 0 },
            Event::TextDelta { delta: "It".into() },
            Event::ReasoningDelta { delta: "Hmm".into() },
            Event::TurnRetry {
                turn: 1,
                attempt: 2,
                code: ErrorCode::ProviderOverloaded,
                message: "anthropic answered HTTP 529".into(),
                wait: std::time::Duration::from_millis(1500),
            },
            Event::ToolStart { call_id: "c".into(), name: "add".into(), input: json!({"a": 2}) },
            Event::ToolDone { call_id: "c".into(), output: json!(5), duration: None },
            Event::ToolError {
                call_id: "c".into(),
                code: crate::error::ErrorCode::ToolFailed,
                error: "boom".into(),
                duration: None,
            },
            Event::ToolDone {
                call_id: "c".into(),
                output: json!(5),
                duration: Some(std::time::Duration::from_micros(12_700)),
            },
            Event::ApprovalRequested {
                approval_id: "ap_1".into(),
                call_id: "c".into(),
                tool: "shell".into(),
                input: json!({"command": "ls"}),
            },
            Event::QuestionAsked { question_id: "qu_1".into(), question: "Which city?".into() },
            Event::OutputRepair { attempt: 1, problem: "missing `answer`".into() },
            Event::ContextCompacted { summarized: 30, kept: 10 },
            Event::StateUpdated { state: json!({"cart": ["tea"]}) },
            Event::Usage(Usage { input_tokens: 1, output_tokens: 2 }),
            Event::RunDone {
                text: "5".into(),
                output: None,
                stopped: StopReason::Final,
                usage: Usage::default(),
            },
            Event::RunDone {
                text: "{}".into(),
                output: Some(json!({})),
                stopped: StopReason::Budget,
                usage: Usage::default(),
            },
            Event::RunPaused {
                pending: vec![PendingInput {
                    id: "ap_1".into(),
                    run_id: RunId::from_suffix("1"),
                    session_id: SessionId::new("s").unwrap(),
                    call_id: "c".into(),
                    kind: PendingKind::Approval { tool: "shell".into(), input: json!({"command": "ls"}) },
                    created_at_ms: 1,
                    expires_at_ms: 2,
                }],
                usage: Usage { input_tokens: 3, output_tokens: 4 },
            },
            Event::RunError { code: ErrorCode::ProviderError, message: "down".into() },
        ];
        let lines: Vec<String> = events.iter().map(event_to_json).collect();
        for (event, line) in events.iter().zip(&lines) {
            assert!(line.starts_with(&format!("{{\"type\":\"{}\"", event_type(event))), "{line}");
        }
        expect_test::expect![[r#"
            {"type":"run.start","runId":"run_1","sessionId":"s"}
            {"type":"turn.start","turn":0}
            {"type":"text.delta","delta":"It"}
            {"type":"reasoning.delta","delta":"Hmm"}
            {"type":"turn.retry","turn":1,"attempt":2,"code":"KEEL_PROVIDER_OVERLOADED","message":"anthropic answered HTTP 529","waitMs":1500}
            {"type":"tool.start","callId":"c","name":"add","input":{"a":2}}
            {"type":"tool.done","callId":"c","output":5}
            {"type":"tool.error","callId":"c","code":"KEEL_TOOL_FAILED","error":"boom"}
            {"type":"tool.done","callId":"c","output":5,"durationMs":12}
            {"type":"approval.requested","approvalId":"ap_1","callId":"c","tool":"shell","input":{"command":"ls"}}
            {"type":"question.asked","questionId":"qu_1","question":"Which city?"}
            {"type":"output.repair","attempt":1,"problem":"missing `answer`"}
            {"type":"context.compacted","summarized":30,"kept":10}
            {"type":"state.updated","state":{"cart":["tea"]}}
            {"type":"usage","inputTokens":1,"outputTokens":2}
            {"type":"run.done","text":"5","stopped":"final","usage":{"inputTokens":0,"outputTokens":0}}
            {"type":"run.done","text":"{}","output":{},"stopped":"budget","usage":{"inputTokens":0,"outputTokens":0}}
            {"type":"run.paused","pending":[{"callId":"c","createdAtMs":1,"expiresAtMs":2,"id":"ap_1","input":{"command":"ls"},"kind":"approval","runId":"run_1","sessionId":"s","tool":"shell"}],"usage":{"inputTokens":3,"outputTokens":4}}
            {"type":"run.error","code":"KEEL_PROVIDER_ERROR","message":"down"}
        "#]]
        .assert_eq(&(lines.join("\n") + "\n"));
    }
}
