//! The memory engine over the memory store and the mock model.

use std::sync::Arc;

use expect_test::expect;
use keel_core::{ManualClock, MockEntry, MockScript, RunId, SessionId};
use keel_providers::MockProvider;
use keel_store::MemoryStore;

use super::*;

/// An engine whose model answers the memory calls of call index 0 with `episode` / `extract`.
fn engine(store: &Arc<MemoryStore>, episode: Option<&str>, extract: Option<&str>) -> MemoryEngine {
    let entry = MockEntry {
        text: Some("ok".into()),
        episode: episode.map(str::to_owned),
        extract: extract.map(str::to_owned),
        ..MockEntry::default()
    };
    let provider = Arc::new(MockProvider::new(MockScript::new(vec![entry])));
    MemoryEngine::new(store.clone() as Arc<dyn Store>, provider, "mock")
}

fn run_messages(input: &str, answer: &str) -> Vec<Arc<Message>> {
    vec![Arc::new(Message::user(input)), Arc::new(Message::assistant(answer))]
}

async fn call(engine: &MemoryEngine, run: &str, request: MemoryRequest) -> MemoryOutcome {
    let (run, session) = (RunId::from_suffix(run), SessionId::new("s").unwrap());
    let scope = MemoryScope { owner: "user:ada", run: &run, session: &session };
    engine.call(scope, &request).await
}

fn extract(input: &str) -> MemoryRequest {
    MemoryRequest::Extract { messages: run_messages(input, "Noted."), call_index: 0 }
}

#[tokio::test]
async fn an_extraction_is_normalized_merged_and_walked_within_its_bounds() {
    let store = Arc::new(MemoryStore::new());
    let reply = r#"```json
{"entities": [{"name": "  Ada   Lovelace ", "type": "Person"}, {"name": ""}, {"nope": 1}],
 "relations": [
   {"from": "Ada Lovelace", "relation": "works at", "to": "ACME", "confidence": 0.6},
   {"from": "ada lovelace", "relation": "works_at", "to": "acme", "confidence": 0.9},
   {"from": "ACME", "relation": "based-in", "to": "Paris", "confidence": 7},
   {"from": "Paris", "relation": "capital of", "to": "France"},
   {"from": "France", "relation": "in", "to": "Europe"},
   {"from": "x", "relation": "is", "to": "X"}
 ]}
```"#;
    let outcome =
        call(&engine(&store, None, Some(reply)), "r1", extract("Ada works at Acme.")).await.unwrap();
    assert_eq!(
        (&outcome["entities"], &outcome["relations"], &outcome["skipped"]),
        (&json!(5), &json!(4), &json!(3))
    );
    // The memory model's tokens go with the outcome, to be counted like a turn's.
    let usage = keel_core::memory::outcome_usage(&outcome).unwrap();
    assert!(usage.input_tokens > 0 && usage.output_tokens > 0, "{outcome}");
    let relations = store.load_memory("user:ada", Some(RELATION)).await.unwrap();
    let works_at = relations.iter().find(|r| r.key == "ada lovelace —[works_at]→ acme").unwrap();
    assert_eq!(works_at.value["confidence"], json!(0.9), "duplicates keep the higher confidence");
    let based_in = relations.iter().find(|r| r.key.contains("based_in")).unwrap();
    assert_eq!(based_in.value["confidence"], json!(1.0), "clamped");

    // A later, weaker extraction of the same relation keeps the stronger one.
    let weaker = r#"{"entities": [], "relations": [{"from": "Ada Lovelace", "relation": "works_at", "to": "Acme", "confidence": 0.2}]}"#;
    call(&engine(&store, None, Some(weaker)), "r2", extract("Still at Acme?")).await.unwrap();
    let relations = store.load_memory("user:ada", Some(RELATION)).await.unwrap();
    let works_at = relations.iter().find(|r| r.key == "ada lovelace —[works_at]→ acme").unwrap();
    assert_eq!(works_at.value["confidence"], json!(0.9));

    // The walk starts from what the input names (whole words), two hops out.
    let walk = |text: &str, graph: GraphSettings| MemoryRequest::Traverse { text: text.into(), graph };
    let context = call(
        &engine(&store, None, None),
        "r3",
        walk("Where does Ada Lovelace work?", GraphSettings::default()),
    )
    .await
    .unwrap();
    expect![[r#"
        ## What you know about what this message mentions
        - ada lovelace —[works_at]→ acme
        - acme —[based_in]→ paris"#]]
    .assert_eq(context["context"].as_str().unwrap());
    let wide = GraphSettings { depth: 5, ..GraphSettings::default() };
    let far = call(&engine(&store, None, None), "r4", walk("Tell me about ACME", wide)).await.unwrap();
    assert_eq!(far["relations"], json!(4), "{far}");
    let narrow = GraphSettings { depth: 5, max_nodes: 2, ..GraphSettings::default() };
    let small = call(&engine(&store, None, None), "r5", walk("Tell me about ACME", narrow)).await.unwrap();
    assert_eq!(
        small["relations"],
        json!(1),
        "max_nodes bounds the walk (acme and its strongest neighbour): {small}"
    );
    // A word inside another is no mention ("acmes" is not "acme"); nothing known, no context.
    let none = call(&engine(&store, None, None), "r6", walk("acmes and parisians", wide)).await.unwrap();
    assert_eq!(none["context"], json!(""));
}

#[tokio::test]
async fn malformed_extractions_are_errors_that_say_what_came_and_store_nothing() {
    let store = Arc::new(MemoryStore::new());
    for (reply, expected) in [
        ("Sure! Alice works at Acme.", "the extraction is not JSON"),
        ("[1, 2]", "not an object: a list"),
        (r#"{"entities": "alice"}"#, "`entities` is a string, not a list"),
        (r#"{"people": []}"#, "neither `entities` nor `relations`"),
    ] {
        let error = call(&engine(&store, None, Some(reply)), "r1", extract("hi")).await.unwrap_err();
        assert!(error.contains(expected), "{reply}: {error}");
    }
    assert!(store.load_memory("user:ada", None).await.unwrap().is_empty());
}

#[tokio::test]
async fn episodes_are_one_per_run_recalled_oldest_first_and_capped() {
    let clock = ManualClock::starting_now();
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    for n in 0..3 {
        clock.advance(std::time::Duration::from_secs(1));
        let sentence = format!("Episode {n}.\nA second line that is dropped.");
        let engine = engine(&store, Some(&sentence), None);
        let episode = MemoryRequest::Episode { messages: run_messages("hi", "hello"), call_index: 0 };
        assert_eq!(
            call(&engine, &format!("r{n}"), episode.clone()).await.unwrap()["episode"],
            json!(format!("Episode {n}."))
        );
        // The same run again (a replay that lost its journal entry) replaces, never adds.
        call(&engine, &format!("r{n}"), episode).await.unwrap();
    }
    assert_eq!(store.load_memory("user:ada", Some(EPISODE)).await.unwrap().len(), 3);
    let recalled = call(&engine(&store, None, None), "r9", MemoryRequest::Recall { limit: 2 }).await.unwrap();
    let context = recalled["context"].as_str().unwrap();
    assert!(
        context.starts_with("## What you remember from earlier conversations (oldest first)\n- "),
        "{context}"
    );
    let one = context.find("Episode 1.").unwrap();
    let two = context.find("Episode 2.").unwrap();
    assert!(one < two && !context.contains("Episode 0."), "{context}");

    // The mock's own summary, without a scripted one; an empty one is an error.
    let episode = MemoryRequest::Episode { messages: run_messages("What is 2+3?", "5"), call_index: 0 };
    let own = call(&engine(&store, None, None), "r10", episode.clone()).await.unwrap();
    assert_eq!(own["episode"], json!("The user asked \"What is 2+3?\" and was told \"5\"."));
    let error = call(&engine(&store, Some("  \n "), None), "r11", episode).await.unwrap_err();
    assert!(error.contains("empty"), "{error}");
}

#[test]
fn names_are_trimmed_collapsed_lowercased_and_stripped_of_control_characters() {
    assert_eq!(normalize_name("  Ada\t\tLOVELACE\n"), "ada lovelace");
    assert_eq!(normalize_name("a\u{0}b"), "a b");
    assert_eq!(normalize_name(&"x".repeat(200)).len(), 80);
}
