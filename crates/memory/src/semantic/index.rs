//! The index of a knowledge folder, on disk: a tantivy full-text index of its passages, and
//! their embedding vectors when there are any.
//!
//! Layout under the index folder (`KEEL_INDEX_DIR`, default `.keel/index`):
//!
//! ```text
//! <name>-<hash of the source folder's path>/
//!   <digest of the documents>/        one version: the folder's content at some time
//!     manifest.json                   files and their SHA-256, passages, what was skipped
//!     vectors-<model hash>.bin        the passages' embeddings by one model
//!     (tantivy's files)
//! ```
//!
//! A version's name is the digest of the documents' paths and contents (and of the chunking),
//! so an unchanged folder opens its index as it is, instances sharing the folder share it, and
//! a change builds a new version (in a temporary folder, renamed into place once complete; two
//! processes building at once end with one). Vectors of unchanged passages are taken over from
//! the version before, so only changed passages are embedded again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, BoostQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    FAST, Field, INDEXED, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions,
    Value as _,
};
use tantivy::snippet::SnippetGenerator;
use tantivy::tokenizer::{
    AsciiFoldingFilter, Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter,
    TextAnalyzer,
};
use tantivy::{IndexReader, TantivyDocument, Term};

use super::chunk::{self, Chunk};
use super::documents::{self, Warning};

/// Bumped when the index's content changes meaning (chunking, schema): every folder is then
/// indexed again.
const FORMAT: u32 = 1;
/// The tokenizer of the text fields: words, lowercased, accents folded, English stop words
/// dropped, stemmed.
const TOKENIZER: &str = "keel_en";
const MANIFEST: &str = "manifest.json";

/// A passage, as search and read return it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Passage {
    /// `<source>#<n>`: the n-th passage (from 1) of the document.
    pub id: String,
    /// The document, under the folder.
    pub source: String,
    /// The headings it is under.
    pub title: String,
    /// The lines of the document it covers.
    pub start_line: u64,
    /// The last of them.
    pub end_line: u64,
    /// For a PDF, its page.
    pub page: Option<u64>,
    /// Its text.
    pub text: String,
}

/// What an index version records about itself.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: u32,
    digest: String,
    /// `(path, sha256)` of each document indexed.
    files: Vec<(String, String)>,
    /// The SHA-256 of each passage's text (with its title), by its number in the index.
    passages: Vec<String>,
    /// What was skipped while reading the documents.
    warnings: Vec<Warning>,
}

#[derive(Clone, Copy)]
struct Fields {
    id: Field,
    source: Field,
    title: Field,
    body: Field,
    ord: Field,
    start_line: Field,
    end_line: Field,
    page: Field,
}

fn schema() -> (Schema, Fields) {
    let mut builder = Schema::builder();
    let text = TextOptions::default()
        .set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(TOKENIZER)
                .set_index_option(IndexRecordOption::WithFreqsAndPositions),
        )
        .set_stored();
    let fields = Fields {
        id: builder.add_text_field("id", STRING | STORED),
        source: builder.add_text_field("source", text.clone()),
        title: builder.add_text_field("title", text.clone()),
        body: builder.add_text_field("body", text),
        ord: builder.add_u64_field("ord", INDEXED | FAST | STORED),
        start_line: builder.add_u64_field("start_line", STORED),
        end_line: builder.add_u64_field("end_line", STORED),
        page: builder.add_u64_field("page", STORED),
    };
    (builder.build(), fields)
}

fn register_tokenizer(index: &tantivy::Index) {
    let mut analyzer = TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(AsciiFoldingFilter)
        .dynamic();
    if let Some(stop_words) = StopWordFilter::new(Language::English) {
        analyzer = analyzer.filter_dynamic(stop_words);
    }
    let analyzer = analyzer.filter_dynamic(Stemmer::new(Language::English)).build();
    index.tokenizers().register(TOKENIZER, analyzer);
}

/// An index version, open.
pub struct OpenIndex {
    index: tantivy::Index,
    reader: IndexReader,
    fields: Fields,
    manifest: Manifest,
    /// Its folder.
    pub dir: PathBuf,
    /// What was skipped: while scanning now, and while reading when the version was built.
    pub warnings: Vec<Warning>,
    /// Whether this call built it (rather than finding it built).
    pub built: bool,
}

/// The folder under `root` where the versions of `source`'s index live.
pub fn library_dir(root: &Path, name: &str, source: &Path) -> PathBuf {
    let absolute = std::path::absolute(source).unwrap_or_else(|_| source.to_owned());
    let hash = hex::encode(Sha256::digest(absolute.to_string_lossy().as_bytes()));
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect();
    root.join(format!("{name}-{}", &hash[..16]))
}

/// Opens the index of `source`'s documents in `library` (see [`library_dir`]), building it first
/// when the documents changed since it was built (or it never was). Blocking: run it off the
/// async threads.
pub fn open_or_build(source: &Path, library: &Path) -> Result<OpenIndex, String> {
    let (found, mut warnings) = documents::scan(source)?;
    let digest = digest(&found);
    let dir = library.join(&digest[..32]);
    let (open, built) = match open_version(&dir, &digest) {
        Some(open) => (open, false),
        None => match build(&found, library, &dir, &digest) {
            Ok(open) => (open, true),
            Err(problem) => {
                // A read-only disk (a container's image) still gets its documents: indexed in
                // memory, at each start.
                tracing::warn!("{problem}: indexing the documents in memory (built again at each start)");
                (
                    build_in_memory(&found, &digest)
                        .map_err(|e| format!("cannot index the documents: {e}"))?,
                    true,
                )
            }
        },
    };
    let (index, reader, fields, manifest) = open;
    warnings.extend(manifest.warnings.iter().cloned());
    warnings.sort_by(|a, b| a.path.cmp(&b.path));
    warnings.dedup();
    Ok(OpenIndex { index, reader, fields, manifest, dir, warnings, built })
}

/// The digest naming the version for these documents.
fn digest(found: &[documents::Found]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(format!("keel-index {FORMAT} {} {}\n", chunk::TARGET_CHARS, chunk::MAX_CHARS));
    for file in found {
        hasher.update(file.path.as_bytes());
        hasher.update([0]);
        hasher.update(file.sha256.as_bytes());
        hasher.update(b"\n");
    }
    hex::encode(hasher.finalize())
}

type Opened = (tantivy::Index, IndexReader, Fields, Manifest);

fn open_version(dir: &Path, digest: &str) -> Option<Opened> {
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).ok()?).ok()?;
    if manifest.format != FORMAT || manifest.digest != digest {
        return None;
    }
    let index = tantivy::Index::open_in_dir(dir).ok()?;
    register_tokenizer(&index);
    let (_, fields) = schema();
    // A version never changes once built: no watcher thread for commits that never come.
    let reader = index.reader_builder().reload_policy(tantivy::ReloadPolicy::Manual).try_into().ok()?;
    Some((index, reader, fields, manifest))
}

fn build(found: &[documents::Found], library: &Path, dir: &Path, digest: &str) -> Result<Opened, String> {
    let io = |what: &str, error: &dyn std::fmt::Display| {
        format!("cannot {what} the index in {}: {error}", library.display())
    };
    std::fs::create_dir_all(library).map_err(|e| io("create", &e))?;
    let nonce =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = library.join(format!(".build-{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| io("create", &e))?;
    let result = write_version(found, &tmp, digest);
    if let Err(error) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(io("build", &error));
    }
    if std::fs::rename(&tmp, dir).is_err() {
        // Another process built the same version meanwhile: its copy is as good as ours.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    open_version(dir, digest).ok_or_else(|| io("open", &"the version just built does not open"))
}

fn write_version(found: &[documents::Found], dir: &Path, digest: &str) -> Result<(), String> {
    let (schema, fields) = schema();
    let index = tantivy::Index::create_in_dir(dir, schema).map_err(|e| e.to_string())?;
    let manifest = fill(&index, fields, found, digest)?;
    let bytes = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
    std::fs::write(dir.join(MANIFEST), bytes).map_err(|e| e.to_string())
}

/// The version built in memory, when it cannot be written where versions live.
fn build_in_memory(found: &[documents::Found], digest: &str) -> Result<Opened, String> {
    let (schema, fields) = schema();
    let index = tantivy::Index::create_in_ram(schema);
    let manifest = fill(&index, fields, found, digest)?;
    let reader = index
        .reader_builder()
        .reload_policy(tantivy::ReloadPolicy::Manual)
        .try_into()
        .map_err(|e: tantivy::TantivyError| e.to_string())?;
    Ok((index, reader, fields, manifest))
}

/// Reads and chunks the documents into `index`; what it holds, as its manifest says.
fn fill(
    index: &tantivy::Index,
    fields: Fields,
    found: &[documents::Found],
    digest: &str,
) -> Result<Manifest, String> {
    register_tokenizer(index);
    let mut writer: tantivy::IndexWriter =
        index.writer_with_num_threads(1, 64 * 1024 * 1024).map_err(|e| e.to_string())?;
    let mut manifest = Manifest {
        format: FORMAT,
        digest: digest.to_owned(),
        files: Vec::new(),
        passages: Vec::new(),
        warnings: Vec::new(),
    };
    for file in found {
        let document = match documents::read(file) {
            Ok(document) => document,
            Err(message) => {
                manifest.warnings.push(Warning { path: file.path.clone(), message });
                continue;
            }
        };
        manifest.files.push((file.path.clone(), file.sha256.clone()));
        for (n, Chunk { title, text, start_line, end_line, page }) in
            chunk::chunks(&document).into_iter().enumerate()
        {
            let ord = manifest.passages.len() as u64;
            manifest.passages.push(passage_hash(&title, &text));
            let mut doc = TantivyDocument::default();
            doc.add_text(fields.id, format!("{}#{}", file.path, n + 1));
            doc.add_text(fields.source, &file.path);
            doc.add_text(fields.title, &title);
            doc.add_text(fields.body, &text);
            doc.add_u64(fields.ord, ord);
            doc.add_u64(fields.start_line, start_line as u64);
            doc.add_u64(fields.end_line, end_line as u64);
            if let Some(page) = page {
                doc.add_u64(fields.page, page as u64);
            }
            writer.add_document(doc).map_err(|e| e.to_string())?;
        }
    }
    writer.commit().map_err(|e| e.to_string())?;
    writer.wait_merging_threads().map_err(|e| e.to_string())?;
    Ok(manifest)
}

/// The name of a version's file of `model`'s vectors.
fn vectors_file(model: &str) -> String {
    let hash = hex::encode(Sha256::digest(model.as_bytes()));
    format!("vectors-{}.bin", &hash[..16])
}

fn passage_hash(title: &str, text: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(title.as_bytes());
    hasher.update([0]);
    hasher.update(text.as_bytes());
    hex::encode(hasher.finalize())
}

impl OpenIndex {
    /// How many passages it holds.
    pub fn len(&self) -> usize {
        self.manifest.passages.len()
    }

    /// Whether it holds no passage.
    pub fn is_empty(&self) -> bool {
        self.manifest.passages.is_empty()
    }

    /// How many documents it holds.
    pub fn documents(&self) -> usize {
        self.manifest.files.len()
    }

    /// The query's words as the index sees them (stemmed, stop words dropped), each once.
    fn terms(&self, field: Field, query: &str) -> Vec<Term> {
        let Ok(mut analyzer) = self.index.tokenizer_for_field(field) else { return Vec::new() };
        let mut stream = analyzer.token_stream(query);
        let mut terms: Vec<Term> = Vec::new();
        while let Some(token) = stream.next() {
            let term = Term::from_field_text(field, &token.text);
            if !terms.contains(&term) {
                terms.push(term);
            }
        }
        terms
    }

    /// Any of the query's words in a passage's text, title (counting twice) or document name:
    /// BM25, best first. The query is words, not a query language: `AND`, quotes and colons
    /// are plain text.
    fn query(&self, query: &str) -> Option<BooleanQuery> {
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for (field, boost) in [(self.fields.body, 1.0), (self.fields.title, 2.0), (self.fields.source, 1.0)] {
            for term in self.terms(field, query) {
                let query: Box<dyn Query> = Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs));
                let query: Box<dyn Query> =
                    if boost == 1.0 { query } else { Box::new(BoostQuery::new(query, boost)) };
                clauses.push((Occur::Should, query));
            }
        }
        (!clauses.is_empty()).then(|| BooleanQuery::new(clauses))
    }

    /// The `limit` best passages for `query` by full text: `(number, BM25 score)`.
    pub fn full_text(&self, query: &str, limit: usize) -> Result<Vec<(u64, f32)>, String> {
        let Some(query) = self.query(query) else { return Ok(Vec::new()) };
        let searcher = self.reader.searcher();
        let top = searcher
            .search(&query, &TopDocs::with_limit(limit.max(1)).order_by_score())
            .map_err(|e| format!("the full-text search failed: {e}"))?;
        let mut hits = Vec::with_capacity(top.len());
        for (score, address) in top {
            let ords = searcher
                .segment_reader(address.segment_ord)
                .fast_fields()
                .u64("ord")
                .map_err(|e| format!("the index is damaged: {e}"))?;
            if let Some(ord) = ords.first(address.doc_id) {
                hits.push((ord, score));
            }
        }
        Ok(hits)
    }

    /// Passage number `ord`, with a snippet of at most `snippet_chars` characters around the
    /// words of `query` (its start when none is in it).
    pub fn passage(
        &self,
        ord: u64,
        query: Option<&str>,
        snippet_chars: usize,
    ) -> Result<Option<(Passage, String)>, String> {
        let term = Term::from_field_u64(self.fields.ord, ord);
        self.find(Box::new(TermQuery::new(term, IndexRecordOption::Basic)), query, snippet_chars)
    }

    /// The passage with this id.
    pub fn by_id(&self, id: &str) -> Result<Option<Passage>, String> {
        let term = Term::from_field_text(self.fields.id, id);
        Ok(self.find(Box::new(TermQuery::new(term, IndexRecordOption::Basic)), None, 0)?.map(|(p, _)| p))
    }

    fn find(
        &self,
        query: Box<dyn Query>,
        words: Option<&str>,
        snippet_chars: usize,
    ) -> Result<Option<(Passage, String)>, String> {
        let searcher = self.reader.searcher();
        let top = searcher
            .search(&query, &TopDocs::with_limit(1).order_by_score())
            .map_err(|e| format!("the index search failed: {e}"))?;
        let Some((_, address)) = top.first() else { return Ok(None) };
        let doc: TantivyDocument =
            searcher.doc(*address).map_err(|e| format!("the index is damaged: {e}"))?;
        let text =
            |field: Field| doc.get_first(field).and_then(|v| v.as_str()).unwrap_or_default().to_owned();
        let number = |field: Field| doc.get_first(field).and_then(|v| v.as_u64());
        let passage = Passage {
            id: text(self.fields.id),
            source: text(self.fields.source),
            title: text(self.fields.title),
            start_line: number(self.fields.start_line).unwrap_or(1),
            end_line: number(self.fields.end_line).unwrap_or(1),
            page: number(self.fields.page),
            text: text(self.fields.body),
        };
        let mut snippet = String::new();
        if snippet_chars > 0 && passage.text.chars().count() <= snippet_chars {
            snippet = passage.text.clone();
        } else if snippet_chars > 0 {
            if let Some(query) = words.and_then(|w| self.query(w)) {
                let mut generator = SnippetGenerator::create(&searcher, &query, self.fields.body)
                    .map_err(|e| format!("the index search failed: {e}"))?;
                generator.set_max_num_chars(snippet_chars);
                snippet = generator.snippet(&passage.text).fragment().trim().to_owned();
            }
            if snippet.is_empty() {
                snippet = cut_chars(&passage.text, snippet_chars);
            }
        }
        Ok(Some((passage, snippet)))
    }

    /// The texts to embed, by passage number: its title, then its text.
    pub fn embedding_inputs(&self) -> Result<Vec<String>, String> {
        let searcher = self.reader.searcher();
        let mut inputs = vec![String::new(); self.len()];
        for segment in searcher.segment_readers() {
            let store = segment.get_store_reader(64).map_err(|e| format!("the index is damaged: {e}"))?;
            for doc_id in 0..segment.max_doc() {
                let doc: TantivyDocument =
                    store.get(doc_id).map_err(|e| format!("the index is damaged: {e}"))?;
                let text = |field: Field| {
                    doc.get_first(field).and_then(|v| v.as_str()).unwrap_or_default().to_owned()
                };
                let Some(ord) = doc.get_first(self.fields.ord).and_then(|v| v.as_u64()) else { continue };
                if let Some(slot) = inputs.get_mut(ord as usize) {
                    let title = text(self.fields.title);
                    let body = text(self.fields.body);
                    *slot = if title.is_empty() { body } else { format!("{title}\n\n{body}") };
                }
            }
        }
        Ok(inputs)
    }

    /// Where this version keeps `model`'s vectors.
    pub fn vectors_path(&self, model: &str) -> PathBuf {
        self.dir.join(vectors_file(model))
    }

    /// `model`'s vectors of this version, when they were made.
    pub fn load_vectors(&self, model: &str) -> Option<Vectors> {
        let vectors = Vectors::read(&self.vectors_path(model))?;
        (vectors.len() == self.len()).then_some(vectors)
    }

    /// `model`'s vectors of passages other versions of the library hold, by passage hash: what
    /// need not be embedded again.
    pub fn reusable_vectors(&self, model: &str) -> HashMap<String, Vec<f32>> {
        let mut reusable = HashMap::new();
        let Some(library) = self.dir.parent() else { return reusable };
        let Ok(entries) = std::fs::read_dir(library) else { return reusable };
        for entry in entries.filter_map(Result::ok) {
            let dir = entry.path();
            if dir == self.dir || entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let Some(manifest) = std::fs::read(dir.join(MANIFEST))
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Manifest>(&bytes).ok())
            else {
                continue;
            };
            let Some(vectors) = Vectors::read(&dir.join(vectors_file(model))) else { continue };
            if vectors.len() != manifest.passages.len() {
                continue;
            }
            for (ord, passage) in manifest.passages.iter().enumerate() {
                reusable.entry(passage.clone()).or_insert_with(|| vectors.row(ord).to_vec());
            }
        }
        reusable
    }

    /// The passage hashes, by number.
    pub fn passage_hashes(&self) -> &[String] {
        &self.manifest.passages
    }

    /// Removes the library's other versions (an older content of the folder), now that this
    /// one is complete; a process still reading one keeps its open files.
    pub fn prune_others(&self) {
        // An index in memory (its folder could not be written) leaves the folder alone.
        if !self.dir.is_dir() {
            return;
        }
        let Some(library) = self.dir.parent() else { return };
        let Ok(entries) = std::fs::read_dir(library) else { return };
        for entry in entries.filter_map(Result::ok) {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale_build = name.starts_with(".build-")
                && entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > std::time::Duration::from_secs(3_600)));
            if dir != self.dir && (stale_build || !name.starts_with('.')) && dir.is_dir() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

/// Embedding vectors, one row per passage, each of unit length (a dot product is the cosine).
#[derive(Clone, Debug, PartialEq)]
pub struct Vectors {
    dims: usize,
    data: Vec<f32>,
}

const VECTORS_MAGIC: &[u8; 8] = b"KEELVEC1";

impl Vectors {
    /// Rows of one length, normalized; `None` when they are not all of one non-zero length.
    pub fn new(rows: Vec<Vec<f32>>) -> Option<Vectors> {
        let dims = rows.first().map_or(0, Vec::len);
        if dims == 0 || rows.iter().any(|r| r.len() != dims) {
            return None;
        }
        let mut data = Vec::with_capacity(rows.len() * dims);
        for mut row in rows {
            normalize(&mut row);
            data.extend(row);
        }
        Some(Vectors { dims, data })
    }

    /// How many rows.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.dims).unwrap_or(0)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Their length.
    pub fn dims(&self) -> usize {
        self.dims
    }

    fn row(&self, index: usize) -> &[f32] {
        &self.data[index * self.dims..(index + 1) * self.dims]
    }

    /// The `limit` rows nearest to `query` by cosine: `(row, similarity)`, nearest first.
    pub fn nearest(&self, query: &[f32], limit: usize) -> Vec<(u64, f32)> {
        if query.len() != self.dims {
            return Vec::new();
        }
        let mut query = query.to_vec();
        normalize(&mut query);
        let mut scored: Vec<(u64, f32)> = self
            .data
            .chunks_exact(self.dims)
            .enumerate()
            .map(|(row, values)| (row as u64, values.iter().zip(&query).map(|(a, b)| a * b).sum()))
            .collect();
        let limit = limit.min(scored.len());
        if limit == 0 {
            return Vec::new();
        }
        scored.select_nth_unstable_by(limit - 1, |a, b| b.1.total_cmp(&a.1));
        scored.truncate(limit);
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored
    }

    /// Writes them to `path` (through a temporary file: a reader never sees half a file).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut bytes = Vec::with_capacity(16 + self.data.len() * 4);
        bytes.extend_from_slice(VECTORS_MAGIC);
        bytes.extend_from_slice(&(self.dims as u32).to_le_bytes());
        bytes.extend_from_slice(&(self.len() as u32).to_le_bytes());
        for value in &self.data {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    }

    /// Reads what [`Vectors::write`] wrote; `None` when the file is missing or damaged.
    pub fn read(path: &Path) -> Option<Vectors> {
        let bytes = std::fs::read(path).ok()?;
        let header = bytes.get(..16)?;
        if &header[..8] != VECTORS_MAGIC {
            return None;
        }
        let dims = u32::from_le_bytes(header[8..12].try_into().ok()?) as usize;
        let count = u32::from_le_bytes(header[12..16].try_into().ok()?) as usize;
        let body = &bytes[16..];
        if dims == 0 || body.len() != dims.checked_mul(count)?.checked_mul(4)? {
            return None;
        }
        let data = body.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Some(Vectors { dims, data })
    }
}

fn normalize(vector: &mut [f32]) {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in vector {
            *x /= norm;
        }
    }
}

/// `text` cut to at most `max` characters, at a space when one is near, with `…` when cut.
pub fn cut_chars(text: &str, max: usize) -> String {
    let text = text.trim();
    match text.char_indices().nth(max) {
        Some((at, _)) => {
            let head = &text[..at];
            let head = head.rfind(char::is_whitespace).filter(|&i| i > at / 2).map_or(head, |i| &head[..i]);
            format!("{}…", head.trim_end())
        }
        None => text.to_owned(),
    }
}
