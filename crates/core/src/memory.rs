//! Memory that outlives a session: what an agent remembers about an owner (DESIGN.md §9).
//!
//! Two kinds live in the store, per owner: **episodic** (a one-sentence summary of each run,
//! the latest recalled at the start of the next runs) and **graph** (entities and the relations
//! between them, extracted after each run, a bounded neighbourhood of what the input mentions
//! shown to the model). Every memory operation is a journaled step of the run
//! (`memory:recall`, `memory:traverse` before the first turn; `memory:episode`,
//! `memory:extract` after the answer), so a re-driven run never pays for one twice; a failed one
//! never fails the run.
//!
//! A third kind is not about an owner: **semantic** memory (and a skill's `knowledge`) is a
//! folder of documents the agent retrieves from ([`Knowledge`]), through a `memory:retrieve`
//! step before the first turn (`mode: inject`) or the `search_memory`/`read_memory` tools
//! (`mode: agentic`).
//!
//! The machine asks for them ([`MemoryRequest`]); the runtime carries them out through
//! [`Memory`] (implemented by `keel-memory`), which reads and writes the store's memory records
//! ([`MemoryItem`], [`MemoryWrite`]).

use std::sync::Arc;

use serde_json::Value;

use crate::BoxFuture;
use crate::event::Usage;
use crate::ids::{RunId, SessionId};
use crate::message::Message;

/// The agent's memory: what it keeps (spec key `memory`) and who keeps it.
#[derive(Clone, Default)]
pub struct AgentMemory {
    /// What the agent remembers.
    pub settings: MemorySettings,
    /// Carries the memory steps out (`None` without memory).
    pub engine: Option<Arc<dyn Memory>>,
}

impl std::fmt::Debug for AgentMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMemory")
            .field("settings", &self.settings)
            .field("engine", &self.engine.is_some())
            .finish()
    }
}

/// The kinds of memory an agent keeps (spec key `memory`: one kind or a list).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySettings {
    /// Episodes: a summary of each run.
    pub episodic: Option<Episodic>,
    /// Entities and relations.
    pub graph: Option<GraphSettings>,
    /// The model (of the agent's provider) that writes episodes and extracts the graph; the
    /// agent's when `None`.
    pub model: Option<String>,
    /// Documents to retrieve from: the agent's own (`kind: semantic`, no skill) and its skills'
    /// `knowledge`.
    pub knowledge: Vec<Knowledge>,
}

impl MemorySettings {
    /// Whether the agent remembers or retrieves anything.
    pub fn is_empty(&self) -> bool {
        self.episodic.is_none() && self.graph.is_none() && self.knowledge.is_empty()
    }

    /// The tools the model gets for documents in `agentic` mode (`search_memory`,
    /// `read_memory`, `search_<skill>`...), in order.
    pub fn knowledge_tools(&self) -> Vec<String> {
        self.knowledge
            .iter()
            .filter(|k| k.mode == RetrievalMode::Agentic)
            .flat_map(|k| {
                let (search, read) = k.tool_names();
                [search, read]
            })
            .collect()
    }
}

/// A folder of documents the agent retrieves from: `memory: { kind: semantic }` (no skill) or a
/// skill's `knowledge`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Knowledge {
    /// The skill whose knowledge it is; `None` for the agent's semantic memory.
    pub skill: Option<String>,
    /// The folder of documents (absolute once loaded from a spec).
    pub source: std::path::PathBuf,
    /// How the model gets at it.
    pub mode: RetrievalMode,
    /// How many passages a retrieval returns (`top_k`, 1 to [`Knowledge::MAX_TOP_K`]).
    pub top_k: usize,
    /// How long a passage's snippet is, in characters.
    pub snippet_chars: usize,
    /// Whether, and with which model, passages are also ranked by embeddings.
    pub embeddings: Embeddings,
}

impl Knowledge {
    /// The default `top_k`.
    pub const DEFAULT_TOP_K: usize = 5;
    /// The largest `top_k`.
    pub const MAX_TOP_K: usize = 50;
    /// The default `snippet_chars`.
    pub const DEFAULT_SNIPPET_CHARS: usize = 240;
    /// The range of `snippet_chars`.
    pub const SNIPPET_CHARS: (usize, usize) = (40, 4_000);

    /// Knowledge in `source` with every setting at its default.
    pub fn new(source: impl Into<std::path::PathBuf>) -> Knowledge {
        Knowledge {
            skill: None,
            source: source.into(),
            mode: RetrievalMode::Inject,
            top_k: Knowledge::DEFAULT_TOP_K,
            snippet_chars: Knowledge::DEFAULT_SNIPPET_CHARS,
            embeddings: Embeddings::Auto,
        }
    }

    /// Its retrieval step's name within `memory:`: `retrieve`, or `retrieve:<skill>`.
    pub fn step(&self) -> String {
        match &self.skill {
            Some(skill) => format!("retrieve:{skill}"),
            None => "retrieve".to_owned(),
        }
    }

    /// Its tools' names in `agentic` mode: `search_memory` and `read_memory`, or
    /// `search_<skill>` and `read_<skill>`.
    pub fn tool_names(&self) -> (String, String) {
        let name = self.skill.as_deref().unwrap_or("memory");
        (format!("search_{name}"), format!("read_{name}"))
    }
}

/// How the model gets at documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetrievalMode {
    /// A `memory:retrieve` step before the first turn puts the best passages for the input in
    /// the context.
    Inject,
    /// The model searches and reads when it wants to, with two tools.
    Agentic,
}

/// Whether passages are ranked by embeddings too (fused with the full-text ranking).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Embeddings {
    /// With the provider's default embedding model, when it has one.
    Auto,
    /// Full-text ranking only.
    Off,
    /// With this model of the agent's provider.
    Model(String),
}

/// Episodic memory (`kind: episodic`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Episodic {
    /// How many of the owner's latest episodes the model is shown (`recall`, at most
    /// [`Episodic::MAX_RECALL`]).
    pub recall: usize,
}

impl Episodic {
    /// The default `recall`.
    pub const DEFAULT_RECALL: usize = 5;
    /// The largest `recall`.
    pub const MAX_RECALL: usize = 20;
    /// How many episodes an owner keeps: older ones are dropped.
    pub const MAX_PER_OWNER: usize = 200;
}

/// Graph memory (`kind: graph`): how much of the graph the model is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphSettings {
    /// How many relations away from a seed the walk goes (`depth`).
    pub depth: usize,
    /// How many entities the input mentions start the walk (`max_seeds`).
    pub max_seeds: usize,
    /// How many relations of one entity are followed (`fan_out`).
    pub fan_out: usize,
    /// How many entities the walk reaches at most (`max_nodes`).
    pub max_nodes: usize,
}

impl GraphSettings {
    /// How many entities an owner keeps: the least recently seen go first.
    pub const MAX_ENTITIES: usize = 2_000;
    /// How many relations an owner keeps.
    pub const MAX_RELATIONS: usize = 5_000;
}

impl Default for GraphSettings {
    fn default() -> GraphSettings {
        GraphSettings { depth: 2, max_seeds: 4, fan_out: 8, max_nodes: 32 }
    }
}

/// A memory step the machine asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum MemoryRequest {
    /// `memory:recall`: the owner's latest episodes, oldest first, as context.
    Recall {
        /// How many.
        limit: usize,
    },
    /// `memory:traverse`: the neighbourhood of the entities `text` mentions, as context.
    Traverse {
        /// The run's input.
        text: String,
        /// How far and wide to walk.
        graph: GraphSettings,
    },
    /// `memory:episode`: summarise the run into one sentence and keep it.
    Episode {
        /// The run's messages (its input first).
        messages: Vec<Arc<Message>>,
        /// The model call index the summary's model call uses (the run's last turn's).
        call_index: u64,
    },
    /// `memory:extract`: extract entities and relations from the run and keep them.
    Extract {
        /// The run's messages (its input first).
        messages: Vec<Arc<Message>>,
        /// The model call index the extraction's model call uses (the run's last turn's).
        call_index: u64,
    },
    /// `memory:retrieve` (`memory:retrieve:<skill>`): the passages of the documents that best
    /// match the input, as context.
    Retrieve {
        /// The skill whose knowledge it is; `None` for the agent's semantic memory.
        skill: Option<String>,
        /// The run's input.
        query: String,
    },
}

impl MemoryRequest {
    /// The step's name within `memory:` (`recall`, `traverse`, `episode`, `extract`,
    /// `retrieve`, `retrieve:<skill>`).
    pub fn name(&self) -> String {
        match self {
            MemoryRequest::Recall { .. } => "recall".to_owned(),
            MemoryRequest::Traverse { .. } => "traverse".to_owned(),
            MemoryRequest::Episode { .. } => "episode".to_owned(),
            MemoryRequest::Extract { .. } => "extract".to_owned(),
            MemoryRequest::Retrieve { skill: Some(skill), .. } => format!("retrieve:{skill}"),
            MemoryRequest::Retrieve { skill: None, .. } => "retrieve".to_owned(),
        }
    }
}

/// What a memory step gives back: for the steps before the first turn, the `context` the model
/// is shown (empty when there is nothing to show); for the others, what was kept, and the
/// `usage` of the model call they made ([`with_usage`]), counted like a turn's.
pub type MemoryOutcome = Result<Value, String>;

/// `value` with the tokens of the model call a memory step made, under `usage`.
pub fn with_usage(mut value: Value, usage: Usage) -> Value {
    value["usage"] =
        serde_json::json!({ "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens });
    value
}

/// The tokens a memory step's model call used, when it made one ([`with_usage`]).
pub fn outcome_usage(value: &Value) -> Option<Usage> {
    let usage = value.get("usage")?;
    let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
    Some(Usage { input_tokens: count("input_tokens"), output_tokens: count("output_tokens") })
}

/// Who a memory step is for.
#[derive(Clone, Copy, Debug)]
pub struct MemoryScope<'a> {
    /// The owner whose memory it is ([`owner_of`]).
    pub owner: &'a str,
    /// The run.
    pub run: &'a RunId,
    /// Its session.
    pub session: &'a SessionId,
}

/// Carries memory steps out (implemented by `keel-memory`). A failure is an `Err` with what
/// went wrong: the run goes on without it.
pub trait Memory: Send + Sync {
    /// Carries one step out.
    fn call<'a>(&'a self, scope: MemoryScope<'a>, request: &'a MemoryRequest)
    -> BoxFuture<'a, MemoryOutcome>;
}

/// The owner of a session's memory: the authenticated user (`user:<scope>` for a session in a
/// JWT subject's scope), else the session itself (`session:<id>`).
pub fn owner_of(session: &SessionId) -> String {
    match session.as_str().split_once(SessionId::SCOPE_SEPARATOR) {
        Some((scope, _)) => format!("user:{scope}"),
        None => format!("session:{}", session.as_str()),
    }
}

/// One record of an owner's memory in the store.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryItem {
    /// `episode`, `entity` or `relation`.
    pub kind: String,
    /// Unique within the owner and kind (an episode's run id, an entity's normalized name).
    pub key: String,
    /// The record.
    pub value: Value,
    /// When it was last written, in milliseconds since the Unix epoch.
    pub updated_ms: u64,
}

/// How a write treats a record that exists already.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryMerge {
    /// The new value replaces it.
    Replace,
    /// The value with the higher number in this field is kept (a relation keeps its highest
    /// confidence); the record counts as written either way.
    KeepHigher(&'static str),
}

/// Records to write to one owner's memory of one kind, in one transaction.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryWrite {
    /// `(key, value)` pairs.
    pub items: Vec<(String, Value)>,
    /// How existing records are treated.
    pub merge: MemoryMerge,
    /// After the write, only the most recently written this many records of the kind are kept.
    pub keep_newest: Option<usize>,
}

/// An owner with memory, for listings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryOwner {
    /// The owner.
    pub owner: String,
    /// How many records of each kind, by kind name.
    pub counts: Vec<(String, u64)>,
    /// When its memory was last written.
    pub updated_ms: u64,
}
