#!/usr/bin/env bash
# TCP all-reduce against the loopback's own limits, interleaved in one run (p = 2, float32 sum,
# user buffers, 4 MiB .. 64 MiB): the one-way stream, and both ways at once over one connection,
# which is what a 2-rank ring moves. Writes bench/results/tcp_limit.md (medians and ratios).
#   REPS=7 bench/tcp_limit.sh [build dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/bench}
reps=${REPS:-7}
out=$root/bench/results/tcp_limit.md
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_ENABLE_CUDA=OFF >/dev/null
cmake --build "$build" -j2 --target ddp_bench_allreduce ddp_bench_limits >/dev/null
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
for ((rep = 1; rep <= reps; rep++)); do
  echo "tcp_limit: repetition $rep of $reps" >&2
  "$build/bench/limits/ddp_bench_limits" --bandwidth --csv | awk -F, -v r="$rep" '/^tcp_/ {print r "," $1 ",0," $2}' >>"$raw"
  "$build/bench/allreduce/ddp_bench_allreduce" --np 2 --transport tcp --buffer user --min-bytes 4194304 --max-bytes 67108864 --csv 2>/dev/null |
    awk -F, -v r="$rep" '/^ddp-tcp/ {print r ",ddp_tcp," $3 "," $8}' >>"$raw"
done
python3 - "$raw" "$reps" "$(git -C "$root" rev-parse --short HEAD)" >"$out" <<'PY'
import sys, statistics, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    rep, what, size, gbs = line.strip().split(",")
    rows[(what, int(size))].append(float(gbs))
med = {k: statistics.median(v) for k, v in rows.items()}
stream, duplex = med[("tcp_loopback_stream", 0)], med[("tcp_loopback_duplex", 0)]
spread = lambda v: (max(v) - min(v)) / statistics.median(v)
print("# TCP all-reduce against the loopback's limits (p = 2)\n")
print(f"`REPS={sys.argv[2]} bench/tcp_limit.sh` at {sys.argv[3]}: medians of {sys.argv[2]} interleaved repetitions, GB/s.")
print(f"One-way stream {stream:.2f} GB/s (spread {spread(rows[('tcp_loopback_stream', 0)]):.0%}); both ways at once over one")
print(f"connection {duplex:.2f} GB/s each way (spread {spread(rows[('tcp_loopback_duplex', 0)]):.0%}).\n")
print("| size | ddp tcp busbw | spread | / one-way stream | / both ways at once |")
print("| ---: | ---: | ---: | ---: | ---: |")
for (what, size), v in sorted(med.items(), key=lambda kv: kv[0][1]):
    if what != "ddp_tcp": continue
    print(f"| {size >> 20} MiB | {v:.2f} | {spread(rows[(what, size)]):.0%} | {v / stream:.2f} | {v / duplex:.2f} |")
PY
cat "$out"
