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
    let warnings = loaded.diagnostics.len() - errors;
    match loaded.spec {
        Some(spec) => {
            let mut tools: Vec<&str> = spec.builtin_tools.iter().map(String::as_str).collect();
            tools.extend(spec.command_tools.iter().map(|t| t.def.name.as_str()));
            let tools =
                if tools.is_empty() { "no tools".to_owned() } else { format!("tools: {}", tools.join(", ")) };
            let mut stdout = std::io::stdout().lock();
            let warned = if warnings > 0 {
                format!(" ({warnings} warning{})", plural(warnings))
            } else {
                String::new()
            };
            writeln!(stdout, "ok: agent `{}` (model {}; {tools}){warned}", spec.name, spec.model)?;
            Ok(exit::OK)
        }
        None => {
            writeln!(stderr, "{} error{} found in {}", errors, plural(errors), args.agent.display())?;
            Ok(exit::INVALID_AGENT)
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}
