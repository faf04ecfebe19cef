//! Semantic memory and skills' knowledge through the real binary: documents retrieved into
//! the context (`inject`) with embeddings from a fake OpenAI-compatible server fused with full
//! text, a killed run that never embeds its query again, search and read tools (`agentic`)
//! over `keel serve` with the mock model, and `keel check` on bad folders and settings.

use keel_testkit::{Recorded, Reply, WireServer};
use serde_json::{Value, json};

use crate::memory::{keel_run, text_reply};
use crate::serve::{Served, client, read_sse, sqlite};
use crate::support::{agent_dir, keel, keel_on_store};

const REFUNDS: &str = "# Refunds\n\nA refund is paid within 14 days of the return reaching our warehouse.\n\n## Exceptions\n\nGift cards are never refunded.\n";
const SHIPPING: &str = "# Shipping\n\nParcels leave the warehouse every weekday at 4 pm.\n";
const MONEY: &str = "# Getting paid\n\nMoney is sent by bank transfer on Fridays.\n";

/// Word groups the fake embedding model places together: "money back" lands near "refund".
const CONCEPTS: &[&[&str]] = &[&["refund", "money back", "reimburse"], &["parcel", "courier", "delivery"]];

fn embedding(text: &str) -> Vec<f32> {
    let text = text.to_lowercase();
    let mut vector: Vec<f32> =
        CONCEPTS.iter().map(|words| words.iter().filter(|w| text.contains(*w)).count() as f32).collect();
    vector.push(0.1);
    vector
}

/// A fake OpenAI server: `/v1/embeddings` embeds by concepts, chat turns answer "Noted.".
async fn fake_model() -> WireServer {
    WireServer::responding(|request| {
        if request.path.ends_with("/embeddings") {
            let inputs = request.json()["input"].as_array().cloned().unwrap_or_default();
            let data: Vec<Value> = inputs
                .iter()
                .enumerate()
                .map(|(index, text)| json!({ "object": "embedding", "index": index, "embedding": embedding(text.as_str().unwrap_or_default()) }))
                .collect();
            return Reply::json(200, &json!({ "object": "list", "data": data, "model": "text-embedding-3-small" }));
        }
        text_reply("Noted.")
    })
    .await
}

fn is_embedding(request: &Recorded) -> bool {
    request.path.ends_with("/embeddings")
}

/// The inputs of each embeddings request.
fn embedded(model: &WireServer) -> Vec<usize> {
    model
        .requests()
        .iter()
        .filter(|r| is_embedding(r))
        .map(|r| r.json()["input"].as_array().unwrap().len())
        .collect()
}

/// The system prompt of each chat turn.
fn turns(model: &WireServer) -> Vec<String> {
    model
        .requests()
        .iter()
        .filter(|r| !is_embedding(r))
        .map(|r| r.json()["messages"][0]["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn inject_agent(base_url: &str) -> String {
    format!(
        "model: openai/fake\nprovider: {{ base_url: '{base_url}/v1' }}\nretry: {{ max_attempts: 1 }}\n\
         instructions: Answer from the documents.\nmemory: {{ kind: semantic, top_k: 2 }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_best_passages_join_the_context_ranked_by_full_text_and_embeddings_and_a_killed_run_never_embeds_again()
 {
    let model = fake_model().await;
    let dir = agent_dir(&[
        ("agent.yaml", &inject_agent(&model.url())),
        ("memory/refunds.md", REFUNDS),
        ("memory/shipping.md", SHIPPING),
        ("memory/money.md", MONEY),
    ]);
    // "money back" shares no word with the refund policy: the embeddings find it.
    let out = keel_run(dir.path(), "s", "Can I get my money back?", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Noted.");
    let seen = turns(&model);
    let system = &seen[0];
    assert!(
        system.starts_with("Answer from the documents.\n\n## From your documents: the passages"),
        "{system}"
    );
    assert!(
        system.contains("refunds.md, line 3 — Refunds (id refunds.md#1)\nA refund is paid within 14 days"),
        "{system}"
    );
    assert!(system.contains("money.md"), "full text still ranks the money note: {system}");
    assert!(!system.contains("shipping.md"), "{system}");
    // Four passages embedded once at start, then the query.
    assert_eq!(embedded(&model), [4, 1]);

    // Killed right after its retrieval is journaled: the next process finishes that run from
    // its journal (no query embedded for it again, no passage embedded again: the index and its
    // vectors are on disk), then makes the new run's own retrieval.
    let out = keel_run(
        dir.path(),
        "s",
        "Is a gift card refunded?",
        &[("KEEL_FAULT", "after_commit:memory:retrieve")],
    );
    assert!(!out.status.success(), "the fault point did not fire");
    assert_eq!(embedded(&model), [4, 1, 1]);
    assert_eq!(turns(&model).len(), 1);
    let out = keel_run(dir.path(), "s", "When do parcels leave?", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(embedded(&model), [4, 1, 1, 1], "one query embedding per run, passages never again");
    let seen = turns(&model);
    assert_eq!(seen.len(), 3);
    assert!(
        seen[1].contains("Refunds › Exceptions (id refunds.md#2)\nGift cards are never refunded."),
        "{}",
        seen[1]
    );
    assert!(seen[2].contains("shipping.md, line 3 — Shipping (id shipping.md#1)"), "{}", seen[2]);
    // The index lives under the working directory: one library, one version.
    let index = dir.path().join(".keel/index");
    assert_eq!(std::fs::read_dir(&index).unwrap().count(), 1, "one library under {}", index.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_a_changed_document_is_indexed_again_and_only_its_passage_embedded() {
    let model = fake_model().await;
    let dir = agent_dir(&[("agent.yaml", &inject_agent(&model.url())), ("memory/refunds.md", REFUNDS)]);
    let ask = |server: &Served, input: &str| {
        let http = client();
        let url = server.url("/chat");
        let input = input.to_owned();
        async move {
            let events = read_sse(
                http.post(url).json(&json!({ "sessionId": "s", "input": input })).send().await.unwrap(),
            )
            .await;
            events.iter().rev().find(|e| e.event.is_none()).unwrap().json()
        }
    };
    let env = [("OPENAI_API_KEY", "sk-fake")];
    let server = Served::start(dir.path(), &sqlite(dir.path()), &env);
    assert_eq!(ask(&server, "refund?").await["type"], "run.done");
    drop(server);
    assert_eq!(embedded(&model), [2, 1]);
    std::fs::write(
        dir.path().join("memory/refunds.md"),
        format!("{REFUNDS}\n## Late returns\n\nNo refund after 60 days.\n"),
    )
    .unwrap();
    let server = Served::start(dir.path(), &sqlite(dir.path()), &env);
    assert_eq!(ask(&server, "refund after 90 days?").await["type"], "run.done");
    assert_eq!(embedded(&model), [2, 1, 1, 1], "the new passage only, then the query");
    assert!(turns(&model)[1].contains("No refund after 60 days."), "{}", turns(&model)[1]);
}

const AGENTIC: &str = "model: mock
memory: { kind: semantic, mode: agentic, top_k: 3 }
mock:
  script:
    - tool_calls: [{ name: search_memory, input: { query: gift card refund } }]
    - tool_calls: [{ name: read_memory, input: { id: refunds.md#2 } }]
    - tool_calls: [{ name: search_billing, input: { query: VAT rate } }]
    - text: 'From the documents: {{last_tool_output}}'
";

const BILLING_SKILL: &str = "---\nname: billing\ndescription: Invoices and VAT.\nknowledge: { source: docs/, mode: agentic }\n---\nQuote the VAT rate.\n";

#[tokio::test]
async fn keel_serve_with_the_mock_model_searches_and_reads_the_documents_and_a_skill_s_knowledge() {
    let dir = agent_dir(&[
        ("agent.yaml", AGENTIC),
        ("memory/refunds.md", REFUNDS),
        ("memory/shipping.md", SHIPPING),
        ("skills/billing/SKILL.md", BILLING_SKILL),
        ("skills/billing/docs/vat.md", "# VAT\n\nThe VAT rate on every invoice is 20 percent.\n"),
    ]);
    let server = Served::start(dir.path(), &sqlite(dir.path()), &[]);
    let events = read_sse(
        client()
            .post(server.url("/chat"))
            .json(&json!({ "sessionId": "s", "input": "Gift cards?" }))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let outputs: Vec<Value> =
        events.iter().filter(|e| e.event.is_none() && e.kind() == "tool.done").map(|e| e.json()).collect();
    assert_eq!(outputs.len(), 3, "{events:?}");
    let search = &outputs[0]["output"];
    assert_eq!(search["hits"][0]["id"], "refunds.md#2", "{search}");
    assert_eq!(search["hits"][0]["source"], "refunds.md");
    assert!(search["hits"][0]["snippet"].as_str().unwrap().contains("Gift cards"), "{search}");
    assert_eq!(search["ranking"], "full-text", "the mock has no embeddings");
    let read = &outputs[1]["output"];
    assert_eq!(read["text"], "Gift cards are never refunded.");
    assert_eq!(read["title"], "Refunds › Exceptions");
    let done = events.iter().rev().find(|e| e.event.is_none()).unwrap().json();
    assert_eq!(done["type"], "run.done", "{done}");
    let answer = done["text"].as_str().unwrap();
    assert!(
        answer.starts_with("From the documents: ")
            && answer.contains("vat.md#1")
            && answer.contains("20 percent"),
        "{answer}"
    );
    // The skill's documents are its own: the agent's search does not see them.
    assert!(!search.to_string().contains("vat.md"), "{search}");
}

#[test]
fn keel_check_names_each_bad_file_and_refuses_top_k_out_of_range() {
    let dir = agent_dir(&[
        ("agent.yaml", "model: mock\nmemory: { kind: semantic }\n"),
        ("memory/good.md", REFUNDS),
        ("memory/again.md", REFUNDS),
        ("memory/broken.pdf", "%PDF-1.7\n1 0 obj garbage"),
        ("memory/logo.svg", "<svg/>"),
        // Its cross-reference table points past the end: the PDF parser logged an ERROR line
        // of its own beside keel's warning.
        (
            "memory/bad-xref.pdf",
            "%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\nxref\n0 3\n0000000000 65535 f \n\
             0000000009 00000 n \n0000000999 00000 n \ntrailer\n<< /Size 3 /Root 1 0 R >>\nstartxref\n58\n%%EOF\n",
        ),
    ]);
    std::fs::write(dir.path().join("memory/junk.txt"), [0u8, 255, 254, 0, 13]).unwrap();
    let huge = std::fs::File::create(dir.path().join("memory/dump.txt")).unwrap();
    huge.set_len(200 * 1024 * 1024).unwrap();
    // Logging as a user's would be, by default.
    let check =
        || keel().env_remove("KEEL_LOG").current_dir(dir.path()).args(["check", "."]).output().unwrap();
    let out = check();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stderr}");
    for (file, why) in [
        ("good.md", "has the same content as again.md"),
        ("broken.pdf", "is a PDF that does not parse"),
        ("logo.svg", "is not a document keel reads"),
        ("junk.txt", "holds binary data"),
        ("dump.txt", "is 200 MB"),
        ("bad-xref.pdf", "or its pages could not be read"),
    ] {
        assert!(
            stderr.lines().any(|l| l.starts_with("warning: ") && l.contains(file) && l.contains(why)),
            "{file}: {stderr}"
        );
    }
    assert!(stderr.lines().all(|l| l.starts_with("warning: ")), "only keel's warnings: {stderr}");
    assert!(stdout.contains("(6 warnings)") && stdout.contains("(1 document, 2 passages)"), "{stdout}");
    // The agent starts all the same, and answers.
    let run = keel_on_store(dir.path(), &["run", ".", "refund?"]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    for top_k in ["0", "10000"] {
        std::fs::write(
            dir.path().join("agent.yaml"),
            format!("model: mock\nmemory: {{ kind: semantic, top_k: {top_k} }}\n"),
        )
        .unwrap();
        let out = check();
        assert_eq!(out.status.code(), Some(1), "top_k {top_k}: an invalid agent");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("`memory.top_k` must be between 1 and 50, not {top_k}"))
                && stderr.contains("agent.yaml:2:"),
            "{stderr}"
        );
    }
}
