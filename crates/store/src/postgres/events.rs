//! The shared event log on PostgreSQL: an event table tailed per session, woken by
//! `LISTEN`/`NOTIFY`.
//!
//! **Why both.** A notification alone is lost when no one listens at that moment (a reconnect, a
//! subscriber arriving a second later) and carries at most 8000 bytes; a table alone must be
//! polled, which costs a query per session per poll and adds the poll period to every event's
//! latency. So the events are rows (`events`), which a reader reads after the last number it has
//! seen, exactly; and each append notifies the sessions it grew (`keel_events`, payload
//! `<process> <session>`), which tells the other processes when to read, at once. A listener
//! that reconnects reads every session it follows again, so a notification lost meanwhile
//! costs nothing.
//!
//! **Order.** An append bumps its sessions' rows in `event_heads` (in session order, so two
//! appends never deadlock) and numbers its events from there. The row stays locked until the
//! append commits, so the appends of one session commit in the order of their numbers: a reader
//! that sees number `n` has every number below it, and "after my last number" never skips one.
//!
//! **Idempotence.** An append's first write is its batch id (`event_batches`); an attempt that
//! finds it there was committed before (its answer was lost with the connection) and appends
//! nothing. Batches and events are pruned together by age.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use keel_core::event_log::OnWake;
use keel_core::{BoxFuture, EventLog, LogWake, LoggedEvent, NewEvent, SessionId, StoreError};
use postgres::fallible_iterator::FallibleIterator;

use super::{Connection, Jobs, Queued, Setup, Worker, get, submit_raw};
use crate::backend::stored_run_id;

/// The notification channel (also named in [`APPEND`]).
const CHANNEL: &str = "keel_events";

/// How often the listener checks, with no notification coming, that its connection still works
/// (a blocked port shows no error on its own).
const LISTENER_PING: Duration = Duration::from_secs(5);

/// The event log of a [`super::Postgres`] store. See the module docs.
pub(crate) struct PgEventLog {
    jobs: Jobs,
    setup: Arc<Setup>,
    /// This process's name in notifications, so that its own appends do not wake it.
    instance: Arc<str>,
    /// Lives as long as the log: the listener thread stops when it is gone.
    alive: Arc<()>,
    /// The connection appends go through, opened on first use: a writer appends one batch at
    /// a time, and on its own connection its appends never queue behind the store's commits.
    appender: std::sync::OnceLock<Jobs>,
}

impl PgEventLog {
    pub(crate) fn new(jobs: Jobs, setup: Arc<Setup>) -> PgEventLog {
        PgEventLog {
            jobs,
            setup,
            instance: format!("{:016x}", fastrand::u64(..)).into(),
            alive: Arc::new(()),
            appender: std::sync::OnceLock::new(),
        }
    }

    /// The appending connection's queue (its thread ends when the log is dropped).
    fn appender(&self) -> &Jobs {
        self.appender.get_or_init(|| {
            let (jobs, queue) = std::sync::mpsc::channel::<Queued>();
            let worker = Worker::new(Arc::clone(&self.setup));
            let spawned = std::thread::Builder::new()
                .name("keel-postgres-events".into())
                .spawn(move || worker.serve(&Mutex::new(queue)));
            if let Err(error) = spawned {
                // Appends then fail (their queue has no reader) and are tried again.
                tracing::error!(%error, "cannot start the thread that appends events");
            }
            jobs
        })
    }
}

impl EventLog for PgEventLog {
    fn append(
        &self,
        batch: u64,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'static, Result<Option<Vec<u64>>, StoreError>> {
        let instance = Arc::clone(&self.instance);
        submit_raw(self.appender(), Box::new(move |connection| append(connection, batch, &events, &instance)))
    }

    fn read_after(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> BoxFuture<'static, Result<Vec<LoggedEvent>, StoreError>> {
        let session = session.clone();
        submit_raw(
            &self.jobs,
            Box::new(move |connection| {
                let after = i64::try_from(after).unwrap_or(i64::MAX);
                let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                let rows = connection.query(
                    "SELECT seq, run_id, body FROM events WHERE session_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                    &[&session.as_str(), &after, &limit],
                )?;
                rows.iter().map(|row| logged(row, 0)).collect()
            }),
        )
    }

    fn read_recent(
        &self,
        session: &SessionId,
        limit: usize,
    ) -> BoxFuture<'static, Result<(u64, Vec<LoggedEvent>), StoreError>> {
        let session = session.clone();
        submit_raw(
            &self.jobs,
            Box::new(move |connection| {
                // One statement: the head and the events from one snapshot.
                let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                let rows = connection.query(
                    "SELECT h.last_seq, e.seq, e.run_id, e.body
                     FROM (SELECT last_seq FROM event_heads WHERE session_id = $1) h
                     LEFT JOIN LATERAL (
                         SELECT seq, run_id, body FROM events WHERE session_id = $1 ORDER BY seq DESC LIMIT $2
                     ) e ON true",
                    &[&session.as_str(), &limit],
                )?;
                let Some(first) = rows.first() else {
                    return Ok((0, Vec::new()));
                };
                let head = seq(get::<i64>(first, 0)?)?;
                let mut events = Vec::with_capacity(rows.len());
                for row in &rows {
                    // A head with no events left (all pruned) joins one row of NULLs.
                    if get::<Option<i64>>(row, 1)?.is_some() {
                        events.push(logged(row, 1)?);
                    }
                }
                events.reverse();
                Ok((head, events))
            }),
        )
    }

    fn watch(&self, on_wake: OnWake) -> Result<(), StoreError> {
        let listener = Listener {
            setup: Arc::clone(&self.setup),
            instance: Arc::clone(&self.instance),
            alive: Arc::downgrade(&self.alive),
            on_wake,
        };
        std::thread::Builder::new()
            .name("keel-postgres-listen".into())
            .spawn(move || listener.run())
            .map(drop)
            .map_err(|e| StoreError::Unavailable(format!("cannot start the PostgreSQL listener thread: {e}")))
    }

    fn prune(&self, older_than_ms: u64) -> BoxFuture<'static, Result<u64, StoreError>> {
        submit_raw(
            &self.jobs,
            Box::new(move |connection| {
                // Seconds as a float: `make_interval` takes them so.
                #[allow(clippy::cast_precision_loss, reason = "milliseconds of an age, far below 2^52")]
                let seconds = older_than_ms as f64 / 1000.0;
                let pruned = connection.execute(
                    "DELETE FROM events WHERE at < now() - make_interval(secs => $1)",
                    &[&seconds],
                )?;
                connection.execute(
                    "DELETE FROM event_batches WHERE at < now() - make_interval(secs => $1)",
                    &[&seconds],
                )?;
                Ok(pruned)
            }),
        )
    }
}

/// One append, as one statement (one round trip, its own transaction): claim the batch id,
/// bump the sessions' heads (in session order), insert the events numbered from them, notify
/// the sessions. Returns nothing when the batch was claimed before.
const APPEND: &str = r#"
WITH claimed AS (
    INSERT INTO event_batches (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id
), added AS (
    SELECT s COLLATE "C" AS s, count(*) AS n FROM unnest($2::text[]) AS u(s) GROUP BY 1
), heads AS (
    INSERT INTO event_heads AS h (session_id, last_seq)
    SELECT s, n FROM added, claimed ORDER BY s
    ON CONFLICT (session_id) DO UPDATE SET last_seq = h.last_seq + excluded.last_seq
    RETURNING session_id, last_seq
), numbered AS (
    SELECT e.ord, e.s, e.run, e.body,
           heads.last_seq - added.n + row_number() OVER (PARTITION BY e.s ORDER BY e.ord) AS seq
    FROM unnest($2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS e(s, run, body, ord)
    JOIN heads ON heads.session_id = e.s COLLATE "C"
    JOIN added ON added.s = e.s COLLATE "C"
), inserted AS (
    INSERT INTO events (session_id, seq, run_id, body) SELECT s, seq, run, body FROM numbered
), notified AS (
    SELECT count(pg_notify('keel_events', $5 || ' ' || session_id)) AS n FROM heads
)
SELECT numbered.seq, notified.n FROM numbered, notified ORDER BY numbered.ord"#;

/// One append: see the module docs and [`APPEND`].
fn append(
    connection: &mut Connection<'_>,
    batch: u64,
    events: &[NewEvent],
    instance: &str,
) -> Result<Option<Vec<u64>>, StoreError> {
    if events.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let batch = i64::from_ne_bytes(batch.to_ne_bytes());
    let sessions: Vec<&str> = events.iter().map(|e| e.session.as_str()).collect();
    let runs: Vec<&str> = events.iter().map(|e| e.run.as_str()).collect();
    let bodies: Vec<Option<&str>> = events.iter().map(|e| e.body.as_deref()).collect();
    let rows = connection.query(APPEND, &[&batch, &sessions, &runs, &bodies, &instance])?;
    if rows.is_empty() {
        // Appended by an earlier attempt whose answer was lost.
        return Ok(None);
    }
    if rows.len() != events.len() {
        return Err(StoreError::Corrupt(format!(
            "{}: appending {} events numbered {}",
            connection.setup.shown,
            events.len(),
            rows.len()
        )));
    }
    rows.iter().map(|row| seq(get(row, 0)?)).collect::<Result<Vec<u64>, StoreError>>().map(Some)
}

fn seq(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::Corrupt(format!("a negative event number {value} in keel.events")))
}

/// The event in columns `first..first + 3` (seq, run id, body) of `row`.
fn logged(row: &postgres::Row, first: usize) -> Result<LoggedEvent, StoreError> {
    let run: String = get(row, first + 1)?;
    Ok(LoggedEvent {
        seq: seq(get(row, first)?)?,
        run: stored_run_id(&run)?,
        body: get::<Option<String>>(row, first + 2)?.map(Arc::from),
    })
}

/// The thread that listens for other processes' appends.
struct Listener {
    setup: Arc<Setup>,
    instance: Arc<str>,
    alive: Weak<()>,
    on_wake: OnWake,
}

impl Listener {
    fn run(self) {
        let mut backoff = Duration::from_millis(100);
        let mut reported = false;
        while self.alive.strong_count() > 0 {
            match self.listen() {
                Ok(()) => return,
                Err(error) => {
                    // Said once per outage, not once per attempt.
                    if !reported {
                        tracing::warn!(%error, "live events from other instances paused; reconnecting");
                        reported = true;
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Listens until the log is dropped (`Ok`) or the connection fails.
    fn listen(&self) -> Result<(), StoreError> {
        let mut client = self.setup.open()?;
        let fail = |error: &postgres::Error| super::map_error(error, &self.setup.shown);
        client.batch_execute(&format!("LISTEN {CHANNEL}")).map_err(|e| fail(&e))?;
        // Anything appended while no one listened is read again now.
        (self.on_wake)(LogWake::All);
        let mut pinged = Instant::now();
        loop {
            if self.alive.strong_count() == 0 {
                return Ok(());
            }
            {
                let mut notifications = client.notifications();
                let mut waiting = notifications.timeout_iter(Duration::from_millis(500));
                while let Some(notification) = waiting.next().map_err(|e| fail(&e))? {
                    let Some((from, session)) = notification.payload().split_once(' ') else {
                        continue;
                    };
                    if from == &*self.instance {
                        continue;
                    }
                    if let Ok(session) = SessionId::from_store(session) {
                        (self.on_wake)(LogWake::Session(&session));
                    }
                }
            }
            if pinged.elapsed() >= LISTENER_PING {
                client.simple_query("SELECT 1").map_err(|e| fail(&e))?;
                pinged = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use keel_core::{RunId, Store};
    use keel_testkit::postgres::ScratchDatabase;

    use super::*;
    use crate::{PostgresOptions, PostgresStore};

    fn event(session: &SessionId, run: &RunId, body: Option<&str>) -> NewEvent {
        NewEvent { session: session.clone(), run: run.clone(), body: body.map(Arc::from) }
    }

    fn bodies(events: &[LoggedEvent]) -> Vec<(u64, Option<&str>)> {
        events.iter().map(|e| (e.seq, e.body.as_deref())).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appenders_on_two_stores_number_each_session_in_commit_order_once() {
        let database = ScratchDatabase::create("event_log");
        let one = PostgresStore::connect(&database.url, PostgresOptions::default()).unwrap();
        let two = PostgresStore::connect(&database.url, PostgresOptions::default()).unwrap();
        let (log_one, log_two) = (one.event_log().unwrap(), two.event_log().unwrap());
        let (a, b) = (SessionId::new("a").unwrap(), SessionId::new("b").unwrap());
        let run = RunId::from_suffix("r");

        // Two processes watch: each is woken by the other's appends only.
        let woken: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = Arc::clone(&woken);
        log_two
            .watch(Box::new(move |wake| {
                let name = match wake {
                    LogWake::All => "*".to_owned(),
                    LogWake::Session(session) => session.to_string(),
                };
                seen.lock().unwrap().push(name);
            }))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while woken.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "the watch never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(*woken.lock().unwrap(), ["*"], "a watch starts by waking every session");

        let seqs = log_one
            .append(1, vec![event(&a, &run, Some("a1")), event(&b, &run, Some("b1")), event(&a, &run, None)])
            .await
            .unwrap();
        assert_eq!(seqs, Some(vec![1, 1, 2]), "each session is numbered on its own");
        assert_eq!(
            log_one.append(1, vec![event(&a, &run, Some("again"))]).await.unwrap(),
            None,
            "a batch is appended once"
        );
        assert_eq!(log_two.append(2, vec![event(&a, &run, Some("a3"))]).await.unwrap(), Some(vec![3]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while woken.lock().unwrap().len() < 3 {
            assert!(
                Instant::now() < deadline,
                "no wake-up for another process's append: {:?}",
                woken.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut names = woken.lock().unwrap().clone();
        names[1..].sort();
        assert_eq!(names, ["*", "a", "b"], "woken by the other process's append, not by its own");

        let all = log_two.read_after(&a, 0, 10).await.unwrap();
        assert_eq!(bodies(&all), [(1, Some("a1")), (2, None), (3, Some("a3"))]);
        assert_eq!(bodies(&log_one.read_after(&a, 2, 10).await.unwrap()), [(3, Some("a3"))]);
        assert_eq!(bodies(&log_one.read_after(&a, 0, 1).await.unwrap()), [(1, Some("a1"))]);
        let (head, recent) = log_one.read_recent(&a, 2).await.unwrap();
        assert_eq!((head, bodies(&recent)), (3, vec![(2, None), (3, Some("a3"))]));
        assert_eq!(log_one.read_recent(&SessionId::new("none").unwrap(), 5).await.unwrap(), (0, vec![]));

        // Concurrent appends to one session from both processes: every number once, in order.
        let appends: Vec<_> = (0..20u64)
            .map(|i| {
                let log = if i % 2 == 0 { Arc::clone(&log_one) } else { Arc::clone(&log_two) };
                let events = (0..5).map(|_| event(&b, &run, Some("x"))).collect();
                tokio::spawn(async move { log.append(100 + i, events).await.unwrap().unwrap() })
            })
            .collect();
        let mut numbers = Vec::new();
        for append in appends {
            numbers.extend(append.await.unwrap());
        }
        numbers.sort_unstable();
        assert_eq!(numbers, (2..=101).collect::<Vec<u64>>());

        // Pruned: the events go, the numbering goes on.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(log_one.prune(1).await.unwrap(), 104);
        assert_eq!(log_one.read_recent(&a, 5).await.unwrap(), (3, vec![]));
        assert_eq!(log_one.append(3, vec![event(&a, &run, Some("a4"))]).await.unwrap(), Some(vec![4]));
        // A deleted session's events go with it.
        assert!(!one.delete_session(&a).await.unwrap());
        assert_eq!(log_two.read_after(&a, 0, 10).await.unwrap(), vec![]);
    }
}
