//! keel-testkit: a scripted HTTP/1.1 server that plays model providers' wire formats and scratch
//! PostgreSQL databases ([`postgres`]) for keel's tests, and callgrind's instruction counts for
//! its benchmarks ([`callgrind`]); not published.
//!
//! A [`WireServer`] answers each request with the next [`Reply`] of its script, byte for byte:
//! status, headers, and a body sent in the pieces the test chooses (each piece is one HTTP
//! chunk, written and flushed on its own, so a client really sees a multi-byte character or a
//! JSON object cut in two). A reply can end cleanly, be cut by a TCP reset mid-body, or hang.
//! Every request is recorded (method, path, headers, body) so tests can assert exactly what
//! keel sent. Transcripts recorded from real servers and written from the providers' API
//! references live in `transcripts/` ([`transcript`]).

pub mod callgrind;
pub mod postgres;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A request the server received.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// `POST`, `GET`...
    pub method: String,
    /// The path and query.
    pub path: String,
    /// Header names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body's bytes.
    pub body: Vec<u8>,
}

impl Recorded {
    /// The value of a header (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON (panics when it is not: a test failure).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!("request body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body))
        })
    }
}

/// How a reply's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The body ends properly; the connection stays open for the next request.
    Complete,
    /// The connection is reset (TCP RST) after the last piece, with the body unfinished.
    Reset,
    /// The server stops sending and never ends the body.
    Hang,
}

/// One scripted answer.
#[derive(Clone, Debug)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    pieces: Vec<Vec<u8>>,
    pause: Duration,
    end: End,
}

impl Reply {
    /// A reply with this status and body in one piece.
    pub fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            status,
            headers: vec![("content-type".into(), content_type.into())],
            pieces: vec![body.into()],
            pause: Duration::ZERO,
            end: End::Complete,
        }
    }

    /// `200 text/event-stream` with this body.
    pub fn sse(body: impl Into<Vec<u8>>) -> Reply {
        Reply::new(200, "text/event-stream", body)
    }

    /// `200 application/x-ndjson` with this body.
    pub fn ndjson(body: impl Into<Vec<u8>>) -> Reply {
        Reply::new(200, "application/x-ndjson", body)
    }

    /// A JSON body with this status.
    pub fn json(status: u16, body: &Value) -> Reply {
        Reply::new(status, "application/json", body.to_string())
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }

    /// Sends the body in pieces of `size` bytes (cutting through lines and characters).
    pub fn in_pieces_of(mut self, size: usize) -> Reply {
        let body: Vec<u8> = self.pieces.concat();
        self.pieces = body.chunks(size.max(1)).map(<[u8]>::to_vec).collect();
        self
    }

    /// Sends the body in the pieces given (their concatenation replaces the body).
    pub fn pieces(mut self, pieces: &[&[u8]]) -> Reply {
        self.pieces = pieces.iter().map(|p| p.to_vec()).collect();
        self
    }

    /// Waits this long before each piece.
    pub fn pause(mut self, pause: Duration) -> Reply {
        self.pause = pause;
        self
    }

    /// Keeps only the first `bytes` of the body and resets the connection after them.
    pub fn reset_after(mut self, bytes: usize) -> Reply {
        let body: Vec<u8> = self.pieces.concat();
        self.pieces = vec![body[..bytes.min(body.len())].to_vec()];
        self.end = End::Reset;
        self
    }

    /// Keeps only the first `bytes` of the body, then never sends more.
    pub fn hang_after(mut self, bytes: usize) -> Reply {
        let body: Vec<u8> = self.pieces.concat();
        self.pieces = vec![body[..bytes.min(body.len())].to_vec()];
        self.end = End::Hang;
        self
    }
}

/// A transcript file of `transcripts/`.
pub fn transcript(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("transcripts").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Answers a request from what it says (a fake model that reads the conversation).
pub type Responder = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

struct State {
    script: Vec<Reply>,
    next: usize,
    requests: Vec<Recorded>,
    responder: Option<Responder>,
}

/// A scripted server on `127.0.0.1`, stopped when dropped.
pub struct WireServer {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl WireServer {
    /// Starts a server that answers requests with `script`, in order; a request past the end
    /// of the script gets a 500 that says so.
    pub async fn start(script: Vec<Reply>) -> WireServer {
        WireServer::serving(State { script, next: 0, requests: Vec::new(), responder: None }).await
    }

    /// Starts a server that answers every request with what `respond` makes of it.
    pub async fn responding(respond: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> WireServer {
        let state =
            State { script: Vec::new(), next: 0, requests: Vec::new(), responder: Some(Arc::new(respond)) };
        WireServer::serving(state).await
    }

    async fn serving(state: State) -> WireServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local address");
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone()));
            }
        });
        WireServer { addr, state, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().expect("lock").requests.clone()
    }

    /// The one request received (panics when there were more or fewer).
    pub fn only_request(&self) -> Recorded {
        let requests = self.requests();
        assert_eq!(requests.len(), 1, "expected one request, got {}", requests.len());
        requests.into_iter().next().expect("one")
    }
}

impl Drop for WireServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let _ = stream.set_nodelay(true);
    let mut buffer = Vec::new();
    loop {
        let Some(request) = read_request(&mut stream, &mut buffer).await else { return };
        let reply = {
            let mut state = state.lock().expect("lock");
            let reply = match &state.responder {
                Some(respond) => Some(respond(&request)),
                None => state.script.get(state.next).cloned(),
            };
            state.requests.push(request);
            state.next += 1;
            reply
        };
        let reply = reply.unwrap_or_else(|| {
            Reply::new(500, "text/plain", "keel-testkit: the script has no reply for this request")
        });
        if !write_reply(&mut stream, &reply).await {
            return;
        }
    }
}

/// Reads one request (headers, then a `Content-Length` body); `None` when the client closed.
async fn read_request(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Recorded> {
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_owned();
    let path = first.next()?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize =
        headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let body_start = head_end + 4;
    while buffer.len() < body_start + length {
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
    let body = buffer[body_start..body_start + length].to_vec();
    buffer.drain(..body_start + length);
    Some(Recorded { method, path, headers, body })
}

/// Writes a reply; `false` when the connection is done.
async fn write_reply(stream: &mut TcpStream, reply: &Reply) -> bool {
    let reason = match reply.status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        529 => "Overloaded",
        _ => "Status",
    };
    let mut head = format!("HTTP/1.1 {} {reason}\r\n", reply.status);
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("transfer-encoding: chunked\r\n\r\n");
    if stream.write_all(head.as_bytes()).await.is_err() {
        return false;
    }
    for piece in &reply.pieces {
        if !reply.pause.is_zero() {
            tokio::time::sleep(reply.pause).await;
        }
        if piece.is_empty() {
            continue;
        }
        let mut frame = format!("{:x}\r\n", piece.len()).into_bytes();
        frame.extend_from_slice(piece);
        frame.extend_from_slice(b"\r\n");
        if stream.write_all(&frame).await.is_err() || stream.flush().await.is_err() {
            return false;
        }
    }
    match reply.end {
        End::Complete => stream.write_all(b"0\r\n\r\n").await.is_ok(),
        End::Reset => {
            // Let the client read what was sent: a reset discards data it has not read yet.
            tokio::time::sleep(Duration::from_millis(50)).await;
            // A zero linger turns the close into a reset: the client sees ECONNRESET.
            let _ = socket2::SockRef::from(&*stream).set_linger(Some(Duration::ZERO));
            false
        }
        End::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            false
        }
    }
}
