#!/usr/bin/env bash
# The playground page in real headless Chromium: installs Debian's chromium (when missing and
# when root) and playwright-core from npm (into target/), starts `keel serve` on a test agent
# with a token, and runs tests/browser/playground.mjs against it; then tests/browser/cross-origin.mjs:
# what a page on another origin can do to a keel without auth (nothing) and with CORS configured.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/serve-for-test.sh
ensure_chromium
modules=target/browser-test
if [ ! -d "$modules/node_modules/playwright-core" ]; then
  mkdir -p "$modules"
  (cd "$modules" && npm install --silent --no-audit --no-fund --no-save playwright-core@1 > /dev/null)
fi
token="browser-$RANDOM-$RANDOM"
start_keel_serve tests/browser/agent "$token"
CHROMIUM="$chromium" node tests/browser/playground.mjs "$address" "$token" "$PWD/$modules/node_modules"
# A page on another origin against a keel without auth, then against one that lists it in
# KEEL_CORS_ORIGINS (the page's origin is fixed: the test serves it on that port).
page_port=$((20000 + RANDOM % 20000))
start_keel_serve tests/browser/agent ""
open_address="$address"
start_keel_serve tests/browser/agent "" KEEL_CORS_ORIGINS="http://127.0.0.1:$page_port"
CHROMIUM="$chromium" node tests/browser/cross-origin.mjs "$open_address" "$address" "$page_port" \
  "$PWD/$modules/node_modules"
