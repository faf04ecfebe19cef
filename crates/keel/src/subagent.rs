//! Subagents: another agent exposed as a tool.
//!
//! A call starts a child run of the subagent on a session of its own, both derived from the
//! parent's run and call ids ([`SessionId::child`], [`RunId::child_run`]), and returns the
//! child's final answer. Because they are derived, a replay of the call (the parent crashed
//! before journaling its result) finds the child's run instead of starting a second one: a
//! finished child gives its answer again, an interrupted one is resumed from its journal, a
//! failed one is reported. The child shares the parent's store.
//!
//! The child has a time budget (the parent's `limits.tool_timeout`, a little less, so that the
//! child is stopped first): past it the child's run is cancelled and the parent is told why.
//! A call dropped for any other reason (the parent's run cancelled) cancels the child too: no
//! child runs on for a parent that stopped waiting. A child that stops at its turn cap or its
//! budget reports that, with what it had, rather than passing for an answer.

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
    /// How long the child may run; `None`: as long as the parent's tool timeout lets it.
    budget: Option<Duration>,
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
        SubagentTool { spec, engine, budget: None }
    }

    /// The child may run for `budget` (give the parent's `limits.tool_timeout`: the child is
    /// stopped a little before it, so the parent hears why); past it its run is cancelled, and
    /// the call fails with `KEEL_TOOL_TIMEOUT`.
    pub fn with_budget(mut self, budget: Duration) -> SubagentTool {
        self.budget = Some(budget.saturating_sub((budget / 10).min(Duration::from_secs(2))));
        self
    }

    /// Waits for the child's run, within the budget; the child is cancelled when the budget
    /// runs out or the call is dropped.
    async fn finish(
        &self,
        handle: keel_runtime::RunHandle,
        session: &SessionId,
    ) -> Result<RunResult, ToolError> {
        let name = &self.spec.name;
        let mut guard = CancelOnDrop { engine: self.engine.clone(), session: session.clone(), armed: true };
        let result = match self.budget {
            None => handle.result().await,
            Some(budget) => match tokio::time::timeout(budget, handle.result()).await {
                Ok(result) => result,
                Err(_) => {
                    guard.armed = false;
                    let _ = self
                        .engine
                        .cancel(session, &format!("the parent's budget for subagent `{name}`"))
                        .await;
                    return Err(ToolError::with_code(
                        ErrorCode::ToolTimeout,
                        format!(
                            "subagent `{name}` used its time budget ({:.1} s) before it finished; its run was cancelled (its work so far is in session {})",
                            budget.as_secs_f64(),
                            session.external()
                        ),
                        false,
                    ));
                }
            },
        };
        guard.armed = false;
        result.map_err(|e| ToolError::failed(format!("subagent `{name}`: {}", e.message)))
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
                    Ok(handle) => return self.finish(handle, &session).await,
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
                    // Re-driven from its journal, the child gives its result again (its
                    // structured output and why it stopped), calling nothing.
                    match self.engine.resume(run_id.clone()).result().await {
                        Ok(result) => return Ok(result),
                        Err(failure) if failure.code == ErrorCode::RunFinished => {}
                        Err(failure) => return Err(failed(&failure.message)),
                    }
                    // Its journal was compacted: the answer is the transcript's last reply.
                    let messages = store.load_messages(&session).await.map_err(|e| failed(&e))?;
                    let text = final_text(&messages);
                    let output = self
                        .engine
                        .agent()
                        .output_schema
                        .is_some()
                        .then(|| serde_json::from_str::<Value>(&text).ok())
                        .flatten();
                    return Ok(RunResult {
                        run_id: run_id.clone(),
                        session_id: session.clone(),
                        text,
                        output,
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
                        return self.finish(handle, &session).await;
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

/// Cancels the child's run when the call is dropped before it ended.
struct CancelOnDrop {
    engine: Engine,
    session: SessionId,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (engine, session) = (self.engine.clone(), self.session.clone());
            runtime.spawn(async move {
                let _ = engine.cancel(&session, "its parent's call ended (timed out or cancelled)").await;
            });
        }
    }
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
            let name = &self.spec.name;
            let cut_short = |why: String| {
                let last = if result.text.trim().is_empty() {
                    "it had no reply yet".to_owned()
                } else {
                    format!("its last reply: {}", result.text.trim())
                };
                Err(ToolError::with_code(
                    ErrorCode::ToolFailed,
                    format!("subagent `{name}` {why}; {last}"),
                    false,
                ))
            };
            let max_turns = self.engine.agent().limits.max_turns;
            match result.stopped {
                StopReason::AwaitingInput => Err(waiting(name, &result.session_id)),
                StopReason::MaxTurns => cut_short(format!(
                    "stopped at its turn cap ({} model calls, its `limits.max_turns`) before it finished",
                    max_turns
                )),
                StopReason::Budget => cut_short(
                    "stopped when its budget (`limits.max_total_tokens` or `limits.max_tool_calls`) was spent, before it finished"
                        .to_owned(),
                ),
                StopReason::Cancelled => cut_short("was cancelled before it finished".to_owned()),
                StopReason::Final | StopReason::StopCondition => {
                    Ok(result.output.unwrap_or(Value::String(result.text)))
                }
            }
        })
    }
}
