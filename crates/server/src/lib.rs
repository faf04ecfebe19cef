//! keel-server: the HTTP API of DESIGN.md §5 over the durable runtime.
//!
//! The server drives the same [`Engine`] as the CLI and the Rust API; it never reimplements the
//! run loop. What it adds is HTTP: request parsing and limits (`routes`), errors as JSON with
//! stable codes (`error`), bearer-token auth (`auth`), and live session events over SSE with
//! `Last-Event-ID` resumption (`feed`). It is the only crate that knows HTTP status codes.
//!
//! ```no_run
//! # async fn example(engine: keel_runtime::Engine) -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! let server = keel_server::Server::new(engine, keel_server::ServerOptions::default());
//! server.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

mod auth;
mod error;
mod feed;
mod routes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::{delete, get, post};
use keel_runtime::Engine;
use tokio_util::sync::CancellationToken;

pub use routes::MAX_BODY;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// `KEEL_API_TOKEN`: when set, every route but `/health` needs `Authorization: Bearer <it>`.
    pub api_token: Option<String>,
    /// How long a shutdown waits for in-flight runs to reach a step boundary.
    pub shutdown_grace: Duration,
    /// How often runs whose process died (lease expired) are looked for and re-driven.
    pub recover_every: Duration,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            api_token: None,
            shutdown_grace: Duration::from_secs(10),
            recover_every: Duration::from_secs(10),
        }
    }
}

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) engine: Engine,
    pub(crate) feeds: Arc<feed::Feeds>,
    /// Cancelled when the server shuts down: open streams end.
    pub(crate) closing: CancellationToken,
    api_token: Option<String>,
    legacy_sessions: AtomicU64,
    started_ms: u64,
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
    /// A server for `engine`.
    pub fn new(engine: Engine, options: ServerOptions) -> Server {
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        let state = AppState {
            engine,
            feeds: Arc::new(feed::Feeds::new()),
            closing: CancellationToken::new(),
            api_token: options.api_token.clone().filter(|t| !t.is_empty()),
            legacy_sessions: AtomicU64::new(0),
            started_ms,
        };
        Server { state: Arc::new(state), options }
    }

    /// The routes, for embedding in another axum app or testing without a socket.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/health", get(routes::health))
            .route("/chat", post(routes::chat))
            .route("/chat/{session}", get(routes::transcript))
            .route("/chat/{session}/events", get(routes::events))
            .route("/chat/{session}/approvals/{id}", post(routes::decide))
            .route("/chat/{session}/run", delete(routes::cancel))
            .fallback(routes::not_found)
            .method_not_allowed_fallback(routes::method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(Arc::clone(&self.state), auth::require_token))
            .with_state(Arc::clone(&self.state))
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
        let recovery = engine.recover_periodically(self.options.recover_every);
        let feeds = Arc::clone(&self.state.feeds);
        let sweeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(30));
            loop {
                tick.tick().await;
                feeds.sweep(Duration::from_secs(300));
            }
        });
        let closing = self.state.closing.clone();
        let stopped = closing.clone();
        let app = self.router();
        let serving = axum::serve(listener, app).with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: no new requests; open streams end");
            closing.cancel();
        });
        let result = serving.await;
        // Whether the server stopped on the signal or failed, runs end at a step boundary.
        stopped.cancel();
        recovery.abort();
        sweeper.abort();
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

/// Refuses to listen on a non-loopback address without auth: an agent server open to the
/// network with no credentials is a remote-execution service for anyone.
pub fn check_bind(address: &SocketAddr, options: &ServerOptions) -> Result<(), String> {
    let has_auth = options.api_token.as_deref().is_some_and(|t| !t.is_empty());
    if address.ip().is_loopback() || has_auth {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {address} without authentication: anyone who can reach it could run the agent \
         and its tools. Set KEEL_API_TOKEN (clients then send `Authorization: Bearer <token>`), or listen on \
         127.0.0.1"
    ))
}
