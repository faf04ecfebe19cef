//! Assembles a streamed reply: text and reasoning as they arrive, tool calls from their
//! argument fragments, usage. Shared by every wire format so that they agree on the edge cases.

use std::borrow::Cow;
use std::fmt;

use keel_core::event::Usage;
use keel_core::message::{Reasoning, ToolCall};
use keel_core::{DeltaSink, ModelReply, Part};
use serde::Deserialize;
use serde_json::Value;

/// A JSON string borrowed from the chunk when it has no escapes, owned otherwise.
///
/// `#[serde(borrow)]` borrows a `Cow<str>` field but not an `Option<Cow<str>>` (serde always
/// allocates those), and every optional text field of a chunk is an `Option`: this type borrows
/// in both places, which saves an allocation per streamed delta.
#[derive(Debug)]
pub(crate) struct Text<'a>(pub(crate) Cow<'a, str>);

impl std::ops::Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Visitor(std::marker::PhantomData))
    }
}

/// A tool call being streamed.
#[derive(Debug, Default)]
struct CallBuilder {
    /// The wire's key for the call (OpenAI's `index`, Anthropic's block index).
    key: u64,
    id: String,
    name: String,
    /// Argument fragments, concatenated.
    arguments: String,
    /// Arguments that came whole, as JSON (Ollama).
    input: Option<Value>,
}

/// A reply under construction.
#[derive(Debug, Default)]
pub(crate) struct ReplyBuilder {
    parts: Vec<Part>,
    calls: Vec<CallBuilder>,
    pub(crate) usage: Usage,
    /// The provider said why it stopped (`finish_reason`, `stop_reason`, `done`).
    pub(crate) finished: bool,
    /// Why, in its words, when it said.
    pub(crate) finish_reason: Option<String>,
    /// The model that answered, when the provider named it.
    pub(crate) response_model: Option<String>,
}

impl ReplyBuilder {
    /// Why the provider stopped: the reply is complete.
    pub(crate) fn stopped(&mut self, reason: &str) {
        self.finished = true;
        if self.finish_reason.is_none() {
            self.finish_reason = Some(reason.to_owned());
        }
    }

    /// The model the provider says answered (the first it names).
    pub(crate) fn answered_by(&mut self, model: Option<&str>) {
        if self.response_model.is_none()
            && let Some(model) = model.filter(|m| !m.is_empty())
        {
            self.response_model = Some(model.to_owned());
        }
    }

    /// A piece of the answer's text.
    pub(crate) fn text(&mut self, delta: &str, sink: &mut dyn DeltaSink) {
        if delta.is_empty() {
            return;
        }
        sink.text_delta(delta);
        match self.parts.last_mut() {
            Some(Part::Text(text)) => text.push_str(delta),
            _ => self.parts.push(Part::Text(delta.to_owned())),
        }
    }

    /// A piece of the model's reasoning: it extends the last part when that is reasoning not
    /// signed yet (a signature closes an Anthropic thinking block).
    pub(crate) fn reasoning(&mut self, delta: &str, sink: &mut dyn DeltaSink) {
        if delta.is_empty() {
            return;
        }
        sink.reasoning_delta(delta);
        match self.parts.last_mut() {
            Some(Part::Reasoning(reasoning)) if reasoning.signature.is_none() => {
                reasoning.text.push_str(delta)
            }
            _ => {
                self.parts.push(Part::Reasoning(Reasoning { text: delta.to_owned(), ..Reasoning::default() }))
            }
        }
    }

    /// Starts a new reasoning part, even when the previous part is reasoning too (Anthropic
    /// signs each thinking block on its own).
    pub(crate) fn start_reasoning(&mut self) {
        self.parts.push(Part::Reasoning(Reasoning::default()));
    }

    /// Starts a new text part (Anthropic text blocks stay separate).
    pub(crate) fn start_text(&mut self) {
        self.parts.push(Part::Text(String::new()));
    }

    /// The signature of the reasoning part started last.
    pub(crate) fn signature(&mut self, signature: &str) {
        if let Some(Part::Reasoning(reasoning)) = self.parts.last_mut() {
            reasoning.signature.get_or_insert_with(String::new).push_str(signature);
        }
    }

    /// Reasoning the provider encrypted.
    pub(crate) fn redacted_reasoning(&mut self, data: &str) {
        self.parts
            .push(Part::Reasoning(Reasoning { redacted: Some(data.to_owned()), ..Reasoning::default() }));
    }

    /// A fragment of tool call `key`: any of its id, its name and a piece of its arguments.
    /// Servers differ: some repeat the id and name in every fragment, some send the name only
    /// once; an id or name is taken the first time it is seen.
    pub(crate) fn call_fragment(
        &mut self,
        key: u64,
        id: Option<&str>,
        name: Option<&str>,
        arguments: Option<&str>,
    ) {
        let call = match self.calls.iter().position(|c| c.key == key) {
            Some(at) => &mut self.calls[at],
            None => {
                self.calls.push(CallBuilder { key, ..CallBuilder::default() });
                self.calls.last_mut().expect("just pushed")
            }
        };
        if let Some(id) = id.filter(|id| !id.is_empty())
            && call.id.is_empty()
        {
            call.id.push_str(id);
        }
        if let Some(name) = name.filter(|name| !name.is_empty())
            && call.name.is_empty()
        {
            call.name.push_str(name);
        }
        if let Some(arguments) = arguments {
            call.arguments.push_str(arguments);
        }
    }

    /// The key of the call with this id, for wires that identify fragments by id only.
    pub(crate) fn call_key_by_id(&self, id: &str) -> Option<u64> {
        self.calls.iter().find(|c| c.id == id).map(|c| c.key)
    }

    /// The key of the call streamed last.
    pub(crate) fn last_call_key(&self) -> Option<u64> {
        self.calls.last().map(|c| c.key)
    }

    /// A whole tool call (Ollama sends them in one piece).
    pub(crate) fn whole_call(&mut self, id: Option<&str>, name: &str, input: Value) {
        let key = self.calls.len() as u64;
        self.calls.push(CallBuilder {
            key,
            id: id.unwrap_or_default().to_owned(),
            name: name.to_owned(),
            input: Some(input),
            ..CallBuilder::default()
        });
    }

    /// The reply: its text and reasoning parts in order, then its tool calls in order.
    ///
    /// Arguments that are empty (a tool without parameters) become `{}`; arguments that are not
    /// JSON are kept as a JSON string, which the run turns into a tool error the model can fix.
    pub(crate) fn finish(self, sink: &mut dyn DeltaSink) -> ModelReply {
        sink.reply_info(keel_core::ReplyInfo {
            response_model: self.response_model.as_deref(),
            finish_reason: self.finish_reason.as_deref(),
        });
        let mut parts: Vec<Part> = self
            .parts
            .into_iter()
            .filter(|part| match part {
                Part::Text(text) => !text.is_empty(),
                Part::Reasoning(r) => !r.text.is_empty() || r.signature.is_some() || r.redacted.is_some(),
                _ => true,
            })
            .collect();
        for call in self.calls {
            let input = match call.input {
                Some(input) => input,
                None if call.arguments.trim().is_empty() => Value::Object(serde_json::Map::new()),
                None => serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments)),
            };
            parts.push(Part::ToolCall(ToolCall { call_id: call.id, name: call.name, input }));
        }
        ModelReply { parts, usage: self.usage }
    }
}
