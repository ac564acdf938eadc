#!/usr/bin/env bash
# Runs the whole CPU test suite: installs missing Debian packages, builds everything
# (CUDA kernels included when nvcc is present), runs every test not tagged gpu,
# benchmark or fuzz, prints each kernel's ptxas resource usage, then runs the suite again
# under --config=asan and --config=tsan and every fuzz target for a bounded time
# (scripts/fuzz.sh), and ends with "N passed, N failed" over all of them.
# LATENTD_QUICK=1 skips the sanitizer and fuzz stages (local runs).
# Extra arguments go to the first bazel test only (e.g. --config=nocuda).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
latentd_ensure_packages || { echo "latentd: package installation failed" >&2; exit 1; }

log=$(mktemp)
times=()
failures=$(mktemp)
trap 'rm -f "$log" "$failures"' EXIT

# After a stage: the tail of each failed test's log goes into a summary printed last,
# so the end of the output (all a CI page may keep) names the failure and its cause.
note_failures() {
  local stage=$1 stage_log=$2 target path
  grep -E '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' "$stage_log" | awk '{print $1}' |
    while read -r target; do
      path=bazel-testlogs/${target#//}
      path=${path/://}/test.log
      {
        echo "== $stage: $target =="
        if [[ -f $path ]]; then tail -n 60 "$path"; else echo "(no test.log at $path)"; fi
      } >> "$failures"
    done
}
start=$SECONDS
bazel test $(latentd_cuda_config) //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
note_failures tests "$log"
times+=("tests $((SECONDS - start))s")

reports=$(find -L bazel-bin/ -name '*.ptxas.txt' 2>/dev/null | sort)
if [[ -n $reports ]]; then
  echo "== ptxas resource usage (per kernel and architecture) =="
  # shellcheck disable=SC2086
  bash tools/check_ptxas.sh $reports || rc=1
fi

# Sanitizer and fuzz stages: their per-test lines land in the same log and count below.
if [[ ${LATENTD_QUICK:-0} != 1 ]]; then
  for config in asan tsan; do
    echo "== bazel test --config=$config =="
    start=$SECONDS
    stage_log=$(mktemp)
    bazel test --config="$config" //... 2>&1 | tee "$stage_log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
    cat "$stage_log" >> "$log"
    note_failures "$config" "$stage_log"
    rm -f "$stage_log"
    times+=("$config $((SECONDS - start))s")
  done
  echo "== scripts/fuzz.sh =="
  start=$SECONDS
  bash scripts/fuzz.sh 2>&1 | tee -a "$log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  times+=("fuzz $((SECONDS - start))s")
fi
echo "== stage times: ${times[*]} =="
if [[ -s $failures ]]; then
  echo "== failed tests (last lines of each log) =="
  cat "$failures"
fi

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' "$log")
# A build error leaves no per-test line: count it as a failure so the line cannot read clean.
if [[ $rc -ne 0 && $failed -eq 0 ]]; then failed=1; fi
echo "$passed passed, $failed failed"
[[ $rc -eq 0 && $failed -eq 0 ]]
