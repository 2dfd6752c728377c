#!/usr/bin/env python3
"""Medians, ratio tables and plots from bench/run.sh's raw CSV.

usage: report.py RESULTS_DIR    (reads allreduce_raw.csv and limits.csv there)
writes allreduce.csv (medians), allreduce.md (tables), busbw_p{N}.png and latency_p{N}.png.

usage: report.py --anchors RESULTS_DIR    (bench/anchors.sh: reads anchors_raw.csv and
anchors_versions.txt there) writes anchors.csv (medians), anchors.md (times, busbw, ratios) and
anchors_busbw_p{N}.png, anchors_latency_p{N}.png.
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


def plot(results, medians, ranks, prefix=""):
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
set output '{results}/{prefix}{name}_p{p}.png'
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
                print(f"plot {prefix}{name}_p{p}.png not made: {e}", file=sys.stderr)
        data.unlink()


# bench/anchors.sh's systems in table order: (name, column label, ordinary buffers)
ANCHOR_SYSTEMS = [
    ("ddp-shm-group", "ddp group buffers", False),
    ("ddp-shm-user", "ddp user buffers", True),
    ("impi-shm", "Intel MPI shm", True),
    ("impi-shm-heap", "Intel MPI shm heap (MPI_Alloc_mem)", False),
    ("mpich-shm", "MPICH shm", True),
    ("oneccl-shm", "oneCCL shm", True),
    ("openmpi-shm-inplace", "Open MPI shm (vader)", True),
    ("deepspeed-shm", "DeepSpeed shm op", True),
]
ORDINARY_ANCHORS = [s for s, _, ordinary in ANCHOR_SYSTEMS if ordinary and not s.startswith("ddp")]
ALL_ANCHORS = [s for s, _, _ in ANCHOR_SYSTEMS if not s.startswith("ddp")]
# (ratio label, ours, anchors the baseline is the fastest of, goal, from this size on)
ANCHOR_GOALS = [
    ("ddp user / best ordinary-buffer anchor", "ddp-shm-user", ORDINARY_ANCHORS, 1.5, 4),
    ("ddp user / Intel MPI shm heap", "ddp-shm-user", ["impi-shm-heap"], 1.0, 16 << 10),
    ("ddp group / best anchor (heap included)", "ddp-shm-group", ALL_ANCHORS, 3.0, 16 << 10),
]


def anchors(results):
    samples = defaultdict(list)
    with open(results / "anchors_raw.csv") as f:
        for row in csv.DictReader(f):
            samples[(row["system"], int(row["ranks"]), int(row["bytes"]))].append(float(row["time_us"]))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    with open(results / "anchors.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "ranks", "bytes", "count", "type", "time_us_median", "algbw_gbs", "busbw_gbs",
                    "time_us_min", "time_us_max", "repetitions"])
        for (system, p, b), t in sorted(medians.items()):
            algbw = b / (t * 1e-6) / 1e9
            v = samples[(system, p, b)]
            w.writerow([system, p, b, b // 4, "float", f"{t:.3f}", f"{algbw:.4f}", f"{algbw * 2 * (p - 1) / p:.4f}",
                        f"{min(v):.3f}", f"{max(v):.3f}", len(v)])

    out = ["# all-reduce against the CPU anchors (bench/anchors.sh)\n"]
    versions = results / "anchors_versions.txt"
    if versions.exists():
        out += [f"- {line.lstrip('# ')}" for line in versions.read_text().splitlines() if line.strip()]
    labels = {s: label for s, label, _ in ANCHOR_SYSTEMS}
    for p in sorted({p for (_, p, _) in medians}):
        systems = [s for s, _, _ in ANCHOR_SYSTEMS if any(k[0] == s and k[1] == p for k in medians)]
        sizes = sorted({b for (s, q, b) in medians if q == p})
        for title, value, fmt in (("median time (us) per call", lambda t, b: t, "{:.2f}"),
                                  ("busbw (GB/s) of the median", lambda t, b: b / (t * 1e-6) / 1e9 * 2 * (p - 1) / p, "{:.3f}")):
            out.append(f"\n### p = {p}: {title}; float32 sum, in place\n")
            out.append("| size | " + " | ".join(labels[s] for s in systems) + " |")
            out.append("|---:|" + "---:|" * len(systems))
            for b in sizes:
                cells = [fmt.format(value(medians[(s, p, b)], b)) if (s, p, b) in medians else "" for s in systems]
                out.append(f"| {human(b)} | " + " | ".join(cells) + " |")
        out.append(f"\n### p = {p}: ratios, anchor time / ddp time (> 1: ddp is faster); **bold**: the goal is met\n")
        head = []
        for label, _, _, goal, start in ANCHOR_GOALS:
            head += [f"{label} (goal >= {goal:g}x{'' if start <= 4 else ' from ' + human(start)})", "that anchor"]
        out.append("| size | " + " | ".join(head) + " |")
        out.append("|---:|" + "---:|---|" * len(ANCHOR_GOALS))
        met = defaultdict(list)
        for b in sizes:
            cells = []
            for label, ours, pool, goal, start in ANCHOR_GOALS:
                present = [a for a in pool if (a, p, b) in medians]
                if (ours, p, b) not in medians or not present:
                    cells += ["", ""]
                    continue
                best = min(present, key=lambda a: medians[(a, p, b)])
                ratio = medians[(best, p, b)] / medians[(ours, p, b)]
                if b >= start:
                    met[label].append((b, ratio >= goal))
                text = f"{ratio:.2f}"
                cells += [f"**{text}**" if b >= start and ratio >= goal else text, labels[best]]
            out.append(f"| {human(b)} | " + " | ".join(cells) + " |")
        out.append("")
        for label, _, _, goal, _ in ANCHOR_GOALS:
            checks = met.get(label, [])
            missed = [human(b) for b, ok in checks if not ok]
            out.append(f"- {label} >= {goal:g}x: met at {len(checks) - len(missed)} of {len(checks)} sizes"
                       + (f"; missed at {', '.join(missed)}" if missed else ""))
    text = "\n".join(out) + "\n"
    (results / "anchors.md").write_text(text)
    print(text)
    plot(results, medians, sorted({p for (_, p, _) in medians}), prefix="anchors_")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--anchors":
        anchors(Path(sys.argv[2]))
    else:
        main()
