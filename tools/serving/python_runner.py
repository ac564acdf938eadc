# A Python model runner over latentd_client: one Decode stream, B sequences with
# prefixes, one message of B steps per layer, wait for all results, next layer; prints
# the per-layer round trip p50/p90/p99. --shm uses the stream's shared region (q/kv
# written with numpy, out/lse read in place); --cuda makes the region a torch CUDA tensor
# (CUDA IPC); otherwise tensors travel as gRPC bytes.
#   PYTHONPATH=clients/python python3 tools/serving/python_runner.py --target=127.0.0.1:50051 --shm
import argparse
import time

import numpy as np

from latentd_client import LatentdClient, reference_decode


def check(c, info, prefix, kv_row, appended, q_bits, out):
    """Sequence 0's last layer-0 result against the float64 reference."""
    rows = np.concatenate([prefix] + [kv_row[None]] * appended)
    to_f = lambda bits: c.unwire(np.ascontiguousarray(bits).tobytes(), bits.shape)
    want, _ = reference_decode(to_f(q_bits[None]), to_f(rows), info.softmax_scale)
    got = to_f(out) if out.dtype == np.uint16 else out
    got = got.reshape(want.shape)
    bad = np.abs(got - want) > np.maximum(8e-4, (2 / 128) * np.abs(want))
    if bad.any():
        raise SystemExit(f"python_runner: result mismatch, max diff {np.abs(got - want).max()}")
    print("python_runner: checked sequence 0's last layer-0 result: ok")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefix_len", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--warmup_tokens", type=int, default=3)
    ap.add_argument("--shm", action="store_true")
    ap.add_argument("--messages_per_layer", type=int, default=1,
                    help="DecodeRequests each layer's steps are split into, sent back to back")
    ap.add_argument("--ring", action="store_true",
                    help="the shared region with its doorbell ring: steps and results through shared memory "
                         "(tensor-major layout: a layer's q and kv are one numpy copy each)")
    ap.add_argument("--cuda", action="store_true",
                    help="the region is a torch CUDA tensor (open_cuda_region); inputs copied on the GPU")
    a = ap.parse_args()
    c = LatentdClient(a.target)
    info = c.info
    h_q, h_kv, B, L = info.num_heads_q, info.num_heads_kv, a.batch, min(a.layers, info.num_layers)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 1 << 16, size=(a.prefix_len, h_kv, 576), dtype=np.uint16) & 0xBFFF  # |x| < 2
    seqs = []
    for _ in range(B):
        s = c.create_sequence()
        c.append_kv(s, {l: prefix.tobytes() for l in range(L)})
        seqs.append(s)
    qb, kvb, ob, lb = h_q * 576 * 2, h_kv * 576 * 2, h_q * 512 * 2, h_q * 4
    slot = (qb + kvb + ob + lb + 255) // 256 * 256
    q_pool = rng.integers(0, 1 << 16, size=(B, h_q, 576), dtype=np.uint16) & 0xBFFF
    kv_pool = rng.integers(0, 1 << 16, size=(B, h_kv, 576), dtype=np.uint16) & 0xBFFF
    times = []
    per_msg = -(-B // max(1, min(a.messages_per_layer, B)))

    def split(submit, steps):
        # One layer's steps as messages of per_msg steps, written back to back.
        ids = []
        for i in range(0, len(steps), per_msg):
            ids += submit(steps[i:i + per_msg])
        return ids

    def layer_steps(ring, q_at, kv_at, out_at, lse_at):
        # A layer's ring entries over a tensor-major layout (all q, then kv, out, lse);
        # each layer then sets only request_id and layer.
        steps = ring.steps(B)
        ring.set_sequence_ids(steps, seqs)
        steps["s_q"] = 1
        steps["q_offset"] = q_at + np.arange(B) * qb
        steps["kv_offset"] = kv_at + np.arange(B) * kvb
        steps["out_offset"] = out_at + np.arange(B) * ob
        steps["lse_offset"] = lse_at + np.arange(B) * lb
        return steps

    with c.open_session() as session:
        if a.cuda:
            import torch
            # Tensor-major layout (all q, then all kv, out, lse), so a layer's inputs are
            # two device copies, as a model's batched q would be.
            q_at, kv_at, out_at, lse_at = 0, B * qb, B * (qb + kvb), B * (qb + kvb + ob)
            dev_region = torch.zeros(B * (qb + kvb + ob + lb), dtype=torch.uint8, device="cuda")
            entries = 1
            while entries < B:
                entries *= 2
            # --ring: the ring is a host file of its own; offsets stay the tensor's.
            session.open_cuda_region(dev_region, ring_entries=entries if a.ring else 0)
            q_dev = torch.from_numpy(q_pool.view(np.int16)).cuda().reshape(B, -1)
            kv_dev = torch.from_numpy(kv_pool.view(np.int16)).cuda().reshape(B, -1)
            q_dst = dev_region[q_at:kv_at].view(torch.int16).view(B, -1)
            kv_dst = dev_region[kv_at:out_at].view(torch.int16).view(B, -1)
            cuda_steps = lambda layer: [dict(sequence_id=seqs[b], layer=layer, s_q=1, q_offset=q_at + b * qb,
                                             kv_offset=kv_at + b * kvb, out_offset=out_at + b * ob,
                                             lse_offset=lse_at + b * lb) for b in range(B)]
            if a.ring:
                ring = session.ring
                ring_steps = layer_steps(ring, q_at, kv_at, out_at, lse_at)
                next_id = 1
        elif a.ring:
            from latentd_client import ring_bytes
            entries = 1
            while entries < B:
                entries *= 2
            base = ring_bytes(entries)
            q_at, kv_at, out_at, lse_at = base, base + B * qb, base + B * (qb + kvb), base + B * (qb + kvb + ob)
            region = session.open_region(lse_at + B * lb, ring_entries=entries)
            ring = session.ring
            q_all = region.array(q_at, (B, h_q, 576), "<u2")
            kv_all = region.array(kv_at, (B, h_kv, 576), "<u2")
            out_views = [region.array(out_at, (h_q, 512), "<u2")]
            ring_steps = layer_steps(ring, q_at, kv_at, out_at, lse_at)
            next_id = 1
        elif a.shm:
            region = session.open_region(slot * B)
            q_views = [region.array(b * slot, (h_q, 576), "<u2") for b in range(B)]
            kv_views = [region.array(b * slot + qb, (h_kv, 576), "<u2") for b in range(B)]
            out_views = [region.array(b * slot + qb + kvb, (h_q, 512), "<u2") for b in range(B)]
        results = session.results()
        for tok in range(a.warmup_tokens + a.tokens):
            for layer in range(L):
                t0 = time.perf_counter()
                if a.cuda:
                    q_dst.copy_(q_dev)
                    kv_dst.copy_(kv_dev)
                    torch.cuda.synchronize()
                    if not a.ring:
                        ids = split(session.submit_region, cuda_steps(layer))
                if a.ring:
                    if not a.cuda:
                        q_all[:] = q_pool
                        kv_all[:] = kv_pool
                    ring_steps["request_id"] = np.arange(next_id, next_id + B)
                    ring_steps["layer"] = layer
                    next_id += B
                    for i in range(0, B, per_msg):
                        ring.submit_array(ring_steps[i:i + per_msg])
                    done = ring.wait(B, timeout=60)
                    if np.any(done["code"] != 0):
                        bad = done[done["code"] != 0][0]
                        raise SystemExit(f"step failed: {bad['code']} {bad['message'][:bad['message_bytes']]}")
                elif a.shm and not a.cuda:
                    for b in range(B):
                        q_views[b][:] = q_pool[b]
                        kv_views[b][:] = kv_pool[b]
                    ids = split(session.submit_region, [dict(sequence_id=seqs[b], layer=layer, s_q=1, q_offset=b * slot,
                                                      kv_offset=b * slot + qb, out_offset=b * slot + qb + kvb,
                                                      lse_offset=b * slot + qb + kvb + ob) for b in range(B)])
                elif not a.cuda:
                    ids = split(session.submit_many, [dict(sequence_id=seqs[b], layer=layer, q=q_pool[b].tobytes(),
                                                    kv=kv_pool[b].tobytes()) for b in range(B)])
                got = B if a.ring else 0
                outs = {}
                for r in (() if a.ring else results):
                    if r.code != 0:
                        raise SystemExit(f"step failed: {r.code} {r.message}")
                    outs[r.request_id] = r
                    got += 1
                    if got == B:
                        break
                if tok == a.warmup_tokens + a.tokens - 1 and layer == 0:
                    if a.cuda:
                        out0 = dev_region[out_at:out_at + ob].cpu().numpy().view("<u2").reshape(h_q, 512)
                    else:
                        out0 = out_views[0].copy() if (a.shm or a.ring) else outs[ids[0]].out
                    check(c, info, prefix, kv_pool[0], tok + 1, q_pool[0], out0)
                if tok >= a.warmup_tokens:
                    times.append((time.perf_counter() - t0) * 1e3)
        session.close_send()
        for _ in results:
            pass
    t = np.array(times)
    print(f"python_runner: h_q {h_q} B {B} L {L} {('CUDA region with doorbell ring' if a.ring else 'CUDA region') if a.cuda else 'doorbell ring' if a.ring else 'shared region' if a.shm else 'gRPC bytes'}, "
          f"{-(-B // per_msg)} message(s) per layer: per-layer p50 "
          f"{np.percentile(t, 50):.3f} ms p90 {np.percentile(t, 90):.3f} ms p99 {np.percentile(t, 99):.3f} ms "
          f"({len(t)} layers)")
    for s in seqs:
        c.release_sequence(s)


if __name__ == "__main__":
    main()
