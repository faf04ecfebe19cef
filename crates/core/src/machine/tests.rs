//! State machine tests: feed inputs, assert the actions (rendered as text snapshots).

use std::fmt::Write as _;
use std::sync::Arc;

use expect_test::{Expect, expect};
use serde_json::{Value, json};

use super::*;
use crate::BoxFuture;
use crate::agent::{Limits, OutputSchema, RetryPolicy, ToolChoice};
use crate::loop_control::Compaction;
use crate::memory::{Episodic, GraphSettings, MemoryRequest, MemorySettings};
use crate::persist::encode_message;
use crate::provider::{ModelReply, ProviderErrorKind};
use crate::tool::{Tool, ToolContext, ToolSet, ToolSpec};
use crate::wire::event_to_json;

/// A tool the machine only needs the spec of: the machine never calls tools itself.
struct SpecOnly(ToolSpec);

impl Tool for SpecOnly {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    fn call<'a>(&'a self, _: Value, _: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        unreachable!("the state machine never calls a tool")
    }
}

fn add_tool() -> Arc<dyn Tool> {
    Arc::new(SpecOnly(ToolSpec {
        name: "add".into(),
        description: "Adds two numbers".into(),
        input_schema: json!({
            "type": "object",
            "properties": { "a": { "type": "number" }, "b": { "type": "number" } },
            "required": ["a", "b"]
        }),
    }))
}

fn echo_tool() -> Arc<dyn Tool> {
    Arc::new(SpecOnly(ToolSpec {
        name: "echo".into(),
        description: "Echoes".into(),
        input_schema: json!({ "type": "object" }),
    }))
}

fn agent(edit: impl FnOnce(&mut AgentDef)) -> Arc<AgentDef> {
    let mut def = AgentDef {
        name: "test".into(),
        description: None,
        instructions: "Be brief.".into(),
        model: "mock".into(),
        tools: ToolSet::new(vec![add_tool(), echo_tool()]).unwrap(),
        limits: Limits::default(),
        retry: RetryPolicy::default(),
        output_schema: None,
        stop_on_tools: Vec::new(),
        concurrency: crate::agent::Concurrency::Reject,
        approval_timeout: AgentDef::DEFAULT_APPROVAL_TIMEOUT,
        schedules: Vec::new(),
        channels: Vec::new(),
        loop_control: Default::default(),
        memory: Default::default(),
        initial_state: None,
    };
    edit(&mut def);
    Arc::new(def)
}

fn machine(agent: Arc<AgentDef>) -> Machine {
    Machine::new(
        agent,
        RunId::from_suffix("1"),
        SessionId::new("s1").unwrap(),
        vec![Arc::new(Message::user("earlier")), Arc::new(Message::assistant("ok"))],
        Arc::new(Message::user("What is 2+3?")),
        1,
    )
}

fn text(t: &str, tokens: u64) -> Input {
    Input::ModelReply(
        ModelReply {
            parts: vec![Part::Text(t.into())],
            usage: Usage { input_tokens: tokens, output_tokens: 1 },
        }
        .into(),
    )
}

fn calls(list: &[(&str, &str, Value)]) -> Input {
    Input::ModelReply(
        ModelReply {
            parts: list
                .iter()
                .map(|(id, name, input)| {
                    Part::ToolCall(ToolCall {
                        call_id: (*id).into(),
                        name: (*name).into(),
                        input: input.clone(),
                    })
                })
                .collect(),
            usage: Usage { input_tokens: 10, output_tokens: 5 },
        }
        .into(),
    )
}

fn done(call_id: &str, outcome: ToolOutcome) -> Input {
    Input::ToolDone { call_id: call_id.into(), outcome, duration: None }
}

/// Feeds the inputs and renders every action; persisted messages are shown in their stored form.
fn check(machine: Machine, inputs: Vec<Input>, expected: Expect) {
    expected.assert_eq(&render(machine, inputs));
}

fn render(mut machine: Machine, inputs: Vec<Input>) -> String {
    let mut out = String::new();
    for input in inputs {
        let label = match &input {
            Input::Start => "start".to_owned(),
            Input::ModelReply(_) => "model reply".to_owned(),
            Input::ModelFailed(e) => format!("model failed: {e}"),
            Input::ToolDone { call_id, .. } => format!("tool done {call_id}"),
            Input::Decision { call_id, decision } => format!("decision {call_id} {decision:?}"),
            Input::MemoryDone(outcome) => format!("memory done {outcome:?}"),
            Input::Cancel => "cancel".to_owned(),
            Input::Abort(failure) => format!("abort: {failure}"),
        };
        writeln!(out, "> {label}").unwrap();
        for action in machine.step(input) {
            match action {
                Action::Emit(event) => writeln!(out, "  emit {}", event_to_json(&event)),
                Action::Persist { first_position, count } => {
                    for (i, m) in
                        machine.transcript()[first_position..first_position + count].iter().enumerate()
                    {
                        writeln!(out, "  persist #{} {}", first_position + i, encode_message(m)).unwrap();
                    }
                    Ok(())
                }
                Action::CallModel { step } => {
                    let request = machine.model_request(1);
                    writeln!(
                        out,
                        "  call model {step} (call_index {}, {} messages)",
                        request.call_index,
                        request.messages.len()
                    )
                }
                Action::CallTool { step, call } => writeln!(out, "  call tool {step} {}", call.input),
                Action::AwaitHuman { step, id, call_id, kind } => {
                    writeln!(out, "  await human {step} {id} {call_id} {kind:?}")
                }
                Action::Memory { step, request } => {
                    writeln!(out, "  memory {step} {}", render_memory(&request))
                }
                Action::Finish(outcome) => writeln!(out, "  finish {outcome:?}"),
            }
            .unwrap();
        }
    }
    out
}

/// The tool loop: the model calls `add(2, 3)`, the tool answers 5, the model says "5".
fn tool_loop() -> Vec<Input> {
    vec![
        Input::Start,
        calls(&[("c1", "add", json!({"a": 2, "b": 3}))]),
        done("c1", Ok(json!(5))),
        text("5", 20),
    ]
}

/// A muted machine (nobody listens to the run's events) builds no event, and does everything
/// else exactly as an unmuted one: the same steps, messages, calls and outcome.
#[test]
fn a_muted_machine_emits_nothing_and_does_the_same_work() {
    let scenarios: Vec<fn() -> Vec<Input>> = vec![
        tool_loop,
        || {
            vec![
                Input::Start,
                calls(&[
                    ("", "add", json!({"a": 1, "b": 1})),
                    ("", "add", json!({"a": "x"})),
                    ("d", "nope", json!({})),
                ]),
                done("call_1_0", Err(ToolError::failed("disk full"))),
                Input::Cancel,
            ]
        },
        || vec![Input::Start, Input::ModelFailed(ProviderError::new(ProviderErrorKind::Auth, "bad key"))],
    ];
    for scenario in scenarios {
        let heard = render(machine(agent(|_| {})), scenario());
        let mut muted = machine(agent(|_| {}));
        muted.mute_events(true);
        let unheard = render(muted, scenario());
        assert!(!unheard.contains("emit "), "a muted machine built an event:\n{unheard}");
        let without_events: String = heard
            .lines()
            .filter(|line| !line.trim_start().starts_with("emit "))
            .map(|line| format!("{line}\n"))
            .collect();
        assert!(heard.contains("emit "), "the unmuted machine built no event:\n{heard}");
        assert_eq!(unheard, without_events);
    }
}

#[test]
fn step_into_appends_the_actions_step_returns() {
    let mut returning = machine(agent(|_| {}));
    let mut appending = machine(agent(|_| {}));
    // Never emptied: each step's actions must come after the ones already there.
    let mut kept = Vec::new();
    for (input, same) in tool_loop().into_iter().zip(tool_loop()) {
        let returned = returning.step(input);
        let before = kept.len();
        appending.step_into(same, &mut kept);
        assert_eq!(format!("{:?}", &kept[before..]), format!("{returned:?}"));
    }
    assert!(kept.iter().any(|action| matches!(action, Action::Finish(_))), "{kept:?}");
}

#[test]
fn tool_loop_then_final_answer() {
    check(
        machine(agent(|_| {})),
        tool_loop(),
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"add","input":{"a":2,"b":3}}]}
              emit {"type":"tool.start","callId":"c1","name":"add","input":{"a":2,"b":3}}
              call tool tool:add:c1 {"a":2,"b":3}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":5}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"add","output":5,"is_error":false}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
            > model reply
              emit {"type":"usage","inputTokens":20,"outputTokens":1}
              persist #5 {"v":1,"role":"assistant","parts":[{"type":"text","text":"5"}]}
              emit {"type":"run.done","text":"5","stopped":"final","usage":{"inputTokens":30,"outputTokens":6}}
              finish Done { text: "5", output: None, stopped: Final, usage: Usage { input_tokens: 30, output_tokens: 6 } }
        "#]],
    );
}

#[test]
fn parallel_calls_keep_call_order_and_bad_calls_become_error_results() {
    check(
        machine(agent(|_| {})),
        vec![
            Input::Start,
            calls(&[
                ("", "add", json!({"a": 1, "b": 1})),
                ("", "add", json!({"a": "x"})),
                ("dup", "nope", json!({})),
                ("dup", "echo", json!({"n": 4})),
            ]),
            // Results arrive out of order; the tool message keeps call order.
            done("call_1_3", Ok(json!({"n": 4}))),
            done("call_1_0", Err(ToolError::failed("disk full"))),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"call_1_0","name":"add","input":{"a":1,"b":1}},{"type":"tool_call","call_id":"call_1_1","name":"add","input":{"a":"x"}},{"type":"tool_call","call_id":"dup","name":"nope","input":{}},{"type":"tool_call","call_id":"call_1_3","name":"echo","input":{"n":4}}]}
              emit {"type":"tool.start","callId":"call_1_0","name":"add","input":{"a":1,"b":1}}
              call tool tool:add:call_1_0 {"a":1,"b":1}
              emit {"type":"tool.start","callId":"call_1_1","name":"add","input":{"a":"x"}}
              emit {"type":"tool.error","callId":"call_1_1","code":"KEEL_TOOL_INPUT_INVALID","error":"invalid input for `add`: \"b\" is a required property; /a: \"x\" is not of type \"number\""}
              emit {"type":"tool.start","callId":"dup","name":"nope","input":{}}
              emit {"type":"tool.error","callId":"dup","code":"KEEL_TOOL_NOT_FOUND","error":"unknown tool `nope`; available tools: add, echo"}
              emit {"type":"tool.start","callId":"call_1_3","name":"echo","input":{"n":4}}
              call tool tool:echo:call_1_3 {"n":4}
            > tool done call_1_3
              emit {"type":"tool.done","callId":"call_1_3","output":{"n":4}}
            > tool done call_1_0
              emit {"type":"tool.error","callId":"call_1_0","code":"KEEL_TOOL_FAILED","error":"disk full"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"call_1_0","name":"add","output":"disk full","is_error":true},{"type":"tool_result","call_id":"call_1_1","name":"add","output":"invalid input for `add`: \"b\" is a required property; /a: \"x\" is not of type \"number\"","is_error":true},{"type":"tool_result","call_id":"dup","name":"nope","output":"unknown tool `nope`; available tools: add, echo","is_error":true},{"type":"tool_result","call_id":"call_1_3","name":"echo","output":{"n":4},"is_error":false}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
        "#]],
    );
}

#[test]
fn max_turns_stops_with_the_last_text() {
    check(
        machine(agent(|a| a.limits.max_turns = 1)),
        vec![Input::Start, calls(&[("c1", "echo", json!({}))]), done("c1", Ok(json!("x")))],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              call tool tool:echo:c1 {}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":"x"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":"x","is_error":false}]}
              emit {"type":"run.done","text":"","stopped":"max_turns","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "", output: None, stopped: MaxTurns, usage: Usage { input_tokens: 10, output_tokens: 5 } }
        "#]],
    );
}

#[test]
fn token_budget_is_checked_before_the_next_model_call() {
    check(
        machine(agent(|a| a.limits.max_total_tokens = Some(15))),
        vec![Input::Start, calls(&[("c1", "echo", json!({}))]), done("c1", Ok(json!(1)))],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              call tool tool:echo:c1 {}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":1}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":1,"is_error":false}]}
              emit {"type":"run.done","text":"","stopped":"budget","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "", output: None, stopped: Budget, usage: Usage { input_tokens: 10, output_tokens: 5 } }
        "#]],
    );
}

#[test]
fn tool_call_budget_refuses_calls_over_the_limit() {
    check(
        machine(agent(|a| a.limits.max_tool_calls = Some(1))),
        vec![
            Input::Start,
            calls(&[("c1", "echo", json!({})), ("c2", "echo", json!({}))]),
            done("c1", Ok(json!(1))),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}},{"type":"tool_call","call_id":"c2","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              call tool tool:echo:c1 {}
              emit {"type":"tool.start","callId":"c2","name":"echo","input":{}}
              emit {"type":"tool.error","callId":"c2","code":"KEEL_TOOL_BUDGET_EXHAUSTED","error":"not run: this run already made 1 tool calls, its limit (`limits.max_tool_calls`)"}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":1}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":1,"is_error":false},{"type":"tool_result","call_id":"c2","name":"echo","output":"not run: this run already made 1 tool calls, its limit (`limits.max_tool_calls`)","is_error":true}]}
              emit {"type":"run.done","text":"","stopped":"budget","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "", output: None, stopped: Budget, usage: Usage { input_tokens: 10, output_tokens: 5 } }
        "#]],
    );
}

#[test]
fn long_outputs_are_cut_with_a_marker() {
    let mut m = machine(agent(|a| a.limits.max_tool_output_chars = 5));
    m.step(Input::Start);
    m.step(calls(&[("c1", "echo", json!({}))]));
    let actions = m.step(done("c1", Ok(json!("héllo wörld"))));
    let Action::Emit(Event::ToolDone { output, .. }) = &actions[0] else { panic!("{actions:?}") };
    assert_eq!(output, &json!("héllo\n[output truncated: showing the first 5 of 11 characters]"));
    // Short outputs, and JSON values that fit, are untouched.
    assert_eq!(cap_output(json!({"a": 1}), 7), json!({"a": 1}));
    assert_eq!(
        cap_output(json!({"a": 1}), 6),
        json!("{\"a\":1\n[output truncated: showing the first 6 of 7 characters]")
    );
    // Characters, not bytes: `{"é":"ü"}` is 9 characters in 11 bytes.
    assert_eq!(cap_output(json!({"é": "ü"}), 9), json!({"é": "ü"}));
    assert_eq!(
        cap_output(json!({"é": "ü"}), 8),
        json!("{\"é\":\"ü\"\n[output truncated: showing the first 8 of 9 characters]")
    );
    // An image a tool returned is not text the model reads: its data does not count.
    let image = json!([{ "type": "text", "text": "chart" }, { "type": "image", "mimeType": "image/png", "data": "A".repeat(10_000) }]);
    assert_eq!(cap_output(image.clone(), 200), image);
    // The text beside it still does.
    let long = json!([{ "type": "text", "text": "x".repeat(300) }, { "type": "image", "mimeType": "image/png", "data": "AAAA" }]);
    assert!(cap_output(long, 200).as_str().unwrap().contains("[output truncated"));
}

#[test]
fn stop_condition_tool_ends_the_run_with_its_output() {
    check(
        machine(agent(|a| a.stop_on_tools = vec!["echo".into()])),
        vec![Input::Start, calls(&[("c1", "echo", json!({"x": 1}))]), done("c1", Ok(json!({"x": 1})))],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{"x":1}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{"x":1}}
              call tool tool:echo:c1 {"x":1}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":{"x":1}}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":{"x":1},"is_error":false}]}
              emit {"type":"run.done","text":"{\"x\":1}","output":{"x":1},"stopped":"stop_condition","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "{\"x\":1}", output: Some(Object {"x": Number(1)}), stopped: StopCondition, usage: Usage { input_tokens: 10, output_tokens: 5 } }
        "#]],
    );
}

#[test]
fn cancel_during_tools_answers_every_call() {
    check(
        machine(agent(|_| {})),
        vec![
            Input::Start,
            calls(&[("c1", "echo", json!({})), ("c2", "echo", json!({}))]),
            done("c2", Ok(json!("fast"))),
            Input::Cancel,
            text("ignored after the end", 1),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}},{"type":"tool_call","call_id":"c2","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              call tool tool:echo:c1 {}
              emit {"type":"tool.start","callId":"c2","name":"echo","input":{}}
              call tool tool:echo:c2 {}
            > tool done c2
              emit {"type":"tool.done","callId":"c2","output":"fast"}
            > cancel
              emit {"type":"tool.error","callId":"c1","code":"KEEL_TOOL_CANCELLED","error":"cancelled: the run was cancelled before this call finished"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":"cancelled: the run was cancelled before this call finished","is_error":true},{"type":"tool_result","call_id":"c2","name":"echo","output":"fast","is_error":false}]}
              emit {"type":"run.done","text":"","stopped":"cancelled","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "", output: None, stopped: Cancelled, usage: Usage { input_tokens: 10, output_tokens: 5 } }
            > model reply
        "#]],
    );
}

#[test]
fn provider_failure_fails_the_run_with_its_code() {
    let error = ProviderError::new(ProviderErrorKind::RateLimited, "slow down");
    check(
        machine(agent(|_| {})),
        vec![Input::Start, Input::ModelFailed(error)],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model failed: slow down
              emit {"type":"run.error","code":"KEEL_PROVIDER_RATE_LIMITED","message":"the model call failed: slow down"}
              finish Failed(RunFailure { code: ProviderRateLimited, message: "the model call failed: slow down" })
        "#]],
    );
}

#[test]
fn structured_output_is_parsed_and_checked() {
    let schema = answer_schema;
    let mut m = machine(agent(|a| a.output_schema = Some(schema())));
    m.step(Input::Start);
    let actions = m.step(text("```json\n{\"answer\": \"5\"}\n```", 1));
    assert!(
        matches!(actions.last(), Some(Action::Finish(RunOutcome::Done { output: Some(o), .. })) if o == &json!({"answer": "5"})),
        "{actions:?}"
    );

    let mut m = machine(agent(|a| {
        a.output_schema = Some(schema());
        a.loop_control.max_repairs = 0;
    }));
    m.step(Input::Start);
    let actions = m.step(text("{\"answer\": 5}", 1));
    let Some(Action::Finish(RunOutcome::Failed(failure))) = actions.last() else { panic!("{actions:?}") };
    assert_eq!(failure.code, ErrorCode::OutputInvalid);
    assert!(failure.message.contains("/answer"), "{}", failure.message);
}

fn answer_schema() -> OutputSchema {
    OutputSchema::new(json!({
        "type": "object", "properties": { "answer": { "type": "string" } }, "required": ["answer"]
    }))
    .unwrap()
}

#[test]
fn an_answer_that_does_not_match_the_schema_gets_a_repair_turn_that_shows_the_error() {
    check(
        machine(agent(|a| a.output_schema = Some(answer_schema()))),
        vec![Input::Start, text("{\"answer\": 5}", 10), text("{\"answer\": \"5\"}", 20)],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":1}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"text","text":"{\"answer\": 5}"}]}
              emit {"type":"output.repair","attempt":1,"problem":"5 is not of type \"string\" at `/answer`"}
              persist #4 {"v":1,"role":"user","parts":[{"type":"text","text":"Your answer does not match the required output schema: 5 is not of type \"string\" at `/answer`. Reply again with only the JSON value, matching this schema:\n{\"properties\":{\"answer\":{\"type\":\"string\"}},\"required\":[\"answer\"],\"type\":\"object\"}"}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
            > model reply
              emit {"type":"usage","inputTokens":20,"outputTokens":1}
              persist #5 {"v":1,"role":"assistant","parts":[{"type":"text","text":"{\"answer\": \"5\"}"}]}
              emit {"type":"run.done","text":"{\"answer\": \"5\"}","output":{"answer":"5"},"stopped":"final","usage":{"inputTokens":30,"outputTokens":2}}
              finish Done { text: "{\"answer\": \"5\"}", output: Some(Object {"answer": String("5")}), stopped: Final, usage: Usage { input_tokens: 30, output_tokens: 2 } }
        "#]],
    );
}

#[test]
fn repairs_run_out_and_then_the_run_fails_saying_how_many_it_had() {
    let mut m = machine(agent(|a| {
        a.output_schema = Some(answer_schema());
        a.loop_control.max_repairs = 2;
    }));
    m.step(Input::Start);
    for _ in 0..2 {
        let actions = m.step(text("not json", 1));
        assert!(matches!(actions.last(), Some(Action::CallModel { .. })), "{actions:?}");
    }
    let actions = m.step(text("still not json", 1));
    let Some(Action::Finish(RunOutcome::Failed(failure))) = actions.last() else { panic!("{actions:?}") };
    assert_eq!(failure.code, ErrorCode::OutputInvalid);
    assert!(failure.message.contains("after 2 repair turns"), "{}", failure.message);
}

#[test]
fn a_repair_turn_is_not_made_past_max_turns() {
    let mut m = machine(agent(|a| {
        a.output_schema = Some(answer_schema());
        a.limits.max_turns = 1;
    }));
    m.step(Input::Start);
    let actions = m.step(text("nope", 1));
    let Some(Action::Finish(RunOutcome::Failed(failure))) = actions.last() else { panic!("{actions:?}") };
    assert_eq!(failure.code, ErrorCode::OutputInvalid);
}

#[test]
fn inputs_out_of_phase_fail_loudly_instead_of_corrupting_state() {
    let mut m = machine(agent(|_| {}));
    m.step(Input::Start);
    let actions = m.step(done("c9", Ok(json!(1))));
    let Some(Action::Finish(RunOutcome::Failed(failure))) = actions.last() else { panic!("{actions:?}") };
    assert_eq!(failure.code, ErrorCode::Internal);
    assert!(m.is_finished());
}

#[test]
fn replaying_the_same_inputs_gives_the_same_actions() {
    let inputs = || {
        vec![
            Input::Start,
            calls(&[("", "add", json!({"a": 2, "b": 3})), ("", "echo", json!({}))]),
            done("call_1_1", Ok(json!({}))),
            done("call_1_0", Ok(json!(5))),
            text("5", 3),
        ]
    };
    let run = || {
        let mut m = machine(agent(|_| {}));
        let actions: Vec<Action> = inputs().into_iter().flat_map(|i| m.step(i)).collect();
        (actions, m.transcript().to_vec())
    };
    assert_eq!(run(), run());
}

#[test]
fn call_ids_reused_across_turns_are_made_unique() {
    let mut m = machine(agent(|_| {}));
    m.step(Input::Start);
    let first = m.step(calls(&[("call_1", "echo", json!({}))]));
    assert!(
        first
            .iter()
            .any(|a| matches!(a, Action::CallTool { step, .. } if step.to_string() == "tool:echo:call_1"))
    );
    m.step(done("call_1", Ok(json!(1))));
    // The model reuses `call_1`: the step must not collide with the journaled one.
    // And the second call's fallback id (`call_2_1`) is taken by the first: it gets a suffix.
    let second = m.step(calls(&[("call_2_1", "echo", json!({})), ("call_1", "echo", json!({}))]));
    let steps: Vec<String> = second
        .iter()
        .filter_map(|a| if let Action::CallTool { step, .. } = a { Some(step.to_string()) } else { None })
        .collect();
    assert_eq!(steps, ["tool:echo:call_2_1", "tool:echo:call_2_1_"]);
}

#[test]
fn a_reply_kept_as_written_is_shared_with_its_journal_entry_and_one_the_run_changes_is_copied() {
    let mut m = machine(agent(|_| {}));
    m.step(Input::Start);
    let Input::ModelReply(kept) = calls(&[("call_1", "echo", json!({}))]) else { unreachable!() };
    m.step(Input::ModelReply(kept.clone()));
    assert!(Arc::ptr_eq(&kept.message, m.transcript().last().unwrap()));
    m.step(done("call_1", Ok(json!(1))));
    // The id is reused: the transcript gets a fresh one, and the journaled reply still says what
    // the model wrote (a replay gives it the same fresh id again).
    let Input::ModelReply(changed) = calls(&[("call_1", "echo", json!({}))]) else { unreachable!() };
    m.step(Input::ModelReply(changed.clone()));
    let written = m.transcript().last().unwrap();
    assert!(!Arc::ptr_eq(&changed.message, written));
    let id = |message: &Message| message.tool_calls().next().unwrap().call_id.clone();
    assert_eq!((id(&changed.message), id(written)), ("call_1".to_owned(), "call_2_0".to_owned()));
}

#[test]
fn a_run_cancelled_before_any_reply_has_no_text_from_earlier_runs() {
    let mut m = machine(agent(|_| {}));
    m.step(Input::Start);
    let actions = m.step(Input::Cancel);
    let Some(Action::Finish(RunOutcome::Done { text, stopped, .. })) = actions.last() else {
        panic!("{actions:?}")
    };
    // The history's last assistant message ("ok") belongs to an earlier run.
    assert_eq!((text.as_str(), *stopped), ("", StopReason::Cancelled));
}

/// The built-in question tool, as far as the machine can tell.
struct Question(ToolSpec);

impl Tool for Question {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    fn call<'a>(&'a self, _: Value, _: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        unreachable!("questions are answered, not called")
    }
    fn asks_human(&self) -> bool {
        true
    }
}

fn decide(call_id: &str, decision: Decision) -> Input {
    Input::Decision { call_id: call_id.into(), decision }
}

#[test]
fn parallel_approvals_are_routed_by_call_and_a_rejection_is_a_result() {
    let agent = agent(|def| {
        def.tools.require_approval("echo", crate::tool::ApprovalRule::Always).unwrap();
        let big = |input: &Value| input["a"].as_f64().is_some_and(|a| a > 100.0);
        def.tools.require_approval("add", crate::tool::ApprovalRule::When(Arc::new(big))).unwrap();
    });
    check(
        machine(agent),
        vec![
            Input::Start,
            calls(&[
                ("c1", "add", json!({"a": 1, "b": 1})),
                ("c2", "echo", json!({"n": 2})),
                ("c3", "add", json!({"a": 500, "b": 1})),
            ]),
            // Decisions come in any order, interleaved with the free call's result.
            decide("c3", Decision::Reject { note: Some("too big".into()) }),
            done("c1", Ok(json!(2))),
            decide("c2", Decision::Approve { note: None }),
            done("c2", Ok(json!({"n": 2}))),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"add","input":{"a":1,"b":1}},{"type":"tool_call","call_id":"c2","name":"echo","input":{"n":2}},{"type":"tool_call","call_id":"c3","name":"add","input":{"a":500,"b":1}}]}
              emit {"type":"tool.start","callId":"c1","name":"add","input":{"a":1,"b":1}}
              call tool tool:add:c1 {"a":1,"b":1}
              emit {"type":"tool.start","callId":"c2","name":"echo","input":{"n":2}}
              await human approval:c2 ap_7b514529d26d3b46 c2 Approval { tool: "echo", input: Object {"n": Number(2)} }
              emit {"type":"tool.start","callId":"c3","name":"add","input":{"a":500,"b":1}}
              await human approval:c3 ap_d835c43eb5415e7c c3 Approval { tool: "add", input: Object {"a": Number(500), "b": Number(1)} }
            > decision c3 Reject { note: Some("too big") }
              emit {"type":"tool.error","callId":"c3","code":"KEEL_TOOL_REJECTED","error":"not run: the user rejected this call: too big"}
            > tool done c1
              emit {"type":"tool.done","callId":"c1","output":2}
            > decision c2 Approve { note: None }
              call tool tool:echo:c2 {"n":2}
            > tool done c2
              emit {"type":"tool.done","callId":"c2","output":{"n":2}}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"add","output":2,"is_error":false},{"type":"tool_result","call_id":"c2","name":"echo","output":{"n":2},"is_error":false},{"type":"tool_result","call_id":"c3","name":"add","output":"not run: the user rejected this call: too big","is_error":true}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
        "#]],
    );
}

#[test]
fn a_question_is_answered_by_the_human_and_timeouts_are_results() {
    let ask: Arc<dyn Tool> = Arc::new(Question(ToolSpec {
        name: "ask_question".into(),
        description: "Asks".into(),
        input_schema: json!({"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}),
    }));
    let agent = agent(|def| {
        def.tools = ToolSet::new(vec![add_tool(), ask]).unwrap();
        def.tools.require_approval("add", crate::tool::ApprovalRule::Always).unwrap();
        def.approval_timeout = std::time::Duration::from_secs(3600);
    });
    check(
        machine(agent),
        vec![
            Input::Start,
            calls(&[
                ("q1", "ask_question", json!({"question": "Which city?"})),
                ("c2", "add", json!({"a": 1, "b": 2})),
            ]),
            decide("q1", Decision::Answer("Paris".into())),
            decide("c2", Decision::TimedOut),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"q1","name":"ask_question","input":{"question":"Which city?"}},{"type":"tool_call","call_id":"c2","name":"add","input":{"a":1,"b":2}}]}
              emit {"type":"tool.start","callId":"q1","name":"ask_question","input":{"question":"Which city?"}}
              await human question:q1 qu_aa3189b8275505ec q1 Question { question: "Which city?" }
              emit {"type":"tool.start","callId":"c2","name":"add","input":{"a":1,"b":2}}
              await human approval:c2 ap_7b514529d26d3b46 c2 Approval { tool: "add", input: Object {"a": Number(1), "b": Number(2)} }
            > decision q1 Answer("Paris")
              emit {"type":"tool.done","callId":"q1","output":"Paris"}
            > decision c2 TimedOut
              emit {"type":"tool.error","callId":"c2","code":"KEEL_TOOL_REJECTED","error":"not run: approval timed out (nobody approved this call within 1h)"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"q1","name":"ask_question","output":"Paris","is_error":false},{"type":"tool_result","call_id":"c2","name":"add","output":"not run: approval timed out (nobody approved this call within 1h)","is_error":true}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
        "#]],
    );
}

#[test]
fn cancelling_a_paused_run_gives_the_waiting_calls_results() {
    let agent = agent(|def| def.tools.require_approval("echo", crate::tool::ApprovalRule::Always).unwrap());
    check(
        machine(agent),
        vec![Input::Start, calls(&[("c1", "echo", json!({}))]), Input::Cancel],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              await human approval:c1 ap_6c77cc5bb60284f0 c1 Approval { tool: "echo", input: Object {} }
            > cancel
              emit {"type":"tool.error","callId":"c1","code":"KEEL_TOOL_CANCELLED","error":"cancelled: the run was cancelled before this call finished"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":"cancelled: the run was cancelled before this call finished","is_error":true}]}
              emit {"type":"run.done","text":"","stopped":"cancelled","usage":{"inputTokens":10,"outputTokens":5}}
              finish Done { text: "", output: None, stopped: Cancelled, usage: Usage { input_tokens: 10, output_tokens: 5 } }
        "#]],
    );
}

#[test]
fn aborting_a_run_answers_its_open_calls_and_fails_it() {
    let failure = RunFailure::new(ErrorCode::RunPoisoned, "the run kept dying at step tool:echo:c1");
    check(
        machine(agent(|_| {})),
        vec![Input::Start, calls(&[("c1", "echo", json!({}))]), Input::Abort(failure)],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"echo","input":{}}]}
              emit {"type":"tool.start","callId":"c1","name":"echo","input":{}}
              call tool tool:echo:c1 {}
            > abort: KEEL_RUN_POISONED: the run kept dying at step tool:echo:c1
              emit {"type":"tool.error","callId":"c1","code":"KEEL_RUN_POISONED","error":"not run: the run kept dying at step tool:echo:c1 (KEEL_RUN_POISONED)"}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":"not run: the run kept dying at step tool:echo:c1 (KEEL_RUN_POISONED)","is_error":true}]}
              emit {"type":"run.error","code":"KEEL_RUN_POISONED","message":"the run kept dying at step tool:echo:c1"}
              finish Failed(RunFailure { code: RunPoisoned, message: "the run kept dying at step tool:echo:c1" })
        "#]],
    );
}

#[test]
fn a_history_ending_in_unanswered_calls_gets_their_results_before_the_new_input() {
    let call = |id: &str| {
        Part::ToolCall(crate::message::ToolCall { call_id: id.into(), name: "echo".into(), input: json!({}) })
    };
    // A run made two calls and was failed without its machine (it kept dying): no results.
    let history = vec![
        Arc::new(Message::user("earlier")),
        Arc::new(Message { role: Role::Assistant, parts: vec![call("c1"), call("c2")] }),
    ];
    let m = Machine::new(
        agent(|_| {}),
        RunId::from_suffix("2"),
        SessionId::new("s1").unwrap(),
        history,
        Arc::new(Message::user("next")),
        1,
    );
    check(
        m,
        vec![Input::Start],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_2","sessionId":"s1"}
              persist #2 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"echo","output":"not run: the run that made this call ended before the call had a result","is_error":true},{"type":"tool_result","call_id":"c2","name":"echo","output":"not run: the run that made this call ended before the call had a result","is_error":true}]}
              persist #3 {"v":1,"role":"user","parts":[{"type":"text","text":"next"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 4 messages)
        "#]],
    );
}

/// The compose tool as the machine sees it: a spec whose calls it runs itself.
struct ComposeSpec(ToolSpec);

impl Tool for ComposeSpec {
    fn spec(&self) -> &ToolSpec {
        &self.0
    }
    fn composes(&self) -> bool {
        true
    }
    fn call<'a>(&'a self, _: Value, _: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        unreachable!("compose is run by the machine")
    }
}

fn with_compose(def: &mut AgentDef) {
    let compose = ToolSpec {
        name: "compose".into(),
        description: "Runs a script".into(),
        input_schema: compose::input_schema(&["add", "echo"]),
    };
    def.tools = ToolSet::new(vec![add_tool(), echo_tool(), Arc::new(ComposeSpec(compose))]).unwrap();
}

/// One lookup answers how a call is carried out, with the precedence the machine gives it:
/// compose, then a question, then an approval rule (evaluated on the input), else run.
#[test]
fn dispatch_names_how_each_call_is_carried_out() {
    use crate::tool::{ApprovalRule, Dispatch};
    let ask: Arc<dyn Tool> = Arc::new(Question(ToolSpec {
        name: "ask_question".into(),
        description: "Asks".into(),
        input_schema: json!({"type": "object"}),
    }));
    let compose = ToolSpec { name: "compose".into(), description: "Runs".into(), input_schema: json!({}) };
    let mut tools = ToolSet::new(vec![add_tool(), echo_tool(), ask, Arc::new(ComposeSpec(compose))]).unwrap();
    let big = |input: &Value| input["a"].as_f64().is_some_and(|a| a > 100.0);
    tools.require_approval("add", ApprovalRule::When(Arc::new(big))).unwrap();
    tools.require_approval("echo", ApprovalRule::Always).unwrap();
    // A rule on a question or on compose does not make them approvals.
    tools.require_approval("ask_question", ApprovalRule::Always).unwrap();
    tools.require_approval("compose", ApprovalRule::Always).unwrap();
    assert_eq!(tools.dispatch("add", &json!({"a": 1})), Dispatch::Run);
    assert_eq!(tools.dispatch("add", &json!({"a": 500})), Dispatch::Approval);
    assert_eq!(tools.dispatch("echo", &json!({})), Dispatch::Approval);
    assert_eq!(tools.dispatch("ask_question", &json!({})), Dispatch::AskHuman);
    assert_eq!(tools.dispatch("compose", &json!({})), Dispatch::Compose);
    assert_eq!(tools.dispatch("nope", &json!({})), Dispatch::Run);
}

#[test]
fn compose_runs_its_steps_one_by_one_as_tool_steps() {
    let script = json!({ "steps": [
        { "id": "sum", "tool": "add", "input": { "a": 2, "b": 3 } },
        { "id": "show", "tool": "echo", "input": { "total": { "$from": "sum" }, "again": [{ "$from": "sum" }] } },
    ] });
    let bad_ref = json!({ "steps": [
        { "id": "x", "tool": "echo", "input": { "v": { "$from": "later" } } },
        { "id": "later", "tool": "echo", "input": {} },
    ] });
    check(
        machine(agent(with_compose)),
        vec![
            Input::Start,
            calls(&[("c", "compose", script), ("d", "compose", bad_ref)]),
            done("c.sum", Ok(json!(5))),
            done("c.show", Ok(json!({"total": 5}))),
            text("5", 1),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 1, 3 messages)
            > model reply
              emit {"type":"usage","inputTokens":10,"outputTokens":5}
              persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c","name":"compose","input":{"steps":[{"id":"sum","input":{"a":2,"b":3},"tool":"add"},{"id":"show","input":{"again":[{"$from":"sum"}],"total":{"$from":"sum"}},"tool":"echo"}]}},{"type":"tool_call","call_id":"d","name":"compose","input":{"steps":[{"id":"x","input":{"v":{"$from":"later"}},"tool":"echo"},{"id":"later","input":{},"tool":"echo"}]}}]}
              emit {"type":"tool.start","callId":"c","name":"compose","input":{"steps":[{"id":"sum","input":{"a":2,"b":3},"tool":"add"},{"id":"show","input":{"again":[{"$from":"sum"}],"total":{"$from":"sum"}},"tool":"echo"}]}}
              emit {"type":"tool.start","callId":"c.sum","name":"add","input":{"a":2,"b":3}}
              call tool tool:add:c.sum {"a":2,"b":3}
              emit {"type":"tool.start","callId":"d","name":"compose","input":{"steps":[{"id":"x","input":{"v":{"$from":"later"}},"tool":"echo"},{"id":"later","input":{},"tool":"echo"}]}}
              emit {"type":"tool.error","callId":"d","code":"KEEL_TOOL_INPUT_INVALID","error":"step `x` takes `$from: later`, which is not an earlier step (earlier: none)"}
            > tool done c.sum
              emit {"type":"tool.done","callId":"c.sum","output":5}
              emit {"type":"tool.start","callId":"c.show","name":"echo","input":{"again":[5],"total":5}}
              call tool tool:echo:c.show {"again":[5],"total":5}
            > tool done c.show
              emit {"type":"tool.done","callId":"c.show","output":{"total":5}}
              emit {"type":"tool.done","callId":"c","output":{"result":{"total":5},"steps":{"show":{"total":5},"sum":5}}}
              persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c","name":"compose","output":{"result":{"total":5},"steps":{"show":{"total":5},"sum":5}},"is_error":false},{"type":"tool_result","call_id":"d","name":"compose","output":"step `x` takes `$from: later`, which is not an earlier step (earlier: none)","is_error":true}]}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 2, 5 messages)
            > model reply
              emit {"type":"usage","inputTokens":1,"outputTokens":1}
              persist #5 {"v":1,"role":"assistant","parts":[{"type":"text","text":"5"}]}
              emit {"type":"run.done","text":"5","stopped":"final","usage":{"inputTokens":11,"outputTokens":6}}
              finish Done { text: "5", output: None, stopped: Final, usage: Usage { input_tokens: 11, output_tokens: 6 } }
        "#]],
    );
}

/// A session's earlier messages: two turns, the first with a tool call and its result.
fn long_history() -> Vec<Arc<Message>> {
    let call = ToolCall { call_id: "c0".into(), name: "add".into(), input: json!({"a": 1, "b": 1}) };
    vec![
        Arc::new(Message::user("Add 1 and 1")),
        Arc::new(Message { role: Role::Assistant, parts: vec![Part::ToolCall(call)] }),
        Arc::new(Message {
            role: Role::Tool,
            parts: vec![Part::ToolResult(ToolResult {
                call_id: "c0".into(),
                name: "add".into(),
                output: json!(2),
                is_error: false,
            })],
        }),
        Arc::new(Message::assistant("2")),
        Arc::new(Message::user("My name is Ada")),
        Arc::new(Message::assistant("Hello Ada")),
    ]
}

fn compacting(max_messages: usize, keep_recent: usize) -> impl FnOnce(&mut AgentDef) {
    move |a| a.loop_control.compaction = Some(Compaction { max_messages, keep_recent, model: None })
}

fn machine_with(agent: Arc<AgentDef>, history: Vec<Arc<Message>>, input: &str) -> Machine {
    let call_base = history.iter().filter(|m| m.role == Role::Assistant).count() as u64;
    Machine::new(
        agent,
        RunId::from_suffix("1"),
        SessionId::new("s1").unwrap(),
        history,
        Arc::new(Message::user(input)),
        call_base,
    )
}

fn brief(t: &str) -> Input {
    text(t, 7)
}

#[test]
fn a_long_conversation_is_compacted_before_the_turn_and_the_model_sees_the_brief_and_the_tail() {
    let mut m = machine_with(agent(compacting(4, 2)), long_history(), "What is my name?");
    let rendered = |m: &Machine| {
        m.model_request(1).messages.iter().map(|msg| encode_message(msg)).collect::<Vec<_>>().join("\n")
    };
    let actions = m.step(Input::Start);
    assert!(matches!(actions.last(), Some(Action::CallModel { step: StepName::Compact(0) })), "{actions:?}");
    let request = m.model_request(1);
    assert_eq!(request.purpose, CallPurpose::Compact);
    assert_eq!(request.call_index, 0, "the session's first brief");
    assert!(request.tools.is_empty());
    expect![[r#"
        The conversation:
        user: Add 1 and 1
        assistant called `add` with {"a":1,"b":1}
        `add` returned: 2
        assistant: 2
        user: My name is Ada

        Write the brief."#]]
    .assert_eq(&request.messages[0].text());

    check_actions(
        &mut m,
        brief("Ada added 1 and 1 (2)."),
        expect![[r#"
        emit {"type":"usage","inputTokens":7,"outputTokens":1}
        persist #7 {"v":1,"role":"user","parts":[{"type":"summary","text":"Ada added 1 and 1 (2).","first_kept":5}]}
        emit {"type":"context.compacted","summarized":5,"kept":2}
        emit {"type":"turn.start","turn":0}
        call model llm:turn:0
    "#]],
    );
    let request = m.model_request(1);
    assert_eq!(request.purpose, CallPurpose::Turn);
    assert_eq!(request.call_index, 3, "a compaction is not one of the session's turns");
    expect![[r#"
        {"v":1,"role":"user","parts":[{"type":"text","text":"Summary of the conversation before this point:\nAda added 1 and 1 (2)."}]}
        {"v":1,"role":"assistant","parts":[{"type":"text","text":"Hello Ada"}]}
        {"v":1,"role":"user","parts":[{"type":"text","text":"What is my name?"}]}"#]].assert_eq(&rendered(&m));
}

/// Steps `m` with `input` and checks the rendered actions (as [`check`] does).
fn check_actions(m: &mut Machine, input: Input, expected: Expect) {
    let mut out = String::new();
    for action in m.step(input) {
        match action {
            Action::Emit(event) => writeln!(out, "emit {}", event_to_json(&event)),
            Action::Persist { first_position, count } => {
                for (i, msg) in m.transcript()[first_position..first_position + count].iter().enumerate() {
                    writeln!(out, "persist #{} {}", first_position + i, encode_message(msg)).unwrap();
                }
                Ok(())
            }
            Action::CallModel { step } => writeln!(out, "call model {step}"),
            Action::CallTool { step, .. } => writeln!(out, "call tool {step}"),
            Action::AwaitHuman { step, .. } => writeln!(out, "await human {step}"),
            Action::Memory { step, request } => writeln!(out, "memory {step} {}", render_memory(&request)),
            Action::Finish(outcome) => writeln!(out, "finish {outcome:?}"),
        }
        .unwrap();
    }
    expected.assert_eq(&out);
}

#[test]
fn the_kept_tail_never_starts_with_a_tool_result_whose_call_was_summarised() {
    // History (6) + input = 7 messages; keeping 5 would start the tail at the tool result
    // (position 2): it starts after it instead.
    let mut m = machine_with(agent(compacting(6, 5)), long_history(), "And now?");
    m.step(Input::Start);
    let actions = m.step(brief("Ada added numbers."));
    let compacted = actions.iter().find_map(|a| match a {
        Action::Emit(Event::ContextCompacted { summarized, kept }) => Some((*summarized, *kept)),
        _ => None,
    });
    assert_eq!(compacted, Some((3, 4)));
    let request = m.model_request(1);
    assert_eq!(request.messages.len(), 5, "the brief and 4 messages");
    assert_eq!(request.messages[1].text(), "2");
    for (i, msg) in request.messages.iter().enumerate() {
        for result in msg.tool_results() {
            let called = request.messages[..i]
                .iter()
                .any(|earlier| earlier.tool_calls().any(|c| c.call_id == result.call_id));
            assert!(called, "result {} without its call", result.call_id);
        }
    }
}

#[test]
fn a_later_run_starts_from_the_latest_brief_and_compacts_again_over_it() {
    let mut history = long_history();
    history.push(Arc::new(Message {
        role: Role::User,
        parts: vec![Part::Summary { text: "Ada added 1 and 1.".into(), first_kept: 4 }],
    }));
    history.push(Arc::new(Message::user("I like tea")));
    history.push(Arc::new(Message::assistant("Noted")));
    // Seen: the brief, 4..6, 7, 8 and the input = 6 messages.
    let m = machine_with(agent(compacting(8, 2)), history.clone(), "What do I like?");
    let seen: Vec<String> = m.context().iter().map(|msg| msg.text()).collect();
    expect![[r#"
        [
            "Summary of the conversation before this point:\nAda added 1 and 1.",
            "My name is Ada",
            "Hello Ada",
            "I like tea",
            "Noted",
            "What do I like?",
        ]
    "#]]
    .assert_debug_eq(&seen);

    let mut m = machine_with(agent(compacting(5, 2)), history, "What do I like?");
    m.step(Input::Start);
    let request = m.model_request(1);
    assert_eq!(request.call_index, 1, "the session's second brief");
    expect![[r#"
        Brief of the conversation so far:
        Ada added 1 and 1.

        What happened next:
        user: My name is Ada
        assistant: Hello Ada
        user: I like tea

        Write the brief."#]]
    .assert_eq(&request.messages[0].text());
}

#[test]
fn a_context_too_long_failure_compacts_once_then_the_turn_is_made_again() {
    let too_long = || ProviderError::new(ProviderErrorKind::ContextTooLong, "prompt is too long");
    check(
        machine_with(agent(compacting(100, 2)), long_history(), "Hi"),
        vec![
            Input::Start,
            Input::ModelFailed(too_long()),
            brief("Ada added 1 and 1."),
            Input::ModelFailed(too_long()),
        ],
        expect![[r#"
            > start
              emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
              persist #6 {"v":1,"role":"user","parts":[{"type":"text","text":"Hi"}]}
              emit {"type":"turn.start","turn":0}
              call model llm:turn:0 (call_index 3, 7 messages)
            > model failed: prompt is too long
              call model llm:compact:0 (call_index 0, 1 messages)
            > model reply
              emit {"type":"usage","inputTokens":7,"outputTokens":1}
              persist #7 {"v":1,"role":"user","parts":[{"type":"summary","text":"Ada added 1 and 1.","first_kept":5}]}
              emit {"type":"context.compacted","summarized":5,"kept":2}
              emit {"type":"turn.start","turn":1}
              call model llm:turn:1 (call_index 4, 3 messages)
            > model failed: prompt is too long
              emit {"type":"run.error","code":"KEEL_PROVIDER_CONTEXT_TOO_LONG","message":"the model call failed: prompt is too long"}
              finish Failed(RunFailure { code: ProviderContextTooLong, message: "the model call failed: prompt is too long" })
        "#]],
    );
}

#[test]
fn a_failed_compaction_leaves_the_conversation_as_it_was_and_the_turn_goes_on() {
    let mut m = machine_with(agent(compacting(4, 2)), long_history(), "Hi");
    m.step(Input::Start);
    let failed = ProviderError::new(ProviderErrorKind::Overloaded, "overloaded");
    check_actions(
        &mut m,
        Input::ModelFailed(failed),
        expect![[r#"
        emit {"type":"turn.start","turn":0}
        call model llm:turn:0
    "#]],
    );
    assert_eq!(m.model_request(1).messages.len(), 7, "everything, uncompacted");
}

#[test]
fn prepare_turn_narrows_the_tools_and_a_call_of_another_is_refused() {
    let mut m = machine(agent(|a| {
        a.loop_control.hooks.prepare_turn = Some(Arc::new(|turn: &TurnContext<'_>| TurnPlan {
            tools: Some(vec!["echo".into()]),
            tool_choice: (turn.turn == 0).then(|| ToolChoice::Tool("echo".into())),
            instructions: Some(format!("Turn {}: {} messages.", turn.turn, turn.messages.len())),
            ..TurnPlan::default()
        }))
    }));
    m.step(Input::Start);
    let request = m.model_request(1);
    assert_eq!(request.tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["echo"]);
    assert_eq!(request.tool_choice, Some(&ToolChoice::Tool("echo".into())));
    assert_eq!(request.instructions, "Turn 0: 3 messages.");
    check_actions(
        &mut m,
        calls(&[("c1", "add", json!({"a": 1, "b": 2}))]),
        expect![[r#"
            emit {"type":"usage","inputTokens":10,"outputTokens":5}
            persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"add","input":{"a":1,"b":2}}]}
            emit {"type":"tool.start","callId":"c1","name":"add","input":{"a":1,"b":2}}
            emit {"type":"tool.error","callId":"c1","code":"KEEL_TOOL_NOT_FOUND","error":"unknown tool `add` this turn; available tools: echo"}
            persist #4 {"v":1,"role":"tool","parts":[{"type":"tool_result","call_id":"c1","name":"add","output":"unknown tool `add` this turn; available tools: echo","is_error":true}]}
            emit {"type":"turn.start","turn":1}
            call model llm:turn:1
        "#]],
    );
}

#[test]
fn repair_tool_call_fixes_a_call_before_it_is_refused_and_the_transcript_shows_the_fix() {
    let mut m = machine(agent(|a| {
        a.loop_control.hooks.repair_tool_call = Some(Arc::new(|call: &ToolCall, error: &ToolError| {
            assert_eq!(error.code, ErrorCode::ToolNotFound);
            (call.name == "Add").then(|| ToolCall { name: "add".into(), ..call.clone() })
        }))
    }));
    m.step(Input::Start);
    let reply = calls(&[("c1", "Add", json!({"a": 1, "b": 2})), ("c2", "nope", json!({}))]);
    let Input::ModelReply(journaled) = &reply else { unreachable!() };
    let journaled = journaled.clone();
    check_actions(
        &mut m,
        reply,
        expect![[r#"
            emit {"type":"usage","inputTokens":10,"outputTokens":5}
            persist #3 {"v":1,"role":"assistant","parts":[{"type":"tool_call","call_id":"c1","name":"add","input":{"a":1,"b":2}},{"type":"tool_call","call_id":"c2","name":"nope","input":{}}]}
            emit {"type":"tool.start","callId":"c1","name":"add","input":{"a":1,"b":2}}
            call tool tool:add:c1
            emit {"type":"tool.start","callId":"c2","name":"nope","input":{}}
            emit {"type":"tool.error","callId":"c2","code":"KEEL_TOOL_NOT_FOUND","error":"unknown tool `nope`; available tools: add, echo"}
        "#]],
    );
    // The journal keeps the call as the model wrote it: a replay repairs it again.
    assert_eq!(journaled.message.tool_calls().next().unwrap().name, "Add");
}

#[test]
fn a_run_s_own_limits_replace_the_agent_s() {
    let overrides =
        LimitOverrides { max_turns: Some(1), max_tool_output_chars: Some(3), ..LimitOverrides::default() };
    let mut m = machine(agent(|_| {})).with_overrides(&overrides);
    assert_eq!(m.limits().max_turns, 1);
    m.step(Input::Start);
    m.step(calls(&[("c1", "echo", json!({"long": "output"}))]));
    let actions = m.step(done("c1", Ok(json!("abcdefgh"))));
    let Some(Action::Finish(RunOutcome::Done { stopped, .. })) = actions.last() else {
        panic!("{actions:?}")
    };
    assert_eq!(*stopped, StopReason::MaxTurns);
    let result = m.transcript().last().unwrap().tool_results().next().unwrap().output.clone();
    assert!(output_to_text(&result).starts_with("abc"), "{result}");
    assert!(!output_to_text(&result).contains("defgh"), "{result}");
}

/// A memory request in one line: its fields, messages by their text.
fn render_memory(request: &MemoryRequest) -> String {
    match request {
        MemoryRequest::Recall { limit } => format!("limit {limit}"),
        MemoryRequest::Traverse { text, graph } => {
            format!("{text:?} depth {} seeds {}", graph.depth, graph.max_seeds)
        }
        MemoryRequest::Episode { messages, call_index } | MemoryRequest::Extract { messages, call_index } => {
            let texts: Vec<String> = messages.iter().map(|m| m.text()).collect();
            format!("call_index {call_index} {texts:?}")
        }
        MemoryRequest::Retrieve { skill, query } => format!("{skill:?} {query:?}"),
    }
}

fn remembering(a: &mut AgentDef) {
    a.memory.settings = MemorySettings {
        episodic: Some(Episodic { recall: 3 }),
        graph: Some(GraphSettings::default()),
        model: None,
        knowledge: Vec::new(),
    };
}

#[test]
fn documents_in_inject_mode_are_retrieved_before_the_first_turn_and_agentic_ones_are_not() {
    use crate::memory::{Knowledge, RetrievalMode};
    let mut m = machine(agent(|a| {
        let billing = Knowledge { skill: Some("billing".into()), ..Knowledge::new("/docs/billing") };
        let faq =
            Knowledge { skill: Some("faq".into()), mode: RetrievalMode::Agentic, ..Knowledge::new("/faq") };
        a.memory.settings.knowledge = vec![Knowledge::new("/docs"), billing, faq];
    }));
    check_actions(
        &mut m,
        Input::Start,
        expect![[r#"
        emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
        persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
        memory memory:retrieve None "What is 2+3?"
    "#]],
    );
    let found = |context: &str| Input::MemoryDone(Ok(json!({ "context": context, "hits": [] })));
    check_actions(
        &mut m,
        found("## From your documents\n[1] sums.md: 2+3 is 5."),
        expect![[r#"
        memory memory:retrieve:billing Some("billing") "What is 2+3?"
    "#]],
    );
    check_actions(
        &mut m,
        found(""),
        expect![[r#"
        emit {"type":"turn.start","turn":0}
        call model llm:turn:0
    "#]],
    );
    assert_eq!(
        m.model_request(1).instructions,
        "Be brief.\n\n## From your documents\n[1] sums.md: 2+3 is 5."
    );
    // Retrieval writes nothing after the answer.
    let actions = m.step(text("5", 10));
    assert!(matches!(actions.last(), Some(Action::Finish(_))), "{actions:?}");
}

#[test]
fn memory_is_recalled_before_the_first_turn_and_written_after_the_answer() {
    let recalled = |context: &str| Input::MemoryDone(Ok(json!({ "context": context })));
    let mut m = machine(agent(remembering));
    check_actions(
        &mut m,
        Input::Start,
        expect![[r#"
        emit {"type":"run.start","runId":"run_1","sessionId":"s1"}
        persist #2 {"v":1,"role":"user","parts":[{"type":"text","text":"What is 2+3?"}]}
        memory memory:recall limit 3
    "#]],
    );
    check_actions(
        &mut m,
        recalled("Earlier: the user likes tea."),
        expect![[r#"
        memory memory:traverse "What is 2+3?" depth 2 seeds 4
    "#]],
    );
    // A failed step leaves its part out; the run goes on.
    let failed = Input::MemoryDone(Err("store away".into()));
    check_actions(
        &mut m,
        failed,
        expect![[r#"
        emit {"type":"turn.start","turn":0}
        call model llm:turn:0
    "#]],
    );
    assert_eq!(m.model_request(1).instructions, "Be brief.\n\nEarlier: the user likes tea.");
    check_actions(
        &mut m,
        text("5", 10),
        expect![[r#"
        emit {"type":"usage","inputTokens":10,"outputTokens":1}
        persist #3 {"v":1,"role":"assistant","parts":[{"type":"text","text":"5"}]}
        memory memory:episode call_index 1 ["What is 2+3?", "5"]
    "#]],
    );
    check_actions(
        &mut m,
        recalled(""),
        expect![[r#"
        memory memory:extract call_index 1 ["What is 2+3?", "5"]
    "#]],
    );
    // The extraction failing does not fail the run.
    let failed = Input::MemoryDone(Err("not JSON".into()));
    check_actions(
        &mut m,
        failed,
        expect![[r#"
        emit {"type":"run.done","text":"5","stopped":"final","usage":{"inputTokens":10,"outputTokens":1}}
        finish Done { text: "5", output: None, stopped: Final, usage: Usage { input_tokens: 10, output_tokens: 1 } }
    "#]],
    );
    assert!(m.is_finished());
}

#[test]
fn a_cancelled_run_is_not_remembered() {
    let mut m = machine(agent(remembering));
    m.step(Input::Start);
    let actions = m.step(Input::Cancel);
    assert!(!actions.iter().any(|a| matches!(a, Action::Memory { .. })), "{actions:?}");
    assert!(matches!(
        actions.last(),
        Some(Action::Finish(RunOutcome::Done { stopped: StopReason::Cancelled, .. }))
    ));
}
