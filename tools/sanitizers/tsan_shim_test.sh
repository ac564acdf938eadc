#!/usr/bin/env bash
# Runs the shim probe without and with the TSan shim: without it TSan must report a
# race (so the probe really exercises abseil's hidden synchronization), with it none.
set -uo pipefail
without=$1
with=$2
export TSAN_OPTIONS="halt_on_error=0:exitcode=66:report_signal_unsafe=0"

out=$("$without" 2>&1); rc=$?
if [[ $rc -ne 66 ]] || ! grep -q "WARNING: ThreadSanitizer: data race" <<<"$out"; then
  echo "FAIL: the probe without the shim did not report a race (rc $rc):"
  echo "$out"
  exit 1
fi
echo "without the shim: TSan reports $(grep -c 'WARNING: ThreadSanitizer' <<<"$out") race(s), as expected"

out=$("$with" 2>&1); rc=$?
if [[ $rc -ne 0 ]] || grep -q "WARNING: ThreadSanitizer" <<<"$out"; then
  echo "FAIL: the probe with the shim (rc $rc):"
  echo "$out"
  exit 1
fi
echo "with the shim: no report"
echo "PASS"
