//! Diagnostics: a problem in a spec, with its code, file, line and column, and a hint.

use std::fmt;
use std::path::{Path, PathBuf};

use keel_core::ErrorCode;

/// How bad a problem is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// The agent cannot run.
    Error,
    /// The agent runs, but something is probably not what the author meant.
    Warning,
}

/// A position in a file: 1-based line and column (in characters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pos {
    /// The line, from 1 (0 when unknown).
    pub line: usize,
    /// The column, from 1 (0 when unknown).
    pub col: usize,
}

/// One problem found while loading an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The stable code.
    pub code: ErrorCode,
    /// The file the problem is in.
    pub file: PathBuf,
    /// Where in the file (line 0: the whole file).
    pub pos: Pos,
    /// What is wrong.
    pub message: String,
    /// What to do about it.
    pub hint: Option<String>,
}

impl Diagnostic {
    /// An error.
    pub fn error(code: ErrorCode, file: &Path, pos: Pos, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            code,
            file: file.to_owned(),
            pos,
            message: message.into(),
            hint: None,
        }
    }

    /// A warning.
    pub fn warning(code: ErrorCode, file: &Path, pos: Pos, message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(code, file, pos, message) }
    }

    /// Adds a hint.
    pub fn with_hint(mut self, hint: impl Into<String>) -> Diagnostic {
        self.hint = Some(hint.into());
        self
    }

    /// Whether this is an error.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// Reads a file the loader needs, or records why it cannot (`what` names it in the message).
pub(crate) fn read_text(file: &Path, what: &str, diagnostics: &mut Vec<Diagnostic>) -> Option<String> {
    match std::fs::read_to_string(file) {
        Ok(text) => Some(text),
        Err(error) => {
            diagnostics.push(Diagnostic::error(
                ErrorCode::SpecNotFound,
                file,
                Pos::default(),
                format!("cannot read the {what}: {error}"),
            ));
            None
        }
    }
}

/// Renders as
/// ```text
/// error[KEEL_SPEC_INVALID]: unknown key `modle`
///   --> agent.yaml:3:1
///   hint: did you mean `model`?
/// ```
impl Diagnostic {
    /// As `keel check --json` shows it: `{severity, code?, message, file, line?, column?,
    /// hint?}` (a warning has no code; a position of 0 is left out).
    pub fn to_json(&self) -> serde_json::Value {
        let mut json = serde_json::json!({
            "severity": if self.is_error() { "error" } else { "warning" },
            "message": self.message,
            "file": self.file.display().to_string(),
        });
        if self.is_error() {
            json["code"] = self.code.as_str().into();
        }
        if self.pos.line > 0 {
            json["line"] = self.pos.line.into();
            json["column"] = self.pos.col.into();
        }
        if let Some(hint) = &self.hint {
            json["hint"] = hint.as_str().into();
        }
        json
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A warning does not stop the agent: it has no error code to look up.
        match self.severity {
            Severity::Error => writeln!(f, "error[{}]: {}", self.code, self.message)?,
            Severity::Warning => writeln!(f, "warning: {}", self.message)?,
        }
        match self.pos {
            Pos { line: 0, .. } => write!(f, "  --> {}", self.file.display())?,
            Pos { line, col } => write!(f, "  --> {}:{line}:{col}", self.file.display())?,
        }
        if let Some(hint) = &self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}
