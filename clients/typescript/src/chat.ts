// A conversation with a keel session as state a UI renders: the messages, the text streaming in,
// what the run waits for, and the status; `useKeelChat` (./react.ts) is this under React. It has
// no framework in it, so it works the same under any UI (or none) and is tested without one.
//
// Its own turns are rendered from their event streams as they come (the user's message shows at
// once, before keel answers: it is taken back if keel refuses the turn). While none of its own
// is in flight it follows the session's live events, so a run driven elsewhere (another tab, a
// decision from `keel approvals`, a schedule) shows too, and reloads the transcript at that
// run's end.

import { KeelClient, KeelError, KeelRunError, type KeelClientOptions, type KeelEvent, type Message, type Pending, type RunStream } from "./client.js";

/** A tool call, as one card shows it. */
export interface ChatToolCall {
  callId: string;
  name: string;
  input: unknown;
  /** `running` until its outcome; `awaiting_approval` while a human must decide. */
  status: "running" | "awaiting_approval" | "done" | "error";
  output?: unknown;
  error?: string;
  /** How long it ran, when it ran while watched. */
  durationMs?: number;
}

/** A message as a chat shows it: one model turn's text and calls, or the user's text. */
export interface ChatMessage {
  id: string;
  role: "user" | "assistant";
  text: string;
  tools: ChatToolCall[];
  /** A user message keel has not taken yet (the optimistic turn). */
  optimistic?: boolean;
}

export type ChatStatus =
  /** Reading the session. */
  | "loading"
  /** Nothing runs; a message can be sent. */
  | "ready"
  /** A turn was sent; keel has not answered yet. */
  | "submitted"
  /** A run streams. */
  | "streaming"
  /** The run waits for a human: see `pending`. */
  | "awaiting_input"
  /** The last request or run failed: see `error`. */
  | "error";

export interface ChatSnapshot {
  sessionId: string;
  messages: ChatMessage[];
  /** The text of the model turn in progress (not in `messages` yet). */
  streamingText: string;
  pending: Pending[];
  status: ChatStatus;
  error: KeelError | undefined;
}

export interface KeelChatOptions {
  /** The client to use, or the options to make one with. */
  client: KeelClient | KeelClientOptions;
  sessionId: string;
  /** Follow runs driven elsewhere while none of this chat's runs is in flight (default true). */
  live?: boolean;
}

/** One session's conversation, as state. `start()` reads the session and follows it; `close()`
 * stops (and `start()` may start it again, as React's strict mode does with effects). */
export class KeelChat {
  readonly client: KeelClient;
  readonly sessionId: string;
  #snapshot: ChatSnapshot;
  #listeners = new Set<() => void>();
  /** Aborted by `close()`: ends what this chat does (runs in flight go on in keel). */
  #closed = new AbortController();
  #started = false;
  #live: boolean;
  /** Aborts the live follow while a turn of this chat runs. */
  #following: AbortController | undefined;
  /** The SSE id of the last event seen, so the live follow starts right after it. */
  #lastEventId: string | undefined;
  #busy = false;
  #localIds = 0;


  constructor(options: KeelChatOptions) {
    this.client = options.client instanceof KeelClient ? options.client : new KeelClient(options.client);
    this.sessionId = options.sessionId;
    this.#live = options.live ?? true;
    this.#snapshot = { sessionId: this.sessionId, messages: [], streamingText: "", pending: [], status: "loading", error: undefined };
  }

  /** Reads the session, then follows its live events (see `live`). Does nothing if started. */
  start(): void {
    if (this.#started) return;
    this.#started = true;
    if (this.#closed.signal.aborted) this.#closed = new AbortController();
    const closed = this.#closed.signal;
    void this.reload().then(() => {
      if (!closed.aborted) this.#follow();
    });
  }

  /** The current state; a new object after each change. */
  get snapshot(): ChatSnapshot {
    return this.#snapshot;
  }

  /** Calls `listener` after each change; returns the function that stops it. */
  subscribe(listener: () => void): () => void {
    this.#listeners.add(listener);
    return () => this.#listeners.delete(listener);
  }

  /** Stops reading and following. Runs in flight go on in keel. */
  close(): void {
    this.#started = false;
    this.#closed.abort();
  }

  /** Reads the session again from keel: its messages and what it waits for. */
  async reload(): Promise<void> {
    try {
      const transcript = await this.client.transcript(this.sessionId, { signal: this.#closed.signal });
      // A transcript has no timings: the calls watched run keep theirs.
      const durations = new Map<string, number>();
      for (const tool of this.#snapshot.messages.flatMap((m) => m.tools)) {
        if (tool.durationMs !== undefined) durations.set(tool.callId, tool.durationMs);
      }
      const messages = fromTranscript(transcript.messages, transcript.pending).map((message) => ({
        ...message,
        tools: message.tools.map((tool) => withDuration(tool, durations.get(tool.callId)) as ChatToolCall),
      }));
      this.#set({
        messages,
        pending: transcript.pending,
        streamingText: "",
        status: transcript.pending.length > 0 ? "awaiting_input" : "ready",
        error: undefined,
      });
    } catch (error) {
      if (this.#closed.signal.aborted) return;
      if (error instanceof KeelError && error.code === "KEEL_SESSION_NOT_FOUND") {
        this.#set({ messages: [], pending: [], streamingText: "", status: "ready", error: undefined });
      } else {
        this.#set({ status: "error", error: asKeelError(error) });
      }
    }
  }

  /** Sends the user's message: it shows at once, and the run streams in. Resolves at the run's end. */
  async send(text: string): Promise<void> {
    const message: ChatMessage = { id: `local-${++this.#localIds}`, role: "user", text, tools: [], optimistic: true };
    this.#set({ messages: [...this.#snapshot.messages, message], status: "submitted", error: undefined });
    await this.#run(this.client.chat(this.sessionId, text, { signal: this.#closed.signal }), message.id);
  }

  /** Approves a pending tool call; the run goes on. */
  approve(approvalId: string, note?: string): Promise<void> {
    return this.#decide(approvalId, () => this.client.approve(this.sessionId, approvalId, noted(note, this.#closed.signal)));
  }

  /** Rejects a pending tool call (the model is told why); the run goes on. */
  reject(approvalId: string, note?: string): Promise<void> {
    return this.#decide(approvalId, () => this.client.reject(this.sessionId, approvalId, noted(note, this.#closed.signal)));
  }

  /** Answers a question the agent asked; the run goes on. */
  answer(questionId: string, answer: string): Promise<void> {
    return this.#decide(questionId, () => this.client.answer(this.sessionId, questionId, answer, { signal: this.#closed.signal }));
  }

  /** Cancels the session's run, in flight or waiting for a human. */
  async cancel(): Promise<void> {
    try {
      await this.client.cancel(this.sessionId, { signal: this.#closed.signal });
    } catch (error) {
      // Nothing to cancel is no failure: the run has just ended.
      if (error instanceof KeelError && error.code === "KEEL_RUN_NOT_FOUND") return;
      this.#set({ error: asKeelError(error) });
      return;
    }
    // A paused run has no stream to tell its end: it ended now.
    if (!this.#busy) await this.reload();
  }

  async #decide(id: string, open: () => RunStream): Promise<void> {
    const before = this.#snapshot.pending;
    this.#set({ pending: before.filter((p) => p.id !== id), status: "submitted", error: undefined });
    await this.#run(open(), undefined, before);
  }

  /** Renders a run of this chat from its stream. */
  async #run(stream: RunStream, optimistic: string | undefined, pendingBefore?: Pending[]): Promise<void> {
    this.#busy = true;
    this.#following?.abort();
    const render = new TurnRenderer(this.#snapshot.messages);
    let started = false;
    try {
      for await (const event of stream) {
        if (!started) {
          started = true;
          // keel took the turn: the user's message is no longer a guess.
          if (optimistic) render.confirm(optimistic);
        }
        render.apply(event);
        this.#set(render.state(this.#snapshot));
      }
    } catch (error) {
      if (this.#closed.signal.aborted) return;
      if (!started) {
        // Refused before it began (a busy session, a bad token): nothing of it stays.
        const messages = this.#snapshot.messages.filter((m) => m.id !== optimistic);
        this.#set({ messages, pending: pendingBefore ?? this.#snapshot.pending, status: "error", error: asKeelError(error) });
      } else {
        this.#set({ ...render.state(this.#snapshot), status: "error", error: asKeelError(error) });
      }
    } finally {
      if (stream.lastEventId !== undefined) this.#lastEventId = stream.lastEventId;
      this.#busy = false;
      this.#follow();
    }
  }

  /** Follows the session's live events while this chat runs nothing of its own. */
  #follow(): void {
    if (!this.#live || this.#busy || this.#closed.signal.aborted) return;
    this.#following?.abort();
    const following = new AbortController();
    this.#following = following;
    const signal = AbortSignal.any([following.signal, this.#closed.signal]);
    void (async () => {
      let text = "";
      let failure: KeelRunError | undefined;
      try {
        for await (const { id, event, runEnded } of this.client.follow(this.sessionId, this.#lastEventId, signal)) {
          this.#lastEventId = id;
          if (runEnded !== undefined) {
            // The transcript is the truth of what that run did; its session is free again.
            await this.reload();
            if (failure) this.#set({ status: "error", error: failure });
            failure = undefined;
          } else if (event.type === "run.start") {
            text = "";
            this.#set({ status: "streaming", streamingText: "" });
          } else if (event.type === "turn.start") {
            text = "";
          } else if (event.type === "text.delta") {
            text += event.delta;
            this.#set({ streamingText: text });
          } else if (event.type === "turn.retry" || event.type === "output.repair") {
            text = "";
            this.#set({ streamingText: "" });
          } else if (event.type === "run.error") {
            failure = new KeelRunError("", event.code, event.message);
          }
        }
      } catch (error) {
        if (signal.aborted) return;
        this.#set({ error: asKeelError(error) });
      }
    })();
  }

  #set(change: Partial<ChatSnapshot>): void {
    this.#snapshot = { ...this.#snapshot, ...change };
    for (const listener of this.#listeners) listener();
  }
}

/** Builds the messages of one run as its events come. */
class TurnRenderer {
  #messages: ChatMessage[];
  #text = "";
  /** The assistant message of the turn in progress, once it made a call. */
  #turnMessage: ChatMessage | undefined;
  #turn = 0;
  #runId = "";
  #pending: Pending[] | undefined;
  #status: ChatStatus = "streaming";
  #error: KeelError | undefined;

  constructor(messages: ChatMessage[]) {
    this.#messages = [...messages];
  }

  confirm(id: string): void {
    this.#messages = this.#messages.map((m) => (m.id === id ? { ...m, optimistic: false } : m));
  }

  state(previous: ChatSnapshot): ChatSnapshot {
    return {
      ...previous,
      messages: this.#messages,
      streamingText: this.#text,
      pending: this.#pending ?? previous.pending,
      status: this.#status,
      error: this.#error,
    };
  }

  apply(event: KeelEvent): void {
    switch (event.type) {
      case "run.start":
        this.#runId = event.runId;
        break;
      case "turn.start":
        this.#flush();
        this.#turn = event.turn;
        break;
      case "text.delta":
        this.#text += event.delta;
        break;
      case "turn.retry":
      case "output.repair":
        this.#text = "";
        break;
      case "tool.start": {
        const known = this.#messages.some((m) => m.tools.some((t) => t.callId === event.callId));
        if (known) break; // A re-driven run announces its calls again.
        const tool: ChatToolCall = { callId: event.callId, name: event.name, input: event.input, status: "running" };
        if (!this.#turnMessage) {
          this.#turnMessage = { id: `${this.#runId}:${this.#turn}`, role: "assistant", text: this.#text, tools: [tool] };
          this.#text = "";
          this.#messages = [...this.#messages, this.#turnMessage];
        } else {
          this.#replace(this.#turnMessage, { ...this.#turnMessage, tools: [...this.#turnMessage.tools, tool] });
        }
        break;
      }
      case "approval.requested":
        this.#updateTool(event.callId, { status: "awaiting_approval" });
        break;
      case "tool.done":
        this.#updateTool(event.callId, withDuration({ status: "done", output: event.output }, event.durationMs));
        break;
      case "tool.error":
        this.#updateTool(event.callId, withDuration({ status: "error", error: event.error }, event.durationMs));
        break;
      case "run.done":
        this.#flush(event.text);
        this.#pending = [];
        this.#status = "ready";
        break;
      case "run.paused":
        this.#flush();
        this.#pending = event.pending;
        this.#status = "awaiting_input";
        break;
      case "run.error":
        this.#flush();
        this.#status = "error";
        this.#error = new KeelRunError(this.#runId, event.code, event.message);
        break;
      default:
        break;
    }
  }

  /** Ends the turn in progress: its text becomes a message (`final` is the run's own answer). */
  #flush(final?: string): void {
    const text = this.#text || (final && !this.#turnMessage ? final : "");
    if (text) {
      this.#messages = [...this.#messages, { id: `${this.#runId}:${this.#turn}:text`, role: "assistant", text, tools: [] }];
    }
    this.#text = "";
    this.#turnMessage = undefined;
  }

  #replace(old: ChatMessage, next: ChatMessage): void {
    this.#messages = this.#messages.map((m) => (m === old ? next : m));
    if (this.#turnMessage === old) this.#turnMessage = next;
  }

  #updateTool(callId: string, change: Partial<ChatToolCall>): void {
    const message = this.#messages.find((m) => m.tools.some((t) => t.callId === callId));
    if (!message) return;
    this.#replace(message, { ...message, tools: message.tools.map((t) => (t.callId === callId ? { ...t, ...change } : t)) });
  }
}

function withDuration(change: Partial<ChatToolCall>, durationMs: number | undefined): Partial<ChatToolCall> {
  return durationMs === undefined ? change : { ...change, durationMs };
}

/** A transcript's messages as chat messages: one per user message and per model turn, each
 * call with its result. */
export function fromTranscript(messages: Message[], pending: Pending[] = []): ChatMessage[] {
  const out: ChatMessage[] = [];
  const calls = new Map<string, ChatToolCall>();
  messages.forEach((message, index) => {
    const parts = message.content as Array<Record<string, unknown>>;
    const text = parts
      .filter((p) => p.type === "text")
      .map((p) => String(p.text))
      .join("\n");
    if (message.role === "tool") {
      for (const part of parts) {
        const call = calls.get(String(part.callId));
        if (part.type !== "toolResult" || !call) continue;
        if (part.isError) {
          call.status = "error";
          call.error = typeof part.output === "string" ? part.output : JSON.stringify(part.output);
        } else {
          call.status = "done";
          call.output = part.output;
        }
      }
      return;
    }
    const tools: ChatToolCall[] = [];
    for (const part of parts) {
      if (part.type !== "toolCall") continue;
      const call: ChatToolCall = { callId: String(part.callId), name: String(part.name), input: part.input, status: "running" };
      if (pending.some((p) => p.callId === call.callId && p.kind === "approval")) call.status = "awaiting_approval";
      calls.set(call.callId, call);
      tools.push(call);
    }
    if (!text && tools.length === 0) return;
    out.push({ id: String(index), role: message.role === "user" ? "user" : "assistant", text, tools });
  });
  return out;
}

function noted(note: string | undefined, signal: AbortSignal): { note?: string; signal: AbortSignal } {
  return note === undefined ? { signal } : { note, signal };
}

function asKeelError(error: unknown): KeelError {
  if (error instanceof KeelError) return error;
  return new KeelError("KEEL_CLIENT_NETWORK", error instanceof Error ? error.message : String(error), 0, undefined, { cause: error });
}
