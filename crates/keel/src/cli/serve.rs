//! `keel serve`: the HTTP API (DESIGN.md §5) for an agent, until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::time::Duration;

use keel_core::env;

use super::{ServeArgs, exit};

pub(crate) fn serve(args: ServeArgs) -> std::io::Result<u8> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    // KEEL_JWT_JWKS: a file, or an http(s) URL fetched once the runtime runs.
    let jwks_source = var(env::JWT_JWKS.name);
    let jwks_url = jwks_source.clone().filter(|s| s.starts_with("https://") || s.starts_with("http://"));
    let jwks = match (&jwks_source, &jwks_url) {
        (Some(path), None) => match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(error) => {
                eprintln!("error: cannot read KEEL_JWT_JWKS {path}: {error}");
                return Ok(exit::INVALID_AGENT);
            }
        },
        _ => None,
    };
    let secret = var(env::JWT_SECRET.name);
    let jwt = (secret.is_some() || jwks_source.is_some()).then(|| keel_server::JwtOptions {
        secret,
        jwks,
        jwks_url,
        issuer: var(env::JWT_ISSUER.name),
        audience: var(env::JWT_AUDIENCE.name),
    });
    let settings = match read_settings(&var) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("error: {message}");
            return Ok(exit::INVALID_AGENT);
        }
    };
    let api_token = var(env::API_TOKEN.name);
    let has_auth = api_token.is_some() || jwt.is_some();
    let mut options = keel_server::ServerOptions {
        api_token,
        jwt,
        rate_limit_per_minute: settings.rate_limit_per_minute,
        allowed_hosts: settings.allowed_hosts,
        cors_origins: settings.cors_origins,
        first_request_timeout: settings.first_request_timeout,
        idle_timeout: settings.idle_timeout,
        event_retention: settings.event_retention,
        // Many clients behind one proxy share an address: with auth, no cap unless asked.
        max_connections_per_client: match settings.max_connections_per_client {
            Some(0) => None,
            Some(n) => Some(n),
            None if has_auth => None,
            None => Some(keel_server::DEFAULT_CONNECTIONS_PER_CLIENT),
        },
        ..keel_server::ServerOptions::default()
    };
    // `::1` and `[::1]` alike: an IP address, then the port.
    let host = args.host.trim();
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let address = match (bare.parse::<std::net::IpAddr>(), bare) {
        (Ok(ip), _) => SocketAddr::new(ip, args.port),
        (Err(_), "localhost") => SocketAddr::from(([127, 0, 0, 1], args.port)),
        (Err(_), _) => {
            eprintln!("error: --host {host:?} is not an IP address (use 127.0.0.1, 0.0.0.0, ::1 ...)");
            return Ok(2);
        }
    };
    if let Err(message) = keel_server::check_bind(&address, &options) {
        eprintln!("error: {message}");
        return Ok(exit::INVALID_AGENT);
    }
    raise_open_file_limit();
    super::run_async(async {
        // Loaded in the runtime: MCP servers are connected (and supervised) on it.
        let agent = match super::run::load_agent(&args.agent, args.model.as_deref(), &args.store).await? {
            Ok(agent) => agent,
            Err(code) => return Ok(code),
        };
        if let Some(jwt) = options.jwt.as_mut()
            && let Some(url) = &jwt.jwks_url
        {
            match keel_server::fetch_jwks(url).await {
                Ok(text) => jwt.jwks = Some(text),
                Err(message) => {
                    eprintln!("error: {message}");
                    return Ok(exit::INVALID_AGENT);
                }
            }
        }
        let auth = match (options.api_token.is_some(), options.jwt.is_some()) {
            (_, true) => ", JWT auth",
            (true, false) => ", bearer token required",
            (false, false) => "",
        };
        // Set up before listening: a setting that cannot work (a channel's secret not set)
        // stops keel before anything can connect.
        let server = match keel_server::Server::new(agent.engine().clone(), options) {
            Ok(server) => server,
            Err(message) => {
                eprintln!("error: {message}");
                return Ok(exit::INVALID_AGENT);
            }
        };
        let listener = match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("error: cannot listen on {address}: {error}");
                return Ok(exit::INVALID_AGENT);
            }
        };
        let bound = listener.local_addr()?;
        eprintln!(
            "keel serve: agent {} on http://{bound} (store {}{auth})",
            agent.definition().name,
            args.store
        );
        server.serve(listener, shutdown_signal()).await?;
        eprintln!("keel serve: stopped");
        Ok(exit::OK)
    })?
}

/// The server settings read from the environment.
struct Settings {
    rate_limit_per_minute: Option<u32>,
    allowed_hosts: Vec<String>,
    cors_origins: Vec<String>,
    first_request_timeout: Duration,
    idle_timeout: Duration,
    max_connections_per_client: Option<usize>,
    event_retention: Duration,
}

fn read_settings(var: &dyn Fn(&str) -> Option<String>) -> Result<Settings, String> {
    let number = |name: &str, what: &str| -> Result<Option<u64>, String> {
        var(name).map(|v| v.trim().parse::<u64>().map_err(|_| format!("{name} must be {what}"))).transpose()
    };
    let duration = |name: &str, default: Duration| -> Result<Duration, String> {
        match var(name) {
            None => Ok(default),
            Some(text) => match humantime::parse_duration(text.trim()) {
                Ok(duration) if !duration.is_zero() => Ok(duration),
                _ => Err(format!("{name} must be a duration like `10s` or `2m`, not {text:?}")),
            },
        }
    };
    let list = |name: &str| -> Vec<String> {
        var(name)
            .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default()
    };
    let cors_origins = list(env::CORS_ORIGINS.name);
    let is_origin = |origin: &str| {
        origin.trim_end_matches('/').split_once("://").is_some_and(|(scheme, host)| {
            matches!(scheme, "http" | "https") && !host.is_empty() && !host.contains(['/', ' ', '?', '#'])
        })
    };
    if let Some(bad) = cors_origins.iter().find(|origin| !is_origin(origin)) {
        return Err(format!(
            "KEEL_CORS_ORIGINS lists {bad:?}, which is not an origin: write `https://app.example.com` (a scheme, a \
             host and an optional port; no path)"
        ));
    }
    let defaults = keel_server::ServerOptions::default();
    Ok(Settings {
        rate_limit_per_minute: number(env::RATE_LIMIT.name, "a number of requests per minute, like 120")?
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        allowed_hosts: list(env::ALLOWED_HOSTS.name),
        cors_origins,
        first_request_timeout: duration(env::FIRST_REQUEST_TIMEOUT.name, defaults.first_request_timeout)?,
        idle_timeout: duration(env::IDLE_TIMEOUT.name, defaults.idle_timeout)?,
        event_retention: duration(env::EVENT_RETENTION.name, defaults.event_retention)?,
        max_connections_per_client: number(
            env::MAX_CONNECTIONS_PER_CLIENT.name,
            "a number of connections, like 512 (0: no limit)",
        )?
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    })
}

/// Every open stream is a file descriptor: raise the soft limit to the hard one (as servers
/// commonly do), so that a default of 1024 does not cap the server at a thousand clients.
fn raise_open_file_limit() {
    #[cfg(unix)]
    {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
            && soft < hard
            && let Err(error) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
        {
            tracing::warn!(%error, soft, hard, "could not raise the open-file limit");
        }
    }
}

/// SIGINT (Ctrl-C) or SIGTERM. The handlers are installed by this call, before the server
/// accepts a connection. Installed at the future's first poll instead (in the accept loop,
/// whose `select!` may take a ready connection first), a SIGTERM sent once a first request was
/// being served could, on a busy machine, come before them and kill the process mid-step (seen
/// once in CI: the server of a test died of the signal).
#[cfg(unix)]
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    async move {
        match (interrupt, terminate) {
            (Ok(mut interrupt), Ok(mut terminate)) => {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
