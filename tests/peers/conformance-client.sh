#!/usr/bin/env bash
# keel's MCP client under the official conformance suite: the suite starts a scenario server and
# runs this script with the server's URL last and MCP_CONFORMANCE_SCENARIO set. It writes an
# agent that uses that server (its mock model calls the scenario's tool) and runs it with `keel run`.
set -euo pipefail
url="${!#}"
keel="${KEEL_BIN:?set KEEL_BIN to the keel binary}"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
case "${MCP_CONFORMANCE_SCENARIO:-}" in
  tools_call) script='    - tool_calls: [{ name: s_add_numbers, input: { a: 2, b: 3 } }]' ;;
  sse-retry) script='    - tool_calls: [{ name: s_test_reconnection, input: {} }]' ;;
  elicitation-sep1034-client-defaults) script='    - tool_calls: [{ name: s_test_client_elicitation_defaults, input: {} }]' ;;
  *) script='    - text: connected' ;;
esac
cat > "$dir/agent.yaml" <<SPEC
model: mock
mcp: [ { name: s, url: "$url", startup_timeout: 10s } ]
mock:
  script:
$script
    - text: "done: {{last_tool_output}}"
SPEC
exec "$keel" run "$dir" go --store memory
