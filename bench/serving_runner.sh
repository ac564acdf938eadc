#!/usr/bin/env bash
# Model-runner serving benchmark on a GPU host: for each daemon build given, starts it
# with the CUDA backend at h_q 16 and 128 (4 layers), runs //server:runner_bench
# (R runners x B steps per message x 4 layers, 4096-token prefixes) and the loadgen,
# and prints every result. Built here and carried with ../shared/tools/bundle.sh.
#   bench/serving_runner.sh BUNDLE DAEMON_NAME [DAEMON_NAME...]
# Environment: TOKENS (default 50), LOADGEN_S (default 10, 0 = skip), WINDOWS ("50 0").
set -uo pipefail
bundle=$1; shift
tokens=${TOKENS:-50}
loadgen_s=${LOADGEN_S:-10}
windows=${WINDOWS:-50}
run_daemon() {  # name h_q window -> sets port, pid
  local name=$1 hq=$2 win=$3
  rm -f /tmp/port
  "$bundle/run" "$name" --backend=cuda --num_layers=4 --num_heads_q="$hq" --kv_memory_fraction=0 \
    --kv_pages=20000 --listen=127.0.0.1:0 --port_file=/tmp/port --batch_window_us="$win" \
    --stats_interval_s=0 --log_level=warn >"/tmp/$name.$hq.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do [[ -s /tmp/port ]] && break; sleep 0.1; done
  port=$(cat /tmp/port)
}
for name in "$@"; do
  for hq in 16 128; do
    for win in $windows; do
      run_daemon "$name" "$hq" "$win"
      echo "=== daemon $name h_q $hq batch_window_us $win (port $port)"
      cases="1:64 4:64"
      [[ $hq == 16 ]] && cases="1:64 1:8 4:64"
      for c in $cases; do
        r=${c%:*}; b=${c#*:}
        echo "--- runner_bench R=$r B=$b"
        "$bundle/run" runner_bench --target=127.0.0.1:$port --runners=$r --batch=$b --layers=4 \
          --prefix_len=4096 --tokens=$tokens --warmup_tokens=5 --check_every=$(( hq == 128 ? 400 : 50 ))
      done
      if [[ $hq == 16 && $loadgen_s != 0 ]]; then
        echo "--- loadgen 64 streams x 1 step"
        "$bundle/run" loadgen --target=127.0.0.1:$port --sequences=64 --streams=64 --prefix_len=4096 \
          --layers=1 --duration_s=$loadgen_s --check_fraction=0.002 --check_threads=4 --window=1 2>&1 | tail -6
      fi
      kill -TERM $pid; wait $pid; echo "daemon exit $?"
    done
  done
done
