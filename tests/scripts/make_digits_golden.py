#!/usr/bin/env python3
"""Makes tests/data/digits_golden.json: train_ddp --dataset digits done by real PyTorch.

    $(tools/torch-venv.sh)/bin/python tests/scripts/make_digits_golden.py     # about a minute on 2 cores

The job is bench/torch/train_ddp_cpu.py --dataset digits --init-seed 0 (its data loading, lr
schedule and held-out evaluation are imported from there, so the two cannot drift apart), run two
ways for each configuration:
  simulated       one process, W replicas: every step each replica's gradients, then for every
                  parameter g = (g_0 + g_1 + ...) / W in float32 (rank order), given to every
                  replica before its SGD step (replicas asserted bit-identical after every step);
                  train_ddp --simulate-world W does the same;
  torchrun_gloo   the script itself under torchrun --standalone with gloo (real DDP: each bucket
                  divided by W, then all-reduced), compared with the simulation.
Configurations: strong scaling at the default global batch 32 (W = 1, 2, 4 with per-rank batch
32 / W), and weak scaling with the linear rule at W = 4 (per-rank batch 32, --lr-scaling linear,
--base-batch 32, the default --warmup-epochs 2).
"""
import copy
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile

import numpy
import torch
from torch import nn
from torch.utils.data.distributed import DistributedSampler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "torch"))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import train_ddp_cpu as job  # noqa: E402

CONFIGS = {  # name: (world, train_ddp / train_ddp_cpu.py options besides --dataset digits --init-seed 0)
    "W1_b32": (1, ["--batch-size", "32"]),
    "W2_b16": (2, ["--batch-size", "16"]),
    "W4_b8": (4, ["--batch-size", "8"]),
    "W4_b32_linear": (4, ["--batch-size", "32", "--lr-scaling", "linear", "--base-batch", "32"]),
}


def hexf(v):
    return struct.pack("<f", v).hex()


def floats(values):
    return {"hex": [hexf(v) for v in values], "dec": [float(format(v, ".9g")) for v in values]}


def packed(named_parameters):
    """Parameters as one string of hexf() per tensor (8 hex digits per value, in flatten() order)."""
    return {n: {"shape": list(p.shape), "hex": "".join(hexf(v) for v in p.detach().flatten().tolist())}
            for n, p in named_parameters}


class LenOnly:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def simulate(world, argv):
    a = job.parse(["--dataset", "digits", "--init-seed", "0"] + argv)
    x, y, hx, hy = job.load_digits(a.data)
    torch.manual_seed(a.init_seed)
    model = nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes))
    initial = packed(model.named_parameters())
    replicas = [model] + [copy.deepcopy(model) for _ in range(world - 1)]
    samplers = [DistributedSampler(LenOnly(len(y)), num_replicas=world, rank=r, shuffle=True, seed=a.sampler_seed)
                for r in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=a.lr) for m in replicas]
    steps_per_epoch = (len(samplers[0]) + a.batch_size - 1) // a.batch_size
    lr_at, peak = job.lr_schedule(a, world, steps_per_epoch)
    loss_fn = nn.CrossEntropyLoss()
    lines, sums, step_losses, acc, hloss = [], [[] for _ in range(world)], [], [], []
    step = 0
    for epoch in range(a.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        order = [list(s) for s in samplers]
        totals, epoch_steps = [0.0] * world, [[] for _ in range(world)]
        for start in range(0, len(order[0]), a.batch_size):
            grads = []
            for r, (m, opt) in enumerate(zip(replicas, opts)):
                batch = order[r][start:start + a.batch_size]
                opt.zero_grad()
                loss = loss_fn(m(x[batch]), y[batch])
                loss.backward()
                totals[r] += loss.item()
                epoch_steps[r].append(loss.item())
                grads.append([p.grad.clone() for p in m.parameters()])
            mean = [sum(gs[1:], gs[0].clone()) / world if world > 1 else gs[0] for gs in zip(*grads)]
            lr = lr_at(step)
            step += 1
            for m, opt in zip(replicas, opts):
                for p, g in zip(m.parameters(), mean):
                    p.grad.copy_(g)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            for m in replicas[1:]:
                assert all(torch.equal(p, q) for p, q in zip(m.parameters(), replicas[0].parameters()))
        for r in range(world):
            sums[r].append(totals[r])
        step_losses.append(floats(epoch_steps[0]))
        lines.append(f"Epoch {epoch + 1}: Rank 0 local loss sum = {totals[0]:.4f}")
        with torch.no_grad():
            parts = [job.heldout_sums(model, hx, hy, r, world) for r in range(world)]
        h = [sum(p[i] for p in parts) for i in range(3)]  # rank order, as train_ddp --simulate-world
        acc.append(h[0] / h[1])
        hloss.append(h[2] / h[1])
        lines.append(f"Epoch {epoch + 1}: held-out accuracy {acc[-1]:.4f} loss {hloss[-1]:.4f}")
    return {
        "world_size": world, "args": ["--dataset", "digits", "--init-seed", "0"] + argv,
        "batch_size_per_rank": a.batch_size, "global_batch": a.batch_size * world, "epochs": a.epochs, "lr": a.lr,
        "hidden": a.hidden, "lr_scaling": a.lr_scaling, "warmup_epochs": a.warmup_epochs, "peak_lr": peak,
        "num_samples_per_rank": len(samplers[0]), "steps_per_epoch": steps_per_epoch,
        "printed_lines": lines, "epoch_loss_sums_by_rank": sums, "step_losses_rank0": step_losses,
        "heldout_accuracy_by_epoch": acc, "heldout_loss_by_epoch": hloss,
        "final_params": packed(model.named_parameters()),
    }, initial


def torchrun(world, argv, simulated):
    torchrun_exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [torchrun_exe, "--standalone", "--nnodes=1", f"--nproc-per-node={world}",
               os.path.join(ROOT, "bench", "torch", "train_ddp_cpu.py"), "--dataset", "digits", "--init-seed", "0"] + argv
        for attempt in range(3):  # gloo occasionally aborts at start-up on this machine (bench/torch/compare.py)
            p = subprocess.run(cmd + ["--report", report], capture_output=True, text=True, timeout=900)
            if p.returncode == 0:
                break
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        with open(report) as f:
            rep = json.load(f)
    lines = [l for l in p.stdout.splitlines() if l.startswith("Epoch ")]
    sim_steps = [v for e in simulated["step_losses_rank0"] for v in e["hex"]]
    real_steps = [hexf(v) for v in rep["step_losses_rank0"]]
    sim_hex = "".join(t["hex"] for t in simulated["final_params"].values())
    sim_params = [sim_hex[i:i + 8] for i in range(0, len(sim_hex), 8)]
    real_params = [struct.pack("<I", b).hex() for b in rep["final_params_bits"]]  # the same bytes as '<f'
    return {
        "command": " ".join(["torchrun"] + cmd[1:]),
        "printed_lines": lines,
        "epoch_loss_sums_by_rank": rep["epoch_loss_sums_by_rank"],
        "heldout_accuracy_by_epoch": rep["heldout_accuracy_by_epoch"],
        "heldout_loss_by_epoch": rep["heldout_loss_by_epoch"],
        "check_vs_simulated": {
            "printed_lines_identical": lines == simulated["printed_lines"],
            "step_losses_rank0_identical": sum(a == b for a, b in zip(sim_steps, real_steps)),
            "step_losses_rank0_total": len(sim_steps),
            "final_params_identical": sum(a == b for a, b in zip(sim_params, real_params)),
            "final_params_total": len(sim_params),
        },
    }


def tutorial_vs_training_json():
    """The tutorial job at W = 1 on this machine against training.json (made on an Intel Xeon): how
    many step losses are bit-identical. Fewer than all means this CPU's BLAS rounds differently."""
    with open(os.path.join(ROOT, "tests", "data", "training.json")) as f:
        want = [h for e in json.load(f)["W1_simulated"]["step_losses_by_rank"][0] for h in e["hex"]]
    a = job.parse(["--init-seed", "0"])
    x, y, _, _ = job.make_data(a)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    sampler = DistributedSampler(LenOnly(len(y)), num_replicas=1, rank=0, shuffle=True, seed=0)
    got = []
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), a.batch_size):
            batch = order[start:start + a.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            got.append(hexf(loss.item()))
    same = [g == w for g, w in zip(got, want)]
    return {"step_losses_identical": sum(same), "step_losses_total": len(want),
            "first_difference": same.index(False) if not all(same) else None}


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    torch.set_num_threads(1)
    out = {
        "meta": {
            "torch_version": torch.__version__, "numpy_version": numpy.__version__,
            "python_version": platform.python_version(), "cpu_capability_used": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY_env": os.environ.get("ATEN_CPU_CAPABILITY"), "platform": platform.platform(),
            "libc": " ".join(platform.libc_ver()), "cpu_model": cpu_model(), "torch_num_threads": 1,
            "blas": "MKL (torch.__config__.show())",
            "float_hex_encoding": "struct.pack('<f', x).hex(); final_params/initial_params: those 8-digit strings "
                                  "concatenated per tensor, in flatten() order",
            "float_dec_encoding": "float(format(x, '.9g'))",
            "made_by": "tests/scripts/make_digits_golden.py",
            "tutorial_W1_vs_training_json": tutorial_vs_training_json(),
            "note": "training.json was made on an Intel Xeon, whose MKL sgemm train_ddp's exact GEMM follows (one "
                    "fused multiply-add chain over k). On other CPUs MKL may take other kernels: "
                    "tutorial_W1_vs_training_json says how far this machine's torch agrees with the Xeon's on the "
                    "tutorial job; where it is not all, train_ddp matches these values to the printed precision, "
                    "not bit for bit",
        },
        "setup": {
            "data": "examples/data/digits.csv (tools/make_digits.py): training rows (1437) and held-out rows (360) in file "
                    "order, features = uint8 pixel / 16 as float32, labels int64",
            "model": "torch.manual_seed(0); nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))",
            "loader": "per rank r: DistributedSampler(train, num_replicas=W, rank=r, shuffle=True, seed=0, "
                      "drop_last=False) + set_epoch(epoch); consecutive batch_size chunks, last partial batch kept",
            "optimizer": "SGD (no momentum, no weight decay); before step t (t = 0, 1, ... over the run) lr = "
                         "lr_schedule(t): base = 0.1, peak = base * (batch * W / base_batch) with --lr-scaling "
                         "linear else base, warmup_steps = warmup_epochs * steps_per_epoch, lr = base + (peak - "
                         "base) * t / warmup_steps while t < warmup_steps, else peak (double)",
            "loss": "nn.CrossEntropyLoss() (mean over the batch)",
            "epochs": 10,
            "heldout": "after every epoch: rank r evaluates held-out samples r, r + W, ...; correct count, count and "
                       "the sum (in double, in order) of the float32 per-sample losses -log_softmax(out)[i, y_i], "
                       "summed over ranks; printed 'Epoch N: held-out accuracy {correct/count:.4f} loss "
                       "{loss_sum/count:.4f}' after the tutorial's 'Epoch N: Rank 0 local loss sum = {total:.4f}'",
        },
        "initial_params": None,
        "simulated": {},
        "torchrun_gloo": {},
    }
    for name, (world, argv) in CONFIGS.items():
        print(f"{name}: simulating", file=sys.stderr, flush=True)
        sim, out["initial_params"] = simulate(world, argv)
        out["simulated"][name] = sim
        print(f"{name}: torchrun", file=sys.stderr, flush=True)
        out["torchrun_gloo"][name] = torchrun(world, argv, sim)
        print(f"{name}: {sim['printed_lines'][-1]}; torchrun {out['torchrun_gloo'][name]['check_vs_simulated']}",
              file=sys.stderr, flush=True)
    path = os.path.join(ROOT, "tests", "data", "digits_golden.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
