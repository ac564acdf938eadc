#!/usr/bin/env bash
# A/B of daemon builds under the model-runner benchmark on a GPU host: for each daemon
# binary named (in the bundle, in the order given), starts it with the CUDA backend at
# each h_q, runs //tools/serving:runner_bench for each case, and stops it. Built here and
# carried with tools/bundle.sh.
#   tools/serving/runner_ab.sh BUNDLE DAEMON [DAEMON...]
# Environment: HQ (default "16"), CASES (default "4:64:ring 1:64:ring"; R:B:mode with
# mode ring, shm, cuda (a CUDA region), cudaring (a CUDA region with its ring) or bytes), TOKENS (default 30), DAEMON_FLAGS (extra daemon flags).
set -uo pipefail
bundle=$1; shift
for name in "$@"; do
  for hq in ${HQ:-16}; do
    rm -f /tmp/port
    # shellcheck disable=SC2086
    "$bundle/run" "$name" --backend=cuda --num_layers=4 --num_heads_q="$hq" --kv_memory_fraction=0 \
      --kv_pages=90000 --listen=127.0.0.1:0 --port_file=/tmp/port --stats_interval_s=0 --log_level=warn \
      ${DAEMON_FLAGS:-} >"/tmp/$name.$hq.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ -s /tmp/port ]] && break; sleep 0.1; done
    port=$(cat /tmp/port)
    for c in ${CASES:-4:64:ring 1:64:ring}; do
      IFS=: read -r r b mode <<<"$c"
      flag=()
      [[ $mode == ring ]] && flag=(--ring)
      [[ $mode == shm ]] && flag=(--shm)
      [[ $mode == cuda ]] && flag=(--cuda_region)
      [[ $mode == cudaring ]] && flag=(--cuda_region --ring)
      echo "--- $name h_q $hq R=$r B=$b $mode"
      "$bundle/run" runner_bench --target=127.0.0.1:"$port" --runners="$r" --batch="$b" --layers=4 \
        --prefix_len=4096 --tokens="${TOKENS:-30}" --warmup_tokens=5 --check_every=$(( hq == 128 ? 400 : 50 )) \
        "${flag[@]}" 2>&1 | grep -E "round trip|layer-steps|->|engine queue|stage|rest of message|mismatch|rror"
    done
    kill -TERM $pid; wait $pid; echo "daemon exit $?"
  done
done
