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
token="browser-$RANDOM-$RANDOM"
. scripts/serve-for-test.sh
start_keel_serve tests/browser/agent "$token"
CHROMIUM="$chromium" node tests/browser/playground.mjs "$address" "$token" "$PWD/$modules/node_modules"
