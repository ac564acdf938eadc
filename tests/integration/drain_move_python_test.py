# The Python client's export and import (docs/export-import.md) against real CPU
# daemons: move_sequence between two daemons with later steps correct on the new one,
# a stream without its last chunk refused with nothing left behind, and the Python
# ShardedClient over three daemons, one SIGTERMed mid-run: its sequences move to their
# next owners on the ring and every later result is OK and matches the reference.
import os
import signal
import subprocess
import tempfile
import time
import unittest

import grpc
import numpy as np

from latentd_client import LatentdClient, LatentdError, ShardedClient
from latentd_client.client import reference_decode

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))
LAYERS, SEQUENCES, ROUNDS, SIGNAL_AFTER, VICTIM = 2, 60, 4, 1, 1


def close(a, b, rel=2 / 128):
    """FlashMLA's element tolerance: abs 8e-4 or rel (2/128 for bf16)."""
    return np.all(np.abs(a - b) <= np.maximum(8e-4, rel * np.abs(b)))


class Daemon:
    def __init__(self, *flags):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "latentd.log")
        env = dict(os.environ, LATENTD_KV_POISON="1")  # NaN in every row nobody wrote
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [os.path.join(RUNFILES, "server/latentd"), "--backend=cpu", "--listen=127.0.0.1:0",
                 f"--port_file={port_file}", "--cpu_threads=2", f"--num_layers={LAYERS}", "--kv_pages=512", *flags],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 120
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("latentd did not start:\n" + self.log())
            time.sleep(0.02)
        with open(port_file) as f:
            self.target = "127.0.0.1:" + f.read().strip()

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class DrainMovePythonTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(5)
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            d.stop()
            log = d.log()
            for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer",
                           "runtime error:"):
                self.assertNotIn(marker, log)

    def start(self, *flags):
        d = Daemon(*flags)
        self.daemons.append(d)
        return d

    def rand(self, client, *shape):
        return client.unwire(client.wire(self.rng.uniform(-1, 1, shape)), shape)

    def check(self, client, rows, q, result):
        self.assertEqual(result.code, 0, result.message)
        want_out, want_lse = reference_decode(q, rows, client.info.softmax_scale)
        self.assertTrue(close(result.out, want_out))
        self.assertTrue(np.allclose(result.lse, want_lse, atol=1e-3))

    def test_move_sequence_and_a_truncated_import(self):
        a, b = self.start(), self.start()
        ca, cb = LatentdClient(a.target), LatentdClient(b.target)
        rows = {l: self.rand(ca, 90 + 40 * l, 1, 576) for l in range(LAYERS)}
        ca.create_sequence("py-moved")
        ca.append_kv("py-moved", rows)
        chunks = list(ca.export_sequence("py-moved", max_chunk_bytes=32 * 1152))
        self.assertTrue(chunks[0].HasField("header"))
        self.assertEqual(list(chunks[0].header.lengths), [90, 130])
        self.assertTrue(chunks[-1].last)
        # Without its last chunk the import fails and leaves nothing.
        with self.assertRaises(LatentdError) as e:
            cb.import_sequence(chunks[:-1])
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("without its last one", e.exception.message)
        info = cb.get_info()
        self.assertEqual((info.sequences, info.free_pages), (0, info.total_pages))
        # Another id from the same chunks, then the real move.
        self.assertEqual(cb.import_sequence(chunks, sequence_id="py-copy").sequence_id, "py-copy")
        resp = ca.move_sequence("py-moved", cb)
        self.assertEqual(resp.rows, 220)
        with self.assertRaises(LatentdError) as e:
            ca.get_sequence("py-moved")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        for layer in range(LAYERS):
            q, kv = self.rand(cb, 1, 16, 576), self.rand(cb, 1, 1, 576)
            [r] = cb.decode([dict(sequence_id="py-moved", layer=layer, q=q, kv=kv)])
            rows[layer] = np.concatenate([rows[layer], kv])
            self.check(cb, rows[layer], q, r)
        ca.close()
        cb.close()

    def test_sigterm_on_one_of_three_daemons_loses_no_sequence(self):
        daemons = [self.start("--drain_handoff_s=30", "--drain_timeout_s=60", "--sequence_ttl_s=0")
                   for _ in range(3)]
        c = ShardedClient([d.target for d in daemons], health_interval=0, batch_timeout=120, rpc_timeout=60)
        rows = {}
        ids = [f"py-seq-{i}" for i in range(SEQUENCES)]
        for i, sid in enumerate(ids):
            c.create_sequence(sid)
            r = {l: self.rand(c, 1 + (i * 37 + l * 11) % 150, 1, 576) for l in range(LAYERS)}
            c.append_kv(sid, r)
            for l in range(LAYERS):
                rows[(sid, l)] = r[l]
        on_victim = {sid for sid in ids if c.locate(sid) == VICTIM}
        self.assertTrue(on_victim)
        for rnd in range(ROUNDS):
            if rnd == SIGNAL_AFTER:
                daemons[VICTIM].proc.send_signal(signal.SIGTERM)
            for layer in range(LAYERS):
                steps, qs = [], []
                for sid in ids:
                    q, kv = self.rand(c, 1, 16, 576), self.rand(c, 1, 1, 576)
                    rows[(sid, layer)] = np.concatenate([rows[(sid, layer)], kv])
                    steps.append(dict(sequence_id=sid, layer=layer, q=q, kv=kv))
                    qs.append(q)
                for sid, q, r in zip(ids, qs, c.decode_batch(steps)):
                    with self.subTest(round=rnd, layer=layer, sequence=sid):
                        self.check(c, rows[(sid, layer)], q, r)
        self.assertEqual(c.moved_sequences, len(on_victim))
        for sid in on_victim:
            now = c.locate(sid)
            self.assertEqual(now, next(t for t in c.ring.preference(sid) if t != VICTIM))
            info = c.client(now).get_sequence(sid)
            self.assertEqual(list(info.lengths), [len(rows[(sid, l)]) for l in range(LAYERS)])
        self.assertEqual(daemons[VICTIM].proc.wait(timeout=120), 0, daemons[VICTIM].log())
        self.assertIn("handoff: 0 sequences left", daemons[VICTIM].log())
        c.close()


if __name__ == "__main__":
    unittest.main()
