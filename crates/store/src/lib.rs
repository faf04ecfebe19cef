//! keel-store: backends of the [`keel_core::Store`] trait.
//!
//! - [`MemoryStore`]: everything in process memory; nothing survives the process. The default
//!   for `keel run`.
//!
//! Every backend must pass [`conformance`], the same tests for all.

pub mod conformance;
mod memory;

pub use memory::MemoryStore;
