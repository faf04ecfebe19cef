//! `keel run`: one turn of an agent, streamed to the terminal (or as JSON lines).

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use keel::{Agent, Decision, ErrorCode, PendingInput, PendingKind, RunHandle, RunId, RunState, StopReason};
use keel_core::{Event, EventLog, NewEvent, SessionId};

use super::RunArgs;
use super::exit;
use super::render::{HumanRenderer, JsonRenderer, Render};

pub(crate) fn run(mut args: RunArgs) -> std::io::Result<u8> {
    match args.input.as_deref() {
        Some("-") => match read_stdin()? {
            Some(text) => args.input = Some(text),
            None => {
                eprintln!("error: `-` reads the input from stdin, and stdin was empty");
                return Ok(2);
            }
        },
        // Piped in (`echo hi | keel run agent`); an empty stdin (`< /dev/null`) only continues.
        None if !std::io::stdin().is_terminal() => args.input = read_stdin()?,
        _ => {}
    }
    if args.after.is_some() || args.at.is_some() {
        return super::triggers::run_later(&args);
    }
    super::run_on_this_thread(async {
        let agent = match load_agent(&args.agent, args.model.as_deref(), &args.store).await? {
            Ok(agent) => agent,
            Err(code) => return Ok(code),
        };
        drive(&agent, &args).await
    })?
}

/// All of stdin, without its final line end; `None` when there is nothing but white space.
fn read_stdin() -> std::io::Result<Option<String>> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
    let text = text.trim_end_matches(['\n', '\r']);
    Ok((!text.trim().is_empty()).then(|| text.to_owned()))
}

/// The agent's spec, its diagnostics printed on stderr; `None` when it has errors.
pub(crate) fn load_spec(path: &std::path::Path) -> std::io::Result<Option<keel::AgentSpec>> {
    let loaded = keel_spec::load(path, &super::load_options());
    let mut stderr = std::io::stderr();
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    if loaded.spec.is_none() {
        writeln!(stderr, "the agent has errors; `keel check {}` lists them", path.display())?;
    }
    Ok(loaded.spec)
}

/// Loads an agent with its store, printing the spec's diagnostics; `Err(exit code)` when it
/// cannot be set up.
pub(crate) async fn load_agent(
    path: &std::path::Path,
    model: Option<&str>,
    store: &str,
) -> std::io::Result<Result<Agent, u8>> {
    let mut stderr = std::io::stderr();
    let Some(mut spec) = load_spec(path)? else { return Ok(Err(exit::INVALID_AGENT)) };
    if let Some(model) = model {
        spec.model = model.to_owned();
    }
    let Some(store) = super::open_store(store).await else { return Ok(Err(exit::INVALID_AGENT)) };
    Ok(match Agent::from_spec(spec, store).await {
        Ok(agent) => Ok(agent),
        Err(keel::LoadError::Setup(failure)) => {
            writeln!(stderr, "error[{}]: {}", failure.code, failure.message)?;
            Err(exit::INVALID_AGENT)
        }
        Err(error) => {
            writeln!(stderr, "error[{}]: {}", error.code(), error)?;
            Err(exit::INVALID_AGENT)
        }
    })
}

async fn drive(agent: &Agent, args: &RunArgs) -> std::io::Result<u8> {
    let context = Context { agent, args, by: keel::who("keel run") };
    // A turn of this session that nobody drives (its process died, or its approvals were
    // decided since) completes first, from its journal, so the new input sees a whole
    // conversation.
    let (code, resumed) = context.recover().await?;
    if code != exit::OK {
        return Ok(code);
    }
    let Some(input) = &args.input else {
        // Only continuing: say what the session still waits for, if anything.
        return context.explain_unfinished(resumed).await;
    };
    let handle = match agent.run(&args.session, input.as_str()) {
        Ok(handle) => handle,
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            return Ok(exit::for_failure(&failure));
        }
    };
    context.follow_through(handle).await
}

/// What following a run needs: the agent, the command's arguments (for the store and agent
/// paths that explain a pause), and who decides here.
pub(crate) struct Context<'a> {
    pub(crate) agent: &'a Agent,
    pub(crate) args: &'a RunArgs,
    /// Who this process is, for the record of its decisions.
    pub(crate) by: String,
}

/// What comes after a run paused and its inputs were decided.
enum Next {
    /// Follow it here.
    Follow(RunHandle),
    /// Another process drives it: wait for it there.
    Elsewhere(RunId, String),
}

impl Context<'_> {
    /// Finishes the session's runs that nobody drives, showing them. Returns the exit code of
    /// the first that did not end well (else [`exit::OK`]), and whether it resumed any run.
    pub(crate) async fn recover(&self) -> std::io::Result<(u8, bool)> {
        let handles = match self.agent.recover(Some(&self.args.session)).await {
            Ok(handles) => handles,
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                return Ok((exit::for_failure(&failure), false));
            }
        };
        let resumed = !handles.is_empty();
        for handle in handles {
            eprintln!("resuming run {} of session {}", handle.run_id(), self.args.session);
            let code = self.follow_through(handle).await?;
            // A run someone cancelled, now ended, leaves the session free for what comes next;
            // one the person here stopped with Ctrl-C stops the command.
            let cancelled_elsewhere = code == exit::INTERRUPTED && !CTRL_C.load(Ordering::SeqCst);
            if code != exit::OK && !cancelled_elsewhere {
                return Ok((code, resumed));
            }
        }
        Ok((exit::OK, resumed))
    }

    /// After recovery, without a new input: says what the session's unfinished run waits for
    /// (a human, or another process), if it has one, and that there was nothing to do when
    /// nothing was `resumed` either (`keel run agent` with the question forgotten).
    async fn explain_unfinished(&self, resumed: bool) -> std::io::Result<u8> {
        let session = self.args.session.as_str();
        let pending = match self.agent.pending(Some(session)).await {
            Ok(pending) => pending,
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                return Ok(exit::RUN_FAILED);
            }
        };
        if !pending.is_empty() {
            explain_pause(&pending, &self.args.store, &self.args.agent)?;
            return Ok(exit::AWAITING_INPUT);
        }
        let open = match keel::SessionId::new(session) {
            Ok(id) => self.agent.engine().open_runs(Some(&id)).await,
            Err(failure) => Err(failure),
        };
        match open {
            Ok(open) => match open.first() {
                Some(run) => {
                    let now = self.agent.engine().clock().now_ms();
                    eprintln!("error[{}]: {}", ErrorCode::SessionBusy, run.busy_message(now));
                    Ok(exit::BUSY)
                }
                None => {
                    if !resumed {
                        eprintln!(
                            "nothing to continue in session {session}: give an input to start a turn \
                             (keel run {} \"...\", or `-` to read it from stdin)",
                            self.args.agent.display()
                        );
                    }
                    Ok(exit::OK)
                }
            },
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                Ok(exit::for_failure(&failure))
            }
        }
    }

    /// Follows a run to its end. When it pauses for a human: on a terminal, asks and continues
    /// (noticing within a second when another process decides first); otherwise says how to
    /// decide and exits with [`exit::AWAITING_INPUT`].
    pub(crate) async fn follow_through(&self, handle: RunHandle) -> std::io::Result<u8> {
        let interactive =
            !self.args.json && std::io::stdin().is_terminal() && std::io::stderr().is_terminal();
        let mut next = Next::Follow(handle);
        loop {
            let (code, pending) = match next {
                Next::Follow(handle) => {
                    follow(handle, self.args.json, self.agent.store().event_log()).await?
                }
                Next::Elsewhere(run, why) => self.wait_elsewhere(&run, &why).await?,
            };
            if pending.is_empty() {
                return Ok(code);
            }
            if !interactive {
                explain_pause(&pending, &self.args.store, &self.args.agent)?;
                return Ok(exit::AWAITING_INPUT);
            }
            for input in &pending {
                match self.ask(input).await? {
                    Asked::Decided | Asked::Elsewhere => {}
                    Asked::Later => {
                        explain_pause(&pending, &self.args.store, &self.args.agent)?;
                        return Ok(exit::AWAITING_INPUT);
                    }
                }
            }
            next = self.continue_run(pending[0].run_id.clone()).await;
        }
    }

    /// Continues a run whose pause was decided: here, unless another process got to it first.
    async fn continue_run(&self, run: RunId) -> Next {
        let mut handle = self.agent.resume(run.clone());
        match handle.admitted().await {
            Err(failure) if failure.code == ErrorCode::RunLeased => Next::Elsewhere(run, failure.message),
            _ => Next::Follow(handle),
        }
    }

    /// Waits for a run another process drives to pause or end, and shows how it ended.
    async fn wait_elsewhere(&self, run: &RunId, why: &str) -> std::io::Result<(u8, Vec<PendingInput>)> {
        eprintln!("{why}; waiting for it to finish");
        let store = self.agent.store();
        let state = loop {
            match store.load_run(run).await {
                Ok(Some(record)) if record.state != RunState::Running => break record.state,
                Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(200)).await,
                Ok(None) => break RunState::Failed,
                Err(error) => {
                    eprintln!("error[{}]: {error}", error.code());
                    return Ok((exit::RUN_FAILED, Vec::new()));
                }
            }
        };
        let pending = match state {
            RunState::AwaitingInput => self.agent.pending(Some(&self.args.session)).await.unwrap_or_default(),
            _ => Vec::new(),
        };
        if state == RunState::Done
            && let Ok(messages) = store
                .load_messages(&keel::SessionId::new(&self.args.session).map_err(std::io::Error::other)?)
                .await
            && let Some(answer) = messages.iter().rev().find(|m| m.role == keel::Role::Assistant)
        {
            println!("{}", answer.text());
        }
        Ok(match state {
            RunState::Done | RunState::Running => (exit::OK, Vec::new()),
            RunState::AwaitingInput => (exit::AWAITING_INPUT, pending),
            RunState::Cancelled => (exit::INTERRUPTED, Vec::new()),
            RunState::Failed => (exit::RUN_FAILED, Vec::new()),
        })
    }

    /// Asks the human on the terminal about `input`, and records the answer. Gives up asking
    /// when another process decides first (it says who), and refuses, without changing
    /// anything, an answer typed after that.
    async fn ask(&self, input: &PendingInput) -> std::io::Result<Asked> {
        let prompt = match &input.kind {
            PendingKind::Approval { tool, input: tool_input } => {
                format!("Allow {tool} {tool_input}? [y/N, or a reason to refuse] ")
            }
            PendingKind::Question { question } => format!("{question}\n> "),
        };
        {
            let mut stderr = std::io::stderr().lock();
            write!(stderr, "{prompt}")?;
            stderr.flush()?;
        }
        let store = self.agent.store();
        let line = loop {
            tokio::select! {
                line = super::input::read_line() => break line?,
                () = tokio::time::sleep(DECIDED_ELSEWHERE_POLL) => {
                    if matches!(store.pending_input(&input.id).await, Ok(None)) {
                        let decided = store.decided_input(&input.id).await.ok().flatten();
                        self.decided_elsewhere(input, decided).await;
                        return Ok(Asked::Elsewhere);
                    }
                }
            }
        };
        let Some(line) = line else { return Ok(Asked::Later) };
        let decision = parse_answer(&input.kind, line.trim());
        match keel::record_decision(store.as_ref(), &input.id, decision, &self.by).await {
            Ok(_) => Ok(Asked::Decided),
            // Decided elsewhere a moment before: this answer changes nothing, and the run goes
            // on with the first decision.
            Err(failure) if failure.code == ErrorCode::NotPending => {
                eprintln!("error[{}]: {}; your answer changes nothing", failure.code, failure.message);
                Ok(Asked::Elsewhere)
            }
            Err(failure) => Err(std::io::Error::other(failure.to_string())),
        }
    }

    /// Says that `input` was decided by someone else, and refuses what was typed meanwhile.
    async fn decided_elsewhere(&self, input: &PendingInput, decided: Option<keel::DecidedInput>) {
        let how = match &decided {
            Some(decided) => {
                let when = keel_core::clock::relative(decided.at_ms, self.agent.engine().clock().now_ms());
                format!("{} elsewhere, by {} {when}", decided.outcome, decided.by)
            }
            None => "decided elsewhere".to_owned(),
        };
        eprintln!("\n{} was {how}; the run goes on", input.id);
        for typed in super::input::typed_already().await {
            if !typed.trim().is_empty() {
                eprintln!("your answer {:?} came too late: it changes nothing", typed.trim());
            }
        }
    }
}

/// Whether the person pressed Ctrl-C during this command.
static CTRL_C: AtomicBool = AtomicBool::new(false);

/// How often a prompt checks whether another process decided what it asks.
const DECIDED_ELSEWHERE_POLL: Duration = Duration::from_millis(250);

/// How asking went.
enum Asked {
    /// Decided here.
    Decided,
    /// Someone else decided (or cancelled) it first.
    Elsewhere,
    /// stdin ended: the decision is left for later.
    Later,
}

/// A typed answer as a decision: approvals take `y`/`yes`; anything but a plain no is the
/// reason for refusing, and the model sees it.
fn parse_answer(kind: &PendingKind, line: &str) -> Decision {
    if matches!(kind, PendingKind::Question { .. }) {
        return Decision::Answer(line.to_owned());
    }
    let lower = line.to_ascii_lowercase();
    if matches!(lower.as_str(), "y" | "yes") {
        Decision::Approve { note: None }
    } else {
        Decision::Reject { note: (!matches!(lower.as_str(), "" | "n" | "no")).then(|| line.to_owned()) }
    }
}

/// Says what the paused run waits for and how to decide it.
fn explain_pause(pending: &[PendingInput], store: &str, agent: &std::path::Path) -> std::io::Result<()> {
    let mut err = std::io::stderr().lock();
    writeln!(err, "paused: the run waits for a human")?;
    if store == "memory" {
        writeln!(
            err,
            "note: the memory store ends with this command, and the run with it; use \
             `--store sqlite:PATH` to decide later"
        )?;
        return Ok(());
    }
    let agent = agent.display();
    for input in pending {
        match &input.kind {
            PendingKind::Approval { tool, input: tool_input } => {
                writeln!(err, "  {}: {tool} {tool_input}", input.id)?;
                writeln!(err, "    keel approvals approve {} --store {store} --agent {agent}", input.id)?;
                writeln!(
                    err,
                    "    keel approvals reject {} --note \"why\" --store {store} --agent {agent}",
                    input.id
                )?;
            }
            PendingKind::Question { question } => {
                writeln!(err, "  {}: {question}", input.id)?;
                writeln!(
                    err,
                    "    keel approvals answer {} \"...\" --store {store} --agent {agent}",
                    input.id
                )?;
            }
        }
    }
    Ok(())
}

/// Shows a run as it goes (Ctrl-C cancels it); returns its exit code and, when it paused,
/// what it waits for. With a store that `keel serve` instances share (`log`), the run's events
/// also go to its event log, for their observers.
pub(crate) async fn follow(
    mut handle: RunHandle,
    json: bool,
    log: Option<Arc<dyn EventLog>>,
) -> std::io::Result<(u8, Vec<PendingInput>)> {
    let mut renderer: Box<dyn Render> =
        if json { Box::new(JsonRenderer::new()) } else { Box::new(HumanRenderer::new()) };
    let mut shared = log.map(SharedEvents::new);
    let mut interrupted = false;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            event = handle.next() => match event {
                Some(event) => {
                    if let Some(shared) = &mut shared {
                        shared.send(handle.run_id(), Some(&event));
                    }
                    renderer.event(&event)?;
                }
                None => break,
            },
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                CTRL_C.store(true, Ordering::SeqCst);
                handle.cancel();
            }
        }
    }
    if let Some(mut shared) = shared {
        shared.send(handle.run_id(), None);
        shared.finish().await;
    }
    renderer.finish()?;
    Ok(match handle.result().await {
        Ok(result) => match result.stopped {
            StopReason::Final | StopReason::StopCondition => (exit::OK, Vec::new()),
            StopReason::MaxTurns | StopReason::Budget => (exit::STOPPED_AT_LIMIT, Vec::new()),
            StopReason::Cancelled => (exit::INTERRUPTED, Vec::new()),
            StopReason::AwaitingInput => (exit::AWAITING_INPUT, result.pending),
        },
        Err(failure) => (exit::for_failure(&failure), Vec::new()),
    })
}

/// A run's events on their way to the store's shared event log.
struct SharedEvents {
    session: Option<SessionId>,
    events: tokio::sync::mpsc::UnboundedSender<NewEvent>,
    publisher: tokio::task::JoinHandle<()>,
}

impl SharedEvents {
    fn new(log: Arc<dyn EventLog>) -> SharedEvents {
        let (events, publisher) = keel_server::publish_to_log(log);
        SharedEvents { session: None, events, publisher }
    }

    /// Sends an event (`None`: the end of the run's stream). The first one, `run.start`, names
    /// the session.
    fn send(&mut self, run: &RunId, event: Option<&Event>) {
        if let Some(Event::RunStart { session_id, .. }) = event {
            self.session = Some(session_id.clone());
        }
        let Some(session) = &self.session else { return };
        let body = event.map(|event| Arc::from(keel_core::wire::event_to_json(event)));
        let _ = self.events.send(NewEvent { session: session.clone(), run: run.clone(), body });
    }

    /// Waits (a few seconds at most) until the events are stored.
    async fn finish(self) {
        drop(self.events);
        if tokio::time::timeout(Duration::from_secs(5), self.publisher).await.is_err() {
            tracing::warn!(
                "the shared event log is unreachable: observers on keel serve miss this run's last events"
            );
        }
    }
}
