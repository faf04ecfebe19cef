//! The keys of a spec file (DESIGN.md §2), decoded from a [`Node`] tree.

use std::path::Path;

use keel_core::loop_control::Compaction;
use keel_core::memory::{Embeddings, Episodic, GraphSettings, Knowledge, MemorySettings, RetrievalMode};
use keel_core::{
    Concurrency, ErrorCode, HttpSettings, Limits, McpServerDef, McpTransport, MockEntry, MockFailure,
    MockScript, MockToolCall, ProviderSettings, RetryPolicy, ShellSettings, ToolChoice, WorkspaceMode,
    WorkspaceSettings,
};
use serde_json::Value;

use crate::decode::{Decoder, did_you_mean};
use crate::diagnostic::{Diagnostic, Pos, read_text};
use crate::tree::{self, Format, Kind, Node};
use crate::{AgentSpec, LoadOptions};

/// Every top-level key a spec may have.
pub(crate) const KEYS: &[&str] = &[
    "name",
    "description",
    "instructions",
    "model",
    "provider",
    "tools",
    "http",
    "limits",
    "retry",
    "approvals",
    "concurrency",
    "workspace",
    "shell",
    "web_search",
    "output",
    "compaction",
    "mcp",
    "triggers",
    "memory",
    "skills",
    "mock",
    "stop_when",
    "state",
];

/// Keys of the design this build does not implement yet: refusing them is safer than ignoring
/// them (an ignored `approvals` would run risky tools without asking). `docs/errors.md` lists
/// them under `KEEL_SPEC_UNSUPPORTED` (a tidy test checks it).
pub const NOT_YET: &[&str] = &[];

const LIMIT_KEYS: &[&str] = &[
    "max_turns",
    "max_total_tokens",
    "max_tool_calls",
    "tool_timeout",
    "max_tool_output_chars",
    "provider_timeout",
];
const APPROVAL_KEYS: &[&str] = &["tools", "timeout"];
const PROVIDER_KEYS: &[&str] = &[
    "base_url",
    "max_tokens",
    "temperature",
    "tool_choice",
    "parallel_tool_calls",
    "thinking_budget",
    "reasoning_effort",
    "headers",
];
const RETRY_KEYS: &[&str] = &["max_attempts", "initial_backoff", "max_backoff"];
const MCP_KEYS: &[&str] = &[
    "name",
    "command",
    "env",
    "inherit_env",
    "cwd",
    "url",
    "headers",
    "bearer_token",
    "prefix",
    "only",
    "startup_timeout",
];
const MOCK_ENTRY_KEYS: &[&str] = &["text", "tool_calls", "delay_ms", "error", "episode", "extract"];

/// The spec file's keys, decoded; `instructions` and `skills` are finished by the caller.
pub(crate) struct FileSpec {
    pub(crate) name: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) instructions: Option<(String, Pos)>,
    pub(crate) model: Option<String>,
    pub(crate) tools: Vec<(String, Pos)>,
    pub(crate) limits: Limits,
    pub(crate) retry: RetryPolicy,
    pub(crate) provider: ProviderSettings,
    pub(crate) http: HttpSettings,
    pub(crate) workspace: Option<WorkspaceSettings>,
    pub(crate) shell: ShellSettings,
    /// `web_search` (`None` inside when it has errors), with the position of its key.
    pub(crate) search: Option<(Option<keel_core::SearchSettings>, Pos)>,
    /// Where `provider.tool_choice` names a tool (checked once the agent's tools are known).
    pub(crate) tool_choice_pos: Option<Pos>,
    pub(crate) concurrency: Concurrency,
    /// `approvals.tools`, with their positions.
    pub(crate) approval_tools: Vec<(String, Pos)>,
    /// `approvals.timeout`.
    pub(crate) approval_timeout: Option<std::time::Duration>,
    pub(crate) output_schema: Option<Value>,
    /// `output.max_repairs`.
    pub(crate) max_repairs: Option<u32>,
    /// `compaction`.
    pub(crate) compaction: Option<Compaction>,
    /// `stop_when: [{tool}]`, with their positions.
    pub(crate) stop_tools: Vec<(String, Pos)>,
    /// `state.initial`.
    pub(crate) initial_state: Option<Value>,
    /// `memory`.
    pub(crate) memory: MemorySettings,
    pub(crate) mock: Option<(MockScript, Vec<(String, Pos)>)>,
    pub(crate) skills: Option<Vec<(String, Pos)>>,
    /// `mcp`: the servers, each with the position of its entry.
    pub(crate) mcp: Vec<(McpServerDef, Pos)>,
    /// `triggers`: the schedules, each with the position of its entry.
    pub(crate) triggers: Vec<(keel_core::schedule::ScheduleDef, Pos)>,
}

/// Reads and decodes a spec file.
pub(crate) fn read(
    file: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<FileSpec> {
    let Some(format) = Format::of(file) else {
        diagnostics.push(
            Diagnostic::error(ErrorCode::SpecNotFound, file, Pos::default(), "not a spec file")
                .with_hint("spec files end in .yaml, .yml, .toml or .json"),
        );
        return None;
    };
    let text = read_text(file, "spec", diagnostics)?;
    let root = match tree::parse(&text, format, file) {
        Ok(root) => root,
        Err(diagnostic) => {
            diagnostics.push(diagnostic);
            return None;
        }
    };
    let mut decoder = Decoder { file: file.to_owned(), diagnostics };
    decode(&root, &mut decoder, options)
}

fn decode(root: &Node, d: &mut Decoder<'_>, options: &LoadOptions<'_>) -> Option<FileSpec> {
    let mut map = d.map(root, "the spec")?;
    let base_dir = d.file().parent().map(Path::to_path_buf).unwrap_or_default();
    let mut spec = FileSpec {
        name: None,
        description: None,
        instructions: None,
        model: None,
        tools: Vec::new(),
        limits: Limits::default(),
        retry: RetryPolicy::default(),
        provider: ProviderSettings::default(),
        http: HttpSettings::default(),
        workspace: None,
        shell: ShellSettings::default(),
        search: None,
        tool_choice_pos: None,
        concurrency: Concurrency::Reject,
        approval_tools: Vec::new(),
        approval_timeout: None,
        output_schema: None,
        max_repairs: None,
        compaction: None,
        stop_tools: Vec::new(),
        initial_state: None,
        memory: MemorySettings::default(),
        mock: None,
        skills: None,
        mcp: Vec::new(),
        triggers: Vec::new(),
    };
    if let Some(node) = map.take("name") {
        spec.name = d.text(node, "name");
        if let Some(name) = &spec.name
            && !keel_core::tool::validate_tool_name(name)
        {
            d.error(
                node.pos,
                format!("invalid agent name {name:?}: use 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`"),
            );
        }
    }
    if let Some(node) = map.take("description") {
        spec.description = d.text(node, "description");
    }
    if let Some(node) = map.take("instructions") {
        spec.instructions = instructions(node, d, &base_dir).map(|text| (text, node.pos));
    }
    match map.take("model") {
        Some(node) => spec.model = model(node, d, options),
        // `modle: mock`: the unknown key's error says "did you mean `model`?", once.
        None if map.misspelled("model", KEYS) => {}
        None => {
            d.error(map.pos, "missing `model`").hint = Some(
                "add `model: mock` to run offline, or `model: openai/gpt-4o-mini` (provider/model)".into(),
            );
        }
    }
    if let Some(node) = map.take("tools") {
        spec.tools = d.string_list(node, "tools").unwrap_or_default();
    }
    if let Some(node) = map.take("limits") {
        limits(node, d, &mut spec.limits);
    }
    if let Some(node) = map.take("retry") {
        retry(node, d, &mut spec.retry);
    }
    if let Some(node) = map.take("http") {
        http(node, d, &mut spec.http);
    }
    if let Some(node) = map.take("workspace") {
        spec.workspace = workspace(node, d, &base_dir);
    }
    if let Some(node) = map.take("shell")
        && let Some(mut shell) = d.map(node, "shell")
    {
        for (key, target) in
            [("inherit_env", &mut spec.shell.inherit_env), ("approve", &mut spec.shell.approve)]
        {
            if let Some(value) = shell.take(key).and_then(|v| d.boolean(v, &format!("shell.{key}"))) {
                *target = value;
            }
        }
        shell.finish(d, "shell", &["inherit_env", "approve"]);
    }
    if let Some(pos) = map.key_pos("web_search")
        && let Some(node) = map.take("web_search")
    {
        spec.search = Some((web_search(node, d), pos));
    }
    if let Some(node) = map.take("provider") {
        provider(node, d, &mut spec.provider);
        if matches!(spec.provider.tool_choice, ToolChoice::Tool(_)) {
            spec.tool_choice_pos = d.map(node, "provider").and_then(|m| m.key_pos("tool_choice"));
        }
    }
    if let Some(node) = map.take("output") {
        (spec.output_schema, spec.max_repairs) = output(node, d);
    }
    if let Some(node) = map.take("compaction") {
        spec.compaction = compaction(node, d);
    }
    if let Some(node) = map.take("stop_when") {
        spec.stop_tools = stop_when(node, d);
    }
    if let Some(node) = map.take("state") {
        spec.initial_state = state(node, d);
    }
    if let Some(node) = map.take("memory") {
        spec.memory = memory(node, d, &base_dir);
    }
    if let Some(node) = map.take("concurrency")
        && let Some(mode) = d.string(node, "concurrency")
    {
        match mode.as_str() {
            "reject" => spec.concurrency = Concurrency::Reject,
            "replace" => spec.concurrency = Concurrency::Replace,
            "queue" => spec.concurrency = Concurrency::Queue,
            other => {
                let hint = did_you_mean(other, &["reject", "replace", "queue"])
                    .map_or("use reject, replace or queue".to_owned(), |c| format!("did you mean `{c}`?"));
                d.error(node.pos, format!("unknown concurrency mode {other:?}")).hint = Some(hint);
            }
        }
    }
    if let Some(node) = map.take("approvals")
        && let Some(mut approvals) = d.map(node, "approvals")
    {
        if let Some(tools) = approvals.take("tools") {
            spec.approval_tools = d.string_list(tools, "approvals.tools").unwrap_or_default();
        }
        if let Some(node) = approvals.take("timeout") {
            spec.approval_timeout = d.duration(node, "approvals.timeout").filter(|timeout| {
                let max = keel_core::AgentDef::MAX_APPROVAL_TIMEOUT;
                if *timeout > max {
                    d.error(node.pos, "`approvals.timeout` is at most a week (`7d`)").hint = Some(
                        "a human who has not decided in a week is not coming: end the wait sooner, and ask again"
                            .into(),
                    );
                }
                *timeout <= max
            });
        }
        approvals.finish(d, "approvals", APPROVAL_KEYS);
    }
    if let Some(node) = map.take("skills") {
        spec.skills = d.string_list(node, "skills");
    }
    if let Some(node) = map.take("mock") {
        spec.mock = mock(node, d);
    }
    if let Some(node) = map.take("mcp") {
        spec.mcp = mcp(node, d, &base_dir);
    }
    if let Some(node) = map.take("triggers") {
        spec.triggers = crate::schedule::triggers(node, d);
    }
    for key in NOT_YET {
        if let Some(pos) = map.key_pos(key) {
            map.take(key);
            let file = d.file.clone();
            d.push(Diagnostic::error(
                ErrorCode::SpecUnsupported,
                &file,
                pos,
                format!("`{key}` is not supported by this version of keel yet"),
            ))
            .hint = Some(format!("remove `{key}` to run the agent with this version"));
        }
    }
    map.finish(d, "", KEYS);
    Some(spec)
}

/// `mcp: [{ name, command | url, ... }]`: the MCP servers whose tools the agent uses.
fn mcp(node: &Node, d: &mut Decoder<'_>, base_dir: &Path) -> Vec<(McpServerDef, Pos)> {
    let Some(items) = d.list(node, "mcp") else { return Vec::new() };
    let mut servers: Vec<(McpServerDef, Pos)> = Vec::new();
    for item in items {
        let Some(server) = mcp_server(item, d, base_dir) else { continue };
        if let Some((_, first)) = servers.iter().find(|(other, _)| other.name == server.name) {
            let message =
                format!("two MCP servers are named `{}` (the first at line {})", server.name, first.line);
            d.error(item.pos, message).hint = Some("give each server its own `name`".into());
            continue;
        }
        servers.push((server, item.pos));
    }
    servers
}

fn mcp_server(node: &Node, d: &mut Decoder<'_>, base_dir: &Path) -> Option<McpServerDef> {
    let mut map = d.map(node, "mcp[]")?;
    let name_node = map.take("name");
    let name = match name_node {
        Some(n) => d.text(n, "mcp[].name"),
        None => {
            d.error(node.pos, "an `mcp` server needs `name`").hint =
                Some("write `- { name: docs, command: [npx, -y, some-mcp-server] }`".into());
            None
        }
    };
    if let (Some(name), Some(n)) = (&name, name_node)
        && !keel_core::tool::validate_tool_name(name)
    {
        d.error(
            n.pos,
            format!("invalid MCP server name {name:?}: use 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`"),
        );
    }
    let what = format!("mcp.{}", name.as_deref().unwrap_or("?"));
    let command = map.take("command").map(|n| (n, d.string_list(n, &format!("{what}.command"))));
    let url = map.take("url").map(|n| (n, d.text(n, &format!("{what}.url"))));
    let env = map.take("env").map(|n| (n, string_map(n, d, &format!("{what}.env"), "a variable name")));
    let inherit_env = map.take("inherit_env").map(|n| (n, d.string_list(n, &format!("{what}.inherit_env"))));
    let cwd = map.take("cwd").map(|n| (n, d.text(n, &format!("{what}.cwd"))));
    let headers =
        map.take("headers").map(|n| (n, string_map(n, d, &format!("{what}.headers"), "an HTTP header name")));
    let bearer = map.take("bearer_token").map(|n| (n, d.text(n, &format!("{what}.bearer_token"))));
    let prefix = map.take("prefix").and_then(|n| d.string(n, &format!("{what}.prefix")).map(|p| (p, n.pos)));
    let only = map.take("only").and_then(|n| d.string_list(n, &format!("{what}.only")));
    let timeout = map.take("startup_timeout").and_then(|n| d.duration(n, &format!("{what}.startup_timeout")));
    map.finish(d, "mcp[]", MCP_KEYS);
    let transport = match (command, url) {
        (Some((_, command)), None) => {
            let command: Vec<String> = command?.into_iter().map(|(arg, _)| arg).collect();
            if command.is_empty() {
                d.error(node.pos, format!("`{what}.command` is empty")).hint =
                    Some("write the program and its arguments: `command: [npx, -y, some-mcp-server]`".into());
                return None;
            }
            for (key, given) in [("headers", headers.map(|h| h.0)), ("bearer_token", bearer.map(|b| b.0))] {
                if let Some(n) = given {
                    d.error(
                        n.pos,
                        format!("`{what}.{key}` applies to HTTP servers (`url`), not to `command`"),
                    );
                }
            }
            let cwd = match cwd {
                Some((_, Some(dir))) => Some(base_dir.join(dir)),
                Some((_, None)) => return None,
                None => Some(base_dir.to_path_buf()),
            };
            McpTransport::Stdio {
                command,
                env: env.and_then(|e| e.1).unwrap_or_default(),
                cwd,
                inherit_env: inherit_env
                    .and_then(|e| e.1)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(n, _)| n)
                    .collect(),
            }
        }
        (None, Some((url_node, url))) => {
            let url = url?;
            match url::Url::parse(&url) {
                Ok(parsed) if matches!(parsed.scheme(), "http" | "https") && parsed.host().is_some() => {}
                _ => {
                    d.error(
                        url_node.pos,
                        format!("`{what}.url` {url:?} is not an http:// or https:// URL"),
                    )
                    .hint = Some("write the server's endpoint, like `http://127.0.0.1:9000/mcp`".into());
                    return None;
                }
            }
            for (key, given) in [
                ("env", env.map(|e| e.0)),
                ("inherit_env", inherit_env.map(|e| e.0)),
                ("cwd", cwd.map(|c| c.0)),
            ] {
                if let Some(n) = given {
                    d.error(
                        n.pos,
                        format!("`{what}.{key}` applies to servers started with `command`, not to `url`"),
                    );
                }
            }
            let mut headers = headers.and_then(|h| h.1).unwrap_or_default();
            if let Some((_, Some(token))) = bearer {
                headers.push(("Authorization".to_owned(), format!("Bearer {token}")));
            }
            McpTransport::Http { url, headers }
        }
        (Some((command_node, _)), Some(_)) => {
            d.error(command_node.pos, format!("`{what}` has both `command` and `url`")).hint =
                Some("a server is either started (`command`) or reached over HTTP (`url`)".into());
            return None;
        }
        (None, None) => {
            d.error(
                node.pos,
                format!("`{what}` needs `command` (a stdio server) or `url` (an HTTP server)"),
            )
            .hint = Some(
                "write `command: [npx, -y, some-mcp-server]` or `url: http://127.0.0.1:9000/mcp`".into(),
            );
            return None;
        }
    };
    if let Some((prefix, pos)) = &prefix
        && !prefix.is_empty()
        && !prefix.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
    {
        d.error(*pos, format!("`{what}.prefix` {prefix:?} has characters tool names cannot hold")).hint =
            Some("use A-Z, a-z, 0-9, `_` and `-`".into());
    }
    Some(McpServerDef {
        name: name?,
        transport,
        prefix: prefix.map(|(p, _)| p),
        only: only.map(|names| names.into_iter().map(|(n, _)| n).collect()),
        startup_timeout: timeout.unwrap_or(McpServerDef::DEFAULT_STARTUP_TIMEOUT),
    })
}

/// A mapping of names (`A-Za-z0-9_-`) to one-line strings (`env`, `headers`); `kind` says what
/// a name must be.
fn string_map(node: &Node, d: &mut Decoder<'_>, what: &str, kind: &str) -> Option<Vec<(String, String)>> {
    let mut map = d.map(node, what)?;
    let mut pairs = Vec::new();
    for (name, pos, value) in map.rest() {
        let valid_name =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
        if !valid_name {
            d.error(pos, format!("`{what}`: {name:?} is not {kind}"));
            continue;
        }
        if let Some(value) = d.string(value, &format!("{what}.{name}")) {
            if value.contains(['\r', '\n', '\0']) {
                d.error(pos, format!("`{what}.{name}` must be one line"));
                continue;
            }
            pairs.push((name.to_owned(), value));
        }
    }
    Some(pairs)
}

fn instructions(node: &Node, d: &mut Decoder<'_>, base_dir: &Path) -> Option<String> {
    if let Kind::Map(_) = node.kind {
        // `instructions: { file: prompt.md }`
        let mut map = d.map(node, "instructions")?;
        let file = map.take("file").and_then(|f| d.text(f, "instructions.file").map(|t| (t, f.pos)));
        map.finish(d, "instructions", &["file"]);
        let (file, pos) = file.or_else(|| {
            d.error(node.pos, "`instructions` as a mapping needs `file`").hint =
                Some("write `instructions: { file: prompt.md }`, or the instructions as a string".into());
            None
        })?;
        let path = base_dir.join(&file);
        return match std::fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(error) => {
                d.error(pos, format!("cannot read the instructions file {}: {error}", path.display())).hint =
                    Some("the path is relative to the spec file's directory".into());
                None
            }
        };
    }
    d.string(node, "instructions")
}

fn model(node: &Node, d: &mut Decoder<'_>, options: &LoadOptions<'_>) -> Option<String> {
    let model = d.text(node, "model")?;
    let (provider, name) = match model.split_once('/') {
        Some((provider, name)) => (provider, Some(name)),
        None => (model.as_str(), None),
    };
    if name.is_none()
        && !options.providers.contains(&provider)
        && let Some(known) = keel_core::provider::usual_provider(provider)
    {
        d.error(node.pos, format!("model {model:?} names no provider")).hint =
            Some(format!("write `{known}/{model}` (models are written provider/model)"));
        return None;
    }
    if !options.providers.contains(&provider) {
        let hint = match did_you_mean(provider, options.providers) {
            Some(close) => format!("did you mean `{close}`?"),
            None => format!("write provider/model with a provider among: {}", options.providers.join(", ")),
        };
        d.error(node.pos, format!("unknown provider `{provider}` in model {model:?}")).hint = Some(hint);
        return None;
    }
    if provider != "mock" && name.is_none_or(str::is_empty) {
        d.error(node.pos, format!("model {model:?} names no model")).hint =
            Some(format!("write `{provider}/<model>`, for example `openai/gpt-4o-mini`"));
        return None;
    }
    Some(model)
}

fn limits(node: &Node, d: &mut Decoder<'_>, limits: &mut Limits) {
    let Some(mut map) = d.map(node, "limits") else { return };
    let max = i64::from(u32::MAX);
    if let Some(n) = map.take("max_turns").and_then(|v| d.int(v, "limits.max_turns", 1, max)) {
        limits.max_turns = n as u32;
    }
    if let Some(n) =
        map.take("max_total_tokens").and_then(|v| d.int(v, "limits.max_total_tokens", 1, i64::MAX))
    {
        limits.max_total_tokens = Some(n as u64);
    }
    if let Some(n) = map.take("max_tool_calls").and_then(|v| d.int(v, "limits.max_tool_calls", 0, max)) {
        limits.max_tool_calls = Some(n as u32);
    }
    if let Some(t) = map.take("tool_timeout").and_then(|v| d.duration(v, "limits.tool_timeout")) {
        limits.tool_timeout = t;
    }
    if let Some(n) =
        map.take("max_tool_output_chars").and_then(|v| d.int(v, "limits.max_tool_output_chars", 1, i64::MAX))
    {
        limits.max_tool_output_chars = n as usize;
    }
    if let Some(t) = map.take("provider_timeout").and_then(|v| d.duration(v, "limits.provider_timeout")) {
        limits.provider_timeout = t;
    }
    map.finish(d, "limits", LIMIT_KEYS);
}

fn retry(node: &Node, d: &mut Decoder<'_>, retry: &mut RetryPolicy) {
    let Some(mut map) = d.map(node, "retry") else { return };
    if let Some(n) = map.take("max_attempts").and_then(|v| d.int(v, "retry.max_attempts", 1, 100)) {
        retry.max_attempts = n as u32;
    }
    if let Some(t) = map.take("initial_backoff").and_then(|v| d.duration(v, "retry.initial_backoff")) {
        retry.initial_backoff = t;
    }
    if let Some(t) = map.take("max_backoff").and_then(|v| d.duration(v, "retry.max_backoff")) {
        retry.max_backoff = t;
    }
    map.finish(d, "retry", RETRY_KEYS);
}

fn workspace(node: &Node, d: &mut Decoder<'_>, base_dir: &Path) -> Option<WorkspaceSettings> {
    let mut map = d.map(node, "workspace")?;
    let path_node = map.take("path");
    let mode_node = map.take("mode");
    let approve_node = map.take("approve_writes");
    map.finish(d, "workspace", &["path", "mode", "approve_writes"]);
    let mode = match mode_node {
        None => WorkspaceMode::ReadOnly,
        Some(node) => match d.string(node, "workspace.mode")?.as_str() {
            "disabled" => WorkspaceMode::Disabled,
            "readonly" => WorkspaceMode::ReadOnly,
            "writable" => WorkspaceMode::Writable,
            other => {
                let hint = did_you_mean(other, &["disabled", "readonly", "writable"])
                    .map_or("use disabled, readonly or writable".to_owned(), |c| {
                        format!("did you mean `{c}`?")
                    });
                d.error(node.pos, format!("unknown workspace mode {other:?}")).hint = Some(hint);
                return None;
            }
        },
    };
    let approve_writes = match approve_node {
        None => true,
        Some(node) => d.boolean(node, "workspace.approve_writes")?,
    };
    let Some(path_node) = path_node else {
        d.error(node.pos, "`workspace` needs `path`").hint =
            Some("write `workspace: { path: ./data, mode: readonly }`".into());
        return None;
    };
    let given = d.text(path_node, "workspace.path")?;
    let path = base_dir.join(&given);
    if mode != WorkspaceMode::Disabled && !path.is_dir() {
        d.error(path_node.pos, format!("the workspace directory {} does not exist", path.display())).hint =
            Some("create it, or fix `workspace.path` (relative to the spec file's directory)".into());
        return None;
    }
    let path = std::fs::canonicalize(&path).unwrap_or(path);
    Some(WorkspaceSettings { path, mode, approve_writes })
}

fn http(node: &Node, d: &mut Decoder<'_>, settings: &mut HttpSettings) {
    let Some(mut map) = d.map(node, "http") else { return };
    if let Some(node) = map.take("allow")
        && let Some(hosts) = d.string_list(node, "http.allow")
    {
        for (host, pos) in hosts {
            let name = host.strip_prefix("*.").unwrap_or(&host);
            let valid = !name.is_empty()
                && !name.contains("..")
                && name.trim_end_matches('.').split('.').all(|label| {
                    !label.is_empty() && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if valid {
                settings.allow.push(host.to_ascii_lowercase());
            } else {
                d.error(pos, format!("`http.allow`: {host:?} is not a host name")).hint = Some(
                    "write host names like `api.github.com`, or `*.example.com` for its subdomains".into(),
                );
            }
        }
    }
    if let Some(allow) = map.take("allow_loopback").and_then(|v| d.boolean(v, "http.allow_loopback")) {
        settings.allow_loopback = allow;
    }
    if let Some(node) = map.take("approve_methods")
        && let Some(methods) = d.string_list(node, "http.approve_methods")
    {
        const METHODS: &[&str] = &["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"];
        settings.approve_methods.clear();
        for (method, pos) in methods {
            let upper = method.to_ascii_uppercase();
            if METHODS.contains(&upper.as_str()) {
                settings.approve_methods.push(upper);
            } else {
                d.error(
                    pos,
                    format!("`http.approve_methods`: {method:?} is not a method `http_request` sends"),
                )
                .hint = Some(format!("use {}", METHODS.join(", ")));
            }
        }
    }
    map.finish(d, "http", &["allow", "allow_loopback", "approve_methods"]);
}

/// `web_search: { backend, url?, api_key_env?, timeout? }`; `None` once its errors are reported.
fn web_search(node: &Node, d: &mut Decoder<'_>) -> Option<keel_core::SearchSettings> {
    use keel_core::SearchBackendKind;
    let mut map = d.map(node, "web_search")?;
    let backend_node = map.take("backend");
    let url_node = map.take("url");
    let key_node = map.take("api_key_env");
    let timeout_node = map.take("timeout");
    map.finish(d, "web_search", &["backend", "url", "api_key_env", "timeout"]);
    let names: Vec<&str> = SearchBackendKind::ALL.iter().map(|(name, _)| *name).collect();
    // Each field is checked, so that every mistake is reported at once.
    let backend = match backend_node {
        None => {
            d.error(node.pos, "`web_search` needs `backend`").hint =
                Some(format!("write `web_search: {{ backend: brave }}` (one of {})", names.join(", ")));
            None
        }
        Some(backend_node) => d.string(backend_node, "web_search.backend").and_then(|name| {
            let found =
                SearchBackendKind::ALL.iter().find(|(known, _)| *known == name).map(|(_, kind)| *kind);
            if found.is_none() {
                let hint = did_you_mean(&name, &names)
                    .map_or(format!("use {}", names.join(", ")), |c| format!("did you mean `{c}`?"));
                d.error(backend_node.pos, format!("unknown search backend {name:?}")).hint = Some(hint);
            }
            found.map(|kind| (kind, backend_node.pos))
        }),
    };
    let url = url_node.map(|node| {
        let url = d.text(node, "web_search.url")?.trim().trim_end_matches('/').to_owned();
        let parsed = url::Url::parse(&url).ok();
        if !parsed.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some()) {
            d.error(node.pos, format!("`web_search.url` must be an http:// or https:// URL, not {url:?}"))
                .hint = Some("write the API's root, for example `http://127.0.0.1:8888`".into());
            return None;
        }
        Some(url)
    });
    let api_key_env = key_node.map(|node| {
        let name = d.text(node, "web_search.api_key_env")?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            d.error(
                node.pos,
                format!("`web_search.api_key_env` must name an environment variable, not {name:?}"),
            )
            .hint = Some("write the variable's name, for example `BRAVE_API_KEY`, never the key".into());
            return None;
        }
        Some(name)
    });
    let timeout = match timeout_node {
        None => Some(keel_core::SearchSettings::DEFAULT_TIMEOUT),
        Some(node) => d.duration(node, "web_search.timeout"),
    };
    let (backend, backend_pos) = backend?;
    // An optional field is `None` (absent), `Some(None)` (given, wrong, reported) or valid.
    let valid = |field: Option<Option<String>>| match field {
        None => Some(None),
        Some(value) => value.map(Some),
    };
    let (Some(url), Some(api_key_env), Some(timeout)) = (valid(url), valid(api_key_env), timeout) else {
        return None;
    };
    if backend == SearchBackendKind::Searxng && url.is_none() {
        d.error(backend_pos, "the `searxng` backend needs `url`, the instance's address").hint =
            Some("write `web_search: { backend: searxng, url: http://127.0.0.1:8888 }`".into());
        return None;
    }
    Some(keel_core::SearchSettings { backend, url, api_key_env, timeout })
}

fn provider(node: &Node, d: &mut Decoder<'_>, settings: &mut ProviderSettings) {
    let Some(mut map) = d.map(node, "provider") else { return };
    if let Some(node) = map.take("base_url")
        && let Some(url) = d.text(node, "provider.base_url")
    {
        let url = url.trim().to_owned();
        let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
        if !scheme_ok || url.len() <= "https://".len() {
            d.error(
                node.pos,
                format!("`provider.base_url` must be an http:// or https:// URL, not {url:?}"),
            )
            .hint = Some("write the API's root, for example `http://127.0.0.1:8080/v1`".into());
        } else {
            settings.base_url = Some(url);
        }
    }
    let max = i64::from(u32::MAX);
    if let Some(n) = map.take("max_tokens").and_then(|v| d.int(v, "provider.max_tokens", 1, max)) {
        settings.max_tokens = Some(n as u32);
    }
    if let Some(node) = map.take("temperature") {
        match node.kind {
            Kind::Int(n) if (0..=2).contains(&n) => settings.temperature = Some(n as f64),
            Kind::Float(x) if (0.0..=2.0).contains(&x) => settings.temperature = Some(x),
            _ => {
                d.error(node.pos, "`provider.temperature` must be a number between 0 and 2");
            }
        }
    }
    if let Some(node) = map.take("tool_choice")
        && let Some(choice) = d.text(node, "provider.tool_choice")
    {
        settings.tool_choice = match choice.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            tool => ToolChoice::Tool(tool.to_owned()),
        };
    }
    if let Some(node) = map.take("parallel_tool_calls") {
        settings.parallel_tool_calls = d.boolean(node, "provider.parallel_tool_calls");
    }
    if let Some(n) = map.take("thinking_budget").and_then(|v| d.int(v, "provider.thinking_budget", 1024, max))
    {
        settings.thinking_budget = Some(n as u32);
    }
    if let Some(node) = map.take("reasoning_effort") {
        settings.reasoning_effort = d.text(node, "provider.reasoning_effort");
    }
    if let Some(node) = map.take("headers") {
        settings.headers = string_map(node, d, "provider.headers", "an HTTP header name").unwrap_or_default();
    }
    map.finish(d, "provider", PROVIDER_KEYS);
}

/// `output: { schema, max_repairs }`: the schema and the number of repair turns.
fn output(node: &Node, d: &mut Decoder<'_>) -> (Option<Value>, Option<u32>) {
    let Some(mut map) = d.map(node, "output") else { return (None, None) };
    let schema_node = map.take("schema");
    let max_repairs =
        map.take("max_repairs").and_then(|v| d.int(v, "output.max_repairs", 0, 10)).map(|n| n as u32);
    map.finish(d, "output", &["schema", "max_repairs"]);
    let Some(schema_node) = schema_node else {
        d.error(node.pos, "`output` needs `schema`");
        return (None, max_repairs);
    };
    if d.map(schema_node, "output.schema").is_none() {
        return (None, max_repairs);
    }
    let schema = schema_node.to_json();
    if let Err(problem) = keel_core::tool::check_schema(&schema) {
        let at = schema_node.at_pointer(&problem.pointer).pos;
        d.error(at, format!("`output.schema` is not a valid JSON Schema: {problem}"));
        return (None, max_repairs);
    }
    (Some(schema), max_repairs)
}

/// `compaction: { max_messages, keep_recent, model? }`.
fn compaction(node: &Node, d: &mut Decoder<'_>) -> Option<Compaction> {
    let mut map = d.map(node, "compaction")?;
    let has_max_messages = map.key_pos("max_messages").is_some();
    let max_messages = map.take("max_messages").and_then(|v| d.int(v, "compaction.max_messages", 2, 100_000));
    let keep_recent = map.take("keep_recent").and_then(|v| d.int(v, "compaction.keep_recent", 1, 100_000));
    let model = map.take("model").and_then(|v| d.text(v, "compaction.model"));
    map.finish(d, "compaction", &["max_messages", "keep_recent", "model"]);
    let Some(max_messages) = max_messages else {
        if !has_max_messages {
            d.error(node.pos, "`compaction` needs `max_messages`").hint =
                Some("write `compaction: { max_messages: 40, keep_recent: 20 }`".into());
        }
        return None;
    };
    let max_messages = max_messages as usize;
    // Half of what triggers it, by default: a brief every `max_messages / 2` messages or so.
    let keep_recent = keep_recent.map_or(max_messages / 2, |n| n as usize);
    let compaction = Compaction { max_messages, keep_recent, model };
    if let Err(problem) = compaction.check() {
        d.error(node.pos, format!("`compaction`: {problem}"));
        return None;
    }
    if let Some(model) = &compaction.model
        && model.contains('/')
    {
        let pos = node.pos;
        d.error(pos, format!("`compaction.model` is {model:?}: name a model of the agent's provider, without a provider prefix"))
            .hint = Some("write `model: gpt-4o-mini`, not `openai/gpt-4o-mini`".into());
        return None;
    }
    Some(compaction)
}

/// `stop_when: [{ tool: NAME }]`: tools whose success ends the run.
fn stop_when(node: &Node, d: &mut Decoder<'_>) -> Vec<(String, Pos)> {
    let Some(items) = d.list(node, "stop_when") else { return Vec::new() };
    let mut tools = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let what = format!("stop_when[{index}]");
        let Some(mut condition) = d.map(item, &what) else { continue };
        let tool = condition.take("tool");
        condition.finish(d, &what, &["tool"]);
        match tool {
            Some(tool) => {
                if let Some(name) = d.text(tool, &format!("{what}.tool")) {
                    tools.push((name, tool.pos));
                }
            }
            None => {
                d.error(item.pos, format!("`{what}` needs `tool`")).hint =
                    Some("write `stop_when: [{ tool: finalize }]`".into());
            }
        }
    }
    tools
}

/// `memory: { kind, ... }` or a list of them: the kinds of memory the agent keeps.
fn memory(node: &Node, d: &mut Decoder<'_>, base_dir: &Path) -> MemorySettings {
    let mut settings = MemorySettings::default();
    let entries: Vec<(&Node, String)> = match &node.kind {
        Kind::Seq(items) => {
            items.iter().enumerate().map(|(i, item)| (item, format!("memory[{i}]"))).collect()
        }
        _ => vec![(node, "memory".to_owned())],
    };
    for (entry, what) in entries {
        let Some(mut map) = d.map(entry, &what) else { continue };
        let kind =
            map.take("kind").and_then(|k| d.text(k, &format!("{what}.kind")).map(|text| (text, k.pos)));
        if let Some(model) = map.take("model").and_then(|m| d.text(m, &format!("{what}.model"))) {
            settings.model.get_or_insert(model);
        }
        match kind.as_ref().map(|(k, pos)| (k.as_str(), *pos)) {
            Some(("episodic", _)) => {
                let recall = bounded(
                    &mut map,
                    d,
                    &what,
                    "recall",
                    (1, Episodic::MAX_RECALL),
                    Episodic::DEFAULT_RECALL,
                );
                settings.episodic = Some(Episodic { recall });
                map.finish(d, &what, &["kind", "recall", "model"]);
            }
            Some(("graph", _)) => {
                let default = GraphSettings::default();
                let graph = GraphSettings {
                    depth: bounded(&mut map, d, &what, "depth", (1, 5), default.depth),
                    max_seeds: bounded(&mut map, d, &what, "max_seeds", (1, 20), default.max_seeds),
                    fan_out: bounded(&mut map, d, &what, "fan_out", (1, 50), default.fan_out),
                    max_nodes: bounded(&mut map, d, &what, "max_nodes", (1, 500), default.max_nodes),
                };
                settings.graph = Some(graph);
                map.finish(d, &what, &["kind", "depth", "max_seeds", "fan_out", "max_nodes", "model"]);
            }
            Some(("semantic", pos)) => {
                let knowledge = knowledge(&mut map, d, &what, base_dir, "memory/");
                map.finish(d, &what, KNOWLEDGE_KEYS);
                let Some(knowledge) = knowledge else { continue };
                if settings.knowledge.iter().any(|k| k.skill.is_none()) {
                    d.error(pos, "the agent has two `kind: semantic` memories").hint =
                        Some("keep one; put every document in its `source` folder".into());
                    continue;
                }
                settings.knowledge.push(knowledge);
            }
            Some((other, pos)) => {
                let hint = did_you_mean(other, &["episodic", "graph", "semantic"])
                    .map_or("use episodic, graph or semantic".to_owned(), |c| format!("did you mean `{c}`?"));
                d.error(pos, format!("unknown memory kind {other:?}")).hint = Some(hint);
            }
            None => {
                if map.key_pos("kind").is_none() {
                    d.error(entry.pos, format!("`{what}` needs `kind`")).hint =
                        Some("write `memory: { kind: episodic, recall: 5 }`".into());
                }
            }
        }
    }
    settings
}

/// The whole number at `key` of `map`, between `range`'s ends; `default` when absent (or wrong:
/// the problem is reported).
fn bounded(
    map: &mut crate::decode::MapReader<'_>,
    d: &mut Decoder<'_>,
    what: &str,
    key: &str,
    range: (usize, usize),
    default: usize,
) -> usize {
    let Some(node) = map.take(key) else { return default };
    d.int(node, &format!("{what}.{key}"), range.0 as i64, range.1 as i64).map_or(default, |n| n as usize)
}

/// The keys of a semantic memory entry (a skill's `knowledge` has them but `kind`).
pub(crate) const KNOWLEDGE_KEYS: &[&str] =
    &["kind", "source", "mode", "top_k", "snippet_chars", "embeddings"];

/// A folder of documents to retrieve from: the keys of `memory: { kind: semantic }` and of a
/// skill's `knowledge` (`source` relative to `base_dir`, `default_source` when absent). `None`
/// when the folder is not there (reported).
pub(crate) fn knowledge(
    map: &mut crate::decode::MapReader<'_>,
    d: &mut Decoder<'_>,
    what: &str,
    base_dir: &Path,
    default_source: &str,
) -> Option<Knowledge> {
    let mut knowledge = Knowledge::new(base_dir.join(default_source));
    let source = map.take("source").map(|node| (d.text(node, &format!("{what}.source")), node.pos));
    if let Some(node) = map.take("mode") {
        match d.text(node, &format!("{what}.mode")).as_deref() {
            Some("inject") => knowledge.mode = RetrievalMode::Inject,
            Some("agentic") => knowledge.mode = RetrievalMode::Agentic,
            Some(other) => {
                let hint = did_you_mean(other, &["inject", "agentic"]).map_or(
                    "use `inject` (passages put in the context) or `agentic` (search and read tools)"
                        .to_owned(),
                    |c| format!("did you mean `{c}`?"),
                );
                d.error(node.pos, format!("unknown {what}.mode {other:?}")).hint = Some(hint);
            }
            None => {}
        }
    }
    knowledge.top_k = bounded(map, d, what, "top_k", (1, Knowledge::MAX_TOP_K), Knowledge::DEFAULT_TOP_K);
    knowledge.snippet_chars =
        bounded(map, d, what, "snippet_chars", Knowledge::SNIPPET_CHARS, Knowledge::DEFAULT_SNIPPET_CHARS);
    if let Some(node) = map.take("embeddings") {
        match &node.kind {
            Kind::Bool(false) => knowledge.embeddings = Embeddings::Off,
            _ => match d.text(node, &format!("{what}.embeddings")).as_deref() {
                Some("auto") => knowledge.embeddings = Embeddings::Auto,
                Some("off" | "none") => knowledge.embeddings = Embeddings::Off,
                Some(model) if !model.trim().is_empty() => {
                    knowledge.embeddings = Embeddings::Model(model.trim().to_owned());
                }
                Some(_) => {
                    d.error(node.pos, format!("{what}.embeddings is empty")).hint = Some(
                        "write `auto`, `off`, or the name of an embedding model of the agent's provider"
                            .into(),
                    );
                }
                None => {}
            },
        }
    }
    let (path, pos) = match source {
        Some((Some(given), pos)) => (base_dir.join(given), Some(pos)),
        Some((None, _)) => return None,
        None => (knowledge.source.clone(), None),
    };
    if !path.is_dir() {
        let pos = pos.unwrap_or(map.pos);
        d.error(pos, format!("the documents folder {} does not exist", path.display())).hint = Some(format!(
            "create it and put Markdown, text, HTML or PDF files in it, or set `source` (default `{default_source}`, next to the spec)"
        ));
        return None;
    }
    knowledge.source = path;
    Some(knowledge)
}

/// `state: { initial: {...} }`: the state object a new session starts with.
fn state(node: &Node, d: &mut Decoder<'_>) -> Option<Value> {
    let mut map = d.map(node, "state")?;
    let initial = map.take("initial");
    map.finish(d, "state", &["initial"]);
    let Some(initial) = initial else {
        d.error(node.pos, "`state` needs `initial`").hint =
            Some("write `state: { initial: { cart: [] } }`".into());
        return None;
    };
    d.map(initial, "state.initial")?;
    Some(initial.to_json())
}

/// The mock script, plus the tool names it calls (checked once the agent's tools are known).
pub(crate) fn mock(node: &Node, d: &mut Decoder<'_>) -> Option<(MockScript, Vec<(String, Pos)>)> {
    let mut map = d.map(node, "mock")?;
    let script = map.take("script");
    let compact = map.take("compact");
    map.finish(d, "mock", &["script", "compact"]);
    let Some(script) = script else {
        d.error(node.pos, "`mock` needs `script`").hint =
            Some("write `mock: { script: [ { text: \"Hello!\" } ] }`".into());
        return None;
    };
    let mut called = Vec::new();
    let entries = mock_entries(script, d, "mock.script", &mut called)?;
    let compact = match compact {
        Some(node) => mock_entries(node, d, "mock.compact", &mut Vec::new())?,
        None => Vec::new(),
    };
    Some((MockScript { entries, compact }, called))
}

/// A list of mock entries (`what` names it in diagnostics); the tool names they call are
/// added to `called`.
pub(crate) fn mock_entries(
    node: &Node,
    d: &mut Decoder<'_>,
    what: &str,
    called: &mut Vec<(String, Pos)>,
) -> Option<Vec<MockEntry>> {
    let items = d.list(node, what)?;
    let mut entries = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let what = format!("{what}[{index}]");
        let Some(mut entry_map) = d.map(item, &what) else { continue };
        let mut entry = MockEntry::default();
        // A present but broken key was reported already; "has no text" would only add noise.
        let has_reply_key = ["text", "tool_calls", "error"].iter().any(|k| entry_map.key_pos(k).is_some());
        if let Some(v) = entry_map.take("text") {
            entry.text = d.string(v, &format!("{what}.text"));
        }
        if let Some(v) = entry_map.take("delay_ms") {
            entry.delay_ms = d.int(v, &format!("{what}.delay_ms"), 0, 3_600_000).unwrap_or(0) as u64;
        }
        if let Some(v) = entry_map.take("tool_calls") {
            for call in d.list(v, &format!("{what}.tool_calls")).unwrap_or_default() {
                if let Some(call) = mock_call(call, d, &what) {
                    called.push((call.name.clone(), item.pos));
                    entry.tool_calls.push(call);
                }
            }
        }
        if let Some(v) = entry_map.take("error") {
            entry.error = mock_error(v, d, &what);
        }
        if let Some(v) = entry_map.take("episode") {
            entry.episode = d.string(v, &format!("{what}.episode"));
        }
        if let Some(v) = entry_map.take("extract") {
            // JSON written as YAML is taken as its JSON; a string as it is (malformed output).
            entry.extract = match v.kind {
                Kind::Map(_) | Kind::Seq(_) => Some(v.to_json().to_string()),
                _ => d.string(v, &format!("{what}.extract")),
            };
        }
        entry_map.finish(d, &what, MOCK_ENTRY_KEYS);
        if !has_reply_key {
            d.error(item.pos, format!("`{what}` has no `text`, `tool_calls` or `error`"));
        }
        entries.push(entry);
    }
    Some(entries)
}

fn mock_call(node: &Node, d: &mut Decoder<'_>, what: &str) -> Option<MockToolCall> {
    let what = format!("{what}.tool_calls[]");
    let mut map = d.map(node, &what)?;
    let has_name = map.key_pos("name").is_some();
    let name = map.take("name").and_then(|n| d.text(n, &format!("{what}.name")));
    let input = match map.take("input") {
        Some(input) => {
            d.map(input, &format!("{what}.input"))?;
            input.to_json()
        }
        None => Value::Object(Default::default()),
    };
    map.finish(d, &what, &["name", "input"]);
    let name = name.or_else(|| {
        if !has_name {
            d.error(node.pos, format!("`{what}` needs `name`"));
        }
        None
    })?;
    Some(MockToolCall { name, input })
}

fn mock_error(node: &Node, d: &mut Decoder<'_>, what: &str) -> Option<MockFailure> {
    let what = format!("{what}.error");
    if let Kind::Int(_) = node.kind {
        // `error: 503`
        let status = d.int(node, &what, 400, 599)? as u16;
        return Some(MockFailure {
            status,
            message: format!("mock provider error (status {status})"),
            times: None,
            partial: None,
        });
    }
    let mut map = d.map(node, &what)?;
    let map_has_status = map.key_pos("status").is_some();
    let status = map.take("status").and_then(|v| d.int(v, &format!("{what}.status"), 400, 599));
    let message = map.take("message").and_then(|v| d.string(v, &format!("{what}.message")));
    let times = map.take("times").and_then(|v| d.int(v, &format!("{what}.times"), 1, 1000));
    let partial = map.take("partial").and_then(|v| d.string(v, &format!("{what}.partial")));
    map.finish(d, &what, &["status", "message", "times", "partial"]);
    let Some(status) = status else {
        if map_has_status {
            return None;
        }
        d.error(node.pos, format!("`{what}` needs `status` (an HTTP status such as 429 or 503)"));
        return None;
    };
    let status = status as u16;
    Some(MockFailure {
        status,
        message: message.unwrap_or_else(|| format!("mock provider error (status {status})")),
        times: times.map(|t| t as u32),
        partial,
    })
}

/// Loads a spec file that is not inside an agent directory.
pub(crate) fn load_standalone(
    file: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<AgentSpec> {
    let spec = read(file, options, diagnostics)?;
    let default_name = file.file_stem().and_then(|s| s.to_str()).unwrap_or("agent").to_owned();
    if let Some(skills) = &spec.skills
        && let Some((_, pos)) = skills.first()
    {
        diagnostics.push(
            Diagnostic::error(ErrorCode::SpecInvalid, file, *pos, "`skills` needs an agent directory")
                .with_hint(
                    "put the spec in a directory as agent.yaml, with skills/<name>/SKILL.md beside it",
                ),
        );
    }
    crate::directory::finish(
        spec,
        default_name,
        String::new(),
        crate::directory::Declared::default(),
        file,
        options,
        diagnostics,
    )
}
