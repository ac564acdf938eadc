#!/usr/bin/env python3
"""Writes the seed corpus under fuzz/corpus/<target>/: a handful of small inputs.

Every byte of an input is a choice (fuzz/input.h: one byte per choice, the value modulo
the number of options), so the hand-written seeds below start the runs their names say
(the comments follow the choices the target reads first), plus seeded pseudo-random
ones for breadth; libFuzzer mutates from there. Rerun after changing how
a target decodes its input; the files are committed.
"""
import os
import random

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


def randoms(target, sizes, seed):
    rng = random.Random(seed)
    for n in sizes:
        write(target, "random-%d" % n, [rng.randrange(256) for _ in range(n)])


# kv_manager: layers-1, heads-1, pages-2, flags, then operations.
# Operation choice r (0..99): <8 create, <25 append, <45 append every layer, <70
# reserve, <76 truncate, <88 fork, else release.
write("kv_manager", "create-append-fork-release",
      [2, 0, 10, 0] +          # 3 layers, 1 head, 12 pages, no reads or touches
      [0, 1] +                 # create "s0"
      [30, 0, 20, 70] +        # append every layer: seq 0, 70 rows (prefill-sized)
      [80, 0, 1] +             # fork seq 0 as "f1"
      [50, 1, 0, 0, 2] +       # reserve on the fork, layer 0, 2 rows
      [95, 0] + [95, 0])       # release both
write("kv_manager", "reads-and-touches",
      [1, 0, 4, 3] +           # 2 layers, 1 head, 6 pages, reads and touches
      [0, 0, 0, 1] +           # (no read) (no touch) create "s0"
      [0, 0, 0] +              # open a read
      [50, 50, 30, 0, 95, 70] +  # append every layer, 70+ rows
      [50, 50, 95, 0] +        # release under the open read
      [0, 1] + [50, 50, 0, 1] +  # close the read, create
      [50, 0, 0, 5, 7])        # touch and scan
write("kv_manager", "out-of-pages",
      [0, 0, 0, 0] + [0, 1] + [20, 0, 0, 95, 250] * 4)
randoms("kv_manager", [64, 256, 1024], 1)

# decode: forks, messages, then per message raw-or-request, steps, step fields.
write("decode", "one-valid-step",
      [0, 0] +                 # 1 fork, 1 message
      [1, 1] +                 # a request with one step
      [7, 0, 0, 0, 0, 0, 6] +  # id 7, s_q 1, empty seed, fork 0, layer 0, not causal, intact
      [1])                     # message not flipped
write("decode", "steps-on-both-layers",
      [1, 1] + [1, 2] + [1, 1, 4, 1, 2, 3, 4, 0, 0, 1, 9] + [2, 2, 0, 1, 1, 0, 10] + [1] +
      [1, 1] + [3, 0, 0, 0, 1, 1, 11] + [1])
write("decode", "raw-garbage", [0, 2, 0, 20] + list(b"\x0a\x12\x08\x01\x12\x02in\x18\x05") +
      [0, 10] + [0xff] * 10)
write("decode", "bad-fields", [0, 3] + [1, 3] +
      [1, 0, 0, 0, 0, 0, 0, 0] + [2, 0, 0, 0, 0, 0, 1, 7] + [3, 0, 0, 0, 0, 0, 2, 200] + [1] +
      [1, 1, 4, 1, 0, 0, 0, 4, 2] + [1] + [1, 1, 5, 0, 0, 0, 0, 0, 5, 1] + [1])
randoms("decode", [64, 256, 1024], 2)

# append_kv: forks, which id, messages, then per message raw-or-request and fields.
write("append_kv", "two-layers",
      [0, 0, 1] + [1, 0, 3, 0, 9] + [1, 1, 1, 2, 0, 9])
write("append_kv", "id-mismatch-and-bad-layer",
      [1, 0, 2] + [1, 0, 1, 0, 9] + [1, 1, 0, 1, 0, 3] + [1, 1, 1, 1, 0, 1, 5])
write("append_kv", "raw", [0, 0, 1, 0, 30] + list(b"\x0a\x05in1-0\x10\x01\x1a\x00") + [0] * 16)
randoms("append_kv", [64, 256, 1024], 3)

# safetensors: the input is a whole file (8-byte little-endian header length, JSON
# header, data), parsed by engine/model's safetensors reader.
def safetensors(header, data):
    import struct
    h = header.encode()
    return list(struct.pack("<Q", len(h)) + h + data)


write("safetensors", "two-tensors", safetensors(
    '{"__metadata__":{"format":"pt"},'
    '"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},'
    '"s":{"dtype":"F32","shape":[1,1],"data_offsets":[12,16]}}', bytes(range(1, 17))))
write("safetensors", "fp8-and-scale", safetensors(
    '{"q.weight":{"dtype":"F8_E4M3","shape":[4,4],"data_offsets":[0,16]},'
    '"q.weight_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[16,20]},'
    '"e":{"dtype":"F4","shape":[0],"data_offsets":[20,20]}}', bytes(range(3, 23))))
write("safetensors", "overlap", safetensors(
    '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
    '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', bytes(6)))
write("safetensors", "truncated", safetensors(
    '{"a":{"dtype":"I64","shape":[2,2],"data_offsets":[0,32]}}', bytes(20)))
