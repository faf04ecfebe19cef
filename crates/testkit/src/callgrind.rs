//! Instructions per iteration of a benchmark's loop, counted by callgrind (valgrind's
//! instruction counter: repeatable whatever else the machine is doing).
//!
//! The benchmark runs itself twice under callgrind, once with a small number of iterations and
//! once with a large one; start-up and warm-up are the same in both and cancel out of the
//! difference of the totals, which is divided by the difference of the iterations. Every thread
//! of the process counts (a store's writer thread too); other processes (a database server) do
//! not.

use std::process::{Command, Stdio};

/// Instructions per iteration: `current_exe` run under callgrind as `args` followed by
/// `small`, then by `large`. `None` when valgrind is missing or either run fails.
pub fn instructions_per_iteration(args: &[&str], small: usize, large: usize) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let dir = tempfile::tempdir().ok()?;
    let mut totals = Vec::new();
    for iterations in [small, large] {
        let out = dir.path().join(format!("callgrind.{iterations}"));
        let status = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args(args)
            .arg(iterations.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok()?;
        if !status.success() {
            return None;
        }
        let text = std::fs::read_to_string(&out).ok()?;
        // "totals:" (or "summary:" in older valgrinds) is the whole process's count.
        let total = text
            .lines()
            .find_map(|l| l.strip_prefix("totals:").or_else(|| l.strip_prefix("summary:")))?
            .trim()
            .parse::<f64>()
            .ok()?;
        totals.push(total);
    }
    Some((totals[1] - totals[0]) / large.abs_diff(small) as f64)
}
