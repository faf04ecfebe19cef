//! [`Agent`]: the entry point of the Rust API, built in code or loaded from files.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use keel_core::agent::OutputSchema;
use keel_core::loop_control::{Compaction, LoopControl, StepFinished, TurnContext, TurnPlan};
use keel_core::message::ToolCall;
use keel_core::tool::{ToolError, ToolSetError};
use keel_core::{
    AgentDef, ApprovalRule, Concurrency, Decision, ErrorCode, Limits, Message, MockScript, PendingInput,
    Provider, ProviderSettings, RetryPolicy, RunFailure, RunId, SessionId, Store, Tool, ToolSet,
};
use keel_runtime::{Engine, RunHandle};

use crate::subagent::SubagentTool;
use keel_spec::{AgentSpec, Diagnostic, LoadOptions};
use keel_store::MemoryStore;
use keel_tools::CommandTool;
use serde_json::Value;

/// An agent bound to its model provider and store, ready to run.
#[derive(Clone)]
pub struct Agent {
    engine: Engine,
    /// Rebuilds the tool set when an MCP server's tool list changes (`None` without servers).
    /// Its watchers hold it weakly: they end with the last clone of the agent.
    _refresher: Option<Arc<Refresher>>,
    /// The folders of documents it retrieves from.
    #[cfg_attr(not(feature = "knowledge"), allow(dead_code))]
    libraries: Vec<Library>,
}

/// A folder of documents an agent retrieves from (none in a build without `knowledge`).
#[cfg(feature = "knowledge")]
type Library = Arc<keel_memory::semantic::Library>;
#[cfg(not(feature = "knowledge"))]
type Library = std::convert::Infallible;

/// An MCP server an agent's tools come from, connected (none in a build without `mcp`).
#[cfg(feature = "mcp")]
type Connected = keel_mcp::McpServer;
#[cfg(not(feature = "mcp"))]
type Connected = std::convert::Infallible;

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Agent").field(&self.engine.agent()).finish()
    }
}

/// Why an agent could not be loaded.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError {
    /// The spec has errors (warnings are included, in file order).
    Spec {
        /// Every problem found.
        diagnostics: Vec<Diagnostic>,
    },
    /// The spec is valid but the agent cannot be set up (an unavailable provider, say).
    Setup(RunFailure),
}

impl LoadError {
    /// The stable code of the (first) error.
    pub fn code(&self) -> ErrorCode {
        match self {
            LoadError::Spec { diagnostics } => {
                diagnostics.iter().find(|d| d.is_error()).map_or(ErrorCode::SpecInvalid, |d| d.code)
            }
            LoadError::Setup(failure) => failure.code,
        }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Spec { diagnostics } => {
                for (i, diagnostic) in diagnostics.iter().enumerate() {
                    if i > 0 {
                        writeln!(f)?;
                    }
                    write!(f, "{diagnostic}")?;
                }
                Ok(())
            }
            LoadError::Setup(failure) => write!(f, "{failure}"),
        }
    }
}

impl std::error::Error for LoadError {}

impl Agent {
    /// Starts defining an agent in code.
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// Loads an agent from a spec file or an agent directory, with an in-memory store, and
    /// connects to its MCP servers.
    pub async fn load(path: impl AsRef<Path>) -> Result<Agent, LoadError> {
        let spec = load_spec(path.as_ref())?;
        Agent::from_spec(spec, Arc::new(MemoryStore::new())).await
    }

    /// Builds an agent from a loaded spec and a store, connecting to its MCP servers (each
    /// within its `startup_timeout`).
    pub async fn from_spec(spec: AgentSpec, store: Arc<dyn Store>) -> Result<Agent, LoadError> {
        Box::pin(Agent::from_spec_inner(spec, store, &crate::testing::Setup::default())).await
    }

    /// [`Agent::from_spec`] set up for a test (what `keel test` does; see [`crate::testing`]):
    /// its tool dispatches and step commits recorded in a probe, its clock tools reading a
    /// fixed time.
    pub async fn from_spec_with(
        spec: AgentSpec,
        store: Arc<dyn Store>,
        setup: &crate::testing::Setup,
    ) -> Result<Agent, LoadError> {
        Box::pin(Agent::from_spec_inner(spec, store, setup)).await
    }

    async fn from_spec_inner(
        spec: AgentSpec,
        store: Arc<dyn Store>,
        setup: &crate::testing::Setup,
    ) -> Result<Agent, LoadError> {
        let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
        let config = keel_tools::BuiltinConfig {
            http: spec.http.clone(),
            workspace: spec.workspace.clone(),
            shell: spec.shell,
            search: spec.search.clone(),
            now: setup.now.clone(),
        };
        let compose = spec.builtin_tools.iter().any(|name| name == keel_tools::compose::ComposeTool::NAME);
        for name in spec.builtin_tools.iter().filter(|name| *name != keel_tools::compose::ComposeTool::NAME) {
            let tool = keel_tools::builtin(name, &config).ok_or_else(|| {
                LoadError::Setup(match keel_tools::not_built(name) {
                    Some(feature) => RunFailure::not_built(&format!("the `{name}` tool"), feature),
                    None => {
                        RunFailure::new(ErrorCode::SpecInvalid, format!("unknown built-in tool `{name}`"))
                    }
                })
            })?;
            tools.push(tool);
        }
        for tool in spec.command_tools {
            tools.push(Arc::new(CommandTool::new(tool.def)));
        }
        for sub in spec.subagents {
            let name = sub.name.clone();
            let description = sub.description.clone();
            let child = Box::pin(Agent::from_spec_inner(sub, store.clone(), setup)).await?;
            // The child's time budget is what the parent gives a tool call.
            let tool = SubagentTool::new(&name, description.as_deref(), child.engine)
                .with_budget(spec.limits.tool_timeout);
            tools.push(Arc::new(tool));
        }
        let mut write_approvals = Vec::new();
        if spec.shell.approve
            && spec.builtin_tools.iter().any(|name| name == keel_tools::shell::ShellTool::NAME)
        {
            write_approvals.push(keel_tools::shell::ShellTool::NAME.to_owned());
        }
        if let Some(workspace) = &spec.workspace {
            let workspace_tools = keel_tools::workspace_tools(workspace).map_err(|error| {
                LoadError::Setup(RunFailure::new(
                    ErrorCode::SpecInvalid,
                    format!("cannot open the workspace {}: {error}", workspace.path.display()),
                ))
            })?;
            tools.extend(workspace_tools);
            if workspace.mode == keel_core::WorkspaceMode::Writable && workspace.approve_writes {
                write_approvals.extend(keel_tools::WORKSPACE_WRITE_TOOLS.iter().map(|n| (*n).to_owned()));
            }
        }
        let mut builder = Agent::builder()
            .name(spec.name)
            .description(spec.description)
            .instructions(spec.instructions)
            .model(spec.model)
            .limits(spec.limits)
            .retry(spec.retry)
            .concurrency(spec.concurrency)
            .approval_timeout(spec.approval_timeout)
            .provider_settings(spec.provider)
            .store(store)
            .tools(tools);
        let mut approvals: Vec<String> =
            spec.approval_tools.iter().map(|name| keel_tools::tool_name(name).to_owned()).collect();
        for name in write_approvals {
            if !approvals.contains(&name) {
                approvals.push(name);
            }
        }
        // `http_request` asks before the methods that change things (`http.approve_methods`),
        // unless `approvals.tools` has it ask before every call.
        let http_name = keel_tools::HttpTool::NAME;
        if spec.builtin_tools.iter().any(|name| name == http_name)
            && !approvals.iter().any(|name| name == http_name)
            && !spec.http.approve_methods.is_empty()
        {
            let methods = spec.http.approve_methods.clone();
            builder = builder.require_approval_when(http_name, move |input| {
                let method = input["method"].as_str().unwrap_or("GET").to_ascii_uppercase();
                methods.contains(&method)
            });
        }
        for name in approvals {
            builder = builder.require_approval(name);
        }
        if let Some(script) = spec.mock {
            builder = builder.mock_script(script);
        }
        if compose {
            builder = builder.compose();
        }
        if let Some(schema) = spec.output_schema {
            builder = builder.output_schema(schema);
        }
        builder = builder.max_repairs(spec.max_repairs);
        if let Some(compaction) = spec.compaction {
            builder = builder.compaction(compaction);
        }
        for name in &spec.stop_tools {
            builder = builder.stop_on_tool(keel_tools::tool_name(name));
        }
        if let Some(state) = spec.initial_state {
            builder = builder.initial_state(state);
        }
        builder = builder.memory(spec.memory);
        if let Some(probe) = &setup.probe {
            builder = builder.probe(probe);
        }
        for server in spec.mcp {
            builder = builder.mcp(server);
        }
        for schedule in spec.schedules {
            builder = builder.schedule(schedule);
        }
        for channel in spec.channels {
            builder = builder.channel(channel);
        }
        let agent = builder.build_async().await.map_err(LoadError::Setup)?;
        #[cfg(feature = "knowledge")]
        agent.prepare_knowledge().await;
        Ok(agent)
    }

    /// Opens the agent's folders of documents now rather than at their first retrieval:
    /// indexes what changed since they were last indexed, embeds new passages when the
    /// provider has embeddings, and logs each file skipped. A folder that cannot be indexed
    /// is logged too, and tried again at its first use: it never stops the agent.
    #[cfg(feature = "knowledge")]
    pub async fn prepare_knowledge(&self) -> Vec<Result<Arc<keel_memory::semantic::Opened>, String>> {
        let mut opened = Vec::with_capacity(self.libraries.len());
        for library in &self.libraries {
            let result = library.open().await;
            if let Err(error) = &result {
                tracing::warn!(folder = %library.knowledge().source.display(), "cannot index the documents: {error}");
            }
            opened.push(result);
        }
        opened
    }

    /// Starts a run: one turn of `session` answering `input` (a string, a [`Message`], or
    /// content parts). The returned handle streams the run's events and gives its result.
    ///
    /// Fails at once when the session id is invalid (`KEEL_SESSION_ID_INVALID`) or the session
    /// has a run in flight (`KEEL_SESSION_BUSY`). Must be called within a Tokio runtime.
    pub fn run(&self, session: &str, input: impl Into<Message>) -> Result<RunHandle, RunFailure> {
        let session = SessionId::new(session)?;
        self.engine.start(session, input.into())
    }

    /// [`Agent::run`] for a caller that awaits the run at once: the run works in the task that
    /// polls the handle rather than a task of its own, so nothing is handed between tasks (on a
    /// multi-thread runtime, no other worker thread is woken). The run moves on only while the
    /// handle is polled; drop the handle and the rest of the run goes on in a task of its own.
    /// See [`Engine::start_inline`](keel_runtime::Engine::start_inline).
    ///
    /// ```
    /// use keel::Agent;
    ///
    /// # tokio_test_block_on(async {
    /// let agent = Agent::builder().model("mock").build().unwrap();
    /// let result = agent.run_inline("s1", "hello").unwrap().result().await.unwrap();
    /// assert!(!result.text.is_empty());
    /// # });
    /// # fn tokio_test_block_on(f: impl std::future::Future<Output = ()>) {
    /// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    /// # }
    /// ```
    pub fn run_inline(&self, session: &str, input: impl Into<Message>) -> Result<RunHandle, RunFailure> {
        let session = SessionId::new(session)?;
        self.engine.start_inline(session, input.into(), keel_runtime::RunOptions::default())
    }

    /// [`Agent::run`] with this run's own options: limits and budgets other than the agent's.
    /// They are stored with the run, so a run re-driven after a crash keeps them.
    ///
    /// ```
    /// use keel::{Agent, LimitOverrides, RunOptions, StopReason};
    ///
    /// # tokio_test_block_on(async {
    /// let agent = Agent::builder().model("mock").build().unwrap();
    /// let limits = LimitOverrides { max_turns: Some(1), max_total_tokens: Some(10_000), ..LimitOverrides::default() };
    /// let result = agent.run_with("s1", "hello", RunOptions { limits }).unwrap().result().await.unwrap();
    /// assert_eq!(result.stopped, StopReason::Final);
    /// # });
    /// # fn tokio_test_block_on(f: impl std::future::Future<Output = ()>) {
    /// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    /// # }
    /// ```
    pub fn run_with(
        &self,
        session: &str,
        input: impl Into<Message>,
        options: keel_runtime::RunOptions,
    ) -> Result<RunHandle, RunFailure> {
        let session = SessionId::new(session)?;
        self.engine.start_with(session, input.into(), options)
    }

    /// Re-drives a stored run from its journal; completed steps are not executed again.
    pub fn resume(&self, run_id: RunId) -> RunHandle {
        self.engine.resume(run_id)
    }

    /// Re-drives the runs a dead process left unfinished (their lease expired): all of the
    /// store's, or `session`'s only. Completed steps are not executed again.
    pub async fn recover(&self, session: Option<&str>) -> Result<Vec<RunHandle>, RunFailure> {
        let session = session.map(SessionId::new).transpose()?;
        self.engine.recover(session.as_ref()).await
    }

    /// The approvals and questions waiting for a human: all of the store's, or `session`'s.
    pub async fn pending(&self, session: Option<&str>) -> Result<Vec<PendingInput>, RunFailure> {
        let session = session.map(SessionId::new).transpose()?;
        self.engine.pending(session.as_ref()).await
    }

    /// Decides a pending approval (`Decision::Approve` / `Decision::Reject`) or answers a
    /// question (`Decision::Answer`), and continues the run: the handle streams the rest of it.
    /// `KEEL_NOT_PENDING` when `id` is not pending (saying who decided first); a second decision
    /// changes nothing. Recorded as decided by this process; [`Agent::decide_as`] names who.
    pub async fn decide(&self, id: &str, decision: Decision) -> Result<RunHandle, RunFailure> {
        self.decide_as(id, decision, &keel_runtime::who("keel (Rust API)")).await
    }

    /// [`Agent::decide`], recording `by` as who decided (a user name, a service...).
    pub async fn decide_as(&self, id: &str, decision: Decision, by: &str) -> Result<RunHandle, RunFailure> {
        self.engine.decide(id, decision, by).await
    }

    /// Cancels `session`'s unfinished run wherever it is: in flight here or in another process
    /// sharing the store, paused for a human, or interrupted. Returns whether there was one.
    pub async fn cancel(&self, session: &str) -> Result<bool, RunFailure> {
        let session = SessionId::new(session)?;
        Ok(self.engine.cancel(&session, &keel_runtime::who("keel (Rust API)")).await?.had_run())
    }

    /// The session's state object (`Value::Null` when no tool set one): what its tools read
    /// and replace through `ToolContext::state`.
    pub async fn session_state(&self, session: &str) -> Result<Value, RunFailure> {
        let session = SessionId::new(session)?;
        let state = self.engine.store().load_session_state(&session).await;
        state.map(Option::unwrap_or_default).map_err(|error| RunFailure::new(error.code(), error.to_string()))
    }

    /// The runtime engine under the agent (what `keel serve` drives).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The agent's definition.
    pub fn definition(&self) -> Arc<AgentDef> {
        self.engine.agent()
    }

    /// The store the agent keeps sessions and journals in.
    pub fn store(&self) -> &Arc<dyn Store> {
        self.engine.store()
    }
}

/// Loads and validates a spec with keel's built-in tool and provider names.
pub fn load_spec(path: &Path) -> Result<AgentSpec, LoadError> {
    let loaded = keel_spec::load(path, &load_options());
    loaded.spec.ok_or(LoadError::Spec { diagnostics: loaded.diagnostics })
}

/// What the spec loader checks an agent against: keel's built-in tools and providers, and what
/// this build was compiled without.
pub fn load_options() -> LoadOptions<'static> {
    LoadOptions {
        builtin_tools: keel_tools::BUILTIN_NAMES,
        providers: keel_providers::PROVIDER_NAMES,
        tool_name: keel_tools::tool_name,
        not_built: crate::features::not_built,
    }
}

/// Defines an agent in code. Every setting but `model` has a default.
#[derive(Default)]
#[must_use]
pub struct AgentBuilder {
    name: Option<String>,
    description: Option<String>,
    instructions: String,
    model: Option<String>,
    tools: Vec<Arc<dyn Tool>>,
    limits: Limits,
    retry: RetryPolicy,
    output_schema: Option<Value>,
    stop_on_tools: Vec<String>,
    concurrency: Concurrency,
    approvals: Vec<(String, ApprovalRule)>,
    approval_timeout: Option<std::time::Duration>,
    mock_script: Option<MockScript>,
    provider_settings: ProviderSettings,
    compose: bool,
    provider: Option<Arc<dyn Provider>>,
    store: Option<Arc<dyn Store>>,
    clock: Option<Arc<dyn keel_core::Clock>>,
    mcp: Vec<keel_core::McpServerDef>,
    schedules: Vec<keel_core::schedule::ScheduleDef>,
    channels: Vec<keel_core::channel::ChannelDef>,
    loop_control: LoopControl,
    initial_state: Option<Value>,
    memory: keel_core::memory::MemorySettings,
    index_dir: Option<std::path::PathBuf>,
    probe: Option<crate::testing::Probe>,
}

impl AgentBuilder {
    /// The agent's name (default: `agent`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// One line about the agent: what MCP clients (and parent agents) are told it does.
    pub fn description(mut self, description: impl Into<Option<String>>) -> Self {
        self.description = description.into();
        self
    }

    /// The system prompt.
    pub fn instructions(mut self, instructions: impl Into<String>) -> Self {
        self.instructions = instructions.into();
        self
    }

    /// `provider/model` (`openai/gpt-4o-mini`) or `mock`. Required unless [`Self::provider`]
    /// is given.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Adds a tool (see [`crate::function_tool`]).
    pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.push(tool);
        self
    }

    /// Adds several tools.
    pub fn tools(mut self, tools: impl IntoIterator<Item = Arc<dyn Tool>>) -> Self {
        self.tools.extend(tools);
        self
    }

    /// Limits and budgets.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The retry policy of model calls.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// A JSON Schema the final answer must match; the run's result then carries `output`.
    pub fn output_schema(mut self, schema: Value) -> Self {
        self.output_schema = Some(schema);
        self
    }

    /// Ends the run (`stopped: stop_condition`) as soon as this tool succeeds; its output becomes
    /// the run's output.
    pub fn stop_on_tool(mut self, name: impl Into<String>) -> Self {
        self.stop_on_tools.push(name.into());
        self
    }

    /// How many repair turns a final answer that does not match the output schema gets: the
    /// model is shown the validation error and asked again (default 1; 0 fails at once).
    pub fn max_repairs(mut self, repairs: u32) -> Self {
        self.loop_control.max_repairs = repairs;
        self
    }

    /// Summarises older messages into a brief (a journaled `llm:compact:N` step) when the
    /// model would see more than `compaction.max_messages`; a context-too-long error from the
    /// provider then compacts once instead of failing the run.
    pub fn compaction(mut self, compaction: Compaction) -> Self {
        self.loop_control.compaction = Some(compaction);
        self
    }

    /// Called before each model call: may change the model, instructions, messages, offered
    /// tools or `tool_choice` of that call. Must be deterministic (a replay calls it again).
    ///
    /// ```
    /// use keel::{Agent, ToolChoice, TurnPlan};
    ///
    /// let agent = Agent::builder()
    ///     .model("mock")
    ///     .prepare_turn(|turn| TurnPlan {
    ///         // The first turn must call a tool; later ones may answer.
    ///         tool_choice: (turn.turn == 0).then_some(ToolChoice::Required),
    ///         // Past ten messages, remind the model to be brief (not stored in the transcript).
    ///         instructions: (turn.messages.len() > 10).then(|| "Be brief: the conversation is long.".to_owned()),
    ///         ..TurnPlan::default()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # drop(agent);
    /// ```
    pub fn prepare_turn(
        mut self,
        hook: impl Fn(&TurnContext<'_>) -> TurnPlan + Send + Sync + 'static,
    ) -> Self {
        self.loop_control.hooks.prepare_turn = Some(Arc::new(hook));
        self
    }

    /// Called when a tool call is refused before it runs (unknown tool, arguments that are not
    /// JSON or do not match the schema): return a fixed call to run instead, or `None`.
    pub fn repair_tool_call(
        mut self,
        hook: impl Fn(&ToolCall, &ToolError) -> Option<ToolCall> + Send + Sync + 'static,
    ) -> Self {
        self.loop_control.hooks.repair_tool_call = Some(Arc::new(hook));
        self
    }

    /// Called after each step is durably committed (not for steps a resumed run replays).
    pub fn on_step_finish(mut self, hook: impl Fn(&StepFinished<'_>) + Send + Sync + 'static) -> Self {
        self.loop_control.hooks.on_step_finish = Some(Arc::new(hook));
        self
    }

    /// Records the agent's tool dispatches and step commits in `probe` (for tests: see
    /// [`crate::testing`]). Its tools, MCP servers' included, are called through it.
    pub fn probe(mut self, probe: &crate::testing::Probe) -> Self {
        self.probe = Some(probe.clone());
        self
    }

    /// What the agent remembers across sessions (episodes, a graph of entities), per owner:
    /// the authenticated user, else the session. Each memory operation is a journaled step.
    pub fn memory(mut self, memory: keel_core::memory::MemorySettings) -> Self {
        self.memory = memory;
        self
    }

    /// A folder of documents the agent retrieves from (semantic memory; a skill's knowledge
    /// when `knowledge.skill` is set): in `inject` mode a journaled `memory:retrieve` step puts
    /// the best passages for each input in the context; in `agentic` mode the model gets
    /// `search_memory` and `read_memory` tools. The folder is indexed on first use (see
    /// [`Agent::prepare_knowledge`]) under [`Self::index_dir`].
    pub fn knowledge(mut self, knowledge: keel_core::memory::Knowledge) -> Self {
        self.memory.knowledge.push(knowledge);
        self
    }

    /// Where document indexes are kept (default: `KEEL_INDEX_DIR`, else `.keel/index` in the
    /// working directory). Instances that share it share the indexes.
    pub fn index_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.index_dir = Some(dir.into());
        self
    }

    /// The state object a new session starts with (tools read and replace it).
    pub fn initial_state(mut self, state: Value) -> Self {
        self.initial_state = Some(state);
        self
    }

    /// What a second input to a busy session does (default: reject it).
    pub fn concurrency(mut self, concurrency: Concurrency) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Every call of tool `name` waits for a human's approval before it runs.
    pub fn require_approval(mut self, name: impl Into<String>) -> Self {
        self.approvals.push((name.into(), ApprovalRule::Always));
        self
    }

    /// Calls of tool `name` whose input makes `predicate` true wait for a human's approval
    /// (say, a payment over some amount); the others run at once.
    pub fn require_approval_when(
        mut self,
        name: impl Into<String>,
        predicate: impl Fn(&Value) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.approvals.push((name.into(), ApprovalRule::When(Arc::new(predicate))));
        self
    }

    /// How long approvals and questions wait for a human (default: 3 days); past that an
    /// approval counts as rejected and a question as unanswered, and the run goes on. At most
    /// a week ([`AgentDef::MAX_APPROVAL_TIMEOUT`]): a longer one is cut to a week, with a warning.
    pub fn approval_timeout(mut self, timeout: std::time::Duration) -> Self {
        if timeout > AgentDef::MAX_APPROVAL_TIMEOUT {
            tracing::warn!(?timeout, "an approval timeout is at most a week; one week it is");
        }
        self.approval_timeout = Some(timeout.min(AgentDef::MAX_APPROVAL_TIMEOUT));
        self
    }

    /// The script the `mock` model plays.
    pub fn mock_script(mut self, script: MockScript) -> Self {
        self.mock_script = Some(script);
        self
    }

    /// How to talk to the provider `model` names: base URL, max tokens, temperature, tool
    /// choice, thinking... (spec key `provider`).
    pub fn provider_settings(mut self, settings: ProviderSettings) -> Self {
        self.provider_settings = settings;
        self
    }

    /// Adds `agent` as a tool named after it: a call runs the agent on a session of its own
    /// (derived from the call, so a replay finds that run again) and returns its final answer.
    /// Give the child the same store as this agent so that its runs are as durable.
    pub fn subagent(mut self, agent: &Agent, description: Option<&str>) -> Self {
        let name = agent.definition().name.clone();
        self.tools.push(Arc::new(SubagentTool::new(&name, description, agent.engine.clone())));
        self
    }

    /// Adds the `compose` tool (code mode): the model can run a script of several calls of the
    /// agent's other tools in one call, each a durable step. Tools that need approval or ask a
    /// human cannot be composed.
    pub fn compose(mut self) -> Self {
        self.compose = true;
        self
    }

    /// A provider to use instead of the one `model` names.
    pub fn provider(mut self, provider: Arc<dyn Provider>) -> Self {
        self.provider = Some(provider);
        self
    }

    /// Where sessions and journals are kept (default: in memory).
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// Reads time from `clock` (approval expiries, lease messages) instead of the system clock:
    /// for tests, with [`keel_core::ManualClock`]. Give the store the same clock.
    pub fn clock(mut self, clock: Arc<dyn keel_core::Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Adds a cron schedule: `keel serve` (or [`crate::Triggers`] in your own server) starts a
    /// run at each of its ticks, once across every process sharing the store. Names must be
    /// unique ([`Self::build`] refuses a second schedule of the same name).
    pub fn schedule(mut self, schedule: keel_core::schedule::ScheduleDef) -> Self {
        self.schedules.push(schedule);
        self
    }

    /// Adds an inbound webhook: `keel serve` mounts it at `POST /channels/<name>`.
    pub fn channel(mut self, channel: keel_core::channel::ChannelDef) -> Self {
        self.channels.push(channel);
        self
    }

    /// Adds the tools of an MCP server (a stdio command or a Streamable HTTP URL), named
    /// `<prefix><tool>` (default prefix `<name>_`). The agent connects to it in
    /// [`Self::build_async`]; approvals may name its tools by their final names.
    pub fn mcp(mut self, server: keel_core::McpServerDef) -> Self {
        self.mcp.push(server);
        self
    }

    /// Connects to the MCP servers (in parallel, each within its `startup_timeout`), then
    /// checks everything and builds the agent. A server that will not start fails the build
    /// with `KEEL_MCP_START_FAILED` and its stderr; a tool name two sources share fails it
    /// with `KEEL_MCP_TOOL_CONFLICT`, naming both.
    pub async fn build_async(mut self) -> Result<Agent, RunFailure> {
        let servers = std::mem::take(&mut self.mcp);
        if servers.is_empty() {
            return self.build();
        }
        #[cfg(not(feature = "mcp"))]
        return Err(RunFailure::not_built(&format!("the MCP server `{}`", servers[0].name), "mcp"));
        #[cfg(feature = "mcp")]
        {
            let taken: Vec<String> = self.tools.iter().map(|tool| tool.spec().name.clone()).collect();
            let servers = crate::mcp::connect_all(servers, &taken).await?;
            let (mut agent, recipe) = self.build_with(servers.clone())?;
            let refresher = Arc::new(Refresher { engine: agent.engine.clone(), recipe });
            for server in &servers {
                tokio::spawn(refresh_on_change(server.changes(), Arc::downgrade(&refresher)));
            }
            agent._refresher = Some(refresher);
            Ok(agent)
        }
    }

    /// Checks everything and builds the agent. An agent with MCP servers is built with
    /// [`Self::build_async`], which connects to them.
    pub fn build(self) -> Result<Agent, RunFailure> {
        if let Some(server) = self.mcp.first() {
            return Err(RunFailure::new(
                ErrorCode::SpecInvalid,
                format!(
                    "the agent uses MCP server `{}`: build it with `.build_async().await`, which connects to it",
                    server.name
                ),
            ));
        }
        self.build_with(Vec::new()).map(|(agent, _)| agent)
    }

    /// Builds the agent with the tools of `servers` (connected) besides its own; returns the
    /// recipe of its tool set too.
    fn build_with(self, servers: Vec<Connected>) -> Result<(Agent, ToolRecipe), RunFailure> {
        let invalid = |message: String| RunFailure::new(ErrorCode::SpecInvalid, message);
        for (index, schedule) in self.schedules.iter().enumerate() {
            if !keel_core::schedule::ScheduleDef::valid_name(&schedule.name) {
                return Err(invalid(format!(
                    "invalid schedule name {:?}: use 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`",
                    schedule.name
                )));
            }
            if self.schedules[..index].iter().any(|other| other.name == schedule.name) {
                return Err(invalid(format!(
                    "two schedules are named `{}`; give each its own name",
                    schedule.name
                )));
            }
        }
        let model = match (self.model, &self.provider) {
            (Some(model), _) => model,
            (None, Some(_)) => "custom".to_owned(),
            (None, None) => {
                return Err(invalid(
                    "the agent has no model: call `.model(\"mock\")` or `.model(\"openai/gpt-4o-mini\")`"
                        .into(),
                ));
            }
        };
        let provider = match self.provider {
            Some(provider) => provider,
            None => keel_providers::from_model(&model, &self.provider_settings, self.mock_script.as_ref())
                .map_err(|error| RunFailure::new(error.code(), error.message))?,
        };
        let index_root = self.index_dir.clone().unwrap_or_else(default_index_dir);
        let (libraries, knowledge_tools) = libraries(&self.memory.knowledge, &provider, &index_root)?;
        let mut own_tools = self.tools;
        own_tools.extend(knowledge_tools);
        let recipe = ToolRecipe {
            own: own_tools,
            servers,
            approvals: self.approvals,
            compose: self.compose,
            stop_on_tools: self.stop_on_tools.clone(),
            probe: self.probe.clone(),
        };
        let tools = recipe.tool_set().map_err(invalid)?;
        let output_schema = match self.output_schema {
            Some(schema) => Some(OutputSchema::new(schema).map_err(|reason| {
                invalid(format!("the output schema is not a valid JSON Schema: {reason}"))
            })?),
            None => None,
        };
        let mut loop_control = self.loop_control;
        if let Some(probe) = self.probe {
            let hook = loop_control.hooks.on_step_finish.take();
            loop_control.hooks.on_step_finish = Some(Arc::new(move |finished: &StepFinished<'_>| {
                if let Some(hook) = &hook {
                    hook(finished);
                }
                probe.committed(finished.run_id, finished.step);
            }));
        }
        let definition = AgentDef {
            name: self.name.unwrap_or_else(|| "agent".to_owned()),
            description: self.description,
            instructions: self.instructions,
            model,
            tools,
            limits: self.limits,
            retry: self.retry,
            output_schema,
            stop_on_tools: self.stop_on_tools,
            concurrency: self.concurrency,
            approval_timeout: self.approval_timeout.unwrap_or(AgentDef::DEFAULT_APPROVAL_TIMEOUT),
            schedules: self.schedules,
            channels: self.channels,
            loop_control,
            initial_state: self.initial_state,
            memory: keel_core::memory::AgentMemory::default(),
        };
        let store = self.store.unwrap_or_else(|| Arc::new(MemoryStore::new()));
        let mut definition = definition;
        if !self.memory.is_empty() {
            // The memory model is the agent's unless `memory.model` names another of its provider.
            let agent_model = definition.model.split_once('/').map_or(definition.model.as_str(), |(_, m)| m);
            let memory_model = self.memory.model.clone().unwrap_or_else(|| agent_model.to_owned());
            let engine =
                keel_memory::MemoryEngine::new(Arc::clone(&store), Arc::clone(&provider), memory_model);
            #[cfg(feature = "knowledge")]
            let engine = engine.with_libraries(libraries.clone());
            definition.memory =
                keel_core::memory::AgentMemory { settings: self.memory, engine: Some(Arc::new(engine)) };
        }
        let mut options = keel_runtime::EngineOptions::default();
        if let Some(clock) = self.clock {
            options.clock = clock;
        }
        let engine = Engine::with_options(Arc::new(definition), provider, store, options);
        Ok((Agent { engine, _refresher: None, libraries }, recipe))
    }
}

/// An agent's folders of documents, and the tools the model searches some of them with.
type Folders = (Vec<Library>, Vec<Arc<dyn Tool>>);

/// The agent's folders of documents (opened at their first retrieval, indexed under
/// `index_root`), and the search and read tools of those the model searches itself (`agentic`).
#[cfg(feature = "knowledge")]
fn libraries(
    knowledge: &[keel_core::memory::Knowledge],
    provider: &Arc<dyn keel_core::Provider>,
    index_root: &Path,
) -> Result<Folders, RunFailure> {
    let mut libraries = Vec::with_capacity(knowledge.len());
    let mut tools = Vec::new();
    for folder in knowledge {
        if knowledge.iter().filter(|k| k.skill == folder.skill).count() > 1 {
            return Err(RunFailure::new(
                ErrorCode::SpecInvalid,
                match &folder.skill {
                    Some(skill) => format!("skill `{skill}` has two knowledge folders; give it one"),
                    None => "the agent has two semantic memories; give it one folder".to_owned(),
                },
            ));
        }
        let library =
            Arc::new(keel_memory::semantic::Library::new(folder.clone(), Arc::clone(provider), index_root));
        if folder.mode == keel_core::memory::RetrievalMode::Agentic {
            tools.extend(library.tools());
        }
        libraries.push(library);
    }
    Ok((libraries, tools))
}

/// A build without `knowledge` has no folders of documents to give an agent.
#[cfg(not(feature = "knowledge"))]
fn libraries(
    knowledge: &[keel_core::memory::Knowledge],
    _: &Arc<dyn keel_core::Provider>,
    _: &Path,
) -> Result<Folders, RunFailure> {
    match knowledge.first() {
        Some(folder) => {
            Err(RunFailure::not_built(&format!("the documents in {}", folder.source.display()), "knowledge"))
        }
        None => Ok((Vec::new(), Vec::new())),
    }
}

/// `KEEL_INDEX_DIR`, else `.keel/index` (in the working directory).
fn default_index_dir() -> std::path::PathBuf {
    std::env::var_os(keel_core::env::INDEX_DIR.name)
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| std::path::PathBuf::from(".keel/index"), std::path::PathBuf::from)
}

/// What an agent's tool set is made of: its own tools, its MCP servers' (as they list them
/// now), the approval rules, `compose`. Kept to make the set again when a server's list changes.
#[derive(Clone)]
struct ToolRecipe {
    own: Vec<Arc<dyn Tool>>,
    #[cfg_attr(not(feature = "mcp"), allow(dead_code))]
    servers: Vec<Connected>,
    approvals: Vec<(String, ApprovalRule)>,
    compose: bool,
    stop_on_tools: Vec<String>,
    probe: Option<crate::testing::Probe>,
}

impl ToolRecipe {
    /// The tool set, checked: names unique, approvals and stop tools naming tools it has.
    fn tool_set(&self) -> Result<ToolSet, String> {
        let mut all_tools = self.own.clone();
        #[cfg(feature = "mcp")]
        for server in &self.servers {
            all_tools.extend(server.tools());
        }
        if let Some(probe) = &self.probe {
            all_tools = all_tools.into_iter().map(|tool| probe.wrap(tool)).collect();
        }
        if self.compose {
            // Tools that always ask a human are left out; those that ask for some inputs only
            // are in, and a step with such an input is refused when it comes (see the machine).
            let excluded: Vec<&str> = self
                .approvals
                .iter()
                .filter(|(_, rule)| matches!(rule, ApprovalRule::Always))
                .map(|(name, _)| name.as_str())
                .collect();
            let composable: Vec<&str> = all_tools
                .iter()
                .filter(|tool| !tool.asks_human() && !tool.composes())
                .map(|tool| tool.spec().name.as_str())
                .filter(|name| !excluded.contains(name))
                .collect();
            let compose = keel_tools::compose::ComposeTool::new(&composable);
            all_tools.push(Arc::new(compose));
        }
        let mut tools = ToolSet::new(all_tools).map_err(|error: ToolSetError| error.to_string())?;
        for (name, rule) in &self.approvals {
            tools.require_approval(name, rule.clone()).map_err(|error| error.to_string())?;
        }
        for name in &self.stop_on_tools {
            if !tools.contains(name) {
                return Err(format!("`stop_on_tool({name:?})` names a tool the agent does not have"));
            }
        }
        Ok(tools)
    }
}

/// Swaps an agent's definition for one with the tool set made again.
#[cfg_attr(not(feature = "mcp"), allow(dead_code))]
struct Refresher {
    engine: Engine,
    recipe: ToolRecipe,
}

/// Makes the tool set again each time a server's list changes, until the agent is dropped (or
/// the server is). A list that cannot make a valid set (a new tool named like another, an
/// approval's tool gone) keeps the set as it was, with a warning.
#[cfg(feature = "mcp")]
async fn refresh_on_change(
    mut changes: tokio::sync::watch::Receiver<u64>,
    refresher: std::sync::Weak<Refresher>,
) {
    while changes.changed().await.is_ok() {
        let Some(refresher) = refresher.upgrade() else { return };
        match refresher.recipe.tool_set() {
            Ok(tools) => {
                let current = refresher.engine.agent();
                let names: Vec<String> = tools.names().map(str::to_owned).collect();
                refresher.engine.set_agent(Arc::new(AgentDef {
                    name: current.name.clone(),
                    description: current.description.clone(),
                    instructions: current.instructions.clone(),
                    model: current.model.clone(),
                    tools,
                    limits: current.limits.clone(),
                    retry: current.retry.clone(),
                    output_schema: current.output_schema.clone(),
                    stop_on_tools: current.stop_on_tools.clone(),
                    concurrency: current.concurrency,
                    approval_timeout: current.approval_timeout,
                    schedules: current.schedules.clone(),
                    channels: current.channels.clone(),
                    loop_control: current.loop_control.clone(),
                    initial_state: current.initial_state.clone(),
                    memory: current.memory.clone(),
                }));
                tracing::info!(agent = %current.name, tools = ?names, "an MCP server's tools changed; new runs use the new list");
            }
            Err(why) => tracing::warn!(
                "an MCP server's tools changed, but the new list cannot be used ({why}); keeping the tools as they were"
            ),
        }
    }
}
