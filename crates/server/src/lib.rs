//! keel-server: the HTTP API of DESIGN.md §5 over the durable runtime.
//!
//! The server drives the same [`Engine`] as the CLI and the Rust API; it never reimplements the
//! run loop. What it adds is HTTP: request parsing and limits (`routes`), errors as JSON with
//! stable codes (`error`), bearer-token and JWT auth (`auth`), what a web page may not make a
//! browser do (`guard`: Host, Origin, CORS), connection deadlines and caps (`connections`), and
//! live session events over SSE with `Last-Event-ID` resumption (`feed`). It is the only crate
//! that knows HTTP status codes.
//!
//! ```no_run
//! # async fn example(engine: keel_runtime::Engine) -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! let server = keel_server::Server::new(engine, keel_server::ServerOptions::default())?;
//! server.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(())
//! # }
//! ```

mod ai_sdk;
mod auth;
mod channels;
mod connections;
mod delayed;
mod email;
mod error;
mod feed;
mod guard;
#[cfg(feature = "mcp")]
mod mcp;
mod metrics;
mod observe;
mod openai;
#[cfg(test)]
mod openapi_tests;
mod routes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::{delete, get, post};
use keel_runtime::Engine;
use tokio_util::sync::CancellationToken;

pub use auth::{JwtOptions, fetch_jwks, subject_scope};
pub use feed::publish_to_log;
pub use routes::{MAX_BODY, OPENAPI};

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// `KEEL_API_TOKEN`: when set, every route but `/health` needs `Authorization: Bearer <it>`.
    pub api_token: Option<String>,
    /// Per-user auth with JWTs; their subjects own their sessions.
    pub jwt: Option<JwtOptions>,
    /// `KEEL_RATE_LIMIT`: requests per minute per identity (429 `KEEL_RATE_LIMITED` beyond).
    pub rate_limit_per_minute: Option<u32>,
    /// How long a shutdown waits for in-flight runs to reach a step boundary.
    pub shutdown_grace: Duration,
    /// How often runs whose process died (lease expired) are looked for and re-driven.
    pub recover_every: Duration,
    /// How long a request that does not stream may take (504 `KEEL_REQUEST_TIMEOUT` after).
    pub request_timeout: Duration,
    /// `KEEL_ALLOWED_HOSTS`: the `Host` names a server without auth answers besides loopback
    /// ones (`*`: any; DNS rebinding is then yours to prevent).
    pub allowed_hosts: Vec<String>,
    /// `KEEL_CORS_ORIGINS`: the web origins (`https://app.example.com`) whose pages may call the
    /// API; none by default.
    pub cors_origins: Vec<String>,
    /// How long a new connection may take to send its first request (its headers): a client
    /// that connects and sends nothing is cut off after it.
    pub first_request_timeout: Duration,
    /// How long a connection with no request in flight stays open (an open event stream is a
    /// request in flight).
    pub idle_timeout: Duration,
    /// How many connections one client address may hold at once (an IPv6 client: its /64);
    /// `None`: no limit. Beyond it, new connections are closed at once.
    pub max_connections_per_client: Option<usize>,
    /// How long the shared event log of a store that many instances share (PostgreSQL) keeps
    /// events, for observers that reconnect with `Last-Event-ID`.
    pub event_retention: Duration,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            api_token: None,
            jwt: None,
            rate_limit_per_minute: None,
            shutdown_grace: Duration::from_secs(10),
            recover_every: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            first_request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections_per_client: Some(DEFAULT_CONNECTIONS_PER_CLIENT),
            event_retention: Duration::from_secs(3600),
        }
    }
}

/// The default of [`ServerOptions::max_connections_per_client`].
pub const DEFAULT_CONNECTIONS_PER_CLIENT: usize = 512;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) engine: Engine,
    pub(crate) feeds: Arc<feed::Feeds>,
    /// Cancelled when the server shuts down: open streams end.
    pub(crate) closing: CancellationToken,
    pub(crate) metrics: Arc<metrics::Metrics>,
    pub(crate) request_timeout: Duration,
    pub(crate) started_ms: u64,
    pub(crate) api_token: Option<String>,
    pub(crate) jwt: Option<auth::JwtVerifier>,
    pub(crate) rate_limiter: Option<auth::RateLimiter>,
    pub(crate) browser: guard::BrowserPolicy,
    /// The agent's channels (`POST /channels/:name`), with their secrets.
    pub(crate) channels: Vec<channels::Channel>,
    legacy_sessions: AtomicU64,
}

impl AppState {
    /// A fresh session id for a legacy single-turn request that names none.
    pub(crate) fn legacy_session_id(&self) -> String {
        format!("legacy-{}-{}", self.started_ms, self.legacy_sessions.fetch_add(1, Ordering::Relaxed))
    }
}

/// The HTTP API of an engine.
pub struct Server {
    state: Arc<AppState>,
    options: ServerOptions,
}

impl Server {
    /// A server for `engine`. Fails when the JWT settings are unusable (a JWKS that does not
    /// parse, say), saying why.
    pub fn new(engine: Engine, options: ServerOptions) -> Result<Server, String> {
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        let metrics = Arc::new(metrics::Metrics::new());
        let api_token = options.api_token.clone().filter(|t| !t.is_empty());
        let has_auth = api_token.is_some() || options.jwt.is_some();
        let feeds =
            feed::Feeds::new(Arc::clone(&metrics), engine.store().event_log(), options.event_retention);
        let channels = channels::load(&engine.agent())?;
        let state = AppState {
            channels,
            engine,
            feeds: Arc::new(feeds),
            closing: CancellationToken::new(),
            metrics,
            request_timeout: options.request_timeout,
            started_ms,
            api_token,
            jwt: options.jwt.as_ref().map(auth::JwtVerifier::new).transpose()?,
            rate_limiter: options.rate_limit_per_minute.and_then(auth::rate_limiter),
            browser: guard::BrowserPolicy::new(has_auth, &options.allowed_hosts, &options.cors_origins),
            legacy_sessions: AtomicU64::new(0),
        };
        Ok(Server { state: Arc::new(state), options })
    }

    /// The routes, for embedding in another axum app or testing without a socket.
    pub fn router(&self) -> Router {
        let state = &self.state;
        // Routes that answer at once get a timeout; the streaming ones live as long as their run.
        let quick = Router::new()
            .route("/", get(routes::playground))
            .route("/health", get(routes::health))
            .route("/metrics", get(routes::metrics))
            .route("/openapi.json", get(routes::openapi))
            .route("/agent", get(routes::agent))
            .route("/sessions", get(routes::sessions))
            .route("/chat/{session}", get(routes::transcript))
            .route("/chat/{session}/state", get(routes::session_state))
            .route("/chat/{session}/run", delete(routes::cancel))
            .route("/runs", post(delayed::create))
            .route("/runs/{run}", get(delayed::status).delete(delayed::cancel))
            .route("/channels/{name}", post(channels::deliver))
            .route_layer(axum::middleware::from_fn_with_state(Arc::clone(state), observe::timeout));
        let streaming = Router::new()
            .route("/chat", post(routes::chat))
            .route("/chat/{session}/events", get(routes::events))
            .route("/chat/{session}/approvals/{id}", post(routes::decide))
            // The OpenAI-compatible face: its answers take as long as their runs.
            .route("/v1/models", get(openai::models))
            .route("/v1/models/{model}", get(openai::model))
            .route("/v1/chat/completions", post(openai::chat_completions))
            .route("/v1/responses", post(openai::responses))
            // The Vercel AI SDK's UI message stream, for `useChat`.
            .route("/ai-sdk/chat", post(ai_sdk::chat));
        #[cfg(feature = "mcp")]
        let streaming = streaming.route_service("/mcp", mcp::service(state));
        #[cfg(not(feature = "mcp"))]
        let streaming = streaming.route("/mcp", axum::routing::any(routes::mcp_not_built));
        // Outermost first: observe, CORS preflights (listed origins only), the browser guard
        // (Host, Origin), auth, then the routes.
        let routes = quick
            .merge(streaming)
            .fallback(routes::not_found)
            .method_not_allowed_fallback(routes::method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(Arc::clone(state), auth::authenticate))
            .layer(axum::middleware::from_fn_with_state(Arc::clone(state), guard::guard));
        let routes = match guard::cors(&self.options.cors_origins) {
            Some(cors) => routes.layer(cors),
            None => routes,
        };
        routes
            .layer(axum::middleware::from_fn_with_state(Arc::clone(state), observe::observe))
            .with_state(Arc::clone(state))
    }

    /// Serves until `shutdown` completes, then shuts down gracefully: stops accepting, ends the
    /// open streams, and lets in-flight runs reach a step boundary (up to the grace period),
    /// leaving them resumable. Re-drives interrupted runs at start and periodically.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let engine = self.state.engine.clone();
        // Runs the engine drives on its own (a session's unfinished run before a new input, a
        // cancellation it completes) and re-driven runs (after a crash, or decided elsewhere)
        // reach their sessions' observers.
        let feeds = Arc::clone(&self.state.feeds);
        engine.set_observer(move |run| feeds.forward_recovered(run));
        let feeds = Arc::clone(&self.state.feeds);
        let recovery =
            engine.recover_periodically(self.options.recover_every, move |run| feeds.forward_recovered(run));
        // Schedules fire and delayed runs start here, once across the instances sharing the store.
        let feeds = Arc::clone(&self.state.feeds);
        let triggers = keel_runtime::Triggers::new(&engine, move |run| feeds.forward_recovered(run));
        self.state.metrics.watch_triggers(triggers.stats());
        log_schedules(&engine);
        for channel in channels::describe(&self.state.channels) {
            tracing::info!(%channel, "channel mounted");
        }
        let triggers = triggers.spawn();
        let feeds = Arc::clone(&self.state.feeds);
        let swept = Arc::clone(&self.state);
        let sweeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(15));
            loop {
                tick.tick().await;
                // A feed nobody watches is kept a minute after its last event, for reconnects.
                feeds.sweep(Duration::from_secs(60));
                if let Some(limiter) = &swept.rate_limiter {
                    limiter.retain_recent();
                }
            }
        });
        let refreshing = Arc::clone(&self.state);
        let jwks_refresh = tokio::spawn(async move {
            let Some(jwt) = refreshing.jwt.as_ref().filter(|jwt| jwt.has_jwks_url()) else { return };
            let mut tick = tokio::time::interval(Duration::from_secs(600));
            tick.tick().await;
            loop {
                tick.tick().await;
                if let Err(error) = jwt.refresh().await {
                    tracing::warn!(%error, "could not refresh the JWKS; keeping the keys it had");
                }
            }
        });
        let closing = self.state.closing.clone();
        let limits = connections::Limits {
            first_request: self.options.first_request_timeout,
            idle: self.options.idle_timeout,
            per_client: self.options.max_connections_per_client,
        };
        let result = connections::accept_loop(
            listener,
            self.router(),
            shutdown,
            closing.clone(),
            self.options.shutdown_grace,
            limits,
            Arc::clone(&self.state.metrics),
        )
        .await;
        // Whether the server stopped on the signal or failed, runs end at a step boundary.
        closing.cancel();
        recovery.abort();
        triggers.abort();
        sweeper.abort();
        jwks_refresh.abort();
        let left = engine.shutdown(self.options.shutdown_grace).await;
        if left > 0 {
            tracing::warn!(
                runs = left,
                "runs were still in a step at the end of the grace period; they resume on the next start"
            );
        }
        result
    }
}

/// Says which schedules this server fires, and when each fires next.
fn log_schedules(engine: &Engine) {
    let agent = engine.agent();
    let now = engine.clock().now_ms();
    for schedule in &agent.schedules {
        let next = schedule.cron.next_after(now);
        tracing::info!(
            schedule = %schedule.name,
            cron = %schedule.cron.expression(),
            timezone = %schedule.cron.timezone(),
            next = %next.map_or_else(|| "never".to_owned(), |at| schedule.cron.local_time(at)),
            "schedule mounted"
        );
    }
}

/// Refuses to listen on a non-loopback address without auth: an agent server open to the
/// network with no credentials is a remote-execution service for anyone.
pub fn check_bind(address: &SocketAddr, options: &ServerOptions) -> Result<(), String> {
    let has_auth = options.api_token.as_deref().is_some_and(|t| !t.is_empty()) || options.jwt.is_some();
    if address.ip().is_loopback() || has_auth {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {address} without authentication: anyone who can reach it could run the agent \
         and its tools. Set KEEL_API_TOKEN (clients then send `Authorization: Bearer <token>`), or listen on \
         127.0.0.1"
    ))
}
