//! Channels: the `channels/<name>.yaml` files of an agent directory, one inbound webhook each.
//!
//! ```yaml
//! type: github                       # slack | github | discord | webhook | email
//! secret_env: GITHUB_WEBHOOK_SECRET  # the variable holding the secret (Discord: public key)
//! events: [issues.opened]            # optional: the event types accepted (default: all)
//! input: "New issue: {{payload.issue.title}}"
//! session: "gh-{{payload.issue.number}}"
//! ```

use std::path::Path;

use keel_core::channel::{ChannelDef, ChannelKind, check_template};

use crate::decode::{Decoder, map_lacks};
use crate::diagnostic::Diagnostic;
use crate::tree::Node;

const KEYS: &[&str] = &["type", "secret_env", "events", "input", "session", "to", "authserv_id", "reply"];
const REPLY_KEYS: &[&str] = &["base_url", "token_env"];

/// Every `*.yaml` (or `.yml`) of `dir`, sorted by name: one channel each.
pub(crate) fn load_dir(dir: &Path, diagnostics: &mut Vec<Diagnostic>) -> Vec<ChannelDef> {
    let mut channels = Vec::new();
    for (name, file, root) in crate::directory::yaml_files(dir, "channel", diagnostics) {
        let mut d = Decoder { file, diagnostics };
        if let Some(channel) = channel(&root, &mut d, name) {
            channels.push(channel);
        }
    }
    channels
}

fn channel(root: &Node, d: &mut Decoder<'_>, name: String) -> Option<ChannelDef> {
    let mut map = d.map(root, "the channel")?;
    let kind_node = map.take("type");
    let kind = kind_node.and_then(|n| d.string(n, "type").map(|kind| (n, kind)));
    let secret = map.take("secret_env").map(|n| (n, d.string(n, "secret_env")));
    let events = map.take("events").and_then(|n| d.string_list(n, "events"));
    let input = map.take("input").map(|n| (n, d.text(n, "input")));
    let session = map.take("session").map(|n| (n, d.text(n, "session")));
    let to = map.take("to").map(|n| (n, d.string_list(n, "to")));
    let authserv_id = map.take("authserv_id").map(|n| (n, d.string(n, "authserv_id")));
    let reply_node = map.take("reply");
    let mut reply_settings = None;
    if let Some(node) = reply_node
        && let Some(mut reply) = d.map(node, "reply")
    {
        let base_url = reply.take("base_url").map(|n| (n, d.string(n, "reply.base_url")));
        let token_env = reply.take("token_env").and_then(|n| d.string(n, "reply.token_env"));
        reply.finish(d, "reply", REPLY_KEYS);
        reply_settings = Some((node, base_url, token_env));
    }
    map.finish(d, "", KEYS);
    let kinds: Vec<&str> = ChannelKind::ALL.iter().map(|(name, _)| *name).collect();
    let kind = match kind {
        Some((n, kind)) => match ChannelKind::ALL.iter().find(|(name, _)| *name == kind) {
            Some((_, kind)) => Some(*kind),
            None => {
                let hint = match crate::decode::did_you_mean(&kind, &kinds) {
                    Some(close) => format!("did you mean `{close}`?"),
                    None => format!("the channel types: {}", kinds.join(", ")),
                };
                d.error(n.pos, format!("unknown channel type `{kind}`")).hint = Some(hint);
                None
            }
        },
        None => {
            if map_lacks(root, "type") {
                d.error(root.pos, "a channel needs `type`").hint =
                    Some(format!("one of {}", kinds.join(", ")));
            }
            None
        }
    };
    let secret_env = match secret {
        Some((n, Some(variable))) => {
            let valid = !variable.is_empty()
                && variable.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !variable.as_bytes()[0].is_ascii_digit();
            if !valid {
                d.error(n.pos, format!("`secret_env` {variable:?} is not an environment variable name"))
                    .hint = Some(
                    "name the variable that holds the secret, e.g. `secret_env: GITHUB_WEBHOOK_SECRET`"
                        .into(),
                );
                None
            } else {
                Some(variable)
            }
        }
        Some((_, None)) => None,
        None => {
            d.error(root.pos, "a channel needs `secret_env`").hint = Some(
                "name the environment variable holding the signing secret (Discord: the application's public key); \
                 the secret itself never goes in a file"
                    .into(),
            );
            None
        }
    };
    let email = kind == Some(ChannelKind::Email);
    for (key, node) in [("to", to.as_ref().map(|t| t.0)), ("authserv_id", authserv_id.as_ref().map(|a| a.0))]
    {
        if let (Some(n), false, Some(_)) = (node, email, kind) {
            d.error(n.pos, format!("`{key}` applies to `type: email` channels only"));
        }
    }
    let reply = match (reply_settings, kind) {
        (Some((node, base_url, token_env)), Some(kind)) => {
            match keel_core::channel::ChannelReply::default_base_url(kind) {
                None => {
                    d.error(
                        node.pos,
                        format!(
                            "`reply` applies to slack, github and discord channels, not {}",
                            kind.as_str()
                        ),
                    );
                    None
                }
                Some(default) => {
                    let base_url = match base_url {
                        Some((n, Some(url)))
                            if !(url.starts_with("http://") || url.starts_with("https://")) =>
                        {
                            d.error(n.pos, format!("`reply.base_url` {url:?} is not an http(s) URL"));
                            None
                        }
                        Some((_, Some(url))) => Some(url.trim_end_matches('/').to_owned()),
                        Some((_, None)) => None,
                        None => Some(default.to_owned()),
                    };
                    if token_env.is_none() && kind != ChannelKind::Discord {
                        d.error(node.pos, "`reply` needs `token_env`, the variable holding the API token").hint =
                            Some(match kind {
                                ChannelKind::Slack => "a bot token that may call chat.postMessage, e.g. `token_env: SLACK_BOT_TOKEN`",
                                _ => "a token that may comment on issues, e.g. `token_env: GITHUB_TOKEN`",
                            }.into());
                    }
                    base_url.map(|base_url| keel_core::channel::ChannelReply { base_url, token_env })
                }
            }
        }
        _ => None,
    };
    let default_input = if email { ChannelDef::DEFAULT_EMAIL_INPUT } else { ChannelDef::DEFAULT_INPUT };
    let mut template = |given: Option<(&Node, Option<String>)>, key: &str, default: &str| -> Option<String> {
        match given {
            Some((n, Some(text))) => match check_template(&text) {
                Ok(()) => Some(text),
                Err(why) => {
                    d.error(n.pos, format!("`{key}`: {why}")).hint = Some(
                        "templates read `{{event}}`, `{{sender}}`, `{{delivery}}`, `{{channel}}` and \
                         `{{payload.<path>}}`"
                            .into(),
                    );
                    None
                }
            },
            Some((_, None)) => None,
            None => Some(default.to_owned()),
        }
    };
    let input = template(input, "input", default_input);
    let session = template(session, "session", ChannelDef::DEFAULT_SESSION);
    Some(ChannelDef {
        name,
        kind: kind?,
        secret_env: secret_env?,
        events: events.unwrap_or_default().into_iter().map(|(event, _)| event).collect(),
        input: input?,
        session: session?,
        addresses: to
            .and_then(|(_, list)| list)
            .unwrap_or_default()
            .into_iter()
            .map(|(address, _)| address.to_ascii_lowercase())
            .collect(),
        authserv_id: authserv_id.and_then(|(_, id)| id),
        reply,
    })
}
