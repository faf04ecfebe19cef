//! The `keel` command: parse arguments, run the command, map the outcome to an exit code.
//!
//! Exit codes (also in `keel --help` and the README):
//! 0 the run finished (or `check` found no error); 1 the agent is invalid or cannot be set up;
//! 2 bad command-line usage; 3 the run failed; 4 the run stopped at a limit (`max_turns`,
//! a budget); 130 interrupted (Ctrl-C).

mod cli;

/// mimalloc: markedly cheaper than glibc's malloc for the many small allocations of a run.
#[global_allocator]
static ALLOCATOR: keel::allocator::Mimalloc = keel::allocator::Mimalloc;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
