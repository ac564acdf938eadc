#!/usr/bin/env bash
# The load generator against the real daemon (CPU backend): a short run with half the
# steps checked against the CPU implementation must report no failures or mismatches.
set -euo pipefail
latentd=$1
loadgen=$2
dir=${TEST_TMPDIR:-$(mktemp -d)}
pid=
trap 'kill -9 $pid 2>/dev/null || true' EXIT
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
# start_daemon LOG [FLAGS...]: a CPU-backend daemon on a free port; sets pid.
start_daemon() {
  local log=$1
  shift
  rm -f "$dir/port"
  LATENTD_KV_POISON=1 "$latentd" --backend=cpu --cpu_threads=2 --num_layers=2 "$@" --listen=127.0.0.1:0 --port_file="$dir/port" \
    > "$log" 2>&1 &
  pid=$!
  wait_for_file "$dir/port" $pid
  [[ -s $dir/port ]] || { cat "$log"; exit 1; }
}
start_daemon "$dir/latentd.log"
out=$("$loadgen" --target="127.0.0.1:$(cat "$dir/port")" --sequences=6 --streams=3 --prefix_len=200 \
  --layers=2 --s_q=2 --window=4 --duration_s=3 --check_fraction=0.5 --check_threads=1)
echo "$out"
grep -q "0 failed" <<<"$out"
grep -qE "checked [1-9][0-9]* steps .* 0 mismatched" <<<"$out"
grep -qE "latency ms: p50 [0-9.]+  p90 [0-9.]+  p99" <<<"$out"
grep -q "(callback API)" <<<"$out"
# The blocking client API, one step in flight per stream.
out=$("$loadgen" --target="127.0.0.1:$(cat "$dir/port")" --sequences=6 --streams=3 --prefix_len=200 \
  --layers=2 --window=1 --duration_s=2 --check_fraction=0.5 --check_threads=1 --client_api=sync)
echo "$out"
grep -q "(sync API)" <<<"$out"
grep -q "0 failed" <<<"$out"
grep -qE "checked [1-9][0-9]* steps .* 0 mismatched" <<<"$out"
# The daemon drains and exits 0 on SIGTERM.
kill -TERM $pid
wait $pid

# Against an fp8 KV cache: the header names it, and the checks (which dequantize what
# the server stored) still find no mismatch.
start_daemon "$dir/latentd_fp8.log" --kv_dtype=fp8_e4m3
out=$("$loadgen" --target="127.0.0.1:$(cat "$dir/port")" --sequences=4 --streams=2 --prefix_len=200 \
  --layers=2 --s_q=2 --window=4 --duration_s=2 --check_fraction=0.5 --check_threads=1)
echo "$out"
grep -q "kv fp8_e4m3 (1312 bytes/token)" <<<"$out"
grep -q "0 failed" <<<"$out"
grep -qE "checked [1-9][0-9]* steps .* 0 mismatched" <<<"$out"
grep -q "kv dtype fp8_e4m3" "$dir/latentd_fp8.log"
kill -TERM $pid
wait $pid
