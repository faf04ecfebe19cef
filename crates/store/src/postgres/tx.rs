//! Storage operations on PostgreSQL inside one transaction ([`PgTx`]).
//!
//! A statement costs the database far more than the row it writes, so a transaction sends as
//! few as it can:
//!
//! - **What it knows, it does not ask.** A transaction that commits steps starts from one
//!   statement that reads, for every step, the run's control row, the session's message count,
//!   whether the step is journaled already, and whether the session has an open run or a pending
//!   input ([`PgTx::prefetch`]). Its own writes keep that knowledge current, so the rules'
//!   reads of a step commit are answered without a statement.
//! - **Writes of the hot tables wait, and go together.** New runs, run control rows, journal
//!   records, messages and session counters are held ([`Held`]) and written by one statement
//!   ([`write_held_sql`]) before the transaction commits, or before a statement that could read them.
//!   Every other write (pending inputs, decisions, schedules, memory, deletions) is sent at once,
//!   after what is held, so writes reach the database in the order the rules made them.
//!
//! A transaction of many step commits (see `Worker::run_batch`) thus costs the database
//! `BEGIN`, one lock statement, one read, one write and `COMMIT`, however many steps it holds.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use keel_core::journal::JournalEntry;
use keel_core::memory::{MemoryItem, MemoryOwner};
use keel_core::persist::{
    decode_message, decode_pending_kind, decode_record, encode_message, encode_pending_kind, encode_record,
};
use keel_core::{
    DecidedInput, DelayedRun, DelayedRunRecord, Message, PendingInput, RunId, RunRecord, RunState,
    SessionFilter, SessionId, SessionSummary, StepName, StoreError, Usage,
};
use postgres::types::{FromSql, ToSql};
use postgres::{Row, Statement};

use super::{CommitSubject, Params, is_retryable, map_error};
use crate::backend::{
    RunControl, SessionRows, Tx, corrupt, memory_item, memory_owner_rows, read_limits, signed,
    stored_delayed_state, stored_limits, stored_run_id, stored_state,
};

/// How many run-to-session entries a store remembers before it starts over.
const REMEMBERED_RUNS: usize = 100_000;

/// Storage operations inside one transaction. See the module docs.
pub(super) struct PgTx<'a, 'c> {
    tx: &'a mut postgres::Transaction<'c>,
    statements: &'a mut HashMap<String, Statement>,
    shown: &'a str,
    round_trips: &'a AtomicU64,
    /// The sessions of runs this store has seen, for every worker: a write about a run locks
    /// its session without looking it up again.
    run_sessions: &'a Mutex<HashMap<RunId, SessionId>>,
    /// A write transaction (which locks what it touches).
    write: bool,
    /// The lock keys taken in this transaction.
    locked: HashSet<String>,
    /// What this transaction read or wrote, kept current by its writes.
    known: Known,
    /// Writes not sent yet.
    held: Held,
    /// Write operations made so far (held or sent): the batch checks that a refused work wrote
    /// nothing.
    pub(super) writes: u64,
    /// The first statement that failed: PostgreSQL aborted the transaction there, and nothing
    /// more it does counts.
    pub(super) failure: Option<StoreError>,
    /// Set when PostgreSQL aborted the transaction as a deadlock (or could not serialize it):
    /// it may succeed when run again whole.
    pub(super) retry: bool,
}

/// What a transaction knows of rows it read or wrote. Each entry is as the database will have
/// it when the held writes are sent.
#[derive(Default)]
struct Known {
    /// Run control rows (`None`: no such run).
    controls: HashMap<RunId, Option<RunControl>>,
    /// Sessions' message counts.
    counts: HashMap<SessionId, u64>,
    /// Whether a run's step is journaled.
    steps: HashMap<(RunId, String), bool>,
    /// Sessions whose open runs are all in `controls` (none were stored when it was read).
    open_runs: HashSet<SessionId>,
    /// Sessions known to have no pending input.
    no_pending: HashSet<SessionId>,
}

impl Known {
    /// Forgets everything about `session` (its rows were deleted).
    fn forget(&mut self, session: &SessionId) {
        self.controls.retain(|_, control| control.as_ref().is_none_or(|c| &c.session != session));
        self.counts.remove(session);
        self.open_runs.remove(session);
        self.no_pending.remove(session);
    }
}

/// The writes a transaction holds until one statement sends them all ([`write_held_sql`]).
#[derive(Default)]
struct Held {
    new_runs: Vec<NewRun>,
    /// Control rows to write, the latest per run.
    controls: Vec<(RunId, RunControl, u64)>,
    steps: Vec<(RunId, String, String)>,
    messages: Vec<(SessionId, i64, RunId, String)>,
    /// Per session: the message count (when messages were appended: the session is written
    /// then), the tokens added and when.
    sessions: Vec<(SessionId, SessionDelta)>,
}

struct NewRun {
    record: RunRecord,
    control: RunControl,
    at_ms: u64,
}

struct SessionDelta {
    count: Option<u64>,
    usage: Usage,
    at_ms: u64,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.new_runs.is_empty()
            && self.controls.is_empty()
            && self.steps.is_empty()
            && self.messages.is_empty()
            && self.sessions.is_empty()
    }

    fn session(&mut self, session: &SessionId, now_ms: u64) -> &mut SessionDelta {
        let index = match self.sessions.iter().position(|(known, _)| known == session) {
            Some(index) => index,
            None => {
                let delta = SessionDelta { count: None, usage: Usage::default(), at_ms: now_ms };
                self.sessions.push((session.clone(), delta));
                self.sessions.len() - 1
            }
        };
        let delta = &mut self.sessions[index].1;
        delta.at_ms = now_ms;
        delta
    }
}

/// The parts of the statement that sends the held writes, each a data-modifying CTE over
/// arrays (one per column, numbered from `$1` within the part), with how many arrays it takes.
/// A statement holds the parts that have rows ([`write_held_sql`]): it then opens only the
/// tables it writes.
const WRITE_PARTS: [(&str, usize); 6] = [
    (
        r#"new_runs AS (
    INSERT INTO runs (id, session_id, input, history_len, call_base, state, created_at, updated_at,
                      lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by, limits)
    SELECT n.id, n.session_id, n.input, n.history_len, n.call_base, n.state, n.at, n.at,
           n.owner, n.expires, n.epoch, n.attempts, n.cancel_by, n.limits
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::text[], $7::int8[],
                $8::text[], $9::int8[], $10::int8[], $11::int8[], $12::text[], $13::text[])
         AS n(id, session_id, input, history_len, call_base, state, at, owner, expires, epoch, attempts,
              cancel_by, limits))"#,
        13,
    ),
    (
        r#"set_runs AS (
    UPDATE runs SET state = c.state, lease_owner = c.owner, lease_expires_at = c.expires,
                    lease_epoch = c.epoch, attempts = c.attempts, cancel_requested_by = c.cancel_by,
                    updated_at = c.at
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[], $7::text[], $8::int8[])
         AS c(id, state, owner, expires, epoch, attempts, cancel_by, at)
    WHERE runs.id = c.id COLLATE "C")"#,
        8,
    ),
    (
        r#"steps AS (
    INSERT INTO journal (run_id, step, seq, body)
    SELECT j.run_id, j.step,
           (SELECT COALESCE(MAX(x.seq) + 1, 0) FROM journal x WHERE x.run_id = j.run_id COLLATE "C") + j.i - 1,
           j.body
    FROM UNNEST($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS j(run_id, step, body, i)
    ON CONFLICT (run_id, step) DO NOTHING)"#,
        3,
    ),
    (
        r#"added AS (
    INSERT INTO messages (session_id, position, run_id, body)
    SELECT m.session_id, m.position, m.run_id, m.body
    FROM UNNEST($1::text[], $2::int8[], $3::text[], $4::text[]) AS m(session_id, position, run_id, body))"#,
        4,
    ),
    // Sessions that got messages: written (count and `updated_at`).
    (
        r#"written AS (
    INSERT INTO sessions AS s (id, message_count, created_at, updated_at, input_tokens, output_tokens)
    SELECT w.id, w.count, w.at, w.at, w.input, w.output
    FROM UNNEST($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[]) AS w(id, count, at, input, output)
    ON CONFLICT (id) DO UPDATE SET message_count = EXCLUDED.message_count, updated_at = EXCLUDED.updated_at,
        input_tokens = s.input_tokens + EXCLUDED.input_tokens,
        output_tokens = s.output_tokens + EXCLUDED.output_tokens)"#,
        5,
    ),
    // Sessions that only got tokens keep their `updated_at`.
    (
        r#"tokens AS (
    INSERT INTO sessions AS s (id, message_count, created_at, updated_at, input_tokens, output_tokens)
    SELECT t.id, 0, t.at, t.at, t.input, t.output
    FROM UNNEST($1::text[], $2::int8[], $3::int8[], $4::int8[]) AS t(id, at, input, output)
    ON CONFLICT (id) DO UPDATE SET input_tokens = s.input_tokens + EXCLUDED.input_tokens,
        output_tokens = s.output_tokens + EXCLUDED.output_tokens)"#,
        4,
    ),
];

/// The statement of the [`WRITE_PARTS`] in `parts` (bit `i` for part `i`), made once.
fn write_held_sql(parts: usize) -> &'static str {
    static MADE: [std::sync::OnceLock<String>; 1 << WRITE_PARTS.len()] =
        [const { std::sync::OnceLock::new() }; 1 << WRITE_PARTS.len()];
    MADE[parts].get_or_init(|| {
        let mut ctes = Vec::new();
        let mut offset = 0;
        for (index, (sql, arrays)) in WRITE_PARTS.iter().enumerate() {
            if parts & (1 << index) != 0 {
                ctes.push(renumber(sql, offset));
                offset += arrays;
            }
        }
        format!("WITH {} SELECT 1", ctes.join(",\n"))
    })
}

/// `sql` with its parameters `$n` numbered from `offset + 1`.
fn renumber(sql: &str, offset: usize) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        match rest[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + offset).to_string()),
            Err(_) => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// What step commits read, for all of them at once (see [`PgTx::prefetch`]): per step, the
/// run's control row, the session's message count, whether the step is journaled, whether the
/// session has an open run, and whether it has a pending input. Each is a lookup by key (a
/// lateral subquery with `LIMIT 1`, which PostgreSQL cannot turn into a scan of the whole table
/// hashed, as it may an `EXISTS`).
const PREFETCH: &str = r#"
SELECT r.session_id, r.state, r.lease_owner, r.lease_expires_at, r.lease_epoch, r.attempts, r.cancel_requested_by,
       s.message_count, j.found, o.found, p.found
FROM UNNEST($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(session, run, step, i)
LEFT JOIN LATERAL (SELECT * FROM runs WHERE id = u.run COLLATE "C" LIMIT 1) r ON true
LEFT JOIN LATERAL (SELECT message_count FROM sessions WHERE id = u.session COLLATE "C" LIMIT 1) s ON true
LEFT JOIN LATERAL (SELECT true AS found FROM journal
                   WHERE run_id = u.run COLLATE "C" AND step = u.step COLLATE "C" LIMIT 1) j ON true
LEFT JOIN LATERAL (SELECT true AS found FROM runs
                   WHERE session_id = u.session COLLATE "C" AND state IN ('running', 'awaiting_input') LIMIT 1) o ON true
LEFT JOIN LATERAL (SELECT true AS found FROM pending_inputs WHERE session_id = u.session COLLATE "C" LIMIT 1) p ON true
ORDER BY u.i"#;

/// What a new run of a session starts from, in one statement (one snapshot, so no transaction):
/// the state, the transcript, and the first unfinished run.
const READ_SESSION: &str = r#"
SELECT s.state, ARRAY(SELECT body FROM messages WHERE session_id = $1 ORDER BY position),
       o.id, o.session_id, o.state, o.lease_owner, o.lease_expires_at, o.lease_epoch, o.attempts, o.cancel_requested_by
FROM (VALUES (1)) AS one (x)
LEFT JOIN LATERAL (SELECT state FROM sessions WHERE id = $1) s ON true
LEFT JOIN LATERAL (SELECT * FROM runs WHERE session_id = $1 AND state IN ('running', 'awaiting_input')
                   ORDER BY id LIMIT 1) o ON true"#;

/// Reads [`SessionRows`] with [`READ_SESSION`].
pub(super) fn read_session(
    connection: &mut super::Connection<'_>,
    session: &SessionId,
) -> Result<SessionRows, StoreError> {
    let rows = connection.query(READ_SESSION, &[&session.as_str()])?;
    let [row] = rows.as_slice() else {
        return Err(corrupt(format!(
            "{}: reading session {session} gave {} rows",
            connection.shown(),
            rows.len()
        )));
    };
    let state = match get::<Option<String>>(row, 0)? {
        Some(json) => Some(serde_json::from_str(&json).map_err(corrupt)?),
        None => None,
    };
    let messages = get::<Vec<String>>(row, 1)?
        .iter()
        .map(|body| decode_message(body).map(Arc::new).map_err(corrupt))
        .collect::<Result<_, _>>()?;
    let open_run = match get::<Option<String>>(row, 2)? {
        Some(run) => Some((stored_run_id(&run)?, control_row(row, 3)?)),
        None => None,
    };
    Ok(SessionRows { messages, state, open_run })
}

impl<'a, 'c> PgTx<'a, 'c> {
    pub(super) fn new(
        tx: &'a mut postgres::Transaction<'c>,
        statements: &'a mut HashMap<String, Statement>,
        setup: &'a super::Setup,
        write: bool,
    ) -> PgTx<'a, 'c> {
        PgTx {
            tx,
            statements,
            shown: &setup.shown,
            round_trips: &setup.round_trips,
            run_sessions: &setup.run_sessions,
            write,
            locked: HashSet::new(),
            known: Known::default(),
            held: Held::default(),
            writes: 0,
            failure: None,
            retry: false,
        }
    }

    /// Locks the sessions of `subjects` (in one order every process follows, so that two
    /// batches never wait on each other in a cycle) and reads what their step commits need.
    pub(super) fn prefetch(&mut self, subjects: &[CommitSubject]) -> Result<(), StoreError> {
        let mut keys: Vec<String> = subjects.iter().map(|s| session_key(&s.session)).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.retain(|key| !self.locked.contains(key));
        if !keys.is_empty() {
            self.run(
                "SELECT pg_advisory_xact_lock(hashtextextended(k, 0)) FROM UNNEST($1::text[]) AS k",
                &[&keys],
            )?;
            self.locked.extend(keys);
        }
        let sessions: Vec<&str> = subjects.iter().map(|s| s.session.as_str()).collect();
        let runs: Vec<&str> = subjects.iter().map(|s| s.run.as_str()).collect();
        let steps: Vec<Option<String>> =
            subjects.iter().map(|s| s.step.as_ref().map(ToString::to_string)).collect();
        let rows = self.rows(PREFETCH, &[&sessions, &runs, &steps])?;
        if rows.len() != subjects.len() {
            return Err(corrupt(format!(
                "{}: {} rows read for {} steps",
                self.shown,
                rows.len(),
                subjects.len()
            )));
        }
        for (subject, row) in subjects.iter().zip(&rows) {
            let control = match get::<Option<String>>(row, 0)? {
                Some(_) => Some(control_row(row, 0)?),
                None => None,
            };
            if let Some(control) = &control {
                self.remember(&subject.run, &control.session);
            }
            self.known.controls.insert(subject.run.clone(), control);
            let messages = get::<Option<i64>>(row, 7)?.map_or(0, |n| n.max(0) as u64);
            self.known.counts.insert(subject.session.clone(), messages);
            if let Some(step) = &subject.step {
                let journaled = get::<Option<bool>>(row, 8)?.is_some();
                self.known.steps.insert((subject.run.clone(), step.to_string()), journaled);
            }
            if get::<Option<bool>>(row, 9)?.is_none() {
                self.known.open_runs.insert(subject.session.clone());
            }
            if get::<Option<bool>>(row, 10)?.is_none() {
                self.known.no_pending.insert(subject.session.clone());
            }
        }
        Ok(())
    }

    /// Sends the held writes (one statement), if there are any.
    pub(super) fn flush(&mut self) -> Result<(), StoreError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let held = std::mem::take(&mut self.held);
        let mut runs = RunColumns::default();
        for new in &held.new_runs {
            let record = &new.record;
            runs.id.push(record.run_id.as_str());
            runs.session.push(record.session_id.as_str());
            runs.input.push(encode_message(&record.input));
            runs.history_len.push(signed(record.history_len));
            runs.call_base.push(signed(record.call_base));
            runs.limits.push(stored_limits(record));
            runs.at.push(signed(new.at_ms));
            runs.control.push(&new.control);
        }
        let (mut set_ids, mut set_at, mut set) = (Vec::new(), Vec::new(), ControlColumns::default());
        for (run, control, at_ms) in &held.controls {
            set_ids.push(run.as_str());
            set_at.push(signed(*at_ms));
            set.push(control);
        }
        let step_runs: Vec<&str> = held.steps.iter().map(|(run, _, _)| run.as_str()).collect();
        let step_names: Vec<&str> = held.steps.iter().map(|(_, step, _)| step.as_str()).collect();
        let step_bodies: Vec<&str> = held.steps.iter().map(|(_, _, body)| body.as_str()).collect();
        let message_sessions: Vec<&str> = held.messages.iter().map(|(s, _, _, _)| s.as_str()).collect();
        let positions: Vec<i64> = held.messages.iter().map(|(_, p, _, _)| *p).collect();
        let message_runs: Vec<&str> = held.messages.iter().map(|(_, _, r, _)| r.as_str()).collect();
        let bodies: Vec<&str> = held.messages.iter().map(|(_, _, _, b)| b.as_str()).collect();
        let mut written = SessionColumns::default();
        let mut tokens = SessionColumns::default();
        for (session, delta) in &held.sessions {
            match delta.count {
                Some(count) => written.push(session, Some(count), delta),
                None => tokens.push(session, None, delta),
            }
        }
        let columns: [Vec<&(dyn ToSql + Sync)>; 6] = [
            vec![
                &runs.id,
                &runs.session,
                &runs.input,
                &runs.history_len,
                &runs.call_base,
                &runs.control.state,
                &runs.at,
                &runs.control.owner,
                &runs.control.expires,
                &runs.control.epoch,
                &runs.control.attempts,
                &runs.control.cancel_by,
                &runs.limits,
            ],
            vec![
                &set_ids,
                &set.state,
                &set.owner,
                &set.expires,
                &set.epoch,
                &set.attempts,
                &set.cancel_by,
                &set_at,
            ],
            vec![&step_runs, &step_names, &step_bodies],
            vec![&message_sessions, &positions, &message_runs, &bodies],
            vec![&written.id, &written.count, &written.at, &written.input, &written.output],
            vec![&tokens.id, &tokens.at, &tokens.input, &tokens.output],
        ];
        let present = [
            !held.new_runs.is_empty(),
            !held.controls.is_empty(),
            !held.steps.is_empty(),
            !held.messages.is_empty(),
            !written.id.is_empty(),
            !tokens.id.is_empty(),
        ];
        let mut parts = 0;
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::new();
        for (index, part) in columns.iter().enumerate() {
            if present[index] {
                parts |= 1 << index;
                params.extend_from_slice(part);
            }
        }
        self.run(write_held_sql(parts), &params).map(drop)
    }

    /// Runs `sql` (prepared once per connection) as it is: nothing held is sent first.
    fn run(&mut self, sql: &str, params: Params<'_>) -> Result<u64, StoreError> {
        let statement = self.statement(sql)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        match self.tx.execute(&statement, params) {
            Ok(changed) => Ok(changed),
            Err(error) => Err(self.fail(&error)),
        }
    }

    /// Reads with `sql` as it is: nothing held is sent first.
    fn rows(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        let statement = self.statement(sql)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        match self.tx.query(&statement, params) {
            Ok(rows) => Ok(rows),
            Err(error) => Err(self.fail(&error)),
        }
    }

    fn statement(&mut self, sql: &str) -> Result<Statement, StoreError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let statement = match self.tx.prepare(sql) {
            Ok(statement) => statement,
            Err(error) => return Err(self.fail(&error)),
        };
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    fn fail(&mut self, error: &postgres::Error) -> StoreError {
        self.retry |= is_retryable(error);
        let failure = map_error(error, self.shown);
        self.failure.get_or_insert_with(|| failure.clone());
        failure
    }

    /// A read: what is held is sent first, so that the read sees it.
    fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        self.flush()?;
        self.rows(sql, params)
    }

    fn query_opt(&mut self, sql: &str, params: Params<'_>) -> Result<Option<Row>, StoreError> {
        let mut rows = self.query(sql, params)?;
        if rows.len() > 1 {
            return Err(corrupt(format!("{}: one row expected, {} read", self.shown, rows.len())));
        }
        Ok(rows.pop())
    }

    /// A write sent at once, after what is held.
    fn execute(&mut self, sql: &str, params: Params<'_>) -> Result<u64, StoreError> {
        self.flush()?;
        self.writes += 1;
        self.run(sql, params)
    }

    /// Takes the transaction's advisory lock on `key` (once): in a write, before reading
    /// anything the rules decide on.
    fn lock(&mut self, key: String) -> Result<(), StoreError> {
        if !self.write || self.locked.contains(&key) {
            return Ok(());
        }
        self.run("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", &[&key])?;
        self.locked.insert(key);
        Ok(())
    }

    fn lock_session(&mut self, session: &SessionId) -> Result<(), StoreError> {
        self.lock(session_key(session))
    }

    /// Locks the session of `run` (when the run exists).
    fn lock_run(&mut self, run: &RunId) -> Result<(), StoreError> {
        if !self.write {
            return Ok(());
        }
        let known = lock(self.run_sessions).get(run).cloned();
        let session = match known {
            Some(session) => session,
            None => {
                let row = self.query_opt("SELECT session_id FROM runs WHERE id = $1", &[&run.as_str()])?;
                let Some(row) = row else { return Ok(()) };
                let session = session_id(get(&row, 0)?)?;
                self.remember(run, &session);
                session
            }
        };
        self.lock_session(&session)
    }

    /// Remembers the session of `run` (a run never changes session).
    fn remember(&self, run: &RunId, session: &SessionId) {
        let mut known = lock(self.run_sessions);
        if known.len() >= REMEMBERED_RUNS {
            known.clear();
        }
        known.insert(run.clone(), session.clone());
    }

    /// Locks the session of the pending input `id` (when it exists).
    fn lock_pending(&mut self, id: &str) -> Result<(), StoreError> {
        if !self.write {
            return Ok(());
        }
        let row = self.query_opt("SELECT session_id FROM pending_inputs WHERE id = $1", &[&id])?;
        let Some(row) = row else { return Ok(()) };
        let session = session_id(get(&row, 0)?)?;
        self.lock_session(&session)
    }
}

/// The advisory lock key of a session.
fn session_key(session: &SessionId) -> String {
    format!("session:{session}")
}

/// The new runs' columns of [`WRITE_PARTS`].
#[derive(Default)]
struct RunColumns<'h> {
    id: Vec<&'h str>,
    session: Vec<&'h str>,
    input: Vec<String>,
    history_len: Vec<i64>,
    call_base: Vec<i64>,
    limits: Vec<Option<String>>,
    at: Vec<i64>,
    control: ControlColumns<'h>,
}

/// The columns of [`RunControl`]s in [`WRITE_PARTS`] (new runs' and written runs').
#[derive(Default)]
struct ControlColumns<'h> {
    state: Vec<&'static str>,
    owner: Vec<Option<&'h str>>,
    expires: Vec<i64>,
    epoch: Vec<i64>,
    attempts: Vec<i64>,
    cancel_by: Vec<Option<&'h str>>,
}

impl<'h> ControlColumns<'h> {
    fn push(&mut self, control: &'h RunControl) {
        self.state.push(control.state.as_str());
        self.owner.push(control.owner.as_deref());
        self.expires.push(signed(control.lease_expires_ms));
        self.epoch.push(signed(control.epoch));
        self.attempts.push(i64::from(control.attempts));
        self.cancel_by.push(control.cancel_requested_by.as_deref());
    }
}

/// Session columns of [`WRITE_PARTS`].
#[derive(Default)]
struct SessionColumns<'h> {
    id: Vec<&'h str>,
    count: Vec<i64>,
    at: Vec<i64>,
    input: Vec<i64>,
    output: Vec<i64>,
}

impl<'h> SessionColumns<'h> {
    fn push(&mut self, session: &'h SessionId, count: Option<u64>, delta: &SessionDelta) {
        self.id.push(session.as_str());
        if let Some(count) = count {
            self.count.push(signed(count));
        }
        self.at.push(signed(delta.at_ms));
        self.input.push(signed(delta.usage.input_tokens));
        self.output.push(signed(delta.usage.output_tokens));
    }
}

/// A column, or `KEEL_STORE_CORRUPT` when it does not hold what keel stores there.
pub(super) fn get<'r, T: FromSql<'r>>(row: &'r Row, index: usize) -> Result<T, StoreError> {
    row.try_get(index).map_err(corrupt)
}

fn count(row: &Row, index: usize) -> Result<u64, StoreError> {
    Ok(get::<i64>(row, index)?.max(0) as u64)
}

fn session_id(id: String) -> Result<SessionId, StoreError> {
    SessionId::from_store(id).map_err(corrupt)
}

/// The columns of a [`RunControl`], for [`control_row`].
const CONTROL_COLUMNS: &str =
    "session_id, state, lease_owner, lease_expires_at, lease_epoch, attempts, cancel_requested_by";

fn control_row(row: &Row, at: usize) -> Result<RunControl, StoreError> {
    Ok(RunControl {
        session: session_id(get(row, at)?)?,
        state: stored_state(get(row, at + 1)?)?,
        owner: get::<Option<String>>(row, at + 2)?.map(Arc::from),
        lease_expires_ms: get::<Option<i64>>(row, at + 3)?.unwrap_or(0).max(0) as u64,
        epoch: count(row, at + 4)?,
        attempts: u32::try_from(get::<i64>(row, at + 5)?.max(0)).unwrap_or(u32::MAX),
        cancel_requested_by: get(row, at + 6)?,
    })
}

const SUMMARY_SELECT: &str = "SELECT s.id, s.updated_at, s.message_count,
    (SELECT COUNT(*) FROM runs r WHERE r.session_id = s.id), s.input_tokens, s.output_tokens
    FROM sessions s";

fn summary_row(row: &Row) -> Result<SessionSummary, StoreError> {
    Ok(SessionSummary {
        id: session_id(get(row, 0)?)?,
        updated_at_ms: count(row, 1)?,
        messages: count(row, 2)?,
        runs: count(row, 3)?,
        usage: Usage { input_tokens: count(row, 4)?, output_tokens: count(row, 5)? },
    })
}

const PENDING_COLUMNS: &str = "id, run_id, session_id, call_id, body, created_at, expires_at";

fn pending_row(row: &Row) -> Result<PendingInput, StoreError> {
    Ok(PendingInput {
        id: get(row, 0)?,
        run_id: stored_run_id(get(row, 1)?)?,
        session_id: session_id(get(row, 2)?)?,
        call_id: get(row, 3)?,
        kind: decode_pending_kind(get(row, 4)?).map_err(corrupt)?,
        created_at_ms: count(row, 5)?,
        expires_at_ms: count(row, 6)?,
    })
}

fn is_open(state: RunState) -> bool {
    matches!(state, RunState::Running | RunState::AwaitingInput)
}

impl Tx for PgTx<'_, '_> {
    fn message_count(&mut self, session: &SessionId) -> Result<u64, StoreError> {
        self.lock_session(session)?;
        if let Some(count) = self.known.counts.get(session) {
            return Ok(*count);
        }
        let row = self.query_opt("SELECT message_count FROM sessions WHERE id = $1", &[&session.as_str()])?;
        let count = row.map_or(Ok(0), |row| count(&row, 0))?;
        if self.write {
            self.known.counts.insert(session.clone(), count);
        }
        Ok(count)
    }

    fn message_writer(&mut self, session: &SessionId, position: u64) -> Result<Option<RunId>, StoreError> {
        self.lock_session(session)?;
        let row = self.query_opt(
            "SELECT run_id FROM messages WHERE session_id = $1 AND position = $2",
            &[&session.as_str(), &signed(position)],
        )?;
        row.map(|row| stored_run_id(get(&row, 0)?)).transpose()
    }

    fn append_messages(
        &mut self,
        session: &SessionId,
        run: &RunId,
        first_position: u64,
        messages: &[Arc<Message>],
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(session)?;
        self.writes += 1;
        for (offset, message) in messages.iter().enumerate() {
            let position = signed(first_position + offset as u64);
            self.held.messages.push((session.clone(), position, run.clone(), encode_message(message)));
        }
        let count = first_position + messages.len() as u64;
        self.held.session(session, now_ms).count = Some(count);
        self.known.counts.insert(session.clone(), count);
        Ok(())
    }

    fn messages(&mut self, session: &SessionId) -> Result<Vec<Arc<Message>>, StoreError> {
        self.lock_session(session)?;
        let rows = self.query(
            "SELECT body FROM messages WHERE session_id = $1 ORDER BY position",
            &[&session.as_str()],
        )?;
        rows.iter().map(|row| decode_message(get(row, 0)?).map(Arc::new).map_err(corrupt)).collect()
    }

    fn add_usage(&mut self, session: &SessionId, usage: Usage, now_ms: u64) -> Result<(), StoreError> {
        self.lock_session(session)?;
        self.writes += 1;
        let delta = self.held.session(session, now_ms);
        delta.usage.input_tokens += usage.input_tokens;
        delta.usage.output_tokens += usage.output_tokens;
        Ok(())
    }

    fn set_session_state(
        &mut self,
        session: &SessionId,
        state: &serde_json::Value,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(session)?;
        self.execute(
            "INSERT INTO sessions (id, message_count, created_at, updated_at, state) VALUES ($1, 0, $2, $2, $3)
             ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, updated_at = EXCLUDED.updated_at",
            &[&session.as_str(), &signed(now_ms), &state.to_string()],
        )
        .map(drop)
    }

    fn session_state(&mut self, session: &SessionId) -> Result<Option<serde_json::Value>, StoreError> {
        self.lock_session(session)?;
        let row = self.query_opt("SELECT state FROM sessions WHERE id = $1", &[&session.as_str()])?;
        match row.map(|row| get::<Option<String>>(&row, 0)).transpose()?.flatten() {
            Some(json) => serde_json::from_str(&json).map(Some).map_err(corrupt),
            None => Ok(None),
        }
    }

    fn session_summary(&mut self, session: &SessionId) -> Result<Option<SessionSummary>, StoreError> {
        let row = self.query_opt(&format!("{SUMMARY_SELECT} WHERE s.id = $1"), &[&session.as_str()])?;
        row.map(|row| summary_row(&row)).transpose()
    }

    fn sessions(&mut self, filter: &SessionFilter) -> Result<Vec<SessionSummary>, StoreError> {
        let (kind, prefix) = crate::backend::scope_parameters(&filter.scope);
        let limit = filter.limit.map(|limit| i64::try_from(limit).unwrap_or(i64::MAX));
        let rows = self.query(
            &format!(
                "{SUMMARY_SELECT} WHERE $1 = 0 OR ($1 = 1 AND strpos(s.id, '{separator}') = 0)
                   OR ($1 = 2 AND starts_with(s.id, $2))
                 ORDER BY s.updated_at DESC, s.id LIMIT $3",
                separator = SessionId::SCOPE_SEPARATOR
            ),
            &[&kind, &prefix, &limit],
        )?;
        rows.iter().map(summary_row).collect()
    }

    fn delete_session(&mut self, session: &SessionId) -> Result<bool, StoreError> {
        self.lock_session(session)?;
        let id = session.as_str();
        self.execute(
            "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE session_id = $1)",
            &[&id],
        )?;
        self.execute("DELETE FROM pending_inputs WHERE session_id = $1", &[&id])?;
        self.execute("DELETE FROM decided_inputs WHERE session_id = $1", &[&id])?;
        let runs = self.execute("DELETE FROM runs WHERE session_id = $1", &[&id])?;
        self.execute("DELETE FROM messages WHERE session_id = $1", &[&id])?;
        // Its event log goes too; its head stays, so that a session of the same id numbers its
        // events after the old ones and no client's `Last-Event-ID` skips them.
        self.execute("DELETE FROM events WHERE session_id = $1", &[&id])?;
        let sessions = self.execute("DELETE FROM sessions WHERE id = $1", &[&id])?;
        self.known.forget(session);
        self.known.steps.clear();
        Ok(runs + sessions > 0)
    }

    fn insert_run(
        &mut self,
        record: &RunRecord,
        control: &RunControl,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.lock_session(&record.session_id)?;
        self.remember(&record.run_id, &record.session_id);
        self.writes += 1;
        self.known.controls.insert(record.run_id.clone(), Some(control.clone()));
        self.held.new_runs.push(NewRun { record: record.clone(), control: control.clone(), at_ms: now_ms });
        Ok(())
    }

    fn run(&mut self, run: &RunId) -> Result<Option<RunRecord>, StoreError> {
        self.lock_run(run)?;
        let row = self.query_opt(
            "SELECT session_id, input, history_len, call_base, state, limits FROM runs WHERE id = $1",
            &[&run.as_str()],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(RunRecord {
            run_id: run.clone(),
            session_id: session_id(get(&row, 0)?)?,
            input: Arc::new(decode_message(get(&row, 1)?).map_err(corrupt)?),
            history_len: count(&row, 2)?,
            call_base: count(&row, 3)?,
            state: stored_state(get(&row, 4)?)?,
            limits: read_limits(get(&row, 5)?)?,
        }))
    }

    fn control(&mut self, run: &RunId) -> Result<Option<RunControl>, StoreError> {
        // Known rows were read under their session's lock (or written in this transaction).
        if let Some(known) = self.known.controls.get(run) {
            return Ok(known.clone());
        }
        self.lock_run(run)?;
        if !self.write {
            let sql = format!("SELECT {CONTROL_COLUMNS} FROM runs WHERE id = $1");
            let row = self.query_opt(&sql, &[&run.as_str()])?;
            return row.map(|row| control_row(&row, 0)).transpose();
        }
        // In a write, the session's message count comes along: the rules check the transcript
        // next, and the session's lock keeps both as read until the commit.
        let sql = format!(
            "SELECT {CONTROL_COLUMNS}, (SELECT message_count FROM sessions s WHERE s.id = r.session_id)
             FROM runs r WHERE id = $1"
        );
        let Some(row) = self.query_opt(&sql, &[&run.as_str()])? else {
            return Ok(None);
        };
        let control = control_row(&row, 0)?;
        let count = get::<Option<i64>>(&row, 7)?.map_or(0, |n| n.max(0) as u64);
        self.known.counts.entry(control.session.clone()).or_insert(count);
        self.known.controls.insert(run.clone(), Some(control.clone()));
        Ok(Some(control))
    }

    fn set_control(&mut self, run: &RunId, control: &RunControl, now_ms: u64) -> Result<(), StoreError> {
        self.lock_session(&control.session)?;
        self.writes += 1;
        self.known.controls.insert(run.clone(), Some(control.clone()));
        if let Some(new) = self.held.new_runs.iter_mut().find(|new| &new.record.run_id == run) {
            new.control = control.clone();
        } else if let Some(held) = self.held.controls.iter_mut().find(|(held, _, _)| held == run) {
            held.1 = control.clone();
            held.2 = now_ms;
        } else {
            self.held.controls.push((run.clone(), control.clone(), now_ms));
        }
        Ok(())
    }

    fn cancel_requested(&mut self, owner: &str) -> Result<Vec<RunId>, StoreError> {
        let rows = self.query(
            "SELECT id FROM runs WHERE state = 'running' AND lease_owner = $1
               AND cancel_requested_by IS NOT NULL ORDER BY id",
            &[&owner],
        )?;
        rows.iter().map(|row| stored_run_id(get(row, 0)?)).collect()
    }

    fn open_runs(&mut self, session: Option<&SessionId>) -> Result<Vec<(RunId, RunControl)>, StoreError> {
        if let Some(session) = session {
            self.lock_session(session)?;
            if self.known.open_runs.contains(session) {
                let mut open: Vec<(RunId, RunControl)> = self
                    .known
                    .controls
                    .iter()
                    .filter_map(|(run, control)| Some((run, control.as_ref()?)))
                    .filter(|(_, control)| &control.session == session && is_open(control.state))
                    .map(|(run, control)| (run.clone(), control.clone()))
                    .collect();
                open.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
                return Ok(open);
            }
        }
        let rows = match session {
            Some(session) => self.query(
                &format!(
                    "SELECT id, {CONTROL_COLUMNS} FROM runs WHERE session_id = $1
                       AND state IN ('running', 'awaiting_input') ORDER BY id"
                ),
                &[&session.as_str()],
            )?,
            None => self.query(
                &format!(
                    "SELECT id, {CONTROL_COLUMNS} FROM runs WHERE state IN ('running', 'awaiting_input') ORDER BY id"
                ),
                &[],
            )?,
        };
        rows.iter().map(|row| Ok((stored_run_id(get(row, 0)?)?, control_row(row, 1)?))).collect()
    }

    fn has_step(&mut self, run: &RunId, step: &StepName) -> Result<bool, StoreError> {
        if let Some(known) = self.known.steps.get(&(run.clone(), step.to_string())) {
            return Ok(*known);
        }
        self.lock_run(run)?;
        let row = self.query_opt(
            "SELECT 1 FROM journal WHERE run_id = $1 AND step = $2",
            &[&run.as_str(), &step.to_string()],
        )?;
        Ok(row.is_some())
    }

    fn append_journal(&mut self, run: &RunId, entry: &Arc<JournalEntry>) -> Result<bool, StoreError> {
        let key = (run.clone(), entry.step.to_string());
        match self.known.steps.get(&key) {
            Some(true) => Ok(false),
            // Known to be new (read under the session's lock): held with the other writes.
            Some(false) => {
                self.writes += 1;
                self.held.steps.push((key.0.clone(), key.1.clone(), encode_record(&entry.record)));
                self.known.steps.insert(key, true);
                Ok(true)
            }
            None => {
                self.lock_run(run)?;
                let appended = self.execute(
                    "INSERT INTO journal (run_id, step, seq, body)
                     VALUES ($1, $2, (SELECT COALESCE(MAX(seq) + 1, 0) FROM journal WHERE run_id = $1), $3)
                     ON CONFLICT (run_id, step) DO NOTHING",
                    &[&run.as_str(), &key.1, &encode_record(&entry.record)],
                )? == 1;
                self.known.steps.insert(key, true);
                Ok(appended)
            }
        }
    }

    fn journal(&mut self, run: &RunId) -> Result<Vec<JournalEntry>, StoreError> {
        self.lock_run(run)?;
        let rows =
            self.query("SELECT step, body FROM journal WHERE run_id = $1 ORDER BY seq", &[&run.as_str()])?;
        rows.iter()
            .map(|row| {
                let step: &str = get(row, 0)?;
                let step = StepName::parse(step).ok_or_else(|| corrupt(format!("bad step name {step:?}")))?;
                Ok(JournalEntry { step, record: decode_record(get(row, 1)?).map_err(corrupt)? })
            })
            .collect()
    }

    fn compact_journals(&mut self) -> Result<u64, StoreError> {
        self.known.steps.clear();
        self.execute(
            "DELETE FROM journal WHERE run_id IN (SELECT id FROM runs WHERE state IN ('done', 'failed', 'cancelled'))",
            &[],
        )
    }

    fn pending(&mut self, id: &str) -> Result<Option<PendingInput>, StoreError> {
        self.lock_pending(id)?;
        let row =
            self.query_opt(&format!("SELECT {PENDING_COLUMNS} FROM pending_inputs WHERE id = $1"), &[&id])?;
        row.map(|row| pending_row(&row)).transpose()
    }

    fn pending_list(&mut self, session: Option<&SessionId>) -> Result<Vec<PendingInput>, StoreError> {
        if let Some(session) = session {
            self.lock_session(session)?;
            if self.known.no_pending.contains(session) {
                return Ok(Vec::new());
            }
        }
        let rows = match session {
            Some(session) => self.query(
                &format!(
                    "SELECT {PENDING_COLUMNS} FROM pending_inputs WHERE session_id = $1 ORDER BY created_at, seq"
                ),
                &[&session.as_str()],
            )?,
            None => self.query(&format!("SELECT {PENDING_COLUMNS} FROM pending_inputs ORDER BY created_at, seq"), &[])?,
        };
        rows.iter().map(pending_row).collect()
    }

    fn insert_pending(&mut self, pending: &PendingInput) -> Result<(), StoreError> {
        self.lock_session(&pending.session_id)?;
        self.known.no_pending.remove(&pending.session_id);
        self.execute(
            "INSERT INTO pending_inputs (id, run_id, session_id, call_id, step, body, created_at, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &pending.id,
                &pending.run_id.as_str(),
                &pending.session_id.as_str(),
                &pending.call_id,
                &pending.step().to_string(),
                &encode_pending_kind(&pending.kind),
                &signed(pending.created_at_ms),
                &signed(pending.expires_at_ms),
            ],
        )
        .map(drop)
    }

    fn delete_pending(&mut self, id: &str) -> Result<(), StoreError> {
        self.lock_pending(id)?;
        self.execute("DELETE FROM pending_inputs WHERE id = $1", &[&id]).map(drop)
    }

    fn decided(&mut self, id: &str) -> Result<Option<DecidedInput>, StoreError> {
        let row = self.query_opt(
            "SELECT run_id, session_id, outcome, by_whom, at FROM decided_inputs WHERE id = $1",
            &[&id],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(DecidedInput {
            id: id.to_owned(),
            run_id: stored_run_id(get(&row, 0)?)?,
            session_id: session_id(get(&row, 1)?)?,
            outcome: get(&row, 2)?,
            by: get(&row, 3)?,
            at_ms: count(&row, 4)?,
        }))
    }

    fn insert_decided(&mut self, decided: &DecidedInput) -> Result<(), StoreError> {
        self.lock_session(&decided.session_id)?;
        self.execute(
            "INSERT INTO decided_inputs (id, run_id, session_id, outcome, by_whom, at) VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (id) DO UPDATE SET outcome = EXCLUDED.outcome, by_whom = EXCLUDED.by_whom, at = EXCLUDED.at",
            &[
                &decided.id,
                &decided.run_id.as_str(),
                &decided.session_id.as_str(),
                &decided.outcome,
                &decided.by,
                &signed(decided.at_ms),
            ],
        )
        .map(drop)
    }

    fn schedule_last_fire(&mut self, name: &str) -> Result<Option<u64>, StoreError> {
        self.lock(format!("schedule:{name}"))?;
        let row = self.query_opt("SELECT last_fire FROM schedules WHERE name = $1", &[&name])?;
        row.map(|row| count(&row, 0)).transpose()
    }

    fn set_schedule_last_fire(&mut self, name: &str, tick_ms: u64) -> Result<(), StoreError> {
        self.lock(format!("schedule:{name}"))?;
        self.execute(
            "INSERT INTO schedules (name, last_fire) VALUES ($1, $2)
             ON CONFLICT (name) DO UPDATE SET last_fire = EXCLUDED.last_fire",
            &[&name, &signed(tick_ms)],
        )
        .map(drop)
    }

    fn delayed_run(&mut self, run: &RunId) -> Result<Option<DelayedRunRecord>, StoreError> {
        self.lock(format!("delayed:{run}"))?;
        let row = self.query_opt(
            "SELECT session_id, input, due_at, source, state, created_at, held_until, attempts, note
             FROM delayed_runs WHERE run_id = $1",
            &[&run.as_str()],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(DelayedRunRecord {
            run: DelayedRun {
                run_id: run.clone(),
                session_id: session_id(get(&row, 0)?)?,
                input: decode_message(get(&row, 1)?).map_err(corrupt)?,
                due_ms: count(&row, 2)?,
                source: get(&row, 3)?,
            },
            state: stored_delayed_state(get(&row, 4)?)?,
            created_ms: count(&row, 5)?,
            held_until_ms: count(&row, 6)?,
            attempts: u32::try_from(count(&row, 7)?).unwrap_or(u32::MAX),
            note: get(&row, 8)?,
        }))
    }

    fn put_delayed_run(&mut self, record: &DelayedRunRecord) -> Result<(), StoreError> {
        let run = &record.run;
        self.lock(format!("delayed:{}", run.run_id))?;
        self.execute(
            "INSERT INTO delayed_runs (run_id, session_id, input, due_at, source, state, created_at, held_until,
             attempts, note) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT (run_id) DO UPDATE SET state = EXCLUDED.state, held_until = EXCLUDED.held_until,
             attempts = EXCLUDED.attempts, note = EXCLUDED.note",
            &[
                &run.run_id.as_str(),
                &run.session_id.as_str(),
                &encode_message(&run.input),
                &signed(run.due_ms),
                &run.source,
                &record.state.as_str(),
                &signed(record.created_ms),
                &signed(record.held_until_ms),
                &i64::from(record.attempts),
                &record.note,
            ],
        )
        .map(drop)
    }

    fn due_delayed_runs(&mut self, now_ms: u64, limit: usize) -> Result<Vec<RunId>, StoreError> {
        let rows = self.query(
            "SELECT run_id FROM delayed_runs WHERE state = 'waiting' AND due_at <= $1 AND held_until <= $1
             ORDER BY due_at, run_id LIMIT $2",
            &[&signed(now_ms), &signed(limit as u64)],
        )?;
        rows.iter().map(|row| stored_run_id(get(row, 0)?)).collect()
    }

    fn memory_item(&mut self, owner: &str, kind: &str, key: &str) -> Result<Option<MemoryItem>, StoreError> {
        // A write reads what it merges with under the owner's lock: two runs of one owner
        // merging the same relation take turns.
        self.lock(format!("memory:{owner}"))?;
        let row = self.query_opt(
            "SELECT value, updated_at FROM memories WHERE owner = $1 AND kind = $2 AND key = $3",
            &[&owner, &kind, &key],
        )?;
        row.map(|row| memory_item(kind.to_owned(), key.to_owned(), get(&row, 0)?, get(&row, 1)?)).transpose()
    }

    fn put_memory_item(&mut self, owner: &str, item: &MemoryItem) -> Result<(), StoreError> {
        self.lock(format!("memory:{owner}"))?;
        self.execute(
            "INSERT INTO memories (owner, kind, key, value, updated_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (owner, kind, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            &[&owner, &item.kind, &item.key, &item.value.to_string(), &signed(item.updated_ms)],
        )
        .map(drop)
    }

    fn memory_items(&mut self, owner: &str, kind: Option<&str>) -> Result<Vec<MemoryItem>, StoreError> {
        let rows = self.query(
            "SELECT kind, key, value, updated_at FROM memories WHERE owner = $1 AND ($2::text IS NULL OR kind = $2)
             ORDER BY updated_at DESC, key",
            &[&owner, &kind],
        )?;
        rows.iter().map(|row| memory_item(get(row, 0)?, get(row, 1)?, get(row, 2)?, get(row, 3)?)).collect()
    }

    fn delete_memory(
        &mut self,
        owner: &str,
        kind: Option<&str>,
        key: Option<&str>,
    ) -> Result<u64, StoreError> {
        self.lock(format!("memory:{owner}"))?;
        self.execute(
            "DELETE FROM memories WHERE owner = $1 AND ($2::text IS NULL OR kind = $2) AND ($3::text IS NULL OR key = $3)",
            &[&owner, &kind, &key],
        )
    }

    fn memory_owners(&mut self) -> Result<Vec<MemoryOwner>, StoreError> {
        let rows = self.query(
            "SELECT owner, kind, count(*), max(updated_at) FROM memories GROUP BY owner, kind ORDER BY owner, kind",
            &[],
        )?;
        let rows: Vec<(String, String, u64, u64)> = rows
            .iter()
            .map(|row| Ok((get(row, 0)?, get(row, 1)?, count(row, 2)?, count(row, 3)?)))
            .collect::<Result<_, StoreError>>()?;
        Ok(memory_owner_rows(rows.into_iter()))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
