#!/usr/bin/env bash
# The shipped nginx configuration (deploy/nginx) as an operator meets it: `nginx -t` on
# the standalone nginx.conf (no root: a temporary prefix, pid and logs inside it), on
# conf.d/latentd.conf dropped into a copy of Debian's own /etc/nginx layout, and on
# what scripts/cluster.sh --dry_run writes; plus the directives the scale-out design
# depends on. Needs Debian's nginx (scripts/deps.sh installs it).
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
deploy="$root/deploy/nginx"
cluster="$root/scripts/cluster.sh"
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/nginx.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }
nginx=$(command -v nginx || echo /usr/sbin/nginx)
[[ -x $nginx ]] || fail "nginx not found (apt-get install nginx; scripts/deps.sh installs it)"
"$nginx" -V 2>&1 | grep -q -- --with-http_v2_module || fail "this nginx lacks the HTTP/2 module"

# As root, nginx hands its temporary directories to the worker user (nobody), which a
# test sandbox's user namespace may not map: the workers stay root there.
global=()
[[ $(id -u) -eq 0 ]] && global=(-g "user root;")

check() {  # prefix conf
  "$nginx" -t -p "$1/" -c "$2" -e "$1/startup-error.log" "${global[@]}" >"$1/t.log" 2>&1 ||
    { cat "$1/t.log" >&2; fail "nginx -t $2"; }
  grep -q "test is successful" "$1/t.log" || { cat "$1/t.log" >&2; fail "nginx -t $2 did not say successful"; }
}

# 1. Standalone, as shipped.
mkdir -p "$tmp/standalone"
cp -rL "$deploy/." "$tmp/standalone/"
check "$tmp/standalone" "$tmp/standalone/nginx.conf"

# 2. The directives the design depends on (docs/deployment.md, "Scale-out").
conf="$deploy/conf.d/latentd.conf"
want() { grep -Eq "^[[:space:]]*$1" "$conf" || fail "conf.d/latentd.conf lacks: $1"; }
want 'hash \$http_x_latentd_route consistent;'
want 'include latentd/upstreams.conf;'
want 'listen [^;]* http2;'
want 'grpc_pass grpc://latentd;'
want 'grpc_next_upstream off;'
want 'client_max_body_size 0;'
want 'grpc_read_timeout 3600s;'
want 'grpc_send_timeout 3600s;'
want 'client_body_timeout 3600s;'
want 'http2_max_concurrent_streams 1024;'
want 'add_header grpc-status 14 always;'
grep -Eq '^server [^ ]+ max_fails=0;' "$deploy/latentd/upstreams.conf" || fail "upstreams.conf: no 'server ... max_fails=0;'"

# 3. Debian's layout: /etc/nginx/nginx.conf includes conf.d/*.conf in http{}, and the
# upstream list is then /etc/nginx/latentd/upstreams.conf. A copy of /etc/nginx with
# its absolute paths moved into the temporary directory.
if [[ -f /etc/nginx/nginx.conf ]]; then
  etc="$tmp/etc-nginx"
  cp -rL /etc/nginx "$etc"
  rm -f "$etc"/sites-enabled/* "$etc"/modules-enabled/*
  sed -i -e "s|/etc/nginx|$etc|g" -e "s|/var/log/nginx|$etc|g" -e "s|^pid .*|pid $etc/nginx.pid;|" \
    -e 's|^user .*||' "$etc/nginx.conf"
  # nginx's compiled-in temporary directories (/var/lib/nginx) are not ours to write.
  sed -i "s|^http {|http {\n\tclient_body_temp_path $etc/tb; proxy_temp_path $etc/tp; fastcgi_temp_path $etc/tf; uwsgi_temp_path $etc/tu; scgi_temp_path $etc/ts;|" \
    "$etc/nginx.conf"
  mkdir -p "$etc/latentd"
  cp "$conf" "$etc/conf.d/latentd.conf"
  cp "$deploy/latentd/upstreams.conf" "$etc/latentd/upstreams.conf"
  check "$etc" "$etc/nginx.conf"
fi

# 4. What cluster.sh writes for 4 daemons on another listen address.
bash "$cluster" --dry_run --cpu=4 --host=127.0.0.2 --base_port=7001 --proxy_port=7000 --run_dir="$tmp/cluster" \
  --nginx="$nginx" ${global[1]:+--nginx_global="${global[1]}"} >"$tmp/cluster.log" 2>&1 || { cat "$tmp/cluster.log" >&2; fail "cluster.sh --dry_run"; }
gen="$tmp/cluster/nginx"
[[ $(grep -c '^server 127.0.0.2:700[1-4] max_fails=0;$' "$gen/latentd/upstreams.conf") -eq 4 ]] ||
  { cat "$gen/latentd/upstreams.conf" >&2; fail "cluster.sh upstreams"; }
grep -Eq '^[[:space:]]*listen 127\.0\.0\.2:7000 http2;' "$gen/conf.d/latentd.conf" || fail "cluster.sh listen line"
# Everything else is the shipped file.
diff <(grep -v listen "$conf") <(grep -v listen "$gen/conf.d/latentd.conf") >/dev/null || fail "cluster.sh changed more than listen"
check "$gen" "$gen/nginx.conf"
echo "PASS"
