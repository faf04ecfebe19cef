//! Loader tests: real files in a temporary directory, diagnostics asserted as rendered text.

use std::path::Path;

use expect_test::{Expect, expect};
use serde_json::json;

use super::*;

const OPTIONS: LoadOptions<'static> = LoadOptions {
    builtin_tools: &["current_date", "day_name", "ask_question", "http_request", "shell", "web_search"],
    providers: &["mock", "openai", "anthropic", "ollama", "openrouter"],
    tool_name: |name| match name {
        "current-date" => "current_date",
        "day-name" => "day_name",
        "http" => "http_request",
        other => other,
    },
    not_built: all_built,
};

/// Writes `files` (path, content) under a fresh directory and returns it.
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, content) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    dir
}

/// Loads `target` under `dir` and renders every diagnostic with paths relative to `dir`.
fn diagnostics(dir: &Path, target: &str) -> String {
    let loaded = load(&dir.join(target), &OPTIONS);
    let prefix = format!("{}/", dir.display());
    let mut out: String =
        loaded.diagnostics.iter().map(|d| d.to_string().replace(&prefix, "") + "\n").collect();
    if loaded.spec.is_some() {
        out.push_str("(loaded)\n");
    }
    out
}

fn check(files: &[(&str, &str)], target: &str, expected: Expect) {
    let dir = tree(files);
    expected.assert_eq(&diagnostics(dir.path(), target));
}

#[test]
fn what_this_build_lacks_is_an_unsupported_error_at_its_place_naming_the_cargo_feature() {
    let dir = tree(&[
        (
            "lean/agent.yaml",
            "model: mock\ntools: [day_name, js]\nmcp:\n  - { name: docs, command: [docs-server] }\nmemory:\n  - { kind: semantic }\n",
        ),
        ("lean/memory/faq.md", "# FAQ\n"),
    ]);
    let options = LoadOptions {
        builtin_tools: &["day_name", "js"],
        not_built: |what| match what {
            "js" => Some("js"),
            "mcp" => Some("mcp"),
            "knowledge" => Some("knowledge"),
            _ => None,
        },
        ..OPTIONS
    };
    let loaded = load(&dir.path().join("lean"), &options);
    assert!(loaded.spec.is_none(), "a spec this build cannot run must not load");
    let prefix = format!("{}/", dir.path().display());
    let rendered: String =
        loaded.diagnostics.iter().map(|d| d.to_string().replace(&prefix, "") + "\n").collect();
    expect![[r#"
        error[KEEL_SPEC_UNSUPPORTED]: the documents of semantic memory (lean/memory/): this keel was built without the `knowledge` cargo feature, which it needs
          --> lean/agent.yaml
          hint: install a keel that has it: `cargo install --locked --path crates/keel` builds every feature; with `--no-default-features`, add `--features knowledge`
        error[KEEL_SPEC_UNSUPPORTED]: the `js` tool: this keel was built without the `js` cargo feature, which it needs
          --> lean/agent.yaml:2:19
          hint: install a keel that has it: `cargo install --locked --path crates/keel` builds every feature; with `--no-default-features`, add `--features js`
        error[KEEL_SPEC_UNSUPPORTED]: the MCP server `docs`: this keel was built without the `mcp` cargo feature, which it needs
          --> lean/agent.yaml:4:5
          hint: install a keel that has it: `cargo install --locked --path crates/keel` builds every feature; with `--no-default-features`, add `--features mcp`
    "#]]
    .assert_eq(&rendered);
}

#[test]
fn a_full_agent_directory_loads() {
    let dir = tree(&[
        (
            "assistant/agent.yaml",
            "model: mock\ntools: [day_name]\nlimits: { max_turns: 4, tool_timeout: 5s }\nmock:\n  script:\n    - tool_calls: [{ name: day_name }]\n    - { text: 'It is {{last_tool_output}}.', delay_ms: 10 }\n    - error: { status: 503, times: 1 }\n      text: ok\n",
        ),
        ("assistant/instructions.md", "You are helpful.\n"),
        (
            "assistant/tools/add.toml",
            "description = \"Adds\"\ncommand = [\"sh\", \"-c\", \"cat\"]\ntimeout = \"2s\"\n[input_schema]\ntype = \"object\"\nrequired = [\"a\"]\n",
        ),
        (
            "assistant/skills/billing/SKILL.md",
            "---\nname: billing\ndescription: Handles invoices.\n---\nAlways quote the invoice number.\n",
        ),
        ("assistant/skills/billing/tools/refund.toml", "description = \"Refunds\"\ncommand = [\"true\"]\n"),
    ]);
    let loaded = load(&dir.path().join("assistant"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let spec = loaded.spec.unwrap();
    assert_eq!(spec.name, "assistant");
    assert_eq!(spec.model, "mock");
    assert_eq!(spec.builtin_tools, ["day_name"]);
    assert_eq!(
        spec.instructions,
        "You are helpful.\n\n## Skill: billing\nHandles invoices.\n\nAlways quote the invoice number.\n"
    );
    let names: Vec<&str> = spec.command_tools.iter().map(|t| t.def.name.as_str()).collect();
    assert_eq!(names, ["add", "refund"]);
    let add = &spec.command_tools[0].def;
    assert_eq!(add.input_schema, json!({"type": "object", "required": ["a"]}));
    assert_eq!(add.timeout, Some(std::time::Duration::from_secs(2)));
    assert!(add.working_dir.is_absolute() && add.working_dir.ends_with("assistant"), "{:?}", add.working_dir);
    assert!(spec.command_tools[1].def.working_dir.ends_with("skills/billing"));
    assert_eq!(spec.limits.max_turns, 4);
    assert_eq!(spec.skills, ["billing"]);
    let script = spec.mock.unwrap();
    assert_eq!(script.entries.len(), 3);
    assert_eq!(script.entries[1].delay_ms, 10);
    assert_eq!(script.entries[2].error.as_ref().unwrap().times, Some(1));
}

#[test]
fn the_same_spec_in_toml_and_json() {
    let toml =
        "model = \"mock\"\ntools = [\"day_name\"]\n[limits]\nmax_turns = 3\n[[mock.script]]\ntext = \"hi\"\n";
    let json = r#"{"model": "mock", "tools": ["day_name"], "limits": {"max_turns": 3}, "mock": {"script": [{"text": "hi"}]}}"#;
    let yaml = "model: mock\ntools: [day_name]\nlimits: {max_turns: 3}\nmock: {script: [{text: hi}]}\n";
    let dir = tree(&[("a.toml", toml), ("a.json", json), ("a.yaml", yaml)]);
    let specs: Vec<AgentSpec> = ["a.toml", "a.json", "a.yaml"]
        .iter()
        .map(|f| load(&dir.path().join(f), &OPTIONS).spec.unwrap())
        .collect();
    for spec in &specs {
        assert_eq!(spec.name, "a");
        assert_eq!(spec.limits.max_turns, 3);
        assert_eq!(spec.mock.as_ref().unwrap().entries[0].text.as_deref(), Some("hi"));
    }
}

#[test]
fn every_problem_is_reported_with_its_position() {
    check(
        &[(
            "agent.yaml",
            "modle: mock\ntools: [day_nam, current_date]\nlimits:\n  max_turns: 0\n  tool_timeout: soon\n  max_tool_cals: 3\nretry: 4\n",
        )],
        "agent.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown key `modle`
              --> agent.yaml:1:1
              hint: did you mean `model`?
            error[KEEL_SPEC_INVALID]: unknown tool `day_nam`
              --> agent.yaml:2:9
              hint: did you mean `day_name`?
            error[KEEL_SPEC_INVALID]: `limits.max_turns` must be at least 1, not 0
              --> agent.yaml:4:14
            error[KEEL_SPEC_INVALID]: `limits.tool_timeout` is not a duration (expected number at 0): "soon"
              --> agent.yaml:5:17
              hint: write durations like `500ms`, `30s`, `5m`, `2h` or `3d`
            error[KEEL_SPEC_INVALID]: unknown key `max_tool_cals` in `limits`
              --> agent.yaml:6:3
              hint: did you mean `max_tool_calls`?
            error[KEEL_SPEC_INVALID]: `retry` must be a mapping, not an integer
              --> agent.yaml:7:8
        "#]],
    );
}

/// The root cause only: a tool file with errors is still named by `approvals` and the mock
/// script without a second error, and a typo of a required key is one error, not two.
#[test]
fn knock_on_errors_are_dropped_for_their_cause() {
    check(
        &[
            (
                "a/agent.yaml",
                "modle: mock\napprovals: { tools: [convert] }\nmock: { script: [ { tool_calls: [ { name: convert } ] } ] }\n",
            ),
            ("a/tools/convert.toml", "description = \"Converts\"\ncommand = [\"./nope.sh\"]\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown key `modle`
              --> a/agent.yaml:1:1
              hint: did you mean `model`?
            error[KEEL_SPEC_INVALID]: the command's program `./nope.sh` does not exist (looked at a/nope.sh)
              --> a/tools/convert.toml:2:11
              hint: relative paths are relative to the tool's working directory (the agent directory by default)
        "#]],
    );
}

#[test]
fn a_bare_model_name_gets_its_provider_suggested() {
    check(
        &[("agent.yaml", "model: gpt-4o\n")],
        "agent.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: model "gpt-4o" names no provider
              --> agent.yaml:1:8
              hint: write `openai/gpt-4o` (models are written provider/model)
        "#]],
    );
    check(
        &[("agent.yaml", "model: claude-sonnet-4-5\n")],
        "agent.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: model "claude-sonnet-4-5" names no provider
              --> agent.yaml:1:8
              hint: write `anthropic/claude-sonnet-4-5` (models are written provider/model)
        "#]],
    );
}

#[test]
fn unknown_tools_and_providers_get_suggestions() {
    check(
        &[("agent.toml", "model = \"opneai/gpt-4o\"\ntools = [\"day-nam\", \"weather\"]\n")],
        "agent.toml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown provider `opneai` in model "opneai/gpt-4o"
              --> agent.toml:1:9
              hint: did you mean `openai`?
            error[KEEL_SPEC_INVALID]: unknown tool `day-nam`
              --> agent.toml:2:10
              hint: did you mean `day_name`?
            error[KEEL_SPEC_INVALID]: unknown tool `weather`
              --> agent.toml:2:21
              hint: available tools: current_date, day_name, ask_question, http_request, shell, web_search
        "#]],
    );
    check(
        &[("agent.toml", "model = \"mock\"\ntools = [\"day-nam\", \"weather\"]\n")],
        "agent.toml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown tool `day-nam`
              --> agent.toml:2:10
              hint: did you mean `day_name`?
            error[KEEL_SPEC_INVALID]: unknown tool `weather`
              --> agent.toml:2:21
              hint: available tools: current_date, day_name, ask_question, http_request, shell, web_search
        "#]],
    );
}

#[test]
fn syntax_errors_and_missing_files() {
    check(
        &[("agent.json", "{\"model\": \"mock\",\n  \"tools\": [}\n")],
        "agent.json",
        expect![[r#"
        error[KEEL_SPEC_SYNTAX]: invalid JSON: expected value at line 2 column 13
          --> agent.json:2:13
    "#]],
    );
    check(
        &[],
        "nothing.yaml",
        expect![[r#"
        error[KEEL_SPEC_NOT_FOUND]: cannot read the agent: No such file or directory (os error 2)
          --> nothing.yaml
          hint: give an agent directory (with agent.yaml) or a spec file (.yaml, .toml or .json)
    "#]],
    );
    check(
        &[("a/readme.md", "")],
        "a",
        expect![[r#"
        error[KEEL_SPEC_NOT_FOUND]: no agent.yaml, agent.toml or agent.json in this directory
          --> a
          hint: create agent.yaml with at least `model: mock`
    "#]],
    );
    check(
        &[("a.yaml", "model: mock\ninstructions: { file: prompt.md }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: cannot read the instructions file prompt.md: No such file or directory (os error 2)
              --> a.yaml:2:23
              hint: the path is relative to the spec file's directory
        "#]],
    );
}

#[test]
fn instructions_from_a_file() {
    let dir = tree(&[
        ("a.yaml", "model: mock\ninstructions: { file: prompts/main.md }\n"),
        ("prompts/main.md", "Be kind."),
    ]);
    assert_eq!(load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap().instructions, "Be kind.");
}

#[test]
fn bad_command_tools() {
    check(
        &[
            ("a/agent.yaml", "model: mock\n"),
            ("a/tools/no_command.toml", "description = \"x\"\n"),
            ("a/tools/string_command.toml", "description = \"x\"\ncommand = \"python3 tool.py\"\n"),
            ("a/tools/missing_program.toml", "description = \"x\"\ncommand = [\"./bin/tool.sh\"]\n"),
            (
                "a/tools/bad_schema.toml",
                "description = \"x\"\ncommand = [\"true\"]\n[input_schema]\ntype = 12\n",
            ),
            ("a/tools/typo.toml", "descripton = \"x\"\ncommand = [\"true\"]\n"),
            ("a/tools/day_name.toml", "description = \"x\"\ncommand = [\"true\"]\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `input_schema` is not a valid JSON Schema: at `type`: 12 is not a type: write one of array, boolean, integer, null, number, object, string (or a list of them)
              --> a/tools/bad_schema.toml:4:8
            error[KEEL_SPEC_INVALID]: tool `day_name` has the name of a built-in tool
              --> a/tools/day_name.toml
              hint: rename the file: built-in tool names are reserved
            error[KEEL_SPEC_INVALID]: the command's program `./bin/tool.sh` does not exist (looked at a/bin/tool.sh)
              --> a/tools/missing_program.toml:2:11
              hint: relative paths are relative to the tool's working directory (the agent directory by default)
            error[KEEL_SPEC_INVALID]: missing `command`
              --> a/tools/no_command.toml:1:1
              hint: add the program and its arguments, e.g. `command = ["python3", "add.py"]`
            error[KEEL_SPEC_INVALID]: `command` must be a list of arguments, not a string
              --> a/tools/string_command.toml:2:11
              hint: no shell runs the command; write `command = ["python3", "tool.py"]`
            error[KEEL_SPEC_INVALID]: unknown key `descripton`
              --> a/tools/typo.toml:1:1
              hint: did you mean `description`?
        "#]],
    );
}

#[test]
fn a_command_tool_names_the_variables_it_gets_and_never_keels_secrets() {
    let dir = tree(&[
        ("a/agent.yaml", "model: mock\n"),
        (
            "a/tools/fetch.toml",
            "description = \"x\"\ncommand = [\"true\"]\nenv = [\"MY_API_KEY\", \"_PROXY\"]\n",
        ),
    ]);
    let spec = load(&dir.path().join("a"), &OPTIONS).spec.unwrap();
    let def = &spec.command_tools[0].def;
    assert_eq!(def.env, ["MY_API_KEY", "_PROXY"]);
    assert!(Path::new(&def.command[0]).is_absolute(), "a program on PATH is resolved: {:?}", def.command);
    check(
        &[
            ("a/agent.yaml", "model: mock\n"),
            (
                "a/tools/leaky.toml",
                "description = \"x\"\ncommand = [\"true\"]\nenv = [\"OPENAI_API_KEY\", \"KEEL_STORE\", \"1BAD\", \"OK_ONE\"]\n",
            ),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `env` lists OPENAI_API_KEY, one of keel's own settings: keel never passes it to a tool
              --> a/tools/leaky.toml:3:8
              hint: give the tool its own variable (say `MY_TOOL_API_KEY`) and name that
            error[KEEL_SPEC_INVALID]: `env` lists KEEL_STORE, one of keel's own settings: keel never passes it to a tool
              --> a/tools/leaky.toml:3:26
              hint: give the tool its own variable (say `MY_TOOL_API_KEY`) and name that
            error[KEEL_SPEC_INVALID]: `env` lists "1BAD", which is not an environment variable name
              --> a/tools/leaky.toml:3:40
              hint: names are letters, digits and `_`, not starting with a digit: `env = ["MY_API_KEY"]`
        "#]],
    );
}

#[test]
fn skills_problems() {
    check(
        &[
            ("a/agent.yaml", "model: mock\nskills: [billing, shiping]\n"),
            ("a/tools/refund.toml", "description = \"x\"\ncommand = [\"true\"]\n"),
            ("a/skills/billing/SKILL.md", "---\nname: billing\ndescription: Bills.\n---\nBody.\n"),
            ("a/skills/billing/tools/refund.toml", "description = \"y\"\ncommand = [\"true\"]\n"),
            ("a/skills/shipping/SKILL.md", "---\nname: shipping\ndescriptoin: Ships.\n---\nBody.\n"),
            ("a/skills/broken/SKILL.md", "no front matter\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown skill `shiping`: there is no skills/shiping/SKILL.md
              --> a/agent.yaml:2:19
              hint: did you mean `shipping`?
            error[KEEL_SPEC_INVALID]: tool `refund` of skill `billing` has the same name as the tool in a/tools/refund.toml
              --> a/skills/billing/tools/refund.toml
              hint: tool names must be unique across the agent and its skills; rename one
        "#]],
    );
    // Keys other tools add to a skill's front matter are warned about, and the skill loads.
    let dir = tree(&[
        ("a/agent.yaml", "model: mock\n"),
        (
            "a/skills/triage/SKILL.md",
            "---\nname: triage\ndescription: Sorts tickets.\nx-team: support\n---\nSort them.\n",
        ),
    ]);
    let loaded = load(&dir.path().join("a"), &OPTIONS);
    let spec = loaded.spec.expect("a skill with an unknown key loads");
    assert!(spec.instructions.contains("Sort them."), "{}", spec.instructions);
    let warnings: Vec<String> = loaded.diagnostics.iter().map(|d| d.to_string()).collect();
    assert!(
        warnings.len() == 1
            && warnings[0].starts_with("warning: unknown key `x-team` in the front matter: ignored"),
        "{warnings:?}"
    );
    check(
        &[
            ("a/agent.yaml", "model: mock\n"),
            ("a/skills/shipping/SKILL.md", "---\nname: shipping\ndescriptoin: Ships.\n---\nBody.\n"),
            ("a/skills/broken/SKILL.md", "no front matter\n"),
            ("a/skills/listed/SKILL.md", "---\n- name: listed\n---\nBody.\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: SKILL.md must start with YAML front matter
              --> a/skills/broken/SKILL.md:1:1
              hint: begin the file with `---`, then `name:` and `description:` lines, then `---`
            error[KEEL_SPEC_INVALID]: the front matter must be a mapping, not a list
              --> a/skills/listed/SKILL.md:2:1
            error[KEEL_SPEC_INVALID]: the front matter has no `description`
              --> a/skills/shipping/SKILL.md:2:1
              hint: say in one line what the skill is for
            warning: unknown key `descriptoin` in the front matter: ignored
              --> a/skills/shipping/SKILL.md:3:1
              hint: did you mean `description`?
        "#]],
    );
}

#[test]
fn semantic_memory_and_skill_knowledge_load_and_bad_ones_are_pointed_at() {
    use keel_core::memory::{Embeddings, RetrievalMode};
    let dir = tree(&[
        (
            "a/agent.yaml",
            "model: mock\nmemory:\n  - { kind: episodic }\n  - { kind: semantic, mode: agentic, top_k: 8, snippet_chars: 500, embeddings: nomic-embed-text }\n",
        ),
        ("a/memory/faq.md", "# FAQ\n"),
        (
            "a/skills/billing/SKILL.md",
            "---\nname: billing\ndescription: Invoices.\nknowledge: { source: docs/, top_k: 2, embeddings: off }\n---\nQuote the invoice.\n",
        ),
        ("a/skills/billing/docs/vat.md", "VAT is 20%.\n"),
        (
            "a/skills/tax/SKILL.md",
            "---\nname: tax\ndescription: Tax.\nknowledge: knowledge\n---\nBe exact.\n",
        ),
        ("a/skills/tax/knowledge/rates.md", "Rates.\n"),
    ]);
    let loaded = load(&dir.path().join("a"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let memory = loaded.spec.unwrap().memory;
    assert!(memory.episodic.is_some());
    let summary: Vec<_> = memory
        .knowledge
        .iter()
        .map(|k| {
            (
                k.skill.clone(),
                k.source.ends_with("memory") || k.source.ends_with("docs") || k.source.ends_with("knowledge"),
                k.mode,
                k.top_k,
                k.snippet_chars,
                k.embeddings.clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (None, true, RetrievalMode::Agentic, 8, 500, Embeddings::Model("nomic-embed-text".into())),
            (Some("billing".into()), true, RetrievalMode::Inject, 2, 240, Embeddings::Off),
            (Some("tax".into()), true, RetrievalMode::Inject, 5, 240, Embeddings::Auto),
        ]
    );
    assert!(memory.knowledge.iter().all(|k| k.source.is_absolute() && k.source.is_dir()), "{memory:?}");

    check(
        &[
            (
                "a.yaml",
                "model: mock\nmemory: [{ kind: semantic, top_k: 0 }, { kind: semantic, source: docs, top_k: 10000, mode: agentc, snippet_chars: 5 }]\n",
            ),
            ("memory/x.md", "x"),
            ("docs/y.md", "y"),
        ],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `memory[0].top_k` must be between 1 and 50, not 0
              --> a.yaml:2:35
            error[KEEL_SPEC_INVALID]: the agent has two `kind: semantic` memories
              --> a.yaml:2:48
              hint: keep one; put every document in its `source` folder
            error[KEEL_SPEC_INVALID]: `memory[1].top_k` must be between 1 and 50, not 10000
              --> a.yaml:2:79
            error[KEEL_SPEC_INVALID]: unknown memory[1].mode "agentc"
              --> a.yaml:2:92
              hint: did you mean `agentic`?
            error[KEEL_SPEC_INVALID]: `memory[1].snippet_chars` must be between 40 and 4000, not 5
              --> a.yaml:2:115
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\nmemory: { kind: semantic, source: nowhere, embedings: off }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: the documents folder nowhere does not exist
              --> a.yaml:2:35
              hint: create it and put Markdown, text, HTML or PDF files in it, or set `source` (default `memory/`, next to the spec)
            error[KEEL_SPEC_INVALID]: unknown key `embedings` in `memory`
              --> a.yaml:2:44
              hint: did you mean `embeddings`?
        "#]],
    );
    // A memory/ folder nobody reads is pointed at, not silently ignored.
    check(
        &[("a/agent.yaml", "model: mock\n"), ("a/memory/notes.md", "x")],
        "a",
        expect![[r#"
            warning: `memory/` holds documents, but the agent does not retrieve from them
              --> a/memory
              hint: add `memory: { kind: semantic }` to the spec (see docs/memory.md), or remove the folder
            (loaded)
        "#]],
    );
}

#[test]
fn schedules_load_from_triggers_and_from_the_schedules_directory() {
    let dir = tree(&[
        (
            "a/agent.yaml",
            "model: mock\ntriggers:\n  - { type: cron, name: weekly, cron: \"0 9 * * MON\", timezone: Europe/Paris, input: Summarise last week. }\n",
        ),
        (
            "a/schedules/nightly.yaml",
            "cron: \"@daily\"\ninput: Tidy up.\nsession: nightly-work\nmissed: skip\n",
        ),
    ]);
    let loaded = load(&dir.path().join("a"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let schedules = loaded.spec.unwrap().schedules;
    let summary: Vec<_> = schedules
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.cron.expression(),
                s.cron.timezone(),
                s.input.as_str(),
                s.session.as_ref().map(|id| id.as_str()),
                s.missed,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "weekly",
                "0 9 * * MON",
                "Europe/Paris",
                "Summarise last week.",
                None,
                keel_core::schedule::Missed::Latest
            ),
            ("nightly", "@daily", "UTC", "Tidy up.", Some("nightly-work"), keel_core::schedule::Missed::Skip),
        ]
    );
}

#[test]
fn a_bad_cron_or_time_zone_is_pointed_at_with_a_hint() {
    check(
        &[
            (
                "a/agent.yaml",
                "model: mock\ntriggers:\n  - { name: weekly, cron: \"0 9 * * FUNDAY\", input: x }\n  - { name: paris, cron: \"@daily\", timezone: Europe/Pariss, input: x }\n  - { name: ok, cron: \"@daily\", input: x }\n  - { name: ok, cron: \"@hourly\", input: y }\n  - { type: slack, name: s, cron: \"@daily\", input: x }\n  - { name: no-input, cron: \"61 * * * *\" }\n",
            ),
            ("a/schedules/bad name.yaml", "cron: '@daily'\ninput: x\n"),
            ("a/schedules/paris.yaml", "cron: '@daily'\ninput: x\nmissed: never\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: invalid cron expression `0 9 * * FUNDAY`: CronPattern contains illegal character 'F' in part 'FUNDAY'
              --> a/agent.yaml:3:27
              hint: write 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds first, or a macro (@hourly, @daily, @weekly, @monthly, @yearly); for example `0 9 * * MON-FRI` or `*/15 * * * *`
            error[KEEL_SPEC_INVALID]: unknown time zone `Europe/Pariss`
              --> a/agent.yaml:4:46
              hint: did you mean `Europe/Paris`? use an IANA time zone name such as `Europe/Paris`, `America/New_York` or `UTC`
            error[KEEL_SPEC_INVALID]: two triggers are named `ok` (the first at line 5)
              --> a/agent.yaml:6:5
              hint: give each trigger its own `name`
            error[KEEL_SPEC_INVALID]: unknown trigger type `slack`
              --> a/agent.yaml:7:13
              hint: channels are defined in `channels/<name>.yaml` of an agent directory
            error[KEEL_SPEC_INVALID]: a trigger needs `input`
              --> a/agent.yaml:8:5
              hint: write what each run is asked, e.g. `input: Summarise yesterday's tickets.`
            error[KEEL_SPEC_INVALID]: invalid cron expression `61 * * * *`: Number out of bounds
              --> a/agent.yaml:8:29
              hint: write 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds first, or a macro (@hourly, @daily, @weekly, @monthly, @yearly); for example `0 9 * * MON-FRI` or `*/15 * * * *`
            error[KEEL_SPEC_INVALID]: invalid schedule name "bad name" (from the file name)
              --> a/schedules/bad name.yaml
              hint: name schedule files with 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`, then `.yaml`
            error[KEEL_SPEC_INVALID]: `missed` must be `latest` or `skip`, not `never`
              --> a/schedules/paris.yaml:3:9
              hint: `latest`: after downtime the latest missed tick fires once; `skip`: it does not
        "#]],
    );
}

#[test]
fn mcp_servers_load_with_their_settings() {
    let dir = tree(&[(
        "a/agent.yaml",
        "model: mock\nmcp:\n  - { name: docs, command: [npx, -y, docs-server], env: { TOKEN: '${DOCS_TOKEN}' }, inherit_env: [LANG], only: [search] }\n  - { name: remote, url: 'http://127.0.0.1:9000/mcp', headers: { X-Team: blue }, bearer_token: '${REMOTE_TOKEN}', prefix: r_, startup_timeout: 5s }\napprovals: { tools: [docs_search, r_delete] }\nmock:\n  script:\n    - tool_calls: [{ name: r_lookup }]\n",
    )]);
    let loaded = load(&dir.path().join("a"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let spec = loaded.spec.unwrap();
    assert_eq!(spec.approval_tools, ["docs_search", "r_delete"]);
    let [docs, remote] = &spec.mcp[..] else { panic!("{:?}", spec.mcp) };
    assert_eq!(docs.tool_prefix(), "docs_");
    assert_eq!(docs.only.as_deref(), Some(&["search".to_owned()][..]));
    assert_eq!(
        docs.transport,
        keel_core::McpTransport::Stdio {
            command: vec!["npx".into(), "-y".into(), "docs-server".into()],
            env: vec![("TOKEN".into(), "${DOCS_TOKEN}".into())],
            // Relative to the agent's directory, like every path of a spec.
            cwd: Some(dir.path().join("a")),
            inherit_env: vec!["LANG".into()],
        }
    );
    assert_eq!(remote.tool_prefix(), "r_");
    assert_eq!(remote.startup_timeout, std::time::Duration::from_secs(5));
    assert_eq!(
        remote.transport,
        keel_core::McpTransport::Http {
            url: "http://127.0.0.1:9000/mcp".into(),
            headers: vec![
                ("X-Team".into(), "blue".into()),
                ("Authorization".into(), "Bearer ${REMOTE_TOKEN}".into())
            ],
        }
    );
}

#[test]
fn bad_mcp_entries_are_located() {
    check(
        &[(
            "a.yaml",
            "model: mock\nmcp:\n  - { command: [x] }\n  - { name: both, command: [x], url: 'http://h/mcp' }\n  - { name: neither }\n  - { name: web, url: 'ftp://h/x', env: { A: b } }\n  - { name: web, url: 'http://h/mcp', prefix: 'a b', comand: [x] }\n  - { name: s, command: [x], headers: { A: b } }\n  - { name: web, url: 'http://h/mcp' }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: an `mcp` server needs `name`
              --> a.yaml:3:5
              hint: write `- { name: docs, command: [npx, -y, some-mcp-server] }`
            error[KEEL_SPEC_INVALID]: `mcp.both` has both `command` and `url`
              --> a.yaml:4:28
              hint: a server is either started (`command`) or reached over HTTP (`url`)
            error[KEEL_SPEC_INVALID]: `mcp.neither` needs `command` (a stdio server) or `url` (an HTTP server)
              --> a.yaml:5:5
              hint: write `command: [npx, -y, some-mcp-server]` or `url: http://127.0.0.1:9000/mcp`
            error[KEEL_SPEC_INVALID]: `mcp.web.url` "ftp://h/x" is not an http:// or https:// URL
              --> a.yaml:6:23
              hint: write the server's endpoint, like `http://127.0.0.1:9000/mcp`
            error[KEEL_SPEC_INVALID]: `mcp.web.prefix` "a b" has characters tool names cannot hold
              --> a.yaml:7:47
              hint: use A-Z, a-z, 0-9, `_` and `-`
            error[KEEL_SPEC_INVALID]: unknown key `comand` in `mcp[]`
              --> a.yaml:7:54
              hint: did you mean `command`?
            error[KEEL_SPEC_INVALID]: `mcp.s.headers` applies to HTTP servers (`url`), not to `command`
              --> a.yaml:8:39
            error[KEEL_SPEC_INVALID]: two MCP servers are named `web` (the first at line 7)
              --> a.yaml:9:5
              hint: give each server its own `name`
        "#]],
    );
}

#[test]
fn approvals_name_the_agents_tools_and_take_a_duration() {
    check(
        &[(
            "a.yaml",
            "model: mock\ntools: [day_name, ask_question]\napprovals:\n  tools: [day_nam, shell]\n  timeout: soon\n  timout: 3d\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `approvals.tools` names `day_nam`, which the agent does not have
              --> a.yaml:4:11
              hint: did you mean `day_name`?
            error[KEEL_SPEC_INVALID]: `approvals.tools` names `shell`, which the agent does not have
              --> a.yaml:4:20
              hint: the agent's tools: day_name, ask_question
            error[KEEL_SPEC_INVALID]: `approvals.timeout` is not a duration (expected number at 0): "soon"
              --> a.yaml:5:12
              hint: write durations like `500ms`, `30s`, `5m`, `2h` or `3d`
            error[KEEL_SPEC_INVALID]: unknown key `timout` in `approvals`
              --> a.yaml:6:3
              hint: did you mean `timeout`?
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\ntools: [ask_question]\napprovals: { timeout: 30d }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `approvals.timeout` is at most a week (`7d`)
              --> a.yaml:3:23
              hint: a human who has not decided in a week is not coming: end the wait sooner, and ask again
        "#]],
    );
}

#[test]
fn mock_script_problems() {
    check(
        &[(
            "a.yaml",
            "model: mock\nmock:\n  script:\n    - { delay_ms: 5 }\n    - tool_calls: [{ name: weather, input: 3 }]\n    - tool_calls: [{ name: weather }]\n    - error: { status: 200 }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `mock.script[0]` has no `text`, `tool_calls` or `error`
              --> a.yaml:4:7
            error[KEEL_SPEC_INVALID]: `mock.script[1].tool_calls[].input` must be a mapping, not an integer
              --> a.yaml:5:44
            warning: the mock script calls `weather`, which the agent does not have (the model will get an error result)
              --> a.yaml:6:7
            error[KEEL_SPEC_INVALID]: `mock.script[3].error.status` must be between 400 and 599, not 200
              --> a.yaml:7:24
        "#]],
    );
}

#[test]
fn hostile_input_never_panics() {
    let inputs = [
        "",
        "---\n---\n",
        "[1, 2]",
        "model: [",
        "\u{0}\u{1}",
        "model: !!binary aGVsbG8=",
        "a: &x 1\nb: *x\n",
        "model: mock\nlimits: { max_turns: 99999999999999999999 }\n",
        "model: mock\ntools: [[[]]]\n",
        "model: mock\nmock: { script: [ { tool_calls: [ 1, { name: [] } ] } ] }\n",
    ];
    for (index, input) in inputs.iter().enumerate() {
        for ext in ["yaml", "json", "toml"] {
            let dir = tree(&[(&format!("x{index}.{ext}"), input)]);
            let loaded = load(&dir.path().join(format!("x{index}.{ext}")), &OPTIONS);
            if loaded.spec.is_none() {
                assert!(
                    loaded.diagnostics.iter().any(Diagnostic::is_error),
                    "{input:?} ({ext}): no error reported"
                );
            }
        }
    }
}

#[test]
fn provider_settings_load_and_bad_ones_are_pointed_at() {
    let dir = tree(&[(
        "a.yaml",
        "model: anthropic/claude-sonnet-4-5\nprovider:\n  base_url: http://127.0.0.1:9/\n  max_tokens: 2048\n  temperature: 0.5\n  tool_choice: required\n  parallel_tool_calls: false\n  thinking_budget: 4096\n  headers: { X-Team: search }\n",
    )]);
    let spec = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    assert_eq!(
        spec.provider,
        keel_core::ProviderSettings {
            base_url: Some("http://127.0.0.1:9/".into()),
            max_tokens: Some(2048),
            temperature: Some(0.5),
            tool_choice: keel_core::ToolChoice::Required,
            parallel_tool_calls: Some(false),
            thinking_budget: Some(4096),
            reasoning_effort: None,
            headers: vec![("X-Team".into(), "search".into())],
        }
    );
    check(
        &[(
            "a.yaml",
            "model: openai/gpt-4o\nprovider:\n  base_url: ftp://x\n  temperature: 7\n  parallel_tool_calls: yes please\n  thinking_budget: 10\n  max_token: 5\n  headers: { \"bad name\": x }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `provider.base_url` must be an http:// or https:// URL, not "ftp://x"
              --> a.yaml:3:13
              hint: write the API's root, for example `http://127.0.0.1:8080/v1`
            error[KEEL_SPEC_INVALID]: `provider.temperature` must be a number between 0 and 2
              --> a.yaml:4:16
            error[KEEL_SPEC_INVALID]: `provider.parallel_tool_calls` must be true or false
              --> a.yaml:5:24
            error[KEEL_SPEC_INVALID]: `provider.thinking_budget` must be at least 1024, not 10
              --> a.yaml:6:20
            error[KEEL_SPEC_INVALID]: unknown key `max_token` in `provider`
              --> a.yaml:7:3
              hint: did you mean `max_tokens`?
            error[KEEL_SPEC_INVALID]: `provider.headers`: "bad name" is not an HTTP header name
              --> a.yaml:8:14
        "#]],
    );
}

#[test]
fn a_forced_tool_must_be_one_of_the_agents() {
    check(
        &[("a.yaml", "model: openai/gpt-4o\ntools: [day_name]\nprovider: { tool_choice: day_nam }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `provider.tool_choice` names `day_nam`, which the agent does not have
              --> a.yaml:3:13
              hint: did you mean `day_name`?
        "#]],
    );
}

#[test]
fn http_settings_load_and_bad_hosts_are_pointed_at() {
    let dir = tree(&[(
        "a.yaml",
        "model: mock\ntools: [http_request]\nhttp: { allow: [api.github.com, \"*.Example.com\"], allow_loopback: true }\n",
    )]);
    let spec = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    assert_eq!(
        spec.http,
        keel_core::HttpSettings {
            allow: vec!["api.github.com".into(), "*.example.com".into()],
            allow_loopback: true,
            approve_methods: vec!["POST".into(), "PUT".into(), "PATCH".into(), "DELETE".into()],
        }
    );
    check(
        &[(
            "a.yaml",
            "model: mock\nhttp:\n  allow: [\"http://x.com\", \"a..b\", \"*.\"]\n  allow_loopback: 1\n  deny: []\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `http.allow`: "http://x.com" is not a host name
              --> a.yaml:3:11
              hint: write host names like `api.github.com`, or `*.example.com` for its subdomains
            error[KEEL_SPEC_INVALID]: `http.allow`: "a..b" is not a host name
              --> a.yaml:3:27
              hint: write host names like `api.github.com`, or `*.example.com` for its subdomains
            error[KEEL_SPEC_INVALID]: `http.allow`: "*." is not a host name
              --> a.yaml:3:35
              hint: write host names like `api.github.com`, or `*.example.com` for its subdomains
            error[KEEL_SPEC_INVALID]: `http.allow_loopback` must be true or false
              --> a.yaml:4:19
            error[KEEL_SPEC_INVALID]: unknown key `deny` in `http`
              --> a.yaml:5:3
              hint: known keys: allow, allow_loopback, approve_methods
        "#]],
    );
}

#[test]
fn web_search_settings_load_and_a_tool_without_a_backend_is_pointed_at() {
    let dir = tree(&[(
        "a.yaml",
        "model: mock\ntools: [web_search]\nweb_search: { backend: searxng, url: 'http://127.0.0.1:8888/', timeout: 5s }\n",
    )]);
    let spec = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    assert_eq!(
        spec.search,
        Some(keel_core::SearchSettings {
            backend: keel_core::SearchBackendKind::Searxng,
            url: Some("http://127.0.0.1:8888".into()),
            api_key_env: None,
            timeout: std::time::Duration::from_secs(5),
        })
    );
    check(
        &[(
            "a.yaml",
            "model: mock\ntools: [web_search]\nweb_search: { backend: bravo, api_key_env: 'sk-live-123', urls: x }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown search backend "bravo"
              --> a.yaml:3:24
              hint: did you mean `brave`?
            error[KEEL_SPEC_INVALID]: `web_search.api_key_env` must name an environment variable, not "sk-live-123"
              --> a.yaml:3:44
              hint: write the variable's name, for example `BRAVE_API_KEY`, never the key
            error[KEEL_SPEC_INVALID]: unknown key `urls` in `web_search`
              --> a.yaml:3:59
              hint: did you mean `url`?
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\ntools: [http_request, web_search]\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `web_search` needs a search backend, and the spec names none
              --> a.yaml:2:23
              hint: add `web_search: { backend: brave }` (or searxng with its `url`, or tavily)
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\nweb_search: { backend: searxng }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: the `searxng` backend needs `url`, the instance's address
              --> a.yaml:2:24
              hint: write `web_search: { backend: searxng, url: http://127.0.0.1:8888 }`
        "#]],
    );
}

#[test]
fn workspace_settings_resolve_their_directory_and_bad_ones_are_pointed_at() {
    let dir = tree(&[
        (
            "a.yaml",
            "model: mock\nworkspace: { path: data, mode: writable }\napprovals: { tools: [read_file] }\n",
        ),
        ("data/x", ""),
    ]);
    let spec = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    let workspace = spec.workspace.unwrap();
    assert_eq!(workspace.path, std::fs::canonicalize(dir.path().join("data")).unwrap());
    assert_eq!((workspace.mode, workspace.approve_writes), (keel_core::WorkspaceMode::Writable, true));
    check(
        &[("a.yaml", "model: mock\nworkspace: { path: missing, mode: readonly }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: the workspace directory missing does not exist
              --> a.yaml:2:20
              hint: create it, or fix `workspace.path` (relative to the spec file's directory)
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\nworkspace: { mode: writeable, approve_writes: no }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: unknown workspace mode "writeable"
              --> a.yaml:2:20
              hint: did you mean `writable`?
        "#]],
    );
}

#[test]
fn shell_needs_a_workspace_and_takes_two_switches() {
    check(
        &[(
            "a.yaml",
            "model: mock\ntools: [shell]\nshell: { inherit_env: yes, approve: false, timeout: 3 }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `shell` runs in the workspace, and the agent has none
              --> a.yaml:2:9
              hint: add `workspace: { path: ./work, mode: writable }`
            error[KEEL_SPEC_INVALID]: `shell.inherit_env` must be true or false
              --> a.yaml:3:23
            error[KEEL_SPEC_INVALID]: unknown key `timeout` in `shell`
              --> a.yaml:3:44
              hint: known keys: inherit_env, approve
        "#]],
    );
}

#[test]
fn subagents_load_as_named_agents_and_loops_are_refused() {
    let dir = tree(&[
        ("a/agent.yaml", "model: mock\napprovals: { tools: [helper] }\n"),
        ("a/subagents/helper/agent.yaml", "description: Helps.\nmodel: mock\n"),
        ("a/subagents/helper/instructions.md", "Be brief.\n"),
    ]);
    let spec = load(&dir.path().join("a"), &OPTIONS).spec.unwrap();
    assert_eq!(spec.subagents.len(), 1);
    assert_eq!(
        (spec.subagents[0].name.as_str(), spec.subagents[0].description.as_deref()),
        ("helper", Some("Helps."))
    );
    assert_eq!(spec.subagents[0].instructions, "Be brief.\n");

    let dir =
        tree(&[("a/agent.yaml", "model: mock\n"), ("a/subagents/bad name/agent.yaml", "model: mock\n")]);
    std::os::unix::fs::symlink(dir.path().join("a"), dir.path().join("a/subagents/again")).unwrap();
    expect![[r#"
        error[KEEL_SPEC_INVALID]: subagents/again leads back to an agent that contains it
          --> a/subagents/again
        error[KEEL_SPEC_INVALID]: invalid subagent name "bad name"
          --> a/subagents/bad name
          hint: a subagent is a tool: name its directory with 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`
    "#]]
    .assert_eq(&diagnostics(dir.path(), "a"));
}

#[test]
fn channels_load_from_their_directory_and_bad_ones_are_pointed_at() {
    let dir = tree(&[
        ("a/agent.yaml", "model: mock\n"),
        (
            "a/channels/issues.yaml",
            "type: github\nsecret_env: GH_SECRET\nevents: [issues.opened]\nsession: \"gh-{{payload.issue.number}}\"\n",
        ),
    ]);
    let loaded = load(&dir.path().join("a"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let channels = loaded.spec.unwrap().channels;
    assert_eq!(channels.len(), 1);
    assert_eq!(
        (channels[0].name.as_str(), channels[0].kind),
        ("issues", keel_core::channel::ChannelKind::Github)
    );
    assert_eq!(channels[0].input, keel_core::channel::ChannelDef::DEFAULT_INPUT);
    check(
        &[
            ("a/agent.yaml", "model: mock\n"),
            ("a/channels/mail.yaml", "type: email\nsecret_env: X\nto: [help@example.com]\n"),
            ("a/channels/slackmail.yaml", "type: slack\nsecret_env: X\nto: [help@example.com]\n"),
            ("a/channels/nosecret.yaml", "type: slack\n"),
            ("a/channels/template.yaml", "type: webhook\nsecret_env: 9LIVES\ninput: \"{{payload.x\"\n"),
            ("a/channels/typo.yaml", "type: discrod\nsecret_env: K\nevent: [x]\n"),
        ],
        "a",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: a channel needs `secret_env`
              --> a/channels/nosecret.yaml:1:1
              hint: name the environment variable holding the signing secret (Discord: the application's public key); the secret itself never goes in a file
            error[KEEL_SPEC_INVALID]: `to` applies to `type: email` channels only
              --> a/channels/slackmail.yaml:3:5
            error[KEEL_SPEC_INVALID]: `secret_env` "9LIVES" is not an environment variable name
              --> a/channels/template.yaml:2:13
              hint: name the variable that holds the secret, e.g. `secret_env: GITHUB_WEBHOOK_SECRET`
            error[KEEL_SPEC_INVALID]: `input`: a `{{` has no closing `}}`
              --> a/channels/template.yaml:3:8
              hint: templates read `{{event}}`, `{{sender}}`, `{{delivery}}`, `{{channel}}` and `{{payload.<path>}}`
            error[KEEL_SPEC_INVALID]: unknown channel type `discrod`
              --> a/channels/typo.yaml:1:7
              hint: did you mean `discord`?
            error[KEEL_SPEC_INVALID]: unknown key `event`
              --> a/channels/typo.yaml:3:1
              hint: did you mean `events`?
        "#]],
    );
}

#[test]
fn loop_controls_load_and_bad_ones_are_pointed_at() {
    let dir = tree(&[(
        "a.yaml",
        "model: mock\ntools: [day_name]\noutput: { schema: { type: object }, max_repairs: 2 }\n\
         compaction: { max_messages: 40, keep_recent: 10, model: small-model }\n\
         stop_when: [{ tool: day_name }]\nstate: { initial: { cart: [] } }\n",
    )]);
    let loaded = load(&dir.path().join("a.yaml"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let loaded = loaded.spec.unwrap();
    assert_eq!(loaded.max_repairs, 2);
    let compaction = loaded.compaction.unwrap();
    assert_eq!((compaction.max_messages, compaction.keep_recent), (40, 10));
    assert_eq!(compaction.model.as_deref(), Some("small-model"));
    assert_eq!(loaded.stop_tools, ["day_name"]);
    assert_eq!(loaded.initial_state, Some(serde_json::json!({"cart": []})));

    // `keep_recent` defaults to half of `max_messages`; one repair turn by default.
    let dir = tree(&[("a.yaml", "model: mock\ncompaction: { max_messages: 30 }\n")]);
    let loaded = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    assert_eq!(loaded.compaction.unwrap().keep_recent, 15);
    assert_eq!(loaded.max_repairs, 1);

    check(
        &[(
            "a.yaml",
            "model: mock\noutput: { schema: { type: object }, max_repairs: 99 }\n\
             compaction: { max_messages: 10, keep_recent: 10 }\nstop_when: [{ tool: finalise }, { tol: x }]\n\
             state: { initial: [1] }\n",
        )],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `output.max_repairs` must be between 0 and 10, not 99
              --> a.yaml:2:50
            error[KEEL_SPEC_INVALID]: `compaction`: `keep_recent` (10) must be smaller than `max_messages` (10): otherwise nothing is ever summarised
              --> a.yaml:3:13
            error[KEEL_SPEC_INVALID]: `stop_when` names `finalise`, which the agent does not have
              --> a.yaml:4:21
              hint: the agent has no tools; list them under `tools`
            error[KEEL_SPEC_INVALID]: `stop_when[1]` needs `tool`
              --> a.yaml:4:33
              hint: write `stop_when: [{ tool: finalize }]`
            error[KEEL_SPEC_INVALID]: unknown key `tol` in `stop_when[1]`
              --> a.yaml:4:35
              hint: did you mean `tool`?
            error[KEEL_SPEC_INVALID]: `state.initial` must be a mapping, not a list
              --> a.yaml:5:19
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\ncompaction: { keep_recent: 3, model: openai/gpt-4o }\nstate: {}\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `compaction` needs `max_messages`
              --> a.yaml:2:13
              hint: write `compaction: { max_messages: 40, keep_recent: 20 }`
            error[KEEL_SPEC_INVALID]: `state` needs `initial`
              --> a.yaml:3:8
              hint: write `state: { initial: { cart: [] } }`
        "#]],
    );
}

#[test]
fn memory_kinds_load_with_their_settings_and_bad_ones_are_pointed_at() {
    let dir = tree(&[(
        "a.yaml",
        "model: mock\nmemory:\n  - { kind: episodic, recall: 7, model: small }\n  - { kind: graph, depth: 3, max_nodes: 50 }\n",
    )]);
    let loaded = load(&dir.path().join("a.yaml"), &OPTIONS);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let memory = loaded.spec.unwrap().memory;
    assert_eq!(memory.episodic.unwrap().recall, 7);
    let graph = memory.graph.unwrap();
    assert_eq!((graph.depth, graph.max_seeds, graph.fan_out, graph.max_nodes), (3, 4, 8, 50));
    assert_eq!(memory.model.as_deref(), Some("small"));
    check(
        &[("a.yaml", "model: mock\nmemory: { kind: episodic, recall: 0, recal: 2 }\n")],
        "a.yaml",
        expect![[r#"
            error[KEEL_SPEC_INVALID]: `memory.recall` must be between 1 and 20, not 0
              --> a.yaml:2:35
            error[KEEL_SPEC_INVALID]: unknown key `recal` in `memory`
              --> a.yaml:2:38
              hint: did you mean `recall`?
        "#]],
    );
    check(
        &[("a.yaml", "model: mock\nmemory: [{ kind: grph }, { recall: 2 }, 3]\n")],
        "a.yaml",
        expect![[r#"
        error[KEEL_SPEC_INVALID]: unknown memory kind "grph"
          --> a.yaml:2:18
          hint: did you mean `graph`?
        error[KEEL_SPEC_INVALID]: `memory[1]` needs `kind`
          --> a.yaml:2:26
          hint: write `memory: { kind: episodic, recall: 5 }`
        error[KEEL_SPEC_INVALID]: `memory[2]` must be a mapping, not an integer
          --> a.yaml:2:41
    "#]],
    );
}

#[test]
fn built_ins_by_their_former_names_still_load_with_a_warning_each() {
    let spec = "model: mock\ntools: [day-name, http]\napprovals: { tools: [http] }\nstop_when: [{ tool: day-name }]\n\
                mock:\n  script:\n    - tool_calls: [{ name: day-name }]\n";
    let dir = tree(&[("a.yaml", spec)]);
    expect![[r#"
        warning: the tool `day-name` is now called `day_name`
          --> a.yaml:2:9
          hint: write `day_name`: the old name still works, for now
        warning: the tool `http` is now called `http_request`
          --> a.yaml:2:19
          hint: write `http_request`: the old name still works, for now
        warning: the tool `http` is now called `http_request`
          --> a.yaml:3:22
          hint: write `http_request`: the old name still works, for now
        warning: the tool `day-name` is now called `day_name`
          --> a.yaml:4:21
          hint: write `day_name`: the old name still works, for now
        warning: the tool `day-name` is now called `day_name`
          --> a.yaml:7:7
          hint: write `day_name`: the old name still works, for now
        (loaded)
    "#]]
    .assert_eq(&diagnostics(dir.path(), "a.yaml"));
    // The agent has the tools by their names: the model, approvals and the script use them.
    let loaded = load(&dir.path().join("a.yaml"), &OPTIONS).spec.unwrap();
    assert_eq!(loaded.builtin_tools, ["day_name", "http_request"]);
    assert_eq!(loaded.approval_tools, ["http_request"]);
    assert_eq!(loaded.stop_tools, ["day_name"]);
    let script = loaded.mock.unwrap();
    assert_eq!(script.entries[0].tool_calls[0].name, "day_name");
}

#[test]
fn a_recorded_script_is_read_back_as_it_was_written() {
    use keel_core::{MockEntry, MockFailure, MockScript, MockToolCall};
    let text = |t: &str| MockEntry { text: Some(t.into()), ..MockEntry::default() };
    let script = MockScript {
        entries: vec![
            MockEntry {
                text: Some(
                    "Let me look: \"quotes\", a # hash, `ticks`, émoji 🦀,\nand a second line.".into(),
                ),
                tool_calls: vec![MockToolCall {
                    name: "word_count".into(),
                    input: serde_json::json!({"text": "a: b", "deep": [1, {"x": null}]}),
                }],
                ..MockEntry::default()
            },
            MockEntry::default(),
            MockEntry {
                error: Some(MockFailure {
                    status: 400,
                    message: "bad request".into(),
                    times: None,
                    partial: None,
                }),
                ..MockEntry::default()
            },
        ],
        compact: vec![text("The brief.")],
    };
    let case = format!("# A case, with its comments.\ninput: hi\n\n{}", crate::mock_yaml(&script));
    let dir = tree(&[("tests/recorded.yaml", case.as_str())]);
    let loaded = crate::load_tests(&[dir.path().join("tests/recorded.yaml")], None, |name| name);
    assert!(loaded.diagnostics.is_empty(), "{:?}", loaded.diagnostics);
    let mut expected = script;
    // A reply with nothing in it is written as an empty text.
    expected.entries[1].text = Some(String::new());
    assert_eq!(loaded.cases[0].mock.as_ref(), Some(&expected));
    // Without briefs, the script is the plain list.
    let plain = MockScript::new(vec![text("only")]);
    assert_eq!(crate::mock_yaml(&plain), "mock:\n  - {\"text\":\"only\"}\n");
}
