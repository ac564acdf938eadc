#!/usr/bin/env bash
# Builds the libFuzzer targets (//fuzz, clang, --config=fuzz) and runs each for a
# bounded time from its committed seed corpus. A crash leaves its input in
# fuzz/regressions/<target>/ (commit it: //fuzz:<target>_regression_test replays it)
# and fails the script. Ends with "N passed, N failed" (one per target).
#   LATENTD_FUZZ_SECONDS  run time per target (default 60)
#   LATENTD_FUZZ_TARGETS  space-separated subset (default: all)
# Extra arguments go to every fuzzer (e.g. -jobs=2).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
latentd_ensure_packages || { echo "latentd: package installation failed" >&2; exit 1; }

seconds=${LATENTD_FUZZ_SECONDS:-60}
targets=(${LATENTD_FUZZ_TARGETS:-kv_manager append_kv decode doorbell safetensors})
labels=()
for t in "${targets[@]}"; do labels+=("//fuzz:${t}_fuzzer"); done

if ! bazel build --config=fuzz "${labels[@]}"; then
  echo "0 passed, ${#targets[@]} failed"
  exit 1
fi
bin=$(bazel info --config=fuzz bazel-bin 2>/dev/null)

passed=0
failed=0
for t in "${targets[@]}"; do
  work=$(mktemp -d)  # new corpus entries stay out of the tree
  mkdir -p "fuzz/regressions/$t"
  echo "== fuzz $t: ${seconds}s =="
  # -rss_limit_mb: the service targets hold a gRPC server and an engine; 2 GiB is
  # ample and catches runaway growth. -timeout: one input must never take seconds.
  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$bin/fuzz/${t}_fuzzer" "$work" "fuzz/corpus/$t" \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="fuzz/regressions/$t/" "$@" > "$work.log" 2>&1
  rc=$?
  # A pass shows the final stats; a failure shows the report (the crash and its stack).
  if [[ $rc -eq 0 ]]; then tail -n 8 "$work.log"; else tail -n 80 "$work.log"; fi
  rm -rf "$work" "$work.log"
  if [[ $rc -eq 0 ]]; then
    echo "//fuzz:${t}_fuzzer PASSED"
    passed=$((passed + 1))
  else
    echo "//fuzz:${t}_fuzzer FAILED (exit $rc; crash input in fuzz/regressions/$t/)"
    failed=$((failed + 1))
  fi
done
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
