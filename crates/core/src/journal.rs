//! The step journal: each completed step's result, keyed by (run, step name).
//!
//! Re-driving a run replays the loop; a step found in the journal returns its recorded result
//! instead of running again, so a model call is never paid twice and a completed tool never
//! re-runs. The persisted encoding of these records is versioned: see [`crate::persist`].

use std::sync::Arc;

use crate::event::Usage;
use crate::human::Decision;
use crate::ids::StepName;
use crate::message::{Message, Role};
use crate::provider::ModelReply;
use crate::tool::ToolOutcome;

/// The recorded result of one step.
#[derive(Clone, Debug, PartialEq)]
pub enum JournalRecord {
    /// A model call's reply (step `llm:turn:N` or `llm:compact:N`).
    ModelReply(JournaledReply),
    /// A model call that failed for good (after retries). Recorded because the run may go on
    /// from it (a compaction that failed, a context-too-long error that compaction answers): a
    /// replay must take the same path.
    ModelFailed(crate::provider::ProviderError),
    /// A memory step's outcome (step `memory:NAME`).
    Memory(crate::memory::MemoryOutcome),
    /// A tool call's outcome (step `tool:NAME:CALL_ID`), before the output cap is applied.
    ToolResult(ToolOutcome),
    /// A human's decision (step `approval:CALL_ID` or `question:CALL_ID`).
    Decision(Decision),
}

/// One journal entry.
#[derive(Clone, Debug, PartialEq)]
pub struct JournalEntry {
    /// The step.
    pub step: StepName,
    /// Its result.
    pub record: JournalRecord,
}

/// A model call's reply as the journal keeps it and the run reads it: the assistant message
/// exactly as the model wrote it (before the run gave its tool calls usable ids), and the tokens
/// the call used.
///
/// The message is shared: a reply the run keeps as it is (the usual case) is one allocation for
/// the journal entry and the transcript both, rather than a copy of every part for each.
#[derive(Clone, Debug, PartialEq)]
pub struct JournaledReply {
    /// The reply's parts, as an assistant message.
    pub message: Arc<Message>,
    /// Tokens used by the call.
    pub usage: Usage,
}

impl From<ModelReply> for JournaledReply {
    fn from(reply: ModelReply) -> JournaledReply {
        JournaledReply {
            message: Arc::new(Message { role: Role::Assistant, parts: reply.parts }),
            usage: reply.usage,
        }
    }
}
