#!/usr/bin/env bash
# The layer API against the kernel-level API on one GPU (docs/benchmarks.md, "Layer API"):
# writes a random 2-layer checkpoint of DeepSeek-V3's attention shape, serves it whole
# (h_q 128) and as tensor rank 0 of 8 (h_q 16), and runs runner_bench over gRPC bytes, the
# shared region and the doorbell ring with both APIs.
#   layer_api_bench.sh RUN_DIR   (RUN_DIR: a tools/bundle.sh folder with latentd and runner_bench)
set -euo pipefail
run=$1
here=$(cd "$(dirname "$0")/../.." && pwd)
ckpt=${CKPT:-/tmp/latentd-ds-2l}
tokens=${TOKENS:-30}
if [[ ! -f $ckpt/config.json ]]; then
  PYTHONPATH=$here/clients/python/examples python3 - "$ckpt" <<'PY'
import sys, mla_reference as m
spec = m.Spec(hidden_size=7168, num_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
              num_layers=2, rope_scaling=m.yarn(40.0, 4096, 32.0, 1.0, 1.0, 1.0), max_position_embeddings=163840)
m.Checkpoint(spec, 1).write(sys.argv[1])
PY
fi
for tp in 1 8; do
  port_file=$(mktemp)
  "$run/run" latentd --backend=cuda --model_dir="$ckpt" --tensor_parallel=$tp --tensor_rank=0 --listen=127.0.0.1:0 \
    --port_file="$port_file" --max_rings=8 --kv_bytes=$((16 << 30)) > /tmp/latentd-tp$tp.log 2>&1 &
  pid=$!
  for _ in $(seq 600); do [[ -s $port_file ]] && break; sleep 0.2; done
  [[ -s $port_file ]] || { cat /tmp/latentd-tp$tp.log; exit 1; }
  target=127.0.0.1:$(cat "$port_file")
  grep -m1 -i "serving\|model" /tmp/latentd-tp$tp.log || true
  for api in "" "--layer_api"; do
    for path in "" "--shm" "--ring"; do
      echo "== tp $tp ${api:-kernel-level} ${path:-grpc bytes}"
      "$run/run" runner_bench --target="$target" --batch=64 --layers=2 --prefix_len=4096 --tokens="$tokens" \
        --warmup_tokens=5 $api $path 2>&1 |
        grep -E "^(per-layer|layer-steps|layer API|first error|  launch|  stage|  client send|  server write)"
    done
  done
  kill "$pid"; wait "$pid" || true
done
