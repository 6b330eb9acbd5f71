#!/usr/bin/env python3
"""Golden logits for tests/lib/model/test_model.c from an independent implementation: llama.cpp,
through the PyPI package `llama-cpp-python`, run on the same GGUF file as bdfp4.

    python3 -m pip install llama-cpp-python==0.3.36 gguf==0.19.0 numpy  # builds llama.cpp
    python3 tests/data/model/gen_golden.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

writes tests/data/model/golden.json: for each prompt, its token ids (llama.cpp's tokenizer, special
tokens parsed, no BOS added: SmolLM2's metadata says add_bos_token = false), then for each of two
llama.cpp runs a 64-step greedy run (argmax of llama.cpp's logits at each step, that token fed
back), and at every step the top-1 token, its margin over the second and the logits of the 8
most likely tokens. Both runs use an F32 KV cache and no flash attention.

  "f32"   llama.cpp on an F32 copy of the GGUF: every tensor dequantized by gguf-py (the same
          values bdfp4 loads: tests/data/gguf checks its dequantizers bit for bit against gguf-py)
          and written back as F32, metadata unchanged but general.file_type. llama.cpp then
          multiplies in FP32 like bdfp4, so the test asserts the same top-1 at every step.
  "q4_1"  llama.cpp on the GGUF as shipped. Here llama.cpp quantizes activations to Q8_1/Q8_0
          on the fly for its quantized dot products, which moves logits by up to ~1.6 on these
          prompts (and flips near ties), so the test reports the difference and asserts the
          top-1 only where llama.cpp's own margin is clear.

The prompts are a chat turn, an everyday sentence, and a long excerpt of the GPL-3 text that
Debian ships (/usr/share/common-licenses/GPL-3), long enough (> 256 tokens) that a decoding
run crosses FP4 page promotions.
"""
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile

import gguf
import llama_cpp
import numpy as np
from gguf import GGUFValueType as VT
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS = 64
TOPN = 8

CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")


def gpl_excerpt():
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        text = f.read()
    # the Preamble, from its heading on: real prose rather than the title block
    start = text.index("Preamble")
    return text[start:start + 1600]


def write_f32_copy(src, dst):
    """The GGUF at src with every tensor dequantized to F32 (gguf-py), metadata kept."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if k == "general.file_type":
            w.add_key_value(k, 0, VT.UINT32)  # LLAMA_FTYPE_ALL_F32
            continue
        vt = f.types[0]
        w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1] if vt == VT.ARRAY else None)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy_run(llm, ids):
    llm.reset()
    llm.eval(ids)
    run = {"greedy": [], "top1": [], "top1_margin": [], "top_ids": [], "top_logits": []}
    for t in range(STEPS):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(-logits, kind="stable")
        best = int(order[0])
        run["greedy"].append(best)
        run["top1"].append(best)
        run["top1_margin"].append(float(logits[order[0]] - logits[order[1]]))
        run["top_ids"].append([int(i) for i in order[:TOPN]])
        run["top_logits"].append([float(logits[i]) for i in order[:TOPN]])
        if t + 1 < STEPS:
            llm.eval([best])
    return run


def open_llm(path):
    return Llama(model_path=path, n_ctx=2048, n_batch=512, logits_all=True, n_threads=2,
                 type_k=0, type_v=0, flash_attn=False, seed=0, verbose=False)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    prompts = [
        ("chat_capital", CHAT),
        ("sentence", "The best way to learn a new language is"),
        ("gpl3_preamble", gpl_excerpt()),
    ]
    out = {
        "generator": "llama-cpp-python %s (llama.cpp), gguf %s, F32 KV cache, greedy" %
                     (llama_cpp.__version__, importlib.metadata.version("gguf")),
        "model": os.path.basename(path),
        "model_sha256": sha,
        "steps": STEPS,
        "prompts": [{"name": n, "text": t} for n, t in prompts],
    }
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        write_f32_copy(path, f32)
        for run_name, model in (("f32", f32), ("q4_1", path)):
            llm = open_llm(model)
            for p in out["prompts"]:
                ids = llm.tokenize(p["text"].encode("utf-8"), add_bos=False, special=True)
                if "prompt_ids" in p:
                    assert p["prompt_ids"] == [int(i) for i in ids]
                p["prompt_ids"] = [int(i) for i in ids]
                p[run_name] = greedy_run(llm, ids)
                print("%s/%s: %d prompt tokens, greedy: %r" % (
                    run_name, p["name"], len(ids),
                    llm.detokenize(p[run_name]["greedy"]).decode("utf-8", "replace")[:100]))
            del llm
    text = json.dumps(out, indent=1)
    # one line per array of numbers, so that the file reads (and diffs) step by step
    text = re.sub(r"\[[-0-9.e,\s]*\]", lambda mo: " ".join(mo.group(0).split()), text)
    with open(os.path.join(HERE, "golden.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
