//! The store conformance suite: the same checks, run against every backend.
//!
//! A backend's tests call [`run_all`] with a fresh, empty store. Each check panics with a
//! message naming the broken rule.

use std::sync::Arc;

use keel_core::journal::{JournalEntry, JournalRecord};
use keel_core::{
    Decision, Fence, Message, ModelReply, Part, PendingInput, PendingKind, RunId, RunRecord, RunState,
    SessionId, StepCommit, StepName, Store, StoreError, Usage,
};
use serde_json::json;

/// Runs every check against `store`, which must be empty.
pub async fn run_all(store: &dyn Store) {
    messages_append_idempotently(store).await;
    messages_of_another_run_conflict(store).await;
    runs_round_trip(store).await;
    journal_first_write_wins(store).await;
    sessions_are_listed_and_deleted(store).await;
    steps_commit_whole_and_replay_idempotently(store).await;
    leases_fence_stale_writers(store).await;
    finished_runs_journals_compact(store).await;
    one_live_run_per_session(store).await;
    schedule_ticks_fire_once(store).await;
    pending_inputs_are_decided_once(store).await;
    a_paused_run_holds_its_session(store).await;
    session_state_commits_with_its_step(store).await;
    session_usage_counts_each_model_call_once(store).await;
}

/// Writes through [`Store::commit_step`], the one write path, one part at a time: the suite's
/// way to set up and probe a store. Journal-only and state-only commits name a placeholder
/// session, which they do not touch.
pub async fn create_run(store: &dyn Store, record: &RunRecord) -> Result<(), StoreError> {
    store.commit_step(StepCommit { new_run: Some(record), ..bare(&record.session_id, &record.run_id) }).await
}

/// Appends messages at `first_position..` (see [`Store::commit_step`]).
pub async fn append_messages(
    store: &dyn Store,
    session: &SessionId,
    run: &RunId,
    first_position: u64,
    messages: &[Arc<Message>],
) -> Result<(), StoreError> {
    store.commit_step(StepCommit { first_position, messages, ..bare(session, run) }).await
}

/// Records one journal entry.
pub async fn append_journal(store: &dyn Store, run: &RunId, entry: &JournalEntry) -> Result<(), StoreError> {
    let placeholder = SessionId::new("conformance-placeholder").unwrap();
    store.commit_step(StepCommit { entry: Some(entry), ..bare(&placeholder, run) }).await
}

/// Moves a run to a new state.
pub async fn set_run_state(store: &dyn Store, run: &RunId, state: RunState) -> Result<(), StoreError> {
    let placeholder = SessionId::new("conformance-placeholder").unwrap();
    store.commit_step(StepCommit { state: Some(state), ..bare(&placeholder, run) }).await
}

/// A commit that writes nothing, to fill in.
fn bare<'a>(session: &'a SessionId, run: &'a RunId) -> StepCommit<'a> {
    StepCommit {
        session,
        run,
        new_run: None,
        entry: None,
        first_position: 0,
        messages: &[],
        state: None,
        fence: None,
        pending: &[],
        session_state: None,
    }
}

fn run_record(run: &str, session: &SessionId, history_len: u64) -> RunRecord {
    RunRecord {
        run_id: RunId::from_suffix(run),
        session_id: session.clone(),
        input: Message::user("hi"),
        history_len,
        call_base: 0,
        state: RunState::Running,
    }
}

/// Appending the same messages twice (a replay) stores them once.
pub async fn messages_append_idempotently(store: &dyn Store) {
    let session = SessionId::new("conformance-append").unwrap();
    let run = RunId::from_suffix("append");
    let messages = [Arc::new(Message::user("one")), Arc::new(Message::assistant("two"))];
    append_messages(store, &session, &run, 0, &messages).await.unwrap();
    append_messages(store, &session, &run, 0, &messages).await.unwrap();
    append_messages(store, &session, &run, 1, &messages[1..]).await.unwrap();
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
    let first = RunId::from_suffix("first");
    let second = RunId::from_suffix("second");
    append_messages(store, &session, &first, 0, &[Arc::new(Message::user("a"))]).await.unwrap();
    let err =
        append_messages(store, &session, &second, 0, &[Arc::new(Message::user("b"))]).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "overwrite by another run: {err:?}");
    let err =
        append_messages(store, &session, &second, 5, &[Arc::new(Message::user("b"))]).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "gap: {err:?}");
    assert_eq!(store.load_messages(&session).await.unwrap(), [Arc::new(Message::user("a"))]);
}

/// Runs are stored whole and change state.
pub async fn runs_round_trip(store: &dyn Store) {
    let session = SessionId::new("conformance-runs").unwrap();
    let record = run_record("rt", &session, 3);
    create_run(store, &record).await.unwrap();
    assert_eq!(store.load_run(&record.run_id).await.unwrap().as_ref(), Some(&record));
    assert!(create_run(store, &record).await.is_err(), "a run was created twice");
    set_run_state(store, &record.run_id, RunState::Done).await.unwrap();
    let loaded = store.load_run(&record.run_id).await.unwrap().unwrap();
    assert_eq!(loaded.state, RunState::Done);
    assert_eq!(store.load_run(&RunId::from_suffix("missing")).await.unwrap(), None);
    assert!(set_run_state(store, &RunId::from_suffix("missing"), RunState::Done).await.is_err());
}

/// The first record of a step wins; the journal keeps write order.
pub async fn journal_first_write_wins(store: &dyn Store) {
    let run = RunId::from_suffix("journal");
    let reply = |text: &str| ModelReply {
        parts: vec![keel_core::Part::Text(text.into())],
        usage: Usage { input_tokens: 1, output_tokens: 1 },
    };
    let entries = [
        JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ModelReply(reply("first")) },
        JournalEntry {
            step: StepName::Tool { name: "add".into(), call_id: "c1".into() },
            record: JournalRecord::ToolResult(Ok(json!(5))),
        },
    ];
    for entry in &entries {
        append_journal(store, &run, entry).await.unwrap();
    }
    let duplicate =
        JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ModelReply(reply("second")) };
    append_journal(store, &run, &duplicate).await.unwrap();
    assert_eq!(store.load_journal(&run).await.unwrap(), entries, "a second record replaced the first");
    assert!(store.load_journal(&RunId::from_suffix("empty")).await.unwrap().is_empty());
}

/// Sessions are listed (most recent first) with their counts, and deleted with everything in them.
pub async fn sessions_are_listed_and_deleted(store: &dyn Store) {
    let older = SessionId::new("conformance-list-a").unwrap();
    let newer = SessionId::new("conformance-list-b").unwrap();
    let run = RunId::from_suffix("list-a");
    create_run(store, &run_record("list-a", &older, 0)).await.unwrap();
    append_messages(store, &older, &run, 0, &[Arc::new(Message::user("a"))]).await.unwrap();
    let entry =
        JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ToolResult(Ok(json!(1))) };
    append_journal(store, &run, &entry).await.unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    let other = RunId::from_suffix("list-b");
    let messages = [Arc::new(Message::user("b")), Arc::new(Message::assistant("c"))];
    append_messages(store, &newer, &other, 0, &messages).await.unwrap();

    let listed = store.list_sessions().await.unwrap();
    let position = |id: &SessionId| listed.iter().position(|s| &s.id == id).expect("listed");
    assert!(position(&newer) < position(&older), "not most recent first: {listed:?}");
    let a = &listed[position(&older)];
    assert_eq!((a.messages, a.runs), (1, 1));
    assert_eq!(listed[position(&newer)].messages, 2);

    assert!(store.delete_session(&older).await.unwrap());
    assert!(!store.delete_session(&older).await.unwrap(), "deleting twice found something");
    assert!(store.load_messages(&older).await.unwrap().is_empty());
    assert_eq!(store.load_run(&run).await.unwrap(), None, "the session's runs survived");
    assert!(store.load_journal(&run).await.unwrap().is_empty(), "the runs' journals survived");
    assert_eq!(store.load_messages(&newer).await.unwrap().len(), 2, "another session was touched");
}

/// A step's journal entry, messages and state change land together, and committing the same
/// step again (a replay) changes nothing.
pub async fn steps_commit_whole_and_replay_idempotently(store: &dyn Store) {
    let session = SessionId::new("conformance-commit").unwrap();
    let record = run_record("commit", &session, 0);
    let entry =
        JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ToolResult(Ok(json!("x"))) };
    let messages = [Arc::new(Message::user("q")), Arc::new(Message::assistant("a"))];
    let commit = StepCommit {
        session: &session,
        run: &record.run_id,
        new_run: Some(&record),
        entry: Some(&entry),
        first_position: 0,
        messages: &messages,
        state: Some(RunState::Done),
        fence: None,
        pending: &[],
        session_state: None,
    };
    store.commit_step(commit).await.unwrap();
    // The replay of a step: the run exists by now.
    let replay = StepCommit { new_run: None, ..commit };
    store.commit_step(replay).await.unwrap();
    assert_eq!(store.load_journal(&record.run_id).await.unwrap(), std::slice::from_ref(&entry));
    assert_eq!(store.load_messages(&session).await.unwrap(), messages);
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::Done);
    // A commit that conflicts writes none of its parts.
    let other = RunId::from_suffix("commit-other");
    let late = JournalEntry { step: StepName::ModelTurn(1), record: JournalRecord::ToolResult(Ok(json!(1))) };
    let clash = StepCommit { run: &other, new_run: None, entry: Some(&late), state: None, ..commit };
    assert!(store.commit_step(clash).await.is_err());
    assert_eq!(store.load_messages(&session).await.unwrap(), messages);
    assert!(store.load_journal(&other).await.unwrap().is_empty(), "a failed commit wrote its journal entry");
}

/// A lease is claimed by one owner at a time, expires, and fences a writer that lost it.
pub async fn leases_fence_stale_writers(store: &dyn Store) {
    use std::time::Duration;
    let session = SessionId::new("conformance-lease").unwrap();
    let record = run_record("lease", &session, 0);
    let run = &record.run_id;
    // Long enough to still be held a few statements later on a loaded machine.
    let short = Duration::from_millis(800);
    let first = Fence { owner: "process-a", epoch: 1, ttl: short };
    let messages = [Arc::new(Message::user("q"))];
    let create = StepCommit {
        session: &session,
        run,
        new_run: Some(&record),
        entry: None,
        first_position: 0,
        messages: &messages,
        state: None,
        fence: Some(first),
        pending: &[],
        session_state: None,
    };
    store.commit_step(create).await.unwrap();

    // Held: nobody else may claim it, and it is not interrupted.
    assert_eq!(store.claim_run(run, "process-b", short).await.unwrap(), None);
    assert!(!store.interrupted_runs(Some(&session)).await.unwrap().contains(run));
    assert!(store.renew_lease(run, "process-a", 1, short).await.unwrap());
    assert!(!store.renew_lease(run, "process-b", 1, short).await.unwrap());

    // Expired: the run is interrupted, and another owner takes it with a new epoch.
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(store.interrupted_runs(Some(&session)).await.unwrap(), std::slice::from_ref(run));
    assert!(store.interrupted_runs(None).await.unwrap().contains(run));
    assert_eq!(store.claim_run(run, "process-b", Duration::from_secs(60)).await.unwrap(), Some(2));
    assert!(store.interrupted_runs(Some(&session)).await.unwrap().is_empty());

    // The stalled first owner wakes up: its commit is refused and writes nothing.
    let entry =
        JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ToolResult(Ok(json!(1))) };
    let stale = StepCommit { new_run: None, entry: Some(&entry), messages: &[], ..create };
    let error = store.commit_step(stale).await.unwrap_err();
    assert!(matches!(error, StoreError::LeaseLost(_)), "{error:?}");
    assert!(store.load_journal(run).await.unwrap().is_empty(), "a fenced commit wrote");
    assert!(!store.renew_lease(run, "process-a", 1, short).await.unwrap());
    // The new owner commits.
    let fresh = StepCommit { fence: Some(Fence { owner: "process-b", epoch: 2, ttl: short }), ..stale };
    store.commit_step(fresh).await.unwrap();
    assert_eq!(store.load_journal(run).await.unwrap().len(), 1);

    // Finished runs cannot be claimed; unknown runs are an error.
    set_run_state(store, run, RunState::Done).await.unwrap();
    assert_eq!(store.claim_run(run, "process-c", short).await.unwrap(), None);
    assert!(store.claim_run(&RunId::from_suffix("no-such-run"), "x", short).await.is_err());
}

/// Compaction empties the journals of finished runs, and only theirs.
pub async fn finished_runs_journals_compact(store: &dyn Store) {
    let session = SessionId::new("conformance-compact").unwrap();
    let finished = run_record("compact-done", &session, 0);
    let running = run_record("compact-running", &session, 0);
    for record in [&finished, &running] {
        create_run(store, record).await.unwrap();
        let entry =
            JournalEntry { step: StepName::ModelTurn(0), record: JournalRecord::ToolResult(Ok(json!(1))) };
        append_journal(store, &record.run_id, &entry).await.unwrap();
    }
    set_run_state(store, &finished.run_id, RunState::Done).await.unwrap();
    assert!(store.compact_journals().await.unwrap() >= 1);
    assert!(
        store.load_journal(&finished.run_id).await.unwrap().is_empty(),
        "a finished run kept its journal"
    );
    assert_eq!(store.load_journal(&running.run_id).await.unwrap().len(), 1, "a running run lost its journal");
    assert_eq!(store.compact_journals().await.unwrap(), 0, "compacting twice removed more");
}

/// The first commit of a new run, leased to `owner`.
fn new_run_commit<'a>(
    record: &'a RunRecord,
    owner: &'a str,
    messages: &'a [Arc<Message>],
    first_position: u64,
) -> StepCommit<'a> {
    StepCommit {
        session: &record.session_id,
        run: &record.run_id,
        new_run: Some(record),
        entry: None,
        first_position,
        messages,
        state: None,
        fence: Some(Fence { owner, epoch: 1, ttl: std::time::Duration::from_secs(60) }),
        pending: &[],
        session_state: None,
    }
}

/// A new run is refused while another run of its session is in flight under a live lease (as
/// from another process), and admitted once that run is finished.
pub async fn one_live_run_per_session(store: &dyn Store) {
    let session = SessionId::new("conformance-busy").unwrap();
    let first = run_record("busy-first", &session, 0);
    let second = run_record("busy-second", &session, 1);
    let one = [Arc::new(Message::user("one"))];
    let two = [Arc::new(Message::user("two"))];
    store.commit_step(new_run_commit(&first, "process-a", &one, 0)).await.unwrap();
    let error = store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap_err();
    assert!(matches!(error, StoreError::Busy(_)), "{error:?}");
    assert_eq!(store.load_run(&second.run_id).await.unwrap(), None, "the refused run was stored");
    set_run_state(store, &first.run_id, RunState::Done).await.unwrap();
    store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap();
    assert_eq!(store.load_messages(&session).await.unwrap().len(), 2);
}

/// Each schedule tick is claimed once; an older tick never wins after a newer one.
pub async fn schedule_ticks_fire_once(store: &dyn Store) {
    assert_eq!(store.schedule_last_fire("conformance-weekly").await.unwrap(), None);
    assert!(store.claim_schedule_tick("conformance-weekly", 1_000).await.unwrap());
    assert!(!store.claim_schedule_tick("conformance-weekly", 1_000).await.unwrap(), "a tick fired twice");
    assert!(!store.claim_schedule_tick("conformance-weekly", 500).await.unwrap(), "an older tick fired");
    assert!(store.claim_schedule_tick("conformance-weekly", 2_000).await.unwrap());
    assert_eq!(store.schedule_last_fire("conformance-weekly").await.unwrap(), Some(2_000));
    assert!(store.claim_schedule_tick("conformance-daily", 1_000).await.unwrap(), "schedules share ticks");
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

/// A pause stores the run's pending inputs and releases its lease; a decision is journaled as
/// its step, once: the second is refused, and a later pause does not ask again. The run becomes
/// re-drivable only when the decision comes.
pub async fn pending_inputs_are_decided_once(store: &dyn Store) {
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
    let fence = Some(Fence { owner: "process-a", epoch: 1, ttl: std::time::Duration::from_secs(60) });
    let pause = StepCommit {
        state: Some(RunState::AwaitingInput),
        pending: &both,
        fence,
        ..bare(&session, &record.run_id)
    };
    store.commit_step(pause).await.unwrap();
    assert_eq!(store.pending_inputs(Some(&session)).await.unwrap(), both, "pending inputs round trip");
    assert_eq!(store.pending_inputs(None).await.unwrap(), both);
    assert_eq!(store.pending_input(&question.id).await.unwrap().as_ref(), Some(&question));
    assert_eq!(store.pending_input("qu_nope").await.unwrap(), None);
    let other = SessionId::new("conformance-none").unwrap();
    assert!(store.pending_inputs(Some(&other)).await.unwrap().is_empty());
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::AwaitingInput);
    assert!(
        store.interrupted_runs(Some(&session)).await.unwrap().is_empty(),
        "a paused run with no decision is not re-driven"
    );
    // Paused: the lease is released, so the process that decides may drive the run.
    assert!(
        store
            .claim_run(&record.run_id, "process-b", std::time::Duration::from_secs(60))
            .await
            .unwrap()
            .is_some()
    );
    set_run_state(store, &record.run_id, RunState::AwaitingInput).await.unwrap();

    let decision = Decision::Reject { note: Some("no".into()) };
    assert_eq!(store.decide(&question.id, &Decision::Answer("because".into())).await.unwrap(), question);
    let again = store.decide(&question.id, &Decision::Answer("twice".into())).await.unwrap_err();
    assert!(matches!(again, StoreError::NotPending(_)), "a second decision: {again:?}");
    let unknown = store.decide("ap_nope", &decision).await.unwrap_err();
    assert!(matches!(unknown, StoreError::NotPending(_)), "an unknown id: {unknown:?}");
    let journal = store.load_journal(&record.run_id).await.unwrap();
    assert_eq!(
        journal,
        [JournalEntry {
            step: StepName::Question("c2".into()),
            record: JournalRecord::Decision(Decision::Answer("because".into()))
        }],
        "the first decision is journaled, the second changes nothing"
    );
    assert_eq!(store.load_run(&record.run_id).await.unwrap().unwrap().state, RunState::Running);
    assert_eq!(
        store.interrupted_runs(Some(&session)).await.unwrap(),
        std::slice::from_ref(&record.run_id),
        "a decided run is re-drivable by any process"
    );
    assert_eq!(store.pending_inputs(Some(&session)).await.unwrap(), std::slice::from_ref(&approval));

    // The re-driven run pauses again on the approval: the decided question is not asked again.
    let epoch =
        store.claim_run(&record.run_id, "process-c", std::time::Duration::from_secs(60)).await.unwrap();
    let repause = StepCommit {
        state: Some(RunState::AwaitingInput),
        pending: &both,
        fence: Some(Fence {
            owner: "process-c",
            epoch: epoch.unwrap(),
            ttl: std::time::Duration::from_secs(60),
        }),
        ..bare(&session, &record.run_id)
    };
    store.commit_step(repause).await.unwrap();
    assert_eq!(
        store.pending_inputs(Some(&session)).await.unwrap(),
        std::slice::from_ref(&approval),
        "a decided input was re-asked"
    );

    // Ending the run drops what it still waited for.
    set_run_state(store, &record.run_id, RunState::Cancelled).await.unwrap();
    assert!(store.pending_inputs(None).await.unwrap().is_empty(), "an ended run left pending inputs");
    let late = store.decide(&approval.id, &Decision::Approve { note: None }).await.unwrap_err();
    assert!(matches!(late, StoreError::NotPending(_)), "a decision for an ended run: {late:?}");
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
    let fence = Some(Fence { owner: "process-a", epoch: 1, ttl: std::time::Duration::from_secs(60) });
    let pause = StepCommit {
        state: Some(RunState::AwaitingInput),
        pending: &approval,
        fence,
        ..bare(&session, &record.run_id)
    };
    store.commit_step(pause).await.unwrap();
    let second = run_record("paused-second", &session, 1);
    let two = [Arc::new(Message::user("two"))];
    let error = store.commit_step(new_run_commit(&second, "process-b", &two, 1)).await.unwrap_err();
    assert!(matches!(&error, StoreError::Busy(m) if m.contains("waiting for a human")), "{error:?}");
    assert!(store.delete_session(&session).await.unwrap());
    assert!(
        store.pending_inputs(Some(&session)).await.unwrap().is_empty(),
        "a deleted session left pending inputs"
    );
}

/// The session's state object is written with its step, all or nothing, and goes with the
/// session.
pub async fn session_state_commits_with_its_step(store: &dyn Store) {
    let session = SessionId::new("conformance-state").unwrap();
    assert_eq!(store.load_session_state(&session).await.unwrap(), None, "a new session has no state");
    let record = run_record("state", &session, 0);
    let input = [Arc::new(Message::user("add to cart"))];
    store.commit_step(new_run_commit(&record, "process-a", &input, 0)).await.unwrap();
    let entry = JournalEntry {
        step: StepName::Tool { name: "cart".into(), call_id: "c1".into() },
        record: JournalRecord::ToolResult(Ok(json!("added"))),
    };
    let cart = json!({"items": ["tea"], "total": 4.5});
    let ttl = std::time::Duration::from_secs(60);
    let step = StepCommit {
        entry: Some(&entry),
        session_state: Some(&cart),
        fence: Some(Fence { owner: "process-a", epoch: 1, ttl }),
        ..bare(&session, &record.run_id)
    };
    store.commit_step(step).await.unwrap();
    assert_eq!(store.load_session_state(&session).await.unwrap(), Some(cart.clone()));
    assert_eq!(store.load_messages(&session).await.unwrap().len(), 1, "the state write touched the messages");

    // A stale writer's commit writes neither its journal entry nor its state.
    let stale_entry = JournalEntry {
        step: StepName::Tool { name: "cart".into(), call_id: "c2".into() },
        record: JournalRecord::ToolResult(Ok(json!("emptied"))),
    };
    let emptied = json!({"items": []});
    let stale = StepCommit {
        entry: Some(&stale_entry),
        session_state: Some(&emptied),
        fence: Some(Fence { owner: "process-b", epoch: 7, ttl }),
        ..bare(&session, &record.run_id)
    };
    let error = store.commit_step(stale).await.unwrap_err();
    assert!(matches!(error, StoreError::LeaseLost(_)), "{error:?}");
    assert_eq!(
        store.load_session_state(&session).await.unwrap(),
        Some(cart),
        "a refused commit changed the state"
    );
    assert_eq!(store.load_journal(&record.run_id).await.unwrap(), [entry]);

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
    let ttl = std::time::Duration::from_secs(60);
    let reply = |n: u64| ModelReply {
        parts: vec![Part::Text("ok".into())],
        usage: Usage { input_tokens: 100 * n, output_tokens: n },
    };
    let turn = |n: u32| StepName::ModelTurn(n);
    for (n, position) in [(0u32, 1u64), (1, 2)] {
        let entry =
            JournalEntry { step: turn(n), record: JournalRecord::ModelReply(reply(u64::from(n) + 1)) };
        let answer = [Arc::new(Message::assistant("ok"))];
        let step = StepCommit {
            entry: Some(&entry),
            first_position: position,
            messages: &answer,
            fence: Some(Fence { owner: "process-a", epoch: 1, ttl }),
            ..bare(&session, &record.run_id)
        };
        store.commit_step(step).await.unwrap();
        // The same step again, as a replay after a crash would write it.
        store.commit_step(step).await.unwrap();
    }
    let stale_entry = JournalEntry { step: turn(2), record: JournalRecord::ModelReply(reply(50)) };
    let stale = StepCommit {
        entry: Some(&stale_entry),
        fence: Some(Fence { owner: "process-b", epoch: 9, ttl }),
        ..bare(&session, &record.run_id)
    };
    assert!(store.commit_step(stale).await.is_err());
    let summary = store.session_summary(&session).await.unwrap().expect("the session exists");
    assert_eq!(summary.usage, Usage { input_tokens: 300, output_tokens: 3 });
    assert_eq!((summary.messages, summary.runs), (3, 1));
    let listed = store.list_sessions().await.unwrap();
    assert_eq!(listed.iter().find(|s| s.id == session).map(|s| s.usage), Some(summary.usage));
    assert!(store.delete_session(&session).await.unwrap());
    assert_eq!(store.session_summary(&session).await.unwrap(), None);
}
