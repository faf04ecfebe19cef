//! keel-providers: model providers behind keel-core's [`Provider`] trait.
//!
//! - [`MockProvider`]: plays an agent's `mock.script`, so every example and test runs offline;
//! - [`openai::OpenAiChat`]: OpenAI Chat Completions, also for OpenRouter and any
//!   OpenAI-compatible server;
//! - [`anthropic::AnthropicMessages`]: Anthropic Messages;
//! - [`ollama::OllamaChat`]: Ollama's native `/api/chat`.
//!
//! [`from_model`] picks the provider for a spec's `model` string (`provider/model`), reading
//! keys and base URLs from the usual variables. The decoders of each wire format
//! ([`framing`], `*::…Stream`) are public so that benchmarks and tools can drive them without
//! a network. Retrying is the runtime's job: a provider makes one attempt and classifies its
//! failure ([`ProviderError::is_transient`]).

pub mod anthropic;
pub mod embed;
pub mod framing;
mod http;

pub use http::{ca_bundle, check_proxy_environment, client as http_client};
mod mock;
pub mod ollama;
pub mod openai;
mod reply;

use std::sync::Arc;

use keel_core::provider::ProviderErrorKind;
use keel_core::{MockScript, Provider, ProviderError, ProviderSettings};

pub use mock::MockProvider;

/// The provider names a spec's `model` may start with.
pub const PROVIDER_NAMES: &[&str] =
    &["mock", "openai", "anthropic", "ollama", "openrouter", "openai-compatible"];

/// Where each provider is when neither the spec nor its variable says otherwise.
pub mod defaults {
    /// OpenAI's API.
    pub const OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
    /// Anthropic's API.
    pub const ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";
    /// OpenRouter's OpenAI-compatible API.
    pub const OPENROUTER_BASE_URL: &str = "https://openrouter.ai/api/v1";
    /// A local Ollama.
    pub const OLLAMA_HOST: &str = crate::ollama::DEFAULT_HOST;
}

/// The provider for a `model` string (`mock`, or `provider/model`), configured from `settings`
/// and the process environment.
pub fn from_model(
    model: &str,
    settings: &ProviderSettings,
    script: Option<&MockScript>,
) -> Result<Arc<dyn Provider>, ProviderError> {
    from_model_with_env(model, settings, script, &|name| std::env::var(name).ok())
}

/// [`from_model`] with the environment given as a function (for tests and embedders).
///
/// Precedence for a base URL: `settings.base_url` (the spec), then the provider's variable,
/// then the provider's public endpoint. A provider that needs a key fails here, before any
/// request, when its variable is unset or empty.
pub fn from_model_with_env(
    model: &str,
    settings: &ProviderSettings,
    script: Option<&MockScript>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Arc<dyn Provider>, ProviderError> {
    let env = |name: &str| env(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    let (provider, name) = match model.split_once('/') {
        Some((provider, name)) => (provider, name),
        None => (model, ""),
    };
    if provider == "mock" {
        return Ok(Arc::new(MockProvider::new(script.cloned().unwrap_or_default())));
    }
    if name.is_empty()
        && let Some(known) = keel_core::provider::usual_provider(provider)
    {
        return Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!(
                "model `{model}` names no provider: write `{known}/{model}` (models are written provider/model)"
            ),
        ));
    }
    if !PROVIDER_NAMES.contains(&provider) {
        return Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!(
                "unknown provider `{provider}` in model `{model}`; known providers: {}",
                PROVIDER_NAMES.join(", ")
            ),
        ));
    }
    if name.is_empty() {
        return Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!(
                "model `{model}` names no model: write `{provider}/<model>`, for example `openai/gpt-4o-mini`"
            ),
        ));
    }
    let key = |variable: &str| {
        env(variable).ok_or_else(|| {
            ProviderError::new(
                ProviderErrorKind::KeyMissing,
                format!(
                    "model `{model}` needs an API key and {variable} is not set: `export {variable}=...`, or run offline with `--model mock`"
                ),
            )
        })
    };
    let base_url = |variable: &str, default: Option<&str>| -> Result<String, ProviderError> {
        let (url, from) = match (&settings.base_url, env(variable), default) {
            (Some(url), _, _) => (url.clone(), "`provider.base_url`".to_owned()),
            (None, Some(url), _) => (url, variable.to_owned()),
            (None, None, Some(default)) => (default.to_owned(), "the default".to_owned()),
            (None, None, None) => {
                return Err(ProviderError::new(
                    ProviderErrorKind::Unavailable,
                    format!(
                        "model `{model}` needs the server's URL: set `provider: {{ base_url: http://host:port/v1 }}` in the spec, or {variable}"
                    ),
                ));
            }
        };
        let url = if provider == "ollama" && from == "OLLAMA_HOST" { ollama::host_url(&url) } else { url };
        check_url(&url, &from)?;
        Ok(url)
    };
    let settings = settings.clone();
    Ok(match provider {
        "openai" => Arc::new(openai::OpenAiChat::new(
            openai::Flavor::OpenAi,
            &base_url("OPENAI_BASE_URL", Some(defaults::OPENAI_BASE_URL))?,
            Some(key("OPENAI_API_KEY")?),
            settings,
        )),
        "openrouter" => Arc::new(openai::OpenAiChat::new(
            openai::Flavor::OpenRouter,
            &base_url("OPENROUTER_BASE_URL", Some(defaults::OPENROUTER_BASE_URL))?,
            Some(key("OPENROUTER_API_KEY")?),
            settings,
        )),
        "openai-compatible" => Arc::new(openai::OpenAiChat::new(
            openai::Flavor::Compatible,
            &base_url("OPENAI_BASE_URL", None)?,
            env("OPENAI_API_KEY"),
            settings,
        )),
        "anthropic" => Arc::new(anthropic::AnthropicMessages::new(
            &base_url("ANTHROPIC_BASE_URL", Some(defaults::ANTHROPIC_BASE_URL))?,
            key("ANTHROPIC_API_KEY")?,
            settings,
        )),
        "ollama" => Arc::new(ollama::OllamaChat::new(
            &base_url("OLLAMA_HOST", Some(defaults::OLLAMA_HOST))?,
            env("OLLAMA_API_KEY"),
            settings,
        )),
        _ => unreachable!("every name of PROVIDER_NAMES is matched above"),
    })
}

/// A base URL must be an absolute `http` or `https` URL.
fn check_url(url: &str, from: &str) -> Result<(), ProviderError> {
    let parsed =
        reqwest::Url::parse(url).ok().filter(|u| matches!(u.scheme(), "http" | "https") && u.has_host());
    if parsed.is_none() {
        return Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!("the base URL from {from} ({url:?}) is not an http:// or https:// URL"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    fn error_of(
        model: &str,
        settings: &ProviderSettings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> ProviderError {
        match from_model_with_env(model, settings, None, env) {
            Ok(_) => panic!("{model} should not build"),
            Err(error) => error,
        }
    }

    #[test]
    fn a_missing_key_names_its_variable_and_the_mock() {
        let none = |_: &str| None;
        for (model, variable) in [
            ("openai/gpt-4o-mini", "OPENAI_API_KEY"),
            ("anthropic/claude-sonnet-4-5", "ANTHROPIC_API_KEY"),
            ("openrouter/meta-llama/llama-3.1-8b-instruct", "OPENROUTER_API_KEY"),
        ] {
            let error = error_of(model, &ProviderSettings::default(), &none);
            assert_eq!(error.kind, ProviderErrorKind::KeyMissing, "{model}");
            assert!(
                error.message.contains(variable) && error.message.contains("--model mock"),
                "{}",
                error.message
            );
        }
        // An empty variable is as good as none.
        let blank = env_of(&[("OPENAI_API_KEY", "  ")]);
        assert_eq!(
            error_of("openai/gpt-4o", &ProviderSettings::default(), &blank).kind,
            ProviderErrorKind::KeyMissing
        );
        // Keyless providers need none.
        assert!(from_model_with_env("ollama/llama3.2", &ProviderSettings::default(), None, &none).is_ok());
    }

    #[test]
    fn a_compatible_server_needs_a_url_and_urls_are_checked() {
        let none = |_: &str| None;
        let error = error_of("openai-compatible/qwen", &ProviderSettings::default(), &none);
        assert!(
            error.message.contains("base_url") && error.message.contains("OPENAI_BASE_URL"),
            "{}",
            error.message
        );
        let from_env = env_of(&[("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1")]);
        assert!(
            from_model_with_env("openai-compatible/qwen", &ProviderSettings::default(), None, &from_env)
                .is_ok()
        );
        let bad = ProviderSettings { base_url: Some("ftp://x".into()), ..ProviderSettings::default() };
        let error = error_of("ollama/llama3.2", &bad, &none);
        assert!(error.message.contains("provider.base_url"), "{}", error.message);
        assert!(error_of("openai/", &ProviderSettings::default(), &none).message.contains("names no model"));
        assert!(
            error_of("bogus/x", &ProviderSettings::default(), &none).message.contains("unknown provider")
        );
    }
}
