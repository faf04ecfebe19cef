//! The store conformance suite: the same checks, run against every backend.
//!
//! A backend's tests call [`run_all`] with a fresh, empty store that reads its time from the
//! [`ManualClock`] they pass too: leases expire because the suite moves the clock, never because
//! it sleeps. Each check panics with a message naming the broken rule; there is at least one
//! check per rule of `crate::rules`.

use std::sync::Arc;
use std::time::Duration;

use keel_core::journal::{JournalEntry, JournalRecord, JournaledReply};
use keel_core::store::{MAX_CLAIMS_WITHOUT_PROGRESS, MAX_REDRIVES};
use keel_core::{
    Claim, Committed, Decision, DelayedRun, DelayedState, Fence, LeaseStatus, LimitOverrides, ManualClock,
    Message, ModelReply, Part, PendingInput, PendingKind, RunId, RunRecord, RunState, SessionFilter,
    SessionId, SessionScope, StepCommit, StepName, Store, StoreError, Usage,
};
use serde_json::json;

/// Runs every check against `store`, which must be empty and read its time from `clock`.
pub async fn run_all(store: &dyn Store, clock: &ManualClock) {
    messages_append_idempotently(store).await;
    messages_of_another_run_conflict(store).await;
    runs_round_trip(store).await;
    commits_need_their_run_in_its_session(store).await;
    journal_first_write_wins(store).await;
    sessions_are_listed_and_deleted(store, clock).await;
    steps_commit_whole_and_replay_idempotently(store).await;
    leases_fence_stale_writers(store, clock).await;
    a_dead_owner_is_taken_over_only_by_name(store).await;
    finished_runs_journals_compact(store).await;
    one_unfinished_run_per_session(store, clock).await;
    schedule_ticks_fire_once(store).await;
    delayed_runs_start_once_unless_cancelled_first(store, clock).await;
    pending_inputs_are_decided_once_and_remember_who_decided(store).await;
    a_paused_run_holds_its_session(store).await;
    a_finished_run_closes_what_it_waited_for(store).await;
    cancellation_reaches_the_owner_and_ends_a_pause(store).await;
    claims_without_progress_poison_a_run(store).await;
    session_state_commits_with_its_step(store).await;
    session_usage_counts_each_model_call_once(store).await;
    memory_is_kept_per_owner_merged_trimmed_and_forgotten(store, clock).await;
    commits_made_together_are_each_applied_or_refused_alone(store).await;
    open_runs_and_journals_come_in_their_order(store).await;
}

const MINUTE: Duration = Duration::from_secs(60);

// The runtime gets its chances to end a poison run cleanly before the store's last resort.
const _: () = assert!(MAX_REDRIVES < MAX_CLAIMS_WITHOUT_PROGRESS);

/// A run record of `session`, running.
pub fn run_record(run: &str, session: &SessionId, history_len: u64) -> RunRecord {
    RunRecord {
        run_id: RunId::from_suffix(run),
        session_id: session.clone(),
        input: Arc::new(Message::user("hi")),
        history_len,
        call_base: 0,
        state: RunState::Running,
        limits: LimitOverrides::default(),
    }
}

/// Creates a run, with no lease: through [`Store::commit_step`], the one write path.
pub async fn create_run(store: &dyn Store, record: &RunRecord) -> Result<Committed, StoreError> {
    store
        .commit_step(StepCommit {
            new_run: Some(record),
            ..StepCommit::new(&record.session_id, &record.run_id)
        })
        .await
}

/// Appends messages at `first_position..` for `run` (see [`Store::commit_step`]).
pub async fn append_messages(
    store: &dyn Store,
    session: &SessionId,
    run: &RunId,
    first_position: u64,
    messages: &[Arc<Message>],
) -> Result<Committed, StoreError> {
    store.commit_step(StepCommit { first_position, messages, ..StepCommit::new(session, run) }).await
}

/// A run's journal, each entry shared as a commit hands it over (so that it compares with them).
async fn journal(store: &dyn Store, run: &RunId) -> Vec<Arc<JournalEntry>> {
    store.load_journal(run).await.unwrap().into_iter().map(Arc::new).collect()
}

/// Records one journal entry.
async fn append_journal(
    store: &dyn Store,
    session: &SessionId,
    run: &RunId,
    entry: &Arc<JournalEntry>,
) -> Result<Committed, StoreError> {
    store.commit_step(StepCommit { entry: Some(entry), ..StepCommit::new(session, run) }).await
}

/// Moves a run to a new state.
pub async fn set_run_state(
    store: &dyn Store,
    session: &SessionId,
    run: &RunId,
    state: RunState,
) -> Result<Committed, StoreError> {
    store.commit_step(StepCommit { state: Some(state), ..StepCommit::new(session, run) }).await
}

/// The first commit of a new run, leased to `owner` for a minute.
fn new_run_commit<'a>(
    record: &'a RunRecord,
    owner: &'a str,
    messages: &'a [Arc<Message>],
    first_position: u64,
) -> StepCommit<'a> {
    StepCommit {
        new_run: Some(record),
        first_position,
        messages,
        fence: Some(Fence { owner, epoch: 1, ttl: MINUTE }),
        ..StepCommit::new(&record.session_id, &record.run_id)
    }
}

fn tool_entry(call: &str, output: serde_json::Value) -> Arc<JournalEntry> {
    Arc::new(JournalEntry {
        step: StepName::Tool { name: "add".into(), call_id: call.into() },
        record: JournalRecord::ToolResult(Ok(output)),
    })
}

fn claimed(claim: Claim) -> (u64, u32, bool) {
    match claim {
        Claim::Claimed { epoch, attempt, cancel_requested } => (epoch, attempt, cancel_requested),
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Appending the same messages twice (a replay) stores them once.
pub async fn messages_append_idempotently(store: &dyn Store) {
    let session = SessionId::new("conformance-append").unwrap();
    let record = run_record("append", &session, 0);
    create_run(store, &record).await.unwrap();
    let run = &record.run_id;
    let messages = [Arc::new(Message::user("one")), Arc::new(Message::assistant("two"))];
    append_messages(store, &session, run, 0, &messages).await.unwrap();
    append_messages(store, &session, run, 0, &messages).await.unwrap();
    append_messages(store, &session, run, 1, &messages[1..]).await.unwrap();
    assert_eq!(
        store.load_messages(&session).await.unwrap(),
        messages,
        "a replayed append duplicated messages"
    );
    let unknown = SessionId::new("conformance-none").unwrap();
    assert!(store.load_messages(&unknown).await.unwrap().is_empty(), "an unknown session has messages");
}

/// A position written by one run cannot be overwritten by another, and no gap can be made.
pub async fn messages_of_another_run_conflict(store: &dyn Store) {
    let session = SessionId::new("conformance-conflict").unwrap();
    let first = run_record("first", &session, 0);
    create_run(store, &first).await.unwrap();
    append_messages(store, &session, &first.run_id, 0, &[Arc::new(Message::user("a"))]).await.unwrap();
    set_run_state(store, &session, &first.run_id, RunState::Done).await.unwrap();
    let second = run_record("second", &session, 1);
    create_run(store, &second).await.unwrap();
    let b = [Arc::new(Message::user("b"))];
    let err = append_messages(store, &session, &second.run_id, 0, &b).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "overwrite by another run: {err:?}");
    let err = append_messages(store, &session, &second.run_id, 5, &b).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "gap: {err:?}");
    assert_eq!(store.load_messages(&session).await.unwrap(), [Arc::new(Message::user("a"))]);
}

/// Runs are stored whole and change state.
pub async fn runs_round_trip(store: &dyn Store) {
    let session = SessionId::new("conformance-runs").unwrap();
    let record = run_record("rt", &session, 3);
    create_run(store, &record).await.unwrap();
    assert_eq!(store.load_run(&record.run_id).await.unwrap().as_ref(), Some(&record));
    // Its creation made again (the first answer lost) changes nothing; another run of that id
    // is refused.
    create_run(store, &record).await.unwrap();
    assert_eq!(store.load_run(&record.run_id).await.unwrap().as_ref(), Some(&record));
    let other = RunRecord { history_len: 9, ..record.clone() };
    let error = create_run(store, &other).await.unwrap_err();
    assert!(matches!(error, StoreError::Conflict(_)), "a run was created twice: {error:?}");
    set_run_state(store, &session, &record.run_id, RunState::Done).await.unwrap();
    let loaded = store.load_run(&record.run_id).await.unwrap().unwrap();
    assert_eq!(loaded.state, RunState::Done);
    assert_eq!(store.load_run(&RunId::from_suffix("missing")).await.unwrap(), None);

    // A run's own limits are kept with it.
    let limits = LimitOverrides {
        max_turns: Some(2),
        tool_timeout: Some(Duration::from_millis(1500)),
        max_total_tokens: Some(10_000),
        ..LimitOverrides::default()
    };
    let limited = RunRecord { limits, ..run_record("rt-limits", &session, 0) };
    create_run(store, &limited).await.unwrap();
    assert_eq!(store.load_run(&limited.run_id).await.unwrap().as_ref(), Some(&limited));
}

/// Every write names an existing run of its own session (or creates it).
pub async fn commits_need_their_run_in_its_session(store: &dyn Store) {
    let session = SessionId::new("conformance-owned").unwrap();
    let missing = RunId::from_suffix("owned-missing");
    let error = set_run_state(store, &session, &missing, RunState::Done).await.unwrap_err();
    assert!(matches!(error, StoreError::NotFound(_)), "a state change for no run: {error:?}");
    let error = append_journal(store, &session, &missing, &tool_entry("c1", json!(1))).await.unwrap_err();
    assert!(matches!(error, StoreError::NotFound(_)), "a journal entry for no run: {error:?}");
    let record = run_record("owned", &session, 0);
    create_run(store, &record).await.unwrap();
    let elsewhere = SessionId::new("conformance-owned-other").unwrap();
    let hello = [Arc::new(Message::user("hello"))];
    let error = append_messages(store, &elsewhere, &record.run_id, 0, &hello).await.unwrap_err();
    assert!(matches!(error, StoreError::Conflict(_)), "a run wrote into another session: {error:?}");
    assert!(store.load_messages(&elsewhere).await.unwrap().is_empty());
}

/// The first record of a step wins; the journal keeps write order.
pub async fn journal_first_write_wins(store: &dyn Store) {
    let session = SessionId::new("conformance-journal").unwrap();
    let record = run_record("journal", &session, 0);
    create_run(store, &record).await.unwrap();
    let run = &record.run_id;
    let reply = |text: &str| -> JournaledReply {
        ModelReply {
            parts: vec![Part::Text(text.into())],
            usage: Usage { input_tokens: 1, output_tokens: 1 },
        }
        .into()
    };
    let entries = [
        Arc::new(JournalEntry {
            step: StepName::ModelTurn(0),
            record: JournalRecord::ModelReply(reply("first")),
        }),
        tool_entry("c1", json!(5)),
    ];
    for entry in &entries {
        append_journal(store, &session, run, entry).await.unwrap();
    }
    let duplicate = Arc::new(JournalEntry {
        step: StepName::ModelTurn(0),
        record: JournalRecord::ModelReply(reply("second")),
    });
    append_journal(store, &session, run, &duplicate).await.unwrap();
    assert_eq!(journal(store, run).await, entries, "a second record replaced the first");
    assert!(store.load_journal(&RunId::from_suffix("empty")).await.unwrap().is_empty());
}

/// Sessions are listed (most recent first) with their counts, and deleted with everything in them.
pub async fn sessions_are_listed_and_deleted(store: &dyn Store, clock: &ManualClock) {
    let older = SessionId::new("conformance-list-a").unwrap();
    let newer = SessionId::new("conformance-list-b").unwrap();
    let record = run_record("list-a", &older, 0);
    create_run(store, &record).await.unwrap();
    let run = &record.run_id;
    append_messages(store, &older, run, 0, &[Arc::new(Message::user("a"))]).await.unwrap();
    append_journal(store, &older, run, &tool_entry("c1", json!(1))).await.unwrap();
    clock.advance(Duration::from_millis(5));
    let other = run_record("list-b", &newer, 0);
    create_run(store, &other).await.unwrap();
    let messages = [Arc::new(Message::user("b")), Arc::new(Message::assistant("c"))];
    append_messages(store, &newer, &other.run_id, 0, &messages).await.unwrap();

    let listed = store.list_sessions(SessionFilter::default()).await.unwrap();
    let position = |id: &SessionId| listed.iter().position(|s| &s.id == id).expect("listed");
    assert!(position(&newer) < position(&older), "not most recent first: {listed:?}");
    let a = &listed[position(&older)];
    assert_eq!((a.messages, a.runs), (1, 1));
    assert_eq!(listed[position(&newer)].messages, 2);

    // An owner's sessions, apart from everyone else's (ids the same after the scope).
    let (alice, bob) = ("a1a1a1a1", "b2b2b2b2");
    let alices = SessionId::scoped(alice, &SessionId::new("conformance-list-c").unwrap());
    let bobs = SessionId::scoped(bob, &SessionId::new("conformance-list-c").unwrap());
    for (suffix, session) in [("list-c", &alices), ("list-d", &bobs)] {
        clock.advance(Duration::from_millis(5));
        let record = run_record(suffix, session, 0);
        create_run(store, &record).await.unwrap();
        append_messages(store, session, &record.run_id, 0, &[Arc::new(Message::user("c"))]).await.unwrap();
    }
    let ids = |filter: SessionFilter| async move {
        let listed = store.list_sessions(filter).await.unwrap();
        listed.into_iter().map(|s| s.id.as_str().to_owned()).collect::<Vec<_>>()
    };
    let scoped = |scope: &str, limit| SessionFilter { scope: SessionScope::Scoped(scope.into()), limit };
    assert_eq!(ids(scoped(alice, None)).await, [alices.as_str()]);
    assert_eq!(ids(scoped(bob, None)).await, [bobs.as_str()]);
    // A scope that is a prefix of another's is not it.
    assert_eq!(ids(scoped("a1a1", None)).await, Vec::<String>::new());
    let has = |ids: &[String], session: &SessionId| ids.iter().any(|id| id == session.as_str());
    let unscoped = ids(SessionFilter { scope: SessionScope::Unscoped, limit: None }).await;
    assert!(has(&unscoped, &newer) && has(&unscoped, &older), "{unscoped:?}");
    assert!(!has(&unscoped, &alices) && !has(&unscoped, &bobs), "{unscoped:?}");
    let all = ids(SessionFilter::default()).await;
    assert!(has(&all, &alices) && has(&all, &bobs) && has(&all, &newer), "{all:?}");
    // The newest first, cut at the limit.
    let newest = ids(SessionFilter { limit: Some(2), ..SessionFilter::default() }).await;
    assert_eq!(newest, [bobs.as_str(), alices.as_str()]);
    let newest_unscoped = ids(SessionFilter { scope: SessionScope::Unscoped, limit: Some(1) }).await;
    assert_eq!(newest_unscoped, [newer.as_str()]);
    for session in [&alices, &bobs] {
        assert!(store.delete_session(session).await.unwrap());
    }

    assert!(store.delete_session(&older).await.unwrap());
    assert!(!store.delete_session(&older).await.unwrap(), "deleting twice found something");
    assert!(store.load_messages(&older).await.unwrap().is_empty());
    assert_eq!(store.load_run(run).await.unwrap(), None, "the session's runs survived");
    assert!(store.load_journal(run).await.unwrap().is_empty(), "the runs' journals survived");
    assert!(store.open_runs(Some(&older)).await.unwrap().is_empty(), "the session's runs are still open");
    assert_eq!(store.load_messages(&newer).await.unwrap().len(), 2, "another session was touched");
}

/// A step's journal entry, messages and state change land together, and committing the same
/// step again (a replay) changes nothing.
pub async fn steps_commit_whole_and_replay_idempotently(store: &dyn Store) {
    let session = SessionId::new("conformance-commit").unwrap();
    let record = run_record("commit", &session, 0);
    let entry = tool_entry("c1", json!("x"));
    let messages = [Arc::new(Message::user("q")), Arc::new(Message::assistant("a"))];
    let commit = StepCommit {
        new_run: Some(&record),
        entry: Some(&entry),
        messages: &messages,
        state: Some(RunState::Done),
        ..StepCommit::new(&session, &record.run_id)
    };
    store.commit_step(commit).await.unwrap();
    // The replay of a step: the run exists by now.
    let replay = StepCommit { new_run: None, ..commit };
    store.commit_step(replay).await.unwrap();
    assert_eq!(journal(store, &record.run_id).await, std::slice::from_ref(&entry));
    assert_eq!(store.load_messages(&session).await.unwrap(), messages);
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::Done);
    // A commit that conflicts writes none of its parts.
    let other = run_record("commit-other", &session, 2);
    create_run(store, &other).await.unwrap();
    let late = Arc::new(JournalEntry {
        step: StepName::ModelTurn(1),
        record: JournalRecord::ToolResult(Ok(json!(1))),
    });
    let clash = StepCommit { run: &other.run_id, new_run: None, entry: Some(&late), state: None, ..commit };
    assert!(store.commit_step(clash).await.is_err());
    assert_eq!(store.load_messages(&session).await.unwrap(), messages);
    assert!(
        store.load_journal(&other.run_id).await.unwrap().is_empty(),
        "a failed commit wrote its journal entry"
    );
}

/// A lease is claimed by one owner at a time, expires, and fences a writer that lost it.
pub async fn leases_fence_stale_writers(store: &dyn Store, clock: &ManualClock) {
    let session = SessionId::new("conformance-lease").unwrap();
    let record = run_record("lease", &session, 0);
    let run = &record.run_id;
    let short = Duration::from_secs(10);
    let first = Fence { owner: "process-a", epoch: 1, ttl: short };
    let messages = [Arc::new(Message::user("q"))];
    let create = StepCommit {
        new_run: Some(&record),
        messages: &messages,
        fence: Some(first),
        ..StepCommit::new(&session, run)
    };
    store.commit_step(create).await.unwrap();

    // Held: nobody else may claim it, and it is not interrupted.
    let held = store.claim_run(run, "process-b", short, None).await.unwrap();
    assert!(matches!(&held, Claim::Held { owner, .. } if owner == "process-a"), "{held:?}");
    let open = store.open_runs(Some(&session)).await.unwrap();
    assert_eq!(open.len(), 1);
    assert!(open[0].is_leased(clock_now(clock)) && !open[0].is_interrupted(clock_now(clock)));
    assert_eq!(open[0].owner.as_deref(), Some("process-a"));
    assert_eq!(
        store.renew_lease(run, "process-a", 1, short).await.unwrap(),
        LeaseStatus::Held { cancel_requested: false }
    );
    assert_eq!(store.renew_lease(run, "process-b", 1, short).await.unwrap(), LeaseStatus::Lost);

    // Expired: the run is interrupted, and another owner takes it with a new epoch.
    clock.advance(short + Duration::from_millis(1));
    let open = store.open_runs(None).await.unwrap();
    let found = open.iter().find(|o| &o.run_id == run).expect("listed as open");
    assert!(found.is_interrupted(clock_now(clock)), "{found:?}");
    assert_eq!(claimed(store.claim_run(run, "process-b", MINUTE, None).await.unwrap()).0, 2);
    assert!(!store.open_runs(Some(&session)).await.unwrap()[0].is_interrupted(clock_now(clock)));

    // The stalled first owner wakes up: its commit is refused and writes nothing.
    let entry = Arc::new(JournalEntry {
        step: StepName::ModelTurn(0),
        record: JournalRecord::ToolResult(Ok(json!(1))),
    });
    let stale = StepCommit { new_run: None, entry: Some(&entry), messages: &[], ..create };
    let error = store.commit_step(stale).await.unwrap_err();
    assert!(matches!(error, StoreError::LeaseLost(_)), "{error:?}");
    assert!(store.load_journal(run).await.unwrap().is_empty(), "a fenced commit wrote");
    assert_eq!(store.renew_lease(run, "process-a", 1, short).await.unwrap(), LeaseStatus::Lost);
    // The new owner commits; its zero-length renewal releases the lease for the next one.
    let fresh = StepCommit { fence: Some(Fence { owner: "process-b", epoch: 2, ttl: short }), ..stale };
    store.commit_step(fresh).await.unwrap();
    assert_eq!(journal(store, run).await, [entry]);
    assert!(matches!(store.claim_run(run, "process-c", short, None).await.unwrap(), Claim::Held { .. }));
    store.renew_lease(run, "process-b", 2, Duration::ZERO).await.unwrap();
    assert_eq!(claimed(store.claim_run(run, "process-c", short, None).await.unwrap()).0, 3);
    // A finished run is claimed by nobody; an unknown one is an error.
    set_run_state(store, &session, run, RunState::Done).await.unwrap();
    assert_eq!(store.claim_run(run, "process-d", short, None).await.unwrap(), Claim::Finished);
    assert!(store.claim_run(&RunId::from_suffix("no-such-run"), "x", short, None).await.is_err());
}

fn clock_now(clock: &ManualClock) -> u64 {
    keel_core::Clock::now_ms(clock)
}

/// A live lease is taken over only by a claim that names its owner (the caller proved that
/// process dead); naming anyone else changes nothing.
pub async fn a_dead_owner_is_taken_over_only_by_name(store: &dyn Store) {
    let session = SessionId::new("conformance-takeover").unwrap();
    let record = run_record("takeover", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-dead", &input, 0)).await.unwrap();
    let run = &record.run_id;
    let wrong = store.claim_run(run, "process-b", MINUTE, Some("process-other")).await.unwrap();
    assert!(matches!(wrong, Claim::Held { .. }), "a takeover naming another owner: {wrong:?}");
    let (epoch, attempt, _) =
        claimed(store.claim_run(run, "process-b", MINUTE, Some("process-dead")).await.unwrap());
    assert_eq!((epoch, attempt), (2, 1));
    let error = store
        .commit_step(StepCommit {
            entry: Some(&tool_entry("c1", json!(1))),
            fence: Some(Fence { owner: "process-dead", epoch: 1, ttl: MINUTE }),
            ..StepCommit::new(&session, run)
        })
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::LeaseLost(_)), "the dead owner still wrote: {error:?}");
    set_run_state(store, &session, run, RunState::Done).await.unwrap();
}

/// Compaction empties the journals of finished runs, and only theirs.
pub async fn finished_runs_journals_compact(store: &dyn Store) {
    let done_session = SessionId::new("conformance-compact-a").unwrap();
    let open_session = SessionId::new("conformance-compact-b").unwrap();
    let finished = run_record("compact-done", &done_session, 0);
    let running = run_record("compact-running", &open_session, 0);
    for record in [&finished, &running] {
        create_run(store, record).await.unwrap();
        append_journal(store, &record.session_id, &record.run_id, &tool_entry("c1", json!(1))).await.unwrap();
    }
    set_run_state(store, &done_session, &finished.run_id, RunState::Done).await.unwrap();
    assert!(store.compact_journals().await.unwrap() >= 1);
    assert!(
        store.load_journal(&finished.run_id).await.unwrap().is_empty(),
        "a finished run kept its journal"
    );
    assert_eq!(store.load_journal(&running.run_id).await.unwrap().len(), 1, "a running run lost its journal");
    assert_eq!(store.compact_journals().await.unwrap(), 0, "compacting twice removed more");
    set_run_state(store, &open_session, &running.run_id, RunState::Done).await.unwrap();
}

/// A new run is refused while its session has any unfinished run: in flight under a live lease
/// (as in another process), interrupted (its process died: it must be resumed first), or paused
/// for a human. Once that run is finished, the new one is admitted.
pub async fn one_unfinished_run_per_session(store: &dyn Store, clock: &ManualClock) {
    let session = SessionId::new("conformance-busy").unwrap();
    let first = run_record("busy-first", &session, 0);
    let second = run_record("busy-second", &session, 1);
    let one = [Arc::new(Message::user("one"))];
    let two = [Arc::new(Message::user("two"))];
    store.commit_step(new_run_commit(&first, "process-a", &one, 0)).await.unwrap();
    // What a new run starts from, in one read: the transcript, the state, the unfinished run.
    let snapshot = store.load_session(&session).await.unwrap();
    assert_eq!(snapshot.messages, one);
    assert_eq!(snapshot.state, None);
    assert_eq!(snapshot.open_run.map(|run| run.run_id), Some(first.run_id.clone()));
    let error = store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap_err();
    assert!(matches!(&error, StoreError::Busy(m) if m.contains("in flight")), "{error:?}");
    assert_eq!(store.load_run(&second.run_id).await.unwrap(), None, "the refused run was stored");
    // Its process died: the lease expires, and the run still holds the session.
    clock.advance(MINUTE * 2);
    let error = store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap_err();
    assert!(matches!(&error, StoreError::Busy(m) if m.contains("resumed first")), "{error:?}");
    assert_eq!(store.load_messages(&session).await.unwrap().len(), 1, "a refused run wrote");
    set_run_state(store, &session, &first.run_id, RunState::Done).await.unwrap();
    store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap();
    assert_eq!(store.load_messages(&session).await.unwrap().len(), 2);
    set_run_state(store, &session, &second.run_id, RunState::Done).await.unwrap();
    assert_eq!(store.load_session(&session).await.unwrap().open_run, None, "a finished run is not open");
}

/// Each schedule tick is claimed once; an older tick never wins after a newer one; a fire's
/// delayed run is stored with its tick.
pub async fn schedule_ticks_fire_once(store: &dyn Store) {
    assert_eq!(store.schedule_last_fire("conformance-weekly").await.unwrap(), None);
    let fire = delayed("cronweekly1000", "conformance-fire", 1_000);
    assert!(store.claim_schedule_tick("conformance-weekly", 1_000, Some(&fire)).await.unwrap());
    let stored =
        store.delayed_run(&fire.run_id).await.unwrap().expect("the fire's run is stored with its tick");
    assert_eq!((stored.run, stored.state), (fire.clone(), DelayedState::Waiting));
    assert!(
        !store.claim_schedule_tick("conformance-weekly", 1_000, Some(&fire)).await.unwrap(),
        "a tick fired twice"
    );
    assert!(
        !store.claim_schedule_tick("conformance-weekly", 500, None).await.unwrap(),
        "an older tick fired"
    );
    assert!(store.claim_schedule_tick("conformance-weekly", 2_000, None).await.unwrap());
    assert_eq!(store.schedule_last_fire("conformance-weekly").await.unwrap(), Some(2_000));
    assert!(
        store.claim_schedule_tick("conformance-daily", 1_000, None).await.unwrap(),
        "schedules share ticks"
    );
    // A fire whose run id is taken records nothing, not even its tick.
    let error = store.claim_schedule_tick("conformance-weekly", 3_000, Some(&fire)).await.unwrap_err();
    assert!(matches!(error, StoreError::Conflict(_)), "{error:?}");
    assert_eq!(store.schedule_last_fire("conformance-weekly").await.unwrap(), Some(2_000));
    // A fire is a delayed run like any other: cancelled, it never starts.
    store.cancel_delayed_run(&fire.run_id, "conformance").await.unwrap();
}

fn delayed(suffix: &str, session: &str, due_ms: u64) -> DelayedRun {
    DelayedRun {
        run_id: RunId::delayed(suffix),
        session_id: SessionId::new(session).unwrap(),
        input: Message::user("later"),
        due_ms,
        source: "conformance".into(),
    }
}

/// A delayed run waits for its time, is taken by one process at a time (again once a hold
/// lapses), starts once with its run's first commit, and can be cancelled only until then.
pub async fn delayed_runs_start_once_unless_cancelled_first(store: &dyn Store, clock: &ManualClock) {
    let now = clock_now(clock);
    let later = delayed("later1", "conformance-delayed", now + 60_000);
    let stored = store.schedule_run(&later).await.unwrap();
    assert_eq!((stored.state, stored.attempts), (DelayedState::Waiting, 0));
    assert_eq!(store.schedule_run(&later).await.unwrap(), stored, "storing it again changes nothing");
    let other = DelayedRun { input: Message::user("something else"), ..later.clone() };
    assert!(matches!(store.schedule_run(&other).await, Err(StoreError::Conflict(_))), "an id is one run");
    assert!(store.take_due_runs(MINUTE, 10).await.unwrap().is_empty(), "taken before its time");

    clock.advance(Duration::from_secs(61));
    let taken = store.take_due_runs(MINUTE, 10).await.unwrap();
    assert_eq!(taken, vec![later.clone()]);
    assert!(store.take_due_runs(MINUTE, 10).await.unwrap().is_empty(), "taken twice while held");
    // Its process died before starting it: the hold lapses and it is taken again.
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.take_due_runs(MINUTE, 10).await.unwrap(), vec![later.clone()]);
    assert_eq!(store.delayed_run(&later.run_id).await.unwrap().unwrap().attempts, 2);
    // Its session was busy: put off, with the reason.
    let until = clock_now(clock) + 5_000;
    store.defer_delayed_run(&later.run_id, until, "session busy").await.unwrap();
    let deferred = store.delayed_run(&later.run_id).await.unwrap().unwrap();
    assert_eq!((deferred.held_until_ms, deferred.note.as_deref()), (until, Some("session busy")));

    // The run's first commit starts it; then it can no longer be cancelled.
    let record = RunRecord {
        run_id: later.run_id.clone(),
        session_id: later.session_id.clone(),
        input: Arc::new(later.input.clone()),
        history_len: 0,
        call_base: 0,
        state: RunState::Running,
        limits: LimitOverrides::default(),
    };
    create_run(store, &record).await.unwrap();
    assert_eq!(store.delayed_run(&later.run_id).await.unwrap().unwrap().state, DelayedState::Started);
    let too_late = store.cancel_delayed_run(&later.run_id, "conformance").await.unwrap().unwrap();
    assert_eq!(too_late.state, DelayedState::Started);
    clock.advance(Duration::from_secs(61));
    assert!(store.take_due_runs(MINUTE, 10).await.unwrap().is_empty(), "a started run was taken");

    // Cancelled first: its run can no longer start.
    let cancelled = delayed("later2", "conformance-delayed-2", clock_now(clock));
    store.schedule_run(&cancelled).await.unwrap();
    let record = store.cancel_delayed_run(&cancelled.run_id, "tester").await.unwrap().unwrap();
    assert_eq!(record.state, DelayedState::Cancelled);
    assert!(record.note.unwrap().contains("tester"));
    assert!(store.take_due_runs(MINUTE, 10).await.unwrap().is_empty(), "a cancelled run was taken");
    let start = RunRecord {
        run_id: cancelled.run_id.clone(),
        session_id: cancelled.session_id.clone(),
        input: Arc::new(cancelled.input.clone()),
        history_len: 0,
        call_base: 0,
        state: RunState::Running,
        limits: LimitOverrides::default(),
    };
    let refused = create_run(store, &start).await.unwrap_err();
    assert!(matches!(refused, StoreError::Conflict(_)), "a cancelled delayed run started: {refused:?}");
    assert!(store.load_run(&cancelled.run_id).await.unwrap().is_none());
    assert_eq!(store.cancel_delayed_run(&RunId::delayed("nobody"), "tester").await.unwrap(), None);

    // Earliest due first, at most `limit`.
    let base = clock_now(clock);
    for (suffix, due) in [("order-b", base - 1_000), ("order-a", base - 2_000), ("order-c", base - 500)] {
        store.schedule_run(&delayed(suffix, &format!("conformance-{suffix}"), due)).await.unwrap();
    }
    let ids: Vec<_> = store.take_due_runs(MINUTE, 2).await.unwrap().into_iter().map(|r| r.run_id).collect();
    assert_eq!(ids, vec![RunId::delayed("order-a"), RunId::delayed("order-b")]);
}

fn pending(id: &str, record: &RunRecord, call_id: &str, kind: PendingKind) -> PendingInput {
    PendingInput {
        id: id.into(),
        run_id: record.run_id.clone(),
        session_id: record.session_id.clone(),
        call_id: call_id.into(),
        kind,
        created_at_ms: 1_000,
        expires_at_ms: 2_000,
    }
}

/// Pauses `record`'s run (leased to `owner` at `epoch`) on `asked`.
async fn pause(store: &dyn Store, record: &RunRecord, owner: &str, epoch: u64, asked: &[PendingInput]) {
    let commit = StepCommit {
        state: Some(RunState::AwaitingInput),
        pending: asked,
        fence: Some(Fence { owner, epoch, ttl: MINUTE }),
        ..StepCommit::new(&record.session_id, &record.run_id)
    };
    store.commit_step(commit).await.unwrap();
}

/// A pause stores the run's pending inputs and releases its lease; a decision is journaled as
/// its step, once: the second is refused saying who decided first, and a later pause does not
/// ask again. The run becomes re-drivable only when the decision comes.
pub async fn pending_inputs_are_decided_once_and_remember_who_decided(store: &dyn Store) {
    let session = SessionId::new("conformance-pending").unwrap();
    let record = run_record("pending", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let approval = pending(
        "ap_conformance1",
        &record,
        "c1",
        PendingKind::Approval { tool: "shell".into(), input: json!({"command": "ls"}) },
    );
    let question =
        pending("qu_conformance2", &record, "c2", PendingKind::Question { question: "Why?".into() });
    let both = [approval.clone(), question.clone()];
    pause(store, &record, "process-a", 1, &both).await;
    assert_eq!(store.pending_inputs(Some(&session)).await.unwrap(), both, "pending inputs round trip");
    assert_eq!(store.pending_inputs(None).await.unwrap(), both);
    assert_eq!(store.pending_input(&question.id).await.unwrap().as_ref(), Some(&question));
    assert_eq!(store.pending_input("qu_nope").await.unwrap(), None);
    let other = SessionId::new("conformance-none").unwrap();
    assert!(store.pending_inputs(Some(&other)).await.unwrap().is_empty());
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::AwaitingInput);
    let open = store.open_runs(Some(&session)).await.unwrap();
    assert!(!open[0].is_interrupted(u64::MAX / 2), "a paused run with no decision is not re-driven");

    let answer = Decision::Answer("because".into());
    assert_eq!(store.decide(&question.id, &answer, "tester one").await.unwrap(), question);
    let again =
        store.decide(&question.id, &Decision::Answer("twice".into()), "tester two").await.unwrap_err();
    assert!(
        matches!(&again, StoreError::NotPending(m) if m.contains("answered") && m.contains("tester one")),
        "a second decision must say who decided first: {again:?}"
    );
    let decided = store.decided_input(&question.id).await.unwrap().expect("remembered");
    assert_eq!((decided.outcome.as_str(), decided.by.as_str()), ("answered", "tester one"));
    let unknown = store.decide("ap_nope", &Decision::Approve { note: None }, "x").await.unwrap_err();
    assert!(matches!(unknown, StoreError::NotPending(_)), "an unknown id: {unknown:?}");
    assert_eq!(
        store.load_journal(&record.run_id).await.unwrap(),
        [JournalEntry { step: StepName::Question("c2".into()), record: JournalRecord::Decision(answer) }],
        "the first decision is journaled, the second changes nothing"
    );
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::Running);
    let open = store.open_runs(Some(&session)).await.unwrap();
    assert!(open[0].is_interrupted(0), "a decided run is re-drivable by any process at once");
    assert_eq!(store.pending_inputs(Some(&session)).await.unwrap(), std::slice::from_ref(&approval));

    // The re-driven run pauses again on the approval: the decided question is not asked again.
    let (epoch, _, _) = claimed(store.claim_run(&record.run_id, "process-c", MINUTE, None).await.unwrap());
    pause(store, &record, "process-c", epoch, &both).await;
    assert_eq!(
        store.pending_inputs(Some(&session)).await.unwrap(),
        std::slice::from_ref(&approval),
        "a decided input was re-asked"
    );
    set_run_state(store, &session, &record.run_id, RunState::Cancelled).await.unwrap();
}

/// A run paused for a human owns its session, lease or not: a new run is refused until it is
/// decided and finished, and deleting the session drops its pending inputs.
pub async fn a_paused_run_holds_its_session(store: &dyn Store) {
    let session = SessionId::new("conformance-paused").unwrap();
    let record = run_record("paused-first", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let approval = [pending(
        "ap_conformance3",
        &record,
        "c1",
        PendingKind::Approval { tool: "t".into(), input: json!({}) },
    )];
    pause(store, &record, "process-a", 1, &approval).await;
    let second = run_record("paused-second", &session, 1);
    let two = [Arc::new(Message::user("two"))];
    let error = store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap_err();
    assert!(matches!(&error, StoreError::Busy(m) if m.contains("waiting for a human")), "{error:?}");
    assert!(store.delete_session(&session).await.unwrap());
    assert!(
        store.pending_inputs(Some(&session)).await.unwrap().is_empty(),
        "a deleted session left pending inputs"
    );
    assert_eq!(store.decided_input("ap_conformance3").await.unwrap(), None);
}

/// Ending a run drops what it still waited for, and a late decision is told so.
pub async fn a_finished_run_closes_what_it_waited_for(store: &dyn Store) {
    let session = SessionId::new("conformance-closed").unwrap();
    let record = run_record("closed", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let approval = [pending(
        "ap_conformance4",
        &record,
        "c1",
        PendingKind::Approval { tool: "t".into(), input: json!({}) },
    )];
    pause(store, &record, "process-a", 1, &approval).await;
    set_run_state(store, &session, &record.run_id, RunState::Failed).await.unwrap();
    assert!(store.pending_inputs(None).await.unwrap().is_empty(), "an ended run left pending inputs");
    let late = store.decide("ap_conformance4", &Decision::Approve { note: None }, "x").await.unwrap_err();
    assert!(
        matches!(&late, StoreError::NotPending(m) if m.contains("ended")),
        "a decision for an ended run: {late:?}"
    );
    assert!(store.open_runs(Some(&session)).await.unwrap().is_empty());
}

/// A cancellation request reaches the run's owner (through its commits, its renewals and its
/// polls); a paused run stops waiting: its inputs are closed as cancelled, it asks for nothing
/// more, and any process may re-drive it to its end at once.
pub async fn cancellation_reaches_the_owner_and_ends_a_pause(store: &dyn Store) {
    let session = SessionId::new("conformance-cancel").unwrap();
    assert_eq!(store.request_cancel(&session, "nobody").await.unwrap(), None, "nothing to cancel");
    let record = run_record("cancel-running", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let run = &record.run_id;
    assert!(store.cancel_requests("process-a").await.unwrap().is_empty());
    let before =
        store.request_cancel(&session, "keel cancel (test)").await.unwrap().expect("a run to cancel");
    assert_eq!((&before.run_id, before.state), (run, RunState::Running));
    assert_eq!(store.cancel_requests("process-a").await.unwrap(), std::slice::from_ref(run));
    assert!(store.cancel_requests("process-b").await.unwrap().is_empty(), "another owner was asked");
    assert_eq!(
        store.renew_lease(run, "process-a", 1, MINUTE).await.unwrap(),
        LeaseStatus::Held { cancel_requested: true }
    );
    let fence = Some(Fence { owner: "process-a", epoch: 1, ttl: MINUTE });
    let step =
        StepCommit { entry: Some(&tool_entry("c0", json!(0))), fence, ..StepCommit::new(&session, run) };
    assert_eq!(store.commit_step(step).await.unwrap(), Committed { cancel_requested: true });
    let open = store.open_runs(Some(&session)).await.unwrap();
    assert_eq!(open[0].cancel_requested_by.as_deref(), Some("keel cancel (test)"));
    set_run_state(store, &session, run, RunState::Cancelled).await.unwrap();

    // Paused: nobody drives it, so the request ends the pause itself.
    let paused = run_record("cancel-paused", &session, 1);
    let next = [Arc::new(Message::user("again"))];
    store.commit_step(new_run_commit(&paused, "process-a", &next, 1)).await.unwrap();
    let approval = [pending(
        "ap_conformance5",
        &paused,
        "c1",
        PendingKind::Approval { tool: "t".into(), input: json!({}) },
    )];
    pause(store, &paused, "process-a", 1, &approval).await;
    let before = store.request_cancel(&session, "keel cancel (test)").await.unwrap().unwrap();
    assert_eq!(before.state, RunState::AwaitingInput);
    assert!(store.pending_inputs(Some(&session)).await.unwrap().is_empty(), "a cancelled pause still waits");
    let refused =
        store.decide("ap_conformance5", &Decision::Approve { note: None }, "late").await.unwrap_err();
    assert!(matches!(&refused, StoreError::NotPending(m) if m.contains("cancelled")), "{refused:?}");
    let open = store.open_runs(Some(&session)).await.unwrap();
    assert!(open[0].is_interrupted(0), "a cancelled pause must be re-drivable at once: {open:?}");
    let (epoch, _, cancel_requested) =
        claimed(store.claim_run(&paused.run_id, "process-b", MINUTE, None).await.unwrap());
    assert!(cancel_requested, "the claim must tell the new driver to cancel");
    // Its re-drive asks again on its way to the end: nothing is stored.
    pause(store, &paused, "process-b", epoch, &approval).await;
    assert!(store.pending_inputs(Some(&session)).await.unwrap().is_empty(), "a cancelled run asked again");
    set_run_state(store, &session, &paused.run_id, RunState::Cancelled).await.unwrap();
}

/// Every claim counts; a commit resets the count. A run claimed too often without committing is
/// failed by the claim itself, and closes what it waited for.
pub async fn claims_without_progress_poison_a_run(store: &dyn Store) {
    let session = SessionId::new("conformance-poison").unwrap();
    let record = run_record("poison", &session, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&record, "process-0", &input, 0)).await.unwrap();
    let run = &record.run_id;
    let release = |owner: &'static str, epoch| async move {
        store.renew_lease(run, owner, epoch, Duration::ZERO).await.unwrap();
    };
    release("process-0", 1).await;
    let (epoch, attempt, _) = claimed(store.claim_run(run, "process-1", MINUTE, None).await.unwrap());
    assert_eq!(attempt, 1);
    // A commit is progress: the count starts over.
    let fence = Some(Fence { owner: "process-1", epoch, ttl: MINUTE });
    store
        .commit_step(StepCommit {
            entry: Some(&tool_entry("c1", json!(1))),
            fence,
            ..StepCommit::new(&session, run)
        })
        .await
        .unwrap();
    release("process-1", epoch).await;
    let owners = ["process-2", "process-3", "process-4", "process-5", "process-6", "process-7"];
    let mut attempts = Vec::new();
    for owner in owners.iter().take(MAX_CLAIMS_WITHOUT_PROGRESS as usize) {
        let (epoch, attempt, _) = claimed(store.claim_run(run, owner, MINUTE, None).await.unwrap());
        attempts.push(attempt);
        // Each re-drive replays what is stored before it dies: a repeat is not progress.
        let fence = Some(Fence { owner, epoch, ttl: MINUTE });
        let replay = StepCommit {
            entry: Some(&tool_entry("c1", json!(1))),
            messages: &input,
            fence,
            ..StepCommit::new(&session, run)
        };
        store.commit_step(replay).await.unwrap();
        release(owner, epoch).await;
    }
    assert_eq!(attempts, (1..=MAX_CLAIMS_WITHOUT_PROGRESS).collect::<Vec<_>>());
    assert_eq!(store.claim_run(run, "process-8", MINUTE, None).await.unwrap(), Claim::Poisoned);
    assert_eq!(store.load_run(run).await.unwrap().unwrap().state, RunState::Failed);
    assert!(store.open_runs(Some(&session)).await.unwrap().is_empty(), "a poisoned run is still open");
    assert_eq!(store.claim_run(run, "process-9", MINUTE, None).await.unwrap(), Claim::Finished);
}

/// The session's state object is written with its step, all or nothing, and goes with the
/// session.
pub async fn session_state_commits_with_its_step(store: &dyn Store) {
    let session = SessionId::new("conformance-state").unwrap();
    assert_eq!(store.load_session_state(&session).await.unwrap(), None, "a new session has no state");
    let record = run_record("state", &session, 0);
    let input = [Arc::new(Message::user("add to cart"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let entry = Arc::new(JournalEntry {
        step: StepName::Tool { name: "cart".into(), call_id: "c1".into() },
        record: JournalRecord::ToolResult(Ok(json!("added"))),
    });
    let cart = json!({"items": ["tea"], "total": 4.5});
    let step = StepCommit {
        entry: Some(&entry),
        session_state: Some(&cart),
        fence: Some(Fence { owner: "process-a", epoch: 1, ttl: MINUTE }),
        ..StepCommit::new(&session, &record.run_id)
    };
    store.commit_step(step).await.unwrap();
    assert_eq!(store.load_session_state(&session).await.unwrap(), Some(cart.clone()));
    assert_eq!(store.load_messages(&session).await.unwrap().len(), 1, "the state write touched the messages");

    // A stale writer's commit writes neither its journal entry nor its state.
    let stale_entry = Arc::new(JournalEntry {
        step: StepName::Tool { name: "cart".into(), call_id: "c2".into() },
        record: JournalRecord::ToolResult(Ok(json!("emptied"))),
    });
    let emptied = json!({"items": []});
    let stale = StepCommit {
        entry: Some(&stale_entry),
        session_state: Some(&emptied),
        fence: Some(Fence { owner: "process-b", epoch: 7, ttl: MINUTE }),
        ..StepCommit::new(&session, &record.run_id)
    };
    let error = store.commit_step(stale).await.unwrap_err();
    assert!(matches!(error, StoreError::LeaseLost(_)), "{error:?}");
    assert_eq!(
        store.load_session_state(&session).await.unwrap(),
        Some(cart),
        "a refused commit changed the state"
    );
    assert_eq!(journal(store, &record.run_id).await, [entry]);

    let other = SessionId::new("conformance-none").unwrap();
    assert_eq!(store.load_session_state(&other).await.unwrap(), None);
    assert!(store.delete_session(&session).await.unwrap());
    assert_eq!(store.load_session_state(&session).await.unwrap(), None, "a deleted session kept its state");
}

/// A session's usage sums its journaled model calls; a replayed step, or a commit refused for a
/// stale lease, does not count again.
pub async fn session_usage_counts_each_model_call_once(store: &dyn Store) {
    let session = SessionId::new("conformance-usage").unwrap();
    assert_eq!(store.session_summary(&session).await.unwrap(), None, "no such session yet");
    let record = run_record("usage", &session, 0);
    let input = [Arc::new(Message::user("hi"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let reply = |n: u64| -> JournaledReply {
        ModelReply {
            parts: vec![Part::Text("ok".into())],
            usage: Usage { input_tokens: 100 * n, output_tokens: n },
        }
        .into()
    };
    let turn = StepName::ModelTurn;
    // The third step adds no message: its usage is stored on its own.
    for (n, position, answers) in [(0u32, 1u64, 1usize), (1, 2, 1), (2, 3, 0)] {
        let entry = Arc::new(JournalEntry {
            step: turn(n),
            record: JournalRecord::ModelReply(reply(u64::from(n) + 1)),
        });
        let answer: Vec<Arc<Message>> = (0..answers).map(|_| Arc::new(Message::assistant("ok"))).collect();
        let step = StepCommit {
            entry: Some(&entry),
            first_position: position,
            messages: &answer,
            fence: Some(Fence { owner: "process-a", epoch: 1, ttl: MINUTE }),
            ..StepCommit::new(&session, &record.run_id)
        };
        store.commit_step(step).await.unwrap();
        // The same step again, as a replay after a crash would write it.
        store.commit_step(step).await.unwrap();
    }
    let stale_entry = Arc::new(JournalEntry { step: turn(3), record: JournalRecord::ModelReply(reply(50)) });
    let stale = StepCommit {
        entry: Some(&stale_entry),
        fence: Some(Fence { owner: "process-b", epoch: 9, ttl: MINUTE }),
        ..StepCommit::new(&session, &record.run_id)
    };
    assert!(store.commit_step(stale).await.is_err());
    let summary = store.session_summary(&session).await.unwrap().expect("the session exists");
    assert_eq!(summary.usage, Usage { input_tokens: 600, output_tokens: 6 });
    assert_eq!((summary.messages, summary.runs), (3, 1));
    let listed = store.list_sessions(SessionFilter::default()).await.unwrap();
    assert_eq!(listed.iter().find(|s| s.id == session).map(|s| s.usage), Some(summary.usage));
    assert!(store.delete_session(&session).await.unwrap());
    assert_eq!(store.session_summary(&session).await.unwrap(), None);
}

/// Memory records: per owner and kind, newest first; `KeepHigher` keeps the record with the
/// higher number; `keep_newest` trims; `forget` erases a record, a kind or everything.
pub async fn memory_is_kept_per_owner_merged_trimmed_and_forgotten(store: &dyn Store, clock: &ManualClock) {
    use keel_core::memory::{MemoryMerge, MemoryWrite};
    let write = |items: Vec<(&str, serde_json::Value)>, merge: MemoryMerge, keep_newest: Option<usize>| {
        MemoryWrite { items: items.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(), merge, keep_newest }
    };
    let (alice, bob) = ("user:alice", "session:bob");
    for n in 0..5 {
        clock.advance(Duration::from_millis(1));
        let episode = write(
            vec![(&format!("run_{n}"), json!({"text": format!("episode {n}")}))],
            MemoryMerge::Replace,
            Some(3),
        );
        store.write_memory(alice, "episode", episode).await.unwrap();
    }
    let episodes = store.load_memory(alice, Some("episode")).await.unwrap();
    let keys: Vec<&str> = episodes.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["run_4", "run_3", "run_2"], "newest first, trimmed to 3");
    assert_eq!(episodes[0].value, json!({"text": "episode 4"}));
    assert!(episodes[0].updated_ms > episodes[1].updated_ms);

    // A relation keeps its highest confidence; rewriting it refreshes it either way.
    clock.advance(Duration::from_millis(1));
    let edge = |confidence: f64| {
        vec![("alice|works_at|acme", json!({"relation": "works_at", "confidence": confidence}))]
    };
    store
        .write_memory(alice, "relation", write(edge(0.9), MemoryMerge::KeepHigher("confidence"), None))
        .await
        .unwrap();
    clock.advance(Duration::from_millis(1));
    store
        .write_memory(alice, "relation", write(edge(0.4), MemoryMerge::KeepHigher("confidence"), None))
        .await
        .unwrap();
    let relations = store.load_memory(alice, Some("relation")).await.unwrap();
    assert_eq!(relations.len(), 1);
    assert_eq!(relations[0].value["confidence"], json!(0.9));
    clock.advance(Duration::from_millis(1));
    store
        .write_memory(alice, "relation", write(edge(0.95), MemoryMerge::KeepHigher("confidence"), None))
        .await
        .unwrap();
    assert_eq!(store.load_memory(alice, Some("relation")).await.unwrap()[0].value["confidence"], json!(0.95));
    // Hostile text round-trips.
    let odd = "'; DROP TABLE memories; --\u{1f}é\\";
    let value = json!({"name": odd, "nul": "\u{0}nul"});
    let entity = write(vec![(odd, value.clone())], MemoryMerge::Replace, None);
    store.write_memory(bob, "entity", entity).await.unwrap();
    let kept = store.load_memory(bob, None).await.unwrap();
    assert_eq!((kept[0].key.as_str(), &kept[0].value), (odd, &value));
    let nul = write(vec![("\u{0}nul", json!(1))], MemoryMerge::Replace, None);
    let refused = store.write_memory(bob, "entity", nul).await;
    assert!(matches!(refused, Err(StoreError::Conflict(_))), "{refused:?}");

    let owners = store.memory_owners().await.unwrap();
    let listed: Vec<(&str, Vec<(&str, u64)>)> = owners
        .iter()
        .map(|o| (o.owner.as_str(), o.counts.iter().map(|(k, n)| (k.as_str(), *n)).collect()))
        .collect();
    assert_eq!(listed, [(bob, vec![("entity", 1)]), (alice, vec![("episode", 3), ("relation", 1)])]);
    assert_eq!(store.load_memory(alice, None).await.unwrap().len(), 4);

    assert_eq!(store.forget(alice, Some("episode"), Some("run_3")).await.unwrap(), 1);
    assert_eq!(store.forget(alice, Some("relation"), None).await.unwrap(), 1);
    assert_eq!(store.load_memory(alice, None).await.unwrap().len(), 2);
    assert_eq!(store.forget(alice, None, None).await.unwrap(), 2);
    assert!(store.load_memory(alice, None).await.unwrap().is_empty());
    assert_eq!(store.forget(alice, None, None).await.unwrap(), 0);
    assert_eq!(store.memory_owners().await.unwrap().len(), 1, "only bob is left");
    store.forget(bob, None, None).await.unwrap();
}

/// Many commits made at once (a backend may run them in one transaction) are each applied or
/// refused on their own: a commit refused (a stale lease, a second run of a busy session, a
/// position past the end) costs the others nothing and writes nothing, and each applied one
/// is whole.
pub async fn commits_made_together_are_each_applied_or_refused_alone(store: &dyn Store) {
    const SESSIONS: usize = 48;
    let sessions: Vec<SessionId> =
        (0..SESSIONS).map(|i| SessionId::new(format!("conformance-together-{i}")).unwrap()).collect();
    let records: Vec<RunRecord> =
        sessions.iter().enumerate().map(|(i, s)| run_record(&format!("together-{i}"), s, 0)).collect();
    let rivals: Vec<RunRecord> =
        sessions.iter().enumerate().map(|(i, s)| run_record(&format!("rival-{i}"), s, 0)).collect();
    let inputs = [Arc::new(Message::user("q"))];
    let started = futures::future::join_all(
        records.iter().map(|record| store.commit_step(new_run_commit(record, "process-a", &inputs, 0))),
    )
    .await;
    assert!(started.iter().all(Result::is_ok), "{started:?}");

    let reply = |n: u64| -> JournaledReply {
        ModelReply {
            parts: vec![Part::Text(format!("answer {n}"))],
            usage: Usage { input_tokens: 10 + n, output_tokens: n },
        }
        .into()
    };
    let entries: Vec<Arc<JournalEntry>> = (0..SESSIONS as u64)
        .map(|n| {
            Arc::new(JournalEntry {
                step: StepName::ModelTurn(0),
                record: JournalRecord::ModelReply(reply(n)),
            })
        })
        .collect();
    let answers: Vec<[Arc<Message>; 1]> =
        (0..SESSIONS).map(|n| [Arc::new(Message::assistant(format!("answer {n}")))]).collect();
    let stale_entry = Arc::new(JournalEntry {
        step: StepName::ModelTurn(1),
        record: JournalRecord::ToolResult(Ok(json!("stale"))),
    });
    let mut commits = Vec::new();
    let mut expected = Vec::new();
    for (i, record) in records.iter().enumerate() {
        let (session, run) = (&sessions[i], &record.run_id);
        let good = Fence { owner: "process-a", epoch: 1, ttl: MINUTE };
        commits.push(StepCommit {
            entry: Some(&entries[i]),
            first_position: 1,
            messages: &answers[i],
            state: Some(RunState::Done).filter(|_| i % 2 == 0),
            fence: Some(good),
            ..StepCommit::new(session, run)
        });
        expected.push("applied");
        if i % 3 == 0 {
            commits.push(StepCommit {
                entry: Some(&stale_entry),
                fence: Some(Fence { owner: "process-b", epoch: 7, ttl: MINUTE }),
                ..StepCommit::new(session, run)
            });
            expected.push("lease lost");
        }
        if i % 4 == 1 {
            commits.push(new_run_commit(&rivals[i], "process-c", &inputs, 1));
            expected.push("busy");
        }
        if i % 5 == 2 {
            commits.push(StepCommit {
                first_position: 9,
                messages: &answers[i],
                fence: Some(good),
                ..StepCommit::new(session, run)
            });
            expected.push("conflict");
        }
    }
    let outcomes = futures::future::join_all(commits.iter().map(|commit| store.commit_step(*commit))).await;
    for ((outcome, expected), commit) in outcomes.iter().zip(&expected).zip(&commits) {
        let got = match outcome {
            Ok(_) => "applied",
            Err(StoreError::LeaseLost(_)) => "lease lost",
            Err(StoreError::Busy(_)) => "busy",
            Err(StoreError::Conflict(_)) => "conflict",
            Err(other) => panic!("commit of {} failed: {other}", commit.run),
        };
        assert_eq!(got, *expected, "commit of {}: {outcome:?}", commit.run);
    }
    for (i, record) in records.iter().enumerate() {
        let session = &sessions[i];
        let transcript: Vec<String> =
            store.load_messages(session).await.unwrap().iter().map(|m| m.text()).collect();
        assert_eq!(transcript, ["q".to_owned(), format!("answer {i}")], "session {session}");
        assert_eq!(journal(store, &record.run_id).await, [entries[i].clone()], "run {i}");
        let usage = store.session_summary(session).await.unwrap().expect("listed").usage;
        assert_eq!(
            usage,
            Usage { input_tokens: 10 + i as u64, output_tokens: i as u64 },
            "session {session}"
        );
        let open = store.open_runs(Some(session)).await.unwrap();
        let open: Vec<&RunId> = open.iter().map(|o| &o.run_id).collect();
        if i % 2 == 0 {
            assert!(open.is_empty(), "session {session}: {open:?}");
        } else {
            assert_eq!(open, [&record.run_id], "session {session}: one unfinished run");
        }
        assert!(store.load_run(&rivals[i].run_id).await.unwrap().is_none(), "a refused run was stored");
    }
}

/// Unfinished runs are listed oldest first whatever their state (a paused run before a newer
/// running one), and a journal comes back in the order it was written, not in its steps' order.
pub async fn open_runs_and_journals_come_in_their_order(store: &dyn Store) {
    let (first, second) =
        (SessionId::new("conformance-order-1").unwrap(), SessionId::new("conformance-order-2").unwrap());
    let older = run_record("order-a", &first, 0);
    let newer = run_record("order-b", &second, 0);
    let input = [Arc::new(Message::user("go"))];
    store.commit_step(new_run_commit(&older, "process-a", &input, 0)).await.unwrap();
    store.commit_step(new_run_commit(&newer, "process-a", &input, 0)).await.unwrap();
    let asked =
        pending("qu_conformance_order", &older, "c1", PendingKind::Question { question: "Which?".into() });
    pause(store, &older, "process-a", 1, std::slice::from_ref(&asked)).await;
    let ours = [older.run_id.clone(), newer.run_id.clone()];
    let open: Vec<(RunId, RunState)> = store
        .open_runs(None)
        .await
        .unwrap()
        .into_iter()
        .filter(|o| ours.contains(&o.run_id))
        .map(|o| (o.run_id, o.state))
        .collect();
    assert_eq!(
        open,
        [(older.run_id.clone(), RunState::AwaitingInput), (newer.run_id.clone(), RunState::Running)],
        "unfinished runs, oldest first"
    );

    // Written: call c9's result, then call a1's (whose step name sorts first).
    let fence = Fence { owner: "process-a", epoch: 1, ttl: MINUTE };
    let (later_named, earlier_named) = (tool_entry("c9", json!(5)), tool_entry("a1", json!(6)));
    for entry in [&later_named, &earlier_named] {
        let commit =
            StepCommit { entry: Some(entry), fence: Some(fence), ..StepCommit::new(&second, &newer.run_id) };
        store.commit_step(commit).await.unwrap();
    }
    assert_eq!(
        journal(store, &newer.run_id).await,
        [later_named, earlier_named],
        "the journal, in write order"
    );
}
