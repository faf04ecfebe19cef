//! MCP servers as tool sources: connecting an agent's servers and checking that their tools'
//! names do not collide with each other or with the agent's other tools.

pub use keel_core::{McpServerDef, McpTransport};
pub use keel_mcp::{McpError, McpServer, RemoteTool};

use keel_core::{ErrorCode, RunFailure};

/// Connects to `servers` in parallel (each within its `startup_timeout`) and checks their
/// tools' names against each other and against `taken` (the agent's other tools): a name two
/// sources share is `KEEL_MCP_TOOL_CONFLICT`, naming both. On failure, the first one's code,
/// and every failure in the message (one line each), so that one start names all that is
/// wrong.
pub async fn connect_all(servers: Vec<McpServerDef>, taken: &[String]) -> Result<Vec<McpServer>, RunFailure> {
    let (servers, failures) = connect_each(servers, taken).await;
    let mut failures = failures.into_iter();
    match failures.next() {
        Some(mut first) => {
            for other in failures {
                first.message.push_str(&format!("\nalso error[{}]: {}", other.code, other.message));
            }
            Err(first)
        }
        None => Ok(servers),
    }
}

/// [`connect_all`], keeping every failure (what `keel check` reports): the servers that
/// connected with tools of their own names, and why each of the others is left out.
pub async fn connect_each(servers: Vec<McpServerDef>, taken: &[String]) -> (Vec<McpServer>, Vec<RunFailure>) {
    let connected = futures::future::join_all(servers.into_iter().map(McpServer::connect)).await;
    let mut owners: std::collections::HashMap<String, String> =
        taken.iter().map(|name| (name.clone(), format!("the agent's tool `{name}`"))).collect();
    let mut servers = Vec::with_capacity(connected.len());
    let mut failures = Vec::new();
    'servers: for server in connected {
        let server = match server {
            Ok(server) => server,
            Err(error) => {
                failures.push(RunFailure::new(error.code, error.message));
                continue;
            }
        };
        let mut named = Vec::new();
        for remote in server.remote_tools() {
            let owner = format!("tool `{}` of MCP server `{}`", remote.remote_name, server.name());
            // Against the other sources, and against this server's own tools so far.
            let same = named.iter().find(|(name, _): &&(String, String)| *name == remote.spec.name);
            if let Some(other) = owners.get(&remote.spec.name).or(same.map(|(_, owner)| owner)) {
                failures.push(RunFailure::new(
                    ErrorCode::McpToolConflict,
                    format!(
                        "two tools would be named `{}`: {owner} and {other}; give the server another `prefix`, or pick its tools with `only`",
                        remote.spec.name
                    ),
                ));
                continue 'servers;
            }
            named.push((remote.spec.name.clone(), owner));
        }
        owners.extend(named);
        servers.push(server);
    }
    (servers, failures)
}
