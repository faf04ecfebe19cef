//! The OpenAPI document's `Event` schema against the events keel sends: clients (the TypeScript
//! client's types are generated from this document) can trust it.

use keel_core::human::{PendingInput, PendingKind};
use keel_core::wire::{event_to_json, event_type};
use keel_core::{ErrorCode, Event, RunId, SessionId, StopReason, Usage};
use serde_json::{Value, json};

use crate::routes::OPENAPI;

/// One event of every kind, some with their optional fields. The match below fails to compile
/// when an event kind is added, so that it is added here, and to the document, too.
fn every_event() -> Vec<Event> {
    let session = SessionId::new("s").unwrap();
    let pending = PendingInput {
        id: "ap_1".into(),
        run_id: RunId::from_suffix("1"),
        session_id: session.clone(),
        call_id: "c".into(),
        kind: PendingKind::Approval { tool: "shell".into(), input: json!({"command": "ls"}) },
        created_at_ms: 1,
        expires_at_ms: 2,
    };
    let events = vec![
        Event::RunStart { run_id: RunId::from_suffix("1"), session_id: session },
        Event::TurnStart { turn: 0 },
        Event::TextDelta { delta: "It".into() },
        Event::ReasoningDelta { delta: "Hmm".into() },
        Event::TurnRetry {
            turn: 1,
            attempt: 2,
            code: ErrorCode::ProviderOverloaded,
            message: "busy".into(),
            wait: std::time::Duration::from_millis(1500),
        },
        Event::ToolStart { call_id: "c".into(), name: "add".into(), input: json!({"a": 2}) },
        Event::ToolDone { call_id: "c".into(), output: json!(5), duration: None },
        Event::ToolDone {
            call_id: "c".into(),
            output: json!([1]),
            duration: Some(std::time::Duration::from_millis(3)),
        },
        Event::ToolError {
            call_id: "c".into(),
            code: keel_core::ErrorCode::ToolRefused,
            error: "boom".into(),
            duration: Some(std::time::Duration::ZERO),
        },
        Event::ApprovalRequested {
            approval_id: "ap_1".into(),
            call_id: "c".into(),
            tool: "shell".into(),
            input: json!({"command": "ls"}),
        },
        Event::QuestionAsked { question_id: "qu_1".into(), question: "Which city?".into() },
        Event::OutputRepair { attempt: 1, problem: "missing `answer`".into() },
        Event::ContextCompacted { summarized: 30, kept: 10 },
        Event::StateUpdated { state: json!({"cart": ["tea"]}) },
        Event::Usage(Usage { input_tokens: 1, output_tokens: 2 }),
        Event::RunDone {
            text: "5".into(),
            output: None,
            stopped: StopReason::Final,
            usage: Usage::default(),
        },
        Event::RunDone {
            text: "{}".into(),
            output: Some(json!({"a": 1})),
            stopped: StopReason::Cancelled,
            usage: Usage::default(),
        },
        Event::RunPaused { pending: vec![pending], usage: Usage { input_tokens: 3, output_tokens: 4 } },
        Event::RunError { code: ErrorCode::ProviderError, message: "upstream failed".into() },
    ];
    for event in &events {
        match event {
            Event::RunStart { .. }
            | Event::TurnStart { .. }
            | Event::TextDelta { .. }
            | Event::ReasoningDelta { .. }
            | Event::TurnRetry { .. }
            | Event::ToolStart { .. }
            | Event::ToolDone { .. }
            | Event::ToolError { .. }
            | Event::ApprovalRequested { .. }
            | Event::QuestionAsked { .. }
            | Event::OutputRepair { .. }
            | Event::ContextCompacted { .. }
            | Event::StateUpdated { .. }
            | Event::Usage(_)
            | Event::RunDone { .. }
            | Event::RunPaused { .. }
            | Event::RunError { .. } => {}
        }
    }
    events
}

#[test]
fn every_event_keel_sends_matches_the_documents_event_schema_and_names_its_kind() {
    let document: Value = serde_json::from_str(OPENAPI).unwrap();
    let schema = json!({ "$ref": "#/components/schemas/Event", "components": document["components"] });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let mapping = document["components"]["schemas"]["Event"]["discriminator"]["mapping"].as_object().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for event in every_event() {
        let json: Value = serde_json::from_str(&event_to_json(&event)).unwrap();
        let errors: Vec<String> = validator.iter_errors(&json).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{json} does not match the document: {errors:?}");
        // Exactly one variant holds it (`oneOf`), the one its type names.
        let kind = event_type(&event);
        assert_eq!(json["type"], kind);
        let variant = mapping[kind].as_str().unwrap().rsplit('/').next().unwrap();
        let one = json!({ "$ref": format!("#/components/schemas/{variant}"), "components": document["components"] });
        assert!(jsonschema::validator_for(&one).unwrap().is_valid(&json), "{json} is not a {variant}");
        seen.insert(kind);
    }
    let documented: std::collections::BTreeSet<&str> = mapping.keys().map(String::as_str).collect();
    assert_eq!(seen, documented, "the document's event kinds are keel's");
    // A wrong shape is refused: the schema can fail.
    for wrong in [
        json!({"type": "tool.done", "output": 1}),
        json!({"type": "run.done", "text": "x", "stopped": "nope", "usage": {"inputTokens": 0, "outputTokens": 0}}),
        json!({"type": "bogus"}),
    ] {
        assert!(!validator.is_valid(&wrong), "{wrong} passed");
    }
}
