#!/usr/bin/env bash
# A latentd cluster on one host: one daemon per visible GPU (or N CPU daemons on a host
# without GPUs), each on its own port, and nginx in front (deploy/nginx) hashing the
# sequences over them by the x-latentd-route header. Runs in the foreground; Ctrl-C or
# SIGTERM stops everything (the daemons drain). A daemon that dies is reported and the
# rest keep serving.
#
#   bash scripts/cluster.sh                        # GPUs from nvidia-smi -L, else 2 CPU daemons
#   bash scripts/cluster.sh --cpu=3 -- --num_layers=4 --kv_bytes=268435456
#
# Clients: the proxy's address (RUN_DIR/proxy) with ShardedClient(via_proxy), or every
# daemon (RUN_DIR/targets) with client-side hashing; docs/deployment.md, "Scale-out".
#
# Options (daemon flags go after "--", to every daemon):
#   --cpu=N         N CPU daemons even on a GPU host (without GPUs: N = $LATENTD_CPU_DAEMONS, else 2)
#   --host=ADDR     address of the daemons and of the proxy (default 127.0.0.1)
#   --base_port=P   daemon i listens on P+i (default 50051; 0: each daemon picks a free port)
#   --proxy_port=P  nginx's port (default 50050; 0: a free one)
#   --no_proxy      daemons only
#   --run_dir=DIR   where the state goes (default: a new directory under /tmp):
#                   targets (one host:port a line), proxy (host:port), pids, ready,
#                   latentd-<i>.log, nginx/ (configuration and logs)
#   --daemon=PATH   daemon binary (default: bazel builds //server:latentd, installing
#                   missing Debian packages first, nginx among them)
#   --nginx=PATH    nginx binary (default: nginx on the PATH, else /usr/sbin/nginx)
#   --nginx_global='DIRECTIVES'  more main-context directives for nginx (-g), e.g.
#                   'user root;' where root cannot switch to nobody (a user namespace)
#   --dry_run       write the nginx configuration for these ports, check it with nginx -t, exit
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
deploy="$repo/deploy/nginx"

cpu=""
host=127.0.0.1
base_port=50051
proxy_port=50050
proxy=1
run_dir=""
daemon=""
nginx=""
nginx_global=""
dry_run=0
daemon_flags=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu=*) cpu=${1#*=} ;;
    --host=*) host=${1#*=} ;;
    --base_port=*) base_port=${1#*=} ;;
    --proxy_port=*) proxy_port=${1#*=} ;;
    --no_proxy) proxy=0 ;;
    --run_dir=*) run_dir=${1#*=} ;;
    --daemon=*) daemon=${1#*=} ;;
    --nginx=*) nginx=${1#*=} ;;
    --nginx_global=*) nginx_global=${1#*=} ;;
    --dry_run) dry_run=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; daemon_flags=("$@"); break ;;
    *) echo "cluster.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "cluster.sh: $*" >&2; exit 1; }
[[ -z $cpu || $cpu =~ ^[1-9][0-9]*$ ]] || die "--cpu=$cpu: expected a positive count"
[[ $base_port =~ ^[0-9]+$ && $proxy_port =~ ^[0-9]+$ ]] || die "ports must be numbers"

# Build unless a binary was given (a test passes its own).
cuda_build=1
if [[ -z $daemon && $dry_run -eq 0 ]]; then
  source "$repo/scripts/deps.sh"
  latentd_ensure_packages
  config=$(latentd_cuda_config)
  [[ -n $config ]] && cuda_build=0
  # shellcheck disable=SC2086  # empty, or --config=nocuda
  (cd "$repo" && bazel build $config //server:latentd)
  daemon="$repo/bazel-bin/server/latentd"
fi
if [[ $proxy -eq 1 ]]; then
  if [[ -z $nginx ]]; then nginx=$(command -v nginx || echo /usr/sbin/nginx); fi
  [[ -x $nginx ]] || die "nginx not found (Debian: apt-get install nginx; scripts/deps.sh installs it)"
fi

# GPUs: those CUDA_VISIBLE_DEVICES names, else every one nvidia-smi lists.
gpus=()
if [[ -z $cpu ]]; then
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    for ((i = 0; i < n; i++)); do gpus+=("$i"); done
  fi
  if [[ ${#gpus[@]} -gt 0 && $cuda_build -eq 0 ]]; then
    echo "cluster.sh: ${#gpus[@]} GPUs but no CUDA toolkit for the build: CPU daemons instead" >&2
    gpus=()
  fi
  [[ ${#gpus[@]} -gt 0 ]] || cpu=${LATENTD_CPU_DAEMONS:-2}
fi
if [[ -n $cpu ]]; then count=$cpu; backend=cpu; else count=${#gpus[@]}; backend=cuda; fi

if [[ -z $run_dir ]]; then run_dir=$(mktemp -d "${TMPDIR:-/tmp}/latentd-cluster.XXXXXX"); fi
mkdir -p "$run_dir"
run_dir=$(cd "$run_dir" && pwd)
rm -f "$run_dir"/{targets,proxy,pids,ready} "$run_dir"/port-*

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("'"$host"'", 0)); print(s.getsockname()[1])'
}
listening() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# nginx's files: the shipped ones, with this listen address and these daemons.
write_nginx_config() {  # targets...
  local d="$run_dir/nginx"
  mkdir -p "$d/conf.d" "$d/latentd"
  cp "$deploy/nginx.conf" "$d/nginx.conf"
  sed -E "s|^([[:space:]]*listen[[:space:]]+)[^[:space:];]+|\1$host:$proxy_port|" \
    "$deploy/conf.d/latentd.conf" >"$d/conf.d/latentd.conf"
  {
    echo "# Written by scripts/cluster.sh: the daemons of $run_dir."
    local t
    for t in "$@"; do echo "server $t max_fails=0;"; done
  } >"$d/latentd/upstreams.conf"
}

if [[ $dry_run -eq 1 ]]; then
  [[ $proxy_port -ne 0 ]] || proxy_port=50050
  [[ $base_port -ne 0 ]] || base_port=50051
  targets=()
  for ((i = 0; i < count; i++)); do targets+=("$host:$((base_port + i))"); done
  write_nginx_config "${targets[@]}"
  "$nginx" -t -q -p "$run_dir/nginx/" -c "$run_dir/nginx/nginx.conf" -e "$run_dir/nginx/error.log" \
    ${nginx_global:+-g "$nginx_global"} ||
    die "nginx -t failed on $run_dir/nginx/nginx.conf"
  echo "cluster.sh: $run_dir/nginx/nginx.conf is valid ($count daemons behind $host:$proxy_port)"
  exit 0
fi
[[ -x $daemon ]] || die "daemon binary $daemon not found"

pids=()
nginx_pid=""
stopping=0
stop() {
  stopping=1
  trap - INT TERM
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  if [[ -n $nginx_pid ]]; then kill -TERM "$nginx_pid" 2>/dev/null || true; fi
  # The daemons drain (--drain_timeout_s, 30 s by default); then whatever is left goes.
  local deadline=$((SECONDS + 40))
  for p in "${pids[@]}" $nginx_pid; do
    while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  echo "cluster.sh: stopped" >&2
  exit 0
}
trap stop INT TERM
trap '[[ $stopping -eq 1 ]] || { for p in "${pids[@]}" $nginx_pid; do kill -KILL "$p" 2>/dev/null || true; done; }' EXIT

threads=$(( $(nproc) / count ))
((threads >= 1)) || threads=1
for ((i = 0; i < count; i++)); do
  port=0
  [[ $base_port -ne 0 ]] && port=$((base_port + i))
  args=(--listen="$host:$port" --port_file="$run_dir/port-$i")
  if [[ $backend == cpu ]]; then
    args+=(--backend=cpu --cpu_threads="$threads")
    env=()
  else
    # As the systemd unit does: the daemon sees its one GPU as device 0.
    args+=(--backend=cuda --device=0)
    env=(CUDA_VISIBLE_DEVICES="${gpus[$i]}")
  fi
  env "${env[@]}" "$daemon" "${args[@]}" "${daemon_flags[@]}" >"$run_dir/latentd-$i.log" 2>&1 &
  pids+=($!)
  echo "daemon $i $! ${gpus[$i]:-cpu}" >>"$run_dir/pids"
done

targets=()
for ((i = 0; i < count; i++)); do
  deadline=$((SECONDS + 120))
  until [[ -s $run_dir/port-$i ]]; do
    kill -0 "${pids[$i]}" 2>/dev/null || { cat "$run_dir/latentd-$i.log" >&2; die "daemon $i exited at start"; }
    ((SECONDS < deadline)) || die "daemon $i did not start in 120 s (see $run_dir/latentd-$i.log)"
    sleep 0.05
  done
  targets+=("$host:$(cat "$run_dir/port-$i")")
done
printf '%s\n' "${targets[@]}" >"$run_dir/targets"

if [[ $proxy -eq 1 ]]; then
  [[ $proxy_port -ne 0 ]] || proxy_port=$(free_port)
  write_nginx_config "${targets[@]}"
  "$nginx" -p "$run_dir/nginx/" -c "$run_dir/nginx/nginx.conf" -e "$run_dir/nginx/error.log" \
    -g "daemon off; $nginx_global" >>"$run_dir/nginx/error.log" 2>&1 &
  nginx_pid=$!
  echo "nginx $nginx_pid" >>"$run_dir/pids"
  deadline=$((SECONDS + 30))
  until listening "$host" "$proxy_port"; do
    kill -0 "$nginx_pid" 2>/dev/null || { cat "$run_dir/nginx/error.log" >&2; die "nginx exited at start"; }
    ((SECONDS < deadline)) || die "nginx did not listen on $host:$proxy_port in 30 s"
    sleep 0.05
  done
  echo "$host:$proxy_port" >"$run_dir/proxy"
fi

echo "cluster.sh: $count $backend daemons on ${targets[*]}${nginx_pid:+, nginx on $host:$proxy_port}; state in $run_dir" >&2
touch "$run_dir/ready"

# Report each process that ends; keep serving with the rest until a signal comes.
live=("${pids[@]}")
[[ -z $nginx_pid ]] || live+=("$nginx_pid")
while [[ ${#live[@]} -gt 0 ]]; do
  done_pid=""
  rc=0
  wait -n -p done_pid "${live[@]}" || rc=$?
  [[ -n $done_pid ]] || continue
  what="nginx"
  for ((i = 0; i < count; i++)); do [[ ${pids[$i]} == "$done_pid" ]] && what="daemon $i (${targets[$i]})"; done
  echo "cluster.sh: $what, pid $done_pid, exited with status $rc" >&2
  rest=()
  for p in "${live[@]}"; do [[ $p == "$done_pid" ]] || rest+=("$p"); done
  live=("${rest[@]}")
done
echo "cluster.sh: every process has exited" >&2
