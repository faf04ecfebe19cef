//! `keel memory list|show|rm`: what agents remember about their owners, and forgetting it.

use std::io::Write;

use keel::{ErrorCode, Store};

use super::{MemoryCommand, StoreArgs, exit};

pub(crate) fn memory(command: MemoryCommand) -> std::io::Result<u8> {
    super::run_async(async {
        match command {
            MemoryCommand::List { json, store } => list(json, &store).await,
            MemoryCommand::Show { owner, kind, json, store } => {
                show(&owner, kind.as_deref(), json, &store).await
            }
            MemoryCommand::Rm { owner, kind, key, store } => {
                remove(&owner, kind.as_deref(), key.as_deref(), &store).await
            }
        }
    })?
}

/// Prints a coded error; returns `code`.
fn fail(code: u8, error_code: ErrorCode, message: impl std::fmt::Display) -> std::io::Result<u8> {
    writeln!(std::io::stderr(), "error[{error_code}]: {message}")?;
    Ok(code)
}

/// The owner an argument names: `session:<id>` and `user:<scope>` as they are, `sub:<subject>`
/// as the scope `keel serve` gives that JWT subject.
fn owner(argument: &str) -> Result<String, String> {
    if let Some(subject) = argument.strip_prefix("sub:") {
        return Ok(format!("user:{}", keel_server::subject_scope(subject)));
    }
    if argument
        .strip_prefix("session:")
        .or_else(|| argument.strip_prefix("user:"))
        .is_some_and(|rest| !rest.is_empty())
    {
        return Ok(argument.to_owned());
    }
    Err(format!(
        "{argument:?} names no owner: write `session:<id>`, `user:<scope>` (as `keel memory list` prints it) or `sub:<JWT subject>`"
    ))
}

fn check_kind(kind: Option<&str>) -> Result<(), String> {
    match kind {
        None | Some(keel_memory::EPISODE | keel_memory::ENTITY | keel_memory::RELATION) => Ok(()),
        Some(other) => Err(format!("unknown memory kind {other:?}: use episode, entity or relation")),
    }
}

fn open(args: &StoreArgs) -> Result<std::sync::Arc<dyn Store>, std::io::Result<u8>> {
    keel_store::open_existing(&args.store).map_err(|error| fail(exit::INVALID_AGENT, error.code(), &error))
}

fn when(ms: u64) -> String {
    keel_core::clock::rfc3339(ms)
}

async fn list(json: bool, args: &StoreArgs) -> std::io::Result<u8> {
    let store = match open(args) {
        Ok(store) => store,
        Err(code) => return code,
    };
    let owners = match store.memory_owners().await {
        Ok(owners) => owners,
        Err(error) => return fail(exit::RUN_FAILED, error.code(), error),
    };
    let mut out = std::io::stdout().lock();
    if json {
        for owner in &owners {
            let count = |kind: &str| owner.counts.iter().find(|(k, _)| k == kind).map_or(0, |(_, n)| *n);
            let line = serde_json::json!({
                "owner": owner.owner,
                "episodes": count(keel_memory::EPISODE),
                "entities": count(keel_memory::ENTITY),
                "relations": count(keel_memory::RELATION),
                "updatedAtMs": owner.updated_ms,
            });
            writeln!(out, "{line}")?;
        }
        return Ok(exit::OK);
    }
    if owners.is_empty() {
        writeln!(std::io::stderr(), "no memory in {}", args.store)?;
        return Ok(exit::OK);
    }
    writeln!(out, "{:<48} {:>8} {:>8} {:>9}  updated (UTC)", "owner", "episodes", "entities", "relations")?;
    for owner in owners {
        let count = |kind: &str| owner.counts.iter().find(|(k, _)| k == kind).map_or(0, |(_, n)| *n);
        writeln!(
            out,
            "{:<48} {:>8} {:>8} {:>9}  {}",
            owner.owner,
            count(keel_memory::EPISODE),
            count(keel_memory::ENTITY),
            count(keel_memory::RELATION),
            when(owner.updated_ms)
        )?;
    }
    Ok(exit::OK)
}

/// The owner and kind the arguments name, and the store: or the exit code, once the problem
/// is printed.
fn target(
    argument: &str,
    kind: Option<&str>,
    args: &StoreArgs,
) -> Result<(String, std::sync::Arc<dyn Store>), std::io::Result<u8>> {
    let owner = owner(argument)
        .and_then(|owner| check_kind(kind).map(|()| owner))
        .map_err(|problem| fail(2, ErrorCode::RequestInvalid, problem))?;
    Ok((owner, open(args)?))
}

async fn show(argument: &str, kind: Option<&str>, json: bool, args: &StoreArgs) -> std::io::Result<u8> {
    let (owner, store) = match target(argument, kind, args) {
        Ok(target) => target,
        Err(code) => return code,
    };
    let items = match store.load_memory(&owner, kind).await {
        Ok(items) => items,
        Err(error) => return fail(exit::RUN_FAILED, error.code(), error),
    };
    if items.is_empty() {
        writeln!(std::io::stderr(), "{owner} has no memory in {}", args.store)?;
        return Ok(exit::OK);
    }
    let mut out = std::io::stdout().lock();
    for item in items {
        if json {
            let line = serde_json::json!({
                "kind": item.kind, "key": item.key, "value": item.value, "updated": when(item.updated_ms),
            });
            writeln!(out, "{line}")?;
            continue;
        }
        let text = match item.kind.as_str() {
            keel_memory::EPISODE => {
                item.value.get("text").and_then(|t| t.as_str()).unwrap_or_default().to_owned()
            }
            keel_memory::RELATION => format!(
                "confidence {}",
                item.value.get("confidence").and_then(serde_json::Value::as_f64).unwrap_or_default()
            ),
            _ => {
                item.value.get("type").and_then(|t| t.as_str()).map(|t| format!("({t})")).unwrap_or_default()
            }
        };
        writeln!(out, "{:<8} {}  {}  {text}", item.kind, when(item.updated_ms), item.key)?;
    }
    Ok(exit::OK)
}

async fn remove(
    argument: &str,
    kind: Option<&str>,
    key: Option<&str>,
    args: &StoreArgs,
) -> std::io::Result<u8> {
    let owner = match owner(argument).and_then(|owner| check_kind(kind).map(|()| owner)) {
        Ok(owner) => owner,
        Err(problem) => return fail(2, ErrorCode::RequestInvalid, problem),
    };
    let store = match open(args) {
        Ok(store) => store,
        Err(code) => return code,
    };
    match store.forget(&owner, kind, key).await {
        Ok(0) => fail(
            exit::INVALID_AGENT,
            ErrorCode::MemoryNotFound,
            format!("{owner} has no such memory in {}", args.store),
        ),
        Ok(erased) => {
            writeln!(std::io::stderr(), "erased {erased} record(s) of {owner}")?;
            Ok(exit::OK)
        }
        Err(error) => fail(exit::RUN_FAILED, error.code(), error),
    }
}
