#!/usr/bin/env bash
# The model-runner benchmark against the real daemon (CPU backend) on a unix socket: gRPC
# bytes in one and in several messages per layer, and the shared region; every sampled
# result must match the CPU implementation and no step may fail. The pool is poisoned
# (LATENTD_KV_POISON=1: NaN in every row nobody wrote) and the prefixes end 2 tokens short
# of a page, so the decode steps append across a page boundary.
set -euo pipefail
latentd=$1
runner_bench=$2
grpc_floor=$3
dir=${TEST_TMPDIR:-$(mktemp -d)}
# A socket path has at most 107 bytes, which the test's own directory can exceed.
sockdir=$(mktemp -d /tmp/latentd-rb.XXXXXX)
sock="$sockdir/latentd.sock"
# wait_for_file FILE PID: until FILE is non-empty (the daemon writes its port file once
# it serves) or PID has exited. The 300 s bound only guards against a hang: start-up
# under TSan on a loaded machine can take a minute, and the wait ends as soon as the
# file is there.
wait_for_file() {
  local i
  for ((i = 0; i < 15000; ++i)); do
    [[ -s $1 ]] && return 0
    kill -0 "$2" 2>/dev/null || return 0
    sleep 0.02
  done
}
pid=
# On failure the daemon's and the echo tool's logs say why (a sanitizer report lands there).
on_exit() {
  local rc=$? f
  if [[ $rc -ne 0 ]]; then
    for f in "$dir/latentd.log" "$dir/floor.log"; do
      [[ -f $f ]] && { echo "== $f (exit $rc)"; tail -n 120 "$f"; }
    done
  fi
  kill -9 $pid 2>/dev/null || true
  rm -rf "$sockdir"
}
trap on_exit EXIT
LATENTD_KV_POISON=1 "$latentd" --backend=cpu --cpu_threads=2 --num_layers=2 --num_heads_q=16 --kv_pages=2048 --listen="unix:$sock" \
  --port_file="$dir/port" --stats_interval_s=0 > "$dir/latentd.log" 2>&1 &
pid=$!
wait_for_file "$dir/port" $pid
[[ -s $dir/port ]] || { cat "$dir/latentd.log"; exit 1; }
grep -q "unix:$sock" "$dir/latentd.log" || { echo "the daemon did not name its unix socket"; cat "$dir/latentd.log"; exit 1; }
run() {
  out=$("$runner_bench" --target="unix:$sock" --runners=2 --batch=6 --layers=2 --prefix_len=62 --tokens=3 \
    --warmup_tokens=1 --check_every=2 "$@")
  echo "$out"
  grep -q "failed steps: 0" <<<"$out"
  grep -qE "checked [1-9][0-9]* results, mismatched 0" <<<"$out"
}
run
# Six steps in three messages, all results still right. (Responses per layer are not
# checked: results of messages answered while a write is pending share a response.)
run --messages_per_layer=3
grep -q "3 message(s) per layer" <<<"$out"
run --shm
# The same region with its doorbell ring: steps and results through shared memory.
run --ring --messages_per_layer=2
grep -q "shared region with doorbell ring" <<<"$out"
kill -TERM $pid
wait $pid

# The echo tool that measures gRPC's own floor: both transports, one small run each.
rm -f "$dir/fport"
"$grpc_floor" --serve --listen="unix:$sockdir/floor.sock" --port_file="$dir/fport" > "$dir/floor.log" 2>&1 &
pid=$!
wait_for_file "$dir/fport" $pid
[[ -s $dir/fport ]] || { cat "$dir/floor.log"; exit 1; }
out=$("$grpc_floor" --target="unix:$sockdir/floor.sock" --streams=4 --connections=2 --request_bytes=70000 \
  --response_bytes=5000 --messages=30)
echo "$out"
grep -qE "round trip p50 [0-9.]+ +p90 [0-9.]+ +p99 [0-9.]+ us" <<<"$out"
kill $pid
wait $pid || true
