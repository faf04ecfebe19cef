//! The HTTP client of Streamable HTTP servers: the configured endpoint is reachable wherever it
//! is (a server on this machine or a private network was named on purpose), and anything else,
//! which only a redirect can lead to, goes through keel's SSRF guard like any outbound call.

use std::sync::Arc;
use std::time::Duration;

use keel_tools::net::{GuardedResolver, NetPolicy, Refusal, SystemLookup};
use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// The most redirects followed.
const MAX_REDIRECTS: usize = 5;

/// A client for the server at `endpoint`.
pub(crate) fn client(endpoint: &Url) -> Result<reqwest::Client, String> {
    let configured_host = endpoint.host_str().unwrap_or_default().to_ascii_lowercase();
    let configured_origin = endpoint.origin();
    let public_only = Arc::new(NetPolicy::default());
    let resolver = EndpointResolver {
        configured_host: configured_host.clone(),
        guarded: GuardedResolver::new(public_only.clone(), Arc::new(SystemLookup)),
    };
    reqwest::Client::builder()
        .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
        // A proxy from the environment would be asked to reach the address instead, past the
        // guard.
        .no_proxy()
        .connect_timeout(Duration::from_secs(10))
        .dns_resolver(Arc::new(resolver))
        .redirect(reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= MAX_REDIRECTS {
                return attempt.error(Refusal(format!("refused: more than {MAX_REDIRECTS} redirects")));
            }
            if attempt.url().origin() == configured_origin {
                return attempt.follow();
            }
            // A host name is checked by the resolver when it connects; a literal address or
            // `localhost` here.
            match public_only.check_url(attempt.url()) {
                Ok(()) => attempt.follow(),
                Err(refusal) => {
                    let to = attempt.url().to_string();
                    attempt.error(Refusal(format!("{refusal} (the MCP server redirected to {to})")))
                }
            }
        }))
        .build()
        .map_err(|error| format!("cannot build the HTTP client: {error}"))
}

/// Resolves the configured host as the system does, and every other host through the guard.
struct EndpointResolver {
    configured_host: String,
    guarded: GuardedResolver,
}

impl Resolve for EndpointResolver {
    fn resolve(&self, name: Name) -> Resolving {
        if name.as_str().eq_ignore_ascii_case(&self.configured_host) {
            let host = name.as_str().to_owned();
            return Box::pin(async move {
                let addresses = tokio::net::lookup_host((host.as_str(), 0))
                    .await
                    .map_err(|error| Box::new(error) as Box<dyn std::error::Error + Send + Sync>)?;
                let addrs: Addrs = Box::new(addresses.collect::<Vec<_>>().into_iter());
                Ok(addrs)
            });
        }
        self.guarded.resolve(name)
    }
}
