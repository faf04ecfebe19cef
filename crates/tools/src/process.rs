//! Child processes of the process-running tools (command tools, `shell`): each runs in its
//! own process group, which is killed whole when the call times out, is cancelled or panics,
//! and their output is read with a cap.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};

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
