#!/usr/bin/env bash
# Runs a Python test script with Debian's interpreter (/usr/bin/python3, which has the
# python3-* packages even where another python3 comes first on the PATH).
set -euo pipefail
exec /usr/bin/python3 "$@"
