// Drives the playground page in real headless Chromium (Debian's, through playwright-core):
// type a message, see the reply stream in, approve the pending tool call, see the run finish,
// then reload and find the conversation again. Run by scripts/browser-test.sh.
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
  await page.goto(`${base}/?session=browser-1`);
  await page.fill("#token", token);
  await page.dispatchEvent("#token", "change");

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

  await approval.locator("button", { hasText: "Approve" }).click();
  await page.waitForFunction(() => document.getElementById("state").textContent.startsWith("done"), null, { timeout: 15000 });
  const reply = await page.locator(".msg.assistant").last().textContent();
  assert.match(reply, /^Today is \w+day, a fine day to ship software that does not lose your work\.$/);
  // The first attempt's words were dropped when the turn was retried.
  assert.equal(await page.locator(".msg.assistant", { hasText: "Nothingday" }).count(), 0);
  const tool = await page.locator(".tool.ok").first().textContent();
  assert.match(tool, /day_name/);
  assert.match(tool, /✓ \w+day/);
  assert.match(await page.textContent("#state"), /done \(final/);
  const updates = await page.evaluate(() => window.__updates);
  assert.ok(updates >= 4, `the reply did not stream (${updates} updates)`);

  // The conversation is stored: a reload shows it, with nothing pending.
  await page.reload();
  await page.waitForSelector(".msg.assistant >> text=/fine day to ship/");
  assert.equal(await page.locator(".pending").count(), 0);
  assert.deepEqual(failures, [], "errors in the page");
  if (process.env.SCREENSHOT) await page.screenshot({ path: process.env.SCREENSHOT });
  console.log("browser test passed: streamed reply, approval, finished run, reload");
} finally {
  await browser.close();
}
