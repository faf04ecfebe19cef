//! What this build of keel was compiled with: its optional capabilities, each a cargo feature
//! (all on by default; `Cargo.toml` of the `keel` crate lists them). `keel --version` prints
//! them, and the spec loader refuses an agent that needs one this build lacks.

/// Each optional capability: its cargo feature, and whether this build has it.
pub const FEATURES: &[(&str, bool)] = &[
    ("mcp", cfg!(feature = "mcp")),
    ("postgres", cfg!(feature = "postgres")),
    ("knowledge", cfg!(feature = "knowledge")),
    ("js", cfg!(feature = "js")),
    ("otlp", cfg!(feature = "otlp")),
];

/// The cargo feature this build lacks for a capability a spec may use (a built-in tool by name,
/// `mcp`, `knowledge`), or `None` when it has it. See [`keel_spec::LoadOptions::not_built`].
pub fn not_built(what: &str) -> Option<&'static str> {
    match what {
        "mcp" if !cfg!(feature = "mcp") => Some("mcp"),
        "knowledge" if !cfg!(feature = "knowledge") => Some("knowledge"),
        tool => keel_tools::not_built(tool),
    }
}

/// The features this build has, in [`FEATURES`] order (`mcp, postgres, ...`).
pub fn built() -> Vec<&'static str> {
    FEATURES.iter().filter(|(_, on)| *on).map(|(name, _)| *name).collect()
}
