//! Where the network tools may go: the SSRF guard of `http_request` and `web_fetch`.
//!
//! A URL passes when its scheme is http or https, its host is allowed by `http.allow` (when
//! set), and every address it stands for is public. A literal address is checked as written
//! (after WHATWG parsing, so `2130706433`, `0x7f.1` and `0177.0.0.1` are all 127.0.0.1). A host
//! name is resolved by the guard itself ([`GuardedResolver`], plugged into the HTTP client):
//! if ANY address it resolves to is not public the request is refused, and the connection is
//! made to the addresses that were checked, never to a second lookup's, so DNS rebinding cannot
//! slip a private address in. Every redirect is checked again.
//!
//! "Not public" is the table in [`blocked`]: loopback, private, link-local (the cloud metadata
//! address 169.254.169.254), CGNAT, multicast, broadcast, unspecified, reserved, benchmarking and
//! documentation ranges, and in IPv6 also unique-local, site-local, IPv4-mapped and
//! IPv4-compatible addresses, NAT64, 6to4 and Teredo (which embed IPv4 addresses). Loopback is
//! reachable only with `http.allow_loopback` (local development and tests).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use keel_core::BoxFuture;
use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// What the network tools may reach (spec key `http`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetPolicy {
    /// Host names the tools may reach (`api.github.com`, `*.example.com`); empty: any public
    /// host.
    pub allow: Vec<String>,
    /// Whether loopback addresses (127.0.0.0/8, ::1, `localhost`) are reachable. Off by default;
    /// for local development and tests.
    pub allow_loopback: bool,
}

/// Why a destination was refused; the message is written for the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(pub String);

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refusal {}

/// The range an address falls in, when it is not a public unicast address.
pub fn blocked(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => blocked_v4(v4),
        IpAddr::V6(v6) => blocked_v6(v6),
    }
}

fn blocked_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, _, _) => "an unspecified (\"this network\") address",
        (10, _, _) | (172, 16..=31, _) | (192, 168, _) => "a private address",
        (100, 64..=127, _) => "a carrier-grade NAT address",
        (127, _, _) => "a loopback address",
        (169, 254, _) => "a link-local address (cloud metadata lives there)",
        (192, 0, 0) => "an IETF protocol assignment address",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "a documentation address",
        (192, 88, 99) => "a 6to4 relay address",
        (198, 18..=19, _) => "a benchmarking address",
        (224..=239, _, _) => "a multicast address",
        (255, 255, 255) if ip == Ipv4Addr::BROADCAST => "the broadcast address",
        (240..=255, _, _) => "a reserved address",
        _ => return None,
    })
}

fn blocked_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let segments = ip.segments();
    if ip.is_unspecified() {
        return Some("the unspecified address");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    Some(match segments {
        // ::ffff:0:0/96 and the deprecated ::/96: an IPv4 address in IPv6 clothing.
        [0, 0, 0, 0, 0, 0xffff, _, _] => "an IPv4-mapped address",
        [0, 0, 0, 0, 0, 0, _, _] => "an IPv4-compatible address",
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] | [0x64, 0xff9b, 1, ..] => "a NAT64 address",
        [0x100, 0, 0, 0, ..] => "a discard-only address",
        [0x2001, 0, ..] => "a Teredo address",
        [0x2001, 0xdb8, ..] => "a documentation address",
        [0x2001, 0x0..=0x1ff, ..] => "an IETF protocol assignment address",
        [0x2002, ..] => "a 6to4 address",
        [first, ..] if first & 0xfe00 == 0xfc00 => "a unique-local (private) address",
        [first, ..] if first & 0xffc0 == 0xfe80 => "a link-local address",
        [first, ..] if first & 0xffc0 == 0xfec0 => "a site-local address",
        [first, ..] if first & 0xff00 == 0xff00 => "a multicast address",
        _ => return None,
    })
}

impl From<&keel_core::HttpSettings> for NetPolicy {
    fn from(settings: &keel_core::HttpSettings) -> NetPolicy {
        NetPolicy { allow: settings.allow.clone(), allow_loopback: settings.allow_loopback }
    }
}

impl NetPolicy {
    /// Whether `ip` may be reached.
    pub fn check_ip(&self, ip: IpAddr, host: &str) -> Result<(), Refusal> {
        let Some(range) = blocked(ip) else { return Ok(()) };
        if self.allow_loopback && ip.is_loopback() {
            return Ok(());
        }
        let hint = if ip.is_loopback() {
            " (set `http.allow_loopback: true` to reach this machine during development)"
        } else {
            ""
        };
        let of = if host == ip.to_string() { String::new() } else { format!(" (the address of {host})") };
        Err(Refusal(format!(
            "refused: {ip}{of} is {range}; the network tools only reach public addresses, to protect internal services{hint}"
        )))
    }

    /// Whether `host` is allowed by `allow` (exact names, or `*.` wildcards matching any
    /// subdomain).
    pub fn check_host(&self, host: &str) -> Result<(), Refusal> {
        if self.allow.is_empty() {
            return Ok(());
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let allowed = self.allow.iter().any(|pattern| {
            let pattern = pattern.trim_end_matches('.').to_ascii_lowercase();
            match pattern.strip_prefix("*.") {
                Some(suffix) => host.len() > suffix.len() && host.ends_with(&format!(".{suffix}")),
                None => host == pattern,
            }
        });
        if allowed {
            Ok(())
        } else {
            Err(Refusal(format!(
                "refused: {host} is not in `http.allow` ({}); the agent may only reach those hosts",
                self.allow.join(", ")
            )))
        }
    }

    /// Checks everything a URL shows before any lookup: scheme, host, allowlist, and a
    /// literal address.
    pub fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Refusal(format!(
                "refused: the scheme `{}` is not allowed; use an http:// or https:// URL",
                url.scheme()
            )));
        }
        let host = match url.host() {
            Some(url::Host::Domain(domain)) => domain.to_owned(),
            Some(url::Host::Ipv4(ip)) => {
                self.check_host(&ip.to_string())?;
                return self.check_ip(IpAddr::V4(ip), &ip.to_string());
            }
            Some(url::Host::Ipv6(ip)) => {
                self.check_host(&ip.to_string())?;
                return self.check_ip(IpAddr::V6(ip), &ip.to_string());
            }
            None => return Err(Refusal("refused: the URL has no host".into())),
        };
        self.check_host(&host)?;
        // `localhost` never needs a lookup to be known local, whatever a resolver says.
        let bare = host.trim_end_matches('.').to_ascii_lowercase();
        if (bare == "localhost" || bare.ends_with(".localhost")) && !self.allow_loopback {
            return Err(Refusal(format!(
                "refused: {host} is this machine; the network tools only reach public addresses (set `http.allow_loopback: true` for local development)"
            )));
        }
        Ok(())
    }
}

/// Resolves a host name to its addresses.
pub trait Lookup: Send + Sync {
    /// Every address of `host`.
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>>;
}

/// The system resolver (getaddrinfo, through Tokio).
pub struct SystemLookup;

impl Lookup for SystemLookup {
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, 0)).await?.map(|a| a.ip()).collect()) })
    }
}

/// The HTTP client's resolver: resolves once, refuses if any address is not allowed, and hands
/// the client exactly the addresses it checked.
pub struct GuardedResolver {
    policy: Arc<NetPolicy>,
    lookup: Arc<dyn Lookup>,
}

impl GuardedResolver {
    /// A resolver enforcing `policy` over `lookup`'s answers.
    pub fn new(policy: Arc<NetPolicy>, lookup: Arc<dyn Lookup>) -> GuardedResolver {
        GuardedResolver { policy, lookup }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let lookup = self.lookup.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addresses = lookup.lookup(&host).await.map_err(|error| {
                Box::new(Refusal(format!("cannot resolve {host}: {error}")))
                    as Box<dyn std::error::Error + Send + Sync>
            })?;
            if addresses.is_empty() {
                return Err(Box::new(Refusal(format!("{host} has no address"))) as _);
            }
            for ip in &addresses {
                policy
                    .check_ip(*ip, &host)
                    .map_err(|refusal| Box::new(refusal) as Box<dyn std::error::Error + Send + Sync>)?;
            }
            let addrs: Addrs = Box::new(addresses.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

/// The refusal behind an HTTP client error, when the guard caused it.
pub fn refusal_in(error: &(dyn std::error::Error + 'static)) -> Option<Refusal> {
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(refusal) = error.downcast_ref::<Refusal>() {
            return Some(refusal.clone());
        }
        current = error.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_addresses_pass() {
        for ip in ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4007:80e::200e"]
        {
            assert_eq!(blocked(ip.parse().unwrap()), None, "{ip}");
        }
    }

    #[test]
    fn every_internal_range_is_blocked() {
        for ip in [
            "0.0.0.0",
            "0.1.2.3",
            "10.0.0.1",
            "100.64.0.1",
            "100.127.255.254",
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.170",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:8.8.8.8",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "100::1",
            "2001::1",
            "2001:db8::1",
            "2001:10::1",
            "2002:a9fe:a9fe::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
        ] {
            assert!(blocked(ip.parse().unwrap()).is_some(), "{ip} should be blocked");
        }
    }
}
