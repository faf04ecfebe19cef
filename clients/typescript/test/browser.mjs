// The example app (examples/react-chat, on useKeelChat) in real headless Chromium against the
// real `keel serve`, its requests through a proxy that drops the connection of the first turn
// mid-run: the user's message shows at once, the reply arrives whole with its tool call (its
// text once, the retried call's words gone), an approval is given by clicking, a question is
// answered, and a reload shows the same conversation. Run by scripts/client-test.sh:
//   node test/browser.mjs <keel binary>   (CHROMIUM names the browser; /usr/bin/chromium by default)
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { build } from "esbuild";
import { chromium } from "playwright-core";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const binary = process.argv[2];
const work = mkdtempSync(join(tmpdir(), "keel-example-"));
const children = [];
const servers = [];

/** Serves the example's page and its bundle. */
async function servePage() {
  const bundle = await build({
    entryPoints: [join(root, "examples/react-chat/app.tsx")],
    bundle: true,
    format: "esm",
    write: false,
    minify: true,
    alias: { "@keel/client": join(root, "src/index.ts"), "@keel/client/react": join(root, "src/react.ts") },
    define: { "process.env.NODE_ENV": '"production"' },
  });
  const files = {
    "/": { type: "text/html", body: readFileSync(join(root, "examples/react-chat/index.html")) },
    "/app.js": { type: "text/javascript", body: bundle.outputFiles[0].contents },
  };
  const server = createServer((request, response) => {
    const file = files[new URL(request.url, "http://x").pathname];
    if (!file) return response.writeHead(404).end();
    response.writeHead(200, { "content-type": file.type }).end(file.body);
  });
  servers.push(server);
  await new Promise((done) => server.listen(0, "127.0.0.1", done));
  return `http://127.0.0.1:${server.address().port}`;
}

/** Starts keel serve on the test agent, letting `origin` call it. */
async function startKeel(origin, token) {
  const child = spawn(binary, ["serve", join(root, "test/agent"), "--port", "0", "--store", `sqlite:${join(work, "keel.db")}`], {
    env: { ...process.env, KEEL_API_TOKEN: token, KEEL_CORS_ORIGINS: origin, KEEL_LOG: "warn" },
    stdio: ["ignore", "ignore", "pipe"],
  });
  children.push(child);
  let said = "";
  return new Promise((resolve, reject) => {
    child.stderr.on("data", (chunk) => {
      said += chunk;
      const found = /http:\/\/[0-9.:]+(?=\s)/.exec(said);
      if (found) resolve(found[0]);
    });
    child.on("exit", (code) => reject(new Error(`keel serve exited (${code}): ${said}`)));
  });
}

const token = `example-${Math.random().toString(36).slice(2)}`;
const page = await servePage();
const keel = await startKeel(page, token);
// The proxy is a TypeScript module of the tests: esbuild makes it runnable here.
const proxyModule = await build({ entryPoints: [join(root, "test/proxy.ts")], bundle: true, platform: "node", format: "esm", write: false });
const proxyFile = join(work, "proxy.mjs");
(await import("node:fs")).writeFileSync(proxyFile, proxyModule.outputFiles[0].contents);
const { CuttingProxy } = await import(proxyFile);
const proxy = new CuttingProxy(new URL(keel), 0);
const through = await proxy.listen();

const browser = await chromium.launch({ executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium", args: ["--no-sandbox"] });
try {
  const tab = await browser.newPage();
  const failures = [];
  tab.on("pageerror", (error) => failures.push(String(error)));
  const session = `example-${Date.now()}`;
  await tab.goto(`${page}/?url=${encodeURIComponent(through)}&token=${token}&session=${session}`);
  await tab.waitForFunction(() => document.getElementById("status")?.textContent.endsWith("ready"));

  // A turn: the user's message at once, then the reply, through a connection dropped mid-run.
  await tab.fill("input[aria-label=message]", "What day is it?");
  await tab.press("input[aria-label=message]", "Enter");
  await tab.locator(".message.user", { hasText: "What day is it?" }).waitFor();
  await tab.waitForFunction(() => document.getElementById("status")?.textContent.endsWith("ready") && document.querySelectorAll(".message.assistant").length === 2, null, { timeout: 15000 });
  assert.equal(proxy.cuts, 1, "the first turn's connection was dropped");
  const replies = await tab.locator(".message.assistant").allTextContents();
  assert.match(replies[0], /^Let me look\.day_name \{\} → "\w+day" \(\d+ ms\)$/);
  assert.match(replies[1], /^Today is \w+day, a good day\.$/, "the reply once, without the retried call's words");
  assert.equal(await tab.locator(".message.user.optimistic").count(), 0);

  // An approval, given by clicking.
  await tab.fill("input[aria-label=message]", "Note the date.");
  await tab.press("input[aria-label=message]", "Enter");
  const approval = tab.locator(".pending", { hasText: "current_date" });
  await approval.waitFor();
  assert.match(await tab.textContent("#status"), /awaiting_input$/);
  assert.equal(await tab.locator(".tool.awaiting_approval").count(), 1);
  await approval.locator("button", { hasText: "Approve" }).click();
  await tab.locator(".message.assistant", { hasText: "Noted:" }).waitFor({ timeout: 15000 });
  assert.equal(await tab.locator(".tool.done").count(), 2);
  assert.equal(await tab.locator(".pending").count(), 0);

  // A question, answered in its form.
  await tab.fill("input[aria-label=message]", "Book a trip.");
  await tab.press("input[aria-label=message]", "Enter");
  await tab.locator(".pending", { hasText: "Which city?" }).waitFor();
  await tab.fill("input[aria-label=answer]", "Lisbon");
  await tab.press("input[aria-label=answer]", "Enter");
  await tab.locator(".message.assistant", { hasText: "Off to Lisbon." }).waitFor({ timeout: 15000 });

  // A reload reads the same conversation back from keel.
  const before = await tab.locator("#messages .message").allTextContents();
  await tab.reload();
  await tab.waitForFunction((count) => document.querySelectorAll("#messages .message").length === count, before.length);
  const after = await tab.locator("#messages .message").allTextContents();
  assert.deepEqual(after.map((t) => t.replace(/ \(\d+ ms\)/g, "")), before.map((t) => t.replace(/ \(\d+ ms\)/g, "")));
  assert.deepEqual(failures, [], "the page threw");
  console.log("example app: optimistic turn, a dropped connection resumed, approval, question, reload");
} finally {
  await browser.close();
  await proxy.close();
  for (const child of children) child.kill("SIGTERM");
  for (const server of servers) server.close();
  rmSync(work, { recursive: true, force: true });
}
