#!/usr/bin/env bash
# Reads ptxas -v reports (from cuda_library) and fails if any kernel spills registers.
# Prints one line per kernel and architecture: registers, shared memory, spill bytes.
set -euo pipefail
status=0
for f in "$@"; do
  awk '
    /Compiling entry function/ {
      fn = $0; sub(/^[^'"'"']*'"'"'/, "", fn); sub(/'"'"'.*$/, "", fn)
      arch = $0; sub(/.*for '"'"'/, "", arch); sub(/'"'"'.*/, "", arch) }
    /bytes stack frame/ { split($0, a, ","); stack = a[1] + 0; spill_st = a[2] + 0; spill_ld = a[3] + 0 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); regs = regs + 0
      smem = 0; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART) + 0
      printf "%-7s regs %3d  smem %6d  stack %4d  spill st %4d ld %4d  %s\n", arch, regs, smem, stack, spill_st, spill_ld, fn
      if (spill_st > 0 || spill_ld > 0) bad = 1 }
    END { exit bad }' "$f" || { echo "register spills in $(basename "$f")" >&2; status=1; }
done
exit $status
