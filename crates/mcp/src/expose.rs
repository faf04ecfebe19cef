//! The other direction: an agent as an MCP server, one tool `agent_<name>` (`{input, sessionId?}`)
//! that runs a turn and answers with its final text and structured output. `keel mcp <agent>`
//! serves it over stdio; `keel serve` at `/mcp` (Streamable HTTP, behind the same auth as
//! `/chat`).
//!
//! A call is a run like any other: durable, in the session named (or a new one), with progress
//! notifications when the client asked for them (a progress token). A run that pauses for a
//! human answers at once with what it waits for and how to decide it, instead of blocking the
//! client; cancelling the request (`notifications/cancelled`) cancels the run.

use std::sync::Arc;

use futures::StreamExt;
use keel_core::wire::pending_to_json;
use keel_core::{Event, Message, PendingInput, SessionId, StopReason};
use keel_runtime::{Engine, RunResult};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Extensions, Implementation, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Value, json};

/// Who calls, as the server embedding this one knows it: the session id a caller's name stands
/// for (scoped to its owner, say), and who the caller is for the record of its runs.
pub type Caller = Arc<dyn Fn(&Extensions, SessionId) -> (SessionId, String) + Send + Sync>;

/// How a human decides a pending input: a line for the client (the CLI command, the HTTP
/// request), given the input and the session id the client named.
pub type DecideHint = Arc<dyn Fn(&PendingInput, &str) -> String + Send + Sync>;

/// An agent served as an MCP server (see the module docs). Cheap to clone: one per session.
#[derive(Clone)]
pub struct AgentServer {
    engine: Engine,
    tool: String,
    description: String,
    caller: Caller,
    decide_hint: DecideHint,
}

impl AgentServer {
    /// Serves `engine`'s agent. `caller` maps a request to its session and who it is;
    /// `decide_hint` says how to decide what a paused run waits for.
    pub fn new(
        engine: Engine,
        description: Option<&str>,
        caller: Caller,
        decide_hint: DecideHint,
    ) -> AgentServer {
        let name = engine.agent().name.clone();
        let description = match description {
            Some(text) if !text.trim().is_empty() => format!("{} (the keel agent `{name}`)", text.trim()),
            _ => format!(
                "Asks the keel agent `{name}`: runs one turn of a session and returns its final answer."
            ),
        };
        AgentServer { engine, tool: format!("agent_{name}"), description, caller, decide_hint }
    }

    /// The tool's name: `agent_<name>`.
    pub fn tool_name(&self) -> &str {
        &self.tool
    }

    fn tool_json(&self) -> Value {
        json!({
            "name": self.tool,
            "description": self.description,
            "inputSchema": {
                "type": "object",
                "properties": {
                    "input": { "type": "string", "description": "What to ask the agent." },
                    "sessionId": {
                        "type": "string",
                        "description": "A session to continue (its earlier turns are the context). Default: a new session, whose id the result gives."
                    }
                },
                "required": ["input"],
                "additionalProperties": false
            },
            "outputSchema": {
                "type": "object",
                "properties": {
                    "text": { "type": "string" },
                    "output": {},
                    "sessionId": { "type": "string" },
                    "runId": { "type": "string" },
                    "stopped": { "type": "string" },
                    "pending": { "type": "array" }
                },
                "required": ["text", "sessionId", "runId", "stopped"]
            }
        })
    }

    async fn run(
        &self,
        params: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        if params.name != self.tool {
            return Err(ErrorData::invalid_params(
                format!("unknown tool `{}`: this server has one tool, `{}`", params.name, self.tool),
                None,
            ));
        }
        let arguments = params.arguments.unwrap_or_default();
        let Some(Value::String(input)) = arguments.get("input") else {
            return Err(ErrorData::invalid_params("`input` must be a string: what to ask the agent", None));
        };
        let named = match arguments.get("sessionId") {
            None | Some(Value::Null) => SessionId::new(format!("mcp-{:016x}", fastrand::u64(..))),
            Some(Value::String(id)) => SessionId::new(id.as_str()),
            Some(_) => return Err(ErrorData::invalid_params("`sessionId` must be a string", None)),
        }
        .map_err(|failure| ErrorData::invalid_params(failure.message, None))?;
        let (session, by) = (self.caller)(&context.extensions, named.clone());
        tracing::info!(tool = %self.tool, session = %named, caller = %by, "MCP call");
        let mut handle = match self.engine.start(session, Message::user(input.as_str())) {
            Ok(handle) => handle,
            Err(failure) => return Ok(tool_error(&format!("error[{}]: {}", failure.code, failure.message))),
        };
        let progress = context.meta.get_progress_token();
        let mut step = 0u32;
        loop {
            tokio::select! {
                event = handle.next() => {
                    let Some(event) = event else { break };
                    if let (Some(token), Some(message)) = (&progress, describe(&event)) {
                        step += 1;
                        let notice = ProgressNotificationParam::new(token.clone(), f64::from(step)).with_message(message);
                        // A client that went away does not stop the run: it is durable.
                        let _ = context.peer.notify_progress(notice).await;
                    }
                }
                () = context.ct.cancelled() => {
                    handle.cancel();
                    break;
                }
            }
        }
        match handle.result().await {
            Ok(result) => Ok(self.answer(&result, named.as_str())),
            Err(failure) => Ok(tool_error(&format!("error[{}]: {}", failure.code, failure.message))),
        }
    }

    /// The result of a finished or paused run.
    fn answer(&self, result: &RunResult, session: &str) -> CallToolResult {
        let mut structured = json!({
            "text": result.text,
            "sessionId": session,
            "runId": result.run_id.to_string(),
            "stopped": result.stopped.as_str(),
        });
        if let Some(output) = &result.output {
            structured["output"] = output.clone();
        }
        let text = if result.stopped == StopReason::AwaitingInput {
            structured["pending"] = result.pending.iter().map(pending_to_json).collect();
            let mut text =
                format!("The agent paused: its run {} (session {session}) waits for a human.", result.run_id);
            for pending in &result.pending {
                text.push_str(&format!("\n- {}: {}", pending.id, (self.decide_hint)(pending, session)));
            }
            text.push_str(&format!(
                "\nOnce decided the run goes on; call {} again with sessionId {session:?} to continue the conversation.",
                self.tool
            ));
            text
        } else if let Some(output) = &result.output {
            output.to_string()
        } else {
            result.text.clone()
        };
        from_json(
            json!({ "content": [{ "type": "text", "text": text }], "structuredContent": structured, "isError": false }),
        )
    }
}

/// A progress line for an event worth telling the client about.
fn describe(event: &Event) -> Option<String> {
    match event {
        Event::TurnStart { turn } => Some(format!("turn {}", turn + 1)),
        Event::ToolStart { name, .. } => Some(format!("calling {name}")),
        Event::ApprovalRequested { tool, .. } => Some(format!("waiting for a human to approve {tool}")),
        Event::QuestionAsked { .. } => Some("waiting for a human to answer a question".into()),
        _ => None,
    }
}

fn tool_error(message: &str) -> CallToolResult {
    from_json(json!({ "content": [{ "type": "text", "text": message }], "isError": true }))
}

/// Builds an rmcp result from its wire JSON (the types are `non_exhaustive`).
fn from_json<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("a result built from its documented wire form")
}

impl ServerHandler for AgentServer {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build());
        info.server_info = Implementation::new("keel", env!("CARGO_PKG_VERSION"));
        info.instructions = Some(format!(
            "Call `{}` to ask the agent; pass `sessionId` to continue a conversation.",
            self.tool
        ));
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(from_json(json!({ "tools": [self.tool_json()] })))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.run(request, context).await.map(CallToolResponse::from)
    }
}
