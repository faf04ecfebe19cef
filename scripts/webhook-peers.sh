#!/usr/bin/env bash
# Installs the vendors' own webhook-signing libraries that keel's channel tests sign with, from
# PyPI and npm: slack-sdk (Slack), standardwebhooks (Standard Webhooks), PyNaCl and
# discord-interactions (Discord), @octokit/webhooks-methods (GitHub). Idempotent; prints the
# directory it installed to (venv/ and npm/ inside).
#
#   scripts/webhook-peers.sh        # install into target/peers/webhooks (or $KEEL_PEERS_DIR/webhooks)
#
# The tests call it themselves when the libraries are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${KEEL_PEERS_DIR:-$PWD/target/peers}/webhooks"
mkdir -p "$dir"
exec 9> "$dir/.lock"
flock 9
if [ ! -x "$dir/venv/bin/python" ] || ! "$dir/venv/bin/python" -c "import slack_sdk, standardwebhooks, nacl, discord_interactions" 2> /dev/null; then
  echo "webhook-peers: PyPI slack-sdk standardwebhooks pynacl discord-interactions" >&2
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check \
    slack-sdk==3.47.0 standardwebhooks==1.1.0 pynacl==1.6.2 discord-interactions==0.4.0 >&2
fi
if [ ! -d "$dir/npm/node_modules/@octokit/webhooks-methods" ]; then
  echo "webhook-peers: npm @octokit/webhooks-methods" >&2
  mkdir -p "$dir/npm"
  npm install --prefix "$dir/npm" --no-audit --no-fund --loglevel=error "@octokit/webhooks-methods@6.0.0" >&2
fi
echo "$dir"
