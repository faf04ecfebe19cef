//! Cron schedules: an agent's `triggers` (and `schedules/<name>.yaml`), parsed once and asked for
//! their fire times.
//!
//! The cron language is the `croner` crate's (POSIX/Vixie cron: 5 fields, or 6 with seconds
//! first; `@hourly`-style macros; `MON`/`JAN` names; ranges, lists and steps). Day of month and
//! day of week combine as crontab(5) says: when both are restricted (neither starts with `*`), a
//! day either matches fires; otherwise only a day both match. Time zones are jiff's IANA
//! database. Daylight saving time follows the Open Cron Pattern Specification, which `croner`
//! implements: a wall clock time skipped when the clock goes forward fires at the first valid
//! time after it, and a fixed-time job in an hour that repeats when the clock goes back fires
//! once (an interval job such as `*/5 * * * *` keeps its interval through both passes). This
//! module adapts jiff's zoned time to the trait `croner` searches over and picks croner's
//! day-matching mode; it parses and searches nothing itself.

use std::cmp::Ordering;
use std::str::FromStr;

use croner::errors::CronError;
use croner::parser::{CronParser, Seconds, Year};
use croner::{CivilDate, CivilDateTime, CivilTime, CronDateTime, Resolution, Weekday};
use jiff::tz::{AmbiguousOffset, TimeZone};
use jiff::{SignedDuration, Timestamp, ZonedDateTime as Zoned};

use crate::ids::{RunId, SessionId, stable_hash};

/// What a schedule does about ticks it missed while no process was running (spec key `missed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Missed {
    /// The latest missed tick fires once (the default); older ones are dropped.
    #[default]
    Latest,
    /// Missed ticks are dropped: the schedule waits for its next tick.
    Skip,
}

/// One schedule of an agent: when it fires and what each fire runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleDef {
    /// Its name (`A-Za-z0-9_-`, at most 64): unique within the agent.
    pub name: String,
    /// When it fires.
    pub cron: CronSchedule,
    /// The input of every run it starts.
    pub input: String,
    /// The session every fire runs in; `None`: a new session per fire
    /// (`schedule-<name>-<fire time>`).
    pub session: Option<SessionId>,
    /// What happens to ticks missed during downtime.
    pub missed: Missed,
}

impl ScheduleDef {
    /// Whether `name` can name a schedule: it becomes part of session and store keys.
    pub fn valid_name(name: &str) -> bool {
        // The same rule as tool names.
        crate::tool::validate_tool_name(name)
    }

    /// The key the store records this schedule's ticks under: unique among the agents that
    /// share a store.
    pub fn store_key(&self, agent: &str) -> String {
        format!("{agent}/{}", self.name)
    }

    /// The session a fire at `tick_ms` runs in.
    pub fn session_for(&self, tick_ms: u64) -> SessionId {
        if let Some(session) = &self.session {
            return session.clone();
        }
        let stamp = Timestamp::from_millisecond(tick_ms as i64)
            .map(|at| at.strftime("%Y%m%dT%H%M%SZ").to_string())
            .unwrap_or_else(|_| tick_ms.to_string());
        // A valid name (checked where schedules are defined) and a timestamp make a valid id.
        SessionId::new(format!("schedule-{}-{stamp}", self.name))
            .unwrap_or_else(|_| SessionId::new(format!("schedule-{tick_ms}")).expect("digits are valid"))
    }

    /// The run id of the fire at `tick_ms` of the schedule stored as `store_key`: the same in
    /// every process, so that the fire is one run whichever process starts it.
    pub fn run_id_for(store_key: &str, tick_ms: u64) -> RunId {
        let tick = tick_ms.to_string();
        let high = stable_hash(&[store_key, &tick]);
        let low = stable_hash(&[&tick, store_key]);
        RunId::delayed(&format!("cron{high:016x}{low:016x}"))
    }
}

/// Why a cron expression or a time zone is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The expression does not parse.
    #[error("invalid cron expression `{expression}`: {reason}")]
    Cron {
        /// The expression as written.
        expression: String,
        /// What the parser said.
        reason: String,
    },
    /// The time zone is not in the IANA database.
    #[error("unknown time zone `{0}`")]
    TimeZone(String),
}

impl ScheduleError {
    /// How to write it instead, for people.
    pub fn hint(&self) -> &'static str {
        match self {
            ScheduleError::Cron { .. } => {
                "write 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds \
                 first, or a macro (@hourly, @daily, @weekly, @monthly, @yearly); for example \
                 `0 9 * * MON-FRI` or `*/15 * * * *`"
            }
            ScheduleError::TimeZone(_) => {
                "use an IANA time zone name such as `Europe/Paris`, `America/New_York` or `UTC`"
            }
        }
    }
}

/// A parsed cron expression in a time zone.
#[derive(Clone)]
pub struct CronSchedule {
    expression: String,
    cron: croner::Cron,
    zone_name: String,
    zone: TimeZone,
}

impl std::fmt::Debug for CronSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CronSchedule({:?} in {})", self.expression, self.zone_name)
    }
}

impl PartialEq for CronSchedule {
    fn eq(&self, other: &CronSchedule) -> bool {
        self.expression == other.expression && self.zone_name == other.zone_name
    }
}

impl CronSchedule {
    /// Parses `expression` (5 or 6 fields, or a macro) in the IANA time zone `timezone`
    /// (`None`: UTC).
    pub fn parse(expression: &str, timezone: Option<&str>) -> Result<CronSchedule, ScheduleError> {
        let zone_name = timezone.unwrap_or("UTC").trim().to_owned();
        let zone = jiff::tz::db().get(&zone_name).map_err(|_| ScheduleError::TimeZone(zone_name.clone()))?;
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .dom_and_dow(either_day_field_is_a_star(expression))
            .build()
            .parse(expression)
            .map_err(|error| ScheduleError::Cron {
                expression: expression.to_owned(),
                reason: describe(&error),
            })?;
        // A pattern that can never match (`0 0 30 2 *`) is refused now, not at its first search.
        let schedule = CronSchedule { expression: expression.trim().to_owned(), cron, zone_name, zone };
        if schedule.next_after(0).is_none() {
            return Err(ScheduleError::Cron {
                expression: expression.to_owned(),
                reason: "it never matches a date (check the day of month against the month)".into(),
            });
        }
        Ok(schedule)
    }

    /// The expression as written.
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The time zone's name.
    pub fn timezone(&self) -> &str {
        &self.zone_name
    }

    /// The first fire time strictly after `after_ms` (milliseconds since the Unix epoch), or
    /// `None` when there is none within a few years.
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        let start = self.zoned(after_ms)?;
        let next = self.cron.find_next_occurrence(&start, false).ok()?;
        u64::try_from(next.0.timestamp().as_millisecond()).ok()
    }

    /// The latest fire time at or before `at_ms`, or `None` when there is none.
    pub fn latest_at_or_before(&self, at_ms: u64) -> Option<u64> {
        let start = self.zoned(at_ms)?;
        let previous = self.cron.find_previous_occurrence(&start, true).ok()?;
        u64::try_from(previous.0.timestamp().as_millisecond()).ok()
    }

    /// `at_ms` as a wall clock time in the schedule's zone: `2026-12-07 09:00:00 CET (+01:00)`.
    pub fn local_time(&self, at_ms: u64) -> String {
        match self.zoned(at_ms) {
            Some(zoned) => zoned.0.strftime("%Y-%m-%d %H:%M:%S %Z (%:z)").to_string(),
            None => at_ms.to_string(),
        }
    }

    fn zoned(&self, at_ms: u64) -> Option<ZonedTime> {
        let at = Timestamp::from_millisecond(i64::try_from(at_ms).ok()?).ok()?;
        Some(ZonedTime(at.to_zoned_datetime(self.zone.clone())))
    }
}

impl FromStr for CronSchedule {
    type Err = ScheduleError;

    /// An expression in UTC.
    fn from_str(expression: &str) -> Result<CronSchedule, ScheduleError> {
        CronSchedule::parse(expression, None)
    }
}

/// Every time zone name the database knows, for "did you mean".
pub fn time_zone_names() -> Vec<String> {
    jiff::tz::db().available().map(|name| name.as_str().to_owned()).collect()
}

/// Whether the day-of-month or the day-of-week field starts with `*` (`*`, `*/2`): crontab(5)
/// then fires only on days both match; when both are restricted, on days either matches.
/// (croner's default counts `*/2` as restricted; keel follows crontab, as cron daemons do.)
fn either_day_field_is_a_star(expression: &str) -> bool {
    let fields: Vec<&str> = expression.split_whitespace().collect();
    // Day of month, then (after the month) day of week.
    let (day_of_month, day_of_week) = match fields.len() {
        5 => (fields[2], fields[4]),
        6 => (fields[3], fields[5]),
        // A macro, or a count of fields the parser refuses: nothing to decide.
        _ => return false,
    };
    day_of_month.starts_with('*') || day_of_week.starts_with('*')
}

fn describe(error: &CronError) -> String {
    match error {
        CronError::EmptyPattern => "it is empty".into(),
        CronError::InvalidPattern(why)
        | CronError::IllegalCharacters(why)
        | CronError::ComponentError(why) => why.trim_end_matches('.').to_owned(),
        other => other.to_string(),
    }
}

/// jiff's zoned time as `croner` searches over it (the trait is croner's extension point for
/// date libraries it does not bundle).
#[derive(Clone)]
struct ZonedTime(Zoned);

fn civil_of(datetime: jiff::civil::DateTime) -> CivilDateTime {
    CivilDateTime::new(
        CivilDate::from_parts_unchecked(
            i32::from(datetime.year()),
            datetime.month() as u32,
            datetime.day() as u32,
        ),
        CivilTime::from_parts_unchecked(
            datetime.hour() as u32,
            datetime.minute() as u32,
            datetime.second() as u32,
        ),
    )
}

impl CronDateTime for ZonedTime {
    fn to_civil(&self) -> CivilDateTime {
        civil_of(self.0.datetime())
    }

    fn civil_weekday(&self) -> Weekday {
        Weekday::from_days_from_sunday(self.0.weekday().to_sunday_zero_offset() as u32)
    }

    fn resolve_civil(&self, civil: CivilDateTime) -> Result<Resolution<Self>, CronError> {
        let year = i16::try_from(civil.year()).map_err(|_| CronError::InvalidDate)?;
        let datetime = jiff::civil::DateTime::new(
            year,
            civil.month() as i8,
            civil.day() as i8,
            civil.hour() as i8,
            civil.minute() as i8,
            civil.second() as i8,
            0,
        )
        .map_err(|_| CronError::InvalidDate)?;
        let ambiguous = self.0.time_zone().to_ambiguous_zoned_datetime(datetime);
        Ok(match ambiguous.offset() {
            AmbiguousOffset::Unambiguous { .. } => {
                Resolution::Single(ZonedTime(ambiguous.unambiguous().map_err(|_| CronError::InvalidTime)?))
            }
            AmbiguousOffset::Fold { .. } => {
                let earlier = ambiguous.clone().earlier().map_err(|_| CronError::InvalidTime)?;
                let later = ambiguous.later().map_err(|_| CronError::InvalidTime)?;
                Resolution::Ambiguous(ZonedTime(earlier), ZonedTime(later))
            }
            AmbiguousOffset::Gap { .. } => Resolution::Gap,
        })
    }

    fn checked_add_seconds(&self, seconds: i64) -> Option<Self> {
        self.0.checked_add(SignedDuration::from_secs(seconds)).ok().map(ZonedTime)
    }

    fn cmp_instant(&self, other: &Self) -> Ordering {
        self.0.timestamp().cmp(&other.0.timestamp())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> u64 {
        text.parse::<Timestamp>().unwrap().as_millisecond() as u64
    }

    fn utc(at_ms: u64) -> String {
        Timestamp::from_millisecond(at_ms as i64).unwrap().to_string()
    }

    fn next(expression: &str, zone: &str, after: &str) -> String {
        utc(CronSchedule::parse(expression, Some(zone)).unwrap().next_after(ms(after)).unwrap())
    }

    #[test]
    fn names_macros_steps_and_seconds() {
        assert_eq!(next("0 9 * * MON", "UTC", "2026-12-01T00:00:00Z"), "2026-12-07T09:00:00Z");
        assert_eq!(next("@daily", "UTC", "2026-12-01T10:00:00Z"), "2026-12-02T00:00:00Z");
        assert_eq!(next("@hourly", "UTC", "2026-12-01T10:00:00Z"), "2026-12-01T11:00:00Z");
        assert_eq!(next("*/15 * * JAN *", "UTC", "2026-12-01T10:00:00Z"), "2027-01-01T00:00:00Z");
        assert_eq!(next("*/10 * * * * *", "UTC", "2026-12-01T10:00:05Z"), "2026-12-01T10:00:10Z");
        assert_eq!(next("0 9 * * MON", "Europe/Paris", "2026-12-01T00:00:00Z"), "2026-12-07T08:00:00Z");
        // Both days restricted: either fires (the 19th, or a Sunday); one starting with `*`: both.
        assert_eq!(next("0 7 19 * SUN", "UTC", "2026-12-01T00:00:00Z"), "2026-12-06T07:00:00Z");
        assert_eq!(next("0 7 */11 * FRI", "UTC", "2026-12-01T00:00:00Z"), "2027-01-01T07:00:00Z");
    }

    #[test]
    fn a_skipped_time_fires_at_the_next_valid_one_and_a_repeated_one_once() {
        // Europe/Paris skips 02:00-03:00 on 2026-03-29 and repeats 02:00-03:00 on 2026-10-25.
        assert_eq!(next("30 2 * * *", "Europe/Paris", "2026-03-29T00:00:00Z"), "2026-03-29T01:00:00Z");
        let schedule = CronSchedule::parse("30 2 * * *", Some("Europe/Paris")).unwrap();
        let first = schedule.next_after(ms("2026-10-24T23:00:00Z")).unwrap();
        assert_eq!(utc(first), "2026-10-25T00:30:00Z");
        assert_eq!(utc(schedule.next_after(first).unwrap()), "2026-10-26T01:30:00Z");
    }

    #[test]
    fn a_half_hour_change_lord_howe() {
        // Australia/Lord_Howe puts its clock back half an hour at 02:00 on 2026-04-05.
        assert_eq!(
            next("* 14 * * SUN", "Australia/Lord_Howe", "2026-04-04T14:45:00Z"),
            "2026-04-05T03:30:00Z"
        );
        assert_eq!(
            next("* 2 * * SUN", "Australia/Lord_Howe", "2026-04-04T14:45:00Z"),
            "2026-04-04T15:30:00Z"
        );
        // 01:45 happens twice; a fixed time fires on its first pass only.
        let schedule = CronSchedule::parse("45 1 * * *", Some("Australia/Lord_Howe")).unwrap();
        let first = schedule.next_after(ms("2026-04-04T14:00:00Z")).unwrap();
        assert_eq!(utc(first), "2026-04-04T14:45:00Z");
        assert_eq!(utc(schedule.next_after(first).unwrap()), "2026-04-05T15:15:00Z");
    }

    #[test]
    fn changes_at_midnight_and_at_a_quarter_to() {
        // America/Santiago skips 00:00-01:00 on 2026-09-06: 01:00 is valid and fires.
        assert_eq!(
            next("* 1 */5 */4 */3", "America/Santiago", "2026-08-01T22:32:10Z"),
            "2026-09-06T04:00:00Z"
        );
        // Pacific/Chatham skips 02:45-03:45 on 2026-09-27: 03:45-03:59 is valid and fires.
        assert_eq!(
            next("* 3 15-28/4 * */2", "Pacific/Chatham", "2026-09-26T13:50:00Z"),
            "2026-09-26T14:00:00Z"
        );
        // A fixed time in the skipped hour fires at the first valid time after it.
        assert_eq!(next("15 3 * * *", "Pacific/Chatham", "2026-09-26T13:50:00Z"), "2026-09-26T14:00:00Z");
    }

    #[test]
    fn the_latest_tick_at_or_before() {
        let schedule = CronSchedule::parse("0 * * * *", None).unwrap();
        assert_eq!(
            utc(schedule.latest_at_or_before(ms("2026-12-01T10:59:59Z")).unwrap()),
            "2026-12-01T10:00:00Z"
        );
        assert_eq!(
            utc(schedule.latest_at_or_before(ms("2026-12-01T10:00:00Z")).unwrap()),
            "2026-12-01T10:00:00Z"
        );
    }

    #[test]
    fn bad_expressions_and_zones_say_what_is_wrong() {
        for bad in ["", "61 * * * *", "* * * *", "0 0 * * * * *", "0 0 30 2 *", "0 9 * * FUNDAY"] {
            let error = CronSchedule::parse(bad, None).unwrap_err();
            assert!(matches!(error, ScheduleError::Cron { .. }), "{bad}: {error}");
        }
        assert_eq!(
            CronSchedule::parse("@daily", Some("Europe/Pariss")).unwrap_err(),
            ScheduleError::TimeZone("Europe/Pariss".into())
        );
    }

    #[test]
    fn fires_get_one_session_and_run_id_each() {
        let def = ScheduleDef {
            name: "daily".into(),
            cron: "@daily".parse().unwrap(),
            input: "hi".into(),
            session: None,
            missed: Missed::Latest,
        };
        let tick = ms("2026-12-01T00:00:00Z");
        assert_eq!(def.session_for(tick).as_str(), "schedule-daily-20261201T000000Z");
        let run = ScheduleDef::run_id_for("agent/daily", tick);
        assert_eq!(run, ScheduleDef::run_id_for("agent/daily", tick));
        assert_ne!(run, ScheduleDef::run_id_for("agent/daily", tick + 1));
        assert!(run.is_delayed());
    }
}
