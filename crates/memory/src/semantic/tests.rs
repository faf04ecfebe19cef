//! Semantic memory over real folders: what is indexed and skipped, when the index is built
//! again, how full text and embeddings rank, and what the tools answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel_core::memory::{Embeddings, Knowledge, RetrievalMode};
use keel_core::provider::ProviderErrorKind;
use keel_core::tool::ToolContext;
use keel_core::{BoxFuture, DeltaSink, ModelReply, ModelRequest, Provider, ProviderError};
use serde_json::json;

use super::*;

/// Words that mean the same, as an embedding model would place them near each other.
const CONCEPTS: &[&[&str]] = &[
    &["refund", "money back", "reimburse"],
    &["ship", "delivery", "parcel", "courier"],
    &["password", "log in", "sign in", "credentials"],
    &["invoice", "bill", "receipt"],
];

/// A provider whose embeddings count concepts (and can be told to fail); it has no chat.
struct ConceptEmbedder {
    embedded: AtomicUsize,
    fail: bool,
}

impl ConceptEmbedder {
    fn new(fail: bool) -> Arc<ConceptEmbedder> {
        Arc::new(ConceptEmbedder { embedded: AtomicUsize::new(0), fail })
    }
}

impl Provider for ConceptEmbedder {
    fn complete<'a>(
        &'a self,
        _request: ModelRequest<'a>,
        _sink: &'a mut dyn DeltaSink,
    ) -> BoxFuture<'a, Result<ModelReply, ProviderError>> {
        Box::pin(async { Err(ProviderError::new(ProviderErrorKind::Unavailable, "no chat here")) })
    }

    fn default_embedding_model(&self) -> Option<&str> {
        Some("concepts")
    }

    fn embed<'a>(
        &'a self,
        _model: &'a str,
        inputs: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, ProviderError>> {
        Box::pin(async move {
            if self.fail {
                return Err(ProviderError::new(ProviderErrorKind::Transient, "the embedding server is down"));
            }
            self.embedded.fetch_add(inputs.len(), Ordering::SeqCst);
            Ok(inputs
                .iter()
                .map(|text| {
                    let text = text.to_lowercase();
                    let mut vector: Vec<f32> = CONCEPTS
                        .iter()
                        .map(|words| words.iter().filter(|w| text.contains(*w)).count() as f32)
                        .collect();
                    // A small constant part: no vector is all zeros.
                    vector.push(0.1);
                    vector
                })
                .collect())
        })
    }
}

fn folder(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, bytes) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
    dir
}

/// A valid PDF with one page per text, in Helvetica.
fn pdf(pages: &[&str]) -> Vec<u8> {
    let font = 3 + 2 * pages.len();
    let kids: Vec<String> = (0..pages.len()).map(|i| format!("{} 0 R", 3 + 2 * i)).collect();
    let mut objects = vec![
        "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
        format!("<< /Type /Pages /Kids [{}] /Count {} >>", kids.join(" "), pages.len()),
    ];
    for (i, text) in pages.iter().enumerate() {
        objects.push(format!(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {} 0 R /Resources << /Font << /F1 {font} 0 R >> >> >>",
            4 + 2 * i
        ));
        let content = format!("BT /F1 12 Tf 72 720 Td ({text}) Tj ET");
        objects.push(format!("<< /Length {} >>\nstream\n{content}\nendstream", content.len()));
    }
    objects
        .push("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>".to_owned());
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, object) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend(format!("{} 0 obj\n{object}\nendobj\n", i + 1).bytes());
    }
    let xref = out.len();
    out.extend(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).bytes());
    for offset in offsets {
        out.extend(format!("{offset:010} 00000 n \n").bytes());
    }
    out.extend(
        format!("trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n", objects.len() + 1).bytes(),
    );
    out
}

const REFUNDS: &str = "# Refunds\n\nA refund is paid within 14 days of the return reaching our warehouse.\n\n## Exceptions\n\nGift cards are never refunded.\n";
const SHIPPING: &str =
    "Parcels leave the warehouse every weekday at 4 pm. The courier delivers within two days.\n";
const ACCOUNT: &[u8] = b"<html><head><title>Your account</title></head><body><nav>Home</nav><h1>Passwords</h1><p>To change your password, open Settings and choose Security.</p></body></html>";

fn library(dir: &Path, index: &Path, provider: Arc<dyn Provider>, embeddings: Embeddings) -> Library {
    let knowledge = Knowledge { embeddings, ..Knowledge::new(dir) };
    Library::new(knowledge, provider, index)
}

fn ids(found: &Found) -> Vec<&str> {
    found.hits.iter().map(|hit| hit.passage.id.as_str()).collect()
}

#[tokio::test]
async fn markdown_text_html_and_pdf_are_indexed_with_positions_and_found_by_their_words() {
    let docs = folder(&[
        ("refunds.md", REFUNDS.as_bytes()),
        ("guides/shipping.txt", SHIPPING.as_bytes()),
        ("account.html", ACCOUNT),
        ("invoices.pdf", &pdf(&["Invoices are sent by email.", "Each invoice lists the VAT paid."])),
    ]);
    let index = tempfile::tempdir().unwrap();
    let library = library(docs.path(), index.path(), ConceptEmbedder::new(false), Embeddings::Off);
    let opened = library.open().await.unwrap();
    assert_eq!(opened.index.documents(), 4);
    assert!(opened.index.warnings.is_empty(), "{:?}", opened.index.warnings);

    let found = library.search("when is my refund paid", 3).await.unwrap();
    assert_eq!(found.ranking, "full-text");
    let best = &found.hits[0];
    assert_eq!(best.passage.id, "refunds.md#1");
    assert_eq!(
        (best.passage.title.as_str(), best.passage.start_line, best.passage.end_line),
        ("Refunds", 3, 3)
    );
    assert!(best.snippet.contains("refund is paid within 14 days"), "{}", best.snippet);

    let found = library.search("gift cards", 1).await.unwrap();
    assert_eq!(found.hits[0].passage.title, "Refunds › Exceptions");
    // Stems match: "delivers" finds "delivered"; the path's words count too.
    let found = library.search("delivered", 1).await.unwrap();
    assert_eq!(ids(&found), ["guides/shipping.txt#1"]);
    let found = library.search("How do I change my password?", 1).await.unwrap();
    let html = &found.hits[0].passage;
    assert_eq!(html.source, "account.html");
    assert!(html.title.starts_with("Your account"), "{html:?}");
    assert!(html.text.contains("open Settings and choose Security"), "{html:?}");
    let found = library.search("VAT", 1).await.unwrap();
    let page = &found.hits[0].passage;
    assert_eq!((page.source.as_str(), page.page), ("invoices.pdf", Some(2)), "{page:?}");
    assert!(page.text.contains("VAT paid"), "{page:?}");

    // Query syntax is plain text: quotes, colons and AND neither fail nor change the meaning.
    for query in ["\"refund", "title:refund AND", "refund: -- ((", ""] {
        library.search(query, 3).await.unwrap();
    }
    assert!(library.search("zebra quantum", 3).await.unwrap().hits.is_empty());
}

#[tokio::test]
async fn binary_junk_huge_files_broken_pdfs_and_copies_are_skipped_with_a_warning_each() {
    let mut junk = vec![0u8, 159, 146, 150, 255, 0, 1, 2];
    junk.extend(std::iter::repeat_n(7u8, 1000));
    // 20,000 nested tables overflowed the parser's stack and aborted the process.
    let nested = format!("<html><body>{}deep</body></html>", "<table><tr><td>".repeat(20_000));
    let docs = folder(&[
        ("good.md", REFUNDS.as_bytes()),
        ("nested.html", nested.as_bytes()),
        ("z-copy.md", REFUNDS.as_bytes()),
        ("junk.txt", &junk),
        ("latin1.txt", b"caf\xe9 cr\xe8me"),
        ("broken.pdf", b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage"),
        ("scanned.pdf", &pdf(&[""])),
        ("photo.png", b"\x89PNG\r\n\x1a\n"),
        ("empty.md", b""),
        (".hidden.md", b"# secret"),
    ]);
    // 200 MB, sparse: the size alone skips it, it is never read.
    let huge = std::fs::File::create(docs.path().join("huge.txt")).unwrap();
    huge.set_len(200 * 1024 * 1024).unwrap();
    drop(huge);
    #[cfg(unix)]
    std::os::unix::fs::symlink("/etc/passwd", docs.path().join("passwd.txt")).unwrap();

    let report = check_folder(docs.path()).unwrap();
    let warned: Vec<(&str, &str)> =
        report.warnings.iter().map(|w| (w.path.as_str(), w.message.as_str())).collect();
    let expect = [
        ("broken.pdf", "is a PDF that does not parse"),
        ("empty.md", "is empty"),
        ("huge.txt", "is 200 MB, over the 32 MB"),
        ("junk.txt", "binary data"),
        ("latin1.txt", "not UTF-8"),
        ("nested.html", "nests its elements more than 256 levels deep"),
        ("passwd.txt", "symbolic link"),
        ("photo.png", "not a document keel reads"),
        ("scanned.pdf", "no text"),
        ("z-copy.md", "same content as good.md"),
    ];
    assert_eq!(warned.len(), expect.len(), "{warned:#?}");
    for ((path, message), (want_path, want)) in warned.iter().zip(expect) {
        assert_eq!(*path, want_path);
        assert!(message.contains(want), "{path}: {message}");
    }
    assert_eq!(report.documents, 1);

    // Indexing reports the same and starts: only the good file is searchable.
    let index = tempfile::tempdir().unwrap();
    let library = library(docs.path(), index.path(), ConceptEmbedder::new(false), Embeddings::Off);
    let opened = library.open().await.unwrap();
    assert_eq!(opened.index.warnings.len(), expect.len(), "{:?}", opened.index.warnings);
    let found = library.search("refund", 10).await.unwrap();
    assert!(found.hits.iter().all(|hit| hit.passage.source == "good.md"), "{:?}", ids(&found));
}

#[tokio::test]
async fn the_index_is_built_again_only_when_documents_change_and_only_new_passages_are_embedded() {
    let docs = folder(&[("refunds.md", REFUNDS.as_bytes()), ("shipping.txt", SHIPPING.as_bytes())]);
    let index = tempfile::tempdir().unwrap();
    let embedder = ConceptEmbedder::new(false);
    let open = || async {
        let library = library(docs.path(), index.path(), embedder.clone(), Embeddings::Auto);
        let opened = library.open().await.unwrap();
        (opened.index.built, opened.index.dir.clone(), opened.vectors.is_some())
    };
    let (built, first_dir, vectors) = open().await;
    assert!(built && vectors);
    let embedded_first = embedder.embedded.load(Ordering::SeqCst);
    assert_eq!(embedded_first, 3, "three passages");

    // Another process (or a restart) with the same documents: nothing built, nothing embedded.
    let (built, dir, _) = open().await;
    assert!(!built);
    assert_eq!(dir, first_dir);
    assert_eq!(embedder.embedded.load(Ordering::SeqCst), embedded_first);

    // One file changes: a new version, and only its passage is embedded.
    std::fs::write(docs.path().join("shipping.txt"), "Parcels leave on Mondays only.\n").unwrap();
    let (built, dir, _) = open().await;
    assert!(built);
    assert_ne!(dir, first_dir);
    assert_eq!(embedder.embedded.load(Ordering::SeqCst), embedded_first + 1);
    assert!(!first_dir.exists(), "the old version is removed once the new one is complete");
    let versions = std::fs::read_dir(dir.parent().unwrap()).unwrap().count();
    assert_eq!(versions, 1);
}

#[tokio::test]
async fn embeddings_find_what_shares_no_word_with_the_query_and_fuse_with_full_text() {
    let docs = folder(&[
        ("refunds.md", REFUNDS.as_bytes()),
        ("shipping.txt", SHIPPING.as_bytes()),
        ("notes.md", b"# Getting your money\n\nMoney is paid by bank transfer on Fridays.\n"),
    ]);
    let index = tempfile::tempdir().unwrap();
    let full_text = library(docs.path(), index.path(), ConceptEmbedder::new(false), Embeddings::Off);
    let fused = library(docs.path(), index.path(), ConceptEmbedder::new(false), Embeddings::Auto);
    let query = "can I get my money back";
    // Full text finds the note about money, not the refund policy.
    let alone = full_text.search(query, 1).await.unwrap();
    assert_eq!(ids(&alone), ["notes.md#1"]);
    let both = fused.search(query, 2).await.unwrap();
    assert_eq!(both.ranking, "fused");
    assert!(ids(&both).contains(&"refunds.md#1"), "{:?}", ids(&both));
    assert!(ids(&both).contains(&"notes.md#1"), "{:?}", ids(&both));
    let courier = fused.search("parcel", 1).await.unwrap();
    assert_eq!(ids(&courier), ["shipping.txt#1"]);
}

#[tokio::test]
async fn a_failing_embedding_model_leaves_full_text_and_says_so() {
    let docs = folder(&[("refunds.md", REFUNDS.as_bytes())]);
    let index = tempfile::tempdir().unwrap();
    let library =
        library(docs.path(), index.path(), ConceptEmbedder::new(true), Embeddings::Model("big".into()));
    let opened = library.open().await.unwrap();
    assert!(opened.vectors.is_none());
    let found = library.search("refund", 1).await.unwrap();
    assert_eq!(found.ranking, "full-text");
    assert!(
        found.note.as_deref().unwrap_or_default().contains("the embedding server is down"),
        "{:?}",
        found.note
    );
    let retrieved = library.retrieve("refund").await.unwrap();
    assert_eq!(retrieved["hits"][0]["id"], "refunds.md#1");
    assert!(retrieved["note"].as_str().unwrap().contains("down"));
}

#[tokio::test]
async fn retrieval_context_names_each_passage_and_its_place() {
    let docs = folder(&[("refunds.md", REFUNDS.as_bytes()), ("shipping.txt", SHIPPING.as_bytes())]);
    let index = tempfile::tempdir().unwrap();
    let library = library(docs.path(), index.path(), ConceptEmbedder::new(false), Embeddings::Off);
    let outcome = library.retrieve("refund for gift cards").await.unwrap();
    let context = outcome["context"].as_str().unwrap();
    assert!(
        context.starts_with("## From your documents: the passages that best match the message"),
        "{context}"
    );
    assert!(
        context.contains("[1] refunds.md, line 7 — Refunds › Exceptions (id refunds.md#2)\nGift cards"),
        "{context}"
    );
    let nothing = library.retrieve("zebra").await.unwrap();
    assert_eq!(nothing["context"], "");
}

#[tokio::test]
async fn the_tools_search_then_read_a_passage_whole_and_refuse_unknown_ids() {
    let docs = folder(&[("refunds.md", REFUNDS.as_bytes())]);
    let index = tempfile::tempdir().unwrap();
    let knowledge = Knowledge {
        mode: RetrievalMode::Agentic,
        snippet_chars: 40,
        embeddings: Embeddings::Off,
        ..Knowledge::new(docs.path())
    };
    let library = Arc::new(Library::new(knowledge, ConceptEmbedder::new(false), index.path()));
    let tools = library.tools();
    let names: Vec<&str> = tools.iter().map(|t| t.spec().name.as_str()).collect();
    assert_eq!(names, ["search_memory", "read_memory"]);
    let ctx = ToolContext {
        run_id: keel_core::RunId::from_suffix("t"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "c".into(),
        idempotency_key: "run_t:tool:search_memory:c".into(),
        state: keel_core::SessionState::default(),
    };
    let found = tools[0].call(json!({ "query": "refund paid", "top_k": 1 }), &ctx).await.unwrap();
    let hit = &found["hits"][0];
    assert_eq!(hit["id"], "refunds.md#1");
    assert_eq!(hit["source"], "refunds.md");
    assert!(hit["snippet"].as_str().unwrap().chars().count() <= 41, "{hit}");
    let read = tools[1].call(json!({ "id": "refunds.md#1" }), &ctx).await.unwrap();
    assert_eq!(read["text"], "A refund is paid within 14 days of the return reaching our warehouse.");
    assert_eq!(read["lines"], json!([3, 3]));
    assert_eq!(read["title"], "Refunds");
    let error = tools[1].call(json!({ "id": "../../etc/passwd" }), &ctx).await.unwrap_err();
    assert!(error.message.contains("no passage has the id"), "{}", error.message);
}

#[test]
fn reciprocal_rank_fusion_rewards_passages_both_rankings_like() {
    let text = [(1, 9.0), (2, 8.0), (3, 7.0)];
    let vector = [(3, 0.9), (4, 0.8), (1, 0.7)];
    let fused = fuse(&[&text, &vector]);
    let order: Vec<u64> = fused.iter().map(|(ord, _)| *ord).collect();
    assert_eq!(order, [1, 3, 2, 4]);
    let expected = 1.0 / 61.0 + 1.0 / 63.0;
    assert!((fused[0].1 - expected).abs() < 1e-6);
}

#[test]
fn vectors_round_trip_and_damaged_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.bin");
    let vectors = Vectors::new(vec![vec![3.0, 4.0], vec![1.0, 0.0]]).unwrap();
    vectors.write(&path).unwrap();
    assert_eq!(Vectors::read(&path).unwrap(), vectors);
    assert_eq!(vectors.nearest(&[0.0, 2.0], 1), vec![(0, 0.8)]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.pop();
    std::fs::write(&path, &bytes).unwrap();
    assert!(Vectors::read(&path).is_none());
    assert!(Vectors::new(vec![vec![1.0], vec![1.0, 2.0]]).is_none());
}

#[tokio::test]
async fn an_index_folder_that_cannot_be_written_leaves_the_documents_indexed_in_memory() {
    let docs = folder(&[("refunds.md", REFUNDS.as_bytes())]);
    // A file where the index folder should be: nothing can be created under it.
    let blocked = tempfile::NamedTempFile::new().unwrap();
    let embedder = ConceptEmbedder::new(false);
    let library = library(docs.path(), blocked.path(), embedder.clone(), Embeddings::Auto);
    let opened = library.open().await.unwrap();
    assert!(opened.index.built && opened.vectors.is_some());
    let found = library.search("gift cards", 1).await.unwrap();
    assert_eq!(ids(&found), ["refunds.md#2"]);
    assert_eq!(found.ranking, "fused");
    assert_eq!(std::fs::metadata(blocked.path()).unwrap().len(), 0, "nothing written");
}
