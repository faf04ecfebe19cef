//! Tools from plain async Rust functions.
//!
//! The input type's JSON Schema is derived by schemars, so the model sees exactly what the
//! function accepts, and the runtime validates the model's input against it before the call.
//! Nested types are written out where they are used (a recursive type keeps a `$ref` to
//! itself), so the schema reads the same to a provider that does not follow references.
//!
//! ```
//! use keel_core::Tool as _;
//! use schemars::JsonSchema;
//! use serde::Deserialize;
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct AddInput {
//!     /// The first number.
//!     a: f64,
//!     /// The second number.
//!     b: f64,
//! }
//!
//! let add = keel_tools::function_tool("add", "Adds two numbers", |input: AddInput| async move {
//!     Ok::<_, std::convert::Infallible>(input.a + input.b)
//! });
//! assert_eq!(add.spec().input_schema["required"], serde_json::json!(["a", "b"]));
//! ```

use std::fmt::Display;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use keel_core::{BoxFuture, ErrorCode, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Makes a tool from an async function of its input.
///
/// The function's error is shown to the model as the tool's error.
pub fn function_tool<I, O, E, F, Fut>(name: &str, description: &str, function: F) -> Arc<FunctionTool<I, F>>
where
    I: DeserializeOwned + JsonSchema + Send + 'static,
    O: Serialize,
    E: Display,
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
{
    Arc::new(FunctionTool { spec: spec_for::<I>(name, description), function, input: PhantomData })
}

/// Makes a tool from an async function of its input and the call's [`ToolContext`] (for the
/// idempotency key, the run and the session).
pub fn function_tool_with_context<I, O, E, F, Fut>(
    name: &str,
    description: &str,
    function: F,
) -> Arc<FunctionTool<I, WithContext<F>>>
where
    I: DeserializeOwned + JsonSchema + Send + 'static,
    O: Serialize,
    E: Display,
    F: Fn(I, ToolContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
{
    Arc::new(FunctionTool {
        spec: spec_for::<I>(name, description),
        function: WithContext(function),
        input: PhantomData,
    })
}

fn spec_for<I: JsonSchema>(name: &str, description: &str) -> ToolSpec {
    // Nested types written where they are used, not as `$defs` behind `$ref`s (a recursive
    // type keeps its `$ref`): not every provider follows references. Providers want a bare
    // object schema: no `$schema`.
    let generator = SchemaSettings::draft2020_12()
        .with(|settings| {
            settings.meta_schema = None;
            settings.inline_subschemas = true;
        })
        .into_generator();
    let mut schema = serde_json::to_value(generator.into_root_schema_for::<I>()).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut schema {
        // The type's name: noise to the model, which has the tool's.
        map.remove("title");
    }
    ToolSpec { name: name.to_owned(), description: description.to_owned(), input_schema: schema }
}

/// A tool made from a function. See [`function_tool`].
pub struct FunctionTool<I, F> {
    spec: ToolSpec,
    function: F,
    input: PhantomData<fn() -> I>,
}

/// Marks a function that also takes the [`ToolContext`].
pub struct WithContext<F>(F);

/// How a [`FunctionTool`] invokes its function; implemented for plain functions and for
/// [`WithContext`].
pub trait Invoke<I>: Send + Sync {
    /// Calls the function.
    fn invoke(&self, input: I, ctx: &ToolContext) -> BoxFuture<'static, ToolOutcome>;
}

fn finish<O: Serialize, E: Display>(result: Result<O, E>) -> ToolOutcome {
    match result {
        Ok(output) => serde_json::to_value(output)
            .map_err(|e| ToolError::failed(format!("the tool's output is not JSON-serializable: {e}"))),
        Err(error) => Err(ToolError::failed(error.to_string())),
    }
}

impl<I, O, E, F, Fut> Invoke<I> for F
where
    O: Serialize,
    E: Display,
    F: Fn(I) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
{
    fn invoke(&self, input: I, _ctx: &ToolContext) -> BoxFuture<'static, ToolOutcome> {
        let future = self(input);
        Box::pin(async move { finish(future.await) })
    }
}

impl<I, O, E, F, Fut> Invoke<I> for WithContext<F>
where
    O: Serialize,
    E: Display,
    F: Fn(I, ToolContext) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
{
    fn invoke(&self, input: I, ctx: &ToolContext) -> BoxFuture<'static, ToolOutcome> {
        let future = (self.0)(input, ctx.clone());
        Box::pin(async move { finish(future.await) })
    }
}

impl<I, F> Tool for FunctionTool<I, F>
where
    I: DeserializeOwned + Send + 'static,
    F: Invoke<I>,
{
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        match serde_json::from_value::<I>(input) {
            Ok(input) => self.function.invoke(input, ctx),
            Err(error) => Box::pin(std::future::ready(Err(ToolError::with_code(
                ErrorCode::ToolInputInvalid,
                format!("invalid input for `{}`: {error}", self.spec.name),
                false,
            )))),
        }
    }
}
