#!/usr/bin/env bash
# The playground page in real headless Chromium: installs Debian's chromium (when missing and
# when root) and playwright-core from npm (into target/), starts `keel serve` on a test agent
# with a token, and runs tests/browser/playground.mjs against it.
set -euo pipefail
cd "$(dirname "$0")/.."

chromium="${CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the browser test needs Debian's chromium: apt-get install chromium (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium > /dev/null
fi
modules=target/browser-test
if [ ! -d "$modules/node_modules/playwright-core" ]; then
  mkdir -p "$modules"
  (cd "$modules" && npm install --silent --no-audit --no-fund --no-save playwright-core@1 > /dev/null)
fi
cargo build --quiet -p keel
work=$(mktemp -d)
token="browser-$RANDOM-$RANDOM"
KEEL_API_TOKEN="$token" KEEL_LOG=error target/debug/keel serve tests/browser/agent \
  --store "sqlite:$work/keel.db" --port 0 2> "$work/serve.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do
  address=$(grep -o 'http://[0-9.:]*' "$work/serve.log" || true)
  [ -n "$address" ] && break
  sleep 0.1
done
[ -n "$address" ] || { cat "$work/serve.log"; exit 1; }
CHROMIUM="$chromium" node tests/browser/playground.mjs "$address" "$token" "$PWD/$modules/node_modules"
