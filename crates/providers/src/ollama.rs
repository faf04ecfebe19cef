//! Ollama's native chat API (`POST /api/chat`, newline-delimited JSON).
//!
//! Each line is a partial message: `message.content` and `message.thinking` pieces, and tool
//! calls that arrive whole (`message.tool_calls[].function.arguments` is an object). The last
//! line has `done: true`, the stop reason and the token counts (`prompt_eval_count`,
//! `eval_count`). Images ride on a message's `images` (base64); a tool result is a `tool`
//! message with `tool_name`. Structured output uses `format` with the JSON Schema.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use keel_core::provider::ProviderErrorKind;
use keel_core::{
    BoxFuture, DeltaSink, Message, ModelReply, ModelRequest, Part, Provider, ProviderError, ProviderSettings,
    Role, ToolChoice,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::framing::NdjsonDecoder;
use crate::http;
use crate::openai::{function_tools, text_file, tool_result_parts};
use crate::reply::{ReplyBuilder, Text};

/// Where Ollama listens when `OLLAMA_HOST` is not set.
pub const DEFAULT_HOST: &str = "http://127.0.0.1:11434";

/// An Ollama server.
#[derive(Clone, Debug)]
pub struct OllamaChat {
    url: String,
    /// `{base_url}/api/embed`.
    embed_url: String,
    api_key: Option<String>,
    settings: ProviderSettings,
}

/// The base URL for an `OLLAMA_HOST` value, which may omit the scheme and the port
/// (`0.0.0.0`, `myhost:1234`, `https://ollama.example.com`), as Ollama's own clients accept.
pub fn host_url(host: &str) -> String {
    let host = host.trim().trim_end_matches('/');
    let (scheme, rest) = match host.split_once("://") {
        Some((scheme, rest)) => (scheme, rest),
        None => ("http", host),
    };
    // A server listening on every interface is reached on loopback.
    let rest = rest.replace("0.0.0.0", "127.0.0.1");
    let authority = rest.split('/').next().unwrap_or_default();
    let has_port = match authority.rsplit_once(':') {
        Some((_, port)) => {
            !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !authority.ends_with(']')
        }
        None => false,
    };
    let default_port = if scheme == "https" { "" } else { ":11434" };
    if has_port || authority.is_empty() {
        format!("{scheme}://{rest}")
    } else {
        let path = &rest[authority.len()..];
        format!("{scheme}://{authority}{default_port}{path}")
    }
}

impl OllamaChat {
    /// A request's headers: the key as a bearer token when set, then the spec's.
    fn headers(&self) -> Result<reqwest::header::HeaderMap, ProviderError> {
        let auth = self.api_key.as_ref().map(|key| format!("Bearer {key}"));
        let pairs: Vec<(&str, &str)> = auth.iter().map(|auth| ("authorization", auth.as_str())).collect();
        http::headers("ollama", &pairs, &self.settings.headers)
    }

    /// A client of `{base_url}/api/chat`. `api_key` is sent as a bearer token when set (for
    /// an Ollama behind an authenticating proxy, or ollama.com).
    pub fn new(base_url: &str, api_key: Option<String>, settings: ProviderSettings) -> OllamaChat {
        let base = base_url.trim_end_matches('/');
        OllamaChat {
            url: format!("{base}/api/chat"),
            embed_url: format!("{base}/api/embed"),
            api_key,
            settings,
        }
    }

    /// The endpoint's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The JSON body of a request.
    pub fn request_body(&self, request: &ModelRequest<'_>) -> Result<Value, ProviderError> {
        let settings = &self.settings;
        let mut messages = Vec::with_capacity(request.messages.len() + 1);
        if !request.instructions.is_empty() {
            messages.push(json!({ "role": "system", "content": request.instructions }));
        }
        for message in request.messages {
            push_message(message, &mut messages)?;
        }
        let mut body = Map::new();
        body.insert("model".into(), request.model.into());
        body.insert("messages".into(), messages.into());
        body.insert("stream".into(), true.into());
        // Ollama's API has no `tool_choice`: "none" is kept by offering no tools; a forced
        // call cannot be asked for.
        let choice = request.tool_choice.unwrap_or(&settings.tool_choice);
        if !request.tools.is_empty() && *choice != ToolChoice::None {
            body.insert("tools".into(), function_tools(request.tools).into());
        }
        if let Some(schema) = request.output_schema {
            body.insert("format".into(), schema.clone());
        }
        let mut options = Map::new();
        if let Some(max) = settings.max_tokens {
            options.insert("num_predict".into(), max.into());
        }
        if let Some(temperature) = settings.temperature {
            options.insert("temperature".into(), temperature.into());
        }
        if !options.is_empty() {
            body.insert("options".into(), options.into());
        }
        if settings.thinking_budget.is_some() || settings.reasoning_effort.is_some() {
            body.insert("think".into(), true.into());
        }
        Ok(Value::Object(body))
    }
}

fn push_message(message: &Message, out: &mut Vec<Value>) -> Result<(), ProviderError> {
    match message.role {
        Role::User => {
            let mut text = String::new();
            let mut images = Vec::new();
            for part in &message.parts {
                match part {
                    Part::Text(t) | Part::Summary { text: t, .. } => text.push_str(t),
                    Part::Image { data, .. } => images.push(Value::String(BASE64.encode(data))),
                    Part::File { media_type, name, data } => match text_file(media_type, data) {
                        Some(file) => {
                            let name = name.as_deref().unwrap_or("file");
                            text.push_str(&format!("\n<file name=\"{name}\">\n{file}\n</file>\n"));
                        }
                        None => {
                            return Err(ProviderError::new(
                                ProviderErrorKind::BadRequest,
                                format!(
                                    "ollama: a message cannot carry a `{media_type}` file (images and text files can)"
                                ),
                            ));
                        }
                    },
                    _ => {}
                }
            }
            let mut entry = json!({ "role": "user", "content": text });
            if !images.is_empty() {
                entry["images"] = images.into();
            }
            out.push(entry);
        }
        Role::Assistant => {
            let mut entry = json!({ "role": "assistant", "content": message.text() });
            let thinking = message.reasoning();
            if !thinking.is_empty() {
                entry["thinking"] = thinking.into();
            }
            let calls: Vec<Value> = message
                .tool_calls()
                .map(|call| {
                    let arguments = if call.input.is_object() { call.input.clone() } else { json!({}) };
                    json!({ "function": { "name": call.name, "arguments": arguments } })
                })
                .collect();
            if !calls.is_empty() {
                entry["tool_calls"] = calls.into();
            }
            out.push(entry);
        }
        Role::Tool => {
            for result in message.tool_results() {
                let (content, images) = tool_result_parts(result);
                let mut tool = json!({ "role": "tool", "tool_name": result.name, "content": content });
                if !images.is_empty() {
                    // Ollama takes images on any message, as base64.
                    tool["images"] = images.iter().map(|image| json!(image.data)).collect();
                }
                out.push(tool);
            }
        }
    }
    Ok(())
}

impl Provider for OllamaChat {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        Box::pin(async move {
            let body = self.request_body(&request)?;
            let headers = self.headers()?;
            let key = self.api_key.as_deref();
            let mut response =
                http::post("ollama", &self.url, headers, &body).await.map_err(|e| http::redact(e, key))?;
            if http::is_html(response.headers()) {
                let body = http::read_capped(response, 64 * 1024).await;
                return Err(http::error_response("ollama", Some(200), &body, true));
            }
            let mut decoder = ChatLines::new();
            while let Some(chunk) = http::next_chunk("ollama", &mut response).await? {
                decoder.feed(&chunk, sink).map_err(|e| http::redact(e, key))?;
            }
            decoder.finish(sink).map_err(|e| http::redact(e, key))
        })
    }

    fn default_embedding_model(&self) -> Option<&str> {
        Some(DEFAULT_EMBEDDING_MODEL)
    }

    fn embed<'a>(
        &'a self,
        model: &'a str,
        inputs: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, ProviderError>> {
        Box::pin(async move {
            let headers = self.headers()?;
            let key = self.api_key.as_deref();
            crate::embed::embed(
                "ollama",
                crate::embed::Wire::Ollama,
                &self.embed_url,
                headers,
                key,
                model,
                inputs,
            )
            .await
        })
    }
}

/// The embedding model Ollama agents use unless they name another (`ollama pull
/// nomic-embed-text`).
pub const DEFAULT_EMBEDDING_MODEL: &str = "nomic-embed-text";

/// Decodes an `/api/chat` NDJSON stream.
#[derive(Default)]
pub struct ChatLines {
    lines: NdjsonDecoder,
    reply: ReplyBuilder,
}

#[derive(Deserialize)]
struct LineJson<'a> {
    #[serde(default, borrow)]
    message: Option<MessageJson<'a>>,
    #[serde(default)]
    done: bool,
    #[serde(default, borrow)]
    done_reason: Option<Text<'a>>,
    #[serde(default, borrow)]
    model: Option<Text<'a>>,
    #[serde(default)]
    prompt_eval_count: Option<u64>,
    #[serde(default)]
    eval_count: Option<u64>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct MessageJson<'a> {
    #[serde(default, borrow)]
    content: Option<Text<'a>>,
    #[serde(default, borrow)]
    thinking: Option<Text<'a>>,
    #[serde(default)]
    tool_calls: Option<Vec<CallJson>>,
}

#[derive(Deserialize)]
struct CallJson {
    #[serde(default)]
    id: Option<String>,
    function: FunctionJson,
}

#[derive(Deserialize)]
struct FunctionJson {
    name: String,
    #[serde(default)]
    arguments: Value,
}

impl ChatLines {
    /// A decoder at the start of a stream.
    pub fn new() -> ChatLines {
        ChatLines::default()
    }

    /// Feeds the next piece of the body.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut dyn DeltaSink) -> Result<(), ProviderError> {
        let Self { lines, reply } = self;
        lines.feed(bytes, |line| on_line(line, reply, sink))
    }

    /// Ends the body and returns the reply; a stream cut before its `done: true` line is an
    /// error.
    pub fn finish(mut self, sink: &mut dyn DeltaSink) -> Result<ModelReply, ProviderError> {
        let Self { lines, reply } = &mut self;
        let last = lines.finish(|line| on_line(line, reply, sink));
        if !self.reply.finished {
            let cut = if last.is_err() { ", its last line cut short" } else { "" };
            return Err(ProviderError::new(
                ProviderErrorKind::BadResponse,
                format!("ollama: the stream ended before the reply was complete (no `\"done\": true`{cut})"),
            ));
        }
        last?;
        Ok(self.reply.finish(sink))
    }
}

fn on_line(line: &str, reply: &mut ReplyBuilder, sink: &mut dyn DeltaSink) -> Result<(), ProviderError> {
    if reply.finished {
        return Ok(());
    }
    let parsed: LineJson<'_> = serde_json::from_str(line).map_err(|error| {
        ProviderError::new(
            ProviderErrorKind::BadResponse,
            format!("ollama: a malformed line in the stream ({error}): {}", http::snippet(line.as_bytes())),
        )
    })?;
    if parsed.error.is_some() {
        return Err(http::error_response("ollama", None, line.as_bytes(), false));
    }
    if let Some(message) = parsed.message {
        if let Some(thinking) = message.thinking.as_deref() {
            reply.reasoning(thinking, sink);
        }
        if let Some(content) = message.content.as_deref() {
            reply.text(content, sink);
        }
        for call in message.tool_calls.into_iter().flatten() {
            let input = match call.function.arguments {
                Value::Null => json!({}),
                other => other,
            };
            reply.whole_call(call.id.as_deref(), &call.function.name, input);
        }
    }
    reply.answered_by(parsed.model.as_deref());
    if parsed.done {
        reply.stopped(parsed.done_reason.as_deref().unwrap_or("stop"));
        reply.usage.input_tokens = parsed.prompt_eval_count.unwrap_or(0);
        reply.usage.output_tokens = parsed.eval_count.unwrap_or(0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::host_url;

    #[test]
    fn ollama_host_forms() {
        assert_eq!(host_url("0.0.0.0"), "http://127.0.0.1:11434");
        assert_eq!(host_url("127.0.0.1:9999"), "http://127.0.0.1:9999");
        assert_eq!(host_url("myhost"), "http://myhost:11434");
        assert_eq!(host_url("http://myhost:80/"), "http://myhost:80");
        assert_eq!(host_url("https://ollama.example.com"), "https://ollama.example.com");
        assert_eq!(host_url("http://[::1]:11434"), "http://[::1]:11434");
        assert_eq!(host_url("http://box/ollama"), "http://box:11434/ollama");
    }
}
