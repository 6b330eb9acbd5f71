"""openai_check.py BASE_URL MODEL — the official openai package against bdfp4's HTTP API.

Chat and completions, streamed and not, greedy (temperature 0): a stream put together is the
non-streamed answer, usage adds up, a stop string cuts the text, an unknown model is a 404
NotFoundError and n = 2 a 400 BadRequestError. Exits 0 when all hold; prints what failed.
"""
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
print("openai", openai.__version__, "ok:", repr(text))
