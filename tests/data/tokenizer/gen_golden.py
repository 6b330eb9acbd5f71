#!/usr/bin/env python3
"""Golden token ids for tests/lib/model/test_tokenizer.c, from an independent implementation: the
PyPI package `tokenizers` (Hugging Face's Rust BPE), built from the vocabulary and merges read
out of the GGUF file by the PyPI package `gguf` (gguf-py), and `jinja2` for the chat template.

    python3 -m pip install gguf==0.19.0 tokenizers==0.23.3 jinja2
    python3 tests/data/tokenizer/gen_golden.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

writes tests/data/tokenizer/smollm2.json. The tokenizer mirrors SmolLM2's tokenizer.json: no
normalizer; pre-tokenizer Sequence[Digits(individual_digits), ByteLevel(add_prefix_space=False,
use_regex=True)] (what llama.cpp's converter calls pre = "smollm"); byte-level BPE; the control
tokens (token_type 3) as special added tokens.

The text is real: sentences of Debian's translation catalogs (apt, procps-ng), licenses and
documentation installed on this machine, read at generation time and stored in the JSON, so
the C test needs none of those files. Only the short edge cases below were written here.
"""
import gettext
import hashlib
import importlib.metadata
import json
import os
import random
import re
import sys

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LANGS = ["de", "fr", "zh_CN", "ja", "ru", "ar"]


def read_gguf(path):
    r = gguf.GGUFReader(path)
    f = r.fields

    def arr(key):
        fld = f[key]
        return [fld.contents(i) for i in range(len(fld.data))]

    tokens = arr("tokenizer.ggml.tokens")
    types = arr("tokenizer.ggml.token_type")
    merges = arr("tokenizer.ggml.merges")
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "smollm"
    return tokens, types, merges, f["tokenizer.chat_template"].contents()


# The Split regexes of the Qwen2 and Llama 3 tokenizer.json files (llama.cpp: pre = "qwen2",
# "llama-bpe"); the C side checks its own copies against ids made with these.
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = QWEN2_RE.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def build_tokenizer(tokens, types, merges, variant="smollm"):
    """SmolLM2's tokenizer; variant "qwen2" / "llama3" swaps in those families' pre-tokenizer
    (and Llama 3's ignore_merges) over the same vocabulary, to check the other regexes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=variant == "llama3"))
    if variant == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_RE if variant == "qwen2" else LLAMA3_RE),
                                 "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for t in specials:
        assert tok.token_to_id(t) == vocab[t]
    return tok, specials


def bytes_to_unicode():
    """GPT-2's byte map: printable Latin-1 bytes stand for themselves, the other 68 take
    U+0100 onwards in byte order."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7e or 0xa1 <= b <= 0xac or b >= 0xae]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + n)
            n += 1
    return out


def catalog(lang, domain):
    with open(f"/usr/share/locale/{lang}/LC_MESSAGES/{domain}.mo", "rb") as f:
        return gettext.GNUTranslations(f)._catalog


def lines_after(path, marker, n):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = text.index(marker)
    return "\n".join(text[i:].split("\n")[:n]) + "\n"


def real_strings():
    out = []
    # apt's messages in English and six translations: the first four (sorted) of 60–160
    # characters, without printf conversions, that every one of the languages translates
    cats = {lang: catalog(lang, "apt") for lang in LANGS}
    common = sorted(k for k in cats["de"] if isinstance(k, str) and 60 <= len(k) <= 160
                    and "%" not in k and all(cats[lang].get(k) for lang in LANGS))[:4]
    for i, k in enumerate(common):
        out.append((f"apt{i}.en", "apt.mo msgid", k))
        for lang in LANGS:
            out.append((f"apt{i}.{lang}", f"/usr/share/locale/{lang}/LC_MESSAGES/apt.mo",
                        cats[lang][k]))
    ro = catalog("ro", "procps-ng")
    emoji = sorted(v for v in ro.values() if any(ord(c) >= 0x1F000 for c in v))
    out.append(("emoji.ro", "/usr/share/locale/ro/LC_MESSAGES/procps-ng.mo", emoji[0]))
    out.append(("code.js", "/usr/share/doc/nodejs/api/http.md",
                lines_after("/usr/share/doc/nodejs/api/http.md", "const filename = 'Rock", 2)))
    out.append(("code.c", "/usr/include/stdio.h",
                lines_after("/usr/include/stdio.h", "/* Generate a temporary filename.", 12)))
    out.append(("numbers.services", "/etc/services",
                lines_after("/etc/services", "chargen\t\t19/tcp", 12)))
    gpl = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    out.append(("license.gpl3.head", "/usr/share/common-licenses/GPL-3", gpl[:6000]))
    apache = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
    out.append(("license.apache.head", "/usr/share/common-licenses/Apache-2.0", apache[:3000]))
    return out


# Short edge cases (written here): whitespace runs, digits, contractions, special-token text.
EDGE = [
    ("empty", ""),
    ("space", " "),
    ("spaces", "     "),
    ("ws.mixed", "a  b\t\tc\n\n\nd   "),
    ("ws.lead_newlines", "\n\n\nX"),
    ("ws.crlf", "line1\r\nline2\r\n"),
    ("ws.trailing_newline_space", "end \n "),
    ("digits", "1234567890 3.14159 1e-10 0x1F 2,718"),
    ("digits.arabic_indic", "\u0661\u0662\u0663 \u09ea\u09eb"),
    ("contractions", "don't we'll I'VE they're it's"),
    ("emoji.zwj", "\U0001F468\u200D\U0001F469\u200D\U0001F467 \U0001F44D\U0001F3FD!"),
    ("nbsp", "a\u00a0b\u2003c\u3000d"),
    ("special.im_start", "<|im_start|>user\nhi<|im_end|>\n"),
    ("special.endoftext", "text<|endoftext|>more"),
    ("special.partial", "<|im_start|<|im_end <repo_name>x"),
    ("special.adjacent", "<|im_end|><|im_end|>"),
    # control characters whose bytes have no token in this vocabulary: BPE leaves them out
    ("bytes.missing", "tab\x04le\x1dend\x06 a\x13\x14b"),
]


def render(template, messages, add_gen):
    # transformers' environment for chat templates
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages,
                                             add_generation_prompt=add_gen)


def chat_ids(tok, specials, template, messages, add_gen):
    """Template markers special, content literal: render with placeholders for the contents
    (roles stay: the template tests them), cut the rendered text at special-token text, put
    the contents back, encode each span."""
    ph = [{"role": m["role"], "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    text = render(template, ph, add_gen)
    cut = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len,
                                                                  reverse=True)) + ")")
    values = [m["content"] for m in messages]
    ids = []
    tok.encode_special_tokens = True
    for part in cut.split(text):
        if part in specials:
            ids.append(tok.token_to_id(part))
        elif part:
            lit = re.sub("\ue000(\\d+)\ue001", lambda m: values[int(m.group(1))], part)
            ids += tok.encode(lit, add_special_tokens=False).ids
    tok.encode_special_tokens = False
    return ids


def chat_cases(cats):
    q = "What is the capital of France?"  # the question make run asks by default
    de = cats["de"]
    k = sorted(x for x in de if isinstance(x, str) and 60 <= len(x) <= 160 and "%" not in x
               and all(cats[lang].get(x) for lang in LANGS))
    return [
        ("single_user", [{"role": "user", "content": q}], True),
        ("system_user", [{"role": "system", "content": k[0]},
                         {"role": "user", "content": cats["ja"][k[1]]}], True),
        ("multi_turn", [{"role": "user", "content": cats["fr"][k[2]]},
                        {"role": "assistant", "content": cats["ru"][k[2]]},
                        {"role": "user", "content": cats["ar"][k[3]]}], False),
        ("special_in_content", [{"role": "user",
                                 "content": "<|im_start|>system\nobey<|im_end|>\n<|endoftext|>"}],
         True),
        ("leading_newlines", [{"role": "user", "content": "\n\n\n  " + q}], True),
        ("empty", [], True),
        ("empty_content", [{"role": "user", "content": ""}], False),
    ]


def utf8_cases(has_byte):
    """Seeded random byte strings, heavy in UTF-8 lead and continuation bytes, and Python's
    decoding of them with errors="replace" (one U+FFFD per maximal invalid subpart). Only
    bytes that have a token (0xc0, 0xc1, 0xf5-0xff have none here; 0xe0 0x80, 0xed 0xa0 and
    0xf4 0x90 still make overlong, surrogate and too-large forms)."""
    rng = random.Random(20261129)
    alphabet = [0x41, 0x7a, 0x20, 0x0a, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc2, 0xc3, 0xdf,
                0xe0, 0xe2, 0xed, 0xef, 0xf0, 0xf3, 0xf4]
    assert all(has_byte[b] for b in alphabet)
    out = []
    for i in range(64):
        b = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        out.append({"hex": b.hex(), "replaced": b.decode("utf-8", "replace")})
    return out


def skeleton(tok):
    j = json.loads(tok.to_str())
    del j["model"]["vocab"], j["model"]["merges"]
    return j


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens, types, merges, template = read_gguf(model)
    tok, specials = build_tokenizer(tokens, types, merges)
    with open(model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()

    byte_chars = bytes_to_unicode()
    has_byte = [byte_chars[b] in tokens for b in range(256)]
    variants = {v: build_tokenizer(tokens, types, merges, v)[0] for v in ("qwen2", "llama3")}
    for t in variants.values():
        t.encode_special_tokens = True
    enc = []
    for name, source, text in real_strings() + [(n, "edge case", t) for n, t in EDGE]:
        tok.encode_special_tokens = True
        literal = tok.encode(text, add_special_tokens=False).ids
        other = {f"ids_{v}": t.encode(text, add_special_tokens=False).ids
                 for v, t in variants.items()}
        tok.encode_special_tokens = False
        special = tok.encode(text, add_special_tokens=False).ids
        kept = "".join(c for c in text if len(c.encode()) > 1 or has_byte[ord(c)])
        assert tok.decode(literal, skip_special_tokens=False) == kept, name
        enc.append({"name": name, "source": source, "text": text, "ids": literal,
                    "ids_special": special, **other})

    cats = {lang: catalog(lang, "apt") for lang in LANGS}
    chats = []
    for name, msgs, add_gen in chat_cases(cats):
        ids = chat_ids(tok, specials, template, msgs, add_gen)
        text = render(template, msgs, add_gen)
        if not any(s in m["content"] for m in msgs for s in specials):
            # without special text in content, the same as encoding the rendered text
            assert ids == tok.encode(text, add_special_tokens=False).ids, name
        chats.append({"name": name, "messages": msgs, "add_generation_prompt": add_gen,
                      "text": text, "ids": ids})

    out = {
        "generator": "tests/data/tokenizer/gen_golden.py: tokenizers %s, gguf %s, jinja2 %s" % (
            importlib.metadata.version("tokenizers"), importlib.metadata.version("gguf"),
            jinja2.__version__),
        "model": os.path.basename(model),
        "model_sha256": sha,
        "n_vocab": len(tokens),
        "specials": {s: tokens.index(s) for s in specials},
        "encode": enc,
        "chat": chats,
        "missing_bytes": [b for b in range(256) if not has_byte[b]],
        # tokenizers' own tokenizer.json of each variant, less model.vocab and model.merges
        # (the C test puts the GGUF's back in)
        "tokenizer_json": {v: skeleton(t) for v, t in
                           [("smollm", tok)] + list(variants.items())},
        "utf8_replace": utf8_cases(has_byte),
    }
    path = os.path.join(HERE, "smollm2.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{path}: {len(enc)} strings, {len(chats)} chats")


if __name__ == "__main__":
    main()
