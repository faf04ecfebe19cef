//! Traces (OpenTelemetry): whether keel makes spans, the tracer every crate shares, and the W3C
//! trace context (`traceparent`) carried on outgoing HTTP requests.
//!
//! Spans cost nothing until the binary installs an exporter (`OTEL_EXPORTER_OTLP_ENDPOINT`):
//! before [`install`], [`tracer`] is `None` and no span is built. The spans follow the GenAI
//! semantic conventions; their names and attributes are in [`attributes`].

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use opentelemetry::global::BoxedTracer;

static TRACER: OnceLock<BoxedTracer> = OnceLock::new();
static RECORD_CONTENT: AtomicBool = AtomicBool::new(false);

/// Spans made but never delivered (the exporter failed or its queue was full): `/metrics`
/// shows them as `keel_otel_spans_dropped_total`.
pub static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// Turns spans on, with the global tracer provider the binary has set (and its propagator).
/// `record_content`: prompts, outputs and tool inputs and results go into spans too.
pub fn install(record_content: bool) {
    RECORD_CONTENT.store(record_content, Ordering::Relaxed);
    TRACER.get_or_init(|| opentelemetry::global::tracer("keel"));
}

/// The tracer, once spans are on.
pub fn tracer() -> Option<&'static BoxedTracer> {
    TRACER.get()
}

/// Whether spans carry content (`KEEL_OTEL_RECORD_CONTENT=true`); off by default.
pub fn record_content() -> bool {
    RECORD_CONTENT.load(Ordering::Relaxed)
}

/// The trace context of the span being polled, as HTTP headers (`traceparent`, and
/// `tracestate` when there is one); none while spans are off or outside a span.
pub fn trace_headers() -> Vec<(String, String)> {
    if TRACER.get().is_none() {
        return Vec::new();
    }
    let context = opentelemetry::Context::current();
    let mut headers: HashMap<String, String> = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut headers);
    });
    headers.into_iter().collect()
}

/// The names of the GenAI semantic conventions keel writes.
pub mod attributes {
    /// `invoke_agent`, `chat`, `execute_tool`.
    pub const OPERATION: &str = "gen_ai.operation.name";
    /// The provider (`openai`, `anthropic`, ...), by the conventions' older name.
    pub const SYSTEM: &str = "gen_ai.system";
    /// The provider, by the conventions' current name.
    pub const PROVIDER: &str = "gen_ai.provider.name";
    /// The model asked for.
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    /// The model that answered.
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    /// Why each reply stopped.
    pub const FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
    /// Input tokens.
    pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    /// Output tokens.
    pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    /// The agent's name.
    pub const AGENT_NAME: &str = "gen_ai.agent.name";
    /// The session.
    pub const CONVERSATION: &str = "gen_ai.conversation.id";
    /// The tool's name.
    pub const TOOL_NAME: &str = "gen_ai.tool.name";
    /// The tool call's id.
    pub const TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
    /// The tool's input (content: only with `KEEL_OTEL_RECORD_CONTENT=true`).
    pub const TOOL_ARGUMENTS: &str = "gen_ai.tool.call.arguments";
    /// The tool's output (content).
    pub const TOOL_RESULT: &str = "gen_ai.tool.call.result";
    /// The messages sent to the model (content).
    pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
    /// The model's reply (content).
    pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
    /// A failure's stable code (`KEEL_...`).
    pub const ERROR_TYPE: &str = "error.type";
    /// keel's run id.
    pub const RUN_ID: &str = "keel.run.id";
}
