// Server-sent events, parsed as the HTML standard's EventSource does (fields `data`, `event`,
// `id`, `retry`; comments; CR, LF or CRLF line ends), over a fetch body. Only whole messages are
// yielded: a message is dispatched at the blank line that ends it, so a stream cut in the middle
// of one never yields half of it.

/** One server-sent message. */
export interface SseMessage {
  /** The `event:` field (`"message"` when absent). */
  event: string;
  /** The `data:` lines, joined by newlines. */
  data: string;
  /** The `id:` field of this message, if it had one. */
  id?: string;
}

/** Yields the messages of an event stream body, until it ends. Throws what reading throws. */
export async function* readSse(body: ReadableStream<Uint8Array>): AsyncGenerator<SseMessage> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data: string[] = [];
  let event = "";
  let id: string | undefined;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return; // An unterminated message at the end is dropped, as EventSource does.
      buffer += decoder.decode(value, { stream: true });
      let start = 0;
      for (;;) {
        const end = lineEnd(buffer, start);
        // No whole line yet (or a CR that may be half of a CRLF): wait for more.
        if (end < 0) break;
        const line = buffer.slice(start, end);
        start = end + (buffer.startsWith("\r\n", end) ? 2 : 1);
        if (line === "") {
          if (data.length > 0) {
            const message: SseMessage = { event: event || "message", data: data.join("\n") };
            if (id !== undefined) message.id = id;
            yield message;
          }
          data = [];
          event = "";
          id = undefined;
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
        else if (field === "event") event = value;
        else if (field === "id" && !value.includes("\0")) id = value;
      }
      buffer = buffer.slice(start);
    }
  } finally {
    // Also when the consumer stops early: the connection is closed, not left open.
    await reader.cancel().catch(() => {});
  }
}

/** Where the line starting at `start` ends, or -1 when it may go on (a lone CR at the end of what
 * has arrived could be the first half of a CRLF). */
function lineEnd(buffer: string, start: number): number {
  for (let i = start; i < buffer.length; i++) {
    const c = buffer.charCodeAt(i);
    if (c === 10) return i;
    if (c === 13) return i + 1 < buffer.length ? i : -1;
  }
  return -1;
}
