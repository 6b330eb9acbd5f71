#!/usr/bin/env python3
"""Seed corpora of the text and file fuzzers (fuzz_config.c, fuzz_calib.c, fuzz_tokenizer.c,
fuzz_chat.c), from the project's real inputs: the shipped configuration, a calibration file in
the format of quant/bd_calib.h (written here independently, with hashlib's SHA-256), text from
a Debian license, and the embedded model's own chat template (read out of its GGUF file).

    python3 tests/fuzz/make_text_seeds.py     # from the repository root, after make model
"""
import hashlib
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def out(corpus, name, data):
    d = os.path.join(HERE, corpus)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def config_seeds():
    with open(os.path.join(ROOT, "deploy", "bdfp4.conf"), "rb") as f:
        conf = f.read()
    out("config-corpus", "bdfp4.conf", conf)
    # a small file, then flags over it (NUL-separated words after the text)
    small = b"[router]\ntp = 2\nmemory_bytes = 512M\ninsecure_tcp = yes\n"
    words = [b"--tp", b"4", b"--memory-bytes=2GiB", b"--insecure-tcp", b"--frontend",
             b"tcp://0.0.0.0:5555"]
    out("config-corpus", "flags.ini", small + b"\0" + b"\0".join(words))
    out("config-corpus", "bad-line.ini", b"[pool]\nsocket = /run/x\nnot a key line\n")


def calib_seed(L, H, d, name):
    mu = struct.pack("<%df" % (L * H * d), *[((i * 37) % 17 - 8) / 64.0 for i in range(L * H * d)])
    model_sha = hashlib.sha256(b"a model file").digest()
    hdr = b"BDFP4CAL" + struct.pack("<IIIIIIffiIQQ", 1, 2048, L, H, d, 64, 21 / 1024, 8.0, 3, 0,
                                    2048, 4096) + model_sha
    assert len(hdr) == 96
    body = hdr + mu
    out("calib-corpus", name, body + hashlib.sha256(body).digest())


def text_seeds():
    with open("/usr/share/common-licenses/GPL-3", "rb") as f:
        gpl = f.read()
    # the first byte of an input is the flags: 0 plain, 1 special parsing, 2 BOS/EOS
    out("text-corpus", "gpl", b"\0" + gpl[:700])
    out("text-corpus", "special", b"\x01<|im_start|>user\nhi \xc3\xa9t\xc3\xa9<|im_end|>\n")
    out("text-corpus", "utf8", "\0naïve café 東京 🙂 12345  \t\n".encode())


def gguf_string(path, key):
    """The string value of one metadata key of a GGUF file (v2/v3 layout)."""
    with open(path, "rb") as f:
        head = f.read(1 << 22)
    k = key.encode()
    at = head.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    typ, = struct.unpack_from("<I", head, at)
    assert typ == 8, "not a string"
    n, = struct.unpack_from("<Q", head, at + 4)
    return head[at + 12:at + 12 + n]


def chat_seeds():
    tpl = gguf_string(MODEL, "tokenizer.chat_template")
    msgs = [b"system\x01You are helpful.", b"user\x01What is the capital of France?",
            b"assistant\x01Paris.", b"user\x01And of Spain?"]
    out("chat-corpus", "smollm2", tpl + b"\0" + b"\0".join(msgs))
    chatml = (b"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
              b"message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
              b"add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    out("chat-corpus", "chatml", chatml + b"\0" + msgs[1])


if __name__ == "__main__":
    config_seeds()
    calib_seed(1, 1, 16, "one-head")
    calib_seed(2, 3, 8, "two-layers")
    text_seeds()
    chat_seeds()
