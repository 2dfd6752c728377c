#!/usr/bin/env python3
"""Writes the seed corpus of ddp_fuzz_store_frames (input format: store_frames_fuzz.cpp).

Run from anywhere: python3 tests/fuzz/make_corpus.py. Seeds cover every opcode, a parked get
answered by another connection, wait timeouts, the handshake byte by byte, a wrong magic, a wrong
version, a client of the same and of another job, an oversized header, and a large frame that
stalls past the frame timeout.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")

SET, GET, ADD, CAS, WAIT, ERASE, NUM = range(1, 8)


def req(op, key=b"", value=b""):
    return struct.pack("<BII", op, len(key), len(value)) + key + value


def get(key, timeout_ms):
    return req(GET, key, struct.pack("<Q", timeout_ms))


def add(key, delta):
    return req(ADD, key, struct.pack("<q", delta))


def cas(key, expected, desired):
    return req(CAS, key, struct.pack("<I", len(expected)) + expected + desired)


def wait(keys, timeout_ms):
    body = struct.pack("<QI", timeout_ms, len(keys)) + b"".join(struct.pack("<I", len(k)) + k for k in keys)
    return req(WAIT, b"", body)


def hello(version=3):
    return struct.pack("<IHH", 0x53504444, version, 0) + bytes(range(32))  # magic, version, client nonce


def proof(job=b"", mac=bytes(32)):
    return mac + job + bytes(64 - len(job))  # the client's proof, then its job


HELLO = hello()
ZERO_PROOF = proof()


def recv(conn, data):
    out = b""
    for i in range(0, len(data), 255):  # one receive command carries at most 255 bytes
        piece = data[i:i + 255]
        out += bytes([conn & 3, len(piece)]) + piece
    return out


def drain(conn, n=255):
    return bytes([(1 << 2) | (conn & 3), n])


def tick(ms10):
    return bytes([(2 << 2), ms10])


def reopen(conn):
    return bytes([(3 << 2) | (conn & 3), 0])


seeds = {
    "all_ops": bytes([2 << 1]) + recv(0, req(SET, b"a", b"1") + get(b"a", 10) + add(b"n", 5) + cas(b"a", b"1", b"2")
                                   + wait([b"a", b"n"], 10) + req(ERASE, b"a") + req(NUM)) + drain(0),
    "parked_get": bytes([2 << 1]) + recv(0, get(b"late", 1000)) + recv(1, req(SET, b"late", b"v")) + drain(0) + drain(1),
    "wait_timeout": bytes([1 << 1]) + recv(0, wait([b"x", b"y"], 50)) + tick(10) + drain(0),
    "handshake_bytes": bytes([0]) + b"".join(recv(0, bytes([b])) for b in HELLO + ZERO_PROOF) + recv(0, req(NUM)) + drain(0),
    "token_wrong_proof": bytes([1]) + recv(0, HELLO + proof(mac=bytes([7]) * 32)) + drain(0),
    "token_good": bytes([1 | (1 << 1)]) + recv(0, req(SET, b"k", b"v")) + reopen(0) + drain(0),
    "bad_magic": bytes([0]) + recv(0, b"GET / HTTP/1.1\r\n\r\n"),
    "bad_version": bytes([0]) + recv(0, hello(2) + bytes(32)) + drain(0),
    "same_job": bytes([0]) + recv(0, HELLO + proof(b"fuzz-job") + req(NUM)) + drain(0),
    "other_job": bytes([0]) + recv(0, HELLO + proof(b"another-job") + req(NUM)) + drain(0),
    "oversized": bytes([1 << 1]) + recv(0, struct.pack("<BII", SET, 1, 64 * 1024 * 1024 + 1) + b"k"),
    "split_frames": bytes([3 << 1]) + recv(0, req(SET, b"key", b"value")[:5]) + recv(1, add(b"c", 1)) +
                    recv(0, req(SET, b"key", b"value")[5:]) + recv(2, get(b"key", 0)) + drain(2),
    "handshake_timeout": bytes([0]) + recv(0, HELLO[:3]) + tick(100),
    "backlog": bytes([1 << 1]) + recv(0, req(SET, b"big", b"x" * 240)) + recv(0, get(b"big", 0) * 20) + drain(0, 1),
    # A frame over small_frame_bytes waits for the budget, then stalls past the frame timeout.
    "large_frame": bytes([2 << 1]) + recv(0, struct.pack("<BII", SET, 1, 1 << 20) + b"k" + b"v" * 200) +
                   recv(1, struct.pack("<BII", SET, 1, 1 << 20) + b"k") + tick(255) * 25 + recv(1, b"v" * 100),
}

os.makedirs(OUT, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"wrote {len(seeds)} seeds to {OUT}")
