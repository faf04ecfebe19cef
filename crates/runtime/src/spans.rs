//! A run's spans, after the GenAI semantic conventions: `invoke_agent <agent>` around the
//! run, `chat <model>` around each model call attempt, `execute_tool <tool>` around each
//! tool call. Made only once `keel_core::telemetry` is on; every function here returns `None`
//! (and costs a load) otherwise.
//!
//! A span's context is passed to the work it covers with `FutureExt::with_context`, so that
//! the providers and the HTTP tools find it (`Context::current()`) to send `traceparent`.
//! Steps replayed from the journal make no span: nothing was called.

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, StringValue, Value};

use keel_core::telemetry::{self, attributes as attr};
use keel_core::{AgentDef, ErrorCode, ModelRequest, ReplyInfo, RunId, SessionId, Usage};

/// The context a run started in (the caller's span: an HTTP request's `traceparent`), to
/// parent its `invoke_agent` span; `None` while spans are off.
pub(crate) fn parent() -> Option<Context> {
    telemetry::tracer().map(|_| Context::current())
}

/// The provider part of `provider/model`: `gen_ai.system`.
fn system(agent_model: &str) -> &str {
    agent_model.split_once('/').map_or(agent_model, |(provider, _)| provider)
}

/// Starts `invoke_agent <agent>` under `parent`.
pub(crate) fn invoke_agent(parent: Option<&Context>, agent: &AgentDef, run: &RunId) -> Option<Context> {
    let tracer = telemetry::tracer()?;
    let parent = parent.cloned().unwrap_or_else(Context::new);
    let system = system(&agent.model).to_owned();
    let span = tracer
        .span_builder(format!("invoke_agent {}", agent.name))
        .with_kind(SpanKind::Internal)
        .with_attributes([
            KeyValue::new(attr::OPERATION, "invoke_agent"),
            KeyValue::new(attr::AGENT_NAME, agent.name.clone()),
            KeyValue::new(attr::SYSTEM, system.clone()),
            KeyValue::new(attr::PROVIDER, system),
            KeyValue::new(attr::REQUEST_MODEL, agent.model.clone()),
            KeyValue::new(attr::RUN_ID, run.to_string()),
        ])
        .start_with_context(tracer, &parent);
    Some(parent.with_span(span))
}

/// The session of the run being polled, known once it is prepared.
pub(crate) fn conversation(session: &SessionId) {
    if telemetry::tracer().is_some() {
        Context::current().span().set_attribute(KeyValue::new(attr::CONVERSATION, session.to_string()));
    }
}

/// Ends `invoke_agent`: its usage, or its failure.
pub(crate) fn end_run(span: Option<Context>, outcome: Result<Usage, (ErrorCode, &str)>) {
    let Some(context) = span else { return };
    let span = context.span();
    match outcome {
        Ok(usage) => {
            span.set_attribute(KeyValue::new(attr::INPUT_TOKENS, usage.input_tokens as i64));
            span.set_attribute(KeyValue::new(attr::OUTPUT_TOKENS, usage.output_tokens as i64));
        }
        Err((code, message)) => fail(&span, code, message),
    }
    span.end();
}

/// Starts `chat <model>` under the current span, for one attempt of a model call.
pub(crate) fn chat(agent: &AgentDef, request: &ModelRequest<'_>) -> Option<Context> {
    let tracer = telemetry::tracer()?;
    let system = system(&agent.model).to_owned();
    let mut attributes = vec![
        KeyValue::new(attr::OPERATION, "chat"),
        KeyValue::new(attr::SYSTEM, system.clone()),
        KeyValue::new(attr::PROVIDER, system),
        KeyValue::new(attr::REQUEST_MODEL, request.model.to_owned()),
    ];
    if telemetry::record_content() {
        let messages: Vec<serde_json::Value> = request
            .messages
            .iter()
            .map(|message| serde_json::json!({"role": message.role.as_str(), "content": message.text()}))
            .collect();
        attributes.push(KeyValue::new(attr::INPUT_MESSAGES, serde_json::Value::Array(messages).to_string()));
    }
    let name = if request.model.is_empty() { "chat".to_owned() } else { format!("chat {}", request.model) };
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Client)
        .with_attributes(attributes)
        .start_with_context(tracer, &Context::current());
    Some(Context::current_with_span(span))
}

/// What the provider said of its reply, kept for the `chat` span (only while it is on).
#[derive(Default)]
pub(crate) struct Answered {
    response_model: Option<String>,
    finish_reason: Option<String>,
}

impl Answered {
    pub(crate) fn record(&mut self, info: ReplyInfo<'_>) {
        self.response_model = info.response_model.map(str::to_owned);
        self.finish_reason = info.finish_reason.map(str::to_owned);
    }
}

/// Ends `chat`: the reply's model, finish reason and usage, or the failure.
pub(crate) fn end_chat(
    span: Option<Context>,
    outcome: Result<(&keel_core::ModelReply, Answered), (ErrorCode, &str)>,
) {
    let Some(context) = span else { return };
    let span = context.span();
    match outcome {
        Ok((reply, answered)) => {
            if let Some(model) = answered.response_model {
                span.set_attribute(KeyValue::new(attr::RESPONSE_MODEL, model));
            }
            if let Some(reason) = answered.finish_reason {
                let reasons = Value::Array(vec![StringValue::from(reason)].into());
                span.set_attribute(KeyValue::new(attr::FINISH_REASONS, reasons));
            }
            span.set_attribute(KeyValue::new(attr::INPUT_TOKENS, reply.usage.input_tokens as i64));
            span.set_attribute(KeyValue::new(attr::OUTPUT_TOKENS, reply.usage.output_tokens as i64));
            if telemetry::record_content() {
                let text: String = reply
                    .parts
                    .iter()
                    .filter_map(|part| {
                        if let keel_core::Part::Text(text) = part { Some(text.as_str()) } else { None }
                    })
                    .collect();
                let output = serde_json::json!([{"role": "assistant", "content": text}]);
                span.set_attribute(KeyValue::new(attr::OUTPUT_MESSAGES, output.to_string()));
            }
        }
        Err((code, message)) => fail(&span, code, message),
    }
    span.end();
}

/// Starts `execute_tool <name>` under the current span.
pub(crate) fn execute_tool(name: &str, call_id: &str, input: &serde_json::Value) -> Option<Context> {
    let tracer = telemetry::tracer()?;
    let mut attributes = vec![
        KeyValue::new(attr::OPERATION, "execute_tool"),
        KeyValue::new(attr::TOOL_NAME, name.to_owned()),
        KeyValue::new(attr::TOOL_CALL_ID, call_id.to_owned()),
    ];
    if telemetry::record_content() {
        attributes.push(KeyValue::new(attr::TOOL_ARGUMENTS, input.to_string()));
    }
    let span = tracer
        .span_builder(format!("execute_tool {name}"))
        .with_kind(SpanKind::Internal)
        .with_attributes(attributes)
        .start_with_context(tracer, &Context::current());
    Some(Context::current_with_span(span))
}

/// Ends `execute_tool`: its result (as content), or its failure.
pub(crate) fn end_tool(span: Option<Context>, outcome: &keel_core::ToolOutcome) {
    let Some(context) = span else { return };
    let span = context.span();
    match outcome {
        Ok(output) if telemetry::record_content() => {
            span.set_attribute(KeyValue::new(attr::TOOL_RESULT, output.to_string()));
        }
        Ok(_) => {}
        Err(error) => fail(&span, error.code, &error.message),
    }
    span.end();
}

fn fail(span: &opentelemetry::trace::SpanRef<'_>, code: ErrorCode, message: &str) {
    span.set_attribute(KeyValue::new(attr::ERROR_TYPE, code.as_str()));
    span.set_status(Status::error(message.to_owned()));
}
