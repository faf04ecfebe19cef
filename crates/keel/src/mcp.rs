//! MCP servers as tool sources: connecting an agent's servers and checking that their tools'
//! names do not collide with each other or with the agent's other tools.

pub use keel_core::{McpServerDef, McpTransport};
pub use keel_mcp::{McpError, McpServer, RemoteTool};

use keel_core::{ErrorCode, RunFailure};

/// Connects to `servers` in parallel (each within its `startup_timeout`) and checks their
/// tools' names against each other and against `taken` (the agent's other tools): a name two
/// sources share is `KEEL_MCP_TOOL_CONFLICT`, naming both.
pub async fn connect_all(servers: Vec<McpServerDef>, taken: &[String]) -> Result<Vec<McpServer>, RunFailure> {
    let connected = futures::future::join_all(servers.into_iter().map(McpServer::connect)).await;
    let mut owners: std::collections::HashMap<String, String> =
        taken.iter().map(|name| (name.clone(), format!("the agent's tool `{name}`"))).collect();
    let mut servers = Vec::with_capacity(connected.len());
    for server in connected {
        let server = server.map_err(|error| RunFailure::new(error.code, error.message))?;
        for remote in server.remote_tools() {
            let owner = format!("tool `{}` of MCP server `{}`", remote.remote_name, server.name());
            if let Some(other) = owners.get(&remote.spec.name) {
                return Err(RunFailure::new(
                    ErrorCode::McpToolConflict,
                    format!(
                        "two tools would be named `{}`: {owner} and {other}; give the server another `prefix`, or pick its tools with `only`",
                        remote.spec.name
                    ),
                ));
            }
            owners.insert(remote.spec.name.clone(), owner);
        }
        servers.push(server);
    }
    Ok(servers)
}
