//! Admission: which run of a session may go now, in this process.
//!
//! One session runs one run at a time. Across processes the store enforces it (a new run is
//! refused while another is unfinished); within a process, [`Sessions`] decides what a second
//! input does before it ever reaches the store, following the agent's `concurrency`: `reject`
//! refuses it, `queue` lines it up (at most [`Concurrency::MAX_QUEUED`]), `replace` cancels the
//! run in flight and lines it up behind the inputs already waiting, which it does not supersede:
//! each was accepted and runs in turn. A waiting input waits at most [`Concurrency::MAX_WAIT`]
//! (the driver gives up on it then). The session passes from one run to the next as its
//! [`SessionClaim`] drops.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::HashMap;
use keel_core::{Concurrency, ErrorCode, RunFailure, RunId, SessionId};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// The sessions with a run in flight in this process, and the inputs waiting for them.
#[derive(Default)]
pub(crate) struct Sessions {
    busy: Mutex<HashMap<SessionId, SessionSlot>>,
    /// Woken when a run gives its session up, for those waiting for a cancelled run to end
    /// (counted, so that a run ending with nobody waiting pays nothing).
    ended: tokio::sync::Notify,
    waiting_for_end: std::sync::atomic::AtomicUsize,
}

/// A busy session: its run in flight (to cancel it) and who waits for it.
struct SessionSlot {
    run: RunId,
    cancel: CancellationToken,
    waiting: VecDeque<Waiting>,
}

/// An input waiting for its session.
struct Waiting {
    run: RunId,
    handover: oneshot::Sender<SessionClaim>,
    cancel: CancellationToken,
}

/// Whether a run may start now, or must wait for the session.
pub(crate) enum Admission {
    /// The session is the run's.
    Now(SessionClaim),
    /// The session will be handed over when the runs before this one end.
    Wait(oneshot::Receiver<SessionClaim>),
}

/// Marks a session busy for as long as it lives; dropping it hands the session to the next
/// waiting run.
pub(crate) struct SessionClaim {
    sessions: Arc<Sessions>,
    session: SessionId,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<SessionId, SessionSlot>> {
        self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits `run` to `session` according to `mode`: now, after the runs before it (queue,
    /// replace), or not at all (`KEEL_SESSION_BUSY`). `cancel` is the run's token: a later
    /// `replace` cancels it.
    pub(crate) fn admit(
        self: &Arc<Self>,
        session: &SessionId,
        run: &RunId,
        cancel: &CancellationToken,
        mode: Concurrency,
    ) -> Result<Admission, RunFailure> {
        let mut busy = self.lock();
        // One lookup, whether the session is free (nearly always) or not.
        let slot = match busy.entry(session.clone()) {
            Entry::Vacant(free) => {
                free.insert(SessionSlot {
                    run: run.clone(),
                    cancel: cancel.clone(),
                    waiting: VecDeque::new(),
                });
                return Ok(Admission::Now(SessionClaim {
                    sessions: Arc::clone(self),
                    session: session.clone(),
                }));
            }
            Entry::Occupied(taken) => taken.into_mut(),
        };
        let busy_error = |why: &str| {
            RunFailure::new(
                ErrorCode::SessionBusy,
                format!("session {} already has a run in flight{why}", session.external()),
            )
        };
        let (handover, wait) = oneshot::channel();
        let waiting = Waiting { run: run.clone(), handover, cancel: cancel.clone() };
        match mode {
            Concurrency::Reject => {
                return Err(busy_error(&format!(
                    " ({}); wait for it to finish or cancel it (`keel cancel {}`)",
                    slot.run,
                    session.external()
                )));
            }
            Concurrency::Queue | Concurrency::Replace if slot.waiting.len() >= Concurrency::MAX_QUEUED => {
                return Err(busy_error(&format!(
                    " and {} inputs waiting, the most a session holds",
                    Concurrency::MAX_QUEUED
                )));
            }
            Concurrency::Queue => {}
            Concurrency::Replace => {
                // The run in flight gives way; the inputs waiting keep their place and run.
                slot.cancel.cancel();
            }
        }
        slot.waiting.push_back(waiting);
        Ok(Admission::Wait(wait))
    }

    /// Claims the session now for `run`, or says it is busy (re-driving a run never waits).
    pub(crate) fn claim(
        self: &Arc<Self>,
        session: &SessionId,
        run: &RunId,
        cancel: &CancellationToken,
    ) -> Result<SessionClaim, RunFailure> {
        match self.admit(session, run, cancel, Concurrency::Reject)? {
            Admission::Now(claim) => Ok(claim),
            Admission::Wait(_) => unreachable!("reject never waits"),
        }
    }

    /// Whether `session` has a run in flight here.
    pub(crate) fn is_busy(&self, session: &SessionId) -> bool {
        self.lock().contains_key(session)
    }

    /// Cancels `session`'s run in flight here and waits for it to end (a cancelled run stops at
    /// once: its model call or tool is abandoned); `None` when there was none, else whether this
    /// call is the one that cancelled it (`false`: it was being cancelled already).
    pub(crate) async fn cancel_and_wait(&self, session: &SessionId) -> Option<bool> {
        use std::sync::atomic::Ordering;
        let (cancelled, first) = match self.lock().get(session) {
            Some(slot) => {
                let first = !slot.cancel.is_cancelled();
                slot.cancel.cancel();
                (slot.run.clone(), first)
            }
            None => return None,
        };
        self.waiting_for_end.fetch_add(1, Ordering::SeqCst);
        loop {
            let ended = self.ended.notified();
            let still = self.lock().get(session).is_some_and(|slot| slot.run == cancelled);
            if !still {
                break;
            }
            ended.await;
        }
        self.waiting_for_end.fetch_sub(1, Ordering::SeqCst);
        Some(first)
    }

    /// Cancels the runs named, where they are in flight here (another process asked).
    pub(crate) fn cancel_runs(&self, runs: &[RunId]) {
        for slot in self.lock().values() {
            if runs.contains(&slot.run) {
                slot.cancel.cancel();
            }
        }
    }
}

impl Drop for SessionClaim {
    /// Hands the session to the next waiting run, or frees it.
    fn drop(&mut self) {
        let next = {
            let mut busy = self.sessions.lock();
            let Some(slot) = busy.get_mut(&self.session) else { return };
            match slot.waiting.pop_front() {
                Some(Waiting { run, handover, cancel }) => {
                    slot.run = run;
                    slot.cancel = cancel;
                    Some(handover)
                }
                None => {
                    busy.remove(&self.session);
                    None
                }
            }
        };
        if self.sessions.waiting_for_end.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.sessions.ended.notify_waiters();
        }
        // Outside the lock: a refused handover is dropped here, and hands over to the next in
        // line.
        if let Some(handover) = next {
            let claim = SessionClaim { sessions: Arc::clone(&self.sessions), session: self.session.clone() };
            drop(handover.send(claim));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: u8) -> (RunId, CancellationToken) {
        (RunId::from_suffix(&format!("r{n}")), CancellationToken::new())
    }

    #[test]
    fn replace_cancels_the_run_in_flight_and_keeps_the_inputs_already_waiting() {
        let sessions = Arc::new(Sessions::default());
        let session = SessionId::new("s").unwrap();
        let ((a, a_cancel), (b, b_cancel), (c, c_cancel)) = (run(1), run(2), run(3));
        let Ok(Admission::Now(a_claim)) = sessions.admit(&session, &a, &a_cancel, Concurrency::Replace)
        else {
            panic!("the first input runs at once");
        };
        let Ok(Admission::Wait(mut b_wait)) = sessions.admit(&session, &b, &b_cancel, Concurrency::Replace)
        else {
            panic!("the second waits");
        };
        assert!(a_cancel.is_cancelled(), "the run in flight gives way");
        let Ok(Admission::Wait(mut c_wait)) = sessions.admit(&session, &c, &c_cancel, Concurrency::Replace)
        else {
            panic!("the third waits");
        };
        assert!(!b_cancel.is_cancelled(), "an input already waiting is not superseded");
        drop(a_claim);
        let b_claim = b_wait.try_recv().expect("the session goes to the second input");
        assert!(c_wait.try_recv().is_err(), "the third waits for the second");
        // Now the second is in flight: a fourth cancels it.
        let (d, d_cancel) = run(4);
        assert!(matches!(
            sessions.admit(&session, &d, &d_cancel, Concurrency::Replace),
            Ok(Admission::Wait(_))
        ));
        assert!(b_cancel.is_cancelled() && !c_cancel.is_cancelled());
        drop(b_claim);
        assert!(c_wait.try_recv().is_ok());
    }

    #[test]
    fn a_session_holds_a_bounded_line_in_every_mode() {
        let sessions = Arc::new(Sessions::default());
        let session = SessionId::new("s").unwrap();
        let (first, cancel) = run(0);
        let _claim = sessions.admit(&session, &first, &cancel, Concurrency::Queue).unwrap();
        let mut waits = Vec::new();
        for n in 1..=Concurrency::MAX_QUEUED as u8 {
            let (id, cancel) = run(n);
            waits.push(sessions.admit(&session, &id, &cancel, Concurrency::Replace).unwrap());
        }
        let (extra, cancel) = run(99);
        let refused = sessions.admit(&session, &extra, &cancel, Concurrency::Replace).err().unwrap();
        assert_eq!(refused.code, ErrorCode::SessionBusy);
    }
}
