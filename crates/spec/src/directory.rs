//! Agent directories: the spec file, `instructions.md`, `tools/` and `skills/`, and the checks
//! that need all of them (tool names, collisions).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use keel_core::ErrorCode;

use crate::command_tool;
use crate::decode::{Decoder, did_you_mean};
use crate::diagnostic::{Diagnostic, Pos, read_text};
use crate::spec_file::{self, FileSpec};
use crate::tree::{self, Kind};
use crate::{AgentSpec, CommandToolSpec, LoadOptions, SPEC_FILE_NAMES};

const SKILL_KEYS: &[&str] =
    &["name", "description", "license", "allowed-tools", "metadata", "compatibility", "version", "knowledge"];

/// A skill: instructions (and tools) the agent gains.
struct Skill {
    name: String,
    description: String,
    body: String,
    tools: Vec<CommandToolSpec>,
    /// Its documents to retrieve from (front matter `knowledge`).
    knowledge: Option<keel_core::memory::Knowledge>,
}

/// Loads an agent directory, finding its spec file.
pub(crate) fn load(
    dir: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<AgentSpec> {
    let found: Vec<PathBuf> = SPEC_FILE_NAMES.iter().map(|n| dir.join(n)).filter(|p| p.is_file()).collect();
    match found.as_slice() {
        [] => {
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecNotFound,
                    dir,
                    Pos::default(),
                    "no agent.yaml, agent.toml or agent.json in this directory",
                )
                .with_hint("create agent.yaml with at least `model: mock`"),
            );
            None
        }
        [file] => load_with_spec_file(dir, file, options, diagnostics),
        [first, second, ..] => {
            diagnostics.push(Diagnostic::error(
                ErrorCode::SpecInvalid,
                second,
                Pos::default(),
                format!(
                    "the directory has two spec files, {} and {}; keep one",
                    file_name(first),
                    file_name(second)
                ),
            ));
            None
        }
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Loads the agent directories under `subagents/`: each becomes a tool named after its
/// directory.
fn load_subagents(
    dir: &Path,
    absolute: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<AgentSpec> {
    let root = dir.join("subagents");
    let Ok(entries) = std::fs::read_dir(&root) else { return Vec::new() };
    let mut paths: Vec<PathBuf> =
        entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    paths.sort();
    let mut subagents = Vec::new();
    for path in paths {
        let name = file_name(&path);
        if !keel_core::tool::validate_tool_name(&name) {
            diagnostics.push(
                Diagnostic::error(ErrorCode::SpecInvalid, &path, Pos::default(), format!("invalid subagent name {name:?}"))
                    .with_hint("a subagent is a tool: name its directory with 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`"),
            );
            continue;
        }
        // A symlink back up the tree would make the agent its own subagent, forever.
        let canonical = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if absolute.starts_with(&canonical) {
            diagnostics.push(Diagnostic::error(
                ErrorCode::SpecInvalid,
                &path,
                Pos::default(),
                format!("subagents/{name} leads back to an agent that contains it"),
            ));
            continue;
        }
        if let Some(mut spec) = load(&path, options, diagnostics) {
            spec.name = name;
            subagents.push(spec);
        }
    }
    subagents
}

/// Loads an agent directory whose spec file is `file`.
pub(crate) fn load_with_spec_file(
    dir: &Path,
    file: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<AgentSpec> {
    // Absolute paths for what runs later (working directories), relative ones in messages.
    let absolute = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let spec = spec_file::read(file, options, diagnostics);

    let instructions_file = dir.join("instructions.md");
    let dir_instructions = if instructions_file.is_file() {
        read_text(&instructions_file, "instructions", diagnostics)
    } else {
        None
    };
    if let (Some(spec), Some(_)) = (&spec, &dir_instructions)
        && let Some((_, pos)) = &spec.instructions
    {
        diagnostics.push(
            Diagnostic::error(
                ErrorCode::SpecInvalid,
                file,
                *pos,
                "the instructions are given twice: here and in instructions.md",
            )
            .with_hint("keep one of them"),
        );
    }

    let mut command_tools = command_tool::load_dir(&dir.join("tools"), &absolute, diagnostics);
    for tool in &mut command_tools {
        tool.def.working_dir = rebase(&tool.def.working_dir, dir, &absolute);
    }
    let requested = spec.as_ref().and_then(|s| s.skills.clone());
    let skills = load_skills(dir, &absolute, requested.as_deref(), file, diagnostics);
    let subagents = load_subagents(dir, &absolute, options, diagnostics);
    let schedule_files = crate::schedule::load_dir(&dir.join("schedules"), diagnostics);
    let channels = crate::channel::load_dir(&dir.join("channels"), diagnostics);

    let mut spec = spec?;
    for (schedule, path) in schedule_files {
        if let Some((_, pos)) = spec.triggers.iter().find(|(other, _)| other.name == schedule.name) {
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecInvalid,
                    &path,
                    Pos::default(),
                    format!(
                        "schedule `{}` is also a trigger of {} (line {})",
                        schedule.name,
                        file_name(file),
                        pos.line
                    ),
                )
                .with_hint("keep one of them, or rename the file"),
            );
            continue;
        }
        spec.triggers.push((schedule, Pos::default()));
    }
    let default_name = absolute.file_name().and_then(|n| n.to_str()).unwrap_or("agent").to_owned();
    let mut instructions = dir_instructions.unwrap_or_default();
    let mut skill_names = Vec::new();
    let mut skill_knowledge = Vec::new();
    for skill in skills {
        skill_knowledge.extend(skill.knowledge);
        for tool in skill.tools {
            if let Some(existing) = command_tools.iter().find(|t| t.def.name == tool.def.name) {
                diagnostics.push(
                    Diagnostic::error(
                        ErrorCode::SpecInvalid,
                        &tool.file,
                        Pos::default(),
                        format!(
                            "tool `{}` of skill `{}` has the same name as the tool in {}",
                            tool.def.name,
                            skill.name,
                            existing.file.display()
                        ),
                    )
                    .with_hint("tool names must be unique across the agent and its skills; rename one"),
                );
                continue;
            }
            command_tools.push(tool);
        }
        append_skill(&mut instructions, &skill.name, &skill.description, &skill.body);
        skill_names.push(skill.name);
    }
    let mut spec = spec;
    spec.memory.knowledge.extend(skill_knowledge);
    // A tool whose file has errors is still the agent's: naming it elsewhere (approvals, the
    // mock script) is not a second error, only the file's own is.
    let mut unloaded: Vec<String> = command_tool::declared_names(&dir.join("tools"));
    for skill in &skill_names {
        unloaded.extend(command_tool::declared_names(&dir.join("skills").join(skill).join("tools")));
    }
    unloaded.retain(|name| !command_tools.iter().any(|tool| &tool.def.name == name));
    let mut agent = finish(
        spec,
        default_name,
        instructions,
        Declared { command_tools, skills: skill_names, subagents, unloaded_tools: unloaded },
        file,
        options,
        diagnostics,
    )?;
    agent.channels = channels;
    let memory_dir = absolute.join("memory");
    if dir.join("memory").is_dir() && !agent.memory.knowledge.iter().any(|k| k.skill.is_none()) {
        diagnostics.push(
            Diagnostic::warning(
                ErrorCode::SpecInvalid,
                &memory_dir,
                Pos::default(),
                "`memory/` holds documents, but the agent does not retrieve from them",
            )
            .with_hint(
                "add `memory: { kind: semantic }` to the spec (see docs/memory.md), or remove the folder",
            ),
        );
    }
    Some(agent)
}

/// The `*.yaml` (or `.yml`) files of `dir`, sorted by name, each parsed, with the name it gives
/// (its stem: 1 to 64 characters of `A-Za-z0-9_-`, else an error naming the file): what
/// `schedules/` and `channels/` hold, one `what` each.
pub(crate) fn yaml_files(
    dir: &Path,
    what: &str,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<(String, PathBuf, tree::Node)> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml") && p.is_file())
            .collect(),
        Err(_) => return Vec::new(),
    };
    files.sort();
    let mut parsed = Vec::new();
    for file in files {
        let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
        if !keel_core::tool::validate_tool_name(&name) {
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecInvalid,
                    &file,
                    Pos::default(),
                    format!("invalid {what} name {name:?} (from the file name)"),
                )
                .with_hint(format!(
                    "name {what} files with 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`, then `.yaml`"
                )),
            );
            continue;
        }
        let Some(text) = read_text(&file, what, diagnostics) else { continue };
        match tree::parse(&text, tree::Format::Yaml, &file) {
            Ok(root) => parsed.push((name, file, root)),
            Err(diagnostic) => diagnostics.push(diagnostic),
        }
    }
    parsed
}

/// A path under `dir` written relative, made absolute under `absolute`.
fn rebase(path: &Path, dir: &Path, absolute: &Path) -> PathBuf {
    match path.strip_prefix(dir) {
        Ok(rest) => absolute.join(rest),
        Err(_) => path.to_owned(),
    }
}

fn append_skill(instructions: &mut String, name: &str, description: &str, body: &str) {
    if !instructions.is_empty() && !instructions.ends_with('\n') {
        instructions.push('\n');
    }
    if !instructions.is_empty() {
        instructions.push('\n');
    }
    instructions.push_str(&format!("## Skill: {name}\n{description}\n\n{}\n", body.trim()));
}

fn load_skills(
    dir: &Path,
    absolute: &Path,
    requested: Option<&[(String, Pos)]>,
    spec_file: &Path,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<Skill> {
    let skills_dir = dir.join("skills");
    let mut available: Vec<String> = std::fs::read_dir(&skills_dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.path().join("SKILL.md").is_file())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    available.sort();
    let names: Vec<String> = match requested {
        None => available.clone(),
        Some(requested) => {
            let mut names = Vec::new();
            let candidates: Vec<&str> = available.iter().map(String::as_str).collect();
            for (name, pos) in requested {
                if available.contains(name) {
                    names.push(name.clone());
                    continue;
                }
                let hint = match did_you_mean(name, &candidates) {
                    Some(close) => format!("did you mean `{close}`?"),
                    None if candidates.is_empty() => {
                        "create skills/<name>/SKILL.md next to the spec".to_owned()
                    }
                    None => format!("available skills: {}", candidates.join(", ")),
                };
                diagnostics.push(
                    Diagnostic::error(
                        ErrorCode::SpecInvalid,
                        spec_file,
                        *pos,
                        format!("unknown skill `{name}`: there is no skills/{name}/SKILL.md"),
                    )
                    .with_hint(hint),
                );
            }
            names
        }
    };
    names
        .into_iter()
        .filter_map(|name| {
            let skill_dir = skills_dir.join(&name);
            let (description, body, knowledge) =
                read_skill_file(&skill_dir.join("SKILL.md"), &name, diagnostics)?;
            let skill_absolute = absolute.join("skills").join(&name);
            let mut tools = command_tool::load_dir(&skill_dir.join("tools"), &skill_absolute, diagnostics);
            for tool in &mut tools {
                tool.def.working_dir = rebase(&tool.def.working_dir, &skill_dir, &skill_absolute);
            }
            let knowledge = knowledge.map(|mut knowledge| {
                knowledge.skill = Some(name.clone());
                if let Ok(relative) = knowledge.source.strip_prefix(&skill_dir) {
                    knowledge.source = skill_absolute.join(relative);
                }
                knowledge
            });
            Some(Skill { name, description, body, tools, knowledge })
        })
        .collect()
}

/// Reads a SKILL.md: YAML front matter between `---` lines, then the instructions; and the
/// skill's `knowledge` (a folder next to SKILL.md, `knowledge/` by default).
fn read_skill_file(
    file: &Path,
    dir_name: &str,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<(String, String, Option<keel_core::memory::Knowledge>)> {
    let text = read_text(file, "skill", diagnostics)?;
    let missing_front_matter = || {
        Diagnostic::error(
            ErrorCode::SpecInvalid,
            file,
            Pos { line: 1, col: 1 },
            "SKILL.md must start with YAML front matter",
        )
        .with_hint("begin the file with `---`, then `name:` and `description:` lines, then `---`")
    };
    let Some(rest) = text.strip_prefix("---\n").or_else(|| text.strip_prefix("---\r\n")) else {
        diagnostics.push(missing_front_matter());
        return None;
    };
    let Some(end) = rest.find("\n---") else {
        diagnostics.push(missing_front_matter());
        return None;
    };
    let front = &rest[..=end];
    let body = rest[end + 4..].trim_start_matches(['-']).trim_start_matches(['\r', '\n']).to_owned();
    let node = match tree::parse_yaml(front, file) {
        Ok(node) => shift_lines(node, 1),
        Err(mut diagnostic) => {
            diagnostic.pos.line += 1;
            diagnostics.push(diagnostic);
            return None;
        }
    };
    let mut d = Decoder { file: file.to_owned(), diagnostics };
    let mut map = d.map(&node, "the front matter")?;
    let name = map.take("name").and_then(|n| d.text(n, "name").map(|t| (t, n.pos)));
    let description = map.take("description").and_then(|n| d.text(n, "description"));
    let knowledge = map.take("knowledge").and_then(|node| skill_knowledge(node, file, &mut d));
    for key in &SKILL_KEYS[2..] {
        map.take(key);
    }
    // Skills are shared between tools that add their own keys: an unknown one is a warning.
    map.finish_leniently(&mut d, "the front matter", SKILL_KEYS);
    match &name {
        Some((name, pos)) if name != dir_name => {
            d.error(*pos, format!("the skill is named `{name}` but lives in skills/{dir_name}/")).hint =
                Some("the front matter `name` must match the skill's directory name".into());
        }
        Some(_) => {}
        None => {
            d.error(node.pos, "the front matter has no `name`");
        }
    }
    if description.is_none() {
        d.error(node.pos, "the front matter has no `description`").hint =
            Some("say in one line what the skill is for".into());
    }
    Some((description?, body, knowledge))
}

/// A skill's `knowledge`: a folder (`knowledge: docs/`) or the keys of a semantic memory
/// (`knowledge: { source: docs/, mode: agentic, top_k: 3 }`).
fn skill_knowledge(
    node: &tree::Node,
    file: &Path,
    d: &mut Decoder<'_>,
) -> Option<keel_core::memory::Knowledge> {
    let skill_dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    if let Kind::Str(_) = &node.kind {
        let source = d.text(node, "knowledge")?;
        let path = skill_dir.join(&source);
        if !path.is_dir() {
            d.error(node.pos, format!("the knowledge folder {} does not exist", path.display())).hint =
                Some("create it next to SKILL.md and put Markdown, text, HTML or PDF files in it".into());
            return None;
        }
        return Some(keel_core::memory::Knowledge::new(path));
    }
    let mut map = d.map(node, "knowledge")?;
    let knowledge = crate::spec_file::knowledge(&mut map, d, "knowledge", &skill_dir, "knowledge/");
    map.finish(d, "knowledge", &crate::spec_file::KNOWLEDGE_KEYS[1..]);
    knowledge
}

/// Moves every position of a tree down by `lines` (front matter starts after `---`).
fn shift_lines(mut node: tree::Node, lines: usize) -> tree::Node {
    node.pos.line += lines;
    node.kind = match node.kind {
        Kind::Seq(items) => Kind::Seq(items.into_iter().map(|n| shift_lines(n, lines)).collect()),
        Kind::Map(entries) => Kind::Map(
            entries
                .into_iter()
                .map(|(k, mut p, v)| {
                    p.line += lines;
                    (k, p, shift_lines(v, lines))
                })
                .collect(),
        ),
        other => other,
    };
    node
}

/// Builds the spec from the decoded file and what the directory added, checking tool names.
#[allow(clippy::too_many_arguments)]
/// What an agent directory declares besides its spec.
#[derive(Default)]
pub(crate) struct Declared {
    /// The command tools loaded (the agent's and its skills').
    pub(crate) command_tools: Vec<CommandToolSpec>,
    /// The skills loaded.
    pub(crate) skills: Vec<String>,
    /// The subagents loaded.
    pub(crate) subagents: Vec<AgentSpec>,
    /// Tools whose files exist but did not load (their errors are reported): names that may
    /// be referred to without a knock-on error.
    pub(crate) unloaded_tools: Vec<String>,
}

pub(crate) fn finish(
    spec: FileSpec,
    default_name: String,
    dir_instructions: String,
    declared: Declared,
    file: &Path,
    options: &LoadOptions<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<AgentSpec> {
    let Declared { command_tools, skills, subagents, unloaded_tools } = declared;
    // Subagents and the search and read tools of documents are tools too, for approvals and
    // mock scripts to name.
    let knowledge_tools = spec.memory.knowledge_tools();
    let command_names: Vec<&str> = command_tools
        .iter()
        .map(|t| t.def.name.as_str())
        .chain(subagents.iter().map(|s| s.name.as_str()))
        .chain(knowledge_tools.iter().map(String::as_str))
        .chain(unloaded_tools.iter().map(String::as_str))
        .collect();
    for tool in &command_tools {
        if options.builtin_tools.contains(&tool.def.name.as_str()) {
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecInvalid,
                    &tool.file,
                    Pos::default(),
                    format!("tool `{}` has the name of a built-in tool", tool.def.name),
                )
                .with_hint("rename the file: built-in tool names are reserved"),
            );
        }
    }
    let mut builtin_tools = Vec::new();
    let mut seen: HashMap<&str, Pos> = HashMap::new();
    // A built-in's former name works, with a warning; it is known by its name from here on.
    let renamed = |name: &str| renamed_builtin(options, name).map(str::to_owned);
    let warn_renamed = |diagnostics: &mut Vec<Diagnostic>, name: &str, now: &str, pos: Pos| {
        diagnostics.push(
            Diagnostic::warning(
                ErrorCode::SpecInvalid,
                file,
                pos,
                format!("the tool `{name}` is now called `{now}`"),
            )
            .with_hint(format!("write `{now}`: the old name still works, for now")),
        );
    };
    for (name, pos) in &spec.tools {
        let now = renamed_builtin(options, name);
        if let Some(first) = seen.insert(now.unwrap_or(name), *pos) {
            diagnostics.push(Diagnostic::warning(
                ErrorCode::SpecInvalid,
                file,
                *pos,
                format!("tool `{name}` is listed twice (first at line {})", first.line),
            ));
            continue;
        }
        if let Some(now) = now {
            warn_renamed(diagnostics, name, now, *pos);
            builtin_tools.push(now.to_owned());
        } else if options.builtin_tools.contains(&name.as_str()) {
            if let Some(feature) = (options.not_built)(name) {
                diagnostics.push(not_built(file, *pos, &format!("the `{name}` tool"), feature));
            }
            builtin_tools.push(name.clone());
        } else if !command_names.contains(&name.as_str()) {
            let candidates: Vec<&str> =
                options.builtin_tools.iter().copied().chain(command_names.iter().copied()).collect();
            let hint = match did_you_mean(name, &candidates) {
                Some(close) => format!("did you mean `{close}`?"),
                None => format!("available tools: {}", candidates.join(", ")),
            };
            diagnostics.push(
                Diagnostic::error(ErrorCode::SpecInvalid, file, *pos, format!("unknown tool `{name}`"))
                    .with_hint(hint),
            );
        }
    }
    let has_workspace = spec.workspace.as_ref().is_some_and(|w| w.mode != keel_core::WorkspaceMode::Disabled);
    if let Some((_, pos)) = spec.tools.iter().find(|(name, _)| name == "shell")
        && !has_workspace
    {
        diagnostics.push(
            Diagnostic::error(
                ErrorCode::SpecInvalid,
                file,
                *pos,
                "`shell` runs in the workspace, and the agent has none",
            )
            .with_hint("add `workspace: { path: ./work, mode: writable }`"),
        );
    }
    match (spec.tools.iter().find(|(name, _)| name == "web_search"), &spec.search) {
        (Some((_, pos)), None) => diagnostics.push(
            Diagnostic::error(
                ErrorCode::SpecInvalid,
                file,
                *pos,
                "`web_search` needs a search backend, and the spec names none",
            )
            .with_hint("add `web_search: { backend: brave }` (or searxng with its `url`, or tavily)"),
        ),
        (None, Some((Some(_), pos))) => diagnostics.push(
            Diagnostic::warning(
                ErrorCode::SpecInvalid,
                file,
                *pos,
                "`web_search` is configured, and not in `tools`",
            )
            .with_hint("add `web_search` to `tools`, or remove the `web_search` key"),
        ),
        _ => {}
    }
    // The workspace tools come with `workspace`, without being listed.
    let workspace_names: &[&str] = match spec.workspace.as_ref().map(|w| w.mode) {
        Some(keel_core::WorkspaceMode::ReadOnly) => &["read_file", "list_files", "stat"],
        Some(keel_core::WorkspaceMode::Writable) => {
            &["read_file", "list_files", "stat", "write_file", "edit_file", "delete_file"]
        }
        _ => &[],
    };
    let forced_tool = match (&spec.provider.tool_choice, spec.tool_choice_pos) {
        (keel_core::ToolChoice::Tool(name), Some(pos)) => Some((name.clone(), pos)),
        _ => None,
    };
    // MCP tools are known once their servers answer: a name with a server's prefix is checked
    // when the agent connects.
    let prefixes: Vec<String> = spec.mcp.iter().map(|(server, _)| server.tool_prefix()).collect();
    let from_mcp = |name: &str| prefixes.iter().any(|prefix| name.starts_with(prefix.as_str()));
    let named = spec.approval_tools.iter().map(|(name, pos)| ("approvals.tools", name, *pos));
    let named = named.chain(spec.stop_tools.iter().map(|(name, pos)| ("stop_when", name, *pos)));
    for (key, name, pos) in
        named.chain(forced_tool.iter().map(|(name, pos)| ("provider.tool_choice", name, *pos)))
    {
        if let Some(now) = renamed(name)
            && builtin_tools.contains(&now)
        {
            warn_renamed(diagnostics, name, &now, pos);
            continue;
        }
        let builtin = builtin_tools.contains(name);
        if !builtin
            && !command_names.contains(&name.as_str())
            && !workspace_names.contains(&name.as_str())
            && !from_mcp(name)
        {
            let candidates: Vec<&str> =
                builtin_tools.iter().map(String::as_str).chain(command_names.iter().copied()).collect();
            let hint = match did_you_mean(name, &candidates) {
                Some(close) => format!("did you mean `{close}`?"),
                None if candidates.is_empty() => "the agent has no tools; list them under `tools`".to_owned(),
                None => format!("the agent's tools: {}", candidates.join(", ")),
            };
            diagnostics.push(
                Diagnostic::error(
                    ErrorCode::SpecInvalid,
                    file,
                    pos,
                    format!("`{key}` names `{name}`, which the agent does not have"),
                )
                .with_hint(hint),
            );
        }
    }
    if let Some(feature) = (options.not_built)("mcp") {
        for (server, pos) in &spec.mcp {
            diagnostics.push(not_built(file, *pos, &format!("the MCP server `{}`", server.name), feature));
        }
    }
    if let Some(feature) = (options.not_built)("knowledge") {
        for knowledge in &spec.memory.knowledge {
            let what = match &knowledge.skill {
                Some(skill) => format!("skill `{skill}`'s documents ({})", knowledge.source.display()),
                None => format!("the documents of semantic memory ({})", knowledge.source.display()),
            };
            diagnostics.push(not_built(file, Pos::default(), &what, feature));
        }
    }
    let mock = spec.mock.map(|(mut script, called)| {
        for (name, pos) in called {
            if let Some(now) = renamed(&name)
                && builtin_tools.contains(&now)
            {
                warn_renamed(diagnostics, &name, &now, pos);
                continue;
            }
            let known = builtin_tools.contains(&name)
                || command_names.contains(&name.as_str())
                || workspace_names.contains(&name.as_str())
                || from_mcp(&name);
            if !known {
                diagnostics.push(Diagnostic::warning(
                    ErrorCode::SpecInvalid,
                    file,
                    pos,
                    format!("the mock script calls `{name}`, which the agent does not have (the model will get an error result)"),
                ));
            }
        }
        for entry in script.entries.iter_mut().chain(script.compact.iter_mut()) {
            for call in &mut entry.tool_calls {
                if let Some(now) = renamed(&call.name) {
                    call.name = now;
                }
            }
        }
        script
    });
    let instructions = match spec.instructions {
        Some((text, _)) if dir_instructions.is_empty() => text,
        Some((text, _)) => format!("{text}\n\n{dir_instructions}"),
        None => dir_instructions,
    };
    Some(AgentSpec {
        name: spec.name.unwrap_or(default_name),
        description: spec.description,
        instructions,
        model: spec.model?,
        builtin_tools,
        command_tools,
        limits: spec.limits,
        retry: spec.retry,
        provider: spec.provider,
        http: spec.http,
        workspace: spec.workspace,
        shell: spec.shell,
        search: spec.search.and_then(|(search, _)| search),
        subagents,
        concurrency: spec.concurrency,
        approval_tools: spec
            .approval_tools
            .into_iter()
            .map(|(name, _)| (options.tool_name)(&name).to_owned())
            .collect(),
        approval_timeout: spec.approval_timeout.unwrap_or(keel_core::AgentDef::DEFAULT_APPROVAL_TIMEOUT),
        output_schema: spec.output_schema,
        max_repairs: spec.max_repairs.unwrap_or(keel_core::LoopControl::DEFAULT_MAX_REPAIRS),
        compaction: spec.compaction,
        stop_tools: spec
            .stop_tools
            .into_iter()
            .map(|(name, _)| (options.tool_name)(&name).to_owned())
            .collect(),
        initial_state: spec.initial_state,
        memory: spec.memory,
        mock,
        skills,
        mcp: spec.mcp.into_iter().map(|(server, _)| server).collect(),
        schedules: spec.triggers.into_iter().map(|(schedule, _)| schedule).collect(),
        channels: Vec::new(),
        source: file.to_owned(),
    })
}

/// The error for a capability the spec uses that this build of keel was compiled without.
fn not_built(file: &Path, pos: Pos, what: &str, feature: &str) -> Diagnostic {
    let failure = keel_core::RunFailure::not_built(what, feature);
    Diagnostic::error(failure.code, file, pos, failure.message).with_hint(format!(
        "install a keel that has it: `cargo install --locked --path crates/keel` builds every feature; \
         with `--no-default-features`, add `--features {feature}`"
    ))
}

/// The name a built-in now has, when `name` is one of its former names.
fn renamed_builtin<'n>(options: &LoadOptions<'_>, name: &'n str) -> Option<&'n str> {
    let now = (options.tool_name)(name);
    (now != name && options.builtin_tools.contains(&now)).then_some(now)
}
