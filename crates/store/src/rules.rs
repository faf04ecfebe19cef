//! The store's rules, written once above every backend.
//!
//! Each rule is a function over [`Tx`] storage operations, run inside one backend transaction:
//! it reads what it needs, checks everything, and only then writes (so a backend without
//! rollback stays consistent). The rules:
//!
//! - **One run per session.** A new run is refused ([`StoreError::Busy`]) while its session has
//!   any unfinished run: in flight, interrupted (to be resumed first), or paused for a human.
//! - **Fencing.** A commit under a [`keel_core::Fence`] writes nothing unless the run's lease
//!   still has that owner and epoch; every claim bumps the epoch.
//! - **Idempotent writes.** The first journal record of a step wins; a message position written
//!   by the same run is skipped, by another run (or past the end) is a conflict.
//! - **A decision is taken once**, journaled with the removal of its pending input, and
//!   remembered with who took it; a decided input is never asked again.
//! - **A finished run drops its pending inputs** (remembered as closed), and a run whose
//!   cancellation was requested asks for nothing more.
//! - **A delayed run starts once, unless cancelled first.** Its run's first commit marks it
//!   started; a cancelled one refuses that commit. A schedule's tick is recorded with its
//!   fire's delayed run, in one transaction.
//! - **Poison runs end.** A claim counts the claims since the run last committed; past
//!   [`MAX_CLAIMS_WITHOUT_PROGRESS`] the claim itself fails the run.
//!
//! [`Ruled`] implements [`Store`] by running these rules (and plain reads) through its backend.

use std::sync::Arc;
use std::time::Duration;

use keel_core::journal::{JournalEntry, JournalRecord};
use keel_core::memory::{MemoryItem, MemoryMerge, MemoryOwner, MemoryWrite};
use keel_core::store::{MAX_CLAIMS_WITHOUT_PROGRESS, decision_outcome};
use keel_core::{
    BoxFuture, Claim, Committed, DecidedInput, Decision, DelayedRun, DelayedRunRecord, DelayedState, Fence,
    LeaseStatus, Message, OpenRun, PendingInput, RunId, RunRecord, RunState, SessionFilter, SessionId,
    SessionSnapshot, SessionSummary, StepCommit, Store, StoreError, StoreFuture,
};

use crate::backend::{Backend, CommitSubject, Ruled, RunControl, SessionRows, Tx};

/// A [`StepCommit`] with its data owned, so that it can travel to a backend's writer.
struct OwnedCommit {
    session: SessionId,
    run: RunId,
    new_run: Option<RunRecord>,
    entry: Option<Arc<JournalEntry>>,
    first_position: u64,
    messages: Vec<Arc<Message>>,
    state: Option<RunState>,
    session_state: Option<serde_json::Value>,
    pending: Vec<PendingInput>,
    fence: Option<(String, u64, Duration)>,
}

impl OwnedCommit {
    fn new(commit: &StepCommit<'_>) -> OwnedCommit {
        OwnedCommit {
            session: commit.session.clone(),
            run: commit.run.clone(),
            new_run: commit.new_run.cloned(),
            entry: commit.entry.cloned(),
            first_position: commit.first_position,
            messages: commit.messages.to_vec(),
            state: commit.state,
            session_state: commit.session_state.cloned(),
            pending: commit.pending.to_vec(),
            fence: commit.fence.map(|f| (f.owner.to_owned(), f.epoch, f.ttl)),
        }
    }

    fn view(&self) -> StepCommit<'_> {
        StepCommit {
            session: &self.session,
            run: &self.run,
            new_run: self.new_run.as_ref(),
            entry: self.entry.as_ref(),
            first_position: self.first_position,
            messages: &self.messages,
            state: self.state,
            session_state: self.session_state.as_ref(),
            pending: &self.pending,
            fence: self.fence.as_ref().map(|(owner, epoch, ttl)| Fence { owner, epoch: *epoch, ttl: *ttl }),
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The run as recovery and busy checks see it.
fn open_run(run: RunId, control: RunControl) -> OpenRun {
    OpenRun {
        run_id: run,
        session_id: control.session,
        state: control.state,
        owner: control.owner.map(|o| o.to_string()),
        lease_expires_ms: control.lease_expires_ms,
        cancel_requested_by: control.cancel_requested_by,
        attempts: control.attempts,
    }
}

/// Checks that appending `count` messages at `first` is a valid (possibly repeated) append by
/// `run`. Returns how many of them are stored already.
fn check_messages(
    tx: &mut dyn Tx,
    session: &SessionId,
    run: &RunId,
    first: u64,
    count: usize,
) -> Result<u64, StoreError> {
    if count == 0 {
        return Ok(0);
    }
    let stored = tx.message_count(session)?;
    if first > stored {
        return Err(StoreError::Conflict(format!(
            "position {first} of session {session} is past its end ({stored})"
        )));
    }
    let repeated = (stored - first).min(count as u64);
    for position in first..first + repeated {
        let writer = tx.message_writer(session, position)?;
        if writer.as_ref() != Some(run) {
            let writer = writer.map_or_else(|| "nobody".to_owned(), |w| w.to_string());
            return Err(StoreError::Conflict(format!(
                "position {position} of session {session} was written by {writer}, not {run}"
            )));
        }
    }
    Ok(repeated)
}

/// Removes the run's pending inputs, remembering them as `outcome` by `by` (said only when
/// there is something to close).
fn close_pending(
    tx: &mut dyn Tx,
    run: &RunId,
    session: &SessionId,
    outcome: &str,
    by: impl Fn() -> String,
    now_ms: u64,
) -> Result<(), StoreError> {
    for pending in tx.pending_list(Some(session))?.into_iter().filter(|p| &p.run_id == run) {
        tx.delete_pending(&pending.id)?;
        tx.insert_decided(&DecidedInput {
            id: pending.id,
            run_id: pending.run_id,
            session_id: pending.session_id,
            outcome: outcome.to_owned(),
            by: by(),
            at_ms: now_ms,
        })?;
    }
    Ok(())
}

fn commit_step(tx: &mut dyn Tx, commit: &StepCommit<'_>, now_ms: u64) -> Result<Committed, StoreError> {
    let StepCommit {
        session,
        run,
        new_run,
        entry,
        first_position,
        messages,
        state,
        session_state,
        pending,
        fence,
    } = *commit;
    // Checks: nothing is written unless all pass.
    // A new run's commit made again after its answer was lost (a connection cut after COMMIT)
    // finds the run as it created it: it is then checked and applied as a commit of that run,
    // which repeats nothing. Any other run of that id is a conflict.
    let new_run = match new_run {
        Some(record) if tx.control(run)?.is_some() => {
            if tx.run(run)?.as_ref() != Some(record) {
                return Err(StoreError::Conflict(format!("run {run} already exists")));
            }
            None
        }
        other => other,
    };
    let mut control = match new_run {
        Some(record) => {
            if &record.run_id != run || &record.session_id != session {
                return Err(StoreError::Conflict(format!("run {run} is not the run its commit creates")));
            }
            if let Some((other, control)) = tx.open_runs(Some(session))?.into_iter().next() {
                return Err(StoreError::Busy(open_run(other, control).busy_message(now_ms)));
            }
            RunControl {
                session: session.clone(),
                state: record.state,
                owner: fence.map(|fence| Arc::from(fence.owner)),
                lease_expires_ms: 0,
                epoch: fence.map_or(0, |fence| fence.epoch),
                attempts: 0,
                cancel_requested_by: None,
            }
        }
        None => {
            let Some(control) = tx.control(run)? else {
                return Err(StoreError::NotFound(format!("run {run}")));
            };
            if &control.session != session {
                return Err(StoreError::Conflict(format!(
                    "run {run} belongs to session {}, not {session}",
                    control.session
                )));
            }
            if let Some(fence) = fence
                && (control.owner.as_deref() != Some(fence.owner) || control.epoch != fence.epoch)
            {
                return Err(StoreError::LeaseLost(format!(
                    "run {run} is no longer leased to {} at epoch {}",
                    fence.owner, fence.epoch
                )));
            }
            control
        }
    };
    // A delayed run's first commit starts it, unless it was cancelled first.
    let delayed = match new_run {
        Some(_) if run.is_delayed() => match tx.delayed_run(run)? {
            Some(record) if record.state == DelayedState::Cancelled => {
                return Err(StoreError::Conflict(format!(
                    "delayed run {run} was cancelled before it started ({})",
                    record.note.as_deref().unwrap_or("no reason recorded")
                )));
            }
            Some(record) if record.state == DelayedState::Waiting => Some(record),
            _ => None,
        },
        _ => None,
    };
    let repeated = check_messages(tx, session, run, first_position, messages.len())?;

    // Writes. Whatever is new is progress: the run got past a step, so it is no step closer to
    // being poisoned. A replay that only repeats what is stored is not.
    let mut progressed = new_run.is_some() || state.is_some() || session_state.is_some();
    // Whether the run's control row must be written: not for a commit that only adds to the
    // journal and the transcript of a run whose lease has most of its length left.
    let mut control_changed = state.is_some();
    if let Some(state) = state {
        control.state = state;
        if state != RunState::Running {
            control.lease_expires_ms = 0;
        }
    }
    if let Some(fence) = fence
        && control.state == RunState::Running
    {
        let ttl = millis(fence.ttl);
        // Extended when a third of it is gone (heartbeats renew it too).
        if control.lease_expires_ms < now_ms.saturating_add(ttl - ttl / 3) {
            control.lease_expires_ms = now_ms.saturating_add(ttl);
            control_changed = true;
        }
    }
    if let Some(record) = new_run {
        tx.insert_run(record, &control, now_ms)?;
    }
    if let Some(mut record) = delayed {
        record.state = DelayedState::Started;
        record.note = None;
        tx.put_delayed_run(&record)?;
    }
    if let Some(entry) = entry
        && tx.append_journal(run, entry)?
    {
        let usage = match &entry.record {
            JournalRecord::ModelReply(reply) => Some(reply.usage),
            JournalRecord::Memory(Ok(value)) => keel_core::memory::outcome_usage(value),
            _ => None,
        };
        if let Some(usage) = usage {
            tx.add_usage(session, usage, now_ms)?;
        }
        progressed = true;
    }
    if repeated < messages.len() as u64 {
        let fresh = &messages[repeated as usize..];
        tx.append_messages(session, run, first_position + repeated, fresh, now_ms)?;
        progressed = true;
    }
    if let Some(value) = session_state {
        tx.set_session_state(session, value, now_ms)?;
    }
    if control.cancel_requested_by.is_none() {
        for asked in pending {
            if tx.pending(&asked.id)?.is_none() && !tx.has_step(run, &asked.step())? {
                tx.insert_pending(asked)?;
                progressed = true;
            }
        }
    }
    if let Some(state) = state
        && state.is_terminal()
    {
        close_pending(tx, run, session, "closed", || format!("the run ended {}", state.as_str()), now_ms)?;
    }
    if progressed && control.attempts != 0 {
        control.attempts = 0;
        control_changed = true;
    }
    if new_run.is_none() && control_changed {
        tx.set_control(run, &control, now_ms)?;
    }
    Ok(Committed { cancel_requested: control.cancel_requested_by.is_some() })
}

fn claim_run(
    tx: &mut dyn Tx,
    run: &RunId,
    owner: &str,
    ttl: Duration,
    takeover: Option<&str>,
    now_ms: u64,
) -> Result<Claim, StoreError> {
    let Some(mut control) = tx.control(run)? else {
        return Err(StoreError::NotFound(format!("run {run}")));
    };
    if control.state.is_terminal() {
        return Ok(Claim::Finished);
    }
    let holder = control.owner.as_deref();
    let held_by_another = control.state == RunState::Running
        && control.lease_expires_ms > now_ms
        && holder.is_some_and(|holder| holder != owner && Some(holder) != takeover);
    if held_by_another {
        return Ok(Claim::Held {
            owner: holder.unwrap_or_default().to_owned(),
            expires_ms: control.lease_expires_ms,
        });
    }
    control.epoch += 1;
    control.owner = Some(Arc::from(owner));
    control.lease_expires_ms = now_ms.saturating_add(millis(ttl));
    control.attempts = control.attempts.saturating_add(1);
    if control.attempts > MAX_CLAIMS_WITHOUT_PROGRESS {
        // The runtime's own attempts to end the run cleanly died too: stop here.
        control.state = RunState::Failed;
        control.lease_expires_ms = 0;
        let session = control.session.clone();
        close_pending(tx, run, &session, "closed", || "the run was poisoned".to_owned(), now_ms)?;
        tx.set_control(run, &control, now_ms)?;
        return Ok(Claim::Poisoned);
    }
    tx.set_control(run, &control, now_ms)?;
    Ok(Claim::Claimed {
        epoch: control.epoch,
        attempt: control.attempts,
        cancel_requested: control.cancel_requested_by.is_some(),
    })
}

fn renew_lease(
    tx: &mut dyn Tx,
    run: &RunId,
    owner: &str,
    epoch: u64,
    ttl: Duration,
    now_ms: u64,
) -> Result<LeaseStatus, StoreError> {
    let Some(mut control) = tx.control(run)? else { return Ok(LeaseStatus::Lost) };
    if control.owner.as_deref() != Some(owner) || control.epoch != epoch {
        return Ok(LeaseStatus::Lost);
    }
    control.lease_expires_ms = now_ms.saturating_add(millis(ttl));
    tx.set_control(run, &control, now_ms)?;
    Ok(LeaseStatus::Held { cancel_requested: control.cancel_requested_by.is_some() })
}

fn request_cancel(
    tx: &mut dyn Tx,
    session: &SessionId,
    by: &str,
    now_ms: u64,
) -> Result<Option<OpenRun>, StoreError> {
    let mut first = None;
    for (run, mut control) in tx.open_runs(Some(session))? {
        let before = open_run(run.clone(), control.clone());
        control.cancel_requested_by.get_or_insert_with(|| by.to_owned());
        if control.state == RunState::AwaitingInput {
            // Nobody drives a paused run: make it re-drivable, so that the next process to
            // drive the session ends it (its open calls get "cancelled" results).
            close_pending(tx, &run, session, "cancelled", || by.to_owned(), now_ms)?;
            control.state = RunState::Running;
            control.lease_expires_ms = 0;
        }
        tx.set_control(&run, &control, now_ms)?;
        first.get_or_insert(before);
    }
    Ok(first)
}

fn decide(
    tx: &mut dyn Tx,
    id: &str,
    decision: Decision,
    by: &str,
    now_ms: u64,
) -> Result<PendingInput, StoreError> {
    let Some(pending) = tx.pending(id)? else {
        return Err(match tx.decided(id)? {
            Some(decided) => StoreError::NotPending(decided.refusal(now_ms)),
            None => StoreError::not_pending(id),
        });
    };
    let run = pending.run_id.clone();
    let step = pending.step();
    tx.delete_pending(id)?;
    tx.insert_decided(&DecidedInput {
        id: id.to_owned(),
        run_id: run.clone(),
        session_id: pending.session_id.clone(),
        outcome: decision_outcome(&decision).to_owned(),
        by: by.to_owned(),
        at_ms: now_ms,
    })?;
    tx.append_journal(&run, &Arc::new(JournalEntry { step, record: JournalRecord::Decision(decision) }))?;
    if let Some(mut control) = tx.control(&run)?
        && control.state == RunState::AwaitingInput
    {
        // Re-drivable by any process at once.
        control.state = RunState::Running;
        control.lease_expires_ms = 0;
        tx.set_control(&run, &control, now_ms)?;
    }
    Ok(pending)
}

fn claim_schedule_tick(
    tx: &mut dyn Tx,
    name: &str,
    tick_ms: u64,
    run: Option<&DelayedRun>,
    now_ms: u64,
) -> Result<bool, StoreError> {
    if tx.schedule_last_fire(name)?.is_some_and(|last| last >= tick_ms) {
        return Ok(false);
    }
    if let Some(run) = run {
        check_new_delayed(tx, run)?;
    }
    tx.set_schedule_last_fire(name, tick_ms)?;
    if let Some(run) = run {
        tx.put_delayed_run(&waiting(run, now_ms))?;
    }
    Ok(true)
}

/// A delayed run as first stored.
fn waiting(run: &DelayedRun, now_ms: u64) -> DelayedRunRecord {
    DelayedRunRecord {
        run: run.clone(),
        state: DelayedState::Waiting,
        created_ms: now_ms,
        held_until_ms: 0,
        attempts: 0,
        note: None,
    }
}

/// Refuses a new delayed run whose id is taken (by a run, or by another delayed run).
fn check_new_delayed(tx: &mut dyn Tx, run: &DelayedRun) -> Result<(), StoreError> {
    if !run.run_id.is_delayed() {
        return Err(StoreError::Conflict(format!("{} is not a delayed run's id", run.run_id)));
    }
    if tx.delayed_run(&run.run_id)?.is_some() || tx.control(&run.run_id)?.is_some() {
        return Err(StoreError::Conflict(format!("run {} already exists", run.run_id)));
    }
    Ok(())
}

fn schedule_run(tx: &mut dyn Tx, run: &DelayedRun, now_ms: u64) -> Result<DelayedRunRecord, StoreError> {
    if let Some(stored) = tx.delayed_run(&run.run_id)?
        && &stored.run == run
    {
        return Ok(stored);
    }
    check_new_delayed(tx, run)?;
    let record = waiting(run, now_ms);
    tx.put_delayed_run(&record)?;
    Ok(record)
}

fn take_due_runs(
    tx: &mut dyn Tx,
    hold: Duration,
    limit: usize,
    now_ms: u64,
) -> Result<Vec<DelayedRun>, StoreError> {
    let mut taken = Vec::new();
    for id in tx.due_delayed_runs(now_ms, limit)? {
        // Read again, locked: another process may have taken it since the list was read.
        let Some(mut record) = tx.delayed_run(&id)? else { continue };
        if record.state != DelayedState::Waiting
            || record.held_until_ms > now_ms
            || record.run.due_ms > now_ms
        {
            continue;
        }
        record.held_until_ms = now_ms.saturating_add(millis(hold));
        record.attempts = record.attempts.saturating_add(1);
        tx.put_delayed_run(&record)?;
        taken.push(record.run);
    }
    Ok(taken)
}

fn defer_delayed_run(tx: &mut dyn Tx, run: &RunId, until_ms: u64, note: &str) -> Result<(), StoreError> {
    if let Some(mut record) = tx.delayed_run(run)?
        && record.state == DelayedState::Waiting
    {
        record.held_until_ms = until_ms;
        record.note = Some(note.to_owned());
        tx.put_delayed_run(&record)?;
    }
    Ok(())
}

fn cancel_delayed_run(
    tx: &mut dyn Tx,
    run: &RunId,
    by: &str,
) -> Result<Option<DelayedRunRecord>, StoreError> {
    let Some(mut record) = tx.delayed_run(run)? else { return Ok(None) };
    if record.state == DelayedState::Waiting {
        record.state = DelayedState::Cancelled;
        record.note = Some(format!("cancelled by {by}"));
        tx.put_delayed_run(&record)?;
    }
    Ok(Some(record))
}

impl<B: Backend> Ruled<B> {
    fn write<T: Send + 'static>(
        &self,
        mut work: impl FnMut(&mut dyn Tx, u64) -> Result<T, StoreError> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let clock = Arc::clone(&self.clock);
        // The time is read inside the transaction: a write that waited for its turn decides
        // with the time it is applied at.
        let work = move |tx: &mut dyn Tx| work(tx, clock.now_ms());
        match self.backend.write_here(work) {
            Ok(result) => Box::pin(std::future::ready(result)),
            Err(work) => self.backend.write(Box::new(work)),
        }
    }

    /// [`Ruled::write`] for a step's commit (see [`Backend::write_commit`]).
    fn write_commit<T: Send + 'static>(
        &self,
        subject: CommitSubject,
        mut work: impl FnMut(&mut dyn Tx, u64) -> Result<T, StoreError> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let clock = Arc::clone(&self.clock);
        self.backend.write_commit(subject, Box::new(move |tx: &mut dyn Tx| work(tx, clock.now_ms())))
    }

    fn read<T: Send + 'static>(
        &self,
        work: impl FnMut(&mut dyn Tx) -> Result<T, StoreError> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        match self.backend.read_here(work) {
            Ok(result) => Box::pin(std::future::ready(result)),
            Err(work) => self.backend.read(Box::new(work)),
        }
    }
}

impl<B: Backend> Store for Ruled<B> {
    fn load_messages<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Vec<Arc<Message>>, StoreError>> {
        let session = session.clone();
        self.read(move |tx| tx.messages(&session))
    }

    fn load_session<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> StoreFuture<'a, Result<SessionSnapshot, StoreError>> {
        let snapshot = |rows: SessionRows| SessionSnapshot {
            messages: rows.messages,
            state: rows.state,
            open_run: rows.open_run.map(|(run, control)| open_run(run, control)),
        };
        match self.backend.read_session(session.clone()) {
            StoreFuture::Ready(rows) => StoreFuture::ready(rows.into_inner().map(snapshot)),
            StoreFuture::Boxed(rows) => StoreFuture::Boxed(Box::pin(async move { rows.await.map(snapshot) })),
        }
    }

    fn load_session_state<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, StoreError>> {
        let session = session.clone();
        self.read(move |tx| tx.session_state(&session))
    }

    fn load_run<'a>(&'a self, run: &'a RunId) -> BoxFuture<'a, Result<Option<RunRecord>, StoreError>> {
        let run = run.clone();
        self.read(move |tx| tx.run(&run))
    }

    fn load_journal<'a>(
        &'a self,
        run: &'a RunId,
    ) -> BoxFuture<'a, Result<Vec<keel_core::journal::JournalEntry>, StoreError>> {
        let run = run.clone();
        self.read(move |tx| tx.journal(&run))
    }

    fn commit_step<'a>(&'a self, commit: StepCommit<'a>) -> StoreFuture<'a, Result<Committed, StoreError>> {
        // A backend in memory runs the rules on the caller's data; one with a writer thread
        // gets a copy.
        let here = |tx: &mut dyn Tx| commit_step(tx, &commit, self.clock.now_ms());
        match self.backend.write_here(here) {
            Ok(result) => StoreFuture::ready(result),
            Err(_) => {
                let owned = OwnedCommit::new(&commit);
                let subject = CommitSubject {
                    session: owned.session.clone(),
                    run: owned.run.clone(),
                    step: owned.entry.as_ref().map(|entry| entry.step.clone()),
                };
                self.write_commit(subject, move |tx, now| commit_step(tx, &owned.view(), now)).into()
            }
        }
    }

    fn claim_run<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        ttl: Duration,
        takeover: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        let (run, owner, takeover) = (run.clone(), owner.to_owned(), takeover.map(str::to_owned));
        self.write(move |tx, now| claim_run(tx, &run, &owner, ttl, takeover.as_deref(), now))
    }

    fn renew_lease<'a>(
        &'a self,
        run: &'a RunId,
        owner: &'a str,
        epoch: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LeaseStatus, StoreError>> {
        let (run, owner) = (run.clone(), owner.to_owned());
        self.write(move |tx, now| renew_lease(tx, &run, &owner, epoch, ttl, now))
    }

    fn open_runs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<OpenRun>, StoreError>> {
        let session = session.cloned();
        self.read(move |tx| {
            Ok(tx
                .open_runs(session.as_ref())?
                .into_iter()
                .map(|(run, control)| open_run(run, control))
                .collect())
        })
    }

    fn cancel_requests<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Result<Vec<RunId>, StoreError>> {
        let owner = owner.to_owned();
        self.read(move |tx| tx.cancel_requested(&owner))
    }

    fn request_cancel<'a>(
        &'a self,
        session: &'a SessionId,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Option<OpenRun>, StoreError>> {
        let (session, by) = (session.clone(), by.to_owned());
        self.write(move |tx, now| request_cancel(tx, &session, &by, now))
    }

    fn pending_inputs<'a>(
        &'a self,
        session: Option<&'a SessionId>,
    ) -> BoxFuture<'a, Result<Vec<PendingInput>, StoreError>> {
        let session = session.cloned();
        self.read(move |tx| tx.pending_list(session.as_ref()))
    }

    fn pending_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<PendingInput>, StoreError>> {
        let id = id.to_owned();
        self.read(move |tx| tx.pending(&id))
    }

    fn decided_input<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<DecidedInput>, StoreError>> {
        let id = id.to_owned();
        self.read(move |tx| tx.decided(&id))
    }

    fn decide<'a>(
        &'a self,
        id: &'a str,
        decision: &'a Decision,
        by: &'a str,
    ) -> BoxFuture<'a, Result<PendingInput, StoreError>> {
        let (id, decision, by) = (id.to_owned(), decision.clone(), by.to_owned());
        self.write(move |tx, now| decide(tx, &id, decision.clone(), &by, now))
    }

    fn compact_journals(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.write(|tx, _| tx.compact_journals())
    }

    fn claim_schedule_tick<'a>(
        &'a self,
        name: &'a str,
        tick_ms: u64,
        run: Option<&'a DelayedRun>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let name = name.to_owned();
        let run = run.cloned();
        self.write(move |tx, now| claim_schedule_tick(tx, &name, tick_ms, run.as_ref(), now))
    }

    fn schedule_run<'a>(
        &'a self,
        run: &'a DelayedRun,
    ) -> BoxFuture<'a, Result<DelayedRunRecord, StoreError>> {
        let run = run.clone();
        self.write(move |tx, now| schedule_run(tx, &run, now))
    }

    fn delayed_run<'a>(
        &'a self,
        run: &'a RunId,
    ) -> BoxFuture<'a, Result<Option<DelayedRunRecord>, StoreError>> {
        let run = run.clone();
        self.read(move |tx| tx.delayed_run(&run))
    }

    fn take_due_runs<'a>(
        &'a self,
        hold: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DelayedRun>, StoreError>> {
        // Every instance asks every second, and almost always nothing is due: a read answers
        // that without a write transaction.
        let clock = Arc::clone(&self.clock);
        let due = self.read(move |tx| tx.due_delayed_runs(clock.now_ms(), 1));
        Box::pin(async move {
            if due.await?.is_empty() {
                return Ok(Vec::new());
            }
            // Made only now: a backend may start a write as soon as it is asked for.
            self.write(move |tx, now| take_due_runs(tx, hold, limit, now)).await
        })
    }

    fn defer_delayed_run<'a>(
        &'a self,
        run: &'a RunId,
        until_ms: u64,
        note: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (run, note) = (run.clone(), note.to_owned());
        self.write(move |tx, _| defer_delayed_run(tx, &run, until_ms, &note))
    }

    fn cancel_delayed_run<'a>(
        &'a self,
        run: &'a RunId,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Option<DelayedRunRecord>, StoreError>> {
        let (run, by) = (run.clone(), by.to_owned());
        self.write(move |tx, _| cancel_delayed_run(tx, &run, &by))
    }

    fn schedule_last_fire<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let name = name.to_owned();
        self.read(move |tx| tx.schedule_last_fire(&name))
    }

    fn session_summary<'a>(
        &'a self,
        session: &'a SessionId,
    ) -> BoxFuture<'a, Result<Option<SessionSummary>, StoreError>> {
        let session = session.clone();
        self.read(move |tx| tx.session_summary(&session))
    }

    fn list_sessions(&self, filter: SessionFilter) -> BoxFuture<'_, Result<Vec<SessionSummary>, StoreError>> {
        self.read(move |tx| tx.sessions(&filter))
    }

    fn delete_session<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<bool, StoreError>> {
        let session = session.clone();
        self.write(move |tx, _| {
            // What the agent remembers of a session it owns goes with it (a user's memory stays
            // with the user: `forget` erases it).
            let owner = keel_core::memory::owner_of(&session);
            if owner.starts_with("session:") {
                tx.delete_memory(&owner, None, None)?;
            }
            tx.delete_session(&session)
        })
    }

    fn write_memory<'a>(
        &'a self,
        owner: &'a str,
        kind: &'a str,
        write: MemoryWrite,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (owner, kind) = (owner.to_owned(), kind.to_owned());
        self.write(move |tx, now_ms| write_memory(tx, &owner, &kind, &write, now_ms))
    }

    fn load_memory<'a>(
        &'a self,
        owner: &'a str,
        kind: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Vec<MemoryItem>, StoreError>> {
        let (owner, kind) = (owner.to_owned(), kind.map(str::to_owned));
        self.read(move |tx| tx.memory_items(&owner, kind.as_deref()))
    }

    fn memory_owners(&self) -> BoxFuture<'_, Result<Vec<MemoryOwner>, StoreError>> {
        self.read(|tx| tx.memory_owners())
    }

    fn forget<'a>(
        &'a self,
        owner: &'a str,
        kind: Option<&'a str>,
        key: Option<&'a str>,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        let (owner, kind, key) = (owner.to_owned(), kind.map(str::to_owned), key.map(str::to_owned));
        self.write(move |tx, _| tx.delete_memory(&owner, kind.as_deref(), key.as_deref()))
    }

    fn event_log(&self) -> Option<Arc<dyn keel_core::EventLog>> {
        self.backend.event_log()
    }
}

/// Writes memory records: each merged with the record it replaces as `write.merge` says, then
/// the kind trimmed to its newest `keep_newest`.
fn write_memory(
    tx: &mut dyn Tx,
    owner: &str,
    kind: &str,
    write: &MemoryWrite,
    now_ms: u64,
) -> Result<(), StoreError> {
    // Checked before any write: a backend without rollback (memory) writes all or nothing too.
    if let Some((key, _)) = write.items.iter().find(|(key, _)| key.contains('\0')) {
        return Err(StoreError::Conflict(format!(
            "the memory key {key:?} holds a NUL character, which PostgreSQL cannot store; nothing was written"
        )));
    }
    for (key, value) in &write.items {
        let value = match &write.merge {
            MemoryMerge::Replace => value.clone(),
            MemoryMerge::KeepHigher(field) => match tx.memory_item(owner, kind, key)? {
                Some(old) if number(&old.value, field) > number(value, field) => old.value,
                _ => value.clone(),
            },
        };
        let item = MemoryItem { kind: kind.to_owned(), key: key.clone(), value, updated_ms: now_ms };
        tx.put_memory_item(owner, &item)?;
    }
    if let Some(keep) = write.keep_newest {
        for old in tx.memory_items(owner, Some(kind))?.into_iter().skip(keep) {
            tx.delete_memory(owner, Some(kind), Some(&old.key))?;
        }
    }
    Ok(())
}

/// A record's number in `field` (missing counts as nothing).
fn number(value: &serde_json::Value, field: &str) -> f64 {
    value.get(field).and_then(serde_json::Value::as_f64).unwrap_or(f64::NEG_INFINITY)
}
