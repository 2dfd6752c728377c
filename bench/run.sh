#!/usr/bin/env bash
# One command for the all-reduce comparison: ddp (shm group/user buffers, tcp) against
# Open MPI (shared memory in place and out of place, TCP only), Gloo (TCP) and the machine's
# limits, p = 2 and 4, float32 sum, 4 B .. 64 MiB. Repetitions are interleaved across systems
# so machine noise hits all alike; the tables use medians of REPS (>= 5) repetitions.
# Writes bench/results/allreduce.csv, allreduce_raw.csv, limits.csv, PNG plots and a
# ratio table (bench/results/allreduce.md). Bounded to about 15 minutes on 2 cores.
# RESULTS_DIR=dir writes there instead (a partial sweep, e.g. MAX_BYTES=4096 NPS=2, then
# leaves the recorded run in bench/results/ alone).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build/bench}
results=${RESULTS_DIR:-$here/results}
reps=${REPS:-5}
max_bytes=${MAX_BYTES:-67108864}
nps=${NPS:-"2 4"}

"$root/tools/install-deps.sh"
need=()
for p in libgloo-dev gnuplot-nox python3; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "bench: installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "bench: building in $build" >&2
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_ENABLE_CUDA=OFF >/dev/null
cmake --build "$build" -j2 --target ddp_bench_allreduce mpi_bench_allreduce gloo_bench_allreduce ddp_bench_limits >/dev/null

mkdir -p "$results"
raw=$results/allreduce_raw.csv
echo "rep,system,ranks,bytes,count,type,time_us,algbw_gbs,busbw_gbs" > "$raw"
mpirun_flags=(--oversubscribe --bind-to none)
[ "$(id -u)" -eq 0 ] && mpirun_flags+=(--allow-run-as-root)
sweep=(--max-bytes "$max_bytes" --csv)

# system name -> command (reads $np)
run_system() {
  local system=$1 np=$2
  case $system in
    ddp-shm-group) "$build/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport shm --buffer group --system "$system" "${sweep[@]}" ;;
    ddp-shm-user)  "$build/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport shm --buffer user --system "$system" "${sweep[@]}" ;;
    ddp-tcp)       "$build/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport tcp --buffer user --system "$system" "${sweep[@]}" ;;
    openmpi-shm-inplace) OMPI_MCA_btl=self,vader mpirun "${mpirun_flags[@]}" -n "$np" "$build/bench/compare/mpi_bench_allreduce" --in-place --system "$system" "${sweep[@]}" ;;
    openmpi-shm)   OMPI_MCA_btl=self,vader mpirun "${mpirun_flags[@]}" -n "$np" "$build/bench/compare/mpi_bench_allreduce" --system "$system" "${sweep[@]}" ;;
    openmpi-tcp)   OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo mpirun "${mpirun_flags[@]}" -n "$np" "$build/bench/compare/mpi_bench_allreduce" --system "$system" "${sweep[@]}" ;;
    gloo-tcp)      "$build/bench/compare/gloo_bench_allreduce" --np "$np" --system "$system" "${sweep[@]}" ;;
    probe)         "$build/bench/limits/ddp_bench_limits" --probe "${sweep[@]}" ;;
    probe-copy)    "$build/bench/limits/ddp_bench_limits" --probe --copy "${sweep[@]}" ;;
  esac
}

systems=(ddp-shm-group ddp-shm-user ddp-tcp openmpi-shm-inplace openmpi-shm openmpi-tcp gloo-tcp)
total=$(( reps * ($(wc -w <<<"$nps") * ${#systems[@]} + 2) ))
done_runs=0
started=$(date +%s)
for rep in $(seq 1 "$reps"); do
  for np in $nps; do
    for system in "${systems[@]}"; do
      done_runs=$((done_runs + 1))
      printf '\rbench: rep %d/%d  p=%d  %-20s [%d/%d, %ds]' "$rep" "$reps" "$np" "$system" "$done_runs" "$total" $(( $(date +%s) - started )) >&2
      run_system "$system" "$np" | grep -v '^system,' | sed "s/^/$rep,/" >> "$raw" || echo "bench: $system p=$np failed" >&2
    done
  done
  for system in probe probe-copy; do
    done_runs=$((done_runs + 1))
    printf '\rbench: rep %d/%d  p=2  %-20s [%d/%d, %ds]' "$rep" "$reps" "$system" "$done_runs" "$total" $(( $(date +%s) - started )) >&2
    run_system "$system" 2 | grep -v '^system,' | sed "s/^/$rep,/" >> "$raw"
  done
done
echo >&2
"$build/bench/limits/ddp_bench_limits" --bandwidth --csv > "$results/limits.csv"
python3 "$here/report.py" "$results"
