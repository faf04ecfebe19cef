//! `keel test`: an agent's test cases run through the real binary, a failing case's diff, the
//! JSON report, check-quality errors for a broken case, and `--chaos` (real SIGKILLs of worker
//! processes at every step boundary) passing on every example and template agent and catching
//! a tool whose output changes from one call to the next.

use std::path::Path;

use crate::support::keel;

fn write(dir: &Path, path: &str, text: &str) {
    let path = dir.join(path);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// An agent with a command tool that counts words, and one that answers a random number.
fn agent(dir: &Path) {
    write(
        dir,
        "agent.yaml",
        "model: mock\nmock:\n  script:\n    - tool_calls: [{ name: count, input: { text: a b c } }]\n    - text: \"{{last_tool_output}} words\"\n",
    );
    write(
        dir,
        "tools/count.toml",
        "description = \"Counts words\"\ncommand = [\"python3\", \"-c\", \"import json,sys; print(len(json.load(sys.stdin)['text'].split()))\"]\n[input_schema]\ntype = \"object\"\nproperties = { text = { type = \"string\" } }\n",
    );
    write(
        dir,
        "tools/dice.toml",
        "description = \"Rolls\"\ncommand = [\"python3\", \"-c\", \"import random; print(random.randrange(10**9))\"]\n[input_schema]\ntype = \"object\"\n",
    );
}

#[test]
fn a_passing_and_a_failing_case_are_reported_with_a_readable_diff() {
    let dir = tempfile::tempdir().unwrap();
    agent(dir.path());
    write(
        dir.path(),
        "tests/counts.yaml",
        "input: count a b c\nexpect:\n  tool_calls: [{ name: count, input: { text: a b c }, output: 3 }]\n  text: 3 words\n  stop: final\n",
    );
    write(
        dir.path(),
        "tests/wrong.yaml",
        "input: count\nexpect:\n  tool_calls: [{ name: count, output: 4 }]\n  text: 4 words\n  state: { seen: true }\n",
    );
    let out = keel().arg("test").arg(dir.path()).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "a failing case exits 7: {out:?}");
    assert!(said.contains("running 2 cases of agent"), "{said}");
    assert!(said.contains("✓ counts ("), "{said}");
    assert!(said.contains("✗ wrong ("), "{said}");
    assert!(
        said.contains("tool_calls[0] (count) output:\n          expected: 4\n          actual:   3"),
        "{said}"
    );
    assert!(said.contains("text:\n          expected: 4 words\n          actual:   3 words"), "{said}");
    assert!(said.contains("state:\n          expected: {\"seen\":true}\n          actual:   null"), "{said}");
    assert!(said.contains("2 cases: 1 passed, 1 failed"), "{said}");

    let out = keel().arg("test").arg(dir.path()).arg("--json").output().unwrap();
    assert_eq!(out.status.code(), Some(7));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["ok"], false);
    assert_eq!((report["passed"].as_u64(), report["failed"].as_u64()), (Some(1), Some(1)));
    let wrong = &report["cases"][1];
    assert_eq!(wrong["name"], "wrong");
    assert_eq!(wrong["mismatches"][0]["what"], "tool_calls[0] (count) output");
    assert_eq!(wrong["mismatches"][0]["actual"], "3");

    // Given one file, only that case runs.
    let out = keel().arg("test").arg(dir.path()).arg(dir.path().join("tests/counts.yaml")).output().unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn a_broken_case_gets_check_quality_errors_and_nothing_runs() {
    let dir = tempfile::tempdir().unwrap();
    agent(dir.path());
    write(
        dir.path(),
        "tests/typo.yaml",
        "inptu: hi\nexpect:\n  tool_calls: [{ name: cuont }]\n  stop: fianl\n",
    );
    for command in ["test", "check"] {
        let out = keel().arg(command).arg(dir.path()).output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {out:?}");
        assert!(said.contains("unknown key `inptu`") && said.contains("did you mean `input`?"), "{said}");
        assert!(said.contains("tests/typo.yaml:1:1"), "{said}");
        assert!(
            said.contains("names tool `cuont`, which the agent does not have") && said.contains("`count`"),
            "{said}"
        );
        assert!(said.contains("tests/typo.yaml:3:16"), "{said}");
        assert!(said.contains("unknown stop `fianl`") && said.contains("did you mean `final`?"), "{said}");
        assert!(!said.contains("has no `input`"), "no knock-on error for the typo: {said}");
    }
}

/// Every example agent and every offline template passes `--chaos`: each run is killed at each
/// of its step boundaries, resumed in a new process, and ends as the clean run did.
#[test]
fn chaos_passes_on_every_example_and_template() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let mut agents = Vec::new();
    for example in ["assistant", "concierge", "desk", "helpdesk"] {
        agents.push(root.join("examples").join(example));
    }
    for template in ["assistant", "tools", "approvals", "serve"] {
        let target = dir.path().join(template);
        let out = keel().arg("init").arg(&target).args(["--template", template]).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        agents.push(target);
    }
    for agent in agents {
        let out = keel()
            .current_dir(dir.path())
            .arg("test")
            .arg(&agent)
            .arg("--chaos")
            .arg("--json")
            .output()
            .unwrap();
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}: {out:?}", agent.display()));
        assert!(out.status.success(), "{}: {report:#}", agent.display());
        for case in report["cases"].as_array().unwrap() {
            let boundaries = case["chaos"]["boundaries"].as_array().unwrap();
            assert!(!boundaries.is_empty(), "{}: killed at each step: {case}", agent.display());
        }
    }
}

/// A tool whose output changes from one call to the next makes a resumed run differ from the
/// clean one: `--chaos` says where, while the plain run passes.
#[test]
fn chaos_catches_a_run_that_does_not_resume_the_same() {
    let dir = tempfile::tempdir().unwrap();
    agent(dir.path());
    write(
        dir.path(),
        "tests/dice.yaml",
        "input: roll\nmock:\n  - tool_calls: [{ name: dice }]\n  - text: \"rolled {{last_tool_output}}\"\nexpect:\n  tool_calls: [dice]\n  text_matches: '^rolled \\d+$'\n",
    );
    let out = keel().arg("test").arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = keel().arg("test").arg(dir.path()).arg("--chaos").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{said}");
    assert!(said.contains("✗ dice"), "{said}");
    // Killed after the first model call, the resumed run rolls again: a different transcript.
    assert!(
        said.contains("chaos: killed after step 1 (llm:turn:0): the resumed run differs from the clean one"),
        "{said}"
    );
    // Killed after the roll was saved, the resumed run reads it from the journal: no reroll.
    assert!(!said.contains("ran again"), "{said}");
}
