//! A small value tree with positions, parsed from YAML, TOML or JSON.
//!
//! Decoding from this tree instead of deserializing straight into structs lets the loader report
//! every problem of a file (not just the first), each with its line and column, the same way
//! for the three formats.

use std::path::Path;

use keel_core::ErrorCode;
use saphyr::{MarkedYaml, Scalar, YamlData, YamlLoader};
use saphyr_parser::{Event, Parser, SpannedEventReceiver};
use serde_json::Value;

use crate::diagnostic::{Diagnostic, Pos};

/// A value with the position it starts at.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Node {
    pub(crate) kind: Kind,
    pub(crate) pos: Pos,
}

/// What a node holds.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Kind {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    /// Keys keep their own positions, for "unknown key" errors.
    Map(Vec<(String, Pos, Node)>),
}

impl Kind {
    /// How the kind is named in messages ("a string", "a list"...).
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            Kind::Null => "nothing (null)",
            Kind::Bool(_) => "a boolean",
            Kind::Int(_) => "an integer",
            Kind::Float(_) => "a number",
            Kind::Str(_) => "a string",
            Kind::Seq(_) => "a list",
            Kind::Map(_) => "a mapping",
        }
    }
}

impl Node {
    /// The node a JSON pointer (`/properties/city/type`) names inside this one, or the deepest
    /// one on the way there.
    pub(crate) fn at_pointer(&self, pointer: &str) -> &Node {
        let mut node = self;
        for segment in pointer.split('/').skip(1) {
            let segment = segment.replace("~1", "/").replace("~0", "~");
            let next = match &node.kind {
                Kind::Map(entries) => {
                    entries.iter().find(|(key, _, _)| *key == segment).map(|(_, _, value)| value)
                }
                Kind::Seq(items) => segment.parse::<usize>().ok().and_then(|index| items.get(index)),
                _ => None,
            };
            match next {
                Some(next) => node = next,
                None => break,
            }
        }
        node
    }

    /// The node as JSON (for schemas and tool inputs).
    pub(crate) fn to_json(&self) -> Value {
        match &self.kind {
            Kind::Null => Value::Null,
            Kind::Bool(b) => Value::Bool(*b),
            Kind::Int(i) => Value::from(*i),
            Kind::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
            Kind::Str(s) => Value::String(s.clone()),
            Kind::Seq(items) => Value::Array(items.iter().map(Node::to_json).collect()),
            Kind::Map(entries) => {
                Value::Object(entries.iter().map(|(k, _, v)| (k.clone(), v.to_json())).collect())
            }
        }
    }
}

/// The format of a spec file, from its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Yaml,
    Toml,
    Json,
}

impl Format {
    pub(crate) fn of(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "yaml" | "yml" => Some(Format::Yaml),
            "toml" => Some(Format::Toml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Parses `text` as `format`, or says where its syntax breaks.
pub(crate) fn parse(text: &str, format: Format, file: &Path) -> Result<Node, Diagnostic> {
    match format {
        Format::Yaml => parse_yaml(text, file),
        Format::Toml => parse_toml(text, file),
        Format::Json => {
            // serde_json gives the precise syntax error; the YAML parser (JSON is YAML 1.2)
            // gives the positions.
            if let Err(error) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
                let pos = Pos { line: error.line(), col: error.column() };
                return Err(syntax(file, pos, format!("invalid JSON: {error}")));
            }
            parse_yaml(text, file)
        }
    }
}

fn syntax(file: &Path, pos: Pos, message: String) -> Diagnostic {
    Diagnostic::error(ErrorCode::SpecSyntax, file, pos, message)
}

/// How deeply lists and mappings may nest in a YAML file: deeper than any spec needs (a tool's
/// input schema nests a few levels), and as deep as serde_json lets JSON nest. The tree is
/// converted and dropped recursively, so a file nested thousands of levels deep would
/// overflow the stack and abort the process; it is refused instead.
pub(crate) const MAX_DEPTH: usize = 128;

pub(crate) fn parse_yaml(text: &str, file: &Path) -> Result<Node, Diagnostic> {
    let docs = load_yaml(text, file)?;
    match docs.len() {
        0 => Ok(Node { kind: Kind::Map(Vec::new()), pos: Pos { line: 1, col: 1 } }),
        1 => from_yaml(&docs[0], file),
        _ => Err(syntax(
            file,
            yaml_pos(&docs[1]),
            "the file holds several YAML documents; a spec is one document".into(),
        )),
    }
}

/// saphyr's documents for `text`, nested at most [`MAX_DEPTH`] levels. The parser is driven
/// event by event: its own `load` recurses once per level of block nesting, with no limit
/// (only flow collections, `[[[`, have one), so it is not used.
fn load_yaml<'a>(text: &'a str, file: &Path) -> Result<Vec<MarkedYaml<'a>>, Diagnostic> {
    let too_deep = || format!("lists and mappings nest more than {MAX_DEPTH} levels deep here");
    let invalid = |error: saphyr::ScanError| {
        let mark = error.marker();
        // The scanner reads ahead, so flow style (`[[[`) meets its own, higher limit first.
        let message = match error.info() {
            "recursion limit exceeded" => too_deep(),
            info => format!("invalid YAML: {info}"),
        };
        syntax(file, Pos { line: mark.line(), col: mark.col() + 1 }, message)
    };
    let mut loader = YamlLoader::<MarkedYaml<'a>>::default();
    let mut depth = 0usize;
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(invalid)?;
        match event {
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(syntax(
                        file,
                        Pos { line: span.start.line(), col: span.start.col() + 1 },
                        too_deep(),
                    ));
                }
            }
            Event::SequenceEnd | Event::MappingEnd => depth = depth.saturating_sub(1),
            _ => {}
        }
        loader.on_event(event, span);
        if let Some(error) = loader.error() {
            return Err(invalid(error.clone()));
        }
    }
    Ok(loader.into_documents())
}

fn yaml_pos(node: &MarkedYaml<'_>) -> Pos {
    Pos { line: node.span.start.line(), col: node.span.start.col() + 1 }
}

fn from_yaml(node: &MarkedYaml<'_>, file: &Path) -> Result<Node, Diagnostic> {
    let pos = yaml_pos(node);
    let kind = match &node.data {
        YamlData::Value(scalar) => match scalar {
            Scalar::Null => Kind::Null,
            Scalar::Boolean(b) => Kind::Bool(*b),
            Scalar::Integer(i) => Kind::Int(*i),
            Scalar::FloatingPoint(f) => Kind::Float(f.into_inner()),
            Scalar::String(s) => Kind::Str(s.to_string()),
        },
        YamlData::Sequence(items) => {
            Kind::Seq(items.iter().map(|item| from_yaml(item, file)).collect::<Result<_, _>>()?)
        }
        YamlData::Mapping(map) => {
            let mut entries = Vec::with_capacity(map.len());
            for (key, value) in map {
                let name = match &key.data {
                    YamlData::Value(Scalar::String(s)) => s.to_string(),
                    YamlData::Value(Scalar::Integer(i)) => i.to_string(),
                    YamlData::Value(Scalar::Boolean(b)) => b.to_string(),
                    _ => {
                        return Err(syntax(file, yaml_pos(key), "mapping keys must be plain strings".into()));
                    }
                };
                entries.push((name, yaml_pos(key), from_yaml(value, file)?));
            }
            Kind::Map(entries)
        }
        YamlData::Tagged(_, inner) => return from_yaml(inner, file),
        YamlData::Representation(text, _, _) => Kind::Str(text.to_string()),
        YamlData::Alias(_) | YamlData::BadValue => {
            return Err(syntax(
                file,
                pos,
                "YAML aliases and unresolvable values are not supported in specs".into(),
            ));
        }
    };
    Ok(Node { kind, pos })
}

/// Maps byte offsets to line and column.
struct LineIndex<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> LineIndex<'a> {
    fn new(text: &'a str) -> LineIndex<'a> {
        let starts = std::iter::once(0).chain(text.match_indices('\n').map(|(i, _)| i + 1)).collect();
        LineIndex { text, starts }
    }

    fn pos(&self, offset: usize) -> Pos {
        let line = self.starts.partition_point(|&start| start <= offset).max(1);
        let start = self.starts[line - 1];
        let end = offset.min(self.text.len());
        let col = self.text.get(start..end).map_or(end - start, |s| s.chars().count()) + 1;
        Pos { line, col }
    }
}

pub(crate) fn parse_toml(text: &str, file: &Path) -> Result<Node, Diagnostic> {
    let index = LineIndex::new(text);
    let table = toml::de::DeTable::parse(text).map_err(|error| {
        let pos = error.span().map_or(Pos::default(), |span| index.pos(span.start));
        syntax(file, pos, format!("invalid TOML: {}", error.message().trim()))
    })?;
    let pos = index.pos(table.span().start);
    Ok(Node { kind: toml_table(table.get_ref(), &index), pos })
}

fn toml_table(table: &toml::de::DeTable<'_>, index: &LineIndex<'_>) -> Kind {
    Kind::Map(
        table
            .iter()
            .map(|(key, value)| {
                (key.get_ref().to_string(), index.pos(key.span().start), toml_value(value, index))
            })
            .collect(),
    )
}

fn toml_value(value: &toml::Spanned<toml::de::DeValue<'_>>, index: &LineIndex<'_>) -> Node {
    use toml::de::DeValue;
    let pos = index.pos(value.span().start);
    let kind = match value.get_ref() {
        DeValue::String(s) => Kind::Str(s.to_string()),
        DeValue::Integer(i) => {
            let digits = i.as_str().replace('_', "");
            match i64::from_str_radix(&digits, i.radix()) {
                Ok(n) => Kind::Int(n),
                Err(_) => Kind::Str(i.as_str().to_owned()),
            }
        }
        DeValue::Float(f) => Kind::Float(f.as_str().replace('_', "").parse().unwrap_or(f64::NAN)),
        DeValue::Boolean(b) => Kind::Bool(*b),
        DeValue::Datetime(d) => Kind::Str(d.to_string()),
        DeValue::Array(items) => Kind::Seq(items.iter().map(|item| toml_value(item, index)).collect()),
        DeValue::Table(table) => toml_table(table, index),
    };
    Node { kind, pos }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(node: &Node) -> Vec<(String, Pos)> {
        let Kind::Map(entries) = &node.kind else { panic!("{node:?}") };
        entries
            .iter()
            .map(|(k, p, v)| (k.clone(), if matches!(v.kind, Kind::Map(_)) { *p } else { v.pos }))
            .collect()
    }

    #[test]
    fn the_three_formats_agree_on_values_and_give_positions() {
        let file = Path::new("x");
        let yaml = parse("name: a\nlimits:\n  max_turns: 3\n", Format::Yaml, file).unwrap();
        let toml = parse("name = \"a\"\n[limits]\nmax_turns = 3\n", Format::Toml, file).unwrap();
        let json = parse("{\n  \"name\": \"a\",\n  \"limits\": {\"max_turns\": 3}\n}\n", Format::Json, file)
            .unwrap();
        for node in [&yaml, &toml, &json] {
            assert_eq!(node.to_json(), serde_json::json!({"name": "a", "limits": {"max_turns": 3}}));
        }
        assert_eq!(
            positions(&yaml),
            [("name".into(), Pos { line: 1, col: 7 }), ("limits".into(), Pos { line: 2, col: 1 })]
        );
        assert_eq!(
            positions(&toml),
            [("name".into(), Pos { line: 1, col: 8 }), ("limits".into(), Pos { line: 2, col: 2 })]
        );
        assert_eq!(
            positions(&json),
            [("name".into(), Pos { line: 2, col: 11 }), ("limits".into(), Pos { line: 3, col: 3 })]
        );
    }

    /// Lists and mappings nested `levels` deep: in block style (which saphyr's own loader
    /// recurses on without a limit) one level per line and all on one line, and in flow style.
    fn nested(levels: usize) -> [String; 4] {
        let block: String = (0..levels).map(|i| format!("{}-\n", " ".repeat(i * 2))).collect();
        let mapping: String = (0..levels).map(|i| format!("{}a:\n", " ".repeat(i))).collect();
        let one_line = format!("{}x\n", "- ".repeat(levels));
        let flow = format!("{}{}\n", "[".repeat(levels), "]".repeat(levels));
        [block, mapping, one_line, flow]
    }

    #[test]
    fn a_file_nested_too_deep_is_an_error_not_a_crash() {
        let file = Path::new("agent.yaml");
        // 20,000 levels overflowed the stack of the loader (a test thread's, and `keel check`'s
        // main thread) and aborted the process.
        for text in nested(20_000) {
            let err = parse(&format!("model: mock\nx:\n{text}"), Format::Yaml, file).unwrap_err();
            assert_eq!(err.code, ErrorCode::SpecSyntax);
            assert_eq!(err.message, "lists and mappings nest more than 128 levels deep here", "{err}");
            assert!((3..140).contains(&err.pos.line) && err.pos.col < 260, "{err}");
        }
        // What a spec may need loads, at the limit too.
        for text in nested(MAX_DEPTH - 1) {
            let node = parse(&format!("x:\n{text}"), Format::Yaml, file);
            assert!(node.is_ok() || !node.unwrap_err().message.contains("nest"), "refused at the limit");
        }
        let deep_schema = format!("x: {}1{}\n", "{a: ".repeat(MAX_DEPTH - 1), "}".repeat(MAX_DEPTH - 1));
        assert!(parse(&deep_schema, Format::Yaml, file).is_ok());
    }

    #[test]
    fn syntax_errors_point_at_the_problem() {
        let file = Path::new("agent.yaml");
        let err = parse("name: a\n  bad: [\n", Format::Yaml, file).unwrap_err();
        assert_eq!(err.code, ErrorCode::SpecSyntax);
        assert!(err.pos.line >= 2, "{err}");
        let err = parse("name = \n", Format::Toml, file).unwrap_err();
        assert_eq!(err.pos.line, 1, "{err}");
        let err = parse("{\"a\": 1,\n \"b\": }", Format::Json, file).unwrap_err();
        assert_eq!(err.pos, Pos { line: 2, col: 7 }, "{err}");
    }
}
