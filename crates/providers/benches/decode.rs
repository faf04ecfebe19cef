//! Stream decoding: how fast the providers' decoders turn a streamed body into a reply, and how
//! many heap allocations each text delta costs.
//!
//! Workloads (built in memory, fed in 1,400-byte pieces like TCP segments, no network):
//! - `openai`: 100,000 `chat.completion.chunk` events of one short word each, with the fields
//!   OpenAI sends (id, object, created, model, system_fingerprint, logprobs), then usage and
//!   `[DONE]`;
//! - `anthropic`: 100,000 `content_block_delta` / `text_delta` events;
//! - `ollama`: 100,000 NDJSON lines;
//! - `openai-tool-args`: one tool call whose arguments come in 100,000 fragments.
//!
//! Reports, per workload, the median of 7 passes: MB/s of body, deltas per second, and heap
//! allocations per delta (counted by a wrapping allocator, the sink's own work excluded: it
//! only counts bytes). Run with `cargo bench -p keel-providers --bench decode`.
#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![allow(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use keel_core::DeltaSink;
use keel_providers::anthropic::MessagesStream;
use keel_providers::ollama::ChatLines;
use keel_providers::openai::ChatStream;

/// The system allocator, counting allocations.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

#[allow(unsafe_code, reason = "a global allocator wrapper is unsafe by definition")]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwards to the system allocator with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwards to the system allocator; `ptr` came from it with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const DELTAS: usize = 100_000;
const PIECE: usize = 1_400;
const WORDS: &[&str] = &["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."];

struct CountingSink {
    bytes: usize,
}

impl DeltaSink for CountingSink {
    fn text_delta(&mut self, delta: &str) {
        self.bytes += delta.len();
    }
}

fn openai_body() -> Vec<u8> {
    let mut body = String::new();
    for i in 0..DELTAS {
        body.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG\",\"object\":\"chat.completion.chunk\",\"created\":1741570283,\"model\":\"gpt-4o-2024-08-06\",\"system_fingerprint\":\"fp_fc9f1d7035\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n",
            WORDS[i % WORDS.len()]
        ));
    }
    body.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
    body.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":100000}}\n\ndata: [DONE]\n\n");
    body.into_bytes()
}

fn openai_tool_args_body() -> Vec<u8> {
    let mut body = String::from(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"write\",\"arguments\":\"{\\\"text\\\": \\\"\"}}]}}]}\n\n",
    );
    for i in 0..DELTAS {
        body.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":\"{}\"}}}}]}}}}]}}\n\n",
            WORDS[i % WORDS.len()]
        ));
    }
    body.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n");
    body.into_bytes()
}

fn anthropic_body() -> Vec<u8> {
    let mut body = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n\
         event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    );
    for i in 0..DELTAS {
        body.push_str(&format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{}\"}}}}\n\n",
            WORDS[i % WORDS.len()]
        ));
    }
    body.push_str("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n");
    body.push_str("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":100000}}\n\n");
    body.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    body.into_bytes()
}

fn ollama_body() -> Vec<u8> {
    let mut body = String::new();
    for i in 0..DELTAS {
        body.push_str(&format!(
            "{{\"model\":\"llama3.2\",\"created_at\":\"2025-01-24T15:41:02.511932Z\",\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"done\":false}}\n",
            WORDS[i % WORDS.len()]
        ));
    }
    body.push_str("{\"model\":\"llama3.2\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"prompt_eval_count\":10,\"eval_count\":100000}\n");
    body.into_bytes()
}

/// One pass: (seconds, allocations).
fn pass(name: &str, body: &[u8]) -> (f64, usize) {
    let mut sink = CountingSink { bytes: 0 };
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let start = Instant::now();
    let reply = match name {
        "openai" | "openai-tool-args" => {
            let mut decoder = ChatStream::new("openai");
            for piece in body.chunks(PIECE) {
                decoder.feed(piece, &mut sink).unwrap();
            }
            decoder.finish(&mut sink).unwrap()
        }
        "anthropic" => {
            let mut decoder = MessagesStream::new();
            for piece in body.chunks(PIECE) {
                decoder.feed(piece, &mut sink).unwrap();
            }
            decoder.finish(&mut sink).unwrap()
        }
        "ollama" => {
            let mut decoder = ChatLines::new();
            for piece in body.chunks(PIECE) {
                decoder.feed(piece, &mut sink).unwrap();
            }
            decoder.finish(&mut sink).unwrap()
        }
        other => unreachable!("{other}"),
    };
    let seconds = start.elapsed().as_secs_f64();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert!(!reply.parts.is_empty());
    std::hint::black_box(reply);
    (seconds, allocations)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let passes = if quick { 1 } else { 7 };
    println!("stream decoding, {DELTAS} deltas per stream, {PIECE}-byte pieces, median of {passes} passes");
    println!(
        "{:<18} {:>10} {:>10} {:>14} {:>16} {:>18}",
        "workload", "body MB", "MB/s", "deltas/s", "allocs/delta", "vs 1000 tok/s"
    );
    let workloads = [
        ("openai", openai_body()),
        ("anthropic", anthropic_body()),
        ("ollama", ollama_body()),
        ("openai-tool-args", openai_tool_args_body()),
    ];
    for (name, body) in &workloads {
        let mut seconds = Vec::new();
        let mut allocations = Vec::new();
        for _ in 0..passes {
            let (s, a) = pass(name, body);
            seconds.push(s);
            allocations.push(a as f64);
        }
        let s = median(seconds);
        let mb = body.len() as f64 / 1e6;
        let per_second = DELTAS as f64 / s;
        println!(
            "{name:<18} {mb:>10.1} {:>10.0} {per_second:>14.0} {:>16.2} {:>17.0}x",
            mb / s,
            median(allocations) / DELTAS as f64,
            per_second / 1000.0
        );
    }
}
