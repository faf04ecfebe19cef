//! Schedules and delayed runs through the real binary: two `keel serve` processes on one store
//! fire each tick once, a process killed right after claiming a tick loses nothing, delayed
//! runs over HTTP and from `keel run --after` start once (also after a restart) and can be
//! cancelled until then, and keel's cron agrees with an independent implementation (cronsim,
//! from PyPI) over random expressions and time zones, DST changes included.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::Store;
use keel_testkit::postgres::ScratchDatabase;
use serde_json::{Value, json};

use crate::serve::{Served, client};
use crate::support::{agent_dir, keel_binary, keel_on_store, repo_root};

const EVERY_SECOND: &str = "name: agent
model: mock
triggers:
  - { type: cron, name: tick, cron: \"* * * * * *\", input: tick }
";

async fn open(url: &str) -> Arc<dyn Store> {
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || keel_store::open(&url)).await.unwrap().unwrap()
}

/// The fires of schedule `tick` in `store`: each tick's session (by its time stamp) with its
/// number of runs and messages.
async fn fires(store: &dyn Store) -> BTreeMap<String, (u64, u64)> {
    let sessions = store.list_sessions(keel_core::SessionFilter::default()).await.unwrap();
    sessions
        .into_iter()
        .filter_map(|s| {
            let stamp = s.id.as_str().strip_prefix("schedule-tick-")?.to_owned();
            Some((stamp, (s.runs, s.messages)))
        })
        .collect()
}

/// The seconds between two stamps `YYYYMMDDTHHMMSSZ`.
fn seconds(stamp: &str) -> i64 {
    let at: jiff::Timestamp = jiff::fmt::strtime::parse("%Y%m%dT%H%M%SZ", stamp)
        .unwrap()
        .to_datetime()
        .unwrap()
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .unwrap()
        .timestamp();
    at.as_second()
}

async fn two_processes_fire_each_tick_once(store_url: &str) {
    let dir = agent_dir(&[("agent.yaml", EVERY_SECOND)]);
    let first = Served::start(dir.path(), store_url, &[]);
    let second = Served::start(dir.path(), store_url, &[]);
    tokio::time::sleep(Duration::from_secs(12)).await;
    drop(first);
    drop(second);
    let store = open(store_url).await;
    // Both processes looked at every tick; each tick's run is stored once.
    let fired = fires(store.as_ref()).await;
    assert!(fired.len() >= 8, "too few ticks fired in 12 s: {fired:?}");
    for (stamp, (runs, _)) in &fired {
        assert_eq!(*runs, 1, "tick {stamp} ran {runs} times: {fired:?}");
    }
    // No tick in between was dropped: the stamps are consecutive seconds. (Not checked over the
    // last two: a fire claimed just before the kill may not have started its run yet, while the
    // next one's did; the crash test covers a claimed fire left behind.)
    let stamps: Vec<i64> = fired.keys().map(|s| seconds(s)).collect();
    for pair in stamps[..stamps.len() - 2].windows(2) {
        assert_eq!(pair[1] - pair[0], 1, "a tick was skipped: {fired:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_on_one_sqlite_file_fire_each_tick_once() {
    let state = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", state.path().join("keel.db").display());
    two_processes_fire_each_tick_once(&url).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_instances_on_one_postgres_database_fire_each_tick_once() {
    let database = ScratchDatabase::create("ticks");
    two_processes_fire_each_tick_once(&database.url).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_process_killed_right_after_claiming_a_tick_loses_no_fire() {
    let dir = agent_dir(&[("agent.yaml", EVERY_SECOND)]);
    let url = format!("sqlite:{}", dir.path().join("keel.db").display());
    // The debug build has the fault points: it aborts (as a SIGKILL would) after the first
    // tick and its fire's delayed run are stored, before the run starts.
    let status = Command::new(keel_binary())
        .args(["serve", dir.path().to_str().unwrap(), "--port", "0", "--store", &url])
        .env("KEEL_FAULT", "after_schedule_claim")
        .env("KEEL_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the fault point did not fire");
    let store = open(&url).await;
    let claimed = store.schedule_last_fire("agent/tick").await.unwrap().expect("a tick was claimed");
    let before = fires(store.as_ref()).await;
    assert!(before.is_empty(), "a run started before the kill: {before:?}");
    drop(store);
    // The next process starts the fire it left behind, once.
    let served = Served::start(dir.path(), &url, &[]);
    let run = keel_core::schedule::ScheduleDef::run_id_for("agent/tick", claimed);
    let deadline = Instant::now() + Duration::from_secs(20);
    let store = open(&url).await;
    loop {
        let record = store.load_run(&run).await.unwrap();
        if record.is_some_and(|r| r.state.is_terminal()) {
            break;
        }
        assert!(Instant::now() < deadline, "the claimed tick's run never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(served);
    let stamp =
        jiff::Timestamp::from_millisecond(claimed as i64).unwrap().strftime("%Y%m%dT%H%M%SZ").to_string();
    assert_eq!(fires(store.as_ref()).await.get(&stamp), Some(&(1, 2)), "the tick ran once, input and answer");
}

const ANSWERING: &str = "model: mock\nmock:\n  script:\n    - text: later it is\n";

/// Polls `GET /runs/<id>` until its state is `state` (30 s at most).
async fn run_state(served: &Served, id: &str, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body: Value =
            client().get(served.url(&format!("/runs/{id}"))).send().await.unwrap().json().await.unwrap();
        if body["state"] == state || Instant::now() > deadline {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delayed_run_starts_once_after_a_restart_and_can_be_cancelled_until_then() {
    let dir = agent_dir(&[("agent.yaml", ANSWERING)]);
    let url = format!("sqlite:{}", dir.path().join("keel.db").display());
    let served = Served::start(dir.path(), &url, &[]);
    let http = client();
    let post = |body: Value| http.post(served.url("/runs")).json(&body).send();
    let stored = post(json!({"sessionId": "later", "input": "what now?", "after": "3s"})).await.unwrap();
    assert_eq!(stored.status(), 202);
    let stored: Value = stored.json().await.unwrap();
    assert_eq!(stored["state"], "waiting");
    let id = stored["runId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("run_at_"), "{stored}");
    let at: jiff::Timestamp = stored["at"].as_str().unwrap().parse().unwrap();
    let cancelled = post(json!({"sessionId": "never", "input": "no", "at": (at + jiff::SignedDuration::from_secs(60)).to_string()}))
        .await
        .unwrap();
    let cancelled: Value = cancelled.json().await.unwrap();
    let cancelled_id = cancelled["runId"].as_str().unwrap().to_owned();
    let deleted = http.delete(served.url(&format!("/runs/{cancelled_id}"))).send().await.unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(deleted.json::<Value>().await.unwrap()["state"], "cancelled");

    // The process dies before the run is due; the next one starts it.
    drop(served);
    let served = Served::start(dir.path(), &url, &[]);
    let done = run_state(&served, &id, "done").await;
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["sessionId"], "later");
    let transcript: Value =
        client().get(served.url("/chat/later")).send().await.unwrap().json().await.unwrap();
    let messages = transcript["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "it ran once: {transcript}");
    assert_eq!(messages[1]["content"][0]["text"], "later it is");
    // Too late to cancel it; the cancelled one never ran.
    let late = client().delete(served.url(&format!("/runs/{id}"))).send().await.unwrap();
    assert_eq!(late.status(), 409);
    assert_eq!(late.json::<Value>().await.unwrap()["error"]["code"], "KEEL_RUN_STARTED");
    let gone = client().get(served.url(&format!("/runs/{cancelled_id}"))).send().await.unwrap();
    assert_eq!(gone.status(), 404);
    let gone: Value = gone.json().await.unwrap();
    let says = gone["error"]["message"].as_str().unwrap();
    assert!(says.contains("never started: it was cancelled by HTTP API"), "{gone}");
    let never = client().get(served.url("/chat/never")).send().await.unwrap();
    assert_eq!(never.status(), 404);

    // Bad requests say what is wrong.
    for (body, says) in [
        (json!({"sessionId": "x", "input": "y"}), "say when"),
        (
            json!({"sessionId": "x", "input": "y", "at": "2026-12-24T09:00:00+01:00", "after": "1m"}),
            "not both",
        ),
        (json!({"sessionId": "x", "input": "y", "after": "soon"}), "not a duration"),
        (json!({"sessionId": "x", "input": "y", "at": "tomorrow"}), "RFC 3339"),
        (json!({"sessionId": "x", "input": "y", "after": "400d"}), "more than a year"),
        (json!({"sessionId": "x", "input": "y", "after": 1.5}), "whole number of seconds"),
    ] {
        let response = client().post(served.url("/runs")).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains(says), "{body}: {error}");
    }
    let unknown = client().get(served.url("/runs/run_at_nothing")).send().await.unwrap();
    assert_eq!(unknown.status(), 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn keel_run_after_stores_a_run_that_keel_serve_starts() {
    let dir = agent_dir(&[("agent.yaml", ANSWERING)]);
    let stored =
        keel_on_store(dir.path(), &["run", ".", "remind me", "--session", "cli-later", "--after", "1s"])
            .output()
            .unwrap();
    assert!(stored.status.success(), "{}", String::from_utf8_lossy(&stored.stderr));
    let id = String::from_utf8(stored.stdout).unwrap().trim().to_owned();
    assert!(id.starts_with("run_at_"), "{id}");
    assert!(String::from_utf8_lossy(&stored.stderr).contains("keel serve"));
    let shown = keel_on_store(dir.path(), &["runs", "show", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&shown.stdout).contains("waiting"), "{shown:?}");
    let url = format!("sqlite:{}", dir.path().join("keel.db").display());
    let served = Served::start(dir.path(), &url, &[]);
    assert_eq!(run_state(&served, &id, "done").await["state"], "done");
    drop(served);
    let shown = keel_on_store(dir.path(), &["runs", "show", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&shown.stdout).contains("done"), "{shown:?}");
    let late = keel_on_store(dir.path(), &["runs", "cancel", &id]).output().unwrap();
    assert!(!late.status.success());
    assert!(String::from_utf8_lossy(&late.stderr).contains("KEEL_RUN_STARTED"));
    // Without a lasting store, nothing could start it: refused.
    let memory = crate::support::keel()
        .args(["run", dir.path().to_str().unwrap(), "x", "--after", "1m"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&memory.stderr).contains("needs a store that outlives"), "{memory:?}");
}

#[test]
fn keel_schedules_list_shows_the_next_fires_in_local_and_utc_time() {
    let dir = agent_dir(&[
        ("agent.yaml", "model: mock\n"),
        (
            "schedules/report.yaml",
            "cron: \"0 9 * * MON\"\ntimezone: America/New_York\ninput: Weekly report.\n",
        ),
    ]);
    let output = crate::support::keel()
        .args(["schedules", "list", dir.path().to_str().unwrap(), "--next", "2", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let line: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(line["name"], "report");
    let next = line["next"].as_array().unwrap();
    assert_eq!(next.len(), 2);
    for fire in next {
        // 09:00 in New York is 13:00 or 14:00 UTC, on a Monday.
        let local = fire["local"].as_str().unwrap();
        assert!(local.contains(" 09:00:00 E"), "{local}");
        let utc: jiff::Timestamp = fire["utc"].as_str().unwrap().parse().unwrap();
        let in_utc = utc.to_zoned_datetime(jiff::tz::TimeZone::UTC);
        assert!([13, 14].contains(&in_utc.hour()), "{utc}");
        let in_new_york = utc.to_zoned_datetime(jiff::tz::TimeZone::get("America/New_York").unwrap());
        assert_eq!(in_new_york.weekday(), jiff::civil::Weekday::Monday);
    }
}

/// Where `scripts/trigger-peers.sh` installed cronsim (installing it the first time).
fn cronsim_python() -> std::path::PathBuf {
    let output = Command::new(repo_root().join("scripts/trigger-peers.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/trigger-peers.sh runs");
    assert!(
        output.status.success(),
        "scripts/trigger-peers.sh failed: the cron test needs python3 -m venv and PyPI"
    );
    Path::new(String::from_utf8(output.stdout).unwrap().trim()).join("bin/python")
}

#[test]
fn keel_cron_agrees_with_cronsim_over_random_expressions_and_time_zones() {
    let python = cronsim_python();
    // DST zones whose clocks move by an hour, away from midnight. Not Australia/Lord_Howe (half
    // an hour), Pacific/Chatham (at 02:45) or America/Santiago (at midnight): around such
    // changes cronsim 2.8 drops valid times (`* 14 * * SUN` in Lord_Howe first fires at 14:30
    // on the day of the change; `* 3 ...` in Chatham skips 03:45-03:59; `* 1 ...` in Santiago
    // skips 01:00 on the day the clock jumps from midnight). keel's unit tests pin those zones
    // (core/src/schedule.rs).
    let zones = ["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata", "Europe/London"];
    let without_dst = ["UTC", "Asia/Kolkata"];
    // Starts near DST changes of those zones, and at random times.
    let mut starts: Vec<i64> = [
        "2026-03-08T06:30:00Z",
        "2026-03-29T00:30:00Z",
        "2026-10-25T00:15:00Z",
        "2026-11-01T05:00:00Z",
        "2026-03-29T00:59:00Z",
        "2026-10-25T01:30:00Z",
        "2026-11-01T06:30:00Z",
        "2026-03-08T07:10:00Z",
    ]
    .iter()
    .map(|t| t.parse::<jiff::Timestamp>().unwrap().as_second())
    .collect();
    // A new seed each run, so that runs over time cover more expressions; a failure names it.
    let seed = fastrand::u64(..);
    let mut random = fastrand::Rng::with_seed(seed);
    for _ in 0..8 {
        starts.push(1_767_225_600 + random.i64(0..365 * 86_400));
    }
    let field = |random: &mut fastrand::Rng, low: u32, high: u32, names: &[&str]| -> String {
        match random.u32(0..8) {
            0 | 1 => "*".into(),
            2 => format!("*/{}", random.u32(2..=((high - low) / 2).max(2))),
            3 => {
                let a = random.u32(low..=high);
                let b = random.u32(a..=high);
                format!("{a}-{b}")
            }
            4 => {
                let a = random.u32(low..=high);
                let b = random.u32(low..=high);
                format!("{},{}", a.min(b), a.max(b))
            }
            5 if !names.is_empty() => names[random.usize(0..names.len())].to_owned(),
            6 => {
                // Not `a-a/n`: cronsim reads it as `a/n` (a to the end), cron as just `a`.
                let a = random.u32(low..high);
                format!("{a}-{high}/{}", random.u32(2..=4))
            }
            _ => random.u32(low..=high).to_string(),
        }
    };
    const DAYS: &[&str] = &["MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN"];
    const MONTHS: &[&str] = &["JAN", "MAR", "JUN", "OCT", "NOV", "DEC"];
    let mut cases = Vec::new();
    for index in 0..1500 {
        let mut expression = format!(
            "{} {} {} {} {}",
            field(&mut random, 0, 59, &[]),
            field(&mut random, 0, 23, &[]),
            field(&mut random, 1, 28, &[]),
            field(&mut random, 1, 12, MONTHS),
            field(&mut random, 0, 6, DAYS),
        );
        if index % 5 == 0 {
            expression = format!("{} {expression}", field(&mut random, 0, 59, &[]));
        }
        // Where a DST change skips a time, keel (croner, the Open Cron Pattern Specification)
        // fires at the next valid time only for a single time of day (`30 2 * * *`), while
        // cronsim (Debian's cron) does so for any second, minute and hour fields that do not
        // start with `*` (`0,30 2 * * *` too): such "several times" expressions are compared
        // in zones without DST. So are expressions with a seconds field: in a repeated hour
        // cronsim fires `41 2 1 1 11 SAT` on both passes (a 5-field `2 1 1 11 *` on the first
        // only), while keel fires every fixed time on its first pass only.
        let several_times = expression
            .split_whitespace()
            .rev()
            .skip(3)
            .any(|time| !time.starts_with('*') && time.contains([',', '-', '/']));
        let with_seconds = expression.split_whitespace().count() == 6;
        let zone = if several_times || with_seconds {
            without_dst[random.usize(0..without_dst.len())]
        } else {
            zones[random.usize(0..zones.len())]
        };
        let start = starts[random.usize(0..starts.len())];
        cases.push((expression, zone, start));
    }
    for macro_name in ["@hourly", "@daily", "@weekly", "@monthly", "@yearly"] {
        for zone in ["Europe/Paris", "America/New_York"] {
            cases.push((macro_name.to_owned(), zone, starts[2]));
        }
    }
    let input: Vec<Value> =
        cases.iter().map(|(expression, zone, start)| json!([expression, zone, start, 5])).collect();
    let mut child = Command::new(python)
        .arg(repo_root().join("tests/peers/cron_oracle.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        child.stdin.as_mut().unwrap(),
        serde_json::to_string(&input).unwrap().as_bytes(),
    )
    .unwrap();
    drop(child.stdin.take());
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    let expected: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    let mut compared = 0;
    for ((expression, zone, start), want) in cases.iter().zip(&expected) {
        let schedule = keel_core::schedule::CronSchedule::parse(expression, Some(zone))
            .unwrap_or_else(|error| panic!("{expression} in {zone}: {error} (seed {seed})"));
        let mut got = Vec::new();
        let mut after = (*start as u64) * 1000;
        for _ in 0..want.as_array().map_or(0, Vec::len) {
            let Some(next) = schedule.next_after(after) else { break };
            got.push(json!(next / 1000));
            after = next;
        }
        assert_eq!(&Value::Array(got), want, "`{expression}` in {zone} after {start} (seed {seed})");
        compared += 1;
    }
    assert_eq!(compared, cases.len());
}

#[test]
fn a_rust_agent_refuses_two_schedules_of_one_name() {
    let schedule = |cron: &str| keel::ScheduleDef {
        name: "daily".into(),
        cron: keel::CronSchedule::parse(cron, Some("Europe/Paris")).unwrap(),
        input: "go".into(),
        session: None,
        missed: keel::Missed::Latest,
    };
    let built = keel::Agent::builder()
        .model("mock")
        .schedule(schedule("@daily"))
        .schedule(schedule("@hourly"))
        .build();
    let Err(failure) = built else { panic!("two schedules of one name were accepted") };
    assert!(failure.message.contains("two schedules are named `daily`"), "{failure:?}");
}
