#!/usr/bin/env bash
# Flat versus hierarchical all-reduce across "hosts" made of network namespaces (root + iproute2),
# and Open MPI over TCP on the same namespaces.
#
# Builds HOSTS namespaces joined by veth pairs to a bridge on a private test subnet
# (10.231.9.0/24), each with its own hostname (UTS namespace) so ddp sees separate hosts, the
# same way as tests/netns/netns_test.sh. Per repetition it runs, in an order that rotates:
#   flat, hierarchical: in each namespace
#     ddprun --nnodes=HOSTS --node-rank=i --nproc-per-node=NPROC ddp_bench_netns_allreduce --csv
#     with DDP_RING_HIERARCHY=flat or hierarchical;
#   openmpi: mpirun (in host 0's namespace) -np HOSTS*NPROC mpi_bench_allreduce --in-place --csv
#     over a hostfile of the namespaces, its orteds started in the other namespaces by the rsh
#     launcher's agent mpi_rsh_agent.sh (ip netns exec instead of ssh); pml ob1, btl
#     self,vader,tcp (vader within a host, tcp between), tcp and oob on 10.231.9.0/24 only,
#     mpi_yield_when_idle=MPI_YIELD.
# It takes the median time and busbw per size, prints a table and writes it to OUT.
# The openmpi column is left out (with a note) when mpirun or mpi_bench_allreduce is missing or
# MPI=0; a failed mpirun fails the run like a failed ddprun.
#
# usage: bench/netns/run.sh [BUILD_DIR]          (default build/default; builds the targets)
# env:   REPS=3 HOSTS=2 NPROC=2 MIN_BYTES=4096 MAX_BYTES=67108864 ITERS=8 WARMUP=2
#        DELAY=1ms (tc netem delay on every host's link; default none)
#        MPI=1 (0: no Open MPI column)  MPI_YIELD=1 (Open MPI's mpi_yield_when_idle; the ranks
#        outnumber the cores here, and with 0 every all-reduce takes 40-140 ms)
#        MPI_ARGS="" (more mpirun arguments, split on blanks)
#        OUT=bench/results/netns_hierarchical.md
# The namespaces (and anything Open MPI left under their hostnames) are removed on every exit path.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build/default}
reps=${REPS:-3} hosts=${HOSTS:-2} nproc=${NPROC:-2}
min_bytes=${MIN_BYTES:-4096} max_bytes=${MAX_BYTES:-67108864} iters=${ITERS:-8} warmup=${WARMUP:-2}
delay=${DELAY:-}
use_mpi=${MPI:-1} mpi_yield=${MPI_YIELD:-1} mpi_args=${MPI_ARGS:-}
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

# Open MPI: mpi_bench_allreduce exists only where CMake found MPI, so its build may fail
systems="flat hierarchical"
mpi_note=""
if [ "$use_mpi" = 1 ]; then
  if ! command -v mpirun >/dev/null; then
    mpi_note="no Open MPI column: mpirun is not installed"
  else
    mpibench=""
    cmake --build "$build" --target mpi_bench_allreduce >/dev/null 2>&1 &&
      mpibench=$(find "$build" -name mpi_bench_allreduce -type f -perm -u+x | head -1)
    if [ -z "$mpibench" ]; then
      mpi_note="no Open MPI column: mpi_bench_allreduce did not build in $build (did CMake find MPI?)"
    else
      systems="flat hierarchical openmpi"
      mpi_version=$(mpirun --version 2>/dev/null | head -1)
    fi
  fi
  [ -z "$mpi_note" ] || echo "bench/netns/run.sh: $mpi_note" >&2
fi

tag=ddpb$$
work=$(mktemp -d)
# shellcheck source=../../tests/netns/topology.sh
. "$root/tests/netns/topology.sh"
# Open MPI names its session directory and vader segments after the hostname (here the
# namespace's name, which carries $tag) and leaves them behind when killed
cleanup() {
  netns_cleanup
  rm -rf "${TMPDIR:-/tmp}/ompi.${tag}"h* /dev/shm/vader_segment."${tag}"h* 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM
netns_create 10.231.9 "$delay"
case $? in
  0) ;;
  2) echo "cannot create network namespaces here" >&2; exit 77 ;;
  *) echo "bench/netns/run.sh: DELAY=$delay needs tc netem (kernel module sch_netem), which is not available here" >&2; exit 77 ;;
esac
master=10.231.9.1
port=$((20000 + $$ % 20000))
for i in $(seq 0 $((hosts - 1))); do echo "${tag}h$i slots=$nproc"; done > "$work/hostfile"

# one SYSTEM REP: flat/hierarchical: every host's ddprun with DDP_RING_HIERARCHY=SYSTEM;
# openmpi: mpirun from host 0 over all hosts. Rank 0's CSV in $work/SYSTEM.REP.csv
one() {
  local mode=$1 rep=$2 i
  local -a pids
  if [ "$mode" = openmpi ]; then
    # the hostname of host 0 is its namespace's name, as the agent gives the others
    # shellcheck disable=SC2086 # MPI_ARGS is split on purpose
    ip netns exec "${tag}h0" unshare --uts sh -c 'hostname "$0" && exec "$@"' "${tag}h0" \
      timeout "$timeout_s" mpirun --allow-run-as-root --oversubscribe --bind-to none \
      -np $((hosts * nproc)) --hostfile "$work/hostfile" --map-by slot \
      --mca plm_rsh_agent "$here/mpi_rsh_agent.sh" \
      --mca pml ob1 --mca btl self,vader,tcp \
      --mca btl_tcp_if_include 10.231.9.0/24 --mca oob_tcp_if_include 10.231.9.0/24 \
      --mca mpi_yield_when_idle "$mpi_yield" $mpi_args \
      "$mpibench" --csv --in-place --system openmpi --min-bytes "$min_bytes" --max-bytes "$max_bytes" \
      --iters "$iters" --warmup "$warmup" > "$work/$mode.$rep.host0.log" 2>&1 &
    # in the background, so that INT/TERM reach the trap at once (wait returns on a signal)
    if ! wait $!; then
      echo "--- openmpi rep $rep"; cat "$work/$mode.$rep.host0.log"
      echo "FAIL: openmpi repetition $rep" >&2
      exit 1
    fi
    echo "# $mpi_version MPI_Allreduce (MPI_IN_PLACE), pml ob1, btl self,vader,tcp, mpi_yield_when_idle=$mpi_yield${mpi_args:+ $mpi_args}" > "$work/$mode.what"
  else
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
    grep -m1 "^# ddp all_reduce" "$work/$mode.$rep.host0.log" > "$work/$mode.what" || true
  fi
  grep "^$mode," "$work/$mode.$rep.host0.log" > "$work/$mode.$rep.csv"
  echo "  $mode repetition $rep: $(wc -l < "$work/$mode.$rep.csv") sizes; $(cat "$work/$mode.what")" >&2
}

read -ra order <<< "$systems"
echo "${systems// / vs } all-reduce: $hosts namespaces x $nproc ranks, ${delay:-no} added delay, $reps repetitions" >&2
for rep in $(seq 1 "$reps"); do
  # rotate the order, so that each system runs first, second, ... about equally often
  for k in $(seq 0 $((${#order[@]} - 1))); do one "${order[$(((rep - 1 + k) % ${#order[@]}))]}" "$rep"; done
done

command_line="bench/netns/run.sh${1:+ $1}  (REPS=$reps HOSTS=$hosts NPROC=$nproc MIN_BYTES=$min_bytes MAX_BYTES=$max_bytes ITERS=$iters WARMUP=$warmup${delay:+ DELAY=$delay}"
[ "$use_mpi" = 1 ] && command_line+=" MPI_YIELD=$mpi_yield${mpi_args:+ MPI_ARGS=\"$mpi_args\"}" || command_line+=" MPI=$use_mpi"
command_line+=")"
what() { [ -f "$work/$1.what" ] && cat "$work/$1.what"; }
mkdir -p "$(dirname "$out")"
python3 - "$work" "$reps" "$hosts" "$nproc" "${delay:-none}" "$command_line" "$(what flat)" "$(what hierarchical)" "$(what openmpi)" "$mpi_note" > "$work/table.md" <<'PY'
import csv, glob, statistics, sys
work, reps, hosts, nproc, delay, command, flat_what, hier_what, mpi_what, mpi_note = sys.argv[1:11]
busbw, time_us = {}, {}
for path in glob.glob(f"{work}/*.csv"):
    for row in csv.reader(open(path)):
        key = (row[0], int(row[2]))
        busbw.setdefault(key, []).append(float(row[7]))
        time_us.setdefault(key, []).append(float(row[5]))
systems = [s for s in ("flat", "hierarchical", "openmpi") if any(k[0] == s for k in busbw)]
names = {"flat": "flat", "hierarchical": "hierarchical", "openmpi": "Open MPI"}
sizes = sorted({b for (_, b) in busbw})
def size(b):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div: return f"{b // div} {unit}"
    return f"{b} B"
print(f"Median of {reps} repetitions, float32 sum, in place, {hosts} hosts x {nproc} ranks "
      f"(p = {int(hosts) * int(nproc)}; busbw = algbw * 2(p-1)/p), added link delay: {delay}.")
whats = [f"flat: `{flat_what.lstrip('# ')}`", f"hierarchical: `{hier_what.lstrip('# ')}`"]
if "openmpi" in systems: whats.append(f"Open MPI: `{mpi_what.lstrip('# ')}`")
print("; ".join(whats) + ".")
if mpi_note: print(f"({mpi_note}.)")
print()
print(f"Command: `{command}`")
print()
ratios = [("hierarchical", "flat")] + ([("flat", "openmpi"), ("hierarchical", "openmpi")] if "openmpi" in systems else [])
head = ["size"] + [f"{names[s]} {c}" for s in systems for c in ("time (us)", "busbw (GB/s)")] + \
       [f"{names[a]} / {names[b]}" for a, b in ratios]
print("| " + " | ".join(head) + " |")
print("| " + " | ".join("---:" for _ in head) + " |")
for b in sizes:
    if any(not busbw.get((s, b)) for s in systems): continue
    bw = {s: statistics.median(busbw[(s, b)]) for s in systems}
    t = {s: statistics.median(time_us[(s, b)]) for s in systems}
    cells = [size(b)] + [x for s in systems for x in (f"{t[s]:.1f}", f"{bw[s]:.3f}")] + \
            [f"{bw[a] / bw[b]:.2f}x" for a, b in ratios]
    print("| " + " | ".join(cells) + " |")
print()
print("Ratios are of busbw (higher is faster): x / y > 1 means x is faster than y.")
PY
{
  echo "# Flat versus hierarchical all-reduce in network namespaces (and Open MPI)"
  echo
  echo "Written by bench/netns/run.sh on $(date -u +%Y-%m-%d) ($(nproc) CPUs, $(uname -r))."
  echo
  cat "$work/table.md"
} > "$out"
cat "$work/table.md"
echo "written: $out" >&2
