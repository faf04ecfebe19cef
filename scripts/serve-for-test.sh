# Sourced by the test scripts: `start_keel_serve AGENT TOKEN` builds keel, starts `keel serve`
# on AGENT with bearer TOKEN, a fresh SQLite store and a free port, sets `address` to its URL,
# and stops it (and removes its files) when the calling script exits.
start_keel_serve() {
  local agent="$1" token="$2"
  cargo build --quiet -p keel
  serve_work=$(mktemp -d)
  KEEL_API_TOKEN="$token" KEEL_LOG=error target/debug/keel serve "$agent" \
    --store "sqlite:$serve_work/keel.db" --port 0 2> "$serve_work/serve.log" &
  serve_pid=$!
  trap 'kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null; rm -rf "$serve_work"' EXIT
  address=""
  for _ in $(seq 100); do
    address=$(grep -o 'http://[0-9.:]*' "$serve_work/serve.log" || true)
    [ -n "$address" ] && break
    sleep 0.1
  done
  [ -n "$address" ] || { cat "$serve_work/serve.log"; exit 1; }
}
