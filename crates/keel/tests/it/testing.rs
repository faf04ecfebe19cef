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

/// A model on OpenAI's wire that calls `count` on the text after "count", then answers with
/// what the tool said; how many times it was asked, in `asked`.
async fn counting_model(asked: std::sync::Arc<std::sync::atomic::AtomicUsize>) -> keel_testkit::WireServer {
    use serde_json::{Value, json};
    keel_testkit::WireServer::responding(move |request: &keel_testkit::Recorded| {
        asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let body = request.json();
        let last = body["messages"].as_array().and_then(|m| m.last().cloned()).unwrap_or(Value::Null);
        let delta = if last["role"] == "tool" {
            json!({ "role": "assistant", "content": format!("It has \"{}\" words: # done.", last["content"].as_str().unwrap_or("?")) })
        } else {
            let said = last["content"].as_str().unwrap_or_default();
            let text = said.trim_start_matches("count").trim();
            json!({ "role": "assistant", "content": "Counting.", "tool_calls": [{
                "index": 0, "id": "call_real", "type": "function",
                "function": { "name": "count", "arguments": json!({ "text": text }).to_string() },
            }] })
        };
        let finish = if delta.get("tool_calls").is_some() { "tool_calls" } else { "stop" };
        let chunk = json!({ "id": "c", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] });
        keel_testkit::Reply::sse(format!("data: {chunk}\n\ndata: [DONE]\n\n"))
    })
    .await
}

// Multi-threaded: the fake model answers while this test waits for `keel` synchronously.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_writes_a_real_models_replies_into_the_case_and_it_plays_them_back_offline() {
    let dir = tempfile::tempdir().unwrap();
    agent(dir.path());
    write(dir.path(), "agent.yaml", "name: counter\nmodel: openai/gpt-4o-mini\n");
    let case = "# Counts three words.\ninput: count a b c\nexpect:\n  tool_calls: [{ name: count, input: { text: a b c }, output: 3 }]\n  text_contains: '\"3\" words'\n";
    write(dir.path(), "tests/counts.yaml", case);
    let scripted = "input: count\nmock:\n  - text: scripted\nexpect: { text: scripted }\n";
    write(dir.path(), "tests/scripted.yaml", scripted);
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let model = counting_model(asked.clone()).await;
    let test = |args: &[&str], base_url: &str| {
        let mut command = keel();
        command
            .arg("test")
            .arg(dir.path())
            .args(args)
            .env("OPENAI_BASE_URL", base_url)
            .env("OPENAI_API_KEY", "sk-test");
        command.output().unwrap()
    };

    let base_url = format!("{}/v1", model.url());
    let out = test(&["--record"], &base_url);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(said.contains("● counts: recorded 2 replies into"), "{said}");
    assert!(said.contains("· scripted: not recorded: scripted already"), "{said}");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2, "the real model answered the run");
    let written = std::fs::read_to_string(dir.path().join("tests/counts.yaml")).unwrap();
    assert!(written.starts_with(case), "the case's own lines are kept: {written}");
    assert!(written.contains("recorded from openai/gpt-4o-mini by `keel test --record`"), "{written}");
    assert!(
        written
            .contains(r#"- {"text":"Counting.","tool_calls":[{"input":{"text":"a b c"},"name":"count"}]}"#),
        "{written}"
    );
    assert_eq!(std::fs::read_to_string(dir.path().join("tests/scripted.yaml")).unwrap(), scripted);

    // From now on the case plays the recording: no model is reachable, and it passes, killed at
    // every step boundary too.
    let offline = test(&["--chaos"], "http://127.0.0.1:9");
    let said = String::from_utf8_lossy(&offline.stdout);
    assert!(offline.status.success(), "{said}");
    assert!(
        said.contains("✓ counts") && said.contains("resumed the same after a kill at each of its"),
        "{said}"
    );
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2, "the recording, not the model");
    // Recording again leaves a recorded case alone.
    let again = test(&["--record", "--json"], &base_url);
    let report: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["cases"][0]["recorded"]["skipped"], "scripted already (its `mock`)", "{report}");
    assert_eq!(std::fs::read_to_string(dir.path().join("tests/counts.yaml")).unwrap(), written);

    // An agent on the mock model has nothing to record; `--record --chaos` is refused.
    write(dir.path(), "agent.yaml", "name: counter\nmodel: mock\n");
    std::fs::remove_file(dir.path().join("tests/scripted.yaml")).unwrap();
    std::fs::write(dir.path().join("tests/counts.yaml"), case).unwrap();
    let mocked = test(&["--record"], &base_url);
    assert!(
        String::from_utf8_lossy(&mocked.stdout).contains("not recorded: the agent's model is `mock`"),
        "{mocked:?}"
    );
    let both = test(&["--record", "--chaos"], &base_url);
    assert_eq!(both.status.code(), Some(2), "{both:?}");
}
