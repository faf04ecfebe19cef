//! Loop control through the real binary: compaction of long conversations (against a fake
//! OpenAI-compatible model that reads what it is sent), repair turns, per-run limits over HTTP,
//! stop conditions and the session state.

use std::sync::{Arc, Mutex};

use keel_testkit::{Recorded, Reply, WireServer};
use serde_json::{Value, json};

use crate::memory::keel_run;
use crate::serve::{Served, client, error_of, read_sse, sqlite};
use crate::support::{agent_dir, keel_on_store};

/// The first words of keel's compaction instructions: how the fake model tells a brief's
/// request from a turn's.
const COMPACTION_MARK: &str = "You condense conversations";

/// One SSE chunk of an OpenAI chat completion stream.
fn chunk(delta: Value, finish: Option<&str>) -> String {
    let body = json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake",
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
    });
    format!("data: {body}\n\n")
}

fn finished(mut body: String, prompt_tokens: usize) -> Reply {
    let usage = json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake", "choices": [],
        "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5 },
    });
    body.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
    Reply::sse(body)
}

fn text_reply(text: &str, prompt_tokens: usize) -> Reply {
    finished(chunk(json!({ "role": "assistant", "content": text }), Some("stop")), prompt_tokens)
}

fn call_reply(id: &str, name: &str, arguments: &str, prompt_tokens: usize) -> Reply {
    let delta = json!({ "role": "assistant", "tool_calls": [{
        "index": 0, "id": id, "type": "function", "function": { "name": name, "arguments": arguments },
    }] });
    finished(chunk(delta, Some("tool_calls")), prompt_tokens)
}

/// What the fake model saw in one request.
#[derive(Debug)]
struct Seen {
    /// A compaction brief's request (no tools, keel's compaction instructions).
    brief: bool,
    /// The conversation messages (the system message left out).
    messages: Vec<Value>,
}

fn seen(request: &Recorded) -> Seen {
    let body = request.json();
    let all = body["messages"].as_array().cloned().unwrap_or_default();
    let system =
        all.first().filter(|m| m["role"] == "system").and_then(|m| m["content"].as_str()).unwrap_or("");
    let brief = system.starts_with(COMPACTION_MARK);
    let messages = all.into_iter().filter(|m| m["role"] != "system").collect();
    Seen { brief, messages }
}

/// A fake model: a brief's request gets a brief naming how many lines it condensed; a turn whose
/// last message is the user's calls `day_name` (id unique per request); after a tool result it
/// answers in text.
async fn fake_model() -> WireServer {
    let counter = Arc::new(Mutex::new(0u64));
    WireServer::responding(move |request| {
        let seen = seen(request);
        let mut n = counter.lock().unwrap();
        *n += 1;
        let tokens = request.body.len() / 4;
        if seen.brief {
            let text = seen.messages[0]["content"].as_str().map(str::to_owned).unwrap_or_else(|| {
                seen.messages[0]["content"][0]["text"].as_str().unwrap_or_default().to_owned()
            });
            let users = text.lines().filter(|l| l.starts_with("user: ")).count();
            return text_reply(&format!("Brief #{n}: the user asked {users} times what day it is."), tokens);
        }
        match seen.messages.last().map(|m| m["role"].as_str().unwrap_or_default()) {
            Some("tool") => text_reply("It is a fine day.", tokens),
            _ => call_reply(&format!("call_fake_{n}"), "day_name", "{}", tokens),
        }
    })
    .await
}

fn compacting_agent(base_url: &str, compaction: &str) -> String {
    format!(
        "model: openai/fake\nprovider: {{ base_url: '{base_url}/v1' }}\ntools: [day_name]\n\
         retry: {{ max_attempts: 1 }}\ncompaction: {compaction}\n"
    )
}

#[tokio::test]
async fn two_hundred_turns_stay_under_the_message_budget_and_every_call_keeps_its_result() {
    const TURNS: usize = 200;
    const MAX_MESSAGES: usize = 30;
    let model = fake_model().await;
    let agent =
        compacting_agent(&model.url(), &format!("{{ max_messages: {MAX_MESSAGES}, keep_recent: 12 }}"));
    let dir = agent_dir(&[("agent.yaml", &agent)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[("OPENAI_API_KEY", "sk-fake")]);
    let http = client();
    let mut compacted_events = 0;
    for turn in 0..TURNS {
        let response = http
            .post(server.url("/chat"))
            .json(&json!({"sessionId": "long", "input": format!("What day is it? ({turn})")}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "turn {turn}");
        let events = read_sse(response).await;
        compacted_events +=
            events.iter().filter(|e| e.event.is_none() && e.kind() == "context.compacted").count();
        let done = events.iter().rev().find(|e| e.event.is_none()).unwrap().json();
        assert_eq!(done["type"], "run.done", "turn {turn}: {done}");
        assert_eq!(done["text"], "It is a fine day.", "turn {turn}: {done}");
    }

    let requests = model.requests();
    let (briefs, turns): (Vec<Seen>, Vec<Seen>) = requests.iter().map(seen).partition(|s| s.brief);
    assert_eq!(turns.len(), 2 * TURNS, "one call and one answer per turn");
    assert_eq!(briefs.len(), compacted_events, "a brief for each context.compacted event");
    assert!(briefs.len() >= TURNS * 4 / MAX_MESSAGES, "only {} briefs", briefs.len());
    let largest = turns.iter().map(|s| s.messages.len()).max().unwrap();
    assert!(largest <= MAX_MESSAGES, "the model saw {largest} messages, over the budget of {MAX_MESSAGES}");
    // Every tool result the model sees answers a call it sees before it, and every call it sees
    // is answered (but the last message's, which is the call it just made... never: a turn
    // ends with the model's text).
    for (index, turn) in turns.iter().enumerate() {
        let mut open: Vec<String> = Vec::new();
        for message in &turn.messages {
            for call in message["tool_calls"].as_array().into_iter().flatten() {
                open.push(call["id"].as_str().unwrap().to_owned());
            }
            if message["role"] == "tool" {
                let id = message["tool_call_id"].as_str().unwrap();
                let at = open.iter().position(|c| c == id);
                assert!(
                    at.is_some(),
                    "request {index}: a result for {id} without its call: {:#?}",
                    turn.messages
                );
                open.remove(at.unwrap());
            }
        }
        assert!(open.is_empty(), "request {index}: calls without results {open:?}");
    }
    // The first message the model sees after a compaction is the brief.
    let last = turns.last().unwrap();
    let first = last.messages[0]["content"].as_str().unwrap_or_default();
    assert!(first.starts_with("Summary of the conversation before this point:\nBrief #"), "{first}");

    // The store keeps everything: 4 messages a turn, plus the briefs.
    let transcript: Value = http.get(server.url("/chat/long")).send().await.unwrap().json().await.unwrap();
    let messages = transcript["messages"].as_array().unwrap();
    let summaries = messages.iter().filter(|m| m["content"][0]["type"] == "summary").count();
    assert_eq!(summaries, briefs.len());
    assert_eq!(messages.len(), 4 * TURNS + summaries);
    crate::model::summarize(&format!(
        "{TURNS} turns, max_messages {MAX_MESSAGES}: {} briefs, the model saw at most {largest} messages \
         (without compaction the last turn would see {}); the store holds {}",
        briefs.len(),
        4 * TURNS - 1,
        messages.len()
    ));
}

// Multi-threaded: the fake model answers while the test waits on `keel run` processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_right_after_a_brief_never_pays_for_that_brief_again() {
    let model = fake_model().await;
    let dir =
        agent_dir(&[("agent.yaml", &compacting_agent(&model.url(), "{ max_messages: 4, keep_recent: 2 }"))]);
    for turn in 0..2 {
        let out = keel_run(dir.path(), "s", &format!("day? {turn}"), &[]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let asked = |model: &WireServer| model.requests().len();
    let before = asked(&model);
    // The third run compacts first (its input makes 9 messages, over 4): the process dies right
    // after the brief's commit, before the turn it was for.
    let out = keel_run(dir.path(), "s", "day? 2", &[("KEEL_FAULT", "after_commit:llm:compact:0")]);
    assert!(!out.status.success(), "the fault point did not fire");
    let at_kill = asked(&model);
    assert_eq!(at_kill, before + 1, "the killed process asked for one brief, then died");
    assert!(seen(&model.requests()[at_kill - 1]).brief);
    // The next input finishes the interrupted run first (its process is provably gone), from
    // its journal: the brief is not asked for again, and the turn sees it.
    let out = keel_run(dir.path(), "s", "day? 3", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let requests = model.requests();
    let next = seen(&requests[at_kill]);
    assert!(!next.brief, "the brief was paid for again");
    let first = next.messages[0]["content"].as_str().unwrap_or_default();
    assert!(
        first.contains(&format!("Brief #{at_kill}:")),
        "the turn did not see the journaled brief: {first}"
    );
    let sessions = keel_on_store(dir.path(), &["sessions", "show", "s", "--json"]).output().unwrap();
    let document: Value = serde_json::from_slice(&sessions.stdout).unwrap();
    let lines: Vec<String> = document["messages"].as_array().unwrap().iter().map(Value::to_string).collect();
    let inputs: Vec<&String> = lines.iter().filter(|l| l.contains("\"day? ")).collect();
    assert_eq!(inputs.len(), 4, "every input once: {lines:#?}");
}

const STRUCTURED: &str = "model: mock
output:
  schema: { type: object, properties: { answer: { type: string } }, required: [answer] }
  max_repairs: 1
mock:
  script:
    - text: '{\"answer\": 42}'
    - text: '{\"answer\": \"42\"}'
";

#[test]
fn an_answer_that_misses_the_schema_is_repaired_once_through_keel_run() {
    let dir = agent_dir(&[("agent.yaml", STRUCTURED)]);
    let out = crate::support::keel_with_store(
        dir.path(),
        &["run", ".", "the answer?", "--json"],
        &sqlite(dir.path()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let repair = events.iter().find(|e| e["type"] == "output.repair").expect("an output.repair event");
    assert_eq!(repair["attempt"], 1);
    assert!(repair["problem"].as_str().unwrap().contains("/answer"), "{repair}");
    let done = events.last().unwrap();
    assert_eq!(done["type"], "run.done");
    assert_eq!(done["output"], json!({"answer": "42"}));

    // With no repair left the run fails, saying so.
    let dir = agent_dir(&[("agent.yaml", &STRUCTURED.replace("max_repairs: 1", "max_repairs: 0"))]);
    let out = crate::support::keel_with_store(dir.path(), &["run", ".", "the answer?"], &sqlite(dir.path()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("KEEL_OUTPUT_INVALID") && stderr.contains("/answer"), "{stderr}");
}

const CART: &str = "model: mock
tools: [day_name]
state: { initial: { cart: [] } }
stop_when: [{ tool: finish }]
mock:
  script:
    - tool_calls: [{ name: add, input: { item: tea } }]
    - tool_calls: [{ name: finish, input: {} }]
    - text: never reached
";

/// Reads the state file keel hands it, adds the item, writes it back.
const ADD: &str = "description = \"Adds an item to the cart\"
state = \"write\"
command = [\"python3\", \"-c\", \"import json,os,sys; item=json.load(sys.stdin)['item']; p=os.environ['KEEL_STATE_FILE']; s=json.load(open(p)); s['cart'].append(item); json.dump(s, open(p, 'w')); print('added ' + item)\"]
[input_schema]
type = \"object\"
required = [\"item\"]
properties = { item = { type = \"string\" } }
";

const FINISH: &str = "description = \"Ends the order\"
state = \"read\"
command = [\"python3\", \"-c\", \"import json,os; s=json.load(open(os.environ['KEEL_STATE_FILE'])); print(json.dumps({'ordered': s['cart']}))\"]
";

#[tokio::test]
async fn a_session_s_state_starts_from_state_initial_tools_replace_it_and_http_shows_it() {
    let dir = agent_dir(&[("agent.yaml", CART), ("tools/add.toml", ADD), ("tools/finish.toml", FINISH)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let (status, code) = error_of(http.get(server.url("/chat/cart/state")).send().await.unwrap()).await;
    assert_eq!((status, code.as_str()), (404, "KEEL_SESSION_NOT_FOUND"));
    let response = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "cart", "input": "tea"}))
        .send()
        .await
        .unwrap();
    let events: Vec<Value> =
        read_sse(response).await.iter().filter(|e| e.event.is_none()).map(|e| e.json()).collect();
    let updates: Vec<&Value> = events.iter().filter(|e| e["type"] == "state.updated").collect();
    assert_eq!(updates, [&json!({"type": "state.updated", "state": {"cart": ["tea"]}})]);
    let done = events.last().unwrap();
    assert_eq!(done["stopped"], "stop_condition", "{done}");
    assert_eq!(done["output"], json!({"ordered": ["tea"]}));
    let state: Value = http.get(server.url("/chat/cart/state")).send().await.unwrap().json().await.unwrap();
    assert_eq!(state, json!({"sessionId": "cart", "state": {"cart": ["tea"]}}));
}

#[tokio::test]
async fn a_request_may_lower_a_run_s_limits_but_never_raise_them() {
    let agent = "model: mock\ntools: [day_name]\nlimits: { max_turns: 5 }\nmock:\n  script:\n    \
                 - tool_calls: [{ name: day_name, input: {} }]\n    - tool_calls: [{ name: day_name, input: {} }]\n    \
                 - text: done\n";
    let dir = agent_dir(&[("agent.yaml", agent)]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let chat = |body: Value| http.post(server.url("/chat")).json(&body).send();

    // `1.0` is a whole number, and `null` means absent, as for every optional field.
    let limits = json!({"maxTurns": 1.0, "providerTimeoutMs": null});
    let response = chat(json!({"sessionId": "a", "input": "go", "limits": limits})).await.unwrap();
    let events = read_sse(response).await;
    let done = events.iter().rev().find(|e| e.event.is_none()).unwrap().json();
    assert_eq!(done["stopped"], "max_turns", "{done}");

    for (limits, expected) in [
        (json!({"maxTurns": 6}), "`limits.maxTurns` is 6 here, more than the agent's 5"),
        (json!({"maxTurns": 0}), "`limits.maxTurns` must be a whole number from 1 to 9007199254740991"),
        (json!({"maxTurns": 1.5}), "`limits.maxTurns` must be a whole number"),
        (json!({"maxTurn": 1}), "unknown key `limits.maxTurn`"),
        (json!({"toolTimeoutMs": 999_999_999}), "`limits.toolTimeoutMs`"),
        (json!([1]), "`limits` must be an object"),
    ] {
        let response = chat(json!({"sessionId": "b", "input": "go", "limits": limits})).await.unwrap();
        assert_eq!(response.status(), 400, "{limits}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "KEEL_REQUEST_INVALID");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{limits}: {message}");
    }
    // The API's document says how far this agent's limits go.
    let document: Value = http.get(server.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    let limits =
        &document["components"]["schemas"]["ChatRequest"]["oneOf"][0]["properties"]["limits"]["anyOf"][0];
    assert_eq!(limits["properties"]["maxTurns"]["maximum"], 5);
    assert_eq!(limits["properties"]["toolTimeoutMs"]["maximum"], 60_000);
    // Nothing was stored for the refused requests.
    let (status, _) = error_of(http.get(server.url("/chat/b")).send().await.unwrap()).await;
    assert_eq!(status, 404);
}
