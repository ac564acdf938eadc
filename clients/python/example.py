# latentd "try it": creates a sequence, uploads a random 300-token prefix, runs a few
# decode steps (one token, then two causal tokens), checks them against a numpy
# reference and releases the sequence.
#   bazel build //clients/python:latentd_client_pkg
#   PYTHONPATH=bazel-bin/clients/python python3 clients/python/example.py --target 127.0.0.1:50051
import argparse
import sys

import numpy as np

import latentd_client


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--auth_token", default=None)
    ap.add_argument("--prefix_len", type=int, default=300)
    ap.add_argument("--layer", type=int, default=0)
    args = ap.parse_args()

    with latentd_client.LatentdClient(args.target, auth_token=args.auth_token) as client:
        info = client.info
        print(f"connected: {info.backend}, layers {info.num_layers}, h_q {info.num_heads_q}, "
              f"h_kv {info.num_heads_kv}, {latentd_client.latentd_pb2.DType.Name(info.dtype)}, "
              f"{info.free_pages}/{info.total_pages} pages free")
        rng = np.random.default_rng(0)
        h_q, h_kv = info.num_heads_q, info.num_heads_kv

        def rand(*shape):  # values the wire format represents exactly
            return client.unwire(client.wire(rng.uniform(-1, 1, shape)), shape)

        seq = client.create_sequence()
        prefix = rand(args.prefix_len, h_kv, 576)
        resp = client.append_kv(seq, {args.layer: prefix})
        print(f"sequence {seq}: uploaded {resp.tokens_appended} rows, lengths {list(resp.lengths)}")

        rows = prefix
        worst = 0.0
        for s_q in (1, 2, 1):
            q, kv = rand(s_q, h_q, 576), rand(s_q, h_kv, 576)
            [res] = client.decode([dict(sequence_id=seq, layer=args.layer, q=q, kv=kv, causal=True)])
            if not res.ok:
                print(f"step failed: code {res.code}: {res.message}")
                return 1
            rows = np.concatenate([rows, kv])
            ref_out, ref_lse = latentd_client.reference_decode(q, rows, info.softmax_scale, causal=True)
            err = float(np.abs(res.out - ref_out).max())
            worst = max(worst, err)
            print(f"s_q {s_q}: out {res.out.shape}, lse[0] {res.lse[0]}, max |out - reference| {err:.2e}")
        pages = client.release_sequence(seq)
        print(f"released {seq} ({pages} pages)")
        if worst > 2e-2:
            print("results differ from the reference")
            return 1
        print("ok")
        return 0


if __name__ == "__main__":
    sys.exit(main())
