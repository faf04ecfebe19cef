#!/usr/bin/env bash
# Regenerates crates/keel/startup.ld, the layout of the code keel runs while it starts.
#
# Builds the `dist` binary with its symbols and without the layout, records which of its
# functions run under callgrind (`keel --version`, `keel run` of the example agent, `keel serve`
# of it up to a health check, then up to a chat), does the same for the build without optional
# features (some of its start-up functions have other names or are inlined elsewhere), and
# writes them as the linker script's patterns (scripts/startup-layout.py). Run it when start-up
# changes a lot (a new subsystem, a new dependency in the path of every start); a stale script
# only lays out less of the code together. Needs valgrind and python3; takes about 40 minutes on
# 2 cores from a cold build.
#
#   scripts/startup-layout.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is not installed: apt install valgrind" >&2; exit 1; }
binary="$PWD/target/dist/keel"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
record() { valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/$1.cg" "${@:2}"; }

# keel serve up to its first health check (what an idle server has run), or (`chat*`) up to a
# chat.
serve() {
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # valgrind itself in the background (not `record`: `$!` would be a subshell's, which a signal
  # does not reach past).
  valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/$1.cg" \
    "$binary" serve examples/assistant --store memory --port "$port" >/dev/null 2>&1 &
  local server=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 0.1
  done
  case "$1" in
    chat*) curl -sf "http://127.0.0.1:$port/chat" -H 'content-type: application/json' \
      -d '{"sessionId": "layout", "input": "hello"}' >/dev/null ;;
  esac
  # Told to stop, keel serve shuts down and callgrind writes its profile. (SIGTERM: a
  # background job of a script ignores SIGINT.)
  kill -TERM "$server"
  wait "$server" || true
}

# Builds keel (cargo arguments after the first) with its symbols and laid out as the compiler
# emits it (valgrind names no function in a code section other than `.text`; building keel again
# afterwards lays it out), and records its four profiles, their names ending in $1.
profile() {
  KEEL_STARTUP_LAYOUT=off CARGO_PROFILE_DIST_STRIP=false cargo build --profile dist -p keel "${@:2}"
  record "version$1" "$binary" --version >/dev/null 2>&1
  record "run$1" "$binary" run examples/assistant hello >/dev/null 2>&1
  serve "serve$1"
  serve "chat$1"
}
profile ""
profile "-lean" --no-default-features

# An idle server's functions first, then a chat's, then the CLI's: what an idle `keel serve`
# runs then lies in as few pages as it can, and the kernel's fault-around maps little else. The
# default build's first in each, then what the lean build adds.
python3 scripts/startup-layout.py "$binary" \
  "$work"/{serve,serve-lean,chat,chat-lean,run,run-lean,version,version-lean}.cg \
  > crates/keel/startup.ld
# target/dist/keel is now the lean build without the layout.
echo "crates/keel/startup.ld written; build keel again (cargo build --profile dist -p keel) to use it" >&2
