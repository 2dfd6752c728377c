#!/usr/bin/env python3
"""Makes tests/data/mixed_precision_golden.json: fp32 master weights under bf16 / fp16 parameters, by torch.

    build/torch-venv/bin/python tests/scripts/make_mixed_precision_golden.py     # a few seconds, CPU

The pattern recorded (DeepSpeed's and torch AMP's with low-precision parameters): every rank
holds the model in a low dtype (bfloat16 or float16) with its own low-precision gradient; the
gradients are averaged over W ranks either in float32 or in the low dtype; an fp32 master copy
of the parameters is stepped by torch.optim.SGD(momentum=0.9, foreach=False) or
torch.optim.AdamW(foreach=False, fused=False) on the averaged gradient; the model's parameters
are then master.to(low dtype) (round to nearest even). W ranks are simulated in one process.

  reduce "float32":  grad = torch.stack([g.float() for g in rank_grads]).sum(0) / W
  reduce "low":      grad = (torch.stack([g.float() ...]).sum(0) / W).to(low).float()
                     (a sum in float32, one division, one rounding: what ddp's collectives do
                     with half-precision data, which they accumulate in float32)

Every value comes from integer formulas (below, and in `setup`) that the C++ test rebuilds:
parameters start at multiples of 2^-7 below 1 in magnitude, gradients are multiples of 2^-10 to
2^-12 with at most 8 significant bits, so they are exact in bfloat16 and float16 and every fp32
sum over ranks is exact in any order; the mean over ranks is then one rounded division in every
implementation, and SGD's masters can be compared bit for bit. The low-precision parameters and
fp32 masters are recorded after the steps in `record_steps` (per size) as hex: float32
struct.pack('<f').hex(), bfloat16 / float16 the 2-byte little-endian hex of the value's bits.
"""
import json
import os
import platform
import struct
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "mixed_precision_golden.json")

STEPS = 10
SIZES = [7, 1000]
RECORD_STEPS = {7: [1, 2, 5, 10], 1000: [10]}
WORLDS = [2, 3]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def init_value(j):  # the C++ test uses the same integer formulas
    return ((29 * j + 7) % 251 - 125) / 128.0


def grad_value(rank, step, j):  # step counts from 1
    n = (37 * j + 11 * step + 53 * rank) % 401 - 200
    return n / float(2 ** (10 + j % 3))


def low_hex(t):
    bits = t.contiguous().view(torch.int16).tolist()
    return "".join(struct.pack("<H", b & 0xFFFF).hex() for b in bits)


def f32_hex(t):
    return "".join(struct.pack("<f", v).hex() for v in t.tolist())


def run(low, n, world, reduce, opt_name):
    params = torch.tensor([init_value(j) for j in range(n)], dtype=torch.float64).to(low)
    master = torch.nn.Parameter(params.float())
    if opt_name == "sgd":
        opt = torch.optim.SGD([master], foreach=False, **SGD)
    else:
        opt = torch.optim.AdamW([master], foreach=False, fused=False, **ADAMW)
    after = {}
    for step in range(1, STEPS + 1):
        rank_grads = [torch.tensor([grad_value(r, step, j) for j in range(n)], dtype=torch.float64).to(low)
                      for r in range(world)]
        for r, g in enumerate(rank_grads):  # the formulas are exact in the low dtype
            assert torch.equal(g.double(), torch.tensor([grad_value(r, step, j) for j in range(n)], dtype=torch.float64))
        mean = torch.stack([g.float() for g in rank_grads]).sum(0) / world
        if reduce == "low":
            mean = mean.to(low).float()
        master.grad = mean
        opt.step()
        params = master.detach().to(low)
        if step in RECORD_STEPS[n]:
            after[str(step)] = {"params": low_hex(params), "master": f32_hex(master.detach())}
    return after


def main():
    cases = []
    for dname, low in DTYPES.items():
        for n in SIZES:
            for world in WORLDS:
                for reduce in ["float32", "low"]:
                    for opt_name in ["sgd", "adamw"]:
                        cases.append({"dtype": dname, "numel": n, "world_size": world, "reduce": reduce,
                                      "optimizer": opt_name, "after": run(low, n, world, reduce, opt_name)})
    golden = {
        "meta": {
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "made_by": "tests/scripts/make_mixed_precision_golden.py",
            "steps": STEPS,
        },
        "setup": {
            "init": "params[j] = low(((29 * j + 7) % 251 - 125) / 128); master = params.float()",
            "grad": "rank r, step s (from 1), element j: low(((37 * j + 11 * s + 53 * r) % 401 - 200) / 2 ** (10 + j % 3))",
            "reduce_float32": "torch.stack([g.float() for g in rank_grads]).sum(0) / W",
            "reduce_low": "(torch.stack([g.float() for g in rank_grads]).sum(0) / W).to(low).float()",
            "sgd": "torch.optim.SGD([master], foreach=False, lr=0.05, momentum=0.9)",
            "adamw": "torch.optim.AdamW([master], foreach=False, fused=False, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, "
                     "weight_decay=1e-2)",
            "after_step": "params = master.to(low)",
            "record_steps": {str(k): v for k, v in RECORD_STEPS.items()},
        },
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    print(OUT, os.path.getsize(OUT), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
