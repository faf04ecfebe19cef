//! `js`: runs model-written JavaScript in an embedded QuickJS engine (`rquickjs`).
//!
//! The code is the body of an async function; what it returns (awaited) is the result, as
//! JSON. The sandbox has the language and its standard objects only: no network, no file
//! system, no timers, no modules, no host objects but a `console` whose output is captured (and
//! capped). Each call gets a fresh engine on its own thread with a CPU-time limit (the thread's
//! own CPU clock, checked by QuickJS's interrupt hook), a heap limit and a stack limit, so an
//! infinite loop, a memory bomb or runaway recursion ends the script with an error, never the
//! host. Dropping the call (a run's tool timeout or cancellation) stops the script too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use rquickjs::{Context, Ctx, Exception, Function, Runtime, Value as JsValue};
use serde_json::{Value, json};

/// CPU time a script may use when the call sets none.
pub const DEFAULT_CPU_TIME: Duration = Duration::from_secs(1);
/// The most CPU time a call may ask for.
pub const MAX_CPU_TIME: Duration = Duration::from_secs(30);
/// The most wall-clock time a script runs, whatever its CPU time (a thread starved by a busy
/// machine still ends).
pub const WALL_TIME: Duration = Duration::from_secs(30);
/// The largest result, as JSON text.
pub const MAX_RESULT_BYTES: usize = 256 * 1024;
/// The engine's heap limit.
pub const MEMORY_LIMIT: usize = 64 * 1024 * 1024;
/// The engine's stack limit (the thread has more, so QuickJS stops first).
pub const STACK_LIMIT: usize = 1024 * 1024;
const THREAD_STACK: usize = 8 * 1024 * 1024;
/// The most console lines kept.
pub const LOG_LINES: usize = 100;
/// The longest console line kept, in characters; a longer one is cut.
pub const LOG_LINE_CHARS: usize = 2000;

/// Sets up `console` on top of one host function, `__keel_log(level, text)`, which the prelude
/// hides again.
const PRELUDE: &str = r#"(() => {
  const log = globalThis.__keel_log;
  delete globalThis.__keel_log;
  const show = (v) => {
    if (typeof v === "string") return v;
    try { const s = JSON.stringify(v); return s === undefined ? String(v) : s; } catch (e) { return String(v); }
  };
  const make = (level) => (...args) => log(level, args.map(show).join(" "));
  globalThis.console = { log: make("log"), info: make("info"), warn: make("warn"), error: make("error"), debug: make("debug") };
})();"#;

/// Captured console lines.
#[derive(Default)]
struct Logs {
    lines: Vec<String>,
    dropped: usize,
}

impl Logs {
    fn push(&mut self, level: &str, text: &str) {
        if self.lines.len() >= LOG_LINES {
            self.dropped += 1;
            return;
        }
        let mut line = if level == "log" { text.to_owned() } else { format!("[{level}] {text}") };
        if let Some((cut, _)) = line.char_indices().nth(LOG_LINE_CHARS) {
            let total = line.chars().count();
            line.truncate(cut);
            line.push_str(&format!("… [cut: {total} characters]"));
        }
        self.lines.push(line);
    }

    fn into_json(self) -> Value {
        let mut lines = self.lines;
        if self.dropped > 0 {
            lines.push(format!("[{} more lines dropped: the console keeps {LOG_LINES} lines]", self.dropped));
        }
        json!(lines)
    }
}

/// How a script ended.
enum Outcome {
    Value(Value),
    Error(String),
}

/// The `js` tool.
pub struct JsTool {
    spec: ToolSpec,
}

impl Default for JsTool {
    fn default() -> Self {
        JsTool::new()
    }
}

impl JsTool {
    /// The tool's name.
    pub const NAME: &'static str = crate::JS_NAME;

    /// The tool.
    pub fn new() -> JsTool {
        let spec = ToolSpec {
            name: Self::NAME.into(),
            description: "Runs JavaScript: `code` is the body of an async function, and what it returns is the result (as JSON). console.log output is returned too. There is no network, file system or timer: compute with what you pass in.".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "code": { "type": "string", "minLength": 1, "description": "The body of an async function, e.g. `const xs = [3, 1, 2]; return xs.sort();`" },
                    "data": { "description": "Any JSON value, available to the code as `data` (in `compose`, the output of an earlier step)" },
                    "cpu_ms": { "type": "integer", "minimum": 1, "maximum": MAX_CPU_TIME.as_millis() as u64, "description": "CPU time limit; default 1000" }
                },
                "required": ["code"],
                "additionalProperties": false
            }),
        };
        JsTool { spec }
    }
}

/// The thread's CPU time so far.
fn thread_cpu_time() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Describes a thrown value.
fn describe<'js>(ctx: &Ctx<'js>, thrown: JsValue<'js>) -> String {
    if let Some(object) = thrown.as_object()
        && let Some(exception) = Exception::from_object(object.clone())
    {
        let name: String = object.get("name").unwrap_or_else(|_| "Error".into());
        let message = exception.message().unwrap_or_default();
        return format!("{name}: {message}");
    }
    // QuickJS throws `null` when it runs out of memory making the error itself.
    if thrown.is_null() {
        return format!(
            "the script threw null, or ran out of memory (the sandbox has {} MiB)",
            MEMORY_LIMIT / (1024 * 1024)
        );
    }
    match ctx.json_stringify(thrown.clone()) {
        Ok(Some(text)) => format!("uncaught {}", text.to_string().unwrap_or_default()),
        _ => "uncaught exception".into(),
    }
}

/// Runs `code` to completion on the current thread, with `data` as the global `data`.
fn run(
    code: &str,
    data: &str,
    cpu_limit: Duration,
    cancelled: &Arc<AtomicBool>,
    logs: &Arc<Mutex<Logs>>,
) -> Outcome {
    let runtime = match Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => return Outcome::Error(format!("the JavaScript engine did not start: {error}")),
    };
    runtime.set_memory_limit(MEMORY_LIMIT);
    runtime.set_max_stack_size(STACK_LIMIT);
    let start = thread_cpu_time();
    let wall_start = std::time::Instant::now();
    let timed_out = Arc::new(AtomicBool::new(false));
    let wall_out = Arc::new(AtomicBool::new(false));
    {
        let (timed_out, wall_out, cancelled) = (timed_out.clone(), wall_out.clone(), cancelled.clone());
        runtime.set_interrupt_handler(Some(Box::new(move || {
            if cancelled.load(Ordering::Relaxed) {
                return true;
            }
            if thread_cpu_time().saturating_sub(start) > cpu_limit {
                timed_out.store(true, Ordering::Relaxed);
                return true;
            }
            if wall_start.elapsed() > WALL_TIME {
                wall_out.store(true, Ordering::Relaxed);
                return true;
            }
            false
        })));
    }
    let context = match Context::full(&runtime) {
        Ok(context) => context,
        Err(error) => return Outcome::Error(format!("the JavaScript engine did not start: {error}")),
    };
    let outcome = context.with(|ctx| {
        let sink = logs.clone();
        let log = Function::new(ctx.clone(), move |level: String, text: String| {
            sink.lock().expect("the log lock is never poisoned").push(&level, &text);
        });
        let installed = log
            .and_then(|log| ctx.globals().set("__keel_log", log))
            .and_then(|()| ctx.eval::<(), _>(PRELUDE))
            .and_then(|()| ctx.json_parse(data))
            .and_then(|data| ctx.globals().set("data", data));
        if let Err(error) = installed {
            return Outcome::Error(format!("the sandbox did not start: {error}"));
        }
        let source = format!("(async () => {{\n{code}\n}})()");
        let settled =
            ctx.eval::<rquickjs::Promise, _>(source).and_then(|promise| promise.finish::<JsValue>());
        match settled {
            Ok(value) => {
                if value.is_undefined() || value.is_null() {
                    return Outcome::Value(Value::Null);
                }
                if value.is_function() || value.is_symbol() {
                    return Outcome::Error(format!(
                        "the script returned a {}, which has no JSON form; return plain data",
                        if value.is_function() { "function" } else { "symbol" }
                    ));
                }
                match ctx.json_stringify(value) {
                    Ok(Some(text)) => {
                        let text = text.to_string().unwrap_or_default();
                        if text.len() > MAX_RESULT_BYTES {
                            return Outcome::Error(format!(
                                "the result is {} KiB of JSON, more than the {} KiB a script may return: return less (a summary, a slice, a count)",
                                text.len().div_ceil(1024),
                                MAX_RESULT_BYTES / 1024
                            ));
                        }
                        match serde_json::from_str(&text) {
                            Ok(json) => Outcome::Value(json),
                            Err(error) => Outcome::Error(format!("the result is not JSON: {error}")),
                        }
                    }
                    Ok(None) => Outcome::Value(Value::Null),
                    Err(_) => {
                        Outcome::Error(format!("the result is not JSON: {}", describe(&ctx, ctx.catch())))
                    }
                }
            }
            Err(rquickjs::Error::WouldBlock) => Outcome::Error(
                "the script awaits something that never settles (there are no timers or I/O in this sandbox)"
                    .into(),
            ),
            Err(rquickjs::Error::Exception) => Outcome::Error(describe(&ctx, ctx.catch())),
            Err(error) => Outcome::Error(error.to_string()),
        }
    });
    if timed_out.load(Ordering::Relaxed) {
        return Outcome::Error(format!(
            "the script used more than {} ms of CPU time (`cpu_ms`) and was stopped",
            cpu_limit.as_millis()
        ));
    }
    if wall_out.load(Ordering::Relaxed) {
        return Outcome::Error(format!(
            "the script ran longer than {} s and was stopped",
            WALL_TIME.as_secs()
        ));
    }
    match outcome {
        Outcome::Error(message) if message.contains("out of memory") => Outcome::Error(format!(
            "the script ran out of memory (the sandbox has {} MiB) and was stopped",
            MEMORY_LIMIT / (1024 * 1024)
        )),
        other => other,
    }
}

/// Stops the script when the call is dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Tool for JsTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let code = input["code"].as_str().unwrap_or_default().to_owned();
            let data = input.get("data").unwrap_or(&Value::Null).to_string();
            let cpu_limit =
                input["cpu_ms"].as_u64().map_or(DEFAULT_CPU_TIME, Duration::from_millis).min(MAX_CPU_TIME);
            let cancelled = Arc::new(AtomicBool::new(false));
            let _cancel = CancelOnDrop(cancelled.clone());
            let logs = Arc::new(Mutex::new(Logs::default()));
            let (send, receive) = tokio::sync::oneshot::channel();
            let thread_logs = logs.clone();
            std::thread::Builder::new()
                .name("keel-js".into())
                .stack_size(THREAD_STACK)
                .spawn(move || {
                    let outcome = run(&code, &data, cpu_limit, &cancelled, &thread_logs);
                    let _ = send.send(outcome);
                })
                .map_err(|e| ToolError::failed(format!("cannot start the JavaScript sandbox: {e}")))?;
            let outcome = receive
                .await
                .unwrap_or_else(|_| Outcome::Error("the JavaScript sandbox stopped unexpectedly".into()));
            let logs = std::mem::take(&mut *logs.lock().expect("the log lock is never poisoned")).into_json();
            match outcome {
                Outcome::Value(value) => Ok(json!({ "value": value, "logs": logs })),
                Outcome::Error(error) => {
                    Err(ToolError::failed(json!({ "error": error, "logs": logs }).to_string()))
                }
            }
        })
    }
}
