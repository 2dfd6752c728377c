#!/usr/bin/env python3
"""Load a ddp checkpoint (ddp/checkpoint.hpp) of train_ddp into the PyTorch tutorial model.

    load_checkpoint.py CKPT                      # CKPT: a --checkpoint-dir (newest complete step) or a step-N dir
    load_checkpoint.py CKPT --expect-report r.json   # also: parameters == train_ddp's final_params_bits

Checks every file against index.json (size, zlib CRC-32), reads replicated.safetensors with the
safetensors package when it is installed (and with the few lines below in any case; both must
agree), builds bench/torch/train_ddp_cpu.py's model, nn.Sequential(nn.Linear(features, hidden),
nn.ReLU(), nn.Linear(hidden, classes)), with the sizes the tensors have, loads the "model."
tensors with load_state_dict(strict=True), and checks that the model's parameters are bit for bit
the saved ones. Prints the step, sampler position and per-rank tensors. Exit 0 when all holds.
"""

import argparse
import json
import os
import struct
import sys
import zlib

import torch
from torch import nn

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}


def read_safetensors(data):
    """safetensors by hand: u64 little-endian header length, JSON header, tensor bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out, meta = {}, header.pop("__metadata__", {})
    for name, t in header.items():
        begin, end = t["data_offsets"]
        raw = bytearray(body[begin:end])
        tensor = torch.frombuffer(raw, dtype=DTYPES[t["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[t["dtype"]])
        out[name] = tensor.reshape(t["shape"]).clone()
    return out, meta


def complete(step_dir):
    """Empty when step_dir is complete and intact, else why not."""
    if not os.path.exists(os.path.join(step_dir, "DONE")):
        return "no DONE marker"
    try:
        with open(os.path.join(step_dir, "index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        return "bad index.json: %s" % e
    for entry in index["files"]:
        path = os.path.join(step_dir, entry["path"])
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return entry["path"] + " is missing"
        if len(data) != entry["bytes"] or zlib.crc32(data) != entry["crc32"]:
            return entry["path"] + ": size or CRC-32 differs from index.json"
    return ""


def find_checkpoint(path):
    if os.path.exists(os.path.join(path, "index.json")):
        return path
    steps = sorted((n for n in os.listdir(path) if n.startswith("step-") and n[5:].isdigit()),
                   key=lambda n: int(n[5:]), reverse=True)
    for name in steps:
        why = complete(os.path.join(path, name))
        if not why:
            return os.path.join(path, name)
        print("load_checkpoint: skipping %s: %s" % (name, why), file=sys.stderr)
    raise SystemExit("load_checkpoint: no complete checkpoint under " + path)


def bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--expect-report", help="train_ddp --report JSON whose final_params_bits the parameters must equal")
    a = ap.parse_args()
    step_dir = find_checkpoint(a.checkpoint)
    why = complete(step_dir)
    if why:
        raise SystemExit("load_checkpoint: %s: %s" % (step_dir, why))
    with open(os.path.join(step_dir, "index.json")) as f:
        index = json.load(f)
    with open(os.path.join(step_dir, "replicated.safetensors"), "rb") as f:
        raw = f.read()
    tensors, meta = read_safetensors(raw)
    try:
        from safetensors.torch import load as st_load
    except ImportError:
        print("load_checkpoint: the safetensors package is not installed; read by hand only")
    else:
        theirs = st_load(raw)
        if theirs.keys() != tensors.keys() or any(not torch.equal(bits(theirs[k]), bits(tensors[k]))
                                                  for k in tensors if tensors[k].is_floating_point()):
            raise SystemExit("load_checkpoint: safetensors reads other tensors than the hand-written reader")
        print("load_checkpoint: safetensors %s reads the same %d tensors" % (
            __import__("safetensors").__version__, len(theirs)))

    state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    hidden, features = state["0.weight"].shape
    classes = state["2.weight"].shape[0]
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    model.load_state_dict(state, strict=True)
    for name, p in model.named_parameters():
        if not torch.equal(bits(p), bits(state[name])):
            raise SystemExit("load_checkpoint: parameter %s differs after load_state_dict" % name)
    print("load_checkpoint: %s: step %d, world size %d, sampler %s" % (
        step_dir, index["step"], index["world_size"], index["sampler"]))
    print("load_checkpoint: model Linear(%d, %d) ReLU Linear(%d, %d): %d parameters loaded bit for bit" % (
        features, hidden, hidden, classes, sum(p.numel() for p in model.parameters())))
    for r in range(index["world_size"]):
        with open(os.path.join(step_dir, "rank-%05d.safetensors" % r), "rb") as f:
            per_rank, _ = read_safetensors(f.read())
        print("load_checkpoint: rank %d: %s" % (r, ", ".join("%s %s" % (k, list(v.shape)) for k, v in per_rank.items())))

    if a.expect_report:
        with open(a.expect_report) as f:
            expected = json.load(f)["final_params_bits"]
        flat = torch.cat([bits(p).reshape(-1) for p in model.parameters()]).tolist()
        flat = [v & 0xffffffff for v in flat]
        if flat != expected:
            diff = sum(1 for x, y in zip(flat, expected) if x != y)
            raise SystemExit("load_checkpoint: %d of %d parameters differ from %s" % (diff, len(expected), a.expect_report))
        print("load_checkpoint: equal to final_params_bits of %s (%d values)" % (a.expect_report, len(flat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
