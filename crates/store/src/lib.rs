//! keel-store: backends of the [`keel_core::Store`] trait.
//!
//! - [`MemoryStore`]: everything in process memory; nothing survives the process. The default
//!   for `keel run`.
//! - [`SqliteStore`]: an embedded SQLite file (WAL); survives restarts.
//!
//! [`open`] picks one from a `--store` value.
//!
//! Every backend must pass [`conformance`], the same tests for all.

pub mod conformance;
mod memory;
mod sqlite;

pub use memory::MemoryStore;
pub use sqlite::SqliteStore;

use std::sync::Arc;

use keel_core::{Store, StoreError};

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Why a new run of `session` is refused: `other` owns the session.
pub(crate) fn busy_error(
    session: &keel_core::SessionId,
    other: &keel_core::RunId,
    state: keel_core::RunState,
) -> StoreError {
    if state == keel_core::RunState::AwaitingInput {
        StoreError::Busy(format!(
            "session {session} has a run waiting for a human ({other}); decide its pending approvals or \
             questions first (`keel approvals list`), or cancel it"
        ))
    } else {
        StoreError::Busy(format!(
            "session {session} already has a run in flight ({other}); wait for it to finish or cancel it"
        ))
    }
}

/// Opens the store a `--store` / `KEEL_STORE` value names: `memory`, or `sqlite:<path>`.
pub fn open(spec: &str) -> Result<Arc<dyn Store>, StoreError> {
    if spec == "memory" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    if let Some(path) = spec.strip_prefix("sqlite:") {
        if path.is_empty() {
            return Err(StoreError::Unavailable(
                "`sqlite:` needs a path, e.g. `sqlite:.keel/keel.db`".into(),
            ));
        }
        return Ok(Arc::new(SqliteStore::open(std::path::Path::new(path))?));
    }
    Err(StoreError::Unavailable(format!(
        "unknown store {spec:?}: use `memory` or `sqlite:<path>` (PostgreSQL comes in a later version)"
    )))
}
