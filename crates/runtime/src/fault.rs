//! Fault injection for crash tests: `KEEL_FAULT=<point>:<step>` makes the process abort (as
//! abruptly as a SIGKILL: no destructor, no flush) when the driver reaches that point for that
//! step, e.g. `KEEL_FAULT=after_commit:tool:append:call_0_0`.
//!
//! Points: `before_commit` (the step's result is in hand, not yet committed) and `after_commit`
//! (committed, the next action not started); and, without a step, `after_schedule_claim` (a
//! schedule's tick and its fire's delayed run are stored, the run not started). Unset, a check is one atomic load. This exists so
//! that crash tests can kill a run at every step boundary systematically instead of by luck.
//!
//! Only debug builds (what tests run) and builds with the `fault-injection` feature read the
//! variable: in a release build it does nothing, so a stray `KEEL_FAULT` in production cannot
//! abort a server.

#[cfg(any(debug_assertions, feature = "fault-injection"))]
use std::sync::OnceLock;

use keel_core::StepName;

#[cfg(any(debug_assertions, feature = "fault-injection"))]
static FAULT: OnceLock<Option<String>> = OnceLock::new();

/// Fault injection is compiled out of this build.
#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub(crate) fn point(_name: &str, _step: &StepName) {}

/// Fault injection is compiled out of this build.
#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub(crate) fn point_here(_name: &str) {}

/// Aborts the process if `KEEL_FAULT` names this point (one that has no step).
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub(crate) fn point_here(name: &str) {
    let Some(target) = FAULT.get_or_init(|| std::env::var(keel_core::env::FAULT.name).ok()) else { return };
    if target == name {
        std::process::abort();
    }
}

/// Aborts the process if `KEEL_FAULT` names this point and step.
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub(crate) fn point(name: &str, step: &StepName) {
    let Some(target) = FAULT.get_or_init(|| std::env::var(keel_core::env::FAULT.name).ok()) else { return };
    let Some(rest) = target.strip_prefix(name).and_then(|r| r.strip_prefix(':')) else { return };
    if rest == step.to_string() {
        // Not a panic: nothing may run after this, as after a kill.
        std::process::abort();
    }
}
