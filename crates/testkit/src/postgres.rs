//! Scratch PostgreSQL databases: each test creates its own on the local server
//! (`KEEL_TEST_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`) and drops it
//! when done, so tests run in parallel and leave nothing behind.

use std::sync::atomic::{AtomicU32, Ordering};

/// The server the tests use.
pub fn server_url() -> String {
    std::env::var(keel_core::env::TEST_POSTGRES.name)
        .ok()
        .filter(|url| !url.trim().is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A database of its own for one test, dropped (with its connections) when this is.
pub struct ScratchDatabase {
    /// Its URL.
    pub url: String,
    name: String,
    server: String,
}

impl ScratchDatabase {
    /// Creates a fresh, empty database. Panics, saying what to do, when the server cannot be
    /// reached: the PostgreSQL tests need it.
    pub fn create(label: &str) -> ScratchDatabase {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let server = server_url();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let label: String = label.chars().filter(char::is_ascii_alphanumeric).take(20).collect();
        let name = format!(
            "keel_test_{}_{}_{}_{nanos}",
            label.to_ascii_lowercase(),
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let sql = format!("CREATE DATABASE {name}");
        let admin_url = server.clone();
        // On a thread of its own: the blocking client cannot run on a thread that drives an
        // async runtime, and tests create databases from async tests.
        let created =
            std::thread::spawn(move || admin(&admin_url).batch_execute(&sql).map_err(|e| e.to_string()))
                .join()
                .unwrap_or_else(|_| Err("the thread creating it panicked (is PostgreSQL reachable?)".into()));
        if let Err(error) = created {
            panic!("CREATE DATABASE {name}: {error}");
        }
        let url = with_database(&server, &name);
        ScratchDatabase { url, name, server }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// `server` with its database replaced by `name`.
fn with_database(server: &str, name: &str) -> String {
    let (base, query) = server.split_once('?').map_or((server, None), |(b, q)| (b, Some(q)));
    let after_scheme = base.find("://").map_or(0, |i| i + 3);
    let base = match base[after_scheme..].find('/') {
        Some(slash) => &base[..after_scheme + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{name}?{query}"),
        None => format!("{base}/{name}"),
    }
}

fn admin(server: &str) -> postgres::Client {
    postgres::Client::connect(server, postgres::NoTls).unwrap_or_else(|error| {
        panic!(
            "the PostgreSQL tests need a server at {server} (set KEEL_TEST_POSTGRES to another): {error}. \
             Start one (`pg_ctlcluster 15 main start`, or `docker run -e POSTGRES_HOST_AUTH_METHOD=trust -p \
             5432:5432 postgres`)"
        )
    })
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        let (server, sql) =
            (self.server.clone(), format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
        let _ = std::thread::spawn(move || {
            if let Ok(mut admin) = postgres::Client::connect(&server, postgres::NoTls) {
                let _ = admin.batch_execute(&sql);
            }
        })
        .join();
    }
}
