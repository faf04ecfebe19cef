//! `keel init`: a working agent directory to start from, commented, with a mock script so it
//! runs offline at once, and the commands to try next.

use std::io::Write;
use std::path::Path;

use super::{InitArgs, Template, exit};

/// A template's files: (path in the agent directory, content; `NAME` becomes the agent's name).
fn files(template: Template) -> &'static [(&'static str, &'static str)] {
    macro_rules! file {
        ($template:literal, $path:literal) => {
            ($path, include_str!(concat!("../../templates/", $template, "/", $path)))
        };
    }
    match template {
        Template::Assistant => &[
            file!("assistant", "agent.yaml"),
            file!("assistant", "instructions.md"),
            file!("assistant", "tests/today.yaml"),
        ],
        Template::Tools => &[
            file!("tools", "agent.yaml"),
            file!("tools", "instructions.md"),
            file!("tools", "tools/word_count.toml"),
            file!("tools", "tools/word_count.py"),
            file!("tools", "tests/counts_words.yaml"),
        ],
        Template::Approvals => &[
            file!("approvals", "agent.yaml"),
            file!("approvals", "instructions.md"),
            file!("approvals", "tools/send_note.toml"),
            file!("approvals", "tools/send_note.py"),
            file!("approvals", "tests/approved.yaml"),
            file!("approvals", "tests/rejected.yaml"),
            file!("approvals", "tests/waits.yaml"),
        ],
        Template::Mcp => &[
            file!("mcp", "agent.yaml"),
            file!("mcp", "instructions.md"),
            file!("mcp", "notes/welcome.md"),
            file!("mcp", "tests/reads_notes.yaml"),
        ],
        Template::Serve => &[
            file!("serve", "agent.yaml"),
            file!("serve", "instructions.md"),
            file!("serve", "tests/greets.yaml"),
        ],
    }
}

/// A question each template's agent answers from its mock script.
fn example_question(template: Template) -> &'static str {
    match template {
        Template::Assistant => "What day is it?",
        Template::Tools => "How many words are in 'the quick brown fox'?",
        Template::Approvals => "Tell the team the build is green.",
        Template::Mcp => "What is in my notes?",
        Template::Serve => "Hello!",
    }
}

pub(crate) fn init(args: &InitArgs) -> std::io::Result<u8> {
    let dir = &args.dir;
    let mut stderr = std::io::stderr().lock();
    let occupied = std::fs::read_dir(dir).map(|mut entries| entries.next().is_some()).unwrap_or(false);
    if occupied && !args.force {
        writeln!(
            stderr,
            "error: {} is not empty: `keel init` writes a new agent directory\n  hint: give a new directory (`keel init my-agent`), or --force to write into this one (files of the template are replaced, and named)",
            dir.display()
        )?;
        return Ok(exit::INVALID_AGENT);
    }
    if dir.exists() && !dir.is_dir() {
        writeln!(stderr, "error: {} is a file, not a directory", dir.display())?;
        return Ok(exit::INVALID_AGENT);
    }
    let name = agent_name(dir);
    let mut written = Vec::new();
    for (path, content) in files(args.template) {
        let target = dir.join(path);
        if target.exists() {
            writeln!(stderr, "replacing {}", target.display())?;
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(super::at_path("create", parent))?;
        }
        std::fs::write(&target, content.replace("NAME", &name)).map_err(super::at_path("write", &target))?;
        written.push(*path);
    }
    let shown = shown(dir);
    let question = example_question(args.template);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "created the agent `{name}` in {} ({} template): {}",
        dir.display(),
        args.template.name(),
        written.join(", ")
    )?;
    writeln!(out, "\nNext:")?;
    writeln!(out, "  keel check {shown}                 # what keel makes of it")?;
    match args.template {
        Template::Approvals => {
            writeln!(out, "  keel run {shown} \"{question}\" --session demo")?;
            writeln!(
                out,
                "                                    # asks you on a terminal; else the run pauses, kept in .keel/keel.db:"
            )?;
            writeln!(
                out,
                "  keel approvals list                # then `keel approvals approve <id> --agent {shown}`"
            )?;
        }
        _ => writeln!(out, "  keel run {shown} \"{question}\"")?,
    }
    match args.template {
        Template::Approvals => {}
        Template::Mcp => {
            writeln!(out, "                                    # the MCP server comes from npm on first use")?
        }
        Template::Serve => {
            writeln!(
                out,
                "  keel serve {shown}                 # then open http://127.0.0.1:3000/ (the playground)"
            )?;
            writeln!(
                out,
                "  curl -N localhost:3000/chat -H 'content-type: application/json' -d '{{\"sessionId\":\"s1\",\"input\":\"{question}\"}}'"
            )?;
        }
        Template::Assistant | Template::Tools => {}
    }
    writeln!(out, "  keel chat {shown}                  # a conversation, a turn per line")?;
    writeln!(
        out,
        "  keel test {shown}                  # its test cases, tests/*.yaml (--chaos: kill and resume each)"
    )?;
    writeln!(
        out,
        "\nThe agent uses the `mock` model (offline, scripted). For a real one, set `model:` in {}\n(e.g. `openai/gpt-4o-mini` with OPENAI_API_KEY set) and remove the `mock:` script.",
        dir.join("agent.yaml").display()
    )?;
    Ok(exit::OK)
}

/// The agent's name: the directory's, made a valid name (`My Agent` → `my-agent`).
fn agent_name(dir: &Path) -> String {
    let base = std::path::absolute(dir)
        .ok()
        .and_then(|dir| dir.file_name().map(|n| n.to_string_lossy().into_owned()));
    let cleaned: String = base
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c.to_ascii_lowercase() } else { '-' })
        .collect();
    let cleaned = cleaned.trim_matches('-').to_owned();
    if cleaned.is_empty() { "agent".to_owned() } else { cleaned }
}

/// The directory as the user would type it: `.` stays `.`.
fn shown(dir: &Path) -> String {
    let text = dir.display().to_string();
    if text.contains(' ') { format!("'{text}'") } else { text }
}
