// KeelClient against the real `keel serve`: typed events, results, approvals and questions,
// typed errors, a connection cut in the middle of a run (through a proxy that drops it) resumed
// without a lost or doubled event, and subscribe() across a restart of its connection.
import { afterEach, describe, expect, inject, it } from "vitest";

import { KeelClient, KeelError, readSse, type KeelEvent } from "../src/index.js";
import { CuttingProxy } from "./proxy.js";

const url = inject("keelUrl");
const token = inject("keelToken");
const client = new KeelClient({ baseUrl: url, token, reconnect: { initialDelayMs: 20, maxDelayMs: 200 } });
let sessions = 0;
const fresh = (name: string) => `${name}-${process.pid}-${Date.now()}-${++sessions}`;

/** The text a reader shows: every turn's deltas, less those a retried attempt voided. */
function text(events: KeelEvent[]): string {
  let shown = "";
  let turn = "";
  for (const event of events) {
    if (event.type === "turn.start") {
      shown += turn;
      turn = "";
    } else if (event.type === "text.delta") turn += event.delta;
    else if (event.type === "turn.retry") turn = "";
  }
  return shown + turn;
}

describe("chat", () => {
  it("streams a run's typed events, from run.start to run.done", async () => {
    const session = fresh("chat");
    const stream = client.chat(session, "What day is it?");
    const events: KeelEvent[] = [];
    for await (const event of stream) events.push(event);
    const types = events.map((e) => e.type);
    expect(types[0]).toBe("run.start");
    expect(types.at(-1)).toBe("run.done");
    expect(types).toContain("tool.start");
    const done = events.at(-1);
    expect(done?.type === "run.done" && done.text).toMatch(/^Today is \w+day, a good day\.$/);
    const tool = events.find((e) => e.type === "tool.done");
    expect(tool?.type === "tool.done" && typeof tool.durationMs).toBe("number");
    expect(stream.runId).toMatch(/^run_/);
    expect(stream.outcome?.status).toBe("done");
    expect(text(events)).toBe("Let me look." + (done?.type === "run.done" ? done.text : ""));
    // The model call that broke off midway was tried again, and said so.
    expect(types).toContain("turn.retry");

    const transcript = await client.transcript(session);
    expect(transcript.sessionId).toBe(session);
    expect(transcript.messages.map((m) => m.role)).toEqual(["user", "assistant", "tool", "assistant"]);
    const listed = await client.sessions();
    expect(listed.map((s) => s.sessionId)).toContain(session);
    const agent = await client.agent();
    expect(agent.name).toBe("client-test");
    expect(agent.tools.find((t) => t.name === "current_date")?.approval).toBe("always");
  });

  it("pauses for an approval, and approve() streams the continued run", async () => {
    const session = fresh("approve");
    await client.chat(session, "What day is it?").result();
    const paused = await client.chat(session, "Note the date.").result();
    expect(paused.status).toBe("paused");
    if (paused.status !== "paused") return;
    const [approval] = paused.pending;
    expect(approval?.kind).toBe("approval");
    expect(approval?.tool).toBe("current_date");

    const continued = client.approve(session, approval!.id, { note: "fine" });
    const events: KeelEvent[] = [];
    for await (const event of continued) events.push(event);
    const done = events.at(-1);
    expect(done?.type === "run.done" && done.text).toMatch(/^Noted: \{"date":"\d{4}-\d\d-\d\d"/);
    // The decided call's outcome is in the continued run; the approval is not asked again.
    expect(events.some((e) => e.type === "tool.done")).toBe(true);
    expect(events.some((e) => e.type === "approval.requested")).toBe(false);

    // A second decision is refused with keel's code.
    const again = client.approve(session, approval!.id);
    await expect(again.result()).rejects.toMatchObject({ name: "KeelError", code: "KEEL_NOT_PENDING", status: 404 });
  });

  it("answers a question, and rejects with the note the model sees", async () => {
    const session = fresh("question");
    await client.chat(session, "What day is it?").result();
    const paused = await client.chat(session, "Note the date.").result();
    if (paused.status !== "paused") throw new Error("expected a pause");
    const rejected = await client.reject(session, paused.pending[0]!.id, { note: "not today" }).result();
    expect(rejected.status).toBe("done");
    const asked = await client.chat(session, "Book a trip.").result();
    if (asked.status !== "paused") throw new Error("expected a question");
    expect(asked.pending[0]).toMatchObject({ kind: "question", question: "Which city?" });
    expect(await client.answer(session, asked.pending[0]!.id, "Lisbon").text()).toBe("Off to Lisbon.");
  });

  it("refuses with typed errors that carry keel's code, status and request id", async () => {
    const unauthorized = new KeelClient({ baseUrl: url, token: "wrong" });
    const error = await unauthorized.sessions().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(KeelError);
    expect(error).toMatchObject({ code: "KEEL_UNAUTHORIZED", status: 401 });
    expect((error as KeelError).requestId).toBeTruthy();

    await expect(client.transcript(fresh("missing"))).rejects.toMatchObject({ code: "KEEL_SESSION_NOT_FOUND", status: 404 });
    await expect(client.chat("not a valid id!", "hi").result()).rejects.toMatchObject({ code: "KEEL_SESSION_ID_INVALID", status: 400 });
    await expect(client.cancel(fresh("idle"))).rejects.toMatchObject({ code: "KEEL_RUN_NOT_FOUND" });

    // A session busy with a run waiting for a human refuses another turn.
    const session = fresh("busy");
    await client.chat(session, "What day is it?").result();
    await client.chat(session, "Note the date.").result();
    await expect(client.chat(session, "Hello?").result()).rejects.toMatchObject({ code: "KEEL_SESSION_BUSY", status: 409 });
    const cancelled = await client.cancel(session);
    expect(cancelled.cancelled).toBe(true);

    // Nothing listens there: a network error, typed.
    const nowhere = new KeelClient({ baseUrl: "http://127.0.0.1:9" });
    await expect(nowhere.agent()).rejects.toMatchObject({ code: "KEEL_CLIENT_NETWORK", status: 0 });
  });
});

describe("a dropped connection", () => {
  let proxy: CuttingProxy | undefined;
  afterEach(async () => {
    await proxy?.close();
    proxy = undefined;
  });

  for (const [name, extra] of [
    ["between events", 0],
    ["in the middle of an event", 40],
    ["before its first event", "headers"],
  ] as const) {
    it(`mid-run (${name}) resumes from the live feed, with no event lost or doubled`, async () => {
      proxy = new CuttingProxy(new URL(url), extra);
      const through = new KeelClient({ baseUrl: await proxy.listen(), token, reconnect: { initialDelayMs: 20 } });
      const session = fresh("cut");
      const stream = through.chat(session, "What day is it?");
      const events: KeelEvent[] = [];
      for await (const event of stream) events.push(event);
      expect(proxy.cuts).toBe(1);
      const done = events.at(-1);
      if (done?.type !== "run.done") throw new Error(`the run did not end: ${JSON.stringify(events)}`);
      // The text reads once, whole: what came before the cut and what came after it.
      expect(text(events)).toBe(`Let me look.${done.text}`);
      const types = events.map((e) => e.type);
      expect(types.filter((t) => t === "run.start")).toHaveLength(1);
      expect(types.filter((t) => t === "tool.start")).toHaveLength(1);
      expect(types.filter((t) => t === "tool.done")).toHaveLength(1);
      // The transcript agrees: one run, its messages once.
      const transcript = await client.transcript(session);
      expect(transcript.messages).toHaveLength(4);
    });
  }
});

describe("subscribe", () => {
  it("follows a session's runs live, and resumes after the last id it saw", async () => {
    const session = fresh("watch");
    const seen: KeelEvent[] = [];
    const ids: string[] = [];
    const stop = new AbortController();
    const watching = (async () => {
      try {
        for await (const { id, event } of client.subscribe(session, { signal: stop.signal })) {
          ids.push(id);
          seen.push(event);
          if (event.type === "run.done") stop.abort();
        }
      } catch (error) {
        if (!stop.signal.aborted) throw error;
      }
    })();
    // Let the subscription open before the run starts.
    await new Promise((done) => setTimeout(done, 200));
    const own = await client.chat(session, "What day is it?").result();
    await watching;
    expect(seen.at(-1)).toMatchObject({ type: "run.done", text: own.status === "done" ? own.text : "" });
    expect(seen[0]?.type).toBe("run.start");

    // From an id seen before: exactly what came after it.
    const after = ids[2]!;
    const replay: KeelEvent[] = [];
    const again = new AbortController();
    try {
      for await (const { event } of client.subscribe(session, { lastEventId: after, signal: again.signal })) {
        replay.push(event);
        if (event.type === "run.done") again.abort();
      }
    } catch (error) {
      if (!again.signal.aborted) throw error;
    }
    expect(replay).toEqual(seen.slice(3));
  });
});

describe("readSse", () => {
  const stream = (...pieces: string[]) =>
    new ReadableStream<Uint8Array>({
      start(controller) {
        for (const piece of pieces) controller.enqueue(new TextEncoder().encode(piece));
        controller.close();
      },
    });

  it("parses messages split anywhere, with CR, LF or CRLF, and drops an unterminated one", async () => {
    const messages = [];
    for await (const message of readSse(stream("id: 1\r", "\ndata: {\"a\"", ":1}\r\n\r\n: a comment\n", "event: done\ndata: x\ndata: y\r\rid: 3\ndata: cut"))) {
      messages.push(message);
    }
    expect(messages).toEqual([
      { event: "message", data: '{"a":1}', id: "1" },
      { event: "done", data: "x\ny" },
    ]);
  });
});
