//! Child processes of the process-running tools (command tools, `shell`): each runs in its
//! own process group, which is killed whole when the call times out, is cancelled or panics,
//! or when keel itself dies; each gets a minimal environment without keel's secrets; and their
//! output is read with a cap.
//!
//! **Dying with keel** (Linux): a killed keel cannot kill anything, and a tool that outlived it
//! would still be doing its step while the recovered run does the same step again. So between
//! fork and exec the child forks once more: the grandchild goes on to exec the tool, and the
//! child stays behind as a tiny supervisor in the tool's process group, with a parent-death
//! signal. When the tool exits, the supervisor exits with its status (keel sees the tool's own
//! exit code); when keel dies, the supervisor kills the whole group, background jobs included.
//! It runs no Rust code that allocates or locks between fork and exec: raw system calls only.

use keel_core::env;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

/// The `PATH` of the minimal environment.
pub const MINIMAL_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Gives `command` the minimal environment (`PATH`, `HOME` = `home`, `LANG`, `TERM`), then
/// the variables named in `pass` that keel's environment has: nothing else of keel's.
pub(crate) fn minimal_env(command: &mut Command, home: &std::path::Path, pass: &[String]) {
    command
        .env_clear()
        .env("PATH", MINIMAL_PATH)
        .env("HOME", home)
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb");
    for name in pass.iter().filter(|name| !env::is_secret(name)) {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
}

/// Prepares a long-lived helper process that is not a tool call (an MCP server): the minimal
/// environment with `home` as `HOME` and the variables named in `pass` (never keel's secrets),
/// in its own process group that dies with keel.
pub fn contain_helper(command: &mut Command, home: &std::path::Path, pass: &[String]) {
    minimal_env(command, home, pass);
    own_group_dying_with_keel(command);
}

/// Takes keel's own secrets out of an environment a tool inherits whole.
pub(crate) fn without_secrets(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(env::is_secret) {
            command.env_remove(&name);
        }
    }
}

/// Gives the program `read` and `write` as its file descriptors 3 and 4 (how Chromium's
/// `--remote-debugging-pipe` takes its DevTools pipes); keel's own descriptors stay closed on
/// exec, as std makes them. Call it after [`own_group_dying_with_keel`], so that the program,
/// not its supervisor, holds them.
#[cfg(target_os = "linux")]
pub(crate) fn pass_pipes(command: &mut Command, read: std::os::fd::RawFd, write: std::os::fd::RawFd) {
    supervisor::pass_pipes(command.as_std_mut(), read, write);
}

/// Runs `command` in its own process group that dies with keel (see the module docs).
pub(crate) fn own_group_dying_with_keel(command: &mut Command) {
    command.process_group(0).kill_on_drop(true);
    #[cfg(target_os = "linux")]
    supervisor::install(command.as_std_mut());
}

#[cfg(target_os = "linux")]
#[allow(
    unsafe_code,
    reason = "code between fork and exec can only be raw system calls; no safe wrapper promises that"
)]
mod supervisor {
    use std::os::unix::process::CommandExt;

    /// The signal the supervisor gets when keel dies. SIGCHLD and it are blocked in the
    /// supervisor and taken with `sigwaitinfo`, so no handler inherited from keel ever runs.
    const KEEL_DIED: libc::c_int = libc::SIGUSR2;

    pub(super) fn install(command: &mut std::process::Command) {
        // SAFETY: the closure runs in the child between fork and exec. `fork_supervisor` makes
        // only async-signal-safe system calls (no allocation, no locks), as that requires.
        unsafe {
            command.pre_exec(fork_supervisor);
        }
    }

    /// See [`super::pass_pipes`].
    pub(super) fn pass_pipes(command: &mut std::process::Command, read: libc::c_int, write: libc::c_int) {
        // SAFETY: the closure runs in the program's process between fork and exec, and makes
        // only async-signal-safe system calls on two integers it owns.
        unsafe {
            command.pre_exec(move || {
                // Each to a high number first (closed on exec), so that placing one at 3 or 4
                // never overwrites the other; `dup2` then gives copies that stay open.
                let high_read = libc::fcntl(read, libc::F_DUPFD_CLOEXEC, 100);
                let high_write = libc::fcntl(write, libc::F_DUPFD_CLOEXEC, 100);
                if high_read < 0
                    || high_write < 0
                    || libc::dup2(high_read, 3) < 0
                    || libc::dup2(high_write, 4) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// In the forked child (already the leader of its process group): forks the tool, which
    /// returns to be exec'd, and supervises it. Returns an error only when no supervision is
    /// possible; then the spawn fails rather than run a tool that would outlive keel.
    fn fork_supervisor() -> std::io::Result<()> {
        // SAFETY: raw system calls on memory of this stack frame.
        unsafe {
            let keel = libc::getppid();
            let mut waited: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut waited);
            libc::sigaddset(&mut waited, libc::SIGCHLD);
            libc::sigaddset(&mut waited, KEEL_DIED);
            if libc::sigprocmask(libc::SIG_BLOCK, &waited, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, KEEL_DIED as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let tool = libc::fork();
            if tool < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if tool == 0 {
                // The tool: no blocked signals, as std leaves a child.
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                return Ok(());
            }
            supervise(keel, tool, &waited)
        }
    }

    /// The supervisor's whole life; never returns.
    unsafe fn supervise(keel: libc::pid_t, tool: libc::pid_t, waited: &libc::sigset_t) -> ! {
        // SAFETY: raw system calls only (see `fork_supervisor`).
        unsafe {
            // Hold nothing keel waits on: the tool's pipes, and std's exec-status pipe (keel's
            // spawn waits for its end; the tool's exec closes its own copy).
            if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
                for fd in 0..4096 {
                    libc::close(fd);
                }
            }
            for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
                libc::signal(signal, libc::SIG_DFL);
            }
            // Keel died before the parent-death signal was armed.
            if libc::getppid() != keel {
                libc::kill(0, libc::SIGKILL);
            }
            loop {
                let signal = libc::sigwaitinfo(waited, std::ptr::null_mut());
                if signal == KEEL_DIED {
                    // Also sent when the keel thread that spawned the tool ends while keel
                    // lives on: then the parent is still keel.
                    if libc::getppid() != keel {
                        libc::kill(0, libc::SIGKILL);
                        libc::_exit(137);
                    }
                } else if signal == libc::SIGCHLD {
                    let mut status = 0;
                    if libc::waitpid(tool, &mut status, libc::WNOHANG) == tool {
                        if libc::WIFEXITED(status) {
                            libc::_exit(libc::WEXITSTATUS(status));
                        }
                        if libc::WIFSIGNALED(status) {
                            // Die of the same signal, so that keel sees how the tool ended.
                            let killed_by = libc::WTERMSIG(status);
                            libc::signal(killed_by, libc::SIG_DFL);
                            let mut only: libc::sigset_t = std::mem::zeroed();
                            libc::sigemptyset(&mut only);
                            libc::sigaddset(&mut only, killed_by);
                            libc::sigprocmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
                            libc::kill(libc::getpid(), killed_by);
                            libc::_exit(128 + killed_by);
                        }
                    }
                }
            }
        }
    }
}

/// Kills a process group when dropped, unless disarmed: covers timeouts, cancelled runs and
/// panics alike.
pub(crate) struct GroupKiller(pub(crate) Option<Pid>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(group) = self.0 {
            // ESRCH (already gone) is fine.
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}

pub(crate) async fn read_capped(
    mut reader: impl AsyncRead + Unpin,
    cap: usize,
) -> std::io::Result<(Vec<u8>, bool)> {
    let mut kept = Vec::new();
    let mut chunk = [0u8; 8192];
    let mut truncated = false;
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok((kept, truncated));
        }
        let room = cap.saturating_sub(kept.len());
        kept.extend_from_slice(&chunk[..n.min(room)]);
        truncated |= n > room;
    }
}

pub(crate) async fn read_tail(mut reader: impl AsyncRead + Unpin, tail: usize) -> std::io::Result<Vec<u8>> {
    let mut kept = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(kept);
        }
        kept.extend_from_slice(&chunk[..n]);
        if kept.len() > tail * 2 {
            kept.drain(..kept.len() - tail);
        }
    }
}

impl GroupKiller {
    /// A killer for the group led by the child with this pid.
    pub(crate) fn for_child(pid: Option<u32>) -> GroupKiller {
        GroupKiller(pid.and_then(|id| i32::try_from(id).ok()).map(Pid::from_raw))
    }

    /// Kills the group now (its leader exited: this reaps stragglers such as background jobs).
    pub(crate) fn kill_now(&mut self) {
        if let Some(group) = self.0.take() {
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}
