#!/usr/bin/env bash
# Runs the Python test script given (a workspace path) with Debian's interpreter and the
# latentd_client package from the runfiles; further arguments go to the script.
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
export PYTHONPATH="$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
script="$root/$1"
shift
exec /usr/bin/python3 "$script" "$@"
