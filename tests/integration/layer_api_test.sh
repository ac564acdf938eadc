#!/usr/bin/env bash
# Runs layer_api_test.py with Debian's python3 (numpy, grpcio, protobuf), the latentd_client
# package and the shared numpy reference (clients/python/examples) from the runfiles.
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
export PYTHONPATH="$root/clients/python:$root/clients/python/examples${PYTHONPATH:+:$PYTHONPATH}"
exec /usr/bin/python3 "$root/tests/integration/layer_api_test.py" "$@"
