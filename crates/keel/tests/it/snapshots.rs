//! Snapshot tests of what people read: the CLI's messages and the HTTP API's bodies, exactly,
//! with ids, paths, processes and times filtered out. A change to any of them shows up as a diff
//! to review (`cargo insta review`, or `INSTA_UPDATE=always` to accept).

use std::path::Path;
use std::process::Output;

use serde_json::{Value, json};

use crate::serve::{Served, client, sqlite};
use crate::support::agent_dir;

const AGENT: &str = "model: mock
approvals: { tools: [convert] }
mock:
  script:
    - tool_calls: [{ name: convert, input: { km: 10 } }]
    - text: '10 km is {{last_tool_output}}.'
";

const CONVERT_TOML: &str =
    "description = \"Converts kilometres to miles\"\ncommand = [\"sh\", \"-c\", \"echo 6.2 miles\"]\n";

fn agent() -> tempfile::TempDir {
    agent_dir(&[("agent.yaml", AGENT), ("tools/convert.toml", CONVERT_TOML)])
}

fn keel(dir: &Path, args: &[&str]) -> Output {
    crate::support::keel_on_store(dir, args).output().unwrap()
}

/// What a person sees of a command: its exit code, stdout and stderr, with this test's paths
/// replaced.
fn screen(dir: &Path, output: &Output) -> String {
    let text = format!(
        "exit: {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    text.replace(&dir.display().to_string(), "[DIR]")
}

/// Ids, processes, hosts and times vary from run to run; their shape does not.
fn settings() -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    for (pattern, replacement) in [
        (r"run_[0-9a-f]{32}", "[RUN]"),
        (r"ap_[0-9a-f]{16}", "[APPROVAL]"),
        (r"qu_[0-9a-f]{16}", "[QUESTION]"),
        (r"pid \d+", "pid [PID]"),
        (r"keel process \d+", "keel process [PID]"),
        (r"host [A-Za-z0-9._-]+", "host [HOST]"),
        (r"\d+ (s|min|h|days) ago", "[WHEN] ago"),
        (r"in \d+ (s|min|h|days)", "in [WHEN]"),
        (r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", "[TIME]"),
        (r#""(createdAtMs|expiresAtMs)": \d+"#, r#""$1": "[MS]""#),
    ] {
        settings.add_filter(pattern, replacement);
    }
    settings
}

#[test]
fn the_cli_says_what_waits_who_decided_and_what_is_busy() {
    let dir = agent();
    let dir = dir.path();
    let agent = dir.to_str().unwrap();
    let paused = keel(dir, &["run", agent, "convert 10 km", "--session", "s"]);
    let listed = keel(dir, &["approvals", "list"]);
    let busy = keel(dir, &["run", agent, "and another thing", "--session", "s"]);
    let id = String::from_utf8_lossy(&listed.stdout).split_whitespace().next().unwrap().to_owned();
    let approved = keel(dir, &["approvals", "approve", &id]);
    let again = keel(dir, &["approvals", "reject", &id, "--note", "too late"]);
    let resumed = keel(dir, &["run", agent, "--session", "s"]);
    let nothing = keel(dir, &["cancel", "s"]);
    settings().bind(|| {
        insta::assert_snapshot!("run_paused", screen(dir, &paused));
        insta::assert_snapshot!("approvals_list", screen(dir, &listed));
        insta::assert_snapshot!("run_busy", screen(dir, &busy));
        insta::assert_snapshot!("approve", screen(dir, &approved));
        insta::assert_snapshot!("decided_twice", screen(dir, &again));
        insta::assert_snapshot!("run_resumed", screen(dir, &resumed));
        insta::assert_snapshot!("cancel_nothing", screen(dir, &nothing));
    });
    // A paused run, cancelled with nobody driving it.
    keel(dir, &["run", agent, "once more", "--session", "t"]);
    let cancelled = keel(dir, &["cancel", "t"]);
    settings().bind(|| insta::assert_snapshot!("cancel_paused", screen(dir, &cancelled)));
}

async fn body(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn http_bodies_keep_their_shape() {
    let dir = agent();
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let http = client();
    let paused = http
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "s", "input": "convert 10 km"}))
        .send()
        .await
        .unwrap();
    paused.text().await.unwrap();
    let transcript = body(http.get(server.url("/chat/s")).send().await.unwrap()).await;
    let busy = body(
        http.post(server.url("/chat"))
            .json(&json!({"sessionId": "s", "input": "more"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let unknown = body(http.get(server.url("/chat/nobody")).send().await.unwrap()).await;
    let not_pending = body(
        http.post(server.url("/chat/s/approvals/ap_0000000000000000"))
            .json(&json!({"approved": true}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let cancelled = body(http.delete(server.url("/chat/s/run")).send().await.unwrap()).await;
    let nothing = body(http.delete(server.url("/chat/s/run")).send().await.unwrap()).await;
    settings().bind(|| {
        insta::assert_json_snapshot!("http_transcript_paused", transcript);
        insta::assert_json_snapshot!("http_busy", busy);
        insta::assert_json_snapshot!("http_unknown_session", unknown);
        insta::assert_json_snapshot!("http_not_pending", not_pending);
        insta::assert_json_snapshot!("http_cancelled", cancelled);
        insta::assert_json_snapshot!("http_nothing_to_cancel", nothing);
    });
}
