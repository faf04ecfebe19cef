//! How `keel run` shows a run: text as it streams, one compact line per tool call, a spinner
//! while the model thinks (on a terminal only); or the events as JSON lines.
//!
//! Data (the agent's text, JSON events) goes to stdout; everything else to stderr, so
//! `keel run agent "..." > answer.txt` keeps just the answer.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use keel::{Event, StopReason, event_to_json};
use serde_json::Value;

/// Shows events as they come.
pub(crate) trait Render {
    /// Shows one event.
    fn event(&mut self, event: &Event) -> std::io::Result<()>;
    /// Called once the stream ends.
    fn finish(&mut self) -> std::io::Result<()>;
}

/// Events as JSON lines on stdout.
pub(crate) struct JsonRenderer {
    stdout: std::io::Stdout,
}

impl JsonRenderer {
    pub(crate) fn new() -> JsonRenderer {
        JsonRenderer { stdout: std::io::stdout() }
    }
}

impl Render for JsonRenderer {
    fn event(&mut self, event: &Event) -> std::io::Result<()> {
        let mut out = self.stdout.lock();
        writeln!(out, "{}", event_to_json(event))?;
        out.flush()
    }

    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Text for people.
pub(crate) struct HumanRenderer {
    spinner: Option<ProgressBar>,
    /// Whether stderr is a terminal (spinner on).
    interactive: bool,
    /// Whether stdout is in the middle of a line.
    mid_line: bool,
    /// Whether any text was streamed.
    streamed: bool,
    tool_names: HashMap<String, String>,
}

const TOOL_LINE_WIDTH: usize = 120;

impl HumanRenderer {
    pub(crate) fn new() -> HumanRenderer {
        HumanRenderer {
            spinner: None,
            interactive: std::io::stderr().is_terminal(),
            mid_line: false,
            streamed: false,
            tool_names: HashMap::new(),
        }
    }

    fn start_spinner(&mut self) {
        if !self.interactive || self.spinner.is_some() {
            return;
        }
        let spinner = ProgressBar::new_spinner();
        spinner.set_style(
            ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        spinner.set_message("thinking");
        spinner.enable_steady_tick(Duration::from_millis(90));
        self.spinner = Some(spinner);
    }

    fn stop_spinner(&mut self) {
        if let Some(spinner) = self.spinner.take() {
            spinner.finish_and_clear();
        }
    }

    /// Ends the current stdout line, so stderr lines start on their own.
    fn end_line(&mut self) -> std::io::Result<()> {
        if self.mid_line {
            let mut out = std::io::stdout().lock();
            writeln!(out)?;
            out.flush()?;
            self.mid_line = false;
        }
        Ok(())
    }

    fn tool_line(&mut self, mark: &str, call_id: &str, detail: &str) -> std::io::Result<()> {
        self.stop_spinner();
        self.end_line()?;
        let name = self.tool_names.get(call_id).map_or(call_id, String::as_str);
        let line = format!("{mark} {name} {detail}");
        writeln!(std::io::stderr().lock(), "{}", shorten(&line, TOOL_LINE_WIDTH))
    }
}

/// Compact one-line JSON (strings unquoted).
fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.replace('\n', " "),
        other => other.to_string(),
    }
}

fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let kept: String = text.chars().take(max.saturating_sub(1)).collect();
    format!("{kept}…")
}

impl Render for HumanRenderer {
    fn event(&mut self, event: &Event) -> std::io::Result<()> {
        match event {
            Event::RunStart { .. } => {}
            Event::TurnStart { .. } => self.start_spinner(),
            Event::Usage(_) => self.stop_spinner(),
            Event::TextDelta { delta } => {
                self.stop_spinner();
                let mut out = std::io::stdout().lock();
                write!(out, "{delta}")?;
                out.flush()?;
                self.streamed = true;
                self.mid_line = !delta.ends_with('\n');
            }
            // Reasoning is for `--json` consumers; the terminal shows the answer.
            Event::ReasoningDelta { .. } => {}
            Event::TurnRetry { attempt, code, message, wait, .. } => {
                self.stop_spinner();
                self.end_line()?;
                let partial = if self.streamed { " (the partial answer above is void)" } else { "" };
                writeln!(
                    std::io::stderr().lock(),
                    "↻ the model call failed ({code}: {message}); retrying in {:.1} s, attempt {attempt}{partial}",
                    wait.as_secs_f64()
                )?;
                self.streamed = false;
                self.start_spinner();
            }
            Event::ToolStart { call_id, name, input } => {
                self.tool_names.insert(call_id.clone(), name.clone());
                self.tool_line("→", call_id, &compact(input))?;
            }
            Event::ToolDone { call_id, output, .. } => self.tool_line("✓", call_id, &compact(output))?,
            Event::ToolError { call_id, error, .. } => {
                self.tool_line("✗", call_id, &format!("failed: {error}"))?
            }
            Event::ApprovalRequested { approval_id, call_id, .. } => {
                self.tool_line("?", call_id, &format!("needs approval ({approval_id})"))?
            }
            Event::QuestionAsked { question_id, question } => {
                self.stop_spinner();
                self.end_line()?;
                writeln!(std::io::stderr().lock(), "? {question} ({question_id})")?;
            }
            Event::OutputRepair { attempt, problem } => {
                self.stop_spinner();
                self.end_line()?;
                let partial = if self.streamed { " (the answer above is void)" } else { "" };
                writeln!(
                    std::io::stderr().lock(),
                    "↻ the answer does not match the output schema ({problem}); repair turn {attempt}{partial}"
                )?;
                self.streamed = false;
            }
            Event::ContextCompacted { summarized, kept } => {
                self.stop_spinner();
                self.end_line()?;
                writeln!(
                    std::io::stderr().lock(),
                    "… compacted the conversation: {summarized} older messages summarised, {kept} kept"
                )?;
            }
            Event::StateUpdated { .. } => {}
            // The command explains the pause itself (what waits, and how to decide it).
            Event::RunPaused { .. } => {
                self.stop_spinner();
                self.end_line()?;
            }
            Event::RunDone { text, stopped, .. } => {
                self.stop_spinner();
                if *stopped == StopReason::StopCondition || (!self.streamed && !text.is_empty()) {
                    self.end_line()?;
                    let mut out = std::io::stdout().lock();
                    write!(out, "{text}")?;
                    self.mid_line = !text.ends_with('\n');
                }
                self.end_line()?;
                let note = match stopped {
                    StopReason::Final | StopReason::StopCondition | StopReason::AwaitingInput => None,
                    StopReason::MaxTurns => Some("stopped: the run used all its turns (`limits.max_turns`)"),
                    StopReason::Budget => Some(
                        "stopped: the run spent its budget (`limits.max_total_tokens` or `limits.max_tool_calls`)",
                    ),
                    StopReason::Cancelled => Some("stopped: cancelled"),
                };
                if let Some(note) = note {
                    writeln!(std::io::stderr().lock(), "{note}")?;
                }
            }
            Event::RunError { code, message } => {
                self.stop_spinner();
                self.end_line()?;
                writeln!(std::io::stderr().lock(), "error[{code}]: {message}")?;
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> std::io::Result<()> {
        self.stop_spinner();
        self.end_line()
    }
}
