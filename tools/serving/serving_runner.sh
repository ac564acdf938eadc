#!/usr/bin/env bash
# Model-runner serving benchmark on a GPU host: for each daemon build given, starts it
# with the CUDA backend at h_q 16 and 128 (4 layers), runs //tools/serving:runner_bench
# (R runners x B steps per message x 4 layers, 4096-token prefixes; gRPC bytes, and the
# shared region where the daemon has it), the Python runner and the loadgen, and prints
# every result. Built here and carried with tools/bundle.sh (bin/, lib/, run)
# plus py/ (the latentd_client package) and python_runner.py in the bundle.
#   tools/serving/serving_runner.sh BUNDLE DAEMON_NAME[:shm][:FLAG=V...] ...
# Environment: TOKENS (default 50), LOADGEN_S (default 10, 0 = skip), HQ ("16 128").
set -uo pipefail
bundle=$1; shift
tokens=${TOKENS:-50}
loadgen_s=${LOADGEN_S:-10}
hqs=${HQ:-16 128}
for spec in "$@"; do
  IFS=: read -r -a parts <<<"$spec"
  name=${parts[0]}
  shm=0
  flags=()
  for p in "${parts[@]:1}"; do
    if [[ $p == shm ]]; then shm=1; else flags+=("--$p"); fi
  done
  for hq in $hqs; do
    rm -f /tmp/port
    "$bundle/run" "$name" --backend=cuda --num_layers=4 --num_heads_q="$hq" --kv_memory_fraction=0 \
      --kv_pages=90000 --listen=127.0.0.1:0 --port_file=/tmp/port --stats_interval_s=0 --log_level=warn \
      "${flags[@]}" >"/tmp/$name.$hq.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ -s /tmp/port ]] && break; sleep 0.1; done
    port=$(cat /tmp/port)
    echo "=== daemon $spec h_q $hq (port $port)"
    cases="1:64 4:64"
    [[ $hq == 16 ]] && cases="1:64 1:8 4:64"
    modes=false
    [[ $shm == 1 ]] && modes="false true"
    for c in $cases; do
      r=${c%:*}; b=${c#*:}
      for m in $modes; do
        echo "--- runner_bench R=$r B=$b shm=$m"
        "$bundle/run" runner_bench --target=127.0.0.1:$port --runners=$r --batch=$b --layers=4 \
          --prefix_len=4096 --tokens=$tokens --warmup_tokens=5 --check_every=$(( hq == 128 ? 400 : 50 )) --shm=$m
      done
    done
    if [[ $shm == 1 && -d $bundle/py ]]; then
      for m in --shm ""; do
        echo "--- python_runner B=64 $m"
        PYTHONPATH=$bundle/py timeout 120 python3 "$bundle/python_runner.py" --target=127.0.0.1:$port --batch=64 \
          --layers=4 --prefix_len=4096 --tokens=$tokens $m 2>&1 | tail -3
      done
    fi
    if [[ $hq == 16 && $loadgen_s != 0 ]]; then
      echo "--- loadgen 64 streams x 1 step"
      "$bundle/run" loadgen --target=127.0.0.1:$port --sequences=64 --streams=64 --prefix_len=4096 \
        --layers=1 --duration_s=$loadgen_s --check_fraction=0.002 --check_threads=4 --window=1 2>&1 | tail -4
    fi
    kill -TERM $pid; wait $pid; echo "daemon exit $?"
  done
done
