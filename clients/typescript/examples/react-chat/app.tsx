// A small chat on `useKeelChat`: messages with their tool calls, the reply streaming in,
// approvals and questions, cancel. Open index.html with `?url=<keel>&token=<token>&session=<id>`
// (keel serve must list this page's origin in KEEL_CORS_ORIGINS). Built by esbuild (see
// clients/typescript/README.md).
import { useState, type FormEvent } from "react";
import { createRoot } from "react-dom/client";

import { useKeelChat, type ChatMessage, type ChatToolCall } from "@keel/client/react";

const params = new URLSearchParams(location.search);
const url = params.get("url") ?? "http://127.0.0.1:3000";
const token = params.get("token") ?? undefined;
const sessionId = params.get("session") ?? `web-${crypto.randomUUID()}`;

function Tool({ tool }: { tool: ChatToolCall }) {
  const result = tool.status === "done" ? JSON.stringify(tool.output) : tool.status === "error" ? tool.error : "…";
  const took = tool.durationMs === undefined ? "" : ` (${tool.durationMs} ms)`;
  return (
    <div className={`tool ${tool.status}`} data-call={tool.callId}>
      {tool.name} {JSON.stringify(tool.input)} → {result}
      {took}
    </div>
  );
}

function Message({ message }: { message: ChatMessage }) {
  return (
    <div className={`message ${message.role}${message.optimistic ? " optimistic" : ""}`}>
      {message.text}
      {message.tools.map((tool) => (
        <Tool key={tool.callId} tool={tool} />
      ))}
    </div>
  );
}

function App() {
  const chat = useKeelChat({ url, sessionId, ...(token ? { token } : {}) });
  const [input, setInput] = useState("");
  const [answer, setAnswer] = useState("");
  const busy = chat.status === "submitted" || chat.status === "streaming";

  const submit = (event: FormEvent) => {
    event.preventDefault();
    if (!input.trim()) return;
    void chat.send(input);
    setInput("");
  };

  return (
    <main>
      <h1>keel chat</h1>
      <p className="status" id="status">
        session {sessionId} · {chat.status}
      </p>
      <div id="messages">
        {chat.messages.map((message) => (
          <Message key={message.id} message={message} />
        ))}
        {chat.streamingText && <div className="message assistant streaming">{chat.streamingText}</div>}
      </div>
      {chat.pending.map((pending) =>
        pending.kind === "approval" ? (
          <div className="pending" key={pending.id}>
            Run <code>{pending.tool}</code> {JSON.stringify(pending.input)}?{" "}
            <button onClick={() => void chat.approve(pending.id)}>Approve</button>{" "}
            <button onClick={() => void chat.reject(pending.id, "not now")}>Reject</button>
          </div>
        ) : (
          <form
            className="pending"
            key={pending.id}
            onSubmit={(event) => {
              event.preventDefault();
              void chat.answer(pending.id, answer);
              setAnswer("");
            }}
          >
            <label>
              {pending.question} <input value={answer} onChange={(e) => setAnswer(e.target.value)} aria-label="answer" />
            </label>
            <button type="submit">Answer</button>
          </form>
        ),
      )}
      {chat.error && (
        <p className="error" id="error">
          {chat.error.code}: {chat.error.message}
        </p>
      )}
      <form onSubmit={submit}>
        <input value={input} onChange={(e) => setInput(e.target.value)} placeholder="Message" aria-label="message" disabled={busy} />
        <button type="submit" disabled={busy}>
          Send
        </button>
        <button type="button" onClick={() => void chat.cancel()} disabled={chat.status === "ready"}>
          Stop
        </button>
      </form>
    </main>
  );
}

createRoot(document.getElementById("root")!).render(<App />);
