#!/usr/bin/env bash
# The daemon's command line as an operator meets it: --help lists latentd's own flags,
# --helpfull every library's too, --version, --model errors, and the example flag file
# deploy/latentd.flags (preset, overrides after it) reaching the start-up line.
set -euo pipefail
latentd=$(realpath "$1")
flags_file=$(realpath "$2")
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/flags.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }

# absl's --help exits 1 after printing; only the text matters here.
help=$("$latentd" --help 2>&1 || true)
for f in --model --tensor_parallel --listen --drain_timeout_s --auth_token_file; do
  grep -q -- "$f (" <<<"$help" || fail "--help does not list $f"
done
grep -q -- "--flagfile" <<<"$help" || fail "--help does not mention --flagfile"
helpfull=$("$latentd" --helpfull 2>&1 || true)
grep -q -- "--flagfile (" <<<"$helpfull" || fail "--helpfull does not list absl's --flagfile"

version=$("$latentd" --version) || fail "--version exited $?"
[[ $version =~ ^latentd\ [0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "--version printed '$version'"

set +e
out=$("$latentd" --model=no-such-model 2>&1); rc=$?
set -e
[[ $rc -eq 2 ]] || fail "unknown --model exited $rc, expected 2"
for m in deepseek-v3 deepseek-r1 deepseek-v2-lite kimi-k2; do
  grep -q -- "$m" <<<"$out" || fail "unknown --model error does not list $m: $out"
done
set +e
out=$("$latentd" --model=deepseek-v3 --tensor_parallel=3 2>&1); rc=$?
set -e
[[ $rc -eq 2 && $out == *--tensor_parallel* ]] || fail "--tensor_parallel=3: rc $rc: $out"
set +e
out=$("$latentd" --backend=cpu --pinned_step_inputs=sometimes 2>&1); rc=$?
set -e
[[ $rc -eq 2 && $out == *--pinned_step_inputs* && $out == *"auto, off or always"* ]] ||
  fail "--pinned_step_inputs=sometimes: rc $rc: $out"
set +e
out=$("$latentd" --backend=cpu --ring_spin_us=-1 2>&1); rc=$?
set -e
[[ $rc -eq 2 && $out == *--ring_spin_us* && $out == *"0 to 1000000"* ]] || fail "--ring_spin_us=-1: rc $rc: $out"
set +e
out=$("$latentd" --backend=cpu --max_rings=-3 2>&1); rc=$?
set -e
[[ $rc -eq 2 && $out == *--max_rings* ]] || fail "--max_rings=-3: rc $rc: $out"
set +e
out=$("$latentd" --backend=cpu --engine_spin_us=-5 2>&1); rc=$?
set -e
[[ $rc -eq 2 && $out == *--engine_spin_us* ]] || fail "--engine_spin_us=-5: rc $rc: $out"

# The example flag file on the CPU backend: later flags override the file's GPU and TLS
# settings; the preset fills the shape, --num_layers given explicitly wins over it.
"$latentd" --flagfile="$flags_file" --backend=cpu --cpu_threads=1 --listen=127.0.0.1:0 \
  --port_file="$tmp/port" --tls_cert= --tls_key= --kv_memory_fraction=0 --kv_bytes=16777216 \
  --num_layers=2 >"$tmp/log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  [[ -s $tmp/port ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/log" >&2; fail "daemon exited"; }
  sleep 0.05
done
[[ -s $tmp/port ]] || { kill -9 "$pid"; cat "$tmp/log" >&2; fail "daemon did not start"; }
kill -TERM "$pid"
wait "$pid" || { cat "$tmp/log" >&2; fail "daemon drain exited $?"; }
line=$(grep "serving on" "$tmp/log")
# DeepSeek-V3 over 8 ranks: 16 query heads; scale (0.1 ln 40 + 1)^2 / sqrt(192).
for want in "model deepseek-v3 tp 8 (overridden: --num_layers)" "layers 2 " "h_q 16 " "h_kv 1 " "bf16" \
  "scale 0.135234"; do
  [[ $line == *"$want"* ]] || fail "start-up line lacks '$want': $line"
done
echo "PASS"
