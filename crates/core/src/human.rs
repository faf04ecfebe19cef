//! Human input: approvals of tool calls and answers to questions.
//!
//! A tool call that needs approval, or a call of the `ask_question` tool, pauses its run. What
//! the run waits for is a [`PendingInput`], stored until a human decides it; the decision is
//! journaled as the step `approval:CALL_ID` or `question:CALL_ID`, so a re-driven run finds it
//! and never asks again. Pending ids are derived from the run and the call, so every replay of
//! the run names the same pending input.

use serde_json::Value;

use crate::error::{ErrorCode, RunFailure};
use crate::ids::{RunId, SessionId, StepName};

/// What a run waits for.
#[derive(Clone, Debug, PartialEq)]
pub enum PendingKind {
    /// A verdict on a tool call.
    Approval {
        /// The tool.
        tool: String,
        /// The input the model gave it.
        input: Value,
    },
    /// A free-text answer.
    Question {
        /// What the agent asks.
        question: String,
    },
}

impl PendingKind {
    /// `approval` or `question`.
    pub fn as_str(&self) -> &'static str {
        match self {
            PendingKind::Approval { .. } => "approval",
            PendingKind::Question { .. } => "question",
        }
    }
}

/// An approval or a question waiting for a human.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingInput {
    /// The id a decision names: `ap_...` for approvals, `qu_...` for questions.
    pub id: String,
    /// The paused run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// The tool call that waits.
    pub call_id: String,
    /// What is asked.
    pub kind: PendingKind,
    /// When it was first asked, in milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// When it is decided for the human: an approval is rejected, a question gets no answer.
    pub expires_at_ms: u64,
}

impl PendingInput {
    /// The step its decision is journaled as.
    pub fn step(&self) -> StepName {
        match self.kind {
            PendingKind::Approval { .. } => StepName::Approval(self.call_id.clone()),
            PendingKind::Question { .. } => StepName::Question(self.call_id.clone()),
        }
    }
}

/// A human's decision on a [`PendingInput`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run the tool call.
    Approve {
        /// Why, for the record.
        note: Option<String>,
    },
    /// Do not run it: the model gets an error result that says so (with the note).
    Reject {
        /// Why; the model sees it.
        note: Option<String>,
    },
    /// The answer to a question.
    Answer(String),
    /// Nobody decided before the pending input expired (`approvals.timeout`).
    TimedOut,
}

/// The id of the pending input for `call_id` of `run`: `ap_` or `qu_` and 16 hex digits of a
/// stable hash, the same on every replay and in every process.
pub fn pending_id(step: &StepName, run: &RunId) -> String {
    let prefix = match step {
        StepName::Question(_) => "qu_",
        _ => "ap_",
    };
    // Ids only need to be unique among one store's open approvals.
    let hash = crate::ids::stable_hash(&[run.as_str(), &step.to_string()]);
    format!("{prefix}{hash:016x}")
}

/// Checks that `decision` fits `pending`: approvals take approve or reject, questions an answer.
pub fn check_decision(pending: &PendingInput, decision: &Decision) -> Result<(), RunFailure> {
    match (&pending.kind, decision) {
        (_, Decision::TimedOut)
        | (PendingKind::Approval { .. }, Decision::Approve { .. } | Decision::Reject { .. })
        | (PendingKind::Question { .. }, Decision::Answer(_)) => Ok(()),
        (PendingKind::Approval { .. }, Decision::Answer(_)) => Err(RunFailure::new(
            ErrorCode::DecisionInvalid,
            format!("{} is an approval: approve or reject it, it takes no answer", pending.id),
        )),
        (PendingKind::Question { .. }, _) => Err(RunFailure::new(
            ErrorCode::DecisionInvalid,
            format!("{} is a question: answer it with text, it cannot be approved or rejected", pending.id),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_ids_are_stable_and_distinct() {
        let run = RunId::from_suffix("0190");
        let approval = pending_id(&StepName::Approval("call_0_1".into()), &run);
        // Pinned: ids are stored and typed by humans, they must not change between builds.
        assert_eq!(approval, "ap_a0a53a130da1eec6");
        let question = pending_id(&StepName::Question("call_0_1".into()), &run);
        assert!(question.starts_with("qu_"));
        assert_ne!(approval[3..], question[3..]);
        let other_run = pending_id(&StepName::Approval("call_0_1".into()), &RunId::from_suffix("0191"));
        assert_ne!(approval, other_run);
    }
}
