//! Channels through the real binary, signed by the vendors' own libraries (installed from PyPI
//! and npm by `scripts/webhook-peers.sh`): GitHub (@octokit/webhooks-methods), Slack
//! (slack_sdk), Discord (PyNaCl, checked by discord-interactions) and Standard Webhooks
//! (standardwebhooks). Genuine deliveries start one run each, even delivered twice; forged,
//! re-encoded, truncated, stale and future-dated ones are refused before anything is parsed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::serve::{Served, client};
use crate::support::{agent_dir, repo_root, served_keel_binary};

/// Where `scripts/webhook-peers.sh` installed the signing libraries.
fn peers() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let output = Command::new(repo_root().join("scripts/webhook-peers.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("scripts/webhook-peers.sh runs");
        assert!(
            output.status.success(),
            "scripts/webhook-peers.sh failed: the channel tests need python3 -m venv and npm"
        );
        let dir = PathBuf::from(String::from_utf8(output.stdout).unwrap().trim());
        // ESM resolves packages next to the script: it runs from the npm directory.
        std::fs::copy(repo_root().join("tests/peers/github_sign.mjs"), dir.join("npm/github_sign.mjs"))
            .unwrap();
        dir
    })
}

/// Headers for `body`, made by the vendor's library (`timestamp` defaults to now).
fn sign(
    provider: &str,
    secret: &str,
    body: &[u8],
    timestamp: Option<i64>,
    id: &str,
) -> Vec<(String, String)> {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), body).unwrap();
    let output = if provider == "github" {
        Command::new("node")
            .current_dir(peers().join("npm"))
            .args(["github_sign.mjs", secret, file.path().to_str().unwrap()])
            .output()
            .unwrap()
    } else {
        let timestamp = timestamp.map(|t| t.to_string()).unwrap_or_default();
        Command::new(peers().join("venv/bin/python"))
            .arg(repo_root().join("tests/peers/webhook_sign.py"))
            .args([provider, secret, file.path().to_str().unwrap(), &timestamp, id])
            .output()
            .unwrap()
    };
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let headers: Value = serde_json::from_slice(&output.stdout).unwrap();
    headers.as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect()
}

fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const HOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// RFC 8032 section 7.1, test 1: the seed; its public key is the channel's.
const DISCORD_SEED: &str = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
const DISCORD_PUBLIC: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";

fn agent(mock_delay_ms: u64) -> tempfile::TempDir {
    agent_dir(&[
        (
            "agent.yaml",
            &format!("model: mock\nmock:\n  script:\n    - {{ text: handled, delay_ms: {mock_delay_ms} }}\n"),
        ),
        (
            "channels/gh.yaml",
            "type: github\nsecret_env: GH_SECRET\nevents: [issues.opened, issue_comment]\ninput: \"Issue #{{payload.issue.number}}: {{payload.issue.title}} (by {{sender}})\"\nsession: \"gh-{{payload.issue.number}}\"\n",
        ),
        (
            "channels/slack.yaml",
            "type: slack\nsecret_env: SLACK_SECRET\nsession: \"slack-{{payload.event.channel}}\"\n",
        ),
        ("channels/discord.yaml", "type: discord\nsecret_env: DISCORD_KEY\n"),
        (
            "channels/hooks.yaml",
            "type: webhook\nsecret_env: HOOK_SECRET\nevents: [invoice.paid]\ninput: \"Paid: {{payload.data.amount}}\"\n",
        ),
        (
            "channels/mail.yaml",
            "type: email\nsecret_env: HOOK_SECRET\nto: [support@keel.example]\nauthserv_id: mx.keel.example\nsession: \"mail-{{payload.subject}}\"\n",
        ),
    ])
}

fn serve(dir: &Path) -> Served {
    Served::start(
        dir,
        "memory",
        &[
            ("GH_SECRET", GITHUB_SECRET),
            ("SLACK_SECRET", SLACK_SECRET),
            ("DISCORD_KEY", DISCORD_PUBLIC),
            ("HOOK_SECRET", HOOK_SECRET),
        ],
    )
}

async fn post(served: &Served, channel: &str, body: &[u8], headers: &[(String, String)]) -> (u16, Value) {
    let mut request = client().post(served.url(&format!("/channels/{channel}"))).body(body.to_vec());
    for (name, value) in headers {
        if !name.starts_with('_') {
            request = request.header(name, value);
        }
    }
    let response = request.header("content-type", "application/json").send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// The transcript of `session` once its run answered (30 s at most).
async fn answered(served: &Served, session: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let transcript: Value =
            client().get(served.url(&format!("/chat/{session}"))).send().await.unwrap().json().await.unwrap();
        if transcript["messages"].as_array().is_some_and(|m| m.len() >= 2) || Instant::now() > deadline {
            return transcript;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn with(mut headers: Vec<(String, String)>, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    headers.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    headers
}

#[tokio::test(flavor = "multi_thread")]
async fn github_deliveries_signed_by_octokit_run_once_and_forgeries_are_refused() {
    let dir = agent(0);
    let served = serve(dir.path());
    let body = serde_json::to_vec(&json!({
        "action": "opened",
        "issue": {"number": 42, "title": "Crash on start"},
        "sender": {"login": "octocat"},
    }))
    .unwrap();
    let signed = sign("github", GITHUB_SECRET, &body, None, "");
    let headers = with(signed.clone(), &[("X-GitHub-Event", "issues"), ("X-GitHub-Delivery", "d-1")]);
    let (status, answer) = post(&served, "gh", &body, &headers).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["claimed"], true);
    let transcript = answered(&served, "gh-42").await;
    assert_eq!(transcript["messages"][0]["content"][0]["text"], "Issue #42: Crash on start (by octocat)");
    assert_eq!(transcript["messages"][1]["content"][0]["text"], "handled");
    // Delivered again (GitHub redelivers): acknowledged, not run again.
    let (status, again) = post(&served, "gh", &body, &headers).await;
    assert_eq!((status, &again["duplicate"]), (200, &json!(true)), "{again}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(answered(&served, "gh-42").await["messages"].as_array().unwrap().len(), 2);

    // `ping` is answered; an event the channel does not take is declined.
    let ping = with(signed.clone(), &[("X-GitHub-Event", "ping"), ("X-GitHub-Delivery", "d-2")]);
    assert_eq!(post(&served, "gh", &body, &ping).await.0, 200);
    let star = with(signed.clone(), &[("X-GitHub-Event", "star"), ("X-GitHub-Delivery", "d-3")]);
    assert_eq!(post(&served, "gh", &body, &star).await.0, 204);

    // Forged: the same JSON re-encoded, cut short, another secret, no signature.
    let reencoded = serde_json::to_vec_pretty(&serde_json::from_slice::<Value>(&body).unwrap()).unwrap();
    let other_secret = sign("github", "not the secret", &body, None, "");
    let events = [("X-GitHub-Event", "issues"), ("X-GitHub-Delivery", "d-4")];
    for (what, bad_body, bad_headers) in [
        ("re-encoded", reencoded.as_slice(), with(signed.clone(), &events)),
        ("truncated", &body[..body.len() - 1], with(signed.clone(), &events)),
        ("another secret", body.as_slice(), with(other_secret, &events)),
        ("unsigned", body.as_slice(), with(Vec::new(), &events)),
    ] {
        let (status, refused) = post(&served, "gh", bad_body, &bad_headers).await;
        assert_eq!(status, 401, "{what}: {refused}");
        assert_eq!(refused["error"]["code"], "KEEL_SIGNATURE_INVALID", "{what}");
    }
    let (_, unsigned) = post(&served, "gh", &body, &with(Vec::new(), &events)).await;
    assert!(unsigned["error"]["message"].as_str().unwrap().contains("x-hub-signature-256"), "{unsigned}");
    // Nothing forged ran: the only session is gh-42.
    assert_eq!(client().get(served.url("/chat/gh-0")).send().await.unwrap().status(), 404);
    let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for (outcome, count) in
        [("claimed", 1), ("duplicate", 1), ("handshake", 1), ("declined", 1), ("bad_signature", 5)]
    {
        let line = format!("keel_channel_deliveries_total{{channel=\"gh\",outcome=\"{outcome}\"}} {count}");
        assert!(metrics.contains(&line), "{line} not in:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn slack_events_signed_by_slack_sdk_run_and_stale_or_future_ones_do_not() {
    let dir = agent(1500);
    let served = serve(dir.path());
    let challenge = serde_json::to_vec(&json!({"type": "url_verification", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"})).unwrap();
    let (status, answer) =
        post(&served, "slack", &challenge, &sign("slack", SLACK_SECRET, &challenge, None, "")).await;
    assert_eq!(
        (status, answer["challenge"].as_str()),
        (200, Some("3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"))
    );

    let event = |id: &str| {
        serde_json::to_vec(&json!({
            "type": "event_callback", "event_id": id,
            "event": {"type": "app_mention", "user": "U2CERLKJA", "channel": "C1", "text": "<@bot> status?"},
        }))
        .unwrap()
    };
    let first = event("Ev1");
    let (status, answer) =
        post(&served, "slack", &first, &sign("slack", SLACK_SECRET, &first, None, "")).await;
    assert_eq!(status, 200, "{answer}");
    // The session is busy with that run (1.5 s): another event for it is answered at once,
    // not queued, and counted.
    let second = event("Ev2");
    let (status, busy) =
        post(&served, "slack", &second, &sign("slack", SLACK_SECRET, &second, None, "")).await;
    assert_eq!(status, 409, "{busy}");
    assert_eq!(busy["error"]["code"], "KEEL_SESSION_BUSY");
    let transcript = answered(&served, "slack-C1").await;
    assert!(
        transcript["messages"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("app_mention from U2CERLKJA")
    );

    // Signed by slack_sdk, but five minutes and more away from now, either way.
    for (what, at) in [("stale", now() - 360), ("future", now() + 360)] {
        let body = event(what);
        let (status, refused) =
            post(&served, "slack", &body, &sign("slack", SLACK_SECRET, &body, Some(at), "")).await;
        assert_eq!(status, 401, "{what}: {refused}");
        assert!(refused["error"]["message"].as_str().unwrap().contains("5 minutes"), "{refused}");
    }
    let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("keel_channel_deliveries_total{channel=\"slack\",outcome=\"busy\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn discord_interactions_signed_with_ed25519_and_standard_webhooks_are_verified() {
    let dir = agent(0);
    let served = serve(dir.path());
    let ping = br#"{"type":1}"#;
    let signed = sign("discord", DISCORD_SEED, ping, None, "");
    assert!(signed.iter().any(|(k, v)| k == "_public_key" && v == DISCORD_PUBLIC));
    let (status, pong) = post(&served, "discord", ping, &signed).await;
    assert_eq!((status, pong), (200, json!({"type": 1})));
    let command = serde_json::to_vec(&json!({
        "type": 2, "id": "1105", "data": {"name": "ask"}, "member": {"user": {"id": "80351110224678912"}},
    }))
    .unwrap();
    let (status, answer) =
        post(&served, "discord", &command, &sign("discord", DISCORD_SEED, &command, None, "")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["type"], 4);
    answered(&served, "discord-80351110224678912").await;
    // One byte changed after signing.
    let mut tampered = command.clone();
    let last = tampered.len() - 2;
    tampered[last] = b'0';
    let (status, _) =
        post(&served, "discord", &tampered, &sign("discord", DISCORD_SEED, &command, None, "")).await;
    assert_eq!(status, 401);

    let paid = serde_json::to_vec(&json!({"type": "invoice.paid", "data": {"amount": 1250}})).unwrap();
    let signed = sign("standard", HOOK_SECRET, &paid, None, "msg_1");
    let (status, answer) = post(&served, "hooks", &paid, &signed).await;
    assert_eq!(status, 200, "{answer}");
    let (status, again) = post(&served, "hooks", &paid, &signed).await;
    assert_eq!((status, &again["duplicate"]), (200, &json!(true)));
    let stale = sign("standard", HOOK_SECRET, &paid, Some(now() - 600), "msg_2");
    assert_eq!(post(&served, "hooks", &paid, &stale).await.0, 401);
    let refunded = serde_json::to_vec(&json!({"type": "invoice.refunded"})).unwrap();
    let signed = sign("standard", HOOK_SECRET, &refunded, None, "msg_3");
    assert_eq!(post(&served, "hooks", &refunded, &signed).await.0, 204);
    // Over the size limit: refused from the declared length, before anything is read.
    let answer = crate::serve::post_declaring(&served, "/channels/hooks", 1024 * 1024 + 1).await;
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("KEEL_BODY_TOO_LARGE"), "{answer}");
    assert_eq!(post(&served, "nowhere", &paid, &[]).await.0, 404);
}

/// A raw message from `from`, with the receiving server's `Authentication-Results`.
fn email(from: &str, to: &str, auth_results: &str, message_id: &str) -> Vec<u8> {
    format!(
        "Received: from mail.example.com by mx.keel.example\r\nAuthentication-Results: {auth_results}\r\nFrom: {from}\r\nTo: {to}\r\nSubject: Late order\r\nMessage-ID: <{message_id}>\r\n\r\nWhere is order 7?\r\n"
    )
    .into_bytes()
}

async fn send_email(served: &Served, raw: Vec<u8>, id: &str) -> (u16, Value) {
    let headers = sign("standard", HOOK_SECRET, &raw, None, id);
    let mut request = client().post(served.url("/channels/mail")).body(raw);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let response = request.header("content-type", "message/rfc822").send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json::<Value>().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn email_passes_the_gate_only_when_its_server_vouches_for_the_from_domain() {
    let dir = agent(0);
    let served = serve(dir.path());
    let aligned = email(
        "Ann <ann@example.com>",
        "support@keel.example",
        "mx.keel.example; spf=pass smtp.mailfrom=ann@example.com; dkim=pass header.d=example.com",
        "m1@example.com",
    );
    let (status, answer) = send_email(&served, aligned.clone(), "mail_1").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["claimed"], true);
    let transcript = answered(&served, "mail-Late-order").await;
    let input = transcript["messages"][0]["content"][0]["text"].as_str().unwrap();
    assert!(
        input.starts_with("Email from ann@example.com: Late order") && input.contains("Where is order 7?"),
        "{input}"
    );
    // The same message again (the relay retried): not run twice.
    let (status, again) = send_email(&served, aligned, "mail_2").await;
    assert_eq!((status, &again["duplicate"]), (200, &json!(true)));
    // Forged: a pass for a subdomain, and a pass written by another server than the trusted one.
    for (what, auth) in [
        ("subdomain", "mx.keel.example; dkim=pass header.d=mail.example.com"),
        ("another server", "evil.test; dmarc=pass header.from=example.com"),
    ] {
        let raw = email("Ann <ann@example.com>", "support@keel.example", auth, "m2@example.com");
        let (status, bounced) = send_email(&served, raw, "mail_3").await;
        assert_eq!(status, 200, "{what}");
        assert_eq!(
            bounced,
            json!({"action": "bounce", "reason": "550 5.7.1 Message not accepted"}),
            "{what}"
        );
    }
    // Not for us: dropped.
    let other = email(
        "Ann <ann@example.com>",
        "sales@keel.example",
        "mx.keel.example; dmarc=pass header.from=example.com",
        "m3@example.com",
    );
    assert_eq!(send_email(&served, other, "mail_4").await.0, 204);
    let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for line in [
        "keel_channel_deliveries_total{channel=\"mail\",outcome=\"bounced\"} 2",
        "keel_channel_deliveries_total{channel=\"mail\",outcome=\"dropped\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}");
    }
}

#[test]
fn a_channel_whose_secret_is_not_set_stops_keel_serve_naming_the_variable() {
    let dir = agent(0);
    let output = Command::new(served_keel_binary())
        .args(["serve", dir.path().to_str().unwrap(), "--port", "0", "--store", "memory"])
        .env("GH_SECRET", GITHUB_SECRET)
        .env("DISCORD_KEY", DISCORD_PUBLIC)
        .env("HOOK_SECRET", HOOK_SECRET)
        .env("KEEL_LOG", "error")
        .env_remove("SLACK_SECRET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("SLACK_SECRET") && stderr.contains("not set"), "{stderr}");
    assert!(!stderr.contains("http://"), "it listened before refusing: {stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn final_answers_are_posted_back_to_github_slack_and_discord() {
    let fake = keel_testkit::WireServer::start(
        (0..3).map(|_| keel_testkit::Reply::json(201, &json!({"ok": true}))).collect(),
    )
    .await;
    let base = fake.url();
    let dir = agent_dir(&[
        ("agent.yaml", "model: mock\nmock:\n  script:\n    - { text: handled }\n"),
        (
            "channels/gh.yaml",
            &format!(
                "type: github\nsecret_env: GH_SECRET\nreply: {{ base_url: \"{base}\", token_env: GH_TOKEN }}\n"
            ),
        ),
        (
            "channels/slack.yaml",
            &format!(
                "type: slack\nsecret_env: SLACK_SECRET\nreply: {{ base_url: \"{base}\", token_env: SLACK_BOT_TOKEN }}\n"
            ),
        ),
        (
            "channels/discord.yaml",
            &format!("type: discord\nsecret_env: DISCORD_KEY\nreply: {{ base_url: \"{base}\" }}\n"),
        ),
    ]);
    let served = Served::start(
        dir.path(),
        "memory",
        &[
            ("GH_SECRET", GITHUB_SECRET),
            ("SLACK_SECRET", SLACK_SECRET),
            ("DISCORD_KEY", DISCORD_PUBLIC),
            ("GH_TOKEN", "gh-token"),
            ("SLACK_BOT_TOKEN", "xoxb-token"),
        ],
    );
    let issue = serde_json::to_vec(&json!({
        "action": "opened", "issue": {"number": 42, "title": "t"}, "repository": {"full_name": "acme/app"},
        "sender": {"login": "octocat"},
    }))
    .unwrap();
    let headers = with(
        sign("github", GITHUB_SECRET, &issue, None, ""),
        &[("X-GitHub-Event", "issues"), ("X-GitHub-Delivery", "r-1")],
    );
    assert_eq!(post(&served, "gh", &issue, &headers).await.0, 200);
    let mention = serde_json::to_vec(&json!({
        "type": "event_callback", "event_id": "EvR",
        "event": {"type": "app_mention", "user": "U1", "channel": "C1", "ts": "123.4", "text": "hi"},
    }))
    .unwrap();
    assert_eq!(
        post(&served, "slack", &mention, &sign("slack", SLACK_SECRET, &mention, None, "")).await.0,
        200
    );
    let command = serde_json::to_vec(&json!({
        "type": 2, "id": "r2", "application_id": "app1", "token": "tok1", "user": {"id": "u9"}, "data": {"name": "ask"},
    }))
    .unwrap();
    assert_eq!(
        post(&served, "discord", &command, &sign("discord", DISCORD_SEED, &command, None, "")).await.0,
        200
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while fake.requests().len() < 3 {
        assert!(Instant::now() < deadline, "replies posted: {:?}", fake.requests());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut requests = fake.requests();
    requests.sort_by(|a, b| a.path.cmp(&b.path));
    let github = &requests[2];
    assert_eq!(
        (github.method.as_str(), github.path.as_str()),
        ("POST", "/repos/acme/app/issues/42/comments")
    );
    assert_eq!(github.header("authorization"), Some("Bearer gh-token"));
    assert_eq!(github.json(), json!({"body": "handled"}));
    let slack = &requests[0];
    assert_eq!(slack.path, "/api/chat.postMessage");
    assert_eq!(slack.header("authorization"), Some("Bearer xoxb-token"));
    assert_eq!(slack.json(), json!({"channel": "C1", "text": "handled", "thread_ts": "123.4"}));
    let discord = &requests[1];
    assert_eq!(discord.path, "/api/v10/webhooks/app1/tok1");
    assert_eq!(discord.header("authorization"), None);
    assert_eq!(discord.json(), json!({"content": "handled"}));
    let metrics = client().get(served.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("keel_channel_replies_total{channel=\"gh\",outcome=\"sent\"} 1"), "{metrics}");
}
