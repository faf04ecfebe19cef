// @vitest-environment jsdom
// `useChat` from the real `@ai-sdk/react`, with its default transport, against `keel serve`'s
// `POST /ai-sdk/chat`: a turn with a tool call and a retried model call (its void words dropped by
// `reset-step`), an approval answered with `addToolApprovalResponse` and sent on automatically,
// a rejection, a question answered by the next message, and refusals the hook reports.
import { useChat } from "@ai-sdk/react";
import { act, renderHook, waitFor } from "@testing-library/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithApprovalResponses, type UIMessage } from "ai";
import { describe, expect, inject, it } from "vitest";

const url = inject("keelUrl");
const token = inject("keelToken");
let chats = 0;
const fresh = (name: string) => `${name}-aisdk-${process.pid}-${Date.now()}-${++chats}`;

function chat(id: string, headers: Record<string, string> = { authorization: `Bearer ${token}` }) {
  return renderHook(() =>
    useChat({
      id,
      transport: new DefaultChatTransport({ api: `${url}/ai-sdk/chat`, headers }),
      sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
    }),
  );
}

type Part = UIMessage["parts"][number];

/** Waits for the chat to be ready again; a chat in error fails at once, saying why. */
async function settled(chat: { current: { status: string; error: Error | undefined } }): Promise<void> {
  await waitFor(() => {
    if (chat.current.status === "error") throw new Error(`the chat failed: ${chat.current.error?.message}`);
    expect(chat.current.status).toBe("ready");
  });
}
const texts = (message: UIMessage | undefined) =>
  (message?.parts ?? []).flatMap((p: Part) => (p.type === "text" ? [p.text] : []));
const tools = (message: UIMessage | undefined) =>
  (message?.parts ?? []).flatMap((p: Part) => (p.type === "dynamic-tool" ? [`${p.toolName}:${p.state}`] : []));

describe("useChat against /ai-sdk/chat", () => {
  it("streams a turn: its steps, its tool call, and the retried call's words dropped", async () => {
    const id = fresh("turn");
    const { result } = chat(id);
    await act(() => result.current.sendMessage({ text: "What day is it?" }));
    await settled(result);
    expect(result.current.error).toBeUndefined();
    const [user, answer] = result.current.messages;
    expect(user?.role).toBe("user");
    expect(answer?.role).toBe("assistant");
    expect(tools(answer)).toEqual(["day_name:output-available"]);
    const said = texts(answer);
    expect(said[0]).toBe("Let me look.");
    expect(said[1]).toMatch(/^Today is \w+day, a good day\.$/);
    expect(said.join(" ")).not.toContain("Nothingday");
    expect(said).toHaveLength(2);
    expect(answer?.parts.filter((p: Part) => p.type === "step-start")).toHaveLength(2);
    expect(answer?.metadata).toMatchObject({ sessionId: id, status: "finished", stopped: "final" });

    // The chat's id is keel's session: the transcript is there.
    const transcript = await fetch(`${url}/chat/${id}`, { headers: { authorization: `Bearer ${token}` } });
    expect(((await transcript.json()) as { messages: unknown[] }).messages).toHaveLength(4);
  });

  it("asks for approval, and the response sent on automatically continues the same message", async () => {
    const id = fresh("approve");
    const { result } = chat(id);
    await act(() => result.current.sendMessage({ text: "What day is it?" }));
    await settled(result);
    await act(() => result.current.sendMessage({ text: "Note the date." }));
    await settled(result);
    const asking = result.current.messages.at(-1);
    expect(tools(asking)).toEqual(["current_date:approval-requested"]);
    expect(asking?.metadata).toMatchObject({ status: "awaiting_input" });
    const part = asking?.parts.find((p: Part) => p.type === "dynamic-tool");
    const approvalId = part?.type === "dynamic-tool" && part.state === "approval-requested" ? part.approval.id : "";
    expect(approvalId).toMatch(/^ap_/);

    await act(async () => {
      await result.current.addToolApprovalResponse({ id: approvalId, approved: true });
    });
    await waitFor(() => expect(texts(result.current.messages.at(-1)).at(-1)).toMatch(/^Noted: \{"date"/));
    await settled(result);
    const continued = result.current.messages.at(-1);
    // The same message, its call done, one text more, and no call announced twice.
    expect(result.current.messages).toHaveLength(4);
    expect(continued?.id).toBe(asking?.id);
    expect(tools(continued)).toEqual(["current_date:output-available"]);
    expect(texts(continued)[0]).toBe("I will note the date.");
  });

  it("denies a rejected call, and a question is answered by the next message", async () => {
    const id = fresh("reject");
    const { result } = chat(id);
    await act(() => result.current.sendMessage({ text: "What day is it?" }));
    await settled(result);
    await act(() => result.current.sendMessage({ text: "Note the date." }));
    await settled(result);
    const part = result.current.messages.at(-1)?.parts.find((p: Part) => p.type === "dynamic-tool");
    const approvalId = part?.type === "dynamic-tool" && part.state === "approval-requested" ? part.approval.id : "";
    await act(async () => {
      await result.current.addToolApprovalResponse({ id: approvalId, approved: false, reason: "not today" });
    });
    await waitFor(() => expect(tools(result.current.messages.at(-1))).toEqual(["current_date:output-denied"]));
    await settled(result);

    await act(() => result.current.sendMessage({ text: "Book a trip." }));
    await settled(result);
    const asking = result.current.messages.at(-1);
    const question = asking?.parts.find((p: Part) => p.type === "data-keel-question");
    expect(question && "data" in question ? question.data : undefined).toMatchObject({ question: "Which city?" });

    await act(() => result.current.sendMessage({ text: "Lisbon" }));
    await settled(result);
    expect(texts(result.current.messages.at(-1))).toEqual(["Off to Lisbon."]);
  });

  it("reports keel's refusals: no token, and a regenerated reply", async () => {
    const { result } = chat(fresh("refused"), {});
    await act(() => result.current.sendMessage({ text: "Hi" }));
    await waitFor(() => expect(result.current.status).toBe("error"));
    expect(result.current.error?.message).toContain("KEEL_UNAUTHORIZED");

    const id = fresh("regenerate");
    const { result: other } = chat(id);
    await act(() => other.current.sendMessage({ text: "What day is it?" }));
    await settled(other);
    await act(() => other.current.regenerate());
    await waitFor(() => expect(other.current.status).toBe("error"));
    expect(other.current.error?.message).toContain("cannot be regenerated");
  });
});
