//! A calculator agent defined in Rust: a typed tool from a plain async function, run offline
//! with the mock model. Run it with `cargo run -p keel --example calculator`.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "an example program prints")]

use futures::StreamExt;
use keel::{Agent, Event, MockEntry, MockScript, MockToolCall};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// The input of the `add` tool; its JSON Schema is derived for the model.
#[derive(Deserialize, JsonSchema)]
struct AddInput {
    /// The first number.
    a: f64,
    /// The second number.
    b: f64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let add = keel::function_tool("add", "Adds two numbers", |input: AddInput| async move {
        Ok::<_, std::convert::Infallible>(input.a + input.b)
    });
    // What the mock model does: call `add`, then answer with its output. Replace `.model("mock")`
    // and the script with a real model to use a provider.
    let script = MockScript::new(vec![
        MockEntry {
            tool_calls: vec![MockToolCall { name: "add".into(), input: json!({"a": 2, "b": 3}) }],
            ..MockEntry::default()
        },
        MockEntry { text: Some("2 + 3 = {{last_tool_output}}".into()), ..MockEntry::default() },
    ]);
    let agent = Agent::builder()
        .name("calculator")
        .instructions("You add numbers. Always use the add tool.")
        .model("mock")
        .mock_script(script)
        .tool(add)
        .build()?;

    let mut run = agent.run("example", "What is 2 + 3?")?;
    while let Some(event) = run.next().await {
        match event {
            Event::ToolStart { name, input, .. } => eprintln!("→ {name} {input}"),
            Event::ToolDone { output, .. } => eprintln!("✓ {output}"),
            Event::TextDelta { delta } => print!("{delta}"),
            _ => {}
        }
    }
    let result = run.result().await?;
    println!();
    eprintln!("stopped: {:?}, tokens: {}", result.stopped, result.usage.total());
    Ok(())
}
