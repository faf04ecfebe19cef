#!/usr/bin/env bash
# The official OpenAI clients against `keel serve`'s OpenAI-compatible routes: the `openai`
# Python package (from PyPI, into target/openai-venv) and the `openai` npm package (into
# target/openai-node), pinned. Starts two servers: the tests' agent, and one with an output schema.
set -euo pipefail
cd "$(dirname "$0")/.."

python_version=3.57.0
npm_version=7.59.0
venv=target/openai-venv
if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$python_version')" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "openai==$python_version"
fi
modules=target/openai-node
if [ "$(node -p "require('./$modules/node_modules/openai/package.json').version" 2>/dev/null)" != "$npm_version" ]; then
  mkdir -p "$modules"
  (cd "$modules" && npm install --silent --no-audit --no-fund --no-save "openai@$npm_version" > /dev/null)
fi
token="openai-$RANDOM-$RANDOM"
. scripts/serve-for-test.sh
start_keel_serve tests/openai/structured "$token"
structured="$address"
start_keel_serve tests/openai/agent "$token"
"$venv/bin/python" tests/openai/python_client.py "$address" "$token" "$structured"
node tests/openai/node_client.mjs "$address" "$token" "$structured" "$PWD/$modules/node_modules"
