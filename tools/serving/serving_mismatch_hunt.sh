#!/usr/bin/env bash
# The hunt for the serving path's rare wrong result (docs/benchmarks.md, "the single
# mismatch of stop 24 reproduced"): fresh daemons on a NaN-poisoned pool, each run twice
# with 4 runners x 64 steps per message at --max_batch_size=256, every 4th result checked
# and each mismatch diagnosed (Reference::Diagnose: which row or page would explain it),
# varied one factor at a time. Built here, carried with tools/bundle.sh.
#   tools/serving/serving_mismatch_hunt.sh BUNDLE [CASE...]   (cases: ring eager shared shm grpc mb64 ab; all but ab by default)
#   tools/serving/serving_mismatch_hunt.sh BUNDLE initcheck|memcheck
# "ab" alternates this build's daemon with latentd_c80, the same daemon built with the
# combine's "-gencode arch=compute_90,code=sm_90" (kernels/BUILD.bazel) changed to
# compute_80 and run with LATENTD_COMBINE_PDL=1: the launch that gave wrong results.
# With "initcheck" it instead runs one small case under compute-sanitizer's initcheck with
# the pool left unwritten (LATENTD_KV_POISON=uninit): any kernel reading a KV row nobody
# wrote is named with its address; "memcheck" runs the same case under memcheck.
set -uo pipefail
B=$1
mode=${2:-matrix}
daemon_flags=(--backend=cuda --num_layers=4 --num_heads_q=16 --kv_memory_fraction=0 --kv_pages=20000
  --listen=127.0.0.1:0 --port_file=/tmp/port --stats_interval_s=0 --log_level=warn)

start_daemon() {  # env... -- flags...
  rm -f /tmp/port
  env "$@" >/tmp/hunt-daemon.log 2>&1 &
  pid=$!
  for _ in $(seq 1800); do [[ -s /tmp/port ]] && break; sleep 0.1; done  # a sanitized start is slow
  port=$(cat /tmp/port 2>/dev/null)
}

bench() {  # label, runner_bench flags...
  local label=$1; shift
  echo "--- $label"
  timeout 120 "$B/run" runner_bench --target=127.0.0.1:$port --runners=4 --batch=64 --layers=4 --prefix_len=4096 \
    --tokens=30 --warmup_tokens=2 --check_every=4 --trace=false "$@" 2>&1 |
    grep -E "round trip|checked|mismatch|diagnosis|values out of|rror|first|layer [0-9]" | head -20
}

if [[ $mode == initcheck || $mode == memcheck ]]; then
  poison=1
  [[ $mode == initcheck ]] && poison=uninit
  start_daemon LATENTD_KV_POISON=$poison compute-sanitizer --tool "$mode" --print-limit 20 \
    "$B/run" latentd "${daemon_flags[@]}" --max_batch_size=256 --kv_pages=2000
  bench "$mode: 4 runners x 16, ring, prefix 256" --batch=16 --prefix_len=256 --tokens=4 --ring
  kill -TERM $pid; wait $pid
  echo "--- daemon's sanitizer report"
  grep -E "=========|Uninitialized|at 0x|by thread|Address" /tmp/hunt-daemon.log | head -60
  exit 0
fi

case_() {  # label, env (comma-separated or "-"), extra daemon flags (or "-"), runner_bench flags...
  local label=$1 envs=$2 extra=$3; shift 3
  local e=(LATENTD_KV_POISON=1) x=()
  [[ $envs != - ]] && IFS=, read -r -a more <<<"$envs" && e+=("${more[@]}")
  [[ $extra != - ]] && read -r -a x <<<"$extra"
  start_daemon "${e[@]}" "$B/run" "${DAEMON:-latentd}" "${daemon_flags[@]}" --max_batch_size=256 "${x[@]}"
  bench "$label: first run on a fresh daemon" "$@"
  bench "$label: second run" "$@"
  kill -TERM $pid; wait $pid
}

# Each case is ~1 minute (a 4.8 GB prefix upload, then checks on the client's CPU): the
# whole matrix is more than one 10-minute device call, so name the cases to run, e.g.
# "ring eager" in one call and "shared shm grpc mb64" in the next.
shift
cases=${*:-ring eager shared shm grpc mb64}
for c in $cases; do
  case $c in
    ring) for i in 1 2 3; do case_ "ring #$i" - - --ring; done ;;
    eager) for i in 1 2; do case_ "ring, CUDA_MODULE_LOADING=EAGER #$i" CUDA_MODULE_LOADING=EAGER - --ring; done ;;
    shared) case_ "ring, shared prefixes (as before)" - - --ring --prefix_pool_pages=0 ;;
    shm) case_ "shared region, no ring" - - --shm ;;
    grpc) case_ "gRPC bytes" - - ;;
    mb64) case_ "ring, --max_batch_size=64" - "--max_batch_size=64" --ring ;;
    ab) for i in $(seq "${AB_PAIRS:-3}"); do  # needs latentd_c80: the combine from compute_80 PTX (no wait)
          DAEMON=latentd_c80 case_ "ring, combine without its wait, dependent launch forced #$i" LATENTD_COMBINE_PDL=1 - --ring
          case_ "ring, this build #$i" - - --ring
        done ;;
    *) echo "unknown case $c (ring eager shared shm grpc mb64 ab)"; exit 2 ;;
  esac
done
