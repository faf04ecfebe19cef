//! `keel mcp`: the agent as an MCP server on stdin and stdout, for any MCP client (a desktop
//! assistant, an IDE, another agent). stdout carries the protocol only; logs go to stderr.

#[cfg(feature = "mcp")]
use std::sync::Arc;

#[cfg(feature = "mcp")]
use keel_mcp::AgentServer;
#[cfg(feature = "mcp")]
use rmcp::ServiceExt;

use super::{McpArgs, exit};

/// A build without the `mcp` cargo feature has no MCP server to offer.
#[cfg(not(feature = "mcp"))]
pub(crate) fn mcp(args: &McpArgs) -> std::io::Result<u8> {
    eprintln!(
        "error[{}]: `keel mcp {}`: this keel was built without the `mcp` cargo feature, so it cannot serve an agent over MCP; install a keel with it (the default)",
        keel::ErrorCode::SpecUnsupported.as_str(),
        args.agent.display()
    );
    Ok(exit::INVALID_AGENT)
}

#[cfg(feature = "mcp")]
pub(crate) fn mcp(args: &McpArgs) -> std::io::Result<u8> {
    super::run_async(async {
        let agent = match super::run::load_agent(&args.agent, args.model.as_deref(), &args.store).await? {
            Ok(agent) => agent,
            Err(code) => return Ok(code),
        };
        // Runs paused for a human, and runs a killed `keel mcp` left, continue where they are
        // decided or driven next (`keel approvals ... --agent`, `keel run`).
        let store = args.store.clone();
        let path = args.agent.display().to_string();
        let hint = Arc::new(move |pending: &keel::PendingInput, _session: &str| {
            let verb = match pending.kind {
                keel::PendingKind::Approval { .. } => "approve",
                keel::PendingKind::Question { .. } => "answer",
            };
            let answer = if verb == "answer" { " \"<answer>\"" } else { "" };
            format!(
                "decide with `keel approvals {verb} {}{answer} --store {store} --agent {path}`",
                pending.id
            )
        });
        let caller =
            Arc::new(|_: &rmcp::model::Extensions, session| (session, "MCP client (stdio)".to_owned()));
        let server =
            AgentServer::new(agent.engine().clone(), agent.definition().description.as_deref(), caller, hint);
        eprintln!(
            "keel mcp: agent {} as the MCP tool {} on stdio",
            agent.definition().name,
            server.tool_name()
        );
        let running = match server.serve(rmcp::transport::stdio()).await {
            Ok(running) => running,
            Err(error) => {
                eprintln!("error: the MCP client did not initialize: {error}");
                return Ok(exit::RUN_FAILED);
            }
        };
        let _ = running.waiting().await;
        Ok(exit::OK)
    })?
}
