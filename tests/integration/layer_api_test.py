# The layer API end to end: CPU daemons started with --model_dir on tiny random checkpoints
# (bf16, fp16, FP8 blocks; q_lora_rank set and null; YaRN on and off; both RoPE layouts),
# driven by the Python client and checked against a float64 reference of DeepseekV3Attention.
import os
import shutil
import sys
import tempfile
import unittest

import grpc
import numpy as np

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))
sys.path.insert(0, os.path.join(RUNFILES, "clients/python/examples"))

import latentd_client  # noqa: E402
from latentd_client import LatentdClient, LatentdError, latentd_pb2  # noqa: E402
from mla_reference import (LIMITS, Checkpoint, Daemon, ReferenceAttention, Spec, errors, round_to,  # noqa: E402
                           run_to_exit, softmax_scale, to_bits, yarn)

LATENTD = os.path.join(RUNFILES, "server/latentd")
TMP = os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp()
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE.value[0]
SUMMARY = []  # one line per variant, printed at the end


class History:
    """What one sequence's layer caches hold, as the reference needs it: every token's
    hidden state and RoPE position, per layer."""

    def __init__(self, num_layers, hidden):
        self.x = [np.zeros((0, hidden)) for _ in range(num_layers)]
        self.pos = [np.zeros(0, np.int64) for _ in range(num_layers)]

    def append(self, layer, x, first=None):
        first = len(self.x[layer]) if first is None else first
        self.x[layer] = np.concatenate([self.x[layer], x])
        self.pos[layer] = np.concatenate([self.pos[layer], np.arange(first, first + len(x))])

    def copy(self):
        h = History(0, 0)
        h.x, h.pos = [a.copy() for a in self.x], [p.copy() for p in self.pos]
        return h


def weight_bytes(spec, heads):
    """What the CPU backend holds for a rank of `heads` heads: every layer's projections
    and norms in float32 (kv_b_proj as its W_UK and W_UV halves)."""
    H, rq = spec.hidden_size, spec.q_lora_rank
    q = rq * H + rq + heads * spec.qk * rq if rq else heads * spec.qk * H
    kv = (512 + 64) * H + 512 + heads * (spec.qk_nope_head_dim + spec.v_head_dim) * 512
    return 4 * spec.num_layers * (q + kv + H * heads * spec.v_head_dim)


class Stats:
    """A variant's errors per output and its softmax's sharpness, for the summary."""

    def __init__(self, dtype):
        self.limits = LIMITS[dtype]
        self.max_rel, self.rms_rel, self.max_p = [], [], []

    def line(self, name):
        if not self.max_rel:
            return f"{name}: no steps"
        return (f"{name}: {len(self.max_rel)} outputs, max |err|/rms {max(self.max_rel):.4f} "
                f"(limit {self.limits[0]}), rms err/rms {max(self.rms_rel):.4f} worst, "
                f"{np.mean(self.rms_rel):.4f} mean (limit {self.limits[1]}); largest attention probability "
                f"per step {min(self.max_p):.3f}..{max(self.max_p):.3f}")


class LayerCase:
    """The checks of one checkpoint variant against a daemon on it; the TestCase classes
    below set name, spec and seed."""

    name, spec, seed, tensor_parallel_check = None, None, 0, False

    @classmethod
    def setUpClass(cls):
        cls.ckpt = Checkpoint(cls.spec, cls.seed)
        cls.dir = cls.ckpt.write(os.path.join(TMP, cls.name))
        cls.daemon = Daemon(LATENTD, f"--model_dir={cls.dir}", "--kv_pages=96", log_dir=TMP)
        # Small upload messages, so that prefixes cross messages as well as pages.
        cls.client = LatentdClient(cls.daemon.target, append_chunk_bytes=50 * cls.spec.hidden_size * 2)
        cls.refs = [ReferenceAttention(cls.spec, w) for w in cls.ckpt.layers]
        cls.stats = Stats(cls.spec.dtype)
        cls.rng = np.random.default_rng(cls.seed + 1000)

    @classmethod
    def tearDownClass(cls):
        SUMMARY.append(cls.stats.line(cls.name))
        cls.client.close()
        cls.daemon.stop()

    # ---- helpers ----

    def hidden(self, n):
        """Hidden states of n tokens, as the wire carries them (model-dtype values)."""
        return round_to(self.rng.normal(0, 1, (n, self.spec.hidden_size)), self.spec.dtype).astype(np.float64)

    def run_steps(self, steps, client=None):
        """The steps as one DecodeRequest on a fresh stream; their StepOutputs in order."""
        c = client or self.client
        with c.open_session() as session:
            ids = session.submit_many(steps)
            session.close_send()
            got = {r.request_id: r for r in session.results()}
        self.assertEqual(sorted(got), sorted(ids))
        return [got[i] for i in ids]

    def check_output(self, out, hist, layer, s_q, causal=True, heads=None, stats=True, what=""):
        ref, max_p = self.refs[layer](hist.x[layer], hist.pos[layer], s_q, causal=causal, heads=heads)
        self.assertEqual(out.shape, ref.shape)
        max_rel, rms_rel = errors(out, ref)
        lim = self.stats.limits
        self.assertLessEqual(max_rel, lim[0], f"{self.name} {what} layer {layer} s_q {s_q}: max {max_rel:.4f}")
        self.assertLessEqual(rms_rel, lim[1], f"{self.name} {what} layer {layer} s_q {s_q}: rms {rms_rel:.4f}")
        if stats:
            self.stats.max_rel.append(max_rel)
            self.stats.rms_rel.append(rms_rel)
            self.stats.max_p.append(max_p)
        return ref

    def step(self, hist, seq, layer, s_q, causal=True, position=None):
        """A layer step's dict and its hidden states, recorded in hist (at position or the
        layer's next one)."""
        x = self.hidden(s_q)
        hist.append(layer, x, position)
        st = dict(sequence_id=seq, layer=layer, hidden=x, causal=causal)
        if position is not None:
            st["position"] = position
        return st

    def new_sequences(self, prefixes):
        """Sequences with prefixes uploaded by append_hidden on every layer: [(id, History)]."""
        c = self.client
        L = self.spec.num_layers
        out = []
        for n in prefixes:
            seq = c.create_sequence()
            hist = History(L, self.spec.hidden_size)
            xs = {layer: self.hidden(n) for layer in range(L)}
            resp = c.append_hidden(seq, xs)
            self.assertEqual(resp.tokens_appended, n * L)
            self.assertEqual(list(resp.lengths), [n] * L)
            for layer, x in xs.items():
                hist.append(layer, x)
            out.append((seq, hist))
        return out

    # ---- tests ----

    def test_info(self):
        info, s = self.client.info, self.spec
        self.assertTrue(info.layer_api)
        self.assertEqual(info.hidden_size, s.hidden_size)
        self.assertEqual(info.num_layers, s.num_layers)
        self.assertEqual(info.num_heads_q, s.num_heads)
        self.assertEqual(info.num_heads_kv, 1)
        self.assertEqual(info.tensor_parallel, 1)
        self.assertEqual(info.tensor_rank, 0)
        self.assertEqual(info.weight_bytes, weight_bytes(s, s.num_heads))
        self.assertEqual(info.max_positions, s.max_position_embeddings)
        self.assertEqual(info.dtype, latentd_pb2.BF16 if s.dtype == "bf16" else latentd_pb2.FP16)
        self.assertAlmostEqual(info.softmax_scale, softmax_scale(s), delta=1e-6 * softmax_scale(s))

    def test_prefill_decode_fork(self):
        """Prefixes across page and message edges, rounds of causal steps of 1-3 tokens on
        both layers of several sequences per DecodeRequest, an upload between steps, an
        explicit position, a non-causal step, then a fork whose branches diverge."""
        L = self.spec.num_layers
        seqs = self.new_sequences([63, 64, 65, 130])

        def round_(r, extra=None):
            steps, checks = [], []
            for i, (seq, hist) in enumerate(seqs):
                for layer in range(L):
                    s_q = 1 + (r + i + layer) % 3
                    kw = (extra or {}).get((i, layer), {})
                    steps.append(self.step(hist, seq, layer, s_q, **kw))
                    checks.append((hist, layer, s_q, kw.get("causal", True)))
            outs = self.run_steps(steps)
            for o, (hist, layer, s_q, causal) in zip(outs, checks):
                self.assertTrue(o.ok, o.message)
                self.check_output(o.out, hist, layer, s_q, causal, what=f"round {r}")

        round_(0)
        round_(1)
        # Prefill again between decode steps: the rows go on at the layer's length.
        seq, hist = seqs[2]
        x = self.hidden(5)
        resp = self.client.append_hidden(seq, {0: x})
        hist.append(0, x)
        self.assertEqual(list(resp.lengths), [len(hist.x[l]) for l in range(L)])
        # A position past YaRN's original context, then one back at 10, and a non-causal
        # step (every token sees the step's own tokens).
        round_(2, {(3, 0): dict(position=5000), (3, 1): dict(position=6001), (1, 0): dict(position=10),
                   (0, 1): dict(causal=False)})
        round_(3)
        info = self.client.get_sequence(seqs[3][0])
        self.assertEqual(list(info.lengths), [len(seqs[3][1].x[l]) for l in range(L)])

        # Fork sequence 1 (its 64-token prefix and 4 rounds' tokens: a whole page shared,
        # and one partly filled that the branches' next rows copy on write).
        everyone = [seq for seq, _ in seqs]
        parent, phist = seqs[1]
        child = self.client.fork_sequence(parent)
        everyone.append(child)
        chist = phist.copy()
        seqs = [(parent, phist), (child, chist)]
        # An upload to the child alone writes into the page it shares with the parent.
        x = self.hidden(3)
        self.client.append_hidden(child, {1: x})
        chist.append(1, x)
        for r in range(4, 7):
            round_(r)
        for seq, hist in seqs:
            self.assertEqual(list(self.client.get_sequence(seq).lengths), [len(hist.x[l]) for l in range(L)])
        for seq in everyone:
            self.client.release_sequence(seq)

    def test_sharded_client(self):
        """Layer steps of sequences spread over two daemons on the same checkpoint,
        through the ShardedClient: uploads of hidden states, then batches of layer steps
        split by daemon, each output against the reference."""
        other = Daemon(LATENTD, f"--model_dir={self.dir}", "--kv_pages=96", log_dir=TMP)
        sc = latentd_client.ShardedClient([self.daemon.target, other.target])
        try:
            L = self.spec.num_layers
            seqs = []
            for i in range(6):
                seq = sc.create_sequence()
                hist = History(L, self.spec.hidden_size)
                xs = {layer: self.hidden(20 + 9 * i) for layer in range(L)}
                sc.append_hidden(seq, xs)
                for layer, x in xs.items():
                    hist.append(layer, x)
                seqs.append((seq, hist))
            for r in range(2):
                for layer in range(L):
                    steps, checks = [], []
                    for i, (seq, hist) in enumerate(seqs):
                        s_q = 1 + (r + i) % 2
                        steps.append(self.step(hist, seq, layer, s_q))
                        checks.append((hist, s_q))
                    outs = sc.decode_batch(steps)
                    for o, (hist, s_q) in zip(outs, checks):
                        self.assertEqual(o.code, 0, o.message)
                        self.check_output(o.out, hist, layer, s_q, what=f"sharded round {r}")
            for seq, _ in seqs:
                sc.release_sequence(seq)
        finally:
            sc.close()
            other.stop()

    def test_position_and_size_errors(self):
        (seq, hist), = self.new_sequences([3])
        maxp = self.spec.max_position_embeddings
        x1 = to_bits(self.hidden(1), self.spec.dtype).tobytes()
        x2 = to_bits(self.hidden(2), self.spec.dtype).tobytes()
        outs = self.run_steps([
            dict(sequence_id=seq, layer=0, hidden=x1[:-2]),
            dict(sequence_id=seq, layer=1, hidden=x2 * 5),  # 10 tokens: over max_s_q (8)
            dict(sequence_id=seq, layer=0, hidden=x1, position=maxp),
            dict(sequence_id=seq, layer=1, hidden=x2, position=maxp - 1),
            dict(sequence_id=seq, layer=1, hidden=x1, position=-1),
        ])
        self.assertEqual([o.code for o in outs], [INVALID_ARGUMENT, INVALID_ARGUMENT, OUT_OF_RANGE, OUT_OF_RANGE,
                                                  OUT_OF_RANGE], [o.message for o in outs])
        for o in outs[:2]:
            self.assertIn("hidden", o.message)
        for o in outs[2:]:
            self.assertIn("position", o.message)
        # None of them appended a row; the last position of the table works.
        self.assertEqual(list(self.client.get_sequence(seq).lengths), [3, 3])
        x = self.hidden(2)
        hist.append(0, x, maxp - 2)
        [o] = self.client.decode([dict(sequence_id=seq, layer=0, hidden=x, causal=True, position=maxp - 2)])
        self.assertTrue(o.ok, o.message)
        self.check_output(o.out, hist, 0, 2, what="last positions")
        # An upload of the wrong size.
        with self.assertRaises(LatentdError) as e:
            self.client.append_hidden(seq, {1: x1 + b"\0\0"})
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("hidden", e.exception.message)
        self.client.release_sequence(seq)

    def test_prefix_cache(self):
        """A second sequence with the same page keys finds the first one's full pages
        (uploaded as hidden states) and attends over them."""
        c = self.client
        tokens = [int(t) for t in self.rng.integers(0, 50000, 150)]
        keys = latentd_client.page_keys(tokens, salt=self.name)
        first, present = c.create_sequence_with_prefix(keys)
        self.assertEqual(present, 0)
        hist = History(self.spec.num_layers, self.spec.hidden_size)
        xs = {layer: self.hidden(150) for layer in range(self.spec.num_layers)}
        c.append_hidden(first, xs)
        for layer, x in xs.items():
            hist.append(layer, x)
        second, present = c.create_sequence_with_prefix(keys)
        self.assertEqual(present, 128)
        other = History(self.spec.num_layers, self.spec.hidden_size)
        tail = {}
        for layer in range(self.spec.num_layers):
            other.append(layer, hist.x[layer][:128])
            tail[layer] = self.hidden(22)  # the second sequence's own last tokens
            other.append(layer, tail[layer])
        c.append_hidden(second, tail)
        steps, checks = [], []
        for seq, hst in ((first, hist), (second, other)):
            for layer in range(self.spec.num_layers):
                steps.append(self.step(hst, seq, layer, 2))
                checks.append((hst, layer))
        for o, (hst, layer) in zip(self.run_steps(steps), checks):
            self.assertTrue(o.ok, o.message)
            self.check_output(o.out, hst, layer, 2, what="prefix cache")
        c.release_sequence(first)
        c.release_sequence(second)

    def test_kernel_steps_beside_layer_steps(self):
        """Kernel-level steps (q and kv rows from the client) still work on a layer-API
        daemon, in the same DecodeRequest as layer steps of max_s_q tokens."""
        c = self.client
        info, h = c.info, self.spec.num_heads
        (seq, hist), = self.new_sequences([20])
        kseq = c.create_sequence()
        rng = np.random.default_rng(self.seed)

        def rand(*shape):
            return c.unwire(c.wire(rng.uniform(-1, 1, shape)), shape)

        rows = {layer: rand(30 + 40 * layer, 1, 576) for layer in range(2)}
        c.append_kv(kseq, rows)
        steps, kernel = [], []
        for layer in range(2):
            q, kv = rand(2, h, 576), rand(2, 1, 576)
            rows[layer] = np.concatenate([rows[layer], kv])
            kernel.append((q, rows[layer]))
            steps.append(dict(sequence_id=kseq, layer=layer, q=q, kv=kv, causal=True))
            steps.append(self.step(hist, seq, layer, info.max_s_q))
        outs = self.run_steps(steps)
        for layer in range(2):
            ko, lo = outs[2 * layer], outs[2 * layer + 1]
            self.assertTrue(ko.ok, ko.message)
            self.assertTrue(lo.ok, lo.message)
            q, r = kernel[layer]
            ref, ref_lse = latentd_client.reference_decode(q, r, info.softmax_scale, causal=True)
            self.assertLess(np.abs(ko.out - ref).max(), 2e-2)
            np.testing.assert_allclose(ko.lse, ref_lse, rtol=1e-3, atol=1e-3)
            self.check_output(lo.out, hist, layer, info.max_s_q, what="beside kernel steps")
        c.release_sequence(seq)
        c.release_sequence(kseq)

    def test_shared_region_and_ring(self):
        """Layer steps through the stream's shared region (hidden_offset / out_offset),
        then through its doorbell ring."""
        c, dt, H, L = self.client, self.spec.dtype, self.spec.hidden_size, self.spec.num_layers
        seqs = self.new_sequences([40, 70])
        s_q = 2
        slot = (2 * s_q * H * 2 + 63) // 64 * 64  # hidden then out
        n = len(seqs) * L

        def fill(region, base):
            steps, checks = [], []
            for i, (seq, hist) in enumerate(seqs):
                for layer in range(L):
                    at = base + (i * L + layer) * slot
                    pos = 3000 if (i, layer) == (1, 1) else None
                    st = self.step(hist, seq, layer, s_q, position=pos)
                    region.array(at, (s_q, H), "<u2")[:] = to_bits(st["hidden"], dt).reshape(s_q, H)
                    d = dict(sequence_id=seq, layer=layer, s_q=s_q, hidden_offset=at, out_offset=at + s_q * H * 2,
                             causal=True)
                    if pos is not None:
                        d["position"] = pos
                    steps.append(d)
                    checks.append((hist, layer))
            return steps, checks

        def read_out(region, d):
            return c.unwire(region.array(d["out_offset"], (s_q, H), "<u2").tobytes(), (s_q, H))

        with c.open_session() as session:
            region = session.open_region(slot * n)
            for r in range(2):
                steps, checks = fill(region, 0)
                ids = session.submit_region(steps)
                got = {}
                for res in session.results():
                    got[res.request_id] = res
                    if len(got) == len(ids):
                        break
                for rid, d, (hist, layer) in zip(ids, steps, checks):
                    self.assertTrue(got[rid].ok, got[rid].message)
                    self.check_output(read_out(region, d), hist, layer, s_q, what=f"region round {r}")
            session.close_send()
            list(session.results())
            region.close()

        entries = 4  # fewer than a round's steps over the rounds: the counters wrap
        base = latentd_client.ring_bytes(entries)
        with c.open_session() as session:
            region = session.open_region(base + slot * n, ring_entries=entries)
            ring = session.ring
            next_id = 1
            for r in range(3):
                steps, checks = fill(region, base)
                for d in steps:
                    d["request_id"] = next_id
                    next_id += 1
                ring.submit(steps[:1])
                ring.submit(steps[1:])
                done = {int(d["request_id"]): d for d in ring.wait(len(steps), timeout=60)}
                for d, (hist, layer) in zip(steps, checks):
                    e = done[d["request_id"]]
                    self.assertEqual(int(e["code"]), 0, e["message"][:e["message_bytes"]])
                    self.check_output(read_out(region, d), hist, layer, s_q, what=f"ring round {r}")
            session.close_send()
            list(session.results())
            ring.close()
            region.close()
        for seq, _ in seqs:
            c.release_sequence(seq)

    def test_tensor_parallel(self):
        """Two ranks' partial sums add up to the one-rank daemon's output; each rank's
        partial matches the reference over its heads."""
        if not self.tensor_parallel_check:
            self.skipTest("checked on other variants")
        h = self.spec.num_heads
        ranks = [Daemon(LATENTD, f"--model_dir={self.dir}", "--kv_pages=32", "--tensor_parallel=2",
                        f"--tensor_rank={r}", log_dir=TMP) for r in range(2)]
        clients = []
        try:
            clients = [LatentdClient(d.target) for d in ranks]
            for r, c in enumerate(clients):
                info = c.info
                self.assertEqual((info.tensor_parallel, info.tensor_rank, info.num_heads_q), (2, r, h // 2))
                self.assertTrue(info.layer_api)
                self.assertEqual(info.hidden_size, self.spec.hidden_size)
                self.assertEqual(info.weight_bytes, weight_bytes(self.spec, h // 2))
            everyone = [self.client] + clients
            L, prefixes = self.spec.num_layers, [65, 100]
            hists, ids = [], []
            for n in prefixes:
                hist = History(L, self.spec.hidden_size)
                xs = {layer: self.hidden(n) for layer in range(L)}
                for layer, x in xs.items():
                    hist.append(layer, x)
                ids.append([c.create_sequence() for c in everyone])
                for c, seq in zip(everyone, ids[-1]):
                    c.append_hidden(seq, xs)
                hists.append(hist)
            worst = [0.0, 0.0, 0.0, 0.0]  # sum of ranks vs the reference, vs the one-rank daemon
            for r in range(3):
                plan = []
                for i, hist in enumerate(hists):
                    for layer in range(L):
                        s_q = 1 + (r + i + layer) % 3
                        pos = 4500 if (r, i) == (1, 0) else None
                        st = self.step(hist, None, layer, s_q, position=pos)
                        plan.append((i, layer, s_q, st))
                outs = []
                for k, c in enumerate(everyone):
                    outs.append(self.run_steps([dict(st, sequence_id=ids[i][k]) for i, _, _, st in plan], client=c))
                for j, (i, layer, s_q, _) in enumerate(plan):
                    full, r0, r1 = outs[0][j], outs[1][j], outs[2][j]
                    for o in (full, r0, r1):
                        self.assertTrue(o.ok, o.message)
                    hist = hists[i]
                    ref = self.check_output(r0.out + r1.out, hist, layer, s_q, stats=False, what="TP sum")
                    self.check_output(r0.out, hist, layer, s_q, heads=range(0, h // 2), stats=False, what="rank 0")
                    self.check_output(r1.out, hist, layer, s_q, heads=range(h // 2, h), stats=False, what="rank 1")
                    vs_one = errors(r0.out + r1.out, full.out)
                    # Against the one-rank daemon, relative to its output's RMS: two roundings apart.
                    self.assertLessEqual(vs_one[0], self.stats.limits[0], "TP sum vs one rank")
                    self.assertLessEqual(vs_one[1], self.stats.limits[1], "TP sum vs one rank")
                    worst = [max(a, b) for a, b in zip(worst, errors(r0.out + r1.out, ref) + vs_one)]
            SUMMARY.append(f"{self.name} tensor parallel 2: sum of ranks vs reference max {worst[0]:.4f}, "
                           f"rms {worst[1]:.4f}; vs the one-rank daemon max {worst[2]:.4f}, rms {worst[3]:.4f}")
        finally:
            for c in clients:
                c.close()
            for d in ranks:
                d.stop()


class Bf16QLoraYarn(LayerCase, unittest.TestCase):
    name, seed = "bf16 q_lora 96 yarn interleaved", 1
    spec = Spec(dtype="bf16", hidden_size=192, q_lora_rank=96, rope_scaling=yarn())


class Fp16PlainRope(LayerCase, unittest.TestCase):
    name, seed, tensor_parallel_check = "fp16 q_proj no-yarn interleaved", 2, True
    spec = Spec(dtype="fp16", hidden_size=256, q_lora_rank=None, rope_scaling=None)


class Fp8Blocks(LayerCase, unittest.TestCase):
    name, seed, tensor_parallel_check = "fp8-e4m3 (bf16) q_lora 96 yarn interleaved", 3, True
    # hidden 192 and q_lora_rank 96 leave partial 128x128 blocks; a rank's q_b_proj rows
    # (2 heads x 96) end inside a block.
    spec = Spec(dtype="bf16", fp8=True, hidden_size=192, q_lora_rank=96,
                rope_scaling=yarn(factor=16, original=2048, mscale=0.9, mscale_all_dim=0.7))


class Bf16NotInterleaved(LayerCase, unittest.TestCase):
    name, seed = "bf16 q_proj yarn rope_interleave=false", 4
    spec = Spec(dtype="bf16", hidden_size=224, q_lora_rank=None, rope_scaling=yarn(), rope_interleave=False)


class StartupAndApiErrors(unittest.TestCase):
    spec = Spec(dtype="bf16", hidden_size=192, q_lora_rank=96)

    def test_config_only_serves_the_kernel_api(self):
        d = os.path.join(TMP, "config-only")
        os.makedirs(d, exist_ok=True)
        ckpt = Checkpoint(self.spec, 5)
        ckpt.write(d)
        os.remove(os.path.join(d, "model.safetensors"))
        with Daemon(LATENTD, f"--model_dir={d}", "--kv_pages=16", log_dir=TMP) as daemon, \
                LatentdClient(daemon.target) as c:
            info = c.info
            self.assertFalse(info.layer_api)
            self.assertEqual((info.num_layers, info.num_heads_q, info.num_heads_kv), (2, 4, 1))
            self.assertAlmostEqual(info.softmax_scale, softmax_scale(self.spec), delta=1e-6)
            seq = c.create_sequence()
            rng = np.random.default_rng(0)

            def rand(*shape):
                return c.unwire(c.wire(rng.uniform(-1, 1, shape)), shape)

            rows = rand(70, 1, 576)
            c.append_kv(seq, {1: rows})
            q, kv = rand(1, 4, 576), rand(1, 1, 576)
            [o] = c.decode([dict(sequence_id=seq, layer=1, q=q, kv=kv)])
            self.assertTrue(o.ok, o.message)
            ref, _ = latentd_client.reference_decode(q, np.concatenate([rows, kv]), info.softmax_scale)
            self.assertLess(np.abs(o.out - ref).max(), 2e-2)
            # A layer step, written by hand (the client refuses one to a daemon without the API).
            hidden = b"\0\0" * self.spec.hidden_size
            req = latentd_pb2.DecodeRequest(steps=[latentd_pb2.DecodeStep(request_id=7, sequence_id=seq, layer=0,
                                                                          hidden=hidden)])
            [resp] = list(c.stub.Decode(iter([req]), timeout=30))
            [r] = resp.results
            self.assertEqual(r.code, FAILED_PRECONDITION, r.message)
            self.assertIn("hidden", r.message)
            with self.assertRaises(grpc.RpcError) as e:
                c.stub.AppendKv(iter([latentd_pb2.AppendKvRequest(sequence_id=seq, layer=0, hidden=hidden)]),
                                timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("hidden", e.exception.details())
            self.assertEqual(list(c.get_sequence(seq).lengths), [0, 71])

    def test_max_positions(self):
        """--max_positions bounds the rotary table: steps and uploads past it fail
        OUT_OF_RANGE; a client keeping its own positions may go on below it."""
        d = os.path.join(TMP, "max-positions")
        ckpt = Checkpoint(self.spec, 7)
        ckpt.write(d)
        refs = [ReferenceAttention(self.spec, w) for w in ckpt.layers]
        rng = np.random.default_rng(7)

        def hidden(n):
            return round_to(rng.normal(0, 1, (n, self.spec.hidden_size)), "bf16").astype(np.float64)

        with Daemon(LATENTD, f"--model_dir={d}", "--kv_pages=16", "--max_positions=70", log_dir=TMP) as daemon, \
                LatentdClient(daemon.target) as c:
            seq = c.create_sequence()
            x = hidden(65)
            c.append_hidden(seq, {0: x})
            with self.assertRaises(LatentdError) as e:
                c.append_hidden(seq, {0: hidden(6)})
            self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn("hidden", e.exception.message)
            y = hidden(6)
            outs = c.decode([dict(sequence_id=seq, layer=0, hidden=hidden(6), causal=True),
                             dict(sequence_id=seq, layer=0, hidden=hidden(1), position=70),
                             dict(sequence_id=seq, layer=0, hidden=y, causal=True, position=2)])
            self.assertEqual([o.code for o in outs[:2]], [OUT_OF_RANGE, OUT_OF_RANGE], [o.message for o in outs])
            for o in outs[:2]:
                self.assertIn("position", o.message)
            self.assertTrue(outs[2].ok, outs[2].message)
            ref, _ = refs[0](np.concatenate([x, y]), np.concatenate([np.arange(65), np.arange(2, 8)]), 6)
            max_rel, rms_rel = errors(outs[2].out, ref)
            self.assertLessEqual(max_rel, LIMITS["bf16"][0])
            self.assertLessEqual(rms_rel, LIMITS["bf16"][1])
            self.assertEqual(list(c.get_sequence(seq).lengths), [71, 0])

    def bad_checkpoint(self, name, ckpt, edit):
        d = os.path.join(TMP, name)
        shutil.rmtree(d, ignore_errors=True)
        ckpt.write(d)
        edit(d)
        rc, out = run_to_exit(LATENTD, f"--model_dir={d}", "--kv_pages=16")
        return rc, out, os.path.join(d, "model.safetensors")

    def test_bad_checkpoints_stop_the_daemon(self):
        spec = Spec(dtype="bf16", fp8=True, hidden_size=192, q_lora_rank=96)
        good = Checkpoint(spec, 6)
        last = list(good.tensors)[-1]
        cases = []

        def truncate(d):
            p = os.path.join(d, "model.safetensors")
            os.truncate(p, os.path.getsize(p) - 1)
        cases.append(("truncated", good, truncate, last, "truncated"))

        missing = Checkpoint(spec, 6)
        del missing.tensors["model.layers.1.self_attn.kv_b_proj.weight"]
        del missing.tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
        cases.append(("missing", missing, lambda d: None, "model.layers.1.self_attn.kv_b_proj.weight", "missing"))

        shape = Checkpoint(spec, 6)
        norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
        shape.tensors[norm] = ("BF16", (256,), b"\x80\x3f" * 256)
        cases.append(("wrong-shape", shape, lambda d: None, norm, "shape [256]"))

        no_scale = Checkpoint(spec, 6)
        del no_scale.tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        cases.append(("no-scale", no_scale, lambda d: None, "model.layers.0.self_attn.o_proj.weight_scale_inv",
                      "missing"))
        for name, ckpt, edit, tensor, what in cases:
            with self.subTest(name):
                rc, out, path = self.bad_checkpoint(name, ckpt, edit)
                self.assertEqual(rc, 2, out)
                self.assertIn(tensor, out)
                self.assertIn(what, out)
                # The file, or for a missing tensor the folder it was looked for in.
                self.assertIn(path if what != "missing" else os.path.dirname(path), out)


def tearDownModule():
    sys.stderr.write("\nmeasured errors, relative to the output RMS (float64 reference):\n")
    for line in SUMMARY:
        sys.stderr.write("  " + line + "\n")


if __name__ == "__main__":
    unittest.main(verbosity=2)
