#!/usr/bin/env python3
"""Export/import throughput between two daemons on one GPU host (docs/benchmarks.md,
"Export and import"): a sequence of LEN tokens on every layer of a DeepSeek-V3-shaped
pool is exported from daemon A and imported into daemon B, chunk by chunk on one stream
pair (the client's MoveSequence path), timed in whole and per side.
  transfer_bench.py RUN_DIR [--layers 61] [--tokens 4096] [--kv_dtype auto|fp8_e4m3]"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from latentd_client import LatentdClient


def start(run, *flags):
    port_file = tempfile.mktemp()
    log = open(tempfile.mktemp(suffix=".log"), "w")
    p = subprocess.Popen([os.path.join(run, "run"), "latentd", "--listen=127.0.0.1:0", f"--port_file={port_file}",
                          *flags], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
            return p, "127.0.0.1:" + open(port_file).read().strip()
        time.sleep(0.1)
    raise RuntimeError("daemon did not start")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv_dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="cuda")
    a = ap.parse_args()
    flags = [f"--backend={a.backend}", f"--num_layers={a.layers}", "--num_heads_q=16", f"--kv_dtype={a.kv_dtype}",
             f"--kv_bytes={8 << 30}", "--drain_handoff_s=0"]
    pa, ta = start(a.run, *flags)
    pb, tb = start(a.run, *flags)
    try:
        ca, cb = LatentdClient(ta), LatentdClient(tb)
        rng = np.random.default_rng(1)
        rows = rng.normal(0, 1, (a.tokens, 1, 576)).astype(np.float32)
        raw = ca.wire(rows)
        for r in range(a.repeats):
            sid = f"s{r}"
            ca.create_sequence(sid)
            t0 = time.perf_counter()
            ca.append_kv(sid, {layer: raw for layer in range(a.layers)})
            t_up = time.perf_counter() - t0
            t0 = time.perf_counter()
            chunks = list(ca.export_sequence(sid))
            t_exp = time.perf_counter() - t0
            nbytes = sum(len(c.rows) for c in chunks if c.rows)
            t0 = time.perf_counter()
            cb.import_sequence(iter(chunks))
            t_imp = time.perf_counter() - t0
            print(f"{a.kv_dtype} {a.layers} layers x {a.tokens} tokens: {nbytes / 1e6:.1f} MB stored rows; "
                  f"upload (AppendKv) {t_up:.3f} s; export {t_exp:.3f} s = {nbytes / t_exp / 1e9:.2f} GB/s; "
                  f"import {t_imp:.3f} s = {nbytes / t_imp / 1e9:.2f} GB/s", flush=True)
            ca.release_sequence(sid)
            cb.release_sequence(sid)
    finally:
        pa.terminate()
        pb.terminate()
        pa.wait()
        pb.wait()


if __name__ == "__main__":
    sys.exit(main())
