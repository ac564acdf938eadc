# A whole tiny DeepSeek-style model decoded greedily, token by token, with latentd serving its
# attention layers (the layer API) and numpy doing the rest (embedding, norms, SwiGLU FFN,
# lm_head); its tokens and logits are checked against the same model run in float64.
#   bazel build //server:latentd //clients/python:latentd_client_pkg
#   PYTHONPATH=bazel-bin/clients/python python3 clients/python/examples/tiny_model.py --latentd bazel-bin/server/latentd
# or against a daemon of your own on the checkpoint it writes:
#   python3 clients/python/examples/tiny_model.py --write_checkpoint /tmp/tiny
#   latentd --model_dir=/tmp/tiny --backend=cpu &
#   python3 clients/python/examples/tiny_model.py --model_dir /tmp/tiny --target 127.0.0.1:50051
import argparse
import sys
import tempfile

import numpy as np

import latentd_client
from mla_reference import Checkpoint, Daemon, ReferenceAttention, Spec, load_checkpoint, rms_norm, yarn


def tiny_spec():
    return Spec(dtype="bf16", hidden_size=192, num_heads=4, q_lora_rank=96, rope_scaling=yarn(), vocab_size=64,
                intermediate_size=384)


def silu(x):
    return x / (1 + np.exp(-x))


class Model:
    """The decoder around the attention: DeepseekV3DecoderLayer with a dense SwiGLU MLP.
    attention(layer, x, tokens) returns the attention layer's output for the last
    `tokens` rows of x; it is the daemon or the reference."""

    def __init__(self, spec, layers, other):
        self.spec, self.layers, self.other = spec, layers, other

    def norm(self, h, w):
        return rms_norm(h, w, self.spec.rms_norm_eps)

    def ffn(self, layer, h):
        w = self.layers[layer]
        x = self.norm(h, w["post_attention_layernorm"])
        return (silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T

    def logits(self, h):
        return self.norm(h, self.other["norm"]) @ self.other["lm_head"].T


class DaemonRunner:
    """One sequence on the daemon: every layer's KV cache lives there."""

    def __init__(self, model, client):
        self.model, self.client = model, client
        self.seq = client.create_sequence()
        self.max_s_q = client.info.max_s_q

    def attention_steps(self, layer, x):
        """Causal layer steps over x [n, hidden] (the tokens after the layer's cache), in
        chunks of max_s_q, sent as one DecodeRequest (they run in order): the outputs."""
        steps = [dict(sequence_id=self.seq, layer=layer, hidden=x[i:i + self.max_s_q].astype(np.float32),
                      causal=True) for i in range(0, len(x), self.max_s_q)]
        with self.client.open_session(self.seq) as session:
            ids = session.submit_many(steps)
            session.close_send()
            got = {r.request_id: r for r in session.results()}
        for i in ids:
            if not got[i].ok:
                raise RuntimeError(f"layer {layer} step failed: {got[i].code} {got[i].message}")
        return np.concatenate([got[i].out for i in ids]).astype(np.float64)

    def prefill(self, tokens):
        """The prompt layer by layer: layer l's inputs are layer l-1's outputs, so every
        layer but the last attends over the prompt with causal steps; the last needs its
        output for the final token only, so the others' latent rows are just uploaded."""
        m, L = self.model, self.model.spec.num_layers
        h = m.other["embed"][tokens]
        for layer in range(L):
            x = m.norm(h, m.layers[layer]["input_layernorm"])
            if layer < L - 1:
                h = h + self.attention_steps(layer, x)
                h = h + m.ffn(layer, h)
            else:
                self.client.append_hidden(self.seq, {layer: x[:-1].astype(np.float32)})
                h = h[-1:] + self.attention_steps(layer, x[-1:])
                h = h + m.ffn(layer, h)
        return m.logits(h[-1])

    def step(self, token):
        m = self.model
        h = m.other["embed"][[token]]
        for layer in range(m.spec.num_layers):
            h = h + self.attention_steps(layer, m.norm(h, m.layers[layer]["input_layernorm"]))
            h = h + m.ffn(layer, h)
        return m.logits(h[0])

    def close(self):
        self.client.release_sequence(self.seq)


def reference_logits(model, tokens):
    """The model in float64 with the reference attention over the whole sequence at once
    (causal): logits [len(tokens), vocab]."""
    refs = [ReferenceAttention(model.spec, w) for w in model.layers]
    h = model.other["embed"][tokens]
    positions = np.arange(len(tokens))
    for layer, ref in enumerate(refs):
        out, _ = ref(model.norm(h, model.layers[layer]["input_layernorm"]), positions, len(tokens), causal=True)
        h = h + out
        h = h + model.ffn(layer, h)
    return model.logits(h)


def run(model_dir, target, prompt_len, new_tokens, seed):
    spec, layers, other = load_checkpoint(model_dir)
    model = Model(spec, layers, other)
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, spec.vocab_size, prompt_len)]
    with latentd_client.LatentdClient(target) as client:
        info = client.info
        if not info.layer_api or info.hidden_size != spec.hidden_size:
            print(f"the daemon at {target} does not serve this model's layer API "
                  f"(layer_api {info.layer_api}, hidden_size {info.hidden_size})")
            return 1
        runner = DaemonRunner(model, client)
        logits = [runner.prefill(prompt)]
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(logits[-1])))
            if len(tokens) < prompt_len + new_tokens:
                logits.append(runner.step(tokens[-1]))
        runner.close()
    generated = tokens[prompt_len:]
    print(f"prompt    {prompt}")
    print(f"generated {generated}")

    # The reference along the daemon's tokens (teacher forcing): where its greedy choice
    # agrees at every step, its own greedy run gives the same tokens.
    ref = reference_logits(model, tokens)[prompt_len - 1:prompt_len - 1 + new_tokens]
    ours = np.array(logits)
    scale = float(np.sqrt(np.mean(ref * ref)))
    err = float(np.abs(ours - ref).max())
    print(f"logits: max |daemon - float64 reference| {err:.4f} ({err / scale:.4f} of their rms {scale:.2f})")
    ok = err / scale <= 0.06  # the layer's bf16 limit (engine/layer/layer_math_test.cc)
    ref_tokens = [int(t) for t in np.argmax(ref, axis=1)]
    for k, (a, b) in enumerate(zip(generated, ref_tokens)):
        if a != b:
            gap = ref[k, b] - ref[k, a]
            # A flip is only acceptable between two logits closer than the logits' error.
            near_tie = gap <= 2 * err
            print(f"token {k}: daemon {a}, reference {b}: reference logits {gap:.4f} apart "
                  f"({'a near tie' if near_tie else 'NOT a near tie'})")
            ok &= near_tie
    if ref_tokens == generated:
        print("tokens equal to the float64 reference's")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description="a tiny DeepSeek-style model over the latentd layer API")
    ap.add_argument("--latentd", help="a latentd binary: write a checkpoint, start a CPU daemon on it, run")
    ap.add_argument("--write_checkpoint", metavar="DIR", help="only write the tiny checkpoint to DIR")
    ap.add_argument("--model_dir", help="the checkpoint the daemon at --target serves")
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--prompt_len", type=int, default=12)
    ap.add_argument("--new_tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.write_checkpoint:
        Checkpoint(tiny_spec(), args.seed).write(args.write_checkpoint)
        print(f"wrote {args.write_checkpoint}")
        return 0
    if args.latentd:
        with tempfile.TemporaryDirectory(prefix="tiny_model.") as model_dir:
            Checkpoint(tiny_spec(), args.seed).write(model_dir)
            with Daemon(args.latentd, f"--model_dir={model_dir}", "--kv_pages=16", log_dir=model_dir) as daemon:
                return run(model_dir, daemon.target, args.prompt_len, args.new_tokens, args.seed)
    if not args.model_dir:
        ap.error("give --latentd, --write_checkpoint, or --model_dir with --target")
    return run(args.model_dir, args.target, args.prompt_len, args.new_tokens, args.seed)


if __name__ == "__main__":
    sys.exit(main())
