#!/usr/bin/env python3
"""Seed corpus for tests/fuzz/fuzz_safetensors.c, written with the reference implementation
(the PyPI package safetensors, Rust core), so the fuzzer starts from well-formed files and
test_safetensors.c can check the parser against a writer that is not ours.

    python3 -m pip install safetensors==0.8.0 numpy
    python3 tests/fuzz/make_st_seeds.py      # writes tests/fuzz/st-corpus/*.safetensors

types.safetensors holds (test_safetensors.c checks these values):
    f32   F32  [2, 3]  i / 2 - 1 for i = 0..5
    f16   F16  [3]     1, -2.5, 65504
    bf16  BF16 [2, 2]  bit patterns 0x3F80 (1), 0xC000 (-2), 0x0000, 0x7F80 (inf)
    i64   I64  [2]     -1, 2^40
    empty U8   [0]
    s     F64  []      0.25
and __metadata__ {"format": "pt", "source": "make_st_seeds.py"}.
"""
import os
import struct

import numpy as np
from safetensors import TensorSpec, serialize_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "st-corpus")


_alive = []  # the buffers TensorSpec points at must outlive serialize_file


def t(dtype, shape, data):
    buf = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, np.uint8)
    _alive.append(buf)
    return TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data, data_len=len(data))


def main():
    os.makedirs(OUT, exist_ok=True)
    f32 = (np.arange(6, dtype=np.float32) / 2 - 1).reshape(2, 3)
    tensors = {
        "f32": t("float32", [2, 3], f32.tobytes()),
        "f16": t("float16", [3], np.array([1, -2.5, 65504], dtype="<f2").tobytes()),
        "bf16": t("bfloat16", [2, 2], struct.pack("<4H", 0x3F80, 0xC000, 0x0000, 0x7F80)),
        "i64": t("int64", [2], np.array([-1, 1 << 40], dtype="<i8").tobytes()),
        "empty": t("uint8", [0], b""),
        "s": t("float64", [], np.array(0.25, dtype="<f8").tobytes()),
    }
    serialize_file(tensors, os.path.join(OUT, "types.safetensors"),
                   metadata={"format": "pt", "source": "make_st_seeds.py"})

    rng = np.random.default_rng(3)
    E, V, F = 8, 5, 12
    model = {}
    def add(name, shape, dt="bfloat16"):
        x = rng.standard_normal(shape).astype(np.float32)
        raw = (x.view(np.uint32) >> 16).astype("<u2").tobytes() if dt == "bfloat16" \
            else x.astype("<f2" if dt == "float16" else "<f4").tobytes()
        model[name] = t(dt, list(shape), raw)
    add("model.embed_tokens.weight", (V, E))
    add("model.norm.weight", (E,), "float32")
    add("model.layers.0.input_layernorm.weight", (E,), "float32")
    add("model.layers.0.self_attn.q_proj.weight", (E, E), "float16")
    add("model.layers.0.mlp.down_proj.weight", (E, F))
    serialize_file(model, os.path.join(OUT, "tiny_model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
