//! `POST /ai-sdk/chat` of `keel serve` over HTTP: the AI SDK's UI message stream for a turn, an
//! approval answered by the assistant message that asked for it, owners kept apart, and every
//! refusal. (`useChat` from the real `@ai-sdk/react` is driven against it by
//! `scripts/client-test.sh`.) Also the session feed's end-of-run messages and the headers that let
//! a client cut before its first event read its run from the start.

use serde_json::{Value, json};

use crate::serve::{Served, client, error_of, in_an_hour, jwt, read_sse};
use crate::support::agent_dir;

const AGENT: &str = "name: desk
model: mock
tools: [day_name, current_date]
approvals: { tools: [current_date] }
retry: { initial_backoff: 10ms }
mock:
  script:
    - text: Let me look.
      tool_calls: [{ name: day_name, input: {} }]
    - text: 'It is {{last_tool_output}}.'
      error: { status: 503, times: 1, partial: 'It is Nothing' }
    - tool_calls: [{ name: current_date, input: {} }]
    - text: 'Noted.'
";

fn user(id: &str, chat: &str, text: &str) -> Value {
    json!({
        "id": chat,
        "messages": [{ "id": id, "role": "user", "parts": [{ "type": "text", "text": text }] }],
        "trigger": "submit-message",
    })
}

async fn chunks(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-vercel-ai-ui-message-stream"], "v1");
    let messages = read_sse(response).await;
    let (done, chunks) = messages.split_last().unwrap();
    assert_eq!(done.data(), "[DONE]");
    chunks.iter().map(|m| m.json()).collect()
}

fn types(chunks: &[Value]) -> Vec<&str> {
    chunks.iter().map(|c| c["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn a_turn_is_a_ui_message_stream_and_an_approval_continues_its_message() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let url = server.url("/ai-sdk/chat");

    let turn = chunks(http.post(&url).json(&user("u1", "c1", "What day?")).send().await.unwrap()).await;
    assert_eq!(
        types(&turn),
        [
            "start",
            "start-step",
            "text-start",
            "text-delta",
            "text-delta",
            "text-delta",
            "text-end",
            "tool-input-available",
            "tool-output-available",
            "finish-step",
            "start-step",
            "text-start",
            "text-delta",
            "text-delta",
            "text-delta",
            // The attempt that broke off: its words are dropped.
            "reset-step",
            "text-start",
            "text-delta",
            "text-delta",
            "text-delta",
            "text-end",
            "finish-step",
            "finish",
        ]
    );
    assert_eq!(turn[0]["messageMetadata"]["sessionId"], "c1");
    assert_eq!(turn[7]["toolName"], "day_name");
    assert_eq!(turn[7]["dynamic"], true);
    assert_eq!(turn[8]["toolCallId"], turn[7]["toolCallId"]);
    let after_reset: String = turn[17..20].iter().map(|c| c["delta"].as_str().unwrap()).collect();
    assert!(after_reset.starts_with("It is ") && after_reset.ends_with("day."), "{after_reset}");
    assert_ne!(turn[16]["id"], turn[11]["id"], "a new text part after the reset");
    assert_eq!(turn.last().unwrap()["finishReason"], "stop");
    assert_eq!(turn.last().unwrap()["messageMetadata"]["status"], "finished");

    // The next turn asks for approval; the message's id is the run's.
    let asking = chunks(http.post(&url).json(&user("u2", "c1", "Note it.")).send().await.unwrap()).await;
    assert_eq!(
        types(&asking),
        ["start", "start-step", "tool-input-available", "tool-approval-request", "finish-step", "finish"]
    );
    let message_id = asking[0]["messageId"].as_str().unwrap().to_owned();
    let approval = asking[3]["approvalId"].as_str().unwrap().to_owned();
    let call = asking[3]["toolCallId"].as_str().unwrap().to_owned();
    assert!(approval.starts_with("ap_"), "{approval}");
    let finish = asking.last().unwrap();
    assert_eq!(finish["messageMetadata"]["status"], "awaiting_input");
    assert_eq!(finish["messageMetadata"]["pending"][0]["id"], approval.as_str());

    // The assistant message comes back with the approval response (as `useChat` sends it): the
    // run continues in that message, its call's outcome first, never announced again.
    let responded = json!({
        "id": "c1",
        "messages": [{
            "id": message_id,
            "role": "assistant",
            "parts": [
                { "type": "step-start" },
                {
                    "type": "dynamic-tool", "toolName": "current_date", "toolCallId": call,
                    "state": "approval-responded", "input": {},
                    "approval": { "id": approval, "approved": true, "reason": "fine" },
                },
            ],
        }],
    });
    let continued = chunks(http.post(&url).json(&responded).send().await.unwrap()).await;
    assert_eq!(
        types(&continued),
        [
            "start",
            // Into the step that asked (its stream ended it), then the next model call's.
            "tool-output-available",
            "start-step",
            "text-start",
            "text-delta",
            "text-end",
            "finish-step",
            "finish"
        ]
    );
    assert_eq!(continued[0]["messageId"], message_id.as_str());
    assert_eq!(continued[1]["toolCallId"], call.as_str());
    assert_eq!(continued[4]["delta"], "Noted.");
    // The same response again: that approval is decided already.
    let again = http.post(&url).json(&responded).send().await.unwrap();
    assert_eq!(error_of(again).await, (404, "KEEL_NOT_PENDING".to_owned()));
    // The chat is keel's session, with the whole conversation.
    let transcript: Value = http.get(server.url("/chat/c1")).send().await.unwrap().json().await.unwrap();
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 8, "{transcript}");
}

#[tokio::test]
async fn bad_requests_are_refused_with_keels_codes_and_nothing_runs() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let url = server.url("/ai-sdk/chat");
    let assistant =
        |parts: Value| json!({ "id": "c", "messages": [{ "id": "m", "role": "assistant", "parts": parts }] });
    let cases = [
        ("no id", json!({ "messages": [] }), 400, "KEEL_REQUEST_INVALID"),
        ("a bad id", user("u", "not ok!", "hi"), 400, "KEEL_SESSION_ID_INVALID"),
        ("no messages", json!({ "id": "c", "messages": [] }), 400, "KEEL_REQUEST_INVALID"),
        (
            "a regenerate",
            json!({ "id": "c", "messages": [{ "id": "u", "role": "user", "parts": [{ "type": "text", "text": "hi" }] }], "trigger": "regenerate-message" }),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        (
            "a file keel would have to fetch",
            json!({ "id": "c", "messages": [{ "id": "u", "role": "user", "parts": [{ "type": "file", "mediaType": "image/png", "url": "http://169.254.169.254/latest" }] }] }),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        ("an empty user message", user("u", "c", ""), 400, "KEEL_REQUEST_INVALID"),
        (
            "an assistant message with nothing to decide",
            assistant(json!([{ "type": "text", "text": "hi" }])),
            400,
            "KEEL_REQUEST_INVALID",
        ),
        (
            "an approval nobody asked for",
            assistant(
                json!([{ "type": "dynamic-tool", "toolCallId": "x", "toolName": "t", "state": "approval-responded", "approval": { "id": "ap_0000000000000000", "approved": true } }]),
            ),
            404,
            "KEEL_NOT_PENDING",
        ),
    ];
    for (what, body, status, code) in cases {
        let response = http.post(&url).json(&body).send().await.unwrap();
        assert_eq!(error_of(response).await, (status, code.to_owned()), "{what}");
    }
    let sessions: Value = http.get(server.url("/sessions")).send().await.unwrap().json().await.unwrap();
    assert_eq!(sessions["sessions"], json!([]), "nothing ran");
}

#[tokio::test]
async fn a_subject_decides_only_its_own_approvals() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(dir.path(), "memory", &[("KEEL_JWT_SECRET", secret)]);
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token =
        |sub: &str| jwt(jsonwebtoken::Algorithm::HS256, None, &key, json!({"sub": sub, "exp": in_an_hour()}));
    let (alice, bob) = (token("alice"), token("bob"));
    let http = client();
    let url = server.url("/ai-sdk/chat");
    let post = |who: &str, body: &Value| http.post(&url).bearer_auth(who).json(body).send();
    chunks(post(&alice, &user("u1", "c", "What day?")).await.unwrap()).await;
    let asking = chunks(post(&alice, &user("u2", "c", "Note it.")).await.unwrap()).await;
    let approval = asking[3]["approvalId"].as_str().unwrap();
    let responded = json!({ "id": "c", "messages": [{ "id": "m", "role": "assistant", "parts": [
        { "type": "dynamic-tool", "toolCallId": asking[3]["toolCallId"], "toolName": "current_date", "state": "approval-responded", "approval": { "id": approval, "approved": true } },
    ] }] });
    // Bob's chat `c` is another session: Alice's approval is not pending there.
    assert_eq!(error_of(post(&bob, &responded).await.unwrap()).await, (404, "KEEL_NOT_PENDING".to_owned()));
    let continued = chunks(post(&alice, &responded).await.unwrap()).await;
    assert_eq!(continued.last().unwrap()["finishReason"], "stop");
    assert_eq!(continued[0]["messageMetadata"]["sessionId"], "c", "the client's own id, not the scoped one");
}

#[tokio::test]
async fn the_session_feed_tells_each_runs_end_and_a_run_can_be_read_from_its_start() {
    let dir = agent_dir(&[("agent.yaml", AGENT)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let response = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "f", "input": "What day?"}))
        .send()
        .await
        .unwrap();
    let run = response.headers()["x-keel-run-id"].to_str().unwrap().to_owned();
    let before = response.headers()["x-keel-last-event-id"].to_str().unwrap().to_owned();
    let streamed = read_sse(response).await;
    let done = streamed.last().unwrap();
    assert_eq!(done.event.as_deref(), Some("done"));
    assert_eq!(done.json()["runId"], run.as_str());
    assert!(done.id.is_some(), "the end has its id too");

    // From the position the headers gave: the run whole, from its `run.start`, then its end.
    let feed = http.get(server.url("/chat/f/events")).header("last-event-id", &before).send().await.unwrap();
    let mut body = feed.bytes_stream();
    let mut buffer = String::new();
    let mut seen = Vec::new();
    use futures::StreamExt;
    while seen.len() < streamed.len() {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), body.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        seen.extend(crate::serve::parse_sse(&mut buffer));
    }
    assert_eq!(seen, streamed, "the feed from that position is the run's stream, its end included");
    assert_eq!(seen[0].json()["runId"], run.as_str());
}

#[tokio::test]
async fn two_approvals_answered_in_one_message_continue_the_run_once() {
    const PAIR: &str = "name: pair
model: mock
tools: [day_name, current_date]
approvals: { tools: [day_name, current_date] }
mock:
  script:
    - tool_calls: [{ name: day_name, input: {} }, { name: current_date, input: {} }]
    - text: Both decided.
";
    let dir = agent_dir(&[("agent.yaml", PAIR)]);
    let server = Served::start(dir.path(), "memory", &[]);
    let http = client();
    let url = server.url("/ai-sdk/chat");
    let asking = chunks(http.post(&url).json(&user("u1", "p", "Go.")).send().await.unwrap()).await;
    let requests: Vec<&Value> = asking.iter().filter(|c| c["type"] == "tool-approval-request").collect();
    assert_eq!(requests.len(), 2, "{asking:?}");
    // `useChat` sends the message once every approval has its response: here, one of each.
    let part = |request: &Value, approved: bool| {
        json!({
            "type": "dynamic-tool", "toolName": "t", "toolCallId": request["toolCallId"], "input": {},
            "state": "approval-responded", "approval": { "id": request["approvalId"], "approved": approved },
        })
    };
    let responded = json!({ "id": "p", "messages": [{
        "id": asking[0]["messageId"], "role": "assistant",
        "parts": [{ "type": "step-start" }, part(requests[0], true), part(requests[1], false)],
    }] });
    let continued = chunks(http.post(&url).json(&responded).send().await.unwrap()).await;
    let outcomes: Vec<(&str, &str)> = continued
        .iter()
        .filter(|c| c["toolCallId"].is_string())
        .map(|c| (c["type"].as_str().unwrap(), c["toolCallId"].as_str().unwrap()))
        .collect();
    let (approved, rejected) =
        (requests[0]["toolCallId"].as_str().unwrap(), requests[1]["toolCallId"].as_str().unwrap());
    assert_eq!(outcomes.len(), 2, "{continued:?}");
    assert!(outcomes.contains(&("tool-output-available", approved)), "{outcomes:?}");
    assert!(outcomes.contains(&("tool-output-denied", rejected)), "{outcomes:?}");
    assert!(continued.iter().any(|c| c["delta"] == "decided."), "{continued:?}");
    assert_eq!(continued.last().unwrap()["messageMetadata"]["status"], "finished");
}
