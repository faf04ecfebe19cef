//! keel-spec: loads an agent from a spec file (`agent.yaml`, `agent.toml`, `agent.json`, or any
//! `*.yaml|*.yml|*.toml|*.json`) or an agent directory, into an [`AgentSpec`].
//!
//! Loading never stops at the first problem: every problem is reported as a [`Diagnostic`] with
//! its file, line and column, unknown keys come with a "did you mean", and nothing panics on
//! user input. An [`AgentSpec`] is plain data; the `keel` crate turns it into a runnable agent
//! (built-in tools by name, command tools, the provider).
//!
//! An agent directory:
//! ```text
//! my-agent/
//!   agent.yaml              # the spec keys (or agent.toml / agent.json)
//!   instructions.md         # the system prompt
//!   tools/<name>.toml       # command tools
//!   skills/<name>/SKILL.md  # front matter (name, description) + instructions; tools/ beside it
//! ```

mod channel;
mod command_tool;
mod decode;
mod diagnostic;
mod directory;
mod schedule;
mod spec_file;
mod test_case;
mod tree;

use keel_core::{CommandToolDef, Concurrency, ErrorCode, Limits, MockScript, RetryPolicy};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub use decode::did_you_mean;
pub use diagnostic::{Diagnostic, Pos, Severity};
pub use spec_file::NOT_YET as UNSUPPORTED_KEYS;
pub use test_case::{
    Expectations, ExpectedCall, ExpectedStop, LoadedTests, TestCase, TextMatch, Verdict, load_tests,
    mock_yaml, test_files,
};

/// An agent as its files describe it.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSpec {
    /// The agent's name: `name`, else the directory or file name.
    pub name: String,
    /// A one-line description (for subagents and listings).
    pub description: Option<String>,
    /// The system prompt, skills' instructions appended.
    pub instructions: String,
    /// `provider/model` or `mock`.
    pub model: String,
    /// Built-in tools, by name.
    pub builtin_tools: Vec<String>,
    /// Command tools from `tools/` and the skills' `tools/`.
    pub command_tools: Vec<CommandToolSpec>,
    /// Limits and budgets.
    pub limits: Limits,
    /// Model call retries.
    pub retry: RetryPolicy,
    /// How to talk to the provider (`provider`).
    pub provider: keel_core::ProviderSettings,
    /// What the network tools may reach (`http`).
    pub http: keel_core::HttpSettings,
    /// The workspace directory of the file tools (`workspace`).
    pub workspace: Option<keel_core::WorkspaceSettings>,
    /// How the `shell` tool runs (`shell`).
    pub shell: keel_core::ShellSettings,
    /// Where `web_search` sends its queries (`web_search`).
    pub search: Option<keel_core::SearchSettings>,
    /// The agents of `subagents/<name>/`, each exposed to this one as the tool `<name>`.
    pub subagents: Vec<AgentSpec>,
    /// What a second input to a busy session does.
    pub concurrency: Concurrency,
    /// Tools whose calls wait for a human's approval (`approvals.tools`).
    pub approval_tools: Vec<String>,
    /// How long approvals and questions wait (`approvals.timeout`, default 3 days).
    pub approval_timeout: std::time::Duration,
    /// The JSON Schema of the final answer (`output.schema`).
    pub output_schema: Option<Value>,
    /// Repair turns for an answer that does not match it (`output.max_repairs`, default 1).
    pub max_repairs: u32,
    /// Summarising long conversations (`compaction`).
    pub compaction: Option<keel_core::loop_control::Compaction>,
    /// Tools whose success ends the run (`stop_when: [{tool}]`).
    pub stop_tools: Vec<String>,
    /// The state object a new session starts with (`state.initial`).
    pub initial_state: Option<Value>,
    /// What the agent remembers across sessions (`memory`).
    pub memory: keel_core::memory::MemorySettings,
    /// The mock provider's script (`mock.script`).
    pub mock: Option<MockScript>,
    /// Inbound webhooks (`channels/<name>.yaml` of a directory).
    pub channels: Vec<keel_core::channel::ChannelDef>,
    /// Cron schedules (`triggers`, and `schedules/<name>.yaml` of a directory).
    pub schedules: Vec<keel_core::schedule::ScheduleDef>,
    /// The MCP servers whose tools the agent uses (`mcp`). Their tools are known once connected:
    /// approvals and mock calls naming `<prefix><tool>` are checked then.
    pub mcp: Vec<keel_core::McpServerDef>,
    /// The skills loaded, in the order their instructions were appended.
    pub skills: Vec<String>,
    /// The file or directory the agent was loaded from.
    pub source: PathBuf,
}

/// A command tool, from `tools/<name>.toml`.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandToolSpec {
    /// The tool, ready to run (its working directory is absolute).
    pub def: CommandToolDef,
    /// The file it was defined in.
    pub file: PathBuf,
}

/// What the loader checks names against.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions<'a> {
    /// The built-in tool names (`keel_tools::BUILTIN_NAMES`).
    pub builtin_tools: &'a [&'a str],
    /// The provider names a `model` may start with (`keel_providers::PROVIDER_NAMES`).
    pub providers: &'a [&'a str],
    /// A built-in's name for a former name (`keel_tools::tool_name`: `day-name` → `day_name`):
    /// a spec using a former name works, with a warning, and the loaded spec has the new one.
    pub tool_name: fn(&str) -> &str,
    /// The cargo feature this build of keel lacks for a capability a spec may use, `None` when
    /// it is built in: a built-in tool by name (`js`), `mcp` (MCP servers) or `knowledge`
    /// (folders of documents). A spec that uses one gets a `KEEL_SPEC_UNSUPPORTED` error.
    pub not_built: fn(&str) -> Option<&'static str>,
}

/// A [`LoadOptions::not_built`] for a build that has every capability.
pub fn all_built(_: &str) -> Option<&'static str> {
    None
}

/// The outcome of loading: the spec when there is no error, and every diagnostic (warnings
/// included) in file order.
#[derive(Debug)]
pub struct Loaded {
    /// The spec, when no diagnostic is an error.
    pub spec: Option<AgentSpec>,
    /// Every problem found.
    pub diagnostics: Vec<Diagnostic>,
}

/// The spec file names an agent directory may hold, in the order they are looked for.
pub const SPEC_FILE_NAMES: &[&str] = &["agent.yaml", "agent.yml", "agent.toml", "agent.json"];

/// Loads an agent from a spec file or an agent directory.
pub fn load(path: &Path, options: &LoadOptions<'_>) -> Loaded {
    let mut diagnostics = Vec::new();
    let spec = load_into(path, options, &mut diagnostics);
    // File order reads best; the loader finds problems in its own order.
    diagnostics.sort_by(|a, b| (&a.file, a.pos.line, a.pos.col).cmp(&(&b.file, b.pos.line, b.pos.col)));
    let spec = if diagnostics.iter().any(Diagnostic::is_error) { None } else { spec };
    Loaded { spec, diagnostics }
}

fn load_into(path: &Path, options: &LoadOptions<'_>, diagnostics: &mut Vec<Diagnostic>) -> Option<AgentSpec> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(error) => {
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecNotFound,
                    path,
                    Pos::default(),
                    format!("cannot read the agent: {error}"),
                )
                .with_hint(
                    "give an agent directory (with agent.yaml) or a spec file (.yaml, .toml or .json)",
                ),
            );
            return None;
        }
    };
    if metadata.is_dir() {
        return directory::load(path, options, diagnostics);
    }
    let is_directory_spec =
        path.file_name().and_then(|n| n.to_str()).is_some_and(|name| SPEC_FILE_NAMES.contains(&name));
    match (is_directory_spec, path.parent()) {
        // `my-agent/agent.yaml` means the directory `my-agent`.
        (true, Some(parent)) => {
            let dir = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            directory::load_with_spec_file(dir, path, options, diagnostics)
        }
        _ => spec_file::load_standalone(path, options, diagnostics),
    }
}

#[cfg(test)]
mod tests;
