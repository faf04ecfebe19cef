//! keel-core: the domain of keel, with no I/O and no async runtime.
//!
//! This crate owns what every other keel crate agrees on:
//!
//! - the conversation types ([`Message`], [`Part`]) and the run [`Event`]s;
//! - the agent definition ([`AgentDef`]) with its limits and tools;
//! - the run loop as a deterministic state machine ([`machine::Machine`]): inputs in, actions
//!   out, so it can be tested by asserting actions and replayed from a journal;
//! - the step journal and its versioned record format ([`journal`]);
//! - the seams the runtime drives: the [`Provider`], [`Tool`] and [`Store`] traits;
//! - cron schedules and their fire times ([`schedule`]);
//! - errors with stable codes ([`ErrorCode`]).
//!
//! The traits return boxed futures ([`BoxFuture`]) rather than using an async runtime, so that
//! this crate stays runtime-agnostic and the traits stay object safe.

pub mod agent;
pub mod channel;
pub mod clock;
pub mod env;
pub mod error;
pub mod event;
pub mod event_log;
pub mod human;
pub mod ids;
pub mod journal;
pub mod loop_control;
pub mod machine;
pub mod memory;
pub mod message;
pub mod owner;
pub mod persist;
pub mod provider;
pub mod schedule;
pub mod store;
pub mod telemetry;
pub mod tool;
pub mod wire;

pub use agent::{
    AgentDef, CommandToolDef, Concurrency, HttpSettings, LimitOverrides, Limits, McpServerDef, McpTransport,
    MockEntry, MockFailure, MockScript, MockToolCall, ProviderSettings, RetryPolicy, SearchBackendKind,
    SearchSettings, ShellSettings, ToolChoice, WorkspaceMode, WorkspaceSettings,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{ErrorCode, RunFailure};
pub use event::{Event, StopReason, Usage};
pub use event_log::{EventLog, LogWake, LoggedEvent, NewEvent};
pub use human::{Decision, PendingInput, PendingKind};
pub use ids::{RunId, SessionId, StepName};
pub use loop_control::{Compaction, Hooks, LoopControl, StepFinished, TurnContext, TurnPlan};
pub use message::{Message, Part, Role};
pub use provider::{
    CallPurpose, DeltaSink, ModelReply, ModelRequest, Provider, ProviderError, ProviderErrorKind, ReplyInfo,
};
pub use store::{
    Claim, Committed, DecidedInput, DelayedRun, DelayedRunRecord, DelayedState, Fence, LeaseStatus, OpenRun,
    RunRecord, RunState, SessionFilter, SessionScope, SessionSnapshot, SessionSummary, StepCommit, Store,
    StoreError, StoreFuture,
};
pub use tool::{ApprovalRule, SessionState, Tool, ToolContext, ToolError, ToolOutcome, ToolSet, ToolSpec};

/// A boxed, sendable future: what the [`Provider`], [`Tool`] and [`Store`] traits return.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
