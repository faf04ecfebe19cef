//! keel-providers: model providers behind keel-core's [`Provider`] trait.
//!
//! - [`MockProvider`]: plays an agent's `mock.script`, so every example and test runs offline.
//!
//! [`from_model`] picks the provider for a spec's `model` string (`provider/model`).

mod mock;

use std::sync::Arc;

use keel_core::provider::ProviderErrorKind;
use keel_core::{MockScript, Provider, ProviderError};

pub use mock::MockProvider;

/// The provider names a spec's `model` may start with.
pub const PROVIDER_NAMES: &[&str] = &["mock", "openai", "anthropic", "ollama", "openrouter"];

/// The provider for a `model` string: `mock`, or `provider/model`.
///
/// `mock` plays `script` (an empty script echoes the input). Providers reached over the network
/// are not in this build yet and fail with `KEEL_PROVIDER_UNAVAILABLE`.
pub fn from_model(model: &str, script: Option<&MockScript>) -> Result<Arc<dyn Provider>, ProviderError> {
    let provider = model.split_once('/').map_or(model, |(provider, _)| provider);
    match provider {
        "mock" => Ok(Arc::new(MockProvider::new(script.cloned().unwrap_or_default()))),
        known if PROVIDER_NAMES.contains(&known) => Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!(
                "the `{known}` provider is not available in this build of keel yet; use `mock` (with `mock.script`) to run offline"
            ),
        )),
        other => Err(ProviderError::new(
            ProviderErrorKind::Unavailable,
            format!(
                "unknown provider `{other}` in model `{model}`; known providers: {}",
                PROVIDER_NAMES.join(", ")
            ),
        )),
    }
}
