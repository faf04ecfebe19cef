//! Several `keel serve` instances on one PostgreSQL database (each test creates and drops its
//! own): one run per session across instances, a decision or a cancellation posted to any
//! instance, observers on one instance of runs on another, and a run whose instance was killed
//! finished by another without repeating a step.

use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_testkit::postgres::ScratchDatabase;
use serde_json::{Value, json};

use crate::serve::{APPROVAL_AGENT, Served, Sse, client, error_of, parse_sse, read_sse};
use crate::support::agent_dir;

const SLOW_AGENT: &str = "model: mock
mock:
  script:
    - { delay_ms: 4000, text: 'Finally.' }
";

/// An agent whose tool appends a line to `counted.txt`, then answers after `delay_ms`.
fn counting_agent(delay_ms: u64) -> tempfile::TempDir {
    agent_dir(&[
        (
            "agent.yaml",
            &format!(
                "model: mock
tools: [count]
mock:
  script:
    - tool_calls: [{{ name: count, input: {{}} }}]
    - {{ delay_ms: {delay_ms}, text: 'Counted {{{{last_tool_output}}}}.' }}
"
            ),
        ),
        (
            "tools/count.toml",
            "description = \"Counts\"\ncommand = [\"sh\", \"-c\", \"echo once >> counted.txt; echo one\"]\n",
        ),
    ])
}

/// Waits until the counting agent's tool has run (its line is written), and returns its file.
async fn tool_ran(dir: &std::path::Path) -> std::path::PathBuf {
    let counted = dir.join("counted.txt");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !counted.exists() {
        assert!(Instant::now() < deadline, "the tool never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    counted
}

/// Three instances of one agent on one database.
fn instances(agent: &std::path::Path, database: &ScratchDatabase) -> Vec<Served> {
    (0..3).map(|_| Served::start(agent, &database.url, &[])).collect()
}

/// Polls `GET /chat/<session>` on `server` until `done` says so (or 30 s pass).
async fn transcript_when(server: &Served, session: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response = client().get(server.url(&format!("/chat/{session}"))).send().await.unwrap();
        let transcript: Value = response.json().await.unwrap();
        if done(&transcript) || Instant::now() > deadline {
            return transcript;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A turn of the approval agent on `server` in `session`, to its pause: its stream.
async fn paused_for_approval(server: &Served, session: &str) -> Vec<Sse> {
    let request = client().post(server.url("/chat")).json(&json!({"sessionId": session, "input": "day?"}));
    read_sse(request.send().await.unwrap()).await
}

/// The id of the approval a paused stream asked for.
fn approval_id(paused: &[Sse]) -> String {
    let requested = paused.iter().find(|m| m.event.is_none() && m.kind() == "approval.requested");
    requested.expect("the run asked for an approval").json()["approvalId"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_session_across_instances_runs_one_turn_at_a_time() {
    let database = ScratchDatabase::create("sessions");
    let dir = agent_dir(&[("agent.yaml", SLOW_AGENT)]);
    let servers = instances(dir.path(), &database);
    let http = client();
    let starts = servers.iter().map(|server| {
        let request = http.post(server.url("/chat")).json(&json!({"sessionId": "shared", "input": "go"}));
        async move { request.send().await.unwrap() }
    });
    let responses = futures::future::join_all(starts).await;
    let mut streams = Vec::new();
    let mut busy = 0;
    for response in responses {
        if response.status() == 200 {
            streams.push(response);
        } else {
            assert_eq!(error_of(response).await, (409, "KEEL_SESSION_BUSY".to_owned()));
            busy += 1;
        }
    }
    assert_eq!((streams.len(), busy), (1, 2), "one instance runs the turn, the others refuse");
    let events = read_sse(streams.pop().unwrap()).await;
    assert!(events.iter().any(|e| e.event.is_none() && e.kind() == "run.done"), "{events:?}");
    // Every instance sees the one turn.
    for server in &servers {
        let transcript =
            transcript_when(server, "shared", |t| t["messages"].as_array().is_some_and(|m| m.len() == 2))
                .await;
        assert_eq!(transcript["messages"][1]["content"][0]["text"], "Finally.", "{transcript}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_or_a_cancellation_reaches_the_run_from_any_instance() {
    let database = ScratchDatabase::create("decide");
    let dir = agent_dir(&[("agent.yaml", APPROVAL_AGENT)]);
    let servers = instances(dir.path(), &database);
    let http = client();
    // Paused on instance 0, decided on instance 1: instance 1 continues it.
    let paused = paused_for_approval(&servers[0], "ask").await;
    let approval = approval_id(&paused);
    let continued = read_sse(
        http.post(servers[1].url(&format!("/chat/ask/approvals/{approval}")))
            .json(&json!({"approved": true}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let done = continued.iter().find(|m| m.event.is_none() && m.kind() == "run.done").unwrap().json();
    assert!(done["text"].as_str().unwrap().starts_with("Today is "), "{done}");
    // A second decision, on instance 2, is refused: it was decided already.
    let again = http
        .post(servers[2].url(&format!("/chat/ask/approvals/{approval}")))
        .json(&json!({"approved": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(again).await, (404, "KEEL_NOT_PENDING".to_owned()));

    // Another pause, on instance 0, cancelled from instance 2.
    paused_for_approval(&servers[0], "stop").await;
    let cancelled = http.delete(servers[2].url("/chat/stop/run")).send().await.unwrap();
    assert_eq!(cancelled.status(), 200);
    assert_eq!(cancelled.json::<Value>().await.unwrap()["cancelled"], true);
    let transcript =
        transcript_when(&servers[1], "stop", |t| t["pending"].as_array().is_some_and(Vec::is_empty)).await;
    assert_eq!(transcript["pending"], json!([]), "{transcript}");
    // The session takes a new turn on any instance.
    let next =
        http.post(servers[1].url("/chat")).json(&json!({"sessionId": "stop", "input": "again"})).send().await;
    assert_eq!(next.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_instance_was_killed_is_finished_by_another_without_repeating_a_step() {
    let database = ScratchDatabase::create("killed");
    let dir = counting_agent(3000);
    let mut servers = instances(dir.path(), &database);
    let http = client();
    let stream = http
        .post(servers[0].url("/chat"))
        .json(&json!({"sessionId": "k", "input": "count"}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // The tool step is committed, and the instance is in its second model call: kill it.
    let counted = tool_ran(dir.path()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut killed = servers.remove(0);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    drop(stream);
    // Another instance takes it over (its periodic recovery: the dead process is provably gone
    // on this machine) and finishes it from the journal.
    let transcript =
        transcript_when(&servers[1], "k", |t| t["messages"].as_array().is_some_and(|m| m.len() == 4)).await;
    let messages = transcript["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 4, "{transcript:#}");
    assert_eq!(messages[3]["content"][0]["text"], "Counted one.");
    assert_eq!(std::fs::read_to_string(&counted).unwrap(), "once\n", "the committed tool step ran again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_mid_tool_is_finished_by_another_instance_with_one_completed_call() {
    let database = ScratchDatabase::create("killed_tool");
    // The tool notes its start and its idempotency key, works for 3 s, then notes its end.
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock
tools: [work]
mock:
  script:
    - tool_calls: [{ name: work, input: {} }]
    - text: 'Worked: {{last_tool_output}}.'
",
        ),
        (
            "tools/work.toml",
            "description = \"Works\"\ncommand = [\"sh\", \"-c\", \"echo start >> calls.txt; echo $KEEL_IDEMPOTENCY_KEY >> keys.txt; sleep 3; echo end >> calls.txt; echo done\"]\n",
        ),
    ]);
    let mut servers = instances(dir.path(), &database);
    let http = client();
    let mut observer = LiveSse::new(http.get(servers[2].url("/chat/t/events")).send().await.unwrap());
    let stream = http
        .post(servers[0].url("/chat"))
        .json(&json!({"sessionId": "t", "input": "work"}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // The tool is running on instance 0: kill the instance (its tool dies with it).
    let calls = dir.path().join("calls.txt");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !calls.exists() {
        assert!(Instant::now() < deadline, "the tool never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut killed = servers.remove(0);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    drop(stream);

    // Another instance takes the run over and calls the tool again (its call never completed),
    // with the same idempotency key; the observer on a third sees the run end.
    let events = observer.until_done().await;
    let done = events.last().unwrap().json();
    assert_eq!(done["text"], "Worked: done.", "{events:?}");
    let transcript =
        transcript_when(&servers[0], "t", |t| t["messages"].as_array().is_some_and(|m| m.len() == 4)).await;
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 4, "one call, one result: {transcript:#}");
    assert_eq!(
        std::fs::read_to_string(&calls).unwrap(),
        "start\nstart\nend\n",
        "killed once, completed once"
    );
    let keys = std::fs::read_to_string(dir.path().join("keys.txt")).unwrap();
    let keys: Vec<&str> = keys.lines().collect();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "the repeated call carries the same idempotency key");
    assert!(keys[0].ends_with(":tool:work:call_0_0"), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_continued_by_the_cli_reaches_observers_on_the_instances() {
    let database = ScratchDatabase::create("cli_decides");
    let dir = agent_dir(&[("agent.yaml", APPROVAL_AGENT)]);
    let servers = instances(dir.path(), &database);
    let http = client();
    let paused = paused_for_approval(&servers[0], "c").await;
    let last_id = paused.iter().rev().find_map(|e| e.id.clone()).unwrap();
    let approval = approval_id(&paused);
    let mut observer = LiveSse::new(
        http.get(servers[1].url("/chat/c/events")).header("last-event-id", &last_id).send().await.unwrap(),
    );
    // The CLI decides and drives the rest of the run in its own process.
    let agent = dir.path().to_str().unwrap().to_owned();
    let decided = tokio::task::spawn_blocking({
        let (dir, url) = (dir.path().to_owned(), database.url.clone());
        move || {
            crate::support::keel_with_store(
                &dir,
                &["approvals", "approve", &approval, "--agent", &agent],
                &url,
            )
            .output()
            .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(decided.status.success(), "{decided:?}");
    let events = observer.until_done().await;
    let kinds: Vec<String> = events.iter().map(Sse::kind).collect();
    assert!(kinds.contains(&"tool.done".to_owned()), "{kinds:?}");
    let done = events.last().unwrap().json();
    assert!(done["text"].as_str().unwrap().starts_with("Today is "), "{done}");
    let id = |e: &Sse| e.id.as_deref().unwrap().parse::<u64>().unwrap();
    assert!(id(&events[0]) > last_id.parse::<u64>().unwrap(), "numbered after the pause");
    assert!(
        !kinds.contains(&"approval.requested".to_owned()),
        "nothing from before the pause again: {kinds:?}"
    );
}

/// A TCP proxy in front of PostgreSQL that the test can cut: while cut, it drops every open
/// connection and every new one, as a database restart or a network cut would.
struct CuttableProxy {
    port: u16,
    cut: tokio::sync::watch::Sender<bool>,
}

impl CuttableProxy {
    async fn start(upstream: u16) -> CuttableProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { return };
                if *watch.borrow() {
                    continue;
                }
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = watch.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        CuttableProxy { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waits_out_a_database_outage_and_finishes_with_nothing_lost() {
    let database = ScratchDatabase::create("outage");
    let upstream: u16 = {
        let after_host = database.url.rsplit_once('@').unwrap().1;
        after_host.split(['/', ':']).nth(1).unwrap().parse().unwrap()
    };
    let proxy = CuttableProxy::start(upstream).await;
    let through_proxy = database.url.replacen(&format!(":{upstream}/"), &format!(":{}/", proxy.port), 1);
    let dir = counting_agent(1500);
    let server = Served::start(dir.path(), &through_proxy, &[]);
    let other = Served::start(dir.path(), &through_proxy, &[]);
    let http = client();
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().status(), 200);
    // An observer on another instance, whose connections to the database break too.
    let mut observer = LiveSse::new(http.get(other.url("/chat/o/events")).send().await.unwrap());
    let stream = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "o", "input": "count"}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let counted = tool_ran(dir.path()).await;
    // The database goes away while the model answers; the answer's commit waits for it.
    proxy.set_cut(true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let health = http.get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 503, "the store is down");
    let body: Value = health.json().await.unwrap();
    assert!(!body["error"]["message"].as_str().unwrap().contains(":postgres@"), "{body}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set_cut(false);
    let events = read_sse(stream).await;
    let done = events.iter().find(|e| e.event.is_none() && e.kind() == "run.done");
    assert!(done.is_some(), "the run did not finish: {events:?}");
    assert_eq!(done.unwrap().json()["text"], "Counted one.");
    let events: Vec<Sse> = events.into_iter().filter(|e| e.event.is_none()).collect();
    assert_eq!(observer.until_done().await, events, "the observer elsewhere saw all of it, once, in order");
    let transcript =
        transcript_when(&server, "o", |t| t["messages"].as_array().is_some_and(|m| m.len() == 4)).await;
    assert_eq!(transcript["messages"].as_array().unwrap().len(), 4, "{transcript}");
    assert_eq!(std::fs::read_to_string(&counted).unwrap(), "once\n");
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().status(), 200);
    // The model's answer streamed while the database was away: its events waited, and are
    // stored now.
    let metrics = http.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("keel_events_waiting 0\n"), "{metrics}");
    let failures: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("keel_event_append_failures_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no append failure counter: {metrics}"));
    assert!(failures > 0, "appends failed while the database was away: {metrics}");
}

/// An SSE response read message by message, as it comes.
struct LiveSse {
    stream: futures::stream::BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buffer: String,
    ready: std::collections::VecDeque<Sse>,
}

impl LiveSse {
    fn new(response: reqwest::Response) -> LiveSse {
        assert_eq!(response.status(), 200);
        LiveSse {
            stream: response.bytes_stream().map(|chunk| chunk.map(|b| b.to_vec())).boxed(),
            buffer: String::new(),
            ready: Default::default(),
        }
    }

    /// The next message that is an event (not `event: done`), within 20 s.
    async fn next_event(&mut self) -> Sse {
        loop {
            while let Some(message) = self.ready.pop_front() {
                if message.event.is_none() {
                    return message;
                }
            }
            let chunk = tokio::time::timeout(Duration::from_secs(20), self.stream.next())
                .await
                .expect("no event within 20 s")
                .expect("the stream ended")
                .unwrap();
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
            self.ready.extend(parse_sse(&mut self.buffer));
        }
    }

    /// Events up to and including `run.done`.
    async fn until_done(&mut self) -> Vec<Sse> {
        let mut events = Vec::new();
        loop {
            let event = self.next_event().await;
            let done = event.kind() == "run.done";
            events.push(event);
            if done {
                return events;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_on_any_instance_see_a_run_on_another_live_and_resume_on_a_third() {
    let database = ScratchDatabase::create("observe");
    let dir = counting_agent(1500);
    let servers = instances(dir.path(), &database);
    let http = client();
    // Observers on instances 1 and 2 before the run starts on instance 0.
    let mut watcher = LiveSse::new(http.get(servers[1].url("/chat/w/events")).send().await.unwrap());
    let mut leaver = LiveSse::new(http.get(servers[2].url("/chat/w/events")).send().await.unwrap());
    let run = http
        .post(servers[0].url("/chat"))
        .json(&json!({"sessionId": "w", "input": "count"}))
        .send()
        .await
        .unwrap();
    assert_eq!(run.status(), 200);
    let run_finished = tokio::spawn(async move {
        let events = read_sse(run).await;
        (events, Instant::now())
    });

    // Live: the tool's events reach instance 1 while the model's 1.5 s answer is still to come.
    let mut watched = Vec::new();
    while watched.last().is_none_or(|e: &Sse| e.kind() != "tool.done") {
        watched.push(watcher.next_event().await);
    }
    let tool_seen_at = Instant::now();
    // The leaver (on instance 2) reads two events, goes away, and comes back to instance 1 with
    // the last id it saw.
    let left = vec![leaver.next_event().await, leaver.next_event().await];
    drop(leaver);
    watched.extend(watcher.until_done().await);
    let (run_events, finished_at) = run_finished.await.unwrap();
    let run_events: Vec<Sse> = run_events.into_iter().filter(|e| e.event.is_none()).collect();
    assert!(
        finished_at.duration_since(tool_seen_at) > Duration::from_millis(1000),
        "the observer on another instance saw the tool's events only {:?} before the run ended",
        finished_at.duration_since(tool_seen_at)
    );
    assert_eq!(
        watched, run_events,
        "the observer on instance 1 saw the run's events, ids included, in order"
    );
    let kinds: Vec<String> = watched.iter().map(Sse::kind).collect();
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
            "usage",
            "run.done"
        ],
    );

    let resumed_from = left[1].id.clone().unwrap();
    let mut back = LiveSse::new(
        http.get(servers[1].url("/chat/w/events"))
            .header("last-event-id", &resumed_from)
            .send()
            .await
            .unwrap(),
    );
    let mut rejoined = left;
    rejoined.extend(back.until_done().await);
    assert_eq!(rejoined, run_events, "resumed on another instance without a gap or a duplicate");

    // The next turn runs on instance 2: the same observers see it, numbered after the first.
    let next = http
        .post(servers[2].url("/chat"))
        .json(&json!({"sessionId": "w", "input": "again"}))
        .send()
        .await
        .unwrap();
    let next_events: Vec<Sse> = read_sse(next).await.into_iter().filter(|e| e.event.is_none()).collect();
    assert_eq!(watcher.until_done().await, next_events);
    assert_eq!(back.until_done().await, next_events);
    let id = |e: &Sse| e.id.as_deref().unwrap().parse::<u64>().unwrap();
    assert!(id(&next_events[0]) > id(run_events.last().unwrap()), "ids go on across runs and instances");
}
