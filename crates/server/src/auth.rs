//! Who is calling: a bearer token (`KEEL_API_TOKEN`, compared in constant time) or a JWT
//! (HS256/384/512 with a shared secret; RS256/ES256... with keys from a JWKS), and a per-identity
//! rate limit.
//!
//! A JWT's subject owns the sessions it creates: its session ids are scoped to it
//! ([`SessionId::scoped`]), so another subject asking for the same id reaches a different,
//! usually empty, session: a 404, and nothing to guess. `/health` and the playground page
//! (`GET /`, `HEAD` too) need no credentials.

use std::num::NonZeroU32;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use keel_core::{ErrorCode, SessionId, SessionScope};
use sha2::Digest;
use subtle::ConstantTimeEq;

use crate::AppState;
use crate::error::ApiError;

/// JWT settings (`KEEL_JWT_SECRET`, `KEEL_JWT_JWKS`, `KEEL_JWT_ISSUER`, `KEEL_JWT_AUDIENCE`).
#[derive(Clone, Debug, Default)]
pub struct JwtOptions {
    /// The shared secret of HS256/HS384/HS512 tokens.
    pub secret: Option<String>,
    /// A JWKS document (JSON) with the public keys of RS256/ES256 (and friends) tokens.
    pub jwks: Option<String>,
    /// Where the JWKS came from, to fetch it again: every 10 minutes, and when a token names a
    /// key id the set does not have (a key rotation), at most every 30 seconds.
    pub jwks_url: Option<String>,
    /// The `iss` tokens must have, if any (then a token without `iss` is refused).
    pub issuer: Option<String>,
    /// The `aud` tokens must have, if any (then a token without `aud` is refused).
    pub audience: Option<String>,
}

/// A public key: its id, algorithm and key.
type PublicKey = (Option<String>, Algorithm, DecodingKey);

/// Verifies JWTs with the configured keys.
pub(crate) struct JwtVerifier {
    secret: Option<DecodingKey>,
    keys: std::sync::RwLock<Arc<Vec<PublicKey>>>,
    jwks_url: Option<String>,
    /// When the JWKS was last fetched again (throttles refetches on unknown key ids).
    fetched: std::sync::Mutex<Option<std::time::Instant>>,
    issuer: Option<String>,
    audience: Option<String>,
}

/// Why a token was refused.
enum Refusal {
    /// No configured key fits it (perhaps a key the JWKS gained since it was fetched).
    NoKey(String),
    Invalid(String),
}

/// Fetches a JWKS document (at most 1 MB, within 10 s).
pub async fn fetch_jwks(url: &str) -> Result<String, String> {
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(|error| format!("cannot build an HTTP client: {error}"))?;
    let response =
        client.get(url).send().await.map_err(|error| format!("cannot fetch the JWKS {url}: {error}"))?;
    if !response.status().is_success() {
        return Err(format!("fetching the JWKS {url} answered {}", response.status()));
    }
    if response.content_length().is_some_and(|length| length > 1024 * 1024) {
        return Err(format!("the JWKS at {url} is over 1 MB"));
    }
    let body = response.text().await.map_err(|error| format!("cannot read the JWKS {url}: {error}"))?;
    if body.len() > 1024 * 1024 {
        return Err(format!("the JWKS at {url} is over 1 MB"));
    }
    Ok(body)
}

/// The signing keys of a JWKS document.
fn parse_jwks(jwks: &str) -> Result<Vec<PublicKey>, String> {
    let set: JwkSet =
        serde_json::from_str(jwks).map_err(|error| format!("the JWKS is not a JSON Web Key Set: {error}"))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let algorithm = match (&jwk.common.key_algorithm, &jwk.algorithm) {
            (Some(KeyAlgorithm::RS256), _) => Algorithm::RS256,
            (Some(KeyAlgorithm::RS384), _) => Algorithm::RS384,
            (Some(KeyAlgorithm::RS512), _) => Algorithm::RS512,
            (Some(KeyAlgorithm::PS256), _) => Algorithm::PS256,
            (Some(KeyAlgorithm::ES256), _) => Algorithm::ES256,
            (Some(KeyAlgorithm::ES384), _) => Algorithm::ES384,
            (Some(KeyAlgorithm::EdDSA), _) => Algorithm::EdDSA,
            (None, AlgorithmParameters::RSA(_)) => Algorithm::RS256,
            (None, AlgorithmParameters::EllipticCurve(ec)) if ec.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            (None, AlgorithmParameters::EllipticCurve(ec)) if ec.curve == EllipticCurve::P384 => {
                Algorithm::ES384
            }
            // Symmetric keys do not belong in a public key set; other kinds are skipped.
            _ => continue,
        };
        let key =
            DecodingKey::from_jwk(jwk).map_err(|error| format!("a key of the JWKS is unusable: {error}"))?;
        keys.push((jwk.common.key_id.clone(), algorithm, key));
    }
    if keys.is_empty() {
        return Err("the JWKS has no RSA or EC signing key".into());
    }
    Ok(keys)
}

#[derive(serde::Deserialize)]
struct Claims {
    sub: String,
}

impl JwtVerifier {
    pub(crate) fn new(options: &JwtOptions) -> Result<JwtVerifier, String> {
        let secret = options
            .secret
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| DecodingKey::from_secret(s.as_bytes()))
            .transpose()
            .map_err(|error| format!("KEEL_JWT_SECRET is unusable: {error}"))?;
        let keys = options.jwks.as_deref().map(parse_jwks).transpose()?.unwrap_or_default();
        if secret.is_none() && keys.is_empty() {
            return Err("JWT auth needs KEEL_JWT_SECRET or KEEL_JWT_JWKS".into());
        }
        Ok(JwtVerifier {
            secret,
            keys: std::sync::RwLock::new(Arc::new(keys)),
            jwks_url: options.jwks_url.clone(),
            // Not "just fetched": the first unknown key id may fetch at once.
            fetched: std::sync::Mutex::new(None),
            issuer: options.issuer.clone(),
            audience: options.audience.clone(),
        })
    }

    /// Fetches the JWKS again from its URL (when it has one).
    pub(crate) async fn refresh(&self) -> Result<(), String> {
        let Some(url) = &self.jwks_url else { return Ok(()) };
        *self.fetched.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        let keys = parse_jwks(&fetch_jwks(url).await?)?;
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
        Ok(())
    }

    pub(crate) fn has_jwks_url(&self) -> bool {
        self.jwks_url.is_some()
    }

    /// The subject of a valid token, or why it is not valid. A token signed by a key the JWKS
    /// did not have when fetched makes it fetched again (at most every 30 s).
    async fn verify(&self, token: &str) -> Result<String, String> {
        match self.verify_now(token) {
            Err(Refusal::NoKey(why)) if self.jwks_url.is_some() => {
                let due = self
                    .fetched
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(30));
                if !due {
                    return Err(why);
                }
                if let Err(error) = self.refresh().await {
                    tracing::warn!(%error, "could not fetch the JWKS again");
                    return Err(why);
                }
                self.verify_now(token).map_err(|refusal| match refusal {
                    Refusal::NoKey(why) | Refusal::Invalid(why) => why,
                })
            }
            Err(Refusal::NoKey(why) | Refusal::Invalid(why)) => Err(why),
            Ok(subject) => Ok(subject),
        }
    }

    fn verify_now(&self, token: &str) -> Result<String, Refusal> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|error| Refusal::Invalid(format!("not a JWT ({error})")))?;
        let algorithm = header.alg;
        let symmetric = matches!(algorithm, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512);
        let public = Arc::clone(&self.keys.read().unwrap_or_else(|p| p.into_inner()));
        // A key only ever verifies its own kind of algorithm: no confusing a public key for an
        // HMAC secret.
        let candidates: Vec<&DecodingKey> = if symmetric {
            self.secret.iter().collect()
        } else {
            public
                .iter()
                .filter(|(kid, alg, _)| *alg == algorithm && (header.kid.is_none() || kid == &header.kid))
                .map(|(_, _, key)| key)
                .collect()
        };
        if candidates.is_empty() {
            let kid = header.kid.map_or(String::new(), |k| format!(" with kid {k:?}"));
            return Err(Refusal::NoKey(format!("no key for a {algorithm:?} token{kid}")));
        }
        let mut validation = Validation::new(algorithm);
        validation.leeway = 30;
        // A configured issuer or audience is required, not just checked when present: a token
        // minted for another service (no `aud`) must not open this one.
        let mut required = vec!["exp", "sub"];
        match &self.issuer {
            Some(issuer) => {
                validation.set_issuer(&[issuer]);
                required.push("iss");
            }
            None => validation.iss = None,
        }
        match &self.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        // A token not valid yet (`nbf` in the future, beyond the leeway) is refused.
        validation.validate_nbf = true;
        let mut last = String::new();
        for key in candidates {
            match jsonwebtoken::decode::<Claims>(token, key, &validation) {
                Ok(data) if !data.claims.sub.is_empty() => return Ok(data.claims.sub),
                Ok(_) => return Err(Refusal::Invalid("the token's `sub` is empty".into())),
                Err(error) => last = error.to_string(),
            }
        }
        Err(Refusal::Invalid(last))
    }
}

/// Who made a request.
#[derive(Clone, Debug)]
pub(crate) struct Identity {
    /// The JWT subject that owns the sessions it names (`None`: no per-user auth).
    owner: Option<String>,
    /// What the rate limit counts by.
    key: String,
}

impl Identity {
    /// Who this is, for the record of a decision or a cancellation: `HTTP API (sub:alice)`,
    /// `HTTP API (api-token)`, `HTTP API (ip:127.0.0.1)`. Never a secret.
    pub(crate) fn describe(&self) -> String {
        format!("HTTP API ({})", self.key)
    }

    /// The sessions this caller reaches: its owner's, or (without per-user auth) those no
    /// owner holds.
    pub(crate) fn scope(&self) -> SessionScope {
        match &self.owner {
            None => SessionScope::Unscoped,
            Some(owner) => SessionScope::Scoped(subject_scope(owner)),
        }
    }

    /// The session `id` names for this caller: scoped to its owner, if it has one.
    pub(crate) fn session(&self, id: SessionId) -> SessionId {
        match &self.owner {
            None => id,
            Some(owner) => SessionId::scoped(&subject_scope(owner), &id),
        }
    }
}

/// The scope a JWT subject's sessions live in (`<scope>~<id>`): a digest of the subject, so
/// that ids never show it. Its memory's owner is `user:<scope>`.
pub fn subject_scope(subject: &str) -> String {
    let digest = sha2::Sha256::digest(subject.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// A per-identity limit of requests per minute.
pub(crate) type RateLimiter = governor::DefaultKeyedRateLimiter<String>;

pub(crate) fn rate_limiter(per_minute: u32) -> Option<RateLimiter> {
    NonZeroU32::new(per_minute).map(|n| governor::RateLimiter::keyed(governor::Quota::per_minute(n)))
}

pub(crate) async fn authenticate(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let read = matches!(*request.method(), axum::http::Method::GET | axum::http::Method::HEAD);
    // Channels carry their platform's signature instead of the bearer token (checked there).
    let channel =
        *request.method() == axum::http::Method::POST && request.uri().path().starts_with("/channels/");
    let open = (read && matches!(request.uri().path(), "/health" | "/")) || channel;
    if open {
        request.extensions_mut().insert(Identity { owner: None, key: "anonymous".into() });
        return next.run(request).await;
    }
    // The token is copied out: the request is not held across the verification's await.
    let token = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(bearer_token)
        .map(str::to_owned);
    // Anonymous callers are told apart (for the rate limit) by their address.
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|info| info.0.ip().to_string());
    let identity = match identify(&state, token.as_deref(), peer).await {
        Ok(identity) => identity,
        Err(error) => return error.into_response(),
    };
    if let Some(limiter) = &state.rate_limiter
        && let Err(not_until) = limiter.check_key(&identity.key)
    {
        let wait = not_until.wait_time_from(DefaultClock::default().now());
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let mut response =
            ApiError::new(ErrorCode::RateLimited, format!("too many requests; try again in {seconds} s"))
                .into_response();
        if let Ok(value) = HeaderValue::from_str(&seconds.max(1).to_string()) {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, value);
        }
        return response;
    }
    request.extensions_mut().insert(identity);
    next.run(request).await
}

async fn identify(state: &AppState, token: Option<&str>, peer: Option<String>) -> Result<Identity, ApiError> {
    if state.api_token.is_none() && state.jwt.is_none() {
        return Ok(Identity { owner: None, key: format!("ip:{}", peer.as_deref().unwrap_or("unknown")) });
    }
    let Some(token) = token else {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "this server needs `Authorization: Bearer <token>` (its KEEL_API_TOKEN, or a JWT)",
        ));
    };
    if let Some(expected) = &state.api_token
        && token_matches(token, expected)
    {
        return Ok(Identity { owner: None, key: "api-token".into() });
    }
    if let Some(jwt) = &state.jwt {
        return match jwt.verify(token).await {
            Ok(subject) => Ok(Identity { key: format!("sub:{subject}"), owner: Some(subject) }),
            Err(why) => {
                Err(ApiError::new(ErrorCode::Unauthorized, format!("the bearer token is not valid: {why}")))
            }
        };
    }
    Err(ApiError::new(ErrorCode::Unauthorized, "the bearer token is not valid"))
}

/// The token of an `Authorization: Bearer <token>` value; the scheme's name is
/// case-insensitive (RFC 9110 §11.1), and any spaces or tabs may follow it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|token| !token.is_empty())
}

/// Compares without leaking, through timing, how much of the token matched.
fn token_matches(given: &str, expected: &str) -> bool {
    // `ct_eq` on slices of different lengths returns early; the length is not the secret.
    given.as_bytes().ct_eq(expected.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, token_matches};

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for value in ["Bearer abc", "bearer abc", "BEARER abc", "BeArEr   abc ", "Bearer\tabc"] {
            assert_eq!(bearer_token(value), Some("abc"), "{value:?}");
        }
        for value in ["Basic abc", "Bearer", "Bearer ", "Bearerabc", "abc"] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }

    #[test]
    fn tokens_match_exactly() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cre", "s3cret"));
        assert!(!token_matches("s3cret!", "s3cret"));
        assert!(!token_matches("", "s3cret"));
    }
}
