//! keel: a runtime for durable AI agents.
//!
//! Define an agent in Rust (or load one from a spec file or an agent directory), run it, and
//! stream its events. Every model call and tool call is a journaled step: a run re-driven after a
//! crash repeats no completed step.
//!
//! ```
//! use keel::{Agent, MockEntry, MockScript, MockToolCall, StopReason};
//! use schemars::JsonSchema;
//! use serde::Deserialize;
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct AddInput {
//!     a: f64,
//!     b: f64,
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let add = keel::function_tool("add", "Adds two numbers", |input: AddInput| async move {
//!     Ok::<_, std::convert::Infallible>(input.a + input.b)
//! });
//! // The mock model calls `add`, then answers with its output: runs offline.
//! let script = MockScript::new(vec![
//!         MockEntry {
//!             tool_calls: vec![MockToolCall { name: "add".into(), input: serde_json::json!({"a": 2, "b": 3}) }],
//!             ..MockEntry::default()
//!         },
//!         MockEntry { text: Some("{{last_tool_output}}".into()), ..MockEntry::default() },
//!     ]);
//! let agent = Agent::builder()
//!     .name("calculator")
//!     .instructions("Add numbers with the add tool.")
//!     .model("mock")
//!     .mock_script(script)
//!     .tool(add)
//!     .build()?;
//!
//! let result = agent.run("session-1", "What is 2 + 3?")?.result().await?;
//! assert_eq!(result.text, "5.0");
//! assert_eq!(result.stopped, StopReason::Final);
//! # Ok(())
//! # }
//! ```

mod agent;
pub mod allocator;
pub mod features;
#[cfg(feature = "mcp")]
pub mod mcp;
mod subagent;
pub mod testing;

pub use agent::{Agent, AgentBuilder, LoadError, load_options, load_spec};
pub use keel_core::loop_control::{Compaction, StepFinished, TurnContext, TurnPlan};
pub use keel_core::machine::RunOutcome;
/// Memory settings and records ([`AgentBuilder::memory`]).
pub use keel_core::memory;
pub use keel_core::schedule::{CronSchedule, Missed, ScheduleDef};
pub use keel_core::wire::{event_to_json, event_type};
pub use keel_core::{
    AgentDef, BoxFuture, Clock, CommandToolDef, Concurrency, DecidedInput, Decision, DeltaSink, ErrorCode,
    Event, LimitOverrides, Limits, ManualClock, Message, MockEntry, MockFailure, MockScript, MockToolCall,
    ModelReply, ModelRequest, OpenRun, Part, PendingInput, PendingKind, Provider, ProviderError, RetryPolicy,
    Role, RunFailure, RunId, RunState, SessionId, SessionState, SessionSummary, StopReason, Store,
    StoreError, StoreFuture, SystemClock, Tool, ToolChoice, ToolContext, ToolError, ToolOutcome, ToolSpec,
    Usage,
};
pub use keel_providers::MockProvider;
pub use keel_runtime::{RunHandle, RunOptions, RunResult, Triggers, record_decision, who};
pub use keel_spec::{AgentSpec, Diagnostic, Severity};
#[cfg(feature = "postgres")]
pub use keel_store::PostgresStore;
pub use keel_store::{MemoryStore, SqliteStore};
pub use keel_tools::{AskQuestion, CommandTool, function_tool, function_tool_with_context};
pub use subagent::SubagentTool;
