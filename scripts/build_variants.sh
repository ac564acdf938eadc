#!/usr/bin/env bash
# Builds bench and gpu_test for the base kernels and for each tuning variant (macros of
# kernels/sm80/config.h passed to nvcc), then bundles them all for one device call.
#   scripts/build_variants.sh OUTDIR NAME="-DMACRO=V ..." [NAME="..."]...
# OUTDIR/bin gets bench_base, gpu_test_base, bench_NAME and gpu_test_NAME; run them with
# scripts/variants_ab.sh OUTDIR FILTER NAME... on the GPU machine. Each variant's ptxas
# report (registers, spills) of the 16-row tile is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: $0 OUTDIR [NAME=\"-DMACRO=V ...\"]..." >&2; exit 2; }
out=$1; shift
bundle=${BUNDLE_SH:-../shared/tools/bundle.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build() {  # build NAME DEFINES
  bazel build --define=LATENTD_NVCC_DEFINES="$2" //bench:bench //kernels:gpu_test
  cp -fL bazel-bin/bench/bench "$tmp/bench_$1"
  cp -fL bazel-bin/kernels/gpu_test "$tmp/gpu_test_$1"
  echo "== $1: ${2:-(no defines)}"
  for r in bazel-bin/kernels/cuda_sm80_decode_*_m16*.ptxas.txt; do
    echo "$(basename "$r"): $(grep -o 'Used [0-9]* registers' "$r" | sort -u | tr '\n' ' ')" \
      "spill stores: $(grep -o '[0-9]* bytes spill stores' "$r" | awk '{print $1}' | tr '\n' ' ')"
  done
}
build base ""
for v in "$@"; do build "${v%%=*}" "${v#*=}"; done
build base "" > /dev/null  # leave bazel-bin as the base build
bash "$bundle" "$out" "$tmp"/*
