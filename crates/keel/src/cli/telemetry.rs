//! OpenTelemetry export: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, the runs' spans (see `keel_runtime`'s `spans`)
//! go to that collector over OTLP/HTTP with protobuf bodies, in batches, from a thread of their
//! own: a run never waits for the collector.
//!
//! The exporter sends with keel's own HTTP client, on a small runtime of its own (the SDK's
//! batch thread is not a Tokio thread). A collector that cannot be reached costs one warning;
//! the spans of each failed batch are dropped and counted (`keel_otel_spans_dropped_total` in
//! `/metrics`), and a warning comes again once export works and fails anew.
//!
//! A keel built without the `otlp` cargo feature exports nothing, and says so once when an
//! endpoint is set.

#[cfg(feature = "otlp")]
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "otlp")]
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
#[cfg(feature = "otlp")]
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
#[cfg(feature = "otlp")]
use opentelemetry_sdk::error::OTelSdkResult;
#[cfg(feature = "otlp")]
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter};

#[cfg(feature = "otlp")]
use keel_core::env;

/// Export in progress; flushed and stopped when dropped (the end of the command).
#[cfg(feature = "otlp")]
pub(crate) struct Telemetry {
    provider: SdkTracerProvider,
    runtime: Option<tokio::runtime::Runtime>,
}

/// A build without the `otlp` feature never exports.
#[cfg(not(feature = "otlp"))]
pub(crate) enum Telemetry {}

#[cfg(feature = "otlp")]
impl Drop for Telemetry {
    fn drop(&mut self) {
        // The last spans (a `keel run`'s whole trace) go out now, or are dropped after the
        // SDK's timeout: a collector that is down never holds the exit for long.
        let _ = self.provider.shutdown();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
        }
    }
}

/// Starts export when an OTLP endpoint is set; `Ok(None)` when none is. An endpoint that
/// cannot work (a protocol keel does not speak, a URL that does not parse) is an error.
pub(crate) fn start() -> Result<Option<Telemetry>, String> {
    let var = |name: &str| std::env::var(name).ok().filter(|value| !value.trim().is_empty());
    let endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let Some(endpoint) = endpoint else { return Ok(None) };
    if var("OTEL_TRACES_EXPORTER").is_some_and(|exporter| exporter == "none") {
        return Ok(None);
    }
    #[cfg(not(feature = "otlp"))]
    {
        tracing::warn!(
            %endpoint,
            "an OTLP endpoint is set, but this keel was built without the `otlp` cargo feature: no spans are exported"
        );
        Ok(None)
    }
    #[cfg(feature = "otlp")]
    export(endpoint, var)
}

/// Starts the exporter to `endpoint`, reading the other settings with `var`.
#[cfg(feature = "otlp")]
fn export(endpoint: String, var: impl Fn(&str) -> Option<String>) -> Result<Option<Telemetry>, String> {
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"));
    match protocol.as_deref() {
        None | Some("http/protobuf") => {}
        Some(other) => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other}: keel exports spans over OTLP/HTTP with protobuf only; set it to `http/protobuf` (the collector's port 4318) or unset it"
            ));
        }
    }
    let parsed = reqwest::Url::parse(&endpoint)
        .map_err(|error| format!("the OTLP endpoint {endpoint:?} is not a URL: {error}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("the OTLP endpoint {endpoint:?} must be an http:// or https:// URL"));
    }
    let record_content = match var(env::OTEL_RECORD_CONTENT.name).as_deref() {
        None | Some("false" | "0") => false,
        Some("true" | "1") => true,
        Some(other) => {
            return Err(format!("{}={other:?}: write `true` or `false`", env::OTEL_RECORD_CONTENT.name));
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("keel-otlp")
        .enable_all()
        .build()
        .map_err(|error| format!("cannot start the span exporter: {error}"))?;
    // The providers' client settings (KEEL_CA_BUNDLE, proxies) apply to the collector too.
    let http = keel_providers::http_client().clone();
    let client = OtlpClient { http, runtime: runtime.handle().clone() };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .build()
        .map_err(|error| format!("cannot set up the OTLP exporter for {endpoint}: {error}"))?;
    let exporter = Counted { inner: exporter, endpoint, warned: AtomicBool::new(false) };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if var("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("keel");
    }
    let provider = SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    opentelemetry::global::set_tracer_provider(provider.clone());
    keel_core::telemetry::install(record_content);
    Ok(Some(Telemetry { provider, runtime: Some(runtime) }))
}

/// keel's HTTP client for the exporter: each request runs on the exporter's runtime.
#[cfg(feature = "otlp")]
#[derive(Debug)]
struct OtlpClient {
    http: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[cfg(feature = "otlp")]
#[async_trait::async_trait]
impl HttpClient for OtlpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let mut request = reqwest::Request::try_from(request)?;
        // The SDK gives up on a batch after its own timeout; the request does not outlive it.
        request.timeout_mut().get_or_insert(std::time::Duration::from_secs(10));
        let http = self.http.clone();
        let sent = self.runtime.spawn(async move {
            let response = http.execute(request).await?;
            let mut answer = Response::builder().status(response.status());
            for (name, value) in response.headers() {
                answer = answer.header(name, value);
            }
            let body = response.bytes().await?;
            Ok::<_, HttpError>(answer.body(body)?)
        });
        sent.await?
    }
}

/// The OTLP exporter, counting the spans of the batches it could not deliver and warning
/// once per outage.
#[cfg(feature = "otlp")]
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    endpoint: String,
    warned: AtomicBool,
}

#[cfg(feature = "otlp")]
impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                if self.warned.swap(false, Ordering::Relaxed) {
                    tracing::info!(endpoint = %self.endpoint, "spans are reaching the OTLP collector again");
                }
            }
            Err(error) => {
                keel_core::telemetry::SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        %error,
                        "cannot send spans to the OTLP collector; they are dropped (counted in keel_otel_spans_dropped_total) until it answers"
                    );
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}
