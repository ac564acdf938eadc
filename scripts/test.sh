#!/usr/bin/env bash
# Runs the whole CPU test suite: installs missing Debian packages, builds everything
# (CUDA kernels included when nvcc is present), runs every test not tagged gpu or
# benchmark, prints each kernel's ptxas resource usage, and ends with "N passed, N failed".
# Extra arguments go to bazel test (e.g. --config=nocuda).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
latentd_ensure_packages || { echo "latentd: package installation failed" >&2; exit 1; }

log=$(mktemp)
trap 'rm -f "$log"' EXIT
bazel test $(latentd_cuda_config) //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

reports=$(find -L bazel-bin/ -name '*.ptxas.txt' 2>/dev/null | sort)
if [[ -n $reports ]]; then
  echo "== ptxas resource usage (per kernel and architecture) =="
  # shellcheck disable=SC2086
  bash tools/check_ptxas.sh $reports || rc=1
fi

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' "$log")
# A build error leaves no per-test line: count it as a failure so the line cannot read clean.
if [[ $rc -ne 0 && $failed -eq 0 ]]; then failed=1; fi
echo "$passed passed, $failed failed"
[[ $rc -eq 0 && $failed -eq 0 ]]
