//! Decoding helpers over [`Node`]s: typed reads that record a diagnostic instead of failing, so
//! one pass reports every problem of a file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_core::ErrorCode;

use crate::diagnostic::{Diagnostic, Pos};
use crate::tree::{Kind, Node};

/// Collects the diagnostics of one file.
pub(crate) struct Decoder<'a> {
    pub(crate) file: PathBuf,
    pub(crate) diagnostics: &'a mut Vec<Diagnostic>,
}

impl Decoder<'_> {
    pub(crate) fn file(&self) -> &Path {
        &self.file
    }

    /// Records an error.
    pub(crate) fn error(&mut self, pos: Pos, message: impl Into<String>) -> &mut Diagnostic {
        self.push(Diagnostic::error(ErrorCode::SpecInvalid, &self.file, pos, message))
    }

    /// Records a diagnostic.
    pub(crate) fn push(&mut self, diagnostic: Diagnostic) -> &mut Diagnostic {
        self.diagnostics.push(diagnostic);
        self.diagnostics.last_mut().expect("just pushed")
    }

    fn wrong_type(&mut self, node: &Node, what: &str, expected: &str) {
        let what = quoted(what);
        self.error(node.pos, format!("{what} must be {expected}, not {}", node.kind.describe()));
    }

    /// Opens a mapping for key-by-key reading.
    pub(crate) fn map<'n>(&mut self, node: &'n Node, what: &str) -> Option<MapReader<'n>> {
        match &node.kind {
            Kind::Map(entries) => {
                Some(MapReader { entries, used: vec![false; entries.len()], pos: node.pos })
            }
            _ => {
                self.wrong_type(node, what, "a mapping");
                None
            }
        }
    }

    pub(crate) fn string(&mut self, node: &Node, what: &str) -> Option<String> {
        match &node.kind {
            Kind::Str(s) => Some(s.clone()),
            _ => {
                self.wrong_type(node, what, "a string");
                None
            }
        }
    }

    /// A non-empty string.
    pub(crate) fn text(&mut self, node: &Node, what: &str) -> Option<String> {
        let text = self.string(node, what)?;
        if text.trim().is_empty() {
            self.error(node.pos, format!("`{what}` must not be empty"));
            return None;
        }
        Some(text)
    }

    /// `true` or `false`.
    pub(crate) fn boolean(&mut self, node: &Node, what: &str) -> Option<bool> {
        match node.kind {
            Kind::Bool(b) => Some(b),
            _ => {
                self.error(node.pos, format!("`{what}` must be true or false"));
                None
            }
        }
    }

    /// An integer in `min..=max`.
    pub(crate) fn int(&mut self, node: &Node, what: &str, min: i64, max: i64) -> Option<i64> {
        match node.kind {
            Kind::Int(n) if (min..=max).contains(&n) => Some(n),
            Kind::Int(n) => {
                let range = if max >= i64::from(u32::MAX) {
                    format!("at least {min}")
                } else {
                    format!("between {min} and {max}")
                };
                self.error(node.pos, format!("`{what}` must be {range}, not {n}"));
                None
            }
            _ => {
                self.wrong_type(node, what, "an integer");
                None
            }
        }
    }

    /// A duration: a string like `30s`, `500ms`, `2m`, `3d` (or a whole number of seconds).
    pub(crate) fn duration(&mut self, node: &Node, what: &str) -> Option<Duration> {
        let duration = match &node.kind {
            Kind::Int(secs) if *secs > 0 => Duration::from_secs(secs.unsigned_abs()),
            Kind::Str(text) => match humantime::parse_duration(text.trim()) {
                Ok(d) if !d.is_zero() => d,
                Ok(_) => {
                    self.error(node.pos, format!("`{what}` must be longer than zero"));
                    return None;
                }
                Err(e) => {
                    self.error(node.pos, format!("`{what}` is not a duration ({e}): {text:?}")).hint =
                        Some("write durations like `500ms`, `30s`, `5m`, `2h` or `3d`".into());
                    return None;
                }
            },
            _ => {
                self.wrong_type(node, what, "a duration such as \"30s\"");
                return None;
            }
        };
        Some(duration)
    }

    /// A list, item by item.
    pub(crate) fn list<'n>(&mut self, node: &'n Node, what: &str) -> Option<&'n [Node]> {
        match &node.kind {
            Kind::Seq(items) => Some(items),
            _ => {
                self.wrong_type(node, what, "a list");
                None
            }
        }
    }

    /// A list of non-empty strings, with their positions.
    pub(crate) fn string_list(&mut self, node: &Node, what: &str) -> Option<Vec<(String, Pos)>> {
        let items = self.list(node, what)?;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            if let Some(text) = self.text(item, &format!("{what}[]")) {
                out.push((text, item.pos));
            }
        }
        Some(out)
    }
}

/// Reads a mapping key by key, then reports the keys nobody asked for.
pub(crate) struct MapReader<'n> {
    entries: &'n [(String, Pos, Node)],
    used: Vec<bool>,
    pub(crate) pos: Pos,
}

impl<'n> MapReader<'n> {
    /// Takes the value of `key`, if present.
    pub(crate) fn take(&mut self, key: &str) -> Option<&'n Node> {
        let index = self.entries.iter().position(|(k, _, _)| k == key)?;
        self.used[index] = true;
        Some(&self.entries[index].2)
    }

    /// Takes every entry not taken yet (a mapping with free-form keys), as (key, key position,
    /// value).
    pub(crate) fn rest(&mut self) -> Vec<(&'n str, Pos, &'n Node)> {
        let mut rest = Vec::new();
        for ((key, pos, node), used) in self.entries.iter().zip(self.used.iter_mut()) {
            if !*used {
                *used = true;
                rest.push((key.as_str(), *pos, node));
            }
        }
        rest
    }

    /// Whether a key not taken is a likely typo of `key` (among `known`): its "unknown key"
    /// error will say so, and a "missing `key`" error would only repeat it.
    pub(crate) fn misspelled(&self, key: &str, known: &[&str]) -> bool {
        self.entries.iter().zip(&self.used).any(|((other, _, _), used)| {
            !*used && !known.contains(&other.as_str()) && did_you_mean(other, known) == Some(key)
        })
    }

    /// The position of `key`, if present.
    pub(crate) fn key_pos(&self, key: &str) -> Option<Pos> {
        self.entries.iter().find(|(k, _, _)| k == key).map(|(_, p, _)| *p)
    }

    /// Reports every key not taken as unknown, with a "did you mean" among `known`.
    pub(crate) fn finish(self, decoder: &mut Decoder<'_>, section: &str, known: &[&str]) {
        self.report_unknown(decoder, section, known, false);
    }

    /// [`MapReader::finish`] for a section whose format others extend (a skill's front matter):
    /// unknown keys are warnings, and loading goes on.
    pub(crate) fn finish_leniently(self, decoder: &mut Decoder<'_>, section: &str, known: &[&str]) {
        self.report_unknown(decoder, section, known, true);
    }

    fn report_unknown(self, decoder: &mut Decoder<'_>, section: &str, known: &[&str], lenient: bool) {
        for ((key, pos, _), used) in self.entries.iter().zip(self.used) {
            if used {
                continue;
            }
            let place = if section.is_empty() { String::new() } else { format!(" in {}", quoted(section)) };
            let message = format!("unknown key `{key}`{place}");
            let diagnostic = if lenient {
                let file = decoder.file.clone();
                decoder.push(Diagnostic::warning(
                    ErrorCode::SpecInvalid,
                    &file,
                    *pos,
                    format!("{message}: ignored"),
                ))
            } else {
                decoder.error(*pos, message)
            };
            diagnostic.hint = Some(match did_you_mean(key, known) {
                Some(close) => format!("did you mean `{close}`?"),
                None => format!("known keys: {}", known.join(", ")),
            });
        }
    }
}

/// Whether `node` is a mapping without `key` (a missing key is reported once, not twice when
/// the key is there with a value of the wrong type).
pub(crate) fn map_lacks(node: &Node, key: &str) -> bool {
    matches!(&node.kind, Kind::Map(entries) if !entries.iter().any(|(k, _, _)| k == key))
}

/// The candidate closest to `word`, when it is close enough to be a likely typo.
pub fn did_you_mean<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|candidate| (strsim::jaro_winkler(word, candidate), *candidate))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| candidate)
}

/// How a message names `what`: a key path in backticks (`limits.max_turns`), a description of a
/// whole document as it is (the front matter, the channel).
fn quoted(what: &str) -> String {
    if what.starts_with("the ") { what.to_owned() } else { format!("`{what}`") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn did_you_mean_finds_typos_only() {
        let keys = ["model", "instructions", "max_turns", "tools"];
        assert_eq!(did_you_mean("modle", &keys), Some("model"));
        assert_eq!(did_you_mean("instruction", &keys), Some("instructions"));
        assert_eq!(did_you_mean("max-turns", &keys), Some("max_turns"));
        assert_eq!(did_you_mean("banana", &keys), None);
    }
}
