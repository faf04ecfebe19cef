//! `/mcp`: the agent as an MCP server over Streamable HTTP (rmcp's service), behind the same
//! guard and auth as `/chat`. A caller's `sessionId` is scoped to its owner exactly as on
//! `/chat`, so a JWT subject reaches its own sessions only.

use std::sync::Arc;

use keel_mcp::AgentServer;
use rmcp::transport::StreamableHttpService;
use rmcp::transport::streamable_http_server::StreamableHttpServerConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

use crate::AppState;
use crate::auth::Identity;

/// The service mounted at `/mcp`.
pub(crate) fn service(state: &Arc<AppState>) -> StreamableHttpService<AgentServer, LocalSessionManager> {
    let caller = Arc::new(|extensions: &rmcp::model::Extensions, session| {
        // The auth layer put the caller's identity on the HTTP request; rmcp hands its parts on.
        let identity = extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Identity>())
            .cloned();
        match identity {
            Some(identity) => (identity.session(session), format!("MCP {}", identity.describe())),
            None => (session, "MCP client (HTTP)".to_owned()),
        }
    });
    let hint = Arc::new(|pending: &keel_core::PendingInput, session: &str| {
        let body = match pending.kind {
            keel_core::PendingKind::Approval { .. } => r#"{"approved": true}"#,
            keel_core::PendingKind::Question { .. } => r#"{"answer": "..."}"#,
        };
        format!("decide with `POST /chat/{session}/approvals/{}` and the body {body}", pending.id)
    });
    let engine = state.engine.clone();
    let server = AgentServer::new(engine.clone(), engine.agent().description.as_deref(), caller, hint);
    // keel's guard already checked Host and Origin (and auth ran) before a request gets here.
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_cancellation_token(state.closing.child_token());
    StreamableHttpService::new(move || Ok(server.clone()), Arc::new(LocalSessionManager::default()), config)
}
