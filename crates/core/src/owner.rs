//! Lease owners: the name a process holds run leases under, and what another process can read
//! from it.
//!
//! An owner names its process precisely enough for a process on the same machine to prove that
//! it is gone: `keel/<host>/<machine>/<pid>/<start>/<nonce>`, where `machine` identifies the
//! running kernel and pid namespace (a reboot or another container gives another one), `start`
//! is when the process started (a reused pid has another start time) and `nonce` tells engines
//! of one process apart. Reading `/proc` to check belongs to the runtime; this module only
//! formats and parses, so that stores can describe who holds a session in their errors.

/// A parsed lease owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseOwner<'a> {
    /// The host name, for people.
    pub host: &'a str,
    /// The kernel boot and pid namespace the pid belongs to (empty when unknown: then nothing
    /// can be proven about the process, and only the lease's expiry frees its runs).
    pub machine: &'a str,
    /// The process id.
    pub pid: u32,
    /// The process's start time, in the kernel's clock ticks since boot (0 when unknown).
    pub start: u64,
    /// Tells engines of one process apart.
    pub nonce: &'a str,
}

impl<'a> LeaseOwner<'a> {
    /// The prefix every owner written by this format starts with.
    pub const PREFIX: &'static str = "keel/";

    /// The owner string of a process.
    pub fn format(host: &str, machine: &str, pid: u32, start: u64, nonce: &str) -> String {
        let clean = |text: &str| text.replace('/', "_");
        format!("{}{}/{}/{pid}/{start}/{}", Self::PREFIX, clean(host), clean(machine), clean(nonce))
    }

    /// Parses an owner string; `None` for one in another format (an older keel's, a test's).
    pub fn parse(owner: &'a str) -> Option<LeaseOwner<'a>> {
        let mut fields = owner.strip_prefix(Self::PREFIX)?.split('/');
        let host = fields.next()?;
        let machine = fields.next()?;
        let pid = fields.next()?.parse().ok()?;
        let start = fields.next()?.parse().ok()?;
        let nonce = fields.next()?;
        if fields.next().is_some() {
            return None;
        }
        Some(LeaseOwner { host, machine, pid, start, nonce })
    }
}

/// The process behind a lease owner, for people: "keel process 4242 on host build-7".
pub fn describe(owner: &str) -> String {
    match LeaseOwner::parse(owner) {
        Some(parsed) => format!("keel process {} on host {}", parsed.pid, parsed.host),
        None => format!("lease owner {owner:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_round_trip_and_strangers_do_not_parse() {
        let owner = LeaseOwner::format("box/1", "b00t", 4242, 987_654, "a1b2");
        assert_eq!(owner, "keel/box_1/b00t/4242/987654/a1b2");
        let parsed = LeaseOwner::parse(&owner).unwrap();
        assert_eq!((parsed.host, parsed.machine, parsed.pid, parsed.start), ("box_1", "b00t", 4242, 987_654));
        assert_eq!(describe(&owner), "keel process 4242 on host box_1");
        for stranger in ["keel-4242-abcdef", "keel/h/m/notapid/1/n", "keel/h/m/1/2/n/extra", "process-a"] {
            assert_eq!(LeaseOwner::parse(stranger), None, "{stranger}");
        }
        assert_eq!(describe("process-a"), "lease owner \"process-a\"");
    }
}
