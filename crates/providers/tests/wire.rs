//! Wire-level tests: each provider against a local server that speaks its protocol byte for
//! byte (`keel-testkit`), asserting the exact request keel sends and what it makes of the
//! response, including the faults real servers produce.

use std::sync::Arc;
use std::time::Duration;

use keel_core::event::Usage;
use keel_core::message::{Reasoning, ToolCall, ToolResult};
use keel_core::provider::ProviderErrorKind;
use keel_core::tool::ToolSpec;
use keel_core::{
    DeltaSink, Message, ModelReply, ModelRequest, Part, Provider, ProviderError, ProviderSettings, Role,
};
use keel_providers::anthropic::AnthropicMessages;
use keel_providers::ollama::OllamaChat;
use keel_providers::openai::{Flavor, OpenAiChat};
use keel_testkit::{Reply, WireServer, transcript};
use serde_json::{Value, json};

#[derive(Default)]
struct Collect {
    text: String,
    reasoning: String,
    deltas: usize,
}

impl DeltaSink for Collect {
    fn text_delta(&mut self, delta: &str) {
        self.text.push_str(delta);
        self.deltas += 1;
    }
    fn reasoning_delta(&mut self, delta: &str) {
        self.reasoning.push_str(delta);
    }
}

fn weather_tool() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: "Get the current weather for a city".into(),
        input_schema: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    }
}

fn request<'a>(messages: &'a [Arc<Message>], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
    ModelRequest {
        model: "gpt-4o-mini",
        instructions: "You are terse.",
        messages,
        tools,
        output_schema: None,
        call_index: 0,
        attempt: 1,
        tool_choice: None,
        purpose: keel_core::CallPurpose::Turn,
    }
}

fn user(text: &str) -> Vec<Arc<Message>> {
    vec![Arc::new(Message::user(text))]
}

async fn call(
    provider: &dyn Provider,
    request: ModelRequest<'_>,
) -> (Result<ModelReply, ProviderError>, Collect) {
    let mut sink = Collect::default();
    let result = provider.complete(request, &mut sink).await;
    (result, sink)
}

fn openai(server: &WireServer, flavor: Flavor) -> OpenAiChat {
    OpenAiChat::new(
        flavor,
        &format!("{}/v1", server.url()),
        Some("sk-test".into()),
        ProviderSettings::default(),
    )
}

fn anthropic(server: &WireServer) -> AnthropicMessages {
    AnthropicMessages::new(&server.url(), "sk-ant-test".into(), ProviderSettings::default())
}

fn call_part(id: &str, name: &str, input: Value) -> Part {
    Part::ToolCall(ToolCall { call_id: id.into(), name: name.into(), input })
}

// ---------------------------------------------------------------- OpenAI Chat Completions

#[tokio::test]
async fn openai_sends_the_exact_request_and_streams_text_with_usage() {
    let server =
        WireServer::start(vec![Reply::sse(transcript("openai-chat-stream-text-with-usage.sse"))]).await;
    let provider = openai(&server, Flavor::OpenAi);
    let messages = user("Hi!");
    let tools = [weather_tool()];
    let (reply, sink) = call(&provider, request(&messages, &tools)).await;
    let reply = reply.unwrap();

    let sent = server.only_request();
    assert_eq!((sent.method.as_str(), sent.path.as_str()), ("POST", "/v1/chat/completions"));
    assert_eq!(sent.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(sent.header("accept"), Some("text/event-stream"));
    assert!(sent.header("user-agent").unwrap().starts_with("keel/"));
    assert_eq!(
        sent.json(),
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi!"},
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
            "tools": [{"type": "function", "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }}],
            "tool_choice": "auto",
        })
    );
    let text =
        reply.parts.iter().find_map(|p| if let Part::Text(t) = p { Some(t.clone()) } else { None }).unwrap();
    assert!(text.starts_with("Hello! How can I"), "{text}");
    assert_eq!(sink.text, text, "the deltas add up to the recorded text");
    assert!(sink.deltas > 5);
    assert_eq!(reply.usage, Usage { input_tokens: 35, output_tokens: 10 });
}

#[tokio::test]
async fn openai_parallel_calls_interleaved_in_tiny_pieces_are_assembled() {
    // 7-byte pieces cut through JSON, escapes and the multi-byte characters of "Tōkyō 東京".
    let body = transcript("openai-chat-stream-parallel-tools.sse");
    let server = WireServer::start(vec![Reply::sse(body).in_pieces_of(7)]).await;
    let (reply, sink) =
        call(&openai(&server, Flavor::OpenAi), request(&user("weather?"), &[weather_tool()])).await;
    let reply = reply.unwrap();
    assert_eq!(
        reply.parts,
        [
            call_part("call_DdmO9pD3xa9XTPNJ32zg2hcA", "get_weather", json!({"city": "Paris"})),
            call_part("call_ABCabc123xyzXYZ0987654321", "get_weather", json!({"city": "Tōkyō 東京"})),
            // A tool without parameters streamed with `""` arguments.
            call_part("call_NoArgs000000000000000000", "current_time", json!({})),
        ]
    );
    assert_eq!(reply.usage, Usage { input_tokens: 82, output_tokens: 51 });
    assert!(sink.text.is_empty());
}

#[tokio::test]
async fn recorded_llama_cpp_streams_decode_byte_by_byte() {
    let server = WireServer::start(vec![
        Reply::sse(transcript("openai-chat-stream-tool-call.sse")).in_pieces_of(1),
        Reply::sse(transcript("llama-cpp-python-stream-forced-tool.sse")).in_pieces_of(3),
    ])
    .await;
    let provider = openai(&server, Flavor::Compatible);
    for _ in 0..2 {
        let (reply, _) =
            call(&provider, request(&user("What is the weather in Paris?"), &[weather_tool()])).await;
        let reply = reply.unwrap();
        let calls: Vec<&ToolCall> = reply
            .parts
            .iter()
            .filter_map(|p| if let Part::ToolCall(c) = p { Some(c) } else { None })
            .collect();
        assert_eq!(calls.len(), 1, "{:?}", reply.parts);
        assert_eq!(calls[0].name, "get_weather", "a name repeated in every delta is not doubled");
        assert_eq!(calls[0].input, json!({"city": "Paris"}));
        assert!(!calls[0].call_id.is_empty());
    }
}

#[tokio::test]
async fn reasoning_content_is_kept_and_sent_back_as_each_flavor_wants() {
    let server = WireServer::start(vec![
        Reply::sse(transcript("openai-compatible-reasoning-content.sse")),
        Reply::sse(transcript("openai-chat-stream-text-with-usage.sse")),
        Reply::sse(transcript("openai-chat-stream-text-with-usage.sse")),
    ])
    .await;
    let compatible = openai(&server, Flavor::Compatible);
    let (reply, sink) = call(&compatible, request(&user("9.11 or 9.9?"), &[])).await;
    let reply = reply.unwrap();
    assert_eq!(
        reply.parts,
        [
            Part::Reasoning(Reasoning { text: "9.11 vs 9.9: 0.90 > 0.11.".into(), ..Reasoning::default() }),
            Part::Text("9.9 is greater.".into()),
        ]
    );
    assert_eq!(sink.reasoning, "9.11 vs 9.9: 0.90 > 0.11.");
    assert_eq!(sink.text, "9.9 is greater.");

    let history = vec![
        Arc::new(Message::user("9.11 or 9.9?")),
        Arc::new(Message { role: Role::Assistant, parts: reply.parts.clone() }),
        Arc::new(Message::user("sure?")),
    ];
    call(&compatible, request(&history, &[])).await.0.unwrap();
    call(&openai(&server, Flavor::OpenAi), request(&history, &[])).await.0.unwrap();
    let sent = server.requests();
    assert_eq!(
        sent[1].json()["messages"][2],
        json!({"role": "assistant", "content": "9.9 is greater.", "reasoning_content": "9.11 vs 9.9: 0.90 > 0.11."})
    );
    // OpenAI's chat API takes no reasoning back.
    assert_eq!(sent[2].json()["messages"][2], json!({"role": "assistant", "content": "9.9 is greater."}));
}

#[tokio::test]
async fn tool_calls_results_errors_images_and_schema_go_out_in_openai_form() {
    let server =
        WireServer::start(vec![Reply::sse(transcript("openai-chat-stream-text-with-usage.sse"))]).await;
    let provider = OpenAiChat::new(
        Flavor::OpenAi,
        &format!("{}/v1/", server.url()),
        Some("sk-test".into()),
        ProviderSettings {
            max_tokens: Some(256),
            temperature: Some(0.0),
            parallel_tool_calls: Some(false),
            tool_choice: keel_core::ToolChoice::Tool("get_weather".into()),
            headers: vec![("OpenAI-Organization".into(), "org-1".into())],
            ..ProviderSettings::default()
        },
    );
    let history = vec![
        Arc::new(Message::from(vec![
            Part::Text("What is in this picture?".into()),
            Part::Image { media_type: "image/png".into(), data: vec![1u8, 2, 3].into() },
            Part::File {
                media_type: "text/csv".into(),
                name: Some("a.csv".into()),
                data: b"x,y\n1,2".to_vec().into(),
            },
        ])),
        Arc::new(Message {
            role: Role::Assistant,
            parts: vec![
                call_part("call_1", "get_weather", json!({"city": "Paris"})),
                // Arguments the model got wrong go back as it wrote them.
                call_part("call_2", "get_weather", Value::String("{\"city\": Par".into())),
            ],
        }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![
                Part::ToolResult(ToolResult {
                    call_id: "call_1".into(),
                    name: "get_weather".into(),
                    output: json!({"temp": 21}),
                    is_error: false,
                }),
                Part::ToolResult(ToolResult {
                    call_id: "call_2".into(),
                    name: "get_weather".into(),
                    output: json!("invalid input"),
                    is_error: true,
                }),
            ],
        }),
    ];
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}});
    let mut req = request(&history, &[]);
    req.output_schema = Some(&schema);
    req.tools = &[];
    call(&provider, req).await.0.unwrap();
    let sent = server.only_request();
    assert_eq!(sent.path, "/v1/chat/completions", "a trailing slash in the base URL is harmless");
    assert_eq!(sent.header("openai-organization"), Some("org-1"));
    let body = sent.json();
    assert_eq!(
        body["messages"][1],
        json!({"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AQID"}},
            {"type": "text", "text": "<file name=\"a.csv\">\nx,y\n1,2\n</file>"},
        ]})
    );
    assert_eq!(
        body["messages"][2],
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": Par"}},
        ]})
    );
    assert_eq!(
        body["messages"][3],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\":21}"})
    );
    assert_eq!(
        body["messages"][4],
        json!({"role": "tool", "tool_call_id": "call_2", "content": "Error: invalid input"})
    );
    assert_eq!(
        body["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    );
    assert_eq!(body["max_completion_tokens"], 256);
    assert_eq!(body["temperature"], 0.0);
    assert!(
        body.get("tools").is_none()
            && body.get("tool_choice").is_none()
            && body.get("parallel_tool_calls").is_none()
    );
}

#[tokio::test]
async fn invalid_tool_arguments_are_kept_for_the_model_to_repair() {
    let body = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": Par\"}}]}}]}\n\n\
                data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n";
    let server = WireServer::start(vec![Reply::sse(body)]).await;
    let (reply, _) = call(&openai(&server, Flavor::OpenAi), request(&user("x"), &[weather_tool()])).await;
    assert_eq!(
        reply.unwrap().parts,
        [call_part("c1", "get_weather", Value::String("{\"city\": Par".into()))]
    );
}

#[tokio::test]
async fn a_server_that_ignores_stream_and_answers_json_is_understood() {
    let completion = json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "plain"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}});
    let server = WireServer::start(vec![Reply::json(200, &completion)]).await;
    let (reply, sink) = call(&openai(&server, Flavor::Compatible), request(&user("x"), &[])).await;
    let reply = reply.unwrap();
    assert_eq!(reply.parts, [Part::Text("plain".into())]);
    assert_eq!(reply.usage, Usage { input_tokens: 3, output_tokens: 1 });
    assert_eq!(sink.text, "plain");
}

// ---------------------------------------------------------------- faults, one attempt each

async fn fault(reply: Reply) -> ProviderError {
    let server = WireServer::start(vec![reply]).await;
    let (result, _) = call(&openai(&server, Flavor::OpenAi), request(&user("x"), &[])).await;
    result.expect_err("the fault should fail the call")
}

#[tokio::test]
async fn http_errors_are_classified_with_their_retry_after() {
    let limited = fault(
        Reply::json(429, &json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}))
            .header("retry-after", "2"),
    )
    .await;
    assert_eq!(limited.kind, ProviderErrorKind::RateLimited);
    assert_eq!(limited.retry_after, Some(Duration::from_secs(2)));
    assert_eq!(limited.status, Some(429));
    assert!(limited.message.contains("Rate limit reached"), "{}", limited.message);
    assert!(limited.is_transient());

    let ms =
        fault(Reply::json(429, &json!({"error": {"message": "slow"}})).header("retry-after-ms", "150")).await;
    assert_eq!(ms.retry_after, Some(Duration::from_millis(150)));

    let server_error = fault(Reply::json(
        500,
        &json!({"error": {"message": "The server had an error", "type": "server_error"}}),
    ))
    .await;
    assert_eq!(server_error.kind, ProviderErrorKind::Transient);

    let auth = fault(Reply::json(
        401,
        &json!({"error": {"message": "Incorrect API key provided: sk-test", "code": "invalid_api_key"}}),
    ))
    .await;
    assert_eq!(auth.kind, ProviderErrorKind::Auth);
    assert!(!auth.is_transient());

    let context = fault(Reply::json(400, &json!({"error": {"message": "This model's maximum context length is 128000 tokens.", "code": "context_length_exceeded"}}))).await;
    assert_eq!(context.kind, ProviderErrorKind::ContextTooLong);

    // A server that echoes the key in its message does not get it printed.
    let echoed =
        fault(Reply::json(401, &json!({"error": {"message": "Incorrect API key provided: sk-test."}}))).await;
    assert_eq!(
        echoed.message,
        "openai answered HTTP 401: Incorrect API key provided: [redacted]. (check OPENAI_API_KEY)"
    );

    let missing = fault(Reply::json(
        404,
        &json!({"error": {"message": "The model `gpt-9` does not exist", "code": "model_not_found"}}),
    ))
    .await;
    assert_eq!(missing.kind, ProviderErrorKind::NotFound);
}

#[tokio::test]
async fn broken_streams_are_transient_or_bad_responses_never_panics() {
    let good = transcript("openai-chat-stream-text-with-usage.sse");

    let reset = fault(Reply::sse(good.clone()).reset_after(900)).await;
    assert_eq!(reset.kind, ProviderErrorKind::Transient, "{reset:?}");
    assert!(reset.message.contains("dropped"), "{}", reset.message);

    let truncated = fault(Reply::sse(good[..900].to_owned())).await;
    assert_eq!(truncated.kind, ProviderErrorKind::BadResponse);
    assert!(truncated.message.contains("ended before"), "{}", truncated.message);

    let malformed = fault(Reply::sse(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"ind\n\n",
    ))
    .await;
    assert_eq!(malformed.kind, ProviderErrorKind::BadResponse);
    assert!(malformed.message.contains("malformed chunk"), "{}", malformed.message);

    let html = fault(Reply::new(
        200,
        "text/html; charset=utf-8",
        "<html><head><title>Welcome to nginx!</title></head></html>",
    ))
    .await;
    assert_eq!(html.kind, ProviderErrorKind::BadResponse);
    assert!(html.message.contains("HTML") && html.message.contains("Welcome to nginx!"), "{}", html.message);

    let html_502 = fault(Reply::new(502, "text/html", "<html><title>502 Bad Gateway</title></html>")).await;
    assert_eq!(html_502.kind, ProviderErrorKind::Transient);

    let in_200 =
        fault(Reply::json(200, &json!({"error": {"message": "Provider returned error", "code": 429}}))).await;
    assert_eq!(in_200.kind, ProviderErrorKind::RateLimited);

    let in_stream = fault(Reply::sse("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"error\":{\"message\":\"upstream overloaded\",\"code\":502}}\n\n")).await;
    assert_eq!(in_stream.kind, ProviderErrorKind::Transient);
    assert!(in_stream.message.contains("upstream overloaded"), "{}", in_stream.message);

    let not_utf8 =
        fault(Reply::sse(b"data: {\"choices\":[{\"delta\":{\"content\":\"\xff\"}}]}\n\n".to_vec())).await;
    assert_eq!(not_utf8.kind, ProviderErrorKind::BadResponse);

    let empty = fault(Reply::sse("")).await;
    assert_eq!(empty.kind, ProviderErrorKind::BadResponse);
}

#[tokio::test]
async fn empty_choices_comments_and_unknown_fields_are_ignored() {
    let body = ": keep-alive\n\ndata: {\"choices\":[],\"object\":\"chat.completion.chunk\"}\n\n\
                data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\",\"refusal\":null},\"future\":1}]}\n\n\
                data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n\
                data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
    let server = WireServer::start(vec![Reply::sse(body).in_pieces_of(5)]).await;
    let (reply, _) = call(&openai(&server, Flavor::OpenAi), request(&user("x"), &[])).await;
    let reply = reply.unwrap();
    assert_eq!(reply.parts, [Part::Text("ok".into())]);
    assert_eq!(reply.usage, Usage { input_tokens: 2, output_tokens: 1 });
}

#[tokio::test]
async fn unreachable_server_is_a_transient_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let provider = OpenAiChat::new(
        Flavor::Compatible,
        &format!("http://127.0.0.1:{port}/v1"),
        None,
        ProviderSettings::default(),
    );
    let (result, _) = call(&provider, request(&user("x"), &[])).await;
    let error = result.unwrap_err();
    assert_eq!(error.kind, ProviderErrorKind::Transient);
    assert!(error.message.contains("could not connect"), "{}", error.message);
}

// ---------------------------------------------------------------- Anthropic Messages

#[tokio::test]
async fn anthropic_thinking_text_and_tool_use_stream_with_exact_request() {
    let server = WireServer::start(vec![
        Reply::sse(transcript("anthropic-messages-thinking-tool-use.sse")).in_pieces_of(11),
    ])
    .await;
    let provider = anthropic(&server);
    let (reply, sink) = call(&provider, request(&user("Weather in Paris?"), &[weather_tool()])).await;
    let reply = reply.unwrap();
    let sent = server.only_request();
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("x-api-key"), Some("sk-ant-test"));
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(sent.header("authorization"), None);
    assert_eq!(
        sent.json(),
        json!({
            "model": "gpt-4o-mini",
            "max_tokens": 4096,
            "system": "You are terse.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
            "stream": true,
            "tools": [{"name": "get_weather", "description": "Get the current weather for a city",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
            "tool_choice": {"type": "auto"},
        })
    );
    assert_eq!(
        reply.parts,
        [
            Part::Reasoning(Reasoning {
                text: "The user wants the weather in Paris. I should call get_weather.".into(),
                signature: Some("EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds".into()),
                redacted: None,
            }),
            Part::Text("Let me check the weather.".into()),
            call_part("toolu_01T1x1fJ34qAmk2tNTrN7Up6", "get_weather", json!({"city": "Paris"})),
        ]
    );
    assert_eq!(reply.usage, Usage { input_tokens: 472, output_tokens: 89 });
    assert_eq!(sink.text, "Let me check the weather.");
    assert_eq!(sink.reasoning, "The user wants the weather in Paris. I should call get_weather.");
}

#[tokio::test]
async fn anthropic_round_trip_keeps_signed_thinking_and_drops_foreign_reasoning() {
    let server = WireServer::start(vec![Reply::sse(transcript("anthropic-messages-text.sse"))]).await;
    let history = vec![
        Arc::new(Message::user("Weather in Paris and the time?")),
        // A turn from an OpenAI-compatible model: unsigned reasoning, an id with a dot.
        Arc::new(Message {
            role: Role::Assistant,
            parts: vec![
                Part::Reasoning(Reasoning { text: "foreign thoughts".into(), ..Reasoning::default() }),
                call_part("call.1:a", "current_time", json!({})),
            ],
        }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(ToolResult {
                call_id: "call.1:a".into(),
                name: "current_time".into(),
                output: json!("12:00"),
                is_error: false,
            })],
        }),
        // A turn from Anthropic: signed thinking.
        Arc::new(Message {
            role: Role::Assistant,
            parts: vec![
                Part::Reasoning(Reasoning {
                    text: "Need weather.".into(),
                    signature: Some("sig==".into()),
                    redacted: None,
                }),
                Part::Reasoning(Reasoning {
                    text: String::new(),
                    signature: None,
                    redacted: Some("ENCRYPTED".into()),
                }),
                Part::Text(String::new()),
                call_part("toolu_1", "get_weather", json!({"city": "Paris"})),
            ],
        }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(ToolResult {
                call_id: "toolu_1".into(),
                name: "get_weather".into(),
                output: json!("no such city"),
                is_error: true,
            })],
        }),
    ];
    let (reply, _) = call(&anthropic(&server), request(&history, &[weather_tool()])).await;
    assert_eq!(reply.unwrap().parts, [Part::Text("Hello!".into())]);
    let body = server.only_request().json();
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and the time?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1_a", "name": "current_time", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1_a", "content": "12:00"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need weather.", "signature": "sig=="},
                {"type": "redacted_thinking", "data": "ENCRYPTED"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": true}]},
        ])
    );
}

#[tokio::test]
async fn anthropic_recorded_llama_cpp_stream_and_settings() {
    let server = WireServer::start(vec![
        Reply::sse(transcript("anthropic-messages-stream-tool-use.sse")).in_pieces_of(1),
    ])
    .await;
    let provider = AnthropicMessages::new(
        &format!("{}/v1", server.url()),
        "k".into(),
        ProviderSettings {
            thinking_budget: Some(2048),
            parallel_tool_calls: Some(false),
            tool_choice: keel_core::ToolChoice::Required,
            ..ProviderSettings::default()
        },
    );
    let schema = json!({"type": "object"});
    let messages = user("Weather in Paris?");
    let mut req = request(&messages, &[]);
    let tools = [weather_tool()];
    req.tools = &tools;
    req.output_schema = Some(&schema);
    let (reply, _) = call(&provider, req).await;
    let reply = reply.unwrap();
    assert_eq!(reply.parts.len(), 1);
    let Part::ToolCall(call) = &reply.parts[0] else { panic!("{:?}", reply.parts) };
    assert_eq!((call.name.as_str(), &call.input), ("get_weather", &json!({"city": "Paris"})));
    assert_eq!(reply.usage, Usage { input_tokens: 171, output_tokens: 21 }, "cached input counts as input");
    let body = server.only_request().json();
    assert_eq!(server.only_request().path, "/v1/messages", "a base URL ending in /v1 is not doubled");
    assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 2048}));
    assert_eq!(body["max_tokens"], 2048 + 4096);
    assert_eq!(body["tool_choice"], json!({"type": "any", "disable_parallel_tool_use": true}));
    assert!(body["system"].as_str().unwrap().contains("matches this JSON Schema:\n{\"type\":\"object\"}"));
}

#[tokio::test]
async fn anthropic_errors_mid_stream_and_overload() {
    let server = WireServer::start(vec![
        Reply::sse(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n\
             event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
        ),
        Reply::json(529, &json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})).header("retry-after", "3"),
        Reply::json(400, &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 200001 tokens > 200000 maximum"}})),
        Reply::sse(transcript("anthropic-messages-text.sse").replace("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", "").replace("\"stop_reason\":\"end_turn\"", "\"stop_reason\":null")),
    ])
    .await;
    let provider = anthropic(&server);
    let mid = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(mid.kind, ProviderErrorKind::Overloaded);
    assert_eq!(mid.message, "anthropic reported an error (overloaded_error): Overloaded");
    let overloaded = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(
        (overloaded.kind, overloaded.retry_after),
        (ProviderErrorKind::Overloaded, Some(Duration::from_secs(3)))
    );
    let long = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(long.kind, ProviderErrorKind::ContextTooLong);
    assert_eq!(long.code().as_str(), "KEEL_PROVIDER_CONTEXT_TOO_LONG");
    let cut = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(cut.kind, ProviderErrorKind::BadResponse, "{cut:?}");
}

// ---------------------------------------------------------------- Ollama

#[tokio::test]
async fn ollama_streams_ndjson_text_with_counts_and_exact_request() {
    let server =
        WireServer::start(vec![Reply::ndjson(transcript("ollama-chat-text.ndjson")).in_pieces_of(4)]).await;
    let provider = OllamaChat::new(
        &server.url(),
        None,
        ProviderSettings { max_tokens: Some(100), temperature: Some(0.5), ..ProviderSettings::default() },
    );
    let history = vec![Arc::new(Message::from(vec![
        Part::Text("Why is the sky blue?".into()),
        Part::Image { media_type: "image/jpeg".into(), data: vec![255u8, 216].into() },
    ]))];
    let (reply, sink) = call(&provider, request(&history, &[weather_tool()])).await;
    let reply = reply.unwrap();
    assert_eq!(reply.parts, [Part::Text("The sky is blue 🌤".into())]);
    assert_eq!(sink.text, "The sky is blue 🌤");
    assert_eq!(reply.usage, Usage { input_tokens: 26, output_tokens: 282 });
    let sent = server.only_request();
    assert_eq!(sent.path, "/api/chat");
    assert_eq!(sent.header("authorization"), None);
    assert_eq!(
        sent.json(),
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Why is the sky blue?", "images": ["/9g="]},
            ],
            "stream": true,
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
            "options": {"num_predict": 100, "temperature": 0.5},
        })
    );
}

#[tokio::test]
async fn ollama_thinking_and_whole_tool_calls_round_trip() {
    let server = WireServer::start(vec![
        Reply::ndjson(transcript("ollama-chat-tool-call.ndjson")),
        Reply::ndjson(transcript("ollama-chat-text.ndjson")),
    ])
    .await;
    let provider = OllamaChat::new(&server.url(), None, ProviderSettings::default());
    let (reply, sink) = call(&provider, request(&user("Weather in Toronto?"), &[weather_tool()])).await;
    let reply = reply.unwrap();
    assert_eq!(sink.reasoning, "The user asks for the weather; call get_weather.");
    assert_eq!(
        reply.parts[1..],
        [call_part("", "get_weather", json!({"city": "Toronto"})), call_part("", "current_time", json!({}))]
    );
    let history = vec![
        Arc::new(Message::user("Weather in Toronto?")),
        Arc::new(Message { role: Role::Assistant, parts: reply.parts.clone() }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(ToolResult {
                call_id: "x".into(),
                name: "get_weather".into(),
                output: json!("sunny"),
                is_error: false,
            })],
        }),
    ];
    call(&provider, request(&history, &[])).await.0.unwrap();
    let body = server.requests()[1].json();
    assert_eq!(
        body["messages"][2],
        json!({"role": "assistant", "content": "", "thinking": "The user asks for the weather; call get_weather.",
               "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Toronto"}}},
                              {"function": {"name": "current_time", "arguments": {}}}]})
    );
    assert_eq!(body["messages"][3], json!({"role": "tool", "tool_name": "get_weather", "content": "sunny"}));
}

#[tokio::test]
async fn ollama_errors_are_classified() {
    let server = WireServer::start(vec![
        Reply::json(404, &json!({"error": "model \"llama9\" not found, try pulling it first"})),
        Reply::ndjson("{\"message\":{\"role\":\"assistant\",\"content\":\"a\"},\"done\":false}\n{\"error\":\"an error was encountered while running the model\"}\n"),
        Reply::ndjson("{\"message\":{\"role\":\"assistant\",\"content\":\"a\"},\"done\":false}\n"),
    ])
    .await;
    let provider = OllamaChat::new(&server.url(), None, ProviderSettings::default());
    let missing = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(missing.kind, ProviderErrorKind::NotFound);
    assert!(missing.message.contains("try pulling it first"), "{}", missing.message);
    let in_stream = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert_eq!(in_stream.kind, ProviderErrorKind::BadResponse);
    assert!(in_stream.message.contains("while running the model"));
    let cut = call(&provider, request(&user("x"), &[])).await.0.unwrap_err();
    assert!(cut.message.contains("done"), "{}", cut.message);
}

// ---------------------------------------------------------------- Images in tool results

/// A turn whose tool (an MCP server's, say) returned an image beside its text.
fn image_tool_turn() -> Vec<Arc<Message>> {
    vec![
        Arc::new(Message::user("Show me the chart.")),
        Arc::new(Message { role: Role::Assistant, parts: vec![call_part("call_1", "chart", json!({}))] }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(ToolResult {
                call_id: "call_1".into(),
                name: "chart".into(),
                output: json!([
                    { "type": "text", "text": "sales by month" },
                    { "type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo=" },
                ]),
                is_error: false,
            })],
        }),
    ]
}

#[tokio::test]
async fn images_a_tool_returned_reach_each_provider_as_images() {
    let readable =
        r#"[{"text":"sales by month","type":"text"},{"mimeType":"image/png","shown":true,"type":"image"}]"#;
    let history = image_tool_turn();

    // OpenAI: the tool message is text; the image follows in a user message.
    let server =
        WireServer::start(vec![Reply::sse(transcript("openai-chat-stream-text-with-usage.sse"))]).await;
    call(&openai(&server, Flavor::OpenAi), request(&history, &[])).await.0.unwrap();
    let body = server.only_request().json();
    assert_eq!(body["messages"][3], json!({"role": "tool", "tool_call_id": "call_1", "content": readable}));
    assert_eq!(
        body["messages"][4],
        json!({"role": "user", "content": [
            {"type": "text", "text": "The images the tool calls above returned:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ]})
    );
    assert_eq!(body["messages"].as_array().unwrap().len(), 5);

    // Anthropic: the image is a block of the tool result.
    let server =
        WireServer::start(vec![Reply::sse(transcript("anthropic-messages-thinking-tool-use.sse"))]).await;
    call(&anthropic(&server), request(&history, &[])).await.0.unwrap();
    let body = server.only_request().json();
    assert_eq!(
        body["messages"][2]["content"][0]["content"],
        json!([
            {"type": "text", "text": readable},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        ])
    );

    // Ollama: the tool message carries the image as base64.
    let server = WireServer::start(vec![Reply::ndjson(transcript("ollama-chat-text.ndjson"))]).await;
    let ollama = OllamaChat::new(&server.url(), None, ProviderSettings::default());
    call(&ollama, request(&history, &[])).await.0.unwrap();
    let body = server.only_request().json();
    assert_eq!(
        body["messages"][3],
        json!({"role": "tool", "tool_name": "chart", "content": readable, "images": ["iVBORw0KGgo="]})
    );
}

#[test]
fn a_call_s_own_tool_choice_wins_over_the_provider_setting_on_every_wire() {
    use keel_core::ToolChoice;
    let settings = ProviderSettings { tool_choice: ToolChoice::Required, ..ProviderSettings::default() };
    let messages = user("Weather in Paris?");
    let tools = [weather_tool()];
    let forced = ToolChoice::Tool("get_weather".into());
    let mut req = request(&messages, &tools);
    req.tool_choice = Some(&forced);

    let openai = OpenAiChat::new(Flavor::OpenAi, "http://127.0.0.1:1/v1", None, settings.clone());
    let body = openai.request_body(&req).unwrap();
    assert_eq!(body["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
    let anthropic = AnthropicMessages::new("http://127.0.0.1:1/v1", "k".into(), settings.clone());
    let body = anthropic.request_body(&req).unwrap();
    assert_eq!(body["tool_choice"], json!({"type": "tool", "name": "get_weather"}));

    // `none` for one call: Ollama, which has no `tool_choice`, is offered no tools then.
    let none = ToolChoice::None;
    req.tool_choice = Some(&none);
    let ollama = OllamaChat::new("http://127.0.0.1:1", None, settings.clone());
    assert!(ollama.request_body(&req).unwrap().get("tools").is_none());
    assert_eq!(openai.request_body(&req).unwrap()["tool_choice"], json!("none"));
    req.tool_choice = None;
    assert!(ollama.request_body(&req).unwrap().get("tools").is_some());
    assert_eq!(openai.request_body(&req).unwrap()["tool_choice"], json!("required"), "the setting applies");
}
