#!/usr/bin/env bash
# The scale-out benchmark (tools/serving:sharded_bench) against two real CPU daemons:
# with both up every step succeeds and every sampled result matches the CPU
# implementation; with one SIGKILLed after set-up, its sequences fail UNAVAILABLE while
# the other daemon's results stay complete and correct, and the benchmark still exits 0.
set -euo pipefail
latentd=$1
bench=$2
dir=${TEST_TMPDIR:-$(mktemp -d)}
sockdir=$(mktemp -d /tmp/latentd-sb.XXXXXX)  # socket paths are limited to 107 bytes
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null || true; rm -rf "$sockdir"' EXIT
# until FILE holds PATTERN or PID has exited (the bound only guards against a hang)
wait_for() {
  local i
  for ((i = 0; i < 15000; ++i)); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || return 0
    sleep 0.02
  done
}
start() {
  LATENTD_KV_POISON=1 "$latentd" --backend=cpu --cpu_threads=1 --num_layers=2 --num_heads_q=16 --kv_pages=1024 \
    --listen="unix:$sockdir/$1.sock" --port_file="$dir/$1.port" --stats_interval_s=0 > "$dir/$1.log" 2>&1 &
  pids+=($!)
  wait_for "$dir/$1.port" . $!
  [[ -s $dir/$1.port ]] || { cat "$dir/$1.log"; exit 1; }
}
start a
start b
printf 'unix:%s\nunix:%s\n' "$sockdir/a.sock" "$sockdir/b.sock" > "$dir/targets"
common=(--targets_file="$dir/targets" --runners=2 --batch=8 --layers=2 --prefix_len=62 --check_every=3 --batch_timeout_s=30)

out=$("$bench" "${common[@]}" --duration_s=1)
echo "$out"
grep -qE "results: [1-9][0-9]* OK, 0 UNAVAILABLE .*, 0 other" <<<"$out"
grep -qE "checked [1-9][0-9]* sampled results, 0 wrong" <<<"$out"
[[ $(grep -c ' OK results$' <<<"$out") -eq 2 ]] || { echo "expected OK results from both daemons"; exit 1; }

# One daemon lost mid-run: killed once set-up is done, so the kill lands in the window,
# which ends 1 s after the first UNAVAILABLE result (600 s only bounds a hang).
"$bench" "${common[@]}" --duration_s=600 --after_unavailable_s=1 > "$dir/kill.out" 2>&1 &
bench_pid=$!
wait_for "$dir/kill.out" '^setup:' $bench_pid
sleep 0.5
kill -9 "${pids[1]}"
rc=0
wait $bench_pid || rc=$?
cat "$dir/kill.out"
[[ $rc -eq 0 ]] || { echo "sharded_bench exited $rc"; exit 1; }
grep -qE "results: [1-9][0-9]* OK, [1-9][0-9]* UNAVAILABLE .*, 0 other" "$dir/kill.out"
grep -qE "checked [1-9][0-9]* sampled results, 0 wrong" "$dir/kill.out"
grep -qE "a.sock: [1-9][0-9]* OK results" "$dir/kill.out"
echo PASS
