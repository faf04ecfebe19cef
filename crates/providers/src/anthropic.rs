//! Anthropic Messages (`POST /v1/messages`, `anthropic-version: 2023-06-01`).
//!
//! The transcript maps onto alternating `user` / `assistant` turns: tool results are
//! `tool_result` blocks of a user turn, and consecutive turns of one role are merged. Thinking
//! blocks are sent back with their `signature` (Anthropic requires them during tool use);
//! reasoning that another provider produced has no signature and is left out. The stream's
//! `content_block_*` events build the reply block by block; `message_delta` carries the stop
//! reason and the output tokens; an `error` event mid-stream is classified like an error body;
//! unknown events (and `ping`) are ignored.

use std::borrow::Cow;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use keel_core::message::output_to_text;
use keel_core::provider::ProviderErrorKind;
use keel_core::{
    BoxFuture, DeltaSink, Message, ModelReply, ModelRequest, Part, Provider, ProviderError, ProviderSettings,
    Role, ToolChoice,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::framing::{SseDecoder, SseEvent};
use crate::http;
use crate::openai::text_file;
use crate::reply::{ReplyBuilder, Text};

/// The API version keel speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `max_tokens` when the spec sets none (Anthropic requires one).
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A Messages endpoint.
#[derive(Clone, Debug)]
pub struct AnthropicMessages {
    url: String,
    api_key: String,
    settings: ProviderSettings,
}

impl AnthropicMessages {
    /// A client of `{base_url}/v1/messages`.
    pub fn new(base_url: &str, api_key: String, settings: ProviderSettings) -> AnthropicMessages {
        let base = base_url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base);
        AnthropicMessages { url: format!("{base}/v1/messages"), api_key, settings }
    }

    /// The endpoint's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The JSON body of a request.
    pub fn request_body(&self, request: &ModelRequest<'_>) -> Result<Value, ProviderError> {
        let settings = &self.settings;
        let mut system = request.instructions.to_owned();
        if let Some(schema) = request.output_schema {
            // The Messages API has no response format: the schema goes in the instructions and
            // keel checks the answer against it.
            if !system.is_empty() {
                system.push_str("\n\n");
            }
            system.push_str("Give your final answer as a single JSON value, with no other text, that matches this JSON Schema:\n");
            system.push_str(&schema.to_string());
        }
        let mut turns: Vec<(Role, Vec<Value>)> = Vec::new();
        for message in request.messages {
            let role = if message.role == Role::Assistant { Role::Assistant } else { Role::User };
            let blocks = blocks(message)?;
            if blocks.is_empty() {
                continue;
            }
            match turns.last_mut() {
                Some((last, content)) if *last == role => content.extend(blocks),
                _ => turns.push((role, blocks)),
            }
        }
        let messages: Vec<Value> = turns
            .into_iter()
            .map(|(role, content)| json!({ "role": role.as_str(), "content": content }))
            .collect();
        let max_tokens = settings.max_tokens.unwrap_or_else(|| {
            settings.thinking_budget.map_or(DEFAULT_MAX_TOKENS, |b| b.saturating_add(DEFAULT_MAX_TOKENS))
        });
        let mut body = Map::new();
        body.insert("model".into(), request.model.into());
        body.insert("max_tokens".into(), max_tokens.into());
        if !system.is_empty() {
            body.insert("system".into(), system.into());
        }
        body.insert("messages".into(), messages.into());
        body.insert("stream".into(), true.into());
        if !request.tools.is_empty() {
            let tools: Vec<Value> = request
                .tools
                .iter()
                .map(|tool| json!({ "name": tool.name, "description": tool.description, "input_schema": tool.input_schema }))
                .collect();
            body.insert("tools".into(), tools.into());
            let tool_choice = request.tool_choice.unwrap_or(&settings.tool_choice);
            let mut choice = match tool_choice {
                ToolChoice::Auto => json!({ "type": "auto" }),
                ToolChoice::None => json!({ "type": "none" }),
                ToolChoice::Required => json!({ "type": "any" }),
                ToolChoice::Tool(name) => json!({ "type": "tool", "name": name }),
            };
            if settings.parallel_tool_calls == Some(false) && *tool_choice != ToolChoice::None {
                choice["disable_parallel_tool_use"] = true.into();
            }
            body.insert("tool_choice".into(), choice);
        }
        if let Some(temperature) = settings.temperature {
            body.insert("temperature".into(), temperature.into());
        }
        if let Some(budget) = settings.thinking_budget {
            body.insert("thinking".into(), json!({ "type": "enabled", "budget_tokens": budget }));
        }
        Ok(Value::Object(body))
    }
}

/// The content blocks of one message.
fn blocks(message: &Message) -> Result<Vec<Value>, ProviderError> {
    let mut blocks = Vec::with_capacity(message.parts.len());
    for part in &message.parts {
        match part {
            // Anthropic refuses empty text blocks.
            Part::Text(text) if text.is_empty() => {}
            // A compaction brief (the runtime sends it as text already; kept for completeness).
            Part::Text(text) | Part::Summary { text, .. } => {
                blocks.push(json!({ "type": "text", "text": text }))
            }
            Part::Image { media_type, data } => blocks.push(json!({ "type": "image", "source": {
                "type": "base64", "media_type": media_type, "data": BASE64.encode(data),
            } })),
            Part::File { media_type, name, data } => {
                let mut block = if let Some(text) = text_file(media_type, data) {
                    json!({ "type": "document", "source": { "type": "text", "media_type": "text/plain", "data": text } })
                } else if media_type == "application/pdf" {
                    json!({ "type": "document", "source": {
                        "type": "base64", "media_type": media_type, "data": BASE64.encode(data),
                    } })
                } else {
                    return Err(ProviderError::new(
                        ProviderErrorKind::BadRequest,
                        format!(
                            "anthropic: a message cannot carry a `{media_type}` file (images, PDFs and text files can)"
                        ),
                    ));
                };
                if let Some(name) = name {
                    block["title"] = name.as_str().into();
                }
                blocks.push(block);
            }
            Part::Reasoning(reasoning) => {
                if let Some(data) = &reasoning.redacted {
                    blocks.push(json!({ "type": "redacted_thinking", "data": data }));
                } else if let Some(signature) = &reasoning.signature {
                    blocks.push(
                        json!({ "type": "thinking", "thinking": reasoning.text, "signature": signature }),
                    );
                }
                // Unsigned reasoning came from another provider: Anthropic would reject it.
            }
            Part::ToolCall(call) => {
                let input = match &call.input {
                    Value::Object(_) => call.input.clone(),
                    // Arguments that were not a JSON object cannot be a `tool_use` input; the
                    // tool result that follows says what was wrong with them.
                    _ => json!({}),
                };
                blocks.push(json!({ "type": "tool_use", "id": tool_use_id(&call.call_id), "name": call.name, "input": input }));
            }
            Part::ToolResult(result) => {
                let (readable, images) = keel_core::message::tool_output_images(&result.output);
                let content = if images.is_empty() {
                    json!(output_to_text(&result.output))
                } else {
                    // A tool result may hold images: the model sees them with the text.
                    let mut content = vec![json!({ "type": "text", "text": output_to_text(&readable) })];
                    content.extend(images.iter().map(|image| {
                        json!({ "type": "image", "source": {
                            "type": "base64", "media_type": image.media_type, "data": image.data,
                        } })
                    }));
                    Value::Array(content)
                };
                let mut block = json!({
                    "type": "tool_result",
                    "tool_use_id": tool_use_id(&result.call_id),
                    "content": content,
                });
                if result.is_error {
                    block["is_error"] = true.into();
                }
                blocks.push(block);
            }
        }
    }
    Ok(blocks)
}

/// A call id as Anthropic accepts it (`^[a-zA-Z0-9_-]+$`): ids from other providers may hold
/// other characters. The same id always maps to the same result, so calls and results match.
fn tool_use_id(id: &str) -> Cow<'_, str> {
    if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Cow::Borrowed(id);
    }
    let cleaned: String =
        id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    Cow::Owned(if cleaned.is_empty() { "call".into() } else { cleaned })
}

impl Provider for AnthropicMessages {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        Box::pin(async move {
            let body = self.request_body(&request)?;
            let headers = http::headers(
                "anthropic",
                &[
                    ("x-api-key", &self.api_key),
                    ("anthropic-version", ANTHROPIC_VERSION),
                    ("accept", "text/event-stream"),
                ],
                &self.settings.headers,
            )?;
            let key = Some(self.api_key.as_str());
            let mut response =
                http::post("anthropic", &self.url, headers, &body).await.map_err(|e| http::redact(e, key))?;
            if http::media_type(response.headers()) != "text/event-stream" {
                let html = http::is_html(response.headers());
                let body = http::read_capped(response, 64 * 1024).await;
                return Err(http::error_response("anthropic", Some(200), &body, html));
            }
            let mut decoder = MessagesStream::new();
            while let Some(chunk) = http::next_chunk("anthropic", &mut response).await? {
                decoder.feed(&chunk, sink).map_err(|e| http::redact(e, key))?;
            }
            decoder.finish(sink).map_err(|e| http::redact(e, key))
        })
    }
}

/// Decodes a Messages event stream.
pub struct MessagesStream {
    sse: SseDecoder,
    state: State,
}

#[derive(Default)]
struct State {
    reply: ReplyBuilder,
    /// The kind of each open content block, by index.
    blocks: Vec<(u64, BlockKind)>,
    stopped: bool,
    cache_input: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Text,
    Thinking,
    ToolUse,
    Other,
}

#[derive(Deserialize)]
struct EventJson<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    index: u64,
    #[serde(default, borrow)]
    delta: Option<DeltaJson<'a>>,
    #[serde(default, borrow)]
    content_block: Option<BlockJson<'a>>,
    #[serde(default)]
    message: Option<MessageJson>,
    #[serde(default)]
    usage: Option<UsageJson>,
}

#[derive(Deserialize)]
struct DeltaJson<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Text<'a>>,
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
    #[serde(default, borrow)]
    partial_json: Option<Text<'a>>,
    #[serde(default, borrow)]
    thinking: Option<Text<'a>>,
    #[serde(default, borrow)]
    signature: Option<Text<'a>>,
    #[serde(default, borrow)]
    stop_reason: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct BlockJson<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    id: Option<Text<'a>>,
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
    #[serde(default, borrow)]
    thinking: Option<Text<'a>>,
    #[serde(default, borrow)]
    signature: Option<Text<'a>>,
    #[serde(default, borrow)]
    data: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct MessageJson {
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize, Default)]
struct UsageJson {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl Default for MessagesStream {
    fn default() -> Self {
        MessagesStream::new()
    }
}

impl MessagesStream {
    /// A decoder at the start of a stream.
    pub fn new() -> MessagesStream {
        MessagesStream { sse: SseDecoder::new(), state: State::default() }
    }

    /// Feeds the next piece of the body.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut dyn DeltaSink) -> Result<(), ProviderError> {
        let Self { sse, state } = self;
        sse.feed(bytes, |event| state.on_event(event, sink))
    }

    /// Ends the body and returns the reply; a stream cut before its stop reason (in
    /// `message_delta`) and its `message_stop` is an error.
    pub fn finish(mut self, sink: &mut dyn DeltaSink) -> Result<ModelReply, ProviderError> {
        let Self { sse, state } = &mut self;
        let last = sse.finish(|event| state.on_event(event, sink));
        if !self.state.stopped && !self.state.reply.finished {
            let cut = if last.is_err() { ", its last event cut short" } else { "" };
            return Err(ProviderError::new(
                ProviderErrorKind::BadResponse,
                format!("anthropic: the stream ended before the reply was complete (no `message_stop`{cut})"),
            ));
        }
        last?;
        Ok(self.state.reply.finish(sink))
    }
}

impl State {
    fn on_event(&mut self, event: SseEvent<'_>, sink: &mut dyn DeltaSink) -> Result<(), ProviderError> {
        if event.event == "error" {
            return Err(http::error_response("anthropic", None, event.data.as_bytes(), false));
        }
        let parsed: EventJson<'_> = serde_json::from_str(event.data).map_err(|error| {
            ProviderError::new(
                ProviderErrorKind::BadResponse,
                format!(
                    "anthropic: a malformed event in the stream ({error}): {}",
                    http::snippet(event.data.as_bytes())
                ),
            )
        })?;
        match &*parsed.kind {
            "message_start" => {
                if let Some(message) = parsed.message {
                    self.reply.answered_by(message.model.as_deref());
                    if let Some(usage) = message.usage {
                        self.usage(&usage);
                    }
                }
            }
            "content_block_start" => {
                let Some(block) = parsed.content_block else { return Ok(()) };
                let kind = match &*block.kind {
                    "text" => {
                        self.reply.start_text();
                        if let Some(text) = block.text.as_deref() {
                            self.reply.text(text, sink);
                        }
                        BlockKind::Text
                    }
                    "thinking" => {
                        self.reply.start_reasoning();
                        if let Some(thinking) = block.thinking.as_deref() {
                            self.reply.reasoning(thinking, sink);
                        }
                        if let Some(signature) = block.signature.as_deref().filter(|s| !s.is_empty()) {
                            self.reply.signature(signature);
                        }
                        BlockKind::Thinking
                    }
                    "redacted_thinking" => {
                        self.reply.redacted_reasoning(block.data.as_deref().unwrap_or_default());
                        BlockKind::Other
                    }
                    "tool_use" => {
                        self.reply.call_fragment(
                            parsed.index,
                            block.id.as_deref(),
                            block.name.as_deref(),
                            None,
                        );
                        // A non-empty `input` at the start is the whole input (servers that do
                        // not stream it); `{}` is the placeholder the deltas replace.
                        if let Some(input) =
                            block.input.filter(|i| i.as_object().is_some_and(|o| !o.is_empty()))
                        {
                            self.reply.call_fragment(parsed.index, None, None, Some(&input.to_string()));
                        }
                        BlockKind::ToolUse
                    }
                    _ => BlockKind::Other,
                };
                self.blocks.push((parsed.index, kind));
            }
            "content_block_delta" => {
                let Some(delta) = parsed.delta else { return Ok(()) };
                let kind = self.blocks.iter().rev().find(|(i, _)| *i == parsed.index).map(|(_, k)| *k);
                match (delta.kind.as_deref(), kind) {
                    (Some("text_delta"), Some(BlockKind::Text)) => {
                        self.reply.text(delta.text.as_deref().unwrap_or_default(), sink);
                    }
                    (Some("thinking_delta"), Some(BlockKind::Thinking)) => {
                        self.reply.reasoning(delta.thinking.as_deref().unwrap_or_default(), sink);
                    }
                    (Some("signature_delta"), Some(BlockKind::Thinking)) => {
                        self.reply.signature(delta.signature.as_deref().unwrap_or_default());
                    }
                    (Some("input_json_delta"), Some(BlockKind::ToolUse)) => {
                        self.reply.call_fragment(parsed.index, None, None, delta.partial_json.as_deref());
                    }
                    // Citations and future delta types carry nothing keel keeps.
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(usage) = parsed.usage {
                    self.usage(&usage);
                }
                if let Some(reason) = parsed.delta.as_ref().and_then(|d| d.stop_reason.as_deref()) {
                    self.reply.stopped(reason);
                }
            }
            "message_stop" => self.stopped = true,
            // `ping`, `content_block_stop` and event types added later.
            _ => {}
        }
        Ok(())
    }

    /// Usage counts are cumulative: the latest value of each wins. Cached input counts as input.
    fn usage(&mut self, usage: &UsageJson) {
        let cache =
            usage.cache_creation_input_tokens.unwrap_or(0) + usage.cache_read_input_tokens.unwrap_or(0);
        if cache > 0 {
            self.cache_input = cache;
        }
        if let Some(input) = usage.input_tokens {
            self.reply.usage.input_tokens = input + self.cache_input;
        }
        if let Some(output) = usage.output_tokens {
            self.reply.usage.output_tokens = output;
        }
    }
}
