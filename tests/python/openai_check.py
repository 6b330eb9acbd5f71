"""openai_check.py BASE_URL MODEL — the official openai package against bdfp4's HTTP API.

Chat and completions, streamed and not, greedy (temperature 0): a stream put together is the
non-streamed answer, usage adds up, a stop string cuts the text, an unknown model is a 404
NotFoundError and n = 2 a 400 BadRequestError; log-probabilities (chat logprobs/top_logprobs,
completions logprobs) parse into the SDK's types, the greedy token's is the largest of its top
ones, all are <= 0 and their probabilities sum to at most 1, streamed as not; top_logprobs 21
and logprobs 6 are 400 BadRequestErrors. Exits 0 when all hold; prints what failed.
"""
import math
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused")
msgs = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."}]
extra = {"ignore_eos": True}

chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=16,
                                      temperature=0, extra_body=extra)
text = chat.choices[0].message.content
assert chat.choices[0].finish_reason == "length", chat
assert chat.usage.completion_tokens == 16, chat.usage
assert chat.usage.total_tokens == chat.usage.prompt_tokens + 16, chat.usage

pieces, usage = [], None
for ev in client.chat.completions.create(model=model, messages=msgs, max_tokens=16,
                                         temperature=0, stream=True, extra_body=extra,
                                         stream_options={"include_usage": True}):
    if ev.usage:
        usage = ev.usage
    for c in ev.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
assert "".join(pieces) == text, (pieces, text)
assert usage is not None and usage.completion_tokens == 16, usage

comp = client.completions.create(model=model, prompt="The capital of France is",
                                 max_tokens=8, temperature=0, extra_body=extra)
ctext = comp.choices[0].text
streamed = "".join(e.choices[0].text for e in client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
    stream=True, extra_body=extra) if e.choices)
assert streamed == ctext, (streamed, ctext)

words = ctext.split()
if len(words) > 2:
    stop = " " + words[2]
    cut = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=8, temperature=0, stop=[stop],
                                    extra_body=extra)
    assert cut.choices[0].text == ctext[:ctext.index(stop)], (cut.choices[0].text, ctext)
    assert cut.choices[0].finish_reason == "stop"

assert [m.id for m in client.models.list()] == [model]

try:
    client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    raise SystemExit("an unknown model was served")
except openai.NotFoundError as e:
    assert e.status_code == 404
try:
    client.completions.create(model=model, prompt="x", max_tokens=2, n=2)
    raise SystemExit("n = 2 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "n must be" in str(e), e


def check_step(sampled, top, what):
    assert sampled <= 0, (what, sampled)
    assert all(v <= 0 for v in top), (what, top)
    assert sampled == max(top), (what, sampled, top)
    assert sum(math.exp(v) for v in top) <= 1 + 1e-6, (what, top)


lchat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=4,
                                       extra_body=extra)
content = lchat.choices[0].logprobs.content
assert len(content) == lchat.usage.completion_tokens == 8, lchat
for e in content:
    assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token, e
    assert bytes(e.bytes).decode("utf-8", "replace") == e.token or \
        e.token.startswith("bytes:"), e
    check_step(e.logprob, [t.logprob for t in e.top_logprobs], e.token)
streamed = []
for ev in client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=4,
                                         stream=True, extra_body=extra):
    for c in ev.choices:
        if c.logprobs and c.logprobs.content:
            streamed.extend(c.logprobs.content)
assert [e.token for e in streamed] == [e.token for e in content], (streamed, content)
assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))

lcomp = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=6, temperature=0, logprobs=3, extra_body=extra)
lp = lcomp.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6, lp
assert "".join(lp.tokens) == lcomp.choices[0].text, (lp.tokens, lcomp.choices[0].text)
assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset
for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert tok in top and 3 <= len(top) <= 4, top
    check_step(v, list(top.values()), tok)
stoks = []
for ev in client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=6, temperature=0, logprobs=3, stream=True,
                                    extra_body=extra):
    if ev.choices and ev.choices[0].logprobs:
        stoks.extend(ev.choices[0].logprobs.tokens)
assert stoks == lp.tokens, (stoks, lp.tokens)

for call in (lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=2,
                                                      logprobs=True, top_logprobs=21),
             lambda: client.completions.create(model=model, prompt="x", max_tokens=2,
                                               logprobs=6)):
    try:
        call()
        raise SystemExit("a bad logprobs value was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "logprobs" in str(e), e
print("openai", openai.__version__, "ok:", repr(text), "logprobs:",
      [round(e.logprob, 3) for e in content][:4])
