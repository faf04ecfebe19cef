//! The agent definition: what an agent is, however it was written (Rust, spec file, directory).
//!
//! [`AgentDef`] is plain data plus the agent's tools. It is immutable once built and shared
//! (`Arc`) by every run of the agent.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::tool::ToolSet;

/// An agent, ready to run.
pub struct AgentDef {
    /// The agent's name (a spec's `name`, or its file or directory name).
    pub name: String,
    /// One line about the agent (a spec's `description`): how subagents and MCP clients see it.
    pub description: Option<String>,
    /// The system prompt, with the skills' instructions appended.
    pub instructions: String,
    /// `provider/model`, or `mock`.
    pub model: String,
    /// The tools the model may call.
    pub tools: ToolSet,
    /// Limits and budgets.
    pub limits: Limits,
    /// How model calls are retried.
    pub retry: RetryPolicy,
    /// The JSON Schema the final answer must match, when structured output is wanted.
    pub output_schema: Option<OutputSchema>,
    /// Tools whose successful completion ends the run with `stop_condition`; the tool's output
    /// becomes the run's output.
    pub stop_on_tools: Vec<String>,
    /// What a second input does while a session has a run in flight.
    pub concurrency: Concurrency,
    /// How long an approval or a question waits for a human before it is decided for them
    /// (an approval is rejected, a question gets no answer). Spec key `approvals.timeout`.
    pub approval_timeout: Duration,
    /// Cron schedules that start runs on their own (spec key `triggers`, `schedules/`): a
    /// server fires them.
    pub schedules: Vec<crate::schedule::ScheduleDef>,
    /// Inbound webhooks that start runs (`channels/<name>.yaml`): a server mounts them.
    pub channels: Vec<crate::channel::ChannelDef>,
    /// Repair turns, compaction and hooks.
    pub loop_control: crate::loop_control::LoopControl,
    /// What the agent remembers across sessions, and the engine that keeps it.
    pub memory: crate::memory::AgentMemory,
    /// The session state a new session starts with (spec key `state.initial`): a JSON object.
    pub initial_state: Option<Value>,
}

impl AgentDef {
    /// How long approvals wait when the agent does not say: three days.
    pub const DEFAULT_APPROVAL_TIMEOUT: Duration = Duration::from_secs(3 * 24 * 3600);
    /// The longest an approval or a question may wait: one week. A pause longer than that is
    /// a forgotten one, and it holds its session (and its inputs waiting) all the while.
    pub const MAX_APPROVAL_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
}

/// What a second input to a busy session does (spec key `concurrency`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Concurrency {
    /// Refused with `KEEL_SESSION_BUSY`.
    #[default]
    Reject,
    /// The run in flight is cancelled, and the new input waits behind the inputs already
    /// waiting (they are not superseded: each was accepted, and runs in turn).
    Replace,
    /// Waits its turn, first in first out; at most [`Concurrency::MAX_QUEUED`] wait, more are
    /// refused with `KEEL_SESSION_BUSY`.
    Queue,
}

impl Concurrency {
    /// How many inputs may wait for a busy session (`queue` and `replace`).
    pub const MAX_QUEUED: usize = 5;
    /// How long an input waits for its session before it gives up (`KEEL_SESSION_BUSY`): a run
    /// ahead of it that is paused for days does not hold it forever.
    pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
}

impl std::fmt::Debug for AgentDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentDef")
            .field("name", &self.name)
            .field("model", &self.model)
            .field("tools", &self.tools.names().collect::<Vec<_>>())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Limits and budgets of a run (spec key `limits`).
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// The most model calls in one run.
    pub max_turns: u32,
    /// The most tokens (input plus output, summed over the run's model calls).
    pub max_total_tokens: Option<u64>,
    /// The most tool calls in one run.
    pub max_tool_calls: Option<u32>,
    /// How long one tool call may take.
    pub tool_timeout: Duration,
    /// Tool outputs longer than this (in characters) are cut, with a visible marker.
    pub max_tool_output_chars: usize,
    /// How long one model call attempt may take.
    pub provider_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_turns: 10,
            max_total_tokens: None,
            max_tool_calls: None,
            tool_timeout: Duration::from_secs(60),
            max_tool_output_chars: 50_000,
            provider_timeout: Duration::from_secs(120),
        }
    }
}

/// Limits and budgets of one run that differ from the agent's (from the Rust API or the
/// `limits` of a `POST /chat` body). Stored with the run, so a re-driven run keeps them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LimitOverrides {
    /// Instead of `limits.max_turns`.
    pub max_turns: Option<u32>,
    /// Instead of `limits.max_total_tokens`.
    pub max_total_tokens: Option<u64>,
    /// Instead of `limits.max_tool_calls`.
    pub max_tool_calls: Option<u32>,
    /// Instead of `limits.tool_timeout`.
    pub tool_timeout: Option<Duration>,
    /// Instead of `limits.max_tool_output_chars`.
    pub max_tool_output_chars: Option<usize>,
    /// Instead of `limits.provider_timeout`.
    pub provider_timeout: Option<Duration>,
}

impl LimitOverrides {
    /// Whether nothing is overridden.
    pub fn is_empty(&self) -> bool {
        *self == LimitOverrides::default()
    }

    /// The agent's limits with these applied.
    pub fn apply(&self, limits: &Limits) -> Limits {
        Limits {
            max_turns: self.max_turns.unwrap_or(limits.max_turns),
            max_total_tokens: self.max_total_tokens.or(limits.max_total_tokens),
            max_tool_calls: self.max_tool_calls.or(limits.max_tool_calls),
            tool_timeout: self.tool_timeout.unwrap_or(limits.tool_timeout),
            max_tool_output_chars: self.max_tool_output_chars.unwrap_or(limits.max_tool_output_chars),
            provider_timeout: self.provider_timeout.unwrap_or(limits.provider_timeout),
        }
    }

    /// The first override that loosens `limits` (a request over HTTP may only tighten them:
    /// a budget is the operator's to raise), if any.
    pub fn loosened(&self, limits: &Limits) -> Option<Loosened> {
        let looser = |key, asked: String, agent: String| Some(Loosened { key, asked, agent });
        if let Some(asked) = self.max_turns.filter(|&n| n > limits.max_turns) {
            return looser("max_turns", asked.to_string(), limits.max_turns.to_string());
        }
        // An agent without a budget has none to loosen.
        if let (Some(asked), Some(agent)) = (self.max_total_tokens, limits.max_total_tokens)
            && asked > agent
        {
            return looser("max_total_tokens", asked.to_string(), agent.to_string());
        }
        if let (Some(asked), Some(agent)) = (self.max_tool_calls, limits.max_tool_calls)
            && asked > agent
        {
            return looser("max_tool_calls", asked.to_string(), agent.to_string());
        }
        if let Some(asked) = self.tool_timeout.filter(|&t| t > limits.tool_timeout) {
            return looser("tool_timeout", format!("{asked:?}"), format!("{:?}", limits.tool_timeout));
        }
        if let Some(asked) = self.max_tool_output_chars.filter(|&n| n > limits.max_tool_output_chars) {
            return looser(
                "max_tool_output_chars",
                asked.to_string(),
                limits.max_tool_output_chars.to_string(),
            );
        }
        if let Some(asked) = self.provider_timeout.filter(|&t| t > limits.provider_timeout) {
            return looser(
                "provider_timeout",
                format!("{asked:?}"),
                format!("{:?}", limits.provider_timeout),
            );
        }
        None
    }
}

/// An override above the agent's limit (see [`LimitOverrides::loosened`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loosened {
    /// The limit, by its spec key (`max_turns`).
    pub key: &'static str,
    /// What was asked.
    pub asked: String,
    /// The agent's limit.
    pub agent: String,
}

/// How failed model calls are retried (spec key `retry`). Only transient errors are retried.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, including the first (1 means no retry).
    pub max_attempts: u32,
    /// The wait before the first retry; it doubles after each attempt.
    pub initial_backoff: Duration,
    /// The longest wait between two attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(20),
        }
    }
}

impl RetryPolicy {
    /// The wait before attempt `attempt` (2 for the first retry), or `None` when attempts are
    /// spent.
    pub fn backoff(&self, attempt: u32) -> Option<Duration> {
        if attempt > self.max_attempts || attempt < 2 {
            return None;
        }
        let doublings = (attempt - 2).min(30);
        Some(self.initial_backoff.saturating_mul(1 << doublings).min(self.max_backoff))
    }
}

/// How to talk to the model's provider (spec key `provider`). Every field is optional; the
/// provider's own defaults apply to what is not set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProviderSettings {
    /// The API's base URL (`https://api.openai.com/v1`, `http://127.0.0.1:11434`...). Wins over
    /// the provider's variable (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`, `OLLAMA_HOST`,
    /// `OPENROUTER_BASE_URL`).
    pub base_url: Option<String>,
    /// The most tokens one reply may have (Anthropic requires one: 4096 when unset).
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Whether and which tools the model must call.
    pub tool_choice: ToolChoice,
    /// Whether the model may ask for several tool calls in one reply (the provider's default
    /// when unset).
    pub parallel_tool_calls: Option<bool>,
    /// Extended thinking: the token budget of Anthropic's `thinking` (off when unset).
    pub thinking_budget: Option<u32>,
    /// OpenAI's `reasoning_effort` for reasoning models (`low`, `medium`, `high`...).
    pub reasoning_effort: Option<String>,
    /// Extra HTTP headers sent with every request (a proxy's auth, OpenRouter's `HTTP-Referer`).
    pub headers: Vec<(String, String)>,
}

/// What the network tools (`http_request`, `web_fetch`, `browser`) may reach, and which requests
/// wait for a human (spec key `http`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpSettings {
    /// Host names they may reach (`api.github.com`, `*.example.com`); empty: any public host.
    pub allow: Vec<String>,
    /// Whether loopback addresses are reachable (local development and tests only).
    pub allow_loopback: bool,
    /// The `http_request` methods whose calls wait for a human's approval (upper case; default
    /// the ones that change things: POST, PUT, PATCH, DELETE).
    pub approve_methods: Vec<String>,
}

impl HttpSettings {
    /// The methods that ask for approval by default: those that change something.
    pub const DEFAULT_APPROVE_METHODS: &'static [&'static str] = &["POST", "PUT", "PATCH", "DELETE"];
}

impl Default for HttpSettings {
    fn default() -> HttpSettings {
        HttpSettings {
            allow: Vec::new(),
            allow_loopback: false,
            approve_methods: HttpSettings::DEFAULT_APPROVE_METHODS.iter().map(|m| (*m).to_owned()).collect(),
        }
    }
}

/// Where the `web_search` tool sends its queries (spec key `web_search`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SearchSettings {
    /// Which search API.
    pub backend: SearchBackendKind,
    /// The API's root (`http://127.0.0.1:8888` for a SearXNG instance); each backend has its
    /// public default, SearXNG has none.
    pub url: Option<String>,
    /// The environment variable holding the API key (default `BRAVE_API_KEY`,
    /// `TAVILY_API_KEY`; SearXNG sends one only when this is set).
    pub api_key_env: Option<String>,
    /// How long one request may take.
    pub timeout: std::time::Duration,
}

impl SearchSettings {
    /// The timeout when the spec gives none.
    pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
}

/// The search APIs `web_search` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SearchBackendKind {
    /// A SearXNG instance's JSON API (`GET /search?format=json`).
    Searxng,
    /// The Brave Search API (`GET /res/v1/web/search`).
    Brave,
    /// Tavily's search API (`POST /search`).
    Tavily,
}

impl SearchBackendKind {
    /// Every backend, by its spec name.
    pub const ALL: &'static [(&'static str, SearchBackendKind)] = &[
        ("searxng", SearchBackendKind::Searxng),
        ("brave", SearchBackendKind::Brave),
        ("tavily", SearchBackendKind::Tavily),
    ];

    /// The spec name.
    pub fn name(self) -> &'static str {
        SearchBackendKind::ALL.iter().find(|(_, kind)| *kind == self).map_or("", |(name, _)| name)
    }
}

/// The directory the workspace tools work in (spec key `workspace`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceSettings {
    /// The directory (absolute once loaded: relative paths are resolved from the spec's
    /// directory).
    pub path: PathBuf,
    /// What the agent may do there.
    pub mode: WorkspaceMode,
    /// Whether `write_file` and `edit_file` wait for a human's approval (default: yes).
    pub approve_writes: bool,
}

/// How the `shell` tool runs (spec key `shell`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShellSettings {
    /// Pass keel's whole environment to commands (default: a minimal one, without secrets).
    pub inherit_env: bool,
    /// Whether each command waits for a human's approval (default: yes).
    pub approve: bool,
}

impl Default for ShellSettings {
    fn default() -> ShellSettings {
        ShellSettings { inherit_env: false, approve: true }
    }
}

/// What the agent may do in its workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkspaceMode {
    /// No workspace tools.
    Disabled,
    /// `read_file` and `list_files`.
    ReadOnly,
    /// Also `write_file` and `edit_file`.
    Writable,
}

/// Whether and which tools the model must call (`provider.tool_choice`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// The model may not call tools.
    None,
    /// The model must call some tool.
    Required,
    /// The model must call this tool.
    Tool(String),
}

/// A JSON Schema for the final answer, compiled once.
#[derive(Clone)]
pub struct OutputSchema {
    schema: Value,
    validator: jsonschema::Validator,
}

impl OutputSchema {
    /// Compiles a schema as tools' input schemas are ([`crate::tool::check_schema`]); the error
    /// says what is wrong with it, and where.
    pub fn new(schema: Value) -> Result<OutputSchema, String> {
        let validator = crate::tool::check_schema(&schema).map_err(|problem| problem.to_string())?;
        Ok(OutputSchema { schema, validator })
    }

    /// The schema.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Checks a value, returning the first problem found.
    pub fn check(&self, value: &Value) -> Result<(), String> {
        match self.validator.iter_errors(value).next() {
            None => Ok(()),
            Some(error) => {
                let path = error.instance_path().to_string();
                let at = if path.is_empty() { String::new() } else { format!(" at `{path}`") };
                Err(format!("{error}{at}"))
            }
        }
    }
}

/// A command tool: a program run with the tool input as JSON on stdin (`tools/<name>.toml` in an
/// agent directory; `keel_tools::CommandTool` runs it).
#[derive(Clone, Debug, PartialEq)]
pub struct CommandToolDef {
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// The JSON Schema of its input.
    pub input_schema: Value,
    /// The program and its arguments (no shell is involved). A relative program path has been
    /// resolved against `working_dir` by the loader.
    pub command: Vec<String>,
    /// The working directory.
    pub working_dir: PathBuf,
    /// Its own time limit; the agent's `limits.tool_timeout` applies too.
    pub timeout: Option<Duration>,
    /// The variables of keel's environment it gets besides the minimal ones (`env = [...]`);
    /// keel's own secrets are never passed, even when named.
    pub env: Vec<String>,
    /// What it may do with the session's state object (`state = "read" | "write"`).
    pub state: StateAccess,
}

/// What a command tool may do with the session's state object. With access, the program
/// finds the state as JSON in the file `KEEL_STATE_FILE` names; with `Write`, what that file
/// holds when the program exits successfully replaces the state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateAccess {
    /// No state file.
    #[default]
    None,
    /// The state, to read.
    Read,
    /// The state, to read and replace.
    Write,
}

/// An MCP server whose tools an agent uses (spec key `mcp`, `AgentBuilder::mcp`; the `keel-mcp`
/// crate connects to it).
#[derive(Clone, Debug, PartialEq)]
pub struct McpServerDef {
    /// The server's name: in tool names (the default prefix is `<name>_`), logs and errors.
    pub name: String,
    /// How to reach it.
    pub transport: McpTransport,
    /// What its tools are called here: `<prefix><tool>`. Default `<name>_`.
    pub prefix: Option<String>,
    /// Only these of its tools (by the server's names); all of them when `None`.
    pub only: Option<Vec<String>>,
    /// How long starting and initializing it may take (default 30 s).
    pub startup_timeout: Duration,
}

impl McpServerDef {
    /// The default of `startup_timeout`.
    pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

    /// A stdio server: `command[0]` run with the rest as arguments.
    pub fn stdio(name: impl Into<String>, command: Vec<String>) -> McpServerDef {
        McpServerDef::new(
            name,
            McpTransport::Stdio { command, env: Vec::new(), cwd: None, inherit_env: Vec::new() },
        )
    }

    /// A Streamable HTTP server at `url`.
    pub fn http(name: impl Into<String>, url: impl Into<String>) -> McpServerDef {
        McpServerDef::new(name, McpTransport::Http { url: url.into(), headers: Vec::new() })
    }

    fn new(name: impl Into<String>, transport: McpTransport) -> McpServerDef {
        McpServerDef {
            name: name.into(),
            transport,
            prefix: None,
            only: None,
            startup_timeout: McpServerDef::DEFAULT_STARTUP_TIMEOUT,
        }
    }

    /// The prefix of its tools' names here.
    pub fn tool_prefix(&self) -> String {
        self.prefix.clone().unwrap_or_else(|| format!("{}_", self.name))
    }
}

/// How keel reaches an MCP server.
#[derive(Clone, Debug, PartialEq)]
pub enum McpTransport {
    /// A child process speaking JSON-RPC on its stdin and stdout.
    Stdio {
        /// The program and its arguments (no shell is involved).
        command: Vec<String>,
        /// Variables set for it; values may hold `${NAME}` references to keel's environment.
        env: Vec<(String, String)>,
        /// Its working directory (default: keel's).
        cwd: Option<PathBuf>,
        /// Variables of keel's environment it gets besides the minimal ones (`PATH`, `HOME`...).
        inherit_env: Vec<String>,
    },
    /// A Streamable HTTP endpoint.
    Http {
        /// The endpoint (`http://127.0.0.1:9000/mcp`). Reachable even when private: it was
        /// configured explicitly. Redirects elsewhere are checked like any outbound call.
        url: String,
        /// Headers sent with every request; values may hold `${NAME}` references.
        headers: Vec<(String, String)>,
    },
}

/// The script of the `mock` provider (spec key `mock.script`): one entry per model call of the
/// session, in order. When the script is exhausted the mock echoes the user's input.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MockScript {
    /// The entries.
    pub entries: Vec<MockEntry>,
    /// Replies to compaction calls (spec key `mock.compact`), one per brief of the session, in
    /// order. When exhausted the mock writes a brief of the user's messages itself.
    pub compact: Vec<MockEntry>,
}

impl MockScript {
    /// A script of `entries` for the conversation's turns, and nothing else.
    pub fn new(entries: Vec<MockEntry>) -> MockScript {
        MockScript { entries, compact: Vec::new() }
    }
}

/// One scripted model call: a reply (text, tool calls or both), optionally preceded by a
/// delay and failures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MockEntry {
    /// Wait this long before replying (the reply still streams after).
    pub delay_ms: u64,
    /// A text answer, streamed as several deltas. `{{last_tool_output}}` is replaced by the
    /// output of the conversation's last tool result.
    pub text: Option<String>,
    /// Tool calls.
    pub tool_calls: Vec<MockToolCall>,
    /// A simulated provider failure.
    pub error: Option<MockFailure>,
    /// What the memory model answers when asked to summarise the run this entry ends
    /// (`memory:episode`); the mock writes a summary of its own without it.
    pub episode: Option<String>,
    /// What the memory model answers when asked to extract entities and relations from the run
    /// this entry ends (`memory:extract`): normally JSON; none without it.
    pub extract: Option<String>,
}

impl MockEntry {
    /// A reply of text (`{{last_tool_output}}` is replaced by the last tool result's output).
    pub fn text(text: impl Into<String>) -> MockEntry {
        MockEntry { text: Some(text.into()), ..MockEntry::default() }
    }

    /// A reply calling one tool.
    pub fn call(name: impl Into<String>, input: Value) -> MockEntry {
        MockEntry { tool_calls: vec![MockToolCall { name: name.into(), input }], ..MockEntry::default() }
    }
}

/// A simulated provider failure.
#[derive(Clone, Debug, PartialEq)]
pub struct MockFailure {
    /// An HTTP-like status: 429 is rate limiting, 5xx is transient (retried), other 4xx are
    /// permanent.
    pub status: u16,
    /// The error message.
    pub message: String,
    /// Fail only the first `times` attempts of this call, then reply; `None` fails every attempt.
    pub times: Option<u32>,
    /// Text streamed before each failure, as a stream cut mid-reply would leave it (clients
    /// then get `turn.retry` and drop it).
    pub partial: Option<String>,
}

/// A scripted tool call.
#[derive(Clone, Debug, PartialEq)]
pub struct MockToolCall {
    /// The tool's name.
    pub name: String,
    /// Its input.
    pub input: Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let policy = RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_millis(1500),
        };
        let waits: Vec<_> = (1..=6).map(|a| policy.backoff(a)).collect();
        assert_eq!(
            waits,
            vec![
                None,
                Some(Duration::from_millis(500)),
                Some(Duration::from_millis(1000)),
                Some(Duration::from_millis(1500)),
                Some(Duration::from_millis(1500)),
                None,
            ]
        );
    }

    #[test]
    fn output_schema_reports_where() {
        let schema = OutputSchema::new(serde_json::json!({
            "type": "object", "properties": { "answer": { "type": "string" } }, "required": ["answer"]
        }))
        .unwrap();
        assert!(schema.check(&serde_json::json!({ "answer": "5" })).is_ok());
        let err = schema.check(&serde_json::json!({ "answer": 5 })).unwrap_err();
        assert!(err.contains("/answer"), "{err}");
        assert!(OutputSchema::new(serde_json::json!({ "type": 12 })).is_err());
    }

    /// An output schema is compiled as a tool's input schema is: its mistakes are worded and
    /// placed the same way.
    #[test]
    fn output_schema_is_compiled_as_tool_schemas_are() {
        let misspelled = serde_json::json!({ "type": "object", "properties": { "n": { "type": "strng" } } });
        let reason = OutputSchema::new(misspelled.clone()).err().unwrap();
        assert_eq!(reason, crate::tool::check_schema(&misspelled).unwrap_err().to_string());
        assert!(reason.starts_with("at `properties.n.type`: \"strng\" is not a type"), "{reason}");

        let plain = serde_json::json!({
            "type": "object",
            "properties": { "reply": { "type": "string" }, "follow_up": { "type": "boolean" } },
            "required": ["reply"]
        });
        let schema = OutputSchema::new(plain).unwrap();
        assert!(schema.check(&serde_json::json!({ "reply": "hi", "follow_up": true })).is_ok());
        let err = schema.check(&serde_json::json!({ "follow_up": "yes" })).unwrap_err();
        assert!(err.contains("reply"), "{err}");
    }
}
