//! docs/tutorial.md, run as written: every `sh` block of it, in order, by `bash -e` in one
//! empty directory with `keel` on the `PATH`; a `text` block after commands is what they must
//! print (each of its lines is found in their output). A block's info string may say
//! `exit=N` (the exit code it ends with) or `background ready="..."` (a server the reader
//! starts in a second terminal: run in the background until it prints that, stopped at the
//! end). The last step's real model is a local server speaking OpenAI's wire format, reached
//! through `OPENAI_BASE_URL` as any OpenAI-compatible server would be.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel_testkit::{Recorded, Reply, WireServer};
use serde_json::{Value, json};

use crate::support::{repo_root, served_keel_binary};

/// One fenced `sh` block, and the `text` block after it.
#[derive(Debug)]
struct Step {
    script: String,
    exit: i32,
    /// `Some(marker)`: run in the background until its output shows `marker`.
    background: Option<String>,
    expected: Vec<String>,
    line: usize,
}

/// The `sh` blocks of `markdown`, each with the `text` block that follows it (if any).
fn steps(markdown: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut lines = markdown.lines().enumerate();
    while let Some((number, line)) = lines.next() {
        let Some(info) = line.strip_prefix("```") else { continue };
        let body: Vec<&str> = lines.by_ref().map(|(_, l)| l).take_while(|l| !l.starts_with("```")).collect();
        let mut words = info.split_whitespace();
        match words.next() {
            Some("sh") => {
                let mut step = Step {
                    script: body.join("\n") + "\n",
                    exit: 0,
                    background: None,
                    expected: Vec::new(),
                    line: number + 1,
                };
                let attributes = info["sh".len()..].trim();
                if let Some(exit) = attributes.strip_prefix("exit=") {
                    step.exit = exit.parse().expect("an exit code");
                } else if let Some(ready) = attributes.strip_prefix("background ready=") {
                    step.background = Some(ready.trim_matches('"').to_owned());
                } else {
                    assert!(
                        attributes.is_empty(),
                        "line {}: unknown block attributes {attributes:?}",
                        number + 1
                    );
                }
                steps.push(step);
            }
            Some("text") => {
                let step = steps.last_mut().expect("a text block after commands");
                step.expected =
                    body.iter().filter(|l| !l.trim().is_empty()).map(|l| (*l).to_owned()).collect();
            }
            _ => {}
        }
    }
    steps
}

/// A model that calls `word_count` on the text after "in:" of the user's last message, then
/// answers with the count the tool gave.
async fn word_counting_model() -> WireServer {
    WireServer::responding(|request: &Recorded| {
        let body = request.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let last = messages.last().cloned().unwrap_or(Value::Null);
        let delta = if last["role"] == "tool" {
            json!({ "role": "assistant", "content": format!("That sentence has {} words.", last["content"].as_str().unwrap_or("?")) })
        } else {
            let said = last["content"].as_str().unwrap_or_default();
            let text = said.split_once("in:").map_or(said, |(_, text)| text).trim().trim_end_matches('?');
            let arguments = json!({ "text": text }).to_string();
            json!({ "role": "assistant", "tool_calls": [{
                "index": 0, "id": "call_real_1", "type": "function",
                "function": { "name": "word_count", "arguments": arguments },
            }] })
        };
        let finish = if delta.get("tool_calls").is_some() { "tool_calls" } else { "stop" };
        let chunk = json!({
            "id": "chatcmpl-tutorial", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        let usage = json!({
            "id": "chatcmpl-tutorial", "object": "chat.completion.chunk", "model": "gpt-4o-mini", "choices": [],
            "usage": { "prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48 },
        });
        Reply::sse(format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n"))
    })
    .await
}

fn shell(step: &Step, dir: &std::path::Path, path: &str, base_url: &str) -> Command {
    let mut command = Command::new("bash");
    command
        .args(["-e", "-c", &step.script])
        .current_dir(dir)
        .env("PATH", path)
        .env("OPENAI_BASE_URL", base_url)
        .env_remove("OPENAI_API_KEY")
        .env_remove("KEEL_STORE")
        .env_remove("KEEL_LOG")
        .env_remove("KEEL_FAULT")
        .stdin(Stdio::null());
    command
}

/// Stops a background step (its whole process group) when dropped.
struct Background(Child);

impl Drop for Background {
    fn drop(&mut self) {
        let group = i32::try_from(self.0.id()).unwrap();
        let _ = Command::new("kill").args(["-INT", "--", &format!("-{group}")]).status();
        let deadline = Instant::now() + Duration::from_secs(12);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tutorial_runs_as_written() {
    let tutorial = std::fs::read_to_string(repo_root().join("docs/tutorial.md")).unwrap();
    let steps = steps(&tutorial);
    assert!(steps.len() >= 8, "the tutorial's steps: {steps:#?}");
    let model = word_counting_model().await;
    let base_url = format!("{}/v1", model.url());

    let dir = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(served_keel_binary(), bin.path().join("keel")).unwrap();
    let path = format!("{}:{}", bin.path().display(), std::env::var("PATH").unwrap_or_default());
    let mut servers = Vec::new();
    for step in &steps {
        let mut command = shell(step, dir.path(), &path, &base_url);
        let said = if let Some(ready) = &step.background {
            let log = dir.path().join(format!("background-{}.log", step.line));
            let file = std::fs::File::create(&log).unwrap();
            command.stdout(file.try_clone().unwrap()).stderr(file).process_group(0);
            servers.push(Background(command.spawn().unwrap()));
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                if said.contains(ready.as_str()) {
                    break said;
                }
                assert!(Instant::now() < deadline, "line {}: never printed {ready:?}:\n{said}", step.line);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        } else {
            let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
            let (mut out, mut err) = (String::new(), String::new());
            let mut stdout = child.stdout.take().unwrap();
            let mut stderr = child.stderr.take().unwrap();
            let reading = std::thread::spawn(move || {
                let mut text = String::new();
                stderr.read_to_string(&mut text).unwrap();
                text
            });
            let waited = tokio::task::spawn_blocking(move || {
                stdout.read_to_string(&mut out).unwrap();
                (child.wait().unwrap(), out)
            });
            let (status, out) = tokio::time::timeout(Duration::from_secs(120), waited)
                .await
                .unwrap_or_else(|_| panic!("line {}: still running after two minutes", step.line))
                .unwrap();
            err.push_str(&reading.join().unwrap());
            assert_eq!(
                status.code(),
                Some(step.exit),
                "line {}: `{}` ended with {status}\nstdout:\n{out}\nstderr:\n{err}",
                step.line,
                step.script.trim()
            );
            format!("{out}{err}")
        };
        for expected in &step.expected {
            assert!(
                said.contains(expected.as_str()),
                "line {}: the output lacks {expected:?}:\n{said}",
                step.line
            );
        }
    }
    drop(servers);

    // The last step ran on the model: offered the agent's tools, it called one and was given
    // its output.
    let requests: Vec<Value> = model.requests().iter().map(Recorded::json).collect();
    assert_eq!(requests.len(), 2, "{requests:#?}");
    let offered: Vec<&str> = requests[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert!(offered.contains(&"word_count") && offered.contains(&"save_note"), "{offered:?}");
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!((last["role"].as_str(), last["content"].as_str()), (Some("tool"), Some("6")), "{last}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("words/notes.txt")).unwrap(),
        "buy milk and eggs\nbuy milk and eggs\n",
        "one note saved from the terminal, one over HTTP"
    );
}
