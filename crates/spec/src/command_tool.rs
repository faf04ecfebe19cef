//! Command tools: `tools/<name>.toml` files.
//!
//! ```toml
//! description = "Adds two numbers"
//! command = ["python3", "add.py"]        # argv; no shell
//! timeout = "10s"                         # optional
//! working_dir = "."                       # optional, relative to the agent directory
//! env = ["MY_API_KEY"]                    # optional: variables of keel's environment it gets
//! state = "write"                         # optional: the session state in $KEEL_STATE_FILE ("read" | "write")
//! [input_schema]                          # optional JSON Schema, default: any object
//! type = "object"
//! properties = { a = { type = "number" }, b = { type = "number" } }
//! required = ["a", "b"]
//! ```

use std::path::{Path, PathBuf};

use keel_core::agent::StateAccess;
use keel_core::tool::{check_schema, validate_tool_name};
use keel_core::{CommandToolDef, ErrorCode};
use serde_json::json;

use crate::CommandToolSpec;
use crate::decode::{Decoder, did_you_mean, map_lacks};
use crate::diagnostic::{Diagnostic, Pos, read_text};
use crate::tree::{self, Format, Kind};

const KEYS: &[&str] = &["description", "command", "input_schema", "timeout", "working_dir", "env", "state"];

/// Loads every `*.toml` of `tools_dir` (sorted by name). `base_dir` is where commands run by
/// default and what relative paths are relative to.
pub(crate) fn load_dir(
    tools_dir: &Path,
    base_dir: &Path,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<CommandToolSpec> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(tools_dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml") && p.is_file())
            .collect(),
        Err(_) => return Vec::new(),
    };
    files.sort();
    files.iter().filter_map(|file| load_file(file, base_dir, diagnostics)).collect()
}

/// The names of the tool files in `tools_dir` (`<name>.toml`), whether they load or not.
pub(crate) fn declared_names(tools_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(tools_dir) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml") && path.is_file())
        .filter_map(|path| path.file_stem().and_then(|s| s.to_str()).map(str::to_owned))
        .collect()
}

fn load_file(file: &Path, base_dir: &Path, diagnostics: &mut Vec<Diagnostic>) -> Option<CommandToolSpec> {
    let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
    if !validate_tool_name(&name) {
        diagnostics.push(
            Diagnostic::error(
                ErrorCode::SpecInvalid,
                file,
                Pos::default(),
                format!("invalid tool name {name:?} (from the file name)"),
            )
            .with_hint("name tool files with 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`, then `.toml`"),
        );
        return None;
    }
    let text = read_text(file, "tool", diagnostics)?;
    let root = match tree::parse(&text, Format::Toml, file) {
        Ok(root) => root,
        Err(diagnostic) => {
            diagnostics.push(diagnostic);
            return None;
        }
    };
    let mut d = Decoder { file: file.to_owned(), diagnostics };
    let mut map = d.map(&root, "the tool")?;
    let description = map.take("description").and_then(|n| d.text(n, "description"));
    let command_node = map.take("command");
    let schema_node = map.take("input_schema");
    let timeout = map.take("timeout").and_then(|n| d.duration(n, "timeout"));
    let working_dir = match map.take("working_dir") {
        Some(node) => {
            let dir = base_dir.join(d.text(node, "working_dir")?);
            if !dir.is_dir() {
                d.error(node.pos, format!("`working_dir` {} is not a directory", dir.display())).hint =
                    Some("the path is relative to the agent directory".into());
                return None;
            }
            dir
        }
        None => base_dir.to_owned(),
    };
    let env = match map.take("env") {
        Some(node) => pass_through(node, &mut d)?,
        None => Vec::new(),
    };
    let state = match map.take("state") {
        Some(node) => match d.text(node, "state")?.as_str() {
            "read" => StateAccess::Read,
            "write" => StateAccess::Write,
            "none" => StateAccess::None,
            other => {
                let hint = did_you_mean(other, &["read", "write", "none"])
                    .map_or("use \"read\" or \"write\"".to_owned(), |close| {
                        format!("did you mean `{close}`?")
                    });
                d.error(
                    node.pos,
                    format!("`state` is {other:?}: it must be \"read\", \"write\" or \"none\""),
                )
                .hint = Some(hint);
                return None;
            }
        },
        None => StateAccess::None,
    };
    // A typo of a required key is reported once, as the unknown key it is.
    let (description_typo, command_typo) =
        (map.misspelled("description", KEYS), map.misspelled("command", KEYS));
    map.finish(&mut d, "", KEYS);

    if description.is_none() && map_lacks(&root, "description") && !description_typo {
        d.error(root.pos, "missing `description`").hint =
            Some("say what the tool does and when to use it: the model reads it".into());
    }
    let command = match command_node {
        None if command_typo => None,
        None => {
            d.error(root.pos, "missing `command`").hint =
                Some("add the program and its arguments, e.g. `command = [\"python3\", \"add.py\"]`".into());
            None
        }
        Some(node) => command(node, &mut d, &working_dir),
    };
    let input_schema = match schema_node {
        None => json!({ "type": "object" }),
        Some(node) => {
            let schema = node.to_json();
            if let Err(problem) = check_schema(&schema) {
                let at = node.at_pointer(&problem.pointer).pos;
                d.error(at, format!("`input_schema` is not a valid JSON Schema: {problem}"));
                return None;
            }
            schema
        }
    };
    Some(CommandToolSpec {
        def: CommandToolDef {
            name,
            description: description?,
            input_schema,
            command: command?,
            working_dir,
            timeout,
            env,
            state,
        },
        file: file.to_owned(),
    })
}

/// `env`: the names of the variables passed on from keel's environment. A tool starts from a
/// minimal environment; keel's own secrets are never passed, so naming one is an error.
fn pass_through(node: &tree::Node, d: &mut Decoder<'_>) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for (name, pos) in d.string_list(node, "env")? {
        let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            d.error(pos, format!("`env` lists {name:?}, which is not an environment variable name")).hint =
                Some(
                    "names are letters, digits and `_`, not starting with a digit: `env = [\"MY_API_KEY\"]`"
                        .into(),
                );
        } else if keel_core::env::is_secret(&name) || name.starts_with("KEEL_") {
            d.error(
                pos,
                format!("`env` lists {name}, one of keel's own settings: keel never passes it to a tool"),
            )
            .hint = Some("give the tool its own variable (say `MY_TOOL_API_KEY`) and name that".into());
        } else {
            names.push(name);
        }
    }
    Some(names)
}

fn command(node: &tree::Node, d: &mut Decoder<'_>, working_dir: &Path) -> Option<Vec<String>> {
    if let Kind::Str(line) = &node.kind {
        let words: Vec<String> = line.split_whitespace().map(|w| format!("{w:?}")).collect();
        d.error(node.pos, "`command` must be a list of arguments, not a string").hint =
            Some(format!("no shell runs the command; write `command = [{}]`", words.join(", ")));
        return None;
    }
    let argv: Vec<String> = d.string_list(node, "command")?.into_iter().map(|(arg, _)| arg).collect();
    let Some(program) = argv.first() else {
        d.error(node.pos, "`command` is empty").hint = Some("give the program and its arguments".into());
        return None;
    };
    let mut argv = argv.clone();
    if program.contains('/') {
        let path = Path::new(program);
        let resolved = if path.is_absolute() {
            path.to_owned()
        } else {
            // `./bin/x` joins as `dir/bin/x`, not `dir/./bin/x`.
            let relative: PathBuf =
                path.components().filter(|c| *c != std::path::Component::CurDir).collect();
            working_dir.join(relative)
        };
        if !resolved.is_file() {
            d.error(node.pos, format!("the command's program `{program}` does not exist (looked at {})", resolved.display())).hint =
                Some("relative paths are relative to the tool's working directory (the agent directory by default)".into());
            return None;
        }
        argv[0] = resolved.to_string_lossy().into_owned();
    } else {
        // Found on keel's PATH now, and run from there: the tool itself gets a minimal PATH.
        let Some(found) = on_path(program) else {
            d.error(node.pos, format!("the command's program `{program}` is not on PATH")).hint =
                Some("install it, or give a path such as `./scripts/tool.sh`".into());
            return None;
        };
        argv[0] = found.to_string_lossy().into_owned();
    }
    Some(argv)
}

fn on_path(program: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|dir| dir.join(program)).find(|path| path.is_file())
}
