#!/usr/bin/env python3
"""Seed corpora of the router and attach fuzzers (fuzz_router.c, fuzz_attach.c): real
serve.proto and kvpool.proto frames, encoded by Python's protobuf (an encoder independent of
protobuf-c) from the .proto files compiled here with protoc, as the Python client does.

    python3 tests/fuzz/make_net_seeds.py      # from the repository root

A router seed is records [frames][len][bytes] (fuzz_router.c): frames & 3 is the frame count
less one, (frames >> 2) & 1 the worker rank that sends it (workers side).
"""
import importlib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(os.path.dirname(os.path.dirname(HERE)), "proto")


def load(tmp):
    subprocess.run(["protoc", "--proto_path=" + PROTO, "--python_out=" + tmp,
                    os.path.join(PROTO, "serve.proto"), os.path.join(PROTO, "kvpool.proto")],
                   check=True)
    sys.path.insert(0, tmp)
    return importlib.import_module("serve_pb2"), importlib.import_module("kvpool_pb2")


def rec(body, frames=0, rank=0):
    assert len(body) < 256, len(body)
    return bytes([(rank << 2) | frames, len(body)]) + body


def out(corpus, name, data):
    d = os.path.join(HERE, corpus)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def client_seeds(pb):
    def req(**kw):
        r = pb.ClientRequest(connection=11, **kw)
        return r.SerializeToString()

    gen_ids = req(generate=pb.GenerateRequest(client_tag=5, token_ids=[1, 2, 3, 4],
                                              max_tokens=8, stream=True, ignore_eos=True))
    gen_chat = req(generate=pb.GenerateRequest(
        client_tag=6, max_tokens=4, stop=["\n\n"],
        messages=[pb.ChatMessage(role="system", content="Be brief."),
                  pb.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=pb.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3)))
    gen_prompt = req(generate=pb.GenerateRequest(client_tag=8, prompt="Once upon a time",
                                                 max_tokens=2, logits_top_k=4,
                                                 forced_tokens=[9, 10]))
    out("router-client-corpus", "health-info",
        rec(req(health=pb.HealthRequest())) + rec(req(info=pb.InfoRequest())))
    out("router-client-corpus", "generate-cancel",
        rec(gen_ids) + rec(req(cancel=pb.CancelRequest(client_tag=5))))
    out("router-client-corpus", "chat-prompt", rec(gen_chat) + rec(gen_prompt))
    out("router-client-corpus", "two-frames", rec(gen_ids, frames=1))


def worker_seeds(pb):
    def wm(**kw):
        return pb.WorkerMessage(**kw).SerializeToString()

    regs = b"".join(rec(wm(register_request=pb.RegisterRequest(
        version=1, rank=r, tp=2, pid=200 + r, backend="cpu", kv_config="bitdecoding-nvfp4")),
        rank=r) for r in range(2))
    steps = b""
    for step in range(1, 4):
        for r in range(2):
            rows = [pb.RowResult(request_id=1, token=(40 + step) if r == 0 else -1)]
            steps += rec(wm(result=pb.StepResult(epoch=1, step=step, rank=r, rows=rows,
                                                 compute_us=1000)), rank=r)
    beats = b"".join(rec(wm(heartbeat=pb.WorkerHeartbeat(rank=r, epoch=1, steps=3, pid=200 + r)),
                         rank=r) for r in range(2))
    # the harness registers both ranks and starts request 1 (step 1, epoch 1) before these
    out("router-workers-corpus", "steps", steps + beats)
    out("router-workers-corpus", "register-again", regs + steps)
    failed = rec(wm(result=pb.StepResult(epoch=1, step=1, rank=1, error=9,
                                         message="all-reduce: peer gone")), rank=1)
    out("router-workers-corpus", "register-fail", regs + failed + regs)


def attach_seeds(kp):
    # fuzz_attach.c's registered group: rank r's token is the bytes 32·r .. 32·r + 31
    tok = [bytes(range(32 * r, 32 * r + 32)) for r in range(2)]
    for name, r, registered in (
            ("rank0", kp.AttachRequest(version=1, rank=0, pid=1234), False),
            ("rank1", kp.AttachRequest(version=1, rank=1, pid=99), False),
            ("old-version", kp.AttachRequest(version=0, rank=0), False),
            ("geometry", kp.AttachRequest(version=1, rank=1, geometry_only=True), False),
            ("rank0-token", kp.AttachRequest(version=1, rank=0, pid=7, token=tok[0]), True),
            ("rank1-token", kp.AttachRequest(version=1, rank=1, pid=8, token=tok[1]), True),
            ("rank1-wrong-token", kp.AttachRequest(version=1, rank=1, token=tok[0]), True)):
        # the first byte: the pool's TP size less one in its low 3 bits (fuzz_attach.c): 1, a
        # pool of 2; 0x80: a group is registered
        out("attach-corpus", name, bytes([0x81 if registered else 1]) + r.SerializeToString())


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        pb, kp = load(tmp)
        client_seeds(pb)
        worker_seeds(pb)
        attach_seeds(kp)
