//! The [`Tool`] trait, and [`ToolSet`]: an agent's tools with their compiled input schemas.
//!
//! A tool is erased (`Arc<dyn Tool>`) at the registry. Typed tools are written with
//! `keel_tools::function_tool`, which derives the input schema and normalises here.

use std::fmt;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::BoxFuture;
use crate::error::ErrorCode;
use crate::ids::{RunId, SessionId};

/// What a model is told about a tool.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    /// The name the model calls it by: 1-64 characters of `A-Za-z0-9_-`.
    pub name: String,
    /// What it does and when to use it.
    pub description: String,
    /// The JSON Schema its input must match.
    pub input_schema: Value,
}

/// The session's state object, as one tool call sees it: a JSON value the session's tools can
/// read and replace (a shopping cart, a form being filled, notes), kept with the session.
///
/// A replacement is written with the call's result, in the same store commit: it is durable
/// exactly when the call is, and a call that fails or is cancelled changes nothing. Parallel calls
/// of one turn see the state as it was when they started plus their own replacement; the last to
/// finish wins.
#[derive(Clone, Debug, Default)]
pub struct SessionState {
    /// The run's view of the state, as committed.
    committed: Arc<Mutex<Value>>,
    /// This call's replacement, not committed yet.
    staged: Arc<Mutex<Option<Value>>>,
}

impl SessionState {
    /// The state of a run's session as stored (`Value::Null` for none).
    pub fn new(current: Value) -> SessionState {
        SessionState { committed: Arc::new(Mutex::new(current)), staged: Arc::default() }
    }

    /// A view for one call: the same committed state, its own replacement slot.
    pub fn for_call(&self) -> SessionState {
        SessionState { committed: Arc::clone(&self.committed), staged: Arc::default() }
    }

    /// The state: this call's replacement if it made one, else the committed state.
    pub fn get(&self) -> Value {
        let staged = lock(&self.staged);
        match &*staged {
            Some(value) => value.clone(),
            None => lock(&self.committed).clone(),
        }
    }

    /// Replaces the state (committed with the call's result).
    pub fn replace(&self, value: Value) {
        *lock(&self.staged) = Some(value);
    }

    /// Takes this call's replacement, making it the run's committed view, when it differs from
    /// that view (a replacement with an equal value changes nothing). For the runtime, which
    /// writes it with the call's result and tells observers (`state.updated`).
    pub fn commit_staged(&self) -> Option<Value> {
        let value = lock(&self.staged).take()?;
        let mut committed = lock(&self.committed);
        if *committed == value {
            return None;
        }
        committed.clone_from(&value);
        Some(value)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The values are replaced whole, so a panic while holding the lock leaves nothing half-done.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a tool call knows about where it runs.
#[derive(Clone, Debug)]
pub struct ToolContext {
    /// The run making the call.
    pub run_id: RunId,
    /// The run's session.
    pub session_id: SessionId,
    /// The call id.
    pub call_id: String,
    /// `<run_id>:<step>`: the same on every attempt of this call, so a tool can dedupe side
    /// effects when a crash makes the call run again.
    pub idempotency_key: String,
    /// The session's state object (see [`SessionState`]).
    pub state: SessionState,
}

/// A tool failure. It goes back to the model as an error result; it does not fail the run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    /// The stable code.
    pub code: ErrorCode,
    /// What went wrong, written for the model (and the human reading the transcript).
    pub message: String,
    /// Whether trying again later might succeed.
    pub transient: bool,
}

impl ToolError {
    /// A tool's own failure (`KEEL_TOOL_FAILED`), not transient.
    pub fn failed(message: impl Into<String>) -> ToolError {
        ToolError { code: ErrorCode::ToolFailed, message: message.into(), transient: false }
    }

    /// A failure with a specific code.
    pub fn with_code(code: ErrorCode, message: impl Into<String>, transient: bool) -> ToolError {
        ToolError { code, message: message.into(), transient }
    }
}

/// The outcome of one tool call, as journaled.
pub type ToolOutcome = Result<Value, ToolError>;

/// A tool the model can call.
///
/// Implementations must be cancel safe in the sense that dropping the returned future stops the
/// work (a command tool kills its process group): the runtime drops it on timeout and cancel.
pub trait Tool: Send + Sync {
    /// The tool's name, description and input schema.
    fn spec(&self) -> &ToolSpec;

    /// Runs the tool. `input` has already been validated against the input schema.
    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome>;

    /// Whether this tool is a question to the human (the built-in `ask_question`): instead of
    /// calling it, the run pauses until the question (the input's `question`) is answered, and
    /// the answer is the call's output.
    fn asks_human(&self) -> bool {
        false
    }

    /// Whether this tool is `compose` (code mode): instead of calling it, the run loop runs its
    /// input's `steps` (calls of other tools, each its own durable step) and their outputs are
    /// the call's output. See [`crate::machine`].
    fn composes(&self) -> bool {
        false
    }
}

impl<T: Tool + ?Sized> Tool for Arc<T> {
    fn spec(&self) -> &ToolSpec {
        (**self).spec()
    }

    fn asks_human(&self) -> bool {
        (**self).asks_human()
    }

    fn composes(&self) -> bool {
        (**self).composes()
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        (**self).call(input, ctx)
    }
}

/// Why a set of tools could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolSetError {
    /// Two tools have the same name.
    #[error("two tools are named `{0}`: tool names must be unique")]
    Duplicate(String),
    /// A name has characters models reject.
    #[error("invalid tool name {0:?}: use 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`")]
    InvalidName(String),
    /// An approval rule names a tool the set does not have.
    #[error("approvals name tool `{0}`, which the agent does not have")]
    Unknown(String),
    /// An input schema is not a valid JSON Schema.
    #[error("the input schema of tool `{name}` is not a valid JSON Schema: {reason}")]
    InvalidSchema {
        /// The tool.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

/// Checks a tool name: 1-64 characters of `A-Za-z0-9_-` (what OpenAI and Anthropic accept).
pub fn validate_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// When a tool call needs a human's approval before it runs.
#[derive(Clone)]
pub enum ApprovalRule {
    /// Every call.
    Always,
    /// The calls whose (validated) input makes the predicate true.
    When(Arc<dyn Fn(&Value) -> bool + Send + Sync>),
}

impl fmt::Debug for ApprovalRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApprovalRule::Always => f.write_str("Always"),
            ApprovalRule::When(_) => f.write_str("When(..)"),
        }
    }
}

/// How a tool call is carried out ([`ToolSet::dispatch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatch {
    /// The `compose` tool: its steps are run by the machine.
    Compose,
    /// A question to the human: the run waits for the answer.
    AskHuman,
    /// A call that waits for a human's approval first.
    Approval,
    /// A call run at once.
    Run,
}

/// An agent's tools, with their input schemas compiled once.
#[derive(Default)]
pub struct ToolSet {
    tools: Vec<Arc<dyn Tool>>,
    specs: Vec<ToolSpec>,
    validators: Vec<jsonschema::Validator>,
    /// By name. A fast hash: the names are the agent's own, and a name the model makes up is
    /// only looked up (never inserted), so there is no table to flood.
    index: foldhash::HashMap<String, usize>,
    /// Approval rules, by tool index (empty when no tool needs approval).
    approvals: Vec<Option<ApprovalRule>>,
}

impl fmt::Debug for ToolSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl ToolSet {
    /// Builds the set, checking names and compiling every input schema.
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Result<ToolSet, ToolSetError> {
        let mut set = ToolSet::default();
        for tool in tools {
            let spec = tool.spec().clone();
            if !validate_tool_name(&spec.name) {
                return Err(ToolSetError::InvalidName(spec.name));
            }
            if set.index.contains_key(&spec.name) {
                return Err(ToolSetError::Duplicate(spec.name));
            }
            let validator = compile_input_schema(&spec.input_schema)
                .map_err(|reason| ToolSetError::InvalidSchema { name: spec.name.clone(), reason })?;
            set.index.insert(spec.name.clone(), set.tools.len());
            set.tools.push(tool);
            set.specs.push(spec);
            set.validators.push(validator);
        }
        Ok(set)
    }

    /// The specs, in the order the tools were given (what the model is shown).
    pub fn specs(&self) -> &[ToolSpec] {
        &self.specs
    }

    /// The tool names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.specs.iter().map(|s| s.name.as_str())
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.index.get(name).map(|&i| &self.tools[i])
    }

    /// Whether there is a tool called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Makes calls of tool `name` wait for a human's approval, per `rule`.
    pub fn require_approval(&mut self, name: &str, rule: ApprovalRule) -> Result<(), ToolSetError> {
        let &i = self.index.get(name).ok_or_else(|| ToolSetError::Unknown(name.to_owned()))?;
        self.approvals.resize(self.tools.len(), None);
        self.approvals[i] = Some(rule);
        Ok(())
    }

    /// Whether this call of tool `name` (its input already validated) needs approval.
    pub fn needs_approval(&self, name: &str, input: &Value) -> bool {
        let Some(&i) = self.index.get(name) else { return false };
        match self.approvals.get(i) {
            Some(Some(ApprovalRule::Always)) => true,
            Some(Some(ApprovalRule::When(predicate))) => predicate(input),
            _ => false,
        }
    }

    /// How a call of tool `name` (its input already validated) is carried out, found with one
    /// lookup: what [`ToolSet::composes`], [`ToolSet::asks_human`] and
    /// [`ToolSet::needs_approval`] answer one by one, in that order of precedence.
    pub fn dispatch(&self, name: &str, input: &Value) -> Dispatch {
        let Some(&i) = self.index.get(name) else { return Dispatch::Run };
        let tool = &self.tools[i];
        if tool.composes() {
            return Dispatch::Compose;
        }
        if tool.asks_human() {
            return Dispatch::AskHuman;
        }
        match self.approvals.get(i) {
            Some(Some(ApprovalRule::Always)) => Dispatch::Approval,
            Some(Some(ApprovalRule::When(predicate))) if predicate(input) => Dispatch::Approval,
            _ => Dispatch::Run,
        }
    }

    /// Whether tool `name` is a question to the human (see [`Tool::asks_human`]).
    pub fn asks_human(&self, name: &str) -> bool {
        self.get(name).is_some_and(|tool| tool.asks_human())
    }

    /// Whether `name` is the `compose` tool (see [`Tool::composes`]).
    pub fn composes(&self, name: &str) -> bool {
        self.get(name).is_some_and(|tool| tool.composes())
    }

    /// The approval rule of tool `name`, if it has one.
    pub fn approval_rule(&self, name: &str) -> Option<&ApprovalRule> {
        self.index.get(name).and_then(|&i| self.approvals.get(i)).and_then(Option::as_ref)
    }

    /// Whether calls of `name` may need approval (a rule of any kind is set).
    pub fn has_approval_rule(&self, name: &str) -> bool {
        self.index.get(name).is_some_and(|&i| matches!(self.approvals.get(i), Some(Some(_))))
    }

    /// Checks an input against the tool's schema, describing every problem found.
    pub fn validate_input(&self, name: &str, input: &Value) -> Result<(), String> {
        let Some(&i) = self.index.get(name) else {
            return Err(format!("unknown tool `{name}`"));
        };
        let validator = &self.validators[i];
        if validator.is_valid(input) {
            return Ok(());
        }
        let problems: Vec<String> = validator
            .iter_errors(input)
            .take(5)
            .map(|error| {
                let path = error.instance_path().to_string();
                if path.is_empty() { error.to_string() } else { format!("{path}: {error}") }
            })
            .collect();
        if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) }
    }
}

/// Compiles a tool input schema, the same way [`ToolSet::new`] does; used by spec loaders to
/// report an invalid schema where it was written.
pub fn compile_input_schema(schema: &Value) -> Result<jsonschema::Validator, String> {
    check_schema(schema).map_err(|problem| problem.to_string())
}

/// Why a schema is not a valid JSON Schema, and where in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaProblem {
    /// The JSON pointer of the part at fault (`/properties/city/type`; empty: the whole).
    pub pointer: String,
    /// What is wrong with it, in words.
    pub message: String,
}

impl std::fmt::Display for SchemaProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pointer.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "at `{}`: {}", self.pointer.trim_start_matches('/').replace('/', "."), self.message)
        }
    }
}

/// Compiles `schema`, or says what in it is wrong: a misspelled `type` is named as such, with
/// the types there are, rather than as the meta-schema's `anyOf` failure.
///
/// A schema is JSON Schema 2020-12 unless its `$schema` says otherwise. jsonschema checks it
/// against its draft's meta-schema first, with a validator generated when keel is compiled (the
/// `macros` feature), so the first schema a process compiles costs what any other does.
pub fn check_schema(schema: &Value) -> Result<jsonschema::Validator, SchemaProblem> {
    if !schema.is_object() {
        return Err(SchemaProblem {
            pointer: String::new(),
            message: "the schema must be a JSON object (usually `{\"type\": \"object\", ...}`)".into(),
        });
    }
    jsonschema::validator_for(schema).map_err(|error| {
        let pointer = error.instance_path().to_string();
        let message = if pointer == "/type" || pointer.ends_with("/type") {
            format!(
                "{} is not a type: write one of array, boolean, integer, null, number, object, string (or a list of them)",
                error.instance()
            )
        } else {
            error.to_string()
        };
        SchemaProblem { pointer, message }
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A schema's own `$schema` picks its draft: draft 7 checks `format`, 2020-12 only notes it.
    #[test]
    fn a_schema_is_2020_12_unless_it_says_otherwise() {
        let mail = json!({"mail": "nope"});
        let plain = json!({"type": "object", "properties": {"mail": {"type": "string", "format": "email"}}});
        assert!(check_schema(&plain).unwrap().is_valid(&mail));
        let mut draft7 = plain.clone();
        draft7["$schema"] = json!("http://json-schema.org/draft-07/schema#");
        assert!(!check_schema(&draft7).unwrap().is_valid(&mail));
        // Keywords of 2020-12 alone are checked.
        let pair = json!({"type": "array", "prefixItems": [{"type": "string"}]});
        assert!(!check_schema(&pair).unwrap().is_valid(&json!([1])));
    }

    #[test]
    fn a_wrong_schema_is_reported_as_2020_12_reports_it() {
        let problem =
            check_schema(&json!({"type": "object", "properties": {"city": {"type": "strng"}}})).unwrap_err();
        assert_eq!(problem.pointer, "/properties/city/type");
        assert!(problem.message.starts_with("\"strng\" is not a type"), "{}", problem.message);
        let problem =
            check_schema(&json!({"type": "object", "properties": {"n": {"minLength": -1}}})).unwrap_err();
        assert_eq!(problem.pointer, "/properties/n/minLength");
        assert_eq!(
            problem.message,
            jsonschema::validator_for(&json!({"type": "object", "properties": {"n": {"minLength": -1}}}))
                .unwrap_err()
                .to_string()
        );
        assert!(check_schema(&json!(["not", "a", "schema"])).is_err());
    }
}
