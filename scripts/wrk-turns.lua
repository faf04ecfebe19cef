-- wrk script for scripts/wrk-turns.sh: every request is `POST /chat` of a new session (a
-- counter per wrk thread, prefixed with the thread's number), so each one is a new durable run
-- and a new session in the store. wrk reads each answer to its end: the SSE stream closes after
-- `event: done`, so a request's latency is the whole turn.
local threads = {}
local counter = 0

function setup(thread)
  thread:set("prefix", tostring(#threads))
  table.insert(threads, thread)
end

function init(args)
  wrk.method = "POST"
  wrk.path = "/chat"
  wrk.headers["content-type"] = "application/json"
end

function request()
  counter = counter + 1
  local body = string.format('{"sessionId":"wrk-%s-%d","input":"hello there, keel"}', prefix, counter)
  return wrk.format(nil, nil, nil, body)
end

-- wrk itself counts answers that are not 2xx ("Non-2xx or 3xx responses"): a 409 or a 429 is
-- not a turn served. No `response` hook, so wrk does not keep each body.
function done(summary, latency, requests)
  io.write(string.format("latency p50 %.2f ms, p99 %.2f ms\n", latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
