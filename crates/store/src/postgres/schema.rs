//! The `keel` schema in PostgreSQL: one migration per version, applied once across processes.

use postgres::Client;

use super::map_error;
use crate::backend::corrupt;
use keel_core::StoreError;

/// The schema, one migration per version (index 0 makes version 1).
pub(super) const MIGRATIONS: &[&str] = &[
    // Version 1: what SQLite's seven versions built, at once.
    r#"CREATE TABLE sessions (
        id TEXT COLLATE "C" PRIMARY KEY,
        message_count BIGINT NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        state TEXT,
        input_tokens BIGINT NOT NULL DEFAULT 0,
        output_tokens BIGINT NOT NULL DEFAULT 0
    );
    CREATE TABLE messages (
        session_id TEXT COLLATE "C" NOT NULL,
        position BIGINT NOT NULL,
        run_id TEXT COLLATE "C" NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (session_id, position)
    );
    CREATE TABLE runs (
        id TEXT COLLATE "C" PRIMARY KEY,
        session_id TEXT COLLATE "C" NOT NULL,
        input TEXT NOT NULL,
        history_len BIGINT NOT NULL,
        call_base BIGINT NOT NULL,
        state TEXT COLLATE "C" NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        lease_owner TEXT COLLATE "C",
        lease_expires_at BIGINT,
        lease_epoch BIGINT NOT NULL DEFAULT 0,
        attempts BIGINT NOT NULL DEFAULT 0,
        cancel_requested_by TEXT
    );
    CREATE INDEX runs_open ON runs (session_id, state);
    CREATE INDEX runs_leased ON runs (state, lease_owner);
    CREATE TABLE journal (
        run_id TEXT COLLATE "C" NOT NULL,
        step TEXT COLLATE "C" NOT NULL,
        seq BIGINT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (run_id, step)
    );
    CREATE TABLE schedules (
        name TEXT COLLATE "C" PRIMARY KEY,
        last_fire BIGINT NOT NULL
    );
    CREATE TABLE pending_inputs (
        seq BIGSERIAL NOT NULL,
        id TEXT COLLATE "C" PRIMARY KEY,
        run_id TEXT COLLATE "C" NOT NULL,
        session_id TEXT COLLATE "C" NOT NULL,
        call_id TEXT NOT NULL,
        step TEXT NOT NULL,
        body TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL
    );
    CREATE INDEX pending_by_session ON pending_inputs (session_id);
    CREATE INDEX pending_by_run ON pending_inputs (run_id);
    CREATE TABLE decided_inputs (
        id TEXT COLLATE "C" PRIMARY KEY,
        run_id TEXT COLLATE "C" NOT NULL,
        session_id TEXT COLLATE "C" NOT NULL,
        outcome TEXT NOT NULL,
        by_whom TEXT NOT NULL,
        at BIGINT NOT NULL
    );
    CREATE INDEX decided_by_session ON decided_inputs (session_id);"#,
    // Version 2: the shared event log (`events.rs`). `event_heads` numbers each session's
    // events and orders its appenders; `event_batches` makes an append idempotent.
    r#"CREATE TABLE event_heads (
        session_id TEXT COLLATE "C" PRIMARY KEY,
        last_seq BIGINT NOT NULL
    );
    CREATE TABLE events (
        session_id TEXT COLLATE "C" NOT NULL,
        seq BIGINT NOT NULL,
        run_id TEXT COLLATE "C" NOT NULL,
        body TEXT,
        at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, seq)
    );
    CREATE INDEX events_at ON events USING brin (at);
    CREATE TABLE event_batches (
        id BIGINT PRIMARY KEY,
        at TIMESTAMPTZ NOT NULL DEFAULT now()
    );"#,
    // Version 3: delayed runs (`POST /runs`, `keel run --after`, schedules' fires), stored
    // until they start.
    r#"CREATE TABLE delayed_runs (
        run_id TEXT COLLATE "C" PRIMARY KEY,
        session_id TEXT COLLATE "C" NOT NULL,
        input TEXT NOT NULL,
        due_at BIGINT NOT NULL,
        source TEXT NOT NULL,
        state TEXT COLLATE "C" NOT NULL,
        created_at BIGINT NOT NULL,
        held_until BIGINT NOT NULL,
        attempts BIGINT NOT NULL,
        note TEXT
    );
    CREATE INDEX delayed_due ON delayed_runs (state, due_at);"#,
    // Version 4: a run's own limits (`persist::encode_overrides`; NULL for the agent's).
    "ALTER TABLE runs ADD COLUMN limits TEXT;",
    // Version 5: what agents remember about their owners (episodes, entities, relations).
    r#"CREATE TABLE memories (
        owner TEXT COLLATE "C" NOT NULL,
        kind TEXT COLLATE "C" NOT NULL,
        key TEXT COLLATE "C" NOT NULL,
        value TEXT NOT NULL,
        updated_at BIGINT NOT NULL,
        PRIMARY KEY (owner, kind, key)
    );
    CREATE INDEX memories_recent ON memories (owner, kind, updated_at);"#,
    // Version 6: indexes that leave the planner no wrong choice. A session has at most one
    // unfinished run (the store's first rule), which the database now enforces too; a
    // lookup of it by session is that unique index, where `runs_leased (state, ...)` could be
    // taken instead, scanning every running run. Cancellation polls read the few runs asked to
    // stop.
    r#"CREATE UNIQUE INDEX runs_unfinished ON runs (session_id) WHERE state IN ('running', 'awaiting_input');
    CREATE INDEX runs_cancelling ON runs (lease_owner) WHERE state = 'running' AND cancel_requested_by IS NOT NULL;
    DROP INDEX runs_leased;"#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The advisory lock migrations take (an arbitrary constant: "keel" in ASCII).
const MIGRATION_LOCK: i64 = 0x6b65_656c;

/// Creates or brings forward the `keel` schema, once across processes (an advisory lock).
pub(super) fn migrate(client: &mut Client, shown: &str) -> Result<(), StoreError> {
    let fail = |error: postgres::Error| map_error(&error, shown);
    let mut tx = client.transaction().map_err(fail)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).map_err(fail)?;
    tx.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS keel;
         CREATE TABLE IF NOT EXISTS keel.schema_version (version BIGINT NOT NULL)",
    )
    .map_err(fail)?;
    let version: i64 = tx
        .query_opt("SELECT version FROM keel.schema_version", &[])
        .map_err(fail)?
        .map(|row| row.try_get(0))
        .transpose()
        .map_err(|e| corrupt(format!("{shown}: keel.schema_version: {e}")))?
        .unwrap_or(0);
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema { found: version, supported: SCHEMA_VERSION });
    }
    if version == SCHEMA_VERSION {
        return tx.commit().map_err(fail);
    }
    for migration in MIGRATIONS.iter().skip(usize::try_from(version).unwrap_or(0)) {
        tx.batch_execute(migration).map_err(fail)?;
    }
    tx.execute("DELETE FROM keel.schema_version", &[]).map_err(fail)?;
    tx.execute("INSERT INTO keel.schema_version (version) VALUES ($1)", &[&SCHEMA_VERSION]).map_err(fail)?;
    tx.commit().map_err(fail)
}
