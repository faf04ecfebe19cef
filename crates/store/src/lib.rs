//! keel-store: the [`keel_core::Store`], written once over storage backends.
//!
//! The rules every write obeys (one run per session, lease fencing, a decision taken once,
//! poison runs, cancellation requests) live in one place, `rules`, above the backends; a backend
//! implements storage operations only ([`Tx`], run in transactions by a [`Backend`]), and
//! [`Ruled`] puts the two together:
//!
//! - [`MemoryStore`]: everything in process memory, bounded ([`MemoryLimits`]); nothing survives
//!   the process. The default for `keel run`.
//! - [`SqliteStore`]: an embedded SQLite file (WAL); survives restarts.
//! - [`PostgresStore`]: a PostgreSQL database, shared by any number of instances.
//!
//! [`open`] picks one from a `--store` value. Every backend must pass [`conformance`], the same
//! tests for all, one or more per rule.

pub mod backend;
pub mod conformance;
mod memory;
pub mod postgres;
mod rules;
mod sqlite;

pub use backend::{Backend, CommitSubject, Ruled, RunControl, SessionRows, Tx, Work};
pub use memory::{Memory, MemoryLimits, MemoryStore};
pub use postgres::{Postgres, PostgresOptions, PostgresStore};
pub use sqlite::{Sqlite, SqliteStore};

use std::sync::Arc;

use keel_core::{Store, StoreError};

/// Opens the store a `--store` / `KEEL_STORE` value names: `memory` (bounded by
/// `KEEL_MEMORY_MAX_SESSIONS` and `KEEL_MEMORY_MAX_IDLE`), `sqlite:<path>`, or `postgres://...`
/// (pool size and statement timeout from `KEEL_STORE_POOL` and `KEEL_STORE_STATEMENT_TIMEOUT`).
pub fn open(spec: &str) -> Result<Arc<dyn Store>, StoreError> {
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        return Ok(Arc::new(PostgresStore::connect(spec, postgres_options()?)?));
    }
    if spec == "memory" {
        let limits = MemoryLimits::from_env()?;
        return Ok(Arc::new(MemoryStore::with_limits(limits, keel_core::clock::system())));
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
        "unknown store {spec:?}: use `memory`, `sqlite:<path>` or `postgres://user@host:port/database`"
    )))
}

/// [`PostgresOptions`] from the environment (`KEEL_STORE_POOL`, `KEEL_STORE_STATEMENT_TIMEOUT`).
pub fn postgres_options() -> Result<PostgresOptions, StoreError> {
    use keel_core::env;
    let mut options = PostgresOptions::default();
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(text) = var(env::STORE_POOL.name) {
        options.pool_size = text.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            StoreError::Unavailable(format!(
                "KEEL_STORE_POOL must be a number of connections, like 4, not {text:?}"
            ))
        })?;
    }
    if let Some(text) = var(env::STORE_STATEMENT_TIMEOUT.name) {
        options.statement_timeout =
            humantime::parse_duration(text.trim()).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
                StoreError::Unavailable(format!(
                    "KEEL_STORE_STATEMENT_TIMEOUT must be a duration like `30s`, not {text:?}"
                ))
            })?;
    }
    Ok(options)
}
