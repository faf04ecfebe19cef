//! Every `KEEL_*` environment variable, declared once.
//!
//! Code reads a variable by its constant here (`std::env::var(env::RUN_LEASE.name)`), never by a
//! string of its own; `docs/configuration.md` has a row for each entry of [`ALL`], and a tidy test
//! checks both ways. Reading the environment is the caller's business: this crate does no I/O.

/// One environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvVar {
    /// Its name.
    pub name: &'static str,
    /// Who reads (or sets) it.
    pub scope: Scope,
    /// Its default, as documented.
    pub default: &'static str,
    /// What it does.
    pub what: &'static str,
}

/// Who reads (or sets) a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The `keel` command.
    Cli,
    /// `keel serve`.
    Server,
    /// The runtime, wherever it runs (the CLI, a server, a Rust program).
    Runtime,
    /// Set by keel in a command tool's environment, for the tool to read.
    Tool,
    /// Tests and benchmarks only.
    Testing,
}

impl Scope {
    /// The name used in the documentation table.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Cli => "cli",
            Scope::Server => "server",
            Scope::Runtime => "runtime",
            Scope::Tool => "tool",
            Scope::Testing => "testing",
        }
    }
}

/// keel's own secrets: never passed to a tool, whatever a tool file or `shell.inherit_env` asks.
pub const SECRETS: &[&str] = &[
    API_TOKEN.name,
    JWT_SECRET.name,
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "OPENROUTER_API_KEY",
    "OLLAMA_API_KEY",
];

/// Whether `name` is one of keel's own secrets ([`SECRETS`]).
pub fn is_secret(name: &str) -> bool {
    SECRETS.contains(&name)
}

/// Declares each variable once: a constant, and its entry in [`ALL`].
macro_rules! env_vars {
    ($($(#[doc = $doc:literal])* $constant:ident = $name:literal, $scope:ident, $default:literal, $what:literal;)*) => {
        $($(#[doc = $doc])* pub const $constant: EnvVar =
            EnvVar { name: $name, scope: Scope::$scope, default: $default, what: $what };)*

        /// Every variable, in documentation order.
        pub const ALL: &[EnvVar] = &[$($constant,)*];
    };
}

env_vars! {
    /// The store.
    STORE = "KEEL_STORE", Cli, "`memory` for `keel run`/`chat`, `sqlite:.keel/keel.db` otherwise",
        "where sessions, runs and journals live: `memory`, `sqlite:<path>` or `postgres://user@host:port/database` (same as `--store`)";
    /// The log filter.
    LOG = "KEEL_LOG", Cli, "`warn` (`info` for `keel serve`)",
        "what is logged to stderr, as a tracing filter (`debug`, `keel_runtime=debug,warn`...); the MCP SDK's own logs only when named (`rmcp=debug`)";
    /// The log format.
    LOG_FORMAT = "KEEL_LOG_FORMAT", Cli, "text", "`json` logs one JSON object per line, for log collectors";
    /// The PostgreSQL pool size.
    STORE_POOL = "KEEL_STORE_POOL", Runtime, "4",
        "connections (and worker threads) a `postgres://` store opens";
    /// How many sessions a memory store keeps.
    MEMORY_MAX_SESSIONS = "KEEL_MEMORY_MAX_SESSIONS", Runtime, "10000",
        "sessions a `memory` store keeps: past it, the least recently written sessions without an unfinished run are forgotten";
    /// How long a memory store keeps an idle session.
    MEMORY_MAX_IDLE = "KEEL_MEMORY_MAX_IDLE", Runtime, "`24h`",
        "how long a `memory` store keeps a session without an unfinished run after its last write";
    /// The PostgreSQL statement timeout.
    STORE_STATEMENT_TIMEOUT = "KEEL_STORE_STATEMENT_TIMEOUT", Runtime, "`30s`",
        "how long one statement of a `postgres://` store may run before PostgreSQL cancels it";
    /// Extra root certificates.
    CA_BUNDLE = "KEEL_CA_BUNDLE", Runtime, "unset",
        "a PEM file of root certificates trusted besides the system's, for model providers (a company proxy or a private CA); a file that is not PEM stops keel at start";
    /// Content in spans.
    OTEL_RECORD_CONTENT = "KEEL_OTEL_RECORD_CONTENT", Runtime, "`false`",
        "`true` puts prompts, replies and tool inputs and results into the OpenTelemetry spans (off: spans carry names, models, token counts, ids and errors only)";
    /// Where document indexes live.
    INDEX_DIR = "KEEL_INDEX_DIR", Runtime, "`.keel/index`",
        "where the indexes of semantic memory and skills' knowledge are kept (one folder per documents folder, a version per content); instances that share it share them";
    /// The browser tool's Chromium.
    BROWSER = "KEEL_BROWSER", Runtime, "the first of `chromium`, `chromium-browser`, `google-chrome-stable`, `google-chrome` on `PATH`",
        "the Chromium (or Chrome) executable the `browser` tool starts, once per process";
    /// The browser tool's pages at once.
    BROWSER_PAGES = "KEEL_BROWSER_PAGES", Runtime, "4",
        "how many pages the `browser` tool has open at once in this process (1-64); further calls wait for one to close";
    /// The run lease.
    RUN_LEASE = "KEEL_RUN_LEASE", Runtime, "`30s`",
        "how long a run's lease lasts without a heartbeat: how soon a process on another machine may take \
         over a run whose process died (on the same machine a dead process is noticed at once)";
    /// The API token.
    API_TOKEN = "KEEL_API_TOKEN", Server, "unset (no auth; loopback only)",
        "every route but `/health` needs `Authorization: Bearer <token>`";
    /// The JWT secret.
    JWT_SECRET = "KEEL_JWT_SECRET", Server, "unset", "HS256/384/512 secret for per-user JWTs (sessions owned by `sub`)";
    /// The JWKS.
    JWT_JWKS = "KEEL_JWT_JWKS", Server, "unset",
        "a JWKS file or http(s) URL for RS*/ES* JWTs (a URL is refetched every 10 minutes and on an unknown `kid`)";
    /// The JWT issuer.
    JWT_ISSUER = "KEEL_JWT_ISSUER", Server, "unset", "the issuer (`iss`) JWTs are checked against";
    /// The JWT audience.
    JWT_AUDIENCE = "KEEL_JWT_AUDIENCE", Server, "unset", "the audience (`aud`) JWTs are checked against";
    /// The rate limit.
    RATE_LIMIT = "KEEL_RATE_LIMIT", Server, "unset (no limit)", "requests per minute per identity; beyond, `429`";
    /// Host names a server without auth answers.
    ALLOWED_HOSTS = "KEEL_ALLOWED_HOSTS", Server, "unset (loopback names only)",
        "comma-separated `Host` names a server without auth answers besides `localhost`, `*.localhost` and \
         loopback IPs (a reverse proxy's name, say); `*` accepts any (DNS rebinding is then yours to stop)";
    /// Web origins allowed to call the API.
    CORS_ORIGINS = "KEEL_CORS_ORIGINS", Server, "unset (none)",
        "comma-separated origins (`https://app.example.com`) whose pages may call the API: their CORS \
         preflights are answered; any other page's requests are `403`";
    /// The first-request deadline of a connection.
    FIRST_REQUEST_TIMEOUT = "KEEL_FIRST_REQUEST_TIMEOUT", Server, "`10s`",
        "how long a new connection may take to send its first request's headers before it is closed";
    /// The idle timeout of a connection.
    IDLE_TIMEOUT = "KEEL_IDLE_TIMEOUT", Server, "`60s`",
        "how long a connection with no request in flight stays open (an open event stream is in flight)";
    /// The cap on connections per client address.
    MAX_CONNECTIONS_PER_CLIENT = "KEEL_MAX_CONNECTIONS_PER_CLIENT", Server,
        "512 without auth; no limit with auth",
        "how many connections one client address (an IPv6 client: its /64) may hold; beyond, new ones are \
         closed at once. `0`: no limit";
    /// How long the shared event log keeps events.
    EVENT_RETENTION = "KEEL_EVENT_RETENTION", Server, "`1h`",
        "with a store many instances share (PostgreSQL): how long a session's events stay in the database \
         for observers that reconnect with `Last-Event-ID` (older ones are pruned every minute)";
    /// A tool call's idempotency key.
    IDEMPOTENCY_KEY = "KEEL_IDEMPOTENCY_KEY", Tool, "",
        "`<run_id>:<step>`, the same on every attempt of the call: dedupe side effects with it";
    /// A tool call's run.
    RUN_ID = "KEEL_RUN_ID", Tool, "", "the run the call belongs to";
    /// A tool call's session.
    SESSION_ID = "KEEL_SESSION_ID", Tool, "", "the session the call belongs to";
    /// A tool call's id.
    CALL_ID = "KEEL_CALL_ID", Tool, "", "the call's id";
    /// The session state's file, for a command tool with `state = \"read\"` or `\"write\"`.
    STATE_FILE = "KEEL_STATE_FILE", Tool, "",
        "a file holding the session's state object as JSON (tools with `state = \"read\"` or `\"write\"`); with \
         `write`, what it holds when the program exits successfully replaces the state";
    /// Fault injection.
    FAULT = "KEEL_FAULT", Testing, "unset",
        "`<point>:<step>` aborts the process at that step boundary (or `after_schedule_claim`, right after a \
         schedule's tick is claimed), for crash tests; only in debug builds or builds with the `fault-injection` \
         feature";
    /// The PostgreSQL server the tests use.
    TEST_POSTGRES = "KEEL_TEST_POSTGRES", Testing, "`postgres://postgres@127.0.0.1:5432/postgres`",
        "the PostgreSQL server tests create (and drop) their own databases on";
    /// The keel binary the `keel serve` end-to-end tests run.
    TEST_BINARY = "KEEL_TEST_BINARY", Testing, "the debug build",
        "the `keel` binary the `keel serve` end-to-end tests run (the release build, say, to test the binary that ships)";
    /// Model test iterations.
    MODEL_ITERATIONS = "KEEL_MODEL_ITERATIONS", Testing, "3",
        "iterations of the model-based concurrency test (`tests/it/model.rs`)";
    /// Model test seed.
    MODEL_SEED = "KEEL_MODEL_SEED", Testing, "random", "the first seed of the model-based concurrency test";
    /// Benchmark runs.
    BENCH_RUNS = "KEEL_BENCH_RUNS", Testing, "", "runs per `--profile` pass of the tool-loop benchmark";
    /// Load benchmark streams.
    LOAD_STREAMS = "KEEL_LOAD_STREAMS", Testing, "", "live streams the load benchmark opens";
    /// Load benchmark connections.
    LOAD_CONNECTIONS = "KEEL_LOAD_CONNECTIONS", Testing, "", "connections the load benchmark's turns use";
    /// Load benchmark seconds.
    LOAD_SECONDS = "KEEL_LOAD_SECONDS", Testing, "", "how long each load benchmark phase runs";
    /// Soak turns.
    LOAD_SOAK_TURNS = "KEEL_LOAD_SOAK_TURNS", Testing, "", "turns of the load benchmark's soak";
    /// Soak sessions.
    LOAD_SOAK_SESSIONS = "KEEL_LOAD_SOAK_SESSIONS", Testing, "", "sessions the soak spreads its turns over";
}

/// The variable named `name`, if keel has one.
pub fn find(name: &str) -> Option<&'static EnvVar> {
    ALL.iter().find(|var| var.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut seen = std::collections::HashSet::new();
        for var in ALL {
            assert!(var.name.starts_with("KEEL_"), "{}", var.name);
            assert!(seen.insert(var.name), "{} twice", var.name);
            assert_eq!(find(var.name), Some(var));
        }
    }
}
