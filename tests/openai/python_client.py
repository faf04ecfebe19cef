"""The official `openai` Python package against `keel serve` (run by scripts/openai-test.sh).

Chat Completions and Responses, sync and async, streamed and not; a session continued with
`X-Keel-Session` and with `previous_response_id`; a run that pauses for a human; structured
output; and the errors a client gets for what keel refuses.
"""

import asyncio
import json
import re
import sys
import urllib.request

import openai
from openai import AsyncOpenAI, OpenAI

base, token, structured_base = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0)
ANSWER = re.compile(r"^Let me look at the calendar\.\n\nToday is \w+day\.$")
ASK = [{"role": "user", "content": "What day is it?"}]


def check(condition, what):
    if not condition:
        raise AssertionError(what)


# The agent is the one model.
models = client.models.list()
check([m.id for m in models.data] == ["openai-test"], f"models: {models}")
check(client.models.retrieve("openai-test").owned_by == "keel", "retrieve")

# Not streamed: the run's text, turns apart; the first attempt of the broken answer is gone.
raw = client.chat.completions.with_raw_response.create(model="openai-test", messages=ASK)
completion = raw.parse()
content = completion.choices[0].message.content
check(ANSWER.match(content), f"content: {content!r}")
check(completion.choices[0].finish_reason == "stop", completion)
check(completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens > 0, completion.usage)
session = raw.headers["x-keel-session"]
check(completion.model_extra["keel"]["sessionId"] == session, completion.model_extra)
check(completion.model_extra["keel"]["status"] == "finished", completion.model_extra)

# Streamed, with usage: the same text, though the answer's first attempt broke off midway.
stream = client.chat.completions.create(
    model="openai-test", messages=ASK, stream=True, stream_options={"include_usage": True}
)
pieces, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
streamed = "".join(pieces)
check(ANSWER.match(streamed), f"streamed: {streamed!r}")
check(len([p for p in pieces if p]) >= 4, f"not streamed in pieces: {pieces}")
check(finish == "stop" and usage and usage.completion_tokens > 0, (finish, usage))

# The session goes on with X-Keel-Session: the agent asks a question and the run pauses; the
# answer says what it waits for and how to decide it.
paused = client.chat.completions.create(
    model="openai-test",
    messages=[{"role": "user", "content": "Book me a trip."}],
    extra_headers={"X-Keel-Session": session},
)
keel = paused.model_extra["keel"]
check(keel["status"] == "awaiting_input" and keel["pending"][0]["kind"] == "question", keel)
question = keel["pending"][0]["id"]
check(f"POST /chat/{session}/approvals/{question}" in paused.choices[0].message.content, paused)
# Answered through keel's own API, the run goes on; the next message continues the session.
request = urllib.request.Request(
    f"{base}/chat/{session}/approvals/{question}",
    data=json.dumps({"answer": "Lisbon"}).encode(),
    headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
)
with urllib.request.urlopen(request) as response:
    check(b"run.done" in response.read(), "the answered run did not finish")
echo = client.chat.completions.create(
    model="openai-test",
    messages=[{"role": "user", "content": "Echo this."}],
    extra_headers={"X-Keel-Session": session},
)
check(echo.choices[0].message.content == "Echo this.", echo)

# What keel refuses, in OpenAI's error shape, naming the parameter.
def refused(error_class, param, **kwargs):
    try:
        client.chat.completions.create(**{"model": "openai-test", "messages": ASK, **kwargs})
    except error_class as error:
        check(error.param == param, f"{param}: {error.body}")
        return error
    raise AssertionError(f"not refused: {kwargs}")


refused(openai.BadRequestError, "tools", tools=[{"type": "function", "function": {"name": "x", "parameters": {}}}])
refused(openai.BadRequestError, "n", n=2)
refused(openai.BadRequestError, "stop", stop=["\n"])
refused(openai.BadRequestError, "response_format", response_format={"type": "json_object"})
refused(openai.NotFoundError, "model", model="gpt-4o")
refused(openai.BadRequestError, "messages", messages=[{"role": "assistant", "content": "hi"}])
refused(openai.BadRequestError, "messages", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]}])
refused(openai.BadRequestError, "frobnicate", extra_body={"frobnicate": True})
# Harmless settings are accepted.
check(ANSWER.match(client.chat.completions.create(model="openai-test", messages=ASK, temperature=0.2, max_tokens=50, seed=1, user="u").choices[0].message.content), "harmless settings")
try:
    OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was let in")
except openai.AuthenticationError:
    pass


# Responses, async: not streamed, then continued by previous_response_id, streamed.
async def responses():
    aclient = AsyncOpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0)
    first = await aclient.responses.create(model="openai-test", input="What day is it?")
    check(first.status == "completed" and ANSWER.match(first.output_text), first)
    check(first.id.startswith("resp_"), first.id)
    events = await aclient.responses.create(
        model="openai-test", input="Book me a trip.", previous_response_id=first.id, stream=True
    )
    kinds, final = [], None
    async for event in events:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    check(kinds[:2] == ["response.created", "response.in_progress"], kinds)
    check(final is not None and final.status == "incomplete", kinds)
    check(final.previous_response_id == first.id, final)
    check("Which city?" in final.output_text, final.output_text)
    check(final.model_extra["keel"]["sessionId"] == first.model_extra["keel"]["sessionId"], "another session")
    try:
        await aclient.responses.create(model="openai-test", input="hi", previous_response_id="resp_nothing")
        raise AssertionError("an unknown previous response was accepted")
    except openai.NotFoundError as error:
        check(error.param == "previous_response_id", error.body)
    # Async chat, streamed.
    chunks = await aclient.chat.completions.create(model="openai-test", messages=ASK, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    check(ANSWER.match(text), text)


asyncio.run(responses())

# Structured output: the answer is the output schema's JSON, asked for as OpenAI asks.
structured = OpenAI(base_url=f"{structured_base}/v1", api_key=token, max_retries=0)
answer = structured.chat.completions.create(
    model="structured",
    messages=[{"role": "user", "content": "Plan a trip."}],
    response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": {"type": "object"}}},
)
check(json.loads(answer.choices[0].message.content) == {"city": "Lisbon", "days": 3}, answer)
parsed = structured.responses.create(model="structured", input="Plan a trip.")
check(json.loads(parsed.output_text) == {"city": "Lisbon", "days": 3}, parsed)

print(f"openai {openai.__version__} (Python): models, chat (sync, streamed, async), responses (async, streamed, continued), a paused run, structured output, refusals")
