//! The Rust API, used as a library user would.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::StreamExt;
use keel::{Agent, ErrorCode, Event, MockEntry, MockScript, MockToolCall, Part, StopReason, ToolContext};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use crate::support::{agent_dir, repo_root, weekdays_now};

#[derive(Deserialize, JsonSchema)]
struct AddInput {
    a: i64,
    b: i64,
}

fn add_tool() -> Arc<dyn keel::Tool> {
    keel::function_tool("add", "Adds two integers", |input: AddInput| async move {
        Ok::<_, std::convert::Infallible>(input.a + input.b)
    })
}

fn script(entries: Vec<MockEntry>) -> MockScript {
    MockScript::new(entries)
}

fn call(name: &str, input: serde_json::Value) -> MockEntry {
    MockEntry { tool_calls: vec![MockToolCall { name: name.into(), input }], ..MockEntry::default() }
}

fn say(text: &str) -> MockEntry {
    MockEntry { text: Some(text.into()), ..MockEntry::default() }
}

#[tokio::test]
async fn a_builder_agent_calls_a_function_tool_and_streams_events() {
    let agent = Agent::builder()
        .name("calc")
        .model("mock")
        .mock_script(script(vec![
            call("add", json!({"a": 2, "b": 3})),
            say("The sum is {{last_tool_output}}."),
        ]))
        .tool(add_tool())
        .build()
        .unwrap();
    let mut run = agent.run("s1", "2+3?").unwrap();
    let mut text = String::new();
    let mut tool_outputs = Vec::new();
    while let Some(event) = run.next().await {
        match event {
            Event::TextDelta { delta } => text.push_str(&delta),
            Event::ToolDone { output, .. } => tool_outputs.push(output),
            _ => {}
        }
    }
    let result = run.result().await.unwrap();
    assert_eq!(text, "The sum is 5.");
    assert_eq!(result.text, "The sum is 5.");
    assert_eq!(tool_outputs, [json!(5)]);
    assert_eq!(result.stopped, StopReason::Final);
    // The transcript is in the store: user, assistant (call), tool, assistant.
    let messages = agent.store().load_messages(&keel::SessionId::new("s1").unwrap()).await.unwrap();
    assert_eq!(messages.len(), 4);
}

#[tokio::test]
async fn a_loaded_agent_directory_runs_through_the_api() {
    let agent = Agent::load(repo_root().join("examples/assistant")).await.unwrap();
    assert_eq!(agent.definition().name, "assistant");
    let result = agent.run("s", "What day is it?").unwrap().result().await.unwrap();
    assert!(weekdays_now().iter().any(|d| result.text == format!("Today is {d}.")), "{}", result.text);
}

#[tokio::test]
async fn loading_a_bad_spec_returns_every_diagnostic() {
    let dir = agent_dir(&[("agent.yaml", "model: mock\ntools: [nope]\nlimits: { max_turns: -1 }\n")]);
    let error = Agent::load(dir.path()).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::SpecInvalid);
    let keel::LoadError::Spec { diagnostics } = &error else { panic!("{error}") };
    assert_eq!(diagnostics.len(), 2, "{error}");
    let rendered = error.to_string();
    assert!(rendered.contains("agent.yaml:2:9") && rendered.contains("agent.yaml:3:22"), "{rendered}");
}

#[tokio::test]
async fn input_can_be_content_parts_with_bytes() {
    let agent = Agent::builder().model("mock").build().unwrap();
    let parts = vec![
        Part::Text("describe this".into()),
        Part::Image { media_type: "image/png".into(), data: vec![137u8, 80, 78, 71].into() },
    ];
    let result = agent.run("img", parts.clone()).unwrap().result().await.unwrap();
    assert_eq!(result.text, "describe this");
    let messages = agent.store().load_messages(&keel::SessionId::new("img").unwrap()).await.unwrap();
    assert_eq!(messages[0].parts, parts);
}

#[tokio::test]
async fn tools_get_an_idempotency_key() {
    #[derive(Deserialize, JsonSchema)]
    struct Empty {}
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let tool =
        keel::function_tool_with_context("charge", "Charges a card", move |_: Empty, ctx: ToolContext| {
            let log = Arc::clone(&log);
            async move {
                log.lock().unwrap().push(ctx.idempotency_key.clone());
                Ok::<_, String>("charged")
            }
        });
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![call("charge", json!({})), say("ok")]))
        .tool(tool)
        .build()
        .unwrap();
    let result = agent.run("pay", "charge me").unwrap().result().await.unwrap();
    let keys = seen.lock().unwrap().clone();
    assert_eq!(keys, [format!("{}:tool:charge:call_0_0", result.run_id)]);
}

#[tokio::test]
async fn stop_on_tool_and_structured_output() {
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![call("add", json!({"a": 1, "b": 1})), say("never reached")]))
        .tool(add_tool())
        .stop_on_tool("add")
        .build()
        .unwrap();
    let result = agent.run("s", "1+1").unwrap().result().await.unwrap();
    assert_eq!(
        (result.stopped, result.output, result.text.as_str()),
        (StopReason::StopCondition, Some(json!(2)), "2")
    );

    let schema = json!({"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]});
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![say("{\"sum\": 4}")]))
        .output_schema(schema.clone())
        .build()
        .unwrap();
    assert_eq!(agent.run("s", "2+2").unwrap().result().await.unwrap().output, Some(json!({"sum": 4})));
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![say("four")]))
        .output_schema(schema)
        .build()
        .unwrap();
    assert_eq!(agent.run("s", "2+2").unwrap().result().await.unwrap_err().code, ErrorCode::OutputInvalid);
}

#[tokio::test]
async fn invalid_definitions_and_inputs_are_refused_with_codes() {
    let no_model = Agent::builder().build().unwrap_err();
    assert!(no_model.message.contains("no model"), "{}", no_model.message);
    let duplicate = Agent::builder().model("mock").tool(add_tool()).tool(add_tool()).build().unwrap_err();
    assert!(duplicate.message.contains("two tools are named `add`"), "{}", duplicate.message);
    let bad_stop = Agent::builder().model("mock").stop_on_tool("nope").build().unwrap_err();
    assert_eq!(bad_stop.code, ErrorCode::SpecInvalid);
    let bad_schema = Agent::builder().model("mock").output_schema(json!({"type": 5})).build().unwrap_err();
    assert!(bad_schema.message.contains("output schema"), "{}", bad_schema.message);
    let unavailable = Agent::builder().model("acme/model-1").build().unwrap_err();
    assert_eq!(unavailable.code, ErrorCode::ProviderUnavailable);
    assert!(unavailable.message.contains("unknown provider `acme`"), "{}", unavailable.message);

    let agent = Agent::builder().model("mock").build().unwrap();
    assert_eq!(agent.run("bad id!", "hi").unwrap_err().code, ErrorCode::SessionIdInvalid);
}

#[tokio::test]
async fn a_second_input_on_a_busy_session_is_rejected() {
    let slow = MockEntry { delay_ms: 300, text: Some("slow".into()), ..MockEntry::default() };
    let agent = Agent::builder().model("mock").mock_script(script(vec![slow])).build().unwrap();
    let first = agent.run("busy", "one").unwrap();
    assert_eq!(agent.run("busy", "two").unwrap_err().code, ErrorCode::SessionBusy);
    first.result().await.unwrap();
}

#[tokio::test]
async fn a_dropped_handle_does_not_stop_the_run() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    #[derive(Deserialize, JsonSchema)]
    struct Empty {}
    let tool = keel::function_tool("tick", "Counts", move |_: Empty| {
        let counter = Arc::clone(&counter);
        async move { Ok::<_, String>(counter.fetch_add(1, Ordering::SeqCst)) }
    });
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![call("tick", json!({})), say("ok")]))
        .tool(tool)
        .build()
        .unwrap();
    drop(agent.run("bg", "go").unwrap());
    for _ in 0..200 {
        if agent.store().load_messages(&keel::SessionId::new("bg").unwrap()).await.unwrap().len() == 4 {
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("the run stopped when its handle was dropped");
}

#[derive(Deserialize, JsonSchema)]
struct PayInput {
    amount: u64,
}

/// A payment tool that counts its executions; approvals above 100 are asked by predicate.
fn payments(paid: Arc<std::sync::Mutex<Vec<u64>>>) -> Arc<dyn keel::Tool> {
    keel::function_tool("pay", "Pays an amount", move |input: PayInput| {
        let paid = Arc::clone(&paid);
        async move {
            paid.lock().unwrap().push(input.amount);
            Ok::<_, std::convert::Infallible>(format!("paid {}", input.amount))
        }
    })
}

fn calls(list: &[(&str, serde_json::Value)]) -> MockEntry {
    MockEntry {
        tool_calls: list
            .iter()
            .map(|(name, input)| MockToolCall { name: (*name).into(), input: input.clone() })
            .collect(),
        ..MockEntry::default()
    }
}

#[tokio::test]
async fn a_rust_predicate_decides_which_calls_need_approval() {
    let paid = Arc::new(std::sync::Mutex::new(Vec::new()));
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![
            calls(&[("pay", json!({"amount": 20})), ("pay", json!({"amount": 500}))]),
            say("{{last_tool_output}}"),
        ]))
        .tool(payments(Arc::clone(&paid)))
        .require_approval_when("pay", |input| input["amount"].as_u64().is_some_and(|amount| amount > 100))
        .build()
        .unwrap();
    let mut run = agent.run("s", "pay both").unwrap();
    let mut requested = Vec::new();
    while let Some(event) = run.next().await {
        if let Event::ApprovalRequested { approval_id, input, .. } = event {
            requested.push((approval_id, input));
        }
    }
    let paused = run.result().await.unwrap();
    assert_eq!(paused.stopped, StopReason::AwaitingInput);
    assert_eq!(requested.len(), 1, "only the large payment asks: {requested:?}");
    assert_eq!(requested[0].1, json!({"amount": 500}));
    assert_eq!(*paid.lock().unwrap(), [20], "the small payment ran, the large one waits");
    assert_eq!(paused.pending.len(), 1);
    assert_eq!(paused.pending[0].id, requested[0].0);
    assert_eq!(agent.pending(Some("s")).await.unwrap(), paused.pending);

    let result = agent
        .decide(&requested[0].0, keel::Decision::Approve { note: None })
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(result.stopped, StopReason::Final);
    assert_eq!(result.text, "paid 500");
    assert_eq!(*paid.lock().unwrap(), [20, 500]);
    let twice = agent.decide(&requested[0].0, keel::Decision::Approve { note: None }).await.unwrap_err();
    assert_eq!(twice.code, ErrorCode::NotPending);
    assert_eq!(*paid.lock().unwrap(), [20, 500], "a second approval ran the call again");
}

#[tokio::test]
async fn decisions_made_while_the_run_is_still_busy_are_not_lost() {
    // `slow` runs while both approvals are decided: the run applies the decisions when it gets
    // to them, instead of pausing and waiting forever.
    let paid = Arc::new(std::sync::Mutex::new(Vec::new()));
    let slow = keel::function_tool("slow", "Takes a while", |_: serde_json::Value| async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        Ok::<_, std::convert::Infallible>("slept")
    });
    let agent = Agent::builder()
        .model("mock")
        .mock_script(script(vec![
            calls(&[("slow", json!({})), ("pay", json!({"amount": 1})), ("pay", json!({"amount": 2}))]),
            say("done"),
        ]))
        .tool(slow)
        .tool(payments(Arc::clone(&paid)))
        .require_approval("pay")
        .build()
        .unwrap();
    let mut run = agent.run("s", "go").unwrap();
    let mut ids = Vec::new();
    while ids.len() < 2 {
        if let Some(Event::ApprovalRequested { approval_id, .. }) = run.next().await {
            ids.push(approval_id);
        }
    }
    // Decided from "another process" (straight in the store) while `slow` still runs.
    keel::record_decision(agent.store().as_ref(), &ids[1], keel::Decision::Approve { note: None }, "test")
        .await
        .unwrap();
    keel::record_decision(agent.store().as_ref(), &ids[0], keel::Decision::Reject { note: None }, "test")
        .await
        .unwrap();
    let result = run.result().await.unwrap();
    assert_eq!(result.stopped, StopReason::Final, "{result:?}");
    assert_eq!(*paid.lock().unwrap(), [2]);
    assert!(agent.pending(None).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_new_input_replaces_a_paused_run_in_replace_mode_and_is_refused_in_reject_mode() {
    for mode in [keel::Concurrency::Reject, keel::Concurrency::Replace] {
        let paid = Arc::new(std::sync::Mutex::new(Vec::new()));
        let agent = Agent::builder()
            .model("mock")
            .mock_script(script(vec![call("pay", json!({"amount": 9}))]))
            .tool(payments(Arc::clone(&paid)))
            .require_approval("pay")
            .concurrency(mode)
            .build()
            .unwrap();
        let paused = agent.run("s", "pay").unwrap().result().await.unwrap();
        assert_eq!(paused.stopped, StopReason::AwaitingInput);
        let second = agent.run("s", "never mind").unwrap().result().await;
        let messages = agent.store().load_messages(&keel::SessionId::new("s").unwrap()).await.unwrap();
        match mode {
            keel::Concurrency::Reject => {
                let error = second.unwrap_err();
                assert_eq!(error.code, ErrorCode::SessionBusy);
                assert!(error.message.contains("waiting for a human"), "{error}");
                assert_eq!(agent.pending(Some("s")).await.unwrap().len(), 1, "the paused run is intact");
            }
            _ => {
                let result = second.unwrap();
                assert_eq!(result.stopped, StopReason::Final);
                assert!(agent.pending(None).await.unwrap().is_empty(), "the replaced run's approval is gone");
                let run = agent.store().load_run(&paused.run_id).await.unwrap().unwrap();
                assert_eq!(run.state, keel::RunState::Cancelled);
                // The replaced turn is closed: its call has a "cancelled" result before the new input.
                let roles: Vec<keel::Role> = messages.iter().map(|m| m.role).collect();
                use keel::Role::{Assistant, Tool, User};
                assert_eq!(roles, [User, Assistant, Tool, User, Assistant], "{messages:#?}");
            }
        }
        assert!(paid.lock().unwrap().is_empty(), "an unapproved call ran");
    }
}

#[derive(Deserialize, JsonSchema)]
struct CartInput {
    item: String,
}

#[tokio::test]
async fn tools_keep_a_session_state_object_that_survives_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("keel.db");
    // Adds an item to the session's cart; "poison" is refused after staging a change, which
    // must then not stick.
    let cart = || {
        keel::function_tool_with_context(
            "cart",
            "Adds to the cart",
            |input: CartInput, ctx: ToolContext| async move {
                let mut state = ctx.state.get();
                if state.is_null() {
                    state = json!({"items": []});
                }
                state["items"].as_array_mut().unwrap().push(json!(input.item));
                ctx.state.replace(state.clone());
                if input.item == "poison" {
                    return Err("not for sale".to_owned());
                }
                Ok(state["items"].as_array().unwrap().len())
            },
        )
    };
    let agent = |store: Arc<dyn keel::Store>| {
        Agent::builder()
            .model("mock")
            .mock_script(script(vec![
                call("cart", json!({"item": "tea"})),
                say("{{last_tool_output}} items"),
                call("cart", json!({"item": "poison"})),
                say("refused"),
                call("cart", json!({"item": "milk"})),
                say("{{last_tool_output}} items"),
            ]))
            .tool(cart())
            .store(store)
            .build()
            .unwrap()
    };
    let first = agent(Arc::new(keel::SqliteStore::open(&db).unwrap()));
    assert_eq!(first.session_state("s").await.unwrap(), serde_json::Value::Null);
    assert_eq!(first.run("s", "tea").unwrap().result().await.unwrap().text, "1 items");
    assert_eq!(first.run("s", "poison").unwrap().result().await.unwrap().text, "refused");
    assert_eq!(
        first.session_state("s").await.unwrap(),
        json!({"items": ["tea"]}),
        "a failed call changed the state"
    );
    drop(first);

    // Another process, the same file: the state is there and the next call builds on it.
    let second = agent(Arc::new(keel::SqliteStore::open(&db).unwrap()));
    assert_eq!(second.run("s", "milk").unwrap().result().await.unwrap().text, "2 items");
    assert_eq!(second.session_state("s").await.unwrap(), json!({"items": ["tea", "milk"]}));
    assert_eq!(second.session_state("other").await.unwrap(), serde_json::Value::Null, "state is per session");
}

/// The context of call `call` of a parent run, as the engine gives it to a subagent tool.
fn parent_call(call: &str) -> ToolContext {
    ToolContext {
        run_id: keel::RunId::from_suffix("parent"),
        session_id: keel::SessionId::new("s").unwrap(),
        call_id: call.into(),
        idempotency_key: "k".into(),
        state: keel::SessionState::new(serde_json::Value::Null),
    }
}

#[tokio::test]
async fn a_replayed_subagent_call_finds_its_child_run_instead_of_running_it_again() {
    #[derive(Deserialize, JsonSchema)]
    struct Empty {}
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let count = keel::function_tool("count", "Counts", move |_: Empty| {
        let counter = Arc::clone(&counter);
        async move { Ok::<_, String>(counter.fetch_add(1, Ordering::SeqCst) + 1) }
    });
    let store: Arc<dyn keel::Store> = Arc::new(keel::MemoryStore::new());
    let child = Agent::builder()
        .name("helper")
        .model("mock")
        .mock_script(script(vec![call("count", json!({})), say("counted")]))
        .tool(count)
        .store(Arc::clone(&store))
        .build()
        .unwrap();
    let tool = keel::SubagentTool::new("helper", Some("Counts things."), child.engine().clone());
    let ctx = parent_call;
    use keel::Tool as _;
    assert_eq!(tool.call(json!({"input": "count"}), &ctx("c1")).await.unwrap(), json!("counted"));
    // The same call again, as a replay would make it: the child's run is found, not repeated.
    assert_eq!(tool.call(json!({"input": "count"}), &ctx("c1")).await.unwrap(), json!("counted"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Another call is another child run.
    tool.call(json!({"input": "count"}), &ctx("c2")).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let sessions = store.list_sessions(keel_core::SessionFilter::default()).await.unwrap();
    assert_eq!(sessions.iter().filter(|s| s.id.as_str().starts_with("sub-helper-")).count(), 2);
}

#[tokio::test]
async fn a_subagent_reports_a_turn_cap_is_stopped_by_its_budget_and_replays_its_structured_output() {
    #[derive(Deserialize, JsonSchema)]
    struct Empty {}
    let store: Arc<dyn keel::Store> = Arc::new(keel::MemoryStore::new());
    let ctx = parent_call;
    use keel::Tool as _;

    // Structured output, the first time and when the call is replayed.
    let counter = Agent::builder()
        .name("counter")
        .model("mock")
        .output_schema(
            json!({"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}),
        )
        .mock_script(script(vec![say(r#"{"count": 3}"#)]))
        .store(Arc::clone(&store))
        .build()
        .unwrap();
    let tool = keel::SubagentTool::new("counter", None, counter.engine().clone());
    assert_eq!(tool.call(json!({"input": "count"}), &ctx("c1")).await.unwrap(), json!({"count": 3}));
    assert_eq!(tool.call(json!({"input": "count"}), &ctx("c1")).await.unwrap(), json!({"count": 3}));

    // Stopped at its turn cap: the parent hears it, with what the child had.
    let noop = keel::function_tool("noop", "Does nothing", |_: Empty| async { Ok::<_, String>("ok") });
    let capped = Agent::builder()
        .name("looper")
        .model("mock")
        .limits(keel::Limits { max_turns: 1, ..keel::Limits::default() })
        .mock_script(script(vec![call("noop", json!({})), say("never reached")]))
        .tool(noop)
        .store(Arc::clone(&store))
        .build()
        .unwrap();
    let tool = keel::SubagentTool::new("looper", None, capped.engine().clone());
    let error = tool.call(json!({"input": "loop"}), &ctx("c2")).await.unwrap_err();
    assert!(
        error.message.contains("subagent `looper` stopped at its turn cap (1 model calls"),
        "{}",
        error.message
    );

    // Past its budget the child is cancelled, and the parent is told so.
    let hang = keel::function_tool("hang", "Takes forever", |_: Empty| async {
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        Ok::<_, String>("late")
    });
    let slow = Agent::builder()
        .name("slow")
        .model("mock")
        .mock_script(script(vec![call("hang", json!({})), say("done")]))
        .tool(hang)
        .store(Arc::clone(&store))
        .build()
        .unwrap();
    let tool = keel::SubagentTool::new("slow", None, slow.engine().clone())
        .with_budget(std::time::Duration::from_millis(800));
    let started = std::time::Instant::now();
    let error = tool.call(json!({"input": "wait"}), &ctx("c3")).await.unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(error.code, ErrorCode::ToolTimeout, "{error:?}");
    assert!(
        error.message.contains("used its time budget") && error.message.contains("its run was cancelled"),
        "{}",
        error.message
    );
    let child = keel::RunId::child_run(&keel::RunId::from_suffix("parent"), "c3", "slow");
    let record = store.load_run(&child).await.unwrap().expect("the child's run");
    assert_eq!(record.state, keel::RunState::Cancelled);

    // A call dropped midway (the parent's own timeout) cancels its child as well.
    let tool = keel::SubagentTool::new("slow", None, slow.engine().clone());
    let context = ctx("c4");
    assert!(
        tokio::time::timeout(
            std::time::Duration::from_millis(300),
            tool.call(json!({"input": "wait"}), &context)
        )
        .await
        .is_err()
    );
    let child = keel::RunId::child_run(&keel::RunId::from_suffix("parent"), "c4", "slow");
    let mut state = None;
    for _ in 0..50 {
        state = store.load_run(&child).await.unwrap().map(|r| r.state);
        if state == Some(keel::RunState::Cancelled) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(state, Some(keel::RunState::Cancelled), "the child ran on after its call was dropped");
}

#[tokio::test]
async fn an_agent_with_mcp_servers_is_built_async_and_build_says_so() {
    let server = keel::mcp::McpServerDef::stdio(
        "odd",
        vec![
            "python3".into(),
            repo_root().join("tests/peers/raw_mcp_server.py").display().to_string(),
            "lookup".into(),
        ],
    );
    let refused = Agent::builder().model("mock").mcp(server.clone()).build().unwrap_err();
    assert_eq!(refused.code, ErrorCode::SpecInvalid);
    assert!(refused.message.contains("build it with `.build_async().await`"), "{}", refused.message);
    let agent = Agent::builder()
        .model("mock")
        .mcp(server)
        .require_approval("odd_lookup")
        .build_async()
        .await
        .unwrap();
    let names: Vec<String> = agent.definition().tools.names().map(str::to_owned).collect();
    assert_eq!(names, ["odd_lookup"]);
    assert!(agent.definition().tools.needs_approval("odd_lookup", &serde_json::json!({})));
}
