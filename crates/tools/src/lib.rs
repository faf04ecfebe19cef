//! keel-tools: tools an agent can use.
//!
//! - built-ins, by name ([`builtin`], [`BUILTIN_NAMES`]): `current-date`, `day-name`, and
//!   `ask_question` ([`AskQuestion`]), which pauses the run for a human's answer;
//! - tools from plain async Rust functions, with the input schema derived by schemars
//!   ([`function_tool`]);
//! - command tools ([`CommandTool`]): a program run with the input JSON on stdin.

mod clock;
mod command;
mod function;
mod question;

use std::sync::Arc;

use keel_core::Tool;

pub use clock::ClockTool;
pub use command::CommandTool;
pub use function::{function_tool, function_tool_with_context};
pub use question::AskQuestion;

/// The names of the built-in tools, for specs to refer to.
pub const BUILTIN_NAMES: &[&str] = &["current-date", "day-name", AskQuestion::NAME];

/// The built-in tool called `name`.
pub fn builtin(name: &str) -> Option<Arc<dyn Tool>> {
    match name {
        "current-date" => Some(Arc::new(ClockTool::current_date())),
        "day-name" => Some(Arc::new(ClockTool::day_name())),
        AskQuestion::NAME => Some(Arc::new(AskQuestion::new())),
        _ => None,
    }
}
