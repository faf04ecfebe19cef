//! Semantic memory: a folder of documents the agent retrieves from (`memory: { kind: semantic }`
//! and skills' `knowledge`).
//!
//! A [`Library`] is one folder. On first use it opens the folder's index (building it when the
//! documents changed, see [`index`]) and, when the agent's provider has embeddings, the
//! passages' vectors (embedding only what is new). A search ranks passages by full text (BM25)
//! and, with vectors, by cosine similarity to the query's embedding, and fuses the two rankings
//! by reciprocal rank (each list's rank r adds 1 / (60 + r)). A failed embedding never fails
//! a search: it falls back to full text, and says so.
//!
//! The model gets at a library through a journaled `memory:retrieve` step (`inject`) or the
//! [`SearchTool`] and [`ReadTool`] (`agentic`), whose calls are ordinary tool steps.

pub mod chunk;
pub mod documents;
pub mod index;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_core::memory::{Embeddings, Knowledge};
use keel_core::tool::{Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use keel_core::{BoxFuture, Provider};
use serde_json::{Value, json};

pub use documents::Warning;
pub use index::{OpenIndex, Passage, Vectors};

/// The constant of reciprocal rank fusion: the weight of rank r is 1 / (RRF_K + r).
pub const RRF_K: f32 = 60.0;
/// How long embedding one query may take before the search goes on by full text alone.
const QUERY_EMBEDDING_TIMEOUT: Duration = Duration::from_secs(20);
/// How many passages are given to the provider at once at opening (it may send them in smaller
/// requests), and how long each such batch may take.
const EMBEDDING_BATCH: usize = 256;
const EMBEDDING_BATCH_TIMEOUT: Duration = Duration::from_secs(300);

/// One folder of documents to retrieve from. See the module docs.
pub struct Library {
    knowledge: Knowledge,
    provider: Arc<dyn Provider>,
    /// Where this library's index versions live.
    dir: PathBuf,
    opened: tokio::sync::OnceCell<Arc<Opened>>,
}

/// An open library: its index and, when made, its vectors.
pub struct Opened {
    /// The index.
    pub index: OpenIndex,
    /// The passages' vectors, and the model that made them.
    pub vectors: Option<(String, Vectors)>,
    /// Why there are no vectors, when embeddings were wanted.
    pub embeddings_problem: Option<String>,
}

/// A passage found.
#[derive(Clone, Debug, PartialEq)]
pub struct Hit {
    /// The passage.
    pub passage: Passage,
    /// The fused score (the BM25 score when only full text ranked it): higher is better.
    pub score: f32,
    /// A snippet of it, around the query's words.
    pub snippet: String,
}

/// What a search found, and how it ranked.
#[derive(Clone, Debug)]
pub struct Found {
    /// Best first.
    pub hits: Vec<Hit>,
    /// `fused` (full text and embeddings) or `full-text`.
    pub ranking: &'static str,
    /// Why embeddings did not rank, when they were meant to.
    pub note: Option<String>,
}

impl Library {
    /// A library of `knowledge`'s folder, embedded (when it is) by `provider`, indexed under
    /// `index_root` (`KEEL_INDEX_DIR`). Nothing is read until it is first used.
    pub fn new(knowledge: Knowledge, provider: Arc<dyn Provider>, index_root: &Path) -> Library {
        let name = knowledge.skill.clone().unwrap_or_else(|| "memory".to_owned());
        let dir = index::library_dir(index_root, &name, &knowledge.source);
        Library { knowledge, provider, dir, opened: tokio::sync::OnceCell::new() }
    }

    /// What it is.
    pub fn knowledge(&self) -> &Knowledge {
        &self.knowledge
    }

    /// The embedding model it uses, if any.
    pub fn embedding_model(&self) -> Option<String> {
        match &self.knowledge.embeddings {
            Embeddings::Off => None,
            Embeddings::Model(model) => Some(model.clone()),
            Embeddings::Auto => self.provider.default_embedding_model().map(str::to_owned),
        }
    }

    /// Opens it (once; a failure is tried again on the next use): the index, built when the
    /// documents changed, then the vectors, embedding the passages no earlier version had.
    pub async fn open(&self) -> Result<Arc<Opened>, String> {
        self.opened.get_or_try_init(|| self.open_now()).await.cloned()
    }

    async fn open_now(&self) -> Result<Arc<Opened>, String> {
        let source = self.knowledge.source.clone();
        if !source.is_dir() {
            return Err(format!("the documents folder {} does not exist", source.display()));
        }
        let dir = self.dir.clone();
        let started = std::time::Instant::now();
        let index = tokio::task::spawn_blocking(move || index::open_or_build(&source, &dir))
            .await
            .map_err(|e| format!("indexing the documents failed: {e}"))??;
        for warning in &index.warnings {
            tracing::warn!(folder = %self.knowledge.source.display(), "{warning}");
        }
        tracing::info!(
            folder = %self.knowledge.source.display(),
            documents = index.documents(),
            passages = index.len(),
            built = index.built,
            ms = started.elapsed().as_millis() as u64,
            "documents indexed"
        );
        let mut opened = Opened { index, vectors: None, embeddings_problem: None };
        if let Some(model) = self.embedding_model().filter(|_| !opened.index.is_empty()) {
            match self.vectors(&opened.index, &model).await {
                Ok(vectors) => opened.vectors = Some((model, vectors)),
                Err(problem) => {
                    tracing::warn!(
                        folder = %self.knowledge.source.display(),
                        "no embeddings ({problem}): passages are ranked by full text only"
                    );
                    opened.embeddings_problem = Some(problem);
                }
            }
        }
        opened.index.prune_others();
        Ok(Arc::new(opened))
    }

    /// The index's vectors by `model`: read when made before, else made (what another version
    /// had is taken over) and written.
    async fn vectors(&self, index: &OpenIndex, model: &str) -> Result<Vectors, String> {
        if let Some(vectors) = index.load_vectors(model) {
            return Ok(vectors);
        }
        let reusable = index.reusable_vectors(model);
        let inputs = index.embedding_inputs()?;
        let hashes = index.passage_hashes();
        let missing: Vec<usize> = (0..inputs.len()).filter(|&i| !reusable.contains_key(&hashes[i])).collect();
        let texts: Vec<String> = missing.iter().map(|&i| inputs[i].clone()).collect();
        let mut made = Vec::with_capacity(texts.len());
        for batch in texts.chunks(EMBEDDING_BATCH) {
            let vectors = tokio::time::timeout(EMBEDDING_BATCH_TIMEOUT, self.provider.embed(model, batch))
                .await
                .map_err(|_| {
                    format!("embedding {} passages took over {EMBEDDING_BATCH_TIMEOUT:?}", batch.len())
                })?
                .map_err(|e| format!("embedding model `{model}`: {e} ({})", e.code()))?;
            made.extend(vectors);
            if texts.len() > EMBEDDING_BATCH {
                tracing::info!(model, done = made.len(), of = texts.len(), "embedding passages");
            }
        }
        if made.len() != texts.len() {
            return Err(format!(
                "embedding model `{model}` answered {} vectors for {}",
                made.len(),
                texts.len()
            ));
        }
        let mut made: HashMap<usize, Vec<f32>> = missing.into_iter().zip(made).collect();
        let rows: Vec<Vec<f32>> = (0..inputs.len())
            .map(|i| made.remove(&i).or_else(|| reusable.get(&hashes[i]).cloned()).unwrap_or_default())
            .collect();
        let vectors = Vectors::new(rows).ok_or_else(|| {
            format!("embedding model `{model}` gave vectors of different lengths (was it changed meanwhile?)")
        })?;
        tracing::info!(model, passages = vectors.len(), embedded = texts.len(), "passages embedded");
        if let Err(error) = vectors.write(&index.vectors_path(model)) {
            tracing::warn!("cannot keep the embeddings in {}: {error}", index.dir.display());
        }
        Ok(vectors)
    }

    /// The `top_k` passages that best match `query`.
    pub async fn search(&self, query: &str, top_k: usize) -> Result<Found, String> {
        let opened = self.open().await?;
        let top_k = top_k.clamp(1, Knowledge::MAX_TOP_K);
        // Each ranking looks deeper than top_k: a passage second in one list and tenth in the
        // other can win the fusion.
        let depth = (top_k * 4).max(40);
        let full_text = opened.index.full_text(query, depth)?;
        let mut note = opened.embeddings_problem.clone();
        let mut by_vector = None;
        if let Some((model, vectors)) = &opened.vectors {
            match self.embed_query(model, query).await {
                Ok(vector) => by_vector = Some(vectors.nearest(&vector, depth)),
                Err(problem) => {
                    tracing::warn!("the query was not embedded ({problem}): full-text ranking only");
                    note = Some(problem);
                }
            }
        }
        let (ranked, ranking) = match by_vector {
            Some(by_vector) => (fuse(&[&full_text, &by_vector]), "fused"),
            None => (full_text, "full-text"),
        };
        let mut hits = Vec::with_capacity(top_k);
        for (ord, score) in ranked.into_iter().take(top_k) {
            if let Some((passage, snippet)) =
                opened.index.passage(ord, Some(query), self.knowledge.snippet_chars)?
            {
                hits.push(Hit { passage, score, snippet });
            }
        }
        Ok(Found { hits, ranking, note })
    }

    async fn embed_query(&self, model: &str, query: &str) -> Result<Vec<f32>, String> {
        let inputs = [query.to_owned()];
        let mut vectors = tokio::time::timeout(QUERY_EMBEDDING_TIMEOUT, self.provider.embed(model, &inputs))
            .await
            .map_err(|_| {
                format!("embedding model `{model}` did not answer within {QUERY_EMBEDDING_TIMEOUT:?}")
            })?
            .map_err(|e| format!("embedding model `{model}`: {e} ({})", e.code()))?;
        vectors.pop().ok_or_else(|| format!("embedding model `{model}` answered no vector"))
    }

    /// The passage with this id (from a search).
    pub async fn read(&self, id: &str) -> Result<Option<Passage>, String> {
        self.open().await?.index.by_id(id)
    }

    /// What a `memory:retrieve` step gives the run: the passages that best match the input, as
    /// context for the model, and what was found (ids and scores) for the journal.
    pub async fn retrieve(&self, query: &str) -> Result<Value, String> {
        let found = self.search(query, self.knowledge.top_k).await?;
        let hits: Vec<Value> =
            found.hits.iter().map(|hit| json!({ "id": hit.passage.id, "score": round(hit.score) })).collect();
        let mut outcome = json!({ "hits": hits, "ranking": found.ranking });
        if let Some(note) = &found.note {
            outcome["note"] = note.clone().into();
        }
        if found.hits.is_empty() {
            outcome["context"] = "".into();
            return Ok(outcome);
        }
        let folder = match &self.knowledge.skill {
            Some(skill) => format!("the knowledge of skill `{skill}`"),
            None => "your documents".to_owned(),
        };
        let mut context =
            format!("## From {folder}: the passages that best match the message (best first)\n");
        for (n, hit) in found.hits.iter().enumerate() {
            context.push_str(&format!("\n[{}] {}\n{}\n", n + 1, position(&hit.passage), hit.snippet));
        }
        outcome["context"] = context.trim_end().to_owned().into();
        Ok(outcome)
    }

    /// The `search_*` and `read_*` tools of `agentic` mode.
    pub fn tools(self: &Arc<Self>) -> Vec<Arc<dyn Tool>> {
        let (search, read) = self.knowledge.tool_names();
        let what = match &self.knowledge.skill {
            Some(skill) => format!("the documents of skill `{skill}`"),
            None => "the agent's documents".to_owned(),
        };
        let search_spec = ToolSpec {
            name: search,
            description: format!(
                "Searches {what} for passages about a question or topic. Returns the best passages, each with an id to read it whole with {read}."
            ),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "query": { "type": "string", "minLength": 1, "maxLength": 2000, "description": "What to look for, in words" },
                    "top_k": { "type": "integer", "minimum": 1, "maximum": Knowledge::MAX_TOP_K, "description": format!("How many passages (default {})", self.knowledge.top_k) }
                },
                "required": ["query"],
                "additionalProperties": false
            }),
        };
        let read_spec = ToolSpec {
            name: read.clone(),
            description: format!("Reads one passage of {what} whole, by the id a search returned."),
            input_schema: json!({
                "type": "object",
                "properties": { "id": { "type": "string", "minLength": 1, "maxLength": 1000, "description": "The passage's id, as the search returned it" } },
                "required": ["id"],
                "additionalProperties": false
            }),
        };
        vec![
            Arc::new(SearchTool { library: Arc::clone(self), spec: search_spec }),
            Arc::new(ReadTool { library: Arc::clone(self), spec: read_spec }),
        ]
    }
}

/// What a folder of documents holds, read as indexing would read it (nothing is written).
#[derive(Clone, Debug, Default)]
pub struct FolderReport {
    /// The documents read.
    pub documents: usize,
    /// The passages they make.
    pub passages: usize,
    /// What was skipped, and why.
    pub warnings: Vec<Warning>,
}

/// Reads the folder as indexing would (for `keel check`): every document, every skip.
pub fn check_folder(folder: &Path) -> Result<FolderReport, String> {
    let (found, mut warnings) = documents::scan(folder)?;
    let mut report = FolderReport::default();
    for file in &found {
        match documents::read(file) {
            Ok(document) => {
                report.documents += 1;
                report.passages += chunk::chunks(&document).len();
            }
            Err(message) => warnings.push(Warning { path: file.path.clone(), message }),
        }
    }
    warnings.sort_by(|a, b| a.path.cmp(&b.path));
    report.warnings = warnings;
    Ok(report)
}

/// Where a passage is: `guide.md, lines 12-20 (id guide.md#3)`.
fn position(passage: &Passage) -> String {
    let lines = if passage.start_line == passage.end_line {
        format!("line {}", passage.start_line)
    } else {
        format!("lines {}-{}", passage.start_line, passage.end_line)
    };
    let page = passage.page.map(|p| format!("page {p}, ")).unwrap_or_default();
    let title = if passage.title.is_empty() { String::new() } else { format!(" — {}", passage.title) };
    format!("{}, {page}{lines}{title} (id {})", passage.source, passage.id)
}

fn round(score: f32) -> f64 {
    (f64::from(score) * 10_000.0).round() / 10_000.0
}

/// Reciprocal rank fusion of rankings (best first): each passage scores the sum over the
/// rankings it is in of 1 / (RRF_K + rank), rank from 1. Ties keep the first ranking's order.
pub fn fuse(rankings: &[&[(u64, f32)]]) -> Vec<(u64, f32)> {
    let mut scores: HashMap<u64, (f32, usize)> = HashMap::new();
    for ranking in rankings {
        for (rank, (ord, _)) in ranking.iter().enumerate() {
            let entry = scores.entry(*ord).or_insert((0.0, usize::MAX));
            entry.0 += 1.0 / (RRF_K + rank as f32 + 1.0);
            entry.1 = entry.1.min(rank);
        }
    }
    let mut fused: Vec<(u64, f32, usize)> =
        scores.into_iter().map(|(ord, (score, best))| (ord, score, best)).collect();
    fused.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
    fused.into_iter().map(|(ord, score, _)| (ord, score)).collect()
}

/// `search_memory` (`search_<skill>`): ranked passages for a query.
struct SearchTool {
    library: Arc<Library>,
    spec: ToolSpec,
}

impl Tool for SearchTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let query = input["query"].as_str().unwrap_or_default();
            let top_k = input["top_k"].as_u64().map_or(self.library.knowledge.top_k, |k| k as usize);
            let found = self.library.search(query, top_k).await.map_err(|e| ToolError {
                transient: true,
                ..ToolError::failed(format!("the documents cannot be searched now: {e}"))
            })?;
            let hits: Vec<Value> = found
                .hits
                .iter()
                .map(|hit| {
                    json!({
                        "id": hit.passage.id,
                        "source": hit.passage.source,
                        "score": round(hit.score),
                        "snippet": hit.snippet,
                    })
                })
                .collect();
            let mut output = json!({ "hits": hits, "ranking": found.ranking });
            if hits.is_empty() {
                output["note"] = "nothing matches: try other words".into();
            }
            Ok(output)
        })
    }
}

/// `read_memory` (`read_<skill>`): one passage whole.
struct ReadTool {
    library: Arc<Library>,
    spec: ToolSpec,
}

impl Tool for ReadTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let id = input["id"].as_str().unwrap_or_default();
            let passage = self.library.read(id).await.map_err(|e| ToolError {
                transient: true,
                ..ToolError::failed(format!("the documents cannot be read now: {e}"))
            })?;
            let Some(passage) = passage else {
                let (search, _) = self.library.knowledge.tool_names();
                return Err(ToolError::failed(format!(
                    "no passage has the id {id:?}: ids come from {search}, as `source#n`"
                )));
            };
            let mut output = json!({
                "id": passage.id,
                "source": passage.source,
                "lines": [passage.start_line, passage.end_line],
                "text": passage.text,
            });
            if !passage.title.is_empty() {
                output["title"] = passage.title.clone().into();
            }
            if let Some(page) = passage.page {
                output["page"] = page.into();
            }
            Ok(output)
        })
    }
}

#[cfg(test)]
mod tests;
