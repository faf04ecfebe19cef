//! keel-memory: what an agent remembers about its owners, kept in the store (DESIGN.md §9).
//!
//! [`MemoryEngine`] carries out the memory steps the run loop asks for
//! ([`keel_core::memory::MemoryRequest`]), each a journaled step of the run:
//!
//! - **episodic**: after a run, `memory:episode` asks the model for a one-sentence summary and
//!   keeps it (one per run, keyed by the run: idempotent; the owner's latest
//!   [`Episodic::MAX_PER_OWNER`] are kept); before a run, `memory:recall` shows the model the
//!   owner's latest episodes, oldest first.
//! - **graph**: after a run, `memory:extract` asks the model for the entities and relations the
//!   conversation establishes (JSON), normalizes their names and upserts them (a relation keeps
//!   its highest confidence); before a run, `memory:traverse` walks the graph from the entities
//!   the input mentions (breadth first, bounded by depth, fan-out and node count) and shows the
//!   model what it found as `- alice —[works_at]→ acme`.
//! - **semantic** ([`semantic`]): a folder of documents, indexed (full text, and embeddings
//!   when the provider has them); before a run, `memory:retrieve` shows the model the passages
//!   that best match the input (`inject`), or the model searches with tools (`agentic`). The
//!   `knowledge` cargo feature (on by default) brings it in.
//!
//! A failure (the model's output is not what was asked for, the store is away) is the step's
//! outcome: the runtime logs it and the run goes on without it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use keel_core::memory::{
    Episodic, GraphSettings, Memory, MemoryMerge, MemoryOutcome, MemoryRequest, MemoryScope, MemoryWrite,
    with_usage,
};
use keel_core::provider::CallPurpose;
use keel_core::{BoxFuture, Message, ModelRequest, Part, Provider, Store, Usage};
use serde_json::{Value, json};

mod extract;
#[cfg(feature = "knowledge")]
pub mod semantic;

pub use extract::{Extraction, normalize_name, parse_extraction};

/// The memory kinds' record kinds in the store.
pub const EPISODE: &str = "episode";
/// An entity of the graph (key: its normalized name).
pub const ENTITY: &str = "entity";
/// A relation of the graph (key: `from|relation|to`).
pub const RELATION: &str = "relation";

/// How long a memory model call may take.
const MODEL_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest rendering of a run sent to the memory model, in characters (the start is kept:
/// the input, then what followed).
const RUN_TEXT_CHARS: usize = 24_000;
/// The longest line of a run's rendering.
const LINE_CHARS: usize = 2_000;
/// The longest episode kept.
const EPISODE_CHARS: usize = 400;

const EPISODE_INSTRUCTIONS: &str = "You keep a diary of conversations between a user and an AI assistant. \
Summarise the conversation you are given in one sentence of at most 40 words: what the user wanted, \
what was done or decided, and anything to remember for next time. Reply with the sentence only.";

const EXTRACT_INSTRUCTIONS: &str = "You extract a knowledge graph from a conversation between a user and an \
AI assistant. List the people, organisations, places, products and other things the conversation says \
something definite about, and the relations between them that it states or confirms. Reply with JSON \
only: {\"entities\": [{\"name\": \"Alice\", \"type\": \"person\"}], \"relations\": [{\"from\": \"Alice\", \
\"relation\": \"works_at\", \"to\": \"Acme\", \"confidence\": 0.9}]}. Relations are short snake_case verbs; \
confidence is between 0 and 1. When the user speaks of themselves, name them \"user\". Nothing to \
extract: {\"entities\": [], \"relations\": []}.";

/// Carries out memory steps over a store and a model. See the crate docs.
pub struct MemoryEngine {
    store: Arc<dyn Store>,
    provider: Arc<dyn Provider>,
    /// The model (of the provider) that writes episodes and extracts the graph.
    model: String,
    /// The folders of documents the agent retrieves from.
    #[cfg(feature = "knowledge")]
    libraries: Vec<Arc<semantic::Library>>,
}

impl MemoryEngine {
    /// An engine keeping memory in `store`, asking `model` of `provider` to summarise and extract.
    pub fn new(store: Arc<dyn Store>, provider: Arc<dyn Provider>, model: impl Into<String>) -> MemoryEngine {
        MemoryEngine {
            store,
            provider,
            model: model.into(),
            #[cfg(feature = "knowledge")]
            libraries: Vec::new(),
        }
    }

    /// The engine with folders of documents to retrieve from (`memory:retrieve` steps).
    #[cfg(feature = "knowledge")]
    pub fn with_libraries(mut self, libraries: Vec<Arc<semantic::Library>>) -> MemoryEngine {
        self.libraries = libraries;
        self
    }

    #[cfg(feature = "knowledge")]
    async fn retrieve(&self, skill: Option<&str>, query: &str) -> MemoryOutcome {
        let library =
            self.libraries.iter().find(|library| library.knowledge().skill.as_deref() == skill).ok_or_else(
                || match skill {
                    Some(skill) => format!("skill `{skill}` has no knowledge to retrieve from"),
                    None => "the agent has no semantic memory".to_owned(),
                },
            )?;
        library.retrieve(query).await
    }

    /// Without the `knowledge` feature no agent has documents (the spec loader refuses them), so
    /// a `memory:retrieve` step only comes from a journal written by a build that had them.
    #[cfg(not(feature = "knowledge"))]
    async fn retrieve(&self, _skill: Option<&str>, _query: &str) -> MemoryOutcome {
        Err("this keel was built without the `knowledge` cargo feature: there are no documents to retrieve from".into())
    }

    async fn recall(&self, owner: &str, limit: usize) -> MemoryOutcome {
        let episodes = self.store.load_memory(owner, Some(EPISODE)).await.map_err(|e| e.to_string())?;
        let mut latest: Vec<_> = episodes.into_iter().take(limit).collect();
        latest.reverse();
        if latest.is_empty() {
            return Ok(json!({ "context": "", "episodes": 0 }));
        }
        let mut context = String::from("## What you remember from earlier conversations (oldest first)\n");
        for episode in &latest {
            let text = episode.value.get("text").and_then(Value::as_str).unwrap_or_default();
            let day = keel_core::clock::rfc3339(episode.updated_ms);
            context.push_str(&format!("- {}: {text}\n", day.get(..10).unwrap_or(&day)));
        }
        Ok(json!({ "context": context.trim_end(), "episodes": latest.len() }))
    }

    async fn traverse(&self, owner: &str, text: &str, settings: GraphSettings) -> MemoryOutcome {
        // Episodes are no part of the walk: only the graph's two kinds are read.
        let mut items = self.store.load_memory(owner, Some(ENTITY)).await.map_err(|e| e.to_string())?;
        items.extend(self.store.load_memory(owner, Some(RELATION)).await.map_err(|e| e.to_string())?);
        let mut entities: Vec<(String, u64)> = Vec::new();
        let mut edges: HashMap<String, Vec<Edge>> = HashMap::new();
        for item in &items {
            match item.kind.as_str() {
                ENTITY => entities.push((item.key.clone(), item.updated_ms)),
                RELATION => {
                    let Some(edge) = Edge::of(&item.value) else { continue };
                    edges.entry(edge.from.clone()).or_default().push(edge.clone());
                    edges.entry(edge.to.clone()).or_default().push(edge);
                }
                _ => {}
            }
        }
        let seeds = seeds(text, &entities, settings.max_seeds);
        if seeds.is_empty() {
            return Ok(json!({ "context": "", "seeds": [], "relations": 0 }));
        }
        for list in edges.values_mut() {
            list.sort_by(|a, b| b.confidence.total_cmp(&a.confidence).then_with(|| a.key().cmp(&b.key())));
        }
        let lines = walk(&seeds, &edges, settings);
        if lines.is_empty() {
            return Ok(json!({ "context": "", "seeds": seeds, "relations": 0 }));
        }
        let mut context = String::from("## What you know about what this message mentions\n");
        for line in &lines {
            context.push_str(line);
            context.push('\n');
        }
        Ok(json!({ "context": context.trim_end(), "seeds": seeds, "relations": lines.len() }))
    }

    async fn episode(
        &self,
        scope: MemoryScope<'_>,
        messages: &[Arc<Message>],
        call_index: u64,
    ) -> MemoryOutcome {
        let (reply, usage) =
            self.ask(EPISODE_INSTRUCTIONS, messages, call_index, CallPurpose::Episode, None).await?;
        let sentence = reply.lines().map(str::trim).find(|line| !line.is_empty()).unwrap_or_default();
        if sentence.is_empty() {
            return Err("the model wrote an empty episode".to_owned());
        }
        let sentence = cut(sentence, EPISODE_CHARS);
        let write = MemoryWrite {
            items: vec![(
                scope.run.as_str().to_owned(),
                json!({ "text": sentence, "session": scope.session.external(), "run": scope.run.as_str() }),
            )],
            merge: MemoryMerge::Replace,
            keep_newest: Some(Episodic::MAX_PER_OWNER),
        };
        self.store.write_memory(scope.owner, EPISODE, write).await.map_err(|e| e.to_string())?;
        Ok(with_usage(json!({ "episode": sentence }), usage))
    }

    async fn extract(
        &self,
        scope: MemoryScope<'_>,
        messages: &[Arc<Message>],
        call_index: u64,
    ) -> MemoryOutcome {
        let schema = extract::schema();
        let (reply, usage) =
            self.ask(EXTRACT_INSTRUCTIONS, messages, call_index, CallPurpose::Extract, Some(&schema)).await?;
        let extraction = parse_extraction(&reply)?;
        let entities = MemoryWrite {
            items: extraction.entities.iter().map(|(key, value)| (key.clone(), value.clone())).collect(),
            merge: MemoryMerge::Replace,
            keep_newest: Some(GraphSettings::MAX_ENTITIES),
        };
        let relations = MemoryWrite {
            items: extraction.relations.iter().map(|(key, value)| (key.clone(), value.clone())).collect(),
            merge: MemoryMerge::KeepHigher("confidence"),
            keep_newest: Some(GraphSettings::MAX_RELATIONS),
        };
        let (entity_count, relation_count) = (entities.items.len(), relations.items.len());
        if entity_count > 0 {
            self.store.write_memory(scope.owner, ENTITY, entities).await.map_err(|e| e.to_string())?;
        }
        if relation_count > 0 {
            self.store.write_memory(scope.owner, RELATION, relations).await.map_err(|e| e.to_string())?;
        }
        let kept =
            json!({ "entities": entity_count, "relations": relation_count, "skipped": extraction.skipped });
        Ok(with_usage(kept, usage))
    }

    /// One model call about the run: `instructions`, then the run as text.
    async fn ask(
        &self,
        instructions: &str,
        messages: &[Arc<Message>],
        call_index: u64,
        purpose: CallPurpose,
        output_schema: Option<&Value>,
    ) -> Result<(String, Usage), String> {
        let conversation = [Arc::new(Message::user(render_run(messages)))];
        let request = ModelRequest {
            model: &self.model,
            instructions,
            messages: &conversation,
            tools: &[],
            output_schema,
            call_index,
            attempt: 1,
            tool_choice: None,
            purpose,
        };
        // Memory calls stream to nobody.
        let mut quiet = keel_core::provider::DiscardDeltas;
        let reply = tokio::time::timeout(MODEL_TIMEOUT, self.provider.complete(request, &mut quiet))
            .await
            .map_err(|_| format!("the memory model did not answer within {MODEL_TIMEOUT:?}"))?
            .map_err(|e| format!("the memory model failed: {e} ({})", e.code()))?;
        let text = reply
            .parts
            .iter()
            .filter_map(|part| if let Part::Text(text) = part { Some(text.as_str()) } else { None });
        Ok((text.collect(), reply.usage))
    }
}

impl Memory for MemoryEngine {
    fn call<'a>(
        &'a self,
        scope: MemoryScope<'a>,
        request: &'a MemoryRequest,
    ) -> BoxFuture<'a, MemoryOutcome> {
        Box::pin(async move {
            match request {
                MemoryRequest::Recall { limit } => self.recall(scope.owner, *limit).await,
                MemoryRequest::Traverse { text, graph } => self.traverse(scope.owner, text, *graph).await,
                MemoryRequest::Episode { messages, call_index } => {
                    self.episode(scope, messages, *call_index).await
                }
                MemoryRequest::Extract { messages, call_index } => {
                    self.extract(scope, messages, *call_index).await
                }
                MemoryRequest::Retrieve { skill, query } => self.retrieve(skill.as_deref(), query).await,
            }
        })
    }
}

/// A relation as stored.
#[derive(Clone, Debug)]
struct Edge {
    from: String,
    relation: String,
    to: String,
    confidence: f64,
}

impl Edge {
    fn of(value: &Value) -> Option<Edge> {
        let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
        Some(Edge {
            from: text("from")?,
            relation: text("relation")?,
            to: text("to")?,
            confidence: value.get("confidence").and_then(Value::as_f64).unwrap_or(0.5),
        })
    }

    fn key(&self) -> String {
        extract::relation_key(&self.from, &self.relation, &self.to)
    }
}

/// The entities `text` mentions (as whole words, after normalization): the longest names
/// first (`new york` before `york`), then the most recently seen, at most `max`.
fn seeds(text: &str, entities: &[(String, u64)], max: usize) -> Vec<String> {
    let haystack = format!(" {} ", words(&normalize_name(text)));
    let mut found: Vec<&(String, u64)> =
        entities.iter().filter(|(name, _)| haystack.contains(&format!(" {} ", words(name)))).collect();
    found.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| b.1.cmp(&a.1)).then_with(|| a.0.cmp(&b.0)));
    found.into_iter().take(max).map(|(name, _)| name.clone()).collect()
}

/// `text` with everything but letters and digits as single spaces (for whole-word matching).
fn words(text: &str) -> String {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).collect::<Vec<_>>().join(" ")
}

/// A breadth-first walk from `seeds`: each entity's `fan_out` strongest relations, up to
/// `depth` hops, until `max_nodes` entities are reached; each relation rendered once.
fn walk(seeds: &[String], edges: &HashMap<String, Vec<Edge>>, settings: GraphSettings) -> Vec<String> {
    let mut reached: HashSet<String> = seeds.iter().cloned().collect();
    let mut queue: VecDeque<(String, usize)> = seeds.iter().map(|s| (s.clone(), 0)).collect();
    let mut shown: HashSet<String> = HashSet::new();
    let mut lines = Vec::new();
    while let Some((node, hops)) = queue.pop_front() {
        if hops >= settings.depth {
            continue;
        }
        for edge in edges.get(&node).into_iter().flatten().take(settings.fan_out) {
            let other = if edge.from == node { &edge.to } else { &edge.from };
            if !reached.contains(other) {
                if reached.len() >= settings.max_nodes {
                    continue;
                }
                reached.insert(other.clone());
                queue.push_back((other.clone(), hops + 1));
            }
            if shown.insert(edge.key()) {
                lines.push(format!("- {} —[{}]→ {}", edge.from, edge.relation, edge.to));
            }
        }
    }
    lines
}

/// A run as plain lines for the memory model: who said what, which tools were called with
/// what and what they returned; long lines cut, and the whole bounded (the start kept).
fn render_run(messages: &[Arc<Message>]) -> String {
    let mut text = String::new();
    for line in messages.iter().flat_map(|message| message.plain_lines()) {
        text.push_str(&cut(&line, LINE_CHARS));
        text.push('\n');
        if text.len() > RUN_TEXT_CHARS {
            text = cut(&text, RUN_TEXT_CHARS);
            text.push_str("\n[the rest of the conversation is left out]\n");
            return text;
        }
    }
    text
}

/// `text` cut to at most `max` characters, with a marker when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests;
