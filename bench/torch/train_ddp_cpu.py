#!/usr/bin/env python3
"""The PyTorch DDP tutorial job on CPU/gloo: the reference examples/train_ddp is compared with.

Adapted from the script recorded in tests/data/training.json (W2_real_torchrun_gloo): same model,
data, sampler, optimizer and printed lines. Added: the sizes as options (the same names and defaults
as train_ddp), --init-seed (torch.manual_seed before building the model), and --report FILE with the
measurements train_ddp reports (training-loop time, throughput, peak RSS per rank, final accuracy
over the whole dataset, each sample once).

--dataset digits is train_ddp's: examples/data/digits.csv (tools/make_digits.py), features =
pixel / 16, MLP 64-hidden-10, the same defaults (--epochs 10 --lr 0.1 --hidden 64 --warmup-epochs 2),
held-out accuracy and loss after every epoch (rank r evaluates held-out samples r, r + W, ...), and
--lr-scaling none|linear with --warmup-epochs and --base-batch (the lr of each step computed as
train_ddp's lr_schedule does, in the same double operations).

    torchrun --standalone --nnodes=1 --nproc-per-node=2 bench/torch/train_ddp_cpu.py --init-seed 0
    torchrun --standalone --nnodes=1 --nproc-per-node=2 bench/torch/train_ddp_cpu.py --dataset digits --init-seed 0

--optimizer sgd|adamw (--momentum, --weight-decay), --clip and --zero are train_ddp's too:
torch.optim.SGD / AdamW with foreach=False, torch.nn.utils.clip_grad_norm_ over the model's
parameters before each step, and --zero 1 wraps the optimizer in
torch.distributed.optim.ZeroRedundancyOptimizer (each rank steps its share of the parameters, then
broadcasts them).

--precision bf16|fp16 is train_ddp's mixed precision, written out in torch: the model holds its
parameters rounded to bfloat16 / float16 (in float32 tensors, so the forward and backward compute
in float32 on exactly those values), each rank's gradients are rounded to the same type before a
DDP comm hook averages them in float32, and the optimizer steps a float32 master copy, which the
model gets back rounded to nearest even after each step. fp16 scales the loss with
torch.amp.GradScaler (its defaults; --loss-scale sets init_scale), which unscales the master gradients, skips the steps whose
gradients overflowed and backs off; bf16 has no scaler.
"""
import argparse
import csv
import json
import math
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


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# train_ddp's defaults: the tutorial's, and --dataset digits' own (options.hpp, digits_defaults).
DEFAULTS = {"tutorial": {"epochs": 3, "lr": 0.01, "hidden": 32, "warmup_epochs": 0},
            "digits": {"epochs": 10, "lr": 0.1, "hidden": 64, "warmup_epochs": 2}}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["tutorial", "digits"], default="tutorial")
    p.add_argument("--data", default=os.path.join(ROOT, "examples", "data", "digits.csv"))
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--features", type=int, default=10)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--data-seed", type=int, default=42)
    p.add_argument("--sampler-seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=None)
    p.add_argument("--lr-scaling", choices=["none", "linear"], default="none")
    p.add_argument("--warmup-epochs", type=int, default=None)
    p.add_argument("--base-batch", type=int, default=0)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--zero", type=int, choices=[0, 1], default=0)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--loss-scale", type=float, default=65536.0)  # fp16: GradScaler's init_scale
    p.add_argument("--report", default="")
    a = p.parse_args(argv)
    for key, value in DEFAULTS[a.dataset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.dataset == "digits":
        a.features, a.classes = 64, 10
    if a.precision != "fp32" and a.zero != 0:
        p.error("--precision bf16/fp16 is written out for --zero 0 only")
    return a


def load_digits(path):
    """(train x, train y, held-out x, held-out y): rows in file order, features = pixel / 16."""
    parts = {"train": ([], []), "heldout": ([], [])}
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(line for line in f if not line.startswith("#"))]
    for r in rows[1:]:
        parts[r[0]][0].append([int(v) for v in r[3:]])
        parts[r[0]][1].append(int(r[2]))
    out = []
    for name in ("train", "heldout"):
        x, y = parts[name]
        out += [torch.tensor(x, dtype=torch.uint8).to(torch.float32) / 16, torch.tensor(y, dtype=torch.int64)]
    return out


def make_data(a):
    """(x, y, held-out x or None, held-out y or None)."""
    if a.dataset == "digits":
        return load_digits(a.data)
    g = torch.Generator().manual_seed(a.data_seed)
    x = torch.randn(a.samples, a.features, generator=g)
    y = torch.randint(0, a.classes, (a.samples,), generator=g)
    return x, y, None, None


def lr_schedule(a, world, steps_per_epoch):
    """train_ddp's lr_schedule: lr of step t = 0, 1, ... (linear: Goyal et al. 2017)."""
    base_batch = a.base_batch if a.base_batch > 0 else a.batch_size
    peak = a.lr * (a.batch_size * world / base_batch) if a.lr_scaling == "linear" else a.lr
    warmup_steps = a.warmup_epochs * steps_per_epoch
    return (lambda t: a.lr + (peak - a.lr) * t / warmup_steps if t < warmup_steps else peak), peak


def heldout_sums(model, x, y, rank, world):
    """[correct, count, loss sum] over samples rank, rank + W, ...: the loss of each sample in
    float32 (log_softmax picked at the label), summed in order in double as train_ddp does."""
    out = model(x[rank::world])
    picked = torch.log_softmax(out, 1).gather(1, y[rank::world].unsqueeze(1)).flatten().tolist()
    loss = 0.0
    for v in picked:
        loss -= v
    return [float((out.argmax(1) == y[rank::world]).sum().item()), float(out.shape[0]), loss]


def make_optimizer(a, params):
    """--optimizer with its options (torch's defaults where not given), under
    ZeroRedundancyOptimizer with --zero 1."""
    kwargs = {"lr": a.lr, "foreach": False}
    if a.optimizer == "sgd":
        cls = torch.optim.SGD
        kwargs["momentum"] = a.momentum
    else:
        cls = torch.optim.AdamW
    if a.weight_decay is not None:
        kwargs["weight_decay"] = a.weight_decay
    if a.zero == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def round_then_average(low, world):
    """A DDP comm hook: this rank's gradients as stored in `low`, averaged in float32."""
    def hook(_state, bucket):
        t = bucket.buffer()
        t.copy_(t.to(low).float())
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0].div_(world))
    return hook


def main():
    a = parse()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if a.init_seed is not None:
        torch.manual_seed(a.init_seed)  # identical initial weights on every rank
    net = nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    master = None
    if low is not None:
        with torch.no_grad():
            for q in net.parameters():
                q.copy_(q.to(low).float())
        master = [nn.Parameter(q.detach().clone()) for q in net.parameters()]
    model = DDP(net)
    if low is not None:
        model.register_comm_hook(None, round_then_average(low, world))
    scaler = torch.amp.GradScaler("cpu", init_scale=a.loss_scale, enabled=a.precision == "fp16")
    stepped = list(model.parameters()) if master is None else master
    x, y, hx, hy = make_data(a)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=a.sampler_seed)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler)
    opt = make_optimizer(a, stepped)
    loss_fn = nn.CrossEntropyLoss()
    lr_at, peak_lr = lr_schedule(a, world, len(loader))
    sums, steps, processed, step, eval_s, clipped, skipped = [], [], 0, 0, 0.0, 0, 0
    heldout_acc, heldout_loss = [], []
    dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for inputs, targets in loader:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            step += 1
            opt.zero_grad()
            model.zero_grad()
            loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            if master is not None:
                for q, m in zip(net.parameters(), master):
                    m.grad = q.grad.detach().clone()
            scaler.unscale_(opt)
            if a.clip > 0:  # an overflowed step's norm is inf or nan, and the step is skipped
                norm = nn.utils.clip_grad_norm_(stepped, a.clip).item()
                clipped += int(math.isfinite(norm) and norm > a.clip)
            scale = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.is_enabled() and scaler.get_scale() < scale)
            if master is not None:
                with torch.no_grad():
                    for q, m in zip(net.parameters(), master):
                        q.copy_(m.to(low).float())
            total += loss.item()
            steps.append(loss.item())
            processed += len(targets)
        sums.append(total)
        if rank == 0:
            print(f"Epoch {epoch + 1}: Rank 0 local loss sum = {total:.4f}", flush=True)
        if hx is not None:  # the held-out split, each sample once; not part of the training time
            e0 = time.perf_counter()
            with torch.no_grad():
                h = torch.tensor(heldout_sums(model.module, hx, hy, rank, world), dtype=torch.float64)
            dist.all_reduce(h)
            heldout_acc.append(h[0].item() / h[1].item())
            heldout_loss.append(h[2].item() / h[1].item())
            if rank == 0:
                print(f"Epoch {epoch + 1}: held-out accuracy {heldout_acc[-1]:.4f} loss {heldout_loss[-1]:.4f}", flush=True)
            eval_s += time.perf_counter() - e0
    dist.barrier()
    loop = time.perf_counter() - t0 - eval_s

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
            "epochs": a.epochs, "batch_size": a.batch_size, "samples": len(y), "features": a.features,
            "hidden": a.hidden, "classes": a.classes, "lr": a.lr, "dataset": a.dataset,
            "lr_scaling": a.lr_scaling, "warmup_epochs": a.warmup_epochs, "global_batch": a.batch_size * world,
            "peak_lr": peak_lr, "optimizer": a.optimizer, "momentum": a.momentum, "clip": a.clip, "zero": a.zero,
            "clipped_steps_rank0": clipped, "precision": a.precision, "skipped_steps": skipped,
            "final_loss_scale": scaler.get_scale() if scaler.is_enabled() else 1.0,
            "epoch_loss_sums_by_rank": all_sums, "step_losses_rank0": steps,
            "train_loop_seconds": loop, "throughput_samples_per_s": stats[3].item() / loop,
            "peak_rss_bytes_by_rank": [int(r.item()) for r in all_rss],
            "eval_samples": int(stats[1].item()), "final_accuracy": stats[0].item() / stats[1].item(),
            "final_mean_loss": stats[2].item() / stats[1].item(),
            "final_params_bits": [struct.unpack("<I", struct.pack("<f", v))[0]
                                  for _, p in model.module.named_parameters() for v in p.detach().flatten().tolist()],
        }
        if hx is not None:
            report.update({"heldout_samples": len(hy), "heldout_accuracy_by_epoch": heldout_acc,
                           "heldout_loss_by_epoch": heldout_loss, "heldout_accuracy": heldout_acc[-1],
                           "heldout_mean_loss": heldout_loss[-1]})
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    # Every rank leaves together: a gloo rank that tears down while a peer is still sending aborts
    # in a destructor ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
