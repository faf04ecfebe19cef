// What a web page on another origin can make a browser do to keel, in real headless Chromium:
// against a keel without auth, nothing (no run from a `text/plain` POST, a form or a JSON
// fetch; no transcript, no events; a DNS-rebound name refused); against a keel whose
// KEEL_CORS_ORIGINS lists the page's origin, a JSON fetch runs a turn and reads its stream.
// Run by scripts/browser-test.sh: node cross-origin.mjs OPEN_BASE CORS_BASE PAGE_PORT MODULES.
import { createRequire } from "node:module";
import http from "node:http";
import assert from "node:assert/strict";

const [openBase, corsBase, pagePort, modulesDir] = process.argv.slice(2);
const require = createRequire(modulesDir + "/");
const { chromium } = require("playwright-core");

// The attacker's page. Its form posts `text/plain` JSON, the classic trick: the field's name and
// value join with `=` into `{"sessionId":"form-victim","input":"x","pad":"="}`.
const evilPage = `<!doctype html><title>a page on another origin</title>
<form id="form" method="POST" enctype="text/plain" target="sink">
<input name='{"sessionId":"form-victim","input":"x","pad":"' value='"}'></form>
<iframe name="sink"></iframe>`;
const pages = http
  .createServer((_, response) => {
    response.writeHead(200, { "content-type": "text/html" });
    response.end(evilPage);
  })
  .listen(Number(pagePort), "127.0.0.1");
await new Promise((resolve) => pages.once("listening", resolve));
const pageOrigin = `http://127.0.0.1:${pagePort}`;

// A conversation of the user's own, made the way a local client does.
const mine = await fetch(`${openBase}/chat`, {
  method: "POST",
  headers: { "content-type": "application/json" },
  body: JSON.stringify({ sessionId: "mine", input: "my private question" }),
});
assert.equal(mine.status, 200);
await mine.text();

const openPort = new URL(openBase).port;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  // A DNS rebinding, without DNS: the attacker's name resolves to 127.0.0.1.
  args: ["--no-sandbox", "--disable-dev-shm-usage", "--host-resolver-rules=MAP rebind.evil.example 127.0.0.1"],
});
try {
  const page = await browser.newPage();
  await page.goto(`${pageOrigin}/`);
  const attempts = await page.evaluate(async (base) => {
    const out = {};
    // A "simple" request: no preflight; its answer is opaque to the page anyway.
    await fetch(`${base}/chat`, {
      method: "POST",
      mode: "no-cors",
      headers: { "content-type": "text/plain" },
      body: JSON.stringify({ sessionId: "simple-victim", input: "run this" }),
    }).catch(() => {});
    // JSON needs a preflight, which keel does not answer for this origin.
    out.json = await fetch(`${base}/chat`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ sessionId: "json-victim", input: "run this" }),
    }).then((r) => `answered ${r.status}`, () => "blocked");
    out.read = await fetch(`${base}/chat/mine`).then(async (r) => `read ${r.status} ${await r.text()}`, () => "blocked");
    out.events = await new Promise((resolve) => {
      const source = new EventSource(`${base}/chat/mine/events`);
      source.onopen = () => { source.close(); resolve("open"); };
      source.onerror = () => { source.close(); resolve("error"); };
    });
    const form = document.getElementById("form");
    form.action = `${base}/chat`;
    form.submit();
    return out;
  }, openBase);
  assert.equal(attempts.json, "blocked", "a JSON POST from another origin went through");
  assert.equal(attempts.read, "blocked", "the page read a transcript");
  assert.equal(attempts.events, "error", "the page opened the event stream");
  await new Promise((resolve) => setTimeout(resolve, 1000));
  for (const session of ["simple-victim", "json-victim", "form-victim"]) {
    const response = await fetch(`${openBase}/chat/${session}`);
    assert.equal(response.status, 404, `the page started a run in session ${session}`);
  }

  // DNS rebinding: the page's own name, now pointing at 127.0.0.1. Same-origin for the browser,
  // refused by keel by name.
  const rebound = await page.goto(`http://rebind.evil.example:${openPort}/chat/mine`);
  assert.equal(rebound.status(), 403, "a rebound name read the transcript");
  assert.match(await rebound.text(), /KEEL_HOST_NOT_ALLOWED/);

  // With the page's origin in KEEL_CORS_ORIGINS, it may call the API and read the answers.
  await page.goto(`${pageOrigin}/`);
  const allowed = await page.evaluate(async (base) => {
    const response = await fetch(`${base}/chat`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ sessionId: "cors-ok", input: "hello" }),
    });
    return { status: response.status, text: await response.text() };
  }, corsBase);
  assert.equal(allowed.status, 200);
  assert.match(allowed.text, /"type":"run\.start"/);
  assert.match(allowed.text, /event: done/);
  // OpenAI's face too, with the headers OpenAI's browser SDK adds, and the session readable.
  const openai = await page.evaluate(async (base) => {
    const response = await fetch(`${base}/v1/chat/completions`, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        "x-keel-session": "cors-openai",
        "x-stainless-lang": "js",
        "x-stainless-retry-count": "0",
      },
      body: JSON.stringify({ model: "browser-test", messages: [{ role: "user", content: "hello" }] }),
    });
    return { status: response.status, session: response.headers.get("x-keel-session"), body: await response.json() };
  }, corsBase);
  assert.equal(openai.status, 200, JSON.stringify(openai.body));
  assert.equal(openai.session, "cors-openai");
  assert.equal(openai.body.object, "chat.completion");
  console.log("cross-origin: a page on another origin cannot drive keel; a listed one can");
} finally {
  await browser.close();
  pages.close();
}
