# Parses deploy/kubernetes/latentd.yaml and checks what the daemon relies on: one GPU per
# pod, native gRPC probes on grpc.health.v1, a grace period longer than the drain, the
# token from a Secret, and flags the daemon accepts.
import subprocess
import sys
import tempfile

import yaml

manifest, latentd = sys.argv[1], sys.argv[2]
docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
by_kind = {d["kind"]: d for d in docs}
assert set(by_kind) == {"ConfigMap", "Service", "StatefulSet"}, by_kind.keys()

pod = by_kind["StatefulSet"]["spec"]["template"]["spec"]
(container,) = pod["containers"]
assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
    assert container[probe]["grpc"]["port"] == 50051, probe
assert container["readinessProbe"]["grpc"]["service"] == "latentd.v1.DecodeService"

env = {e["name"]: e for e in container["env"]}
assert "secretKeyRef" in env["LATENTD_AUTH_TOKEN"]["valueFrom"]

flags_text = by_kind["ConfigMap"]["data"]["latentd.flags"]
flags = dict(l.split("=", 1) for l in flags_text.splitlines() if l.startswith("--"))
assert pod["terminationGracePeriodSeconds"] > int(flags["--drain_timeout_s"]) + 2
assert "--flagfile=/etc/latentd/latentd.flags" in container["command"]

# The flag file must parse: the daemon rejects an unknown flag or model before serving.
# --version exits after parsing every flag, so this starts nothing.
with tempfile.NamedTemporaryFile("w", suffix=".flags") as f:
    f.write(flags_text)
    f.flush()
    r = subprocess.run([latentd, f"--flagfile={f.name}", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("latentd "), (r.returncode, r.stdout, r.stderr)
print("PASS")
