#!/usr/bin/env bash
# Flat versus hierarchical all-reduce across "hosts" made of network namespaces (root + iproute2).
#
# Builds HOSTS namespaces joined by veth pairs to a bridge on a private test subnet
# (10.231.9.0/24), each with its own hostname (UTS namespace) so ddp sees separate hosts, the
# same way as tests/netns/netns_test.sh. In each it runs
#   ddprun --nnodes=HOSTS --node-rank=i --nproc-per-node=NPROC ddp_bench_netns_allreduce --csv
# once with DDP_RING_HIERARCHY=flat and once with DDP_RING_HIERARCHY=hierarchical per repetition
# (the order alternates), takes the median busbw per size, prints a table and writes it to OUT.
#
# usage: bench/netns/run.sh [BUILD_DIR]          (default build/default; builds the two targets)
# env:   REPS=3 HOSTS=2 NPROC=2 MIN_BYTES=4096 MAX_BYTES=67108864 ITERS=8 WARMUP=2
#        DELAY=1ms (tc netem delay on every host's link; default none)
#        OUT=bench/results/netns_hierarchical.md
# The namespaces are removed on every exit path.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build/default}
reps=${REPS:-3} hosts=${HOSTS:-2} nproc=${NPROC:-2}
min_bytes=${MIN_BYTES:-4096} max_bytes=${MAX_BYTES:-67108864} iters=${ITERS:-8} warmup=${WARMUP:-2}
delay=${DELAY:-}
out=${OUT:-$root/bench/results/netns_hierarchical.md}
timeout_s=${NETNS_TIMEOUT:-600}

[ "$(id -u)" -eq 0 ] || { echo "bench/netns/run.sh: network namespaces need root" >&2; exit 77; }
command -v ip >/dev/null || { echo "bench/netns/run.sh: iproute2 (ip) is not installed" >&2; exit 77; }
command -v unshare >/dev/null || { echo "bench/netns/run.sh: unshare (util-linux) is not installed" >&2; exit 77; }
command -v python3 >/dev/null || { echo "bench/netns/run.sh: python3 is needed for the table" >&2; exit 77; }

cmake --build "$build" --target ddprun ddp_bench_netns_allreduce >/dev/null || { echo "build failed" >&2; exit 1; }
ddprun=$build/tools/ddprun/ddprun
[ -x "$ddprun" ] || ddprun=$(find "$build" -name ddprun -type f -perm -u+x | head -1)
bench=$(find "$build" -name ddp_bench_netns_allreduce -type f -perm -u+x | head -1)
[ -x "$ddprun" ] && [ -x "$bench" ] || { echo "ddprun or ddp_bench_netns_allreduce not found in $build" >&2; exit 1; }

tag=ddpb$$
work=$(mktemp -d)
# shellcheck source=../../tests/netns/topology.sh
. "$root/tests/netns/topology.sh"
trap netns_cleanup EXIT
trap 'exit 130' INT TERM
netns_create 10.231.9 "$delay"
case $? in
  0) ;;
  2) echo "cannot create network namespaces here" >&2; exit 77 ;;
  *) echo "bench/netns/run.sh: DELAY=$delay needs tc netem (kernel module sch_netem), which is not available here" >&2; exit 77 ;;
esac
master=10.231.9.1
port=$((20000 + $$ % 20000))

# one MODE REP: every host's ddprun with DDP_RING_HIERARCHY=MODE; rank 0's CSV in $work/MODE.REP.csv
one() {
  local mode=$1 rep=$2 i
  local -a pids
  port=$((port + 1))
  for i in $(seq 0 $((hosts - 1))); do
    ip netns exec "${tag}h$i" unshare --uts sh -c "hostname host$i && exec timeout $timeout_s \"\$0\" \"\$@\"" \
      env DDP_RING_HIERARCHY="$mode" \
      "$ddprun" --nnodes="$hosts" --node-rank="$i" --master-addr="$master" --master-port="$port" --nproc-per-node="$nproc" \
      "$bench" --csv --system "$mode" --min-bytes "$min_bytes" --max-bytes "$max_bytes" --iters "$iters" --warmup "$warmup" \
      $([ "$rep" -eq 1 ] && echo --check) > "$work/$mode.$rep.host$i.log" 2>&1 &
    pids[$i]=$!
  done
  local failed=0
  for i in $(seq 0 $((hosts - 1))); do wait "${pids[$i]}" || failed=1; done
  if [ "$failed" -ne 0 ]; then
    for i in $(seq 0 $((hosts - 1))); do echo "--- $mode rep $rep host $i"; cat "$work/$mode.$rep.host$i.log"; done
    echo "FAIL: $mode repetition $rep" >&2
    exit 1
  fi
  grep "^$mode," "$work/$mode.$rep.host0.log" > "$work/$mode.$rep.csv"
  grep -m1 "^# ddp all_reduce" "$work/$mode.$rep.host0.log" > "$work/$mode.what" || true
  echo "  $mode repetition $rep: $(wc -l < "$work/$mode.$rep.csv") sizes; $(cat "$work/$mode.what")" >&2
}

echo "flat vs hierarchical all-reduce: $hosts namespaces x $nproc ranks, ${delay:-no} added delay, $reps repetitions" >&2
for rep in $(seq 1 "$reps"); do
  if [ $((rep % 2)) -eq 1 ]; then one flat "$rep"; one hierarchical "$rep"; else one hierarchical "$rep"; one flat "$rep"; fi
done

command_line="bench/netns/run.sh${1:+ $1}  (REPS=$reps HOSTS=$hosts NPROC=$nproc MIN_BYTES=$min_bytes MAX_BYTES=$max_bytes ITERS=$iters WARMUP=$warmup${delay:+ DELAY=$delay})"
mkdir -p "$(dirname "$out")"
python3 - "$work" "$reps" "$hosts" "$nproc" "${delay:-none}" "$command_line" "$(cat "$work/flat.what")" "$(cat "$work/hierarchical.what")" > "$work/table.md" <<'PY'
import csv, glob, statistics, sys
work, reps, hosts, nproc, delay, command, flat_what, hier_what = sys.argv[1:9]
busbw, time_us = {}, {}
for path in glob.glob(f"{work}/*.csv"):
    for row in csv.reader(open(path)):
        key = (row[0], int(row[2]))
        busbw.setdefault(key, []).append(float(row[7]))
        time_us.setdefault(key, []).append(float(row[5]))
sizes = sorted({b for (_, b) in busbw})
def size(b):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div: return f"{b // div} {unit}"
    return f"{b} B"
print(f"Median of {reps} repetitions, float32 sum, in place, group buffers, {hosts} hosts x {nproc} ranks "
      f"(p = {int(hosts) * int(nproc)}; busbw = algbw * 2(p-1)/p), added link delay: {delay}.")
print(f"flat: `{flat_what.lstrip('# ')}`; hierarchical: `{hier_what.lstrip('# ')}`.")
print()
print(f"Command: `{command}`")
print()
print("| size | flat time (us) | flat busbw (GB/s) | hierarchical time (us) | hierarchical busbw (GB/s) | hier / flat |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for b in sizes:
    f, h = busbw.get(("flat", b)), busbw.get(("hierarchical", b))
    if not f or not h: continue
    fm, hm = statistics.median(f), statistics.median(h)
    ft, ht = statistics.median(time_us[("flat", b)]), statistics.median(time_us[("hierarchical", b)])
    print(f"| {size(b)} | {ft:.1f} | {fm:.3f} | {ht:.1f} | {hm:.3f} | {hm / fm:.2f}x |")
PY
{
  echo "# Flat versus hierarchical all-reduce in network namespaces"
  echo
  echo "Written by bench/netns/run.sh on $(date -u +%Y-%m-%d) ($(nproc) CPUs, $(uname -r))."
  echo
  cat "$work/table.md"
} > "$out"
cat "$work/table.md"
echo "written: $out" >&2
