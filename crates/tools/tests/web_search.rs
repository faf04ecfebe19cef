//! `web_search` against local servers that speak each backend's documented API (SearXNG's JSON
//! API, Brave's web search, Tavily's search): the request each expects (method, path, query,
//! key), the results read from their answers; throttling retried, auth failures, HTML and
//! oversized answers, an unreachable backend, each with its own code.

use std::sync::Arc;
use std::time::Duration;

use keel_core::{ErrorCode, SearchBackendKind, SearchSettings, SessionState, Tool, ToolContext, ToolError};
use keel_testkit::{Recorded, Reply, WireServer};
use keel_tools::web_search::WebSearch;
use serde_json::{Value, json};

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("searchtest"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "call_1".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

fn settings(backend: SearchBackendKind, url: &str) -> SearchSettings {
    SearchSettings { backend, url: Some(url.to_owned()), api_key_env: None, timeout: Duration::from_secs(5) }
}

/// The tool with `BRAVE_API_KEY=brave-key` and `TAVILY_API_KEY=tvly-key` as its environment.
fn search_tool(settings: &SearchSettings) -> WebSearch {
    WebSearch::from_settings_with_env(
        settings,
        Arc::new(|name| match name {
            "BRAVE_API_KEY" => Some("brave-key".into()),
            "TAVILY_API_KEY" => Some("tvly-key".into()),
            _ => None,
        }),
    )
}

async fn search(tool: &WebSearch, input: Value) -> Result<Value, ToolError> {
    tool.call(input, &ctx()).await
}

/// The query parameters of a recorded request.
fn query(request: &Recorded) -> Vec<(String, String)> {
    let url = url::Url::parse(&format!("http://x{}", request.path)).unwrap();
    url.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect()
}

fn param(request: &Recorded, name: &str) -> Option<String> {
    query(request).into_iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// `n` results as SearXNG's JSON API lists them.
fn searxng_answer(q: &str, n: usize) -> Value {
    let results: Vec<Value> = (0..n)
        .map(|i| {
            json!({
                "url": format!("https://example.org/{i}"), "title": format!("Result {i}"),
                "content": format!("About {q}, number {i}"), "engine": "duckduckgo",
                "parsed_url": ["https", "example.org", format!("/{i}"), "", "", ""],
                "template": "default.html", "engines": ["duckduckgo"], "positions": [i + 1],
                "score": 1.0, "category": "general"
            })
        })
        .collect();
    json!({ "query": q, "number_of_results": 0, "results": results, "answers": [], "corrections": [],
            "infoboxes": [], "suggestions": [], "unresponsive_engines": [] })
}

/// A SearXNG instance: `GET /search?q=..&format=json`, else what SearXNG answers.
fn searxng(request: &Recorded) -> Reply {
    if request.method != "GET" || !request.path.starts_with("/search?") {
        return Reply::new(404, "text/html", "<html><body>Not Found</body></html>");
    }
    if param(request, "format").as_deref() != Some("json") {
        return Reply::new(200, "text/html", "<html><body>results page</body></html>");
    }
    let q = param(request, "q").unwrap_or_default();
    Reply::json(200, &searxng_answer(&q, 8))
}

#[tokio::test]
async fn searxng_results_come_from_its_json_api_five_by_default_at_most_ten() {
    let server = WireServer::responding(searxng).await;
    let tool = search_tool(&settings(SearchBackendKind::Searxng, &server.url()));
    let results = search(&tool, json!({ "query": "durable agents" })).await.unwrap();
    let results = results.as_array().unwrap();
    assert_eq!(results.len(), 5, "{results:?}");
    assert_eq!(
        results[0],
        json!({ "url": "https://example.org/0", "title": "Result 0", "description": "About durable agents, number 0" })
    );
    let request = server.only_request();
    assert_eq!(
        (param(&request, "q").unwrap(), param(&request, "format").unwrap()),
        ("durable agents".into(), "json".into())
    );
    assert_eq!(request.header("authorization"), None, "no key configured, none sent");

    let results = search(&tool, json!({ "query": "durable agents", "limit": 2 })).await.unwrap();
    assert_eq!(results.as_array().unwrap().len(), 2);
    // SearXNG's page has 8: a limit above that gives what there is.
    let results = search(&tool, json!({ "query": "q", "limit": 10 })).await.unwrap();
    assert_eq!(results.as_array().unwrap().len(), 8);
    // A limit past the maximum is refused by the schema the model sees.
    let set = keel_core::ToolSet::new(vec![Arc::new(tool)]).unwrap();
    assert!(set.validate_input("web_search", &json!({ "query": "q", "limit": 11 })).is_err());
    assert!(set.validate_input("web_search", &json!({ "query": "" })).is_err());
}

#[tokio::test]
async fn brave_is_asked_with_its_token_and_its_snippets_lose_their_markup() {
    let server = WireServer::responding(|request| {
        if request.header("x-subscription-token") != Some("brave-key") {
            return Reply::json(
                422,
                &json!({ "type": "ErrorResponse", "error": { "id": "e1", "status": 422, "code": "SUBSCRIPTION_TOKEN_INVALID",
                          "detail": "The provided subscription token is invalid." }, "time": 1 }),
            );
        }
        assert!(request.path.starts_with("/res/v1/web/search?"), "{}", request.path);
        let count: usize = param(request, "count").unwrap().parse().unwrap();
        let mut results: Vec<Value> = (0..count)
            .map(|i| json!({ "type": "search_result", "title": format!("The <strong>keel</strong> book {i}"),
                             "url": format!("https://keel.example/{i}"),
                             "description": "A runtime for <strong>durable</strong> agents &amp; their tools.",
                             "language": "en", "family_friendly": true }))
            .collect();
        // What the tool drops: a repeated URL, a result that is not a web page.
        results.insert(1, results[0].clone());
        results.insert(2, json!({ "title": "mail", "url": "mailto:someone@example.org" }));
        Reply::json(200, &json!({ "type": "search", "query": { "original": param(request, "q") },
                                   "mixed": {}, "web": { "type": "search", "results": results } }))
    })
    .await;
    let tool = search_tool(&settings(SearchBackendKind::Brave, &server.url()));
    let results = search(&tool, json!({ "query": "keel", "limit": 3 })).await.unwrap();
    assert_eq!(
        results,
        json!([
            { "url": "https://keel.example/0", "title": "The keel book 0", "description": "A runtime for durable agents & their tools." },
            { "url": "https://keel.example/1", "title": "The keel book 1", "description": "A runtime for durable agents & their tools." },
            { "url": "https://keel.example/2", "title": "The keel book 2", "description": "A runtime for durable agents & their tools." },
        ])
    );
    assert_eq!(param(&server.only_request(), "count").as_deref(), Some("3"));

    // A wrong token: Brave's 422, an auth error with Brave's words.
    let wrong = WebSearch::from_settings_with_env(
        &settings(SearchBackendKind::Brave, &server.url()),
        Arc::new(|_| Some("stale".into())),
    );
    let error = search(&wrong, json!({ "query": "keel" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchAuth, "{error:?}");
    assert!(error.message.contains("subscription token is invalid"), "{}", error.message);
    // No key at all: said before any request.
    let before = server.requests().len();
    let keyless = WebSearch::from_settings_with_env(
        &settings(SearchBackendKind::Brave, &server.url()),
        Arc::new(|_| None),
    );
    let error = search(&keyless, json!({ "query": "keel" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchAuth);
    assert!(error.message.contains("BRAVE_API_KEY is not set"), "{}", error.message);
    assert_eq!(server.requests().len(), before);
}

#[tokio::test]
async fn tavily_gets_a_json_post_with_a_bearer_key_and_a_spent_plan_is_said_so() {
    let server = WireServer::responding(|request| {
        if request.header("authorization") != Some("Bearer tvly-key") {
            return Reply::json(401, &json!({ "detail": { "error": "Unauthorized: missing or invalid API key." } }));
        }
        let body = request.json();
        if body["query"] == "quota" {
            return Reply::json(432, &json!({ "detail": { "error": "This request exceeds your plan's set usage limit." } }));
        }
        assert_eq!((request.method.as_str(), request.path.as_str()), ("POST", "/search"));
        let n = body["max_results"].as_u64().unwrap() as usize;
        let results: Vec<Value> = (0..n)
            .map(|i| json!({ "title": format!("T{i}"), "url": format!("https://t.example/{i}"),
                             "content": format!("snippet {i}"), "score": 0.9, "raw_content": null }))
            .collect();
        Reply::json(200, &json!({ "query": body["query"], "follow_up_questions": null, "answer": null,
                                   "images": [], "results": results, "response_time": 0.8, "request_id": "r1" }))
    })
    .await;
    let tool = search_tool(&settings(SearchBackendKind::Tavily, &server.url()));
    let results = search(&tool, json!({ "query": "keel runtime" })).await.unwrap();
    assert_eq!(results.as_array().unwrap().len(), 5);
    assert_eq!(
        results[4],
        json!({ "url": "https://t.example/4", "title": "T4", "description": "snippet 4" })
    );
    let sent = server.only_request().json();
    assert_eq!((sent["query"].as_str(), sent["max_results"].as_u64()), (Some("keel runtime"), Some(5)));

    let error = search(&tool, json!({ "query": "quota" })).await.unwrap_err();
    assert_eq!((error.code, error.transient), (ErrorCode::SearchThrottled, false), "{error:?}");
    assert!(error.message.contains("quota") && error.message.contains("usage limit"), "{}", error.message);

    let wrong = WebSearch::from_settings_with_env(
        &settings(SearchBackendKind::Tavily, &server.url()),
        Arc::new(|_| Some("x".into())),
    );
    let error = search(&wrong, json!({ "query": "keel" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchAuth);
    assert!(
        error.message.contains("HTTP 401") && error.message.contains("invalid API key"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn throttling_is_waited_out_and_a_throttle_that_lasts_fails_clearly() {
    // Two 429s (Brave's headers), then the results.
    let rate_limited = || {
        Reply::json(
            429,
            &json!({ "type": "ErrorResponse", "error": { "code": "RATE_LIMITED", "status": 429 } }),
        )
        .header("X-RateLimit-Limit", "1, 15000")
        .header("X-RateLimit-Remaining", "0, 14000")
        .header("X-RateLimit-Reset", "0, 1419704")
    };
    let ok = Reply::json(
        200,
        &json!({ "type": "search", "web": { "results": [{ "title": "A", "url": "https://a.example/" }] } }),
    );
    let server = WireServer::start(vec![rate_limited(), rate_limited(), ok]).await;
    let tool = search_tool(&settings(SearchBackendKind::Brave, &server.url()));
    let results = search(&tool, json!({ "query": "q" })).await.unwrap();
    assert_eq!(results, json!([{ "url": "https://a.example/", "title": "A" }]));
    assert_eq!(server.requests().len(), 3);

    // SearXNG's limiter, with Retry-After: a try and three retries, then the error.
    let server = WireServer::responding(|_| {
        Reply::new(429, "text/plain", "Too Many Requests").header("Retry-After", "0")
    })
    .await;
    let tool = search_tool(&settings(SearchBackendKind::Searxng, &server.url()));
    let error = search(&tool, json!({ "query": "q" })).await.unwrap_err();
    assert_eq!((error.code, error.transient), (ErrorCode::SearchThrottled, true), "{error:?}");
    assert!(error.message.contains("HTTP 429 after 3 retries"), "{}", error.message);
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn answers_that_are_not_the_api_fail_with_a_code_that_says_so() {
    // A login page where the API should be.
    let server = WireServer::responding(|_| {
        Reply::new(200, "text/html; charset=utf-8", "<!DOCTYPE html><html><head><title>Sign in</title></head><body><form>Sign in to continue</form></body></html>")
    })
    .await;
    let tool = search_tool(&settings(SearchBackendKind::Searxng, &server.url()));
    let error = search(&tool, json!({ "query": "q" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchBadResponse);
    assert!(error.message.contains("an HTML page") && error.message.contains("Sign in"), "{}", error.message);

    // JSON of another shape.
    let server = WireServer::responding(|_| Reply::json(200, &json!({ "hits": [] }))).await;
    let error =
        search(&tool_for(&server, SearchBackendKind::Tavily), json!({ "query": "q" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchBadResponse);
    assert!(error.message.contains("`results` is not a list"), "{}", error.message);

    // SearXNG with its JSON format off answers 403.
    let server = WireServer::responding(|_| {
        Reply::new(403, "text/html", "<html><body><h1>Forbidden</h1></body></html>")
    })
    .await;
    let error =
        search(&tool_for(&server, SearchBackendKind::Searxng), json!({ "query": "q" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchAuth);
    assert!(error.message.contains("settings.yml"), "{}", error.message);

    // 5 MiB of JSON is no page of results.
    let huge = format!("{{\"results\": [\"{}\"]}}", "x".repeat(5 * 1024 * 1024));
    let server = WireServer::responding(move |_| Reply::new(200, "application/json", huge.clone())).await;
    let error =
        search(&tool_for(&server, SearchBackendKind::Searxng), json!({ "query": "q" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchBadResponse);
    assert!(error.message.contains("more than 4 MiB"), "{}", error.message);

    // A backend that is down: retried as a failure of the moment, then said.
    let server =
        WireServer::responding(|_| Reply::new(503, "text/plain", "upstream down").header("Retry-After", "0"))
            .await;
    let error =
        search(&tool_for(&server, SearchBackendKind::Brave), json!({ "query": "q" })).await.unwrap_err();
    assert_eq!((error.code, error.transient), (ErrorCode::SearchUnavailable, true));
    assert!(
        error.message.contains("HTTP 503") && error.message.contains("upstream down"),
        "{}",
        error.message
    );
    assert_eq!(server.requests().len(), 4);

    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let tool = search_tool(&settings(SearchBackendKind::Searxng, &format!("http://127.0.0.1:{port}")));
    let error = search(&tool, json!({ "query": "q" })).await.unwrap_err();
    assert_eq!(error.code, ErrorCode::SearchUnavailable);
    assert!(error.message.contains("cannot be reached"), "{}", error.message);
}

fn tool_for(server: &WireServer, backend: SearchBackendKind) -> WebSearch {
    search_tool(&settings(backend, &server.url()))
}
