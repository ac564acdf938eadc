#!/usr/bin/env bash
# One device call for a kernel change: the GPU checks of the changed paths, then the
# benchmark of the base build and of this one (each variant flag) alternating, so that
# clock drift shifts all alike. Logs go to $OUT/kernel_ab.tar.gz (or ./kernel_ab_out); a
# short table last.
#   scripts/kernel_ab.sh BUNDLE "GTEST_FILTER" "SANITIZER_FILTER" "VARIANT_FLAGS|..."
# BUNDLE (../shared/tools/bundle.sh) holds gpu_test, bench and bench_base (the base build).
set -uo pipefail
bundle=$1 filter=$2 san_filter=$3 variants=${4:-}
final=${OUT:-kernel_ab_out}
out=$(mktemp -d)  # logs, packed into $final/kernel_ab.tar.gz at the end (few files come back)
mkdir -p "$final"
trap 'tar -czf "$final/kernel_ab.tar.gz" -C "$out" .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$out/gpu.txt"
echo "== gpu_test $filter"
timeout 240 "$bundle/run" gpu_test --gtest_filter="$filter" > "$out/gpu_test.log" 2>&1
echo "gpu_test rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED|differ from" "$out/gpu_test.log" | head -20
if [[ -n $san_filter ]]; then
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 "$bundle/bin/gpu_test" \
      --gtest_filter="$san_filter" > "$out/sanitizer-$tool.log" 2>&1
    echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-$tool.log" | tail -1)"
  done
fi
IFS='|' read -r -a flags <<< "$variants"
runs=${BENCH_RUNS:-60}
run=0
bench_new() {  # every variant once, in order, then again in reverse order
  local v
  for v in "$@"; do
    run=$((run + 1))
    # shellcheck disable=SC2086
    timeout 100 "$bundle/run" bench --runs "$runs" $v > "$out/bench-new-$run.log" 2>&1
    echo "${v:-(default)}" > "$out/bench-new-$run.flags"
  done
}
# BASE_FIRST=1: the base build also runs first (two base runs around the variants).
[[ ${BASE_FIRST:-0} == 1 ]] && timeout 100 "$bundle/run" bench_base --runs "$runs" > "$out/bench-base-0.log" 2>&1
bench_new "${flags[@]}"
timeout 100 "$bundle/run" bench_base --runs "$runs" > "$out/bench-base-1.log" 2>&1
rev=()
for ((i = ${#flags[@]} - 1; i >= 0; i--)); do rev+=("${flags[i]}"); done
bench_new "${rev[@]}"
echo "== per row: splits, whole ms (kernel ms), % of the read ceiling"
for f in "$out"/bench-new-*.log "$out"/bench-base-*.log; do
  echo "-- $(basename "$f") $(cat "${f%.log}.flags" 2>/dev/null)"
  awk -F'|' '/^\| (bf16|fp16) / && NF > 15 {gsub(/ /,"",$2); gsub(/ /,"",$3); gsub(/ /,"",$4); gsub(/ /,"",$5);
    gsub(/ /,"",$6); gsub(/ /,"",$7); gsub(/ /,"",$9); printf "%s %s %s,%s,%s s_q%s %s %s (%s) %s%%\n", $2, $3, $4, $5, $7, $6, $9, $11, $15, $13}' "$f" | head -40
  grep -m1 "read ceiling" "$f"
done
