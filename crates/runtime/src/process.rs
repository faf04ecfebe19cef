//! This process as a lease owner, and whether another owner's process is provably gone.
//!
//! A run's lease names the process driving it (see [`keel_core::owner`]). When that process dies
//! without releasing the lease (a SIGKILL, a crash, a power cut), waiting for the lease to
//! expire would leave the run stuck for its whole length. A process on the same machine can do
//! better: if the owner's pid no longer exists in the same kernel and pid namespace, or exists
//! but started at another time (the pid was reused), the owner is gone and its runs can be taken
//! over at once. Anything less than proof (another host, another container, a platform without
//! `/proc`) leaves the decision to the lease.

use std::sync::OnceLock;

use keel_core::owner::LeaseOwner;

/// What names this process.
struct Identity {
    host: String,
    /// The kernel boot and pid namespace (empty when they cannot be read).
    machine: String,
    pid: u32,
    start: u64,
}

fn identity() -> &'static Identity {
    static IDENTITY: OnceLock<Identity> = OnceLock::new();
    IDENTITY.get_or_init(|| {
        let pid = std::process::id();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unknown".to_owned());
        Identity {
            host,
            machine: machine_key().unwrap_or_default(),
            pid,
            start: start_time(pid).unwrap_or(0),
        }
    })
}

/// The running kernel (its boot id changes at every boot) and this process's pid namespace (a
/// container has its own): two processes with the same key see the same pids.
fn machine_key() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let namespace = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let hash = keel_core::ids::stable_hash(&[boot.trim(), &namespace.to_string_lossy()]);
    Some(format!("{hash:016x}"))
}

/// A process's start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`), and whether
/// it is a zombie (dead, not yet reaped). `None` when there is no such process.
fn process_stat(pid: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces or parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    // Fields 3 and on: state is field 3, start time field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((start, matches!(state, "Z" | "X")))
}

fn start_time(pid: u32) -> Option<u64> {
    process_stat(pid).map(|(start, _)| start)
}

/// This machine's host name (read once), for people.
pub(crate) fn host() -> &'static str {
    &identity().host
}

/// A lease owner name for an engine of this process.
pub(crate) fn lease_owner() -> String {
    let me = identity();
    let nonce = &uuid::Uuid::new_v4().simple().to_string()[..12];
    LeaseOwner::format(&me.host, &me.machine, me.pid, me.start, nonce)
}

/// Whether `owner`'s process is provably gone: it ran in this very kernel and pid namespace,
/// and its pid is now free, a zombie, or another process's.
pub fn is_provably_dead(owner: &str) -> bool {
    let me = identity();
    let Some(them) = LeaseOwner::parse(owner) else { return false };
    if me.machine.is_empty() || them.machine != me.machine || them.start == 0 {
        return false;
    }
    // Signal 0 checks that the pid exists without touching it; unlike `/proc`, it cannot be
    // hidden from another user (`hidepid`): "not permitted" still means "exists".
    let pid = nix::unistd::Pid::from_raw(i32::try_from(them.pid).unwrap_or(i32::MAX));
    match nix::sys::signal::kill(pid, None) {
        Err(nix::errno::Errno::ESRCH) => true,
        Ok(()) | Err(_) => match process_stat(them.pid) {
            Some((start, zombie)) => zombie || start != them.start,
            // Exists but unreadable: no proof.
            None => false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_finished_child_is_provably_dead() {
        let me = lease_owner();
        assert!(!is_provably_dead(&me), "{me}");
        if identity().machine.is_empty() {
            return; // no /proc: nothing can be proven, and nothing is claimed
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time(pid);
        child.wait().unwrap();
        let Some(start) = start else { return }; // it ended before we could look
        let owner = LeaseOwner::format(&identity().host, &identity().machine, pid, start, "child");
        assert!(is_provably_dead(&owner), "{owner}");
        // The same pid with another start time: reused, so the owner is gone.
        let reused = LeaseOwner::format(&identity().host, &identity().machine, me_pid(), 1, "old");
        assert!(is_provably_dead(&reused));
        // Another machine (or container), or an owner keel cannot read: never provably dead.
        let elsewhere = LeaseOwner::format("other", "0123456789abcdef", pid, start, "x");
        assert!(!is_provably_dead(&elsewhere));
        assert!(!is_provably_dead("keel-1234-abcdef"));
    }

    fn me_pid() -> u32 {
        std::process::id()
    }
}
