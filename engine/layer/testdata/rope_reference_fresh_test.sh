#!/bin/bash
# Checks that rope_reference.inc is what rope_reference.py prints today, so the table rope_test
# compares against cannot drift from the script that documents how it was made.
set -euo pipefail
/usr/bin/python3 "$1" | diff -u "$2" - && echo "rope_reference.inc is fresh"
