#!/usr/bin/env python3
"""Medians, ratio tables and plots from bench/run.sh's raw CSV.

usage: report.py RESULTS_DIR    (reads allreduce_raw.csv and limits.csv there)
writes allreduce.csv (medians), allreduce.md (tables), busbw_p{N}.png and latency_p{N}.png.
"""
import csv
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# (ours, baseline, what the comparison means)
COMPARISONS = [
    ("ddp-shm-group", "openmpi-shm-inplace", "shm, group buffers vs Open MPI in place"),
    ("ddp-shm-group", "probe", "shm, group buffers vs the bare probe (limit)"),
    ("ddp-shm-user", "openmpi-shm", "shm, user buffers vs Open MPI out of place"),
    ("ddp-shm-user", "openmpi-shm-inplace", "shm, user buffers vs Open MPI in place"),
    ("ddp-shm-user", "probe-copy", "shm, user buffers vs the probe with copies"),
    ("ddp-tcp", "openmpi-tcp", "tcp vs Open MPI over TCP"),
    ("ddp-tcp", "gloo-tcp", "tcp vs Gloo ring"),
]


def human(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main():
    results = Path(sys.argv[1])
    samples = defaultdict(list)
    with open(results / "allreduce_raw.csv") as f:
        for row in csv.DictReader(f):
            key = (row["system"], int(row["ranks"]), int(row["bytes"]))
            samples[key].append(float(row["time_us"]))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    with open(results / "allreduce.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "ranks", "bytes", "time_us_median", "busbw_gbs", "repetitions"])
        for (system, p, b), t in sorted(medians.items()):
            busbw = b / (t * 1e-6) / 1e9 * 2 * (p - 1) / p
            w.writerow([system, p, b, f"{t:.3f}", f"{busbw:.4f}", len(samples[(system, p, b)])])

    out = []
    ranks = sorted({p for (_, p, _) in medians})
    sizes = sorted({b for (_, _, b) in medians})
    for p in ranks:
        systems = sorted({s for (s, q, _) in medians if q == p})
        out.append(f"\n### p = {p}: median time (us) per size\n")
        out.append("| size | " + " | ".join(systems) + " |")
        out.append("|---:|" + "---:|" * len(systems))
        for b in sizes:
            cells = [f"{medians[(s, p, b)]:.2f}" if (s, p, b) in medians else "" for s in systems]
            out.append(f"| {human(b)} | " + " | ".join(cells) + " |")
        out.append(f"\n### p = {p}: ratios (baseline time / ddp time: > 1 means ddp is faster; equal to the busbw ratio)\n")
        comps = [c for c in COMPARISONS if any((c[0], p, b) in medians and (c[1], p, b) in medians for b in sizes)]
        out.append("| size | " + " | ".join(c[2] for c in comps) + " |")
        out.append("|---:|" + "---:|" * len(comps))
        for b in sizes:
            cells = []
            for ours, base, _ in comps:
                if (ours, p, b) in medians and (base, p, b) in medians:
                    cells.append(f"{medians[(base, p, b)] / medians[(ours, p, b)]:.2f}")
                else:
                    cells.append("")
            out.append(f"| {human(b)} | " + " | ".join(cells) + " |")
    limits = results / "limits.csv"
    if limits.exists():
        out.append("\n### limits of this machine\n")
        out.append("| limit | GB/s |\n|---|---:|")
        with open(limits) as f:
            for row in csv.DictReader(f):
                out.append(f"| {row['limit']} | {row['value_gbs']} |")
    text = "\n".join(out) + "\n"
    (results / "allreduce.md").write_text(text)
    print(text)
    plot(results, medians, ranks)


def plot(results, medians, ranks):
    for p in ranks:
        systems = sorted({s for (s, q, _) in medians if q == p})
        data = results / f"plot_p{p}.dat"
        with open(data, "w") as f:
            for s in systems:
                f.write(f'"{s}"\n')
                for (sys_, q, b), t in sorted(medians.items(), key=lambda kv: kv[0][2]):
                    if sys_ == s and q == p:
                        busbw = b / (t * 1e-6) / 1e9 * 2 * (p - 1) / p
                        f.write(f"{b} {t} {busbw}\n")
                f.write("\n\n")
        for name, column, ylabel in (("busbw", 3, "busbw (GB/s)"), ("latency", 2, "time (us)")):
            script = f"""
set terminal pngcairo size 1000,650
set output '{results}/{name}_p{p}.png'
set title 'all-reduce float32 sum, p = {p}: {ylabel} (median of repetitions)'
set logscale xy 2
set xlabel 'message size (bytes)'
set ylabel '{ylabel}'
set key left top
set grid
plot for [i=0:{len(systems) - 1}] '{data}' index i using 1:{column} with linespoints title columnheader(1)
"""
            try:
                subprocess.run(["gnuplot"], input=script, text=True, check=True)
            except (OSError, subprocess.CalledProcessError) as e:
                print(f"plot {name}_p{p}.png not made: {e}", file=sys.stderr)
        data.unlink()


if __name__ == "__main__":
    main()
