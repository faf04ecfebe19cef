//! Subagents: another agent exposed as a tool.
//!
//! A call starts a child run of the subagent on a session of its own, both derived from the
//! parent's run and call ids ([`SessionId::child`], [`RunId::child_run`]), and returns the
//! child's final answer. Because they are derived, a replay of the call (the parent crashed
//! before journaling its result) finds the child's run instead of starting a second one: a
//! finished child gives its answer again, an interrupted one is resumed from its journal, a
//! failed one is reported. The child shares the parent's store.

use std::time::Duration;

use keel_core::error::ErrorCode;
use keel_core::{
    BoxFuture, Message, Role, RunId, RunState, SessionId, StopReason, Tool, ToolContext, ToolError,
    ToolOutcome, ToolSpec,
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
        let name = &self.spec.name;
        let session = ctx.session_id.child(&ctx.run_id, &ctx.call_id, name);
        let run_id = RunId::child_run(&ctx.run_id, &ctx.call_id, name);
        let store = self.engine.store();
        let failed = |e: &dyn std::fmt::Display| ToolError::failed(format!("subagent `{name}`: {e}"));
        loop {
            let record = store.load_run(&run_id).await.map_err(|e| failed(&e))?;
            let Some(record) = record else {
                match self.engine.start_with_id(run_id.clone(), session.clone(), Message::user(input)) {
                    Ok(handle) => return handle.result().await.map_err(|e| failed(&e.message)),
                    // Another process is starting it this very moment: look again.
                    Err(error) if error.code == ErrorCode::SessionBusy => {
                        tokio::time::sleep(CLAIM_POLL).await;
                        continue;
                    }
                    Err(error) => return Err(failed(&error.message)),
                }
            };
            // The call ran before (a replay): the child's run exists and is never started twice.
            match record.state {
                RunState::Done => {
                    let messages = store.load_messages(&session).await.map_err(|e| failed(&e))?;
                    return Ok(RunResult {
                        run_id: run_id.clone(),
                        session_id: session.clone(),
                        text: final_text(&messages),
                        output: None,
                        stopped: StopReason::Final,
                        usage: Default::default(),
                        pending: Vec::new(),
                    });
                }
                RunState::Failed | RunState::Cancelled => {
                    return Err(failed(&format!(
                        "its run {run_id} ended {} (session {})",
                        record.state.as_str(),
                        session.external()
                    )));
                }
                RunState::AwaitingInput => return Err(waiting(name, &session)),
                RunState::Running => {
                    // Interrupted (its lease expired): resume it from its journal. Still leased
                    // by a live process: wait for it.
                    let handles =
                        self.engine.recover(Some(&session)).await.map_err(|e| failed(&e.message))?;
                    if let Some(handle) = handles.into_iter().find(|h| h.run_id() == &run_id) {
                        return handle.result().await.map_err(|e| failed(&e.message));
                    }
                    tokio::time::sleep(CLAIM_POLL).await;
                }
            }
        }
    }
}

/// The text of the child's last assistant message (empty when it has none).
fn final_text(messages: &[std::sync::Arc<Message>]) -> String {
    messages.iter().rev().find(|m| m.role == Role::Assistant).map(|m| m.text()).unwrap_or_default()
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
