//! The run loop as a deterministic state machine: inputs in, actions out.
//!
//! The [`Machine`] owns one run's state: the transcript, the turn counter, usage, budgets and the
//! tool calls of the current turn. It never performs I/O. The driver (`keel-runtime`) feeds it
//! [`Input`]s (a model reply, a tool outcome, a cancel) and executes the [`Action`]s it returns
//! (persist messages, emit events, call the model, call tools, finish).
//!
//! Because the machine's only sources of change are its inputs, a run re-driven from its journal
//! (the same inputs, replayed) produces the same actions, the same call ids and the same
//! transcript. Nothing here reads a clock or a random number.
//!
//! Rules the machine enforces:
//! - budgets are checked before each step: `max_turns` and `max_total_tokens` before a model
//!   call, `max_tool_calls` before each tool call;
//! - tool inputs are validated against the tool's JSON Schema before the call; an unknown tool,
//!   an invalid input or a spent budget becomes an error result for the model, not a failure;
//! - the tool calls of one turn run in parallel, their results are kept in call order, and
//!   every call gets a result before the model is called again (even on cancel), so the
//!   transcript never has a dangling call;
//! - tool outputs over `max_tool_output_chars` are cut with a visible marker;
//! - a final answer that does not match `output.schema` gets `output.max_repairs` repair turns,
//!   each showing the model what was wrong;
//! - with `compaction`, when the model would see more than `max_messages` messages, older ones
//!   are summarised first (an `llm:compact:N` model call) and the model sees the brief plus the
//!   recent tail, which never starts with a tool result (its call stays with it). A model call
//!   refused as too long for the context window is answered by one compaction, then the turn is
//!   made again;
//! - with `memory`, memory steps come before the first turn (what they recall joins the run's
//!   instructions) and after the answer, before `run.done` (what the run established is kept).

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::agent::{AgentDef, LimitOverrides, Limits};
use crate::error::{ErrorCode, RunFailure};
use crate::event::{Event, StopReason, Usage};
use crate::human::{Decision, PendingKind, pending_id};
use crate::ids::{RunId, SessionId, StepName};
use crate::journal::JournaledReply;
use crate::loop_control::{TurnContext, TurnPlan};
use crate::memory::{MemoryOutcome, MemoryRequest, RetrievalMode};
use crate::message::{Message, Part, Role, ToolCall, ToolResult, output_to_text};
use crate::provider::{CallPurpose, ModelRequest, ProviderError, ProviderErrorKind};
use crate::tool::ToolSpec;
use crate::tool::{Dispatch, ToolError, ToolOutcome};

pub mod compose;
#[cfg(test)]
mod tests;

/// What the driver tells the machine.
#[derive(Clone, Debug)]
pub enum Input {
    /// Begin the run (the input message was given to [`Machine::new`]).
    Start,
    /// The model call of the current turn returned (as journaled: the transcript keeps its
    /// message, shared, unless the run must change it).
    ModelReply(JournaledReply),
    /// The model call of the current turn failed for good (retries are the driver's job).
    ModelFailed(ProviderError),
    /// A tool call finished.
    ToolDone {
        /// The call id.
        call_id: String,
        /// Its outcome, before the output cap.
        outcome: ToolOutcome,
        /// How long it ran, when it ran now (`None`: its result came from the journal).
        duration: Option<Duration>,
    },
    /// A human decided a pending approval or question of the current turn.
    Decision {
        /// The call the decision is for.
        call_id: String,
        /// The decision.
        decision: Decision,
    },
    /// The memory step asked for finished (its failure is logged, never the run's).
    MemoryDone(MemoryOutcome),
    /// Stop the run now.
    Cancel,
    /// End the run as failed, now, without running anything more: every open call gets an
    /// error result saying why (so the transcript has no dangling call), then `run.error`. For
    /// a run that cannot go on (it kept killing its process at one step).
    Abort(RunFailure),
}

/// What the machine asks the driver to do, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send an event to the run's observers.
    Emit(Event),
    /// Store `transcript()[first_position..first_position + count]` at those session positions.
    Persist {
        /// The session position of the first message.
        first_position: usize,
        /// How many messages.
        count: usize,
    },
    /// Call the model (see [`Machine::model_request`]) and feed back [`Input::ModelReply`] or
    /// [`Input::ModelFailed`]. A failure is journaled like a reply: the run may go on from it.
    CallModel {
        /// The step (`llm:turn:N`, or `llm:compact:N` for a compaction brief).
        step: StepName,
    },
    /// Call a tool and feed back [`Input::ToolDone`]. Several in one batch run in parallel.
    CallTool {
        /// The step (`tool:NAME:CALL_ID`).
        step: StepName,
        /// The call, its input already validated.
        call: ToolCall,
    },
    /// The call waits for a human: feed back [`Input::Decision`] once there is one (from the
    /// journal, or after the run paused and a human decided). An approved call then comes back
    /// as [`Action::CallTool`].
    AwaitHuman {
        /// The step the decision is journaled as (`approval:CALL_ID` or `question:CALL_ID`).
        step: StepName,
        /// The pending input's id (see [`crate::human::pending_id`]).
        id: String,
        /// The call.
        call_id: String,
        /// What is asked.
        kind: PendingKind,
    },
    /// Carry out a memory step (see [`crate::memory`]) and feed back [`Input::MemoryDone`].
    Memory {
        /// The step (`memory:recall`, `memory:traverse`, `memory:retrieve`, `memory:episode`,
        /// `memory:extract`).
        step: StepName,
        /// What to do.
        request: MemoryRequest,
    },
    /// The run is over.
    Finish(RunOutcome),
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum RunOutcome {
    /// It finished (see `stopped` for why).
    Done {
        /// The final text.
        text: String,
        /// The structured output.
        output: Option<Value>,
        /// Why it stopped.
        stopped: StopReason,
        /// Usage summed over the run.
        usage: Usage,
    },
    /// It failed.
    Failed(RunFailure),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    NotStarted,
    /// Waiting for a memory step: before the first turn, or after the answer.
    Remembering,
    AwaitingModel,
    /// Waiting for a compaction brief; the turn is made once it is in.
    Compacting,
    AwaitingTools,
    Finished,
}

/// A tool call of the current turn. The call itself is in the turn's assistant message.
#[derive(Debug)]
struct PendingCall {
    call_id: String,
    /// The outcome after the output cap; `None` while the call runs or waits.
    result: Option<ToolOutcome>,
    /// What the call waits for before it can run (or, for a question, before it has a result).
    human: Option<HumanWait>,
    /// The script of a `compose` call, while its steps run.
    compose: Option<compose::Plan>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HumanWait {
    Approval,
    Question,
}

/// One run's loop state. See the module docs.
pub struct Machine {
    agent: Arc<AgentDef>,
    run_id: RunId,
    session_id: SessionId,
    transcript: Vec<Arc<Message>>,
    /// Where this run's messages start in the transcript.
    run_start: usize,
    /// Every call id of this run: a step name must identify one call, even when a model reuses
    /// an id from an earlier turn.
    call_ids: std::collections::HashSet<String>,
    call_base: u64,
    turns: u32,
    usage: Usage,
    tool_calls: u32,
    budget_spent: bool,
    phase: Phase,
    calls: Vec<PendingCall>,
    /// The run's limits: the agent's, with the run's overrides applied.
    limits: Limits,
    /// What the model sees once the transcript holds a compaction brief: the latest brief (as a
    /// user message), then the transcript from the brief's first kept message on (briefs left
    /// out). `None`: the model sees the transcript itself (no copy of it is kept).
    compacted: Option<Vec<Arc<Message>>>,
    /// Repair turns used for answers that did not match `output.schema`.
    repairs: u32,
    /// Compactions of this run so far (numbers the `llm:compact:N` steps).
    compactions: u32,
    /// Whether a context-too-long failure was already answered by a compaction (once a run).
    forced_compaction: bool,
    /// The compaction being written.
    compaction: Option<CompactionJob>,
    /// What `prepare_turn` decided for the current turn.
    plan: TurnPlan,
    /// The tools offered this turn, when `prepare_turn` narrowed them.
    turn_tools: Option<Vec<ToolSpec>>,
    /// Memory steps still to make, in order, and what comes once they are made.
    memory_steps: std::collections::VecDeque<MemoryRequest>,
    after_memory: Option<AfterMemory>,
    /// The agent's instructions with what memory recalled for this run, once it did.
    remembered_instructions: Option<String>,
    /// Whether the run's memory was written (its answer summarised and extracted).
    memorized: bool,
    /// Whether nobody listens to the run's events: then none is built ([`Machine::mute_events`]).
    events_muted: bool,
}

/// What the machine does once its memory steps are made.
#[derive(Debug)]
enum AfterMemory {
    /// Start the turns, with the context recalled.
    Turns(Vec<String>),
    /// Finish as it was about to.
    Finish { stopped: StopReason, text: String, output: Option<Value> },
}

/// A compaction brief being written.
#[derive(Debug)]
struct CompactionJob {
    /// The session position of the first message kept as it is.
    first_kept: usize,
    /// How many messages the brief replaces, and how many the model keeps seeing.
    summarized: usize,
    kept: usize,
    /// The request's one message: the conversation to summarise, as text.
    messages: Vec<Arc<Message>>,
    /// How many briefs the session had before (the request's `call_index`).
    index: u64,
    /// Whether a context-too-long failure asked for it (a failure then fails the run).
    forced: bool,
}

/// The instructions of a compaction call.
const COMPACT_INSTRUCTIONS: &str = "You condense conversations between a user and an AI assistant that uses tools. \
Write a brief that lets the assistant continue the conversation without the original messages: \
the user's goals and requests, decisions made, facts learned (names, numbers, ids, dates), tool \
results that still matter, and what is still open. Be specific and concise; plain sentences or \
short bullet points, no preamble.";

/// The longest rendering of one message in a compaction request, in characters.
const COMPACT_MESSAGE_CHARS: usize = 2_000;
/// The longest compaction request, in characters (the oldest messages give way first).
const COMPACT_REQUEST_CHARS: usize = 120_000;

impl Machine {
    /// The agent definition this run uses (the engine's when the run started or resumed).
    pub fn agent(&self) -> &Arc<AgentDef> {
        &self.agent
    }

    /// A machine for a run of `agent` continuing `history` with `input`.
    ///
    /// `call_base` is the number of model calls the session made before this run (it makes
    /// [`ModelRequest::call_index`]).
    pub fn new(
        agent: Arc<AgentDef>,
        run_id: RunId,
        session_id: SessionId,
        history: Vec<Arc<Message>>,
        input: Arc<Message>,
        call_base: u64,
    ) -> Machine {
        let mut transcript = history;
        let run_start = transcript.len();
        if let Some(answers) = answer_dangling_calls(&transcript) {
            transcript.push(Arc::new(answers));
        }
        transcript.push(input);
        let compacted = compacted_view(&transcript);
        let limits = agent.limits.clone();
        Machine {
            limits,
            compacted,
            repairs: 0,
            compactions: 0,
            forced_compaction: false,
            compaction: None,
            plan: TurnPlan::default(),
            turn_tools: None,
            memory_steps: std::collections::VecDeque::new(),
            after_memory: None,
            remembered_instructions: None,
            memorized: false,
            events_muted: false,
            agent,
            run_id,
            session_id,
            transcript,
            run_start,
            call_ids: std::collections::HashSet::new(),
            call_base,
            turns: 0,
            usage: Usage::default(),
            tool_calls: 0,
            budget_spent: false,
            phase: Phase::NotStarted,
            calls: Vec::new(),
        }
    }

    /// The same machine with the run's own limits (the agent's, with `overrides` applied).
    #[must_use]
    pub fn with_overrides(mut self, overrides: &LimitOverrides) -> Machine {
        self.limits = overrides.apply(&self.agent.limits);
        self
    }

    /// Whether the machine builds [`Action::Emit`] events (it does unless muted). A caller that
    /// only awaits the run's outcome mutes them: building an event clones what it shows (a
    /// tool's input and output, the answer), a cost nobody would see. Every other action is the
    /// same either way.
    pub fn mute_events(&mut self, muted: bool) {
        self.events_muted = muted;
    }

    /// The run's limits: the agent's, with the run's overrides applied.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The whole transcript: the session's history, then this run's messages.
    pub fn transcript(&self) -> &[Arc<Message>] {
        &self.transcript
    }

    /// What the model sees of the transcript (after compaction).
    pub fn context(&self) -> &[Arc<Message>] {
        self.compacted.as_deref().unwrap_or(&self.transcript)
    }

    /// Appends a message to the transcript and to what the model sees.
    fn push(&mut self, message: Message) {
        self.push_shared(Arc::new(message));
    }

    fn push_shared(&mut self, message: Arc<Message>) {
        if let Some(compacted) = &mut self.compacted
            && message.summary().is_none()
        {
            compacted.push(Arc::clone(&message));
        }
        self.transcript.push(message);
    }

    /// Usage summed over the run so far.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// The number of the current turn (the model call in progress, or the last one made),
    /// as `turn.start` showed it.
    pub fn turn(&self) -> u32 {
        self.turns.saturating_sub(1)
    }

    /// Whether the run is over.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// The request for the model call the machine is waiting for: the turn's, or the
    /// compaction brief's.
    pub fn model_request(&self, attempt: u32) -> ModelRequest<'_> {
        let agent_model = model_name(&self.agent.model);
        if let (Phase::Compacting, Some(job)) = (self.phase, &self.compaction) {
            let model = self.agent.loop_control.compaction.as_ref().and_then(|c| c.model.as_deref());
            return ModelRequest {
                model: model.map_or(agent_model, model_name),
                instructions: COMPACT_INSTRUCTIONS,
                messages: &job.messages,
                tools: &[],
                output_schema: None,
                call_index: job.index,
                attempt,
                tool_choice: None,
                purpose: CallPurpose::Compact,
            };
        }
        ModelRequest {
            model: self.plan.model.as_deref().map_or(agent_model, model_name),
            instructions: self
                .plan
                .instructions
                .as_deref()
                .or(self.remembered_instructions.as_deref())
                .unwrap_or(&self.agent.instructions),
            messages: self.plan.messages.as_deref().unwrap_or(self.context()),
            tools: self.turn_tools.as_deref().unwrap_or(self.agent.tools.specs()),
            output_schema: self.agent.output_schema.as_ref().map(|s| s.schema()),
            call_index: self.call_base + u64::from(self.turns.saturating_sub(1)),
            attempt,
            tool_choice: self.plan.tool_choice.as_ref(),
            purpose: CallPurpose::Turn,
        }
    }

    /// Feeds one input and returns the actions it causes, in order.
    pub fn step(&mut self, input: Input) -> Vec<Action> {
        let mut actions = Vec::new();
        self.step_into(input, &mut actions);
        actions
    }

    /// [`Machine::step`], appending the actions to `actions`: a driver that keeps one vector
    /// for the whole run allocates it once rather than at every step.
    pub fn step_into(&mut self, input: Input, actions: &mut Vec<Action>) {
        match (self.phase, input) {
            (Phase::Finished, _) => {}
            (_, Input::Cancel) => self.cancel(actions),
            (_, Input::Abort(failure)) => self.abort(failure, actions),
            (Phase::NotStarted, Input::Start) => {
                if !self.events_muted {
                    actions.push(Action::Emit(Event::RunStart {
                        run_id: self.run_id.clone(),
                        session_id: self.session_id.clone(),
                    }));
                }
                self.persist_last(actions, self.transcript.len() - self.run_start);
                self.recall(actions);
            }
            (Phase::Remembering, Input::MemoryDone(outcome)) => self.on_memory_done(outcome, actions),
            (Phase::AwaitingModel, Input::ModelReply(reply)) => self.on_reply(reply, actions),
            (Phase::AwaitingModel, Input::ModelFailed(error)) => {
                if error.kind == ProviderErrorKind::ContextTooLong
                    && !self.forced_compaction
                    && self.agent.loop_control.compaction.is_some()
                {
                    self.forced_compaction = true;
                    if self.start_compaction(true, actions) {
                        return;
                    }
                }
                let failure = RunFailure::new(error.code(), format!("the model call failed: {error}"));
                self.fail(failure, actions);
            }
            (Phase::Compacting, Input::ModelReply(reply)) => self.on_compacted(reply, actions),
            (Phase::Compacting, Input::ModelFailed(error)) => self.on_compaction_failed(&error, actions),
            (Phase::AwaitingTools, Input::ToolDone { call_id, outcome, duration }) => {
                self.on_tool_done(&call_id, outcome, duration, actions);
            }
            (Phase::AwaitingTools, Input::Decision { call_id, decision }) => {
                self.on_decision(&call_id, decision, actions);
            }
            (phase, input) => {
                let failure = RunFailure::new(
                    ErrorCode::Internal,
                    format!("the run loop got {input:?} while in phase {phase:?}; please report this bug"),
                );
                self.fail(failure, actions);
            }
        }
    }

    fn persist_last(&self, actions: &mut Vec<Action>, count: usize) {
        actions.push(Action::Persist { first_position: self.transcript.len() - count, count });
    }

    /// Before the first turn: what memory holds for the run (`memory:recall`,
    /// `memory:traverse`, `memory:retrieve` for each knowledge in `inject` mode), or the first
    /// turn at once without memory.
    fn recall(&mut self, actions: &mut Vec<Action>) {
        let settings = &self.agent.memory.settings;
        if let Some(episodic) = settings.episodic {
            self.memory_steps.push_back(MemoryRequest::Recall { limit: episodic.recall });
        }
        if let Some(graph) = settings.graph {
            let text = self.transcript.last().map(|m| m.text()).unwrap_or_default();
            self.memory_steps.push_back(MemoryRequest::Traverse { text, graph });
        }
        for knowledge in settings.knowledge.iter().filter(|k| k.mode == RetrievalMode::Inject) {
            let query = self.transcript.last().map(|m| m.text()).unwrap_or_default();
            self.memory_steps.push_back(MemoryRequest::Retrieve { skill: knowledge.skill.clone(), query });
        }
        if self.memory_steps.is_empty() {
            return self.next_turn(actions);
        }
        self.after_memory = Some(AfterMemory::Turns(Vec::new()));
        self.next_memory_step(actions);
    }

    /// Asks for the next queued memory step, or goes on once there is none.
    fn next_memory_step(&mut self, actions: &mut Vec<Action>) {
        if let Some(request) = self.memory_steps.pop_front() {
            self.phase = Phase::Remembering;
            let step = StepName::Memory(request.name());
            actions.push(Action::Memory { step, request });
            return;
        }
        match self.after_memory.take() {
            Some(AfterMemory::Turns(context)) => {
                if !context.is_empty() {
                    self.remembered_instructions =
                        Some(format!("{}\n\n{}", self.agent.instructions, context.join("\n\n")));
                }
                self.next_turn(actions);
            }
            Some(AfterMemory::Finish { stopped, text, output }) => {
                self.finish_with_text(stopped, text, output, actions);
            }
            None => {
                let failure =
                    RunFailure::new(ErrorCode::Internal, "memory steps ended with nothing to go on to");
                self.fail(failure, actions);
            }
        }
    }

    /// A memory step is done: a recall's context is kept for the turns; a failure only
    /// leaves its part out.
    fn on_memory_done(&mut self, outcome: MemoryOutcome, actions: &mut Vec<Action>) {
        // The memory model's tokens count like a turn's (a failed call's are not known).
        if let Some(usage) = outcome.as_ref().ok().and_then(crate::memory::outcome_usage) {
            self.usage.add(usage);
            if !self.events_muted {
                actions.push(Action::Emit(Event::Usage(usage)));
            }
        }
        if let (Ok(value), Some(AfterMemory::Turns(context))) = (&outcome, &mut self.after_memory)
            && let Some(text) = value.get("context").and_then(Value::as_str).filter(|t| !t.trim().is_empty())
        {
            context.push(text.to_owned());
        }
        self.next_memory_step(actions);
    }

    fn next_turn(&mut self, actions: &mut Vec<Action>) {
        if let Some(stopped) = self.turns_spent() {
            return self.finish(stopped, None, actions);
        }
        if self.start_compaction(false, actions) {
            return;
        }
        self.start_turn(actions);
    }

    /// Why no further model call may be made, if none may.
    fn turns_spent(&self) -> Option<StopReason> {
        if self.turns >= self.limits.max_turns {
            return Some(StopReason::MaxTurns);
        }
        self.limits
            .max_total_tokens
            .is_some_and(|max| self.usage.total() >= max)
            .then_some(StopReason::Budget)
    }

    /// Makes the next model call, as `prepare_turn` (if any) shapes it.
    fn start_turn(&mut self, actions: &mut Vec<Action>) {
        let turn = self.turns;
        self.plan = match &self.agent.loop_control.hooks.prepare_turn {
            Some(prepare) => prepare(&TurnContext {
                run_id: &self.run_id,
                session_id: &self.session_id,
                turn,
                messages: self.context(),
                tools: self.agent.tools.specs(),
                usage: self.usage,
            }),
            None => TurnPlan::default(),
        };
        self.turn_tools = self.plan.tools.as_ref().map(|names| {
            self.agent.tools.specs().iter().filter(|spec| names.contains(&spec.name)).cloned().collect()
        });
        self.turns += 1;
        self.phase = Phase::AwaitingModel;
        if !self.events_muted {
            actions.push(Action::Emit(Event::TurnStart { turn }));
        }
        actions.push(Action::CallModel { step: StepName::ModelTurn(turn) });
    }

    /// Starts a compaction when one is due (or `forced`, after a context-too-long failure) and
    /// possible; returns whether it did.
    fn start_compaction(&mut self, forced: bool, actions: &mut Vec<Action>) -> bool {
        let Some(config) = &self.agent.loop_control.compaction else { return false };
        if !forced && self.context().len() <= config.max_messages {
            return false;
        }
        // The transcript positions of what the model sees as it is: from the latest brief's
        // first kept message on, briefs left out.
        let latest = self.transcript.iter().rev().find_map(|m| m.summary());
        let first = latest.map_or(0, |(_, first_kept)| position(first_kept, self.transcript.len()));
        let brief = latest.map(|(text, _)| text.to_owned());
        let live: Vec<usize> =
            (first..self.transcript.len()).filter(|&i| self.transcript[i].summary().is_none()).collect();
        let keep = if forced { config.keep_recent.min(live.len() / 2) } else { config.keep_recent };
        let mut start = live.len().saturating_sub(keep);
        // The kept tail never starts with tool results: their calls would be in the brief.
        while start < live.len() && self.transcript[live[start]].role == Role::Tool {
            start += 1;
        }
        if start == 0 || start >= live.len() {
            return false;
        }
        let first_kept = live[start];
        let text = render_for_brief(brief.as_deref(), live[..start].iter().map(|&i| &*self.transcript[i]));
        let index = self.transcript.iter().filter(|m| m.summary().is_some()).count() as u64;
        self.compaction = Some(CompactionJob {
            first_kept,
            summarized: start,
            kept: live.len() - start,
            messages: vec![Arc::new(Message::user(text))],
            index,
            forced,
        });
        let step = StepName::Compact(self.compactions);
        self.compactions += 1;
        self.phase = Phase::Compacting;
        actions.push(Action::CallModel { step });
        true
    }

    fn on_compacted(&mut self, reply: JournaledReply, actions: &mut Vec<Action>) {
        self.usage.add(reply.usage);
        if !self.events_muted {
            actions.push(Action::Emit(Event::Usage(reply.usage)));
        }
        let job = self.compaction.take().expect("a compaction is in progress");
        let text = reply.message.text();
        let text = text.trim();
        if text.is_empty() {
            let error = ProviderError::new(ProviderErrorKind::BadResponse, "the model wrote an empty brief");
            self.compaction = Some(job);
            return self.on_compaction_failed(&error, actions);
        }
        self.push(Message {
            role: Role::User,
            parts: vec![Part::Summary { text: text.to_owned(), first_kept: job.first_kept as u64 }],
        });
        self.persist_last(actions, 1);
        self.compacted = compacted_view(&self.transcript);
        if !self.events_muted {
            actions.push(Action::Emit(Event::ContextCompacted {
                summarized: job.summarized as u64,
                kept: job.kept as u64,
            }));
        }
        self.after_compaction(job.forced, actions);
    }

    /// A compaction that failed leaves the conversation as it was: the turn is tried anyway,
    /// unless the compaction was the answer to a context-too-long failure.
    fn on_compaction_failed(&mut self, error: &ProviderError, actions: &mut Vec<Action>) {
        let job = self.compaction.take().expect("a compaction is in progress");
        if job.forced {
            let failure = RunFailure::new(
                ErrorCode::ProviderContextTooLong,
                format!(
                    "the conversation does not fit the model's context window, and compacting it failed: {error}"
                ),
            );
            return self.fail(failure, actions);
        }
        self.after_compaction(false, actions);
    }

    fn after_compaction(&mut self, forced: bool, actions: &mut Vec<Action>) {
        // After a forced compaction the failed turn counts: the budgets are checked again.
        if let Some(stopped) = self.turns_spent().filter(|_| forced) {
            return self.finish(stopped, None, actions);
        }
        self.start_turn(actions);
    }

    fn on_reply(&mut self, reply: JournaledReply, actions: &mut Vec<Action>) {
        let turn = self.turns - 1;
        self.usage.add(reply.usage);
        if !self.events_muted {
            actions.push(Action::Emit(Event::Usage(reply.usage)));
        }

        // The message stays shared with the journal entry unless an id or a repair changes it
        // (then it is copied first: the journal keeps what the model wrote).
        let mut message = reply.message;
        normalize_call_ids(&mut message, self.call_base + u64::from(turn), &mut self.call_ids);
        if let Some(repair) = &self.agent.loop_control.hooks.repair_tool_call {
            for index in 0..message.parts.len() {
                let Part::ToolCall(call) = &message.parts[index] else { continue };
                let Some(error) = self.refusal(call) else { continue };
                if let Some(fixed) = repair(call, &error) {
                    // The call keeps its id: its result must answer it.
                    let fixed = ToolCall { call_id: call.call_id.clone(), ..fixed };
                    Arc::make_mut(&mut message).parts[index] = Part::ToolCall(fixed);
                }
            }
        }
        self.push_shared(message);
        self.persist_last(actions, 1);

        let message = Arc::clone(self.transcript.last().expect("just pushed"));
        if message.tool_calls().next().is_none() {
            let text = message.text();
            return self.final_answer(text, actions);
        }

        self.phase = Phase::AwaitingTools;
        let mut pending = std::mem::take(&mut self.calls);
        pending.clear();
        let max_tool_calls = self.limits.max_tool_calls;
        for call in message.tool_calls() {
            if !self.events_muted {
                actions.push(Action::Emit(Event::ToolStart {
                    call_id: call.call_id.clone(),
                    name: call.name.clone(),
                    input: call.input.clone(),
                }));
            }
            let refusal = self.refusal(call).or_else(|| {
                max_tool_calls.is_some_and(|max| self.tool_calls >= max).then(|| {
                    self.budget_spent = true;
                    ToolError::with_code(
                        ErrorCode::ToolBudgetExhausted,
                        format!(
                            "not run: this run already made {} tool calls, its limit (`limits.max_tool_calls`)",
                            self.tool_calls
                        ),
                        false,
                    )
                })
            });
            match refusal {
                Some(error) => {
                    if !self.events_muted {
                        actions.push(Action::Emit(outcome_event(&call.call_id, &Err(error.clone()), None)));
                    }
                    pending.push(PendingCall {
                        call_id: call.call_id.clone(),
                        result: Some(Err(error)),
                        human: None,
                        compose: None,
                    });
                }
                None => match self.agent.tools.dispatch(&call.name, &call.input) {
                    Dispatch::Compose => {
                        let mut entry = PendingCall {
                            call_id: call.call_id.clone(),
                            result: None,
                            human: None,
                            compose: None,
                        };
                        match compose::Plan::parse(&call.input, &self.agent.tools) {
                            Ok(mut plan) => match self.compose_advance(&call.call_id, &mut plan, actions) {
                                Some(outcome) => {
                                    entry.result =
                                        Some(self.compose_finished(&call.call_id, outcome, actions))
                                }
                                None => entry.compose = Some(plan),
                            },
                            Err(error) => {
                                entry.result = Some(self.compose_finished(&call.call_id, Err(error), actions))
                            }
                        }
                        pending.push(entry);
                    }
                    dispatch => {
                        self.tool_calls += 1;
                        let human = if dispatch == Dispatch::AskHuman {
                            let question = match call.input.get("question") {
                                Some(Value::String(question)) => question.clone(),
                                Some(other) => other.to_string(),
                                None => call.input.to_string(),
                            };
                            let step = StepName::Question(call.call_id.clone());
                            let id = pending_id(&step, &self.run_id);
                            let kind = PendingKind::Question { question };
                            actions.push(Action::AwaitHuman {
                                step,
                                id,
                                call_id: call.call_id.clone(),
                                kind,
                            });
                            Some(HumanWait::Question)
                        } else if dispatch == Dispatch::Approval {
                            let step = StepName::Approval(call.call_id.clone());
                            let id = pending_id(&step, &self.run_id);
                            let kind =
                                PendingKind::Approval { tool: call.name.clone(), input: call.input.clone() };
                            actions.push(Action::AwaitHuman {
                                step,
                                id,
                                call_id: call.call_id.clone(),
                                kind,
                            });
                            Some(HumanWait::Approval)
                        } else {
                            let step =
                                StepName::Tool { name: call.name.clone(), call_id: call.call_id.clone() };
                            actions.push(Action::CallTool { step, call: call.clone() });
                            None
                        };
                        pending.push(PendingCall {
                            call_id: call.call_id.clone(),
                            result: None,
                            human,
                            compose: None,
                        });
                    }
                },
            }
        }
        self.calls = pending;
        self.complete_turn_if_done(actions);
    }

    /// Why a call cannot run as the model wrote it: an unknown tool (or one not offered this
    /// turn), arguments that are not JSON, or input that does not match the tool's schema.
    fn refusal(&self, call: &ToolCall) -> Option<ToolError> {
        let offered = |name: &str| match &self.turn_tools {
            Some(specs) => specs.iter().any(|spec| spec.name == name),
            None => self.agent.tools.contains(name),
        };
        if !offered(&call.name) {
            let available: Vec<&str> = match &self.turn_tools {
                Some(specs) => specs.iter().map(|spec| spec.name.as_str()).collect(),
                None => self.agent.tools.names().collect(),
            };
            let this_turn = if self.turn_tools.is_some() && self.agent.tools.contains(&call.name) {
                " this turn"
            } else {
                ""
            };
            return Some(ToolError::with_code(
                ErrorCode::ToolNotFound,
                format!(
                    "unknown tool `{}`{this_turn}; available tools: {}",
                    call.name,
                    if available.is_empty() { "none".into() } else { available.join(", ") }
                ),
                false,
            ));
        }
        if let Some(problem) = unparsed_arguments(&call.input) {
            return Some(ToolError::with_code(
                ErrorCode::ToolInputInvalid,
                format!(
                    "the arguments for `{}` are not valid JSON ({problem}); send a JSON object that matches the tool's input schema",
                    call.name
                ),
                false,
            ));
        }
        if let Err(problems) = self.agent.tools.validate_input(&call.name, &call.input) {
            return Some(ToolError::with_code(
                ErrorCode::ToolInputInvalid,
                format!("invalid input for `{}`: {problems}", call.name),
                false,
            ));
        }
        None
    }

    fn on_tool_done(
        &mut self,
        call_id: &str,
        outcome: ToolOutcome,
        duration: Option<Duration>,
        actions: &mut Vec<Action>,
    ) {
        if let Some(index) = self.compose_step_owner(call_id) {
            return self.on_compose_step_done(index, call_id, outcome, duration, actions);
        }
        let max_chars = self.limits.max_tool_output_chars;
        let Some(pending) = self.calls.iter_mut().find(|p| p.call_id == call_id && p.result.is_none()) else {
            let failure = RunFailure::new(
                ErrorCode::Internal,
                format!(
                    "the run loop got a result for unknown or finished call `{call_id}`; please report this bug"
                ),
            );
            return self.fail(failure, actions);
        };
        let outcome = outcome.map(|output| cap_output(output, max_chars));
        if !self.events_muted {
            actions.push(Action::Emit(outcome_event(call_id, &outcome, duration)));
        }
        pending.result = Some(outcome);
        self.complete_turn_if_done(actions);
    }

    fn on_decision(&mut self, call_id: &str, decision: Decision, actions: &mut Vec<Action>) {
        let waiting = self.calls.iter_mut().find(|p| p.call_id == call_id && p.result.is_none());
        let Some(human) = waiting.and_then(|p| p.human.take()) else {
            let failure = RunFailure::new(
                ErrorCode::Internal,
                format!(
                    "the run loop got a decision for call `{call_id}`, which waits for none; please report this bug"
                ),
            );
            return self.fail(failure, actions);
        };
        let timeout = short_duration(self.agent.approval_timeout);
        let outcome = match (human, decision) {
            (HumanWait::Approval, Decision::Approve { .. }) => {
                let call = self
                    .transcript
                    .iter()
                    .rev()
                    .find(|m| m.role == Role::Assistant)
                    .and_then(|m| m.tool_calls().find(|c| c.call_id == call_id).cloned());
                let Some(call) = call else {
                    let failure = RunFailure::new(
                        ErrorCode::Internal,
                        format!("approved call `{call_id}` is not in the turn; please report this bug"),
                    );
                    return self.fail(failure, actions);
                };
                let step = StepName::Tool { name: call.name.clone(), call_id: call.call_id.clone() };
                actions.push(Action::CallTool { step, call });
                return;
            }
            (HumanWait::Approval, Decision::Reject { note }) => Err(ToolError::with_code(
                ErrorCode::ToolRejected,
                match note {
                    Some(note) if !note.trim().is_empty() => {
                        format!("not run: the user rejected this call: {}", note.trim())
                    }
                    _ => "not run: the user rejected this call".to_owned(),
                },
                false,
            )),
            (HumanWait::Approval, Decision::TimedOut) => Err(ToolError::with_code(
                ErrorCode::ToolRejected,
                format!("not run: approval timed out (nobody approved this call within {timeout})"),
                false,
            )),
            (HumanWait::Question, Decision::Answer(answer)) => Ok(Value::String(answer)),
            (HumanWait::Question, Decision::TimedOut) => Err(ToolError::with_code(
                ErrorCode::ToolRejected,
                format!("the user did not answer within {timeout}"),
                false,
            )),
            (human, decision) => {
                let failure = RunFailure::new(
                    ErrorCode::Internal,
                    format!(
                        "the run loop got {decision:?} for a call waiting for {human:?}; please report this bug"
                    ),
                );
                return self.fail(failure, actions);
            }
        };
        self.on_tool_done(call_id, outcome, None, actions);
    }

    /// The index of the `compose` call whose running step has this call id.
    fn compose_step_owner(&self, call_id: &str) -> Option<usize> {
        self.calls.iter().position(|pending| {
            pending.result.is_none()
                && pending.compose.as_ref().is_some_and(|plan| {
                    plan.steps
                        .get(plan.next)
                        .is_some_and(|step| call_id == compose_call_id(&pending.call_id, &step.id))
                })
        })
    }

    fn on_compose_step_done(
        &mut self,
        index: usize,
        call_id: &str,
        outcome: ToolOutcome,
        duration: Option<Duration>,
        actions: &mut Vec<Action>,
    ) {
        let max_chars = self.limits.max_tool_output_chars;
        let parent = self.calls[index].call_id.clone();
        let mut plan = self.calls[index].compose.take().expect("the owner has a plan");
        let outcome = outcome.map(|output| cap_output(output, max_chars));
        if !self.events_muted {
            actions.push(Action::Emit(outcome_event(call_id, &outcome, duration)));
        }
        let step = plan.steps[plan.next].clone();
        let finished = match outcome {
            Ok(output) => {
                plan.outputs.insert(step.id.clone(), output);
                plan.next += 1;
                self.compose_advance(&parent, &mut plan, actions)
            }
            Err(error) => Some(Err(ToolError::with_code(
                error.code,
                format!("step `{}` (`{}`) failed: {}", step.id, step.tool, error.message),
                error.transient,
            ))),
        };
        match finished {
            Some(outcome) => {
                let result = self.compose_finished(&parent, outcome, actions);
                self.calls[index].result = Some(result);
                self.complete_turn_if_done(actions);
            }
            None => self.calls[index].compose = Some(plan),
        }
    }

    /// Starts the script's next step; `Some` when the script is over (all steps done, or one
    /// could not start).
    fn compose_advance(
        &mut self,
        parent: &str,
        plan: &mut compose::Plan,
        actions: &mut Vec<Action>,
    ) -> Option<ToolOutcome> {
        let Some(next) = plan.resolve_next() else {
            return Some(Ok(plan.output()));
        };
        let (step, input) = match next {
            Ok(next) => next,
            Err(error) => return Some(Err(error)),
        };
        if self.limits.max_tool_calls.is_some_and(|max| self.tool_calls >= max) {
            self.budget_spent = true;
            return Some(Err(ToolError::with_code(
                ErrorCode::ToolBudgetExhausted,
                format!(
                    "step `{}` was not run: the run's tool calls are spent (`limits.max_tool_calls`)",
                    step.id
                ),
                false,
            )));
        }
        if let Err(problems) = self.agent.tools.validate_input(&step.tool, &input) {
            return Some(Err(ToolError::with_code(
                ErrorCode::ToolInputInvalid,
                format!("step `{}`: invalid input for `{}`: {problems}", step.id, step.tool),
                false,
            )));
        }
        // A tool that asks for approval only for some inputs (`http_request` sending a POST)
        // may be composed; a step whose input needs the approval is not run: a script cannot
        // wait for a human between two steps.
        if self.agent.tools.needs_approval(&step.tool, &input) {
            return Some(Err(ToolError::with_code(
                ErrorCode::ToolRefused,
                format!(
                    "step `{}`: this call of `{}` needs a human's approval, which a compose script cannot wait for: call it on its own",
                    step.id, step.tool
                ),
                false,
            )));
        }
        self.tool_calls += 1;
        let call_id = compose_call_id(parent, &step.id);
        if !self.events_muted {
            actions.push(Action::Emit(Event::ToolStart {
                call_id: call_id.clone(),
                name: step.tool.clone(),
                input: input.clone(),
            }));
        }
        let call = ToolCall { call_id: call_id.clone(), name: step.tool.clone(), input };
        actions.push(Action::CallTool { step: StepName::Tool { name: step.tool, call_id }, call });
        None
    }

    /// The result of a finished script, announced under the compose call's id.
    fn compose_finished(
        &mut self,
        parent: &str,
        outcome: ToolOutcome,
        actions: &mut Vec<Action>,
    ) -> ToolOutcome {
        let outcome = outcome.map(|output| cap_output(output, self.limits.max_tool_output_chars));
        // The script's steps carry their own durations; the whole is not one call's run.
        if !self.events_muted {
            actions.push(Action::Emit(outcome_event(parent, &outcome, None)));
        }
        outcome
    }

    fn complete_turn_if_done(&mut self, actions: &mut Vec<Action>) {
        if self.calls.iter().any(|p| p.result.is_none()) {
            return;
        }
        let stop_output = self.close_turn(actions);
        if let Some(output) = stop_output {
            let text = output_to_text(&output);
            self.finish_with_text(StopReason::StopCondition, text, Some(output), actions);
        } else if self.budget_spent {
            self.finish(StopReason::Budget, None, actions);
        } else {
            self.next_turn(actions);
        }
    }

    /// Appends the turn's tool results, in call order, as one tool message. Returns the output
    /// of the first successful stop-condition tool, if any.
    fn close_turn(&mut self, actions: &mut Vec<Action>) -> Option<Value> {
        let mut stop_output = None;
        let mut parts = Vec::with_capacity(self.calls.len());
        // The turn's calls are in its assistant message, the last one of the transcript.
        let assistant = self.transcript.iter().rev().find(|m| m.role == Role::Assistant).map(Arc::clone);
        let calls = assistant.iter().flat_map(|m| m.tool_calls());
        for (pending, call) in self.calls.drain(..).zip(calls) {
            debug_assert_eq!(pending.call_id, call.call_id);
            let (output, is_error) = match pending.result.expect("every call has a result") {
                Ok(output) => {
                    if stop_output.is_none() && self.agent.stop_on_tools.contains(&call.name) {
                        stop_output = Some(output.clone());
                    }
                    (output, false)
                }
                Err(error) => (Value::String(error.message), true),
            };
            parts.push(Part::ToolResult(ToolResult {
                call_id: pending.call_id,
                name: call.name.clone(),
                output,
                is_error,
            }));
        }
        self.push(Message { role: Role::Tool, parts });
        self.persist_last(actions, 1);
        stop_output
    }

    fn final_answer(&mut self, text: String, actions: &mut Vec<Action>) {
        let Some(schema) = &self.agent.output_schema else {
            return self.finish_with_text(StopReason::Final, text, None, actions);
        };
        let parsed = serde_json::from_str::<Value>(strip_code_fence(&text))
            .map_err(|e| format!("the final answer is not JSON ({e})"))
            .and_then(|value| schema.check(&value).map(|()| value));
        let problem = match parsed {
            Ok(output) => return self.finish_with_text(StopReason::Final, text, Some(output), actions),
            Err(problem) => problem,
        };
        if self.repairs < self.agent.loop_control.max_repairs && self.turns_spent().is_none() {
            self.repairs += 1;
            if !self.events_muted {
                actions.push(Action::Emit(Event::OutputRepair {
                    attempt: self.repairs,
                    problem: problem.clone(),
                }));
            }
            self.push(Message::user(format!(
                "Your answer does not match the required output schema: {problem}. Reply again with only \
                 the JSON value, matching this schema:\n{}",
                schema.schema()
            )));
            self.persist_last(actions, 1);
            return self.next_turn(actions);
        }
        let repaired = match self.repairs {
            0 => String::new(),
            1 => " (after 1 repair turn)".to_owned(),
            n => format!(" (after {n} repair turns)"),
        };
        let failure = RunFailure::new(
            ErrorCode::OutputInvalid,
            format!("{problem}{repaired}; the agent's `output.schema` requires a matching JSON answer"),
        );
        self.fail(failure, actions);
    }

    /// Finishes with the text of the run's last assistant message (empty when it has none).
    fn finish(&mut self, stopped: StopReason, output: Option<Value>, actions: &mut Vec<Action>) {
        let text = self.transcript[self.run_start..]
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant)
            .map(|m| m.text())
            .unwrap_or_default();
        self.finish_with_text(stopped, text, output, actions);
    }

    fn finish_with_text(
        &mut self,
        stopped: StopReason,
        text: String,
        output: Option<Value>,
        actions: &mut Vec<Action>,
    ) {
        // A run that answered is remembered first (a cancelled one is not: it may be half-done).
        if stopped != StopReason::Cancelled && !self.memorized {
            self.memorized = true;
            let call_index = self.call_base + u64::from(self.turns.saturating_sub(1));
            let settings = &self.agent.memory.settings;
            let run_messages = || self.transcript[self.run_start..].to_vec();
            if settings.episodic.is_some() {
                self.memory_steps.push_back(MemoryRequest::Episode { messages: run_messages(), call_index });
            }
            if settings.graph.is_some() {
                self.memory_steps.push_back(MemoryRequest::Extract { messages: run_messages(), call_index });
            }
            if !self.memory_steps.is_empty() {
                self.after_memory = Some(AfterMemory::Finish { stopped, text, output });
                return self.next_memory_step(actions);
            }
        }
        self.phase = Phase::Finished;
        let usage = self.usage;
        if !self.events_muted {
            actions.push(Action::Emit(Event::RunDone {
                text: text.clone(),
                output: output.clone(),
                stopped,
                usage,
            }));
        }
        actions.push(Action::Finish(RunOutcome::Done { text, output, stopped, usage }));
    }

    fn fail(&mut self, failure: RunFailure, actions: &mut Vec<Action>) {
        self.phase = Phase::Finished;
        if !self.events_muted {
            actions
                .push(Action::Emit(Event::RunError { code: failure.code, message: failure.message.clone() }));
        }
        actions.push(Action::Finish(RunOutcome::Failed(failure)));
    }

    fn cancel(&mut self, actions: &mut Vec<Action>) {
        self.close_open_calls(
            ErrorCode::ToolCancelled,
            "cancelled: the run was cancelled before this call finished",
            actions,
        );
        self.finish(StopReason::Cancelled, None, actions);
    }

    fn abort(&mut self, failure: RunFailure, actions: &mut Vec<Action>) {
        let why = format!("not run: {} ({})", failure.message, failure.code);
        self.close_open_calls(failure.code, &why, actions);
        self.fail(failure, actions);
    }

    /// Gives every unfinished call of the turn a result, so the model never sees a dangling
    /// call, and closes the turn.
    fn close_open_calls(&mut self, code: ErrorCode, message: &str, actions: &mut Vec<Action>) {
        if self.phase != Phase::AwaitingTools {
            return;
        }
        for pending in self.calls.iter_mut().filter(|p| p.result.is_none()) {
            let error = ToolError::with_code(code, message, false);
            if !self.events_muted {
                actions.push(Action::Emit(outcome_event(&pending.call_id, &Err(error.clone()), None)));
            }
            pending.result = Some(Err(error));
        }
        self.close_turn(actions);
    }
}

/// The results a history ending in tool calls needs before anything else can follow: a run that
/// made those calls ended without them (it kept dying and was failed, or its journal could not
/// be read). Providers refuse a transcript with a call and no result, so the next run answers
/// each call with an error first, deterministically (a replay writes the same message).
fn answer_dangling_calls(history: &[Arc<Message>]) -> Option<Message> {
    let last = history.last().filter(|m| m.role == Role::Assistant)?;
    let parts: Vec<Part> = last
        .tool_calls()
        .map(|call| {
            Part::ToolResult(crate::message::ToolResult {
                call_id: call.call_id.clone(),
                name: call.name.clone(),
                output: Value::String(
                    "not run: the run that made this call ended before the call had a result".into(),
                ),
                is_error: true,
            })
        })
        .collect();
    (!parts.is_empty()).then_some(Message { role: Role::Tool, parts })
}

/// What the model sees of `transcript` when it holds a compaction brief: the latest brief as a
/// user message, then every message from the brief's first kept one on (briefs left out).
/// `None` without a brief: the model sees the transcript itself.
fn compacted_view(transcript: &[Arc<Message>]) -> Option<Vec<Arc<Message>>> {
    let (text, first_kept) = transcript.iter().rev().find_map(|m| m.summary())?;
    let first_kept = position(first_kept, transcript.len());
    let brief = Message::user(format!("Summary of the conversation before this point:\n{text}"));
    let kept = transcript[first_kept..].iter().filter(|m| m.summary().is_none()).cloned();
    Some(std::iter::once(Arc::new(brief)).chain(kept).collect())
}

/// A stored session position as an index into a transcript of `len` messages.
fn position(stored: u64, len: usize) -> usize {
    usize::try_from(stored).unwrap_or(usize::MAX).min(len)
}

/// The text a compaction call summarises: the previous brief, then each message on a line of
/// its own, long ones cut; when the whole is too long the oldest messages give way.
fn render_for_brief<'a>(brief: Option<&str>, messages: impl Iterator<Item = &'a Message>) -> String {
    let mut lines: Vec<String> = Vec::new();
    for message in messages {
        lines.extend(message.plain_lines().map(|line| cut_chars(line, COMPACT_MESSAGE_CHARS)));
    }
    let mut total: usize = lines.iter().map(|line| line.len() + 1).sum();
    let mut dropped = 0;
    while total > COMPACT_REQUEST_CHARS && dropped < lines.len() {
        total -= lines[dropped].len() + 1;
        dropped += 1;
    }
    let mut text = String::new();
    if let Some(brief) = brief {
        text.push_str("Brief of the conversation so far:\n");
        text.push_str(brief);
        text.push_str("\n\nWhat happened next:\n");
    } else {
        text.push_str("The conversation:\n");
    }
    if dropped > 0 {
        text.push_str(&format!("[{dropped} older lines left out]\n"));
    }
    for line in &lines[dropped..] {
        text.push_str(line);
        text.push('\n');
    }
    text.push_str("\nWrite the brief.");
    text
}

/// `text` cut to at most `max` characters, with a marker when cut.
fn cut_chars(text: String, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{} [...]", &text[..cut]),
        None => text,
    }
}

/// The model name of `provider/model` (a bare name is kept).
fn model_name(model: &str) -> &str {
    model.split_once('/').map_or(model, |(_, name)| name)
}

/// The call id of a compose step: `<compose call id>.<step id>`.
fn compose_call_id(parent: &str, step: &str) -> String {
    format!("{parent}.{step}")
}

/// Gives every tool call of a reply a usable id: the model's own when it is present and not
/// used before in the run, else `call_<N>_<index>` where N is the session's model call number.
/// Deterministic, so replays agree; `seen` collects the run's ids. The message is copied only
/// when an id must change.
fn normalize_call_ids(
    message: &mut Arc<Message>,
    call_number: u64,
    seen: &mut std::collections::HashSet<String>,
) {
    let usable = |call: &ToolCall, seen: &std::collections::HashSet<String>| {
        !call.call_id.is_empty() && !seen.contains(&call.call_id)
    };
    // Most replies' ids are usable as they are: recorded, and the message is left alone.
    let mut first_unusable = None;
    for (index, call) in message.tool_calls().enumerate() {
        if !usable(call, seen) {
            first_unusable = Some(index);
            break;
        }
        seen.insert(call.call_id.clone());
    }
    let Some(first_unusable) = first_unusable else { return };
    let parts = &mut Arc::make_mut(message).parts;
    let calls = parts.iter_mut().filter(|p| matches!(p, Part::ToolCall(_))).enumerate();
    for (index, part) in calls.skip(first_unusable) {
        let Part::ToolCall(call) = part else { continue };
        if !usable(call, seen) {
            let mut id = format!("call_{call_number}_{index}");
            // A model could have used that very id; keep looking until it is unique.
            while seen.contains(&id) {
                id.push('_');
            }
            call.call_id = id;
        }
        seen.insert(call.call_id.clone());
    }
}

/// A duration as people write it in a spec: `3d`, `2h`, `90s`, `250ms`.
fn short_duration(duration: std::time::Duration) -> String {
    let secs = duration.as_secs();
    if duration.subsec_millis() != 0 || secs == 0 {
        return format!("{}ms", duration.as_millis());
    }
    match secs {
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// Cuts an output longer than `max_chars` characters, leaving a marker that says so.
/// The event that announces a call's outcome: `tool.done` or `tool.error`.
fn outcome_event(call_id: &str, outcome: &ToolOutcome, duration: Option<Duration>) -> Event {
    match outcome {
        Ok(output) => Event::ToolDone { call_id: call_id.to_owned(), output: output.clone(), duration },
        Err(error) => Event::ToolError {
            call_id: call_id.to_owned(),
            code: error.code,
            error: error.message.clone(),
            duration,
        },
    }
}

fn cap_output(output: Value, max_chars: usize) -> Value {
    let truncated = {
        // Images a tool returned do not count: the cap is on what the model reads as text.
        let (readable, _) = crate::message::tool_output_images(&output);
        // Most outputs are well under the cap: counted as they are written out, with no text
        // built, and only those over it are rendered to be cut.
        if !matches!(&*readable, Value::String(_)) && json_fits(&readable, max_chars) {
            return output;
        }
        let text = match &*readable {
            Value::String(s) => std::borrow::Cow::Borrowed(s.as_str()),
            other => std::borrow::Cow::Owned(other.to_string()),
        };
        text.char_indices().nth(max_chars).map(|(cut, _)| {
            let total = text.chars().count();
            format!(
                "{}\n[output truncated: showing the first {max_chars} of {total} characters]",
                &text[..cut]
            )
        })
    };
    match truncated {
        Some(text) => Value::String(text),
        None => output,
    }
}

/// Whether `value`'s JSON text has at most `max_chars` characters. Stops writing once past it.
fn json_fits(value: &Value, max_chars: usize) -> bool {
    struct Counter {
        chars: usize,
        max: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            // A character starts at every byte that is not a UTF-8 continuation byte.
            self.chars += bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count();
            if self.chars > self.max {
                return Err(std::io::Error::other("over the cap"));
            }
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(Counter { chars: 0, max: max_chars }, value).is_ok()
}

/// Accepts a JSON answer wrapped in a Markdown code fence, as models often write it.
fn strip_code_fence(text: &str) -> &str {
    let trimmed = text.trim();
    let Some(inner) = trimmed.strip_prefix("```") else {
        return trimmed;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.strip_suffix("```").unwrap_or(inner).trim()
}

/// Why a tool call's arguments are not JSON, when a provider kept them as raw text (see
/// [`crate::message::ToolCall::input`]).
fn unparsed_arguments(input: &Value) -> Option<String> {
    let Value::String(raw) = input else { return None };
    serde_json::from_str::<Value>(raw).err().map(|error| error.to_string())
}
