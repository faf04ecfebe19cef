//! Subagents: another agent exposed as a tool.
//!
//! A call starts a child run of the subagent on a session of its own, derived from the parent's
//! run and call ids ([`SessionId::child`]), and returns the child's final answer. Because the
//! session is derived, a replay of the call (the parent crashed before journaling its result)
//! finds the child's run instead of starting a second one: a finished child gives its answer
//! again, an interrupted one is resumed from its journal. The child shares the parent's store.

use std::time::Duration;

use keel_core::error::ErrorCode;
use keel_core::{
    BoxFuture, Message, Role, SessionId, StopReason, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec,
};
use keel_runtime::{Engine, RunResult};
use serde_json::{Value, json};

/// How often a replayed call looks for its child's run to become claimable (its lease to
/// expire) while another process may still hold it.
const CLAIM_POLL: Duration = Duration::from_millis(200);

/// A subagent as a tool.
pub struct SubagentTool {
    spec: ToolSpec,
    engine: Engine,
}

impl SubagentTool {
    /// The agent run by `engine`, as the tool `name`.
    pub fn new(name: &str, description: Option<&str>, engine: Engine) -> SubagentTool {
        let what = description.map_or_else(|| format!("the `{name}` agent"), str::to_owned);
        let spec = ToolSpec {
            name: name.to_owned(),
            description: format!(
                "Delegates a task to a subagent: {what}. Give it the whole task in `input`; it answers with its final reply."
            ),
            input_schema: json!({
                "type": "object",
                "properties": { "input": { "type": "string", "minLength": 1, "description": "The task, in full" } },
                "required": ["input"],
                "additionalProperties": false
            }),
        };
        SubagentTool { spec, engine }
    }

    async fn run(&self, input: &str, ctx: &ToolContext) -> Result<RunResult, ToolError> {
        let session = ctx.session_id.child(&ctx.run_id, &ctx.call_id, &self.spec.name);
        let store = self.engine.store();
        let failed =
            |e: &dyn std::fmt::Display| ToolError::failed(format!("subagent `{}`: {e}", self.spec.name));
        loop {
            let messages = store.load_messages(&session).await.map_err(|e| failed(&e))?;
            if messages.is_empty() {
                match self.engine.start(session.clone(), Message::user(input)) {
                    Ok(handle) => return handle.result().await.map_err(|e| failed(&e.message)),
                    // Another process started it a moment ago: fall through to claiming it.
                    Err(error) if error.code == ErrorCode::SessionBusy => {}
                    Err(error) => return Err(failed(&error.message)),
                }
            } else if let Some(answer) = finished_answer(&messages) {
                // The call ran before (a replay): the child's run is over, its answer stands.
                return Ok(RunResult {
                    run_id: ctx.run_id.clone(),
                    session_id: session.clone(),
                    text: answer,
                    output: None,
                    stopped: StopReason::Final,
                    usage: Default::default(),
                    pending: Vec::new(),
                });
            }
            // The child's run was interrupted: resume it once its lease lets us.
            let handles = self.engine.recover(Some(&session)).await.map_err(|e| failed(&e.message))?;
            if let Some(handle) = handles.into_iter().next() {
                return handle.result().await.map_err(|e| failed(&e.message));
            }
            if !self.engine.pending(Some(&session)).await.map_err(|e| failed(&e.message))?.is_empty() {
                return Err(waiting(&self.spec.name, &session));
            }
            tokio::time::sleep(CLAIM_POLL).await;
        }
    }
}

/// The child's final answer, when its transcript ends with one.
fn finished_answer(messages: &[std::sync::Arc<Message>]) -> Option<String> {
    let last = messages.last()?;
    (last.role == Role::Assistant && last.tool_calls().next().is_none()).then(|| last.text())
}

fn waiting(name: &str, session: &SessionId) -> ToolError {
    ToolError::with_code(
        ErrorCode::ToolFailed,
        format!(
            "subagent `{name}` is waiting for a human (session {}): decide its pending approvals or questions (`keel approvals list`), then ask again",
            session.external()
        ),
        false,
    )
}

impl Tool for SubagentTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let task = input["input"].as_str().unwrap_or_default();
            let result = self.run(task, ctx).await?;
            match result.stopped {
                StopReason::AwaitingInput => Err(waiting(&self.spec.name, &result.session_id)),
                _ => Ok(result.output.unwrap_or(Value::String(result.text))),
            }
        })
    }
}
