#!/usr/bin/env bash
# The whole test suite: the README's test command, which .ci/run calls too.
#
#   scripts/test.sh                 # every test of every crate
#   scripts/test.sh -p keel-store   # arguments go to `cargo test` (instead of `--workspace`)
#
# The browser tool's tests drive a real headless Chromium: Debian's `chromium` is installed here
# when it is missing (as root; otherwise the script says how, and stops). The PostgreSQL tests
# need the local server (127.0.0.1:5432, trust auth, or `KEEL_TEST_POSTGRES`).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/serve-for-test.sh
source scripts/serve-for-test.sh
ensure_chromium
if [ $# -eq 0 ]; then
  set -- --workspace
fi
cargo test "$@"
