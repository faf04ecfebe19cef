#!/usr/bin/env bash
# Served turns measured from outside: wrk drives the release `keel serve` over loopback, each
# request a `POST /chat` of a new session (scripts/wrk-turns.lua), the mock model answering.
# Prints wrk's report (turns/s, latency, non-2xx answers) and the server's resident memory
# sampled every second, for each store asked for.
#
#   scripts/wrk-turns.sh                       # memory and SQLite, 10 s each, 32 connections
#   scripts/wrk-turns.sh sqlite                # one store
#   SECONDS_EACH=60 CONNECTIONS=64 scripts/wrk-turns.sh memory
#
# Needs wrk (`apt install wrk`). The server gets a fresh SQLite file per measurement; `idle` in
# the RSS line is the server after start-up, before the first request.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "wrk is not installed: apt install wrk" >&2; exit 1; }
seconds="${SECONDS_EACH:-10}"
connections="${CONNECTIONS:-32}"
stores=("$@")
[ ${#stores[@]} -gt 0 ] || stores=(memory sqlite)

[ -n "${KEEL_BIN:-}" ] || cargo build -q --release -p keel
keel="${KEEL_BIN:-target/release/keel}"
work=$(mktemp -d)
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$work"
}
mkdir -p "$work/agent"
printf 'name: load\nmodel: mock\n' > "$work/agent/agent.yaml"

# Only its `wait_for_address`: this script starts and stops its own servers.
# shellcheck source=scripts/serve-for-test.sh
source scripts/serve-for-test.sh
trap cleanup EXIT

rss() { awk '/^VmRSS:/ { print int($2 / 1024) }' "/proc/$1/status"; }

for store in "${stores[@]}"; do
  case "$store" in
    memory) url=memory ;;
    sqlite) url="sqlite:$work/keel-$RANDOM.db" ;;
    *) echo "unknown store $store: memory or sqlite" >&2; exit 1 ;;
  esac
  # Every connection comes from 127.0.0.1: lift the per-client connection cap.
  KEEL_LOG=error KEEL_MAX_CONNECTIONS_PER_CLIENT=0 "$keel" serve "$work/agent" \
    --port 0 --store "$url" 2> "$work/serve.log" &
  server=$!
  wait_for_address "$work/serve.log"
  sleep 1
  idle=$(rss "$server")
  (for _ in $(seq "$seconds"); do sleep 1; rss "$server"; done) > "$work/rss" &
  sampler=$!
  echo "== $store store: wrk -t1 -c$connections -d${seconds}s, a new session per POST /chat"
  wrk -t1 -c"$connections" -d"${seconds}s" --latency -s scripts/wrk-turns.lua "$address" | grep -v '^  Thread\|^    Latency\|Req/Sec'
  wait "$sampler"
  mapfile -t samples < "$work/rss"
  echo "server RSS (MiB): idle $idle, each second: ${samples[*]}"
  kill "$server"; wait "$server" 2>/dev/null || true; server=""
done
