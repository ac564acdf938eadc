#!/usr/bin/env bash
# Runs python_client_test.py with the system python3 and the latentd_client package
# from the runfiles (a py_test's stub needs a `python` executable that Debian lacks).
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
export PYTHONPATH="$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
exec python3 "$root/tests/integration/python_client_test.py" -v
