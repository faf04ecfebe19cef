//! Testing agents: what `keel test` runs, offered to Rust code too.
//!
//! - [`Probe`]: attached to an agent ([`crate::AgentBuilder::probe`]), it records every tool
//!   dispatch (a tool really called, not replayed from the journal) and every step commit, and
//!   can call a hook at each: how `keel test --chaos` kills a run exactly at a step boundary and
//!   proves that no completed tool ran again.
//! - [`Observed`]: what a run did, read back from the store (tool calls with their inputs and
//!   outputs, final text, how it ended, the session's state, the transcript), with assertions.
//! - [`check`]: an agent's test case ([`TestCase`], from `tests/*.yaml`) against what a run
//!   did, as a list of readable [`Mismatch`]es; [`drive_case`] runs a case (deciding its
//!   approvals and answering its questions), or resumes it after a crash.
//!
//! ```
//! use keel::testing::{Observed, Probe};
//! use keel::{Agent, MockEntry, StopReason};
//! use serde_json::json;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let add = keel::function_tool("add", "Adds two numbers", |input: serde_json::Value| async move {
//!     Ok::<_, std::convert::Infallible>(input["a"].as_f64().unwrap_or(0.0) + input["b"].as_f64().unwrap_or(0.0))
//! });
//! let probe = Probe::new();
//! let agent = Agent::builder()
//!     .model("mock")
//!     .mock_script(keel::MockScript::new(vec![
//!         MockEntry::call("add", json!({"a": 2, "b": 3})),
//!         MockEntry::text("It is {{last_tool_output}}."),
//!     ]))
//!     .tool(add)
//!     .probe(&probe)
//!     .build()?;
//! let result = agent.run("s1", "What is 2 + 3?")?.result().await;
//! let run = Observed::read(&agent, "s1", result).await?;
//! run.assert_called("add", json!({"a": 2}));
//! assert_eq!(run.text, "It is 5.0.");
//! assert_eq!(run.stopped(), Some(StopReason::Final));
//! assert_eq!(probe.dispatches().len(), 1);
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use keel_core::{
    BoxFuture, Decision, Message, Part, PendingKind, RunFailure, RunId, SessionId, StepName, StopReason,
    Tool, ToolContext, ToolOutcome, ToolSpec,
};
use keel_runtime::{RunHandle, RunResult};
use serde_json::Value;

pub use keel_spec::{Expectations, ExpectedCall, ExpectedStop, TestCase, TextMatch, Verdict};

use crate::Agent;

/// How a test sets an agent up ([`crate::Agent::from_spec_with`]).
#[derive(Clone, Debug, Default)]
pub struct Setup {
    /// Records the agent's tool dispatches and step commits.
    pub probe: Option<Probe>,
    /// The time the clock tools (`current_date`, `day_name`) read instead of the clock, in
    /// this zone unless a call names another.
    pub now: Option<jiff::ZonedDateTime>,
}

/// A tool call that really ran (its tool was called: not replayed from the journal).
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatch {
    /// The run that called it (a subagent's own run for its tools).
    pub run_id: RunId,
    /// The tool.
    pub tool: String,
    /// The call id.
    pub call_id: String,
    /// The input it was called with.
    pub input: Value,
}

type DispatchHook = Arc<dyn Fn(&Dispatch) + Send + Sync>;
type CommitHook = Arc<dyn Fn(&RunId, &StepName) + Send + Sync>;

/// Records what an agent really does: each tool dispatch and each step commit, in order, with
/// optional hooks called at each (synchronously, on the run's task: a hook that blocks stops
/// the run there). Cloning shares the record.
#[derive(Clone, Default)]
pub struct Probe {
    inner: Arc<ProbeInner>,
}

#[derive(Default)]
struct ProbeInner {
    dispatches: Mutex<Vec<Dispatch>>,
    commits: Mutex<Vec<StepName>>,
    on_dispatch: Mutex<Option<DispatchHook>>,
    on_commit: Mutex<Option<CommitHook>>,
}

impl fmt::Debug for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probe").field("dispatches", &self.dispatches().len()).finish_non_exhaustive()
    }
}

impl Probe {
    /// A probe that records only.
    pub fn new() -> Probe {
        Probe::default()
    }

    /// Calls `hook` before each tool dispatch.
    #[must_use]
    pub fn on_dispatch(self, hook: impl Fn(&Dispatch) + Send + Sync + 'static) -> Probe {
        *lock(&self.inner.on_dispatch) = Some(Arc::new(hook));
        self
    }

    /// Calls `hook` with the run and the step after each step is durably committed (the
    /// journal holds its result).
    #[must_use]
    pub fn on_commit(self, hook: impl Fn(&RunId, &StepName) + Send + Sync + 'static) -> Probe {
        *lock(&self.inner.on_commit) = Some(Arc::new(hook));
        self
    }

    /// The tool dispatches so far, in order.
    pub fn dispatches(&self) -> Vec<Dispatch> {
        lock(&self.inner.dispatches).clone()
    }

    /// How many times `tool` was dispatched.
    pub fn dispatch_count(&self, tool: &str) -> usize {
        lock(&self.inner.dispatches).iter().filter(|d| d.tool == tool).count()
    }

    /// The steps committed so far, in order.
    pub fn commits(&self) -> Vec<StepName> {
        lock(&self.inner.commits).clone()
    }

    /// `tool`, recording its calls here.
    pub(crate) fn wrap(&self, tool: Arc<dyn Tool>) -> Arc<dyn Tool> {
        Arc::new(ProbedTool { inner: tool, probe: self.clone() })
    }

    pub(crate) fn committed(&self, run: &RunId, step: &StepName) {
        lock(&self.inner.commits).push(step.clone());
        let hook = lock(&self.inner.on_commit).clone();
        if let Some(hook) = hook {
            hook(run, step);
        }
    }

    fn dispatched(&self, dispatch: Dispatch) {
        let hook = lock(&self.inner.on_dispatch).clone();
        if let Some(hook) = hook {
            hook(&dispatch);
        }
        lock(&self.inner.dispatches).push(dispatch);
    }
}

/// A poisoned lock only means a hook panicked; the record is still good.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct ProbedTool {
    inner: Arc<dyn Tool>,
    probe: Probe,
}

impl Tool for ProbedTool {
    fn spec(&self) -> &ToolSpec {
        self.inner.spec()
    }

    fn asks_human(&self) -> bool {
        self.inner.asks_human()
    }

    fn composes(&self) -> bool {
        self.inner.composes()
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        self.probe.dispatched(Dispatch {
            run_id: ctx.run_id.clone(),
            tool: self.inner.spec().name.clone(),
            call_id: ctx.call_id.clone(),
            input: input.clone(),
        });
        self.inner.call(input, ctx)
    }
}

/// One tool call of a run, with its result.
#[derive(Clone, Debug, PartialEq)]
pub struct ObservedCall {
    /// The call id.
    pub call_id: String,
    /// The tool.
    pub name: String,
    /// The input the model gave.
    pub input: Value,
    /// The output (the error message when `is_error`); `None` when the call has no result
    /// (the run paused or stopped before it).
    pub output: Option<Value>,
    /// Whether the call failed.
    pub is_error: bool,
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// It stopped (`AwaitingInput`: paused for a human).
    Stopped(StopReason),
    /// It failed.
    Failed(RunFailure),
}

/// What a run did, read back from the store.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The run.
    pub run_id: Option<RunId>,
    /// The final text (empty when it failed or paused before answering).
    pub text: String,
    /// How it ended.
    pub ended: Ended,
    /// Its tool calls, in order.
    pub tool_calls: Vec<ObservedCall>,
    /// The session's state object afterwards (`null` when no tool set one).
    pub state: Value,
    /// The run's messages: its input, then every reply and tool result.
    pub transcript: Vec<Message>,
}

impl Observed {
    /// What the run that gave `result` did in `session`.
    pub async fn read(
        agent: &Agent,
        session: &str,
        result: Result<RunResult, RunFailure>,
    ) -> Result<Observed, RunFailure> {
        let session_id = SessionId::new(session)?;
        let store = agent.store();
        let failure = |e: keel_core::StoreError| RunFailure::new(e.code(), e.to_string());
        let messages = store.load_messages(&session_id).await.map_err(failure)?;
        let (run_id, text, ended) = match result {
            Ok(result) => (Some(result.run_id), result.text, Ended::Stopped(result.stopped)),
            Err(failure) => (None, String::new(), Ended::Failed(failure)),
        };
        let start = match &run_id {
            Some(run_id) => store.load_run(run_id).await.map_err(failure)?.map_or(0, |run| run.history_len),
            None => 0,
        };
        let transcript: Vec<Message> = messages
            .iter()
            .skip(usize::try_from(start).unwrap_or(usize::MAX))
            .map(|message| Message::clone(message))
            .collect();
        let state = agent.session_state(session).await?;
        Ok(Observed { run_id, text, ended, tool_calls: calls_of(&transcript), state, transcript })
    }

    /// The stop reason, unless the run failed.
    pub fn stopped(&self) -> Option<StopReason> {
        match &self.ended {
            Ended::Stopped(reason) => Some(*reason),
            Ended::Failed(_) => None,
        }
    }

    /// Panics unless the run called `tool` with an input that has `input`'s keys and values
    /// (a subset: the input may have more).
    #[track_caller]
    pub fn assert_called(&self, tool: &str, input: Value) {
        let found = self
            .tool_calls
            .iter()
            .any(|call| call.name == tool && subset_diff(&input, &call.input).is_none());
        assert!(
            found,
            "no call of `{tool}` with input {input}; the run's calls: {}",
            describe_calls(&self.tool_calls)
        );
    }

    /// Panics unless the run's tool calls are these tools, in this order.
    #[track_caller]
    pub fn assert_tools(&self, tools: &[&str]) {
        let names: Vec<&str> = self.tool_calls.iter().map(|call| call.name.as_str()).collect();
        assert_eq!(names, tools, "the run's calls: {}", describe_calls(&self.tool_calls));
    }
}

/// The tool calls of a transcript with their results, in call order.
fn calls_of(transcript: &[Message]) -> Vec<ObservedCall> {
    let mut calls: Vec<ObservedCall> = Vec::new();
    for part in transcript.iter().flat_map(|message| &message.parts) {
        match part {
            Part::ToolCall(call) => calls.push(ObservedCall {
                call_id: call.call_id.clone(),
                name: call.name.clone(),
                input: call.input.clone(),
                output: None,
                is_error: false,
            }),
            Part::ToolResult(result) => {
                if let Some(call) =
                    calls.iter_mut().find(|c| c.call_id == result.call_id && c.output.is_none())
                {
                    call.output = Some(result.output.clone());
                    call.is_error = result.is_error;
                }
            }
            _ => {}
        }
    }
    calls
}

fn describe_calls(calls: &[ObservedCall]) -> String {
    if calls.is_empty() {
        return "none".to_owned();
    }
    calls.iter().map(|call| format!("{}({})", call.name, call.input)).collect::<Vec<_>>().join(", ")
}

/// Runs `case` in `session` to its end: starts it (or, with `resume`, finishes the session's
/// run after a crash: recovers it, else replays it from its journal), then decides each
/// approval and answers each question the way the case says, one by one, until the run ends or
/// waits for a decision the case does not give.
pub async fn drive_case(
    agent: &Agent,
    case: &TestCase,
    session: &str,
    resume: Option<&RunId>,
) -> Result<Observed, RunFailure> {
    let mut handle: RunHandle = match resume {
        None => agent.run(session, case.input.as_str())?,
        Some(run_id) => match agent.recover(Some(session)).await?.into_iter().next() {
            Some(handle) => handle,
            None => agent.resume(run_id.clone()),
        },
    };
    loop {
        let result = handle.result().await;
        let paused = matches!(&result, Ok(r) if r.stopped == StopReason::AwaitingInput);
        if !paused {
            return Observed::read(agent, session, result).await;
        }
        let pending = agent.pending(Some(session)).await?;
        let mut next = None;
        for input in &pending {
            if let Some(decision) = decide(agent, case, session, input).await? {
                next = Some(agent.decide_as(&input.id, decision, "keel test").await?);
                break;
            }
        }
        match next {
            Some(continued) => handle = continued,
            None => return Observed::read(agent, session, result).await,
        }
    }
}

/// The case's decision on a pending input, if it has one.
async fn decide(
    agent: &Agent,
    case: &TestCase,
    session: &str,
    input: &keel_core::PendingInput,
) -> Result<Option<Decision>, RunFailure> {
    Ok(match &input.kind {
        PendingKind::Approval { tool, .. } => {
            case.approvals.iter().find(|(name, _)| name == tool).map(|(_, verdict)| match verdict {
                Verdict::Approve => Decision::Approve { note: None },
                Verdict::Reject(reason) => Decision::Reject { note: reason.clone() },
            })
        }
        PendingKind::Question { .. } => {
            // The n-th question of the session gets the n-th answer, however many processes
            // the run went through.
            let session_id = SessionId::new(session)?;
            let messages = agent
                .store()
                .load_messages(&session_id)
                .await
                .map_err(|e| RunFailure::new(e.code(), e.to_string()))?;
            let asked_before = messages
                .iter()
                .flat_map(|message| &message.parts)
                .filter_map(|part| match part {
                    Part::ToolCall(call) if agent.definition().tools.asks_human(&call.name) => {
                        Some(&call.call_id)
                    }
                    _ => None,
                })
                .take_while(|call_id| **call_id != input.call_id)
                .count();
            case.answers.get(asked_before).cloned().map(Decision::Answer)
        }
    })
}

/// One way a run differs from what its test case expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// What differs: `text`, `stop`, `state`, `tool_calls[1].input`...
    pub what: String,
    /// What the case expects, as written.
    pub expected: String,
    /// What the run did.
    pub actual: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}:", self.what)?;
        if self.expected.contains('\n') || self.actual.contains('\n') {
            let diff = similar::TextDiff::from_lines(&self.expected, &self.actual);
            for change in diff.iter_all_changes() {
                let sign = match change.tag() {
                    similar::ChangeTag::Delete => '-',
                    similar::ChangeTag::Insert => '+',
                    similar::ChangeTag::Equal => ' ',
                };
                write!(f, "    {sign} {}", change.value())?;
                if change.missing_newline() {
                    writeln!(f)?;
                }
            }
            Ok(())
        } else {
            writeln!(f, "    expected: {}", self.expected)?;
            writeln!(f, "    actual:   {}", self.actual)
        }
    }
}

fn mismatch(what: impl Into<String>, expected: impl Into<String>, actual: impl Into<String>) -> Mismatch {
    Mismatch { what: what.into(), expected: expected.into(), actual: actual.into() }
}

/// How `observed` differs from `expect` (empty: the case passes).
pub fn check(expect: &Expectations, observed: &Observed) -> Vec<Mismatch> {
    let mut out = Vec::new();
    if let Some(expected) = &expect.stop {
        let matches = match (expected, &observed.ended) {
            (ExpectedStop::Stopped(reason), Ended::Stopped(actual)) => reason == actual,
            (ExpectedStop::Failed(None), Ended::Failed(_)) => true,
            (ExpectedStop::Failed(Some(code)), Ended::Failed(failure)) => *code == failure.code,
            _ => false,
        };
        if !matches {
            let expected = match expected {
                ExpectedStop::Stopped(reason) => reason.as_str().to_owned(),
                ExpectedStop::Failed(None) => "failed".to_owned(),
                ExpectedStop::Failed(Some(code)) => format!("failed with {code}"),
            };
            out.push(mismatch("stop", expected, describe_end(&observed.ended)));
        }
    } else if let Ended::Failed(failure) = &observed.ended {
        // A failure nobody expected is always worth saying.
        out.push(mismatch(
            "stop",
            "the run to finish",
            format!("failed: {}: {}", failure.code, failure.message),
        ));
    }
    if let Some(expected) = &expect.tool_calls {
        check_calls(expected, &observed.tool_calls, &mut out);
    }
    if let Some(text) = &expect.text {
        let actual = &observed.text;
        let (ok, what, expected) = match text {
            TextMatch::Equals(expected) => {
                (expected.trim() == actual.trim(), "text", expected.trim().to_owned())
            }
            TextMatch::Contains(part) => {
                (actual.contains(part.as_str()), "text_contains", format!("text containing {part:?}"))
            }
            TextMatch::Matches(pattern) => {
                let ok = regex::Regex::new(pattern).is_ok_and(|re| re.is_match(actual));
                (ok, "text_matches", format!("text matching /{pattern}/"))
            }
        };
        if !ok {
            let actual = if matches!(text, TextMatch::Equals(_)) {
                actual.trim().to_owned()
            } else {
                format!("{actual:?}")
            };
            out.push(mismatch(what, expected, actual));
        }
    }
    if let Some(expected) = &expect.state
        && let Some((path, want, got)) = subset_diff(expected, &observed.state)
    {
        out.push(mismatch(format!("state{path}"), want, got));
    }
    out
}

fn describe_end(ended: &Ended) -> String {
    match ended {
        Ended::Stopped(reason) => reason.as_str().to_owned(),
        Ended::Failed(failure) => format!("failed: {}: {}", failure.code, failure.message),
    }
}

fn check_calls(expected: &[ExpectedCall], actual: &[ObservedCall], out: &mut Vec<Mismatch>) {
    let names =
        |calls: Vec<&str>| if calls.is_empty() { "no tool call".to_owned() } else { calls.join(", ") };
    let expected_names = names(expected.iter().map(|c| c.name.as_str()).collect());
    let actual_names = names(actual.iter().map(|c| c.name.as_str()).collect());
    if expected.len() != actual.len() || expected.iter().zip(actual).any(|(e, a)| e.name != a.name) {
        out.push(mismatch("tool_calls", expected_names, actual_names));
        return;
    }
    for (index, (want, got)) in expected.iter().zip(actual).enumerate() {
        let at = format!("tool_calls[{index}] ({})", want.name);
        if let Some(input) = &want.input
            && let Some((path, e, a)) = subset_diff(input, &got.input)
        {
            out.push(mismatch(format!("{at} input{path}"), e, a));
        }
        match (&want.output, &got.output) {
            (Some(output), Some(actual)) => {
                if let Some((path, e, a)) = subset_diff(output, actual) {
                    out.push(mismatch(format!("{at} output{path}"), e, a));
                }
            }
            (Some(output), None) => {
                out.push(mismatch(format!("{at} output"), output.to_string(), "no result"))
            }
            _ => {}
        }
        if let Some(error) = want.error
            && (error != got.is_error || got.output.is_none())
        {
            let describe = |failed: bool| if failed { "the call fails" } else { "the call succeeds" };
            let actual = match &got.output {
                None => "no result".to_owned(),
                Some(output) => format!("{}: {output}", describe(got.is_error)),
            };
            out.push(mismatch(format!("{at} error"), describe(error), actual));
        }
    }
}

/// Where `actual` fails to hold `expected` (objects may have more keys; lists must have the
/// same length; numbers compare by value): the JSON pointer, what was expected, what was found.
pub fn subset_diff(expected: &Value, actual: &Value) -> Option<(String, String, String)> {
    fn walk(expected: &Value, actual: &Value, path: &mut String) -> Option<(String, String, String)> {
        match (expected, actual) {
            (Value::Object(want), Value::Object(got)) => {
                for (key, value) in want {
                    let len = path.len();
                    path.push('/');
                    path.push_str(&key.replace('~', "~0").replace('/', "~1"));
                    let found = match got.get(key) {
                        Some(actual) => walk(value, actual, path),
                        None => Some((path.clone(), value.to_string(), "nothing (no such key)".to_owned())),
                    };
                    if found.is_some() {
                        return found;
                    }
                    path.truncate(len);
                }
                None
            }
            (Value::Array(want), Value::Array(got)) if want.len() == got.len() => {
                for (index, (value, actual)) in want.iter().zip(got).enumerate() {
                    let len = path.len();
                    path.push_str(&format!("/{index}"));
                    if let Some(found) = walk(value, actual, path) {
                        return Some(found);
                    }
                    path.truncate(len);
                }
                None
            }
            (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => None,
            _ if expected == actual => None,
            _ => Some((path.clone(), expected.to_string(), actual.to_string())),
        }
    }
    walk(expected, actual, &mut String::new())
}

/// Each message of a transcript on one line (role, then its parts): how `keel test --chaos`
/// shows where a resumed run differs from the clean one.
pub fn describe_transcript(transcript: &[Message]) -> String {
    let mut out = String::new();
    for message in transcript {
        let parts: Vec<String> = message
            .parts
            .iter()
            .map(|part| match part {
                Part::Text(text) => format!("{text:?}"),
                Part::ToolCall(call) => format!("call {}({}) [{}]", call.name, call.input, call.call_id),
                Part::ToolResult(result) => {
                    let kind = if result.is_error { "error" } else { "result" };
                    format!("{kind} of {} [{}]: {}", result.name, result.call_id, result.output)
                }
                Part::Summary { .. } => "summary".to_owned(),
                Part::Reasoning(_) => "reasoning".to_owned(),
                Part::Image { .. } => "image".to_owned(),
                Part::File { .. } => "file".to_owned(),
            })
            .collect();
        out.push_str(&format!("{}: {}\n", message.role.as_str(), parts.join(" | ")));
    }
    out
}

/// The model's replies of run `run`, read back from its journal, as a mock script that plays
/// them again: each model call of the conversation (`llm:turn:N`, in order) one entry with its
/// text and tool calls (a call that failed for good, its failure), each brief of a compaction
/// (`llm:compact:N`) one of `compact`. What `keel test --record` writes into a case, so that a
/// run against a real model is replayed offline from then on. The memory model's calls are not
/// in it (their outcomes are journaled, not their replies): played back, the mock writes its own.
pub async fn recorded_script(
    store: &dyn keel_core::Store,
    run: &RunId,
) -> Result<keel_core::MockScript, keel_core::StoreError> {
    use keel_core::journal::JournalRecord;
    use keel_core::{MockEntry, MockFailure, MockToolCall};

    fn entry(record: &JournalRecord) -> Option<MockEntry> {
        match record {
            JournalRecord::ModelReply(reply) => {
                let text = reply.message.text();
                let tool_calls = reply
                    .message
                    .parts
                    .iter()
                    .filter_map(|part| match part {
                        Part::ToolCall(call) => {
                            Some(MockToolCall { name: call.name.clone(), input: call.input.clone() })
                        }
                        _ => None,
                    })
                    .collect();
                Some(MockEntry {
                    text: Some(text).filter(|t| !t.is_empty()),
                    tool_calls,
                    ..MockEntry::default()
                })
            }
            JournalRecord::ModelFailed(error) => Some(MockEntry {
                error: Some(MockFailure {
                    status: error.status.unwrap_or(500),
                    message: error.message.clone(),
                    times: None,
                    partial: None,
                }),
                ..MockEntry::default()
            }),
            _ => None,
        }
    }

    let mut turns = Vec::new();
    let mut briefs = Vec::new();
    for journaled in store.load_journal(run).await? {
        match journaled.step {
            StepName::ModelTurn(n) => turns.extend(entry(&journaled.record).map(|e| (n, e))),
            StepName::Compact(n) => briefs.extend(entry(&journaled.record).map(|e| (n, e))),
            _ => {}
        }
    }
    turns.sort_by_key(|(n, _)| *n);
    briefs.sort_by_key(|(n, _)| *n);
    Ok(keel_core::MockScript {
        entries: turns.into_iter().map(|(_, e)| e).collect(),
        compact: briefs.into_iter().map(|(_, e)| e).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn subset_diff_names_the_first_difference() {
        assert_eq!(subset_diff(&json!({"a": 1}), &json!({"a": 1.0, "b": 2})), None);
        assert_eq!(
            subset_diff(&json!({"a": {"b": [1, 2]}}), &json!({"a": {"b": [1, 3]}})),
            Some(("/a/b/1".into(), "2".into(), "3".into()))
        );
        assert_eq!(
            subset_diff(&json!({"x": true}), &json!({})),
            Some(("/x".into(), "true".into(), "nothing (no such key)".into()))
        );
        assert_eq!(
            subset_diff(&json!([1]), &json!([1, 2])),
            Some((String::new(), "[1]".into(), "[1,2]".into()))
        );
    }

    #[test]
    fn a_multi_line_text_mismatch_is_a_line_diff() {
        let shown = mismatch("text", "one\ntwo\n", "one\nthree\n").to_string();
        assert_eq!(shown, "text:\n      one\n    - two\n    + three\n");
    }
}
