//! Run events: what a run tells its observers, in order, as it goes.
//!
//! The JSON form (DESIGN.md §5, `docs/protocol.md`) is produced by [`crate::wire`].

use serde_json::Value;

use crate::error::ErrorCode;
use crate::ids::{RunId, SessionId};

/// Token usage of one model call, or summed over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens sent to the model.
    pub input_tokens: u64,
    /// Tokens the model produced.
    pub output_tokens: u64,
}

impl Usage {
    /// Input plus output tokens: what `limits.max_total_tokens` counts.
    pub fn total(self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Adds another usage to this one.
    pub fn add(&mut self, other: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
    }
}

/// Why a run stopped (the `stopped` field of `run.done`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The model gave a final answer (a reply without tool calls).
    Final,
    /// The run used `limits.max_turns` model calls and still wanted more.
    MaxTurns,
    /// A tool marked as a stop condition completed.
    StopCondition,
    /// `max_total_tokens` or `max_tool_calls` was spent.
    Budget,
    /// The run was cancelled.
    Cancelled,
    /// The run is paused until a human decides its pending approvals or answers its questions.
    /// Never on `run.done` (a paused run is not done); only in a run's result.
    AwaitingInput,
}

impl StopReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Final => "final",
            StopReason::MaxTurns => "max_turns",
            StopReason::StopCondition => "stop_condition",
            StopReason::Budget => "budget",
            StopReason::Cancelled => "cancelled",
            StopReason::AwaitingInput => "awaiting_input",
        }
    }

    /// Every stop reason, in the order the docs list them.
    pub const ALL: [StopReason; 6] = [
        StopReason::Final,
        StopReason::MaxTurns,
        StopReason::StopCondition,
        StopReason::Budget,
        StopReason::Cancelled,
        StopReason::AwaitingInput,
    ];

    /// Parses a wire name.
    pub fn parse(name: &str) -> Option<StopReason> {
        StopReason::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// One event of a run.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The run started (or was re-driven).
    RunStart {
        /// The run.
        run_id: RunId,
        /// Its session.
        session_id: SessionId,
    },
    /// A model call is about to be made; turns count from 0 within the run.
    TurnStart {
        /// The turn number.
        turn: u32,
    },
    /// A piece of the model's text, as it streams.
    TextDelta {
        /// The new text.
        delta: String,
    },
    /// A piece of the model's reasoning ("thinking"), as it streams, for models that show it.
    ReasoningDelta {
        /// The new text.
        delta: String,
    },
    /// The model call of this turn failed and is tried again as a whole: the text and
    /// reasoning deltas streamed since the turn's `turn.start` are void and will come again.
    /// Only the attempt that succeeds reaches the transcript.
    TurnRetry {
        /// The turn being retried.
        turn: u32,
        /// The attempt about to start (2 for the first retry).
        attempt: u32,
        /// Why the last attempt failed.
        code: ErrorCode,
        /// What went wrong.
        message: String,
        /// How long keel waits before the attempt.
        wait: std::time::Duration,
    },
    /// A tool call is starting.
    ToolStart {
        /// The call id.
        call_id: String,
        /// The tool.
        name: String,
        /// Its input.
        input: Value,
    },
    /// A tool call succeeded.
    ToolDone {
        /// The call id.
        call_id: String,
        /// The output as the model sees it (after the output cap).
        output: Value,
        /// How long the call ran, when it ran now (`None` for a result read from the journal,
        /// or a call refused without running).
        duration: Option<std::time::Duration>,
    },
    /// A tool call failed; the error went back to the model.
    ToolError {
        /// The call id.
        call_id: String,
        /// The error's stable code (`KEEL_TOOL_FAILED`, `KEEL_TOOL_REFUSED`...).
        code: crate::error::ErrorCode,
        /// What went wrong.
        error: String,
        /// How long the call ran, when it ran now (as for `ToolDone`).
        duration: Option<std::time::Duration>,
    },
    /// A tool call waits for a human's approval; the run pauses once nothing else is running.
    ApprovalRequested {
        /// What a decision names.
        approval_id: String,
        /// The call.
        call_id: String,
        /// The tool.
        tool: String,
        /// Its input.
        input: Value,
    },
    /// The agent asks the human a question (the `ask_question` tool); the run pauses.
    QuestionAsked {
        /// What an answer names.
        question_id: String,
        /// The question.
        question: String,
    },
    /// The final answer did not match `output.schema`: the model is shown why and asked again
    /// (`output.max_repairs`). The text streamed since the turn's `turn.start` was that answer.
    OutputRepair {
        /// The repair, from 1.
        attempt: u32,
        /// What was wrong with the answer.
        problem: String,
    },
    /// Older messages were summarised into one brief (`compaction`): the model now sees the
    /// brief and the `kept` latest messages.
    ContextCompacted {
        /// How many messages the brief replaces.
        summarized: u64,
        /// How many messages the model still sees as they are.
        kept: u64,
    },
    /// A tool replaced the session's state with a different value.
    StateUpdated {
        /// The new state.
        state: Value,
    },
    /// Usage of one model call.
    Usage(Usage),
    /// The run finished.
    RunDone {
        /// The final text.
        text: String,
        /// The structured output, when the agent has `output.schema`.
        output: Option<Value>,
        /// Why it stopped.
        stopped: StopReason,
        /// Usage summed over the run.
        usage: Usage,
    },
    /// The run paused: nothing is left to do until a human decides (its last event, in place
    /// of `run.done`).
    RunPaused {
        /// What it waits for.
        pending: Vec<crate::human::PendingInput>,
        /// Usage summed over the run so far.
        usage: Usage,
    },
    /// The run failed.
    RunError {
        /// The stable code.
        code: ErrorCode,
        /// What went wrong.
        message: String,
    },
}
