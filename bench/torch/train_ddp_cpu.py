#!/usr/bin/env python3
"""The PyTorch DDP tutorial job on CPU/gloo: the reference examples/train_ddp is compared with.

Adapted from the script recorded in tests/data/training.json (W2_real_torchrun_gloo): same model,
data, sampler, optimizer and printed lines. Added: the sizes as options (the same names and defaults
as train_ddp), --init-seed (torch.manual_seed before building the model), and --report FILE with the
measurements train_ddp reports (training-loop time, throughput, peak RSS per rank, final accuracy
over the whole dataset, each sample once).

    torchrun --standalone --nnodes=1 --nproc-per-node=2 bench/torch/train_ddp_cpu.py --init-seed 0
"""
import argparse
import json
import os
import resource
import struct
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--features", type=int, default=10)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--data-seed", type=int, default=42)
    p.add_argument("--sampler-seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=None)
    p.add_argument("--report", default="")
    return p.parse_args()


def main():
    a = parse()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if a.init_seed is not None:
        torch.manual_seed(a.init_seed)  # identical initial weights on every rank
    model = DDP(nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes)))
    g = torch.Generator().manual_seed(a.data_seed)
    x = torch.randn(a.samples, a.features, generator=g)
    y = torch.randint(0, a.classes, (a.samples,), generator=g)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=a.sampler_seed)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss_fn = nn.CrossEntropyLoss()
    sums, steps, processed = [], [], 0
    dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for inputs, targets in loader:
            opt.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            opt.step()
            total += loss.item()
            steps.append(loss.item())
            processed += len(targets)
        sums.append(total)
        if rank == 0:
            print(f"Epoch {epoch + 1}: Rank 0 local loss sum = {total:.4f}", flush=True)
    dist.barrier()
    loop = time.perf_counter() - t0

    # Exact evaluation: rank r takes samples r, r + W, ... (each sample once).
    with torch.no_grad():
        out = model.module(x[rank::world])
        stats = torch.tensor([(out.argmax(1) == y[rank::world]).sum().item(), out.shape[0],
                              nn.functional.cross_entropy(out, y[rank::world], reduction="sum").item(), processed],
                             dtype=torch.float64)
    dist.all_reduce(stats)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    all_sums = [None] * world
    dist.all_gather_object(all_sums, sums)
    if rank == 0 and a.report:
        report = {
            "build": "pytorch-" + torch.__version__, "backend": "gloo", "world_size": world,
            "epochs": a.epochs, "batch_size": a.batch_size, "samples": a.samples, "features": a.features,
            "hidden": a.hidden, "classes": a.classes, "lr": a.lr,
            "epoch_loss_sums_by_rank": all_sums, "step_losses_rank0": steps,
            "train_loop_seconds": loop, "throughput_samples_per_s": stats[3].item() / loop,
            "peak_rss_bytes_by_rank": [int(r.item()) for r in all_rss],
            "eval_samples": int(stats[1].item()), "final_accuracy": stats[0].item() / stats[1].item(),
            "final_mean_loss": stats[2].item() / stats[1].item(),
            "final_params_bits": [struct.unpack("<I", struct.pack("<f", v))[0]
                                  for _, p in model.module.named_parameters() for v in p.detach().flatten().tolist()],
        }
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
