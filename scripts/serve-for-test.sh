# Sourced by the test scripts. `ensure_chromium` sets `chromium` to Debian's chromium (CHROMIUM
# names another), installing it when missing and when root. `start_keel_serve AGENT TOKEN
# [NAME=VALUE...]` builds keel,
# starts `keel serve` on AGENT with bearer TOKEN (none when empty) and the given environment, a
# fresh SQLite store and a free port, and sets `address` to its URL. Every server started so is
# stopped (and its files removed) when the calling script exits. `wait_for_address LOG` (below)
# waits for the URL of a server started otherwise.
serve_pids=()
serve_dirs=()
stop_keel_servers() {
  for pid in "${serve_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${serve_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for dir in "${serve_dirs[@]}"; do rm -rf "$dir"; done
}
trap stop_keel_servers EXIT

start_keel_serve() {
  local agent="$1" token="$2"
  shift 2
  cargo build --quiet -p keel
  local work
  work=$(mktemp -d)
  serve_dirs+=("$work")
  env KEEL_API_TOKEN="$token" KEEL_LOG=error "$@" target/debug/keel serve "$agent" \
    --store "sqlite:$work/keel.db" --port 0 2> "$work/serve.log" &
  serve_pids+=($!)
  wait_for_address "$work/serve.log"
}

# `wait_for_address LOG`: sets `address` to the URL a starting `keel serve` prints to LOG (its
# stderr), waiting up to 10 s; prints the log and exits if none comes.
wait_for_address() {
  address=""
  for _ in $(seq 100); do
    address=$(grep -o 'http://[0-9.:]*' "$1" || true)
    [ -n "$address" ] && break
    sleep 0.1
  done
  [ -n "$address" ] || { cat "$1"; exit 1; }
}

ensure_chromium() {
  chromium="${CHROMIUM:-/usr/bin/chromium}"
  if [ ! -x "$chromium" ]; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "the browser tests need Debian's chromium: apt-get install chromium (as root)" >&2
      exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium > /dev/null
  fi
}
