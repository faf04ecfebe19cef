//! Command tools: a program the agent can call, defined in `tools/<name>.toml`.
//!
//! The input JSON goes to the program's stdin. Its stdout is the output: parsed as JSON when it
//! is JSON, else kept as text. A non-zero exit is a tool error carrying the tail of stderr. The
//! program runs in its own process group, and a timeout or a cancelled run kills the whole group
//! (a shell script's children included), not just the direct child.
//!
//! The program gets the same minimal environment as `shell` (`PATH`, `HOME` = its working
//! directory, `LANG`, `TERM`), the variables its tool file names (`env = ["MY_API_KEY"]`;
//! never keel's own secrets), and `KEEL_IDEMPOTENCY_KEY`, `KEEL_RUN_ID`, `KEEL_SESSION_ID` and
//! `KEEL_CALL_ID`, so that it can dedupe side effects when a crash makes a call run again. It
//! dies with keel (see `process`), so a re-driven step never overlaps the attempt before it.
//!
//! A tool with `state = "read"` or `"write"` also gets `KEEL_STATE_FILE`: a private file
//! holding the session's state object as JSON. With `write`, what the file holds when the
//! program exits successfully replaces the state (committed with the call's result, like a Rust
//! tool's `ctx.state.replace`); a file that is not JSON then fails the call, and the state is
//! kept as it was.

use std::process::Stdio;

use keel_core::agent::StateAccess;
use keel_core::env;
use keel_core::{BoxFuture, CommandToolDef, ErrorCode, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::process::{GroupKiller, minimal_env, own_group_dying_with_keel, read_capped, read_tail};
use tokio::process::Command;

/// The most stdout kept from a command (the output cap of the agent applies after).
const MAX_STDOUT_BYTES: usize = 8 * 1024 * 1024;
/// How much of stderr's end a failure shows.
const STDERR_TAIL_BYTES: usize = 2048;
/// The largest state a command tool may write back.
const MAX_STATE_BYTES: u64 = 1024 * 1024;

/// A tool that runs a program. See the module docs.
pub struct CommandTool {
    spec: ToolSpec,
    config: CommandToolDef,
}

impl CommandTool {
    /// A command tool. `config.command` must not be empty (an empty one fails every call).
    pub fn new(config: CommandToolDef) -> CommandTool {
        let spec = ToolSpec {
            name: config.name.clone(),
            description: config.description.clone(),
            input_schema: config.input_schema.clone(),
        };
        CommandTool { spec, config }
    }
}

impl CommandTool {
    async fn run(&self, input: Value, ctx: &ToolContext) -> ToolOutcome {
        let name = &self.config.name;
        let Some((program, args)) = self.config.command.split_first() else {
            return Err(ToolError::failed(format!("command tool `{name}` has an empty `command`")));
        };
        let mut command = Command::new(program);
        minimal_env(&mut command, &self.config.working_dir, &self.config.env);
        // Created private (0600) and removed when the call ends, however it ends.
        let state_file = match self.config.state {
            StateAccess::None => None,
            StateAccess::Read | StateAccess::Write => {
                let file = write_state_file(&ctx.state.get()).map_err(|e| {
                    ToolError::failed(format!("cannot write the state file for tool `{name}`: {e}"))
                })?;
                command.env(env::STATE_FILE.name, file.path());
                Some(file)
            }
        };
        own_group_dying_with_keel(&mut command);
        let mut child = command
            .args(args)
            .current_dir(&self.config.working_dir)
            .env(env::IDEMPOTENCY_KEY.name, &ctx.idempotency_key)
            .env(env::RUN_ID.name, ctx.run_id.as_str())
            .env(env::SESSION_ID.name, ctx.session_id.as_str())
            .env(env::CALL_ID.name, &ctx.call_id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                ToolError::failed(format!(
                    "cannot start `{program}` for tool `{name}` (in {}): {e}",
                    self.config.working_dir.display()
                ))
            })?;
        let mut killer = GroupKiller::for_child(child.id());

        let mut stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let payload = input.to_string();
        let write_input = async move {
            // A program that exits without reading its input is not an error.
            let _ = stdin.write_all(payload.as_bytes()).await;
            drop(stdin);
        };
        let work = async {
            let ((), out, err, status) = tokio::join!(
                write_input,
                read_capped(stdout, MAX_STDOUT_BYTES),
                read_tail(stderr, STDERR_TAIL_BYTES),
                child.wait()
            );
            (out, err, status)
        };
        let (out, err, status) = match self.config.timeout {
            Some(limit) => match tokio::time::timeout(limit, work).await {
                Ok(done) => done,
                Err(_) => {
                    // `killer` kills the group on drop.
                    return Err(ToolError::with_code(
                        ErrorCode::ToolTimeout,
                        format!(
                            "command tool `{name}` did not finish within {limit:?} (its `timeout`) and was killed"
                        ),
                        true,
                    ));
                }
            },
            None => work.await,
        };
        let status = status.map_err(|e| ToolError::failed(format!("waiting for `{program}` failed: {e}")))?;
        // The leader exited; still reap the group's stragglers (a script's background jobs).
        killer.kill_now();
        let stderr_tail = String::from_utf8_lossy(&err.unwrap_or_default()).trim().to_owned();
        if !status.success() {
            let how = match status.code() {
                Some(code) => format!("exited with status {code}"),
                None => "was killed by a signal".to_owned(),
            };
            let detail = if stderr_tail.is_empty() {
                "(no stderr)".to_owned()
            } else {
                tail_chars(&stderr_tail, STDERR_TAIL_BYTES)
            };
            return Err(ToolError::failed(format!("command tool `{name}` {how}: {detail}")));
        }
        if let (StateAccess::Write, Some(file)) = (self.config.state, &state_file) {
            let state = read_state_file(file.path()).map_err(|problem| {
                ToolError::failed(format!(
                    "command tool `{name}` left {problem} in $KEEL_STATE_FILE; the state is unchanged"
                ))
            })?;
            ctx.state.replace(state);
        }
        let (stdout, truncated) =
            out.map_err(|e| ToolError::failed(format!("reading the output of `{program}` failed: {e}")))?;
        let text = String::from_utf8_lossy(&stdout);
        let text = text.trim_end_matches(['\n', '\r']);
        if !truncated && let Ok(json) = serde_json::from_str::<Value>(text) {
            return Ok(json);
        }
        let mut text = text.to_owned();
        if truncated {
            text.push_str(&format!(
                "\n[output truncated: the command wrote more than {MAX_STDOUT_BYTES} bytes]"
            ));
        }
        Ok(Value::String(text))
    }
}

/// The state as JSON in a new private temporary file.
fn write_state_file(state: &Value) -> std::io::Result<tempfile::NamedTempFile> {
    use std::io::Write as _;
    let mut file = tempfile::Builder::new().prefix("keel-state-").suffix(".json").tempfile()?;
    file.write_all(state.to_string().as_bytes())?;
    file.flush()?;
    Ok(file)
}

/// What a tool left in its state file: JSON of at most [`MAX_STATE_BYTES`], or what is wrong.
fn read_state_file(path: &std::path::Path) -> Result<Value, String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| format!("no readable file ({e})"))?;
    let mut bytes = Vec::new();
    file.take(MAX_STATE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("an unreadable file ({e})"))?;
    if bytes.len() as u64 > MAX_STATE_BYTES {
        return Err(format!("more than {MAX_STATE_BYTES} bytes"));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("something that is not JSON ({e})"))
}

fn tail_chars(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &text[start..])
}

impl Tool for CommandTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(self.run(input, ctx))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use keel_core::{RunId, SessionId};
    use serde_json::json;

    fn ctx() -> ToolContext {
        ToolContext {
            run_id: RunId::from_suffix("r1"),
            session_id: SessionId::new("s1").unwrap(),
            call_id: "c1".into(),
            idempotency_key: "run_r1:tool:t:c1".into(),
            state: keel_core::SessionState::default(),
        }
    }

    fn tool(script: &str, timeout: Option<Duration>, dir: &std::path::Path) -> CommandTool {
        CommandTool::new(CommandToolDef {
            name: "t".into(),
            description: "test".into(),
            input_schema: json!({"type": "object"}),
            command: vec!["sh".into(), "-c".into(), script.into()],
            working_dir: dir.to_owned(),
            timeout,
            env: Vec::new(),
            state: StateAccess::None,
        })
    }

    #[tokio::test]
    async fn a_tool_with_state_access_reads_the_state_file_and_with_write_replaces_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let with = |script: &str, state: StateAccess| {
            CommandTool::new(CommandToolDef { state, ..tool(script, None, dir.path()).config })
        };
        let ctx = ToolContext { state: keel_core::SessionState::new(json!({"n": 1})), ..ctx() };

        let read = with(r#"cat "$KEEL_STATE_FILE""#, StateAccess::Read);
        assert_eq!(read.call(json!({}), &ctx).await.unwrap(), json!({"n": 1}));
        // Read access: what the program writes is ignored.
        let scribble = with(r#"echo '{"n": 9}' > "$KEEL_STATE_FILE"; echo ok"#, StateAccess::Read);
        scribble.call(json!({}), &ctx).await.unwrap();
        assert_eq!(ctx.state.get(), json!({"n": 1}));
        // No access: no file.
        let none = with(r#"echo "[${KEEL_STATE_FILE:-none}]""#, StateAccess::None);
        assert_eq!(none.call(json!({}), &ctx).await.unwrap(), json!("[none]"));

        let write =
            with(r#"echo '{"n": 2}' > "$KEEL_STATE_FILE"; echo "$KEEL_STATE_FILE""#, StateAccess::Write);
        let path = write.call(json!({}), &ctx).await.unwrap();
        assert_eq!(ctx.state.get(), json!({"n": 2}));
        assert!(!std::path::Path::new(path.as_str().unwrap()).exists(), "the state file outlived the call");

        let junk = with(r#"echo 'not json' > "$KEEL_STATE_FILE""#, StateAccess::Write);
        let ctx = ToolContext { state: keel_core::SessionState::new(json!({"n": 1})), ..self::ctx() };
        let error = junk.call(json!({}), &ctx).await.unwrap_err();
        assert!(
            error.message.contains("not JSON") && error.message.contains("unchanged"),
            "{}",
            error.message
        );
        assert_eq!(ctx.state.get(), json!({"n": 1}));
    }

    #[tokio::test]
    async fn json_in_json_out() {
        let dir = tempfile::tempdir().unwrap();
        let out = tool(
            r#"read line; printf '{"got": %s, "key": "%s"}\n' "$line" "$KEEL_IDEMPOTENCY_KEY""#,
            None,
            dir.path(),
        )
        .call(json!({"n": 1}), &ctx())
        .await
        .unwrap();
        assert_eq!(out, json!({"got": {"n": 1}, "key": "run_r1:tool:t:c1"}));
    }

    #[tokio::test]
    async fn text_output_is_kept_as_text_and_cwd_is_used() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hello.txt"), "hello from the file\n").unwrap();
        let out = tool("cat hello.txt", None, dir.path()).call(json!({}), &ctx()).await.unwrap();
        assert_eq!(out, json!("hello from the file"));
    }

    #[tokio::test]
    async fn a_failing_command_reports_its_stderr_tail() {
        let dir = tempfile::tempdir().unwrap();
        let err = tool("echo starting; echo 'disk is full' >&2; exit 3", None, dir.path())
            .call(json!({}), &ctx())
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::ToolFailed);
        assert_eq!(err.message, "command tool `t` exited with status 3: disk is full");
    }

    #[tokio::test]
    async fn a_missing_program_is_a_tool_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = tool("", None, dir.path()).config;
        config.command = vec!["/nonexistent/keel-test-program".into()];
        let err = CommandTool::new(config).call(json!({}), &ctx()).await.unwrap_err();
        assert!(err.message.contains("cannot start `/nonexistent/keel-test-program`"), "{}", err.message);
    }

    /// Whether a process is alive (signal 0 checks without sending anything).
    fn alive(pid: i32) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
    }

    #[tokio::test]
    async fn a_timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        // The shell starts a grandchild that would outlive a plain kill of the shell.
        let script = "sleep 300 & echo $! > grandchild.pid; wait";
        let err = tool(script, Some(Duration::from_millis(300)), dir.path())
            .call(json!({}), &ctx())
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::ToolTimeout);
        let pid: i32 =
            std::fs::read_to_string(dir.path().join("grandchild.pid")).unwrap().trim().parse().unwrap();
        for _ in 0..100 {
            if !alive(pid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the grandchild {pid} survived the timeout");
    }

    #[tokio::test]
    async fn dropping_the_call_kills_the_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let command = tool("sleep 300 & echo $! > grandchild.pid; wait", None, dir.path());
        let context = ctx();
        let call = command.call(json!({}), &context);
        let pid_file = dir.path().join("grandchild.pid");
        tokio::select! {
            _ = call => panic!("the command finished"),
            () = async { while std::fs::read_to_string(&pid_file).map_or(true, |s| s.trim().is_empty()) { tokio::time::sleep(Duration::from_millis(10)).await } } => {}
        }
        let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        for _ in 0..100 {
            if !alive(pid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the grandchild {pid} survived the cancelled call");
    }
}
