#!/usr/bin/env bash
# Installs what keel's OpenTelemetry test decodes spans with, from PyPI: opentelemetry-proto
# (the official protobuf definitions of OTLP, generated for Python) and protobuf. Idempotent;
# prints the venv's directory.
#
#   scripts/otel-peers.sh           # install into target/peers/otel-venv (or $KEEL_PEERS_DIR)
#
# The test calls it itself when it is missing; tests/peers/otlp_receiver.py is the receiver.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${KEEL_PEERS_DIR:-$PWD/target/peers}"
mkdir -p "$dir"
proto_version="1.45.2"
exec 9> "$dir/.otel.lock"
flock 9
venv="$dir/otel-venv"
check='from opentelemetry.proto.collector.trace.v1 import trace_service_pb2'
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "$check" 2> /dev/null; then
  echo "otel-peers: PyPI opentelemetry-proto==$proto_version" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "opentelemetry-proto==$proto_version" >&2
fi
echo "$venv"
