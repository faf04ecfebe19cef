//! The persisted formats of messages and journal records, version 1.
//!
//! These serde types are separate from the domain types on purpose: the domain may change, the
//! bytes in a user's database may not. Every record carries `"v": 1`; a reader refuses a record
//! from a newer version instead of misreading it. Bytes (images, files) are base64.
//!
//! A message:
//! ```json
//! {"v":1,"role":"assistant","parts":[{"type":"text","text":"Hi"},
//!   {"type":"tool_call","call_id":"c1","name":"add","input":{"a":2}}]}
//! ```
//! A journal record:
//! ```json
//! {"v":1,"kind":"model_reply","parts":[{"type":"text","text":"5"}],"usage":{"input_tokens":3,"output_tokens":1}}
//! {"v":1,"kind":"tool_result","ok":true,"output":5}
//! {"v":1,"kind":"tool_result","ok":false,"error":{"code":"KEEL_TOOL_TIMEOUT","message":"...","transient":true}}
//! {"v":1,"kind":"model_failed","code":"KEEL_PROVIDER_CONTEXT_TOO_LONG","message":"...","status":400}
//! {"v":1,"kind":"memory","ok":true,"value":{"context":"..."}}
//! ```
//! Run overrides of limits: `{"v":1,"max_turns":3,"tool_timeout_ms":5000}`.

use std::borrow::Cow;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::LimitOverrides;
use crate::error::ErrorCode;
use crate::event::Usage;
use crate::human::{Decision, PendingKind};
use crate::journal::JournalRecord;
use crate::message::{Message, Part, Reasoning, Role, ToolCall, ToolResult};
use crate::provider::{ModelReply, ProviderError, ProviderErrorKind};
use crate::tool::ToolError;

/// The version this build writes (and the newest it reads).
pub const FORMAT_VERSION: u32 = 1;

/// A record that could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("cannot decode stored {what}: {reason}")]
pub struct DecodeError {
    what: &'static str,
    reason: String,
}

/// A part as stored. Encoding borrows from the message (`Cow::Borrowed`: no copy of a text or a
/// tool's input before it is written out); decoding owns what it reads.
#[derive(Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum PartV1<'a> {
    Text {
        text: Cow<'a, str>,
    },
    Image {
        media_type: Cow<'a, str>,
        data: String,
    },
    File {
        media_type: Cow<'a, str>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<Cow<'a, str>>,
        data: String,
    },
    Reasoning {
        #[serde(default, skip_serializing_if = "str::is_empty")]
        text: Cow<'a, str>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<Cow<'a, str>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        redacted: Option<Cow<'a, str>>,
    },
    ToolCall {
        call_id: Cow<'a, str>,
        name: Cow<'a, str>,
        input: Cow<'a, Value>,
    },
    ToolResult {
        call_id: Cow<'a, str>,
        name: Cow<'a, str>,
        output: Cow<'a, Value>,
        #[serde(default)]
        is_error: bool,
    },
    Summary {
        text: Cow<'a, str>,
        first_kept: u64,
    },
}

#[derive(Serialize, Deserialize)]
struct MessageV1<'a> {
    v: u32,
    role: Cow<'a, str>,
    parts: Vec<PartV1<'a>>,
}

#[derive(Serialize, Deserialize)]
struct UsageV1 {
    input_tokens: u64,
    output_tokens: u64,
}

#[derive(Serialize, Deserialize)]
struct ToolErrorV1 {
    code: String,
    message: String,
    #[serde(default)]
    transient: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum RecordBodyV1<'a> {
    ModelReply {
        parts: Vec<PartV1<'a>>,
        usage: UsageV1,
    },
    ToolResult {
        ok: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output: Option<Cow<'a, Value>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ToolErrorV1>,
    },
    Decision {
        decision: DecisionV1,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer: Option<String>,
    },
    ModelFailed {
        code: String,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
    },
    Memory {
        ok: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<Cow<'a, Value>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

#[derive(Serialize, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum DecisionV1 {
    Approve,
    Reject,
    Answer,
    TimedOut,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum PendingKindV1 {
    Approval { tool: String, input: Value },
    Question { question: String },
}

#[derive(Serialize, Deserialize)]
struct PendingV1 {
    v: u32,
    #[serde(flatten)]
    kind: PendingKindV1,
}

#[derive(Serialize, Deserialize)]
struct RecordV1<'a> {
    v: u32,
    #[serde(flatten)]
    body: RecordBodyV1<'a>,
}

fn part_to_v1(part: &Part) -> PartV1<'_> {
    fn text(text: &str) -> Cow<'_, str> {
        Cow::Borrowed(text)
    }
    match part {
        Part::Text(t) => PartV1::Text { text: text(t) },
        Part::Image { media_type, data } => {
            PartV1::Image { media_type: text(media_type), data: BASE64.encode(data) }
        }
        Part::File { media_type, name, data } => PartV1::File {
            media_type: text(media_type),
            name: name.as_deref().map(text),
            data: BASE64.encode(data),
        },
        Part::Reasoning(reasoning) => PartV1::Reasoning {
            text: text(&reasoning.text),
            signature: reasoning.signature.as_deref().map(text),
            redacted: reasoning.redacted.as_deref().map(text),
        },
        Part::ToolCall(call) => PartV1::ToolCall {
            call_id: text(&call.call_id),
            name: text(&call.name),
            input: Cow::Borrowed(&call.input),
        },
        Part::ToolResult(result) => PartV1::ToolResult {
            call_id: text(&result.call_id),
            name: text(&result.name),
            output: Cow::Borrowed(&result.output),
            is_error: result.is_error,
        },
        Part::Summary { text: t, first_kept } => PartV1::Summary { text: text(t), first_kept: *first_kept },
    }
}

fn part_from_v1(part: PartV1<'_>, what: &'static str) -> Result<Part, DecodeError> {
    let bytes = |data: &str| {
        BASE64
            .decode(data)
            .map(Into::into)
            .map_err(|e| DecodeError { what, reason: format!("bad base64: {e}") })
    };
    // Decoded values are owned already: `into_owned` moves them.
    Ok(match part {
        PartV1::Text { text } => Part::Text(text.into_owned()),
        PartV1::Image { media_type, data } => {
            Part::Image { data: bytes(&data)?, media_type: media_type.into_owned() }
        }
        PartV1::File { media_type, name, data } => Part::File {
            data: bytes(&data)?,
            media_type: media_type.into_owned(),
            name: name.map(Cow::into_owned),
        },
        PartV1::Reasoning { text, signature, redacted } => Part::Reasoning(Reasoning {
            text: text.into_owned(),
            signature: signature.map(Cow::into_owned),
            redacted: redacted.map(Cow::into_owned),
        }),
        PartV1::ToolCall { call_id, name, input } => Part::ToolCall(ToolCall {
            call_id: call_id.into_owned(),
            name: name.into_owned(),
            input: input.into_owned(),
        }),
        PartV1::ToolResult { call_id, name, output, is_error } => Part::ToolResult(ToolResult {
            call_id: call_id.into_owned(),
            name: name.into_owned(),
            output: output.into_owned(),
            is_error,
        }),
        PartV1::Summary { text, first_kept } => Part::Summary { text: text.into_owned(), first_kept },
    })
}

fn check_version(v: u32, what: &'static str) -> Result<(), DecodeError> {
    if v == 0 || v > FORMAT_VERSION {
        return Err(DecodeError {
            what,
            reason: format!(
                "format version {v} is not supported (this keel reads up to {FORMAT_VERSION}); upgrade keel"
            ),
        });
    }
    Ok(())
}

/// Encodes a message as JSON.
pub fn encode_message(message: &Message) -> String {
    let v1 = MessageV1 {
        v: FORMAT_VERSION,
        role: Cow::Borrowed(message.role.as_str()),
        parts: message.parts.iter().map(part_to_v1).collect(),
    };
    serde_json::to_string(&v1).expect("message JSON always serializes")
}

/// Decodes a message written by [`encode_message`] (of this or an older version).
pub fn decode_message(json: &str) -> Result<Message, DecodeError> {
    let what = "message";
    let v1: MessageV1 =
        serde_json::from_str(json).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    check_version(v1.v, what)?;
    let role = match &*v1.role {
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        other => return Err(DecodeError { what, reason: format!("unknown role {other:?}") }),
    };
    let parts = v1.parts.into_iter().map(|p| part_from_v1(p, what)).collect::<Result<_, _>>()?;
    Ok(Message { role, parts })
}

/// Encodes a journal record as JSON.
pub fn encode_record(record: &JournalRecord) -> String {
    let body = match record {
        JournalRecord::ModelReply(reply) => RecordBodyV1::ModelReply {
            parts: reply.message.parts.iter().map(part_to_v1).collect(),
            usage: UsageV1 {
                input_tokens: reply.usage.input_tokens,
                output_tokens: reply.usage.output_tokens,
            },
        },
        JournalRecord::ToolResult(Ok(output)) => {
            RecordBodyV1::ToolResult { ok: true, output: Some(Cow::Borrowed(output)), error: None }
        }
        JournalRecord::ToolResult(Err(error)) => RecordBodyV1::ToolResult {
            ok: false,
            output: None,
            error: Some(ToolErrorV1 {
                code: error.code.as_str().to_owned(),
                message: error.message.clone(),
                transient: error.transient,
            }),
        },
        JournalRecord::Decision(decision) => {
            let (decision, note, answer) = match decision {
                Decision::Approve { note } => (DecisionV1::Approve, note.clone(), None),
                Decision::Reject { note } => (DecisionV1::Reject, note.clone(), None),
                Decision::Answer(answer) => (DecisionV1::Answer, None, Some(answer.clone())),
                Decision::TimedOut => (DecisionV1::TimedOut, None, None),
            };
            RecordBodyV1::Decision { decision, note, answer }
        }
        JournalRecord::Memory(outcome) => match outcome {
            Ok(value) => RecordBodyV1::Memory { ok: true, value: Some(Cow::Borrowed(value)), error: None },
            Err(error) => RecordBodyV1::Memory { ok: false, value: None, error: Some(error.clone()) },
        },
        JournalRecord::ModelFailed(error) => RecordBodyV1::ModelFailed {
            code: error.code().as_str().to_owned(),
            message: error.message.clone(),
            status: error.status,
        },
    };
    serde_json::to_string(&RecordV1 { v: FORMAT_VERSION, body }).expect("record JSON always serializes")
}

/// Decodes a journal record written by [`encode_record`] (of this or an older version).
pub fn decode_record(json: &str) -> Result<JournalRecord, DecodeError> {
    let what = "journal record";
    let raw: Value = serde_json::from_str(json).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    let version = raw.get("v").and_then(Value::as_u64).unwrap_or(0);
    check_version(u32::try_from(version).unwrap_or(u32::MAX), what)?;
    let v1: RecordV1 =
        serde_json::from_value(raw).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    Ok(match v1.body {
        RecordBodyV1::ModelReply { parts, usage } => JournalRecord::ModelReply(
            ModelReply {
                parts: parts.into_iter().map(|p| part_from_v1(p, what)).collect::<Result<_, _>>()?,
                usage: Usage { input_tokens: usage.input_tokens, output_tokens: usage.output_tokens },
            }
            .into(),
        ),
        RecordBodyV1::ToolResult { ok: true, output, .. } => {
            JournalRecord::ToolResult(Ok(output.map_or(Value::Null, Cow::into_owned)))
        }
        RecordBodyV1::ToolResult { ok: false, error, .. } => {
            let error = error
                .ok_or_else(|| DecodeError { what, reason: "failed tool result without `error`".into() })?;
            JournalRecord::ToolResult(Err(ToolError {
                code: ErrorCode::parse(&error.code).unwrap_or(ErrorCode::ToolFailed),
                message: error.message,
                transient: error.transient,
            }))
        }
        RecordBodyV1::Decision { decision, note, answer } => JournalRecord::Decision(match decision {
            DecisionV1::Approve => Decision::Approve { note },
            DecisionV1::Reject => Decision::Reject { note },
            DecisionV1::Answer => Decision::Answer(answer.unwrap_or_default()),
            DecisionV1::TimedOut => Decision::TimedOut,
        }),
        RecordBodyV1::Memory { ok: true, value, .. } => {
            JournalRecord::Memory(Ok(value.map_or(Value::Null, Cow::into_owned)))
        }
        RecordBodyV1::Memory { ok: false, error, .. } => {
            JournalRecord::Memory(Err(error.unwrap_or_default()))
        }
        RecordBodyV1::ModelFailed { code, message, status } => {
            let kind = ErrorCode::parse(&code)
                .and_then(ProviderErrorKind::from_code)
                .unwrap_or(ProviderErrorKind::BadRequest);
            JournalRecord::ModelFailed(ProviderError { kind, status, message, retry_after: None })
        }
    })
}

/// Encodes what a pending input asks (the tool and input of an approval, or a question).
pub fn encode_pending_kind(kind: &PendingKind) -> String {
    let kind = match kind {
        PendingKind::Approval { tool, input } => {
            PendingKindV1::Approval { tool: tool.clone(), input: input.clone() }
        }
        PendingKind::Question { question } => PendingKindV1::Question { question: question.clone() },
    };
    serde_json::to_string(&PendingV1 { v: FORMAT_VERSION, kind }).expect("pending JSON always serializes")
}

/// Decodes what [`encode_pending_kind`] wrote.
pub fn decode_pending_kind(json: &str) -> Result<PendingKind, DecodeError> {
    let what = "pending input";
    let raw: Value = serde_json::from_str(json).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    let version = raw.get("v").and_then(Value::as_u64).unwrap_or(0);
    check_version(u32::try_from(version).unwrap_or(u32::MAX), what)?;
    let v1: PendingV1 =
        serde_json::from_value(raw).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    Ok(match v1.kind {
        PendingKindV1::Approval { tool, input } => PendingKind::Approval { tool, input },
        PendingKindV1::Question { question } => PendingKind::Question { question },
    })
}

#[derive(Serialize, Deserialize, Default)]
struct OverridesV1 {
    v: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_turns: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_tool_calls: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tool_timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_tool_output_chars: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    provider_timeout_ms: Option<u64>,
}

/// Encodes a run's overrides of the agent's limits.
pub fn encode_overrides(overrides: &LimitOverrides) -> String {
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let v1 = OverridesV1 {
        v: FORMAT_VERSION,
        max_turns: overrides.max_turns,
        max_total_tokens: overrides.max_total_tokens,
        max_tool_calls: overrides.max_tool_calls,
        tool_timeout_ms: overrides.tool_timeout.map(millis),
        max_tool_output_chars: overrides.max_tool_output_chars.map(|n| n as u64),
        provider_timeout_ms: overrides.provider_timeout.map(millis),
    };
    serde_json::to_string(&v1).expect("overrides JSON always serializes")
}

/// Decodes what [`encode_overrides`] wrote.
pub fn decode_overrides(json: &str) -> Result<LimitOverrides, DecodeError> {
    let what = "run limits";
    let v1: OverridesV1 =
        serde_json::from_str(json).map_err(|e| DecodeError { what, reason: e.to_string() })?;
    check_version(v1.v, what)?;
    Ok(LimitOverrides {
        max_turns: v1.max_turns,
        max_total_tokens: v1.max_total_tokens,
        max_tool_calls: v1.max_tool_calls,
        tool_timeout: v1.tool_timeout_ms.map(std::time::Duration::from_millis),
        max_tool_output_chars: v1.max_tool_output_chars.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        provider_timeout: v1.provider_timeout_ms.map(std::time::Duration::from_millis),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn overrides_round_trip() {
        let overrides = LimitOverrides {
            max_turns: Some(3),
            tool_timeout: Some(std::time::Duration::from_millis(1500)),
            ..LimitOverrides::default()
        };
        let json = encode_overrides(&overrides);
        expect_test::expect![[r#"{"v":1,"max_turns":3,"tool_timeout_ms":1500}"#]].assert_eq(&json);
        assert_eq!(decode_overrides(&json).unwrap(), overrides);
    }

    fn sample_message() -> Message {
        Message {
            role: Role::Assistant,
            parts: vec![
                Part::Text("Hi".into()),
                Part::Image { media_type: "image/png".into(), data: vec![0u8, 159, 255].into() },
                Part::File {
                    media_type: "text/csv".into(),
                    name: Some("a.csv".into()),
                    data: b"a,b".to_vec().into(),
                },
                Part::Reasoning(Reasoning {
                    text: "Adding.".into(),
                    signature: Some("sig".into()),
                    redacted: None,
                }),
                Part::Reasoning(Reasoning {
                    text: String::new(),
                    signature: None,
                    redacted: Some("ENC".into()),
                }),
                Part::ToolCall(ToolCall { call_id: "c1".into(), name: "add".into(), input: json!({"a": 2}) }),
                Part::ToolResult(ToolResult {
                    call_id: "c1".into(),
                    name: "add".into(),
                    output: json!(5),
                    is_error: false,
                }),
            ],
        }
    }

    #[test]
    fn messages_round_trip_with_bytes() {
        let message = sample_message();
        assert_eq!(decode_message(&encode_message(&message)).unwrap(), message);
    }

    #[test]
    fn the_v1_format_is_stable() {
        // A golden record: if this changes, stored data written by earlier builds breaks.
        expect_test::expect![[r#"{"v":1,"role":"assistant","parts":[{"type":"text","text":"Hi"},{"type":"image","media_type":"image/png","data":"AJ//"},{"type":"file","media_type":"text/csv","name":"a.csv","data":"YSxi"},{"type":"reasoning","text":"Adding.","signature":"sig"},{"type":"reasoning","redacted":"ENC"},{"type":"tool_call","call_id":"c1","name":"add","input":{"a":2}},{"type":"tool_result","call_id":"c1","name":"add","output":5,"is_error":false}]}"#]]
            .assert_eq(&encode_message(&sample_message()));
        let failed =
            JournalRecord::ToolResult(Err(ToolError::with_code(ErrorCode::ToolTimeout, "timed out", true)));
        expect_test::expect![[r#"{"v":1,"kind":"tool_result","ok":false,"error":{"code":"KEEL_TOOL_TIMEOUT","message":"timed out","transient":true}}"#]]
            .assert_eq(&encode_record(&failed));
        let reply = JournalRecord::ModelReply(
            ModelReply {
                parts: vec![Part::Text("5".into())],
                usage: Usage { input_tokens: 3, output_tokens: 1 },
            }
            .into(),
        );
        expect_test::expect![[r#"{"v":1,"kind":"model_reply","parts":[{"type":"text","text":"5"}],"usage":{"input_tokens":3,"output_tokens":1}}"#]]
            .assert_eq(&encode_record(&reply));
        expect_test::expect![[r#"{"v":1,"kind":"tool_result","ok":true,"output":{"sum":5}}"#]]
            .assert_eq(&encode_record(&JournalRecord::ToolResult(Ok(json!({"sum": 5})))));
        expect_test::expect![[r#"{"v":1,"kind":"memory","ok":true,"value":{"context":"- tea"}}"#]]
            .assert_eq(&encode_record(&JournalRecord::Memory(Ok(json!({"context": "- tea"})))));
        let decision = JournalRecord::Decision(Decision::Reject { note: Some("too risky".into()) });
        expect_test::expect![[r#"{"v":1,"kind":"decision","decision":"reject","note":"too risky"}"#]]
            .assert_eq(&encode_record(&decision));
        let kind = PendingKind::Approval { tool: "shell".into(), input: json!({"command": "ls"}) };
        expect_test::expect![[r#"{"v":1,"kind":"approval","tool":"shell","input":{"command":"ls"}}"#]]
            .assert_eq(&encode_pending_kind(&kind));
        assert_eq!(decode_pending_kind(&encode_pending_kind(&kind)).unwrap(), kind);
        let question = PendingKind::Question { question: "Which city?".into() };
        assert_eq!(decode_pending_kind(&encode_pending_kind(&question)).unwrap(), question);
    }

    #[test]
    fn records_round_trip() {
        let records = [
            JournalRecord::ModelReply(
                ModelReply {
                    parts: sample_message().parts,
                    usage: Usage { input_tokens: 3, output_tokens: 1 },
                }
                .into(),
            ),
            JournalRecord::ToolResult(Ok(json!({"x": [1, 2]}))),
            JournalRecord::ToolResult(Err(ToolError::failed("boom"))),
            JournalRecord::Decision(Decision::Approve { note: Some("ok".into()) }),
            JournalRecord::Decision(Decision::Reject { note: None }),
            JournalRecord::Decision(Decision::Answer("Paris".into())),
            JournalRecord::Decision(Decision::TimedOut),
            JournalRecord::ModelFailed(ProviderError::from_status(413, "prompt is too long")),
            JournalRecord::Memory(Ok(serde_json::json!({"context": "- alice —[works_at]→ acme"}))),
            JournalRecord::Memory(Err("the extraction was not JSON".into())),
            JournalRecord::ModelReply(
                ModelReply {
                    parts: vec![Part::Summary { text: "Alice asked about tea.".into(), first_kept: 12 }],
                    usage: Usage::default(),
                }
                .into(),
            ),
        ];
        for record in records {
            assert_eq!(decode_record(&encode_record(&record)).unwrap(), record);
        }
    }

    #[test]
    fn newer_versions_are_refused() {
        let err = decode_record(r#"{"v":2,"kind":"tool_result","ok":true,"output":1}"#).unwrap_err();
        assert!(err.to_string().contains("upgrade keel"), "{err}");
        let err = decode_message(r#"{"v":9,"role":"user","parts":[]}"#).unwrap_err();
        assert!(err.to_string().contains("version 9"), "{err}");
        assert!(decode_record("not json").is_err());
    }
}
