//! `keel check`: load an agent and print every problem.

use std::io::Write;

use super::CheckArgs;
use super::exit;

pub(crate) fn check(args: &CheckArgs) -> std::io::Result<u8> {
    let options = keel_spec::LoadOptions {
        builtin_tools: keel_tools::BUILTIN_NAMES,
        providers: keel_providers::PROVIDER_NAMES,
        tool_name: keel_tools::tool_name,
    };
    let loaded = keel_spec::load(&args.agent, &options);
    let mut stderr = std::io::stderr().lock();
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    let errors = loaded.diagnostics.iter().filter(|d| d.is_error()).count();
    let mut warnings = loaded.diagnostics.len() - errors;
    match loaded.spec {
        Some(spec) => {
            let folders = check_documents(&spec, &mut stderr)?;
            warnings += folders.iter().map(|(_, report)| report.warnings.len()).sum::<usize>();
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
            for (folder, report) in &folders {
                writeln!(
                    stdout,
                    "documents: {} ({} document{}, {} passage{})",
                    folder.display(),
                    report.documents,
                    plural(report.documents),
                    report.passages,
                    plural(report.passages)
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

/// Reads the agent's folders of documents as indexing will, printing each file that will be
/// skipped as a warning (a skipped file never stops the agent).
fn check_documents(
    spec: &keel_spec::AgentSpec,
    stderr: &mut impl Write,
) -> std::io::Result<Vec<(std::path::PathBuf, keel_memory::semantic::FolderReport)>> {
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
                reports.push((knowledge.source.clone(), report));
            }
            Err(error) => writeln!(stderr, "warning: {error}")?,
        }
    }
    Ok(reports)
}

/// Connects to the agent's MCP servers and lists their tools as the agent will name them.
async fn check_mcp(spec: keel_spec::AgentSpec) -> std::io::Result<u8> {
    let mut taken: Vec<String> =
        spec.builtin_tools.iter().map(|name| keel_tools::tool_name(name).to_owned()).collect();
    taken.extend(spec.command_tools.iter().map(|tool| tool.def.name.clone()));
    taken.extend(spec.subagents.iter().map(|sub| sub.name.clone()));
    let servers = match keel::mcp::connect_all(spec.mcp.clone(), &taken).await {
        Ok(servers) => servers,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(exit::INVALID_AGENT);
        }
    };
    let mut stdout = std::io::stdout().lock();
    for server in &servers {
        let tools: Vec<String> = server.remote_tools().into_iter().map(|tool| tool.spec.name).collect();
        writeln!(
            stdout,
            "mcp `{}`: {} tool{}: {}",
            server.name(),
            tools.len(),
            plural(tools.len()),
            tools.join(", ")
        )?;
    }
    let approvals = spec.approval_tools.iter().filter(|name| {
        spec.mcp.iter().any(|server| name.starts_with(&server.tool_prefix()))
            && !servers.iter().any(|server| server.remote_tools().iter().any(|tool| &tool.spec.name == *name))
    });
    let mut missing = 0;
    for name in approvals {
        missing += 1;
        eprintln!(
            "error[{}]: `approvals.tools` names `{name}`, which no MCP server of the agent offers",
            keel::ErrorCode::SpecInvalid.as_str()
        );
    }
    Ok(if missing == 0 { exit::OK } else { exit::INVALID_AGENT })
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}
