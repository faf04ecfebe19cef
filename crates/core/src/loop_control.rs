//! How code and configuration steer the run loop beyond its limits: repair turns for answers
//! that do not match the output schema, compaction of long conversations, and the Rust hooks
//! (`prepare_turn`, `repair_tool_call`, `on_step_finish`).
//!
//! Hooks run inside the deterministic loop (or, for `on_step_finish`, after a step is durably
//! committed), so they must be deterministic too: given the same transcript they must decide the
//! same way, or a run re-driven from its journal would take another path than the one recorded.

use std::sync::Arc;

use crate::agent::ToolChoice;
use crate::event::Usage;
use crate::ids::{RunId, SessionId, StepName};
use crate::journal::JournalRecord;
use crate::message::{Message, ToolCall};
use crate::tool::{ToolError, ToolSpec};

/// The agent's loop controls (spec keys `output.max_repairs`, `compaction`; Rust hooks).
#[derive(Clone)]
pub struct LoopControl {
    /// How many repair turns a final answer that does not match `output.schema` gets: the model
    /// is shown the validation error and asked again. 0 fails the run at once.
    pub max_repairs: u32,
    /// Summarise older messages when the conversation grows too long.
    pub compaction: Option<Compaction>,
    /// Rust code called by the loop.
    pub hooks: Hooks,
}

impl LoopControl {
    /// The default number of repair turns (`output.max_repairs`).
    pub const DEFAULT_MAX_REPAIRS: u32 = 1;
}

impl Default for LoopControl {
    fn default() -> LoopControl {
        LoopControl { max_repairs: Self::DEFAULT_MAX_REPAIRS, compaction: None, hooks: Hooks::default() }
    }
}

impl std::fmt::Debug for LoopControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopControl")
            .field("max_repairs", &self.max_repairs)
            .field("compaction", &self.compaction)
            .field("hooks", &self.hooks)
            .finish()
    }
}

/// Compaction (spec key `compaction`): when the messages the model would see exceed
/// `max_messages`, the older ones are summarised into one brief by a journaled `llm:compact:N`
/// step, and the model sees the brief plus the `keep_recent` latest messages. A tool call is
/// never separated from its result. The full transcript stays in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// Compact when the model would see more messages than this.
    pub max_messages: usize,
    /// How many of the latest messages stay as they are (a few more when that would split a
    /// tool call from its result).
    pub keep_recent: usize,
    /// The model that writes the brief (same provider), when not the agent's.
    pub model: Option<String>,
}

impl Compaction {
    /// Checks the numbers: `keep_recent` must leave something to summarise.
    pub fn check(&self) -> Result<(), String> {
        if self.max_messages < 2 {
            return Err(format!("`max_messages` is {}: it must be at least 2", self.max_messages));
        }
        if self.keep_recent >= self.max_messages {
            return Err(format!(
                "`keep_recent` ({}) must be smaller than `max_messages` ({}): otherwise nothing is ever summarised",
                self.keep_recent, self.max_messages
            ));
        }
        Ok(())
    }
}

/// Decides, before each model call, what that call is given (hook `prepare_turn`).
pub type PrepareTurn = Arc<dyn Fn(&TurnContext<'_>) -> TurnPlan + Send + Sync>;
/// Offers a fixed call for one the loop refused (an unknown tool, arguments that are not JSON or
/// do not match the schema); `None` keeps the refusal (hook `repair_tool_call`).
pub type RepairToolCall = Arc<dyn Fn(&ToolCall, &ToolError) -> Option<ToolCall> + Send + Sync>;
/// Told about each step once it is durably committed (hook `on_step_finish`).
pub type OnStepFinish = Arc<dyn Fn(&StepFinished<'_>) + Send + Sync>;

/// Rust hooks into the loop. See the module docs: they must be deterministic.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Before each model call.
    pub prepare_turn: Option<PrepareTurn>,
    /// When a tool call is refused before it runs.
    pub repair_tool_call: Option<RepairToolCall>,
    /// After each new step's commit (not for steps replayed from the journal).
    pub on_step_finish: Option<OnStepFinish>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("prepare_turn", &self.prepare_turn.is_some())
            .field("repair_tool_call", &self.repair_tool_call.is_some())
            .field("on_step_finish", &self.on_step_finish.is_some())
            .finish()
    }
}

/// What `prepare_turn` sees.
#[derive(Debug)]
pub struct TurnContext<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// Its session.
    pub session_id: &'a SessionId,
    /// The turn about to be made (from 0 within the run).
    pub turn: u32,
    /// The messages the model would see (after compaction).
    pub messages: &'a [Arc<Message>],
    /// The tools the model would be offered.
    pub tools: &'a [ToolSpec],
    /// Usage so far in the run.
    pub usage: Usage,
}

/// What `prepare_turn` decides; every `None` keeps the default.
#[derive(Clone, Debug, Default)]
pub struct TurnPlan {
    /// Another model of the same provider for this call (the name without the provider prefix).
    pub model: Option<String>,
    /// Other instructions for this call.
    pub instructions: Option<String>,
    /// Other messages for this call (say, with a reminder appended). Not stored: the
    /// transcript keeps what really happened.
    pub messages: Option<Vec<Arc<Message>>>,
    /// Offer only these tools (by name) this turn; a call of another tool is refused.
    pub tools: Option<Vec<String>>,
    /// Whether and which tool the model must call this turn.
    pub tool_choice: Option<ToolChoice>,
}

/// What `on_step_finish` is told.
#[derive(Debug)]
pub struct StepFinished<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// Its session.
    pub session_id: &'a SessionId,
    /// The step.
    pub step: &'a StepName,
    /// What it recorded in the journal.
    pub record: &'a JournalRecord,
}
