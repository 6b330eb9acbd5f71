#!/usr/bin/env python3
"""Seed corpus for tests/fuzz/fuzz_gguf.c, written with gguf-py's GGUFWriter (an independent
GGUF writer) so the fuzzer starts from well-formed files of every value type and several
tensor types.

    python3 -m pip install gguf==0.19.0 numpy
    python3 tests/fuzz/make_seeds.py      # writes tests/fuzz/corpus/*.gguf
"""
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def raw_tensor(w, rng, name, qt, shape):
    blck, tsize = gguf.constants.GGML_QUANT_SIZES[qt]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    nbytes = rows * shape[-1] // blck * tsize
    data = rng.integers(0, 256, size=nbytes, dtype=np.uint8).reshape(rows, -1)
    w.add_tensor(name, data, raw_dtype=qt)


def seed_types(rng):
    w = gguf.GGUFWriter(os.path.join(OUT, "types.gguf"), "test")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "h\u00e9llo")
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 40))
    w.add_float64("t.f64", -1.5e300)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "", "xyz"])
    w.add_array("t.arr_f32", [0.25, -8.0])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((2, 4)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3,)).astype(np.float16))
    raw_tensor(w, rng, "bf16", T.BF16, (2, 8))
    for qt in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        raw_tensor(w, rng, qt.name.lower(), qt, (2, 32))
    for qt in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw_tensor(w, rng, qt.name.lower(), qt, (1, 256))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def seed_llama(rng):
    w = gguf.GGUFWriter(os.path.join(OUT, "llama.gguf"), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_token_types([3, 1, 1, 1])
    w.add_bos_token_id(0)
    raw_tensor(w, rng, "token_embd.weight", T.Q8_0, (4, 64))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(7)
    seed_types(rng)
    seed_llama(rng)


if __name__ == "__main__":
    main()
