//! The accept loop and what each connection may hold: HTTP/1.1 and HTTP/2 (cleartext, prior
//! knowledge: thousands of event streams over a few connections) on one port, a deadline for a
//! new connection's first request, an idle timeout, a cap on connections per client address,
//! and graceful shutdown.
//!
//! A connection's clock is its requests, not its bytes: it is idle while no request is in
//! flight (an open event stream is a request in flight, however quiet). A client that connects
//! and sends nothing, or keeps a connection open between requests for longer than the idle
//! timeout, is cut off, so idle sockets cannot pile up until descriptors run out.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::metrics::Metrics;

/// How many requests (event streams, mostly) one HTTP/2 connection may carry at once.
const MAX_STREAMS_PER_CONNECTION: u32 = 10_000;

/// How long an idle connection told to close may take to do so before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The limits of [`accept_loop`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) first_request: Duration,
    pub(crate) idle: Duration,
    pub(crate) per_client: Option<usize>,
}

/// Serves until `shutdown`; then ends the open streams (`closing`) and lets the connections
/// finish, for up to `grace`.
pub(crate) async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    closing: CancellationToken,
    grace: Duration,
    limits: Limits,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // hyper's header-read timeout runs from the moment an HTTP/1.1 connection waits for a
    // request's head, idle keep-alive included: the idle timeout, so that a client sending its
    // headers a byte at a time is cut off like an idle one.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.idle);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        // A peer that vanished (no FIN) stops holding its streams once pings go unanswered.
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    let clients = Arc::new(Clients::default());
    let tracker = tokio_util::task::TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, say: wait for connections to close rather than spin.
                    tracing::error!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = clients.admit(peer.ip(), limits.per_client) else {
            // Dropping the stream closes it: no request was read, so no response is owed. Not
            // logged one by one (a flood would flood the log): counted.
            metrics.connection_cut("client_cap");
            tracing::debug!(client = %peer.ip(), "refused a connection: the client holds as many as it may");
            continue;
        };
        // Events are small writes that must go out at once: without TCP_NODELAY, Nagle's
        // algorithm and the client's delayed ACK hold each for ~40 ms.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "could not set TCP_NODELAY");
        }
        let builder = builder.clone();
        let app = app.clone();
        let closing = closing.clone();
        let metrics = Arc::clone(&metrics);
        tracker.spawn(async move {
            let _open = metrics.connection_opened();
            if let Some(reason) = serve_connection(builder, stream, peer, app, closing, limits).await {
                metrics.connection_cut(reason);
            }
            drop(slot);
        });
    }
    tracing::info!("shutting down: no new requests; open streams end");
    closing.cancel();
    tracker.close();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!("connections still open at the end of the grace period");
    }
    Ok(())
}

/// Drives one connection until it ends, is idle too long, or the server shuts down. Returns why
/// the server cut it, if it did.
async fn serve_connection(
    builder: hyper_util::server::conn::auto::Builder<TokioExecutor>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Router,
    closing: CancellationToken,
    limits: Limits,
) -> Option<&'static str> {
    let activity = Arc::new(Activity::new());
    let service = {
        let activity = Arc::clone(&activity);
        hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
            let in_flight = activity.begin();
            let http1 = request.version() < axum::http::Version::HTTP_2;
            let read = Arc::new(AtomicBool::new(request.body().is_end_stream()));
            let request = request.map(|body| BodyRead { body, read: Arc::clone(&read) });
            let response = app.clone().oneshot(request);
            async move {
                let mut response = response.await?;
                // A request answered before its body was read (refused by auth, too large, the
                // wrong content type, no such route) leaves the rest of that body on the
                // connection: hyper then closes it after the answer, unless the body is small
                // enough to drain. The answer says so, so that a keep-alive client does not send
                // its next request on a connection about to close and lose it.
                if http1 && !read.load(Ordering::Relaxed) {
                    response.headers_mut().insert(
                        axum::http::header::CONNECTION,
                        axum::http::HeaderValue::from_static("close"),
                    );
                }
                // The request stays in flight until its body (an event stream, maybe) is done.
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    axum::body::Body::new(body.map_frame(move |frame| {
                        let _in_flight = &in_flight;
                        frame
                    }))
                }))
            }
        })
    };
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    tokio::pin!(connection);
    // Set once the connection was told to close because it is idle: if it has not closed by
    // then, it is dropped.
    let mut drop_at: Option<Instant> = None;
    let mut cut: Option<&'static str> = None;
    let mut shutting_down = false;
    loop {
        let deadline = drop_at.unwrap_or_else(|| activity.idle_deadline(&limits));
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    // hyper's own header-read timeout (set to the idle timeout) cut it.
                    let timed_out = error.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout);
                    if timed_out {
                        cut = cut.or(Some(activity.idle_reason()));
                    } else {
                        tracing::debug!(%error, client = %peer, "connection ended with an error");
                    }
                }
                return cut;
            }
            () = closing.cancelled(), if !shutting_down => {
                // Server shutdown: requests in flight finish (their streams end on `closing`);
                // the accept loop waits for them up to its grace period.
                shutting_down = true;
                connection.as_mut().graceful_shutdown();
            }
            () = tokio::time::sleep_until(deadline) => {
                if drop_at.is_some() {
                    return cut;
                }
                if activity.is_idle_past(&limits) {
                    tracing::debug!(client = %peer, "closing an idle connection");
                    cut = Some(activity.idle_reason());
                    if !shutting_down {
                        connection.as_mut().graceful_shutdown();
                    }
                    drop_at = Some(Instant::now() + CLOSE_GRACE);
                }
            }
        }
    }
}

/// A request's body, noting when it has been read to its end.
struct BodyRead {
    body: hyper::body::Incoming,
    read: Arc<AtomicBool>,
}

impl hyper::body::Body for BodyRead {
    type Data = axum::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(context);
        if let std::task::Poll::Ready(None) = polled {
            self.read.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let end = self.body.is_end_stream();
        if end {
            self.read.store(true, Ordering::Relaxed);
        }
        end
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection's requests: how many are in flight, and since when nothing has changed.
struct Activity {
    in_flight: AtomicUsize,
    /// Requests seen so far (0: the first request's deadline applies).
    seen: AtomicUsize,
    /// When the connection opened.
    opened: Instant,
    /// When a request last started or ended, in milliseconds after `opened`.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            in_flight: AtomicUsize::new(0),
            seen: AtomicUsize::new(0),
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let since = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(since, Ordering::Release);
    }

    fn begin(self: &Arc<Activity>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.seen.fetch_add(1, Ordering::AcqRel);
        self.touch();
        InFlight(Arc::clone(self))
    }

    /// When the connection would be idle too long, if nothing happens until then. With a
    /// request in flight it is checked again an idle period later.
    fn idle_deadline(&self, limits: &Limits) -> Instant {
        let last = self.opened + Duration::from_millis(self.last_ms.load(Ordering::Acquire));
        let limit = if self.seen.load(Ordering::Acquire) == 0 { limits.first_request } else { limits.idle };
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return Instant::now() + limits.idle;
        }
        last + limit
    }

    /// Why an idle connection is cut: before its first request, or between requests.
    fn idle_reason(&self) -> &'static str {
        if self.seen.load(Ordering::Acquire) == 0 { "first_request_timeout" } else { "idle" }
    }

    fn is_idle_past(&self, limits: &Limits) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0 && self.idle_deadline(limits) <= Instant::now()
    }
}

/// A request in flight on a connection, until dropped.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

/// Open connections per client address.
#[derive(Default)]
struct Clients {
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl Clients {
    /// A slot for a new connection from `ip`, or `None` when it holds `limit` already.
    fn admit(self: &Arc<Clients>, ip: IpAddr, limit: Option<usize>) -> Option<ClientSlot> {
        let Some(limit) = limit else { return Some(ClientSlot(None)) };
        let key = client_key(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(key).or_default();
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(ClientSlot(Some((Arc::clone(self), key))))
    }
}

/// One address's claim on a connection, given back when dropped.
struct ClientSlot(Option<(Arc<Clients>, IpAddr)>);

impl Drop for ClientSlot {
    fn drop(&mut self) {
        if let Some((clients, key)) = self.0.take() {
            let mut open = clients.open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(count) = open.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    open.remove(&key);
                }
            }
        }
    }
}

/// What the cap counts by: the IPv4 address, or the /64 of an IPv6 one (one host usually has a
/// whole /64), with IPv4-mapped IPv6 addresses counted as IPv4.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let segments = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(
                    segments[0],
                    segments[1],
                    segments[2],
                    segments[3],
                    0,
                    0,
                    0,
                    0,
                ))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_counts_per_address_and_frees_on_drop() {
        let clients = Arc::new(Clients::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = clients.admit(a, Some(2)).unwrap();
        let _second = clients.admit(a, Some(2)).unwrap();
        assert!(clients.admit(a, Some(2)).is_none());
        assert!(clients.admit(b, Some(2)).is_some());
        drop(first);
        assert!(clients.admit(a, Some(2)).is_some());
        assert!(clients.admit(a, None).is_some());
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64() {
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let other: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        assert_eq!(client_key(one), client_key(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(client_key(mapped), "10.0.0.1".parse::<IpAddr>().unwrap());
    }
}
