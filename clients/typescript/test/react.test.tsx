// @vitest-environment jsdom
// useKeelChat in React (jsdom) against the real `keel serve`: the user's turn shows before keel
// answers, the reply streams in and becomes messages with their tool calls, an approval round
// trip, a refused turn taken back, a run driven elsewhere shown live, and a connection dropped
// mid-run that ends with the same messages, no text doubled.
import { act, renderHook, waitFor } from "@testing-library/react";
import { afterEach, describe, expect, inject, it } from "vitest";

import { KeelClient } from "../src/index.js";
import { useKeelChat, type ChatMessage } from "../src/react.js";
import { CuttingProxy } from "./proxy.js";

const url = inject("keelUrl");
const token = inject("keelToken");
let sessions = 0;
const fresh = (name: string) => `${name}-react-${process.pid}-${Date.now()}-${++sessions}`;
const client = { reconnect: { initialDelayMs: 20, maxDelayMs: 200 } };

const summary = (messages: ChatMessage[]) =>
  messages.map((m) => `${m.role}: ${m.text}${m.tools.map((t) => ` [${t.name} ${t.status}]`).join("")}`);

describe("useKeelChat", () => {
  let proxy: CuttingProxy | undefined;
  afterEach(async () => {
    await proxy?.close();
    proxy = undefined;
  });

  it("shows the user's turn at once, streams the reply, and keeps the messages", async () => {
    const sessionId = fresh("send");
    const { result, unmount } = renderHook(() => useKeelChat({ url, sessionId, token, client }));
    await waitFor(() => expect(result.current.status).toBe("ready"));
    expect(result.current.messages).toEqual([]);

    let sent!: Promise<void>;
    act(() => {
      sent = result.current.send("What day is it?");
    });
    // Before keel has answered anything: the optimistic turn.
    expect(result.current.messages).toMatchObject([{ role: "user", text: "What day is it?", optimistic: true }]);
    expect(result.current.status).toBe("submitted");
    await waitFor(() => expect(result.current.status).toBe("streaming"));
    await act(() => sent);
    expect(result.current.status).toBe("ready");
    expect(result.current.streamingText).toBe("");
    const shown = summary(result.current.messages);
    expect(shown[0]).toBe("user: What day is it?");
    expect(shown[1]).toBe("assistant: Let me look. [day_name done]");
    expect(shown[2]).toMatch(/^assistant: Today is \w+day, a good day\.$/);
    expect(shown).toHaveLength(3);
    expect(result.current.messages[0]?.optimistic).toBe(false);
    const tool = result.current.messages[1]?.tools[0];
    expect(typeof tool?.durationMs).toBe("number");
    unmount();

    // Another hook on the same session reads the same conversation back.
    const again = renderHook(() => useKeelChat({ url, sessionId, token, client }));
    await waitFor(() => expect(again.result.current.status).toBe("ready"));
    expect(summary(again.result.current.messages)).toEqual(shown);
    again.unmount();
  });

  it("pauses for an approval and goes on when it is given", async () => {
    const sessionId = fresh("approve");
    const { result, unmount } = renderHook(() => useKeelChat({ url, sessionId, token, client }));
    await waitFor(() => expect(result.current.status).toBe("ready"));
    await act(() => result.current.send("What day is it?"));
    await act(() => result.current.send("Note the date."));
    expect(result.current.status).toBe("awaiting_input");
    const [pending] = result.current.pending;
    expect(pending).toMatchObject({ kind: "approval", tool: "current_date" });
    expect(summary(result.current.messages).at(-1)).toBe("assistant: I will note the date. [current_date awaiting_approval]");

    await act(() => result.current.approve(pending!.id, "ok"));
    expect(result.current.status).toBe("ready");
    expect(result.current.pending).toEqual([]);
    const shown = summary(result.current.messages);
    expect(shown.at(-2)).toBe("assistant: I will note the date. [current_date done]");
    expect(shown.at(-1)).toMatch(/^assistant: Noted: \{"date"/);
    unmount();
  });

  it("takes the optimistic turn back when keel refuses it", async () => {
    const sessionId = fresh("refused");
    const other = new KeelClient({ baseUrl: url, token });
    await other.chat(sessionId, "What day is it?").result();
    await other.chat(sessionId, "Note the date.").result(); // Now it waits for a human.
    const { result, unmount } = renderHook(() => useKeelChat({ url, sessionId, token, client, live: false }));
    await waitFor(() => expect(result.current.status).toBe("awaiting_input"));
    const before = result.current.messages;
    await act(() => result.current.send("Hello?"));
    expect(result.current.status).toBe("error");
    expect(result.current.error).toMatchObject({ code: "KEEL_SESSION_BUSY", status: 409 });
    expect(result.current.messages).toEqual(before);
    expect(result.current.pending).toHaveLength(1);

    // Cancelling the paused run frees the session.
    await act(() => result.current.cancel());
    await waitFor(() => expect(result.current.pending).toEqual([]));
    expect(result.current.status).toBe("ready");
    unmount();
  });

  it("shows a run driven elsewhere, live", async () => {
    const sessionId = fresh("live");
    const { result, unmount } = renderHook(() => useKeelChat({ url, sessionId, token, client }));
    await waitFor(() => expect(result.current.status).toBe("ready"));
    // Let the hook's live feed open.
    await new Promise((done) => setTimeout(done, 200));
    const elsewhere = new KeelClient({ baseUrl: url, token });
    await elsewhere.chat(sessionId, "What day is it?").result();
    await waitFor(() => expect(result.current.messages).toHaveLength(3));
    expect(summary(result.current.messages)[2]).toMatch(/^assistant: Today is \w+day/);
    expect(result.current.status).toBe("ready");
    unmount();
  });

  it("survives a connection dropped mid-run: the same messages, no text doubled", async () => {
    proxy = new CuttingProxy(new URL(url), 0);
    const through = await proxy.listen();
    const sessionId = fresh("drop");
    const { result, unmount } = renderHook(() => useKeelChat({ url: through, sessionId, token, client }));
    await waitFor(() => expect(result.current.status).toBe("ready"));
    await act(() => result.current.send("What day is it?"));
    expect(proxy.cuts).toBe(1);
    expect(result.current.error).toBeUndefined();
    expect(result.current.status).toBe("ready");
    const shown = summary(result.current.messages);
    expect(shown).toHaveLength(3);
    expect(shown[1]).toBe("assistant: Let me look. [day_name done]");
    expect(shown[2]).toMatch(/^assistant: Today is \w+day, a good day\.$/);
    unmount();
  });
});
