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
//! - [`PostgresStore`]: a PostgreSQL database, shared by any number of instances (the
//!   `postgres` cargo feature, on by default).
//!
//! [`open`] picks one from a `--store` value ([`open_existing`] without creating a SQLite
//! file). Every backend must pass [`conformance`], the same tests for all, one or more per rule.

pub mod backend;
pub mod conformance;
mod held;
mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
mod rules;
mod sqlite;
mod wal_frames;

pub use backend::{Backend, CommitSubject, Ruled, RunControl, SessionRows, Tx, Work};
pub use memory::{Memory, MemoryLimits, MemoryStore};
#[cfg(feature = "postgres")]
pub use postgres::{Postgres, PostgresOptions, PostgresStore};
pub use sqlite::{Sqlite, SqliteStore};

use std::sync::Arc;

use keel_core::{Store, StoreError};

/// Opens the store a `--store` / `KEEL_STORE` value names: `memory` (bounded by
/// `KEEL_MEMORY_MAX_SESSIONS` and `KEEL_MEMORY_MAX_IDLE`), `sqlite:<path>`, or `postgres://...`
/// (pool size and statement timeout from `KEEL_STORE_POOL` and `KEEL_STORE_STATEMENT_TIMEOUT`).
pub fn open(spec: &str) -> Result<Arc<dyn Store>, StoreError> {
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return Ok(Arc::new(PostgresStore::connect(spec, postgres_options()?)?));
        #[cfg(not(feature = "postgres"))]
        // The URL is not shown: it may hold a password, and only the driver can parse it.
        return Err(StoreError::Unavailable(
            "this keel was built without PostgreSQL support (the `postgres` cargo feature), so it \
             cannot open a `postgres://` store; use `memory` or `sqlite:<path>`, or install a keel \
             built with the feature (it is on by default)"
                .into(),
        ));
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

/// [`open`] for a caller that only looks at a store or tidies it: a SQLite file that does not
/// exist is read as an empty store, and nothing is created (no file, no directory), so that a
/// mistyped path or the default one asked from another directory leaves nothing behind.
pub fn open_existing(spec: &str) -> Result<Arc<dyn Store>, StoreError> {
    if let Some(path) = spec.strip_prefix("sqlite:")
        && !path.is_empty()
        && matches!(std::path::Path::new(path).try_exists(), Ok(false))
    {
        return Ok(Arc::new(MemoryStore::new()));
    }
    open(spec)
}

/// [`PostgresOptions`] from the environment (`KEEL_STORE_POOL`, `KEEL_STORE_STATEMENT_TIMEOUT`).
#[cfg(feature = "postgres")]
pub fn postgres_options() -> Result<PostgresOptions, StoreError> {
    use keel_core::env;
    let mut options = PostgresOptions::default();
    if let Some(size) = env_count(&env::STORE_POOL, "a number of connections, like 4")? {
        options.pool_size = size;
    }
    if let Some(timeout) = env_duration(&env::STORE_STATEMENT_TIMEOUT, "a duration like `30s`")? {
        options.statement_timeout = timeout;
    }
    Ok(options)
}

/// A store setting read from the environment: a positive whole number, or `None` when unset or
/// blank. `expected` says what a good value looks like, for the error.
pub(crate) fn env_count(var: &keel_core::env::EnvVar, expected: &str) -> Result<Option<usize>, StoreError> {
    env_setting(var, expected, |text| text.parse().ok().filter(|n: &usize| *n > 0))
}

/// A store setting read from the environment: a non-zero duration (`30s`, `24h`), or `None`
/// when unset or blank.
pub(crate) fn env_duration(
    var: &keel_core::env::EnvVar,
    expected: &str,
) -> Result<Option<std::time::Duration>, StoreError> {
    env_setting(var, expected, |text| humantime::parse_duration(text).ok().filter(|d| !d.is_zero()))
}

fn env_setting<T>(
    var: &keel_core::env::EnvVar,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>, StoreError> {
    let Some(text) = std::env::var(var.name).ok().filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    parse(text.trim())
        .map(Some)
        .ok_or_else(|| StoreError::Unavailable(format!("{} must be {expected}, not {text:?}", var.name)))
}

#[cfg(all(test, not(feature = "postgres")))]
mod without_postgres {
    /// A build without the PostgreSQL backend refuses a `postgres://` store by naming the
    /// feature it lacks and what works instead, and never echoes the URL (it may hold a
    /// password). Run by CI's lean build (`scripts/lean-build-test.sh`).
    #[test]
    fn a_postgres_url_names_the_missing_feature_and_not_the_password() {
        for url in ["postgres://keel:hunter2@db:5432/keel", "postgresql://keel:hunter2@db/keel"] {
            let Err(error) = super::open(url) else { panic!("{url} opened without PostgreSQL support") };
            let message = error.to_string();
            assert!(message.contains("the `postgres` cargo feature"), "{message}");
            assert!(message.contains("sqlite:<path>"), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn open_existing_reads_a_missing_sqlite_file_as_empty_and_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not/yet/keel.db");
        let spec = format!("sqlite:{}", path.display());
        let store = open_existing(&spec).unwrap();
        assert!(store.list_sessions(keel_core::SessionFilter::default()).await.unwrap().is_empty());
        assert!(!dir.path().join("not").exists(), "a directory was created");
        assert!(!path.exists());
        assert!(open_existing("sqlite:").is_err(), "an empty path is still refused");
    }
}
