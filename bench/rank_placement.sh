#!/usr/bin/env bash
# Run-to-run spread of the shared-memory all-reduce with ranks bound to CPUs and unbound,
# interleaved in one run (p = 2, float32 sum, user buffers): RUNS launches of each at every size
# in SIZES, each launch measuring that one size alone (the bench's default warm-up). A run is
# slow when it took over twice the bound runs' median. Writes bench/results/rank_placement.md.
#   RUNS=30 SIZES="16384 131072 262144" bench/rank_placement.sh [build dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/bench}
runs=${RUNS:-30}
sizes=${SIZES:-16384 131072 262144}
out=$root/bench/results/rank_placement.md
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_ENABLE_CUDA=OFF >/dev/null
cmake --build "$build" -j2 --target ddp_bench_allreduce >/dev/null
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
for ((run = 1; run <= runs; run++)); do
  echo "rank_placement: run $run of $runs" >&2
  for size in $sizes; do
    for bind in cpus none; do
      "$build/bench/allreduce/ddp_bench_allreduce" --np 2 --transport shm --buffer user --bind "$bind" \
        --min-bytes "$size" --max-bytes "$size" --csv 2>/dev/null | awk -F, -v b="$bind" '/^ddp-shm/ {print b "," $3 "," $6}' >>"$raw"
    done
  done
done
python3 - "$raw" "$runs" "$(git -C "$root" rev-parse --short HEAD)" "$(nproc)" >"$out" <<'PY'
import sys, statistics, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    bind, size, us = line.strip().split(",")
    rows[(bind, int(size))].append(float(us))
print("# Rank placement: the shared-memory all-reduce bound to CPUs and unbound (p = 2)\n")
print(f"`RUNS={sys.argv[2]} bench/rank_placement.sh` at {sys.argv[3]}, {sys.argv[4]} CPUs: {sys.argv[2]} launches of each,")
print("interleaved, each measuring one size alone; us per call. Slow: over twice the bound runs' median.\n")
print("| size | bound: median | max | slow runs | unbound: median | max | slow runs |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for size in sorted({s for _, s in rows}):
    b, u = rows[("cpus", size)], rows[("none", size)]
    ref = statistics.median(b)
    slow = lambda v: sum(x > 2 * ref for x in v)
    print(f"| {size >> 10} KiB | {ref:.2f} | {max(b):.2f} | {slow(b)} of {len(b)} | {statistics.median(u):.2f} | {max(u):.2f} | {slow(u)} of {len(u)} |")
PY
cat "$out"
