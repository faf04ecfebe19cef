//! Secure defaults, tested from outside (issue 12): what a web page, a token minted for another
//! service, an idle socket, a tool reading keel's secrets, a FIFO and a killed keel can do.
//! Each test failed on the code before these defences.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::header;
use serde_json::{Value, json};

use crate::serve::{Served, client, error_of, in_an_hour, jwt, read_sse};
use crate::support::agent_dir;

const ECHO_AGENT: &str = "model: mock\n";

/// The `host:port` of a server's base URL.
fn authority(server: &Served) -> String {
    server.url("").trim_start_matches("http://").trim_end_matches('/').to_owned()
}

#[tokio::test]
async fn a_web_page_cannot_drive_a_local_keel_without_auth() {
    let dir = agent_dir(&[("agent.yaml", ECHO_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_ALLOWED_HOSTS", "keel.internal")]);
    let http = client();
    let port = authority(&server).rsplit_once(':').unwrap().1.to_owned();

    // A page on another origin posts `text/plain` (no preflight in a browser): refused, and no
    // run started.
    let response = http
        .post(server.url("/chat"))
        .header(header::ORIGIN, "https://evil.example")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(r#"{"sessionId": "victim", "input": "delete everything"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await, (403, "KEEL_ORIGIN_NOT_ALLOWED".to_owned()));
    // The same body without an Origin (curl forgetting the header) is a 415, not a run.
    let response = http
        .post(server.url("/chat"))
        .header(header::CONTENT_TYPE, "text/plain")
        .body(r#"{"sessionId": "victim", "input": "delete everything"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await, (415, "KEEL_UNSUPPORTED_MEDIA_TYPE".to_owned()));
    // JSON from a foreign page (after a preflight nobody answered) is refused too.
    let response = http
        .post(server.url("/chat"))
        .header(header::ORIGIN, "null")
        .json(&json!({"sessionId": "victim", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await, (403, "KEEL_ORIGIN_NOT_ALLOWED".to_owned()));
    let transcript = http.get(server.url("/chat/victim")).send().await.unwrap();
    assert_eq!(error_of(transcript).await, (404, "KEEL_SESSION_NOT_FOUND".to_owned()), "a run started");

    // The playground's own requests (same origin) and plain clients work.
    let own = http
        .post(server.url("/chat"))
        .header(header::ORIGIN, server.url("").trim_end_matches('/'))
        .json(&json!({"sessionId": "mine", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    assert!(read_sse(own).await.iter().any(|m| m.event.as_deref() == Some("done")));

    // DNS rebinding: the page's own name, resolved to 127.0.0.1. Nothing is read or decided.
    for (method, path) in [
        ("GET", "/chat/mine"),
        ("GET", "/metrics"),
        ("GET", "/chat/mine/events"),
        ("DELETE", "/chat/mine/run"),
    ] {
        let response = http
            .request(method.parse().unwrap(), server.url(path))
            .header(header::HOST, format!("rebind.evil.example:{port}"))
            .send()
            .await
            .unwrap();
        assert_eq!(error_of(response).await, (403, "KEEL_HOST_NOT_ALLOWED".to_owned()), "{method} {path}");
    }
    let response = http
        .post(server.url("/chat/mine/approvals/ap_0"))
        .header(header::HOST, format!("rebind.evil.example:{port}"))
        .json(&json!({"approved": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await, (403, "KEEL_HOST_NOT_ALLOWED".to_owned()));
    // Loopback names and the configured one are answered.
    for host in [format!("localhost:{port}"), format!("keel.internal:{port}"), format!("[::1]:{port}")] {
        let response = http.get(server.url("/chat/mine")).header(header::HOST, &host).send().await.unwrap();
        assert_eq!(response.status(), 200, "{host}");
    }
}

#[tokio::test]
async fn cors_answers_the_listed_origins_only() {
    let dir = agent_dir(&[("agent.yaml", ECHO_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_CORS_ORIGINS", "https://app.example.com")]);
    let http = client();
    let preflight = |origin: &'static str| {
        http.request(reqwest::Method::OPTIONS, server.url("/chat"))
            .header(header::ORIGIN, origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type,authorization")
            .send()
    };
    let allowed = preflight("https://app.example.com").await.unwrap();
    assert!(allowed.status().is_success(), "{}", allowed.status());
    assert_eq!(allowed.headers()["access-control-allow-origin"], "https://app.example.com");
    let methods = allowed.headers()["access-control-allow-methods"].to_str().unwrap().to_owned();
    assert!(methods.contains("POST"), "{methods}");
    let other = preflight("https://evil.example").await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none(), "{:?}", other.headers());

    let response = http
        .post(server.url("/chat"))
        .header(header::ORIGIN, "https://app.example.com")
        .json(&json!({"sessionId": "s", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["access-control-allow-origin"], "https://app.example.com");
    let response = http
        .post(server.url("/chat"))
        .header(header::ORIGIN, "https://evil.example")
        .json(&json!({"sessionId": "t", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(response).await, (403, "KEEL_ORIGIN_NOT_ALLOWED".to_owned()));
}

#[tokio::test]
async fn configured_issuer_and_audience_are_required_and_nbf_is_honoured() {
    let dir = agent_dir(&[("agent.yaml", ECHO_AGENT)]);
    let secret = "a-shared-secret-for-hs256";
    let server = Served::start(
        dir.path(),
        "memory",
        &[
            ("KEEL_JWT_SECRET", secret),
            ("KEEL_JWT_ISSUER", "https://id.example"),
            ("KEEL_JWT_AUDIENCE", "keel-api"),
        ],
    );
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let token = |claims: Value| jwt(jsonwebtoken::Algorithm::HS256, None, &key, claims);
    let now = in_an_hour() - 3600;
    let http = client();
    let status = |token: String| {
        let request = http.get(server.url("/chat/nobody")).bearer_auth(token);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let good = json!({"sub": "alice", "exp": now + 3600, "iss": "https://id.example", "aud": "keel-api"});
    // A valid token reaches the route (the session does not exist).
    assert_eq!(status(token(good.clone())).await, 404);
    let mut without_aud = good.clone();
    without_aud.as_object_mut().unwrap().remove("aud");
    assert_eq!(status(token(without_aud)).await, 401, "a token without `aud`");
    let mut without_iss = good.clone();
    without_iss.as_object_mut().unwrap().remove("iss");
    assert_eq!(status(token(without_iss)).await, 401, "a token without `iss`");
    let mut other_aud = good.clone();
    other_aud["aud"] = json!("billing-api");
    assert_eq!(status(token(other_aud)).await, 401, "a token for another audience");
    let mut not_yet = good.clone();
    not_yet["nbf"] = json!(now + 600);
    assert_eq!(status(token(not_yet)).await, 401, "a token not valid for ten minutes");
    let mut valid_since = good.clone();
    valid_since["nbf"] = json!(now - 10);
    assert_eq!(status(token(valid_since)).await, 404);
}

/// Reads from `stream` until it closes (`true`) or `within` passes (`false`).
fn closes_within(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buffer = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_and_one_client_holds_only_so_many() {
    let dir = agent_dir(&[("agent.yaml", ECHO_AGENT)]);
    let server = Served::start(
        dir.path(),
        "memory",
        &[
            ("KEEL_FIRST_REQUEST_TIMEOUT", "3s"),
            ("KEEL_IDLE_TIMEOUT", "2s"),
            ("KEEL_MAX_CONNECTIONS_PER_CLIENT", "8"),
        ],
    );
    let address = authority(&server);
    let opened = Instant::now();
    let mut silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&address).unwrap()).collect();
    // A ninth connection from the same address is closed at once.
    let mut ninth = TcpStream::connect(&address).unwrap();
    assert!(closes_within(&mut ninth, Duration::from_secs(2)), "the ninth connection was kept");
    assert!(opened.elapsed() < Duration::from_millis(2500), "closed by the cap, before any timeout");
    // The eight that never send a byte are closed after the first-request deadline.
    for (i, stream) in silent.iter_mut().enumerate() {
        assert!(closes_within(stream, Duration::from_secs(8)), "silent connection {i} still open");
    }
    assert!(opened.elapsed() >= Duration::from_millis(2500), "closed before their deadline");
    // Their slots are free again; a kept-alive connection is closed once idle.
    let mut keep_alive = TcpStream::connect(&address).unwrap();
    keep_alive.write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n").unwrap();
    let mut answer = [0u8; 256];
    keep_alive.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let n = keep_alive.read(&mut answer).unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
    let idle_from = Instant::now();
    assert!(
        closes_within(&mut keep_alive, Duration::from_secs(6)),
        "an idle keep-alive connection stayed open"
    );
    assert!(idle_from.elapsed() >= Duration::from_millis(1500), "closed before its idle timeout");

    // An open event stream is a request in flight: quiet for longer than the idle timeout, it
    // stays open and carries the next run.
    let mut stream = TcpStream::connect(&address).unwrap();
    stream.write_all(b"GET /chat/quiet/events HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let turn = client()
        .post(server.url("/chat"))
        .json(&json!({"sessionId": "quiet", "input": "still there?"}))
        .send()
        .await
        .unwrap();
    read_sse(turn).await;
    let mut seen = Vec::new();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    while !String::from_utf8_lossy(&seen).contains("run.done") {
        let n = stream.read(&mut answer).expect("the quiet event stream was closed");
        assert!(n > 0, "the quiet event stream was closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&answer[..n]);
    }
    // What the server cut, and why, is counted.
    let metrics = client().get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for line in [
        r#"keel_connections_cut_total{reason="client_cap"} 1"#,
        r#"keel_connections_cut_total{reason="first_request_timeout"} 8"#,
        r#"keel_connections_cut_total{reason="idle"} "#,
    ] {
        assert!(metrics.contains(line), "no `{line}` in:\n{metrics}");
    }
}

#[tokio::test]
async fn small_things_head_health_any_case_bearer_ipv6_host_and_one_cancel() {
    let dir = agent_dir(&[("agent.yaml", crate::serve::SLOW_AGENT)]);
    let server = Served::start(dir.path(), "memory", &[("KEEL_API_TOKEN", "s3cret-token")]);
    let http = client();
    let head = http.head(server.url("/health")).send().await.unwrap();
    assert_eq!(head.status(), 200, "HEAD /health needs no token, like GET");
    for scheme in ["BEARER", "bearer", "Bearer", "bEaReR"] {
        let response = http
            .get(server.url("/metrics"))
            .header(header::AUTHORIZATION, format!("{scheme} s3cret-token"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{scheme}");
    }

    // Several cancels of one run at once: one cancelled it, the others say it was going.
    let run = http
        .post(server.url("/chat"))
        .bearer_auth("s3cret-token")
        .json(&json!({"sessionId": "c", "input": "go"}))
        .send()
        .await
        .unwrap();
    assert_eq!(run.status(), 200);
    let cancels = (0..5).map(|_| {
        let request = http.delete(server.url("/chat/c/run")).bearer_auth("s3cret-token");
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    });
    let answers = futures::future::join_all(cancels).await;
    let firsts = answers.iter().filter(|a| a["cancelled"] == true).count();
    assert_eq!(firsts, 1, "{answers:?}");
    // The others found it being cancelled, or (arriving later) already ended.
    for answer in answers.iter().filter(|a| a["cancelled"] != true) {
        let later = answer["error"]["code"] == "KEEL_RUN_NOT_FOUND";
        assert!(answer["alreadyCancelling"] == true || later, "{answer}");
    }
    read_sse(run).await;

    // `--host ::1` is the IPv6 loopback, as the error message suggests.
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        let served = Served::start_with_args(dir.path(), &["--host", "::1"], &[]);
        assert!(served.url("").starts_with("http://[::1]:"), "{}", served.url(""));
        assert_eq!(http.get(served.url("/health")).send().await.unwrap().status(), 200);
    }
}

/// An agent whose model reads a FIFO of its workspace.
fn fifo_agent() -> tempfile::TempDir {
    let dir = agent_dir(&[(
        "agent.yaml",
        "model: mock
workspace: { path: ./work }
mock:
  script:
    - tool_calls: [{ name: read_file, input: { path: pipe } }]
    - text: 'Read it: {{last_tool_output}}'
",
    )]);
    std::fs::create_dir(dir.path().join("work")).unwrap();
    assert!(
        std::process::Command::new("mkfifo").arg(dir.path().join("work/pipe")).status().unwrap().success()
    );
    dir
}

#[test]
fn a_fifo_in_the_workspace_holds_up_neither_keel_run_nor_keel_serve() {
    let dir = fifo_agent();
    let started = Instant::now();
    let output = crate::support::keel()
        .current_dir(dir.path())
        .args(["run", ".", "read the pipe"])
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout} {}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("not a regular file"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(10), "keel run took {:?} to exit", started.elapsed());

    let server = Served::start(dir.path(), "memory", &[]);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let turn = client()
            .post(server.url("/chat"))
            .json(&json!({"sessionId": "f", "input": "read the pipe"}))
            .send()
            .await
            .unwrap();
        read_sse(turn).await;
    });
    let mut server = server;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let stopping = Instant::now();
    loop {
        if server.child.try_wait().unwrap().is_some() {
            break;
        }
        // The documented bound: the grace period (10 s) and a second.
        assert!(stopping.elapsed() < Duration::from_secs(11), "keel serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A command tool printing what it can see of its environment and of keel's.
const SNOOP: &str = r#"description = "Shows its environment"
command = ["sh", "-c", "env; echo ---; cat /proc/$PPID/environ; read -r _ _ _ keel _ < /proc/$PPID/stat; cat /proc/$keel/environ; true"]
env = ["MY_API_KEY"]
"#;

#[test]
fn tools_get_a_minimal_environment_and_can_read_no_secret_of_keels() {
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock
tools: [snoop, shell]
shell: { approve: false }
workspace: { path: ./work, mode: writable, approve_writes: false }
mock:
  script:
    - tool_calls: [{ name: snoop, input: {} }]
    - tool_calls: [{ name: shell, input: { command: 'cat /proc/$PPID/environ; read -r _ _ _ keel _ < /proc/$PPID/stat; cat /proc/$keel/environ' } }]
    - text: done
",
        ),
        ("tools/snoop.toml", SNOOP),
        ("work/.keep", ""),
    ]);
    let output = crate::support::keel()
        .current_dir(dir.path())
        .env("KEEL_API_TOKEN", "keel-api-token-value")
        .env("KEEL_JWT_SECRET", "keel-jwt-secret-value")
        .env("OPENAI_API_KEY", "sk-openai-secret-value")
        .env("MY_API_KEY", "the-tools-own-key")
        .env("UNRELATED", "not-for-tools")
        .args(["run", ".", "snoop", "--json"])
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let events: Vec<Value> =
        String::from_utf8_lossy(&output.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let outputs: Vec<String> =
        events.iter().filter(|e| e["type"] == "tool.done").map(|e| e["output"].to_string()).collect();
    assert_eq!(outputs.len(), 2, "{events:?}");
    // Not in their environment, nor in keel's (whether /proc/<keel>/environ is closed to them,
    // or readable because the test runs as root: the secrets' bytes are gone from it).
    let all = outputs.join("\n");
    for secret in ["keel-api-token-value", "keel-jwt-secret-value", "sk-openai-secret-value"] {
        assert!(!all.contains(secret), "a tool saw {secret}: {all}");
    }
    let own_environment = outputs[0].split("---").next().unwrap();
    assert!(
        !own_environment.contains("not-for-tools"),
        "keel's environment was passed on: {own_environment}"
    );
    assert!(
        outputs[0].contains("MY_API_KEY=the-tools-own-key"),
        "the named variable is passed: {}",
        outputs[0]
    );
    assert!(outputs[0].contains("PATH=/usr/local/sbin:"), "the minimal PATH: {}", outputs[0]);
    assert!(outputs[0].contains("KEEL_IDEMPOTENCY_KEY="), "the call's ids: {}", outputs[0]);
}

#[test]
fn a_tool_dies_with_keel_and_its_step_never_runs_twice_at_once() {
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock
tools: [slow-effect]
mock:
  script:
    - tool_calls: [{ name: slow-effect, input: {} }]
    - text: done
",
        ),
        (
            "tools/slow-effect.toml",
            r#"description = "A side effect that takes a while"
command = ["sh", "-c", "(sleep 2; echo background > background-done) & echo $$ > started; sleep 2; echo foreground > foreground-done; wait"]
"#,
        ),
    ]);
    let mut keel = crate::support::keel_on_store(dir.path(), &["run", ".", "go"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = dir.path().join("started");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !started.exists() || std::fs::read_to_string(&started).unwrap().trim().is_empty() {
        assert!(Instant::now() < deadline, "the tool never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    keel.kill().unwrap();
    keel.wait().unwrap();
    std::thread::sleep(Duration::from_secs(4));
    for file in ["foreground-done", "background-done"] {
        assert!(!dir.path().join(file).exists(), "the tool's {file} happened after keel was killed");
    }
    let pid: i32 = std::fs::read_to_string(&started).unwrap().trim().parse().unwrap();
    assert!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err(),
        "the tool's process {pid} outlived keel"
    );
}

#[test]
fn a_tool_of_keels_own_user_cannot_open_keels_environment_at_all() {
    // Run as root, the test runs keel as `nobody` (root reads every process's files, which is
    // why the secrets are also blanked); run as anyone else, as that user.
    let as_root = effective_uid() == 0;
    if as_root && !Path::new("/usr/bin/setpriv").exists() {
        return;
    }
    let dir = agent_dir(&[
        (
            "agent.yaml",
            "model: mock
tools: [shell]
shell: { approve: false }
workspace: { path: ./work, mode: writable, approve_writes: false }
mock:
  script:
    - tool_calls: [{ name: shell, input: { command: 'read -r _ _ _ keel _ < /proc/$PPID/stat; cat /proc/$keel/environ; cat /proc/$PPID/environ; cat /proc/$keel/mem' } }]
    - text: done
",
        ),
        ("work/.keep", ""),
    ]);
    use std::os::unix::fs::PermissionsExt;
    for path in [dir.path(), &dir.path().join("work")] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let keel_binary = crate::support::keel_binary();
    let mut command = if as_root {
        let mut command = std::process::Command::new("/usr/bin/setpriv");
        command.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(&keel_binary);
        command
    } else {
        std::process::Command::new(&keel_binary)
    };
    let output = command
        .current_dir(dir.path())
        .env_remove("KEEL_STORE")
        .env("KEEL_LOG", "error")
        .env("KEEL_API_TOKEN", "keel-api-token-value")
        .args(["run", ".", "go", "--json"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let done: Value = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["type"] == "tool.done")
        .unwrap();
    let stderr = done["output"]["stderr"].as_str().unwrap();
    assert_eq!(stderr.matches("Permission denied").count(), 3, "keel's /proc files were readable: {done}");
    assert!(!done.to_string().contains("keel-api-token-value"), "{done}");
}

/// This process's effective user id (`id -u`).
fn effective_uid() -> u32 {
    let output = std::process::Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&output.stdout).trim().parse().unwrap()
}
