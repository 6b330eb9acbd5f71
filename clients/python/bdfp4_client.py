#!/usr/bin/env python3
"""bdfp4_client.py — the Python client of the bdfp4 router, made from proto/serve.proto.

The messages come from the same .proto file as the C client's (compiled with protoc
--python_out into a scratch directory at start) and travel over a ZeroMQ DEALER socket as
lib/serve/client.c sends them. The command line and the output are `bdfp4 client`'s (cli/client.c):
the same request prints the same text, the same JSON lines (--json; their tag and request_id
name this connection and request, the usage times this run) and the same log-probability lines.

    python3 bdfp4_client.py [--router ADDR] [--json] [--raw] [--max-tokens N] [--logprobs N] PROMPT
    python3 bdfp4_client.py [--router ADDR] [--json] --health | --info
    python3 bdfp4_client.py --router tcp://host:5555 --server-key router.pub \
        --secret-key me.key ...     # CURVE (also $BDFP4_SERVER_KEY, $BDFP4_SECRET_KEY)

Needs protoc (Debian protobuf-compiler) and the protobuf and pyzmq packages (python3-protobuf,
python3-zmq). Exit status: 0 on a finished answer, 1 on an error, a refusal or a refused
security handshake (its reason on stderr), 2 on bad usage.
As a module: Client(load_messages(PROTO_DIR, dir), endpoint).generate(...).
"""
import argparse
import importlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
MAX_STOPS = 8
MAX_TOP_LOGPROBS = 20

# bd_serve_error_name() and bd_finish_name() of lib/serve/client.c, by code
ERROR_NAMES = ["ok", "malformed", "oversize", "unknown-type", "invalid-argument", "too-long",
               "unknown-kv-config", "resource-exhausted", "unavailable", "worker-failed",
               "deadline-exceeded", "cancelled", "not-found", "shutting-down", "internal",
               "version"]
FINISH_NAMES = ["none", "stop", "length", "stop-string", "cancelled", "error"]
STATE_NAMES = ["starting", "serving", "degraded", "stopping"]


def error_name(code):
    return ERROR_NAMES[code] if 0 <= code < len(ERROR_NAMES) else "unknown"


def finish_name(code):
    return FINISH_NAMES[code] if 0 <= code < len(FINISH_NAMES) else "unknown"


def load_messages(proto_dir, out_dir):
    """Compiles serve.proto into out_dir and imports the generated module."""
    subprocess.run(["protoc", "--proto_path=" + proto_dir, "--python_out=" + out_dir,
                    os.path.join(proto_dir, "serve.proto")], check=True)
    sys.path.insert(0, out_dir)
    return importlib.import_module("serve_pb2")


# ---- output as cli/client.c writes it (jansson: compact, ASCII, reals to 9 digits) ----------

def _real(x):
    """A float as jansson writes it with JSON_REAL_PRECISION(9)."""
    s = "%.9g" % x
    if "e" in s:
        mant, exp = s.split("e")
        sign = "-" if exp.startswith("-") else ""
        s = mant + "e" + sign + exp.lstrip("+-").lstrip("0")
    elif "." not in s and s not in ("inf", "-inf", "nan"):
        s += ".0"
    return s


def _str(s):
    """A string as jansson writes it with JSON_ENSURE_ASCII (upper-case \\u escapes)."""
    return re.sub(r"(?<!\\)((?:\\\\)*)\\u([0-9a-f]{4})",
                  lambda m: m.group(1) + "\\u" + m.group(2).upper(),
                  json.dumps(s, ensure_ascii=True))


def dumps(v):
    """v (dicts in insertion order, lists, str, bool, int, float, None) as jansson's
    json_dumps(JSON_COMPACT | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(9))."""
    if isinstance(v, dict):
        return "{" + ",".join(_str(k) + ":" + dumps(x) for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(dumps(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _real(v)
    if v is None:
        return "null"
    return _str(v)


def piece_text(b):
    """bd_utf8_or_bytes(): a token's bytes as text when they are UTF-8, else "bytes:\\xNN..."."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join("\\x%02x" % c for c in b)


def logprob_obj(t):
    return {"token": t.token, "piece": piece_text(t.piece), "logprob": t.logprob}


def chunk_obj(ch):
    """chunk_json() of cli/client.c."""
    o = {"tag": ch.client_tag, "request_id": ch.request_id, "tokens": list(ch.token_ids),
         "text": ch.text, "finish": finish_name(ch.finish_reason)}
    if ch.error:
        o["error"] = error_name(ch.error)
    if ch.message:
        o["message"] = ch.message
    if len(ch.logprobs) == len(ch.token_ids) and ch.logprobs:
        rows = []
        for st in ch.logprobs:
            e = logprob_obj(st.sampled)
            e["top"] = [logprob_obj(t) for t in st.top]
            rows.append(e)
        o["logprobs"] = rows
    if ch.finish_reason != 0:
        u = ch.usage
        o["usage"] = {"prompt_tokens": u.prompt_tokens,
                      "completion_tokens": u.completion_tokens, "queue_us": u.queue_us,
                      "ttft_us": u.ttft_us, "total_us": u.total_us,
                      "preemptions": u.preemptions}
    return o


def logprob_lines(ch):
    """print_logprobs() of cli/client.c: per token ID, LOGPROB, PIECE (JSON), then ID:LOGPROB."""
    out = ""
    for st in ch.logprobs:
        out += "%d\t%.4f\t%s" % (st.sampled.token, st.sampled.logprob,
                                 _str(piece_text(st.sampled.piece)))
        out += "".join("\t%d:%.4f" % (t.token, t.logprob) for t in st.top)
        out += "\n"
    return out


# ---- the connection --------------------------------------------------------------------------

def read_key(path):
    """The 40-character Z85 key on the first line of a key file (base/bd_zsec.h)."""
    with open(path, "rb") as f:
        key = f.readline().strip()
    if len(key) != 40:
        raise ValueError("%s: not a 40-character Z85 key" % path)
    return key


class HandshakeError(Exception):
    """The connection's security handshake failed (a refused key, CURVE on one side only)."""


class Client:
    """One DEALER connection; requests are named by client tags, as in lib/serve/bd_client.h.
    With server_key and secret_key (key file paths) the connection is CURVE."""

    def __init__(self, pb, endpoint, timeout_ms=30000, server_key=None, secret_key=None):
        self.pb = pb
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bool(server_key) != bool(secret_key):
            raise ValueError("a CURVE client needs both --server-key and --secret-key")
        if server_key:
            secret = read_key(secret_key)
            self.sock.curve_serverkey = read_key(server_key)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = zmq.curve_public(secret)
        # the handshake's failures, so that a refused client stops at once
        self.mon = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.sock.connect(endpoint)
        self.timeout_ms = timeout_ms
        self.next_tag = (int(time.time() * 1000) & 0xffff) << 16 | 1
        self.connection = random.getrandbits(64) | 1

    def _check_monitor(self):
        from zmq.utils.monitor import recv_monitor_message
        while self.mon.poll(0):
            ev = recv_monitor_message(self.mon)
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise HandshakeError("%s refused this client's CURVE key (ZAP status %d): its "
                                     "public key is not in the server's allow-list"
                                     % (self.endpoint, ev["value"]))
            raise HandshakeError("security handshake with %s failed: the server and this "
                                 "client disagree on CURVE (a CURVE server and a plain client, "
                                 "or the other way round, or the wrong server public key)"
                                 % self.endpoint)

    def close(self):
        self.sock.disable_monitor()
        self.mon.close()
        self.sock.close()
        self.ctx.term()

    def _send(self, req):
        req.connection = self.connection
        self.sock.send(req.SerializeToString())

    def _recv(self):
        """The next reply other than a keepalive; TimeoutError when the router is silent."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.timeout_ms))
            if not ready:
                raise TimeoutError("no answer from the router for %d ms" % self.timeout_ms)
            if self.mon in ready:
                self._check_monitor()
            if self.sock not in ready:
                continue
            rep = self.pb.ClientReply()
            rep.ParseFromString(self.sock.recv())
            if rep.WhichOneof("msg") != "keepalive":
                return rep

    def generate(self, prompt=None, messages=None, chat=True, max_tokens=256, stream=True,
                 temperature=0.0, top_k=0, top_p=0.0, seed=0, kv_config="", stops=(),
                 deadline_ms=0, logprobs=None, on_chunk=None):
        """Sends one generation (a prompt, as a chat user turn unless chat is False, or
        messages [(role, content)]) and returns its last reply: the final chunk, or the
        ErrorReply of a refusal. on_chunk(chunk) sees every chunk. logprobs: None, or the
        number of most likely tokens to report with each token's log-probability."""
        req = self.pb.ClientRequest()
        g = req.generate
        g.client_tag = self.next_tag
        self.next_tag += 1
        if messages:
            for role, content in messages:
                m = g.messages.add()
                m.role, m.content = role, content
        elif chat:
            m = g.messages.add()
            m.role, m.content = "user", prompt
        else:
            g.prompt = prompt
        g.max_tokens = max_tokens
        g.stream = stream
        g.sampling.temperature = temperature
        g.sampling.top_k = top_k
        g.sampling.top_p = top_p
        g.sampling.seed = seed
        g.kv_config = kv_config
        g.stop.extend(stops)
        g.deadline_ms = deadline_ms
        if logprobs is not None:
            g.logprobs = True
            g.top_logprobs = logprobs
        self._send(req)
        while True:
            rep = self._recv()
            kind = rep.WhichOneof("msg")
            if kind == "error" and rep.error.client_tag == g.client_tag:
                return rep.error
            if kind != "chunk" or rep.chunk.client_tag != g.client_tag:
                continue
            if on_chunk:
                on_chunk(rep.chunk)
            if rep.chunk.finish_reason != self.pb.FINISH_NONE:
                return rep.chunk

    def _query(self, field):
        """Sends the empty request `field` ("health", "info") and returns the reply's field of
        the same name, passing over any other reply."""
        req = self.pb.ClientRequest()
        getattr(req, field).SetInParent()
        self._send(req)
        while True:
            rep = self._recv()
            if rep.WhichOneof("msg") == field:
                return getattr(rep, field)

    def health(self):
        return self._query("health")

    def info(self):
        return self._query("info")


# ---- the command -----------------------------------------------------------------------------

def print_health(h, as_json):
    """do_health() of cli/client.c; returns the exit status."""
    if as_json:
        print(dumps({"healthy": h.healthy, "state": STATE_NAMES[h.state], "reason": h.reason,
                     "workers": [{"rank": w.rank, "pid": w.pid, "alive": w.alive,
                                  "last_heartbeat_ms": w.last_heartbeat_ms, "steps": w.steps}
                                 for w in h.workers],
                     "pool": {"ok": h.pool_ok, "error": h.pool_error,
                              "last_ok_ms": h.pool_last_ok_ms}}))
    else:
        print("%s%s%s" % (STATE_NAMES[h.state], ": " if h.reason else "", h.reason))
        print("  kvpoold: %s%s%s, last answer %d ms ago" % (
            "answering" if h.pool_ok else "unreachable", ": " if h.pool_error else "",
            h.pool_error, h.pool_last_ok_ms))
        for w in h.workers:
            print("  rank %d: %s, pid %d, last heartbeat %d ms ago, %d steps" % (
                w.rank, "alive" if w.alive else "absent", w.pid, w.last_heartbeat_ms, w.steps))
    return 0 if h.healthy else 1


def print_info(s, as_json):
    """do_info() of cli/client.c (its JSON fields)."""
    if as_json:
        print(dumps({"version": s.version, "model": s.model, "arch": s.arch,
                     "n_vocab": s.n_vocab, "n_ctx": s.n_ctx, "kv_config": s.kv_config,
                     "tp": s.tp, "backend": s.backend, "max_batch": s.max_batch,
                     "max_queue": s.max_queue, "queued": s.queued, "running": s.running,
                     "requests_total": s.requests_total,
                     "requests_failed": s.requests_failed,
                     "tokens_generated": s.tokens_generated, "steps": s.steps,
                     "pages_total": s.pages_total, "pages_free": s.pages_free,
                     "pages_peak": s.pages_peak, "slots_total": s.slots_total,
                     "slots_free": s.slots_free, "uptime_ms": s.uptime_ms,
                     "healthy": s.health.healthy, "decode_kernel": s.decode_kernel}))
    else:
        print("router %s: %s (%s, vocabulary %d, context %d), tp %d, %s backend, kv %s" % (
            s.version, s.model, s.arch, s.n_vocab, s.n_ctx, s.tp, s.backend, s.kv_config))
        print("  %s; %d running, %d queued (max batch %d, max queue %d)" % (
            "serving" if s.health.healthy else "not serving", s.running, s.queued,
            s.max_batch, s.max_queue))
        print("  %d requests (%d failed), %d tokens, %d steps, %d preemptions, up %.1f s" % (
            s.requests_total, s.requests_failed, s.tokens_generated, s.steps, s.preemptions,
            s.uptime_ms / 1000.0))
        print("  pool: %d/%d pages free (router peak %d held), %d/%d slots free" % (
            s.pages_free, s.pages_total, s.pages_peak, s.slots_free, s.slots_total))
        if s.decode_kernel:
            print("  decode kernel: %s" % s.decode_kernel)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--router", default=os.environ.get("BD_ROUTER") or DEFAULT_ENDPOINT)
    ap.add_argument("--proto-dir", default=PROTO_DIR, help="where serve.proto is")
    ap.add_argument("--out-dir", help="where protoc writes serve_pb2.py (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object per chunk")
    ap.add_argument("--raw", action="store_true", help="PROMPT as plain text, no chat template")
    ap.add_argument("--system", help="a system message before the user turn")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (0: the router's)")
    ap.add_argument("--kv", default="", help="KV configuration (default: the server's)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--logprobs", type=int, metavar="N",
                    help="each token's log-probability and the N most likely")
    ap.add_argument("--deadline-ms", type=int, default=0)
    ap.add_argument("--timeout-ms", type=int, default=30000)
    ap.add_argument("--health", action="store_true")
    ap.add_argument("--info", action="store_true")
    ap.add_argument("--server-key", default=os.environ.get("BDFP4_SERVER_KEY"),
                    help="the router's CURVE public key file")
    ap.add_argument("--secret-key", default=os.environ.get("BDFP4_SECRET_KEY"),
                    help="this client's CURVE secret key file (bdfp4 keygen)")
    ap.add_argument("prompt", nargs="?", help="the prompt; - reads stdin, @FILE a file")
    a = ap.parse_args()
    if a.max_tokens < 1:
        ap.error("--max-tokens wants an integer >= 1")
    if a.logprobs is not None and not 0 <= a.logprobs <= MAX_TOP_LOGPROBS:
        ap.error("--logprobs wants an integer in [0, %d]" % MAX_TOP_LOGPROBS)
    if len(a.stop) > MAX_STOPS:
        ap.error("too many --stop strings")
    if not (a.health or a.info) and a.prompt is None:
        ap.error("no PROMPT given")
    prompt = a.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    elif prompt and prompt.startswith("@"):
        with open(prompt[1:], encoding="utf-8") as f:
            prompt = f.read()

    with tempfile.TemporaryDirectory() as tmp:
        pb = load_messages(a.proto_dir, a.out_dir or tmp)
        c = Client(pb, a.router, a.timeout_ms, a.server_key, a.secret_key)
        try:
            if a.health:
                return print_health(c.health(), a.json)
            if a.info:
                return print_info(c.info(), a.json)
            table = []

            def show(ch):
                if a.json:
                    print(dumps(chunk_obj(ch)), flush=True)
                    return
                sys.stdout.write(ch.text)
                sys.stdout.flush()
                if a.logprobs is not None:
                    table.append(logprob_lines(ch))

            msgs = [("system", a.system), ("user", prompt)] if a.system else None
            try:
                last = c.generate(prompt, messages=msgs, chat=not a.raw,
                                  max_tokens=a.max_tokens, stream=not a.no_stream,
                                  temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                  seed=a.seed, kv_config=a.kv, stops=a.stop,
                                  deadline_ms=a.deadline_ms, logprobs=a.logprobs,
                                  on_chunk=show)
            except TimeoutError as e:
                sys.stderr.write("\nbdfp4_client.py: %s at %s\n" % (e, a.router))
                return 1
            if isinstance(last, pb.ErrorReply):
                if a.json:
                    print(dumps({"tag": last.client_tag, "finish": "error",
                                 "error": error_name(last.error), "message": last.message}))
                sys.stderr.write("bdfp4_client.py: refused (%s): %s\n" % (
                    error_name(last.error), last.message))
                return 1
            if not a.json:
                sys.stdout.write("\n" + "".join(table))
            if last.finish_reason in (pb.FINISH_ERROR, pb.FINISH_CANCELLED):
                sys.stderr.write("bdfp4_client.py: %s (%s): %s\n" % (
                    finish_name(last.finish_reason), error_name(last.error), last.message))
                return 1
            return 0
        except HandshakeError as e:
            sys.stderr.write("bdfp4_client.py: %s\n" % e)
            return 1
        finally:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
