//! Hostile agent files: the example agents, and one with every kind of file an agent directory
//! holds, mutated thousands of ways (lines dropped, repeated, re-indented; values replaced by
//! hostile ones; files cut short, nested tens of thousands of levels deep, or binary), load as
//! `keel check` loads them to an agent or to diagnostics that point into the agent's files:
//! never a panic, never a crash.
//!
//! The cases come from a fixed seed, so a failure repeats; `KEEL_SPEC_CASES=20000` runs more.
//! Before each case, the file it writes and the seed are saved to `hostile-spec-case.txt` in
//! the temporary directory, which is what is left to read if the process aborts.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

use crate::support::repo_root;

/// Values that are wrong in every way a value can be.
const HOSTILE: &[&str] = &[
    "~",
    "[]",
    "{}",
    "''",
    "-1",
    "0",
    "-9223372036854775809",
    "99999999999999999999999",
    "1e309",
    ".nan",
    "-.inf",
    "0x7f",
    "true",
    "\"\\u0000\"",
    "\"\\u202e\\ufeff\"",
    "\"\\ud800\"",
    "!!binary aGVsbG8=",
    "*anchor",
    "&anchor 1",
    "'../../../../etc/passwd'",
    "/dev/zero",
    "\"${HOME}\"",
    "'{{ payload.x }}'",
    "'{{'",
    "[1, [2, [3, {a: b}]]]",
    "{a: {b: {c: [d]}}}",
    "|\n  a block\n  of text",
    "0s",
    "-1s",
    "99999999999h",
    "1 fortnight",
    "'*/0 * * * *'",
    "'60 24 * * *'",
    "'@yearly @daily'",
    "Mars/Olympus_Mons",
    "http://169.254.169.254/latest/",
    "file:///etc/passwd",
    "\"\"\"",
    "= 1",
    "[[x]]",
    "\"\\\\\"",
];

/// The agent files of a directory that loading reads, relative to it, in name order.
fn agent_files(dir: &Path) -> Vec<PathBuf> {
    walkdir::WalkDir::new(dir)
        .sort_by_file_name()
        .into_iter()
        .map(Result::unwrap)
        .map(walkdir::DirEntry::into_path)
        .filter(|path| {
            path.is_file()
                && (matches!(
                    path.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml" | "toml" | "json")
                ) || path.file_name().is_some_and(|n| n == "SKILL.md"))
        })
        .map(|path| path.strip_prefix(dir).unwrap().to_path_buf())
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

/// `text` changed once by `rng`.
fn mutate(text: &str, rng: &mut fastrand::Rng) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    if lines.is_empty() {
        lines.push(String::new());
    }
    let at = rng.usize(..lines.len());
    let hostile = HOSTILE[rng.usize(..HOSTILE.len())];
    match rng.u8(..12) {
        0 => {
            lines.remove(at);
        }
        1 => lines.insert(at, lines[at].clone()),
        2 if at + 1 < lines.len() => lines.swap(at, at + 1),
        // A value replaced: after the key of a YAML or TOML line, or the whole line.
        3..=5 => {
            let line = &lines[at];
            let cut = line.find(": ").map(|i| i + 2).or_else(|| line.find(" = ").map(|i| i + 3));
            lines[at] = match cut {
                Some(cut) => format!("{}{hostile}", &line[..cut]),
                None => format!("{}{hostile}", " ".repeat(line.len() - line.trim_start().len())),
            };
        }
        6 => {
            let indent = " ".repeat(rng.usize(..6));
            let key = ["model", "tools", "limits", "mock", "cron", "type", "input_schema", "name", "x"]
                [rng.usize(..9)];
            lines.insert(at, format!("{indent}{key}: {hostile}"));
        }
        7 => {
            let line = &lines[at];
            lines[at] = match rng.u8(..3) {
                0 => format!("{}{line}", " ".repeat(rng.usize(1..4))),
                1 => format!("\t{line}"),
                _ => line.trim_start().to_owned(),
            };
        }
        // A character dropped or doubled (a typo in a key, a quote left open).
        8 => {
            let line = &lines[at];
            let chars: Vec<char> = line.chars().collect();
            if !chars.is_empty() {
                let i = rng.usize(..chars.len());
                let mut out: String = chars[..i].iter().collect();
                if rng.bool() {
                    out.push(chars[i]);
                    out.push(chars[i]);
                }
                out.extend(&chars[i + 1..]);
                lines[at] = out;
            }
        }
        // Cut short anywhere.
        9 => {
            let mut text = lines.join("\n");
            let mut cut = rng.usize(..=text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            return text;
        }
        // Nested deeper than any spec, in each style, under a key.
        10 => {
            let levels = [200, 5_000, 60_000][rng.usize(..3)];
            let nest = match rng.u8(..4) {
                0 => format!("x:\n{}", "- ".repeat(levels)),
                1 => format!("x: {}{}", "[".repeat(levels), "]".repeat(levels)),
                2 => (0..levels.min(5_000)).map(|i| format!("{}a{i}:\n", " ".repeat(i))).collect(),
                _ => format!("x = {}1{}", "[".repeat(levels), "]".repeat(levels)),
            };
            lines.insert(at, nest);
        }
        _ => {
            let junk: String = match rng.u8(..3) {
                0 => "\u{feff}\u{0}\u{7}\u{1b}[31m".to_owned(),
                1 => "é".repeat(rng.usize(1..50_000)),
                _ => {
                    let count = rng.usize(1..200);
                    std::iter::repeat_with(|| rng.char(..)).take(count).collect()
                }
            };
            lines.insert(at, junk);
        }
    }
    lines.join("\n") + if text.ends_with('\n') { "\n" } else { "" }
}

#[test]
fn mutated_agent_files_load_to_an_agent_or_to_diagnostics_never_a_crash() {
    let cases: usize = std::env::var("KEEL_SPEC_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(1_500);
    let work = tempfile::tempdir().unwrap();
    let record = std::env::temp_dir().join("hostile-spec-case.txt");
    // The examples, and an agent with a file of every kind (schedules, channels, command
    // tools, a skill with its own tool, a test case).
    let mut agents: Vec<PathBuf> = ["assistant", "concierge", "desk", "helpdesk", "notes"]
        .iter()
        .map(|name| {
            let copy = work.path().join(name);
            copy_dir(&repo_root().join("examples").join(name), &copy);
            copy
        })
        .collect();
    let full = work.path().join("full");
    for (path, text) in [
        (
            "agent.yaml",
            "model: mock\ntools: [day_name, http_request]\nlimits: { max_turns: 4, tool_timeout: 5s }\napprovals: { tools: [add] }\nmock:\n  script:\n    - tool_calls: [{ name: add, input: { a: 1 } }]\n    - text: done\n",
        ),
        (
            "tools/add.toml",
            "description = \"Adds\"\ncommand = [\"sh\", \"-c\", \"cat\"]\ntimeout = \"2s\"\n[input_schema]\ntype = \"object\"\nrequired = [\"a\"]\n[input_schema.properties.a]\ntype = \"integer\"\n",
        ),
        (
            "skills/billing/SKILL.md",
            "---\nname: billing\ndescription: Handles invoices.\n---\nAlways quote the invoice number.\n",
        ),
        ("skills/billing/tools/refund.toml", "description = \"Refunds\"\ncommand = [\"true\"]\n"),
        (
            "schedules/nightly.yaml",
            "cron: \"0 3 * * *\"\ntimezone: Europe/Paris\ninput: Tidy up.\nsession: nightly-work\nmissed: skip\n",
        ),
        (
            "channels/issues.yaml",
            "type: github\nsecret_env: GH_SECRET\nevents: [issues.opened]\nsession: \"gh-{{payload.issue.number}}\"\n",
        ),
        (
            "tests/add.yaml",
            "input: add one\nexpect:\n  tool_calls: [{ name: add, input: { a: 1 } }]\n  text_contains: done\n",
        ),
    ] {
        std::fs::create_dir_all(full.join(path).parent().unwrap()).unwrap();
        std::fs::write(full.join(path), text).unwrap();
    }
    agents.push(full);
    let options = keel::load_options();
    // Each starts valid, so that a mutation is the one thing wrong.
    for agent in &agents {
        let loaded = keel_spec::load(agent, &options);
        assert!(loaded.spec.is_some(), "{}: {:?}", agent.display(), loaded.diagnostics);
    }
    let files: Vec<(PathBuf, PathBuf, String)> = agents
        .iter()
        .flat_map(|agent| {
            agent_files(agent).into_iter().map(move |file| {
                let text = std::fs::read_to_string(agent.join(&file)).unwrap();
                (agent.clone(), file, text)
            })
        })
        .collect();
    assert!(files.len() >= 15, "{} agent files", files.len());

    let mut rng = fastrand::Rng::with_seed(0x6b65656c);
    let mut outcomes = [0usize; 2];
    for case in 0..cases {
        let (agent, file, original) = &files[rng.usize(..files.len())];
        let mut text = original.clone();
        for _ in 0..rng.usize(1..4) {
            text = mutate(&text, &mut rng);
        }
        let path = agent.join(file);
        std::fs::write(&record, format!("case {case}: {}\n{text}", path.display())).unwrap();
        std::fs::write(&path, &text).unwrap();
        // As `keel check` does: the agent, then its test cases.
        let load = || {
            let loaded = keel_spec::load(agent, &options);
            let tools: Option<Vec<String>> = loaded.spec.as_ref().map(|spec| {
                let commands = spec.command_tools.iter().map(|tool| tool.def.name.clone());
                spec.builtin_tools.iter().cloned().chain(commands).collect()
            });
            let files = keel_spec::test_files(agent).unwrap();
            let tests = keel_spec::load_tests(&files, tools.as_deref(), options.tool_name);
            (loaded, tests.diagnostics)
        };
        let (loaded, test_diagnostics) = std::panic::catch_unwind(AssertUnwindSafe(load))
            .unwrap_or_else(|_| panic!("case {case}: loading panicked on {}:\n{text}", path.display()));
        for diagnostic in loaded.diagnostics.iter().chain(&test_diagnostics) {
            let shown = format!("case {case}, {}:\n{text}\n---\n{diagnostic}", path.display());
            assert!(!diagnostic.message.trim().is_empty(), "{shown}");
            assert!(diagnostic.file.starts_with(agent), "a file outside the agent: {shown}");
            if let Ok(content) = std::fs::read_to_string(&diagnostic.file) {
                assert!(diagnostic.pos.line <= content.lines().count() + 1, "past the file's end: {shown}");
            }
        }
        if loaded.spec.is_none() {
            assert!(loaded.diagnostics.iter().any(keel_spec::Diagnostic::is_error), "case {case}: no reason");
        }
        // The same files, the same verdict.
        let (again, again_tests) = load();
        assert_eq!(
            (again.diagnostics, again_tests),
            (loaded.diagnostics.clone(), test_diagnostics),
            "case {case}"
        );
        outcomes[usize::from(loaded.spec.is_some())] += 1;
        std::fs::write(&path, original).unwrap();
    }
    // The mutations reach both ends: agents that still load, and ones refused.
    assert!(outcomes[0] > cases / 10 && outcomes[1] > cases / 10, "refused, loaded: {outcomes:?}");
    let _ = std::fs::remove_file(record);
}
