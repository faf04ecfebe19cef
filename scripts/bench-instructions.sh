#!/usr/bin/env bash
# Instructions per tool-loop run, for the memory, SQLite and PostgreSQL stores.
#
# The benchmark runs itself twice per store under callgrind (valgrind's instruction counter:
# repeatable whatever else the machine does), once with a small number of runs and once with a
# large one, and prints (total_large - total_small) / (large - small): start-up and warm-up are
# the same in both and cancel out. Every thread of the process counts (SQLite's writer too);
# the PostgreSQL server's own work does not. Needs valgrind (`apt install valgrind`) and, for
# PostgreSQL, the server of KEEL_TEST_POSTGRES (default: postgres@127.0.0.1:5432/test).
#
#   scripts/bench-instructions.sh            # full counts (a few minutes)
#   scripts/bench-instructions.sh --quick    # smaller N, about a minute
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is not installed: apt install valgrind" >&2; exit 1; }
exec cargo bench -q -p keel --bench tool_loop -- --instructions "$@"
