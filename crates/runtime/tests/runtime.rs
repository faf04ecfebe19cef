//! Runtime tests: the driver against the memory store, the mock provider and real tools.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keel_core::agent::OutputSchema;
use keel_core::{
    AgentDef, BoxFuture, CallPurpose, Compaction, DeltaSink, ErrorCode, Event, Limits, Message, MockEntry,
    MockFailure, MockScript, MockToolCall, ModelReply, ModelRequest, Provider, ProviderError, RetryPolicy,
    RunState, SessionId, StepName, StopReason, Store, Tool, ToolSet,
};
use keel_providers::MockProvider;
use keel_runtime::{Engine, EngineOptions};
use keel_store::MemoryStore;
use keel_tools::function_tool;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

/// Counts model calls by session call index (compaction calls apart, by the session's brief
/// number), then delegates to the mock.
struct CountingProvider {
    mock: MockProvider,
    calls: Mutex<Vec<u64>>,
    briefs: Mutex<Vec<u64>>,
}

impl Provider for CountingProvider {
    fn complete<'a>(
        &'a self,
        request: ModelRequest<'a>,
        sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        match request.purpose {
            CallPurpose::Turn => self.calls.lock().unwrap().push(request.call_index),
            CallPurpose::Compact => self.briefs.lock().unwrap().push(request.call_index),
            CallPurpose::Episode | CallPurpose::Extract => {}
        }
        self.mock.complete(request, sink)
    }
}

fn counting(entries: Vec<MockEntry>) -> Arc<CountingProvider> {
    Arc::new(CountingProvider {
        mock: MockProvider::new(MockScript::new(entries)),
        calls: Mutex::default(),
        briefs: Mutex::default(),
    })
}

fn calls(list: &[(&str, Value)]) -> MockEntry {
    MockEntry {
        tool_calls: list
            .iter()
            .map(|(name, input)| MockToolCall { name: (*name).into(), input: input.clone() })
            .collect(),
        ..MockEntry::default()
    }
}

fn text(t: &str) -> MockEntry {
    MockEntry { text: Some(t.into()), ..MockEntry::default() }
}

#[derive(Deserialize, JsonSchema)]
struct Note {
    note: String,
}

/// A tool that records each execution.
fn recorder(log: Arc<Mutex<Vec<String>>>) -> Arc<dyn Tool> {
    function_tool("record", "Records a note", move |input: Note| {
        let log = Arc::clone(&log);
        async move {
            log.lock().unwrap().push(input.note.clone());
            Ok::<_, String>(format!("recorded {}", input.note))
        }
    })
}

#[derive(Deserialize, JsonSchema)]
struct Nothing {}

/// A tool that hangs on its first execution (the "crash" happens while it runs) and answers
/// on later ones.
fn hang_once(started: Arc<tokio::sync::Notify>, runs: Arc<AtomicUsize>) -> Arc<dyn Tool> {
    function_tool("slow", "Takes a while", move |_: Nothing| {
        let started = Arc::clone(&started);
        let first = runs.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                started.notify_one();
                std::future::pending::<()>().await;
            }
            Ok::<_, String>("slow done")
        }
    })
}

fn agent(tools: Vec<Arc<dyn Tool>>, edit: impl FnOnce(&mut AgentDef)) -> Arc<AgentDef> {
    let mut def = AgentDef {
        name: "test".into(),
        description: None,
        instructions: "Test agent.".into(),
        model: "mock".into(),
        tools: ToolSet::new(tools).unwrap(),
        limits: Limits::default(),
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
        },
        output_schema: None,
        stop_on_tools: Vec::new(),
        concurrency: keel_core::Concurrency::Reject,
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

fn session(id: &str) -> SessionId {
    SessionId::new(id).unwrap()
}

fn crash_script() -> Vec<MockEntry> {
    vec![
        calls(&[("record", json!({"note": "a"})), ("slow", json!({}))]),
        calls(&[("record", json!({"note": "b"}))]),
        text("finished: {{last_tool_output}}"),
    ]
}

#[test]
fn a_run_interrupted_mid_tool_resumes_without_repeating_completed_steps() {
    // The uninterrupted reference run.
    let reference_store = Arc::new(MemoryStore::new());
    let reference_log = Arc::new(Mutex::new(Vec::new()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let reference = runtime.block_on(async {
        let runs = Arc::new(AtomicUsize::new(1)); // never hangs
        let tools = vec![recorder(Arc::clone(&reference_log)), hang_once(Arc::default(), runs)];
        let engine = Engine::new(agent(tools, |_| {}), counting(crash_script()), reference_store.clone());
        engine.start(session("s"), Message::user("go")).unwrap().result().await.unwrap()
    });
    let reference_transcript = runtime.block_on(reference_store.load_messages(&session("s"))).unwrap();
    drop(runtime);

    // The same run, killed while `slow` runs: dropping the runtime drops every task mid-flight,
    // as a crash would, leaving only what was already in the store. Time is a manual clock: the
    // lease expires when the test says so, not after a sleep.
    let clock = keel_core::ManualClock::starting_now();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let options = || EngineOptions { lease_ttl: Duration::from_secs(30), clock: Arc::new(clock.clone()) };
    let log = Arc::new(Mutex::new(Vec::new()));
    let slow_runs = Arc::new(AtomicUsize::new(0));
    let provider = counting(crash_script());
    let tools = || vec![recorder(Arc::clone(&log)), hang_once(Arc::default(), Arc::clone(&slow_runs))];
    let first = tokio::runtime::Runtime::new().unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let run_id = first.block_on(async {
        let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::clone(&started), Arc::clone(&slow_runs))];
        let engine = Engine::with_options(agent(tools, |_| {}), provider.clone(), store.clone(), options());
        let handle = engine.start(session("s"), Message::user("go")).unwrap();
        started.notified().await;
        // Let `record` finish and be journaled too.
        let recorded = StepName::Tool { name: "record".into(), call_id: "call_0_0".into() };
        while !store.load_journal(handle.run_id()).await.unwrap().iter().any(|e| e.step == recorded) {
            tokio::task::yield_now().await;
        }
        handle.run_id().clone()
    });
    first.shutdown_timeout(Duration::from_secs(1));
    assert_eq!(*provider.calls.lock().unwrap(), [0], "one model call before the crash");
    assert_eq!(*log.lock().unwrap(), ["a"]);

    // A new "process" re-drives the run from the store, once the dead one's lease expired.
    let second = tokio::runtime::Runtime::new().unwrap();
    let result = second.block_on(async {
        let engine = Engine::with_options(agent(tools(), |_| {}), provider.clone(), store.clone(), options());
        let early = engine.resume(run_id.clone()).result().await.unwrap_err();
        assert_eq!(early.code, ErrorCode::RunLeased);
        assert!(engine.recover(None).await.unwrap().is_empty(), "a run with a live lease is not interrupted");
        clock.advance(Duration::from_secs(31));
        let mut recovered = engine.recover(None).await.unwrap();
        assert_eq!(recovered.len(), 1);
        recovered.pop().unwrap().result().await.unwrap()
    });
    assert_eq!(result.text, "finished: recorded b");
    assert_eq!(result.text, reference.text);
    assert_eq!(result.usage, reference.usage);
    // Turn 0 was journaled: never paid twice. `record a` completed: never re-run. `slow` had
    // not completed: it runs again (at-least-once), once.
    assert_eq!(*provider.calls.lock().unwrap(), [0, 1, 2]);
    assert_eq!(*log.lock().unwrap(), ["a", "b"]);
    assert_eq!(slow_runs.load(Ordering::SeqCst), 2);
    let transcript = second.block_on(store.load_messages(&session("s"))).unwrap();
    assert_eq!(transcript, reference_transcript, "the transcript differs from an uninterrupted run");
    let record = second.block_on(store.load_run(&run_id)).unwrap().unwrap();
    assert_eq!(record.state, RunState::Done);
}

#[tokio::test]
async fn re_driving_a_finished_run_calls_nothing_and_appends_nothing() {
    let store = Arc::new(MemoryStore::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(crash_script());
    let slow_runs = Arc::new(AtomicUsize::new(1));
    let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::default(), Arc::clone(&slow_runs))];
    let engine = Engine::new(agent(tools, |_| {}), provider.clone(), store.clone());
    let first = engine.start(session("s"), Message::user("go")).unwrap().result().await.unwrap();
    let transcript = store.load_messages(&session("s")).await.unwrap();
    assert_eq!(transcript.len(), 6, "user, 3 assistant and 2 tool messages: {transcript:#?}");

    let mut replay = engine.resume(first.run_id.clone());
    let mut replay_events = Vec::new();
    while let Some(event) = replay.next().await {
        replay_events.push(event);
    }
    let second = replay.result().await.unwrap();
    assert_eq!(second, first);
    assert_eq!(provider.calls.lock().unwrap().len(), 3, "a journaled model call was made again");
    assert_eq!(*log.lock().unwrap(), ["a", "b"], "a journaled tool ran again");
    assert_eq!(slow_runs.load(Ordering::SeqCst), 2, "slow ran again (it started at 1 and ran once)");
    assert_eq!(
        store.load_messages(&session("s")).await.unwrap(),
        transcript,
        "the replay changed the transcript"
    );
    // An observer of the replay is not shown again what the run showed before (text, usage, the
    // older turns): it gets the run's start, its last turn, and its end.
    let kinds: Vec<&str> = replay_events.iter().map(keel_core::wire::event_type).collect();
    assert_eq!(kinds, ["run.start", "turn.start", "run.done"], "{replay_events:#?}");
    assert!(matches!(&replay_events[2], Event::RunDone { text, .. } if text == "finished: recorded b"));
}

#[tokio::test]
async fn events_come_in_order_and_text_streams() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(vec![calls(&[("record", json!({"note": "x"}))]), text("all done now")]);
    let engine = Engine::new(agent(vec![recorder(log)], |_| {}), provider, Arc::new(MemoryStore::new()));
    let mut run = engine.start(session("s"), Message::user("go")).unwrap();
    let mut kinds = Vec::new();
    while let Some(event) = run.next().await {
        kinds.push(keel_core::wire::event_type(&event));
    }
    assert_eq!(
        kinds,
        [
            "run.start",
            "turn.start",
            "usage",
            "tool.start",
            "tool.done",
            "turn.start",
            "text.delta",
            "text.delta",
            "text.delta",
            "usage",
            "run.done"
        ]
    );
}

#[tokio::test]
async fn parallel_tool_calls_run_concurrently_and_keep_call_order() {
    #[derive(Deserialize, JsonSchema)]
    struct Wait {
        ms: u64,
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (f, p) = (Arc::clone(&in_flight), Arc::clone(&peak));
    let wait = function_tool("wait", "Waits", move |input: Wait| {
        let (in_flight, peak) = (Arc::clone(&f), Arc::clone(&p));
        async move {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(input.ms)).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, String>(input.ms)
        }
    });
    let provider = counting(vec![
        calls(&[("wait", json!({"ms": 300})), ("wait", json!({"ms": 10})), ("wait", json!({"ms": 150}))]),
        text("ok"),
    ]);
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(agent(vec![wait], |_| {}), provider, store.clone());
    let mut run = engine.start(session("p"), Message::user("go")).unwrap();
    let mut done_order = Vec::new();
    while let Some(event) = run.next().await {
        if let Event::ToolDone { output, duration, .. } = event {
            // Each call reports how long it ran: at least its wait.
            let ran = duration.expect("a call that ran now has a duration");
            assert!(ran >= Duration::from_millis(output.as_u64().unwrap()), "{output}: {ran:?}");
            done_order.push(output);
        }
    }
    run.result().await.unwrap();
    assert_eq!(peak.load(Ordering::SeqCst), 3, "the calls did not overlap");
    assert_eq!(done_order, [json!(10), json!(150), json!(300)], "events come as calls finish");
    let transcript = store.load_messages(&session("p")).await.unwrap();
    let outputs: Vec<Value> = transcript[2].tool_results().map(|r| r.output.clone()).collect();
    assert_eq!(outputs, [json!(300), json!(10), json!(150)], "results are kept in call order");
}

#[tokio::test]
async fn a_panicking_tool_and_a_hanging_tool_become_tool_errors() {
    // A call that panics in its first poll (made in the run's own task) and one that panics
    // later (in the task a waiting call moves to) fail alike.
    let boom = function_tool("boom", "Panics", |_: Nothing| async move {
        if true {
            panic!("kaboom");
        }
        Ok::<_, String>(())
    });
    let late_boom = function_tool("late_boom", "Panics after a wait", |_: Nothing| async move {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if true {
            panic!("later");
        }
        Ok::<_, String>(())
    });
    let hang = function_tool("hang", "Never returns", |_: Nothing| async move {
        std::future::pending::<()>().await;
        Ok::<_, String>(())
    });
    let provider = counting(vec![
        calls(&[("boom", json!({})), ("late_boom", json!({})), ("hang", json!({}))]),
        text("recovered"),
    ]);
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(
        agent(vec![boom, late_boom, hang], |a| a.limits.tool_timeout = Duration::from_millis(200)),
        provider,
        store.clone(),
    );
    let result = engine.start(session("e"), Message::user("go")).unwrap().result().await.unwrap();
    assert_eq!(result.text, "recovered");
    let transcript = store.load_messages(&session("e")).await.unwrap();
    let errors: Vec<(bool, String)> = transcript[2]
        .tool_results()
        .map(|r| (r.is_error, r.output.as_str().unwrap_or("").to_owned()))
        .collect();
    assert_eq!(
        errors,
        [
            (true, "tool `boom` crashed: it panicked: kaboom".to_owned()),
            (true, "tool `late_boom` crashed: it panicked: later".to_owned()),
            (
                true,
                "tool `hang` did not finish within 200ms (`limits.tool_timeout`) and was stopped".to_owned()
            ),
        ]
    );
}

#[tokio::test]
async fn transient_provider_errors_are_retried_and_permanent_ones_fail_the_run() {
    let flaky = MockEntry {
        error: Some(MockFailure { status: 503, message: "overloaded".into(), times: Some(2), partial: None }),
        text: Some("third time lucky".into()),
        ..MockEntry::default()
    };
    let engine = Engine::new(agent(vec![], |_| {}), counting(vec![flaky]), Arc::new(MemoryStore::new()));
    let result = engine.start(session("r"), Message::user("go")).unwrap().result().await.unwrap();
    assert_eq!(result.text, "third time lucky");

    let broken = MockEntry {
        error: Some(MockFailure { status: 500, message: "down".into(), times: None, partial: None }),
        ..MockEntry::default()
    };
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(agent(vec![], |_| {}), counting(vec![broken]), store.clone());
    let mut run = engine.start(session("r"), Message::user("go")).unwrap();
    let run_id = run.run_id().clone();
    let mut last = None;
    let mut errors = 0;
    while let Some(event) = run.next().await {
        errors += usize::from(matches!(event, Event::RunError { .. }));
        last = Some(event);
    }
    assert_eq!(errors, 1, "run.error must be sent exactly once");
    let failure = run.result().await.unwrap_err();
    assert_eq!(failure.code, ErrorCode::ProviderError);
    assert!(failure.message.contains("down (after 3 attempts)"), "{}", failure.message);
    assert!(matches!(last, Some(Event::RunError { code: ErrorCode::ProviderError, .. })), "{last:?}");
    assert_eq!(store.load_run(&run_id).await.unwrap().unwrap().state, RunState::Failed);
}

#[tokio::test]
async fn cancel_stops_a_hanging_tool_and_leaves_no_dangling_call() {
    let cancelled = Arc::new(AtomicBool::new(false));
    let started = Arc::new(tokio::sync::Notify::new());
    let (flag, notify) = (Arc::clone(&cancelled), Arc::clone(&started));
    let hang = function_tool("hang", "Never returns", move |_: Nothing| {
        let (flag, notify) = (Arc::clone(&flag), Arc::clone(&notify));
        async move {
            struct SetOnDrop(Arc<AtomicBool>);
            impl Drop for SetOnDrop {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let _guard = SetOnDrop(flag);
            notify.notify_one();
            std::future::pending::<()>().await;
            Ok::<_, String>(())
        }
    });
    let store = Arc::new(MemoryStore::new());
    let engine =
        Engine::new(agent(vec![hang], |_| {}), counting(vec![calls(&[("hang", json!({}))])]), store.clone());
    let run = engine.start(session("c"), Message::user("go")).unwrap();
    started.notified().await;
    run.cancel();
    let result = run.result().await.unwrap();
    assert_eq!(result.stopped, StopReason::Cancelled);
    for _ in 0..100 {
        if cancelled.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(cancelled.load(Ordering::SeqCst), "the tool's work was not dropped");
    let transcript = store.load_messages(&session("c")).await.unwrap();
    let last = transcript.last().unwrap();
    assert_eq!(last.tool_results().count(), 1, "the call has no result: {transcript:#?}");
    // The session is free again.
    let engine2 = engine.clone();
    assert!(engine2.start(session("c"), Message::user("again")).is_ok());
}

#[tokio::test]
async fn a_second_run_on_a_busy_session_is_rejected() {
    let slow = MockEntry { delay_ms: 200, text: Some("slow".into()), ..MockEntry::default() };
    let engine = Engine::new(agent(vec![], |_| {}), counting(vec![slow]), Arc::new(MemoryStore::new()));
    let first = engine.start(session("b"), Message::user("one")).unwrap();
    let Err(busy) = engine.start(session("b"), Message::user("two")) else { panic!("accepted") };
    assert_eq!(busy.code, ErrorCode::SessionBusy);
    assert!(engine.start(session("other"), Message::user("x")).is_ok());
    first.result().await.unwrap();
    assert!(engine.start(session("b"), Message::user("three")).is_ok());
}

#[tokio::test]
async fn a_session_continues_across_runs_and_the_script_follows_the_session() {
    let store = Arc::new(MemoryStore::new());
    let provider = counting(vec![text("first answer"), text("second answer")]);
    let engine = Engine::new(agent(vec![], |_| {}), provider.clone(), store.clone());
    let one = engine.start(session("m"), Message::user("hi")).unwrap().result().await.unwrap();
    let two = engine.start(session("m"), Message::user("again")).unwrap().result().await.unwrap();
    let three = engine.start(session("m"), Message::user("echo this")).unwrap().result().await.unwrap();
    assert_eq!([one.text, two.text, three.text], ["first answer", "second answer", "echo this"]);
    assert_eq!(*provider.calls.lock().unwrap(), [0, 1, 2]);
    assert_eq!(store.load_messages(&session("m")).await.unwrap().len(), 6);
}

#[tokio::test]
async fn structured_output_is_returned() {
    let schema = OutputSchema::new(
        json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}),
    )
    .unwrap();
    let engine = Engine::new(
        agent(vec![], |a| a.output_schema = Some(schema)),
        counting(vec![text("{\"answer\": \"5\"}")]),
        Arc::new(MemoryStore::new()),
    );
    let result = engine.start(session("o"), Message::user("2+3?")).unwrap().result().await.unwrap();
    assert_eq!(result.output, Some(json!({"answer": "5"})));
}

#[tokio::test]
async fn resuming_an_unknown_run_fails_clearly() {
    let engine = Engine::new(agent(vec![], |_| {}), counting(vec![]), Arc::new(MemoryStore::new()));
    let mut run = engine.resume(keel_core::RunId::from_suffix("nope"));
    let mut events = Vec::new();
    while let Some(event) = run.next().await {
        events.push(event);
    }
    assert!(
        matches!(events.as_slice(), [Event::RunError { code: ErrorCode::RunNotFound, .. }]),
        "{events:?}"
    );
    let failure = run.result().await.unwrap_err();
    assert_eq!(failure.code, ErrorCode::RunNotFound);
}

#[tokio::test]
async fn a_live_run_keeps_its_lease_by_heartbeat_and_is_never_taken_over() {
    #[derive(Deserialize, JsonSchema)]
    struct Wait {
        ms: u64,
    }
    let wait = function_tool("wait", "Waits", |input: Wait| async move {
        tokio::time::sleep(Duration::from_millis(input.ms)).await;
        Ok::<_, String>("waited")
    });
    let store = Arc::new(MemoryStore::new());
    // Heartbeats every 200 ms keep a 600 ms lease alive through a 2.4 s tool call.
    let lease = Duration::from_millis(600);
    let script = vec![calls(&[("wait", json!({"ms": 2400}))]), text("ok")];
    let engine = Engine::with_lease_ttl(agent(vec![wait], |_| {}), counting(script), store.clone(), lease);
    let run = engine.start(session("long"), Message::user("go")).unwrap();
    // Another process looks for interrupted runs while the tool runs for several lease lengths.
    let other = Engine::with_lease_ttl(agent(vec![], |_| {}), counting(vec![]), store.clone(), lease);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(other.recover(None).await.unwrap().is_empty(), "a live run was seen as interrupted");
    }
    assert_eq!(run.result().await.unwrap().text, "ok");
}

fn slow_echo(delay_ms: u64, turns: usize) -> Vec<MockEntry> {
    (0..turns)
        .map(|i| MockEntry { delay_ms, text: Some(format!("answer {i}")), ..MockEntry::default() })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_inputs_run_one_at_a_time_in_order_and_the_queue_is_bounded() {
    for iteration in 0..20 {
        let store = Arc::new(MemoryStore::new());
        let engine = Engine::new(
            agent(vec![], |a| a.concurrency = keel_core::Concurrency::Queue),
            counting(slow_echo(5, 40)),
            store.clone(),
        );
        // Twelve inputs race for one session from as many tasks.
        let barrier = Arc::new(tokio::sync::Barrier::new(12));
        let racers: Vec<_> = (0..12)
            .map(|i| {
                let (engine, barrier) = (engine.clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    engine.start(session("q"), Message::user(format!("input {i}"))).map(|h| (i, h))
                })
            })
            .collect();
        let mut accepted = Vec::new();
        let mut refused = 0;
        for racer in racers {
            match racer.await.unwrap() {
                Ok(handle) => accepted.push(handle),
                Err(failure) => {
                    assert_eq!(failure.code, ErrorCode::SessionBusy);
                    refused += 1;
                }
            }
        }
        assert_eq!(accepted.len(), 6, "iteration {iteration}: one running and five waiting");
        assert_eq!(refused, 6, "iteration {iteration}");
        for (_, handle) in accepted {
            handle.result().await.unwrap();
        }
        // The transcript is whole turns, one after another: user, assistant, user, assistant...
        let transcript = store.load_messages(&session("q")).await.unwrap();
        assert_eq!(transcript.len(), 12, "iteration {iteration}");
        for (index, message) in transcript.iter().enumerate() {
            let expected = if index % 2 == 0 { keel_core::Role::User } else { keel_core::Role::Assistant };
            assert_eq!(message.role, expected, "iteration {iteration}: interleaved turns {transcript:#?}");
        }
    }
}

#[tokio::test]
async fn queued_runs_start_in_arrival_order() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(
        agent(vec![], |a| a.concurrency = keel_core::Concurrency::Queue),
        counting(slow_echo(20, 10)),
        store.clone(),
    );
    let handles: Vec<_> = (0..4)
        .map(|i| engine.start(session("order"), Message::user(format!("input {i}"))).unwrap())
        .collect();
    for handle in handles {
        handle.result().await.unwrap();
    }
    let users: Vec<String> = store
        .load_messages(&session("order"))
        .await
        .unwrap()
        .iter()
        .filter(|m| m.role == keel_core::Role::User)
        .map(|m| m.text())
        .collect();
    assert_eq!(users, ["input 0", "input 1", "input 2", "input 3"]);
}

#[tokio::test]
async fn replace_cancels_the_run_in_flight_and_runs_the_new_input() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::new(
        agent(vec![], |a| a.concurrency = keel_core::Concurrency::Replace),
        counting(slow_echo(300, 5)),
        store.clone(),
    );
    let first = engine.start(session("r"), Message::user("first")).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = engine.start(session("r"), Message::user("second")).unwrap();
    assert_eq!(first.result().await.unwrap().stopped, StopReason::Cancelled);
    let result = second.result().await.unwrap();
    assert_eq!(result.stopped, StopReason::Final);
    let transcript = store.load_messages(&session("r")).await.unwrap();
    let texts: Vec<String> = transcript.iter().map(|m| m.text()).collect();
    // The first run was cancelled during its model call: its input stays, with no answer.
    assert_eq!(texts, ["first", "second", "answer 0"]);
}

#[tokio::test(start_paused = true)]
async fn a_queued_input_gives_up_after_twelve_hours_behind_a_run_that_does_not_end() {
    let store = Arc::new(MemoryStore::new());
    let (started, runs) = (Arc::new(tokio::sync::Notify::new()), Arc::new(AtomicUsize::new(0)));
    let engine = Engine::new(
        agent(vec![hang_once(started.clone(), runs)], |a| {
            a.concurrency = keel_core::Concurrency::Queue;
            a.limits.tool_timeout = Duration::from_secs(48 * 3600);
        }),
        counting(vec![calls(&[("slow", json!({}))]), text("first"), text("third")]),
        store.clone(),
    );
    let first = engine.start(session("w"), Message::user("one")).unwrap();
    started.notified().await;
    let queued_at = tokio::time::Instant::now();
    let second = engine.start(session("w"), Message::user("two")).unwrap();
    let failure = second.result().await.unwrap_err();
    assert_eq!(failure.code, keel_core::ErrorCode::SessionBusy, "{failure}");
    assert!(failure.message.contains("waited 12 h"), "{failure}");
    let waited = queued_at.elapsed();
    assert!(
        (Duration::from_secs(12 * 3600)..Duration::from_secs(12 * 3600 + 60)).contains(&waited),
        "{waited:?}"
    );
    // The run ahead is untouched, and the session serves the next input once it ends.
    first.cancel();
    assert_eq!(first.result().await.unwrap().stopped, StopReason::Cancelled);
    let third = engine.start(session("w"), Message::user("three")).unwrap();
    assert_eq!(third.result().await.unwrap().stopped, StopReason::Final);
}

#[tokio::test]
async fn a_finished_run_whose_journal_was_compacted_is_never_executed_again() {
    let store = Arc::new(MemoryStore::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(vec![calls(&[("record", json!({"note": "x"}))]), text("done")]);
    let engine =
        Engine::new(agent(vec![recorder(Arc::clone(&log))], |_| {}), provider.clone(), store.clone());
    let result = engine.start(session("c"), Message::user("go")).unwrap().result().await.unwrap();
    assert!(store.compact_journals().await.unwrap() >= 2);
    let failure = engine.resume(result.run_id).result().await.unwrap_err();
    assert_eq!(failure.code, ErrorCode::RunFinished);
    assert_eq!(provider.calls.lock().unwrap().len(), 2, "the model was called again");
    assert_eq!(log.lock().unwrap().len(), 1, "the tool ran again");
    assert_eq!(store.load_messages(&session("c")).await.unwrap().len(), 4, "the transcript changed");
}

#[test]
fn a_long_lived_process_takes_over_runs_of_a_dead_one_by_itself() {
    let clock = keel_core::ManualClock::starting_now();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let options = || EngineOptions { lease_ttl: Duration::from_secs(30), clock: Arc::new(clock.clone()) };
    let log = Arc::new(Mutex::new(Vec::new()));
    let slow_runs = Arc::new(AtomicUsize::new(0));
    let provider = counting(crash_script());
    // The first "process" dies while `slow` runs (after `record` was journaled).
    let first = tokio::runtime::Runtime::new().unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    first.block_on(async {
        let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::clone(&started), Arc::clone(&slow_runs))];
        let engine = Engine::with_options(agent(tools, |_| {}), provider.clone(), store.clone(), options());
        let handle = engine.start(session("s"), Message::user("go")).unwrap();
        started.notified().await;
        let recorded = StepName::Tool { name: "record".into(), call_id: "call_0_0".into() };
        while !store.load_journal(handle.run_id()).await.unwrap().iter().any(|e| e.step == recorded) {
            tokio::task::yield_now().await;
        }
    });
    first.shutdown_timeout(Duration::from_secs(1));
    // Its lease runs out.
    clock.advance(Duration::from_secs(31));
    // A second one, already running its recovery loop, finishes the run without being asked.
    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::default(), Arc::clone(&slow_runs))];
        let engine = Engine::with_options(agent(tools, |_| {}), provider.clone(), store.clone(), options());
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let recovery = engine.recover_periodically(Duration::from_millis(50), move |handle| {
            let done = done_tx.clone();
            tokio::spawn(async move { done.send(handle.result().await) });
        });
        let finished = done_rx.recv().await.expect("a re-driven run");
        assert_eq!(finished.unwrap().text, "finished: recorded b");
        recovery.abort();
    });
    let transcript = second.block_on(store.load_messages(&session("s"))).unwrap();
    assert_eq!(transcript.len(), 6, "the run was not finished: {transcript:#?}");
    assert_eq!(transcript[5].text(), "finished: recorded b");
    assert_eq!(*log.lock().unwrap(), ["a", "b"], "a completed tool ran again");
}

#[tokio::test]
async fn two_processes_cannot_run_one_session_at_once() {
    // Two engines on one store stand for two processes: each has its own in-process bookkeeping,
    // so only the store can refuse the second run.
    let store = Arc::new(MemoryStore::new());
    let slow = vec![MockEntry { delay_ms: 300, text: Some("slow".into()), ..MockEntry::default() }];
    let first = Engine::new(agent(vec![], |_| {}), counting(slow), store.clone());
    let second = Engine::new(agent(vec![], |_| {}), counting(vec![text("quick")]), store.clone());
    let running = first.start(session("shared"), Message::user("one")).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let failure = second.start(session("shared"), Message::user("two")).unwrap().result().await.unwrap_err();
    assert_eq!(failure.code, ErrorCode::SessionBusy, "{failure:?}");
    assert_eq!(running.result().await.unwrap().text, "slow");
    // Once the first is done, the session is free for the other process.
    let done = second.start(session("shared"), Message::user("two")).unwrap().result().await.unwrap();
    assert_eq!(done.stopped, StopReason::Final);
    assert_eq!(store.load_messages(&session("shared")).await.unwrap().len(), 4);
}

#[tokio::test]
async fn an_input_queued_behind_another_processs_run_waits_for_it_and_can_be_cancelled_meanwhile() {
    // Two engines on one store stand for two processes.
    let store = Arc::new(MemoryStore::new());
    let slow = vec![MockEntry { delay_ms: 400, text: Some("slow".into()), ..MockEntry::default() }];
    let first = Engine::new(agent(vec![], |_| {}), counting(slow), store.clone());
    let queue = |a: &mut AgentDef| a.concurrency = keel_core::Concurrency::Queue;
    let second =
        Engine::new(agent(vec![], queue), counting(vec![text("a"), text("b"), text("c")]), store.clone());
    let running = first.start(session("q"), Message::user("one")).unwrap();
    while store.open_runs(Some(&session("q"))).await.unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    // Queued behind the other process's run: admitted at once (a server answers 200), it waits,
    // then runs after it.
    let mut waiting = second.start(session("q"), Message::user("two")).unwrap();
    waiting.admitted().await.unwrap();
    assert_eq!(store.open_runs(Some(&session("q"))).await.unwrap().len(), 1, "it waits, not runs");
    // Another queued input, cancelled while it waits: it gives up at once, unstored.
    let third = Engine::new(agent(vec![], queue), counting(vec![]), store.clone());
    let cancelled = third.start(session("q"), Message::user("never")).unwrap();
    assert_eq!(third.cancel(&session("q"), "test").await.unwrap(), keel_runtime::Cancellation::Cancelled);
    assert_eq!(cancelled.result().await.unwrap_err().code, ErrorCode::SessionBusy);
    assert_eq!(running.result().await.unwrap().text, "slow");
    assert_eq!(waiting.result().await.unwrap().stopped, StopReason::Final);
    let texts: Vec<String> =
        store.load_messages(&session("q")).await.unwrap().iter().map(|m| m.text()).collect();
    assert!(!texts.iter().any(|t| t == "never"), "{texts:?}");
    assert_eq!(texts[..2], ["one", "slow"]);
    assert!(texts.contains(&"two".to_owned()), "{texts:?}");
}

/// Runs `work` on a runtime of its own, then drops the runtime as a crash would: tasks die
/// mid-flight, and only what is in the store stays.
fn in_a_process_that_dies<T>(work: impl std::future::Future<Output = T>) -> T {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let out = runtime.block_on(work);
    runtime.shutdown_timeout(Duration::from_secs(1));
    out
}

#[test]
fn a_compaction_is_a_journaled_step_and_a_resumed_run_never_writes_the_brief_again() {
    // Turn 2 sees 5 messages, more than 4: a brief first; turn 2 then calls `slow`, which hangs
    // (the crash).
    let script = || {
        vec![
            calls(&[("record", json!({"note": "a"}))]),
            calls(&[("record", json!({"note": "b"}))]),
            calls(&[("slow", json!({}))]),
            text("done after {{last_tool_output}}"),
        ]
    };
    let compacting = |a: &mut AgentDef| {
        a.loop_control.compaction = Some(Compaction { max_messages: 4, keep_recent: 2, model: None });
    };
    let clock = keel_core::ManualClock::starting_now();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let options = || EngineOptions { lease_ttl: Duration::from_secs(30), clock: Arc::new(clock.clone()) };
    let log = Arc::new(Mutex::new(Vec::new()));
    let slow_runs = Arc::new(AtomicUsize::new(0));
    let provider = counting(script());
    let started = Arc::new(tokio::sync::Notify::new());
    let run_id = in_a_process_that_dies(async {
        let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::clone(&started), Arc::clone(&slow_runs))];
        let engine =
            Engine::with_options(agent(tools, compacting), provider.clone(), store.clone(), options());
        let handle = engine.start(session("long"), Message::user("go")).unwrap();
        started.notified().await;
        handle.run_id().clone()
    });
    assert_eq!(*provider.briefs.lock().unwrap(), [0], "one brief before the crash");
    let journal = in_a_process_that_dies(store.load_journal(&run_id)).unwrap();
    assert!(journal.iter().any(|e| e.step == StepName::Compact(0)), "the brief is journaled");

    clock.advance(Duration::from_secs(31));
    let (result, events) = in_a_process_that_dies(async {
        let tools = vec![recorder(Arc::clone(&log)), hang_once(Arc::default(), Arc::clone(&slow_runs))];
        let engine =
            Engine::with_options(agent(tools, compacting), provider.clone(), store.clone(), options());
        let mut handle = engine.recover(None).await.unwrap().pop().unwrap();
        let mut events = Vec::new();
        while let Some(event) = handle.next().await {
            events.push(event);
        }
        (handle.result().await.unwrap(), events)
    });
    assert_eq!(result.text, "done after slow done");
    // The second brief is new work (turn 3 would see 5 messages again); the first was not
    // written again.
    assert_eq!(*provider.briefs.lock().unwrap(), [0, 1], "a brief was written twice");
    assert_eq!(*provider.calls.lock().unwrap(), [0, 1, 2, 3], "a turn was paid twice");
    assert!(
        !events.iter().any(|e| matches!(e, Event::TextDelta { delta } if delta.contains("Earlier"))),
        "the brief's text reached observers: {events:?}"
    );
    let messages = in_a_process_that_dies(store.load_messages(&session("long"))).unwrap();
    let briefs = messages.iter().filter(|m| m.summary().is_some()).count();
    assert_eq!(briefs, 2, "a brief stored twice");
}

#[tokio::test]
async fn a_run_s_own_limits_are_stored_with_it_and_a_failure_of_the_model_is_journaled() {
    let store = Arc::new(MemoryStore::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(vec![
        calls(&[("record", json!({"note": "a"}))]),
        calls(&[("record", json!({"note": "b"}))]),
        text("never reached"),
    ]);
    let engine =
        Engine::new(agent(vec![recorder(Arc::clone(&log))], |_| {}), provider.clone(), store.clone());
    let limits = keel_core::LimitOverrides { max_turns: Some(2), ..Default::default() };
    let options = keel_runtime::RunOptions { limits: limits.clone() };
    let result =
        engine.start_with(session("lim"), Message::user("go"), options).unwrap().result().await.unwrap();
    assert_eq!(result.stopped, StopReason::MaxTurns);
    assert_eq!(store.load_run(&result.run_id).await.unwrap().unwrap().limits, limits);

    // A model call that fails for good is journaled with the run's end.
    let failing = MockEntry {
        error: Some(MockFailure { status: 400, message: "bad".into(), times: None, partial: None }),
        ..MockEntry::default()
    };
    let engine = Engine::new(agent(vec![], |_| {}), counting(vec![failing]), store.clone());
    let handle = engine.start(session("fails"), Message::user("go")).unwrap();
    let run_id = handle.run_id().clone();
    let failure = handle.result().await.unwrap_err();
    assert_eq!(failure.code, ErrorCode::ProviderBadRequest);
    let journal = store.load_journal(&run_id).await.unwrap();
    assert!(
        matches!(&journal[..], [e] if e.step == StepName::ModelTurn(0) && matches!(e.record, keel_core::journal::JournalRecord::ModelFailed(_))),
        "{journal:?}"
    );
}

#[tokio::test]
async fn a_new_session_starts_from_the_initial_state_and_a_real_change_is_an_event() {
    #[derive(Deserialize, JsonSchema)]
    struct Item {
        item: String,
    }
    let add =
        function_tool(
            "add_item",
            "Adds to the cart",
            |input: Item| async move { Ok::<_, String>(input.item) },
        );
    // A tool that writes the state through its context.
    let add: Arc<dyn Tool> = Arc::new(StateTool(add));
    let store = Arc::new(MemoryStore::new());
    let provider = counting(vec![
        calls(&[("add_item", json!({"item": "tea"}))]),
        calls(&[("add_item", json!({"item": "tea"}))]),
        text("ok"),
    ]);
    let engine = Engine::new(
        agent(vec![add], |a| a.initial_state = Some(json!({"cart": []}))),
        provider,
        store.clone(),
    );
    assert_eq!(store.load_session_state(&session("cart")).await.unwrap(), None);
    let mut handle = engine.start(session("cart"), Message::user("tea please")).unwrap();
    let mut updates = Vec::new();
    while let Some(event) = handle.next().await {
        if let Event::StateUpdated { state } = event {
            updates.push(state);
        }
    }
    handle.result().await.unwrap();
    // The second call set the same state again: no change, no event.
    assert_eq!(updates, [json!({"cart": ["tea"]})]);
    assert_eq!(store.load_session_state(&session("cart")).await.unwrap(), Some(json!({"cart": ["tea"]})));
}

/// Wraps a tool: appends its output to the state's `cart` unless it is there already.
struct StateTool(Arc<dyn Tool>);

impl Tool for StateTool {
    fn spec(&self) -> &keel_core::ToolSpec {
        self.0.spec()
    }
    fn call<'a>(
        &'a self,
        input: Value,
        ctx: &'a keel_core::ToolContext,
    ) -> BoxFuture<'a, keel_core::ToolOutcome> {
        Box::pin(async move {
            let item = self.0.call(input, ctx).await?;
            let mut state = ctx.state.get();
            let cart = state["cart"].as_array_mut().expect("the initial state has a cart");
            if !cart.contains(&item) {
                cart.push(item.clone());
            }
            ctx.state.replace(state);
            Ok(item)
        })
    }
}

#[tokio::test]
async fn on_step_finish_hears_each_committed_step_once() {
    let store = Arc::new(MemoryStore::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let heard = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(vec![calls(&[("record", json!({"note": "a"}))]), text("done")]);
    let hook_heard = Arc::clone(&heard);
    let engine = Engine::new(
        agent(vec![recorder(Arc::clone(&log))], move |a| {
            a.loop_control.hooks.on_step_finish =
                Some(Arc::new(move |step: &keel_core::StepFinished<'_>| {
                    hook_heard.lock().unwrap().push(step.step.to_string());
                }));
        }),
        provider,
        store.clone(),
    );
    let result = engine.start(session("hook"), Message::user("go")).unwrap().result().await.unwrap();
    assert_eq!(*heard.lock().unwrap(), ["llm:turn:0", "tool:record:call_0_0", "llm:turn:1"]);
    // A replay of the finished run commits nothing new: the hook hears nothing.
    let _ = engine.resume(result.run_id).result().await;
    assert_eq!(heard.lock().unwrap().len(), 3);
}

/// A tool that says where it was called: the id of the Tokio task that polled it first.
fn whereabouts(seen: Arc<Mutex<Vec<Option<tokio::task::Id>>>>) -> Arc<dyn Tool> {
    function_tool("where", "Says which task called it", move |_: Nothing| {
        seen.lock().unwrap().push(tokio::task::try_id());
        async { Ok::<_, String>("here") }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_run_works_in_the_task_that_awaits_it_and_a_started_one_in_its_own() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let provider = counting(vec![calls(&[("where", json!({}))]), text("found {{last_tool_output}}")]);
    let engine = Engine::new(
        agent(vec![whereabouts(Arc::clone(&seen))], |_| {}),
        provider,
        Arc::new(MemoryStore::new()),
    );
    let caller = tokio::spawn(async move {
        let options = keel_runtime::RunOptions::default();
        let inline = engine.start_inline(session("inline"), Message::user("go"), options).unwrap();
        let inline = inline.result().await.unwrap();
        let spawned = engine.start(session("spawned"), Message::user("go")).unwrap().result().await.unwrap();
        (tokio::task::id(), inline, spawned)
    });
    let (caller, inline, spawned) = caller.await.unwrap();
    assert_eq!((inline.text.as_str(), spawned.text.as_str()), ("found here", "found here"));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], Some(caller), "the inline run's tool was not called from the caller's task");
    assert!(seen[1].is_some() && seen[1] != Some(caller), "the started run worked in the caller's task");
}

#[tokio::test]
async fn an_inline_run_moves_only_while_polled_and_ends_all_the_same_once_its_handle_is_dropped() {
    let (started, release) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
    let (on_start, gate) = (Arc::clone(&started), Arc::clone(&release));
    let waits = function_tool("gate", "Waits to be let through", move |_: Nothing| {
        let (on_start, gate) = (Arc::clone(&on_start), Arc::clone(&gate));
        async move {
            on_start.notify_one();
            gate.notified().await;
            Ok::<_, String>("open")
        }
    });
    let store = Arc::new(MemoryStore::new());
    let provider = counting(vec![calls(&[("gate", json!({}))]), text("through: {{last_tool_output}}")]);
    let engine = Engine::new(agent(vec![waits], |_| {}), provider.clone(), store.clone());
    let mut run =
        engine.start_inline(session("g"), Message::user("go"), keel_runtime::RunOptions::default()).unwrap();
    let run_id = run.run_id().clone();

    // Nobody polls it: it has not even been stored.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(store.load_run(&run_id).await.unwrap().is_none(), "an unpolled inline run moved on");

    // Polled, it goes as far as the tool that waits.
    run.admitted().await.unwrap();
    while let Some(event) = run.next().await {
        if matches!(event, Event::ToolStart { .. }) {
            break;
        }
    }
    started.notified().await;
    assert_eq!(store.load_run(&run_id).await.unwrap().unwrap().state, RunState::Running);

    // Dropped mid-tool, it goes on by itself and ends, the tool called once.
    drop(run);
    release.notify_one();
    let mut state = RunState::Running;
    for _ in 0..400 {
        state = store.load_run(&run_id).await.unwrap().unwrap().state;
        if state != RunState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(state, RunState::Done);
    let transcript = store.load_messages(&session("g")).await.unwrap();
    assert_eq!(transcript.last().unwrap().text(), "through: open");
    assert_eq!(provider.calls.lock().unwrap().len(), 2);
    // The session is free for its next input.
    assert!(engine.start(session("g"), Message::user("again")).is_ok());
}

#[test]
fn a_run_handle_can_be_shared_and_sent_between_threads() {
    // An inline run's handle carries the run's work; it stays `Send + Sync` like any handle, so
    // that a task holding a `&RunHandle` across an await is still `Send`.
    fn shareable<T: Send + Sync>() {}
    shareable::<keel_runtime::RunHandle>();
}
