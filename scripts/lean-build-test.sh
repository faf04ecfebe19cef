#!/usr/bin/env bash
# The smallest keel: built with no optional capability (`--no-default-features`: no MCP, no
# PostgreSQL, no documents, no `js`, no OTLP), without a warning, and driven as a user would. What it lacks
# must be refused clearly (KEEL_SPEC_UNSUPPORTED or the store's error, naming the cargo
# feature), and what it has must work. CI runs it last; it leaves the full debug `keel` in
# place again at the end.
#
#   scripts/lean-build-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "lean-build-test: $*" >&2
  exit 1
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Built without any of them, and without a warning (code left unused by a missing feature shows
# up here). A separate clippy pass would check every dependency again for little more.
cargo build -p keel --no-default-features 2>&1 | tee "$work/build.log"
if grep -q '^warning' "$work/build.log"; then fail "the lean build has warnings"; fi
cargo test --quiet -p keel-store --no-default-features --lib without_postgres

trap 'kill "${serve_pid:-}" 2> /dev/null || true; rm -rf "$work"' EXIT
cp target/debug/keel "$work/keel"
keel="$work/keel"

"$keel" --version | grep -qx "features: none" || fail "--version does not say the build has no features"

# A spec needing what the build lacks: refused by `keel check`, at its place, naming the feature.
mkdir -p "$work/needs"
printf 'model: mock\ntools: [day_name, js]\nmcp:\n  - { name: docs, command: [docs-server] }\n' \
  > "$work/needs/agent.yaml"
set +e
"$keel" check "$work/needs" > "$work/check.out" 2> "$work/check.err"
status=$?
set -e
[ "$status" -eq 1 ] || fail "keel check exited $status, not 1: $(cat "$work/check.err")"
grep -q 'error\[KEEL_SPEC_UNSUPPORTED\]: the `js` tool: .* without the `js` cargo feature' "$work/check.err" ||
  fail "no js error: $(cat "$work/check.err")"
grep -q -- '--> .*/needs/agent.yaml:2:19$' "$work/check.err" || fail "the js error has not its place"
grep -q '`mcp` cargo feature' "$work/check.err" || fail "no mcp error: $(cat "$work/check.err")"
# `keel run` refuses it the same way, before any model call.
if "$keel" run "$work/needs" hi > /dev/null 2> "$work/run.err"; then fail "keel run ran an agent with js"; fi
grep -q 'KEEL_SPEC_UNSUPPORTED' "$work/run.err" || fail "keel run: $(cat "$work/run.err")"

# A PostgreSQL store: refused, naming the feature, never echoing the URL's password.
if "$keel" run examples/assistant hi --store postgres://keel:hunter2@127.0.0.1/keel \
  > /dev/null 2> "$work/pg.err"; then
  fail "a postgres:// store opened"
fi
grep -q 'the `postgres` cargo feature' "$work/pg.err" || fail "postgres: $(cat "$work/pg.err")"
if grep -q hunter2 "$work/pg.err"; then fail "the store error shows the password"; fi

if "$keel" mcp examples/assistant < /dev/null > /dev/null 2> "$work/mcp.err"; then
  fail "keel mcp served without MCP"
fi
grep -q '`mcp` cargo feature' "$work/mcp.err" || fail "keel mcp: $(cat "$work/mcp.err")"

# What it has works: a durable run on SQLite, resumed by session, and the HTTP API.
store="sqlite:$work/keel.db"
answer="$("$keel" run examples/assistant "What day is it?" --store "$store" --session s1 2> /dev/null)"
case "$answer" in Today\ is\ *) ;; *) fail "keel run answered: $answer" ;; esac
"$keel" sessions list --store "$store" | grep -q s1 || fail "the session is not in the store"

KEEL_LOG=error "$keel" serve examples/assistant --store "$store" --port 0 2> "$work/serve.log" &
serve_pid=$!
address=""
for _ in $(seq 100); do
  address="$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$work/serve.log" | head -n 1 || true)"
  [ -n "$address" ] && break
  sleep 0.1
done
[ -n "$address" ] || fail "keel serve did not start: $(cat "$work/serve.log")"
curl -fsS "$address/health" > /dev/null || fail "/health"
stream="$(curl -fsS -N -H 'content-type: application/json' \
  -d '{"sessionId":"s2","input":"What day is it?"}' "$address/chat")"
case "$stream" in *'Today is'*) ;; *) fail "POST /chat streamed: $stream" ;; esac
mcp="$(curl -sS -o /dev/null -w '%{http_code}' -X POST "$address/mcp")"
[ "$mcp" = 404 ] || fail "/mcp answered $mcp, not 404"
case "$(curl -sS -X POST "$address/mcp")" in *'`mcp` cargo feature'*) ;; *) fail "/mcp does not say why" ;; esac
kill "$serve_pid"

# Leave the full binary for whatever runs next.
cargo build --quiet -p keel
echo "lean-build-test: ok (a keel with no optional features refuses what it lacks and runs the rest)"
