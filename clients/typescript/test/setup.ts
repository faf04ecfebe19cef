// Starts the real `keel serve` (KEEL_BIN, else the workspace's debug build) on the test agent,
// with a bearer token and a fresh SQLite store, for every test file; stops it at the end.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import type { TestProject } from "vitest/node";

declare module "vitest" {
  export interface ProvidedContext {
    keelUrl: string;
    keelToken: string;
  }
}

const here = dirname(fileURLToPath(import.meta.url));

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const binary = process.env.KEEL_BIN ?? resolve(here, "../../../target/debug/keel");
  const work = mkdtempSync(join(tmpdir(), "keel-client-test-"));
  const token = `client-test-${Math.random().toString(36).slice(2)}`;
  const child: ChildProcess = spawn(binary, ["serve", join(here, "agent"), "--port", "0", "--store", `sqlite:${join(work, "keel.db")}`], {
    env: { ...process.env, KEEL_API_TOKEN: token, KEEL_LOG: "warn" },
    stdio: ["ignore", "ignore", "pipe"],
  });
  const url = await new Promise<string>((resolveUrl, reject) => {
    let said = "";
    const timer = setTimeout(() => reject(new Error(`keel serve did not start: ${said}`)), 20_000);
    child.stderr?.on("data", (chunk: Buffer) => {
      said += chunk.toString();
      const found = /http:\/\/[0-9.:]+(?=\s)/.exec(said);
      if (found) {
        clearTimeout(timer);
        resolveUrl(found[0]);
      }
    });
    child.on("exit", (code) => reject(new Error(`keel serve exited (${code}): ${said}`)));
  });
  project.provide("keelUrl", url);
  project.provide("keelToken", token);
  return async () => {
    child.kill("SIGTERM");
    await new Promise((done) => child.once("exit", done));
    rmSync(work, { recursive: true, force: true });
  };
}
