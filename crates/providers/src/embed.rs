//! Embeddings: OpenAI's `POST /v1/embeddings` (also OpenRouter and OpenAI-compatible servers:
//! vLLM, llama.cpp's `llama-server --embeddings`, LM Studio...) and Ollama's `POST /api/embed`.
//! Semantic memory ranks passages by them, fused with its full-text ranking.

use keel_core::ProviderError;
use keel_core::provider::ProviderErrorKind;
use reqwest::header::HeaderMap;
use serde::Deserialize;
use serde_json::json;

use crate::http;

/// The most inputs one request carries: OpenAI accepts 2,048; smaller batches keep each
/// request well under servers' body limits.
pub const BATCH: usize = 64;

/// The wire of an embeddings endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// `{model, input: [..]}` → `{data: [{index, embedding}]}`.
    OpenAi,
    /// `{model, input: [..]}` → `{embeddings: [[..]]}`.
    Ollama,
}

/// Embeds `inputs` at `url`, in batches of [`BATCH`]; one vector per input, in order.
pub(crate) async fn embed(
    provider: &str,
    wire: Wire,
    url: &str,
    headers: HeaderMap,
    key: Option<&str>,
    model: &str,
    inputs: &[String],
) -> Result<Vec<Vec<f32>>, ProviderError> {
    let mut vectors = Vec::with_capacity(inputs.len());
    for batch in inputs.chunks(BATCH) {
        let body = match wire {
            Wire::OpenAi => json!({ "model": model, "input": batch, "encoding_format": "float" }),
            Wire::Ollama => json!({ "model": model, "input": batch }),
        };
        let response =
            http::post(provider, url, headers.clone(), &body).await.map_err(|e| http::redact(e, key))?;
        if http::is_html(response.headers()) {
            let body = http::read_capped(response, 64 * 1024).await;
            return Err(http::error_response(provider, Some(200), &body, true));
        }
        let body = http::read_capped(response, 256 * 1024 * 1024).await;
        let got = parse(provider, wire, &body, batch.len())?;
        vectors.extend(got);
    }
    Ok(vectors)
}

#[derive(Deserialize)]
struct OpenAiBody {
    data: Vec<OpenAiItem>,
}

#[derive(Deserialize)]
struct OpenAiItem {
    #[serde(default)]
    index: Option<usize>,
    embedding: Vec<f32>,
}

#[derive(Deserialize)]
struct OllamaBody {
    embeddings: Vec<Vec<f32>>,
}

/// The vectors of one response, checked: as many as asked, in the inputs' order, all of one
/// length, finite.
pub fn parse(
    provider: &str,
    wire: Wire,
    body: &[u8],
    expected: usize,
) -> Result<Vec<Vec<f32>>, ProviderError> {
    let bad = |what: String| {
        ProviderError::new(
            ProviderErrorKind::BadResponse,
            format!("{provider}: the embeddings response {what}: {}", http::snippet(body)),
        )
    };
    let vectors = match wire {
        Wire::OpenAi => {
            let parsed: OpenAiBody = serde_json::from_slice(body)
                .map_err(|e| bad(format!("is not what the API returns ({e})")))?;
            let mut items: Vec<(usize, Vec<f32>)> = parsed
                .data
                .into_iter()
                .enumerate()
                .map(|(position, item)| (item.index.unwrap_or(position), item.embedding))
                .collect();
            items.sort_by_key(|(index, _)| *index);
            if items.iter().enumerate().any(|(position, (index, _))| position != *index) {
                return Err(bad("does not number its vectors 0, 1, 2...".into()));
            }
            items.into_iter().map(|(_, vector)| vector).collect::<Vec<_>>()
        }
        Wire::Ollama => {
            let parsed: OllamaBody = serde_json::from_slice(body)
                .map_err(|e| bad(format!("is not what the API returns ({e})")))?;
            parsed.embeddings
        }
    };
    if vectors.len() != expected {
        return Err(bad(format!("has {} vectors for {expected} inputs", vectors.len())));
    }
    let dims = vectors.first().map_or(0, Vec::len);
    if dims == 0 || vectors.iter().any(|v| v.len() != dims || v.iter().any(|x| !x.is_finite())) {
        return Err(bad("has empty, uneven or non-finite vectors".into()));
    }
    Ok(vectors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_vectors_come_back_in_input_order() {
        let body = br#"{"object":"list","data":[{"object":"embedding","index":1,"embedding":[0.0,1.0]},{"object":"embedding","index":0,"embedding":[1.0,0.0]}],"model":"m","usage":{"prompt_tokens":2,"total_tokens":2}}"#;
        let vectors = parse("openai", Wire::OpenAi, body, 2).unwrap();
        assert_eq!(vectors, vec![vec![1.0, 0.0], vec![0.0, 1.0]]);
    }

    #[test]
    fn ollama_vectors_are_read() {
        let body = br#"{"model":"nomic-embed-text","embeddings":[[0.5,0.5,0.0]],"total_duration":1}"#;
        assert_eq!(parse("ollama", Wire::Ollama, body, 1).unwrap(), vec![vec![0.5, 0.5, 0.0]]);
    }

    #[test]
    fn short_uneven_or_garbled_answers_are_errors() {
        let two_for_three = br#"{"data":[{"index":0,"embedding":[1.0]},{"index":1,"embedding":[2.0]}]}"#;
        let error = parse("openai", Wire::OpenAi, two_for_three, 3).unwrap_err();
        assert!(error.message.contains("2 vectors for 3 inputs"), "{}", error.message);
        let uneven = br#"{"embeddings":[[1.0,2.0],[1.0]]}"#;
        assert!(parse("ollama", Wire::Ollama, uneven, 2).unwrap_err().message.contains("uneven"));
        let gaps = br#"{"data":[{"index":0,"embedding":[1.0]},{"index":2,"embedding":[2.0]}]}"#;
        assert!(parse("openai", Wire::OpenAi, gaps, 2).unwrap_err().message.contains("number"));
        let html = b"<html>nope</html>";
        assert_eq!(parse("openai", Wire::OpenAi, html, 1).unwrap_err().kind, ProviderErrorKind::BadResponse);
    }
}
