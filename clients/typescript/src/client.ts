// The client of the HTTP API of `keel serve` (docs/http.md) from TypeScript, on fetch and web
// streams only, so it runs in browsers, Node 20+ and edge runtimes alike.
//
// A turn is a `RunStream`: an async iterator of the run's typed events. When the connection
// drops in the middle of a run (the run goes on in keel), the stream resumes from the session's
// live feed with `Last-Event-ID`, so no event is lost and none comes twice; `subscribe()` follows
// a session's events for as long as it is asked to, reconnecting the same way with back-off.
// Every refusal is a `KeelError` carrying keel's error code.

import { readSse } from "./sse.js";
import type { components, operations } from "./openapi.js";

type Schemas = components["schemas"];
/** One event of a run (docs/protocol.md), discriminated by `type`. */
export type KeelEvent = Schemas["Event"];
/** The event of one `type`. */
export type EventOf<T extends KeelEvent["type"]> = Extract<KeelEvent, { type: T }>;
/** The input of a turn: text, or content parts (text, images, files as base64). */
export type Input = Schemas["Input"];
/** A message of a session's transcript. */
export type Message = Schemas["Message"];
/** A part of a message. */
export type Part = Schemas["Part"];
/** An approval or a question a session's run waits for. */
export type Pending = Schemas["Pending"];
/** Tokens used. */
export type Usage = Schemas["Usage"];
/** `GET /chat/:sessionId`. */
export type Transcript = JsonOf<operations["transcript"]>;
/** A session of `GET /sessions`. */
export type SessionSummary = JsonOf<operations["listSessions"]>["sessions"][number];
/** `GET /agent`: the agent's name, description, model and tools. */
export type AgentCard = JsonOf<operations["agent"]>;
/** A run's own limits, each at most the agent's (`POST /chat` `limits`). */
export type Limits = NonNullable<Extract<Schemas["ChatRequest"], { input: unknown }>["limits"]>;

type JsonOf<Op> = Op extends { responses: { 200: { content: { "application/json": infer T } } } } ? T : never;

/** An event as a stream delivered it, with its SSE id (what `Last-Event-ID` resumes after). */
export interface StreamedEvent {
  id: string;
  event: KeelEvent;
}

/** An item of a session's live feed: an event, or the end of a run's stream. */
export type FeedItem = { id: string; event: KeelEvent; runEnded?: undefined } | { id: string; event?: undefined; runEnded: string };

/** How a run ended, as its stream told it. */
export type RunOutcome =
  | { status: "done"; runId: string; text: string; output?: unknown; stopped: EventOf<"run.done">["stopped"]; usage: Usage }
  | { status: "paused"; runId: string; pending: Pending[]; usage: Usage }
  | { status: "failed"; runId: string; code: string; message: string };

/** A refusal of keel's (an HTTP error with keel's code), or a stream that could not go on. */
export class KeelError extends Error {
  /** keel's error code (`KEEL_SESSION_BUSY`, ...; docs/errors.md), or the client's own
   * (`KEEL_CLIENT_STREAM_CUT`, `KEEL_CLIENT_NETWORK`, `KEEL_CLIENT_PROTOCOL`). */
  readonly code: string;
  /** The HTTP status (0 when the request never got an answer). */
  readonly status: number;
  /** The `X-Request-Id` of the answer, to find its line in keel's log. */
  readonly requestId?: string;

  constructor(code: string, message: string, status = 0, requestId?: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "KeelError";
    this.code = code;
    this.status = status;
    if (requestId !== undefined) this.requestId = requestId;
  }
}

/** A run that failed (`run.error`) while its result was awaited with `RunStream.result()`. */
export class KeelRunError extends KeelError {
  readonly runId: string;
  constructor(runId: string, code: string, message: string) {
    super(code, message, 200);
    this.name = "KeelRunError";
    this.runId = runId;
  }
}

/** How a cut stream is reconnected. */
export interface Reconnect {
  /** The first wait, in ms (default 250); each next one doubles, with jitter. */
  initialDelayMs?: number;
  /** The longest wait (default 5,000 ms). */
  maxDelayMs?: number;
  /** Attempts in a row without any event before giving up (default 8; `Infinity` never). */
  maxAttempts?: number;
}

export interface KeelClientOptions {
  /** Where keel serves, e.g. `http://127.0.0.1:3000`. */
  baseUrl: string;
  /** The bearer token (`KEEL_API_TOKEN`, or a JWT), or a function that gives the current one. */
  token?: string | (() => string | undefined | Promise<string | undefined>);
  /** Headers sent with every request. */
  headers?: Record<string, string>;
  /** The fetch to use (default: the global one). */
  fetch?: typeof fetch;
  reconnect?: Reconnect;
}

export interface RequestOptions {
  signal?: AbortSignal;
}

export interface ChatOptions extends RequestOptions {
  limits?: Limits;
}

/** The client of one keel server. */
export class KeelClient {
  readonly baseUrl: string;
  readonly #options: KeelClientOptions;

  constructor(options: KeelClientOptions) {
    if (!/^https?:\/\//.test(options.baseUrl)) {
      throw new TypeError(`baseUrl must be an http(s) URL, not ${JSON.stringify(options.baseUrl)}`);
    }
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.#options = options;
  }

  /** Runs a turn of `sessionId`: the run's events as they come. */
  chat(sessionId: string, input: Input, options: ChatOptions = {}): RunStream {
    const body: Record<string, unknown> = { sessionId, input };
    if (options.limits) body.limits = options.limits;
    return new RunStream(this, sessionId, () => this.request("POST", "/chat", body, options.signal, true), options.signal);
  }

  /** Approves a pending tool call: the continued run's events. */
  approve(sessionId: string, approvalId: string, options: RequestOptions & { note?: string } = {}): RunStream {
    return this.#decide(sessionId, approvalId, { approved: true, note: options.note }, options.signal);
  }

  /** Rejects a pending tool call (the model is told, with the note): the continued run's events. */
  reject(sessionId: string, approvalId: string, options: RequestOptions & { note?: string } = {}): RunStream {
    return this.#decide(sessionId, approvalId, { approved: false, note: options.note }, options.signal);
  }

  /** Answers a question the agent asked: the continued run's events. */
  answer(sessionId: string, questionId: string, answer: string, options: RequestOptions = {}): RunStream {
    return this.#decide(sessionId, questionId, { answer }, options.signal);
  }

  #decide(sessionId: string, id: string, body: object, signal?: AbortSignal): RunStream {
    const path = `/chat/${encodeURIComponent(sessionId)}/approvals/${encodeURIComponent(id)}`;
    return new RunStream(this, sessionId, () => this.request("POST", path, body, signal, true), signal);
  }

  /** Cancels the session's unfinished run, wherever it is (`KEEL_RUN_NOT_FOUND` when none). */
  async cancel(sessionId: string, options: RequestOptions = {}): Promise<{ cancelled: boolean; alreadyCancelling?: boolean; by?: string }> {
    const response = await this.request("DELETE", `/chat/${encodeURIComponent(sessionId)}/run`, undefined, options.signal);
    return (await response.json()) as { cancelled: boolean; alreadyCancelling?: boolean; by?: string };
  }

  /** The session's messages, what it waits for and its usage (`KEEL_SESSION_NOT_FOUND` when it
   * does not exist). */
  async transcript(sessionId: string, options: RequestOptions = {}): Promise<Transcript> {
    const response = await this.request("GET", `/chat/${encodeURIComponent(sessionId)}`, undefined, options.signal);
    return (await response.json()) as Transcript;
  }

  /** The session's state object (`null` for none). */
  async state(sessionId: string, options: RequestOptions = {}): Promise<unknown> {
    const response = await this.request("GET", `/chat/${encodeURIComponent(sessionId)}/state`, undefined, options.signal);
    return ((await response.json()) as { state: unknown }).state;
  }

  /** The caller's sessions, most recently written first. */
  async sessions(options: RequestOptions & { limit?: number } = {}): Promise<SessionSummary[]> {
    const query = options.limit === undefined ? "" : `?limit=${options.limit}`;
    const response = await this.request("GET", `/sessions${query}`, undefined, options.signal);
    return ((await response.json()) as { sessions: SessionSummary[] }).sessions;
  }

  /** Who answers: the agent's card. */
  async agent(options: RequestOptions = {}): Promise<AgentCard> {
    const response = await this.request("GET", "/agent", undefined, options.signal);
    return (await response.json()) as AgentCard;
  }

  /**
   * Follows every event of the session's runs, whichever process runs them, until `signal` aborts
   * (or the consumer stops). A cut connection is resumed after the last event seen, with back-off;
   * `lastEventId` starts after an event seen before.
   */
  async *subscribe(sessionId: string, options: RequestOptions & { lastEventId?: string } = {}): AsyncGenerator<StreamedEvent> {
    for await (const item of this.follow(sessionId, options.lastEventId, options.signal)) {
      if (item.event) yield { id: item.id, event: item.event };
    }
  }

  /**
   * The session's live feed after `lastEventId`: its events, and the end of each run's stream
   * (`runEnded`: from then on the run holds its session no longer), reconnecting after a cut.
   * Ends when the consumer stops; `subscribe()` is the same, events only.
   */
  async *follow(sessionId: string, lastEventId: string | undefined, signal: AbortSignal | undefined): AsyncGenerator<FeedItem> {
    const reconnect = this.#options.reconnect ?? {};
    const initial = reconnect.initialDelayMs ?? 250;
    const most = reconnect.maxDelayMs ?? 5000;
    const attempts = reconnect.maxAttempts ?? 8;
    let failures = 0;
    let last = lastEventId;
    for (;;) {
      signal?.throwIfAborted();
      let cause: unknown;
      try {
        const headers: Record<string, string> = last === undefined ? {} : { "last-event-id": last };
        const response = await this.request("GET", `/chat/${encodeURIComponent(sessionId)}/events`, undefined, signal, false, headers);
        for await (const message of readSse(requireBody(response))) {
          if (message.id === undefined) continue;
          failures = 0;
          last = message.id;
          if (message.event === "done") {
            yield { id: message.id, runEnded: runIdOf(message.data) };
          } else {
            yield { id: message.id, event: parseEvent(message.data) };
          }
        }
      } catch (error) {
        // keel's refusals (a bad token, an unknown route) do not get better by retrying; nor does
        // a caller's abort.
        if (signal?.aborted || (error instanceof KeelError && error.status >= 400 && error.status !== 429 && error.status !== 503)) {
          throw error;
        }
        cause = error;
      }
      failures += 1;
      if (failures > attempts) {
        throw new KeelError("KEEL_CLIENT_STREAM_CUT", `the event stream of session ${sessionId} was cut and could not be resumed after ${attempts} attempts`, 0, undefined, { cause });
      }
      const wait = Math.min(most, initial * 2 ** (failures - 1));
      await sleep(wait / 2 + Math.random() * (wait / 2), signal);
    }
  }

  /** Sends a request to keel; an answer that is not a success is thrown as a `KeelError`. */
  async request(
    method: string,
    path: string,
    body?: unknown,
    signal?: AbortSignal,
    stream = false,
    extraHeaders: Record<string, string> = {},
  ): Promise<Response> {
    const headers: Record<string, string> = { ...this.#options.headers, ...extraHeaders };
    const token = typeof this.#options.token === "function" ? await this.#options.token() : this.#options.token;
    if (token) headers.authorization = `Bearer ${token}`;
    if (body !== undefined) headers["content-type"] = "application/json";
    if (stream || path.endsWith("/events")) headers.accept = "text/event-stream";
    const fetcher = this.#options.fetch ?? globalThis.fetch;
    let response: Response;
    try {
      const init: RequestInit = { method, headers };
      if (body !== undefined) init.body = JSON.stringify(body);
      if (signal) init.signal = signal;
      response = await fetcher(`${this.baseUrl}${path}`, init);
    } catch (error) {
      if (signal?.aborted) throw error;
      throw new KeelError("KEEL_CLIENT_NETWORK", `${method} ${path}: ${errorMessage(error)}`, 0, undefined, { cause: error });
    }
    if (!response.ok) throw await errorOf(response, method, path);
    return response;
  }
}

/**
 * The events of one run, from a request that streams them (`POST /chat`, a decision). Iterate it
 * for the events; `result()` reads it to the end and gives how the run ended. A stream cut before
 * the run ended resumes from the session's live feed, after the last event received.
 */
export class RunStream implements AsyncIterable<KeelEvent> {
  /** The run's id, once its first event came. */
  runId: string | undefined;
  /** The SSE id of the last event received. */
  lastEventId: string | undefined;
  readonly sessionId: string;
  readonly #client: KeelClient;
  readonly #open: () => Promise<Response>;
  readonly #signal: AbortSignal | undefined;
  #started = false;
  #outcome: RunOutcome | undefined;
  /** The run the events read now are of (a session's feed has every run's). */
  #current: string | undefined;

  constructor(client: KeelClient, sessionId: string, open: () => Promise<Response>, signal?: AbortSignal) {
    this.#client = client;
    this.sessionId = sessionId;
    this.#open = open;
    this.#signal = signal;
  }

  /** How the run ended, once the stream has (`undefined` before, or when it was not read through). */
  get outcome(): RunOutcome | undefined {
    return this.#outcome;
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<KeelEvent> {
    if (this.#started) throw new TypeError("a RunStream is read once");
    this.#started = true;
    const response = await this.#open();
    // Where the run's events start in the session's feed: a stream cut before its first event
    // reaches us resumes from there (a browser drops what it had not handed over yet).
    const start = response.headers.get("x-keel-last-event-id") ?? undefined;
    this.runId ??= response.headers.get("x-keel-run-id") ?? undefined;
    try {
      // Read to `event: done`, not just to the run's last event: only then has the run let go of
      // its session, so that the next turn is not refused as busy.
      for await (const message of readSse(requireBody(response))) {
        // The end's id too: the session's feed after it has nothing more of this run.
        if (message.id !== undefined) this.lastEventId = message.id;
        if (message.event === "done") return;
        const event = parseEvent(message.data);
        this.#see(event);
        yield event;
      }
    } catch (error) {
      if (this.#signal?.aborted || (error instanceof KeelError && error.code === "KEEL_CLIENT_PROTOCOL")) throw error;
      // The connection dropped: the run goes on in keel; follow it below.
    }
    const after = this.lastEventId ?? start;
    if (after === undefined || this.runId === undefined) {
      throw new KeelError("KEEL_CLIENT_STREAM_CUT", "the stream was cut before the run's first event: read the session with transcript() or subscribe()");
    }
    const runId = this.runId;
    for await (const item of this.#client.follow(this.sessionId, after, this.#signal)) {
      this.lastEventId = item.id;
      if (item.runEnded !== undefined) {
        // The run's stream ended: done, unless it was interrupted (it is re-driven later, and
        // goes on in this feed).
        if (item.runEnded === runId && this.#outcome) return;
        continue;
      }
      const event = item.event;
      // The feed has every run of the session; this stream is one run's. Events carry no run id
      // but `run.start`, so the run's are those since its own `run.start` (`#current`), until
      // another starts.
      if (event.type === "run.start") this.#current = event.runId;
      if (this.#current !== runId) continue;
      this.#see(event);
      yield event;
    }
  }

  #see(event: KeelEvent): void {
    if (event.type === "run.start") {
      this.runId ??= event.runId;
      this.#current = event.runId;
    }
    const runId = this.runId ?? "";
    if (event.type === "run.done") {
      this.#outcome = { status: "done", runId, text: event.text, stopped: event.stopped, usage: event.usage };
      if (event.output !== undefined) this.#outcome.output = event.output;
    } else if (event.type === "run.paused") {
      this.#outcome = { status: "paused", runId, pending: event.pending, usage: event.usage };
    } else if (event.type === "run.error") {
      this.#outcome = { status: "failed", runId, code: event.code, message: event.message };
    }
  }

  /** Reads the stream to its end: how the run ended. A failed run is a `KeelRunError`. */
  async result(): Promise<Extract<RunOutcome, { status: "done" | "paused" }>> {
    for await (const _ of this) {
      // Read through.
    }
    const outcome = this.#outcome;
    if (!outcome) throw new KeelError("KEEL_CLIENT_PROTOCOL", "the stream ended without the run's end");
    if (outcome.status === "failed") throw new KeelRunError(outcome.runId, outcome.code, outcome.message);
    return outcome;
  }

  /** Reads the stream to its end: the text the run answered with (see `result()`). */
  async text(): Promise<string> {
    const outcome = await this.result();
    return outcome.status === "done" ? outcome.text : "";
  }
}

function runIdOf(data: string): string {
  try {
    const { runId } = JSON.parse(data) as { runId?: unknown };
    if (typeof runId === "string") return runId;
  } catch {
    // Reported below.
  }
  throw new KeelError("KEEL_CLIENT_PROTOCOL", `the end of a run's stream does not name the run: ${data}`);
}

function parseEvent(data: string): KeelEvent {
  try {
    const event = JSON.parse(data) as KeelEvent;
    if (typeof event !== "object" || event === null || typeof event.type !== "string") throw new Error("no `type`");
    return event;
  } catch (error) {
    throw new KeelError("KEEL_CLIENT_PROTOCOL", `an event is not a keel event: ${errorMessage(error)}`, 0, undefined, { cause: error });
  }
}

function requireBody(response: Response): ReadableStream<Uint8Array> {
  if (!response.body) throw new KeelError("KEEL_CLIENT_PROTOCOL", "the answer has no body", response.status);
  return response.body;
}

async function errorOf(response: Response, method: string, path: string): Promise<KeelError> {
  const requestId = response.headers.get("x-request-id") ?? undefined;
  let code = `HTTP_${response.status}`;
  let message = `${method} ${path} answered ${response.status}`;
  try {
    const body = (await response.json()) as { error?: { code?: unknown; message?: unknown } };
    if (typeof body.error?.code === "string") code = body.error.code;
    if (typeof body.error?.message === "string") message = body.error.message;
  } catch {
    // Not keel's JSON error (a proxy's page, say): the status says it.
  }
  return new KeelError(code, message, response.status, requestId);
}

function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", abort);
      resolve();
    }, ms);
    const abort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", abort, { once: true });
  });
}
