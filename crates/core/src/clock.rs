//! [`Clock`]: where the runtime and the stores read the time.
//!
//! Lease expiries, approval timeouts and "when can this run be taken over" are decided by wall
//! clock time. Reading it through a trait lets tests move time forward on purpose
//! ([`ManualClock`]) instead of sleeping and hoping. The run loop itself never reads a clock
//! (see the crate docs): only the driver and the stores do.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of wall-clock time, in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now.
    fn now_ms(&self) -> u64;
}

/// The system's clock (0 before the Unix epoch).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// The system clock, shared: the default everywhere a clock is taken.
pub fn system() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

/// A clock that moves only when told to: for tests. Clones share the same time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `now_ms`.
    pub fn at(now_ms: u64) -> ManualClock {
        ManualClock { now: Arc::new(AtomicU64::new(now_ms)) }
    }

    /// A clock showing the system's time now, frozen there.
    pub fn starting_now() -> ManualClock {
        ManualClock::at(SystemClock.now_ms())
    }

    /// Moves the time forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.now.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// `at_ms` (milliseconds since the Unix epoch) as an RFC 3339 UTC time, `2026-12-01T09:00:00Z`:
/// how the API and the CLI write times.
pub fn rfc3339(at_ms: u64) -> String {
    jiff::Timestamp::from_millisecond(i64::try_from(at_ms).unwrap_or(i64::MAX))
        .map_or_else(|_| at_ms.to_string(), |at| at.to_string())
}

/// "3 s ago", "in 2 min": a time relative to `now`, for messages.
pub fn relative(at_ms: u64, now_ms: u64) -> String {
    let (seconds, past) = if at_ms <= now_ms {
        ((now_ms - at_ms).div_ceil(1000), true)
    } else {
        ((at_ms - now_ms).div_ceil(1000), false)
    };
    let amount = match seconds {
        0..=120 => format!("{seconds} s"),
        121..=7_200 => format!("{} min", seconds.div_ceil(60)),
        7_201..=172_800 => format!("{} h", seconds.div_ceil(3_600)),
        _ => format!("{} days", seconds.div_ceil(86_400)),
    };
    if past { format!("{amount} ago") } else { format!("in {amount}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_clones_share_it() {
        let clock = ManualClock::at(1_000);
        let shared = clock.clone();
        assert_eq!(clock.now_ms(), 1_000);
        shared.advance(Duration::from_millis(250));
        assert_eq!(clock.now_ms(), 1_250);
    }

    #[test]
    fn relative_times_read_like_people_write_them() {
        assert_eq!(relative(1_000, 4_000), "3 s ago");
        assert_eq!(relative(31_000, 1_000), "in 30 s");
        assert_eq!(relative(0, 600_000), "10 min ago");
        assert_eq!(relative(10_800_000, 0), "in 3 h");
        assert_eq!(relative(0, 3 * 86_400_000), "3 days ago");
    }
}
