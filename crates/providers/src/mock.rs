//! The `mock` provider: replies from a script, one entry per model call of the session.
//!
//! The entry is chosen by [`ModelRequest::call_index`] (the session's model-call count), which
//! the runtime derives from stored state, so a replay or a restarted process picks the same
//! entry. When the script is exhausted the mock echoes the user's last input. Token usage is
//! estimated deterministically (about four characters a token).

use keel_core::message::{ToolCall, output_to_text};
use keel_core::{
    BoxFuture, CallPurpose, DeltaSink, MockEntry, MockScript, ModelReply, ModelRequest, Part, Provider,
    ProviderError, Role, Usage,
};

/// Plays a [`MockScript`].
#[derive(Clone, Debug, Default)]
pub struct MockProvider {
    script: MockScript,
}

impl MockProvider {
    /// A mock playing `script`.
    pub fn new(script: MockScript) -> MockProvider {
        MockProvider { script }
    }
}

impl Provider for MockProvider {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        let entries = match request.purpose {
            CallPurpose::Turn => &self.script.entries,
            CallPurpose::Compact => &self.script.compact,
            CallPurpose::Episode | CallPurpose::Extract => {
                let entry = usize::try_from(request.call_index).ok().and_then(|i| self.script.entries.get(i));
                let text = memory_reply(&request, entry);
                return Box::pin(std::future::ready(Ok(reply_with_text(&request, &text, Vec::new(), sink))));
            }
        };
        let entry = usize::try_from(request.call_index).ok().and_then(|i| entries.get(i));
        let Some(entry) = entry else {
            if request.purpose == CallPurpose::Compact {
                let brief = brief_of_user_lines(&request);
                return Box::pin(std::future::ready(Ok(reply_with_text(&request, &brief, Vec::new(), sink))));
            }
            let echo = last_user_text(&request);
            return Box::pin(std::future::ready(Ok(reply_with_text(&request, &echo, Vec::new(), sink))));
        };
        if entry.delay_ms == 0 {
            return Box::pin(std::future::ready(play(entry, &request, sink)));
        }
        Box::pin(async move {
            tokio::time::sleep(std::time::Duration::from_millis(entry.delay_ms)).await;
            play(entry, &request, sink)
        })
    }
}

fn play(
    entry: &MockEntry,
    request: &ModelRequest<'_>,
    sink: &mut dyn DeltaSink,
) -> Result<ModelReply, ProviderError> {
    if let Some(failure) = &entry.error {
        let replies = entry.text.is_some() || !entry.tool_calls.is_empty();
        let fails_now = !replies || failure.times.is_none_or(|times| request.attempt <= times);
        if fails_now {
            if let Some(partial) = &failure.partial {
                for word in partial.split_inclusive(' ') {
                    sink.text_delta(word);
                }
            }
            return Err(ProviderError::from_status(failure.status, failure.message.clone()));
        }
    }
    let text = match entry.text.as_deref() {
        Some(template) => fill_last_tool_output(template, request),
        None => String::new(),
    };
    let calls = entry
        .tool_calls
        .iter()
        .enumerate()
        .map(|(index, call)| {
            Part::ToolCall(ToolCall {
                call_id: call_id(request.call_index, index),
                name: call.name.clone(),
                input: call.input.clone(),
            })
        })
        .collect();
    Ok(reply_with_text(request, &text, calls, sink))
}

/// `call_<call_index>_<index>`, unique in the session.
fn call_id(call_index: u64, index: usize) -> String {
    let (call_index, index) = (call_index.to_string(), index.to_string());
    let mut id = String::with_capacity(6 + call_index.len() + index.len());
    for piece in ["call_", &call_index, "_", &index] {
        id.push_str(piece);
    }
    id
}

/// Streams `text` in word-sized deltas and builds the reply.
fn reply_with_text(
    request: &ModelRequest<'_>,
    text: &str,
    calls: Vec<Part>,
    sink: &mut dyn DeltaSink,
) -> ModelReply {
    let mut start = 0;
    for (index, _) in text.match_indices(' ') {
        sink.text_delta(&text[start..=index]);
        start = index + 1;
    }
    if start < text.len() {
        sink.text_delta(&text[start..]);
    }
    // A rough, deterministic estimate: serializing inputs just to count them costs more than
    // the estimate is worth.
    let output_chars = text.len() + 24 * calls.len();
    let finish_reason = if calls.is_empty() { "stop" } else { "tool_calls" };
    sink.reply_info(keel_core::ReplyInfo {
        response_model: Some("mock"),
        finish_reason: Some(finish_reason),
    });
    let mut parts = Vec::with_capacity(calls.len() + 1);
    if !text.is_empty() {
        parts.push(Part::Text(text.to_owned()));
    }
    parts.extend(calls);
    ModelReply {
        parts,
        usage: Usage { input_tokens: estimate_input(request), output_tokens: tokens(output_chars) },
    }
}

fn tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4).max(1)
}

fn estimate_input(request: &ModelRequest<'_>) -> u64 {
    let mut chars = request.instructions.len();
    for message in request.messages {
        for part in &message.parts {
            chars += match part {
                Part::Text(text) | Part::Summary { text, .. } => text.len(),
                Part::Reasoning(reasoning) => reasoning.text.len(),
                Part::ToolCall(call) => call.name.len() + 16,
                Part::ToolResult(result) => 16 + result.output.as_str().map_or(8, str::len),
                Part::Image { .. } | Part::File { .. } => 256,
            };
        }
    }
    tokens(chars)
}

/// The mock's answer to a memory call: the script's `episode` / `extract` of the entry that
/// ended the run, else a summary of its own (the user's first line and the last answer) or an
/// empty extraction.
fn memory_reply(request: &ModelRequest<'_>, entry: Option<&MockEntry>) -> String {
    let scripted = entry.and_then(|e| match request.purpose {
        CallPurpose::Episode => e.episode.clone(),
        _ => e.extract.clone(),
    });
    if let Some(text) = scripted {
        return text;
    }
    if request.purpose != CallPurpose::Episode {
        return r#"{"entities": [], "relations": []}"#.to_owned();
    }
    let text = request.messages.iter().map(|m| m.text()).collect::<Vec<_>>().join("\n");
    let asked = text.lines().find_map(|l| l.strip_prefix("user: ")).unwrap_or_default();
    let answered = text.lines().rev().find_map(|l| l.strip_prefix("assistant: ")).unwrap_or_default();
    let short = |s: &str| s.chars().take(120).collect::<String>();
    format!("The user asked \"{}\" and was told \"{}\".", short(asked), short(answered))
}

/// The mock's own compaction brief: the user's lines of the conversation it is given (the
/// latest ones, when there are many), so that a test can see what a brief kept.
fn brief_of_user_lines(request: &ModelRequest<'_>) -> String {
    const KEPT: usize = 12;
    let text = request.messages.iter().map(|m| m.text()).collect::<Vec<_>>().join("\n");
    let said: Vec<&str> = text.lines().filter_map(|line| line.strip_prefix("user: ")).collect();
    let latest = &said[said.len().saturating_sub(KEPT)..];
    let earlier = text.lines().find_map(|line| line.strip_prefix("Brief of the conversation so far:"));
    let mut brief = String::from("Earlier the user said: ");
    brief.push_str(&latest.join(" | "));
    if earlier.is_some() || said.len() > KEPT {
        brief.insert_str(0, "(and more before) ");
    }
    brief
}

fn last_user_text(request: &ModelRequest<'_>) -> String {
    request.messages.iter().rev().find(|m| m.role == Role::User).map(|m| m.text()).unwrap_or_default()
}

/// `template` with each `{{last_tool_output}}` replaced by the output of the conversation's last
/// tool result. The placeholder is found by looking at each `{` (a byte search), which costs far
/// less than `str::replace`'s substring searcher for the short texts of a script.
fn fill_last_tool_output(template: &str, request: &ModelRequest<'_>) -> String {
    const PLACEHOLDER: &str = "{{last_tool_output}}";
    let mut output: Option<String> = None;
    let mut filled = String::with_capacity(template.len());
    let mut copied = 0;
    for (at, _) in template.match_indices('{') {
        if at >= copied && template[at..].starts_with(PLACEHOLDER) {
            filled.push_str(&template[copied..at]);
            filled.push_str(output.get_or_insert_with(|| last_tool_output(request)));
            copied = at + PLACEHOLDER.len();
        }
    }
    filled.push_str(&template[copied..]);
    filled
}

fn last_tool_output(request: &ModelRequest<'_>) -> String {
    request
        .messages
        .iter()
        .rev()
        .find_map(|m| m.tool_results().last())
        .map(|result| output_to_text(&result.output))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use keel_core::{Message, MockFailure, MockToolCall, ProviderErrorKind};
    use serde_json::json;

    struct Collect(Vec<String>);
    impl DeltaSink for Collect {
        fn text_delta(&mut self, delta: &str) {
            self.0.push(delta.to_owned());
        }
    }

    fn request<'a>(messages: &'a [Arc<Message>], call_index: u64, attempt: u32) -> ModelRequest<'a> {
        ModelRequest {
            model: "mock",
            instructions: "",
            messages,
            tools: &[],
            output_schema: None,
            call_index,
            attempt,
            tool_choice: None,
            purpose: keel_core::CallPurpose::Turn,
        }
    }

    fn script() -> MockProvider {
        MockProvider::new(MockScript::new(vec![
            MockEntry {
                tool_calls: vec![
                    MockToolCall { name: "day_name".into(), input: json!({}) },
                    MockToolCall { name: "add".into(), input: json!({"a": 1}) },
                ],
                ..MockEntry::default()
            },
            MockEntry { text: Some("It is {{last_tool_output}} today.".into()), ..MockEntry::default() },
            MockEntry {
                error: Some(MockFailure {
                    status: 503,
                    message: "overloaded".into(),
                    times: Some(1),
                    partial: None,
                }),
                text: Some("recovered".into()),
                ..MockEntry::default()
            },
            MockEntry {
                error: Some(MockFailure { status: 400, message: "bad".into(), times: None, partial: None }),
                ..MockEntry::default()
            },
        ]))
    }

    async fn call(
        provider: &MockProvider,
        messages: &[Message],
        index: u64,
        attempt: u32,
    ) -> (Result<ModelReply, ProviderError>, Vec<String>) {
        let mut sink = Collect(Vec::new());
        let messages: Vec<Arc<Message>> = messages.iter().cloned().map(Arc::new).collect();
        let result = provider.complete(request(&messages, index, attempt), &mut sink).await;
        (result, sink.0)
    }

    #[tokio::test]
    async fn entries_are_picked_by_call_index() {
        let provider = script();
        let history = [Message::user("What day is it?")];
        let (reply, deltas) = call(&provider, &history, 0, 1).await;
        let reply = reply.unwrap();
        assert!(deltas.is_empty());
        let names: Vec<_> = reply
            .parts
            .iter()
            .map(|p| match p {
                Part::ToolCall(c) => format!("{} {}", c.call_id, c.name),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(names, ["call_0_0 day_name", "call_0_1 add"]);
    }

    #[tokio::test]
    async fn text_streams_in_several_deltas_with_the_last_tool_output() {
        let provider = script();
        let history = [
            Message::user("What day is it?"),
            Message {
                role: Role::Tool,
                parts: vec![
                    Part::ToolResult(keel_core::message::ToolResult {
                        call_id: "a".into(),
                        name: "x".into(),
                        output: json!("Monday"),
                        is_error: false,
                    }),
                    Part::ToolResult(keel_core::message::ToolResult {
                        call_id: "b".into(),
                        name: "day_name".into(),
                        output: json!("Sunday"),
                        is_error: false,
                    }),
                ],
            },
        ];
        let (reply, deltas) = call(&provider, &history, 1, 1).await;
        assert_eq!(deltas, ["It ", "is ", "Sunday ", "today."]);
        assert_eq!(reply.unwrap().parts, [Part::Text("It is Sunday today.".into())]);
    }

    #[test]
    fn every_placeholder_is_filled_and_other_braces_stay() {
        let tool = Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(keel_core::message::ToolResult {
                call_id: "a".into(),
                name: "add".into(),
                output: json!(5),
                is_error: false,
            })],
        };
        let with_result = [Arc::new(Message::user("add")), Arc::new(tool)];
        let fill = |template: &str, messages: &[Arc<Message>]| {
            fill_last_tool_output(template, &request(messages, 1, 1))
        };
        assert_eq!(fill("{{last_tool_output}}", &with_result), "5");
        assert_eq!(fill("{{last_tool_output}} and {{last_tool_output}}", &with_result), "5 and 5");
        assert_eq!(fill("{{{last_tool_output}}}", &with_result), "{5}");
        assert_eq!(fill("{x} {{last_tool_output}", &with_result), "{x} {{last_tool_output}");
        assert_eq!(fill("no placeholder", &with_result), "no placeholder");
        assert_eq!(fill("é{{last_tool_output}}ü", &with_result), "é5ü");
        // No tool result yet: the placeholder becomes empty.
        assert_eq!(fill("got {{last_tool_output}}.", &[Arc::new(Message::user("hi"))]), "got .");
    }

    #[tokio::test]
    async fn errors_fail_the_first_attempts_then_reply() {
        let provider = script();
        let history = [Message::user("hi")];
        let (first, _) = call(&provider, &history, 2, 1).await;
        let error = first.unwrap_err();
        assert_eq!(error.kind, ProviderErrorKind::Overloaded);
        assert_eq!(error.status, Some(503));
        let (second, _) = call(&provider, &history, 2, 2).await;
        assert_eq!(second.unwrap().parts, [Part::Text("recovered".into())]);
        for attempt in 1..4 {
            let (result, _) = call(&provider, &history, 3, attempt).await;
            assert_eq!(result.unwrap_err().kind, ProviderErrorKind::BadRequest);
        }
    }

    #[tokio::test]
    async fn an_exhausted_script_echoes_the_input() {
        let provider = script();
        let history = [Message::user("echo me please")];
        let (reply, deltas) = call(&provider, &history, 9, 1).await;
        assert_eq!(deltas.concat(), "echo me please");
        assert_eq!(reply.unwrap().parts, [Part::Text("echo me please".into())]);
    }

    #[tokio::test(start_paused = true)]
    async fn delays_wait_before_replying() {
        let provider = MockProvider::new(MockScript::new(vec![MockEntry {
            delay_ms: 5_000,
            text: Some("late".into()),
            ..MockEntry::default()
        }]));
        let start = tokio::time::Instant::now();
        let (reply, _) = call(&provider, &[Message::user("x")], 0, 1).await;
        assert_eq!(reply.unwrap().parts, [Part::Text("late".into())]);
        assert!(start.elapsed() >= std::time::Duration::from_secs(5));
    }

    #[test]
    fn model_strings_pick_a_provider() {
        let settings = keel_core::ProviderSettings::default();
        assert!(crate::from_model("mock", &settings, None).is_ok());
        let err = crate::from_model("nope/x", &settings, None).err().unwrap();
        assert!(err.message.contains("unknown provider `nope`"), "{}", err.message);
    }
}
