# Numpy pieces shared by the layer-API test and the tiny-model example: a safetensors
# writer and reader, tiny random DeepSeek-style checkpoints (bf16, fp16, FP8 e4m3 blocks),
# a float64 reference of Hugging Face's DeepseekV3Attention, and a latentd launcher.
import json
import math
import os
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

KV_LORA_RANK = 512  # the decode kernel's latent row
ROPE_DIM = 64
# Errors relative to the output's RMS that engine/layer/layer_math_test.cc allows: (max, rms).
LIMITS = {"bf16": (0.06, 0.015), "fp16": (0.008, 0.002)}


# ---- Model dtypes ----

def round_to(x, dtype):
    """x rounded (to nearest even) to bf16 or fp16, as float32 values."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "fp16":
        return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    return (top << 16).view(np.float32).reshape(a.shape)


def to_bits(x, dtype):
    """Values already representable in dtype, as their 16-bit patterns."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "fp16":
        return a.astype("<f2").view("<u2")
    return (a.view(np.uint32) >> 16).astype("<u2")


def from_bits(bits, dtype):
    b = np.asarray(bits, dtype="<u2")
    if dtype == "fp16":
        return b.view("<f2").astype(np.float32)
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---- FP8 e4m3 ("fn": no infinities, S.1111.111 is NaN) ----

def _e4m3_table():
    codes = np.arange(256)
    exp, man = (codes >> 3) & 15, codes & 7
    mag = np.where(exp == 0, man * 2.0 ** -9, (8 + man) * 2.0 ** (exp - 10.0))
    v = np.where(codes & 0x80, -mag, mag).astype(np.float32)
    v[(codes & 0x7F) == 0x7F] = np.nan
    return v


E4M3 = _e4m3_table()
_E4M3_MAX = 448.0


def e4m3_quantize(w, block):
    """w [rows, cols] -> (codes uint8, scale_inv float32 [ceil(rows/b0), ceil(cols/b1)]) as
    DeepSeek's checkpoints hold them: w ~ e4m3(code) * scale_inv of the code's block. No
    code is zero, so no dequantized weight is."""
    rows, cols = w.shape
    br, bc = block
    sr, sc = -(-rows // br), -(-cols // bc)
    scale = np.zeros((sr, sc), np.float32)
    codes = np.zeros((rows, cols), np.uint8)
    finite = np.where(np.isnan(E4M3), np.inf, E4M3).astype(np.float64)
    positive = np.arange(1, 0x7F)  # every finite positive code, ascending
    for i in range(sr):
        for j in range(sc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = np.float32(np.abs(blk).max() / _E4M3_MAX)
            scale[i, j] = s
            y = np.abs(blk) / np.float64(s)
            # The nearest positive code (ties either way: this is the writer, not the reference).
            k = np.clip(np.searchsorted(finite[positive], y), 1, len(positive) - 1)
            lo, hi = positive[k - 1], positive[k]
            c = np.where(np.abs(finite[lo] - y) <= np.abs(finite[hi] - y), lo, hi)
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = np.where(blk < 0, c | 0x80, c)
    return codes, scale


def e4m3_dequantize(codes, scale_inv, block, dtype):
    """What engine/model/weights.cc loads: float32(e4m3) * float32 scale, one rounding to dtype."""
    br, bc = block
    s = np.repeat(np.repeat(scale_inv, br, axis=0), bc, axis=1)[:codes.shape[0], :codes.shape[1]]
    return round_to(E4M3[codes] * s.astype(np.float32), dtype)


# ---- safetensors ----

_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def write_safetensors(path, tensors):
    """tensors: {name: (dtype name, shape, bytes)}, written in that order: an 8-byte
    little-endian header length, the JSON header (padded with spaces to 8 bytes), data."""
    header, data, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        assert len(raw) == int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype], name
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in data:
            f.write(raw)


def read_safetensors(path):
    """{name: array}: BF16/F16/F32 as float32, F8_E4M3 as its uint8 codes."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base, out = 8 + n, {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        raw = blob[base + t["data_offsets"][0]:base + t["data_offsets"][1]]
        if t["dtype"] in ("BF16", "F16"):
            a = from_bits(np.frombuffer(raw, "<u2"), "bf16" if t["dtype"] == "BF16" else "fp16")
        elif t["dtype"] == "F32":
            a = np.frombuffer(raw, "<f4").astype(np.float32)
        else:
            a = np.frombuffer(raw, np.uint8)
        out[name] = a.reshape(t["shape"])
    return out


# ---- Tiny checkpoints ----

def yarn(factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8):
    """A config.json rope_scaling of type yarn. mscale_all_dim differs from mscale by
    default so that both the softmax scale and RoPE's attention factor are not 1."""
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


@dataclass
class Spec:
    """The config.json of a tiny model; kv_lora_rank 512 and qk_rope_head_dim 64 are fixed
    (the daemon's kernel row), the rest is free."""
    dtype: str = "bf16"  # the model dtype: bf16 or fp16
    fp8: bool = False    # Linear weights stored as e4m3 with 128x128 block scales
    hidden_size: int = 192
    num_heads: int = 4
    q_lora_rank: Optional[int] = 96
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    rope_scaling: Optional[dict] = field(default_factory=yarn)
    rope_interleave: Optional[bool] = None  # None: absent (true, DeepSeek's layout)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    num_layers: int = 2
    max_position_embeddings: int = 8192
    # Beyond the attention (the tiny-model example's own weights).
    vocab_size: int = 64
    intermediate_size: int = 0  # 0: no FFN weights written

    @property
    def qk(self):
        return self.qk_nope_head_dim + ROPE_DIM

    @property
    def interleave(self):
        return self.rope_interleave is not False

    def config(self):
        c = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": KV_LORA_RANK, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": ROPE_DIM, "v_head_dim": self.v_head_dim,
            "num_hidden_layers": self.num_layers, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "torch_dtype": "bfloat16" if self.dtype == "bf16" else "float16",
        }
        if self.intermediate_size:
            c["intermediate_size"] = self.intermediate_size
        if self.rope_interleave is not None:
            c["rope_interleave"] = self.rope_interleave
        if self.fp8:
            c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]}
        return c


class Checkpoint:
    """Random weights of a Spec: .layers[l][short name] are the float64 values the daemon
    serves (model-dtype values; FP8 dequantized as the loader does), .other the rest of
    the model (embedding, norms, FFN, lm_head) when spec.vocab_size and
    intermediate_size ask for them; write(dir) puts config.json and model.safetensors there."""

    BLOCK = (128, 128)

    def __init__(self, spec, seed):
        self.spec = spec
        rng = np.random.default_rng(seed)
        s, dt = spec, spec.dtype
        self.tensors = {}  # what the file holds, in order
        self.layers, self.other = [], {}
        H, h = s.hidden_size, s.num_heads

        def weight(name, shape, mean, sigma, linear=True):
            w = rng.normal(mean, sigma, shape)
            if s.fp8 and linear:
                codes, scale = e4m3_quantize(w, self.BLOCK)
                self.tensors[name] = ("F8_E4M3", shape, codes.tobytes())
                self.tensors[name + "_scale_inv"] = ("F32", scale.shape, scale.astype("<f4").tobytes())
                v = e4m3_dequantize(codes, scale, self.BLOCK, dt)
            else:
                v = round_to(w, dt)
                v[v == 0] = round_to(np.float32(sigma), dt)  # never zero
                self.tensors[name] = ("BF16" if dt == "bf16" else "F16", shape, to_bits(v, dt).tobytes())
            return v.astype(np.float64)

        if s.vocab_size and s.intermediate_size:
            self.other["embed"] = weight("model.embed_tokens.weight", (s.vocab_size, H), 0, 1, linear=False)
        # Scales as layer_math_test's: scores spread over a few units, so the softmax is
        # neither uniform nor one-hot, and outputs are of order one. Queries shrink by
        # YaRN's softmax factor, which would otherwise sharpen the softmax towards one-hot.
        q_sigma = 1.2 * s.qk ** -0.5 / softmax_scale(s)
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}.self_attn."
            w = {}
            if s.q_lora_rank:
                rq = s.q_lora_rank
                w["q_a_proj"] = weight(p + "q_a_proj.weight", (rq, H), 0, 1 / math.sqrt(H))
                w["q_a_layernorm"] = weight(p + "q_a_layernorm.weight", (rq,), 1, 0.1, linear=False)
                w["q_b_proj"] = weight(p + "q_b_proj.weight", (h * s.qk, rq), 0, q_sigma / math.sqrt(rq))
            else:
                w["q_proj"] = weight(p + "q_proj.weight", (h * s.qk, H), 0, q_sigma / math.sqrt(H))
            w["kv_a_proj_with_mqa"] = weight(p + "kv_a_proj_with_mqa.weight", (KV_LORA_RANK + ROPE_DIM, H), 0,
                                             1 / math.sqrt(H))
            w["kv_a_layernorm"] = weight(p + "kv_a_layernorm.weight", (KV_LORA_RANK,), 1, 0.1, linear=False)
            w["kv_b_proj"] = weight(p + "kv_b_proj.weight", (h * (s.qk_nope_head_dim + s.v_head_dim), KV_LORA_RANK),
                                    0, 1.2 / math.sqrt(KV_LORA_RANK))
            w["o_proj"] = weight(p + "o_proj.weight", (H, h * s.v_head_dim), 0, 1 / math.sqrt(h * s.v_head_dim))
            if s.vocab_size and s.intermediate_size:
                m, I = f"model.layers.{layer}.", s.intermediate_size
                w["input_layernorm"] = weight(m + "input_layernorm.weight", (H,), 1, 0.1, linear=False)
                w["post_attention_layernorm"] = weight(m + "post_attention_layernorm.weight", (H,), 1, 0.1,
                                                       linear=False)
                w["gate_proj"] = weight(m + "mlp.gate_proj.weight", (I, H), 0, 1 / math.sqrt(H), linear=False)
                w["up_proj"] = weight(m + "mlp.up_proj.weight", (I, H), 0, 1 / math.sqrt(H), linear=False)
                w["down_proj"] = weight(m + "mlp.down_proj.weight", (H, I), 0, 1 / math.sqrt(I), linear=False)
            self.layers.append(w)
        if s.vocab_size and s.intermediate_size:
            self.other["norm"] = weight("model.norm.weight", (H,), 1, 0.1, linear=False)
            self.other["lm_head"] = weight("lm_head.weight", (s.vocab_size, H), 0, 4 / math.sqrt(H), linear=False)

    def write(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.spec.config(), f, indent=2)
        write_safetensors(os.path.join(directory, "model.safetensors"), self.tensors)
        return directory


def load_checkpoint(directory):
    """A folder of this layout back (as a serving stack would read its model): (Spec,
    layers, other) with layers[l] keyed as Checkpoint.layers (FP8 weights dequantized as
    the daemon's loader does) and other holding embed, norm and lm_head when present."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    scaling = cfg.get("rope_scaling")  # Rotary and softmax_scale default its optional keys as HF does
    spec = Spec(dtype="bf16" if cfg["torch_dtype"] == "bfloat16" else "fp16",
                fp8=cfg.get("quantization_config", {}).get("quant_method") == "fp8",
                hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"], q_lora_rank=cfg["q_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"], rope_scaling=scaling,
                rope_interleave=cfg.get("rope_interleave"), rope_theta=cfg["rope_theta"],
                rms_norm_eps=cfg["rms_norm_eps"], num_layers=cfg["num_hidden_layers"],
                max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                vocab_size=cfg.get("vocab_size", 0), intermediate_size=cfg.get("intermediate_size", 0))
    t = read_safetensors(os.path.join(directory, "model.safetensors"))

    def value(name):
        if name + "_scale_inv" in t:
            return e4m3_dequantize(t[name], t[name + "_scale_inv"], Checkpoint.BLOCK, spec.dtype).astype(np.float64)
        return t[name].astype(np.float64)

    layers = []
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        w = {}
        for name in t:
            if name.startswith(prefix) and name.endswith(".weight"):
                w[name[len(prefix):-len(".weight")].split(".")[-1]] = value(name)
        layers.append(w)
    other = {k: value(n) for k, n in (("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"),
                                      ("lm_head", "lm_head.weight")) if n in t}
    return spec, layers, other


# ---- The reference: Hugging Face's DeepseekV3Attention in float64, not absorbed ----

def yarn_get_mscale(scale=1.0, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(spec):
    """DeepseekV3Attention.softmax_scale: q_head_dim^-0.5, times yarn_get_mscale(factor,
    mscale_all_dim)^2 when rope_scaling sets a nonzero mscale_all_dim."""
    scale = spec.qk ** -0.5
    r = spec.rope_scaling
    if r and r.get("mscale_all_dim", 0):
        m = yarn_get_mscale(r["factor"], r["mscale_all_dim"])
        scale *= m * m
    return scale


class Rotary:
    """DeepseekV3RotaryEmbedding / DeepseekV3YarnRotaryEmbedding in float64."""

    def __init__(self, spec):
        d, base, r = ROPE_DIM, spec.rope_theta, spec.rope_scaling
        exponents = np.arange(0, d, 2, dtype=np.float64) / d
        extra = 1.0 / base ** exponents
        self.mscale = 1.0
        if not r:
            self.inv_freq = extra
        else:
            factor, original = r["factor"], r["original_max_position_embeddings"]
            inter = 1.0 / (factor * base ** exponents)

            def correction_dim(rotations):  # yarn_find_correction_dim
                return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(r.get("beta_fast", 32))), 0)  # yarn_find_correction_range
            high = min(math.ceil(correction_dim(r.get("beta_slow", 1))), d - 1)
            if low == high:
                high += 0.001  # yarn_linear_ramp_mask
            ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
            mask = 1.0 - ramp  # inv_freq_mask: the extrapolated share
            self.inv_freq = inter * (1 - mask) + extra * mask
            self.mscale = (yarn_get_mscale(factor, r.get("mscale", 1)) /
                           yarn_get_mscale(factor, r.get("mscale_all_dim", 0)))
        self.interleave = spec.interleave

    def apply(self, x, positions):
        """x [n, ..., 64] rotated at positions [n], as apply_rotary_pos_emb leaves it (the
        interleaved layout de-interleaved first by view(d/2, 2).transpose)."""
        x = np.asarray(x, np.float64)
        if self.interleave:
            x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        freqs = np.outer(np.asarray(positions, np.float64), self.inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        shape = (len(positions),) + (1,) * (x.ndim - 2) + (ROPE_DIM,)
        cos = (np.cos(emb) * self.mscale).reshape(shape)
        sin = (np.sin(emb) * self.mscale).reshape(shape)
        half = ROPE_DIM // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half
        return x * cos + rotated * sin


def rms_norm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


class ReferenceAttention:
    """One layer of DeepseekV3Attention over weights w (Checkpoint.layers[l])."""

    def __init__(self, spec, w):
        self.spec, self.w = spec, w
        self.rope = Rotary(spec)
        self.scale = softmax_scale(spec)

    def __call__(self, x, positions, s_q, causal=True, heads=None):
        """x [N, hidden] (float64) of every token of the layer's cache in order, the step's
        s_q tokens last; positions [N] their RoPE positions. Returns (out [s_q, hidden],
        the largest attention probability). heads (a range): only those heads, with their
        o_proj columns, as a tensor-parallel rank computes its partial sum."""
        s, w = self.spec, self.w
        x = np.asarray(x, np.float64)
        N, h, nope, v = len(x), s.num_heads, s.qk_nope_head_dim, s.v_head_dim
        heads = range(h) if heads is None else heads
        positions = np.asarray(positions)
        xq, pq = x[N - s_q:], positions[N - s_q:]
        if s.q_lora_rank:
            q = rms_norm(xq @ w["q_a_proj"].T, w["q_a_layernorm"], s.rms_norm_eps) @ w["q_b_proj"].T
        else:
            q = xq @ w["q_proj"].T
        q = q.reshape(s_q, h, s.qk)
        q_nope, q_pe = q[..., :nope], self.rope.apply(q[..., nope:], pq)
        kv = x @ w["kv_a_proj_with_mqa"].T
        c = rms_norm(kv[:, :KV_LORA_RANK], w["kv_a_layernorm"], s.rms_norm_eps)
        k_pe = self.rope.apply(kv[:, KV_LORA_RANK:], positions)  # [N, 64], shared by the heads
        kvb = (c @ w["kv_b_proj"].T).reshape(N, h, nope + v)
        k_nope, values = kvb[..., :nope], kvb[..., nope:]
        o = np.zeros((s_q, h, v))
        max_p = 0.0
        for j in heads:
            scores = (q_nope[:, j] @ k_nope[:, j].T + q_pe[:, j] @ k_pe.T) * self.scale  # [s_q, N]
            if causal:
                visible = np.arange(N)[None, :] <= (N - s_q + np.arange(s_q))[:, None]
                scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            max_p = max(max_p, float(p.max()))
            o[:, j] = p @ values[:, j]
        cols = np.concatenate([np.arange(j * v, (j + 1) * v) for j in heads])
        out = o.reshape(s_q, h * v)[:, cols] @ w["o_proj"][:, cols].T
        return out, max_p


def errors(out, ref):
    """(max |out - ref|, rms(out - ref)), both relative to rms(ref)."""
    ref = np.asarray(ref, np.float64)
    e = np.asarray(out, np.float64) - ref
    rms = math.sqrt(float(np.mean(ref * ref)))
    return float(np.abs(e).max()) / rms, math.sqrt(float(np.mean(e * e))) / rms


# ---- The daemon ----

class Daemon:
    """latentd (CPU backend) on a free loopback port, told through --port_file."""

    def __init__(self, binary, *flags, log_dir=None, timeout=600):
        self.dir = tempfile.mkdtemp(dir=log_dir)
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "latentd.log")
        self.log = open(self.log_path, "w")
        # The layer math's GEMMs are small; OpenBLAS threads would only contend with the
        # attention threads.
        env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
        self.proc = subprocess.Popen(
            [binary, "--backend=cpu", "--cpu_threads=2", "--listen=127.0.0.1:0", f"--port_file={port_file}", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout  # a guard against a hang only
        port = ""
        while not port:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("latentd did not start:\n" + self.output())
            time.sleep(0.02)
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.read().strip()
        self.target = "127.0.0.1:" + port

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run_to_exit(binary, *flags, timeout=120):
    """Runs latentd expecting it to stop by itself (a start-up failure): (exit code, output)."""
    run = subprocess.run([binary, "--backend=cpu", "--cpu_threads=1", "--listen=127.0.0.1:0", *flags],
                         capture_output=True, text=True, timeout=timeout)
    return run.returncode, run.stdout + run.stderr
