//! `keel sessions list|show|rm`: look at and clean up a store's sessions.

use std::io::Write;

use keel::{ErrorCode, Part, Role, SessionId, Store};
use keel_core::message::output_to_text;

use super::{SessionsCommand, StoreArgs, exit};

pub(crate) fn sessions(command: SessionsCommand) -> std::io::Result<u8> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match command {
            SessionsCommand::List(store) => list(&store).await,
            SessionsCommand::Show { id, json, store } => show(&id, json, &store).await,
            SessionsCommand::Rm { id, store } => remove(&id, &store).await,
            SessionsCommand::Prune { older_than, compact, dry_run, store } => {
                prune(older_than, compact, dry_run, &store).await
            }
        }
    })
}

/// Opens the store, or prints why not.
fn open(args: &StoreArgs) -> std::io::Result<Result<std::sync::Arc<dyn Store>, u8>> {
    match keel_store::open(&args.store) {
        Ok(store) => Ok(Ok(store)),
        Err(error) => {
            writeln!(std::io::stderr(), "error[{}]: {error}", error.code())?;
            Ok(Err(exit::INVALID_AGENT))
        }
    }
}

fn session_id(id: &str) -> std::io::Result<Result<SessionId, u8>> {
    match SessionId::new(id) {
        Ok(id) => Ok(Ok(id)),
        Err(failure) => {
            writeln!(std::io::stderr(), "error[{}]: {}", failure.code, failure.message)?;
            Ok(Err(2))
        }
    }
}

fn store_error(error: &keel::StoreError) -> std::io::Result<u8> {
    writeln!(std::io::stderr(), "error[{}]: {error}", error.code())?;
    Ok(exit::RUN_FAILED)
}

async fn list(args: &StoreArgs) -> std::io::Result<u8> {
    let store = match open(args)? {
        Ok(store) => store,
        Err(code) => return Ok(code),
    };
    let sessions = match store.list_sessions().await {
        Ok(sessions) => sessions,
        Err(error) => return store_error(&error),
    };
    let mut out = std::io::stdout().lock();
    if sessions.is_empty() {
        writeln!(std::io::stderr(), "no sessions in {}", args.store)?;
        return Ok(exit::OK);
    }
    writeln!(out, "{:<40} {:>8} {:>5}  updated (UTC)", "session", "messages", "runs")?;
    for session in sessions {
        let updated = jiff::Timestamp::from_millisecond(session.updated_at_ms as i64)
            .map(|t| t.strftime("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_default();
        writeln!(out, "{:<40} {:>8} {:>5}  {updated}", session.id, session.messages, session.runs)?;
    }
    Ok(exit::OK)
}

async fn show(id: &str, json: bool, args: &StoreArgs) -> std::io::Result<u8> {
    let id = match session_id(id)? {
        Ok(id) => id,
        Err(code) => return Ok(code),
    };
    let store = match open(args)? {
        Ok(store) => store,
        Err(code) => return Ok(code),
    };
    let messages = match store.load_messages(&id).await {
        Ok(messages) => messages,
        Err(error) => return store_error(&error),
    };
    if messages.is_empty() {
        writeln!(
            std::io::stderr(),
            "error[{}]: no session {id} in {}",
            ErrorCode::SessionNotFound,
            args.store
        )?;
        return Ok(exit::INVALID_AGENT);
    }
    let mut out = std::io::stdout().lock();
    for message in messages {
        if json {
            writeln!(out, "{}", keel_core::persist::encode_message(&message))?;
            continue;
        }
        let who = match message.role {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        };
        for part in &message.parts {
            match part {
                Part::Text(text) => writeln!(out, "{who}: {text}")?,
                Part::Image { media_type, data } => {
                    writeln!(out, "{who}: [image {media_type}, {} bytes]", data.len())?
                }
                Part::File { media_type, name, data } => writeln!(
                    out,
                    "{who}: [file {} {media_type}, {} bytes]",
                    name.as_deref().unwrap_or("(unnamed)"),
                    data.len()
                )?,
                Part::ToolCall(call) => {
                    writeln!(out, "{who}: → {} {} [{}]", call.name, call.input, call.call_id)?
                }
                Part::ToolResult(result) => {
                    let mark = if result.is_error { "✗" } else { "✓" };
                    writeln!(
                        out,
                        "{who}: {mark} {} {} [{}]",
                        result.name,
                        output_to_text(&result.output),
                        result.call_id
                    )?;
                }
            }
        }
    }
    Ok(exit::OK)
}

async fn remove(id: &str, args: &StoreArgs) -> std::io::Result<u8> {
    let id = match session_id(id)? {
        Ok(id) => id,
        Err(code) => return Ok(code),
    };
    let store = match open(args)? {
        Ok(store) => store,
        Err(code) => return Ok(code),
    };
    match store.delete_session(&id).await {
        Ok(true) => {
            writeln!(std::io::stdout(), "removed session {id}")?;
            Ok(exit::OK)
        }
        Ok(false) => {
            writeln!(
                std::io::stderr(),
                "error[{}]: no session {id} in {}",
                ErrorCode::SessionNotFound,
                args.store
            )?;
            Ok(exit::INVALID_AGENT)
        }
        Err(error) => store_error(&error),
    }
}

async fn prune(
    older_than: Option<std::time::Duration>,
    compact: bool,
    dry_run: bool,
    args: &StoreArgs,
) -> std::io::Result<u8> {
    let store = match open(args)? {
        Ok(store) => store,
        Err(code) => return Ok(code),
    };
    if let Some(older_than) = older_than {
        let code = expire(&*store, older_than, dry_run).await?;
        if code != exit::OK {
            return Ok(code);
        }
    }
    if compact && !dry_run {
        match store.compact_journals().await {
            Ok(removed) => {
                writeln!(std::io::stderr(), "compacted: {removed} journal entries of finished runs removed")?
            }
            Err(error) => return store_error(&error),
        }
    }
    Ok(exit::OK)
}

/// Removes the sessions unused for longer than `older_than`.
async fn expire(store: &dyn Store, older_than: std::time::Duration, dry_run: bool) -> std::io::Result<u8> {
    let sessions = match store.list_sessions().await {
        Ok(sessions) => sessions,
        Err(error) => return store_error(&error),
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let cutoff = now_ms.saturating_sub(u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX));
    let mut out = std::io::stdout().lock();
    let mut removed = 0;
    for session in sessions.iter().filter(|s| s.updated_at_ms < cutoff) {
        if !dry_run && let Err(error) = store.delete_session(&session.id).await {
            return store_error(&error);
        }
        writeln!(out, "{} {}", if dry_run { "would remove" } else { "removed" }, session.id)?;
        removed += 1;
    }
    writeln!(
        std::io::stderr(),
        "{removed} of {} sessions {} (unused for more than {})",
        sessions.len(),
        if dry_run { "would be removed" } else { "removed" },
        humantime::format_duration(older_than)
    )?;
    Ok(exit::OK)
}
