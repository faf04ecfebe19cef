//! `ask_question`: the agent asks the human a free-text question.
//!
//! The tool is never called: the run loop sees [`Tool::asks_human`] and pauses the run instead
//! (state `awaiting_input`, event `question.asked`); the human's answer, journaled as the step
//! `question:CALL_ID`, becomes the call's output.

use keel_core::{BoxFuture, ErrorCode, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::{Value, json};

/// The built-in `ask_question` tool. See the module docs.
pub struct AskQuestion {
    spec: ToolSpec,
}

impl AskQuestion {
    /// The tool name.
    pub const NAME: &'static str = "ask_question";

    /// The tool.
    pub fn new() -> AskQuestion {
        AskQuestion {
            spec: ToolSpec {
                name: Self::NAME.to_owned(),
                description: "Ask the user a question and wait for their answer. Use it when you need \
                              information only the user has, or a choice only they can make. The \
                              answer comes back as text; it may take a while."
                    .to_owned(),
                input_schema: json!({
                    "type": "object",
                    "properties": {
                        "question": {
                            "type": "string",
                            "minLength": 1,
                            "description": "The question, complete and self-contained."
                        }
                    },
                    "required": ["question"],
                    "additionalProperties": false
                }),
            },
        }
    }
}

impl Default for AskQuestion {
    fn default() -> AskQuestion {
        AskQuestion::new()
    }
}

impl Tool for AskQuestion {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, _input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        // The run loop pauses for the human instead of calling this tool.
        Box::pin(std::future::ready(Err(ToolError::with_code(
            ErrorCode::Internal,
            "ask_question is answered by a human, not called; please report this bug",
            false,
        ))))
    }

    fn asks_human(&self) -> bool {
        true
    }
}
