#!/usr/bin/env bash
# Whether the speed modes of ordinary-buffer all-reduces are ddp's or the machine's: RUNS launches
# each of a full sweep of ddp's shared-memory all-reduce on user buffers and of the bare probe
# with copies in and out (ddp_bench_limits --probe --copy: two processes, one shared mapping, a
# plain loop and two memcpys, no library), interleaved (the order swapped every run), p = 2,
# ranks bound. Per size: each system's fastest, median and slowest launch, how many launches
# ran over 1.15x that system's fastest (its slow mode), and how often the two were slow in the
# same run. Writes bench/results/sweep_modes.md and sweep_modes_raw.csv (run, system, bytes, us).
#   RUNS=20 MIN_BYTES=16384 MAX_BYTES=1048576 bench/sweep_modes.sh [build dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/bench}
runs=${RUNS:-20}
min_bytes=${MIN_BYTES:-16384}
max_bytes=${MAX_BYTES:-1048576}
out=$root/bench/results/sweep_modes.md
if [ ! -x "$build/bench/allreduce/ddp_bench_allreduce" ] || [ ! -x "$build/bench/limits/ddp_bench_limits" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_ENABLE_CUDA=OFF >/dev/null
fi
cmake --build "$build" -j2 --target ddp_bench_allreduce ddp_bench_limits >/dev/null
raw=$root/bench/results/sweep_modes_raw.csv
: >"$raw"
sweep=(--min-bytes "$min_bytes" --max-bytes "$max_bytes" --csv)
run_ddp() { "$build/bench/allreduce/ddp_bench_allreduce" --np 2 --transport shm --buffer user "${sweep[@]}" 2>/dev/null; }
run_probe() { "$build/bench/limits/ddp_bench_limits" --probe --copy "${sweep[@]}" 2>/dev/null; }
for ((run = 1; run <= runs; run++)); do
  echo "sweep_modes: run $run of $runs" >&2
  if ((run % 2)); then order=(run_ddp run_probe); else order=(run_probe run_ddp); fi
  for f in "${order[@]}"; do
    "$f" | awk -F, -v r="$run" '$1 ~ /^(ddp-shm-user|probe-copy)$/ {print r "," $1 "," $3 "," $6}' >>"$raw"
  done
done
python3 - "$raw" "$runs" "$(git -C "$root" rev-parse --short HEAD)" "$(nproc)" "$(uptime | sed 's/.*load average: //')" >"$out" <<'PY'
import sys, statistics, collections
times = collections.defaultdict(dict)  # (system, size) -> run -> us
for line in open(sys.argv[1]):
    run, system, size, us = line.strip().split(",")
    times[(system, int(size))][int(run)] = float(us)
systems = [("ddp-shm-user", "ddp user buffers"), ("probe-copy", "bare probe with copies")]
print("# Speed modes: ddp's ordinary-buffer all-reduce beside the bare probe with copies (p = 2)\n")
print(f"`RUNS={sys.argv[2]} bench/sweep_modes.sh` at {sys.argv[3]}, {sys.argv[4]} CPUs, load average at the end {sys.argv[5]}:")
print("one full sweep per launch, the two interleaved, ranks bound; us per call. Slow: over 1.15x that")
print("system's fastest launch. Both slow: runs in which the two launches (back to back) were both slow.\n")
head = "| size |"
for _, name in systems: head += f" {name}: fastest | median | slowest | slow runs |"
print(head + " both slow | ddp: slowest / fastest |")
print("|" + " ---: |" * (2 + 4 * len(systems) + 1))
for size in sorted({s for _, s in times}):
    row = f"| {size // 1024} KiB |" if size >= 1024 else f"| {size} B |"
    slow_runs = []
    for system, _ in systems:
        v = times[(system, size)]
        fastest = min(v.values())
        slow = {r for r, us in v.items() if us > 1.15 * fastest}
        slow_runs.append(slow)
        row += f" {fastest:.2f} | {statistics.median(v.values()):.2f} | {max(v.values()):.2f} | {len(slow)} of {len(v)} |"
    d = times[("ddp-shm-user", size)]
    row += f" {len(slow_runs[0] & slow_runs[1])} | {max(d.values()) / min(d.values()):.2f}x |"
    print(row)
PY
echo "wrote $out" >&2
