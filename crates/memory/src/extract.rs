//! Reading the memory model's extraction: JSON entities and relations, normalized and bounded.

use serde_json::{Value, json};

/// The most entities one extraction keeps.
const MAX_ENTITIES: usize = 50;
/// The most relations one extraction keeps.
const MAX_RELATIONS: usize = 100;
/// The longest entity name kept, in characters.
const MAX_NAME_CHARS: usize = 80;
/// The longest relation name kept.
const MAX_RELATION_CHARS: usize = 40;

/// What an extraction adds to the graph, as store records: `(key, value)` pairs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extraction {
    /// Entities by normalized name: `{name, type?}`.
    pub entities: Vec<(String, Value)>,
    /// Relations by `from —[relation]→ to`: `{from, relation, to, confidence}`.
    pub relations: Vec<(String, Value)>,
    /// Items left out: malformed, empty, self-referring, or over the caps.
    pub skipped: usize,
}

/// The JSON Schema the extraction is asked to match (providers that support structured output
/// enforce it).
pub fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "entities": { "type": "array", "items": {
                "type": "object",
                "properties": { "name": { "type": "string" }, "type": { "type": "string" } },
                "required": ["name"]
            } },
            "relations": { "type": "array", "items": {
                "type": "object",
                "properties": {
                    "from": { "type": "string" }, "relation": { "type": "string" },
                    "to": { "type": "string" }, "confidence": { "type": "number" }
                },
                "required": ["from", "relation", "to"]
            } }
        },
        "required": ["entities", "relations"]
    })
}

/// An entity's name as the graph keys it: control characters dropped, whitespace collapsed,
/// trimmed, lowercased, at most 80 characters.
pub fn normalize_name(name: &str) -> String {
    let cleaned: String = name.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let collapsed = cleaned.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase();
    collapsed.chars().take(MAX_NAME_CHARS).collect::<String>().trim_end().to_owned()
}

/// A relation's name: normalized like a name, then spaces and dashes as `_`, only letters,
/// digits and `_` kept.
fn normalize_relation(relation: &str) -> String {
    let name = normalize_name(relation).replace([' ', '-'], "_");
    name.chars().filter(|c| c.is_alphanumeric() || *c == '_').take(MAX_RELATION_CHARS).collect()
}

/// The store key of a relation.
pub(crate) fn relation_key(from: &str, relation: &str, to: &str) -> String {
    format!("{from} —[{relation}]→ {to}")
}

/// Reads the model's reply: a JSON object (in a code fence or not) with `entities` and
/// `relations`. Anything else is an error saying what came instead; malformed items inside a
/// good reply are skipped and counted.
pub fn parse_extraction(reply: &str) -> Result<Extraction, String> {
    let text = strip_fence(reply.trim());
    let value: Value = serde_json::from_str(text).map_err(|e| {
        let start: String = text.chars().take(80).collect();
        format!("the extraction is not JSON ({e}); it began {start:?}")
    })?;
    let Value::Object(object) = &value else {
        return Err(format!("the extraction is JSON but not an object: {}", kind(&value)));
    };
    let list = |key: &str| -> Result<&[Value], String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(&[]),
            Some(Value::Array(items)) => Ok(items),
            Some(other) => Err(format!("the extraction's `{key}` is {}, not a list", kind(other))),
        }
    };
    let (entity_items, relation_items) = (list("entities")?, list("relations")?);
    if object.get("entities").is_none() && object.get("relations").is_none() {
        return Err("the extraction has neither `entities` nor `relations`".to_owned());
    }
    let mut out = Extraction::default();
    let add_entity = |out: &mut Extraction, name: &str, kind: Option<&str>| {
        if out.entities.iter().any(|(key, _)| key == name) {
            return;
        }
        if out.entities.len() >= MAX_ENTITIES {
            out.skipped += 1;
            return;
        }
        let mut value = json!({ "name": name });
        if let Some(kind) = kind.map(normalize_name).filter(|k| !k.is_empty()) {
            value["type"] = kind.into();
        }
        out.entities.push((name.to_owned(), value));
    };
    for item in entity_items {
        let name = item.get("name").and_then(Value::as_str).map(normalize_name).filter(|n| !n.is_empty());
        match name {
            Some(name) => add_entity(&mut out, &name, item.get("type").and_then(Value::as_str)),
            None => out.skipped += 1,
        }
    }
    for item in relation_items {
        let field = |key: &str| item.get(key).and_then(Value::as_str);
        let from = field("from").map(normalize_name).filter(|n| !n.is_empty());
        let to = field("to").map(normalize_name).filter(|n| !n.is_empty());
        let relation = field("relation").map(normalize_relation).filter(|n| !n.is_empty());
        let (Some(from), Some(relation), Some(to)) = (from, relation, to) else {
            out.skipped += 1;
            continue;
        };
        if from == to || out.relations.len() >= MAX_RELATIONS {
            out.skipped += 1;
            continue;
        }
        let confidence = item.get("confidence").and_then(Value::as_f64).unwrap_or(0.5).clamp(0.0, 1.0);
        let key = relation_key(&from, &relation, &to);
        match out.relations.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => {
                if existing["confidence"].as_f64().unwrap_or(0.0) < confidence {
                    existing["confidence"] = confidence.into();
                }
            }
            None => {
                // A relation's ends are entities too.
                add_entity(&mut out, &from, None);
                add_entity(&mut out, &to, None);
                let value = json!({ "from": from, "relation": relation, "to": to, "confidence": confidence });
                out.relations.push((key, value));
            }
        }
    }
    Ok(out)
}

fn strip_fence(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("```") else { return text };
    let rest = rest.split_once('\n').map_or(rest, |(_, body)| body);
    rest.trim_end().strip_suffix("```").unwrap_or(rest).trim()
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
