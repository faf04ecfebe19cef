//! Conversation messages and their content parts.
//!
//! A [`Message`] is what a session's transcript is made of. Its content is a list of [`Part`]s:
//! text, image and file bytes, the tool calls a model asks for, and the results that answer them.
//! These are domain types: the persisted form lives in [`crate::persist`] and the wire form of
//! events in [`crate::wire`], so this module can change without breaking stored data.

use std::sync::Arc;

use serde_json::Value;

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The person (or program) talking to the agent.
    User,
    /// The model.
    Assistant,
    /// Results of tool calls, answering the assistant message before it.
    Tool,
}

impl Role {
    /// The lower-case name used in persisted and wire formats.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One piece of a message's content.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// Plain text.
    Text(String),
    /// An image, as raw bytes with its media type (`image/png`, ...).
    Image {
        /// The IANA media type.
        media_type: String,
        /// The encoded image. Shared, because transcripts are cloned into requests.
        data: Arc<[u8]>,
    },
    /// A file (a PDF, a CSV...), as raw bytes.
    File {
        /// The IANA media type.
        media_type: String,
        /// The file name, when known.
        name: Option<String>,
        /// The file's bytes.
        data: Arc<[u8]>,
    },
    /// The model's reasoning ("thinking") before its answer, kept so that it can be sent back:
    /// some providers require it during tool use (Anthropic checks the `signature`).
    Reasoning(Reasoning),
    /// A tool call requested by the model.
    ToolCall(ToolCall),
    /// The result of a tool call.
    ToolResult(ToolResult),
    /// A brief of the conversation before session position `first_kept`, written by
    /// compaction (step `llm:compact:N`). From then on the model sees the brief instead of
    /// those messages; the store keeps them all.
    Summary {
        /// The brief.
        text: String,
        /// The session position of the first message kept as it is.
        first_kept: u64,
    },
}

/// A model's reasoning, as the provider returned it.
///
/// The transcript stays provider-neutral: reasoning with a `signature` or `redacted` payload is
/// sent back only to a provider that checks them (the one that made them); other providers get
/// the text, or nothing when they take no reasoning.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reasoning {
    /// The reasoning text (empty when the provider redacted it).
    pub text: String,
    /// The provider's proof that the text is its own (Anthropic's `signature`).
    pub signature: Option<String>,
    /// Reasoning the provider encrypted (Anthropic's `redacted_thinking` `data`), sent back as is.
    pub redacted: Option<String>,
}

/// A model's request to call a tool.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The call id, unique within the run (from the model, or derived: see [`crate::machine`]).
    pub call_id: String,
    /// The tool's name.
    pub name: String,
    /// The input the model gave, as JSON. Arguments that were not valid JSON are kept as a JSON
    /// string of the raw text, so that the tool call fails validation and the model can repair it.
    pub input: Value,
}

/// The result of one tool call, as the model will see it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolResult {
    /// The id of the call this answers.
    pub call_id: String,
    /// The tool's name.
    pub name: String,
    /// The output (or the error message when `is_error`).
    pub output: Value,
    /// Whether the call failed (the model is told so).
    pub is_error: bool,
}

/// A message of a session's transcript.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// What it says, in order.
    pub parts: Vec<Part>,
}

impl Message {
    /// A user message of one text part.
    pub fn user(text: impl Into<String>) -> Message {
        Message { role: Role::User, parts: vec![Part::Text(text.into())] }
    }

    /// An assistant message of one text part.
    pub fn assistant(text: impl Into<String>) -> Message {
        Message { role: Role::Assistant, parts: vec![Part::Text(text.into())] }
    }

    /// The text parts joined together (no separator: deltas of one reply concatenate).
    pub fn text(&self) -> String {
        let mut text = String::new();
        for part in &self.parts {
            if let Part::Text(t) = part {
                text.push_str(t);
            }
        }
        text
    }

    /// The reasoning parts' text joined together (empty when there is none).
    pub fn reasoning(&self) -> String {
        let mut text = String::new();
        for part in &self.parts {
            if let Part::Reasoning(reasoning) = part {
                text.push_str(&reasoning.text);
            }
        }
        text
    }

    /// The tool calls of this message, in order.
    pub fn tool_calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.parts.iter().filter_map(|part| match part {
            Part::ToolCall(call) => Some(call),
            _ => None,
        })
    }

    /// The message as plain lines, for a model asked about the conversation (a compaction
    /// brief, a memory extraction): who said what, which tool was called with what and what it
    /// returned, placeholders for images and files. Reasoning and briefs are left out.
    pub fn plain_lines(&self) -> impl Iterator<Item = String> + '_ {
        let role = self.role.as_str();
        self.parts.iter().filter_map(move |part| {
            Some(match part {
                Part::Text(text) => format!("{role}: {text}"),
                Part::ToolCall(call) => format!("assistant called `{}` with {}", call.name, call.input),
                Part::ToolResult(result) => format!(
                    "`{}` {}: {}",
                    result.name,
                    if result.is_error { "failed" } else { "returned" },
                    output_to_text(&result.output)
                ),
                Part::Image { media_type, .. } => format!("{role}: [an image, {media_type}]"),
                Part::File { media_type, name, .. } => {
                    format!("{role}: [a file {}, {media_type}]", name.as_deref().unwrap_or(""))
                }
                Part::Reasoning(_) | Part::Summary { .. } => return None,
            })
        })
    }

    /// The compaction brief this message carries, with the position of the first message it
    /// keeps.
    pub fn summary(&self) -> Option<(&str, u64)> {
        self.parts.iter().find_map(|part| match part {
            Part::Summary { text, first_kept } => Some((text.as_str(), *first_kept)),
            _ => None,
        })
    }

    /// The tool results of this message, in order.
    pub fn tool_results(&self) -> impl Iterator<Item = &ToolResult> {
        self.parts.iter().filter_map(|part| match part {
            Part::ToolResult(result) => Some(result),
            _ => None,
        })
    }
}

/// Renders a tool output the way a model and a template see it: a JSON string as its text,
/// anything else as compact JSON.
pub fn output_to_text(output: &Value) -> String {
    match output {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// An image a tool returned for the model to see: in a tool output that is a list, a block
/// `{"type": "image", "mimeType": "image/png", "data": "<base64>"}` (what MCP tools return).
/// Providers that can show images with a tool result show it; the rest of the output is text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolImage<'a> {
    /// The IANA media type.
    pub media_type: &'a str,
    /// The image, base64-encoded.
    pub data: &'a str,
}

/// Splits a tool output into what the model reads as text (image blocks keep their media type,
/// marked as shown, without their data) and the images themselves. An output without image
/// blocks comes back as it is, with no images.
pub fn tool_output_images(output: &Value) -> (std::borrow::Cow<'_, Value>, Vec<ToolImage<'_>>) {
    let Value::Array(items) = output else { return (std::borrow::Cow::Borrowed(output), Vec::new()) };
    let image = |item: &'_ Value| -> bool {
        item.get("type").and_then(Value::as_str) == Some("image")
            && item.get("data").is_some_and(Value::is_string)
    };
    if !items.iter().any(image) {
        return (std::borrow::Cow::Borrowed(output), Vec::new());
    }
    let mut images = Vec::new();
    let text = items
        .iter()
        .map(|item| {
            if !image(item) {
                return item.clone();
            }
            let media_type = item.get("mimeType").and_then(Value::as_str).unwrap_or("image/png");
            images.push(ToolImage { media_type, data: item["data"].as_str().unwrap_or_default() });
            serde_json::json!({ "type": "image", "mimeType": media_type, "shown": true })
        })
        .collect();
    (std::borrow::Cow::Owned(Value::Array(text)), images)
}

impl From<&str> for Message {
    fn from(text: &str) -> Message {
        Message::user(text)
    }
}

impl From<String> for Message {
    fn from(text: String) -> Message {
        Message::user(text)
    }
}

impl From<Vec<Part>> for Message {
    /// A user message of these parts (text, images, files).
    fn from(parts: Vec<Part>) -> Message {
        Message { role: Role::User, parts }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn images_are_split_from_what_a_tool_output_says() {
        let output = json!([
            { "type": "text", "text": "two charts" },
            { "type": "image", "mimeType": "image/png", "data": "AAAA" },
            { "type": "image", "mimeType": "image/jpeg", "data": "BBBB" },
            { "type": "image", "mimeType": "image/gif", "bytes": 9_000_000 },
        ]);
        let (readable, images) = tool_output_images(&output);
        assert_eq!(
            images,
            [
                ToolImage { media_type: "image/png", data: "AAAA" },
                ToolImage { media_type: "image/jpeg", data: "BBBB" }
            ]
        );
        assert_eq!(
            *readable,
            json!([
                { "type": "text", "text": "two charts" },
                { "type": "image", "mimeType": "image/png", "shown": true },
                { "type": "image", "mimeType": "image/jpeg", "shown": true },
                { "type": "image", "mimeType": "image/gif", "bytes": 9_000_000 },
            ])
        );
        // Outputs without image data are untouched.
        for plain in
            [json!("text"), json!({"type": "image", "data": "AAAA"}), json!([{"type": "text", "text": "x"}])]
        {
            let (readable, images) = tool_output_images(&plain);
            assert_eq!(*readable, plain);
            assert!(images.is_empty());
        }
    }
}
