#!/usr/bin/env bash
# Installs the Python client with the two command lines of README.md's "Python client
# package" section, as written there (pip, offline, in a virtual environment over Debian's
# python3-grpcio/-protobuf/-numpy), then runs the example against a real daemon with that
# environment's interpreter and no PYTHONPATH.
set -euo pipefail
root="$TEST_SRCDIR/$TEST_WORKSPACE"
latentd="$root/$1"
example="$root/$2"
readme="$root/$3"
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/pypkg.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }

# A writable copy in the checkout's layout: pip builds in place, and setup.py reads
# ../../proto and ../../server/version.h.
mkdir -p "$tmp/src/clients/python" "$tmp/src/proto" "$tmp/src/server"
cp -rL "$root/clients/python/setup.py" "$root/clients/python/pyproject.toml" "$root/clients/python/src" \
  "$tmp/src/clients/python/"
cp -L "$root/server/version.h" "$tmp/src/server/"
cp -L "$root/proto/latentd.proto" "$root/proto/health.proto" "$tmp/src/proto/"

export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
# The indented lines under the README's heading, with the venv in the test's directory.
commands=$(awk '/^### Python client package/ {on = 1; next} on && /^#/ {exit} on && /^    [^ ]/' "$readme" |
  sed 's/^    //; s#~/latentd-venv#'"$tmp"'/venv#g')
[[ $(grep -c . <<<"$commands") -eq 2 ]] || fail "README.md: expected two install lines, got: $commands"
(cd "$tmp/src" && bash -euo pipefail -c "$commands") >"$tmp/pip.log" 2>&1 ||
  { cat "$tmp/pip.log" >&2; fail "the README's install commands"; }

unset PYTHONPATH
cd "$tmp"  # not the source tree: the import must come from the installed package
"$tmp/venv/bin/python" - <<'PY' || fail "installed package"
import os
import latentd_client
from latentd_client import health_pb2, health_pb2_grpc, latentd_pb2, latentd_pb2_grpc
assert "site-packages" in latentd_client.__file__, latentd_client.__file__
assert latentd_pb2.DESCRIPTOR.package == "latentd.v1"
assert latentd_pb2_grpc.DecodeServiceStub and health_pb2_grpc.HealthStub
step = latentd_pb2.DecodeStep(request_id=7, sequence_id="s", layer=0, causal=True)
assert latentd_pb2.DecodeRequest.FromString(latentd_pb2.DecodeRequest(steps=[step]).SerializeToString()).steps[0].request_id == 7
assert health_pb2.HealthCheckRequest(service="latentd.v1.DecodeService").service
from latentd_client import HashRing, ShardedClient, ROUTE_HEADER
assert ROUTE_HEADER == "x-latentd-route" and HashRing(["a:1", "b:1"]).owner("seq") in (0, 1)
PY

"$latentd" --backend=cpu --cpu_threads=2 --listen=127.0.0.1:0 --port_file="$tmp/port" \
  --kv_bytes=67108864 --num_layers=2 --num_heads_q=16 >"$tmp/latentd.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  [[ -s $tmp/port ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/latentd.log" >&2; fail "daemon exited"; }
  sleep 0.05
done
[[ -s $tmp/port ]] || fail "daemon did not start"
out=$("$tmp/venv/bin/python" "$example" --target "127.0.0.1:$(cat "$tmp/port")" 2>&1) || { echo "$out" >&2; fail "example"; }
[[ $(tail -n 1 <<<"$out") == ok ]] || { echo "$out" >&2; fail "example did not end with ok"; }

# The generated modules are recorded, so uninstalling removes them too.
stub="$tmp/venv/lib/python3*/site-packages/latentd_client/latentd_pb2.py"
compgen -G "$stub" >/dev/null || fail "no installed latentd_pb2.py"
"$tmp/venv/bin/python" -m pip uninstall -y latentd-client >/dev/null || fail "pip uninstall"
if compgen -G "$stub" >/dev/null; then fail "uninstall left the generated stubs"; fi
echo "PASS"
