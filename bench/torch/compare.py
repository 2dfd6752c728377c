#!/usr/bin/env python3
"""train_ddp against the same job in PyTorch DDP (gloo, CPU), side by side in one run.

Runs, interleaved rep by rep so machine noise hits both alike:
  ddprun   --standalone --nnodes=1 --nproc-per-node=W train_ddp          --init-seed 0 ARGS --report F
  torchrun --standalone --nnodes=1 --nproc-per-node=W train_ddp_cpu.py   --init-seed 0 ARGS --report F
for the tutorial job and a compute-bound variant, W = 1 and 2, and reports medians: the training
loop (from each program's report), the whole command (launch to exit, timed here), throughput,
peak RSS per rank, speedup T1/TW and efficiency, final loss/accuracy, and whether the printed
epoch lines agree. Writes OUT.md (tables), OUT.csv (every run) and OUT.png (gnuplot, if present).

    bench/torch/run.sh                       # installs torch in a venv if needed, then this
    python3 bench/torch/compare.py --torchrun /path/to/torchrun --build build/default --reps 5
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

COMPUTE_BOUND = ["--samples", "65536", "--hidden", "1024", "--batch-size", "256"]
JOBS = {
    "tutorial": [],
    "compute-bound": COMPUTE_BOUND,
    # The same job with Eigen's GEMM on the ddp side: fast for large shapes, not PyTorch's bits.
    "compute-bound-eigen": COMPUTE_BOUND,
    # The same job with the fused host training step (--gemm fast): not PyTorch's bits either.
    "compute-bound-fast": COMPUTE_BOUND,
}
DDP_ONLY_ARGS = {"compute-bound-eigen": ["--gemm", "eigen"], "compute-bound-fast": ["--gemm", "fast"]}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build", "default"), help="ddp build folder (train_ddp, ddprun)")
    p.add_argument("--torchrun", default=shutil.which("torchrun") or "torchrun")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--jobs", default=",".join(JOBS))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "train"))
    return p.parse_args()


FAILED_ATTEMPTS = {"torch": 0, "ddp": 0}


def run_once(system, cmd, report_path, attempts=3):
    # A failed run is retried (and counted in the report): PyTorch's gloo occasionally aborts at
    # start-up on this machine ("terminate called without an active exception").
    for attempt in range(attempts):
        start = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        wall = time.perf_counter() - start
        if proc.returncode == 0:
            break
        FAILED_ATTEMPTS[system] += 1
        if attempt + 1 == attempts:
            sys.exit(f"{system}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(report_path) as f:
        rep = json.load(f)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("Epoch ")]
    return {
        "command_s": wall,
        "loop_s": rep["train_loop_seconds"],
        "throughput": rep["throughput_samples_per_s"],
        "rss_mib": max(rep["peak_rss_bytes_by_rank"]) / 2**20,
        "final_loss": rep["final_mean_loss"],
        "final_accuracy": rep["final_accuracy"],
        "lines": lines,
    }


def command(system, args, world, job, report_path):
    job_args = JOBS[job]
    common = ["--standalone", "--nnodes=1", f"--nproc-per-node={world}"]
    tail = ["--init-seed", "0", *job_args, "--report", report_path]
    if system == "ddp":
        return [os.path.join(args.build, "tools", "ddprun", "ddprun"), *common,
                os.path.join(args.build, "examples", "train_ddp", "train_ddp"), *tail, *DDP_ONLY_ARGS.get(job, [])]
    return [args.torchrun, *common, os.path.join(HERE, "train_ddp_cpu.py"), *tail]


def progress(text):
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + text)
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main():
    args = parse()
    worlds = [int(w) for w in args.worlds.split(",")]
    jobs = args.jobs.split(",")
    systems = ["torch", "ddp"]
    runs = []  # dicts with job, world, system, rep and the measurements
    total = args.reps * len(jobs) * len(worlds) * len(systems)
    done = 0
    started = time.perf_counter()
    env_note = os.environ.get("OMP_NUM_THREADS")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for job in jobs:
                for world in worlds:
                    for system in systems:
                        path = os.path.join(tmp, f"{system}-{job}-{world}-{rep}.json")
                        r = run_once(system, command(system, args, world, job, path), path)
                        runs.append({"job": job, "world": world, "system": system, "rep": rep, **r})
                        done += 1
                        left = (time.perf_counter() - started) / done * (total - done)
                        progress(f"[{done}/{total}] rep {rep + 1} {job} W={world} {system}: loop {r['loop_s'] * 1e3:.1f} ms, "
                                 f"command {r['command_s']:.2f} s (about {left:.0f} s left)")
    sys.stderr.write("\n")

    def med(job, world, system, key):
        return statistics.median(r[key] for r in runs if r["job"] == job and r["world"] == world and r["system"] == system)

    def same_lines(job, world):
        t = {tuple(r["lines"]) for r in runs if r["job"] == job and r["world"] == world and r["system"] == "torch"}
        d = {tuple(r["lines"]) for r in runs if r["job"] == job and r["world"] == world and r["system"] == "ddp"}
        return "yes" if len(t) == 1 and t == d else "no"

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        keys = ["job", "world", "system", "rep", "loop_s", "command_s", "throughput", "rss_mib", "final_loss", "final_accuracy"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(runs)

    md = [f"# train_ddp vs PyTorch {torch_version(args)} DDP (gloo, CPU)", "",
          f"Medians of {args.reps} interleaved repetitions; `{' '.join(sys.argv)}`.", ""]
    for job in jobs:
        md += [f"## {job} job ({' '.join(JOBS[job]) or 'the tutorial defaults'}"
               f"{'; ddp adds ' + ' '.join(DDP_ONLY_ARGS[job]) if job in DDP_ONLY_ARGS else ''})", "",
               "| W | metric | PyTorch | ddp | ddp advantage |", "| --- | --- | --- | --- | --- |"]
        for world in worlds:
            t_loop, d_loop = med(job, world, "torch", "loop_s"), med(job, world, "ddp", "loop_s")
            t_cmd, d_cmd = med(job, world, "torch", "command_s"), med(job, world, "ddp", "command_s")
            t_thr, d_thr = med(job, world, "torch", "throughput"), med(job, world, "ddp", "throughput")
            t_rss, d_rss = med(job, world, "torch", "rss_mib"), med(job, world, "ddp", "rss_mib")
            md.append(f"| {world} | training loop | {t_loop * 1e3:.1f} ms | {d_loop * 1e3:.2f} ms | {t_loop / d_loop:.0f}x faster |")
            md.append(f"| {world} | whole command | {t_cmd:.2f} s | {d_cmd * 1e3:.0f} ms | {t_cmd / d_cmd:.0f}x faster |")
            md.append(f"| {world} | throughput | {t_thr:,.0f} samples/s | {d_thr:,.0f} samples/s | {d_thr / t_thr:.1f}x |")
            md.append(f"| {world} | peak RSS per rank | {t_rss:.0f} MiB | {d_rss:.1f} MiB | 1/{t_rss / d_rss:.0f} |")
            md.append(f"| {world} | final loss / accuracy | {med(job, world, 'torch', 'final_loss'):.4f} / "
                      f"{med(job, world, 'torch', 'final_accuracy'):.4f} | {med(job, world, 'ddp', 'final_loss'):.4f} / "
                      f"{med(job, world, 'ddp', 'final_accuracy'):.4f} | printed lines equal: {same_lines(job, world)} |")
        if 1 in worlds:
            md += ["", "| W | speedup T1/TW PyTorch | efficiency PyTorch | speedup ddp | efficiency ddp |", "| --- | --- | --- | --- | --- |"]
            for world in worlds:
                if world == 1:
                    continue
                ts = med(job, 1, "torch", "loop_s") / med(job, world, "torch", "loop_s")
                ds = med(job, 1, "ddp", "loop_s") / med(job, world, "ddp", "loop_s")
                md.append(f"| {world} | {ts:.2f} | {ts / world:.2f} | {ds:.2f} | {ds / world:.2f} |")
        md.append("")
    md.append("Training loop: each program's own timer from the first step to the last (after a barrier). "
              "Whole command: launcher start to exit, timed by this script. "
              "Throughput: samples processed by all ranks per second of training loop. "
              "Efficiency: speedup / W with the per-rank batch fixed (the tutorial's setting). "
              f"PyTorch runs with torch.set_num_threads(1) per rank, as train_ddp does; OMP_NUM_THREADS={env_note}. "
              f"Failed runs retried: PyTorch {FAILED_ATTEMPTS['torch']}, ddp {FAILED_ATTEMPTS['ddp']}.")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    plot(args, jobs, worlds, med)


def torch_version(args):
    try:
        import torch
        return torch.__version__
    except ImportError:
        return "(version unknown)"


def plot(args, jobs, worlds, med):
    if not shutil.which("gnuplot"):
        print(f"gnuplot not found: {args.out}.png not written", file=sys.stderr)
        return
    data = args.out + ".dat"
    with open(data, "w") as f:
        for job in jobs:
            f.write(f"# {job}\n")
            for world in worlds:
                f.write(f"{world} {med(job, world, 'torch', 'throughput')} {med(job, world, 'ddp', 'throughput')}\n")
            f.write("\n\n")
    script = [
        f"set terminal pngcairo size {480 * len(jobs)},420", f"set output '{args.out}.png'",
        f"set multiplot layout 1,{len(jobs)}", "set style data histograms", "set style histogram clustered gap 1",
        "set style fill solid 0.8 border -1", "set logscale y", "set ylabel 'samples/s (log)'", "set xlabel 'ranks'",
        "set key top left", "set grid ytics"]
    for i, job in enumerate(jobs):
        script += [f"set title '{job} job: throughput'",
                   f"plot '{data}' index {i} using 2:xtic(1) title 'PyTorch DDP (gloo)', '' index {i} using 3 title 'ddp'"]
    script.append("unset multiplot")
    subprocess.run(["gnuplot"], input="\n".join(script), text=True, check=False)
    os.remove(data)


if __name__ == "__main__":
    main()
