//! `shell`: runs a command line with `sh -c` in the workspace directory.
//!
//! The process gets a minimal environment (`PATH`, `HOME` = the workspace, `LANG`, `TERM`, and
//! the `KEEL_*` ids of the call), not the agent's: API keys and other secrets in keel's
//! environment stay out of reach. `shell.inherit_env` passes keel's environment on, less keel's
//! own secrets (`keel_core::env::SECRETS`). It runs in its own process group with no stdin; a
//! timeout kills the whole group (background jobs included), and so do the end of the call and
//! the death of keel. Its stdout and stderr are each kept up to a cap. A command that
//! exits non-zero is a result (with its exit code), not a tool error: the model reads it.
//! `shell` needs approval unless `shell.approve` is false: it can do anything the user running
//! keel can.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use keel_core::env;
use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::{Value, json};
use tokio::process::Command;

pub use crate::process::MINIMAL_PATH;
use crate::process::{GroupKiller, minimal_env, own_group_dying_with_keel, read_capped, without_secrets};

/// The timeout when the call sets none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest timeout a call may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(600);
/// How much of stdout and of stderr is kept.
pub const OUTPUT_CAP: usize = 64 * 1024;

/// The `shell` tool.
pub struct ShellTool {
    spec: ToolSpec,
    dir: PathBuf,
    inherit_env: bool,
}

impl ShellTool {
    /// The tool's name.
    pub const NAME: &'static str = "shell";

    /// A shell in `dir`; `inherit_env` passes keel's whole environment on.
    pub fn new(dir: PathBuf, inherit_env: bool) -> ShellTool {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Runs a shell command (sh -c) in the workspace directory and returns its exit code, stdout and stderr.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "command": { "type": "string", "minLength": 1, "description": "The command line" },
                    "timeout_ms": { "type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT.as_millis() as u64, "description": "Default 30000" }
                },
                "required": ["command"],
                "additionalProperties": false
            }),
        };
        ShellTool { spec, dir, inherit_env }
    }
}

fn text(bytes: &[u8], truncated: bool) -> Value {
    let mut text = String::from_utf8_lossy(bytes).into_owned();
    if truncated {
        text.push_str(&format!("\n[cut: more than {OUTPUT_CAP} bytes]"));
    }
    Value::String(text)
}

impl Tool for ShellTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let line = input["command"].as_str().unwrap_or_default();
            if line.contains('\0') {
                return Err(ToolError::with_code(
                    ErrorCode::ToolInputInvalid,
                    "the command contains a NUL byte",
                    false,
                ));
            }
            let timeout =
                input["timeout_ms"].as_u64().map_or(DEFAULT_TIMEOUT, Duration::from_millis).min(MAX_TIMEOUT);
            let mut command = Command::new("/bin/sh");
            command.arg("-c").arg(line).current_dir(&self.dir);
            if self.inherit_env {
                without_secrets(&mut command);
            } else {
                minimal_env(&mut command, &self.dir, &[]);
            }
            own_group_dying_with_keel(&mut command);
            command
                .env(env::IDEMPOTENCY_KEY.name, &ctx.idempotency_key)
                .env(env::RUN_ID.name, ctx.run_id.as_str())
                .env(env::SESSION_ID.name, ctx.session_id.as_str())
                .env(env::CALL_ID.name, &ctx.call_id)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = command.spawn().map_err(|e| {
                ToolError::failed(format!("cannot start /bin/sh in {}: {e}", self.dir.display()))
            })?;
            let mut killer = GroupKiller::for_child(child.id());
            let group = killer.0;
            let stdout = child.stdout.take().expect("stdout is piped");
            let stderr = child.stderr.take().expect("stderr is piped");
            // Once the shell exits, its group goes too: a background job would otherwise hold
            // the pipes open and the call until the timeout.
            let wait_then_reap = async {
                let status = child.wait().await;
                GroupKiller(group).kill_now();
                status
            };
            let work = async {
                tokio::join!(read_capped(stdout, OUTPUT_CAP), read_capped(stderr, OUTPUT_CAP), wait_then_reap)
            };
            let Ok((out, err, status)) = tokio::time::timeout(timeout, work).await else {
                // `killer` kills the whole group as it drops.
                return Err(ToolError::with_code(
                    ErrorCode::ToolTimeout,
                    format!(
                        "the command did not finish within {} ms and was killed (with its children)",
                        timeout.as_millis()
                    ),
                    true,
                ));
            };
            killer.kill_now();
            let status =
                status.map_err(|e| ToolError::failed(format!("waiting for the command failed: {e}")))?;
            let (out, out_cut) = out.unwrap_or_default();
            let (err, err_cut) = err.unwrap_or_default();
            let mut output = json!({
                "exit_code": status.code(),
                "stdout": text(&out, out_cut),
                "stderr": text(&err, err_cut),
            });
            if status.code().is_none() {
                output["signal"] = json!("the command was killed by a signal");
            }
            Ok(output)
        })
    }
}
