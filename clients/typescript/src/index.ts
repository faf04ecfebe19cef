// @keel/client: the HTTP API of `keel serve` (docs/http.md) from TypeScript, on fetch and web
// streams only: browsers, Node 20+ and edge runtimes. `KeelClient` speaks the API; `KeelChat` is
// a conversation as state for a UI; `@keel/client/react` has the `useKeelChat` hook.

export * from "./client.js";
export { KeelChat, fromTranscript } from "./chat.js";
export type { ChatMessage, ChatSnapshot, ChatStatus, ChatToolCall, KeelChatOptions } from "./chat.js";
export { readSse } from "./sse.js";
export type { SseMessage } from "./sse.js";
