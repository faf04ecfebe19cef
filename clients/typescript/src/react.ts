// `useKeelChat`: a keel session's conversation in a React component (a `KeelChat` under
// `useSyncExternalStore`). React is a peer dependency of this entry point only.

import { useCallback, useEffect, useMemo, useSyncExternalStore } from "react";

import { KeelChat, type ChatMessage, type ChatStatus } from "./chat.js";
import type { KeelClientOptions, KeelError, Pending } from "./client.js";

export type { ChatMessage, ChatStatus, ChatToolCall, ChatSnapshot } from "./chat.js";
export { KeelChat, fromTranscript } from "./chat.js";

export interface UseKeelChatOptions {
  /** Where keel serves, e.g. `http://127.0.0.1:3000`. */
  url: string;
  /** The session to talk in: its transcript is read, and each message is one of its turns. */
  sessionId: string;
  /** The bearer token (`KEEL_API_TOKEN`, or the user's JWT), or a function giving the current one. */
  token?: KeelClientOptions["token"];
  /** Options for the client beyond `url` and `token` (headers, fetch, reconnection). */
  client?: Omit<KeelClientOptions, "baseUrl" | "token">;
  /** Follow runs driven elsewhere while none of this chat's is in flight (default true). */
  live?: boolean;
}

export interface UseKeelChat {
  messages: ChatMessage[];
  /** The text of the model turn streaming now. */
  streamingText: string;
  /** What the run waits for: approvals (`ap_...`) and questions (`qu_...`). */
  pending: Pending[];
  status: ChatStatus;
  error: KeelError | undefined;
  send(text: string): Promise<void>;
  approve(approvalId: string, note?: string): Promise<void>;
  reject(approvalId: string, note?: string): Promise<void>;
  answer(questionId: string, answer: string): Promise<void>;
  cancel(): Promise<void>;
  /** Reads the session again from keel. */
  reload(): Promise<void>;
}

/** A keel session's conversation: its messages, the text streaming in, what it waits for. */
export function useKeelChat(options: UseKeelChatOptions): UseKeelChat {
  const { url, sessionId, token, live } = options;
  const chat = useMemo(() => {
    const clientOptions: KeelClientOptions = { ...options.client, baseUrl: url };
    if (token !== undefined) clientOptions.token = token;
    return new KeelChat({ client: clientOptions, sessionId, live: live ?? true });
    // One chat per server, session and token: a new one of any is another conversation.
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [url, sessionId, token, live]);
  // The chat is made in render (without side effects) and started once it is committed.
  useEffect(() => {
    chat.start();
    return () => chat.close();
  }, [chat]);
  const subscribe = useCallback((listener: () => void) => chat.subscribe(listener), [chat]);
  const snapshot = useSyncExternalStore(subscribe, () => chat.snapshot, () => chat.snapshot);
  return useMemo(
    () => ({
      messages: snapshot.messages,
      streamingText: snapshot.streamingText,
      pending: snapshot.pending,
      status: snapshot.status,
      error: snapshot.error,
      send: (text: string) => chat.send(text),
      approve: (id: string, note?: string) => chat.approve(id, note),
      reject: (id: string, note?: string) => chat.reject(id, note),
      answer: (id: string, answer: string) => chat.answer(id, answer),
      cancel: () => chat.cancel(),
      reload: () => chat.reload(),
    }),
    [chat, snapshot],
  );
}
