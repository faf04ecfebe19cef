//! What an MCP tool result becomes for keel: one JSON value the model reads, or a tool error.
//!
//! Read from the result's wire form (`content`, `structuredContent`, `isError`), so every
//! protocol version maps the same way:
//! - `isError: true` → a tool error (`KEEL_TOOL_FAILED`) whose message is the content's text;
//! - `structuredContent` → that value, as is (the text blocks beside it repeat it for older
//!   clients), unless the content also has something text cannot say (an image...);
//! - only text blocks → their text, joined by blank lines; parsed when it is a JSON object or
//!   array (as a command tool's output is), since servers often write JSON as text;
//! - anything else → a list of the blocks: text as is; an image with its data (up to
//!   [`MAX_IMAGE_BYTES`]; providers show it to the model with the result, see
//!   `keel_core::message::tool_output_images`), a larger one and audio as their media type and
//!   size; an embedded resource as its URI, media type and text (or its size when binary); a
//!   resource link as its URI, name and description.

use base64::Engine as _;
use keel_core::{ErrorCode, ToolError, ToolOutcome};
use serde_json::{Map, Value, json};

/// The largest image passed on to the model (decoded); a larger one is described instead.
pub const MAX_IMAGE_BYTES: usize = 5 * 1024 * 1024;

/// Maps a `tools/call` result (its JSON form) to keel's outcome.
pub fn to_outcome(result: &Value) -> ToolOutcome {
    let blocks: &[Value] = result.get("content").and_then(Value::as_array).map_or(&[], Vec::as_slice);
    let is_error = result.get("isError").and_then(Value::as_bool).unwrap_or(false);
    if is_error {
        let text =
            texts(blocks).unwrap_or_else(|| blocks.iter().map(describe).map(|v| v.to_string()).collect());
        let message = if text.trim().is_empty() { "the MCP tool reported an error".to_owned() } else { text };
        return Err(ToolError::with_code(ErrorCode::ToolFailed, message, false));
    }
    let only_text = blocks.iter().all(|block| block.get("type").and_then(Value::as_str) == Some("text"));
    match result.get("structuredContent") {
        Some(structured) if only_text => return Ok(structured.clone()),
        _ => {}
    }
    if only_text {
        let text = texts(blocks).unwrap_or_default();
        let trimmed = text.trim_start();
        if (trimmed.starts_with('{') || trimmed.starts_with('['))
            && let Ok(value) = serde_json::from_str::<Value>(&text)
        {
            return Ok(value);
        }
        return Ok(Value::String(text));
    }
    let mut items: Vec<Value> = blocks.iter().map(describe).collect();
    if let Some(structured) = result.get("structuredContent") {
        items.push(json!({ "type": "structured", "value": structured }));
    }
    Ok(Value::Array(items))
}

/// The text blocks' text joined by blank lines, when every block is text.
fn texts(blocks: &[Value]) -> Option<String> {
    let mut parts = Vec::with_capacity(blocks.len());
    for block in blocks {
        if block.get("type").and_then(Value::as_str) != Some("text") {
            return None;
        }
        parts.push(block.get("text").and_then(Value::as_str).unwrap_or_default());
    }
    Some(parts.join("\n\n"))
}

/// One content block as the model reads it.
fn describe(block: &Value) -> Value {
    let field = |name: &str| block.get(name).and_then(Value::as_str);
    match field("type") {
        Some("text") => json!({ "type": "text", "text": field("text").unwrap_or_default() }),
        Some("image") if decoded_len(field("data").unwrap_or_default()) <= MAX_IMAGE_BYTES => json!({
            "type": "image",
            "mimeType": field("mimeType").unwrap_or("image/png"),
            "data": field("data").unwrap_or_default(),
        }),
        Some(kind @ ("image" | "audio")) => json!({
            "type": kind,
            "mimeType": field("mimeType").unwrap_or("application/octet-stream"),
            "bytes": decoded_len(field("data").unwrap_or_default()),
        }),
        Some("resource") => {
            let resource = block.get("resource").cloned().unwrap_or(Value::Null);
            let mut out = Map::new();
            out.insert("type".into(), "resource".into());
            for key in ["uri", "mimeType", "text"] {
                if let Some(value) = resource.get(key) {
                    out.insert(key.into(), value.clone());
                }
            }
            if let Some(blob) = resource.get("blob").and_then(Value::as_str) {
                out.insert("bytes".into(), decoded_len(blob).into());
            }
            Value::Object(out)
        }
        Some("resource_link") => {
            let mut out = Map::new();
            out.insert("type".into(), "resource_link".into());
            for key in ["uri", "name", "title", "description", "mimeType"] {
                if let Some(value) = block.get(key) {
                    out.insert(key.into(), value.clone());
                }
            }
            Value::Object(out)
        }
        _ => block.clone(),
    }
}

/// The size of base64 data once decoded (its length estimate when it is not valid base64).
fn decoded_len(data: &str) -> usize {
    base64::engine::general_purpose::STANDARD.decode(data).map_or(data.len() / 4 * 3, |bytes| bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_results_become_their_text() {
        let result = json!({ "content": [{ "type": "text", "text": "Echo: hi" }] });
        assert_eq!(to_outcome(&result).unwrap(), json!("Echo: hi"));
        let two = json!({ "content": [{ "type": "text", "text": "a" }, { "type": "text", "text": "b" }] });
        assert_eq!(to_outcome(&two).unwrap(), json!("a\n\nb"));
        assert_eq!(to_outcome(&json!({ "content": [] })).unwrap(), json!(""));
        let json_text = json!({ "content": [{ "type": "text", "text": "{\n  \"a\": [1, 2]\n}" }] });
        assert_eq!(to_outcome(&json_text).unwrap(), json!({ "a": [1, 2] }));
        let not_quite = json!({ "content": [{ "type": "text", "text": "{not json" }] });
        assert_eq!(to_outcome(&not_quite).unwrap(), json!("{not json"));
    }

    #[test]
    fn structured_content_wins_over_its_text_copy() {
        let result = json!({
            "content": [{ "type": "text", "text": "{\"result\":42}" }],
            "structuredContent": { "result": 42 },
        });
        assert_eq!(to_outcome(&result).unwrap(), json!({ "result": 42 }));
    }

    #[test]
    fn errors_are_tool_errors_with_the_text() {
        let result = json!({ "content": [{ "type": "text", "text": "boom" }], "isError": true });
        let error = to_outcome(&result).unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolFailed);
        assert_eq!(error.message, "boom");
        let empty = to_outcome(&json!({ "content": [], "isError": true })).unwrap_err();
        assert_eq!(empty.message, "the MCP tool reported an error");
    }

    #[test]
    fn media_and_resources_are_described() {
        let result = json!({ "content": [
            { "type": "text", "text": "here" },
            { "type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo=" },
            { "type": "audio", "mimeType": "audio/wav", "data": "UklGRg==" },
            { "type": "resource", "resource": { "uri": "file:///a.txt", "mimeType": "text/plain", "text": "hello" } },
            { "type": "resource", "resource": { "uri": "file:///b.bin", "blob": "AAEC" } },
            { "type": "resource_link", "uri": "file:///c", "name": "c", "description": "the c file" },
        ], "structuredContent": { "n": 1 } });
        assert_eq!(
            to_outcome(&result).unwrap(),
            json!([
                { "type": "text", "text": "here" },
                { "type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo=" },
                { "type": "audio", "mimeType": "audio/wav", "bytes": 4 },
                { "type": "resource", "uri": "file:///a.txt", "mimeType": "text/plain", "text": "hello" },
                { "type": "resource", "uri": "file:///b.bin", "bytes": 3 },
                { "type": "resource_link", "uri": "file:///c", "name": "c", "description": "the c file" },
                { "type": "structured", "value": { "n": 1 } },
            ])
        );
    }
}
