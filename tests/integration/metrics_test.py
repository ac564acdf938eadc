# latentd's Prometheus metrics end to end: the real daemon (CPU backend) with
# --metrics_listen, a real Prometheus server scraping it every second, load from the
# load generator and the Python client, and the values read back through Prometheus's
# HTTP query API.
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import grpc
import numpy as np

from latentd_client import LatentdClient, LatentdError

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))
PROMETHEUS = "/usr/bin/prometheus"  # Debian's prometheus package (scripts/deps.sh installs it)
MAX_SEQUENCES = 12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, predicate, timeout=20.0, interval=0.1):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class Daemon:
    """latentd on free loopback ports; the metrics port is read from its start-up log."""

    def __init__(self, workdir):
        port_file = os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "latentd.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(RUNFILES, "server/latentd"), "--backend=cpu", "--cpu_threads=2", "--num_layers=2",
             "--kv_pages=256", f"--max_sequences={MAX_SEQUENCES}", "--listen=127.0.0.1:0",
             f"--port_file={port_file}", "--metrics_listen=127.0.0.1:0"],
            stdout=self.log, stderr=subprocess.STDOUT)
        # A guard only (it ends once the port file is there): a sanitizer build on a loaded
        # machine can take over a minute to start.
        wait_for("latentd to start", lambda: os.path.exists(port_file) or self.proc.poll() is not None, 600)
        if self.proc.poll() is not None:
            raise RuntimeError("latentd did not start:\n" + self.read_log())
        with open(port_file) as f:
            self.target = "127.0.0.1:" + f.read().strip()
        m = re.search(r"Prometheus metrics on http://(127\.0\.0\.1:\d+)/metrics", self.read_log())
        if not m:
            raise RuntimeError("no metrics address in the log:\n" + self.read_log())
        self.metrics_address = m.group(1)

    def read_log(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class Prometheus:
    """Prometheus scraping `target` every second, on a free loopback port."""

    def __init__(self, workdir, target):
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: latentd\n    static_configs:\n"
                    f"      - targets: ['{target}']\n")
        self.log_path = os.path.join(workdir, "prometheus.log")
        # Another process may take the probed port before Prometheus binds it: try again.
        for _ in range(3):
            self.port = free_port()
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
            try:
                wait_for("Prometheus to be ready", lambda: self.proc.poll() is not None or self._ready(), 30)
            except AssertionError:
                self.stop()
                raise
            if self.proc.poll() is None:
                return
            self.log.close()
        with open(self.log_path) as f:
            raise RuntimeError("Prometheus did not start:\n" + f.read())

    def _ready(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr):
        """The instant vector for expr: a list of (labels, value)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"query {expr}: {body}")
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

    def scalar(self, expr):
        """The one value of expr, or None while no scrape has produced it."""
        result = self.query(expr)
        if len(result) > 1:
            raise AssertionError(f"query {expr}: {len(result)} series, expected one")
        return result[0][1] if result else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class MetricsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        self.daemon = Daemon(self.dir)
        self.addCleanup(self.daemon.stop)
        self.prom = Prometheus(self.dir, self.daemon.metrics_address)
        self.addCleanup(self.prom.stop)
        self.client = LatentdClient(self.daemon.target)
        self.addCleanup(self.client.close)

    def settle(self, what, expr, expected, timeout=15.0):
        """Waits until a scrape reports `expected` for expr. Every value seen before must
        be at most `expected`: the counters only grow, and once the clients have seen all
        their results nothing changes them any more, so any scrape after that point (at
        most scrape_interval later) reports the final value exactly."""
        seen = []

        def check():
            v = self.prom.scalar(expr)
            seen.append(v)
            if v is not None and v > expected:
                raise AssertionError(f"{what}: {expr} = {v}, above the {expected} the clients saw")
            return v == expected

        try:
            wait_for(f"{what} ({expr} == {expected})", check, timeout, 0.2)
        except AssertionError:
            print(f"{what}: values seen {seen[-10:]}", file=sys.stderr)
            raise

    def test_metrics_through_prometheus(self):
        p = self.prom
        wait_for("the first scrape", lambda: p.scalar('up{job="latentd"}') == 1)
        info = self.client.info
        build = p.query("latentd_build_info")
        self.assertEqual(len(build), 1)
        self.assertEqual(build[0][0]["version"], info.version)
        self.assertEqual(build[0][0]["backend"], "cpu")
        self.assertEqual(build[0][1], 1)
        self.assertEqual(p.scalar("sum(latentd_kv_pages)"), info.total_pages)

        # Load from many streams (batches of several steps) ...
        out = subprocess.run(
            [os.path.join(RUNFILES, "tools/serving/loadgen"), f"--target={self.daemon.target}", "--sequences=6",
             "--streams=6", "--prefix_len=100", "--layers=2", "--window=4", "--duration_s=3",
             "--check_fraction=0", "--check_threads=1"],
            capture_output=True, text=True, timeout=60)
        print(out.stdout, file=sys.stderr)
        self.assertEqual(out.returncode, 0, out.stderr)
        m = re.search(r"steps: (\d+) ok, (\d+) failed", out.stdout)
        self.assertIsNotNone(m, out.stdout)
        loadgen_ok, loadgen_failed = int(m.group(1)), int(m.group(2))
        self.assertGreater(loadgen_ok, 0)
        self.assertEqual(loadgen_failed, 0)

        # ... and a known number of steps from the Python client.
        rng = np.random.default_rng(0)
        seq = self.client.create_sequence()
        steps = [dict(sequence_id=seq, layer=i % 2, q=rng.standard_normal((1, info.num_heads_q, 576)),
                      kv=rng.standard_normal((1, info.num_heads_kv, 576))) for i in range(25)]
        results = self.client.decode(steps)
        python_ok = sum(r.ok for r in results)
        self.assertEqual(python_ok, len(steps))

        expected_steps = loadgen_ok + python_ok
        self.settle("steps completed", "latentd_steps_completed_total", expected_steps)
        # Every accepted step's result was taken by a client (nothing cancelled, nobody left).
        self.settle("results delivered", 'latentd_results_total{outcome="delivered"}', expected_steps)
        self.assertEqual(p.scalar('latentd_results_total{outcome="undelivered"}'), 0)
        self.assertEqual(p.scalar("latentd_sequences"), 1)  # the loadgen released its own
        self.assertEqual(p.scalar("latentd_queued_steps"), 0)

        # The batch size histogram: cumulative buckets ending in +Inf = count = batches.
        batches = p.scalar("latentd_batches_total")
        self.assertGreater(batches, 0)
        buckets = sorted((float(labels["le"]), v) for labels, v in p.query("latentd_batch_size_bucket"))
        print("batch size buckets:", buckets, file=sys.stderr)
        self.assertEqual(buckets[-1][0], float("inf"))
        self.assertEqual([b[0] for b in buckets[:4]], [1, 3, 7, 15])
        for (_, lower), (_, upper) in zip(buckets, buckets[1:]):
            self.assertLessEqual(lower, upper)
        self.assertEqual(buckets[-1][1], batches)
        self.assertEqual(p.scalar("latentd_batch_size_count"), batches)
        # Every step was in some batch, and batches of at most 1 cannot hold them all
        # unless each batch held exactly one.
        self.assertLessEqual(batches, expected_steps)

        # Latency quantiles in seconds, ordered.
        waits = {labels["quantile"]: v for labels, v in p.query("latentd_step_queue_wait_seconds")}
        execs = {labels["quantile"]: v for labels, v in p.query("latentd_batch_exec_seconds")}
        self.assertEqual(set(waits), {"0.5", "0.9", "0.99"})
        self.assertTrue(0 < execs["0.5"] <= execs["0.9"] <= execs["0.99"] < 10, execs)
        self.assertTrue(0 <= waits["0.5"] <= waits["0.9"] <= waits["0.99"] < 10, waits)
        self.assertEqual(p.scalar("latentd_step_queue_wait_seconds_count"), expected_steps)
        self.assertEqual(p.scalar("latentd_batch_exec_seconds_count"), batches)

        # Provoked rejections. Sequences beyond --max_sequences (engine side):
        before = p.scalar('latentd_rejections_total{reason="max_sequences"}')
        self.assertEqual(before, 0)
        refused = 0
        for _ in range(MAX_SEQUENCES + 3):
            try:
                self.client.create_sequence()
            except LatentdError as e:
                self.assertEqual(e.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
                refused += 1
        self.assertEqual(refused, 4)  # one sequence was live already
        self.settle("max_sequences rejections", 'latentd_rejections_total{reason="max_sequences"}', refused)

        # Decode messages that do not parse (service side): each ends its stream.
        self.assertEqual(p.scalar('latentd_rejections_total{reason="message"}'), 0)
        raw = self.client.channel.stream_stream("/latentd.v1.DecodeService/Decode")
        for _ in range(3):
            with self.assertRaises(grpc.RpcError):
                list(raw(iter([b"\xff\xff\xff\xff not a DecodeRequest"]), timeout=10))
        self.settle("message rejections", 'latentd_rejections_total{reason="message"}', 3)
        self.assertEqual(p.scalar("latentd_open_decode_streams"), 0)
        self.assertEqual(p.scalar("latentd_open_calls"), 0)
        self.assertEqual(p.scalar("latentd_inflight_bytes"), 0)

        # All ten reasons are exported (absent series would read as "never happened" in
        # dashboards only by accident).
        reasons = {labels["reason"] for labels, _ in p.query("latentd_rejections_total")}
        self.assertEqual(reasons, {"queue_full", "out_of_pages", "invalid", "deadline", "cancelled",
                                   "max_sequences", "streams", "inflight_bytes", "message", "upload", "region", "ring",
                                   "transfer_streams"})

        # The daemon still drains cleanly with the exporter running.
        self.client.close()
        code = self.daemon.stop()
        with open(self.daemon.log_path) as f:
            self.assertEqual(code, 0, f.read())


class BadAddressTest(unittest.TestCase):
    def test_refuses_to_start_naming_the_flag(self):
        for address in ["localhost:9464", "127.0.0.1", "127.0.0.1:99999"]:
            out = subprocess.run(
                [os.path.join(RUNFILES, "server/latentd"), "--backend=cpu", "--listen=127.0.0.1:0",
                 f"--metrics_listen={address}"], capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn("--metrics_listen", out.stderr)

    def test_refuses_a_taken_port(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            out = subprocess.run(
                [os.path.join(RUNFILES, "server/latentd"), "--backend=cpu", "--listen=127.0.0.1:0",
                 f"--metrics_listen=127.0.0.1:{s.getsockname()[1]}"], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--metrics_listen", out.stderr)


if __name__ == "__main__":
    unittest.main()
