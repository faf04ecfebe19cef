//! Episodic and graph memory through the real binary: remembered after a run, shown to the
//! model in the next (against a fake OpenAI-compatible model that reads what it is sent),
//! owner-scoped over HTTP with JWT subjects, inspected and forgotten with `keel memory`, never
//! paid for twice after a kill, and malformed extraction output that never fails a run.

use std::process::Stdio;
use std::sync::{Arc, Mutex};

use keel_testkit::{Recorded, Reply, WireServer};
use serde_json::{Value, json};

use crate::serve::{Served, client, in_an_hour, jwt, read_sse, sqlite};
use crate::support::{agent_dir, keel_on_store};

/// What a request to the fake model was for, by keel's instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    Turn,
    Episode,
    Extract,
}

fn system(request: &Recorded) -> String {
    let body = request.json();
    let first = &body["messages"][0];
    if first["role"] == "system" {
        first["content"].as_str().unwrap_or_default().to_owned()
    } else {
        String::new()
    }
}

fn purpose(request: &Recorded) -> Purpose {
    let system = system(request);
    if system.starts_with("You keep a diary") {
        Purpose::Episode
    } else if system.starts_with("You extract a knowledge graph") {
        Purpose::Extract
    } else {
        Purpose::Turn
    }
}

/// One streamed OpenAI chat completion answering `text` (10 tokens in, 5 out).
pub(crate) fn text_reply(text: &str) -> Reply {
    let chunk = json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake",
        "choices": [{ "index": 0, "delta": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
    });
    let usage = json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake", "choices": [],
        "usage": { "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15 },
    });
    Reply::sse(format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n"))
}

/// A fake model: episodes say what the user's message was; extractions find "X works at Y"
/// in it (or answer `extraction` when set: malformed output); turns answer "Noted.".
async fn fake_model(extraction: Option<&'static str>) -> WireServer {
    let works_at = Arc::new(Mutex::new(()));
    WireServer::responding(move |request| {
        let _guard = works_at.lock().unwrap();
        let body = request.json();
        let conversation = body["messages"][1]["content"].as_str().map(str::to_owned).unwrap_or_else(|| {
            body["messages"][1]["content"][0]["text"].as_str().unwrap_or_default().to_owned()
        });
        let said = conversation.lines().find_map(|l| l.strip_prefix("user: ")).unwrap_or_default().to_owned();
        match purpose(request) {
            Purpose::Episode => text_reply(&format!("The user said: {said}")),
            Purpose::Extract => {
                if let Some(raw) = extraction {
                    return text_reply(raw);
                }
                let relations: Vec<Value> = said
                    .split_once(" works at ")
                    .map(|(who, at)| {
                        json!({"from": who.trim(), "relation": "works_at", "to": at.trim_end_matches('.'), "confidence": 0.9})
                    })
                    .into_iter()
                    .collect();
                text_reply(&json!({"entities": [], "relations": relations}).to_string())
            }
            Purpose::Turn => text_reply("Noted."),
        }
    })
    .await
}

fn agent(base_url: &str) -> String {
    format!(
        "model: openai/fake\nprovider: {{ base_url: '{base_url}/v1' }}\nretry: {{ max_attempts: 1 }}\n\
         memory:\n  - {{ kind: episodic, recall: 5 }}\n  - {{ kind: graph }}\n"
    )
}

/// `keel run . <input> --session <session>` in `dir` on its SQLite store, with a fake OpenAI key.
pub(crate) fn keel_run(
    dir: &std::path::Path,
    session: &str,
    input: &str,
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut command = keel_on_store(dir, &["run", ".", input, "--session", session]);
    command.env("OPENAI_API_KEY", "sk-fake").stdin(Stdio::null());
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn turns(model: &WireServer) -> Vec<String> {
    model.requests().iter().filter(|r| purpose(r) == Purpose::Turn).map(system).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_run_establishes_is_shown_to_the_model_in_the_next_and_can_be_forgotten() {
    let model = fake_model(None).await;
    let dir = agent_dir(&[("agent.yaml", &agent(&model.url()))]);
    let out = keel_run(dir.path(), "s", "Ada works at Acme.", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = keel_run(dir.path(), "s", "Where does Ada work?", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let seen = turns(&model);
    assert!(!seen[0].contains("What you remember"), "the first run had nothing to recall: {}", seen[0]);
    let second = &seen[1];
    assert!(
        second.contains("## What you remember from earlier conversations (oldest first)\n- ")
            && second.contains(": The user said: Ada works at Acme."),
        "{second}"
    );
    assert!(
        second.contains("## What you know about what this message mentions\n- ada —[works_at]→ acme"),
        "{second}"
    );
    let counts: Vec<Purpose> = model.requests().iter().map(purpose).collect();
    assert_eq!(counts.iter().filter(|p| **p == Purpose::Episode).count(), 2, "one episode per run");

    let show = keel_on_store(dir.path(), &["memory", "show", "session:s", "--json"]).output().unwrap();
    let records: Vec<Value> =
        String::from_utf8_lossy(&show.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kinds: Vec<&str> = records.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "episode").count(), 2, "{records:#?}");
    assert!(records.iter().any(|r| r["key"] == "ada —[works_at]→ acme"), "{records:#?}");
    let list = keel_on_store(dir.path(), &["memory", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(list.lines().any(|l| l.starts_with("session:s ") && l.contains(" 2 ")), "{list}");

    let rm =
        keel_on_store(dir.path(), &["memory", "rm", "session:s", "--kind", "relation"]).output().unwrap();
    assert!(rm.status.success(), "{}", String::from_utf8_lossy(&rm.stderr));
    let rm = keel_on_store(dir.path(), &["memory", "rm", "session:s"]).output().unwrap();
    assert!(String::from_utf8_lossy(&rm.stderr).contains("erased 4 record(s) of session:s"), "{rm:?}");
    let again = keel_on_store(dir.path(), &["memory", "rm", "session:s"]).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("KEEL_MEMORY_NOT_FOUND"), "{again:?}");
    let out = keel_run(dir.path(), "s", "Where does Ada work?", &[]);
    assert!(out.status.success());
    let third = turns(&model).pop().unwrap();
    assert!(!third.contains("What you"), "forgotten, yet shown: {third}");

    let bad = keel_on_store(dir.path(), &["memory", "show", "alice"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("names no owner"), "{bad:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_extraction_output_is_logged_and_the_run_succeeds() {
    let model = fake_model(Some("Sure! Here is what I found: Ada, Acme.")).await;
    let dir = agent_dir(&[("agent.yaml", &agent(&model.url()))]);
    let out = keel_run(dir.path(), "s", "Ada works at Acme.", &[("KEEL_LOG", "warn")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Noted.");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("memory:extract") && stderr.contains("not JSON"), "{stderr}");
    // The episode was kept; the graph has nothing.
    let show = keel_on_store(dir.path(), &["memory", "show", "session:s", "--json"]).output().unwrap();
    let records = String::from_utf8_lossy(&show.stdout);
    assert_eq!(records.lines().count(), 1, "{records}");
    assert!(records.contains("\"kind\":\"episode\""), "{records}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_after_the_episode_never_asks_for_it_again() {
    let model = fake_model(None).await;
    let dir = agent_dir(&[("agent.yaml", &agent(&model.url()))]);
    let out =
        keel_run(dir.path(), "s", "Ada works at Acme.", &[("KEEL_FAULT", "after_commit:memory:episode")]);
    assert!(!out.status.success(), "the fault point did not fire");
    let asked = |p: Purpose| model.requests().iter().filter(|r| purpose(r) == p).count();
    assert_eq!((asked(Purpose::Turn), asked(Purpose::Episode), asked(Purpose::Extract)), (1, 1, 0));
    // The next input finishes the killed run from its journal first: no new turn, no new
    // episode; the extraction it had not made yet is made once.
    let out = keel_run(dir.path(), "s", "And Bob?", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!((asked(Purpose::Turn), asked(Purpose::Episode), asked(Purpose::Extract)), (2, 2, 2));
    let show = keel_on_store(dir.path(), &["memory", "show", "session:s", "--kind", "episode", "--json"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&show.stdout).lines().count(), 2, "one episode per run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_a_user_s_memory_follows_them_across_sessions_and_no_one_else_sees_it() {
    let model = fake_model(None).await;
    let dir = agent_dir(&[("agent.yaml", &agent(&model.url()))]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(
        dir.path(),
        &sqlite(dir.path()),
        &[("KEEL_JWT_SECRET", secret), ("OPENAI_API_KEY", "sk-fake")],
    );
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token =
        |sub: &str| jwt(jsonwebtoken::Algorithm::HS256, None, &key, json!({"sub": sub, "exp": in_an_hour()}));
    let http = client();
    let chat = |who: String, session: &'static str, input: &'static str| {
        let request = http
            .post(server.url("/chat"))
            .bearer_auth(who)
            .json(&json!({"sessionId": session, "input": input}));
        async move { read_sse(request.send().await.unwrap()).await }
    };
    chat(token("alice"), "monday", "Ada works at Acme.").await;
    chat(token("alice"), "tuesday", "Where does Ada work?").await;
    chat(token("bob"), "tuesday", "Where does Ada work?").await;
    let seen = turns(&model);
    assert!(seen[1].contains("ada —[works_at]→ acme"), "alice's other session: {}", seen[1]);
    assert!(!seen[2].contains("What you"), "bob saw alice's memory: {}", seen[2]);

    // Forgetting alice (by her JWT subject) erases what keel remembers of her.
    let rm = keel_on_store(dir.path(), &["memory", "rm", "sub:alice"]).output().unwrap();
    assert!(rm.status.success(), "{}", String::from_utf8_lossy(&rm.stderr));
    chat(token("alice"), "wednesday", "Where does Ada work?").await;
    let last = turns(&model).pop().unwrap();
    assert!(!last.contains("ada —[works_at]→ acme") && !last.contains("The user said: Ada"), "{last}");
}

const MOCK_MEMORY: &str = "model: mock
memory: [{ kind: episodic }, { kind: graph }]
mock:
  script:
    - text: Noted.
      episode: Ada said where she works.
      extract: 'Ada works at Acme, I think.'
    - text: Noted again.
      extract: { relations: [{ from: Ada, relation: works at, to: Acme }] }
    - text: She works at Acme.
";

#[tokio::test]
async fn keel_serve_with_the_mock_model_remembers_and_survives_malformed_extraction() {
    let dir = agent_dir(&[("agent.yaml", MOCK_MEMORY)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let mut run_tokens = 0;
    // Usage events per run: the turn's, the episode's, and the extraction's when its output
    // was usable (the first run's was not JSON).
    for (input, usages) in [("Ada works at Acme.", 2), ("Yes, Acme.", 3), ("Where does Ada work?", 3)] {
        let events = read_sse(
            http.post(server.url("/chat"))
                .json(&json!({"sessionId": "s", "input": input}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        let done = events.iter().rev().find(|e| e.event.is_none()).unwrap().json();
        assert_eq!(done["type"], "run.done", "{input}: {done}");
        let seen = events.iter().filter(|e| e.event.is_none() && e.kind() == "usage").count();
        assert_eq!(seen, usages, "{input}: {events:?}");
        run_tokens +=
            done["usage"]["inputTokens"].as_u64().unwrap() + done["usage"]["outputTokens"].as_u64().unwrap();
    }
    let show = keel_on_store(dir.path(), &["memory", "show", "session:s", "--json"]).output().unwrap();
    let records: Vec<Value> =
        String::from_utf8_lossy(&show.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let keys: Vec<&str> = records.iter().map(|r| r["key"].as_str().unwrap()).collect();
    // The first run's extraction was not JSON: nothing from it; the second's was: its relation
    // (confidence 0.5 when none is given) and both ends.
    assert!(
        keys.contains(&"ada —[works_at]→ acme") && keys.contains(&"ada") && keys.contains(&"acme"),
        "{keys:?}"
    );
    let episodes: Vec<&str> = records
        .iter()
        .filter(|r| r["kind"] == "episode")
        .map(|r| r["value"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(episodes.len(), 3, "{episodes:?}");
    assert!(episodes.contains(&"Ada said where she works."), "{episodes:?}");
    // The transcript never shows memory: only what was said.
    let transcript: Value = http.get(server.url("/chat/s")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 6);
    // The session's totals count the memory model's tokens as its runs did.
    let usage = &transcript["usage"];
    assert_eq!(usage["inputTokens"].as_u64().unwrap() + usage["outputTokens"].as_u64().unwrap(), run_tokens);
}
