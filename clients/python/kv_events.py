#!/usr/bin/env python3
"""kv_events.py — a consumer of kvpoold's KV event stream, decoded as a KV-aware router
(NVIDIA Dynamo's ZeroMQ relay, vLLM's example subscriber) decodes vLLM's events.

The stream (kvpoold/kvpool.h "KV events"): a PUB socket sends [topic, seq (8 bytes,
big-endian), payload]; a ROUTER socket answers [b"", start (8 bytes)] with every batch kept
from start on, as [b"", seq, payload], then [b"", -1, b""]. A payload is the msgpack array
[ts, [event, ...], data_parallel_rank]; an event is ["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium], ["BlockRemoved", block_hashes,
medium] or ["AllBlocksCleared"]. One block is one bdfp4 page of 128 tokens.

    kv_events.py --replay ENDPOINT [--from SEQ]      the kept batches, one JSON line each
    kv_events.py --sub ENDPOINT [--count N]          live batches (N of them, 0: forever)
    kv_events.py --replay EP --held                  the block hashes the stream says are held

Debian's python3-zmq and python3-msgpack.
"""
import argparse
import json
import sys

import msgpack
import zmq


def decode(seq, payload):
    """One batch as a dict: seq, ts, rank, events (each a dict with its type's fields)."""
    batch = msgpack.unpackb(payload, raw=False)
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    out = []
    for ev in events:
        kind = ev[0]
        if kind == "BlockStored":
            out.append({"type": kind, "block_hashes": ev[1], "parent_block_hash": ev[2],
                        "token_ids": ev[3], "block_size": ev[4], "lora_id": ev[5],
                        "medium": ev[6] if len(ev) > 6 else None})
        elif kind == "BlockRemoved":
            out.append({"type": kind, "block_hashes": ev[1],
                        "medium": ev[2] if len(ev) > 2 else None})
        elif kind == "AllBlocksCleared":
            out.append({"type": kind})
        else:
            raise ValueError("unknown event %r" % (kind,))
    return {"seq": seq, "ts": ts, "rank": rank, "events": out}


def replay(endpoint, start, timeout_ms):
    """Every kept batch from sequence number start on, decoded, oldest first."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        if not s.poll(timeout_ms):
            raise TimeoutError("no answer from %s" % endpoint)
        _, seq_b, payload = s.recv_multipart()
        seq = int.from_bytes(seq_b, "big", signed=True)
        if seq < 0:
            break
        batches.append(decode(seq, payload))
    s.close()
    return batches


def held(batches):
    """The block hashes stored and not removed since the last clear, in order."""
    blocks = {}
    for b in batches:
        for ev in b["events"]:
            if ev["type"] == "AllBlocksCleared":
                blocks.clear()
            elif ev["type"] == "BlockStored":
                for h in ev["block_hashes"]:
                    blocks[h] = True
            else:
                for h in ev["block_hashes"]:
                    blocks.pop(h, None)
    return list(blocks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", help="kvpoold's kv_events_replay endpoint")
    ap.add_argument("--sub", help="kvpoold's kv_events endpoint")
    ap.add_argument("--topic", default="")
    ap.add_argument("--from", dest="start", type=int, default=0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--held", action="store_true")
    ap.add_argument("--timeout-ms", type=int, default=5000)
    a = ap.parse_args()
    if a.replay:
        batches = replay(a.replay, a.start, a.timeout_ms)
        if a.held:
            print(json.dumps(held(batches)))
        else:
            for b in batches:
                print(json.dumps(b))
        return 0
    if not a.sub:
        ap.error("--replay or --sub")
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, a.topic.encode())
    s.connect(a.sub)
    n = 0
    while a.count == 0 or n < a.count:
        if not s.poll(a.timeout_ms):
            print("no batch within %d ms" % a.timeout_ms, file=sys.stderr)
            return 1
        _, seq_b, payload = s.recv_multipart()
        print(json.dumps(decode(int.from_bytes(seq_b, "big"), payload)), flush=True)
        n += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
