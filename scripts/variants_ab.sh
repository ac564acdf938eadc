#!/usr/bin/env bash
# One device call for compile-time kernel variants (scripts/build_variants.sh): the GPU
# checks of each variant, compute-sanitizer on the last one, then bench of the base and
# of every variant alternating (base, variants, base, variants reversed, base), so that
# clock drift shifts all alike. Logs go to $OUT (or ./variants_ab_out); a table last.
#   scripts/variants_ab.sh BUNDLE "GTEST_FILTER" NAME [NAME...]
# An empty GTEST_FILTER skips the checks and the sanitizers (bench only); BENCH=0 skips
# the bench (checks only).
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: $0 BUNDLE GTEST_FILTER NAME..." >&2; exit 2; }
b=$1 filter=$2; shift 2
o=${OUT:-variants_ab_out}
mkdir -p "$o"
runs=${BENCH_RUNS:-60}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$o/gpu.txt"
for v in "$@"; do
  [[ -n $filter ]] || break
  timeout 200 "$b/run" "gpu_test_$v" --gtest_filter="$filter" > "$o/gpu_test_$v.log" 2>&1
  echo "gpu_test_$v rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED|differ from" "$o/gpu_test_$v.log" | head -12
done
last=${*: -1}
for tool in memcheck racecheck synccheck; do
  [[ -n $filter ]] || break
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 "$b/bin/gpu_test_$last" \
    --gtest_filter=GpuDecode.Subset > "$o/sanitizer-$tool-$last.log" 2>&1
  echo "sanitizer $tool ($last) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$o/sanitizer-$tool-$last.log" | tail -1)"
done
[[ ${BENCH:-1} == 0 ]] && exit 0
rev=()
for ((i = $#; i >= 1; i--)); do rev+=("${!i}"); done
n=0
for v in base "$@" base "${rev[@]}" base; do
  n=$((n + 1))
  timeout 100 "$b/run" "bench_$v" --runs "$runs" > "$o/bench-$n-$v.log" 2>&1
  echo "bench $n $v rc=$?"
done
echo "== per run: dtype kv b h_q s_q s_k tile splits CTAs/SM whole-ms %ceil kernel-ms"
for f in "$o"/bench-*.log; do
  echo "-- $(basename "$f") $(grep -m1 'read ceiling' "$f")"
  grep -E "^\| (bf16|fp16) " "$f" | awk -F'|' '{print $2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$13,$15}'
done
