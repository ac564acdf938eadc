#!/usr/bin/env bash
# Checks deploy/latentd@.service with systemd-analyze verify (offline: no running systemd
# needed) for instance 0, its ExecStart pointed at the built daemon; any warning fails.
# Also checks that the stop timeout outlasts the example flag file's drain timeout.
set -euo pipefail
latentd=$(realpath "$1")
unit=$2
flags=$3

dir=$(mktemp -d "${TEST_TMPDIR:-/tmp}/unit.XXXXXX")
sed "s|^ExecStart=/usr/local/bin/latentd |ExecStart=$latentd |" "$unit" >"$dir/latentd@0.service"
grep -q "^ExecStart=$latentd --flagfile=/etc/latentd/latentd-%i.flags$" "$dir/latentd@0.service" ||
  { echo "FAIL: ExecStart not in the expected form" >&2; exit 1; }

out=$(systemd-analyze verify --man=no "$dir/latentd@0.service" 2>&1) || { echo "FAIL: verify: $out" >&2; exit 1; }
# verify only warns about unknown keys and bad values; a clean unit prints nothing.
if [[ -n $out ]]; then echo "FAIL: systemd-analyze verify printed:" >&2; echo "$out" >&2; exit 1; fi

want() { grep -qx -- "$1" "$unit" || { echo "FAIL: unit lacks '$1'" >&2; exit 1; }; }
want "Type=notify"
want "KillSignal=SIGTERM"
want "Restart=on-failure"
want "NoNewPrivileges=yes"
want "ProtectSystem=strict"
want "PrivateTmp=yes"
want "DeviceAllow=/dev/nvidia%i rw"
want "EnvironmentFile=-/etc/latentd/latentd.env"
if grep -q '^ExecReload=' "$unit"; then echo "FAIL: the daemon has no reload" >&2; exit 1; fi

stop_s=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)$/\1/p' "$unit")
drain_s=$(sed -n 's/^--drain_timeout_s=\([0-9]*\)$/\1/p' "$flags")
if ! ((stop_s > drain_s + 2)); then
  echo "FAIL: TimeoutStopSec=$stop_s must exceed --drain_timeout_s=$drain_s plus the 2 s stream close" >&2
  exit 1
fi
echo "PASS"
