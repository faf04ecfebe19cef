//! The browser's only way out: an HTTP proxy on 127.0.0.1 that applies the SSRF guard of
//! `http_request` ([`crate::net`]) to every connection a page makes — navigations, sub-requests,
//! iframes, `fetch`, WebSockets, redirects — since Chromium sends each through it (`CONNECT
//! host:port` for TLS and WebSockets, an absolute URL for plain HTTP). The proxy resolves the
//! host itself, refuses when any address is not allowed, and connects to exactly the addresses
//! it checked: a name that resolves to loopback, or rebinds between two lookups, gets nowhere.
//!
//! Each page gets a proxy of its own (its browser context's), which counts the bytes it hands
//! the page and cuts every connection past the page's cap, and remembers what it refused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use url::Url;

use crate::net::{Lookup, NetPolicy, Refusal};

/// The longest request head the proxy reads (a request line and headers).
const MAX_HEAD: usize = 64 * 1024;
/// How many refusals a page remembers.
const MAX_REFUSALS: usize = 50;

/// What a page's proxy saw.
#[derive(Default)]
pub(crate) struct Traffic {
    /// Bytes handed to the page so far.
    pub(crate) bytes: AtomicU64,
    /// Set when the page went past its byte cap (every connection is cut from then on).
    pub(crate) over_cap: AtomicBool,
    /// What was refused, and why.
    pub(crate) refused: Mutex<Vec<(String, Refusal)>>,
}

impl Traffic {
    fn refuse(&self, target: &str, refusal: &Refusal) {
        let mut refused = self.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if refused.len() < MAX_REFUSALS && !refused.iter().any(|(t, _)| t == target) {
            refused.push((target.to_owned(), refusal.clone()));
        }
    }

    /// The refusal of `host`, if the proxy refused it.
    pub(crate) fn refusal_of(&self, host: &str) -> Option<Refusal> {
        let refused = self.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        refused.iter().find(|(target, _)| target_host(target) == host).map(|(_, refusal)| refusal.clone())
    }
}

/// `host` of `host:port` (brackets of an IPv6 literal kept).
fn target_host(target: &str) -> &str {
    target.rsplit_once(':').map_or(target, |(host, _)| host)
}

/// A running proxy; it stops when dropped.
pub(crate) struct GuardProxy {
    pub(crate) address: SocketAddr,
    pub(crate) traffic: Arc<Traffic>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GuardProxy {
    fn drop(&mut self) {
        // The accept loop and, through their abort handles, the connections it relays.
        self.task.abort();
    }
}

impl GuardProxy {
    /// Starts a proxy enforcing `policy` over `lookup`, handing at most `cap` bytes to the page.
    pub(crate) async fn start(
        policy: Arc<NetPolicy>,
        lookup: Arc<dyn Lookup>,
        cap: u64,
    ) -> std::io::Result<GuardProxy> {
        GuardProxy::serve(Some(policy), lookup, cap).await
    }

    /// A proxy that lets nothing through: the browser's default context, which no page uses,
    /// reaches nothing (Chromium's own background requests included).
    pub(crate) async fn refusing() -> std::io::Result<GuardProxy> {
        GuardProxy::serve(None, Arc::new(crate::net::SystemLookup), 0).await
    }

    async fn serve(
        policy: Option<Arc<NetPolicy>>,
        lookup: Arc<dyn Lookup>,
        cap: u64,
    ) -> std::io::Result<GuardProxy> {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let traffic = Arc::new(Traffic::default());
        let shared = traffic.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else { continue };
                let (policy, lookup, traffic) = (policy.clone(), lookup.clone(), shared.clone());
                connections.spawn(async move {
                    let _ = match &policy {
                        Some(policy) => relay(client, policy, lookup.as_ref(), &traffic, cap).await,
                        None => {
                            let mut client = client;
                            respond(
                                &mut client,
                                403,
                                "refused: the browser's default context reaches nothing",
                            )
                            .await
                        }
                    };
                });
                // Reap the finished ones, so the set does not grow with a long page.
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(GuardProxy { address, traffic, task })
    }

    /// The proxy's URL, as Chromium takes it.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.address)
    }
}

/// Serves one connection from the browser: reads the request head, checks where it goes,
/// connects there, and relays both ways, counting what comes back.
async fn relay(
    mut client: TcpStream,
    policy: &NetPolicy,
    lookup: &dyn Lookup,
    traffic: &Traffic,
    cap: u64,
) -> std::io::Result<()> {
    let (head, rest) = read_head(&mut client).await?;
    let Some(request) = parse_head(&head) else {
        return respond(&mut client, 400, "keel's browser proxy cannot read this request").await;
    };
    let (target, url) = match &request {
        Request::Connect { target } => (target.clone(), format!("https://{target}/")),
        Request::Plain { url, .. } => {
            let port = url.port_or_known_default().unwrap_or(80);
            (format!("{}:{port}", url.host_str().unwrap_or_default()), url.to_string())
        }
    };
    let addresses = match check(policy, lookup, &url).await {
        Ok(addresses) => addresses,
        Err(refusal) => {
            traffic.refuse(&target, &refusal);
            return respond(&mut client, 403, &refusal.0).await;
        }
    };
    let Ok(mut upstream) = TcpStream::connect(&addresses[..]).await else {
        return respond(&mut client, 502, "keel's browser proxy cannot connect there").await;
    };
    match request {
        Request::Connect { .. } => {
            client.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n").await?;
            upstream.write_all(&rest).await?;
            tunnel(client, upstream, traffic, cap).await
        }
        Request::Plain { head, body, .. } => {
            // One request per connection: its body as long as it says, then nothing more of the
            // browser's is forwarded, and the answer tells the browser to close (a request it
            // sent after it on this connection, for another host, never goes unchecked).
            let Some(length) = body else {
                return respond(&mut client, 501, "keel's browser proxy does not forward chunked uploads")
                    .await;
            };
            upstream.write_all(&head).await?;
            let mut sent = rest.len().min(length);
            upstream.write_all(&rest[..sent]).await?;
            let mut chunk = [0u8; 16 * 1024];
            while sent < length {
                let n = client.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                let take = n.min(length - sent);
                upstream.write_all(&chunk[..take]).await?;
                sent += take;
            }
            let (answer_head, answer_rest) = read_head(&mut upstream).await?;
            let answer_head = closing(&answer_head);
            client.write_all(&answer_head).await?;
            traffic.bytes.fetch_add((answer_head.len() + answer_rest.len()) as u64, Ordering::SeqCst);
            client.write_all(&answer_rest).await?;
            let (_, mut client_write) = client.into_split();
            let (mut upstream_read, _upstream_write) = upstream.into_split();
            download(&mut upstream_read, &mut client_write, traffic, cap).await;
            Ok(())
        }
    }
}

/// A response head with `Connection: close` instead of what it said about the connection.
fn closing(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::with_capacity(text.len() + 20);
    for line in text.split("\r\n").filter(|line| !line.is_empty()) {
        let name = line.split(':').next().unwrap_or_default().trim();
        if ["connection", "keep-alive", "proxy-connection"].iter().any(|hop| name.eq_ignore_ascii_case(hop)) {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

/// The addresses `url` may be reached at, all of them checked.
async fn check(policy: &NetPolicy, lookup: &dyn Lookup, url: &str) -> Result<Vec<SocketAddr>, Refusal> {
    let url = Url::parse(url)
        .map_err(|error| Refusal(format!("refused: not a URL the browser may reach ({error})")))?;
    policy.check_url(&url)?;
    let port = url.port_or_known_default().unwrap_or(443);
    let ips = match url.host() {
        Some(url::Host::Ipv4(ip)) => vec![std::net::IpAddr::V4(ip)],
        Some(url::Host::Ipv6(ip)) => vec![std::net::IpAddr::V6(ip)],
        Some(url::Host::Domain(host)) => {
            let ips = lookup
                .lookup(host)
                .await
                .map_err(|error| Refusal(format!("cannot resolve {host}: {error}")))?;
            for ip in &ips {
                policy.check_ip(*ip, host)?;
            }
            ips
        }
        None => return Err(Refusal("refused: the URL has no host".into())),
    };
    if ips.is_empty() {
        return Err(Refusal(format!("{} has no address", url.host_str().unwrap_or_default())));
    }
    Ok(ips.into_iter().map(|ip| SocketAddr::new(ip, port)).collect())
}

/// A tunnel both ways until either side closes; what comes back is counted, and past `cap`
/// for the page every connection is cut.
async fn tunnel(client: TcpStream, upstream: TcpStream, traffic: &Traffic, cap: u64) -> std::io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut upstream_read, mut upstream_write) = upstream.into_split();
    let out = async {
        let _ = tokio::io::copy(&mut client_read, &mut upstream_write).await;
        let _ = upstream_write.shutdown().await;
    };
    // The download side decides: when it ends (or is cut), the connection is over.
    tokio::select! {
        () = download(&mut upstream_read, &mut client_write, traffic, cap) => {}
        () = async { out.await; std::future::pending::<()>().await } => {}
    }
    Ok(())
}

/// Copies what the origin sends to the browser, counting it against the page's cap.
async fn download(
    upstream: &mut (impl tokio::io::AsyncRead + Unpin),
    client: &mut (impl tokio::io::AsyncWrite + Unpin),
    traffic: &Traffic,
    cap: u64,
) {
    let mut buffer = vec![0u8; 32 * 1024];
    loop {
        if traffic.over_cap.load(Ordering::SeqCst) {
            break;
        }
        let n = match upstream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let total = traffic.bytes.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
        if total > cap {
            traffic.over_cap.store(true, Ordering::SeqCst);
            break;
        }
        if client.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
    let _ = client.shutdown().await;
}

/// A request the browser sends its proxy.
enum Request {
    /// `CONNECT host:port`: a tunnel (TLS, or a WebSocket).
    Connect { target: String },
    /// A plain-HTTP request with an absolute URL, its head rewritten for the origin, and the
    /// length of its body (`None`: chunked, which the proxy does not forward).
    Plain { url: Url, head: Vec<u8>, body: Option<usize> },
}

/// Reads up to the end of the request head; returns it and what came after it.
async fn read_head(client: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buffer = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(&buffer, b"\r\n\r\n") {
            let rest = buffer.split_off(end + 4);
            return Ok((buffer, rest));
        }
        if buffer.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too long"));
        }
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

/// The request of `head`: a CONNECT's target, or a plain request rewritten to the origin form
/// (`GET /path`), without the proxy's headers, closed after its answer (a proxy connection the
/// browser reused for another host would otherwise reach the first one).
fn parse_head(head: &[u8]) -> Option<Request> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let first = lines.next()?;
    let mut words = first.split(' ');
    let (method, target, version) = (words.next()?, words.next()?, words.next()?);
    if method.eq_ignore_ascii_case("CONNECT") {
        // `host:port`, the port required.
        let (_, port) = target.rsplit_once(':')?;
        port.parse::<u16>().ok()?;
        return Some(Request::Connect { target: target.to_owned() });
    }
    let url = Url::parse(target).ok()?;
    if url.scheme() != "http" {
        return None;
    }
    let mut path = url.path().to_owned();
    if let Some(query) = url.query() {
        path.push('?');
        path.push_str(query);
    }
    let mut rewritten = format!("{method} {path} {version}\r\n");
    let mut body = Some(0);
    for line in lines.filter(|line| !line.is_empty()) {
        let (name, value) = line.split_once(':').unwrap_or((line, ""));
        let name = name.trim();
        if name.eq_ignore_ascii_case("content-length") {
            body = Some(value.trim().parse().ok()?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            body = None;
        }
        if ["proxy-connection", "proxy-authorization", "connection", "keep-alive"]
            .iter()
            .any(|hop| name.eq_ignore_ascii_case(hop))
        {
            continue;
        }
        rewritten.push_str(line);
        rewritten.push_str("\r\n");
    }
    rewritten.push_str("Connection: close\r\n\r\n");
    Some(Request::Plain { url, head: rewritten.into_bytes(), body })
}

async fn respond(client: &mut TcpStream, status: u16, message: &str) -> std::io::Result<()> {
    let reason = match status {
        403 => "Forbidden",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        _ => "Bad Request",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{message}",
        message.len()
    );
    client.write_all(response.as_bytes()).await?;
    client.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_request_is_rewritten_for_the_origin_and_closed_after() {
        let head = b"GET http://example.com:8080/a/b?c=1 HTTP/1.1\r\nHost: example.com:8080\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n";
        let Some(Request::Plain { url, head, body }) = parse_head(head) else { panic!("not plain") };
        assert_eq!(body, Some(0));
        assert_eq!(url.as_str(), "http://example.com:8080/a/b?c=1");
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "GET /a/b?c=1 HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        let Some(Request::Connect { target }) = parse_head(b"CONNECT example.com:443 HTTP/1.1\r\n\r\n")
        else {
            panic!("not connect")
        };
        assert_eq!(target, "example.com:443");
        assert!(parse_head(b"CONNECT example.com HTTP/1.1\r\n\r\n").is_none(), "a CONNECT names its port");
        assert!(parse_head(b"GET /relative HTTP/1.1\r\n\r\n").is_none(), "a proxy takes absolute URLs");
        assert!(parse_head(b"GET ftp://example.com/ HTTP/1.1\r\n\r\n").is_none());
        let post = b"POST http://example.com/form HTTP/1.1\r\nContent-Length: 12\r\n\r\n";
        assert!(matches!(parse_head(post), Some(Request::Plain { body: Some(12), .. })));
        let chunked = b"POST http://example.com/form HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(parse_head(chunked), Some(Request::Plain { body: None, .. })));
    }

    #[test]
    fn an_answer_tells_the_browser_to_close_the_connection() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n";
        assert_eq!(
            String::from_utf8(closing(head)).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n\r\n"
        );
    }
}
