//! `/runs`: delayed runs (DESIGN.md §8). `POST /runs` stores a run that starts later, `GET
//! /runs/:id` says where a run is (delayed or not), `DELETE /runs/:id` cancels a delayed run
//! that has not started: it is gone then (`404`, saying who cancelled it), as a deleted
//! resource is. The server's trigger loop starts them when they are due, whichever
//! instance sharing the store gets there first.

use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_core::{DelayedRun, DelayedRunRecord, DelayedState, ErrorCode, RunId, SessionId};
use serde_json::{Value, json};

use keel_core::clock::rfc3339;

use crate::AppState;
use crate::auth::Identity;
use crate::error::ApiError;
use crate::routes::{JsonBody, json_type, parse_input, require_object, string_field};

/// `POST /runs`: `{sessionId, input, at | after}` → `202 {runId, sessionId, at, state}`.
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    require_object(&body)?;
    let session =
        string_field(&body, "sessionId")?.ok_or_else(|| ApiError::invalid("missing `sessionId`"))?;
    let session = identity.session(SessionId::new(session)?);
    let input = body.get("input").filter(|v| !v.is_null());
    let input =
        parse_input(input.ok_or_else(|| ApiError::invalid("missing `input` (a string or content parts)"))?)?;
    let at = string_field(&body, "at")?;
    let after = match body.get("after") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        // Whole seconds, also when written `90.0`.
        Some(Value::Number(seconds)) => match seconds.as_f64() {
            Some(seconds) if seconds >= 0.0 && seconds.fract() == 0.0 && seconds <= 1e12 => {
                Some(format!("{}s", seconds as u64))
            }
            _ => {
                return Err(ApiError::invalid(
                    "`after` must be a whole number of seconds or a duration such as 10m",
                ));
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "`after` must be a duration such as 10m (or seconds), not {}",
                json_type(other)
            )));
        }
    };
    let now = state.engine.clock().now_ms();
    let due_ms = keel_runtime::triggers::due_time(at, after.as_deref(), now).map_err(ApiError::invalid)?;
    let run = DelayedRun {
        run_id: keel_runtime::new_delayed_run_id(),
        session_id: session,
        input,
        due_ms,
        source: format!("POST /runs, {}", identity.describe()),
    };
    let record = state.engine.store().schedule_run(&run).await?;
    tracing::info!(run = %run.run_id, session = %run.session_id, at = %rfc3339(due_ms), "delayed run stored");
    Ok((StatusCode::ACCEPTED, axum::Json(delayed_json(&record))).into_response())
}

/// `GET /runs/:runId`: a delayed run (waiting, cancelled) or any run (its state).
pub(crate) async fn status(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let run = run_id(path)?;
    let store = state.engine.store();
    let delayed = store.delayed_run(&run).await?.filter(|record| owns(&identity, &record.run.session_id));
    let record = store.load_run(&run).await?.filter(|record| owns(&identity, &record.session_id));
    let body = match (delayed, record) {
        (delayed, Some(record)) => {
            let mut body = json!({
                "runId": run.as_str(),
                "sessionId": record.session_id.external(),
                "state": record.state.as_str(),
            });
            if let Some(delayed) = delayed {
                body["at"] = json!(rfc3339(delayed.run.due_ms));
            }
            body
        }
        // Cancelled before it started: there is no such run, and there never will be.
        (Some(delayed), None) if delayed.state == DelayedState::Cancelled => return Err(cancelled(&delayed)),
        (Some(delayed), None) => delayed_json(&delayed),
        (None, None) => return Err(not_found(&run)),
    };
    Ok(axum::Json(body).into_response())
}

/// `DELETE /runs/:runId`: cancels a delayed run that has not started.
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let run = run_id(path)?;
    let store = state.engine.store();
    // Someone else's run is not found, not forbidden: its existence is not told.
    match store.delayed_run(&run).await? {
        Some(record)
            if record.state == DelayedState::Cancelled && owns(&identity, &record.run.session_id) =>
        {
            return Err(cancelled(&record));
        }
        Some(record) if owns(&identity, &record.run.session_id) => {}
        _ => return Err(not_found(&run)),
    }
    let Some(record) = store.cancel_delayed_run(&run, &identity.describe()).await? else {
        return Err(not_found(&run));
    };
    match record.state {
        DelayedState::Started => Err(ApiError::new(
            ErrorCode::RunStarted,
            format!(
                "run {run} already started; cancel it as a run of session {}: DELETE /chat/{}/run",
                record.run.session_id.external(),
                record.run.session_id.external()
            ),
        )),
        DelayedState::Cancelled | DelayedState::Waiting => {
            tracing::info!(%run, by = %identity.describe(), "delayed run cancelled");
            Ok(axum::Json(delayed_json(&record)).into_response())
        }
    }
}

fn run_id(path: Result<Path<String>, PathRejection>) -> Result<RunId, ApiError> {
    let Path(id) = path.map_err(|rejection| ApiError::invalid(rejection.body_text()))?;
    RunId::parse(&id).ok_or_else(|| {
        ApiError::invalid(format!("invalid run id {id:?}: run ids look like run_0193... or run_at_0193..."))
    })
}

/// Whether the caller may see a run of `session`: with per-user auth, only its own.
fn owns(identity: &Identity, session: &SessionId) -> bool {
    SessionId::new(session.external()).is_ok_and(|external| &identity.session(external) == session)
}

fn not_found(run: &RunId) -> ApiError {
    ApiError::new(ErrorCode::RunNotFound, format!("no run {run}"))
}

/// A delayed run cancelled before it started: gone, saying who cancelled it.
fn cancelled(record: &DelayedRunRecord) -> ApiError {
    let by = record.note.as_deref().unwrap_or("cancelled");
    ApiError::new(
        ErrorCode::RunNotFound,
        format!("delayed run {} never started: it was {by}", record.run.run_id),
    )
}

fn delayed_json(record: &DelayedRunRecord) -> Value {
    let mut body = json!({
        "runId": record.run.run_id.as_str(),
        "sessionId": record.run.session_id.external(),
        "at": rfc3339(record.run.due_ms),
        "state": record.state.as_str(),
    });
    if let Some(note) = &record.note {
        body["note"] = json!(note);
    }
    body
}
