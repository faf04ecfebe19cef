//! `compose` (code mode): one tool call that runs a short data-flow script of other tools.
//!
//! The call's input is `{ steps: [{ id, tool, input }] }`. The machine runs the steps one after
//! the other, each as an ordinary tool step (`tool:NAME:<call id>.<step id>`), so each is
//! journaled on its own and a replay re-runs none that completed. A step's input may take an
//! earlier step's output, or a part of it, with `{ "$from": "<id>", "$path": "a.b.0" }`; the
//! resolved input is validated against the step's tool schema like a top-level call. The
//! call's output is `{ steps: { <id>: output }, result: <the last output> }`; the first step that
//! fails fails the call, saying which step and why. Steps count against `max_tool_calls`.

use serde_json::{Map, Value};

use crate::error::ErrorCode;
use crate::tool::{ToolError, ToolSet};

/// The most steps a script may have (a longer one is refused whole, never cut).
pub const MAX_STEPS: usize = 16;

/// One step of a script.
#[derive(Clone, Debug)]
pub(crate) struct Step {
    pub(crate) id: String,
    pub(crate) tool: String,
    pub(crate) input: Value,
}

/// A script being run: its steps and the outputs so far.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) steps: Vec<Step>,
    pub(crate) next: usize,
    pub(crate) outputs: Map<String, Value>,
}

fn refused(message: String) -> ToolError {
    ToolError::with_code(ErrorCode::ToolInputInvalid, message, false)
}

impl Plan {
    /// Reads and checks a script: step count, ids, tools. (The shape was already validated
    /// against the compose tool's schema.)
    pub(crate) fn parse(input: &Value, tools: &ToolSet) -> Result<Plan, ToolError> {
        let items = input.get("steps").and_then(Value::as_array).cloned().unwrap_or_default();
        if items.is_empty() {
            return Err(refused("a compose script needs at least one step".into()));
        }
        if items.len() > MAX_STEPS {
            return Err(refused(format!(
                "a compose script has at most {MAX_STEPS} steps and this one has {}: split the work into several calls",
                items.len()
            )));
        }
        let mut steps = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            let id = item.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
            let tool = item.get("tool").and_then(Value::as_str).unwrap_or_default().to_owned();
            let valid_id = !id.is_empty()
                && id.len() <= 32
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid_id {
                return Err(refused(format!(
                    "step {index}: the id {id:?} must be 1-32 characters of A-Z, a-z, 0-9, `_` and `-`"
                )));
            }
            if steps.iter().any(|s: &Step| s.id == id) {
                return Err(refused(format!("two steps have the id `{id}`")));
            }
            if !tools.contains(&tool) {
                return Err(refused(format!("step `{id}`: there is no tool `{tool}`")));
            }
            let always_approved =
                matches!(tools.approval_rule(&tool), Some(crate::tool::ApprovalRule::Always));
            if tools.composes(&tool) || tools.asks_human(&tool) || always_approved {
                return Err(refused(format!(
                    "step `{id}`: `{tool}` cannot be composed (it composes, asks a human, or needs approval): call it on its own"
                )));
            }
            let input = item.get("input").cloned().unwrap_or_else(|| Value::Object(Map::new()));
            steps.push(Step { id, tool, input });
        }
        Ok(Plan { steps, next: 0, outputs: Map::new() })
    }

    /// The step to run next, with its references resolved.
    pub(crate) fn resolve_next(&self) -> Option<Result<(Step, Value), ToolError>> {
        let step = self.steps.get(self.next)?;
        Some(self.resolve(&step.input, &step.id).map(|input| (step.clone(), input)))
    }

    fn resolve(&self, value: &Value, step: &str) -> Result<Value, ToolError> {
        match value {
            Value::Object(map) if map.contains_key("$from") => {
                let from = map.get("$from").and_then(Value::as_str).unwrap_or_default();
                let extra = map.keys().find(|k| *k != "$from" && *k != "$path");
                if let Some(extra) = extra {
                    return Err(refused(format!(
                        "step `{step}`: a reference has `$from` and `$path` only, not `{extra}`"
                    )));
                }
                let Some(output) = self.outputs.get(from) else {
                    return Err(refused(format!(
                        "step `{step}` takes `$from: {from}`, which is not an earlier step (earlier: {})",
                        if self.outputs.is_empty() {
                            "none".to_owned()
                        } else {
                            self.outputs.keys().cloned().collect::<Vec<_>>().join(", ")
                        }
                    )));
                };
                let path = map.get("$path").and_then(Value::as_str).unwrap_or_default();
                let mut current = output;
                for segment in path.split('.').filter(|s| !s.is_empty()) {
                    let next = match current {
                        Value::Object(fields) => fields.get(segment),
                        Value::Array(items) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
                        _ => None,
                    };
                    current = next.ok_or_else(|| {
                        refused(format!("step `{step}`: the output of `{from}` has nothing at `{path}` (stopped at `{segment}`)"))
                    })?;
                }
                Ok(current.clone())
            }
            Value::Object(map) => {
                let mut resolved = Map::with_capacity(map.len());
                for (key, item) in map {
                    resolved.insert(key.clone(), self.resolve(item, step)?);
                }
                Ok(Value::Object(resolved))
            }
            Value::Array(items) => {
                items.iter().map(|item| self.resolve(item, step)).collect::<Result<_, _>>().map(Value::Array)
            }
            other => Ok(other.clone()),
        }
    }

    /// The call's output once every step succeeded.
    pub(crate) fn output(&self) -> Value {
        let last = self.steps.last().and_then(|s| self.outputs.get(&s.id)).cloned().unwrap_or(Value::Null);
        serde_json::json!({ "steps": self.outputs, "result": last })
    }
}

/// The JSON Schema of the compose tool's input, for the tools it may use.
pub fn input_schema(tools: &[&str]) -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_STEPS,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": { "type": "string", "pattern": "^[A-Za-z0-9_-]{1,32}$" },
                        "tool": { "type": "string", "enum": tools },
                        "input": { "type": "object", "description": "The tool's input; any value may be {\"$from\": \"<earlier step id>\", \"$path\": \"a.b.0\"}" }
                    },
                    "required": ["id", "tool", "input"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["steps"],
        "additionalProperties": false
    })
}
