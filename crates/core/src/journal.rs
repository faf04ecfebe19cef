//! The step journal: each completed step's result, keyed by (run, step name).
//!
//! Re-driving a run replays the loop; a step found in the journal returns its recorded result
//! instead of running again, so a model call is never paid twice and a completed tool never
//! re-runs. The persisted encoding of these records is versioned: see [`crate::persist`].

use crate::human::Decision;
use crate::ids::StepName;
use crate::provider::ModelReply;
use crate::tool::ToolOutcome;

/// The recorded result of one step.
#[derive(Clone, Debug, PartialEq)]
pub enum JournalRecord {
    /// A model call's reply (step `llm:turn:N` or `llm:compact:N`).
    ModelReply(ModelReply),
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
