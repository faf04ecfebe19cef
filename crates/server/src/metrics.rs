//! `/metrics`: what the server did, in the Prometheus (OpenMetrics) text format.
//!
//! Runs by outcome and their duration, model and tool calls, tokens, HTTP requests by route and
//! status with their latency, the streams open now, the shared event log's backlog, schedule
//! fires and missed ticks, and delayed runs started and put off. Counted from the runs' events
//! as the server forwards them, from each request as it is answered, and from the trigger
//! loop's counters when the metrics are read.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::Event;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

type Labels = Vec<(&'static str, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// The server's metrics.
pub(crate) struct Metrics {
    registry: Registry,
    runs: Family<Labels, Counter>,
    run_seconds: Histogram,
    model_calls: Counter,
    model_retries: Family<Labels, Counter>,
    tool_calls: Family<Labels, Counter>,
    tokens: Family<Labels, Counter>,
    requests: Family<Labels, Counter>,
    request_seconds: HistogramFamily,
    open_streams: Gauge,
    runs_in_flight: Gauge,
    open_connections: Gauge,
    connections_cut: Family<Labels, Counter>,
    events_waiting: Gauge,
    event_append_failures: Counter,
    schedule_fires: Family<Labels, Counter>,
    schedule_missed: Family<Labels, Counter>,
    delayed_started: Counter,
    delayed_deferred: Counter,
    deliveries: Family<Labels, Counter>,
    replies: Family<Labels, Counter>,
    human: Family<Labels, Counter>,
    otel_spans_dropped: Counter,
    /// The trigger loop's counters, copied into the ones above when the metrics are read.
    triggers: Mutex<Option<Arc<keel_runtime::TriggerStats>>>,
}

fn latency_buckets() -> Histogram {
    // 1 ms to about 33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("keel");
        let runs = Family::<Labels, Counter>::default();
        registry.register(
            "runs",
            "Runs that ended, by outcome (a stop reason, `failed` or `awaiting_input`)",
            runs.clone(),
        );
        // Runs last from milliseconds (a mock) to hours (a human in the loop).
        let run_seconds = Histogram::new(exponential_buckets(0.001, 4.0, 14));
        registry.register_with_unit(
            "run_duration",
            "How long runs took, start to end or pause",
            Unit::Seconds,
            run_seconds.clone(),
        );
        let model_calls = Counter::default();
        registry.register("model_calls", "Model calls made (one per turn)", model_calls.clone());
        let model_retries = Family::<Labels, Counter>::default();
        registry.register(
            "model_retries",
            "Model call attempts that failed and were retried, by error code",
            model_retries.clone(),
        );
        let tool_calls = Family::<Labels, Counter>::default();
        registry.register(
            "tool_calls",
            "Tool calls that ended, by outcome (ok or error)",
            tool_calls.clone(),
        );
        let tokens = Family::<Labels, Counter>::default();
        registry.register("tokens", "Model tokens, by direction (input or output)", tokens.clone());
        let requests = Family::<Labels, Counter>::default();
        registry.register("http_requests", "HTTP requests answered, by route and status", requests.clone());
        let request_seconds: HistogramFamily = Family::new_with_constructor(latency_buckets);
        registry.register_with_unit(
            "http_request_duration",
            "Time to answer an HTTP request (to the first byte, for streams)",
            Unit::Seconds,
            request_seconds.clone(),
        );
        let open_streams = Gauge::default();
        registry.register("open_streams", "SSE streams open now", open_streams.clone());
        let runs_in_flight = Gauge::default();
        registry.register("runs_in_flight", "Runs this server is forwarding now", runs_in_flight.clone());
        let open_connections = Gauge::default();
        registry.register("open_connections", "Client connections open now", open_connections.clone());
        let connections_cut = Family::<Labels, Counter>::default();
        registry.register(
            "connections_cut",
            "Connections the server closed or refused, by reason (client_cap, first_request_timeout, idle)",
            connections_cut.clone(),
        );
        let events_waiting = Gauge::default();
        registry.register(
            "events_waiting",
            "Events of this instance's runs not yet in the shared event log (PostgreSQL; grows while the database is away)",
            events_waiting.clone(),
        );
        let event_append_failures = Counter::default();
        registry.register(
            "event_append_failures",
            "Appends to the shared event log that failed and were tried again",
            event_append_failures.clone(),
        );
        let schedule_fires = Family::<Labels, Counter>::default();
        registry.register(
            "schedule_fires",
            "Schedule ticks this instance fired, by schedule",
            schedule_fires.clone(),
        );
        let schedule_missed = Family::<Labels, Counter>::default();
        registry.register(
            "schedule_missed_ticks",
            "Schedule ticks that passed while no instance ran (not fired, or only the latest fired), by schedule",
            schedule_missed.clone(),
        );
        let delayed_started = Counter::default();
        registry.register(
            "delayed_runs_started",
            "Delayed runs (and schedule fires) this instance started",
            delayed_started.clone(),
        );
        let delayed_deferred = Counter::default();
        registry.register(
            "delayed_runs_deferred",
            "Delayed run starts put off because their session was busy",
            delayed_deferred.clone(),
        );
        let deliveries = Family::<Labels, Counter>::default();
        registry.register(
            "channel_deliveries",
            "Webhook deliveries by channel and outcome (claimed, duplicate, declined, handshake, bad_signature, busy, invalid; email: bounced, dropped)",
            deliveries.clone(),
        );
        let replies = Family::<Labels, Counter>::default();
        registry.register(
            "channel_replies",
            "Final answers posted back to a channel's platform, by channel and outcome (sent, failed, skipped)",
            replies.clone(),
        );
        let human = Family::<Labels, Counter>::default();
        registry.register(
            "human_inputs",
            "Approvals and questions, by kind (approval, question) and outcome (requested; approved, rejected, answered: decided over HTTP here; timed_out: nobody decided within approvals.timeout, timed out by this server)",
            human.clone(),
        );
        let otel_spans_dropped = Counter::default();
        registry.register(
            "otel_spans_dropped",
            "Spans that never reached the OTLP collector (it could not be reached, or answered an error)",
            otel_spans_dropped.clone(),
        );
        Metrics {
            registry,
            human,
            otel_spans_dropped,
            deliveries,
            replies,
            schedule_fires,
            schedule_missed,
            delayed_started,
            delayed_deferred,
            triggers: Mutex::new(None),
            runs,
            run_seconds,
            model_calls,
            model_retries,
            tool_calls,
            tokens,
            requests,
            request_seconds,
            open_streams,
            runs_in_flight,
            open_connections,
            connections_cut,
            events_waiting,
            event_append_failures,
        }
    }

    /// `count` events joined the queue for the shared event log (a negative count: they left it,
    /// stored).
    pub(crate) fn events_waiting(&self, count: i64) {
        self.events_waiting.inc_by(count);
    }

    /// An append to the shared event log failed (it is tried again).
    pub(crate) fn event_append_failed(&self) {
        self.event_append_failures.inc();
    }

    /// Counts an open connection until the guard drops.
    pub(crate) fn connection_opened(&self) -> StreamGuard {
        self.open_connections.inc();
        StreamGuard(self.open_connections.clone())
    }

    /// A connection closed or refused by the server, and why.
    pub(crate) fn connection_cut(&self, reason: &'static str) {
        self.connections_cut.get_or_create(&vec![("reason", reason.to_owned())]).inc();
    }

    /// Counts what an event says happened.
    pub(crate) fn event(&self, event: &Event) {
        match event {
            Event::TurnStart { .. } => {
                self.model_calls.inc();
            }
            Event::TurnRetry { code, .. } => {
                self.model_retries.get_or_create(&vec![("code", code.as_str().to_owned())]).inc();
            }
            Event::ToolDone { .. } => {
                self.tool_calls.get_or_create(&vec![("outcome", "ok".to_owned())]).inc();
            }
            Event::ToolError { .. } => {
                self.tool_calls.get_or_create(&vec![("outcome", "error".to_owned())]).inc();
            }
            Event::ApprovalRequested { .. } => self.human_input("approval", "requested"),
            Event::QuestionAsked { .. } => self.human_input("question", "requested"),
            Event::Usage(usage) => {
                self.tokens
                    .get_or_create(&vec![("direction", "input".to_owned())])
                    .inc_by(usage.input_tokens);
                self.tokens
                    .get_or_create(&vec![("direction", "output".to_owned())])
                    .inc_by(usage.output_tokens);
            }
            _ => {}
        }
    }

    /// An approval or a question requested, or decided.
    pub(crate) fn human_input(&self, kind: &str, outcome: &str) {
        self.human.get_or_create(&vec![("kind", kind.to_owned()), ("outcome", outcome.to_owned())]).inc();
    }

    pub(crate) fn run_started(&self) {
        self.runs_in_flight.inc();
    }

    /// A run's stream ended with `outcome` after `took`.
    pub(crate) fn run_ended(&self, outcome: &str, took: Duration) {
        self.runs_in_flight.dec();
        self.runs.get_or_create(&vec![("outcome", outcome.to_owned())]).inc();
        self.run_seconds.observe(took.as_secs_f64());
    }

    pub(crate) fn request(&self, route: &str, status: u16, took: Duration) {
        self.requests.get_or_create(&vec![("route", route.to_owned()), ("status", status.to_string())]).inc();
        self.request_seconds.get_or_create(&vec![("route", route.to_owned())]).observe(took.as_secs_f64());
    }

    /// Counts an open stream until the guard drops.
    pub(crate) fn stream_opened(&self) -> StreamGuard {
        self.open_streams.inc();
        StreamGuard(self.open_streams.clone())
    }

    /// A channel's delivery and what became of it.
    pub(crate) fn delivery(&self, channel: &str, outcome: &str) {
        self.deliveries
            .get_or_create(&vec![("channel", channel.to_owned()), ("outcome", outcome.to_owned())])
            .inc();
    }

    /// A reply to a channel's platform and what became of it.
    pub(crate) fn reply(&self, channel: &str, outcome: &str) {
        self.replies
            .get_or_create(&vec![("channel", channel.to_owned()), ("outcome", outcome.to_owned())])
            .inc();
    }

    /// Brings the timed-out approvals and questions up to the engine's counts.
    pub(crate) fn timed_out(&self, approvals: u64, questions: u64) {
        for (kind, count) in [("approval", approvals), ("question", questions)] {
            let counter = self
                .human
                .get_or_create(&vec![("kind", kind.to_owned()), ("outcome", "timed_out".to_owned())]);
            counter.inc_by(count.saturating_sub(counter.get()));
        }
    }

    /// Reports the counters of a trigger loop from now on.
    pub(crate) fn watch_triggers(&self, stats: Arc<keel_runtime::TriggerStats>) {
        *self.triggers.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stats);
    }

    /// Brings the trigger counters up to the loop's (counters only grow: each gets the
    /// difference).
    fn copy_triggers(&self) {
        let stats = self.triggers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let Some(stats) = stats else { return };
        let catch_up = |counter: &Counter, value: u64| {
            counter.inc_by(value.saturating_sub(counter.get()));
        };
        for (schedule, fires, missed) in stats.schedules() {
            let labels = vec![("schedule", schedule)];
            catch_up(&self.schedule_fires.get_or_create(&labels), fires);
            catch_up(&self.schedule_missed.get_or_create(&labels), missed);
        }
        catch_up(&self.delayed_started, stats.delayed_started.load(std::sync::atomic::Ordering::Relaxed));
        catch_up(&self.delayed_deferred, stats.delayed_deferred.load(std::sync::atomic::Ordering::Relaxed));
    }

    /// The text exposition.
    pub(crate) fn render(&self) -> String {
        self.copy_triggers();
        let dropped = keel_core::telemetry::SPANS_DROPPED.load(std::sync::atomic::Ordering::Relaxed);
        self.otel_spans_dropped.inc_by(dropped.saturating_sub(self.otel_spans_dropped.get()));
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Decrements a gauge (open streams, open connections) when dropped.
pub(crate) struct StreamGuard(Gauge);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
