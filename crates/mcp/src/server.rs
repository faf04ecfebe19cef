//! One MCP server: connecting, its tools, calls, and the supervisor that restarts it.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::{
    BoxFuture, ErrorCode, McpServerDef, McpTransport, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec,
};
use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, MetaObject, RequestMetaObject,
};
use rmcp::service::{NotificationContext, Peer, RoleClient, RunningService, ServiceError};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, ServiceExt};
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader, ReadBuf};
use tokio::sync::{Notify, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

/// The largest message a server may send: one stdio line, one HTTP body or SSE event.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// The stderr lines kept to explain a server that would not start.
const STDERR_LINES: usize = 20;
/// How long a call waits for a server that is restarting before it fails.
const WAIT_FOR_RESTART: Duration = Duration::from_secs(10);
/// What a call in flight when its server died ends with.
const STOPPED_DURING_CALL: &str = "the server stopped during the call; it is being restarted";
/// The first and the longest wait between restarts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// Why a server could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct McpError {
    /// `KEEL_MCP_START_FAILED`, `KEEL_MCP_TOOL_CONFLICT`...
    pub code: ErrorCode,
    /// What went wrong, naming the server.
    pub message: String,
}

impl McpError {
    fn new(code: ErrorCode, message: impl Into<String>) -> McpError {
        McpError { code, message: message.into() }
    }
}

/// A tool a server offers, as listed.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteTool {
    /// The server's name for it.
    pub remote_name: String,
    /// The name the model calls it by here (`<prefix><tool>`), its description and schema.
    pub spec: ToolSpec,
}

/// A connected MCP server. Cloning shares the connection; it closes (a stdio server is
/// stopped) when the last clone and the last of its tools are dropped.
#[derive(Clone)]
pub struct McpServer {
    inner: Arc<Inner>,
}

impl fmt::Debug for McpServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpServer").field("name", &self.inner.def.name).finish_non_exhaustive()
    }
}

struct Inner {
    def: McpServerDef,
    shared: Arc<Shared>,
    /// Stops the supervisor (and with it the server) when the last handle goes.
    _stop: DropGuard,
}

/// What the supervisor and the handles share.
struct Shared {
    name: String,
    link: watch::Sender<Link>,
    tools: Mutex<Vec<RemoteTool>>,
    /// Bumped each time the tool list changes.
    changes: watch::Sender<u64>,
    /// The last lines a stdio server wrote to stderr, to explain why it would not start.
    stderr: Mutex<VecDeque<String>>,
    /// Signalled when the server sends `notifications/tools/list_changed`.
    list_changed: Notify,
    /// Signalled when the server wrote a line rmcp drops (over the size limit, not JSON): the
    /// call waiting for it would wait until its timeout. `broken_why` says which.
    broken: Notify,
    broken_why: Mutex<String>,
}

/// The state of the connection.
#[derive(Clone)]
enum Link {
    Up { peer: Peer<RoleClient>, generation: u64 },
    Down { reason: String },
}

impl McpServer {
    /// Starts (or reaches) the server, initializes it and lists its tools, within the
    /// server's `startup_timeout`. Must run within a Tokio runtime; a supervisor task keeps
    /// the server up from then on.
    pub async fn connect(def: McpServerDef) -> Result<McpServer, McpError> {
        let (link, _) = watch::channel(Link::Down { reason: "not connected yet".into() });
        let shared = Arc::new(Shared {
            name: def.name.clone(),
            link,
            tools: Mutex::new(Vec::new()),
            changes: watch::channel(0).0,
            stderr: Mutex::default(),
            list_changed: Notify::new(),
            broken: Notify::new(),
            broken_why: Mutex::new(String::new()),
        });
        let connection = open(&def, &shared).await?;
        let tools = list_tools(&def, connection.peer()).await?;
        *lock(&shared.tools) = tools;
        shared.link.send_replace(Link::Up { peer: connection.peer().clone(), generation: 0 });
        let stop = CancellationToken::new();
        tokio::spawn(supervise(def.clone(), Arc::clone(&shared), connection, stop.clone()));
        Ok(McpServer { inner: Arc::new(Inner { def, shared, _stop: stop.drop_guard() }) })
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.inner.def.name
    }

    /// Its tools as listed now (after `only`), with their names here.
    pub fn remote_tools(&self) -> Vec<RemoteTool> {
        lock(&self.inner.shared.tools).clone()
    }

    /// Its tools as keel tools. A call of a tool the server no longer lists is sent anyway:
    /// the server's answer says what happened.
    pub fn tools(&self) -> Vec<Arc<dyn Tool>> {
        self.remote_tools()
            .into_iter()
            .map(|remote| Arc::new(McpTool { server: self.clone(), remote }) as Arc<dyn Tool>)
            .collect()
    }

    /// Changes each time the tool list changes (after `notifications/tools/list_changed` or a
    /// restart that lists other tools).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.shared.changes.subscribe()
    }

    /// Calls `tool` (the server's name for it).
    pub async fn call(&self, tool: &str, input: Value, ctx: &ToolContext) -> ToolOutcome {
        let shared = &self.inner.shared;
        let (peer, generation) = self.peer().await?;
        let mut meta = Map::new();
        meta.insert("keel/idempotencyKey".into(), ctx.idempotency_key.clone().into());
        meta.insert("keel/runId".into(), ctx.run_id.to_string().into());
        meta.insert("keel/sessionId".into(), ctx.session_id.to_string().into());
        meta.insert("keel/callId".into(), ctx.call_id.clone().into());
        let arguments = match input {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => {
                return Err(ToolError::failed(format!("MCP tools take a JSON object as input, not {other}")));
            }
        };
        let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        let mut link = shared.link.subscribe();
        let lost = async {
            // Resolves when this connection is gone.
            let _ =
                link.wait_for(|now| !matches!(now, Link::Up { generation: g, .. } if *g == generation)).await;
        };
        tokio::select! {
            result = peer.call_tool(params) => match result {
                Ok(result) => match serde_json::to_value(&result) {
                    Ok(json) => crate::content::to_outcome(&json),
                    Err(error) => Err(protocol(&shared.name, format!("its result cannot be read: {error}"))),
                },
                Err(error) => Err(call_error(&shared.name, error)),
            },
            () = lost => Err(unavailable(&shared.name, STOPPED_DURING_CALL)),
            () = shared.broken.notified() => Err(protocol(&shared.name, lock(&shared.broken_why).clone())),
        }
    }

    /// The live connection, waiting a little for one that is restarting.
    async fn peer(&self) -> Result<(Peer<RoleClient>, u64), ToolError> {
        let mut link = self.inner.shared.link.subscribe();
        let up = tokio::time::timeout(WAIT_FOR_RESTART, async {
            // A connection whose transport closed is over, even before the supervisor noticed.
            let now = link
                .wait_for(|now| matches!(now, Link::Up { peer, .. } if !peer.is_transport_closed()))
                .await
                .ok()?;
            match &*now {
                Link::Up { peer, generation } => Some((peer.clone(), *generation)),
                Link::Down { .. } => None,
            }
        })
        .await;
        if let Ok(Some(up)) = up {
            return Ok(up);
        }
        let reason = match &*link.borrow() {
            Link::Down { reason } => reason.clone(),
            Link::Up { .. } => "it is restarting".into(),
        };
        Err(unavailable(&self.inner.shared.name, &format!("the server is not available: {reason}")))
    }
}

fn unavailable(server: &str, what: &str) -> ToolError {
    ToolError::with_code(ErrorCode::McpUnavailable, format!("MCP server `{server}`: {what}"), true)
}

fn protocol(server: &str, what: String) -> ToolError {
    ToolError::with_code(ErrorCode::McpProtocol, format!("MCP server `{server}`: {what}"), false)
}

fn call_error(server: &str, error: ServiceError) -> ToolError {
    match error {
        // The server answered the call with a JSON-RPC error (an unknown tool, invalid
        // arguments): the model reads it like a failed call.
        ServiceError::McpError(error) => ToolError::failed(format!(
            "MCP server `{server}` answered with error {}: {}",
            error.code.0, error.message
        )),
        ServiceError::TransportClosed => unavailable(server, STOPPED_DURING_CALL),
        ServiceError::TransportSend(error) => {
            unavailable(server, &format!("the request could not be sent: {error}"))
        }
        ServiceError::Timeout { timeout } => {
            unavailable(server, &format!("no answer within {}", seconds(timeout)))
        }
        ServiceError::UnexpectedResponse => {
            protocol(server, "it answered the call with something else".into())
        }
        other => protocol(server, other.to_string()),
    }
}

fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// What keel answers the server's own requests with, and how it hears of list changes.
struct Handler {
    shared: Arc<Shared>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.shared.list_changed.notify_one();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        // No roots, sampling or elicitation: an agent's tool call has no human at hand to ask,
        // and the model's budget is not the server's to spend. rmcp answers `roots/list` with
        // none and declines elicitation; sampling is refused as not supported.
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("keel", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// A live connection: the rmcp service, and for a stdio server its process (killed, with its
/// whole group, when the connection is dropped).
struct Connection {
    running: RunningService<RoleClient, Handler>,
    child: Option<ChildGuard>,
}

impl Connection {
    fn peer(&self) -> &Peer<RoleClient> {
        self.running.peer()
    }

    /// Resolves when the connection is over: the process exited, the transport closed.
    async fn ended(&mut self) -> String {
        let exited = async {
            match &mut self.child {
                Some(child) => match child.0.wait().await {
                    Ok(status) => format!("the server exited ({status})"),
                    Err(error) => format!("the server's process is lost: {error}"),
                },
                None => std::future::pending().await,
            }
        };
        let closed = async {
            while !self.running.is_closed() && !self.running.peer().is_transport_closed() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            "the connection closed".to_owned()
        };
        tokio::select! {
            why = exited => why,
            why = closed => why,
        }
    }
}

/// Starts or reaches the server and initializes it.
async fn open(def: &McpServerDef, shared: &Arc<Shared>) -> Result<Connection, McpError> {
    let name = &def.name;
    let handler = Handler { shared: Arc::clone(shared) };
    let started = match &def.transport {
        McpTransport::Stdio { command, env, cwd, inherit_env } => {
            let (program, args) = command.split_first().ok_or_else(|| {
                McpError::new(ErrorCode::McpStartFailed, format!("MCP server `{name}` has no command"))
            })?;
            let mut cmd = tokio::process::Command::new(program);
            cmd.args(args);
            let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
            let dir = cwd.clone().unwrap_or_else(|| std::env::current_dir().unwrap_or_default());
            keel_tools::contain_helper(&mut cmd, home.as_deref().unwrap_or(&dir), inherit_env);
            cmd.current_dir(&dir);
            for (key, value) in env {
                let value = crate::expand_env(value).map_err(|why| {
                    McpError::new(ErrorCode::McpStartFailed, format!("MCP server `{name}`: env {key}: {why}"))
                })?;
                cmd.env(key, value);
            }
            cmd.stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            let child = cmd.spawn().map_err(|error| {
                McpError::new(
                    ErrorCode::McpStartFailed,
                    format!("MCP server `{name}`: cannot start {program:?}: {error}"),
                )
            })?;
            // Guarded from here: a server that does not answer `initialize` in time, or
            // fails it, is killed with its whole group (the `kill_on_drop` of its `Child`
            // would kill only the supervisor that leads the group, and leave the server).
            let mut child = ChildGuard(child);
            let (Some(stdout), Some(stdin), Some(stderr)) =
                (child.0.stdout.take(), child.0.stdin.take(), child.0.stderr.take())
            else {
                return Err(McpError::new(
                    ErrorCode::McpStartFailed,
                    format!("MCP server `{name}`: no pipes"),
                ));
            };
            tokio::spawn(keep_stderr(stderr, Arc::clone(shared)));
            let stdout = LineLimit::new(stdout, Arc::clone(shared));
            let serving = handler.serve((stdout, stdin));
            match tokio::time::timeout(def.startup_timeout, serving).await {
                Ok(Ok(running)) => Ok(Ok(Connection { running, child: Some(child) })),
                Ok(Err(error)) => Ok(Err(error.to_string())),
                Err(elapsed) => Err(elapsed),
            }
        }
        McpTransport::Http { url, headers } => {
            let endpoint = reqwest::Url::parse(url).map_err(|error| {
                McpError::new(
                    ErrorCode::McpStartFailed,
                    format!("MCP server `{name}`: bad URL {url:?}: {error}"),
                )
            })?;
            let client = crate::http::client(&endpoint).map_err(|why| {
                McpError::new(ErrorCode::McpStartFailed, format!("MCP server `{name}`: {why}"))
            })?;
            let mut custom = std::collections::HashMap::new();
            for (key, value) in headers {
                let value = crate::expand_env(value).map_err(|why| {
                    McpError::new(
                        ErrorCode::McpStartFailed,
                        format!("MCP server `{name}`: header {key}: {why}"),
                    )
                })?;
                let header = (
                    reqwest::header::HeaderName::from_bytes(key.as_bytes()),
                    reqwest::header::HeaderValue::from_str(&value),
                );
                let (Ok(header), Ok(mut value)) = header else {
                    return Err(McpError::new(
                        ErrorCode::McpStartFailed,
                        format!("MCP server `{name}`: header {key} cannot be sent over HTTP"),
                    ));
                };
                value.set_sensitive(true);
                custom.insert(header, value);
            }
            let config = StreamableHttpClientTransportConfig::with_uri(url.clone())
                .custom_headers(custom)
                .max_sse_event_size(MAX_MESSAGE_BYTES)
                .max_json_response_size(MAX_MESSAGE_BYTES)
                .reinit_on_expired_session(true);
            let transport = StreamableHttpClientTransport::with_client(client, config);
            match tokio::time::timeout(def.startup_timeout, handler.serve(transport)).await {
                Ok(Ok(running)) => Ok(Ok(Connection { running, child: None })),
                Ok(Err(error)) if error.is_authorization_required() => Ok(Err(
                    "it answered 401: authorization required (check the server's `bearer_token` or `headers`)".into(),
                )),
                Ok(Err(rmcp::service::ClientInitializeError::TransportError { error, .. })) => {
                    Ok(Err(innermost(&error)))
                }
                Ok(Err(error)) => Ok(Err(error.to_string())),
                Err(elapsed) => Err(elapsed),
            }
        }
    };
    match started {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(start_failed(def, shared, &error)),
        Err(_) => Err(start_failed(
            def,
            shared,
            &format!("no answer to `initialize` within {}", seconds(def.startup_timeout)),
        )),
    }
}

/// What an HTTP transport error comes down to: keel's refusal of a destination, else the
/// HTTP client's error with its causes (`... Connection refused`), without the layers' names.
fn innermost(error: &(dyn std::error::Error + 'static)) -> String {
    if let Some(refusal) = keel_tools::net::refusal_in(error) {
        return refusal.to_string();
    }
    // rmcp wraps the client's error without making it the source: look for it by type.
    let mut layer = Some(error);
    while let Some(current) = layer {
        if let Some(rmcp::transport::streamable_http_client::StreamableHttpError::Client(client)) =
            current
                .downcast_ref::<rmcp::transport::streamable_http_client::StreamableHttpError<reqwest::Error>>(
                )
        {
            if let Some(refusal) = keel_tools::net::refusal_in(client) {
                return refusal.to_string();
            }
            let mut message = client.to_string();
            let mut cause = std::error::Error::source(client);
            while let Some(inner) = cause {
                message = format!("{message}: {inner}");
                cause = inner.source();
            }
            return message;
        }
        layer = current.source();
    }
    error.to_string()
}

fn start_failed(def: &McpServerDef, shared: &Shared, why: &str) -> McpError {
    let tail = lock(&shared.stderr).iter().cloned().collect::<Vec<_>>().join("\n  ");
    let stderr = if tail.is_empty() { String::new() } else { format!("; its stderr ends with:\n  {tail}") };
    let target = match &def.transport {
        McpTransport::Stdio { command, .. } => command.join(" "),
        McpTransport::Http { url, .. } => url.clone(),
    };
    McpError::new(
        ErrorCode::McpStartFailed,
        format!("MCP server `{}` ({target}) did not start: {why}{stderr}", def.name),
    )
}

/// Lists the server's tools (every page), applies `only`, and names them here.
async fn list_tools(def: &McpServerDef, peer: &Peer<RoleClient>) -> Result<Vec<RemoteTool>, McpError> {
    let listed = peer.list_all_tools().await.map_err(|error| {
        McpError::new(
            ErrorCode::McpStartFailed,
            format!("MCP server `{}`: cannot list its tools: {error}", def.name),
        )
    })?;
    let prefix = def.tool_prefix();
    let mut tools: Vec<RemoteTool> = Vec::with_capacity(listed.len());
    let mut offered: Vec<String> = Vec::with_capacity(listed.len());
    for tool in listed {
        let json = serde_json::to_value(&tool).unwrap_or(Value::Null);
        let remote_name = json.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
        offered.push(remote_name.clone());
        if def.only.as_ref().is_some_and(|only| !only.contains(&remote_name)) {
            continue;
        }
        if tools.iter().any(|known| known.remote_name == remote_name) {
            return Err(McpError::new(
                ErrorCode::McpToolConflict,
                format!("MCP server `{}` lists two tools named `{remote_name}`", def.name),
            ));
        }
        let description = json.get("description").and_then(Value::as_str).unwrap_or_default().to_owned();
        let mut input_schema =
            json.get("inputSchema").cloned().unwrap_or_else(|| serde_json::json!({"type": "object"}));
        if let Value::Object(schema) = &mut input_schema {
            // Draft-07 `$schema` tags and the like are fine; a missing type is not for models.
            schema.entry("type").or_insert_with(|| "object".into());
        }
        let spec = ToolSpec { name: format!("{prefix}{remote_name}"), description, input_schema };
        tools.push(RemoteTool { remote_name, spec });
    }
    if let Some(only) = &def.only {
        let missing: Vec<&str> = only
            .iter()
            .map(String::as_str)
            .filter(|name| !tools.iter().any(|t| t.remote_name == *name))
            .collect();
        if !missing.is_empty() {
            return Err(McpError::new(
                ErrorCode::McpStartFailed,
                format!(
                    "MCP server `{}` has no tool {} named in `only`; it offers: {}",
                    def.name,
                    missing.join(", "),
                    offered.join(", ")
                ),
            ));
        }
    }
    Ok(tools)
}

/// Keeps the server up: notices its end, restarts it with backoff, reads the tool list again
/// when told it changed. Ends (stopping the server) when `stop` is cancelled.
async fn supervise(
    def: McpServerDef,
    shared: Arc<Shared>,
    mut connection: Connection,
    stop: CancellationToken,
) {
    let mut generation = 0;
    loop {
        // Serve until the connection ends or keel lets go of the server.
        let ended = loop {
            tokio::select! {
                () = stop.cancelled() => {
                    let _ = connection.running.close_with_timeout(Duration::from_secs(2)).await;
                    return;
                }
                why = connection.ended() => break why,
                () = shared.list_changed.notified() => {
                    match list_tools(&def, connection.peer()).await {
                        Ok(tools) => replace_tools(&shared, tools),
                        Err(error) => tracing::warn!(server = %def.name, %error, "cannot read the changed tool list"),
                    }
                }
            }
        };
        tracing::warn!(server = %def.name, "MCP server stopped: {ended}; restarting it");
        shared.link.send_replace(Link::Down { reason: ended });
        drop(connection);
        let mut delay = BACKOFF.0;
        connection = loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            match open(&def, &shared).await {
                Ok(connection) => break connection,
                Err(error) => {
                    delay = (delay * 2).min(BACKOFF.1);
                    tracing::warn!(server = %def.name, %error, "MCP server did not restart; next try in {delay:?}");
                    shared.link.send_replace(Link::Down { reason: error.message });
                }
            }
        };
        match list_tools(&def, connection.peer()).await {
            Ok(tools) => replace_tools(&shared, tools),
            Err(error) => {
                tracing::warn!(server = %def.name, %error, "cannot list the restarted server's tools")
            }
        }
        generation += 1;
        tracing::info!(server = %def.name, "MCP server restarted");
        shared.link.send_replace(Link::Up { peer: connection.peer().clone(), generation });
    }
}

fn replace_tools(shared: &Shared, tools: Vec<RemoteTool>) {
    let mut current = lock(&shared.tools);
    if *current != tools {
        *current = tools;
        shared.changes.send_modify(|version| *version += 1);
    }
}

/// Reads a server's stderr into the tail kept for errors, and into keel's log.
async fn keep_stderr(stderr: tokio::process::ChildStderr, shared: Arc<Shared>) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::debug!(server = %shared.name, "stderr: {line}");
        let mut tail = lock(&shared.stderr);
        if tail.len() == STDERR_LINES {
            tail.pop_front();
        }
        tail.push_back(line.chars().take(500).collect());
    }
}

/// A stdio server's child process, killed (its whole group) when the connection ends.
struct ChildGuard(tokio::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.id().and_then(|pid| i32::try_from(pid).ok()) {
            // The server leads its own group (see `keel_tools::contain_helper`).
            let _ =
                nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.0.start_kill();
    }
}

/// A stdio server's stdout, watching for lines that rmcp drops: over [`MAX_MESSAGE_BYTES`],
/// or not JSON (a server printing a log line to stdout breaks the protocol). A call waiting
/// for an answer that came garbled fails at once with `KEEL_MCP_PROTOCOL` instead of waiting
/// for its timeout.
struct LineLimit {
    inner: tokio::process::ChildStdout,
    /// The current line so far (dropped once over the limit).
    line: Vec<u8>,
    /// Bytes of the current line so far.
    length: usize,
    shared: Arc<Shared>,
}

impl LineLimit {
    fn new(inner: tokio::process::ChildStdout, shared: Arc<Shared>) -> LineLimit {
        LineLimit { inner, line: Vec::new(), length: 0, shared }
    }

    fn broken(&self, why: String) {
        *lock(&self.shared.broken_why) = why;
        self.shared.broken.notify_waiters();
    }

    /// A whole line came: is it JSON?
    fn check_line(&self) {
        let line = self.line.trim_ascii();
        if !line.is_empty() && serde_json::from_slice::<serde::de::IgnoredAny>(line).is_err() {
            let shown: String = String::from_utf8_lossy(line).chars().take(120).collect();
            self.broken(format!("the server wrote a line that is not JSON-RPC: `{shown}`"));
        }
    }
}

impl AsyncRead for LineLimit {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let poll = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        let mut rest = &buf.filled()[before..];
        while !rest.is_empty() {
            let (piece, newline) = match rest.iter().position(|&byte| byte == b'\n') {
                Some(at) => (&rest[..at], true),
                None => (rest, false),
            };
            this.length += piece.len();
            if this.length <= MAX_MESSAGE_BYTES {
                this.line.extend_from_slice(piece);
            } else if this.length - piece.len() <= MAX_MESSAGE_BYTES {
                // This piece took the line over the limit: rmcp drops it; so does this.
                this.line = Vec::new();
                this.broken(format!(
                    "the server sent a message over {} MiB; it was dropped",
                    MAX_MESSAGE_BYTES >> 20
                ));
            }
            rest = &rest[piece.len()..];
            if newline {
                if this.length <= MAX_MESSAGE_BYTES {
                    this.check_line();
                }
                // A large message's buffer is not kept for the small ones after it.
                if this.line.capacity() > 64 * 1024 {
                    this.line = Vec::new();
                }
                this.line.clear();
                this.length = 0;
                rest = &rest[1..];
            }
        }
        poll
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Values are replaced whole: a panic while holding the lock leaves nothing half-done.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One of a server's tools as a keel tool.
struct McpTool {
    server: McpServer,
    remote: RemoteTool,
}

impl Tool for McpTool {
    fn spec(&self) -> &ToolSpec {
        &self.remote.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(self.server.call(&self.remote.remote_name, input, ctx))
    }
}
