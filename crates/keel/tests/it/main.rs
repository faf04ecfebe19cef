//! End-to-end tests: the `keel` binary (`cli`) and the Rust API (`api`).

mod ai_sdk;
mod api;
mod approvals;
mod build;
mod channels;
mod cli;
mod durability;
mod instances;
mod loop_control;
mod mcp;
mod memory;
mod model;
mod one_run;
mod openai;
mod providers;
mod security;
mod semantic;
mod serve;
mod snapshots;
mod support;
mod telemetry;
mod testing;
mod tidy;
mod tools;
mod triggers;
mod tutorial;
