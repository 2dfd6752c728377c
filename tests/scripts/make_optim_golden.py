#!/usr/bin/env python3
"""Makes tests/data/optim_golden.json: torch's optimizers, GradScaler and clip_grad_norm_ on CPU.

    build/torch-venv/bin/python tests/scripts/make_optim_golden.py     # a few seconds

What ddp/optim/ reproduces, recorded from the real thing:
  sgd, adamw     torch.optim.SGD / torch.optim.AdamW with foreach=False (the single-tensor path),
                 four tensors (sizes in `inputs`), 20 steps of recorded gradients; the parameters
                 after steps 1, 2, 10, 20 and the optimizer state after steps 2 and 20. Float32, and
                 two float64 cases (`dtype`).
  grad_scaler    torch._amp_update_scale_ (CPU) over recorded found_inf sequences, the scale and
                 growth tracker after every update; torch._amp_foreach_non_finite_check_and_unscale_
                 with inv_scale = scale.double().reciprocal().float() as GradScaler computes it.
  clip           torch.nn.utils.clip_grad_norm_ (default foreach): the total norm, each tensor's
                 norm (torch.linalg.vector_norm) and the clipped gradients.
Float32 values are struct.pack('<f', x).hex(), float64 struct.pack('<d', x).hex(), concatenated
per tensor (8 or 16 hex digits per value).
"""
import json
import os
import platform
import struct
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "optim_golden.json")

SIZES = [1, 7, 64, 1000]
STEPS = 20
PARAM_STEPS = [1, 2, 10, 20]
STATE_STEPS = [2, 20]


def hexf(v):
    return struct.pack("<f", v).hex()


def packed(t):
    """A tensor as one string: 8 hex digits per float32, 16 per float64, in flatten() order."""
    fmt = {torch.float32: "<f", torch.float64: "<d"}[t.dtype]
    return "".join(struct.pack(fmt, v).hex() for v in t.detach().flatten().tolist())


def make_inputs(dtype, sizes, seed):
    """Initial parameters and STEPS gradients per tensor, from one seeded generator; gradient
    scales vary by step and tensor so that the state covers several magnitudes."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
    grads = [[torch.randn(n, generator=g, dtype=dtype) * (0.1 * (1 + (s % 5)) * (1 + i))
              for s in range(STEPS)] for i, n in enumerate(sizes)]
    return params, grads


def run_optimizer(make, params0, grads, state_keys):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = make(params)
    after = {}
    for s in range(1, STEPS + 1):
        for p, gs in zip(params, grads):
            p.grad = gs[s - 1].clone()
        opt.step()
        if s in PARAM_STEPS or s in STATE_STEPS:
            rec = {}
            if s in PARAM_STEPS:
                rec["params"] = [packed(p) for p in params]
            if s in STATE_STEPS:
                st = {}
                for key in state_keys:
                    if key == "step":
                        st[key] = [float(opt.state[p]["step"]) for p in params]
                    else:
                        st[key] = [packed(opt.state[p][key]) for p in params]
                rec["state"] = st
            after[str(s)] = rec
    return after


def sgd_cases():
    base = {"lr": 0.01, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False}
    variants = [
        ("plain", {}),
        ("weight_decay", {"weight_decay": 1e-2}),
        ("momentum", {"momentum": 0.9}),
        ("momentum_dampening", {"momentum": 0.9, "dampening": 0.1}),
        ("nesterov", {"momentum": 0.9, "nesterov": True}),
        ("nesterov_weight_decay", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
        ("momentum_dampening_weight_decay_maximize",
         {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2, "maximize": True, "lr": 0.03}),
    ]
    return [(name, {**base, **v}) for name, v in variants]


def adamw_cases():
    base = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False}
    variants = [
        ("defaults", {}),
        ("amsgrad", {"amsgrad": True}),
        ("no_weight_decay", {"weight_decay": 0.0}),
        # 1 - beta1 = 0.7 >= 0.5: lerp's other branch.
        ("beta1_low_maximize", {"betas": [0.3, 0.99], "lr": 3e-3, "maximize": True, "weight_decay": 0.1}),
    ]
    return [(name, {**base, **v}) for name, v in variants]


def optimizer_section(dtype, seed, sizes, which):
    params0, grads = make_inputs(dtype, sizes, seed)
    inputs = {"dtype": str(dtype).replace("torch.", ""), "sizes": sizes, "seed": seed,
              "params": [packed(p) for p in params0],
              "grads": [[packed(g) for g in gs] for gs in grads]}
    cases = []
    if which == "sgd":
        for name, o in sgd_cases():
            keys = ["momentum_buffer"] if o["momentum"] != 0 else []
            after = run_optimizer(lambda ps, o=o: torch.optim.SGD(ps, foreach=False, **o), params0, grads, keys)
            cases.append({"name": name, "options": o, "after": after,
                          "call": "torch.optim.SGD(params, foreach=False, **options)"})
    else:
        for name, o in adamw_cases():
            keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o["amsgrad"] else [])
            kw = {**o, "betas": tuple(o["betas"])}
            after = run_optimizer(lambda ps, kw=kw: torch.optim.AdamW(ps, foreach=False, fused=False, **kw),
                                  params0, grads, keys)
            cases.append({"name": name, "options": o, "after": after,
                          "call": "torch.optim.AdamW(params, foreach=False, fused=False, **options)"})
    return {"inputs": inputs, "cases": cases}


def scaler_sequences():
    out = []
    seqs = [
        ("interval3", 2.0 ** 16, 2.0, 0.5, 3,
         [0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]),
        # Factors that are not powers of two: the product is rounded from double to float.
        ("odd_factors", 3.0 * 2.0 ** 14, 1.7, 0.3, 2,
         [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]),
        # Growth past float's range is refused (the scale stays finite).
        ("near_float_max", 2.0 ** 126, 2.0, 0.5, 1, [0, 0, 0, 1, 0, 0, 0, 0]),
        # Defaults: no growth within 30 steps of interval 2000.
        ("defaults", 2.0 ** 16, 2.0, 0.5, 2000, [0] * 10 + [1] + [0] * 19),
    ]
    for name, init, growth, backoff, interval, flags in seqs:
        scale = torch.full((1,), init, dtype=torch.float32)
        tracker = torch.full((1,), 0, dtype=torch.int32)
        traj = []
        for f in flags:
            found = torch.full((1,), float(f), dtype=torch.float32)
            torch._amp_update_scale_(scale, tracker, found, growth, backoff, interval)
            traj.append({"scale": hexf(scale.item()), "growth_tracker": int(tracker.item())})
        out.append({"name": name, "init_scale": init, "growth_factor": growth, "backoff_factor": backoff,
                    "growth_interval": interval, "found_inf": flags, "after": traj})
    return out


def unscale_cases():
    # float(1/double(s)) always equals the float division 1.0f/s (a quotient of 24-bit numbers is
    # never close enough to a float midpoint for the double rounding to show); what the float
    # inv_scale changes is g * inv_scale against g / s, counted in `differs_from_division`.
    scales = [2.0 ** 16, 3.0, 65536 * 0.5 ** 3 * 3, 1.0, 0.1, 1000.0 / 7.0]
    out = []
    for k, s in enumerate(scales):
        for n, bad in ((64, None), (1000, None), (7, "inf"), (1000, "nan"), (64, "-inf")):
            gg = torch.Generator().manual_seed(100 + k)
            grads = torch.randn(n, generator=gg) * 1000
            if bad is not None:
                grads[n // 2] = float(bad)
            before = packed(grads)
            divided = grads / torch.full((1,), s, dtype=torch.float32)
            scale_t = torch.full((1,), s, dtype=torch.float32)
            inv_scale = scale_t.double().reciprocal().float()
            found = torch.full((1,), 0.0, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_([grads], found, inv_scale)
            assert inv_scale.item() == torch.tensor([1.0]).div(scale_t).item()
            out.append({"scale": hexf(scale_t.item()), "inv_scale": hexf(inv_scale.item()),
                        "differs_from_division": int((grads != divided).sum().item()),
                        "before": before, "after": packed(grads), "found_inf": bool(found.item() != 0)})
    return out


def clip_cases():
    out = []
    g = torch.Generator().manual_seed(21)
    lists = [[1000], [7, 64, 1000], [1, 3, 17, 300, 2049], [64]]
    for i, sizes in enumerate(lists):
        base = [torch.randn(n, generator=g) * (0.5 + j) for j, n in enumerate(sizes)]
        runs = []
        for max_norm in (1.0, 0.25, 1e6, 5.0):
            params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
            for p, b in zip(params, base):
                p.grad = b.clone()
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
            runs.append({"max_norm": max_norm, "total_norm": hexf(total.item()),
                         "after": [packed(p.grad) for p in params]})
        out.append({"sizes": sizes, "grads": [packed(b) for b in base],
                    "norms": [hexf(torch.linalg.vector_norm(b).item()) for b in base], "runs": runs})
    return out


def main():
    golden = {
        "meta": {
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "made_by": "tests/scripts/make_optim_golden.py",
            "param_steps": PARAM_STEPS,
            "state_steps": STATE_STEPS,
            "steps": STEPS,
        },
        "sgd": optimizer_section(torch.float32, 1, SIZES, "sgd"),
        "adamw": optimizer_section(torch.float32, 2, SIZES, "adamw"),
        "sgd_f64": optimizer_section(torch.float64, 3, [7, 64], "sgd"),
        "adamw_f64": optimizer_section(torch.float64, 4, [7, 64], "adamw"),
        "grad_scaler": {"update": scaler_sequences(), "unscale": unscale_cases()},
        "clip": clip_cases(),
    }
    with open(OUT, "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    print(OUT, os.path.getsize(OUT), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
