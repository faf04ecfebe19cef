//! `POST /channels/:name`: inbound webhooks from Slack, GitHub, Discord and Standard Webhooks
//! senders, each turned into a run (DESIGN.md §8).
//!
//! The order is the point: the body is read raw (at most 1 MB), its signature is checked with
//! the platform's scheme over those exact bytes (constant-time comparisons; a timestamp outside
//! five minutes, either way, is refused), and only then is anything parsed. A forged, replayed,
//! stale, re-encoded or truncated body is a `401` that parsed nothing. A verified delivery is
//! then answered at once: a platform handshake (Slack's `url_verification`, GitHub's `ping`,
//! Discord's `PING`), `204` when the channel does not take its event type, `200` when a run was
//! started for it (the run goes on in the background), `200` again for a delivery id seen
//! before (its run id is derived from it, so the store knows), and `409` when its session is
//! busy (nothing is stored: the platform may deliver it again; the drop is logged and counted).
//!
//! These routes carry their own signatures: they bypass the bearer token and nothing else.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use aws_lc_rs::{hmac, signature};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use keel_core::channel::{ChannelDef, ChannelKind, render};
use keel_core::ids::stable_hash;
use keel_core::{AgentDef, ErrorCode, Message, RunId, SessionId};
use serde_json::{Value, json};

use crate::AppState;
use crate::error::ApiError;

/// How far a signed timestamp may be from now, either way.
const WINDOW_SECS: i64 = 300;

/// A channel with its secret, ready to verify deliveries.
pub(crate) struct Channel {
    def: ChannelDef,
    key: Key,
    reply: Option<ReplyTarget>,
}

/// Where a channel's final answers go, with the token read at start-up.
struct ReplyTarget {
    base_url: String,
    token: Option<String>,
    http: reqwest::Client,
}

enum Key {
    Hmac(Box<hmac::Key>),
    Ed25519(Vec<u8>),
}

/// The channels of `agent`, with their secrets read from the environment: an error naming the
/// variable that is not set (or holds no usable key).
pub(crate) fn load(agent: &AgentDef) -> Result<Vec<Channel>, String> {
    let mut channels = Vec::new();
    for def in &agent.channels {
        let secret = std::env::var(&def.secret_env).unwrap_or_default();
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(format!(
                "channel `{}` reads its secret from {}, which is not set; set it to the {}",
                def.name,
                def.secret_env,
                match def.kind {
                    ChannelKind::Discord =>
                        "application's public key (hex, from the Discord developer portal)",
                    ChannelKind::Slack => "app's signing secret",
                    ChannelKind::Github => "webhook's secret",
                    ChannelKind::Webhook | ChannelKind::Email => "endpoint's secret (`whsec_...`)",
                }
            ));
        }
        let key = match def.kind {
            ChannelKind::Slack | ChannelKind::Github => {
                Key::Hmac(Box::new(hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes())))
            }
            ChannelKind::Webhook | ChannelKind::Email => {
                let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
                let bytes = base64::engine::general_purpose::STANDARD.decode(encoded).map_err(|_| {
                    format!("{} is not a Standard Webhooks secret (`whsec_` then base64)", def.secret_env)
                })?;
                Key::Hmac(Box::new(hmac::Key::new(hmac::HMAC_SHA256, &bytes)))
            }
            ChannelKind::Discord => match hex::decode(secret) {
                Ok(bytes) if bytes.len() == 32 => Key::Ed25519(bytes),
                _ => return Err(format!("{} is not an Ed25519 public key (64 hex digits)", def.secret_env)),
            },
        };
        let reply = match &def.reply {
            None => None,
            Some(reply) => {
                let token = match &reply.token_env {
                    None => None,
                    Some(variable) => match std::env::var(variable) {
                        Ok(token) if !token.trim().is_empty() => Some(token.trim().to_owned()),
                        _ => {
                            return Err(format!(
                                "channel `{}` replies with the token in {variable}, which is not set",
                                def.name
                            ));
                        }
                    },
                };
                let http = reqwest::Client::builder()
                    .timeout(std::time::Duration::from_secs(30))
                    .user_agent("keel")
                    .build()
                    .map_err(|error| {
                        format!("channel `{}`: no HTTP client for replies: {error}", def.name)
                    })?;
                Some(ReplyTarget { base_url: reply.base_url.clone(), token, http })
            }
        };
        channels.push(Channel { def: def.clone(), key, reply });
    }
    Ok(channels)
}

/// What a verified delivery is about.
struct Delivery {
    /// The event type (`issues.opened`, `app_mention`, `application_command`...).
    event: String,
    /// The platform's id of the delivery (dedupe key).
    id: String,
    /// Who sent it, as the signed payload says.
    sender: String,
    payload: Value,
}

/// `POST /channels/:name`.
pub(crate) async fn deliver(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let Some(channel) = state.channels.iter().find(|c| c.def.name == name) else {
        return ApiError::new(ErrorCode::ChannelNotFound, format!("no channel {name:?}")).into_response();
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A declared length over the limit is refused before anything is read.
    let body = match declared {
        Some(length) if length > crate::routes::MAX_BODY as u64 => Err(()),
        _ => axum::body::to_bytes(body, crate::routes::MAX_BODY).await.map_err(drop),
    };
    let body: Bytes = match body {
        Ok(body) => body,
        Err(_) => {
            state.metrics.delivery(&channel.def.name, "invalid");
            return ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("the body is over {} bytes, or ended early", crate::routes::MAX_BODY),
            )
            .into_response();
        }
    };
    let count = |outcome: &str| state.metrics.delivery(&channel.def.name, outcome);
    if let Err(why) = verify(channel, &headers, &body) {
        count("bad_signature");
        tracing::warn!(channel = %channel.def.name, %why, "delivery refused");
        return ApiError::new(ErrorCode::SignatureInvalid, why).into_response();
    }
    let parsed = match channel.def.kind {
        ChannelKind::Email => parse_email(&channel.def, &headers, &body),
        kind => parse(kind, &headers, &body),
    };
    let delivery = match parsed {
        Ok(Parsed::Handshake(answer)) => {
            count("handshake");
            return answer;
        }
        Ok(Parsed::Answered(answer, outcome)) => {
            count(outcome);
            return answer;
        }
        Ok(Parsed::Delivery(delivery)) => delivery,
        Err(why) => {
            count("invalid");
            return ApiError::invalid(why).into_response();
        }
    };
    if !channel.def.accepts(&delivery.event) {
        count("declined");
        return StatusCode::NO_CONTENT.into_response();
    }
    let agent = state.engine.agent();
    let run_id = RunId::from_suffix(&format!(
        "ch{:016x}{:016x}",
        stable_hash(&[&agent.name, &channel.def.name, &delivery.id]),
        stable_hash(&[&delivery.id, &channel.def.name, &agent.name]),
    ));
    match state.engine.store().load_run(&run_id).await {
        Ok(Some(_)) => {
            count("duplicate");
            return claimed(channel.def.kind, &run_id, true);
        }
        Ok(None) => {}
        Err(error) => return ApiError::from(error).into_response(),
    }
    let variables = json!({
        "event": delivery.event,
        "sender": delivery.sender,
        "delivery": delivery.id,
        "channel": channel.def.name,
        "payload": delivery.payload,
    });
    let session = session_id(&render(&channel.def.session, &variables), &channel.def.name, &delivery.id);
    let input = render(&channel.def.input, &variables);
    let started = state.engine.start_exclusive(run_id.clone(), session.clone(), Message::user(input));
    let admitted = match started {
        Ok(mut handle) => handle.admitted().await.map(|()| handle),
        Err(failure) => Err(failure),
    };
    match admitted {
        Ok(handle) => {
            count("claimed");
            tracing::info!(channel = %channel.def.name, event = %delivery.event, delivery = %delivery.id, run = %run_id, %session, "delivery claimed");
            let forwarded = state.feeds.forward(&session, handle);
            if channel.reply.is_some() {
                let state = Arc::clone(&state);
                let name = channel.def.name.clone();
                let payload = delivery.payload;
                tokio::spawn(async move {
                    let Ok(Ok(result)) = forwarded.await else { return };
                    let Some(channel) = state.channels.iter().find(|c| c.def.name == name) else { return };
                    let outcome = reply(channel, &payload, &result.text).await;
                    state.metrics.reply(&name, outcome);
                });
            }
            claimed(channel.def.kind, &run_id, false)
        }
        // The same delivery twice at once: the other one started it.
        Err(_) if matches!(state.engine.store().load_run(&run_id).await, Ok(Some(_))) => {
            count("duplicate");
            claimed(channel.def.kind, &run_id, true)
        }
        Err(failure) if failure.code == ErrorCode::SessionBusy => {
            count("busy");
            tracing::warn!(channel = %channel.def.name, delivery = %delivery.id, %session, "delivery dropped: its session is busy");
            ApiError::new(
                ErrorCode::SessionBusy,
                format!("session {session} is busy; the delivery was not taken (deliver it again later)"),
            )
            .into_response()
        }
        Err(failure) => ApiError::from(failure).into_response(),
    }
}

/// Posts a run's final answer back where its delivery came from: `sent`, `skipped` (nothing to
/// say, or nowhere to say it) or `failed` (logged). Not journaled: a process that dies between
/// the run's end and this post does not post it.
async fn reply(channel: &Channel, payload: &Value, text: &str) -> &'static str {
    let Some(target) = &channel.reply else { return "skipped" };
    if text.trim().is_empty() {
        return "skipped";
    }
    let field = |path: &[&str]| {
        let mut value = payload;
        for key in path {
            value = value.get(key).unwrap_or(&Value::Null);
        }
        match value {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    };
    let request = match channel.def.kind {
        ChannelKind::Github => {
            let number = field(&["issue", "number"]).or_else(|| field(&["pull_request", "number"]));
            let (Some(repository), Some(number)) = (field(&["repository", "full_name"]), number) else {
                return "skipped";
            };
            target
                .http
                .post(format!("{}/repos/{repository}/issues/{number}/comments", target.base_url))
                .header("accept", "application/vnd.github+json")
                .json(&json!({"body": text}))
        }
        ChannelKind::Slack => {
            let Some(conversation) = field(&["event", "channel"]).or_else(|| field(&["channel_id"])) else {
                return "skipped";
            };
            let thread = field(&["event", "thread_ts"]).or_else(|| field(&["event", "ts"]));
            let mut body = json!({"channel": conversation, "text": text});
            if let Some(thread) = thread {
                body["thread_ts"] = json!(thread);
            }
            target.http.post(format!("{}/api/chat.postMessage", target.base_url)).json(&body)
        }
        ChannelKind::Discord => {
            let (Some(application), Some(token)) = (field(&["application_id"]), field(&["token"])) else {
                return "skipped";
            };
            // A Discord message holds 2,000 characters.
            let content: String = text.chars().take(2000).collect();
            target
                .http
                .post(format!("{}/api/v10/webhooks/{application}/{token}", target.base_url))
                .json(&json!({"content": content}))
        }
        ChannelKind::Webhook | ChannelKind::Email => return "skipped",
    };
    let request = match &target.token {
        Some(token) => request.bearer_auth(token),
        None => request,
    };
    match request.send().await {
        Ok(response) if response.status().is_success() => "sent",
        Ok(response) => {
            tracing::warn!(channel = %channel.def.name, status = %response.status(), "the platform refused the reply");
            "failed"
        }
        Err(error) => {
            tracing::warn!(channel = %channel.def.name, %error, "could not post the reply");
            "failed"
        }
    }
}

/// The answer to a claimed delivery: Discord wants an interaction response.
fn claimed(kind: ChannelKind, run: &RunId, duplicate: bool) -> Response {
    let body = match kind {
        ChannelKind::Discord => json!({"type": 4, "data": {"content": "Received: working on it."}}),
        _ => json!({"claimed": true, "runId": run.as_str(), "duplicate": duplicate}),
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// A session id from a rendered template: characters ids cannot hold become `-`, at most 128;
/// nothing left: one per delivery.
fn session_id(rendered: &str, channel: &str, delivery: &str) -> SessionId {
    let cleaned: String = rendered
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '-' })
        .take(128)
        .collect();
    let cleaned = cleaned.trim_matches('-');
    SessionId::new(cleaned)
        .or_else(|_| SessionId::new(session_fallback(channel, delivery)))
        .unwrap_or_else(|_| SessionId::new("channel").expect("a valid id"))
}

fn session_fallback(channel: &str, delivery: &str) -> String {
    format!("{channel}-{:016x}", stable_hash(&[channel, delivery]))
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Result<&'h str, String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| format!("the `{name}` header is missing"))
}

/// Checks a signed timestamp (seconds) against now: within [`WINDOW_SECS`] either way.
fn fresh(timestamp: &str, what: &str) -> Result<(), String> {
    let at: i64 = timestamp.parse().map_err(|_| format!("`{what}` is not a Unix time in seconds"))?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if (now - at).abs() > WINDOW_SECS {
        return Err(format!("`{what}` is more than 5 minutes from now (a replay, or a clock that is off)"));
    }
    Ok(())
}

fn hmac_hex_matches(key: &hmac::Key, message: &[&[u8]], hex_signature: &str) -> bool {
    let Ok(expected) = hex::decode(hex_signature) else { return false };
    let mut context = hmac::Context::with_key(key);
    for part in message {
        context.update(part);
    }
    let tag = context.sign();
    // Constant-time: the length is public, the bytes are not.
    expected.len() == tag.as_ref().len() && subtle::ConstantTimeEq::ct_eq(tag.as_ref(), &expected[..]).into()
}

/// Verifies the delivery's signature over the raw body, with the channel's scheme.
fn verify(channel: &Channel, headers: &HeaderMap, body: &[u8]) -> Result<(), String> {
    let refused = |scheme: &str| format!("the {scheme} signature does not match the body");
    match (&channel.def.kind, &channel.key) {
        (ChannelKind::Github, Key::Hmac(key)) => {
            let signature = header(headers, "x-hub-signature-256")?;
            let hex = signature
                .strip_prefix("sha256=")
                .ok_or("`X-Hub-Signature-256` does not start with `sha256=`")?;
            hmac_hex_matches(key, &[body], hex).then_some(()).ok_or_else(|| refused("GitHub"))
        }
        (ChannelKind::Slack, Key::Hmac(key)) => {
            let timestamp = header(headers, "x-slack-request-timestamp")?;
            let signature = header(headers, "x-slack-signature")?;
            fresh(timestamp, "X-Slack-Request-Timestamp")?;
            let hex = signature.strip_prefix("v0=").ok_or("`X-Slack-Signature` does not start with `v0=`")?;
            hmac_hex_matches(key, &[b"v0:", timestamp.as_bytes(), b":", body], hex)
                .then_some(())
                .ok_or_else(|| refused("Slack"))
        }
        (ChannelKind::Webhook | ChannelKind::Email, Key::Hmac(key)) => {
            let id = header(headers, "webhook-id")?;
            let timestamp = header(headers, "webhook-timestamp")?;
            let signatures = header(headers, "webhook-signature")?;
            fresh(timestamp, "webhook-timestamp")?;
            let mut context = hmac::Context::with_key(key);
            for part in [id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
                context.update(part);
            }
            let tag = context.sign();
            // A space-separated list (keys being rotated): any `v1,` entry may match.
            let matched =
                signatures.split(' ').filter_map(|entry| entry.strip_prefix("v1,")).any(|encoded| {
                    base64::engine::general_purpose::STANDARD.decode(encoded).is_ok_and(|given| {
                        given.len() == tag.as_ref().len()
                            && bool::from(subtle::ConstantTimeEq::ct_eq(tag.as_ref(), &given[..]))
                    })
                });
            matched.then_some(()).ok_or_else(|| refused("Standard Webhooks"))
        }
        (ChannelKind::Discord, Key::Ed25519(public_key)) => {
            let signature = header(headers, "x-signature-ed25519")?;
            let timestamp = header(headers, "x-signature-timestamp")?;
            fresh(timestamp, "X-Signature-Timestamp")?;
            let signature =
                hex::decode(signature).map_err(|_| "`X-Signature-Ed25519` is not hex".to_owned())?;
            let mut message = Vec::with_capacity(timestamp.len() + body.len());
            message.extend_from_slice(timestamp.as_bytes());
            message.extend_from_slice(body);
            signature::UnparsedPublicKey::new(&signature::ED25519, public_key)
                .verify(&message, &signature)
                .map_err(|_| refused("Discord"))
        }
        _ => Err("the channel's key does not fit its type".into()),
    }
}

enum Parsed {
    Handshake(Response),
    /// Answered without a run, counted as this outcome (an email bounced or dropped).
    Answered(Response, &'static str),
    Delivery(Delivery),
}

/// The one reason a refused email is bounced with: which check failed is not told.
pub(crate) const BOUNCE_REASON: &str = "550 5.7.1 Message not accepted";

/// Reads a verified email delivery: raw RFC 5322, or JSON with the message in `raw`. A message
/// to none of the channel's addresses is dropped (`204`); one the gate refuses is answered
/// with a bounce and the fixed reason.
fn parse_email(def: &ChannelDef, headers: &HeaderMap, body: &[u8]) -> Result<Parsed, String> {
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    let raw: Vec<u8> = if json {
        let value: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        value.get("raw").and_then(Value::as_str).ok_or("the JSON has no `raw` message")?.as_bytes().to_vec()
    } else {
        body.to_vec()
    };
    let bounce = || {
        Parsed::Answered(
            (StatusCode::OK, axum::Json(json!({"action": "bounce", "reason": BOUNCE_REASON})))
                .into_response(),
            "bounced",
        )
    };
    let Ok(mail) = crate::email::read(&raw) else { return Ok(bounce()) };
    let claimed = def.addresses.is_empty()
        || mail.recipients.iter().any(|to| def.addresses.iter().any(|ours| ours.eq_ignore_ascii_case(to)));
    if !claimed {
        return Ok(Parsed::Answered(StatusCode::NO_CONTENT.into_response(), "dropped"));
    }
    if !crate::email::vouched(&mail, def.authserv_id.as_deref()) {
        tracing::info!(channel = %def.name, from = %mail.from, "email bounced: its From domain is not vouched for");
        return Ok(bounce());
    }
    let id = match &mail.message_id {
        Some(id) => id.clone(),
        None => header(headers, "webhook-id")?.to_owned(),
    };
    Ok(Parsed::Delivery(Delivery {
        event: "email".into(),
        id,
        sender: mail.from.clone(),
        payload: json!({
            "from": mail.from,
            "to": mail.recipients,
            "subject": mail.subject,
            "text": mail.text,
            "messageId": mail.message_id,
        }),
    }))
}

/// Reads a verified body: a handshake to answer, or a delivery.
fn parse(kind: ChannelKind, headers: &HeaderMap, body: &[u8]) -> Result<Parsed, String> {
    let form = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/x-www-form-urlencoded"));
    let payload: Value = if form {
        // Slack's slash commands and interactive payloads are forms; an interactive one holds
        // its JSON in `payload`.
        let fields: serde_json::Map<String, Value> = form_urlencoded::parse(body)
            .map(|(k, v)| (k.into_owned(), Value::String(v.into_owned())))
            .collect();
        match fields.get("payload").and_then(Value::as_str) {
            Some(json) => {
                serde_json::from_str(json).map_err(|e| format!("the form's `payload` is not JSON: {e}"))?
            }
            None => Value::Object(fields),
        }
    } else {
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?
    };
    let text = |value: &Value| match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    };
    let at = |path: &[&str]| {
        let mut value = &payload;
        for key in path {
            value = value.get(key).unwrap_or(&Value::Null);
        }
        text(value)
    };
    let delivery = match kind {
        ChannelKind::Github => {
            let event = header(headers, "x-github-event")?.to_owned();
            if event == "ping" {
                return Ok(Parsed::Handshake(axum::Json(json!({"ok": true})).into_response()));
            }
            let action = at(&["action"]);
            Delivery {
                event: if action.is_empty() { event } else { format!("{event}.{action}") },
                id: header(headers, "x-github-delivery")?.to_owned(),
                sender: at(&["sender", "login"]),
                payload,
            }
        }
        ChannelKind::Slack => {
            if at(&["type"]) == "url_verification" {
                let challenge = at(&["challenge"]);
                return Ok(Parsed::Handshake(axum::Json(json!({"challenge": challenge})).into_response()));
            }
            let (event, id, sender) = if at(&["type"]) == "event_callback" {
                (at(&["event", "type"]), at(&["event_id"]), at(&["event", "user"]))
            } else if !at(&["command"]).is_empty() {
                ("slash_command".to_owned(), at(&["trigger_id"]), at(&["user_id"]))
            } else {
                (at(&["type"]), at(&["trigger_id"]), at(&["user", "id"]))
            };
            if id.is_empty() {
                return Err("the Slack payload has no `event_id` or `trigger_id`".into());
            }
            Delivery { event, id, sender, payload }
        }
        ChannelKind::Discord => {
            if payload.get("type").and_then(Value::as_u64) == Some(1) {
                return Ok(Parsed::Handshake(axum::Json(json!({"type": 1})).into_response()));
            }
            let event = match payload.get("type").and_then(Value::as_u64) {
                Some(2) => "application_command",
                Some(3) => "message_component",
                Some(4) => "autocomplete",
                Some(5) => "modal_submit",
                _ => "interaction",
            };
            let mut sender = at(&["member", "user", "id"]);
            if sender.is_empty() {
                sender = at(&["user", "id"]);
            }
            let id = at(&["id"]);
            if id.is_empty() {
                return Err("the Discord interaction has no `id`".into());
            }
            Delivery { event: event.to_owned(), id, sender, payload }
        }
        ChannelKind::Email => return Err("an email delivery is read by parse_email".into()),
        ChannelKind::Webhook => Delivery {
            event: at(&["type"]),
            id: header(headers, "webhook-id")?.to_owned(),
            sender: String::new(),
            payload,
        },
    };
    Ok(Parsed::Delivery(delivery))
}

/// The names of the channels mounted, for the start-up log.
pub(crate) fn describe(channels: &[Channel]) -> Vec<String> {
    channels
        .iter()
        .map(|c| format!("{} ({}) at POST /channels/{}", c.def.name, c.def.kind.as_str(), c.def.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vendors' documented vectors (`shared/peers/README.md` lists their sources).
    #[test]
    fn the_documented_vectors_verify_and_one_changed_byte_does_not() {
        // GitHub's docs: secret "It's a Secret to Everybody", body "Hello, World!".
        let github = hmac::Key::new(hmac::HMAC_SHA256, b"It's a Secret to Everybody");
        let signature = "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert!(hmac_hex_matches(&github, &[b"Hello, World!"], signature));
        assert!(!hmac_hex_matches(&github, &[b"Hello, World?"], signature));
        // Slack's docs: the slash command of their example, at 1531420618.
        let slack = hmac::Key::new(hmac::HMAC_SHA256, b"8f742231b10e8888abcd99yyyzzz85a5");
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let signature = "a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";
        assert!(hmac_hex_matches(&slack, &[b"v0:", b"1531420618", b":", body], signature));
        assert!(!hmac_hex_matches(&slack, &[b"v0:", b"1531420619", b":", body], signature));
        // RFC 8032 section 7.1, test 2 (Discord signs with Ed25519).
        let public = hex::decode("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c").unwrap();
        let signature = hex::decode("92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00").unwrap();
        let key = signature::UnparsedPublicKey::new(&signature::ED25519, &public);
        assert!(key.verify(&[0x72], &signature).is_ok());
        assert!(key.verify(&[0x73], &signature).is_err());
    }

    #[test]
    fn a_standard_webhooks_vector_verifies_through_the_channel() {
        // standard-webhooks' own test: id, timestamp and body below, signed at 1614265330.
        let def = ChannelDef {
            name: "hooks".into(),
            kind: ChannelKind::Webhook,
            secret_env: "UNUSED".into(),
            events: Vec::new(),
            input: String::new(),
            session: String::new(),
            addresses: Vec::new(),
            authserv_id: None,
            reply: None,
        };
        let secret =
            base64::engine::general_purpose::STANDARD.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let key = Key::Hmac(Box::new(hmac::Key::new(hmac::HMAC_SHA256, &secret)));
        let channel = Channel { def, key, reply: None };
        let mut context = hmac::Context::with_key(match &channel.key {
            Key::Hmac(key) => key,
            Key::Ed25519(_) => unreachable!(),
        });
        context.update(b"msg_p5jXN8AQM9LWM0D4loKWxJek.1614265330.{\"test\": 2432232314}");
        let tag = base64::engine::general_purpose::STANDARD.encode(context.sign().as_ref());
        assert_eq!(tag, "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // Through `verify`, the vector's timestamp is years old: refused for that alone.
        let mut headers = HeaderMap::new();
        headers.insert("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek".parse().unwrap());
        headers.insert("webhook-timestamp", "1614265330".parse().unwrap());
        headers.insert("webhook-signature", format!("v1,{tag}").parse().unwrap());
        let refused = verify(&channel, &headers, b"{\"test\": 2432232314}").unwrap_err();
        assert!(refused.contains("5 minutes"), "{refused}");
    }
}
