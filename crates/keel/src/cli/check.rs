//! `keel check`: load an agent and print every problem.

use std::io::Write;

use super::CheckArgs;
use super::exit;

pub(crate) fn check(args: &CheckArgs) -> std::io::Result<u8> {
    let options = super::load_options();
    let loaded = keel_spec::load(&args.agent, &options);
    if args.json {
        return check_json(args, loaded);
    }
    let mut stderr = std::io::stderr().lock();
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    let errors = loaded.diagnostics.iter().filter(|d| d.is_error()).count();
    let mut warnings = loaded.diagnostics.len() - errors;
    match loaded.spec {
        Some(spec) => {
            let (cases, tests) = check_tests(&args.agent, &spec);
            for diagnostic in &tests {
                writeln!(stderr, "{diagnostic}")?;
            }
            let test_errors = tests.iter().filter(|d| d.is_error()).count();
            if test_errors > 0 {
                writeln!(stderr, "{test_errors} error{} found in the test cases", plural(test_errors))?;
                return Ok(exit::INVALID_AGENT);
            }
            warnings += tests.len();
            let folders = check_documents(&spec, &mut stderr)?;
            warnings += folders.iter().map(|folder| folder.skipped).sum::<usize>();
            let mut tools: Vec<&str> = spec.builtin_tools.iter().map(String::as_str).collect();
            tools.extend(spec.command_tools.iter().map(|t| t.def.name.as_str()));
            let knowledge_tools = spec.memory.knowledge_tools();
            tools.extend(knowledge_tools.iter().map(String::as_str));
            let tools =
                if tools.is_empty() { "no tools".to_owned() } else { format!("tools: {}", tools.join(", ")) };
            let mut stdout = std::io::stdout().lock();
            let warned = if warnings > 0 {
                format!(" ({warnings} warning{})", plural(warnings))
            } else {
                String::new()
            };
            writeln!(stdout, "ok: agent `{}` (model {}; {tools}){warned}", spec.name, spec.model)?;
            if cases > 0 {
                writeln!(
                    stdout,
                    "tests: {cases} case{} in {}",
                    plural(cases),
                    args.agent.join("tests").display()
                )?;
            }
            for folder in &folders {
                writeln!(
                    stdout,
                    "documents: {} ({} document{}, {} passage{})",
                    folder.path.display(),
                    folder.documents,
                    plural(folder.documents),
                    folder.passages,
                    plural(folder.passages)
                )?;
            }
            drop(stdout);
            drop(stderr);
            if spec.mcp.is_empty() {
                return Ok(exit::OK);
            }
            if args.offline {
                let names: Vec<&str> = spec.mcp.iter().map(|server| server.name.as_str()).collect();
                writeln!(std::io::stdout(), "MCP servers not checked (--offline): {}", names.join(", "))?;
                return Ok(exit::OK);
            }
            super::run_async(check_mcp(spec))?
        }
        None => {
            writeln!(stderr, "{} error{} found in {}", errors, plural(errors), args.agent.display())?;
            Ok(exit::INVALID_AGENT)
        }
    }
}

/// The test cases of an agent directory (`tests/*.yaml`): how many there are, and their
/// diagnostics.
fn check_tests(agent: &std::path::Path, spec: &keel_spec::AgentSpec) -> (usize, Vec<keel_spec::Diagnostic>) {
    if !agent.is_dir() {
        return (0, Vec::new());
    }
    let files = match keel_spec::test_files(agent) {
        Ok(files) => files,
        Err(error) => {
            let dir = agent.join("tests");
            let diagnostic = keel_spec::Diagnostic::error(
                keel::ErrorCode::SpecNotFound,
                &dir,
                keel_spec::Pos::default(),
                format!("cannot read the test cases: {error}"),
            );
            return (0, vec![diagnostic]);
        }
    };
    let names = super::test::spec_tool_names(spec);
    let loaded = keel_spec::load_tests(&files, names.as_deref(), keel_tools::tool_name);
    (files.len(), loaded.diagnostics)
}

/// What `keel check` found in a folder of documents.
struct Folder {
    path: std::path::PathBuf,
    documents: usize,
    passages: usize,
    /// The files indexing will skip.
    skipped: usize,
}

/// Reads the agent's folders of documents as indexing will, printing each file that will be
/// skipped as a warning (a skipped file never stops the agent).
#[cfg(feature = "knowledge")]
fn check_documents(spec: &keel_spec::AgentSpec, stderr: &mut impl Write) -> std::io::Result<Vec<Folder>> {
    let mut reports = Vec::new();
    for knowledge in &spec.memory.knowledge {
        match keel_memory::semantic::check_folder(&knowledge.source) {
            Ok(report) => {
                for skipped in &report.warnings {
                    writeln!(
                        stderr,
                        "warning: {}: {}",
                        knowledge.source.join(&skipped.path).display(),
                        skipped.message
                    )?;
                }
                reports.push(Folder {
                    path: knowledge.source.clone(),
                    documents: report.documents,
                    passages: report.passages,
                    skipped: report.warnings.len(),
                });
            }
            Err(error) => writeln!(stderr, "warning: {error}")?,
        }
    }
    Ok(reports)
}

/// A build without `knowledge` loads no agent with documents (the loader refuses them).
#[cfg(not(feature = "knowledge"))]
fn check_documents(_: &keel_spec::AgentSpec, _: &mut impl Write) -> std::io::Result<Vec<Folder>> {
    Ok(Vec::new())
}

/// The agent's MCP servers, connected: each server's tools as the agent will name them, and
/// the errors found (a server that does not start; an approval naming a tool no server has).
#[cfg(feature = "mcp")]
async fn mcp_tools(
    spec: &keel_spec::AgentSpec,
) -> (Vec<(String, Vec<String>)>, Vec<(keel::ErrorCode, String)>) {
    let mut taken: Vec<String> =
        spec.builtin_tools.iter().map(|name| keel_tools::tool_name(name).to_owned()).collect();
    taken.extend(spec.command_tools.iter().map(|tool| tool.def.name.clone()));
    taken.extend(spec.subagents.iter().map(|sub| sub.name.clone()));
    // Every server's failure, not only the first.
    let (servers, failures) = keel::mcp::connect_each(spec.mcp.clone(), &taken).await;
    let mut errors: Vec<(keel::ErrorCode, String)> =
        failures.into_iter().map(|failure| (failure.code, failure.message)).collect();
    let listed: Vec<(String, Vec<String>)> = servers
        .iter()
        .map(|server| {
            (server.name().to_owned(), server.remote_tools().into_iter().map(|tool| tool.spec.name).collect())
        })
        .collect();
    // An approval for a server's tool is judged only when that server answered.
    let answered = |name: &str| {
        spec.mcp.iter().any(|server| {
            name.starts_with(&server.tool_prefix()) && listed.iter().any(|(listed, _)| *listed == server.name)
        })
    };
    errors.extend(
        spec.approval_tools
            .iter()
            .filter(|name| answered(name) && !listed.iter().any(|(_, tools)| tools.contains(name)))
            .map(|name| {
                (
                    keel::ErrorCode::SpecInvalid,
                    format!("`approvals.tools` names `{name}`, which no MCP server of the agent offers"),
                )
            }),
    );
    (listed, errors)
}

/// A build without `mcp` loads no agent with MCP servers (the loader refuses them); were one
/// given, this is what it would be told.
#[cfg(not(feature = "mcp"))]
async fn mcp_tools(_: &keel_spec::AgentSpec) -> (Vec<(String, Vec<String>)>, Vec<(keel::ErrorCode, String)>) {
    let why = "this keel was built without the `mcp` cargo feature: it cannot connect to MCP servers";
    (Vec::new(), vec![(keel::ErrorCode::SpecUnsupported, why.to_owned())])
}

/// Connects to the agent's MCP servers and lists their tools as the agent will name them.
async fn check_mcp(spec: keel_spec::AgentSpec) -> std::io::Result<u8> {
    let (servers, errors) = mcp_tools(&spec).await;
    let mut stdout = std::io::stdout().lock();
    for (server, tools) in &servers {
        writeln!(
            stdout,
            "mcp `{server}`: {} tool{}: {}",
            tools.len(),
            plural(tools.len()),
            tools.join(", ")
        )?;
    }
    for (code, message) in &errors {
        eprintln!("error[{}]: {message}", code.as_str());
    }
    if !errors.is_empty() {
        eprintln!("{} error{} with the MCP servers of {}", errors.len(), plural(errors.len()), spec.name);
    }
    Ok(if errors.is_empty() { exit::OK } else { exit::INVALID_AGENT })
}

/// `keel check --json`: one document, `{ok, agent?, diagnostics, documents, mcp}`.
fn check_json(args: &CheckArgs, loaded: keel_spec::Loaded) -> std::io::Result<u8> {
    let mut diagnostics: Vec<serde_json::Value> =
        loaded.diagnostics.iter().map(keel_spec::Diagnostic::to_json).collect();
    let mut document = serde_json::json!({ "ok": false, "documents": [], "mcp": [] });
    if let Some(spec) = loaded.spec {
        let (cases, tests) = check_tests(&args.agent, &spec);
        diagnostics.extend(tests.iter().map(keel_spec::Diagnostic::to_json));
        document["tests"] = cases.into();
        #[cfg_attr(not(feature = "knowledge"), allow(unused_mut))]
        let mut documents: Vec<serde_json::Value> = Vec::new();
        #[cfg(feature = "knowledge")]
        for knowledge in &spec.memory.knowledge {
            match keel_memory::semantic::check_folder(&knowledge.source) {
                Ok(report) => {
                    for skipped in &report.warnings {
                        diagnostics.push(serde_json::json!({
                            "severity": "warning",
                            "message": skipped.message,
                            "file": knowledge.source.join(&skipped.path).display().to_string(),
                        }));
                    }
                    documents.push(serde_json::json!({
                        "folder": knowledge.source.display().to_string(),
                        "documents": report.documents,
                        "passages": report.passages,
                    }));
                }
                Err(error) => diagnostics.push(serde_json::json!({
                    "severity": "warning",
                    "message": error.to_string(),
                    "file": knowledge.source.display().to_string(),
                })),
            }
        }
        let mut tools: Vec<String> = spec.builtin_tools.clone();
        tools.extend(spec.command_tools.iter().map(|t| t.def.name.clone()));
        tools.extend(spec.memory.knowledge_tools());
        document["agent"] = serde_json::json!({ "name": spec.name, "model": spec.model, "tools": tools });
        document["documents"] = documents.into();
        if !spec.mcp.is_empty() && !args.offline {
            let (servers, errors) = super::run_async(async { mcp_tools(&spec).await })?;
            document["mcp"] = servers
                .into_iter()
                .map(|(server, tools)| serde_json::json!({ "server": server, "tools": tools }))
                .collect::<Vec<_>>()
                .into();
            for (code, message) in errors {
                diagnostics.push(serde_json::json!({
                    "severity": "error",
                    "code": code.as_str(),
                    "message": message,
                    "file": spec.source.display().to_string(),
                }));
            }
        }
    }
    let ok = !diagnostics.iter().any(|d| d["severity"] == "error");
    document["ok"] = ok.into();
    document["diagnostics"] = diagnostics.into();
    writeln!(std::io::stdout().lock(), "{document}")?;
    Ok(if ok { exit::OK } else { exit::INVALID_AGENT })
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}
