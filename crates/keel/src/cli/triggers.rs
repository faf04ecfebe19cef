//! `keel schedules list`, `keel runs show|cancel` and `keel run --after|--at`: an agent's cron
//! schedules, and delayed runs in a store.

use keel::{RunId, SessionId};
use keel_core::{DelayedRun, DelayedState, Message};

use super::{RunArgs, RunsCommand, SchedulesCommand, exit};

pub(crate) fn schedules(command: SchedulesCommand) -> std::io::Result<u8> {
    let SchedulesCommand::List { agent, next, json } = command;
    let options = super::load_options();
    let loaded = keel_spec::load(&agent, &options);
    for diagnostic in &loaded.diagnostics {
        eprintln!("{diagnostic}");
    }
    let Some(spec) = loaded.spec else {
        eprintln!("the agent has errors; `keel check {}` lists them", agent.display());
        return Ok(exit::INVALID_AGENT);
    };
    if spec.schedules.is_empty() && !json {
        println!("{} has no schedules (add `triggers:` to its spec, or files to schedules/)", spec.name);
    }
    let now = keel::Clock::now_ms(&keel_core::SystemClock);
    for schedule in &spec.schedules {
        let mut fires = Vec::new();
        let mut after = now;
        for _ in 0..next {
            let Some(at) = schedule.cron.next_after(after) else { break };
            fires.push(at);
            after = at;
        }
        let session =
            schedule.session.as_ref().map_or_else(|| "a new one per fire".to_owned(), |s| s.to_string());
        if json {
            let line = serde_json::json!({
                "name": schedule.name,
                "cron": schedule.cron.expression(),
                "timezone": schedule.cron.timezone(),
                "session": schedule.session.as_ref().map(SessionId::as_str),
                "missed": match schedule.missed { keel_core::schedule::Missed::Latest => "latest", keel_core::schedule::Missed::Skip => "skip" },
                "next": fires.iter().map(|at| serde_json::json!({
                    "local": schedule.cron.local_time(*at),
                    "utc": keel_core::clock::rfc3339(*at),
                })).collect::<Vec<_>>(),
            });
            println!("{line}");
            continue;
        }
        println!(
            "{}  `{}` in {}  (session: {session})",
            schedule.name,
            schedule.cron.expression(),
            schedule.cron.timezone()
        );
        if fires.is_empty() {
            println!("  never fires again");
        }
        for at in fires {
            println!("  {}  =  {}", schedule.cron.local_time(at), keel_core::clock::rfc3339(at));
        }
    }
    Ok(exit::OK)
}

/// `keel run AGENT INPUT --after D | --at T`: stores the run for later.
pub(crate) fn run_later(args: &RunArgs) -> std::io::Result<u8> {
    let session = match SessionId::new(&args.session) {
        Ok(session) => session,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(2);
        }
    };
    if args.store == "memory" {
        eprintln!(
            "error[KEEL_REQUEST_INVALID]: a delayed run needs a store that outlives this command: give \
             --store sqlite:<path> or postgres://... (the one `keel serve` uses)"
        );
        return Ok(2);
    }
    let input = args.input.clone().unwrap_or_default();
    let now = keel::Clock::now_ms(&keel_core::SystemClock);
    let due_ms = match keel_runtime::triggers::due_time(args.at.as_deref(), args.after.as_deref(), now) {
        Ok(due) => due,
        Err(why) => {
            eprintln!("error[KEEL_REQUEST_INVALID]: {why}");
            return Ok(2);
        }
    };
    super::run_async(async {
        let Some(store) = super::open_store(&args.store).await else { return Ok(exit::INVALID_AGENT) };
        let run = DelayedRun {
            run_id: keel_runtime::new_delayed_run_id(),
            session_id: session.clone(),
            input: Message::user(input),
            due_ms,
            source: keel::who("keel run --after"),
        };
        match store.schedule_run(&run).await {
            Ok(_) if args.json => {
                let line = serde_json::json!({
                    "runId": run.run_id.as_str(), "sessionId": session.as_str(), "at": keel_core::clock::rfc3339(due_ms), "state": "waiting",
                });
                println!("{line}");
                Ok(exit::OK)
            }
            Ok(_) => {
                println!("{}", run.run_id);
                eprintln!(
                    "stored: session {session} runs at {} (local {}); `keel serve {} --store {}` starts it then. \
                     Cancel it with `keel runs cancel {} --store {}`",
                    keel_core::clock::rfc3339(due_ms),
                    local(due_ms),
                    args.agent.display(),
                    args.store,
                    run.run_id,
                    args.store
                );
                Ok(exit::OK)
            }
            Err(error) => {
                eprintln!("error[{}]: {error}", error.code());
                Ok(exit::RUN_FAILED)
            }
        }
    })?
}

pub(crate) fn runs(command: RunsCommand) -> std::io::Result<u8> {
    let (id, store_url, cancel) = match &command {
        RunsCommand::Show { run, store } => (run, &store.store, false),
        RunsCommand::Cancel { run, store } => (run, &store.store, true),
    };
    let Some(run) = RunId::parse(id) else {
        eprintln!(
            "error[KEEL_REQUEST_INVALID]: {id:?} is not a run id (run ids look like run_0193... or run_at_0193...)"
        );
        return Ok(2);
    };
    super::run_async(async {
        let Some(store) = super::open_store_to_inspect(store_url).await else {
            return Ok(exit::INVALID_AGENT);
        };
        let failed = |error: keel_core::StoreError| {
            eprintln!("error[{}]: {error}", error.code());
            Ok(exit::RUN_FAILED)
        };
        if cancel {
            let by = keel::who("keel runs cancel");
            return match store.cancel_delayed_run(&run, &by).await {
                Ok(Some(record)) if record.state == DelayedState::Started => {
                    eprintln!(
                        "error[KEEL_RUN_STARTED]: run {run} already started; cancel it as a run of its session: \
                         `keel cancel {} --store {store_url}`",
                        record.run.session_id
                    );
                    Ok(exit::RUN_FAILED)
                }
                Ok(Some(_)) => {
                    eprintln!("cancelled delayed run {run}: it will not start");
                    Ok(exit::OK)
                }
                Ok(None) => {
                    eprintln!("error[KEEL_RUN_NOT_FOUND]: no delayed run {run} in {store_url}");
                    Ok(exit::RUN_FAILED)
                }
                Err(error) => failed(error),
            };
        }
        let delayed = match store.delayed_run(&run).await {
            Ok(delayed) => delayed,
            Err(error) => return failed(error),
        };
        let record = match store.load_run(&run).await {
            Ok(record) => record,
            Err(error) => return failed(error),
        };
        let (session, state) = match (&delayed, &record) {
            (_, Some(record)) => (record.session_id.to_string(), record.state.as_str()),
            (Some(delayed), None) => (delayed.run.session_id.to_string(), delayed.state.as_str()),
            (None, None) => {
                eprintln!("error[KEEL_RUN_NOT_FOUND]: no run {run} in {store_url}");
                return Ok(exit::RUN_FAILED);
            }
        };
        println!("{run}  session {session}  {state}");
        if let Some(delayed) = delayed {
            println!(
                "  due {} (local {}), from {}",
                keel_core::clock::rfc3339(delayed.run.due_ms),
                local(delayed.run.due_ms),
                delayed.run.source
            );
            if let Some(note) = delayed.note {
                println!("  {note}");
            }
        }
        Ok(exit::OK)
    })?
}

fn local(at_ms: u64) -> String {
    jiff::Timestamp::from_millisecond(i64::try_from(at_ms).unwrap_or(i64::MAX)).map_or_else(
        |_| at_ms.to_string(),
        |at| at.to_zoned_datetime(jiff::tz::TimeZone::system()).strftime("%Y-%m-%d %H:%M:%S %Z").to_string(),
    )
}
