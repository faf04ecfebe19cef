//! The clock tools: `current_date` and `day_name`.
//!
//! Both take an optional IANA time zone (`Europe/Paris`); without one they use the machine's
//! local zone. Reading the clock inside a tool step is what keeps the run loop deterministic:
//! the answer is journaled, and a replay reads the journal, not the clock.

use std::path::Path;

use jiff::ZonedDateTime as Zoned;
use jiff::tz::TimeZone;
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::{Value, json};

fn zone_input_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "timezone": {
                "type": "string",
                "description": "An IANA time zone such as Europe/Paris or America/New_York; default: the machine's local zone"
            }
        },
        "additionalProperties": false
    })
}

/// Now (or `fixed`), in the zone the input asks for, else the local one (else `fixed`'s).
fn now_in(input: &Value, fixed: Option<&Zoned>) -> Result<Zoned, ToolError> {
    let zone = match input.get("timezone").and_then(Value::as_str) {
        Some(name) => Some(TimeZone::get(name).map_err(|_| {
            ToolError::failed(format!(
                "unknown time zone {name:?}: use an IANA name such as Europe/Paris or America/New_York"
            ))
        })?),
        None => None,
    };
    Ok(match (fixed, zone) {
        (Some(fixed), Some(zone)) => fixed.with_time_zone(zone),
        (Some(fixed), None) => fixed.clone(),
        // Not `Zoned::now()`, which asks jiff for the system's zone first.
        (None, zone) => jiff::Timestamp::now().to_zoned_datetime(zone.unwrap_or_else(local_zone)),
    })
}

/// The machine's time zone, as [`TimeZone::system`] finds it, without building jiff's index of
/// zone names first: before its first lookup, jiff's database lists every file under
/// `/usr/share/zoneinfo` (about 600 files, 2.6M instructions: 30% of a whole `keel run` whose
/// agent reads the clock once). Where `TZ` is unset and `/etc/localtime` links into a zoneinfo
/// directory, the link's path names the zone and the file it leads to is that zone's data,
/// which is all the lookup would have found. Anything else (`TZ` set, a copied file, no file)
/// is left to jiff.
fn local_zone() -> TimeZone {
    if std::env::var_os("TZ").is_none()
        && let Some(zone) = linked_zone(Path::new(LOCALTIME))
    {
        return zone;
    }
    TimeZone::system()
}

/// Where Unix systems say which time zone is local.
const LOCALTIME: &str = "/etc/localtime";

/// The zone a `localtime` link leads to (`.../zoneinfo/Europe/Paris`), named as the link names
/// it; `None` when `path` is not such a link or what it leads to is not time zone data.
fn linked_zone(path: &Path) -> Option<TimeZone> {
    let target = std::fs::read_link(path).ok()?;
    let (_, name) = target.to_str()?.rsplit_once("zoneinfo/")?;
    // `posix/` holds the same zones under the same names (`right/`, with leap seconds, differs
    // and keeps its prefix).
    let name = name.strip_prefix("posix/").unwrap_or(name);
    if name.eq_ignore_ascii_case("UTC") {
        return Some(TimeZone::UTC);
    }
    TimeZone::tzif(name, &std::fs::read(path).ok()?).ok()
}

/// A clock tool: reads the clock in the asked (or local) zone and answers from it.
pub struct ClockTool {
    spec: ToolSpec,
    answer: fn(&Zoned) -> Value,
    /// The time it always reads instead of the clock (`keel test`: the case's `now`).
    fixed: Option<Zoned>,
}

impl ClockTool {
    /// The name of [`ClockTool::current_date`].
    pub const CURRENT_DATE: &'static str = "current_date";
    /// The name of [`ClockTool::day_name`].
    pub const DAY_NAME: &'static str = "day_name";

    /// `current_date`: today's date, weekday, time and zone.
    pub fn current_date() -> ClockTool {
        ClockTool::new(
            Self::CURRENT_DATE,
            "Returns the current date, weekday and time (ISO 8601), optionally in a given time zone.",
            |now| {
                json!({
                    "date": now.strftime("%Y-%m-%d").to_string(),
                    "weekday": now.strftime("%A").to_string(),
                    "time": now.strftime("%H:%M:%S").to_string(),
                    "timezone": now.time_zone().iana_name().unwrap_or("local"),
                    "iso": now.timestamp().to_string(),
                })
            },
        )
    }

    /// `day_name`: the name of today's weekday (`Sunday`).
    pub fn day_name() -> ClockTool {
        ClockTool::new(
            Self::DAY_NAME,
            "Returns the name of today's day of the week (for example Monday), optionally in a given time zone.",
            |now| Value::String(now.strftime("%A").to_string()),
        )
    }

    fn new(name: &str, description: &str, answer: fn(&Zoned) -> Value) -> ClockTool {
        let spec = ToolSpec {
            name: name.to_owned(),
            description: description.to_owned(),
            input_schema: zone_input_schema(),
        };
        ClockTool { spec, answer, fixed: None }
    }

    /// This tool, reading `now` (and its zone, unless the input names one) instead of the
    /// clock: what makes a test of a date-dependent agent repeatable.
    #[must_use]
    pub fn at(mut self, now: Zoned) -> ClockTool {
        self.fixed = Some(now);
        self
    }
}

impl Tool for ClockTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(std::future::ready(now_in(&input, self.fixed.as_ref()).map(|now| (self.answer)(&now))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::{RunId, SessionId};

    fn ctx() -> ToolContext {
        ToolContext {
            run_id: RunId::from_suffix("t"),
            session_id: SessionId::new("s").unwrap(),
            call_id: "c".into(),
            idempotency_key: "run_t:tool:day_name:c".into(),
            state: keel_core::SessionState::default(),
        }
    }

    fn weekday_now(zone: &str) -> String {
        Zoned::now().with_time_zone(TimeZone::get(zone).unwrap()).strftime("%A").to_string()
    }

    #[tokio::test]
    async fn a_fixed_time_is_read_in_its_zone_or_the_asked_one() {
        let now: Zoned = "2026-03-02T23:30:00+01:00[Europe/Paris]".parse().unwrap();
        let tool = ClockTool::day_name().at(now.clone());
        assert_eq!(tool.call(json!({}), &ctx()).await.unwrap(), json!("Monday"));
        assert_eq!(tool.call(json!({ "timezone": "Asia/Tokyo" }), &ctx()).await.unwrap(), json!("Tuesday"));
        let date = ClockTool::current_date().at(now).call(json!({}), &ctx()).await.unwrap();
        assert_eq!(date["iso"], "2026-03-02T22:30:00Z");
        assert_eq!(date["time"], "23:30:00");
    }

    #[tokio::test]
    async fn day_name_answers_in_the_given_zone() {
        // Read the clock around the call: the day may change in between, at midnight.
        for zone in ["Pacific/Kiritimati", "Pacific/Pago_Pago", "UTC"] {
            let before = weekday_now(zone);
            let out = ClockTool::day_name().call(json!({ "timezone": zone }), &ctx()).await.unwrap();
            let after = weekday_now(zone);
            assert!(out == json!(before) || out == json!(after), "{zone}: {out}");
        }
    }

    #[tokio::test]
    async fn unknown_zones_are_tool_errors() {
        let err =
            ClockTool::day_name().call(json!({ "timezone": "Mars/Olympus" }), &ctx()).await.unwrap_err();
        assert!(err.message.contains("unknown time zone \"Mars/Olympus\""), "{}", err.message);
    }

    #[tokio::test]
    async fn current_date_has_date_and_weekday() {
        let out = ClockTool::current_date().call(json!({ "timezone": "Asia/Tokyo" }), &ctx()).await.unwrap();
        let date = out["date"].as_str().unwrap();
        assert_eq!(date.len(), 10, "{out}");
        assert_eq!(out["timezone"], "Asia/Tokyo");
        let parsed: jiff::civil::Date = date.parse().unwrap();
        assert_eq!(out["weekday"], parsed.strftime("%A").to_string());
    }

    /// The offsets `zone` has in winter and in summer (2026).
    fn offsets(zone: &TimeZone) -> [i32; 2] {
        ["2026-01-15T12:00:00Z", "2026-07-15T12:00:00Z"]
            .map(|at| zone.to_offset(at.parse().unwrap()).seconds())
    }

    #[test]
    fn a_localtime_link_names_the_zone_and_leads_to_its_data() {
        let dir = tempfile::tempdir().unwrap();
        // A relative link, as some systems make them, into a zoneinfo directory of its own.
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("zoneinfo/Asia")).unwrap();
        std::fs::copy("/usr/share/zoneinfo/America/New_York", dir.path().join("zoneinfo/Asia/Tokyo"))
            .unwrap();
        let link = dir.path().join("etc/localtime");
        std::os::unix::fs::symlink("../zoneinfo/Asia/Tokyo", &link).unwrap();
        let zone = linked_zone(&link).unwrap();
        // The name is the link's; the rules are the file's (New York's, to tell them apart).
        assert_eq!(zone.iana_name(), Some("Asia/Tokyo"));
        assert_eq!(offsets(&zone), offsets(&TimeZone::get("America/New_York").unwrap()));

        let paris = dir.path().join("paris");
        std::os::unix::fs::symlink("/usr/share/zoneinfo/Europe/Paris", &paris).unwrap();
        let zone = linked_zone(&paris).unwrap();
        assert_eq!(zone.iana_name(), Some("Europe/Paris"));
        assert_eq!(offsets(&zone), [3600, 7200]);

        let utc = dir.path().join("utc");
        std::os::unix::fs::symlink("/usr/share/zoneinfo/UTC", &utc).unwrap();
        assert_eq!(linked_zone(&utc).unwrap(), TimeZone::UTC);

        // A link into `posix/` names the zone by its IANA name, without the prefix.
        std::fs::create_dir_all(dir.path().join("zoneinfo/posix/Europe")).unwrap();
        std::fs::copy("/usr/share/zoneinfo/Europe/Paris", dir.path().join("zoneinfo/posix/Europe/Paris"))
            .unwrap();
        let posix = dir.path().join("posix");
        std::os::unix::fs::symlink(dir.path().join("zoneinfo/posix/Europe/Paris"), &posix).unwrap();
        let zone = linked_zone(&posix).unwrap();
        assert_eq!(zone.iana_name(), Some("Europe/Paris"));
        assert_eq!(offsets(&zone), [3600, 7200]);
    }

    #[test]
    fn what_is_not_a_link_to_zone_data_is_left_to_jiff() {
        let dir = tempfile::tempdir().unwrap();
        let copied = dir.path().join("copied");
        std::fs::copy("/usr/share/zoneinfo/Europe/Paris", &copied).unwrap();
        assert!(linked_zone(&copied).is_none(), "a copy has no name");
        let elsewhere = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&copied, &elsewhere).unwrap();
        assert!(linked_zone(&elsewhere).is_none(), "no zoneinfo directory in the link");
        std::fs::create_dir(dir.path().join("zoneinfo")).unwrap();
        std::fs::write(dir.path().join("zoneinfo/Mars"), "not a time zone").unwrap();
        let garbage = dir.path().join("garbage");
        std::os::unix::fs::symlink(dir.path().join("zoneinfo/Mars"), &garbage).unwrap();
        assert!(linked_zone(&garbage).is_none(), "not TZif data");
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("zoneinfo/Venus"), &dangling).unwrap();
        assert!(linked_zone(&dangling).is_none(), "no file");
        assert!(linked_zone(&dir.path().join("absent")).is_none());
    }

    #[test]
    fn the_local_zone_is_the_one_jiff_finds() {
        let ours = local_zone();
        let jiffs = TimeZone::system();
        assert_eq!(ours.iana_name(), jiffs.iana_name());
        assert_eq!(offsets(&ours), offsets(&jiffs));
    }
}
