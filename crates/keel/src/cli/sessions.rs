//! `keel sessions list|show|rm|prune`: look at and clean up a store's sessions.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use keel::{ErrorCode, Part, Role, SessionId, Store, StoreError};
use keel_core::message::output_to_text;

use super::{SessionsCommand, StoreArgs, exit};

/// Why a command stops early: an exit code (the reason was already printed), or an I/O error.
enum Stop {
    Exit(u8),
    Io(std::io::Error),
}

impl From<std::io::Error> for Stop {
    fn from(error: std::io::Error) -> Stop {
        Stop::Io(error)
    }
}

type Outcome<T = u8> = Result<T, Stop>;

/// Prints a coded error and stops with `code`.
fn fail(code: u8, error_code: ErrorCode, message: impl std::fmt::Display) -> Stop {
    match writeln!(std::io::stderr(), "error[{error_code}]: {message}") {
        Ok(()) => Stop::Exit(code),
        Err(error) => Stop::Io(error),
    }
}

fn store_failed(error: &StoreError) -> Stop {
    fail(exit::RUN_FAILED, error.code(), error)
}

pub(crate) fn sessions(command: SessionsCommand) -> std::io::Result<u8> {
    let outcome = super::run_async(async {
        match command {
            SessionsCommand::List { json, store } => list(json, &store).await,
            SessionsCommand::Show { id, json, store } => show(&id, json, &store).await,
            SessionsCommand::Rm { id, store } => remove(&id, &store).await,
            SessionsCommand::Prune { older_than, compact, dry_run, store } => {
                prune(older_than, compact, dry_run, &store).await
            }
        }
    })?;
    match outcome {
        Ok(code) | Err(Stop::Exit(code)) => Ok(code),
        Err(Stop::Io(error)) => Err(error),
    }
}

fn open(args: &StoreArgs) -> Outcome<Arc<dyn Store>> {
    keel_store::open_existing(&args.store).map_err(|error| fail(exit::INVALID_AGENT, error.code(), &error))
}

/// A session id as `keel sessions list` prints it: a client's id, or one scoped to a JWT
/// subject by `keel serve` (`<digest>~<id>`).
fn session_id(id: &str) -> Outcome<SessionId> {
    SessionId::from_store(id).map_err(|failure| fail(2, failure.code, failure.message))
}

fn no_session(id: &SessionId, args: &StoreArgs) -> Stop {
    fail(exit::INVALID_AGENT, ErrorCode::SessionNotFound, format!("no session {id} in {}", args.store))
}

async fn list(json: bool, args: &StoreArgs) -> Outcome {
    let store = open(args)?;
    let sessions =
        store.list_sessions(keel_core::SessionFilter::default()).await.map_err(|e| store_failed(&e))?;
    if json {
        let mut out = std::io::stdout().lock();
        for session in &sessions {
            writeln!(out, "{}", keel_core::wire::session_summary_to_json(session))?;
        }
        return Ok(exit::OK);
    }
    if sessions.is_empty() {
        writeln!(std::io::stderr(), "no sessions in {}", args.store)?;
        return Ok(exit::OK);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<40} {:>8} {:>5} {:>10} {:>10}  updated (UTC)",
        "session", "messages", "runs", "tokens in", "out"
    )?;
    for session in sessions {
        let updated = jiff::Timestamp::from_millisecond(session.updated_at_ms as i64)
            .map(|t| t.strftime("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_default();
        writeln!(
            out,
            "{:<40} {:>8} {:>5} {:>10} {:>10}  {updated}",
            session.id,
            session.messages,
            session.runs,
            session.usage.input_tokens,
            session.usage.output_tokens
        )?;
    }
    Ok(exit::OK)
}

async fn show(id: &str, json: bool, args: &StoreArgs) -> Outcome {
    let id = session_id(id)?;
    let store = open(args)?;
    let messages = store.load_messages(&id).await.map_err(|e| store_failed(&e))?;
    if messages.is_empty() {
        return Err(no_session(&id, args));
    }
    let mut out = std::io::stdout().lock();
    if json {
        // The shape of `GET /chat/:id`: one document, messages and pending inputs in it.
        let pending = store.pending_inputs(Some(&id)).await.map_err(|e| store_failed(&e))?;
        let usage = store
            .session_summary(&id)
            .await
            .map_err(|e| store_failed(&e))?
            .map(|s| s.usage)
            .unwrap_or_default();
        let body = keel_core::wire::transcript_to_json(
            id.external(),
            usage,
            messages.iter().map(|m| &**m),
            &pending,
        );
        writeln!(out, "{body}")?;
        return Ok(exit::OK);
    }
    for message in messages {
        let who = match message.role {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        };
        for part in &message.parts {
            match part {
                Part::Text(text) => writeln!(out, "{who}: {text}")?,
                Part::Image { media_type, data } => {
                    writeln!(out, "{who}: [image {media_type}, {} bytes]", data.len())?;
                }
                Part::File { media_type, name, data } => writeln!(
                    out,
                    "{who}: [file {} {media_type}, {} bytes]",
                    name.as_deref().unwrap_or("(unnamed)"),
                    data.len()
                )?,
                Part::Reasoning(reasoning) => writeln!(out, "{who}: (thinking) {}", reasoning.text)?,
                Part::Summary { text, first_kept } => {
                    writeln!(out, "(brief of the conversation before message {first_kept}) {text}")?
                }
                Part::ToolCall(call) => {
                    writeln!(out, "{who}: → {} {} [{}]", call.name, call.input, call.call_id)?
                }
                Part::ToolResult(result) => {
                    let mark = if result.is_error { "✗" } else { "✓" };
                    let output = output_to_text(&result.output);
                    writeln!(out, "{who}: {mark} {} {output} [{}]", result.name, result.call_id)?;
                }
            }
        }
    }
    if !json && let Some(state) = store.load_session_state(&id).await.map_err(|e| store_failed(&e))? {
        writeln!(out, "state: {state}")?;
    }
    if !json && let Some(summary) = store.session_summary(&id).await.map_err(|e| store_failed(&e))? {
        let usage = summary.usage;
        writeln!(out, "usage: {} input tokens, {} output tokens", usage.input_tokens, usage.output_tokens)?;
    }
    Ok(exit::OK)
}

async fn remove(id: &str, args: &StoreArgs) -> Outcome {
    let id = session_id(id)?;
    let store = open(args)?;
    if !store.delete_session(&id).await.map_err(|e| store_failed(&e))? {
        return Err(no_session(&id, args));
    }
    writeln!(std::io::stdout(), "removed session {id}")?;
    Ok(exit::OK)
}

async fn prune(older_than: Option<Duration>, compact: bool, dry_run: bool, args: &StoreArgs) -> Outcome {
    let store = open(args)?;
    if let Some(older_than) = older_than {
        expire(&*store, older_than, dry_run).await?;
    }
    if compact && !dry_run {
        let removed = store.compact_journals().await.map_err(|e| store_failed(&e))?;
        writeln!(std::io::stderr(), "compacted: {removed} journal entries of finished runs removed")?;
    }
    Ok(exit::OK)
}

/// Removes the sessions unused for longer than `older_than` (lists them with `dry_run`).
async fn expire(store: &dyn Store, older_than: Duration, dry_run: bool) -> Outcome<()> {
    let sessions =
        store.list_sessions(keel_core::SessionFilter::default()).await.map_err(|e| store_failed(&e))?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let cutoff = now_ms.saturating_sub(u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX));
    let mut out = std::io::stdout().lock();
    let mut removed = 0;
    for session in sessions.iter().filter(|s| s.updated_at_ms < cutoff) {
        if !dry_run {
            store.delete_session(&session.id).await.map_err(|e| store_failed(&e))?;
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
    Ok(())
}
