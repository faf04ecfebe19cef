//! MCP servers' tools as keel tools, on the official Rust SDK (`rmcp`).
//!
//! [`McpServer::connect`] starts a stdio server (a child process, contained like keel's other
//! helpers: minimal environment, its own process group that dies with keel) or reaches a
//! Streamable HTTP server, finishes `initialize`, and lists its tools. [`McpServer::tools`]
//! gives them as ordinary [`keel_core::Tool`]s named `<prefix><tool>`: the runtime journals each
//! call as a step like any other, so a replay never asks the server again; the call carries its
//! idempotency key in `_meta` (`keel/idempotencyKey`).
//!
//! After the first connection a supervisor task owns the link: when the server dies (or an HTTP
//! server stops answering) the calls in flight end with `KEEL_MCP_UNAVAILABLE` at once, and the
//! server is started again with backoff; `notifications/tools/list_changed` makes it read the
//! list again ([`McpServer::changes`] tells the agent). Requests from the server are answered
//! without a human: `roots/list` with no roots, sampling refused, elicitation declined.
//!
//! Results map to one JSON value the model reads ([`content`]); `isError: true` is a tool error
//! the model sees. An HTTP server's configured URL may be private (it was written down on
//! purpose); a redirect anywhere else is checked by keel's SSRF guard ([`http`]).

pub mod content;
pub mod expose;
mod http;
mod server;

pub use expose::AgentServer;
pub use server::{McpError, McpServer, RemoteTool};

/// Expands `${NAME}` references to keel's environment in a configured value. `$${` stands for
/// a literal `${`. A reference to a variable that is not set is an error naming it.
pub fn expand_env(value: &str) -> Result<String, String> {
    expand_with(value, |name| std::env::var(name).ok())
}

fn expand_with(value: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        if rest[..start].ends_with('$') {
            out.push_str(&rest[..start - 1]);
            out.push_str("${");
            rest = &rest[start + 2..];
            continue;
        }
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("`${{` without a closing `}}` in {value:?}"))?;
        let name = &after[..end];
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("`${{{name}}}` is not a variable name"));
        }
        let resolved = lookup(name).ok_or_else(|| format!("the environment variable {name} is not set"))?;
        out.push_str(&resolved);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_expand_and_missing_ones_are_named() {
        let lookup = |name: &str| (name == "TOKEN").then(|| "s3cret".to_owned());
        assert_eq!(expand_with("Bearer ${TOKEN}", lookup).unwrap(), "Bearer s3cret");
        assert_eq!(expand_with("no refs", lookup).unwrap(), "no refs");
        assert_eq!(expand_with("$${TOKEN} stays", lookup).unwrap(), "${TOKEN} stays");
        assert_eq!(
            expand_with("${MISSING}", lookup).unwrap_err(),
            "the environment variable MISSING is not set"
        );
        assert!(expand_with("${TOKEN", lookup).unwrap_err().contains("without a closing"));
        assert!(expand_with("${A-B}", lookup).unwrap_err().contains("not a variable name"));
    }
}
