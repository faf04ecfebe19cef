//! Test cases of an agent (`tests/*.yaml` of an agent directory, what `keel test` runs): an
//! input, the model's replies (a mock script, else the agent's own), how its approvals and
//! questions are decided, and what the run must do. Decoded like a spec file: every problem of
//! every file is reported with its line and column and a "did you mean".
//!
//! ```yaml
//! input: How many words are in "the quick brown fox"?
//! mock:                                 # the model's replies, in order
//!   - tool_calls: [{ name: word_count, input: { text: the quick brown fox } }]
//!   - text: That text has {{last_tool_output}} words.
//! expect:
//!   tool_calls:                         # every call, in order; inputs and outputs match as subsets
//!     - { name: word_count, input: { text: the quick brown fox }, output: 4 }
//!   text: That text has 4 words.        # or text_contains / text_matches (a regex)
//!   stop: final
//! ```

use std::path::{Path, PathBuf};

use keel_core::{ErrorCode, MockScript, StopReason};
use serde_json::Value;

use crate::decode::{Decoder, did_you_mean};
use crate::diagnostic::{Diagnostic, Pos};
use crate::tree::{self, Format, Kind, Node};

/// One test case.
#[derive(Clone, Debug, PartialEq)]
pub struct TestCase {
    /// The file's stem (`tests/counts_words.yaml` → `counts_words`).
    pub name: String,
    /// The file it was read from.
    pub file: PathBuf,
    /// The user's message.
    pub input: String,
    /// The model's replies for this case; `None`: the agent's own model (its mock script, or a
    /// real provider).
    pub mock: Option<MockScript>,
    /// The time the clock tools read (`now: 2026-03-02T09:00:00Z`, or with a zone:
    /// `2026-03-02T09:00:00+01:00[Europe/Paris]`); `None`: the clock.
    pub now: Option<jiff::ZonedDateTime>,
    /// The session's state before the run (`state`); `None`: the agent's `state.initial`.
    pub state: Option<Value>,
    /// How approvals are decided, by tool name (`approvals: { convert: approve }`). A pending
    /// approval of a tool not named here leaves the run paused.
    pub approvals: Vec<(String, Verdict)>,
    /// The answers to the agent's questions, in the order they are asked.
    pub answers: Vec<String>,
    /// What the run must do.
    pub expect: Expectations,
}

/// How a test case decides an approval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The call runs.
    Approve,
    /// The call is refused, with this reason.
    Reject(Option<String>),
}

/// What a run must do to pass. Everything not named is not checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Expectations {
    /// Every tool call of the run, in order.
    pub tool_calls: Option<Vec<ExpectedCall>>,
    /// The final answer.
    pub text: Option<TextMatch>,
    /// How the run ended.
    pub stop: Option<ExpectedStop>,
    /// The session's state after the run, matched as a subset.
    pub state: Option<Value>,
}

/// One expected tool call.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedCall {
    /// The tool.
    pub name: String,
    /// The input, matched as a subset (objects may have more keys).
    pub input: Option<Value>,
    /// The output, matched as a subset.
    pub output: Option<Value>,
    /// Whether the call must fail (`error: true`) or succeed (`error: false`).
    pub error: Option<bool>,
    /// Where it was written, for messages.
    pub pos: Pos,
}

/// How the final answer is matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextMatch {
    /// Exactly this text (surrounding white space aside).
    Equals(String),
    /// Text containing this.
    Contains(String),
    /// Text matching this regular expression.
    Matches(String),
}

/// How the run must end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectedStop {
    /// With this stop reason (`awaiting_input`: paused for a human).
    Stopped(StopReason),
    /// With a failure; with this error code when one is given (`stop: failed`,
    /// `error: KEEL_TOOL_FAILED`).
    Failed(Option<ErrorCode>),
}

/// What loading the test cases gave: the cases when there is no error, and every diagnostic.
#[derive(Debug, Default)]
pub struct LoadedTests {
    /// The cases, in file name order (empty when any file has an error).
    pub cases: Vec<TestCase>,
    /// Every problem found, in file order.
    pub diagnostics: Vec<Diagnostic>,
}

const CASE_KEYS: &[&str] = &["input", "mock", "now", "state", "approvals", "answers", "expect"];
const EXPECT_KEYS: &[&str] =
    &["tool_calls", "text", "text_contains", "text_matches", "stop", "error", "state"];
const CALL_KEYS: &[&str] = &["name", "input", "output", "error"];

/// The test case files of an agent directory: `tests/*.yaml` (and `.yml`), by name; empty when
/// there is no `tests/`.
pub fn test_files(agent_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let dir = agent_dir.join("tests");
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.is_file() && matches!(Format::of(&path), Some(Format::Yaml)) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Loads test case files. `tools`: the agent's tool names as the model sees them, to check
/// the names the cases use (`None` when some are only known at run time, from MCP servers).
/// `tool_name`: a built-in's name for a former name (`keel_tools::tool_name`): a case using a
/// former name works, with a warning.
pub fn load_tests(files: &[PathBuf], tools: Option<&[String]>, tool_name: fn(&str) -> &str) -> LoadedTests {
    let mut loaded = LoadedTests::default();
    for file in files {
        if let Some(mut case) = load_case(file, tools, tool_name, &mut loaded.diagnostics) {
            rename_tools(&mut case, tool_name, &mut loaded.diagnostics);
            loaded.cases.push(case);
        }
    }
    loaded
        .diagnostics
        .sort_by(|a, b| (&a.file, a.pos.line, a.pos.col).cmp(&(&b.file, b.pos.line, b.pos.col)));
    if loaded.diagnostics.iter().any(Diagnostic::is_error) {
        loaded.cases.clear();
    }
    loaded
}

/// Gives the built-ins a case names by a former name their names now, warning once per name.
fn rename_tools(case: &mut TestCase, tool_name: fn(&str) -> &str, diagnostics: &mut Vec<Diagnostic>) {
    let mut warned: Vec<String> = Vec::new();
    let mut rename = |name: &mut String, pos: Pos| {
        let now = tool_name(name);
        if now == name.as_str() {
            return;
        }
        let now = now.to_owned();
        if !warned.contains(name) {
            diagnostics.push(
                Diagnostic::warning(
                    ErrorCode::SpecInvalid,
                    &case.file,
                    pos,
                    format!("the tool `{name}` is now called `{now}`"),
                )
                .with_hint(format!("write `{now}`: the old name still works, for now")),
            );
            warned.push(name.clone());
        }
        *name = now;
    };
    let root = Pos { line: 1, col: 1 };
    for call in case.expect.tool_calls.iter_mut().flatten() {
        rename(&mut call.name, call.pos);
    }
    for (name, _) in &mut case.approvals {
        rename(name, root);
    }
    for entry in case.mock.iter_mut().flat_map(|script| script.entries.iter_mut()) {
        for call in &mut entry.tool_calls {
            rename(&mut call.name, root);
        }
    }
}

/// `script` as a case's `mock` key, in YAML: a block to append to a case file (what `keel test
/// --record` writes). Each reply is one line, a JSON object (YAML's flow style, so the text keeps
/// every character as the model wrote it); with briefs of compactions, `{script, compact}`.
pub fn mock_yaml(script: &MockScript) -> String {
    fn line(entry: &keel_core::MockEntry) -> String {
        let mut reply = serde_json::Map::new();
        if let Some(text) = &entry.text {
            reply.insert("text".into(), Value::String(text.clone()));
        }
        if !entry.tool_calls.is_empty() {
            let calls = entry
                .tool_calls
                .iter()
                .map(|call| serde_json::json!({ "name": call.name, "input": call.input }))
                .collect();
            reply.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(error) = &entry.error {
            reply.insert(
                "error".into(),
                serde_json::json!({ "status": error.status, "message": error.message }),
            );
        }
        if reply.is_empty() {
            // A reply with nothing in it is still a reply.
            reply.insert("text".into(), Value::String(String::new()));
        }
        Value::Object(reply).to_string()
    }
    let mut yaml = String::from("mock:\n");
    let indent = if script.compact.is_empty() { "  " } else { "    " };
    if !script.compact.is_empty() {
        yaml.push_str("  script:\n");
    }
    for entry in &script.entries {
        yaml.push_str(&format!("{indent}- {}\n", line(entry)));
    }
    if !script.compact.is_empty() {
        yaml.push_str("  compact:\n");
        for entry in &script.compact {
            yaml.push_str(&format!("{indent}- {}\n", line(entry)));
        }
    }
    yaml
}

fn load_case(
    file: &Path,
    tools: Option<&[String]>,
    tool_name: fn(&str) -> &str,
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<TestCase> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(error) => {
            diagnostics.push(Diagnostic::error(
                ErrorCode::SpecNotFound,
                file,
                Pos::default(),
                format!("cannot read the test case: {error}"),
            ));
            return None;
        }
    };
    let root = match tree::parse_yaml(&text, file) {
        Ok(root) => root,
        Err(diagnostic) => {
            diagnostics.push(diagnostic);
            return None;
        }
    };
    let errors_before = diagnostics.iter().filter(|d| d.is_error()).count();
    let mut d = Decoder { file: file.to_owned(), diagnostics };
    let case = decode_case(&root, file, tools, tool_name, &mut d);
    let failed = d.diagnostics.iter().filter(|d| d.is_error()).count() > errors_before;
    if failed { None } else { case }
}

fn decode_case(
    root: &Node,
    file: &Path,
    tools: Option<&[String]>,
    tool_name: fn(&str) -> &str,
    d: &mut Decoder<'_>,
) -> Option<TestCase> {
    if matches!(root.kind, Kind::Null) {
        d.error(root.pos, "the test case is empty").hint =
            Some("write at least `input: Hello` and an `expect:` section".into());
        return None;
    }
    let mut map = d.map(root, "the test case")?;
    let input = map.take("input").and_then(|node| d.text(node, "input"));
    let mut called = Vec::new();
    let mock = map.take("mock").and_then(|node| {
        // The agent's `mock.script` list, or the same `{ script: [...] }` mapping.
        let script = match &node.kind {
            Kind::Map(_) => crate::spec_file::mock(node, d),
            _ => crate::spec_file::mock_entries(node, d, "mock", &mut called)
                .map(|entries| (MockScript::new(entries), Vec::new())),
        };
        script.map(|(script, names)| {
            called.extend(names);
            script
        })
    });
    let now = map.take("now").and_then(|node| now(node, d));
    let state = map.take("state").and_then(|node| {
        d.map(node, "state")?;
        Some(node.to_json())
    });
    let approvals = map.take("approvals").map(|node| approvals(node, d)).unwrap_or_default();
    let answers = map
        .take("answers")
        .and_then(|node| d.string_list(node, "answers"))
        .map(|answers| answers.into_iter().map(|(answer, _)| answer).collect())
        .unwrap_or_default();
    let expect = map.take("expect").map(|node| expectations(node, d));
    let input_misspelled = map.misspelled("input", CASE_KEYS);
    map.finish(d, "", CASE_KEYS);
    if input.is_none() && crate::decode::map_lacks(root, "input") && !input_misspelled {
        d.error(root.pos, "the test case has no `input`").hint =
            Some("write the user's message: `input: What day is it?`".into());
    }
    let expect = expect.flatten().unwrap_or_default();
    if let Some(tools) = tools {
        let expected = expect.tool_calls.iter().flatten().map(|call| (call.name.clone(), call.pos));
        let decided = approvals.iter().map(|(name, _)| (name.clone(), root.pos));
        for (name, pos) in called.into_iter().chain(expected).chain(decided) {
            // A former name is checked as the name it now has (`rename_tools` renames it).
            if !tools.iter().any(|tool| tool == tool_name(&name)) {
                let known: Vec<&str> = tools.iter().map(String::as_str).collect();
                d.error(pos, format!("the test case names tool `{name}`, which the agent does not have"))
                    .hint = Some(match did_you_mean(&name, &known) {
                    Some(close) => format!("did you mean `{close}`?"),
                    None if known.is_empty() => "the agent has no tools".to_owned(),
                    None => format!("the agent's tools: {}", known.join(", ")),
                });
            }
        }
    }
    let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or("case").to_owned();
    Some(TestCase {
        name,
        file: file.to_owned(),
        input: input?,
        mock,
        now,
        state,
        approvals,
        answers,
        expect,
    })
}

/// `now`: an RFC 3339 time, read in the machine's zone, or with its zone in brackets (RFC 9557).
fn now(node: &Node, d: &mut Decoder<'_>) -> Option<jiff::ZonedDateTime> {
    let text = d.text(node, "now")?;
    if let Ok(zoned) = text.parse::<jiff::ZonedDateTime>() {
        return Some(zoned);
    }
    match text.parse::<jiff::Timestamp>() {
        Ok(instant) => Some(instant.to_zoned_datetime(jiff::tz::TimeZone::system())),
        Err(error) => {
            d.error(node.pos, format!("`now` is not a time ({error}): {text:?}")).hint = Some(
                "write an RFC 3339 time, `2026-03-02T09:00:00Z`, or one with its zone: `2026-03-02T09:00:00+01:00[Europe/Paris]`"
                    .into(),
            );
            None
        }
    }
}

/// `approvals: { convert: approve, delete_file: reject }` (or `{ reject: "why" }`).
fn approvals(node: &Node, d: &mut Decoder<'_>) -> Vec<(String, Verdict)> {
    let Some(mut map) = d.map(node, "approvals") else { return Vec::new() };
    let mut out = Vec::new();
    for (tool, _, value) in map.rest() {
        let what = format!("approvals.{tool}");
        let verdict = match &value.kind {
            Kind::Str(s) if s == "approve" => Some(Verdict::Approve),
            Kind::Str(s) if s == "reject" => Some(Verdict::Reject(None)),
            Kind::Map(entries) if entries.len() == 1 && entries[0].0 == "reject" => {
                d.string(&entries[0].2, &what).map(|reason| Verdict::Reject(Some(reason)))
            }
            _ => {
                d.error(
                    value.pos,
                    format!("`{what}` must be `approve`, `reject` or `{{ reject: <reason> }}`"),
                );
                None
            }
        };
        if let Some(verdict) = verdict {
            out.push((tool.to_owned(), verdict));
        }
    }
    out
}

fn expectations(node: &Node, d: &mut Decoder<'_>) -> Option<Expectations> {
    let mut map = d.map(node, "expect")?;
    let mut expect = Expectations::default();
    if let Some(node) = map.take("tool_calls") {
        let calls = d.list(node, "expect.tool_calls").unwrap_or_default();
        expect.tool_calls = Some(calls.iter().filter_map(|call| expected_call(call, d)).collect());
    }
    let mut texts = Vec::new();
    for key in ["text", "text_contains", "text_matches"] {
        if let Some(node) = map.take(key) {
            let what = format!("expect.{key}");
            let Some(text) = d.string(node, &what) else { continue };
            texts.push(node.pos);
            expect.text = Some(match key {
                "text" => TextMatch::Equals(text),
                "text_contains" => TextMatch::Contains(text),
                _ => match regex::Regex::new(&text) {
                    Ok(_) => TextMatch::Matches(text),
                    Err(error) => {
                        d.error(node.pos, format!("`{what}` is not a valid regular expression: {error}"));
                        continue;
                    }
                },
            });
        }
    }
    if texts.len() > 1 {
        d.error(texts[1], "give one of `text`, `text_contains` and `text_matches`, not several");
    }
    let error = map.take("error").and_then(|node| {
        let code = d.text(node, "expect.error")?;
        let found = ErrorCode::ALL.iter().find(|c| c.as_str() == code).copied();
        if found.is_none() {
            let known: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
            d.error(node.pos, format!("`expect.error`: unknown error code `{code}`")).hint =
                Some(match did_you_mean(&code, &known) {
                    Some(close) => format!("did you mean `{close}`?"),
                    None => "error codes are listed in docs/errors.md".to_owned(),
                });
        }
        found.map(|code| (code, node.pos))
    });
    if let Some(node) = map.take("stop") {
        let stop = d.text(node, "expect.stop");
        expect.stop = match stop.as_deref() {
            None => None,
            Some("failed") => Some(ExpectedStop::Failed(error.map(|(code, _)| code))),
            Some(name) => match StopReason::parse(name) {
                Some(reason) => Some(ExpectedStop::Stopped(reason)),
                None => {
                    let mut known: Vec<&str> = StopReason::ALL.iter().map(|r| r.as_str()).collect();
                    known.push("failed");
                    d.error(node.pos, format!("`expect.stop`: unknown stop `{name}`")).hint =
                        Some(match did_you_mean(name, &known) {
                            Some(close) => format!("did you mean `{close}`?"),
                            None => format!("write one of: {}", known.join(", ")),
                        });
                    None
                }
            },
        };
    }
    if let Some((code, pos)) = error
        && !matches!(expect.stop, Some(ExpectedStop::Failed(_)))
    {
        if map.key_pos("stop").is_none() {
            expect.stop = Some(ExpectedStop::Failed(Some(code)));
        } else {
            d.error(pos, "`expect.error` goes with `stop: failed`");
        }
    }
    if let Some(node) = map.take("state")
        && d.map(node, "expect.state").is_some()
    {
        expect.state = Some(node.to_json());
    }
    map.finish(d, "expect", EXPECT_KEYS);
    Some(expect)
}

fn expected_call(node: &Node, d: &mut Decoder<'_>) -> Option<ExpectedCall> {
    let what = "expect.tool_calls[]";
    // `- word_count` is a call of that tool, whatever its input.
    if let Kind::Str(_) = node.kind {
        let name = d.text(node, what)?;
        return Some(ExpectedCall { name, input: None, output: None, error: None, pos: node.pos });
    }
    let mut map = d.map(node, what)?;
    let has_name = map.key_pos("name").is_some();
    let name = map.take("name").and_then(|n| d.text(n, &format!("{what}.name")));
    let input = map.take("input").map(Node::to_json);
    let output = map.take("output").map(Node::to_json);
    let error = map.take("error").and_then(|n| d.boolean(n, &format!("{what}.error")));
    let name_misspelled = map.misspelled("name", CALL_KEYS);
    map.finish(d, what, CALL_KEYS);
    if !has_name && !name_misspelled {
        d.error(node.pos, format!("`{what}` needs `name`"));
    }
    Some(ExpectedCall { name: name?, input, output, error, pos: node.pos })
}
