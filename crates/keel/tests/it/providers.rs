//! Real providers end to end: `keel run` and `keel serve` against local servers that speak each
//! provider's wire format (`keel-testkit`), with the faults a real provider throws.

use std::path::Path;
use std::time::{Duration, Instant};

use keel_testkit::{Recorded, Reply, WireServer};
use serde_json::{Value, json};

use crate::serve::{Served, client, read_sse, sqlite};
use crate::support::{agent_dir, keel, weekdays_now};

/// Every variable a provider reads, removed so the machine's environment cannot leak in.
const PROVIDER_VARIABLES: &[&str] = &[
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENROUTER_API_KEY",
    "OPENROUTER_BASE_URL",
    "OLLAMA_HOST",
    "OLLAMA_API_KEY",
];

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Wire {
    OpenAi,
    Anthropic,
    Ollama,
}

/// A streamed reply that calls `tool` with `arguments` (raw text), in the wire's own format.
pub(crate) fn tool_call_stream(wire: Wire, id: &str, tool: &str, arguments: &str) -> Reply {
    let args = serde_json::to_string(arguments).unwrap();
    match wire {
        Wire::OpenAi => Reply::sse(format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{{\"index\":0,\"id\":\"{id}\",\"type\":\"function\",\"function\":{{\"name\":\"{tool}\",\"arguments\":\"\"}}}}]}},\"finish_reason\":null}}]}}\n\n\
             data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":{args}}}}}]}},\"finish_reason\":null}}]}}\n\n\
             data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"tool_calls\"}}]}}\n\n\
             data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{{\"prompt_tokens\":40,\"completion_tokens\":7,\"total_tokens\":47}}}}\n\n\
             data: [DONE]\n\n"
        )),
        Wire::Anthropic => Reply::sse(format!(
            "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"stop_reason\":null,\"usage\":{{\"input_tokens\":40,\"output_tokens\":1}}}}}}\n\n\
             event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{{\"type\":\"tool_use\",\"id\":\"{id}\",\"name\":\"{tool}\",\"input\":{{}}}}}}\n\n\
             event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"input_json_delta\",\"partial_json\":{args}}}}}\n\n\
             event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":0}}\n\n\
             event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"tool_use\",\"stop_sequence\":null}},\"usage\":{{\"output_tokens\":7}}}}\n\n\
             event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
        )),
        Wire::Ollama => {
            let arguments: Value = serde_json::from_str(arguments).unwrap_or(json!({}));
            Reply::ndjson(format!(
                "{}\n{}\n",
                json!({"model": "m", "message": {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": tool, "arguments": arguments}}]}, "done": false}),
                json!({"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "stop", "prompt_eval_count": 40, "eval_count": 7}),
            ))
        }
    }
}

/// A streamed text reply, one delta per word, in the wire's own format.
fn text_stream(wire: Wire, text: &str) -> Reply {
    let words: Vec<String> = text.split_inclusive(' ').map(str::to_owned).collect();
    let mut body = String::new();
    match wire {
        Wire::OpenAi => {
            body.push_str("data: {\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n");
            for word in &words {
                let chunk = json!({"id": "chatcmpl-2", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": null}]});
                body.push_str(&format!("data: {chunk}\n\n"));
            }
            body.push_str("data: {\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
            body.push_str("data: {\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":60,\"completion_tokens\":9,\"total_tokens\":69}}\n\ndata: [DONE]\n\n");
            Reply::sse(body)
        }
        Wire::Anthropic => {
            body.push_str("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_2\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"stop_reason\":null,\"usage\":{\"input_tokens\":60,\"output_tokens\":1}}}\n\n");
            body.push_str("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n");
            for word in &words {
                let delta = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}});
                body.push_str(&format!("event: content_block_delta\ndata: {delta}\n\n"));
            }
            body.push_str(
                "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            );
            body.push_str("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":9}}\n\n");
            body.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
            Reply::sse(body)
        }
        Wire::Ollama => {
            for word in &words {
                body.push_str(
                    &json!({"model": "m", "message": {"role": "assistant", "content": word}, "done": false})
                        .to_string(),
                );
                body.push('\n');
            }
            body.push_str(&json!({"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "stop", "prompt_eval_count": 60, "eval_count": 9}).to_string());
            body.push('\n');
            Reply::ndjson(body)
        }
    }
}

/// Runs `keel run` off the async runtime (the wire server lives on it).
async fn keel_run(dir: &Path, args: Vec<String>, env: Vec<(String, String)>) -> std::process::Output {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut command = keel();
        for variable in PROVIDER_VARIABLES {
            command.env_remove(variable);
        }
        command.current_dir(&dir).arg("run").arg(&dir).args(&args).envs(env).timeout(Duration::from_secs(60));
        command.output().unwrap()
    })
    .await
    .unwrap()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// The text of the tool result a request carries back, in whichever wire format.
fn tool_result_text(request: &Recorded) -> String {
    let body = request.json();
    let messages = body["messages"].as_array().unwrap();
    for message in messages.iter().rev() {
        if message["role"] == "tool" {
            return message["content"].as_str().unwrap().to_owned();
        }
        if let Some(blocks) = message["content"].as_array() {
            for block in blocks {
                if block["type"] == "tool_result" {
                    return block["content"].as_str().unwrap().to_owned();
                }
            }
        }
    }
    panic!("no tool result in {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_run_drives_every_provider_through_a_tool_call() {
    struct Case {
        model: &'static str,
        wire: Wire,
        keys: &'static [(&'static str, &'static str)],
        base_variable: &'static str,
        auth: Option<(&'static str, &'static str)>,
    }
    let cases = [
        Case {
            model: "openai/gpt-4o-mini",
            wire: Wire::OpenAi,
            keys: &[("OPENAI_API_KEY", "sk-openai")],
            base_variable: "OPENAI_BASE_URL",
            auth: Some(("authorization", "Bearer sk-openai")),
        },
        Case {
            model: "anthropic/claude-haiku-4-5",
            wire: Wire::Anthropic,
            keys: &[("ANTHROPIC_API_KEY", "sk-ant")],
            base_variable: "ANTHROPIC_BASE_URL",
            auth: Some(("x-api-key", "sk-ant")),
        },
        Case {
            model: "ollama/llama3.2",
            wire: Wire::Ollama,
            keys: &[],
            base_variable: "OLLAMA_HOST",
            auth: None,
        },
        Case {
            model: "openrouter/meta-llama/llama-3.1-8b-instruct",
            wire: Wire::OpenAi,
            keys: &[("OPENROUTER_API_KEY", "sk-or")],
            base_variable: "OPENROUTER_BASE_URL",
            auth: Some(("authorization", "Bearer sk-or")),
        },
        Case {
            model: "openai-compatible/qwen2.5",
            wire: Wire::OpenAi,
            keys: &[],
            base_variable: "OPENAI_BASE_URL",
            auth: None,
        },
    ];
    for Case { model, wire, keys, base_variable, auth } in cases {
        let server = WireServer::start(vec![
            tool_call_stream(wire, "call_day_1", "day_name", "{}"),
            text_stream(wire, "It is a fine day."),
        ])
        .await;
        let dir = agent_dir(&[(
            "agent.yaml",
            &format!("model: {model}\ninstructions: Answer briefly.\ntools: [day_name]\n"),
        )]);
        let base = if wire == Wire::OpenAi { format!("{}/v1", server.url()) } else { server.url() };
        let mut env = pairs(keys);
        env.push((base_variable.to_owned(), base));
        let output = keel_run(dir.path(), strings(&["What day is it?", "--json"]), env).await;
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{model}: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
        let events: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let done =
            events.iter().find(|e| e["type"] == "run.done").unwrap_or_else(|| panic!("{model}: {stdout}"));
        assert_eq!(done["text"], "It is a fine day.", "{model}");
        assert_eq!(
            done["usage"],
            json!({"inputTokens": 100, "outputTokens": 16}),
            "{model}: usage summed over both calls"
        );
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, "It is a fine day.", "{model}: streamed word by word");

        let requests = server.requests();
        assert_eq!(requests.len(), 2, "{model}");
        let path = match wire {
            Wire::OpenAi => "/v1/chat/completions",
            Wire::Anthropic => "/v1/messages",
            Wire::Ollama => "/api/chat",
        };
        assert_eq!(requests[0].path, path, "{model}");
        let name = model.split_once('/').unwrap().1;
        assert_eq!(
            requests[0].json()["model"],
            name,
            "{model}: the model name goes without its provider prefix"
        );
        if let Some((header, value)) = auth {
            assert_eq!(requests[0].header(header), Some(value), "{model}");
        } else {
            assert_eq!(requests[0].header("authorization"), None, "{model}: no key, no header");
        }
        if model.starts_with("openrouter/") {
            assert_eq!(requests[0].header("x-title"), Some("keel"));
        }
        let weekday = tool_result_text(&requests[1]);
        assert!(weekdays_now().contains(&weekday), "{model}: the tool's output went back: {weekday}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_fails_before_any_request_and_says_what_to_do() {
    let server = WireServer::start(vec![]).await;
    let dir = agent_dir(&[("agent.yaml", "model: anthropic/claude-haiku-4-5\n")]);
    let output =
        keel_run(dir.path(), strings(&["hi"]), pairs(&[("ANTHROPIC_BASE_URL", &server.url())])).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.matches("KEEL_PROVIDER_KEY_MISSING").count(), 1, "the code, once: {stderr}");
    assert!(
        stderr.starts_with(
            "error[KEEL_PROVIDER_KEY_MISSING]: model `anthropic/claude-haiku-4-5` needs an API key"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("ANTHROPIC_API_KEY") && stderr.contains("--model mock"), "{stderr}");
    assert!(server.requests().is_empty(), "nothing was sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_unknown_tools_go_back_to_the_model_which_recovers() {
    let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[\
                 {\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"day_name\",\"arguments\":\"{\\\"x\\\": \"}},\
                 {\"index\":1,\"id\":\"c2\",\"type\":\"function\",\"function\":{\"name\":\"teleport\",\"arguments\":\"{}\"}}]}}]}\n\n\
                 data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n";
    let server = WireServer::start(vec![Reply::sse(first), text_stream(Wire::OpenAi, "Sorry, fixed.")]).await;
    let dir = agent_dir(&[("agent.yaml", "model: openai/gpt-4o-mini\ntools: [day_name]\n")]);
    let env = pairs(&[("OPENAI_API_KEY", "k"), ("OPENAI_BASE_URL", &format!("{}/v1", server.url()))]);
    let output = keel_run(dir.path(), strings(&["go"]), env).await;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "Sorry, fixed.");
    let second = server.requests()[1].json();
    let tool_messages: Vec<&Value> =
        second["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tool_messages.len(), 2);
    let invalid = tool_messages[0]["content"].as_str().unwrap();
    assert!(invalid.starts_with("Error: the arguments for `day_name` are not valid JSON"), "{invalid}");
    let unknown = tool_messages[1]["content"].as_str().unwrap();
    assert!(unknown.starts_with("Error: unknown tool `teleport`"), "{unknown}");
    // The model's broken arguments went back as it wrote them, so it can see its mistake.
    assert_eq!(second["messages"][1]["tool_calls"][0]["function"]["arguments"], "{\"x\": ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_switches_provider_mid_session() {
    let dir = agent_dir(&[("agent.yaml", "model: openai-compatible/qwen\ntools: [day_name]\n")]);
    let store = sqlite(dir.path());
    let reasoning_then_call = "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"I need the day.\"}}]}\n\n\
         data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call:1\",\"type\":\"function\",\"function\":{\"name\":\"day_name\",\"arguments\":\"\"}}]}}]}\n\n\
         data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n";
    let compatible = WireServer::start(vec![
        Reply::sse(reasoning_then_call),
        text_stream(Wire::OpenAi, "Today is known."),
    ])
    .await;
    let env = pairs(&[("OPENAI_BASE_URL", &format!("{}/v1", compatible.url()))]);
    let first =
        keel_run(dir.path(), strings(&["What day is it?", "--session", "s1", "--store", &store]), env).await;
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));

    let anthropic = WireServer::start(vec![text_stream(Wire::Anthropic, "Tomorrow follows.")]).await;
    let env = pairs(&[("ANTHROPIC_API_KEY", "k"), ("ANTHROPIC_BASE_URL", &anthropic.url())]);
    let args = strings(&[
        "And tomorrow?",
        "--session",
        "s1",
        "--store",
        &store,
        "--model",
        "anthropic/claude-haiku-4-5",
    ]);
    let second = keel_run(dir.path(), args, env).await;
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), "Tomorrow follows.");

    let body = anthropic.only_request().json();
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 5, "{body}");
    assert_eq!(messages[0]["content"], json!([{"type": "text", "text": "What day is it?"}]));
    // The unsigned reasoning of the other provider is left out; the call id is made acceptable
    // and matches its result.
    assert_eq!(
        messages[1]["content"],
        json!([{"type": "tool_use", "id": "call_1", "name": "day_name", "input": {}}])
    );
    assert_eq!(messages[2]["content"][0]["tool_use_id"], "call_1");
    assert_eq!(messages[3]["content"], json!([{"type": "text", "text": "Today is known."}]));
    assert_eq!(messages[4]["content"], json!([{"type": "text", "text": "And tomorrow?"}]));

    // The session's usage adds up both providers' calls.
    let store_arg = store.clone();
    let shown = tokio::task::spawn_blocking(move || {
        keel().args(["sessions", "show", "s1", "--store", &store_arg]).output().unwrap()
    })
    .await
    .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("usage: 120 input tokens, 18 output tokens"), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_serve_retries_a_broken_stream_and_clients_are_told_to_drop_the_partial_text() {
    let full = text_stream(Wire::OpenAi, "The whole answer, once.");
    let server = WireServer::start(vec![
        Reply::json(500, &json!({"error": {"message": "The server had an error", "type": "server_error"}})),
        // Cut after "The whole " has been streamed.
        text_stream(Wire::OpenAi, "The whole answer, once.").reset_after(560),
        Reply::json(429, &json!({"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}}))
            .header("retry-after-ms", "400"),
        full,
    ])
    .await;
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: openai/gpt-4o-mini\nretry: { max_attempts: 5, initial_backoff: 10ms, max_backoff: 50ms }\n",
    )]);
    let base = format!("{}/v1", server.url());
    let served = Served::start(
        dir.path(),
        &sqlite(dir.path()),
        &[("OPENAI_API_KEY", "k"), ("OPENAI_BASE_URL", &base)],
    );
    let started = Instant::now();
    let response = client()
        .post(served.url("/chat"))
        .json(&json!({"sessionId": "s", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let events: Vec<Value> = read_sse(response).await.into_iter().map(|e| e.json()).collect();
    assert!(started.elapsed() >= Duration::from_millis(400), "the provider's retry-after-ms was honoured");
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap_or_default()).collect();
    let retries: Vec<&Value> = events.iter().filter(|e| e["type"] == "turn.retry").collect();
    assert_eq!(retries.len(), 3, "{events:#?}");
    assert_eq!(retries[0]["code"], "KEEL_PROVIDER_ERROR");
    assert_eq!(retries[0]["attempt"], 2);
    assert_eq!(retries[1]["code"], "KEEL_PROVIDER_ERROR");
    assert!(retries[1]["message"].as_str().unwrap().contains("dropped"), "{}", retries[1]);
    assert_eq!(retries[2]["code"], "KEEL_PROVIDER_RATE_LIMITED");
    assert!(retries[2]["waitMs"].as_u64().unwrap() >= 400);
    // Partial text came before the second retry; what follows the last retry is the answer.
    let last_retry = kinds.iter().rposition(|k| *k == "turn.retry").unwrap();
    let before: String = events[..last_retry]
        .iter()
        .filter(|e| e["type"] == "text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert!(before.starts_with("The whole"), "the client saw partial text first: {before:?}");
    let after: String = events[last_retry..]
        .iter()
        .filter(|e| e["type"] == "text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(after, "The whole answer, once.");
    let done = events.iter().find(|e| e["type"] == "run.done").unwrap();
    assert_eq!(done["text"], "The whole answer, once.");
    assert_eq!(server.requests().len(), 4);
    let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("keel_model_retries_total{code=\"KEEL_PROVIDER_ERROR\"} 2"), "{metrics}");
    assert!(metrics.contains("keel_model_retries_total{code=\"KEEL_PROVIDER_RATE_LIMITED\"} 1"), "{metrics}");

    // The transcript holds the answer once, and the usage is the successful attempt's.
    let session: Value = client().get(served.url("/chat/s")).send().await.unwrap().json().await.unwrap();
    assert_eq!(session["usage"], json!({"inputTokens": 60, "outputTokens": 9}));
    assert_eq!(
        session["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The whole answer, once."}]},
        ])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_fail_the_run_with_their_code_at_once() {
    let server = WireServer::start(vec![Reply::json(
        401,
        &json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
    )])
    .await;
    let dir = agent_dir(&[("agent.yaml", "model: anthropic/claude-haiku-4-5\n")]);
    let env = pairs(&[("ANTHROPIC_API_KEY", "sk-ant-SECRET-42"), ("ANTHROPIC_BASE_URL", &server.url())]);
    let output = keel_run(dir.path(), strings(&["hi"]), env).await;
    assert_eq!(output.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("KEEL_PROVIDER_AUTH") && stderr.contains("invalid x-api-key"), "{stderr}");
    assert!(!stderr.contains("SECRET-42"), "the key is never printed: {stderr}");
    assert_eq!(server.requests().len(), 1, "an auth error is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_serve_streams_anthropic_and_ollama_replies() {
    for (model, wire, env_base, key) in [
        (
            "anthropic/claude-haiku-4-5",
            Wire::Anthropic,
            "ANTHROPIC_BASE_URL",
            Some(("ANTHROPIC_API_KEY", "k")),
        ),
        ("ollama/llama3.2", Wire::Ollama, "OLLAMA_HOST", None),
    ] {
        let server = WireServer::start(vec![text_stream(wire, "Served over the wire.")]).await;
        let dir = agent_dir(&[("agent.yaml", &format!("model: {model}\n"))]);
        let url = server.url();
        let mut env = vec![(env_base, url.as_str())];
        env.extend(key);
        let served = Served::start(dir.path(), "memory", &env);
        let response = client()
            .post(served.url("/chat"))
            .json(&json!({"sessionId": "s", "input": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{model}");
        let events: Vec<Value> = read_sse(response).await.into_iter().map(|e| e.json()).collect();
        let deltas: Vec<&str> = events
            .iter()
            .filter(|e| e["type"] == "text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, ["Served ", "over ", "the ", "wire."], "{model}");
        let done = events.iter().find(|e| e["type"] == "run.done").unwrap();
        assert_eq!(done["usage"], json!({"inputTokens": 60, "outputTokens": 9}), "{model}");
        assert_eq!(server.only_request().json()["messages"].as_array().unwrap().len(), 1, "{model}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_times_out_and_the_turn_is_retried() {
    let server = WireServer::start(vec![
        text_stream(Wire::Ollama, "never finished").hang_after(80),
        text_stream(Wire::Ollama, "Second try."),
    ])
    .await;
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: ollama/llama3.2\nlimits: { provider_timeout: 1s }\nretry: { initial_backoff: 10ms }\n",
    )]);
    let output =
        keel_run(dir.path(), strings(&["hi", "--json"]), pairs(&[("OLLAMA_HOST", &server.url())])).await;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let events: Vec<Value> =
        String::from_utf8_lossy(&output.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let retry = events.iter().find(|e| e["type"] == "turn.retry").expect("a turn.retry event");
    assert_eq!(retry["code"], "KEEL_PROVIDER_TIMEOUT");
    assert!(retry["message"].as_str().unwrap().contains("provider_timeout"), "{retry}");
    assert_eq!(events.last().unwrap()["text"], "Second try.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_longer_than_keel_waits_fails_the_call_at_once() {
    let server = WireServer::start(vec![
        Reply::json(429, &json!({"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}}))
            .header("retry-after", "3600"),
    ])
    .await;
    let dir = agent_dir(&[("agent.yaml", "model: openai/gpt-4o-mini\n")]);
    let env = pairs(&[("OPENAI_API_KEY", "k"), ("OPENAI_BASE_URL", &format!("{}/v1", server.url()))]);
    let started = Instant::now();
    let output = keel_run(dir.path(), strings(&["hi"]), env).await;
    assert_eq!(output.status.code(), Some(3));
    assert!(started.elapsed() < Duration::from_secs(30), "keel did not sleep for an hour");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("KEEL_PROVIDER_RATE_LIMITED") && stderr.contains("asks to wait 3600 s"),
        "{stderr}"
    );
    assert_eq!(server.requests().len(), 1);
}

/// A child process that prints its port first, killed when dropped.
struct Peer {
    child: std::process::Child,
    port: u16,
}

impl Peer {
    fn start(script: &str, args: &[&Path]) -> Peer {
        use std::io::BufRead;
        let mut child = std::process::Command::new("python3")
            .arg(crate::support::repo_root().join("tests/peers").join(script))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("python3 runs the test peers");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("{script} printed {line:?}"));
        Peer { child, port }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whatever the proxy variables say, `http_request` and `web_fetch` go straight to the address
/// their SSRF guard checked: a proxy would resolve and reach the host itself, past the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ssrf_guarded_tools_never_go_through_the_providers_proxy() {
    let dir = agent_dir(&[]);
    let proxy_log = dir.path().join("proxy.log");
    let proxy = Peer::start("connect_proxy.py", &[&proxy_log]);
    let proxy_url = format!("http://127.0.0.1:{}", proxy.port);
    let page = WireServer::start(vec![
        Reply::new(200, "text/plain", "straight from the page"),
        Reply::new(200, "text/plain", "straight from the page"),
    ])
    .await;
    let run = |url: &str, loopback: bool| {
        std::fs::write(
            dir.path().join("agent.yaml"),
            format!(
                "model: mock\ntools: [http_request, web_fetch]\nhttp: {{ allow_loopback: {loopback} }}\nmock:\n  script:\n    - tool_calls: [{{ name: http_request, input: {{ url: '{url}' }} }}]\n    - tool_calls: [{{ name: web_fetch, input: {{ url: '{url}' }} }}]\n    - text: 'got: {{{{last_tool_output}}}}'\n"
            ),
        )
        .unwrap();
        let mut command = keel();
        command.current_dir(dir.path()).args(["run", ".", "fetch it", "--json"]);
        for variable in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"] {
            command.env(variable, &proxy_url);
        }
        command.env_remove("NO_PROXY").env_remove("no_proxy");
        command.output().unwrap()
    };
    let events = |output: &std::process::Output| -> Vec<Value> {
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    };

    let out = run(&format!("{}/page", page.url()), true);
    assert!(out.status.success(), "{out:?}");
    let done: Vec<Value> = events(&out).into_iter().filter(|e| e["type"] == "tool.done").collect();
    assert_eq!(done.len(), 2, "{out:?}");
    assert!(done.iter().all(|e| e["output"].to_string().contains("straight from the page")), "{done:?}");
    assert_eq!(page.requests().len(), 2, "both tools reached the page themselves");

    // The metadata address is refused by the guard, not handed to the proxy.
    let out = run("http://169.254.169.254/latest/meta-data/", false);
    assert!(out.status.success(), "{out:?}");
    let errors: Vec<Value> = events(&out).into_iter().filter(|e| e["type"] == "tool.error").collect();
    assert_eq!(errors.len(), 2, "{out:?}");
    assert!(errors.iter().all(|e| e["error"].as_str().unwrap().contains("169.254.169.254")), "{errors:?}");
    assert!(!proxy_log.exists(), "the proxy saw: {:?}", std::fs::read_to_string(&proxy_log));
}

/// A test CA and a certificate it signs for `localhost` and 127.0.0.1 (openssl's command line).
fn test_ca(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out =
            std::process::Command::new("openssl").args(args).current_dir(dir).output().expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    std::fs::write(
        dir.join("ca.ext"),
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.csr",
        "-subj",
        "/CN=keel test CA",
    ]);
    openssl(&[
        "x509", "-req", "-in", "ca.csr", "-signkey", "ca.key", "-out", "ca.pem", "-days", "2", "-extfile",
        "ca.ext",
    ]);
    openssl(&[
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "server.ext",
    ]);
}

#[test]
fn a_private_ca_is_trusted_through_keel_ca_bundle_and_providers_go_through_the_https_proxy() {
    let dir = agent_dir(&[]);
    test_ca(dir.path());
    let server =
        Peer::start("tls_chat_server.py", &[&dir.path().join("server.pem"), &dir.path().join("server.key")]);
    let proxy_log = dir.path().join("proxy.log");
    let proxy = Peer::start("connect_proxy.py", &[&proxy_log]);
    std::fs::write(
        dir.path().join("agent.yaml"),
        format!(
            "model: openai-compatible/tls\nprovider: {{ base_url: 'https://localhost:{}/v1' }}\nretry: {{ max_attempts: 1 }}\n",
            server.port
        ),
    )
    .unwrap();
    let run = |env: &[(&str, String)]| {
        let mut command = keel();
        command.current_dir(dir.path()).args(["run", ".", "hi"]);
        for variable in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
            "NO_PROXY",
            "no_proxy",
        ] {
            command.env_remove(variable);
        }
        for (key, value) in env {
            command.env(key, value);
        }
        command.output().unwrap()
    };
    let bundle = dir.path().join("ca.pem").display().to_string();

    // The system does not know the test CA: refused, however often it is asked.
    let out = run(&[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("KEEL_PROVIDER_ERROR") && stderr.contains(&format!("localhost:{}", server.port)),
        "{stderr}"
    );

    let out = run(&[("KEEL_CA_BUNDLE", bundle.clone())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Hello over TLS.");
    assert!(!proxy_log.exists(), "no proxy was set");

    // Through the proxy: the tunnel is made to the provider, TLS still checked end to end.
    let proxy_url = format!("http://127.0.0.1:{}", proxy.port);
    let out = run(&[("KEEL_CA_BUNDLE", bundle.clone()), ("HTTPS_PROXY", proxy_url.clone())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&proxy_log).unwrap(), format!("localhost:{}\n", server.port));
    let out = run(&[("HTTPS_PROXY", proxy_url.clone())]);
    assert!(!out.status.success(), "the proxy does not make an unknown CA trusted");
    // NO_PROXY names the host: straight there.
    let out =
        run(&[("KEEL_CA_BUNDLE", bundle), ("HTTPS_PROXY", proxy_url), ("NO_PROXY", "localhost".to_owned())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(&proxy_log).unwrap().lines().count(),
        2,
        "the failed run tunnelled too, the NO_PROXY one did not"
    );

    // A bundle that is not PEM stops keel at once, naming the file.
    std::fs::write(dir.path().join("not.pem"), "this is not a certificate\n").unwrap();
    let out = run(&[("KEEL_CA_BUNDLE", dir.path().join("not.pem").display().to_string())]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error[KEEL_CONFIG_INVALID]: KEEL_CA_BUNDLE=")
            && stderr.contains("not.pem holds no certificate"),
        "{stderr}"
    );
    let out = run(&[("KEEL_CA_BUNDLE", "/nonexistent/ca.pem".to_owned())]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/ca.pem cannot be read"), "{out:?}");

    // So does a proxy that is not a URL (requests would have gone out directly), named without
    // its value, which may hold a password.
    let out = run(&[("https_proxy", "http://me:hunter2@[::1".to_owned())]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .starts_with("error[KEEL_CONFIG_INVALID]: https_proxy is not a proxy URL (invalid IPv6 address)"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&proxy_log).unwrap().lines().count(), 2, "nothing went out");
}
