// Drives the playground page in real headless Chromium (Debian's, through playwright-core): the
// page names the agent; type a message, see the reply stream in, approve the pending tool call
// (one card for the call, with its duration; the approval keeps its outcome), see the run's
// timeline; a Markdown reply is rendered and its hostile parts are not; a long turn is stopped
// and says so; the sessions come from the server; a reload on a narrow screen finds the
// conversation again, and the keyboard opens a session. Run by scripts/browser-test.sh.
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const [base, token, modulesDir] = process.argv.slice(2);
const require = createRequire(modulesDir + "/");
const { chromium } = require("playwright-core");

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage();
  const failures = [];
  page.on("pageerror", (error) => failures.push(String(error)));
  // Every request the page makes: a rendered reply must not make it fetch anything.
  const requested = [];
  page.on("request", (request) => requested.push(request.url()));
  await page.goto(`${base}/?session=browser-1`);
  await page.fill("#token", token);
  await page.dispatchEvent("#token", "change");

  // The page names the agent, from GET /agent.
  await page.waitForFunction(() => document.getElementById("agent-name").textContent === "browser-test");
  assert.equal(await page.textContent("#agent-description"), "The agent of the playground's browser test.");
  assert.equal(await page.textContent("#tools summary"), "mock · 1 tool");
  assert.match(await page.textContent("#tools ul"), /day_name\s*needs approval/);
  assert.equal(await page.title(), "browser-test · keel");

  // Count the updates of the assistant's messages: a streamed reply arrives in pieces.
  await page.evaluate(() => {
    window.__updates = 0;
    new MutationObserver((records) => {
      for (const r of records) {
        const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
        if (el && el.closest(".msg.assistant")) window.__updates++;
      }
    }).observe(document.getElementById("log"), { subtree: true, childList: true, characterData: true });
  });

  await page.fill("#input", "What day is it?");
  await page.click("#send");
  await page.waitForSelector(".msg.user >> text=What day is it?");
  await page.waitForSelector(".msg.assistant >> text=Let me look at the calendar.");
  const approval = page.locator(".pending", { hasText: "Approve day_name" });
  await approval.waitFor();
  assert.match(await page.textContent("#state"), /waiting for you/);
  assert.equal(await page.locator(".tool.waiting").count(), 1, "the call waiting for approval is marked");

  await approval.locator("input").fill("looks fine");
  await approval.locator("button", { hasText: "Approve" }).click();
  await page.waitForFunction(() => document.getElementById("state").textContent.startsWith("done"), null, { timeout: 15000 });
  const reply = await page.locator(".msg.assistant").last().textContent();
  assert.match(reply, /^Today is \w+day, a fine day to ship software that does not lose your work\.$/);
  // The first attempt's words were dropped when the turn was retried.
  assert.equal(await page.locator(".msg.assistant", { hasText: "Nothingday" }).count(), 0);
  // The continued run announced the call again: still one card, finished, with its duration.
  assert.equal(await page.locator(".tool").count(), 1, "one card per tool call");
  const tool = await page.locator(".tool.ok").first().textContent();
  assert.match(tool, /day_name/);
  assert.match(tool, /✓ \w+day/);
  assert.match(await page.locator(".tool.ok summary").textContent(), /^✓ day_name \{\} · \d+ ms$/);
  // The approval keeps its outcome.
  assert.match(await approval.locator(".outcome").textContent(), /^✓ Approved by you \(looks fine\)$/);
  assert.equal(await approval.locator("button").count(), 0);
  assert.match(await page.textContent("#state"), /done \(final/);
  // The continued run's timeline: the wait for the human, the tool call and the model call, timed.
  const timeline = page.locator(".timeline-box").last();
  assert.match(await timeline.textContent(), /^Run done in [\d.]+ m?s · 1 wait [\d.]+ m?s · 1 model call [\d.]+ m?s · 1 tool call \d+ ms/);
  assert.deepEqual(await timeline.locator(".timeline span").evaluateAll((spans) => spans.map((s) => s.className)), ["wait", "tool-ok", "model"]);
  assert.match(await timeline.locator(".model").textContent(), /^model [\d.]+ m?s · \d+\+\d+ tokens$/);
  const updates = await page.evaluate(() => window.__updates);
  assert.ok(updates >= 4, `the reply did not stream (${updates} updates)`);
  // The session is listed by the server.
  await page.waitForFunction(() => /browser-1\s*4 messages/.test(document.querySelector("#sessions li.current")?.textContent));

  // Markdown is rendered; what a hostile model could write into it is shown as text, not run.
  // (Sent from the keyboard.)
  await page.fill("#input", "What can you do?");
  await page.press("#input", "Enter");
  await page.waitForFunction(() => document.getElementById("state").textContent.startsWith("done"), null, { timeout: 15000 });
  const markdown = page.locator(".msg.assistant").last();
  assert.equal(await markdown.locator("strong").textContent(), "what I can do");
  assert.deepEqual(await markdown.locator("li").allTextContents(), ["read the calendar", "answer questions"]);
  assert.equal(await markdown.locator("code").textContent(), "calendar");
  const links = await markdown.locator("a").evaluateAll((as) => as.map((a) => [a.textContent, a.getAttribute("href"), a.rel]));
  assert.deepEqual(links, [
    ["questions", "https://example.com/help", "noopener noreferrer nofollow"],
    ["[image: pixel]", "http://127.0.0.1:9/leak", "noopener noreferrer nofollow"],
  ]);
  assert.match(await markdown.textContent(), /<img src=x onerror="window.__pwned=1"> bad/);
  assert.equal(await page.locator("#log img").count(), 0, "an image was rendered");
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "the reply ran script");
  assert.deepEqual(requested.filter((url) => !url.startsWith(base)), [], "the page fetched another host");

  // A long turn is stopped, and the log says so.
  await page.fill("#input", "Take your time.");
  await page.click("#send");
  await page.waitForFunction(() => document.getElementById("state").textContent.startsWith("thinking"));
  await page.click("#stop");
  await page.waitForSelector(".marker.cancelled >> text=Run cancelled", { timeout: 15000 });
  assert.match(await page.textContent("#state"), /done \(cancelled/);
  if (process.env.SCREENSHOT) await page.screenshot({ path: process.env.SCREENSHOT.replace(/(\.png)?$/, "-live.png") });

  // The conversation is stored: a reload on a narrow screen shows it, with nothing pending.
  await page.setViewportSize({ width: 390, height: 800 });
  await page.reload();
  await page.waitForSelector(".msg.assistant >> text=/fine day to ship/");
  assert.equal(await page.locator(".pending").count(), 0);
  assert.equal(await page.locator(".tool").count(), 1);
  assert.equal(await page.locator(".msg.assistant strong").count(), 1, "the stored reply is rendered too");
  // Everything is on the narrow screen, and a session opens from the keyboard.
  for (const selector of ["#input", "#send", "#new", "#sessions li"]) {
    const box = await page.locator(selector).first().boundingBox();
    assert.ok(box && box.x >= 0 && box.x + box.width <= 390, `${selector} is off the narrow screen: ${JSON.stringify(box)}`);
  }
  await page.click("#new");
  assert.equal(await page.locator(".msg").count(), 0);
  await page.locator("#sessions li", { hasText: "browser-1" }).focus();
  await page.keyboard.press("Enter");
  await page.waitForSelector(".msg.assistant >> text=/fine day to ship/");
  assert.deepEqual(failures, [], "errors in the page");
  if (process.env.SCREENSHOT) await page.screenshot({ path: process.env.SCREENSHOT });
  console.log("browser test passed: agent named, streamed reply, approval with outcome, one timed tool card, timeline, safe Markdown, stop, server sessions, reload");
} finally {
  await browser.close();
}
