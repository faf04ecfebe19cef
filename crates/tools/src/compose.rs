//! `compose` (code mode): the tool the model sees; the run loop runs its script (see
//! `keel_core::machine::compose`), so each step is a durable step of its own.

use keel_core::machine::compose::{MAX_STEPS, input_schema};
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::Value;

/// The `compose` tool.
pub struct ComposeTool {
    spec: ToolSpec,
}

impl ComposeTool {
    /// The tool's name.
    pub const NAME: &'static str = "compose";

    /// A compose tool over `tools` (the ones a script may call: not those that need approval or
    /// ask a human).
    pub fn new(tools: &[&str]) -> ComposeTool {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: format!(
                "Runs up to {MAX_STEPS} tool calls as one script, in order. A step's input may use an earlier step's output: put {{\"$from\": \"<step id>\", \"$path\": \"a.b.0\"}} where the value goes ($path is optional). Returns every step's output and the last one as `result`. Tools: {}.",
                tools.join(", ")
            ),
            input_schema: input_schema(tools),
        };
        ComposeTool { spec }
    }
}

impl Tool for ComposeTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn composes(&self) -> bool {
        true
    }

    fn call<'a>(&'a self, _input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async {
            Err(ToolError::failed(
                "compose is run by the agent loop, step by step; it is never called directly",
            ))
        })
    }
}
