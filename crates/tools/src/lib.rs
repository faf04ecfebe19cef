//! keel-tools: tools an agent can use.
//!
//! - built-ins, by name ([`builtin`], [`BUILTIN_NAMES`]; every name in snake_case, as the model
//!   sees it, the former names still accepted: [`RENAMED_BUILTINS`]): `current_date`,
//!   `day_name`, `ask_question` ([`AskQuestion`]), which pauses the run for a human's answer,
//!   `http_request` ([`HttpTool`]) and `web_fetch`, behind the SSRF guard of [`net`], `shell`,
//!   `js` (sandboxed JavaScript), `compose`, `browser` (a headless Chromium behind the same
//!   guard), `web_search` (SearXNG, Brave, Tavily), and the workspace file tools
//!   ([`workspace_tools`]);
//! - tools from plain async Rust functions, with the input schema derived by schemars
//!   ([`function_tool`]);
//! - command tools ([`CommandTool`]): a program run with the input JSON on stdin.

#[cfg(target_os = "linux")]
pub mod browser;
mod clock;
mod command;
pub mod compose;
mod function;
pub mod html;
pub mod http;
#[cfg(feature = "js")]
pub mod js;
pub mod net;
mod process;
mod question;
pub mod shell;
pub mod web_fetch;
pub mod web_search;
pub mod workspace;

use std::sync::Arc;

use keel_core::Tool;

pub use clock::ClockTool;
pub use command::CommandTool;
pub use function::{function_tool, function_tool_with_context};
pub use http::{GuardedClient, HttpTool};
pub use process::contain_helper;
pub use question::AskQuestion;

/// The names of the built-in tools, as specs list them and the model sees them.
pub const BUILTIN_NAMES: &[&str] = &[
    ClockTool::CURRENT_DATE,
    ClockTool::DAY_NAME,
    AskQuestion::NAME,
    HttpTool::NAME,
    web_fetch::WebFetch::NAME,
    shell::ShellTool::NAME,
    JS_NAME,
    compose::ComposeTool::NAME,
    BROWSER_NAME,
    web_search::WebSearch::NAME,
];

/// The name of the `js` tool (JavaScript in QuickJS; the `js` cargo feature).
pub const JS_NAME: &str = "js";

/// The cargo feature this build lacks for the built-in tool `name`, or `None` when it has the
/// tool (or knows no such tool). A spec naming a tool this build lacks is refused with this
/// name, not as an unknown tool.
pub fn not_built(name: &str) -> Option<&'static str> {
    match tool_name(name) {
        #[cfg(not(feature = "js"))]
        JS_NAME => Some("js"),
        _ => None,
    }
}

/// The name of the `browser` tool (a headless Chromium; Linux only).
pub const BROWSER_NAME: &str = "browser";

/// Built-ins' former names, `(old, new)`: still accepted (a spec using one gets a warning), so
/// that agents written before every built-in was named in snake_case keep working.
pub const RENAMED_BUILTINS: &[(&str, &str)] = &[
    ("current-date", ClockTool::CURRENT_DATE),
    ("day-name", ClockTool::DAY_NAME),
    ("http", HttpTool::NAME),
    ("web-fetch", web_fetch::WebFetch::NAME),
];

/// What the configurable built-ins are configured with (the spec's `http` key...).
#[derive(Clone, Debug, Default)]
pub struct BuiltinConfig {
    /// Where the network tools may go.
    pub http: keel_core::HttpSettings,
    /// The workspace (`shell` runs there).
    pub workspace: Option<keel_core::WorkspaceSettings>,
    /// How `shell` runs.
    pub shell: keel_core::ShellSettings,
    /// Where `web_search` searches (the spec's `web_search`; the tool needs it).
    pub search: Option<keel_core::SearchSettings>,
    /// The time the clock tools read instead of the clock (`keel test`: a case's `now`).
    pub now: Option<jiff::ZonedDateTime>,
}

/// The workspace tools for `settings`: none when disabled, `read_file`, `list_files` and `stat`
/// when read-only, and `write_file`, `edit_file` and `delete_file` too when writable. Fails when the directory
/// cannot be opened.
pub fn workspace_tools(settings: &keel_core::WorkspaceSettings) -> std::io::Result<Vec<Arc<dyn Tool>>> {
    use keel_core::WorkspaceMode;
    use workspace::{DeleteFile, EditFile, ListFiles, ReadFile, Stat, Workspace, WriteFile};
    if settings.mode == WorkspaceMode::Disabled {
        return Ok(Vec::new());
    }
    let workspace = Workspace::open(&settings.path)?;
    let mut tools: Vec<Arc<dyn Tool>> = vec![
        Arc::new(ReadFile::new(workspace.clone())),
        Arc::new(ListFiles::new(workspace.clone())),
        Arc::new(Stat::new(workspace.clone())),
    ];
    if settings.mode == WorkspaceMode::Writable {
        tools.push(Arc::new(WriteFile::new(workspace.clone())));
        tools.push(Arc::new(EditFile::new(workspace.clone())));
        tools.push(Arc::new(DeleteFile::new(workspace)));
    }
    Ok(tools)
}

/// The workspace tools that change files, which wait for approval unless
/// `workspace.approve_writes` is false.
pub const WORKSPACE_WRITE_TOOLS: &[&str] = &["write_file", "edit_file", "delete_file"];

/// The workspace tools every enabled workspace has.
pub const WORKSPACE_READ_TOOLS: &[&str] = &["read_file", "list_files", "stat"];

/// A built-in's name for a name a spec may use: its own, or the one a former name now has
/// (`current-date` → `current_date`). Any other name is returned as it is.
pub fn tool_name(spec_name: &str) -> &str {
    RENAMED_BUILTINS.iter().find(|(old, _)| *old == spec_name).map_or(spec_name, |(_, new)| new)
}

/// The built-in tool a spec calls `name`, configured by `config`.
pub fn builtin(name: &str, config: &BuiltinConfig) -> Option<Arc<dyn Tool>> {
    match tool_name(name) {
        name @ (ClockTool::CURRENT_DATE | ClockTool::DAY_NAME) => {
            let tool = if name == ClockTool::CURRENT_DATE {
                ClockTool::current_date()
            } else {
                ClockTool::day_name()
            };
            Some(Arc::new(match &config.now {
                Some(now) => tool.at(now.clone()),
                None => tool,
            }))
        }
        AskQuestion::NAME => Some(Arc::new(AskQuestion::new())),
        HttpTool::NAME => {
            Some(Arc::new(HttpTool::new(GuardedClient::new(net::NetPolicy::from(&config.http)))))
        }
        web_fetch::WebFetch::NAME => {
            Some(Arc::new(web_fetch::WebFetch::new(GuardedClient::new(net::NetPolicy::from(&config.http)))))
        }
        #[cfg(feature = "js")]
        JS_NAME => Some(Arc::new(js::JsTool::new())),
        web_search::WebSearch::NAME => {
            Some(Arc::new(web_search::WebSearch::from_settings(config.search.as_ref()?)))
        }
        #[cfg(target_os = "linux")]
        BROWSER_NAME => {
            // Screenshots and PDFs go into a writable workspace, when the agent has one.
            let artifacts = config
                .workspace
                .as_ref()
                .filter(|w| w.mode == keel_core::WorkspaceMode::Writable)
                .and_then(|w| workspace::Workspace::open(&w.path).ok());
            Some(Arc::new(browser::BrowserTool::new(net::NetPolicy::from(&config.http), artifacts)))
        }
        shell::ShellTool::NAME => {
            let workspace = config.workspace.as_ref()?;
            Some(Arc::new(shell::ShellTool::new(workspace.path.clone(), config.shell.inherit_env)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use keel_core::{SearchBackendKind, SearchSettings, WorkspaceMode, WorkspaceSettings};

    use super::*;

    /// Every built-in's schema compiles, and is a bare object schema: no `$schema`, and no
    /// `$ref` or `$defs`, which not every provider follows.
    #[test]
    fn every_builtin_schema_is_valid_and_plain() {
        let dir = tempfile::tempdir().unwrap();
        let workspace = WorkspaceSettings {
            path: dir.path().to_owned(),
            mode: WorkspaceMode::Writable,
            approve_writes: true,
        };
        let config = BuiltinConfig {
            workspace: Some(workspace.clone()),
            search: Some(SearchSettings {
                backend: SearchBackendKind::Searxng,
                url: Some("http://127.0.0.1:9".into()),
                api_key_env: None,
                timeout: Duration::from_secs(1),
            }),
            ..BuiltinConfig::default()
        };
        let builtins: Vec<Arc<dyn Tool>> =
            BUILTIN_NAMES.iter().filter_map(|name| builtin(name, &config)).collect();
        // Every built-in this build has (`compose` is made by the agent from its other tools).
        let expected = BUILTIN_NAMES.len()
            - 1
            - usize::from(!cfg!(feature = "js"))
            - usize::from(!cfg!(target_os = "linux"));
        assert_eq!(
            builtins.len(),
            expected,
            "{:?}",
            builtins.iter().map(|tool| &tool.spec().name).collect::<Vec<_>>()
        );
        let mut schemas: Vec<(String, serde_json::Value)> = builtins
            .into_iter()
            .chain(workspace_tools(&workspace).unwrap())
            .map(|tool| (tool.spec().name.clone(), tool.spec().input_schema.clone()))
            .collect();
        schemas.push((
            compose::ComposeTool::NAME.into(),
            keel_core::machine::compose::input_schema(&["a", "b"]),
        ));
        for (name, schema) in &schemas {
            assert!(keel_core::tool::check_schema(schema).is_ok(), "{name}: {schema}");
            assert_eq!(schema["type"], "object", "{name}: {schema}");
            let text = schema.to_string();
            assert!(!["$ref", "$defs", "$schema"].iter().any(|key| text.contains(key)), "{name}: {schema}");
        }
    }

    /// A function tool's schema, as schemars derives it: `format`s for the number types (notes
    /// only, in 2020-12) and bounds for the unsigned ones, which are checked.
    #[test]
    fn a_function_tools_schema_checks_its_inputs() {
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        struct Input {
            /// How many.
            count: u32,
            ratio: f64,
            offset: Option<i64>,
            label: String,
            flags: Vec<bool>,
        }
        let tool = function_tool("measure", "Measures", |input: Input| async move {
            Ok::<_, std::convert::Infallible>(input.count)
        });
        let schema = &tool.spec().input_schema;
        assert_eq!(schema["properties"]["count"]["format"], "uint32", "{schema}");
        let tools = keel_core::ToolSet::new(vec![tool as Arc<dyn Tool>]).unwrap();
        let good = serde_json::json!({"count": 3, "ratio": 0.5, "label": "a", "flags": [true]});
        tools.validate_input("measure", &good).unwrap();
        let negative = serde_json::json!({"count": -1, "ratio": 0.5, "label": "a", "flags": []});
        let problems = tools.validate_input("measure", &negative).unwrap_err();
        assert!(problems.contains("/count"), "{problems}");
    }

    /// Nested types are written into the schema where they are used, not as `$defs` behind
    /// `$ref`s: some providers do not follow references. The nested fields are still checked.
    #[test]
    fn a_function_tools_nested_types_are_written_inline() {
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        struct Address {
            city: String,
            zip: Option<u32>,
        }
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[serde(rename_all = "snake_case")]
        #[allow(dead_code)]
        enum Speed {
            Standard,
            Express { hours: u8 },
        }
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        struct Order {
            to: Address,
            from: Option<Address>,
            stops: Vec<Address>,
            speed: Speed,
        }
        let tool = function_tool("ship", "Ships an order", |order: Order| async move {
            Ok::<_, std::convert::Infallible>(order.to.city)
        });
        let schema = &tool.spec().input_schema;
        let text = schema.to_string();
        assert!(!text.contains("$ref") && !text.contains("$defs") && !text.contains("$schema"), "{schema}");

        let tools = keel_core::ToolSet::new(vec![tool as Arc<dyn Tool>]).unwrap();
        let good = serde_json::json!({
            "to": {"city": "Lyon"}, "from": null, "stops": [{"city": "Dijon", "zip": 21000}],
            "speed": {"express": {"hours": 4}}
        });
        tools.validate_input("ship", &good).unwrap();
        let bad_stop = serde_json::json!({
            "to": {"city": "Lyon"}, "stops": [{"zip": "21000"}], "speed": "standard"
        });
        let problems = tools.validate_input("ship", &bad_stop).unwrap_err();
        assert!(problems.contains("/stops/0"), "{problems}");
        let bad_speed = serde_json::json!({"to": {"city": "Lyon"}, "stops": [], "speed": "warp"});
        assert!(tools.validate_input("ship", &bad_speed).is_err());
    }

    /// A recursive type cannot be written inline: its schema keeps a `$ref` to itself, which
    /// the validator follows to any depth.
    #[test]
    fn a_function_tools_recursive_type_is_checked_at_every_depth() {
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        struct Node {
            name: String,
            children: Vec<Node>,
        }
        let tool = function_tool("tree", "Takes a tree", |node: Node| async move {
            Ok::<_, std::convert::Infallible>(node.name)
        });
        let schema = &tool.spec().input_schema;
        assert!(schema.to_string().contains("$ref"), "{schema}");
        let tools = keel_core::ToolSet::new(vec![tool as Arc<dyn Tool>]).unwrap();
        let deep = |leaf: serde_json::Value| serde_json::json!({"name": "a", "children": [{"name": "b", "children": [leaf]}]});
        tools.validate_input("tree", &deep(serde_json::json!({"name": "c", "children": []}))).unwrap();
        let problems =
            tools.validate_input("tree", &deep(serde_json::json!({"name": 3, "children": []}))).unwrap_err();
        assert!(problems.contains("/children/0/children/0/name"), "{problems}");
    }
}
