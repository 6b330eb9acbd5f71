#!/usr/bin/env python3
"""bdfp4_client.py — a small Python client of the bdfp4 router, made from proto/serve.proto.

It shows that the client API is not tied to C: the messages come from the same .proto file
(compiled here with protoc --python_out into a scratch directory) and travel over a ZeroMQ
DEALER socket exactly as lib/serve/client.c sends them.

    python3 bdfp4_client.py --router ipc:///path/router.sock [--json] [--max-tokens N] PROMPT
    python3 bdfp4_client.py --router ... --health | --info
    python3 bdfp4_client.py --router tcp://host:5555 --server-key router.pub \
        --secret-key me.key ...     # CURVE (also $BDFP4_SERVER_KEY, $BDFP4_SECRET_KEY)

Needs: protoc (Debian protobuf-compiler), the protobuf and pyzmq Python packages (Debian
python3-protobuf, python3-zmq). Exit status: 0 on a finished answer, 1 on an error reply or a
refused security handshake (its reason on stderr).
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def load_messages(proto_dir, out_dir):
    """Compiles serve.proto into out_dir and imports the generated module."""
    subprocess.run(["protoc", "--proto_path=" + proto_dir, "--python_out=" + out_dir,
                    os.path.join(proto_dir, "serve.proto")], check=True)
    sys.path.insert(0, out_dir)
    return importlib.import_module("serve_pb2")


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
        self.next_tag = 1

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
        self.sock.send(req.SerializeToString())

    def _recv(self):
        """The next reply other than a keepalive; TimeoutError when the router is silent."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.timeout_ms))
            if not ready:
                raise TimeoutError("the router stopped answering")
            if self.mon in ready:
                self._check_monitor()
            if self.sock not in ready:
                continue
            rep = self.pb.ClientReply()
            rep.ParseFromString(self.sock.recv())
            if rep.WhichOneof("msg") != "keepalive":
                return rep

    def generate(self, prompt, max_tokens=64, stream=True, chat=True, seed=0, on_chunk=None):
        """Returns (token ids, text, finish reason name, error name, message, usage)."""
        pb = self.pb
        req = pb.ClientRequest()
        g = req.generate
        g.client_tag = self.next_tag
        self.next_tag += 1
        if chat:
            m = g.messages.add()
            m.role = "user"
            m.content = prompt
        else:
            g.prompt = prompt
        g.max_tokens = max_tokens
        g.stream = stream
        g.sampling.seed = seed
        self._send(req)
        tokens, text = [], ""
        while True:
            rep = self._recv()
            kind = rep.WhichOneof("msg")
            if kind == "error" and rep.error.client_tag == g.client_tag:
                return (tokens, text, "error", pb.ServeError.Name(rep.error.error),
                        rep.error.message, None)
            if kind != "chunk" or rep.chunk.client_tag != g.client_tag:
                continue
            ch = rep.chunk
            tokens.extend(ch.token_ids)
            text += ch.text
            if on_chunk:
                on_chunk(ch)
            if ch.finish_reason != pb.FINISH_NONE:
                usage = {"prompt_tokens": ch.usage.prompt_tokens,
                         "completion_tokens": ch.usage.completion_tokens,
                         "ttft_us": ch.usage.ttft_us, "total_us": ch.usage.total_us}
                return (tokens, text, pb.FinishReason.Name(ch.finish_reason),
                        pb.ServeError.Name(ch.error), ch.message, usage)

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--router", default=os.environ.get("BD_ROUTER", "tcp://127.0.0.1:5555"))
    ap.add_argument("--proto-dir", default=PROTO_DIR)
    ap.add_argument("--out-dir", help="where protoc writes serve_pb2.py (default: a temp dir)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (0: the router's)")
    ap.add_argument("--raw", action="store_true", help="no chat template")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--timeout-ms", type=int, default=30000)
    ap.add_argument("--health", action="store_true")
    ap.add_argument("--info", action="store_true")
    ap.add_argument("--server-key", default=os.environ.get("BDFP4_SERVER_KEY"),
                    help="the router's CURVE public key file")
    ap.add_argument("--secret-key", default=os.environ.get("BDFP4_SECRET_KEY"),
                    help="this client's CURVE secret key file (bdfp4 keygen)")
    ap.add_argument("prompt", nargs="?")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pb = load_messages(a.proto_dir, a.out_dir or tmp)
        c = Client(pb, a.router, a.timeout_ms, a.server_key, a.secret_key)
        try:
            if a.health:
                h = c.health()
                print(json.dumps({"healthy": h.healthy,
                                  "state": pb.ServingState.Name(h.state),
                                  "reason": h.reason,
                                  "pool": {"ok": h.pool_ok, "error": h.pool_error,
                                           "last_ok_ms": h.pool_last_ok_ms},
                                  "workers": [w.pid for w in h.workers]}))
                return 0 if h.healthy else 1
            if a.info:
                s = c.info()
                print(json.dumps({"model": s.model, "kv_config": s.kv_config, "tp": s.tp,
                                  "n_vocab": s.n_vocab, "n_ctx": s.n_ctx}))
                return 0
            if not a.prompt:
                ap.error("a PROMPT is needed")

            def show(ch):
                if not a.json:
                    sys.stdout.write(ch.text)
                    sys.stdout.flush()

            toks, text, fin, err, msg, usage = c.generate(
                a.prompt, a.max_tokens, stream=not a.no_stream, chat=not a.raw, seed=a.seed,
                on_chunk=show)
            if a.json:
                print(json.dumps({"tokens": toks, "text": text, "finish": fin, "error": err,
                                  "message": msg, "usage": usage}))
            else:
                sys.stdout.write("\n")
            if fin in ("error", "FINISH_ERROR", "FINISH_CANCELLED"):
                sys.stderr.write("bdfp4_client.py: %s: %s\n" % (err, msg))
                return 1
            return 0
        except HandshakeError as e:
            sys.stderr.write("bdfp4_client.py: %s\n" % e)
            return 1
        finally:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
