//! `keel serve`: the HTTP API (DESIGN.md §5) for an agent, until SIGINT or SIGTERM.

use std::net::SocketAddr;

use keel_core::env;

use super::{ServeArgs, exit};

pub(crate) fn serve(args: ServeArgs) -> std::io::Result<u8> {
    let agent = match super::run::load_agent(&args.agent, args.model.as_deref(), &args.store)? {
        Ok(agent) => agent,
        Err(code) => return Ok(code),
    };
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
    let rate_limit_per_minute = match var(env::RATE_LIMIT.name).map(|v| v.trim().parse::<u32>()) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            eprintln!("error: KEEL_RATE_LIMIT must be a number of requests per minute, like 120");
            return Ok(exit::INVALID_AGENT);
        }
    };
    let mut options = keel_server::ServerOptions {
        api_token: var(env::API_TOKEN.name),
        jwt,
        rate_limit_per_minute,
        ..keel_server::ServerOptions::default()
    };
    let address: SocketAddr = match format!("{}:{}", args.host, args.port).parse() {
        Ok(address) => address,
        Err(_) => match (args.host.as_str(), args.port) {
            ("localhost", port) => SocketAddr::from(([127, 0, 0, 1], port)),
            (host, _) => {
                eprintln!("error: --host {host:?} is not an IP address (use 127.0.0.1, 0.0.0.0, ::1 ...)");
                return Ok(2);
            }
        },
    };
    if let Err(message) = keel_server::check_bind(&address, &options) {
        eprintln!("error: {message}");
        return Ok(exit::INVALID_AGENT);
    }
    raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
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
        let listener = match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("error: cannot listen on {address}: {error}");
                return Ok(exit::INVALID_AGENT);
            }
        };
        let bound = listener.local_addr()?;
        eprintln!(
            "keel serve: agent {} on http://{bound} (store {}{})",
            agent.definition().name,
            args.store,
            match (options.api_token.is_some(), options.jwt.is_some()) {
                (_, true) => ", JWT auth",
                (true, false) => ", bearer token required",
                (false, false) => "",
            }
        );
        let server = match keel_server::Server::new(agent.engine().clone(), options) {
            Ok(server) => server,
            Err(message) => {
                eprintln!("error: {message}");
                return Ok(exit::INVALID_AGENT);
            }
        };
        server.serve(listener, shutdown_signal()).await?;
        eprintln!("keel serve: stopped");
        Ok(exit::OK)
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

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
