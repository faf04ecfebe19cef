//! keel-store: the [`keel_core::Store`], written once over storage backends.
//!
//! The rules every write obeys (one run per session, lease fencing, a decision taken once,
//! poison runs, cancellation requests) live in one place, `rules`, above the backends; a backend
//! implements storage operations only ([`Tx`], run in transactions by a [`Backend`]), and
//! [`Ruled`] puts the two together:
//!
//! - [`MemoryStore`]: everything in process memory; nothing survives the process. The default
//!   for `keel run`.
//! - [`SqliteStore`]: an embedded SQLite file (WAL); survives restarts.
//!
//! [`open`] picks one from a `--store` value. Every backend must pass [`conformance`], the same
//! tests for all, one or more per rule.

pub mod backend;
pub mod conformance;
mod memory;
mod rules;
mod sqlite;

pub use backend::{Backend, Ruled, RunControl, Tx, Work};
pub use memory::{Memory, MemoryStore};
pub use sqlite::{Sqlite, SqliteStore};

use std::sync::Arc;

use keel_core::{Store, StoreError};

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
