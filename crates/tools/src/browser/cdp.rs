//! A headless Chromium and the DevTools protocol spoken to it over its debugging pipes
//! (`--remote-debugging-pipe`: file descriptors 3 and 4, one JSON message per NUL-terminated
//! frame), so no debugging port is ever open for another process to find.
//!
//! One reader task takes every frame: a reply (`id`) goes to the command that waits for it, an
//! event to the page session it belongs to (`sessionId`, from `Target.attachToTarget` with
//! `flatten`). The process runs in its own process group, which dies with keel.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// How much of one frame is read at most (a full-page screenshot of a long page is large).
const MAX_FRAME: usize = 256 * 1024 * 1024;

/// What went wrong talking to the browser.
#[derive(Debug, Clone)]
pub(crate) struct CdpError(pub(crate) String);

impl std::fmt::Display for CdpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type Replies = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, CdpError>>>>>;
type Sessions = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Value>>>>;

/// A running Chromium and the connection to it. Its tasks (the pipes, the proxies) run on a
/// runtime of their own ([`io`]): the browser serves every runtime of the process, and outlives
/// any one of them (each test has its own).
pub(crate) struct Chromium {
    /// Frames to write, in order, by the writer task.
    writer: mpsc::UnboundedSender<Vec<u8>>,
    next_id: AtomicU64,
    replies: Replies,
    sessions: Sessions,
    /// Cleared by the reader when the pipe closes: the browser is gone.
    alive: Arc<std::sync::atomic::AtomicBool>,
    child: Mutex<tokio::process::Child>,
    /// The profile directory, removed with the browser.
    _profile: tempfile::TempDir,
}

impl Chromium {
    /// Starts `executable` headless, every connection of its default context through `proxy`
    /// (an `http://127.0.0.1:PORT` URL; pages get one each, see `create_context`).
    pub(crate) async fn launch(executable: PathBuf, proxy: String) -> Result<Chromium, CdpError> {
        io().spawn(async move { Chromium::start(&executable, &proxy).await })
            .await
            .map_err(|error| CdpError(format!("the browser's start stopped: {error}")))?
    }

    async fn start(executable: &Path, proxy: &str) -> Result<Chromium, CdpError> {
        let failed = |what: &str, error: std::io::Error| {
            CdpError(format!("cannot start the browser ({what}): {error}"))
        };
        let profile =
            tempfile::Builder::new().prefix("keel-browser-").tempdir().map_err(|e| failed("profile", e))?;
        // Keel writes commands into `to_browser`, the browser answers into `from_browser`. Only
        // keel's ends are non-blocking: the browser's read and write as a program expects.
        let (to_browser_read, to_browser_write) = pipe().map_err(|e| failed("pipe", e))?;
        let (from_browser_read, from_browser_write) = pipe().map_err(|e| failed("pipe", e))?;
        for ours in [&to_browser_write, &from_browser_read] {
            nonblocking(ours).map_err(|e| failed("pipe", e))?;
        }
        let mut command = tokio::process::Command::new(executable);
        command.args(arguments(profile.path(), proxy));
        crate::process::contain_helper(&mut command, profile.path(), &[]);
        command.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
        command.stderr(std::process::Stdio::piped());
        #[cfg(target_os = "linux")]
        crate::process::pass_pipes(&mut command, to_browser_read.as_raw_fd(), from_browser_write.as_raw_fd());
        let mut child = command.spawn().map_err(|e| failed(&executable.display().to_string(), e))?;
        // The browser's ends are its own now.
        drop((to_browser_read, from_browser_write));
        let mut pipe_writer =
            tokio::net::unix::pipe::Sender::from_owned_fd(to_browser_write).map_err(|e| failed("pipe", e))?;
        let (writer, mut frames) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            while let Some(frame) = frames.recv().await {
                if pipe_writer.write_all(&frame).await.is_err() {
                    break;
                }
            }
        });
        let reader = tokio::net::unix::pipe::Receiver::from_owned_fd(from_browser_read)
            .map_err(|e| failed("pipe", e))?;
        if let Some(stderr) = child.stderr.take() {
            // Chromium's own complaints, at debug level: never in the way, there when wanted.
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "keel::browser", "{line}");
                }
            });
        }
        let replies: Replies = Arc::default();
        let sessions: Sessions = Arc::default();
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        tokio::spawn(read_frames(reader, replies.clone(), sessions.clone(), alive.clone()));
        let chromium = Chromium {
            writer,
            next_id: AtomicU64::new(1),
            replies,
            sessions,
            alive,
            child: Mutex::new(child),
            _profile: profile,
        };
        // The first command proves the pipe works (and the executable is a Chromium).
        let version = tokio::time::timeout(
            Duration::from_secs(20),
            chromium.call(None, "Browser.getVersion", json!({})),
        )
        .await
        .map_err(|_| {
            CdpError(format!("{} did not answer on its DevTools pipe within 20 s", executable.display()))
        })??;
        tracing::debug!(target: "keel::browser", product = %version["product"], "browser started");
        Ok(chromium)
    }

    /// Whether the browser still answers (its pipe is open).
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Sends `method` (to the page session `session`, or the browser) and waits for its reply.
    pub(crate) async fn call(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, CdpError> {
        if !self.is_alive() {
            return Err(CdpError("the browser has exited".into()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let (tx, rx) = oneshot::channel();
        lock(&self.replies).insert(id, tx);
        let mut frame = message.to_string().into_bytes();
        frame.push(0);
        if self.writer.send(frame).is_err() {
            lock(&self.replies).remove(&id);
            return Err(CdpError("the browser has exited".into()));
        }
        match rx.await {
            Ok(reply) => reply,
            Err(_) => Err(CdpError("the browser has exited".into())),
        }
    }

    /// The events of page session `session` from now on.
    pub(crate) fn events(&self, session: &str) -> mpsc::UnboundedReceiver<Value> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.sessions).insert(session.to_owned(), tx);
        rx
    }

    /// Stops routing `session`'s events.
    pub(crate) fn forget(&self, session: &str) {
        lock(&self.sessions).remove(session);
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        // The whole process group: the browser and its renderers.
        if let Some(pid) = lock(&self.child).id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ =
                nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The runtime the browser's tasks run on: one thread, for the whole process.
pub(crate) fn io() -> &'static tokio::runtime::Handle {
    static IO: std::sync::OnceLock<tokio::runtime::Handle> = std::sync::OnceLock::new();
    IO.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("keel-browser")
            .build()
            .expect("a runtime for the browser's pipes");
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("keel-browser".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("a thread for the browser's pipes");
        handle
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

fn nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Chromium's command line: headless, no first-run work, nothing in the background, every
/// connection through the guard's proxy (loopback too: `<-loopback>` removes the rule that lets
/// it bypass proxies), no QUIC and no UDP that would go around the proxy, downloads off.
fn arguments(profile: &Path, proxy: &str) -> Vec<String> {
    let mut arguments: Vec<String> = [
        "--headless=new",
        "--remote-debugging-pipe",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-background-timer-throttling",
        "--disable-breakpad",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-extensions",
        "--disable-sync",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--disable-features=Translate,MediaRouter,OptimizationHints,AutofillServerCommunication,DialMediaRouteProvider",
        "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
        "--proxy-bypass-list=<-loopback>",
        "--hide-scrollbars",
        "--mute-audio",
        "--password-store=basic",
        "--use-mock-keychain",
    ]
    .iter()
    .map(|flag| (*flag).to_owned())
    .collect();
    arguments.push(format!("--proxy-server={proxy}"));
    arguments.push(format!("--user-data-dir={}", profile.display()));
    // Chromium's sandbox cannot run as root; pages then run without it (see docs/tools.md).
    if nix::unistd::geteuid().is_root() {
        arguments.push("--no-sandbox".into());
    }
    arguments.push("about:blank".into());
    arguments
}

/// Reads the browser's frames until its pipe closes, routing each.
async fn read_frames(
    reader: tokio::net::unix::pipe::Receiver,
    replies: Replies,
    sessions: Sessions,
    alive: Arc<std::sync::atomic::AtomicBool>,
) {
    // Also when this task is dropped unfinished (its runtime shut down): the browser is then
    // unreachable, and every call waiting on it must learn so.
    struct Gone {
        replies: Replies,
        sessions: Sessions,
        alive: Arc<std::sync::atomic::AtomicBool>,
    }
    impl Drop for Gone {
        fn drop(&mut self) {
            self.alive.store(false, Ordering::SeqCst);
            lock(&self.replies).clear();
            lock(&self.sessions).clear();
        }
    }
    let _gone = Gone { replies: replies.clone(), sessions: sessions.clone(), alive };
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    let mut frame = Vec::new();
    loop {
        frame.clear();
        match (&mut reader).take(MAX_FRAME as u64).read_until(0, &mut frame).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if frame.last() == Some(&0) {
            frame.pop();
        } else {
            // A frame larger than any the tool asks for, or the pipe ended mid-frame.
            break;
        }
        let Ok(message) = serde_json::from_slice::<Value>(&frame) else { continue };
        if let Some(id) = message.get("id").and_then(Value::as_u64) {
            let Some(waiting) = lock(&replies).remove(&id) else { continue };
            let reply = match message.get("error") {
                Some(error) => Err(CdpError(
                    error
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("the browser refused the command")
                        .to_owned(),
                )),
                None => Ok(message.get("result").cloned().unwrap_or(Value::Null)),
            };
            let _ = waiting.send(reply);
        } else if let Some(session) = message.get("sessionId").and_then(Value::as_str)
            && let Some(events) = lock(&sessions).get(session)
        {
            let _ = events.send(message);
        }
    }
}

/// Where a Chromium is: `KEEL_BROWSER`, else the first of the usual names on `PATH`.
pub(crate) fn find_executable() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(keel_core::env::BROWSER.name).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome-stable", "google-chrome", "chrome"].iter().find_map(
        |name| std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file()),
    )
}
