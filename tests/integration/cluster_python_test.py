# The Python ShardedClient on a loopback cluster: scripts/cluster.sh starts 3 CPU
# daemons and nginx; one client hashes client-side over the daemons, one goes through
# nginx; 30 sequences each, prefixes, per-layer batches checked against the numpy
# reference, the sequences found on all three daemons; one daemon SIGKILLed while both
# run: the others' results stay complete and correct, the dead one's fail UNAVAILABLE,
# no batch outlives its deadline, and the lost sequences are re-created elsewhere.
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import latentd_client
from latentd_client import LatentdClient, LatentdError, ShardedClient

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))
DAEMONS, SEQUENCES, LAYERS, VICTIM = 3, 30, 2, 1
BATCH_TIMEOUT = 30.0
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def close(a, b, rel):
    """FlashMLA's element tolerance: abs 8e-4 or rel (2/128 for bf16)."""
    return np.all(np.abs(a - b) <= np.maximum(8e-4, rel * np.abs(b)))


def read(path):
    with open(path) as f:
        return f.read()


def gone(pid):
    """The process runs no more (no /proc entry, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


class Cluster:
    def __init__(self, *daemon_flags):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        args = ["/bin/bash", os.path.join(RUNFILES, "scripts/cluster.sh"), f"--cpu={DAEMONS}", "--base_port=0",
                "--proxy_port=0", f"--run_dir={self.dir}", "--daemon=" + os.path.join(RUNFILES, "server/latentd")]
        if os.getuid() == 0:  # a sandbox's user namespace may not map nginx's worker user
            args.append("--nginx_global=user root;")
        self.log_path = os.path.join(self.dir, "cluster.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args + ["--", *daemon_flags], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while not os.path.exists(os.path.join(self.dir, "ready")):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("cluster.sh did not start:\n" + self.log())
            time.sleep(0.02)
        self.targets = read(os.path.join(self.dir, "targets")).split()
        self.proxy = read(os.path.join(self.dir, "proxy")).strip()
        self.daemon_pids, self.nginx_pid = [], None
        for line in read(os.path.join(self.dir, "pids")).splitlines():
            w = line.split()
            if w[0] == "daemon":
                self.daemon_pids.append(int(w[2]))
            elif w[0] == "nginx":
                self.nginx_pid = int(w[1])

    def log(self):
        out = read(self.log_path)
        for i in range(DAEMONS):
            p = os.path.join(self.dir, f"latentd-{i}.log")
            if os.path.exists(p):
                out += f"--- daemon {i}\n" + read(p)
        return out

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.daemon_pids + ([self.nginx_pid] if self.nginx_pid else []):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode


class Path:
    def __init__(self, name, client):
        self.name, self.client = name, client
        self.ids, self.home = [], {}
        self.rounds = self.rounds_after_kill = self.ok = self.unavailable_after_kill = 0
        self.failures = []


class ClusterPythonTest(unittest.TestCase):
    def setUp(self):
        self.cluster = Cluster(f"--num_layers={LAYERS}", "--kv_bytes=67108864", "--drain_timeout_s=5")
        self.daemons = [LatentdClient(t, timeout=30) for t in self.cluster.targets]
        self.rows = {}  # (sequence, layer) -> float array [n, 1, 576]
        self.rows_lock = threading.Lock()
        self.lost = set()
        self.kill_start = self.kill_done = None

    def tearDown(self):
        for d in self.daemons:
            d.close()
        self.cluster.stop()
        # Under --config=asan/tsan the daemons are instrumented: any report fails the test.
        for i in range(DAEMONS):
            log = read(os.path.join(self.cluster.dir, f"latentd-{i}.log"))
            for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer",
                           "runtime error:"):
                self.assertNotIn(marker, log, f"daemon {i}:\n{log}")

    def holder(self, sid):
        found = []
        for i, d in enumerate(self.daemons):
            try:
                d.get_sequence(sid, timeout=30)
                found.append(i)
            except LatentdError:
                pass
        return found[0] if len(found) == 1 else -1

    def rand(self, client, rng, *shape):
        return client.unwire(client.wire(rng.uniform(-1, 1, shape)), shape)

    def create(self, path, prefix, rng):
        c = path.client
        for i in range(SEQUENCES):
            sid = f"{prefix}{i}"
            self.assertEqual(c.create_sequence(sid), sid)
            rows = {l: self.rand(c, rng, int(rng.integers(0, 100)), 1, 576) for l in range(LAYERS)}
            resp = c.append_kv(sid, rows)
            self.assertEqual(list(resp.lengths), [len(rows[l]) for l in range(LAYERS)])
            for l in range(LAYERS):
                self.rows[(sid, l)] = rows[l]
            path.ids.append(sid)
        per = [0] * DAEMONS
        for sid in path.ids:
            h = self.holder(sid)
            self.assertGreaterEqual(h, 0, f"{path.name}: {sid} not held by exactly one daemon")
            if not c.via_proxy:
                self.assertEqual(h, c.locate(sid))
            path.home[sid] = h
            per[h] += 1
        print(f"{path.name}: sequences per daemon {per}", file=sys.stderr)
        self.assertTrue(all(per), f"{path.name}: a daemon got no sequence: {per}")

    def batch(self, path, layer, rng):
        c, info = path.client, path.client.info
        steps = []
        for sid in path.ids:
            s_q = int(rng.integers(1, 3))
            steps.append(dict(sequence_id=sid, layer=layer, q=self.rand(c, rng, s_q, info.num_heads_q, 576),
                              kv=self.rand(c, rng, s_q, 1, 576), causal=s_q == 2))
        start = time.monotonic()
        outs = c.decode_batch(steps)
        end = time.monotonic()
        if end - start > BATCH_TIMEOUT + 5:
            path.failures.append(f"a batch took {end - start:.1f} s")
        before = self.kill_start is None or end < self.kill_start
        after = self.kill_done is not None and start > self.kill_done
        for step, out in zip(steps, outs):
            sid = step["sequence_id"]
            victim = path.home[sid] == VICTIM
            if victim and sid in self.lost:
                if out.code != UNAVAILABLE:
                    path.failures.append(f"{sid} (lost): code {out.code}: {out.message}")
                elif after:
                    path.unavailable_after_kill += 1
                continue
            if victim and not before:
                if out.code == UNAVAILABLE:
                    self.lost.add(sid)
                    path.unavailable_after_kill += after
                    continue
                if after:
                    path.failures.append(f"{sid} on the dead daemon: code {out.code}: {out.message}")
                    continue
            if not out.ok:
                path.failures.append(f"{sid} on daemon {path.home[sid]}: code {out.code}: {out.message}")
                continue
            with self.rows_lock:
                rows = self.rows[(sid, layer)] = np.concatenate([self.rows[(sid, layer)], step["kv"]])
            ref_out, ref_lse = latentd_client.reference_decode(step["q"], rows, info.softmax_scale,
                                                               causal=step["causal"])
            if not close(out.out, ref_out, 2 / 128) or not np.allclose(out.lse, ref_lse, rtol=1e-4, atol=1e-4):
                path.failures.append(f"{sid} layer {layer}: max |out - ref| {np.abs(out.out - ref_out).max()}")
                continue
            path.ok += 1

    def test_spread_kill_and_recreate(self):
        kw = dict(connect_timeout=30, health_interval=0.25, health_timeout=5, unhealthy_after=3, rpc_timeout=30,
                  batch_timeout=BATCH_TIMEOUT)
        direct = Path("client-side hashing", ShardedClient(self.cluster.targets, **kw))
        proxied = Path("nginx", ShardedClient([self.cluster.proxy], via_proxy=True, **kw))
        try:
            self.run_paths(direct, proxied)
        finally:
            direct.client.close()
            proxied.client.close()
        # SIGTERM stops the script, the daemons and nginx.
        self.assertEqual(self.cluster.stop(), 0, self.cluster.log())
        for pid in self.cluster.daemon_pids + [self.cluster.nginx_pid]:
            self.assertTrue(gone(pid), pid)
        self.assertIn(f"daemon {VICTIM} (", self.cluster.log())

    def run_paths(self, direct, proxied):
        rng = np.random.default_rng(3)
        self.create(direct, "pd-", rng)
        self.create(proxied, "pp-", rng)
        two_rounds = threading.Semaphore(0)

        def run(path, seed):
            r = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    if path.rounds_after_kill >= 3:
                        break
                    round_start = time.monotonic()
                    for layer in range(LAYERS):
                        self.batch(path, layer, r)
                    path.rounds += 1
                    if self.kill_done is not None and round_start > self.kill_done:
                        path.rounds_after_kill += 1
                    if path.rounds == 2:
                        two_rounds.release()
            except Exception as e:  # reported by the main thread
                path.failures.append(repr(e))
                two_rounds.release()

        threads = [threading.Thread(target=run, args=(p, s)) for p, s in ((direct, 5), (proxied, 6))]
        for t in threads:
            t.start()
        for _ in threads:
            two_rounds.acquire(timeout=120)
        victim = self.cluster.daemon_pids[VICTIM]
        self.kill_start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while not gone(victim):
            time.sleep(0.001)
        self.kill_done = time.monotonic()
        for t in threads:
            t.join(timeout=300)
            self.assertFalse(t.is_alive(), "a batch thread hangs")

        for p in (direct, proxied):
            self.assertEqual(p.failures, [], p.name)
            self.assertGreaterEqual(p.rounds_after_kill, 3, p.name)
            self.assertGreater(p.unavailable_after_kill, 0, p.name)
            for sid in p.ids:
                if p.home[sid] == VICTIM:
                    start = time.monotonic()
                    with self.assertRaises(LatentdError) as e:
                        p.client.get_sequence(sid)
                    self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
                    self.assertLess(time.monotonic() - start, 10)
                else:  # complete: every row sent, once
                    lengths = list(p.client.get_sequence(sid).lengths)
                    self.assertEqual(lengths, [len(self.rows[(sid, l)]) for l in range(LAYERS)], sid)
            print(f"{p.name}: {p.rounds} rounds ({p.rounds_after_kill} after the kill), {p.ok} steps checked, "
                  f"{p.unavailable_after_kill} UNAVAILABLE after the kill", file=sys.stderr)
        deadline = time.time() + 5
        while direct.client.healthy(VICTIM) and time.time() < deadline:
            time.sleep(0.05)
        self.assertFalse(direct.client.healthy(VICTIM))
        self.assertTrue(direct.client.healthy(0) and direct.client.healthy(2))

        # Re-created under the same ids, the victim's sequences live on the other two.
        for p in (direct, proxied):
            again = [sid for sid in p.ids if p.home[sid] == VICTIM]
            self.assertTrue(again, p.name)
            for sid in again:
                self.assertEqual(p.client.create_sequence(sid), sid)
                h = self.holder(sid)
                self.assertIn(h, (0, 2), f"{p.name}: {sid} re-created on {h}")
                if p.client.via_proxy:
                    self.assertNotEqual(p.client.route_key(sid), sid)
                else:
                    self.assertEqual(p.client.locate(sid), h)
                rows = self.rand(p.client, rng, 70, 1, 576)
                p.client.append_kv(sid, {0: rows})
                self.rows[(sid, 0)] = rows
                p.home[sid] = h
                self.lost.discard(sid)
            p.ids, p.ok, p.failures = again, 0, []
            self.batch(p, 0, rng)
            self.assertEqual(p.failures, [], p.name)
            self.assertEqual(p.ok, len(again), p.name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
