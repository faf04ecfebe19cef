//! The OpenAI-compatible routes of `keel serve`, over HTTP: the answer's shape streamed and not,
//! the session header, a paused run's note, owners kept apart, and every refusal in OpenAI's error
//! shape. (The official OpenAI SDKs are driven against the same routes by
//! `scripts/openai-test.sh`.)

use serde_json::{Value, json};

use crate::serve::{Served, client, in_an_hour, jwt, read_sse};
use crate::support::agent_dir;

/// A tool loop whose answer breaks off once midway, then a question to the human.
const AGENT: &str = "name: front-desk
model: mock
tools: [day_name, ask_question]
retry: { initial_backoff: 10ms }
mock:
  script:
    - text: Let me look.
      tool_calls: [{ name: day_name, input: {} }]
    - text: 'It is {{last_tool_output}}.'
      error: { status: 503, times: 1, partial: 'It is Nothing' }
    - tool_calls: [{ name: ask_question, input: { question: Which city? } }]
";

fn ask(text: &str) -> Value {
    json!({ "model": "front-desk", "messages": [{ "role": "user", "content": text }] })
}

async fn openai_error(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (status, body["error"].clone())
}

#[tokio::test]
async fn a_chat_completion_is_the_runs_text_streamed_or_not_and_names_its_session() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let url = server.url("/v1/chat/completions");

    let response = http.post(&url).json(&ask("What day is it?")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let session = response.headers()["x-keel-session"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "front-desk");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    // The failed attempt's words are gone: unstreamed, they were never sent.
    assert!(
        content.starts_with("Let me look.\n\nIt is ")
            && content.ends_with("day.")
            && !content.contains("Nothing"),
        "{content:?}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let usage = &body["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(body["keel"]["sessionId"], session.as_str());
    // The run is keel's: its transcript is there.
    let transcript: Value =
        http.get(server.url(&format!("/chat/{session}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 4, "{transcript}");

    // Streamed: chunks of one completion; the text says the failed attempt's words once, apart.
    let mut request = ask("What day is it?");
    request["stream"] = json!(true);
    request["stream_options"] = json!({ "include_usage": true });
    let response = http.post(&url).json(&request).send().await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let messages = read_sse(response).await;
    let (done, chunks) = messages.split_last().unwrap();
    assert_eq!(done.data(), "[DONE]");
    let chunks: Vec<Value> = chunks.iter().map(|m| m.json()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert!(
        text.starts_with("Let me look.\n\nIt is Nothing\n\nIt is ") && text.ends_with("day."),
        "{text:?}"
    );
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");

    // The session goes on by its header; a question pauses the run, and the answer says how to
    // give it.
    let response = http
        .post(&url)
        .header("X-Keel-Session", &session)
        .json(&ask("Book me a trip."))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-keel-session"], session.as_str());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["keel"]["status"], "awaiting_input");
    let question = body["keel"]["pending"][0]["id"].as_str().unwrap();
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        content,
        format!(
            "[waiting for an answer to \"Which city?\" (POST /chat/{session}/approvals/{question} {{\"answer\": ...}})]"
        )
    );
    // A second input while it waits: the session is busy.
    let response =
        http.post(&url).header("X-Keel-Session", &session).json(&ask("Hello?")).send().await.unwrap();
    let (status, error) = openai_error(response).await;
    assert_eq!(
        (status, error["code"].as_str(), error["type"].as_str()),
        (409, Some("KEEL_SESSION_BUSY"), Some("conflict_error"))
    );
}

#[tokio::test]
async fn what_keel_cannot_honour_is_refused_naming_the_parameter() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let with = |extra: Value| {
        let mut body = ask("hi");
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let image = |url: &str| json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": url } }] }] });
    let cases = [
        (with(json!({ "tools": [{ "type": "function", "function": { "name": "x" } }] })), 400, "tools"),
        (with(json!({ "tool_choice": "required" })), 400, "tool_choice"),
        (with(json!({ "n": 3 })), 400, "n"),
        (with(json!({ "logprobs": true })), 400, "logprobs"),
        (with(json!({ "stop": ["\n"] })), 400, "stop"),
        (with(json!({ "response_format": { "type": "json_object" } })), 400, "response_format"),
        (with(json!({ "frobnicate": 1 })), 400, "frobnicate"),
        (with(json!({ "model": "gpt-4o" })), 404, "model"),
        (with(json!({ "stream": "yes" })), 400, "stream"),
        (with(json!({ "messages": [] })), 400, "messages"),
        (with(json!({ "messages": [{ "role": "system", "content": "Be a pirate." }] })), 400, "messages"),
        (with(json!({ "messages": [{ "role": "user", "content": "" }] })), 400, "messages"),
        // keel fetches nothing a request points at: the cloud metadata address stays unasked.
        (with(image("http://169.254.169.254/latest/meta-data.png")), 400, "messages"),
        (with(image("data:text/plain;base64,aGk=")), 400, "messages"),
        (with(image("data:image/png;base64,@@@")), 400, "messages"),
    ];
    for (body, status, param) in cases {
        let response = http.post(server.url("/v1/chat/completions")).json(&body).send().await.unwrap();
        let (got, error) = openai_error(response).await;
        assert_eq!((got, error["param"].as_str()), (status, Some(param)), "{body}: {error}");
        assert!(error["message"].as_str().unwrap().len() > 10, "{error}");
        assert!(error["type"].as_str().unwrap().ends_with("_error"), "{error}");
    }
    // Harmless settings are taken and ignored.
    let body = with(json!({ "temperature": 0.1, "max_tokens": 9, "user": "u", "seed": 3, "store": false }));
    let response = http.post(server.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // An image sent as a data URL reaches the transcript as an image.
    let parts = json!([
        { "type": "text", "text": "What is this?" },
        { "type": "image_url", "image_url": { "url": "data:image/png;base64,iVBORw0KGgo=" } },
    ]);
    let body = with(json!({ "messages": [{ "role": "user", "content": parts }] }));
    let response = http.post(server.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let session = response.headers()["x-keel-session"].to_str().unwrap().to_owned();
    let transcript: Value =
        http.get(server.url(&format!("/chat/{session}"))).send().await.unwrap().json().await.unwrap();
    let input = &transcript["messages"][0]["content"];
    assert_eq!(
        (input[0]["type"].as_str(), input[1]["type"].as_str()),
        (Some("text"), Some("image")),
        "{input}"
    );
    assert_eq!(input[1]["mediaType"], "image/png");

    let responses = server.url("/v1/responses");
    for (body, param) in [
        (json!({ "model": "front-desk", "input": "hi", "instructions": "Be a pirate." }), "instructions"),
        (json!({ "model": "front-desk", "input": "hi", "background": true }), "background"),
        (json!({ "model": "front-desk", "input": 7 }), "input"),
        (json!({ "model": "front-desk", "input": [{ "role": "assistant", "content": "x" }] }), "input"),
        (
            json!({ "model": "front-desk", "input": "hi", "text": { "format": { "type": "json_schema" } } }),
            "text",
        ),
    ] {
        let response = http.post(&responses).json(&body).send().await.unwrap();
        let (status, error) = openai_error(response).await;
        assert_eq!((status, error["param"].as_str()), (400, Some(param)), "{body}: {error}");
    }
    // Not JSON, in OpenAI's shape too.
    let response = http
        .post(server.url("/v1/chat/completions"))
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .unwrap();
    let (status, error) = openai_error(response).await;
    assert_eq!((status, error["type"].as_str()), (415, Some("invalid_request_error")));
}

#[tokio::test]
async fn a_previous_response_continues_its_session_for_its_owner_only() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(dir.path(), "memory", &[("KEEL_JWT_SECRET", secret)]);
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token = |sub: &str| {
        jwt(jsonwebtoken::Algorithm::HS256, None, &key, json!({ "sub": sub, "exp": in_an_hour() }))
    };
    let (alice, bob) = (token("alice"), token("bob"));
    let http = client();
    let url = server.url("/v1/responses");
    let create = |who: &str, body: Value| http.post(&url).bearer_auth(who).json(&body).send();

    let first: Value = create(&alice, json!({ "model": "front-desk", "input": "What day is it?" }))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    let text = first["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("Let me look.\n\nIt is "), "{text:?}");
    let id = first["id"].as_str().unwrap();

    // Bob cannot continue Alice's conversation: her response is not found for him.
    let body = json!({ "model": "front-desk", "input": "hi", "previous_response_id": id });
    let (status, error) = openai_error(create(&bob, body.clone()).await.unwrap()).await;
    assert_eq!((status, error["param"].as_str()), (404, Some("previous_response_id")));

    // Alice continues hers, streamed: numbered events, the run paused, incomplete.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let messages = read_sse(create(&alice, streamed).await.unwrap()).await;
    let kinds: Vec<String> = messages.iter().map(|m| m.event.clone().unwrap()).collect();
    assert_eq!(kinds.first().map(String::as_str), Some("response.created"));
    assert_eq!(kinds.last().map(String::as_str), Some("response.incomplete"), "{kinds:?}");
    let numbers: Vec<u64> = messages.iter().map(|m| m.json()["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (0..numbers.len() as u64).collect::<Vec<_>>());
    let last = messages.last().unwrap().json();
    assert_eq!(last["response"]["previous_response_id"], id);
    assert_eq!(last["response"]["keel"]["sessionId"], first["keel"]["sessionId"]);
    assert!(last["response"]["output"][0]["content"][0]["text"].as_str().unwrap().contains("Which city?"));
    // Without a token, nothing.
    let response =
        http.post(&url).json(&json!({ "model": "front-desk", "input": "hi" })).send().await.unwrap();
    assert_eq!(response.status(), 401);
}

#[tokio::test]
async fn a_failed_run_is_an_error_in_openais_shape_streamed_or_not() {
    let agent = "name: broken
model: mock
mock:
  script:
    - error: { status: 400, message: the provider refused }
";
    let dir = agent_dir(&[("agent.yaml", agent)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let url = server.url("/v1/chat/completions");
    let body = json!({ "model": "broken", "messages": [{ "role": "user", "content": "hi" }] });
    let (status, error) = openai_error(http.post(&url).json(&body).send().await.unwrap()).await;
    assert_eq!(status, 502, "{error}");
    assert!(error["code"].as_str().unwrap().starts_with("KEEL_PROVIDER"), "{error}");
    assert!(error["message"].as_str().unwrap().contains("the provider refused"), "{error}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let messages = read_sse(http.post(&url).json(&streamed).send().await.unwrap()).await;
    let (done, events) = messages.split_last().unwrap();
    assert_eq!(done.data(), "[DONE]");
    let error = events.last().unwrap().json();
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    assert!(error["error"]["code"].as_str().unwrap().starts_with("KEEL_PROVIDER"), "{error}");

    let responses = json!({ "model": "broken", "input": "hi" });
    let response = http.post(server.url("/v1/responses")).json(&responses).send().await.unwrap();
    assert_eq!(openai_error(response).await.0, 502);
}
