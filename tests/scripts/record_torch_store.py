#!/usr/bin/env python3
"""Records what a real PyTorch TCPStore client and server say to each other, byte for byte.

    build/torch-venv/bin/python tests/scripts/record_torch_store.py > tests/data/torch_store_exchanges.json

For each server backend (use_libuv=True and False) it starts a torch TCPStore server, puts a
logging TCP proxy in front of it, connects a torch client through the proxy, wraps the client in
the PrefixStore that torchrun's workers use (/worker/attempt_0), and makes one call at a time.
Each call's exchange is the ordered list of byte runs in each direction ("c": client to server,
"s": server to client), hex-encoded. tests/unit/torch_tcp_store_test.cpp replays them against
ddp::store::torch_tcp_store, so the test needs no torch. Run it again after a PyTorch upgrade and
compare.
"""
import json
import os
import platform
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PREFIX = "/worker/attempt_0"
# A request without an answer (set) has been forwarded once the proxy is idle this long.
QUIET_S = 0.25


class Proxy:
    """Accepts one connection and relays it to the server, logging each direction's bytes."""

    def __init__(self, upstream_port):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.runs = []  # [direction, bytearray], consecutive bytes of one direction merged
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._pump, args=(client, server, "c"), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, "s"), daemon=True).start()

    def _pump(self, src, dst, direction):
        while True:
            data = src.recv(65536)
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            with self.lock:  # log before forwarding: the answer cannot be logged ahead of its request
                if self.runs and self.runs[-1][0] == direction:
                    self.runs[-1][1].extend(data)
                else:
                    self.runs.append([direction, bytearray(data)])
            dst.sendall(data)

    def take(self):
        time.sleep(QUIET_S)
        with self.lock:
            runs, self.runs = self.runs, []
        return [[d, bytes(b).hex()] for d, b in runs]


def h(value):
    return (value.encode() if isinstance(value, str) else value).hex()


def record(use_libuv):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=use_libuv, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    proxy = Proxy(server.port)
    exchanges = []

    def call(name, args, fn):
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - recorded as the call's outcome
            result, error = None, type(e).__name__
        entry = {"call": name, "args": args, "steps": proxy.take()}
        if isinstance(result, (bytes, bytearray)):
            entry["result_hex"] = bytes(result).hex()
        elif isinstance(result, (bool, int)):
            entry["result"] = result
        if error is not None:
            entry["error"] = error
        exchanges.append(entry)
        return result

    raw = call("connect", {"nonce": os.getpid()},
               lambda: dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=30)))
    store = dist.PrefixStore(PREFIX, raw)

    def put(key, value, target=store, **extra):
        call("set", {"key": key, "value_hex": h(value), **extra}, lambda: target.set(key, value))

    def get(key, target=store, **extra):
        call("get", {"key": key, **extra}, lambda: target.get(key))

    def cas(key, expected, desired):
        call("compare_set", {"key": key, "expected_hex": h(expected), "desired_hex": h(desired)},
             lambda: store.compare_set(key, expected, desired))

    def wait(keys, ms):
        call("wait", {"keys": keys, "timeout_ms": ms}, lambda: store.wait(keys, timedelta(milliseconds=ms)))

    put("key", b"value")
    get("key")
    put("empty", b"")
    get("empty")
    put("binary", bytes(range(256)) + b"\x00" * 44)
    get("binary")
    call("add", {"key": "counter", "delta": 5}, lambda: store.add("counter", 5))
    call("add", {"key": "counter", "delta": -2}, lambda: store.add("counter", -2))
    get("counter")
    cas("cas", b"", b"first")
    cas("cas", b"wrong", b"second")
    cas("cas", b"first", b"second")
    cas("absent", b"expected", b"x")
    wait(["key", "counter"], 5000)
    for keys in (["key"], ["missing"], ["key", "missing"]):
        call("check", {"keys": keys}, lambda keys=keys: store.check(keys))
    wait(["missing"], 300)
    wait(["key", "missing"], 300)
    call("delete_key", {"key": "key"}, lambda: store.delete_key("key"))
    call("delete_key", {"key": "key"}, lambda: store.delete_key("key"))
    call("num_keys", {}, lambda: store.num_keys())
    # Without a PrefixStore: only the TCPStore's own "/" in front of the key.
    put("plain", b"v", target=raw, no_prefix=True)
    get("plain", target=raw, no_prefix=True)
    del store, raw
    del server
    return exchanges


def main():
    out = {
        "about": "Bytes between a torch.distributed.TCPStore client (wrapped in PrefixStore(prefix)) and a "
                 "TCPStore server, one call at a time; steps are [direction, hex] with c = client to server, "
                 "s = server to client. Made by tests/scripts/record_torch_store.py; do not edit, regenerate.",
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "prefix": PREFIX,
        "servers": [{"use_libuv": flag, "exchanges": record(flag)} for flag in (True, False)],
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
