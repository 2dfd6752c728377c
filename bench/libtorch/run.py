#!/usr/bin/env python3
"""Step time of libtorch + ddp (examples/libtorch_ddp) vs Python DDP (gloo), same kernels, same job.

    build/torch-venv/bin/python bench/libtorch/run.py [--reps 5] [--build build/default]

Both programs run under the venv's torchrun (OMP_NUM_THREADS=1, one thread per rank), at W = 1, 2,
on the tutorial job and on a compute-bound size (--samples 65536 --hidden 1024 --batch-size 256),
repetitions interleaved. Step time = rank 0's training loop (barrier to barrier, as both
reports measure it) / its number of steps; the table shows medians. The printed lines of each
pair are compared too. Writes bench/results/libtorch_step.md (--out to change).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = {"tutorial": [], "compute-bound": ["--samples", "65536", "--hidden", "1024", "--batch-size", "256"]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a, which, w, job, d, retries=3):
    report = os.path.join(d, f"{which}.json")
    base = [a.torchrun, "--nnodes=1", f"--nproc-per-node={w}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    if which == "python":
        cmd = base + [os.path.join(ROOT, "bench", "torch", "train_ddp_cpu.py")]
    else:
        cmd = base + ["--no-python", os.path.join(a.build, "examples", "libtorch_ddp", "libtorch_ddp")]
    cmd += ["--init-seed", "0", "--report", report] + JOBS[job]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    for _ in range(retries):  # gloo's workers sometimes abort at exit after finishing
        if os.path.exists(report):
            os.remove(report)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode == 0 and os.path.exists(report):
            with open(report) as f:
                r = json.load(f)
            lines = [l for l in p.stdout.splitlines() if l.startswith("Epoch ")]
            return r["train_loop_seconds"] / len(r["step_losses_rank0"]), lines
    sys.exit(f"{which} W={w} {job} failed:\n{p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "default"))
    ap.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "libtorch_step.md"))
    a = ap.parse_args()
    import torch
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    times = {}
    same = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.reps):
            for job in JOBS:
                for w in (1, 2):
                    t_py, l_py = run(a, "python", w, job, d)
                    t_lt, l_lt = run(a, "libtorch", w, job, d)
                    times.setdefault((job, w), ([], []))
                    times[(job, w)][0].append(t_py)
                    times[(job, w)][1].append(t_lt)
                    same[(job, w)] = same.get((job, w), True) and l_py == l_lt
                    print(f"rep {rep + 1}: {job} W={w}: python {t_py * 1e3:.3f} ms, libtorch+ddp {t_lt * 1e3:.3f} ms",
                          flush=True)
    load_after = os.getloadavg()[0]
    rows = []
    for (job, w), (py, lt) in times.items():
        mp, ml = statistics.median(py), statistics.median(lt)
        rows.append(f"| {job} | {w} | {mp * 1e3:.3f} ms | {ml * 1e3:.3f} ms | {mp / ml:.2f}x | "
                    f"{'yes' if same[(job, w)] else 'NO'} |")
    text = f"""# libtorch + ddp vs Python DDP: step time

The tutorial job (MLP 10-32-2, batch 32, 1024 samples, 3 epochs) and a compute-bound size
(`--samples 65536 --hidden 1024 --batch-size 256`), each rank one thread, both under torchrun:
`examples/libtorch_ddp` (libtorch's C++ frontend, ddp's ring backend, bucket all-reduces started
from post-accumulate-grad hooks) and `bench/torch/train_ddp_cpu.py` (Python, `DistributedDataParallel`,
gloo). The kernels are the same libtorch. Step time = rank 0's training loop / its steps; medians of
{a.reps} interleaved repetitions. torch {torch.__version__}, {cpu}, {os.cpu_count()} CPUs, shared with
other work (1-minute load average {load_before:.1f} before, {load_after:.1f} after): expect noise. Command: `build/torch-venv/bin/python bench/libtorch/run.py --reps {a.reps}`.

| job | W | Python DDP (gloo) | libtorch + ddp | speedup | printed lines equal |
| --- | --- | --- | --- | --- | --- |
""" + "\n".join(rows) + "\n"
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
