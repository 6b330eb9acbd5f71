#!/usr/bin/env python3
"""Golden data for tests/lib/formats/test_gguf.c, from an independent implementation: the PyPI
package `gguf` (gguf-py, the GGUF reader and numpy dequantizers of the llama.cpp project).

    python3 -m pip install gguf==0.19.0 numpy
    python3 tests/data/gguf/gen_golden.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

writes tests/data/gguf/quants.json (dequantization of seeded random blocks of every type the C
dequantizer handles) and, when the model file exists, tests/data/gguf/smollm2.json (its metadata,
tensor table facts and dequantized spot rows, all as gguf-py reads them). Floats are stored as
the hex of their little-endian IEEE bytes so that the C test compares bits.
"""
import hashlib
import importlib.metadata
import json
import os
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20261129

# type -> (number of blocks, byte ranges of F16 scale fields inside a block)
QUANT_CASES = {
    T.F32: (256, []),
    T.F16: (256, []),
    T.BF16: (256, []),
    T.Q4_0: (8, [(0, 2)]),
    T.Q4_1: (8, [(0, 2), (2, 4)]),
    T.Q5_0: (8, [(0, 2)]),
    T.Q5_1: (8, [(0, 2), (2, 4)]),
    T.Q8_0: (8, [(0, 2)]),
    T.Q4_K: (3, [(0, 2), (2, 4)]),
    T.Q5_K: (3, [(0, 2), (2, 4)]),
    T.Q6_K: (3, [(208, 210)]),
}


def f32_hex(a):
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def quant_cases(rng):
    out = []
    for qt, (nblk, scale_fields) in QUANT_CASES.items():
        blck, tsize = gguf.constants.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(nblk, tsize), dtype=np.uint8)
        # Random bytes give NaN/inf scales 1 time in 32; keep block scales finite (the
        # elements of F32/F16/BF16 keep their specials: the C side must pass them through).
        for b in range(nblk):
            for lo, hi in scale_fields:
                if b == 1 and lo == scale_fields[0][0]:
                    v = np.float16(-(2.0 ** -20))  # a negative subnormal scale
                else:
                    v = np.float16(rng.normal(0.0, 0.05))
                raw[b, lo:hi] = np.frombuffer(v.tobytes(), dtype=np.uint8)
        deq = gguf.quants.dequantize(raw.reshape(-1), qt).reshape(-1)
        assert deq.dtype == np.float32 and deq.size == nblk * blck
        out.append({
            "type": qt.name,
            "ggml_type": int(qt.value),
            "n": int(deq.size),
            "raw_hex": raw.tobytes().hex(),
            "out_hex": f32_hex(deq),
        })
    return out


def field_value(r, key):
    return r.fields[key].contents()


def model_golden(path):
    r = gguf.GGUFReader(path)
    kv = {}
    for key in ("general.architecture", "llama.block_count", "llama.context_length",
                "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
                "llama.vocab_size", "llama.rope.dimension_count",
                "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "general.file_type"):
        v = field_value(r, key)
        kv[key] = {"type": r.fields[key].types[0].name,
                   "value": v if not isinstance(v, float) else float(np.float32(v))}
    tokens = r.fields["tokenizer.ggml.tokens"]
    merges = r.fields["tokenizer.ggml.merges"]
    tok = tokens.contents()
    mer = merges.contents()
    tmpl = field_value(r, "tokenizer.chat_template")

    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1

    def tinfo(name):
        t = next(x for x in r.tensors if x.name == name)
        return t, {"name": name, "type": t.tensor_type.name,
                   "ne": [int(x) for x in t.shape], "offset": int(t.data_offset)}

    tensors = []
    for name in ("token_embd.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight",
                 "output_norm.weight"):
        tensors.append(tinfo(name)[1])

    spots = []
    for name, rows in (("token_embd.weight", [0, 1, 49151]),
                       ("blk.0.attn_k.weight", [0, 191]),
                       ("blk.29.ffn_down.weight", [575]),
                       ("output_norm.weight", [0])):
        t, _ = tinfo(name)
        deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
        for row in rows:
            spots.append({"tensor": name, "row": row, "out_hex": f32_hex(deq[row])})

    t, _ = tinfo("blk.0.attn_q.weight")
    q = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    return {
        "file": os.path.basename(path),
        "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
        "version": int(field_value(r, "GGUF.version")),
        "n_tensors": len(r.tensors),
        "n_kv": int(field_value(r, "GGUF.kv_count")),
        "data_offset": int(r.data_offset),
        "kv": kv,
        "n_tokens": len(tok),
        "tokens": {str(i): tok[i] for i in (0, 1, 2, 17, 1000, 49151)},
        "n_merges": len(mer),
        "merges": {str(i): mer[i] for i in (0, 1, 48899)},
        "token_type": {str(i): int(tokens_type) for i, tokens_type in
                       ((i, field_value(r, "tokenizer.ggml.token_type")[i]) for i in (0, 1, 100))},
        "chat_template_len": len(tmpl.encode()),
        "chat_template_prefix": tmpl[:60],
        "tensor_types": types,
        "has_output_weight": any(t.name == "output.weight" for t in r.tensors),
        "tensors": tensors,
        "spots": spots,
        "attn_q_sum": float(q.sum()),
        "attn_q_abs_sum": float(np.abs(q).sum()),
    }


def main():
    rng = np.random.default_rng(SEED)
    with open(os.path.join(HERE, "quants.json"), "w") as f:
        json.dump({"generator": "gguf-py " + importlib.metadata.version("gguf"), "seed": SEED,
                   "cases": quant_cases(rng)}, f, indent=1)
        f.write("\n")
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        HERE, "..", "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(model):
        with open(os.path.join(HERE, "smollm2.json"), "w") as f:
            json.dump(model_golden(model), f, indent=1, ensure_ascii=False)
            f.write("\n")
    else:
        print(f"{model} not found: smollm2.json not written", file=sys.stderr)


if __name__ == "__main__":
    main()
