#!/usr/bin/env bash
# Runs metrics_test.py with the system python3 and the latentd_client package from the
# runfiles; the test also needs Debian's prometheus server (/usr/bin/prometheus).
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
export PYTHONPATH="$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
exec python3 "$root/tests/integration/metrics_test.py" -v
