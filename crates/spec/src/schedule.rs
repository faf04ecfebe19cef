//! Schedules: the `triggers` key of a spec and the `schedules/<name>.yaml` files of a directory.
//!
//! ```yaml
//! triggers:
//!   - { type: cron, name: weekly, cron: "0 9 * * MON", timezone: Europe/Paris, input: Summarise last week. }
//! ```
//!
//! A file of `schedules/` holds one schedule, named after the file: the same keys, without
//! `name`. The cron expression and the time zone are checked here, so that `keel check` points
//! at a bad one.

use std::path::{Path, PathBuf};

use keel_core::SessionId;
use keel_core::schedule::{CronSchedule, Missed, ScheduleDef, ScheduleError, time_zone_names};

use crate::decode::{Decoder, did_you_mean, map_lacks};
use crate::diagnostic::{Diagnostic, Pos};
use crate::tree::Node;

const KEYS: &[&str] = &["type", "name", "cron", "timezone", "input", "session", "missed"];
const FILE_KEYS: &[&str] = &["type", "cron", "timezone", "input", "session", "missed"];

/// `triggers: [...]`: the spec's schedules, each with the position of its entry.
pub(crate) fn triggers(node: &Node, d: &mut Decoder<'_>) -> Vec<(ScheduleDef, Pos)> {
    let Some(items) = d.list(node, "triggers") else { return Vec::new() };
    let mut schedules: Vec<(ScheduleDef, Pos)> = Vec::new();
    for item in items {
        let Some(schedule) = schedule(item, d, None) else { continue };
        if let Some((_, first)) = schedules.iter().find(|(other, _)| other.name == schedule.name) {
            let message =
                format!("two triggers are named `{}` (the first at line {})", schedule.name, first.line);
            d.error(item.pos, message).hint = Some("give each trigger its own `name`".into());
            continue;
        }
        schedules.push((schedule, item.pos));
    }
    schedules
}

/// Every `*.yaml` (or `.yml`) of `dir`, sorted by name: one schedule each.
pub(crate) fn load_dir(dir: &Path, diagnostics: &mut Vec<Diagnostic>) -> Vec<(ScheduleDef, PathBuf)> {
    let mut schedules = Vec::new();
    for (name, file, root) in crate::directory::yaml_files(dir, "schedule", diagnostics) {
        let mut d = Decoder { file: file.clone(), diagnostics };
        if let Some(schedule) = schedule(&root, &mut d, Some(name)) {
            schedules.push((schedule, file));
        }
    }
    schedules
}

/// One schedule: an entry of `triggers` (`file_name: None`) or a file of `schedules/`.
fn schedule(node: &Node, d: &mut Decoder<'_>, file_name: Option<String>) -> Option<ScheduleDef> {
    let in_file = file_name.is_some();
    let what = if in_file { "the schedule" } else { "triggers[]" };
    let mut map = d.map(node, what)?;
    let kind = map.take("type").map(|n| (n, d.string(n, "type")));
    let name = match file_name {
        Some(name) => Some(name),
        None => match map.take("name") {
            Some(n) => {
                let name = d.string(n, "triggers[].name")?;
                if !ScheduleDef::valid_name(&name) {
                    d.error(
                        n.pos,
                        format!("invalid trigger name {name:?}: use 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`"),
                    );
                    return None;
                }
                Some(name)
            }
            None => {
                d.error(node.pos, "a trigger needs `name`").hint =
                    Some("write `- { type: cron, name: daily, cron: \"0 9 * * *\", input: ... }`".into());
                None
            }
        },
    };
    let what = match (&name, in_file) {
        (Some(name), false) => format!("triggers.{name}"),
        _ => String::new(),
    };
    let key = |key: &str| if what.is_empty() { key.to_owned() } else { format!("{what}.{key}") };
    let cron = map.take("cron").map(|n| (n, d.string(n, &key("cron"))));
    let zone = map.take("timezone").map(|n| (n, d.string(n, &key("timezone"))));
    let input = map.take("input").and_then(|n| d.text(n, &key("input")));
    let session = match map.take("session") {
        Some(n) => {
            let id = d.string(n, &key("session"))?;
            match SessionId::new(&id) {
                Ok(session) => Some(session),
                Err(failure) => {
                    d.error(n.pos, failure.message);
                    return None;
                }
            }
        }
        None => None,
    };
    let missed = match map.take("missed") {
        Some(n) => match d.string(n, &key("missed"))?.as_str() {
            "latest" => Missed::Latest,
            "skip" => Missed::Skip,
            other => {
                d.error(n.pos, format!("`{}` must be `latest` or `skip`, not `{other}`", key("missed")))
                    .hint = Some(
                    "`latest`: after downtime the latest missed tick fires once; `skip`: it does not".into(),
                );
                return None;
            }
        },
        None => Missed::Latest,
    };
    map.finish(d, if in_file { "" } else { "triggers[]" }, if in_file { FILE_KEYS } else { KEYS });
    if let Some((n, Some(kind))) = &kind
        && kind != "cron"
    {
        let hint = if ["slack", "github", "discord", "webhook", "email"].contains(&kind.as_str()) {
            "channels are defined in `channels/<name>.yaml` of an agent directory"
        } else {
            "the trigger type is `cron`"
        };
        d.error(n.pos, format!("unknown trigger type `{kind}`")).hint = Some(hint.into());
        return None;
    }
    let Some((cron_node, cron)) = cron else {
        d.error(node.pos, format!("{} needs `cron`", if in_file { "a schedule" } else { "a trigger" }))
            .hint = Some("write when it fires, e.g. `cron: \"0 9 * * MON-FRI\"` (09:00 on weekdays)".into());
        return None;
    };
    if input.is_none() && map_lacks(node, "input") {
        d.error(node.pos, format!("{} needs `input`", if in_file { "a schedule" } else { "a trigger" }))
            .hint = Some("write what each run is asked, e.g. `input: Summarise yesterday's tickets.`".into());
    }
    let zone_text = match &zone {
        Some((_, Some(zone))) => Some(zone.as_str()),
        Some((_, None)) => return None,
        None => None,
    };
    let cron = match CronSchedule::parse(&cron?, zone_text) {
        Ok(cron) => cron,
        Err(error @ ScheduleError::Cron { .. }) => {
            d.error(cron_node.pos, error.to_string()).hint = Some(error.hint().into());
            return None;
        }
        Err(error @ ScheduleError::TimeZone(_)) => {
            let pos = zone.as_ref().map_or(cron_node.pos, |(n, _)| n.pos);
            let names = time_zone_names();
            let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
            let hint = match did_you_mean(zone_text.unwrap_or_default(), &candidates) {
                Some(close) => format!("did you mean `{close}`? {}", error.hint()),
                None => error.hint().to_owned(),
            };
            d.error(pos, error.to_string()).hint = Some(hint);
            return None;
        }
    };
    Some(ScheduleDef { name: name?, cron, input: input?, session, missed })
}
