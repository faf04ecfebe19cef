#!/usr/bin/env bash
# Installs what keel's trigger tests check against, from PyPI: cronsim (an independent cron
# implementation: tests/peers/cron_oracle.py). Idempotent; prints the venv's directory.
#
#   scripts/trigger-peers.sh        # install into target/peers/triggers-venv (or $KEEL_PEERS_DIR)
#
# The tests call it themselves when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${KEEL_PEERS_DIR:-$PWD/target/peers}"
mkdir -p "$dir"
cronsim_version="2.8"
exec 9> "$dir/.triggers.lock"
flock 9
venv="$dir/triggers-venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import cronsim" 2> /dev/null; then
  echo "trigger-peers: PyPI cronsim==$cronsim_version" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "cronsim==$cronsim_version" >&2
fi
echo "$venv"
