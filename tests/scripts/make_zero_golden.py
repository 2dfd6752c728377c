#!/usr/bin/env python3
"""Makes tests/data/zero_golden.json: train_ddp's --optimizer / --clip / --zero jobs done by real
PyTorch, torch.distributed.optim.ZeroRedundancyOptimizer under DistributedDataParallel on gloo.

    $(tools/torch-venv.sh)/bin/python tests/scripts/make_zero_golden.py     # under a minute on 2 cores

Each configuration is bench/torch/train_ddp_cpu.py (the tutorial job: MLP 10-32-2, 1024 samples,
batch 32, 3 epochs, --init-seed 0) under torchrun --standalone with gloo, with --zero 1: DDP
averages the gradients, clip_grad_norm_ clips them over all parameters, each rank steps its share
of the parameters with the optimizer (foreach=False) and broadcasts it. train_ddp_test runs
train_ddp with the same options and --zero 0, 1 and 2 against this.
"""
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "torch", "train_ddp_cpu.py")

CONFIGS = {  # name: (world, options besides --init-seed 0 --zero 1)
    "W2_adamw": (2, ["--optimizer", "adamw"]),
    "W3_sgd_momentum_clip": (3, ["--optimizer", "sgd", "--momentum", "0.9", "--clip", "0.1"]),
    "W4_adamw_weight_decay_clip": (4, ["--optimizer", "adamw", "--weight-decay", "0.1", "--clip", "0.05"]),
}
KEPT = ["printed_lines", "epoch_loss_sums_by_rank", "step_losses_rank0", "final_params_bits", "clipped_steps_rank0",
        "optimizer", "momentum", "clip", "zero"]


def run(world, options, zero=1, kept=KEPT):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        out = subprocess.run([torchrun, "--standalone", "--nnodes=1", f"--nproc-per-node={world}", SCRIPT,
                              "--init-seed", "0", "--zero", str(zero), *options, "--report", report],
                             check=True, capture_output=True, text=True)
        with open(report) as f:
            r = json.load(f)
    r["printed_lines"] = [line for line in out.stdout.splitlines() if line.startswith("Epoch")]
    return {k: r[k] for k in kept}


def write_golden(golden, name):
    path = os.path.join(ROOT, "tests", "data", name)
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print("wrote", path)


def main():
    golden = {"meta": {
        "how": "tests/scripts/make_zero_golden.py: torchrun --standalone --nproc-per-node W "
               "bench/torch/train_ddp_cpu.py --init-seed 0 --zero 1 <options>",
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "setup": "DDP (gloo) + ZeroRedundancyOptimizer(optimizer_class=SGD or AdamW, foreach=False); "
                 "clip_grad_norm_(model.parameters(), clip) after backward when clip > 0; the tutorial's data, "
                 "sampler and lr; final_params_bits: float32 bits in named_parameters() order",
    }}
    for name, (world, options) in CONFIGS.items():
        print(f"{name}: W = {world}, {' '.join(options)}", flush=True)
        golden[name] = {"world_size": world, "options": options, **run(world, options)}
    write_golden(golden, "zero_golden.json")


if __name__ == "__main__":
    main()
