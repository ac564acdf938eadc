# The Python client (latentd_client) against the real daemon (CPU backend): results
# against a numpy reference for several layers, s_q 1 and 2, h_q 32, forks and threads;
# error codes; the bearer token; and the example script from the docs.
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import latentd_client
from latentd_client import LatentdClient, LatentdError

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))


class Daemon:
    """latentd on a free loopback port (port file), killed at exit."""

    def __init__(self, *flags):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "latentd.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(RUNFILES, "server/latentd"), "--backend=cpu", "--cpu_threads=2",
             "--listen=127.0.0.1:0", f"--port_file={port_file}", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        # Only a guard against a daemon that hangs: the wait ends once the port file is
        # there, and a TSan daemon on a loaded machine can take over a minute to start.
        deadline = time.time() + 600
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("latentd did not start:\n" + open(self.log_path).read())
            time.sleep(0.02)
        self.target = "127.0.0.1:" + open(port_file).read().strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def close(a, b, rel):
    """FlashMLA's element tolerance: abs 8e-4 or rel (2/128 for bf16)."""
    return np.all(np.abs(a - b) <= np.maximum(8e-4, rel * np.abs(b)))


class StepOutputLike:
    """out/lse read from a shared region, shaped like a StepOutput for check()."""

    def __init__(self, out, lse):
        self.out, self.lse, self.ok, self.message = out, lse, True, ""


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("--num_layers=2", "--num_heads_q=32")
        cls.client = LatentdClient(cls.daemon.target)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()

    def rand(self, rng, *shape):
        # Values the wire format holds exactly, so the reference sees what the server sees.
        c = self.client
        return c.unwire(c.wire(rng.uniform(-1, 1, shape)), shape)

    def check(self, out, q, rows, causal):
        info = self.client.info
        if info.kv_dtype == "fp8_e4m3":  # the reference reads what the daemon stored
            rows = latentd_client.fp8_kv_roundtrip(rows, info.dtype)
        ref_out, ref_lse = latentd_client.reference_decode(q, rows, info.softmax_scale, causal=causal)
        self.assertTrue(out.ok, out.message)
        self.assertTrue(close(out.out, ref_out, 2 / 128), f"max diff {np.abs(out.out - ref_out).max()}")
        np.testing.assert_allclose(out.lse, ref_lse, rtol=1e-4, atol=1e-4)

    def run_sequence(self, seed, prefixes, steps, fork_after=None):
        """Creates a sequence, uploads prefixes, runs steps [(layer, s_q, causal)] on one
        session and checks each; optionally forks and checks the fork too."""
        c = self.client
        rng = np.random.default_rng(seed)
        info = c.info
        seq = c.create_sequence()
        rows = {layer: self.rand(rng, n, info.num_heads_kv, 576) for layer, n in prefixes.items()}
        resp = c.append_kv(seq, {l: r for l, r in rows.items() if len(r)})
        self.assertEqual(resp.tokens_appended, sum(prefixes.values()))
        self.assertEqual(list(resp.lengths), [prefixes.get(l, 0) for l in range(info.num_layers)])
        seqs = {seq: rows}
        for i, (layer, s_q, causal) in enumerate(steps):
            if i == fork_after:
                fork = c.fork_sequence(seq)
                seqs[fork] = {l: r.copy() for l, r in seqs[seq].items()}
            for sid, srows in seqs.items():
                q = self.rand(rng, s_q, info.num_heads_q, 576)
                kv = self.rand(rng, s_q, info.num_heads_kv, 576)
                [out] = c.decode([dict(sequence_id=sid, layer=layer, q=q, kv=kv, causal=causal)])
                srows[layer] = np.concatenate([srows.get(layer, np.zeros((0, info.num_heads_kv, 576))), kv])
                self.check(out, q, srows[layer], causal)
        for sid in seqs:
            self.assertGreaterEqual(c.release_sequence(sid), 0)

    def test_results_match_reference(self):
        self.run_sequence(1, {0: 130, 1: 64}, [(0, 1, False), (1, 2, True), (0, 2, True), (1, 1, False)],
                          fork_after=2)

    def test_prefix_reuse(self):
        c, info = self.client, self.client.info
        # The chain's bytes as the C++ client's test has them (clients/cpp/page_keys_test.cc).
        ids = [(i * 7919 + 13) % 129280 for i in range(200)]
        self.assertEqual([k.hex() for k in latentd_client.page_keys(ids)],
                         ["993f763e15cd48180d5d806e7838563a", "3b01f31f81a7f3d4104608be2a8cf3f8",
                          "6f7028a8268e5db4f0ee1a75ebd6fb2e"])
        self.assertEqual(latentd_client.page_keys(ids, "tenant-a")[0].hex(), "ad28246e1f940208e41a1c5e7c61f9ab")

        rng = np.random.default_rng(7)
        shared = [int(t) for t in rng.integers(0, 100000, 192)]
        own = [[int(t) for t in rng.integers(0, 100000, 70)] for _ in range(3)]
        prefix_rows = {l: self.rand(rng, 192, info.num_heads_kv, 576) for l in range(info.num_layers)}
        seqs = []
        for i in range(3):
            keys = latentd_client.page_keys(shared + own[i], salt="tenant-a")
            self.assertEqual(len(keys), 4)
            seq, present = c.create_sequence_with_prefix(keys)
            # The first uploads everything; the others find the three shared pages (the
            # fourth page's tokens differ). After a release the pages stay cached.
            self.assertEqual(present, 0 if i == 0 else 192)
            rows = {l: np.concatenate([prefix_rows[l], self.rand(rng, 70, info.num_heads_kv, 576)])
                    for l in range(info.num_layers)}
            resp = c.append_kv(seq, {l: r[present:] for l, r in rows.items()})
            self.assertEqual(list(resp.lengths), [262] * info.num_layers)
            for layer in range(info.num_layers):
                q = self.rand(rng, 1, info.num_heads_q, 576)
                kv = self.rand(rng, 1, info.num_heads_kv, 576)
                [out] = c.decode([dict(sequence_id=seq, layer=layer, q=q, kv=kv)])
                self.check(out, q, np.concatenate([rows[layer], kv]), False)
            seqs.append(seq)
            if i == 1:  # no sequence holds the shared pages now: the third finds them cached
                c.release_sequence(seqs.pop(0))
                c.release_sequence(seqs.pop(0))
        # Another tenant's salt names other pages.
        seq, present = c.create_sequence_with_prefix(latentd_client.page_keys(shared, salt="tenant-b"))
        self.assertEqual(present, 0)
        for sid in seqs + [seq]:
            c.release_sequence(sid)
        with self.assertRaises(LatentdError) as e:
            c.create_sequence_with_prefix([b"short"])
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("page_keys[0]", str(e.exception))

    def test_many_threads(self):
        errors = []

        def work(seed):
            try:
                self.run_sequence(seed, {0: 1 + seed * 37, 1: 0}, [(seed % 2, 1, False), (1, 2, True)])
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=work, args=(s,)) for s in range(2, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])

    def test_session_streams_many_steps(self):
        c = self.client
        rng = np.random.default_rng(9)
        seq = c.create_sequence("py-session")
        prefix = self.rand(rng, 65, 1, 576)
        c.append_kv(seq, {0: prefix})
        rows = prefix
        expected = {}
        with c.open_session() as session:
            for _ in range(10):
                q, kv = self.rand(rng, 1, 32, 576), self.rand(rng, 1, 1, 576)
                rows = np.concatenate([rows, kv])
                expected[session.submit(seq, 0, q, kv)] = (q, rows)
            session.close_send()
            got = list(session.results())
        self.assertEqual(sorted(r.request_id for r in got), sorted(expected))
        for r in got:
            q, r_rows = expected[r.request_id]
            self.check(r, q, r_rows, False)
        c.release_sequence(seq)

    def test_shared_region(self):
        """Steps through the stream's shared region: q/kv written into it with numpy,
        out/lse read back from it, one message per layer batch, each checked."""
        c = self.client
        info = c.info
        rng = np.random.default_rng(21)
        h_q, h_kv = info.num_heads_q, info.num_heads_kv
        qb, kvb, ob, lb = h_q * 576 * 2, h_kv * 576 * 2, h_q * 512 * 2, h_q * 4
        slot = (qb + kvb + ob + lb + 63) // 64 * 64
        seqs, rows = [], []
        for i in range(4):
            seq = c.create_sequence()
            r = self.rand(rng, 20 + 31 * i, h_kv, 576)
            c.append_kv(seq, {0: r})
            seqs.append(seq)
            rows.append(r)
        with c.open_session() as session:
            region = session.open_region(slot * len(seqs))
            for _ in range(3):
                steps, qs = [], []
                for i, seq in enumerate(seqs):
                    base = i * slot
                    q, kv = self.rand(rng, 1, h_q, 576), self.rand(rng, 1, h_kv, 576)
                    region.array(base, (1, h_q, 576), "<u2")[:] = np.frombuffer(c.wire(q), "<u2").reshape(1, h_q, 576)
                    region.array(base + qb, (1, h_kv, 576), "<u2")[:] = np.frombuffer(c.wire(kv), "<u2").reshape(
                        1, h_kv, 576)
                    rows[i] = np.concatenate([rows[i], kv])
                    qs.append(q)
                    steps.append(dict(sequence_id=seq, layer=0, s_q=1, q_offset=base, kv_offset=base + qb,
                                      out_offset=base + qb + kvb, lse_offset=base + qb + kvb + ob))
                ids = session.submit_region(steps)
                got = {}
                for r in session.results():
                    got[r.request_id] = r
                    if len(got) == len(ids):
                        break
                for i, rid in enumerate(ids):
                    self.assertTrue(got[rid].ok, got[rid].message)
                    base = i * slot
                    out = c.unwire(region.array(base + qb + kvb, (1, h_q, 512), "<u2").tobytes(), (1, h_q, 512))
                    lse = region.array(base + qb + kvb + ob, (h_q, 1), "<f4").copy()
                    self.check(StepOutputLike(out, lse), qs[i], rows[i], False)
            session.close_send()
            list(session.results())
            region.close()
        for seq in seqs:
            c.release_sequence(seq)

    def test_doorbell_ring(self):
        """Steps through the region's doorbell ring: q/kv written with numpy, steps
        published in the submission queue in batches, completions read off the ring,
        out/lse read back from the region and checked; a bad entry fails alone."""
        c = self.client
        info = c.info
        rng = np.random.default_rng(33)
        h_q, h_kv = info.num_heads_q, info.num_heads_kv
        qb, kvb, ob, lb = h_q * 576 * 2, h_kv * 576 * 2, h_q * 512 * 2, h_q * 4
        slot = (qb + kvb + ob + lb + 63) // 64 * 64
        entries = 4  # fewer than a round's steps over the rounds: the counters wrap
        base = latentd_client.ring_bytes(entries)
        seqs, rows = [], []
        for i in range(3):
            seq = c.create_sequence()
            r = self.rand(rng, 10 + 45 * i, h_kv, 576)
            c.append_kv(seq, {1: r})
            seqs.append(seq)
            rows.append(r)
        with c.open_session() as session:
            region = session.open_region(base + slot * len(seqs), ring_entries=entries)
            ring = session.ring
            self.assertEqual(ring.nbytes, base)
            next_id = 1
            for _ in range(4):
                steps, qs = [], []
                for i, seq in enumerate(seqs):
                    at = base + i * slot
                    q, kv = self.rand(rng, 1, h_q, 576), self.rand(rng, 1, h_kv, 576)
                    region.array(at, (1, h_q, 576), "<u2")[:] = np.frombuffer(c.wire(q), "<u2").reshape(1, h_q, 576)
                    region.array(at + qb, (1, h_kv, 576), "<u2")[:] = np.frombuffer(c.wire(kv), "<u2").reshape(
                        1, h_kv, 576)
                    rows[i] = np.concatenate([rows[i], kv])
                    qs.append(q)
                    steps.append(dict(request_id=next_id, sequence_id=seq, layer=1, s_q=1, q_offset=at,
                                      kv_offset=at + qb, out_offset=at + qb + kvb, lse_offset=at + qb + kvb + ob))
                    next_id += 1
                ring.submit(steps[:1])
                ring.submit(steps[1:])
                done = ring.wait(len(steps), timeout=30)
                self.assertEqual(ring.outstanding, 0)
                by_id = {int(d["request_id"]): d for d in done}
                for i, st in enumerate(steps):
                    d = by_id[st["request_id"]]
                    self.assertEqual(int(d["code"]), 0, d["message"][:d["message_bytes"]])
                    at = base + i * slot
                    out = c.unwire(region.array(at + qb + kvb, (1, h_q, 512), "<u2").tobytes(), (1, h_q, 512))
                    lse = region.array(at + qb + kvb + ob, (h_q, 1), "<f4").copy()
                    self.check(StepOutputLike(out, lse), qs[i], rows[i], False)
            bad = dict(request_id=999, sequence_id=seqs[0], layer=1, s_q=1, q_offset=64, kv_offset=base + qb,
                       out_offset=base + qb + kvb, lse_offset=base + qb + kvb + ob)
            ring.submit([bad])
            [d] = ring.wait(1, timeout=30)
            self.assertEqual(int(d["code"]), grpc.StatusCode.INVALID_ARGUMENT.value[0])
            self.assertIn(b"region.q_offset", d["message"][:d["message_bytes"]])
            session.close_send()
            list(session.results())
            ring.close()
        for seq in seqs:
            c.release_sequence(seq)

    def test_errors(self):
        c = self.client
        seq = c.create_sequence("py-errors")
        with self.assertRaises(LatentdError) as e:
            c.create_sequence("py-errors")
        self.assertEqual(e.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        with self.assertRaises(LatentdError) as e:
            c.release_sequence("py-missing")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(LatentdError) as e:
            c.append_kv(seq, {0: b"\0" * 1000})
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("kv", e.exception.message)
        with self.assertRaises(LatentdError) as e:
            c.append_kv(seq, {5: np.zeros((1, 1, 576))})
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("layer", e.exception.message)
        q, kv = np.zeros((1, 32, 576)), np.zeros((1, 1, 576))
        outs = c.decode([dict(sequence_id=seq, layer=0, q=q, kv=kv),
                         dict(sequence_id=seq, layer=0, q=b"\0" * 10, kv=kv),
                         dict(sequence_id="py-missing", layer=0, q=q, kv=kv),
                         dict(sequence_id=seq, layer=0, q=q, kv=kv)])
        self.assertEqual([o.code for o in outs], [0, grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                  grpc.StatusCode.NOT_FOUND.value[0], 0])
        self.assertIn("q:", outs[1].message)
        self.assertEqual(c.health(), "SERVING")
        c.release_sequence(seq)

    def test_health_and_reflection(self):
        c = self.client
        self.assertEqual(c.health(), "SERVING")
        self.assertEqual(c.health("latentd.v1.DecodeService"), "SERVING")
        # Server reflection, spoken in raw bytes: ServerReflectionRequest{list_services: ""}.
        call = c.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        responses = list(call(iter([b"\x3a\x00"]), timeout=10))
        self.assertEqual(len(responses), 1)
        self.assertIn(b"latentd.v1.DecodeService", responses[0])
        self.assertIn(b"grpc.health.v1.Health", responses[0])

    def test_example_script(self):
        example = os.path.join(RUNFILES, "clients/python/example.py")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        run = subprocess.run([sys.executable, example, "--target", self.daemon.target, "--layer", "1"],
                             env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("ok", run.stdout.splitlines()[-1])


class AuthTest(unittest.TestCase):
    def test_token(self):
        daemon = Daemon("--auth_token=py-token")
        try:
            with self.assertRaises(LatentdError) as e:
                LatentdClient(daemon.target)
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
            with LatentdClient(daemon.target, auth_token="py-token") as c:
                seq = c.create_sequence()
                c.append_kv(seq, {0: np.zeros((3, 1, 576))})
                [out] = c.decode([dict(sequence_id=seq, layer=0, q=np.zeros((1, 16, 576)),
                                       kv=np.ones((1, 1, 576)) * 0.5)])
                self.assertTrue(out.ok, out.message)
                # q = 0 gives equal scores: out is the mean of the value rows, (0 * 3 + 0.5) / 4.
                np.testing.assert_allclose(out.out, 0.125, rtol=1e-2)
        finally:
            daemon.stop()


class Fp8CachePythonClientTest(unittest.TestCase):
    """A daemon with an FP8 KV cache: results against the reference over the rows as the
    daemon stores them (latentd_client.fp8_kv_roundtrip)."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("--num_layers=2", "--num_heads_q=32", "--kv_dtype=fp8_e4m3")
        cls.client = LatentdClient(cls.daemon.target)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()

    rand = PythonClientTest.rand
    check = PythonClientTest.check
    run_sequence = PythonClientTest.run_sequence

    def test_info_reports_the_cache(self):
        info = self.client.info
        self.assertEqual(info.kv_dtype, "fp8_e4m3")
        self.assertEqual(info.kv_bytes_per_token, 656 * info.num_layers * info.num_heads_kv)

    def test_results_match_reference_over_stored_rows(self):
        self.run_sequence(7, {0: 130, 1: 64}, [(0, 1, False), (1, 2, True), (0, 2, True)], fork_after=1)

    def test_roundtrip_differs_from_the_rows_sent(self):
        # A check that cannot pass by accident: the unquantized rows give other results.
        rng = np.random.default_rng(3)
        rows = self.rand(rng, 10, 1, 576)
        stored = latentd_client.fp8_kv_roundtrip(rows, self.client.info.dtype)
        self.assertFalse(np.array_equal(stored, rows))
        np.testing.assert_array_equal(stored[..., 512:], rows[..., 512:])
        self.assertLess(np.abs(stored - rows).max(), 0.07)


if __name__ == "__main__":
    unittest.main()
