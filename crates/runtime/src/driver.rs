//! The driver: executes a [`Machine`]'s actions, journals each completed step, replays journaled
//! steps instead of executing them again.
//!
//! The loop has a closed set of inputs (see [`Input`]): it takes the next queued input or, when
//! none is queued, waits for the first of "a tool call finished" and "the run was cancelled".

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use keel_core::journal::{JournalEntry, JournalRecord};
use keel_core::machine::{Action, Input, Machine, RunOutcome};
use keel_core::message::ToolCall;
use keel_core::provider::ProviderErrorKind;
use keel_core::{
    BoxFuture, DeltaSink, ErrorCode, Event, Fence, Message, ModelReply, Part, PendingInput, PendingKind,
    ProviderError, Role, RunFailure, RunId, RunRecord, RunState, SessionId, SessionState, StepCommit,
    StepName, StopReason, StoreError, ToolContext, ToolError, ToolOutcome,
};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use crate::engine::{Admission, SessionClaim, Shared};
use crate::handle::RunResult;

/// How a run begins.
pub(crate) enum Plan {
    /// A new run of `session` answering `input`.
    Fresh { run_id: RunId, session: SessionId, input: Message, admission: Admission },
    /// Re-drive a stored run from its journal. `session_held`: the caller already holds the
    /// run's session in this process (a `replace` cancelling the paused run it replaces).
    Resume { run_id: RunId, session_held: bool },
}

/// A tool call in flight: its step, call id, outcome and, when it succeeded and replaced the
/// session's state object, the new state.
type ToolFuture = BoxFuture<'static, (StepName, String, ToolOutcome, Option<Value>)>;

/// Runs a run to its end and returns its result. Every failure is also sent as `run.error`.
pub(crate) async fn run(
    shared: Arc<Shared>,
    plan: Plan,
    events: UnboundedSender<Event>,
    cancel: CancellationToken,
) -> Result<RunResult, RunFailure> {
    let mut reported = false;
    let result = match prepare(&shared, plan, &cancel).await {
        Ok(prepared) => {
            let beat = prepared.epoch.map(|_| heartbeat(&shared));
            let mut driver = Driver {
                shared,
                run_id: prepared.run_id,
                session: prepared.session,
                replay: (!prepared.journal.is_empty()).then(Vec::new),
                journal: prepared.journal,
                new_run: prepared.new_run,
                epoch: prepared.epoch,
                beat,
                events: events.clone(),
                cancel,
                reported: false,
                state: SessionState::new(prepared.state),
                _claim: prepared.claim,
            };
            let result = driver.drive(prepared.machine).await;
            reported = driver.reported;
            result
        }
        Err(failure) => Err(failure),
    };
    if let Err(failure) = &result
        && !reported
    {
        // A failure of the driver itself (the store, the journal): the machine never saw it.
        let _ = events.send(Event::RunError { code: failure.code, message: failure.message.clone() });
    }
    result
}

struct Prepared {
    run_id: RunId,
    session: SessionId,
    machine: Machine,
    journal: HashMap<StepName, JournalRecord>,
    new_run: Option<RunRecord>,
    /// The lease epoch this driver writes under (`None`: replaying a finished run, which writes
    /// nothing new).
    epoch: Option<u64>,
    claim: Option<SessionClaim>,
    /// The session's state object, as stored.
    state: Value,
}

fn store_failure(error: StoreError) -> RunFailure {
    RunFailure::new(error.code(), format!("the store failed: {error}"))
}

async fn prepare(
    shared: &Arc<Shared>,
    plan: Plan,
    cancel: &CancellationToken,
) -> Result<Prepared, RunFailure> {
    let store = &shared.store;
    match plan {
        Plan::Fresh { run_id, session, input, admission } => {
            let claim = match admission {
                Admission::Now(claim) => claim,
                // Queued (or replacing the run in flight): wait for the session.
                Admission::Wait(handover) => tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Err(RunFailure::new(
                        ErrorCode::SessionBusy,
                        format!("the input to session {session} was cancelled or replaced before its run started"),
                    )),
                    claim = handover => claim.map_err(|_| RunFailure::new(
                        ErrorCode::Internal,
                        "the session was never handed over; please report this bug",
                    ))?,
                },
            };
            if shared.agent.concurrency == keel_core::Concurrency::Replace {
                Box::pin(cancel_paused_runs(shared, &session)).await?;
            }
            let history = store.load_messages(&session).await.map_err(store_failure)?;
            let state = store.load_session_state(&session).await.map_err(store_failure)?.unwrap_or_default();
            // Each completed model call appends exactly one assistant message.
            let call_base = history.iter().filter(|m| m.role == Role::Assistant).count() as u64;
            let record = RunRecord {
                run_id: run_id.clone(),
                session_id: session.clone(),
                input: input.clone(),
                history_len: history.len() as u64,
                call_base,
                state: RunState::Running,
            };
            // The run is stored with its first step's commit (the user's message).
            let machine = Machine::new(
                Arc::clone(&shared.agent),
                run_id.clone(),
                session.clone(),
                history,
                input,
                call_base,
            );
            Ok(Prepared {
                run_id,
                session,
                machine,
                journal: HashMap::new(),
                new_run: Some(record),
                epoch: Some(1),
                claim: Some(claim),
                state,
            })
        }
        Plan::Resume { run_id, session_held } => {
            let record = store.load_run(&run_id).await.map_err(store_failure)?.ok_or_else(|| {
                RunFailure::new(ErrorCode::RunNotFound, format!("no run {run_id} in the store"))
            })?;
            let claim = if session_held {
                None
            } else {
                Some(shared.claim(&record.session_id, cancel).map_err(|_| {
                    RunFailure::new(
                        ErrorCode::RunLeased,
                        format!(
                            "session {} already has a run in flight in this process; run {run_id} goes on there \
                             (a decision recorded for it is applied when that run gets to it)",
                            record.session_id
                        ),
                    )
                })?)
            };
            let epoch = match store
                .claim_run(&run_id, &shared.owner, shared.lease_ttl)
                .await
                .map_err(store_failure)?
            {
                Some(epoch) => Some(epoch),
                // A finished run replays from its journal alone: nothing new to write.
                None if record.state.is_terminal() => None,
                None => {
                    return Err(RunFailure::new(
                        ErrorCode::RunLeased,
                        format!(
                            "run {run_id} is being driven by another process (its lease has not expired)"
                        ),
                    ));
                }
            };
            let mut history = store.load_messages(&record.session_id).await.map_err(store_failure)?;
            let state = store
                .load_session_state(&record.session_id)
                .await
                .map_err(store_failure)?
                .unwrap_or_default();
            let history_len = record.history_len as usize;
            if history.len() < history_len {
                return Err(RunFailure::new(
                    ErrorCode::JournalCorrupt,
                    format!(
                        "run {run_id} started after message {history_len} of session {}, which has only {}",
                        record.session_id,
                        history.len()
                    ),
                ));
            }
            history.truncate(history_len);
            let journal = store
                .load_journal(&run_id)
                .await
                .map_err(store_failure)?
                .into_iter()
                .map(|entry| (entry.step, entry.record))
                .collect();
            tracing::debug!(run = %run_id, "re-driving run from its journal");
            let machine = Machine::new(
                Arc::clone(&shared.agent),
                run_id.clone(),
                record.session_id.clone(),
                history,
                record.input,
                record.call_base,
            );
            Ok(Prepared {
                run_id,
                session: record.session_id,
                machine,
                journal,
                new_run: None,
                epoch,
                claim,
                state,
            })
        }
    }
}

/// Cancels the runs of `session` paused for a human (a `replace` input replaces them too): each
/// is re-driven to its pause with a cancelled token, so its open calls get "cancelled" results
/// and it ends `cancelled`. The caller holds the session in this process.
pub(crate) async fn cancel_paused_runs(shared: &Arc<Shared>, session: &SessionId) -> Result<(), RunFailure> {
    let pending = shared.store.pending_inputs(Some(session)).await.map_err(store_failure)?;
    let mut runs: Vec<RunId> = pending.into_iter().map(|p| p.run_id).collect();
    runs.sort();
    runs.dedup();
    for run_id in runs {
        let cancel = CancellationToken::new();
        cancel.cancel();
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let plan = Plan::Resume { run_id: run_id.clone(), session_held: true };
        match Box::pin(run(Arc::clone(shared), plan, events, cancel)).await {
            Ok(_) => tracing::info!(run = %run_id, "cancelled a paused run: a new input replaces it"),
            Err(failure) => return Err(failure),
        }
    }
    Ok(())
}

struct Driver {
    shared: Arc<Shared>,
    run_id: RunId,
    session: SessionId,
    /// While a resumed run replays its journal: the events of the turn being replayed, shown
    /// once the run reaches new work (see [`Driver::emit`]). `None` once live.
    replay: Option<Vec<Event>>,
    /// Journaled steps not replayed yet.
    journal: HashMap<StepName, JournalRecord>,
    /// The record of a new run, stored with its first commit.
    new_run: Option<RunRecord>,
    /// The lease epoch commits are fenced with.
    epoch: Option<u64>,
    /// When to renew the lease while waiting on a model or tools (`None` without a lease).
    beat: Option<tokio::time::Interval>,
    events: UnboundedSender<Event>,
    cancel: CancellationToken,
    /// Whether the machine already emitted `run.error` for the run's failure.
    reported: bool,
    /// The session's state object, as this run's tools see it.
    state: SessionState,
    _claim: Option<SessionClaim>,
}

impl Driver {
    async fn drive(&mut self, mut machine: Machine) -> Result<RunResult, RunFailure> {
        let mut inputs: VecDeque<(Input, Option<JournalEntry>)> = VecDeque::from([(Input::Start, None)]);
        let mut tools: FuturesUnordered<ToolFuture> = FuturesUnordered::new();
        // The calls waiting for a human, with no decision journaled yet.
        let mut waiting: Vec<PendingInput> = Vec::new();
        // The session state a finished tool call set, committed with its result.
        let mut session_state: Option<Value> = None;
        loop {
            // An input with a journal entry is a fresh result: the entry is committed with what
            // the machine makes of it, before any new model call or tool call starts.
            let (input, entry) = match inputs.pop_front() {
                Some(next) => next,
                // Nothing runs and only humans can move the run on: cancel or pause.
                None if tools.is_empty() && self.cancel.is_cancelled() => (Input::Cancel, None),
                None if tools.is_empty() && !waiting.is_empty() => {
                    match Box::pin(self.pause(&mut waiting)).await? {
                        Pause::Paused(pending) => return Ok(self.paused_result(&machine, pending)),
                        Pause::Decided(decisions) => {
                            inputs.extend(decisions.into_iter().map(|input| (input, None)));
                            continue;
                        }
                    }
                }
                None if tools.is_empty() => {
                    return Err(RunFailure::new(
                        ErrorCode::Internal,
                        "the run loop stalled; please report this bug",
                    ));
                }
                None => {
                    let woken = tokio::select! {
                        biased;
                        () = self.cancel.cancelled() => {
                            // Dropping the futures aborts the tool tasks.
                            tools.clear();
                            Wake::Input(Input::Cancel, None, None)
                        }
                        () = next_beat(&mut self.beat) => Wake::Heartbeat,
                        Some((step, call_id, outcome, state)) = tools.next() => {
                            let entry = JournalEntry { step, record: JournalRecord::ToolResult(outcome.clone()) };
                            Wake::Input(Input::ToolDone { call_id, outcome }, Some(entry), state)
                        }
                    };
                    match woken {
                        Wake::Heartbeat => {
                            self.renew_lease().await;
                            continue;
                        }
                        Wake::Input(input, entry, state) => {
                            session_state = state;
                            (input, entry)
                        }
                    }
                }
            };
            let mut pending = PendingCommit { entry, messages: None, session_state: session_state.take() };
            for action in machine.step(input) {
                match action {
                    Action::Emit(event) => self.emit(event),
                    Action::Persist { first_position, count } => {
                        if !pending.continues_at(first_position) {
                            self.commit(&machine, &mut pending, None).await?;
                        }
                        pending.add_messages(first_position, count);
                    }
                    Action::CallModel { step } => {
                        self.commit(&machine, &mut pending, None).await?;
                        inputs.push_back(self.model_step(&machine, step).await?);
                    }
                    Action::CallTool { step, call } => {
                        self.commit(&machine, &mut pending, None).await?;
                        match self.journal.remove(&step) {
                            Some(JournalRecord::ToolResult(outcome)) => {
                                inputs.push_back((Input::ToolDone { call_id: call.call_id, outcome }, None));
                            }
                            Some(_) => return Err(self.corrupt(&step)),
                            None if self.epoch.is_none() => return Err(self.finished(&step)),
                            None => {
                                self.stop_if_shutting_down().await?;
                                self.go_live();
                                tools.push(self.spawn_tool(step, call));
                            }
                        }
                    }
                    Action::AwaitHuman { step, id, call_id, kind } => {
                        self.commit(&machine, &mut pending, None).await?;
                        match self.journal.remove(&step) {
                            Some(JournalRecord::Decision(decision)) => {
                                inputs.push_back((Input::Decision { call_id, decision }, None));
                            }
                            Some(_) => return Err(self.corrupt(&step)),
                            None if self.epoch.is_none() => return Err(self.finished(&step)),
                            // Boxed, like the pause: rare paths that should not grow every run's future.
                            None => waiting.push(Box::pin(self.ask_human(id, call_id, kind)).await?),
                        }
                    }
                    Action::Finish(outcome) => return self.finish(&machine, &mut pending, outcome).await,
                }
            }
            self.commit(&machine, &mut pending, None).await?;
        }
    }

    /// A commit of this run under its lease that writes nothing yet, to fill in.
    fn bare_commit(&self) -> StepCommit<'_> {
        StepCommit {
            session: &self.session,
            run: &self.run_id,
            new_run: None,
            fence: self.epoch.map(|epoch| Fence {
                owner: &self.shared.owner,
                epoch,
                ttl: self.shared.lease_ttl,
            }),
            entry: None,
            first_position: 0,
            messages: &[],
            state: None,
            pending: &[],
            session_state: None,
        }
    }

    /// Writes what a step produced (journal entry, messages, new state) in one store commit.
    async fn commit(
        &mut self,
        machine: &Machine,
        pending: &mut PendingCommit,
        state: Option<RunState>,
    ) -> Result<(), RunFailure> {
        let entry = pending.entry.take();
        let (first_position, count) = pending.messages.take().unwrap_or((0, 0));
        let new_run = self.new_run.take();
        let session_state = pending.session_state.take();
        if entry.is_none() && count == 0 && state.is_none() && new_run.is_none() && session_state.is_none() {
            return Ok(());
        }
        let commit = StepCommit {
            new_run: new_run.as_ref(),
            entry: entry.as_ref(),
            first_position: first_position as u64,
            messages: &machine.transcript()[first_position..first_position + count],
            state,
            session_state: session_state.as_ref(),
            ..self.bare_commit()
        };
        let step = entry.as_ref().map(|e| &e.step);
        if let Some(step) = step {
            crate::fault::point("before_commit", step);
        }
        self.shared.store.commit_step(commit).await.map_err(store_failure)?;
        if let Some(step) = step {
            crate::fault::point("after_commit", step);
        }
        Ok(())
    }

    /// Asks a human: stores the pending input at once (so it can be decided while the run's
    /// other calls still run), then tells the observers.
    async fn ask_human(
        &mut self,
        id: String,
        call_id: String,
        kind: PendingKind,
    ) -> Result<PendingInput, RunFailure> {
        self.go_live();
        let now = now_ms();
        let timeout = u64::try_from(self.shared.agent.approval_timeout.as_millis()).unwrap_or(u64::MAX);
        let asked = PendingInput {
            id,
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            call_id,
            kind,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(timeout),
        };
        let commit = StepCommit { pending: std::slice::from_ref(&asked), ..self.bare_commit() };
        self.shared.store.commit_step(commit).await.map_err(store_failure)?;
        self.emit(match &asked.kind {
            PendingKind::Approval { tool, input } => Event::ApprovalRequested {
                approval_id: asked.id.clone(),
                call_id: asked.call_id.clone(),
                tool: tool.clone(),
                input: input.clone(),
            },
            PendingKind::Question { question } => {
                Event::QuestionAsked { question_id: asked.id.clone(), question: question.clone() }
            }
        });
        Ok(asked)
    }

    /// Pauses the run for the humans it waits for: the state `awaiting_input`, which releases
    /// the lease (the pending inputs were stored when asked; storing them again is a no-op). A
    /// decision that arrived while the run was still busy continues the run at once.
    async fn pause(&mut self, waiting: &mut Vec<PendingInput>) -> Result<Pause, RunFailure> {
        let store = Arc::clone(&self.shared.store);
        let step = waiting[0].step();
        crate::fault::point("before_commit", &step);
        // The run was stored with its input, before its first model call: no new run here.
        let commit =
            StepCommit { state: Some(RunState::AwaitingInput), pending: waiting, ..self.bare_commit() };
        store.commit_step(commit).await.map_err(store_failure)?;
        crate::fault::point("after_commit", &step);

        let mut decisions = Vec::new();
        for entry in store.load_journal(&self.run_id).await.map_err(store_failure)? {
            if let JournalRecord::Decision(decision) = entry.record
                && let Some(index) = waiting.iter().position(|p| p.step() == entry.step)
            {
                let decided = waiting.remove(index);
                decisions.push(Input::Decision { call_id: decided.call_id, decision });
            }
        }
        if !decisions.is_empty() {
            let shared = &self.shared;
            if let Some(epoch) =
                store.claim_run(&self.run_id, &shared.owner, shared.lease_ttl).await.map_err(store_failure)?
            {
                self.epoch = Some(epoch);
                let resume = StepCommit { state: Some(RunState::Running), ..self.bare_commit() };
                store.commit_step(resume).await.map_err(store_failure)?;
                return Ok(Pause::Decided(decisions));
            }
            // The process that decided took the run over first; it goes on there.
        }
        let pending = store.pending_inputs(Some(&self.session)).await.map_err(store_failure)?;
        Ok(Pause::Paused(pending.into_iter().filter(|p| p.run_id == self.run_id).collect()))
    }

    fn paused_result(&mut self, machine: &Machine, pending: Vec<PendingInput>) -> RunResult {
        self.go_live();
        RunResult {
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            text: String::new(),
            output: None,
            stopped: StopReason::AwaitingInput,
            usage: machine.usage(),
            pending,
        }
    }

    /// At a step boundary during a shutdown: releases the lease (the next process may take the
    /// run over at once) and stops, leaving the run resumable.
    async fn stop_if_shutting_down(&self) -> Result<(), RunFailure> {
        if !self.shared.stopping.is_cancelled() {
            return Ok(());
        }
        if let Some(epoch) = self.epoch {
            let shared = &self.shared;
            if let Err(error) =
                shared.store.renew_lease(&self.run_id, &shared.owner, epoch, std::time::Duration::ZERO).await
            {
                tracing::warn!(run = %self.run_id, %error, "could not release the run's lease");
            }
        }
        Err(RunFailure::new(
            ErrorCode::ShuttingDown,
            format!(
                "the process is shutting down; run {} stopped between two steps and continues when keel \
                 starts again (or on another instance)",
                self.run_id
            ),
        ))
    }

    /// Renews the run's lease. A lost lease cancels the run here: another process has taken it
    /// over, and this driver's commits would be refused anyway.
    async fn renew_lease(&self) {
        let Some(epoch) = self.epoch else { return };
        let shared = &self.shared;
        match shared.store.renew_lease(&self.run_id, &shared.owner, epoch, shared.lease_ttl).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(run = %self.run_id, "lost the run's lease to another process; stopping");
                self.cancel.cancel();
            }
            // A transient store failure: the next beat retries before the lease runs out.
            Err(error) => tracing::warn!(run = %self.run_id, %error, "could not renew the run's lease"),
        }
    }

    /// Sends an event to the run's observers. While a resumed run replays its journal, the
    /// events are held: an observer of the resumed run sees `run.start`, then the calls of the
    /// turn it resumes in (not the older turns, nor text and usage it was shown before), then
    /// the new work.
    fn emit(&mut self, event: Event) {
        if let Some(held) = &mut self.replay {
            match event {
                Event::RunStart { .. } => {}
                Event::RunDone { .. } | Event::RunError { .. } => self.go_live(),
                Event::TextDelta { .. }
                | Event::ReasoningDelta { .. }
                | Event::TurnRetry { .. }
                | Event::Usage(_) => return,
                Event::TurnStart { .. } => {
                    held.clear();
                    held.push(event);
                    return;
                }
                _ => {
                    held.push(event);
                    return;
                }
            }
        }
        // The caller may have stopped listening; the run goes on.
        let _ = self.events.send(event);
    }

    /// Ends the replay: the run reached work that is not in its journal.
    fn go_live(&mut self) {
        for event in self.replay.take().unwrap_or_default() {
            let _ = self.events.send(event);
        }
    }

    /// A finished run is only ever replayed: a step missing from its journal (compacted) is not
    /// executed again.
    fn finished(&self, step: &StepName) -> RunFailure {
        RunFailure::new(
            ErrorCode::RunFinished,
            format!(
                "run {} is finished and its journal has no step {step} (it was compacted); nothing is executed again",
                self.run_id
            ),
        )
    }

    fn corrupt(&self, step: &StepName) -> RunFailure {
        RunFailure::new(
            ErrorCode::JournalCorrupt,
            format!("the journal of run {} has a record of the wrong kind for step {step}", self.run_id),
        )
    }

    /// One model call: from the journal when recorded, else from the provider. A fresh reply
    /// comes with its journal entry, for the caller to commit.
    async fn model_step(
        &mut self,
        machine: &Machine,
        step: StepName,
    ) -> Result<(Input, Option<JournalEntry>), RunFailure> {
        match self.journal.remove(&step) {
            Some(JournalRecord::ModelReply(reply)) => {
                tracing::debug!(run = %self.run_id, %step, "replayed from the journal");
                let text: String = reply
                    .parts
                    .iter()
                    .filter_map(|p| if let Part::Text(t) = p { Some(t.as_str()) } else { None })
                    .collect();
                if !text.is_empty() {
                    self.emit(Event::TextDelta { delta: text });
                }
                return Ok((Input::ModelReply(reply), None));
            }
            Some(_) => return Err(self.corrupt(&step)),
            None if self.epoch.is_none() => return Err(self.finished(&step)),
            None => {
                self.stop_if_shutting_down().await?;
                self.go_live();
            }
        }
        let call = call_model(&self.shared, machine, &self.events);
        tokio::pin!(call);
        let result = loop {
            let finished = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Ok((Input::Cancel, None)),
                () = next_beat(&mut self.beat) => None,
                result = &mut call => Some(result),
            };
            match finished {
                Some(result) => break result,
                None => self.renew_lease().await,
            }
        };
        Ok(match result {
            Ok(reply) => {
                let entry = JournalEntry { step, record: JournalRecord::ModelReply(reply.clone()) };
                (Input::ModelReply(reply), Some(entry))
            }
            Err(error) => (Input::ModelFailed(error), None),
        })
    }

    /// Starts a tool call in its own task, so that a panic or a blocked thread in the tool cannot
    /// take the run down with it.
    fn spawn_tool(&self, step: StepName, call: ToolCall) -> ToolFuture {
        let ToolCall { call_id, name, input } = call;
        let Some(tool) = self.shared.agent.tools.get(&name).cloned() else {
            // The machine checked the name; this is a bug, reported to the model as a failure.
            let error = ToolError::with_code(ErrorCode::Internal, format!("tool `{name}` vanished"), false);
            return Box::pin(std::future::ready((step, call_id, Err(error), None)));
        };
        let state = self.state.for_call();
        let ctx = ToolContext {
            run_id: self.run_id.clone(),
            session_id: self.session.clone(),
            call_id: call_id.clone(),
            idempotency_key: step.idempotency_key(&self.run_id),
            state: state.clone(),
        };
        let timeout = self.shared.agent.limits.tool_timeout;
        let mut task = AbortOnDrop(tokio::spawn(async move { tool.call(input, &ctx).await }));
        Box::pin(async move {
            let outcome = match tokio::time::timeout(timeout, &mut task.0).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(join_error)) => Err(ToolError::with_code(
                    ErrorCode::ToolPanicked,
                    format!("tool `{name}` crashed: {}", panic_message(join_error)),
                    false,
                )),
                Err(_elapsed) => Err(ToolError::with_code(
                    ErrorCode::ToolTimeout,
                    format!(
                        "tool `{name}` did not finish within {timeout:?} (`limits.tool_timeout`) and was stopped"
                    ),
                    true,
                )),
            };
            // A failed call's state replacement is dropped with it.
            let new_state = if outcome.is_ok() { state.commit_staged() } else { None };
            (step, call_id, outcome, new_state)
        })
    }

    async fn finish(
        &mut self,
        machine: &Machine,
        pending: &mut PendingCommit,
        outcome: RunOutcome,
    ) -> Result<RunResult, RunFailure> {
        match outcome {
            RunOutcome::Done { text, output, stopped, usage } => {
                let state =
                    if stopped == StopReason::Cancelled { RunState::Cancelled } else { RunState::Done };
                self.commit(machine, pending, Some(state)).await?;
                Ok(RunResult {
                    run_id: self.run_id.clone(),
                    session_id: self.session.clone(),
                    text,
                    output,
                    stopped,
                    usage,
                    pending: Vec::new(),
                })
            }
            RunOutcome::Failed(failure) => {
                self.reported = true;
                self.commit(machine, pending, Some(RunState::Failed)).await?;
                Err(failure)
            }
        }
    }
}

/// How a pause ended.
enum Pause {
    /// The run is paused; these are what it waits for.
    Paused(Vec<PendingInput>),
    /// Decisions came while the run was busy: feed them and go on.
    Decided(Vec<Input>),
}

/// Milliseconds since the Unix epoch: when a pending input was asked, for its expiry.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Why a driver waiting on tools woke up.
enum Wake {
    /// Time to renew the lease.
    Heartbeat,
    /// The next input, with its journal entry when it is a fresh result, and the session state
    /// a finished tool call set.
    Input(Input, Option<JournalEntry>, Option<Value>),
}

/// What a step has produced and not yet committed.
struct PendingCommit {
    entry: Option<JournalEntry>,
    /// The session's new state object, set by the step's tool call.
    session_state: Option<Value>,
    /// A contiguous range of transcript positions (first, count).
    messages: Option<(usize, usize)>,
}

impl PendingCommit {
    /// Whether messages starting at `position` can join the pending ones in one commit.
    fn continues_at(&self, position: usize) -> bool {
        self.messages.is_none_or(|(first, count)| first + count == position)
    }

    /// Adds messages; the caller checked [`Self::continues_at`].
    fn add_messages(&mut self, first_position: usize, count: usize) {
        self.messages = Some(match self.messages {
            Some((first, existing)) => (first, existing + count),
            None => (first_position, count),
        });
    }
}

/// Ticks a third of the way through the lease: how often a driver waiting on a model or tools
/// renews it (each commit renews it too). A timer, not a task: a run costs no extra spawn.
fn heartbeat(shared: &Shared) -> tokio::time::Interval {
    let period = (shared.lease_ttl / 3).max(std::time::Duration::from_millis(10));
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    beat
}

/// The next heartbeat, or never without a lease.
async fn next_beat(beat: &mut Option<tokio::time::Interval>) {
    match beat {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Aborts a spawned task when dropped (on timeout or cancel).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// "Equal jitter": a uniformly random wait between half the backoff and all of it. Randomness here
/// only spaces retries out; it decides nothing about the run.
fn jitter(backoff: std::time::Duration) -> std::time::Duration {
    backoff.mul_f64(0.5 + fastrand::f64() * 0.5)
}

fn panic_message(error: tokio::task::JoinError) -> String {
    if !error.is_panic() {
        return "it was aborted".into();
    }
    let payload = error.into_panic();
    if let Some(message) = payload.downcast_ref::<&str>() {
        format!("it panicked: {message}")
    } else if let Some(message) = payload.downcast_ref::<String>() {
        format!("it panicked: {message}")
    } else {
        "it panicked".into()
    }
}

/// Streams text deltas to the run's observers.
struct EventSink<'a>(&'a UnboundedSender<Event>);

impl DeltaSink for EventSink<'_> {
    fn text_delta(&mut self, delta: &str) {
        if self.0.is_closed() {
            return;
        }
        let _ = self.0.send(Event::TextDelta { delta: delta.to_owned() });
    }

    fn reasoning_delta(&mut self, delta: &str) {
        if self.0.is_closed() {
            return;
        }
        let _ = self.0.send(Event::ReasoningDelta { delta: delta.to_owned() });
    }
}

/// The longest `Retry-After` keel honours when `retry.max_backoff` is shorter.
const LONGEST_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Calls the model with the agent's timeout and retry policy.
///
/// A failed attempt is retried as a whole turn: observers get `turn.retry`, which voids the
/// text they were streamed since `turn.start`, and only the attempt that succeeds is journaled.
/// The wait is the policy's exponential backoff with jitter (so that many runs failing
/// together do not retry together), never shorter than what the provider asked for.
async fn call_model(
    shared: &Shared,
    machine: &Machine,
    events: &UnboundedSender<Event>,
) -> Result<ModelReply, ProviderError> {
    let retry = &shared.agent.retry;
    let timeout = shared.agent.limits.provider_timeout;
    let mut sink = EventSink(events);
    let mut attempt = 1;
    loop {
        let request = machine.model_request(attempt);
        let result = match tokio::time::timeout(timeout, shared.provider.complete(request, &mut sink)).await {
            Ok(result) => result,
            Err(_elapsed) => Err(ProviderError::new(
                ProviderErrorKind::Timeout,
                format!("no reply within {timeout:?} (`limits.provider_timeout`)"),
            )),
        };
        let error = match result {
            Ok(reply) => return Ok(reply),
            Err(error) => error,
        };
        let next = attempt + 1;
        let wait = if error.is_transient() { retry.backoff(next) } else { None };
        let Some(mut wait) = wait else {
            let mut error = error;
            if attempt > 1 {
                error.message = format!("{} (after {attempt} attempts)", error.message);
            }
            return Err(error);
        };
        wait = jitter(wait);
        if let Some(after) = error.retry_after {
            // Honour the provider's wait, up to a bound: a run does not sleep for an hour
            // because a rate-limit window says so.
            let longest = retry.max_backoff.max(LONGEST_RETRY_AFTER);
            if after > longest {
                let mut error = error;
                error.message = format!(
                    "{} (the provider asks to wait {:.0} s before trying again, longer than keel waits: {:.0} s, the larger of `retry.max_backoff` and 60 s)",
                    error.message,
                    after.as_secs_f64(),
                    longest.as_secs_f64()
                );
                return Err(error);
            }
            wait = wait.max(after);
        }
        tracing::warn!(attempt, ?wait, %error, "model call failed; retrying");
        let _ = events.send(Event::TurnRetry {
            turn: machine.turn(),
            attempt: next,
            code: error.code(),
            message: error.message.clone(),
            wait,
        });
        tokio::time::sleep(wait).await;
        attempt = next;
    }
}
