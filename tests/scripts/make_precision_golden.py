#!/usr/bin/env python3
"""Makes tests/data/precision_golden.json: train_ddp's --precision bf16 / fp16 jobs done by real
PyTorch, written out as bench/torch/train_ddp_cpu.py --precision describes (parameters and
gradients rounded to the low type, gradients averaged in float32 by a DDP comm hook on gloo, a
float32 master stepped by torch.optim, fp16 with torch.amp.GradScaler).

    $(tools/torch-venv.sh)/bin/python tests/scripts/make_precision_golden.py     # under a minute on 2 cores

Each configuration also keeps the final parameters of the same job in float32
(fp32_final_params_bits), so that train_ddp_test can show that its tolerance separates the
mixed-precision run from the float32 one. train_ddp_test runs train_ddp with the same options and
--zero 0, 1 and 2 against this.
"""
import platform

import torch

from make_zero_golden import run, write_golden

CONFIGS = {  # name: (world, options besides --init-seed 0 --zero 0)
    "W2_bf16_adamw": (2, ["--precision", "bf16", "--optimizer", "adamw"]),
    # 2^24 overflows float16 on the first steps: the scaler skips them and backs off.
    "W2_fp16_sgd_momentum_clip": (2, ["--precision", "fp16", "--optimizer", "sgd", "--momentum", "0.9", "--clip", "0.5",
                                      "--loss-scale", "16777216"]),
    "W3_fp16_adamw": (3, ["--precision", "fp16", "--optimizer", "adamw", "--loss-scale", "16777216"]),
}
KEPT = ["printed_lines", "epoch_loss_sums_by_rank", "step_losses_rank0", "final_params_bits", "clipped_steps_rank0",
        "optimizer", "momentum", "clip", "precision", "skipped_steps", "final_loss_scale"]


def without_precision(options):
    out, skip = [], False
    for o in options:
        if skip:
            skip = False
        elif o in ("--precision", "--loss-scale"):
            skip = True
        else:
            out.append(o)
    return out


def main():
    golden = {"meta": {
        "how": "tests/scripts/make_precision_golden.py: torchrun --standalone --nproc-per-node W "
               "bench/torch/train_ddp_cpu.py --init-seed 0 --zero 0 <options>",
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "setup": "parameters rounded to bfloat16/float16 (kept in float32 tensors), float32 compute; a DDP comm hook rounds "
                 "each rank's gradients to the low type and averages them in float32 (gloo); SGD or AdamW (foreach=False) "
                 "on a float32 master copy, clip_grad_norm_ over it; fp16: torch.amp.GradScaler('cpu', init_scale = "
                 "--loss-scale); final_params_bits: the model's (rounded) float32 bits in named_parameters() order",
    }}
    for name, (world, options) in CONFIGS.items():
        print(f"{name}: W = {world}, {' '.join(options)}", flush=True)
        entry = {"world_size": world, "options": options, **run(world, options, zero=0, kept=KEPT)}
        entry["fp32_final_params_bits"] = run(world, without_precision(options), zero=0, kept=["final_params_bits"])[
            "final_params_bits"]
        golden[name] = entry
    write_golden(golden, "precision_golden.json")


if __name__ == "__main__":
    main()
