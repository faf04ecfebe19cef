// A TCP proxy in front of keel that drops one connection in the middle of a run, as a flaky
// network would: the first `POST /chat` whose answer streams the first text delta through it is
// cut right after that event, and `extraBytes` into what follows (to cut inside the next event);
// with `extraBytes` "headers", right after the answer's headers, before any event.
import { createServer, connect, type Server, type Socket } from "node:net";

export class CuttingProxy {
  cuts = 0;
  readonly server: Server;
  readonly #sockets = new Set<Socket>();

  readonly path = "POST /chat ";

  constructor(target: URL, extraBytes: number | "headers") {
    this.server = createServer((client) => {
      const upstream = connect(Number(target.port), target.hostname);
      this.#sockets.add(client).add(upstream);
      // Connections are kept alive and reused: any request on this one may be the one to cut.
      let watching = false;
      client.on("data", (chunk: Buffer) => {
        if (this.cuts === 0 && chunk.toString("latin1").startsWith(this.path)) watching = true;
        upstream.write(chunk);
      });
      upstream.on("data", (chunk: Buffer) => {
        const mark = extraBytes === "headers" ? "\r\n\r\n" : '"type":"text.delta"';
        const at = watching && this.cuts === 0 ? chunk.indexOf(mark) : -1;
        if (at < 0) {
          client.write(chunk);
          return;
        }
        // Through the end of that event's message (or of the headers), and `extraBytes` more.
        const end = extraBytes === "headers" ? at + 2 : chunk.indexOf("\n\n", at);
        const more = extraBytes === "headers" ? 0 : extraBytes;
        const cut = end < 0 ? chunk.length : Math.min(chunk.length, end + 2 + more);
        client.write(chunk.subarray(0, cut));
        this.cuts += 1;
        client.destroy();
        upstream.destroy();
      });
      const close = () => {
        client.destroy();
        upstream.destroy();
      };
      client.on("error", close).on("close", close);
      upstream.on("error", close).on("close", close);
    });
  }

  async listen(): Promise<string> {
    await new Promise<void>((done) => this.server.listen(0, "127.0.0.1", done));
    const address = this.server.address();
    if (typeof address !== "object" || !address) throw new Error("no address");
    return `http://127.0.0.1:${address.port}`;
  }

  async close(): Promise<void> {
    for (const socket of this.#sockets) socket.destroy();
    await new Promise((done) => this.server.close(done));
  }
}

