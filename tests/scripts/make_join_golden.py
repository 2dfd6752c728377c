#!/usr/bin/env python3
"""Makes tests/data/join_golden.json: DDP with uneven inputs under torch's Join, done by real PyTorch.

    build/torch-venv/bin/python tests/scripts/make_join_golden.py      # a few seconds, CPU, gloo

W = 3 processes (torch.multiprocessing, gloo over loopback) with 3, 5 and 7 batches each train
nn.Linear(3, 2) (MSELoss, mean over batch x outputs, 4 samples a batch) with SGD lr 0.125 under
`with Join([model], divide_by_initial_world_size=...)`, for both values of the option; the final
weight and bias of every rank are recorded (they are equal: Join broadcasts the last joiner's).
Every input, target and initial value is a small multiple of a power of two, so the C++ test
rebuilds them exactly from the formulas below (x_of, y_of, the init) instead of reading them.
join_test compares its own run (ddp::join_context) with these values.
"""
import json
import os
import platform
import socket
import struct
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "join_golden.json")
WORLD = 3
BATCHES = [3, 5, 7]
BATCH = 4
N_IN, N_OUT = 3, 2
LR = 0.125


def x_of(r, b, n, i):  # the C++ test uses the same integer formulas
    return ((7 * r + 3 * b + 5 * n + 11 * i) % 13 - 6) / 8.0


def y_of(r, b, n, k):
    return ((5 * r + 2 * b + 3 * n + 7 * k) % 11 - 5) / 4.0


def init_weight(k, i):
    return ((3 * k + i) % 5 - 2) / 8.0


def init_bias(k):
    return (2 * k - 1) / 8.0


def hexes(t):
    return "".join(struct.pack("<f", float(v)).hex() for v in t.detach().reshape(-1).tolist())


def worker(rank, port, divide, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Linear(N_IN, N_OUT)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[init_weight(k, i) for i in range(N_IN)] for k in range(N_OUT)]))
        model.bias.copy_(torch.tensor([init_bias(k) for k in range(N_OUT)]))
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    with Join([net], divide_by_initial_world_size=divide):
        for b in range(BATCHES[rank]):
            x = torch.tensor([[x_of(rank, b, n, i) for i in range(N_IN)] for n in range(BATCH)])
            y = torch.tensor([[y_of(rank, b, n, k) for k in range(N_OUT)] for n in range(BATCH)])
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
    queue.put((rank, hexes(model.weight), hexes(model.bias)))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(divide):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, divide, queue)) for port in [free_port()] for r in range(WORLD)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    assert all(g[1:] == got[0][1:] for g in got), "ranks differ after Join"
    return {"weight": got[0][1], "bias": got[0][2]}


def main():
    torch.set_num_threads(1)
    result = {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "made_by": "tests/scripts/make_join_golden.py",
        },
        "setup": {
            "world": WORLD, "batches": BATCHES, "batch": BATCH, "n_in": N_IN, "n_out": N_OUT, "lr": LR,
            "model": "nn.Linear(3, 2), nn.MSELoss() (mean), torch.optim.SGD(lr), DDP default buckets, gloo",
            "x": "((7r + 3b + 5n + 11i) % 13 - 6) / 8", "y": "((5r + 2b + 3n + 7k) % 11 - 5) / 4",
            "weight0": "((3k + i) % 5 - 2) / 8", "bias0": "(2k - 1) / 8",
        },
        "divide_by_initial_world_size": {"true": run(True), "false": run(False)},
    }
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["divide_by_initial_world_size"], indent=1))


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    main()
