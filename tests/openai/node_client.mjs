// The official `openai` npm package against `keel serve` (run by scripts/openai-test.sh): chat
// completions streamed and not, a session continued with X-Keel-Session, Responses streamed and
// continued by previous_response_id, structured output, and the errors of what keel refuses.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import assert from "node:assert/strict";

const [base, token, structuredBase, modulesDir] = process.argv.slice(2);
const require = createRequire(modulesDir + "/");
const { default: OpenAI } = require("openai");

const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: token, maxRetries: 0 });
const ANSWER = /^Let me look at the calendar\.\n\nToday is \w+day\.$/;
const ask = [{ role: "user", content: "What day is it?" }];

const models = await client.models.list();
assert.deepEqual(models.data.map((m) => m.id), ["openai-test"]);

// Not streamed, with the raw response for the session header.
const { data: completion, response } = await client.chat.completions.create({ model: "openai-test", messages: ask }).withResponse();
assert.match(completion.choices[0].message.content, ANSWER);
assert.equal(completion.choices[0].finish_reason, "stop");
const session = response.headers.get("x-keel-session");
assert.equal(completion.keel.sessionId, session);

// Streamed: the same text, in pieces, with usage at the end.
const stream = await client.chat.completions.create({
  model: "openai-test", messages: ask, stream: true, stream_options: { include_usage: true },
});
let text = "", pieces = 0, usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    if (choice.delta.content) { text += choice.delta.content; pieces++; }
  }
}
assert.match(text, ANSWER);
assert.ok(pieces >= 4, `not streamed in pieces (${pieces})`);
assert.ok(usage && usage.total_tokens > 0);

// The session goes on: the run pauses for a question, and says so.
const paused = await client.chat.completions.create(
  { model: "openai-test", messages: [{ role: "user", content: "Book me a trip." }] },
  { headers: { "X-Keel-Session": session } },
);
assert.equal(paused.keel.status, "awaiting_input");
assert.match(paused.choices[0].message.content, new RegExp(`waiting for an answer to "Which city\\?" \\(POST /chat/${session}/approvals/`));
// A second message while the run waits: refused, as OpenAI's clients report a conflict.
await assert.rejects(
  client.chat.completions.create({ model: "openai-test", messages: ask }, { headers: { "X-Keel-Session": session } }),
  (error) => error instanceof OpenAI.ConflictError && error.code === "KEEL_SESSION_BUSY",
);

// Responses: streamed, then continued by previous_response_id.
const events = await client.responses.create({ model: "openai-test", input: "What day is it?", stream: true });
let deltas = "", completed = null, last = -1;
for await (const event of events) {
  assert.equal(event.sequence_number, last + 1, "events in order");
  last = event.sequence_number;
  if (event.type === "response.output_text.delta") deltas += event.delta;
  if (event.type === "response.completed") completed = event.response;
}
assert.match(deltas, ANSWER);
assert.equal(completed.status, "completed");
assert.match(completed.output[0].content[0].text, ANSWER);
const next = await client.responses.create({ model: "openai-test", input: "Book me a trip.", previous_response_id: completed.id });
assert.equal(next.status, "incomplete");
assert.equal(next.keel.sessionId, completed.keel.sessionId);
assert.match(next.output_text, /Which city\?/);

// Refusals name the parameter.
await assert.rejects(
  client.chat.completions.create({ model: "openai-test", messages: ask, tools: [{ type: "function", function: { name: "x" } }] }),
  (error) => error instanceof OpenAI.BadRequestError && error.param === "tools",
);
await assert.rejects(
  client.responses.create({ model: "openai-test", input: "hi", instructions: "Be a pirate." }),
  (error) => error instanceof OpenAI.BadRequestError && error.param === "instructions",
);
await assert.rejects(
  client.chat.completions.create({ model: "nope", messages: ask }),
  (error) => error instanceof OpenAI.NotFoundError && error.param === "model",
);

// Structured output.
const structured = new OpenAI({ baseURL: `${structuredBase}/v1`, apiKey: token, maxRetries: 0 });
const plan = await structured.chat.completions.create({
  model: "structured",
  messages: [{ role: "user", content: "Plan a trip." }],
  response_format: { type: "json_object" },
});
assert.deepEqual(JSON.parse(plan.choices[0].message.content), { city: "Lisbon", days: 3 });

const { version } = JSON.parse(readFileSync(`${modulesDir}/openai/package.json`, "utf8"));
console.log(`openai ${version} (npm): models, chat (streamed and not), a paused run, a busy session, responses (streamed, continued), structured output, refusals`);
