//! Channels: inbound webhooks that start runs (`channels/<name>.yaml` of an agent directory).
//!
//! A channel names its platform (which signature scheme guards it), the environment variable
//! that holds its secret, the event types it accepts, and templates for the run's input and
//! session. The server verifies and maps deliveries (`keel-server`'s `channels.rs`); this
//! module is the definition and the template language, which is small on purpose:
//! `{{path.to.field}}` reads the delivery's variables, nothing else.

use serde_json::Value;

/// The platforms a channel speaks for: each has its own signature scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelKind {
    /// Slack: `X-Slack-Signature` (HMAC-SHA256 of `v0:<timestamp>:<body>`), 5-minute window.
    Slack,
    /// GitHub: `X-Hub-Signature-256` (HMAC-SHA256 of the body).
    Github,
    /// Discord interactions: `X-Signature-Ed25519` over `<timestamp><body>`.
    Discord,
    /// Standard Webhooks (Svix and others): `webhook-id`, `webhook-timestamp`, `webhook-signature`.
    Webhook,
    /// Inbound email (raw RFC 5322) from a relay that signs as Standard Webhooks do; then the
    /// gate: the receiving server must vouch for the `From:` domain.
    Email,
}

impl ChannelKind {
    /// Every kind, with its spec name.
    pub const ALL: [(&'static str, ChannelKind); 5] = [
        ("slack", ChannelKind::Slack),
        ("github", ChannelKind::Github),
        ("discord", ChannelKind::Discord),
        ("webhook", ChannelKind::Webhook),
        ("email", ChannelKind::Email),
    ];

    /// Its spec name.
    pub fn as_str(self) -> &'static str {
        match self {
            ChannelKind::Slack => "slack",
            ChannelKind::Github => "github",
            ChannelKind::Discord => "discord",
            ChannelKind::Webhook => "webhook",
            ChannelKind::Email => "email",
        }
    }
}

/// A channel of an agent.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelDef {
    /// Its name (`A-Za-z0-9_-`): the route is `POST /channels/<name>`.
    pub name: String,
    /// The platform.
    pub kind: ChannelKind,
    /// The environment variable holding the secret (Discord: the application's public key, hex).
    pub secret_env: String,
    /// The event types accepted (`issues`, `issues.opened`, `app_mention`...); empty: all.
    pub events: Vec<String>,
    /// The run's input, a template.
    pub input: String,
    /// The run's session, a template (made a valid session id).
    pub session: String,
    /// Email: the addresses the channel claims (`to`); a message to none of them is dropped.
    /// Empty: every message.
    pub addresses: Vec<String>,
    /// Email: the authserv-id of the receiving server whose `Authentication-Results` are
    /// believed; `None`: the topmost header's.
    pub authserv_id: Option<String>,
    /// Where the run's final answer is posted back, if anywhere (Slack, GitHub, Discord).
    pub reply: Option<ChannelReply>,
}

/// Posting a channel run's final answer back to the platform: a Slack message in the event's
/// channel (thread), a GitHub comment on the issue or pull request, a Discord follow-up.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelReply {
    /// The platform's API (default its public one; tests point it at a local fake).
    pub base_url: String,
    /// The variable holding the API token (Slack: a bot token; GitHub: a token that may comment;
    /// Discord needs none: the interaction's token is enough).
    pub token_env: Option<String>,
}

impl ChannelReply {
    /// The public API of `kind`, when it has one replies go to.
    pub fn default_base_url(kind: ChannelKind) -> Option<&'static str> {
        match kind {
            ChannelKind::Slack => Some("https://slack.com"),
            ChannelKind::Github => Some("https://api.github.com"),
            ChannelKind::Discord => Some("https://discord.com"),
            ChannelKind::Webhook | ChannelKind::Email => None,
        }
    }
}

impl ChannelDef {
    /// The input when the file gives none.
    pub const DEFAULT_INPUT: &'static str = "{{event}} from {{sender}}:\n{{payload}}";
    /// An email channel's input when the file gives none.
    pub const DEFAULT_EMAIL_INPUT: &'static str =
        "Email from {{sender}}: {{payload.subject}}\n\n{{payload.text}}";
    /// The session when the file gives none: one per channel and sender.
    pub const DEFAULT_SESSION: &'static str = "{{channel}}-{{sender}}";

    /// Whether the channel takes events of `kind`: listed exactly, or as the prefix before a
    /// dot (`issues` takes `issues.opened`).
    pub fn accepts(&self, kind: &str) -> bool {
        self.events.is_empty()
            || self
                .events
                .iter()
                .any(|e| e == kind || kind.strip_prefix(e.as_str()).is_some_and(|rest| rest.starts_with('.')))
    }
}

/// Checks a template: every `{{` has its `}}` around a path of `A-Za-z0-9_-` segments joined
/// by dots. Returns what is wrong.
pub fn check_template(template: &str) -> Result<(), String> {
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            return Err("a `{{` has no closing `}}`".into());
        };
        let path = after[..end].trim();
        let valid = !path.is_empty()
            && path.split('.').all(|segment| {
                !segment.is_empty()
                    && segment.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
        if !valid {
            return Err(format!("`{{{{{path}}}}}` is not a path such as `{{{{payload.issue.title}}}}`"));
        }
        rest = &after[end + 2..];
    }
    Ok(())
}

/// Renders a template over `variables`: `{{a.b.0}}` is that field (a string as it is, anything
/// else as compact JSON), or nothing when it is missing.
pub fn render(template: &str, variables: &Value) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let mut value = variables;
        let mut found = true;
        for segment in after[..end].trim().split('.') {
            let next = match value {
                Value::Object(map) => map.get(segment),
                Value::Array(items) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            };
            match next {
                Some(next) => value = next,
                None => {
                    found = false;
                    break;
                }
            }
        }
        match value {
            _ if !found => {}
            Value::String(text) => out.push_str(text),
            Value::Null => {}
            other => out.push_str(&other.to_string()),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn templates_read_paths_and_leave_missing_ones_empty() {
        let variables = json!({"payload": {"issue": {"number": 7, "title": "Broken", "labels": [{"name": "bug"}]}}, "sender": "octocat"});
        assert_eq!(
            render(
                "#{{payload.issue.number}} {{ payload.issue.title }} [{{payload.issue.labels.0.name}}] by {{sender}}{{nothing.here}}",
                &variables
            ),
            "#7 Broken [bug] by octocat"
        );
        assert_eq!(render("{{payload.issue.labels}}", &variables), r#"[{"name":"bug"}]"#);
        assert!(check_template("{{payload.issue.title}} and {{sender}}").is_ok());
        assert!(check_template("{{payload.issue").is_err());
        assert!(check_template("{{ }}").is_err());
        assert!(check_template("{{a b}}").is_err());
    }

    #[test]
    fn events_match_exactly_or_by_prefix() {
        let def = ChannelDef {
            name: "gh".into(),
            kind: ChannelKind::Github,
            secret_env: "S".into(),
            events: vec!["issues".into(), "pull_request.opened".into()],
            input: String::new(),
            session: String::new(),
            addresses: Vec::new(),
            authserv_id: None,
            reply: None,
        };
        assert!(def.accepts("issues.opened"));
        assert!(def.accepts("issues"));
        assert!(def.accepts("pull_request.opened"));
        assert!(!def.accepts("pull_request.closed"));
        assert!(!def.accepts("issues_comment.created"));
    }
}
