//! Trigger tests: schedules and delayed runs against the memory store and a manual clock, so
//! that hours of downtime pass at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::schedule::{CronSchedule, Missed, ScheduleDef};
use keel_core::{
    AgentDef, DelayedRun, DelayedState, Limits, ManualClock, Message, MockEntry, MockScript, RetryPolicy,
    RunId, SessionId, Store, ToolSet,
};
use keel_providers::MockProvider;
use keel_runtime::{Engine, EngineOptions, RunHandle, Triggers};
use keel_store::MemoryStore;

/// 2026-12-01T09:00:30Z.
const START_MS: u64 = 1_796_115_630_000;

fn schedule(name: &str, cron: &str, missed: Missed) -> ScheduleDef {
    ScheduleDef {
        name: name.into(),
        cron: CronSchedule::parse(cron, None).unwrap(),
        input: format!("fire of {name}"),
        session: None,
        missed,
    }
}

struct Setup {
    clock: ManualClock,
    store: Arc<dyn Store>,
    engine: Engine,
    started: Arc<Mutex<Vec<RunHandle>>>,
}

fn setup(schedules: Vec<ScheduleDef>) -> Setup {
    let clock = ManualClock::at(START_MS);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let agent = AgentDef {
        name: "watcher".into(),
        description: None,
        instructions: String::new(),
        model: "mock".into(),
        tools: ToolSet::new(Vec::new()).unwrap(),
        limits: Limits::default(),
        retry: RetryPolicy::default(),
        output_schema: None,
        stop_on_tools: Vec::new(),
        concurrency: keel_core::Concurrency::Queue,
        approval_timeout: AgentDef::DEFAULT_APPROVAL_TIMEOUT,
        schedules,
        channels: Vec::new(),
        loop_control: Default::default(),
        memory: Default::default(),
        initial_state: None,
    };
    let entries = vec![MockEntry { text: Some("done".into()), delay_ms: 200, ..MockEntry::default() }];
    let provider = Arc::new(MockProvider::new(MockScript::new(entries)));
    let options = EngineOptions { clock: Arc::new(clock.clone()), ..EngineOptions::default() };
    let engine = Engine::with_options(Arc::new(agent), provider, Arc::clone(&store), options);
    Setup { clock, store, engine, started: Arc::default() }
}

impl Setup {
    fn triggers(&self) -> Triggers {
        let started = Arc::clone(&self.started);
        Triggers::new(&self.engine, move |handle| started.lock().unwrap().push(handle))
    }

    /// The runs started since the last call, each waited for: (session, input).
    async fn finished(&self) -> Vec<(String, String)> {
        let handles: Vec<RunHandle> = std::mem::take(&mut *self.started.lock().unwrap());
        let mut out = Vec::new();
        for handle in handles {
            let run = handle.run_id().clone();
            handle.result().await.unwrap();
            let record = self.store.load_run(&run).await.unwrap().unwrap();
            out.push((record.session_id.to_string(), record.input.text()));
        }
        out
    }

    fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

/// Lets spawned starts reach the store.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_schedule_fires_each_tick_once_and_a_new_one_does_not_fire_for_the_past() {
    let setup = setup(vec![schedule("minutely", "0 * * * * *", Missed::Latest)]);
    let mut triggers = setup.triggers();
    // 09:00:30: the 09:00 tick was before the schedule existed.
    triggers.pass().await;
    settle().await;
    assert!(setup.finished().await.is_empty());
    setup.advance(Duration::from_secs(30));
    triggers.pass().await;
    triggers.pass().await;
    settle().await;
    assert_eq!(
        setup.finished().await,
        [("schedule-minutely-20261201T090100Z".to_owned(), "fire of minutely".to_owned())]
    );
    // A second process sharing the store (a fresh loop) does not fire that tick again.
    let mut other = setup.triggers();
    other.pass().await;
    settle().await;
    assert!(setup.finished().await.is_empty());
    assert_eq!(triggers.stats().schedules(), [("minutely".to_owned(), 1, 0)]);
}

#[tokio::test]
async fn after_downtime_the_latest_missed_tick_fires_once_or_none_with_skip() {
    let setup = setup(vec![
        schedule("latest", "*/10 * * * *", Missed::Latest),
        schedule("skipped", "*/10 * * * *", Missed::Skip),
    ]);
    setup.triggers().pass().await;
    // Three hours and five minutes of downtime: 18 ticks of each schedule went by.
    setup.advance(Duration::from_secs(3 * 3600 + 5 * 60));
    let mut triggers = setup.triggers();
    triggers.pass().await;
    settle().await;
    assert_eq!(
        setup.finished().await,
        [("schedule-latest-20261201T120000Z".to_owned(), "fire of latest".to_owned())]
    );
    let stats = triggers.stats().schedules();
    assert_eq!(stats, [("latest".to_owned(), 1, 17), ("skipped".to_owned(), 0, 18)]);
    // Both go on with their next tick.
    setup.advance(Duration::from_secs(5 * 60));
    triggers.pass().await;
    settle().await;
    let mut fired = setup.finished().await;
    fired.sort();
    assert_eq!(
        fired,
        [
            ("schedule-latest-20261201T121000Z".to_owned(), "fire of latest".to_owned()),
            ("schedule-skipped-20261201T121000Z".to_owned(), "fire of skipped".to_owned()),
        ]
    );
}

#[tokio::test]
async fn a_delayed_run_waits_for_its_time_for_a_busy_session_and_not_after_a_cancel() {
    let setup = setup(Vec::new());
    let mut triggers = setup.triggers();
    let session = SessionId::new("later").unwrap();
    let run = DelayedRun {
        run_id: RunId::delayed("test-later"),
        session_id: session.clone(),
        input: Message::user("in ten minutes"),
        due_ms: START_MS + 600_000,
        source: "test".into(),
    };
    setup.store.schedule_run(&run).await.unwrap();
    triggers.pass().await;
    settle().await;
    assert!(setup.finished().await.is_empty(), "started before its time");

    // At its time, its session is busy with a run that waits for a while.
    setup.advance(Duration::from_secs(600));
    let busy = setup.engine.start(session.clone(), Message::user("first")).unwrap();
    triggers.pass().await;
    settle().await;
    assert!(setup.started.lock().unwrap().is_empty(), "started while its session was busy");
    let record = setup.store.delayed_run(&run.run_id).await.unwrap().unwrap();
    assert_eq!(record.state, DelayedState::Waiting);
    assert!(record.note.unwrap().contains("already has a run in flight"));
    busy.result().await.unwrap();
    // Tried again once the retry time passed.
    setup.advance(Duration::from_secs(6));
    triggers.pass().await;
    settle().await;
    assert_eq!(setup.finished().await, [("later".to_owned(), "in ten minutes".to_owned())]);
    assert_eq!(setup.store.delayed_run(&run.run_id).await.unwrap().unwrap().state, DelayedState::Started);
    assert_eq!(triggers.stats().delayed_deferred.load(std::sync::atomic::Ordering::Relaxed), 1);

    // Cancelled in time: never started.
    let cancelled =
        DelayedRun { run_id: RunId::delayed("test-cancelled"), due_ms: START_MS + 700_000, ..run };
    setup.store.schedule_run(&cancelled).await.unwrap();
    setup.store.cancel_delayed_run(&cancelled.run_id, "test").await.unwrap();
    setup.advance(Duration::from_secs(3600));
    triggers.pass().await;
    settle().await;
    assert!(setup.finished().await.is_empty());
    assert!(setup.store.load_run(&cancelled.run_id).await.unwrap().is_none());
}

#[tokio::test]
async fn a_loop_that_wakes_late_still_fires_every_tick_in_turn() {
    let setup = setup(vec![schedule("secondly", "* * * * * *", Missed::Skip)]);
    let mut triggers = setup.triggers();
    triggers.pass().await;
    // Four seconds late (a stalled process, a busy machine): still on time, none is dropped.
    setup.advance(Duration::from_secs(4));
    triggers.pass().await;
    settle().await;
    let mut fired: Vec<String> = setup.finished().await.into_iter().map(|(session, _)| session).collect();
    fired.sort();
    assert_eq!(
        fired,
        [
            "schedule-secondly-20261201T090031Z",
            "schedule-secondly-20261201T090032Z",
            "schedule-secondly-20261201T090033Z",
            "schedule-secondly-20261201T090034Z",
        ]
    );
    assert_eq!(triggers.stats().schedules(), [("secondly".to_owned(), 4, 0)]);
}
