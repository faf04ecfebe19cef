//! keel-runtime: drives runs of an agent.
//!
//! The [`Engine`] executes the actions of keel-core's state machine through the [`Provider`],
//! [`Tool`] and [`Store`] traits:
//!
//! - every completed step (model reply, tool outcome) is journaled before the loop moves on;
//! - re-driving a run ([`Engine::resume`]) replays the journal: a journaled step returns its
//!   recorded result and is not executed again, and messages are appended idempotently;
//! - model calls get a timeout and retries with backoff for transient errors;
//! - the tool calls of one turn run in parallel, each in its own task, with a timeout, and a
//!   panicking or hanging tool becomes a tool error while the run goes on;
//! - a run can be cancelled; one session runs one run at a time;
//! - [`Triggers`] fire the agent's cron schedules and start delayed runs when they are due.
//!
//! [`Provider`]: keel_core::Provider
//! [`Tool`]: keel_core::Tool
//! [`Store`]: keel_core::Store

mod admission;
mod driver;
mod engine;
mod fault;
mod handle;
mod process;
mod shared;
mod spans;
pub mod triggers;

pub use engine::{Cancellation, Engine, EngineOptions, RunOptions, new_delayed_run_id, record_decision, who};
pub use handle::{RunHandle, RunResult};
pub use process::is_provably_dead;
pub use triggers::{TriggerStats, Triggers};
