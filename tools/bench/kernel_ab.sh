#!/usr/bin/env bash
# A/B of two builds of the kernel benchmark (//tools/bench:bench) on one GPU: the old and the
# new binary alternate, ROUNDS times each (default 3), so that clock or thermal drift
# shifts both alike; logs go to $OUT (or ./kernel_ab_out), one per run, and the table
# rows of every run are printed side by side, old first, for a row-by-row comparison.
#   tools/bench/kernel_ab.sh OLD_BENCH NEW_BENCH [bench flags...]
# e.g. tools/bench/kernel_ab.sh /tmp/bench-old bazel-bin/tools/bench/bench --runs 60
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 OLD_BENCH NEW_BENCH [bench flags...]" >&2; exit 2; }
old=$1 new=$2
shift 2
out=${OUT:-kernel_ab_out}
rounds=${ROUNDS:-3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.txt" || true
for ((i = 1; i <= rounds; ++i)); do
  "$old" "$@" > "$out/old-$i.log" 2>&1
  "$new" "$@" > "$out/new-$i.log" 2>&1
done
# The table rows (dtype .. kernel TFLOP/s) of each run, keyed by their first 7 columns.
for ((i = 1; i <= rounds; ++i)); do
  for side in old new; do
    grep -E '^\| (bf16|fp16) ' "$out/$side-$i.log" | sed "s/^/$side-$i /"
  done
done | sort -s -t'|' -k2,8 | tee "$out/rows.txt"
