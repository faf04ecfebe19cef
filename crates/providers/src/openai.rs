//! OpenAI Chat Completions, the wire of `openai/`, `openrouter/` and `openai-compatible/`
//! models (vLLM, llama.cpp, LM Studio, DeepSeek, Groq, Together...).
//!
//! Requests stream (`stream: true`, `stream_options.include_usage`). A reply is assembled from
//! `chat.completion.chunk` events: text from `delta.content`, reasoning from
//! `delta.reasoning_content` (DeepSeek, vLLM, llama.cpp) or `delta.reasoning` (OpenRouter),
//! tool calls from `delta.tool_calls[]` fragments keyed by `index`, usage from the usage-only
//! chunk before `data: [DONE]`. A server that ignores `stream` and answers one JSON completion
//! is understood too.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use keel_core::event::Usage;
use keel_core::message::{ToolImage, ToolResult, output_to_text};
use keel_core::provider::ProviderErrorKind;
use keel_core::tool::ToolSpec;
use keel_core::{
    BoxFuture, DeltaSink, Message, ModelReply, ModelRequest, Part, Provider, ProviderError, ProviderSettings,
    Role, ToolChoice,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::framing::{FramingError, SseDecoder, SseEvent};
use crate::http;
use crate::reply::{ReplyBuilder, Text};

/// Which service speaks the wire: they differ in small ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// api.openai.com: `max_completion_tokens`; no reasoning in the transcript.
    OpenAi,
    /// openrouter.ai: attribution headers; reasoning comes back as `reasoning`.
    OpenRouter,
    /// Any other server: `max_tokens`; reasoning goes back as `reasoning_content`.
    Compatible,
}

impl Flavor {
    /// The provider's name, as the model string and messages spell it.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::OpenAi => "openai",
            Flavor::OpenRouter => "openrouter",
            Flavor::Compatible => "openai-compatible",
        }
    }
}

/// A Chat Completions endpoint.
#[derive(Clone, Debug)]
pub struct OpenAiChat {
    flavor: Flavor,
    url: String,
    /// `{base_url}/embeddings`.
    embeddings_url: String,
    api_key: Option<String>,
    settings: ProviderSettings,
    /// Headers the flavor always sends (OpenRouter's attribution).
    fixed_headers: Vec<(String, String)>,
}

impl OpenAiChat {
    /// A client of `{base_url}/chat/completions`.
    pub fn new(
        flavor: Flavor,
        base_url: &str,
        api_key: Option<String>,
        settings: ProviderSettings,
    ) -> OpenAiChat {
        let fixed_headers = match flavor {
            Flavor::OpenRouter => vec![("X-Title".to_owned(), "keel".to_owned())],
            _ => Vec::new(),
        };
        OpenAiChat {
            flavor,
            url: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            embeddings_url: format!("{}/embeddings", base_url.trim_end_matches('/')),
            api_key,
            settings,
            fixed_headers,
        }
    }

    /// The endpoint's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A request's headers: the key, `extra`, the flavor's own, the spec's.
    fn headers(&self, extra: Option<(&str, &str)>) -> Result<reqwest::header::HeaderMap, ProviderError> {
        let auth = self.api_key.as_ref().map(|key| format!("Bearer {key}"));
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        if let Some(auth) = &auth {
            pairs.push(("authorization", auth));
        }
        pairs.extend(extra);
        pairs.extend(self.fixed_headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        http::headers(self.flavor.name(), &pairs, &self.settings.headers)
    }

    /// The JSON body of a request.
    pub fn request_body(&self, request: &ModelRequest<'_>) -> Result<Value, ProviderError> {
        let settings = &self.settings;
        let mut messages = Vec::with_capacity(request.messages.len() + 1);
        if !request.instructions.is_empty() {
            messages.push(json!({ "role": "system", "content": request.instructions }));
        }
        for message in request.messages {
            self.push_message(message, &mut messages)?;
        }
        let mut body = Map::new();
        body.insert("model".into(), request.model.into());
        body.insert("messages".into(), messages.into());
        body.insert("stream".into(), true.into());
        body.insert("stream_options".into(), json!({ "include_usage": true }));
        if !request.tools.is_empty() {
            body.insert("tools".into(), function_tools(request.tools).into());
            let choice = match request.tool_choice.unwrap_or(&settings.tool_choice) {
                ToolChoice::Auto => json!("auto"),
                ToolChoice::None => json!("none"),
                ToolChoice::Required => json!("required"),
                ToolChoice::Tool(name) => json!({ "type": "function", "function": { "name": name } }),
            };
            body.insert("tool_choice".into(), choice);
            if let Some(parallel) = settings.parallel_tool_calls {
                body.insert("parallel_tool_calls".into(), parallel.into());
            }
        }
        if let Some(schema) = request.output_schema {
            body.insert(
                "response_format".into(),
                json!({ "type": "json_schema", "json_schema": { "name": "output", "schema": schema } }),
            );
        }
        if let Some(max) = settings.max_tokens {
            let field = if self.flavor == Flavor::OpenAi { "max_completion_tokens" } else { "max_tokens" };
            body.insert(field.into(), max.into());
        }
        if let Some(temperature) = settings.temperature {
            body.insert("temperature".into(), temperature.into());
        }
        if let Some(effort) = &settings.reasoning_effort {
            body.insert("reasoning_effort".into(), effort.as_str().into());
        }
        Ok(Value::Object(body))
    }

    fn push_message(&self, message: &Message, out: &mut Vec<Value>) -> Result<(), ProviderError> {
        match message.role {
            Role::User => {
                let only_text = message.parts.iter().all(|p| matches!(p, Part::Text(_)));
                let content = if only_text {
                    Value::String(message.text())
                } else {
                    let parts: Result<Vec<Value>, ProviderError> =
                        message.parts.iter().filter_map(|part| self.user_part(part)).collect();
                    Value::Array(parts?)
                };
                out.push(json!({ "role": "user", "content": content }));
            }
            Role::Assistant => {
                let mut entry = Map::new();
                entry.insert("role".into(), "assistant".into());
                let text = message.text();
                entry.insert("content".into(), if text.is_empty() { Value::Null } else { text.into() });
                let reasoning = message.reasoning();
                if !reasoning.is_empty() {
                    match self.flavor {
                        // OpenAI's chat API neither returns nor takes reasoning.
                        Flavor::OpenAi => {}
                        Flavor::OpenRouter => {
                            entry.insert("reasoning".into(), reasoning.into());
                        }
                        Flavor::Compatible => {
                            entry.insert("reasoning_content".into(), reasoning.into());
                        }
                    }
                }
                let calls: Vec<Value> = message
                    .tool_calls()
                    .map(|call| {
                        let arguments = match &call.input {
                            // Arguments that were not JSON go back as the model wrote them.
                            Value::String(raw) => raw.clone(),
                            input => input.to_string(),
                        };
                        json!({ "id": call.call_id, "type": "function",
                                "function": { "name": call.name, "arguments": arguments } })
                    })
                    .collect();
                if !calls.is_empty() {
                    entry.insert("tool_calls".into(), calls.into());
                }
                out.push(Value::Object(entry));
            }
            Role::Tool => {
                // A tool message holds text only: images the tools returned follow in a user
                // message, after every result of the turn.
                let mut shown =
                    vec![json!({ "type": "text", "text": "The images the tool calls above returned:" })];
                for result in message.tool_results() {
                    let (content, images) = tool_result_parts(result);
                    out.push(json!({ "role": "tool", "tool_call_id": result.call_id, "content": content }));
                    shown.extend(images.iter().map(|image| {
                        json!({ "type": "image_url", "image_url": {
                            "url": format!("data:{};base64,{}", image.media_type, image.data),
                        } })
                    }));
                }
                if shown.len() > 1 {
                    out.push(json!({ "role": "user", "content": shown }));
                }
            }
        }
        Ok(())
    }

    /// One content part of a user message, or `None` for parts a user message cannot hold.
    fn user_part(&self, part: &Part) -> Option<Result<Value, ProviderError>> {
        Some(Ok(match part {
            Part::Text(text) | Part::Summary { text, .. } => json!({ "type": "text", "text": text }),
            Part::Image { media_type, data } => json!({ "type": "image_url", "image_url": {
                "url": format!("data:{media_type};base64,{}", BASE64.encode(data)),
            } }),
            Part::File { media_type, name, data } => {
                if let Some(text) = text_file(media_type, data) {
                    let name = name.as_deref().unwrap_or("file");
                    json!({ "type": "text", "text": format!("<file name=\"{name}\">\n{text}\n</file>") })
                } else if media_type == "application/pdf" {
                    json!({ "type": "file", "file": {
                        "filename": name.as_deref().unwrap_or("file.pdf"),
                        "file_data": format!("data:{media_type};base64,{}", BASE64.encode(data)),
                    } })
                } else {
                    return Some(Err(ProviderError::new(
                        ProviderErrorKind::BadRequest,
                        format!(
                            "{}: a user message cannot carry a `{media_type}` file (images, PDFs and text files can)",
                            self.flavor.name()
                        ),
                    )));
                }
            }
            Part::Reasoning(_) | Part::ToolCall(_) | Part::ToolResult(_) => return None,
        }))
    }
}

/// The tools as `function` tools, the form OpenAI's wire and Ollama's share.
pub(crate) fn function_tools(tools: &[ToolSpec]) -> Vec<Value> {
    tools
        .iter()
        .map(|tool| {
            json!({ "type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": tool.input_schema,
            } })
        })
        .collect()
}

/// A tool result as the text of a `tool` message (the wire has no error flag, so an error says
/// so in its text), and the images it holds, which the caller sends as the wire allows.
pub(crate) fn tool_result_parts(result: &ToolResult) -> (String, Vec<ToolImage<'_>>) {
    let (readable, images) = keel_core::message::tool_output_images(&result.output);
    let text = output_to_text(&readable);
    (if result.is_error { format!("Error: {text}") } else { text }, images)
}

/// The text of a text-like file (`text/*`, JSON, XML, YAML), when it is UTF-8.
pub(crate) fn text_file<'a>(media_type: &str, data: &'a [u8]) -> Option<&'a str> {
    let textual = media_type.starts_with("text/")
        || matches!(
            media_type,
            "application/json" | "application/xml" | "application/yaml" | "application/x-yaml"
        );
    textual.then(|| std::str::from_utf8(data).ok()).flatten()
}

impl Provider for OpenAiChat {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        Box::pin(async move {
            let provider = self.flavor.name();
            let body = self.request_body(&request)?;
            let headers = self.headers(Some(("accept", "text/event-stream")))?;
            let key = self.api_key.as_deref();
            let mut response =
                http::post(provider, &self.url, headers, &body).await.map_err(|e| http::redact(e, key))?;
            let media_type = http::media_type(response.headers());
            if media_type == "application/json" {
                // A server that does not stream: one completion object.
                let body = http::read_capped(response, 64 * 1024 * 1024).await;
                return complete_from_json(provider, &body, sink);
            }
            if http::is_html(response.headers()) {
                let body = http::read_capped(response, 64 * 1024).await;
                return Err(http::error_response(provider, Some(200), &body, true));
            }
            let mut decoder = ChatStream::new(provider);
            while let Some(chunk) = http::next_chunk(provider, &mut response).await? {
                decoder.feed(&chunk, sink).map_err(|e| http::redact(e, key))?;
            }
            decoder.finish(sink).map_err(|e| http::redact(e, key))
        })
    }

    fn default_embedding_model(&self) -> Option<&str> {
        // Other servers name their models as they please: the agent names one.
        (self.flavor == Flavor::OpenAi).then_some(DEFAULT_EMBEDDING_MODEL)
    }

    fn embed<'a>(
        &'a self,
        model: &'a str,
        inputs: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, ProviderError>> {
        Box::pin(async move {
            let provider = self.flavor.name();
            let headers = self.headers(None)?;
            let key = self.api_key.as_deref();
            crate::embed::embed(
                provider,
                crate::embed::Wire::OpenAi,
                &self.embeddings_url,
                headers,
                key,
                model,
                inputs,
            )
            .await
        })
    }
}

/// The embedding model `openai/` agents use unless they name another.
pub const DEFAULT_EMBEDDING_MODEL: &str = "text-embedding-3-small";

/// Decodes a Chat Completions event stream.
pub struct ChatStream {
    provider: &'static str,
    sse: SseDecoder,
    reply: ReplyBuilder,
    done: bool,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default, borrow)]
    model: Option<Text<'a>>,
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    /// Non-streamed completions carry `message` instead of `delta`.
    #[serde(default, borrow)]
    message: Option<Delta<'a>>,
    #[serde(default, borrow)]
    finish_reason: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Text<'a>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Text<'a>>,
    #[serde(default, borrow)]
    reasoning: Option<Text<'a>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<CallDelta<'a>>>,
}

#[derive(Deserialize)]
struct CallDelta<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    id: Option<Text<'a>>,
    #[serde(default, borrow)]
    function: Option<FunctionDelta<'a>>,
}

#[derive(Deserialize)]
struct FunctionDelta<'a> {
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
    #[serde(default, borrow)]
    arguments: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl From<FramingError> for ProviderError {
    fn from(error: FramingError) -> ProviderError {
        ProviderError::new(ProviderErrorKind::BadResponse, error.to_string())
    }
}

impl ChatStream {
    /// A decoder at the start of a stream from `provider`.
    pub fn new(provider: &'static str) -> ChatStream {
        ChatStream { provider, sse: SseDecoder::new(), reply: ReplyBuilder::default(), done: false }
    }

    /// Feeds the next piece of the body.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut dyn DeltaSink) -> Result<(), ProviderError> {
        let Self { provider, sse, reply, done } = self;
        sse.feed(bytes, |event| on_event(provider, event, reply, done, sink))
    }

    /// Ends the body and returns the reply. A stream cut before `[DONE]` and before any
    /// `finish_reason` is an error: the reply may be missing its end.
    pub fn finish(mut self, sink: &mut dyn DeltaSink) -> Result<ModelReply, ProviderError> {
        let Self { provider, sse, reply, done } = &mut self;
        // An event left at the end without its line end is usually `data: [DONE]`; when it
        // does not parse, the body was cut.
        let last = sse.finish(|event| on_event(provider, event, reply, done, sink));
        if !self.done && !self.reply.finished {
            let cut = if last.is_err() { ", its last chunk cut short" } else { "" };
            return Err(ProviderError::new(
                ProviderErrorKind::BadResponse,
                format!(
                    "{}: the stream ended before the reply was complete (no `[DONE]`{cut})",
                    self.provider
                ),
            ));
        }
        last?;
        Ok(self.reply.finish(sink))
    }
}

fn on_event(
    provider: &str,
    event: SseEvent<'_>,
    reply: &mut ReplyBuilder,
    done: &mut bool,
    sink: &mut dyn DeltaSink,
) -> Result<(), ProviderError> {
    if *done {
        return Ok(());
    }
    let data = event.data.trim();
    if data == "[DONE]" {
        *done = true;
        return Ok(());
    }
    if event.event == "error" || data.starts_with("{\"error\"") {
        return Err(stream_error(provider, data));
    }
    if data.is_empty() {
        return Ok(());
    }
    let chunk: Chunk<'_> = serde_json::from_str(data).map_err(|error| malformed(provider, data, &error))?;
    if chunk.error.is_some() {
        return Err(stream_error(provider, data));
    }
    apply_chunk(chunk, reply, sink);
    Ok(())
}

fn apply_chunk(chunk: Chunk<'_>, reply: &mut ReplyBuilder, sink: &mut dyn DeltaSink) {
    reply.answered_by(chunk.model.as_deref());
    if let Some(usage) = chunk.usage {
        reply.usage = Usage { input_tokens: usage.prompt_tokens, output_tokens: usage.completion_tokens };
    }
    for choice in chunk.choices {
        if let Some(delta) = choice.delta.or(choice.message) {
            if let Some(reasoning) = delta.reasoning_content.as_deref().or(delta.reasoning.as_deref()) {
                reply.reasoning(reasoning, sink);
            }
            if let Some(content) = &delta.content {
                reply.text(content, sink);
            }
            for (position, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                // `index` is the call's key; servers that omit it are keyed by id, else by order.
                let key = match (call.index, call.id.as_deref()) {
                    (Some(index), _) => index,
                    (None, Some(id)) => reply.call_key_by_id(id).unwrap_or(u64::MAX - position as u64),
                    (None, None) => reply.last_call_key().unwrap_or(0),
                };
                let function = call.function.as_ref();
                reply.call_fragment(
                    key,
                    call.id.as_deref(),
                    function.and_then(|f| f.name.as_deref()),
                    function.and_then(|f| f.arguments.as_deref()),
                );
            }
        }
        if let Some(reason) = &choice.finish_reason {
            reply.stopped(reason);
        }
    }
}

fn stream_error(provider: &str, data: &str) -> ProviderError {
    http::error_response(provider, None, data.as_bytes(), false)
}

fn malformed(provider: &str, data: &str, error: &serde_json::Error) -> ProviderError {
    ProviderError::new(
        ProviderErrorKind::BadResponse,
        format!("{provider}: a malformed chunk in the stream ({error}): {}", http::snippet(data.as_bytes())),
    )
}

/// A whole completion (a server that answered `stream: true` with plain JSON).
fn complete_from_json(
    provider: &str,
    body: &[u8],
    sink: &mut dyn DeltaSink,
) -> Result<ModelReply, ProviderError> {
    let text = std::str::from_utf8(body).map_err(|_| {
        ProviderError::new(
            ProviderErrorKind::BadResponse,
            format!("{provider}: the reply is not valid UTF-8"),
        )
    })?;
    let chunk: Chunk<'_> = serde_json::from_str(text).map_err(|error| malformed(provider, text, &error))?;
    if chunk.error.is_some() {
        return Err(stream_error(provider, text));
    }
    if chunk.choices.is_empty() {
        return Err(ProviderError::new(
            ProviderErrorKind::BadResponse,
            format!("{provider}: the reply has no choices: {}", http::snippet(body)),
        ));
    }
    let mut reply = ReplyBuilder::default();
    apply_chunk(chunk, &mut reply, sink);
    Ok(reply.finish(sink))
}
