#!/usr/bin/env bash
# The all-reduce against the strongest CPU libraries on one host: ddp over shared memory (group and
# user buffers) against Intel MPI (ordinary buffers and its shared heap, MPI_Alloc_mem), MPICH,
# oneCCL, Open MPI and DeepSpeed's CPU shm all-reduce; float32 sum, in place, 4 B .. 64 MiB,
# repetitions interleaved across systems as in bench/run.sh, medians of REPS (>= 5).
# Installs what is missing: Debian's mpich (called as mpicxx.mpich / mpirun.mpich, so Open MPI
# stays the default mpirun), a venv build/anchors-venv with the impi-devel, impi-rt, oneccl and
# oneccl-cpu(-devel) wheels, and deepspeed into build/torch-venv (bench/torch/run.sh makes it).
# An anchor whose install, build or smoke run fails is reported as "SKIPPED: <why>" and left out;
# the ddp systems always run. Writes bench/results/anchors_raw.csv, anchors.csv (medians),
# anchors.md (times and ratios) and anchors_{busbw,latency}_p{N}.png.
#   REPS=5 NPS=2 MAX_BYTES=67108864 SYSTEMS="ddp-shm-user impi-shm ..." RESULTS_DIR=dir
# RUNNER: a command every system's runs go under (not the builds), e.g. RUNNER="chrt -f 10" on a
# machine busy with compilers (as for bench/compare_commits.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build/bench}
anchors=${ANCHORS_DIR:-$root/build/anchors}
venv=${ANCHORS_VENV:-$root/build/anchors-venv}
torch_venv=${TORCH_VENV:-$root/build/torch-venv}
results=${RESULTS_DIR:-$here/results}
reps=${REPS:-5}
max_bytes=${MAX_BYTES:-67108864}
nps=${NPS:-2}
impi_version=${IMPI_VERSION:-2021.18.1}
oneccl_version=${ONECCL_VERSION:-2021.17.2}
deepspeed_spec=${DEEPSPEED_SPEC:-deepspeed}
all_systems=(ddp-shm-group ddp-shm-user impi-shm impi-shm-heap mpich-shm oneccl-shm openmpi-shm-inplace deepspeed-shm)
read -r -a systems <<<"${SYSTEMS:-${all_systems[*]}}"

"$root/tools/install-deps.sh"
mkdir -p "$anchors" "$results"
log=$anchors/install.log
: > "$log"
# The plots (bench/report.py), as bench/run.sh makes them.
if ! dpkg-query -W -f='${Status}' gnuplot-nox 2>/dev/null | grep -q "install ok installed"; then
  echo "bench: installing gnuplot-nox" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gnuplot-nox >>"$log" 2>&1 || echo "bench: gnuplot-nox not installed (see $log): no plots" >&2
fi
declare -A skipped=()
skip() { skipped[$1]=$2; echo "bench: $1 SKIPPED: $2" >&2; }
wanted() { [[ " ${systems[*]} " == *" $1 "* ]]; }

echo "bench: building ddp and Open MPI in $build" >&2
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_ENABLE_CUDA=OFF >/dev/null
cmake --build "$build" -j2 --target ddp_bench_allreduce >/dev/null
cmake --build "$build" -j2 --target mpi_bench_allreduce >>"$log" 2>&1 || skip openmpi-shm-inplace "mpi_bench_allreduce did not build (see $log)"

# MPICH from Debian, by its full names.
if wanted mpich-shm; then
  if ! command -v mpicxx.mpich >/dev/null || ! command -v mpirun.mpich >/dev/null; then
    echo "bench: installing mpich" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mpich libmpich-dev >>"$log" 2>&1 || true
  fi
  if ! command -v mpicxx.mpich >/dev/null; then
    skip mpich-shm "apt-get install mpich libmpich-dev failed (see $log)"
  elif ! mpicxx.mpich -std=c++20 -O2 -o "$anchors/mpich_bench_allreduce" "$here/compare/mpi_allreduce.cpp" >>"$log" 2>&1; then
    skip mpich-shm "mpicxx.mpich failed (see $log)"
  fi
fi

# Intel MPI and oneCCL from PyPI. The oneccl wheel brings libccl.so.2, which the CPU build of
# libccl.so.1 (oneccl-cpu, installed over oneccl's SYCL build) needs.
if wanted impi-shm || wanted impi-shm-heap || wanted oneccl-shm; then
  if [ ! -x "$venv/bin/pip" ]; then
    python3 -m venv "$venv" >>"$log" 2>&1 || true
  fi
  if [ ! -x "$venv/bin/pip" ]; then
    for s in impi-shm impi-shm-heap oneccl-shm; do skip $s "python3 -m venv $venv failed (see $log)"; done
  else
    if [ ! -x "$venv/bin/mpicxx" ]; then
      echo "bench: installing impi-devel, impi-rt $impi_version into $venv" >&2
      "$venv/bin/pip" install -q "impi-devel==$impi_version" "impi-rt==$impi_version" >>"$log" 2>&1 || true
    fi
    if wanted oneccl-shm && ! { [ -e "$venv/lib/libccl.so.2" ] && [ -e "$venv/include/oneapi/ccl.hpp" ] &&
                               [ -e "$venv/lib/libccl.so.1" ] && ! readelf -d "$venv/lib/libccl.so.1" | grep -q libsycl; }; then
      echo "bench: installing oneccl, oneccl-cpu, oneccl-cpu-devel $oneccl_version into $venv" >&2
      "$venv/bin/pip" install -q "oneccl==$oneccl_version" >>"$log" 2>&1 &&
        "$venv/bin/pip" install -q --force-reinstall --no-deps "oneccl-cpu==$oneccl_version" "oneccl-cpu-devel==$oneccl_version" >>"$log" 2>&1 || true
    fi
  fi
fi
impi_env=(env I_MPI_ROOT="$venv" PATH="$venv/bin:$PATH" LD_LIBRARY_PATH="$venv/lib" FI_PROVIDER_PATH="$venv/lib" I_MPI_FABRICS=shm)
if wanted impi-shm || wanted impi-shm-heap; then
  if [ -n "${skipped[impi-shm]:-}" ]; then :
  elif [ ! -x "$venv/bin/mpicxx" ]; then
    for s in impi-shm impi-shm-heap; do skip $s "pip install impi-devel impi-rt failed (see $log)"; done
  elif ! "${impi_env[@]}" I_MPI_CXX=g++ "$venv/bin/mpicxx" -std=c++20 -O2 -o "$anchors/impi_bench_allreduce" "$here/compare/mpi_allreduce.cpp" >>"$log" 2>&1; then
    for s in impi-shm impi-shm-heap; do skip $s "Intel MPI's mpicxx failed (see $log)"; done
  fi
fi
if wanted oneccl-shm && [ -z "${skipped[oneccl-shm]:-}" ]; then
  if [ ! -e "$venv/include/oneapi/ccl.hpp" ] || [ ! -e "$venv/lib/libccl.so.2" ]; then
    skip oneccl-shm "pip install oneccl oneccl-cpu oneccl-cpu-devel $oneccl_version failed (see $log)"
  elif ! g++ -std=c++20 -O2 -I"$venv/include" -o "$anchors/oneccl_bench_allreduce" "$here/compare/oneccl_allreduce.cpp" \
         -L"$venv/lib" -lccl -Wl,-rpath,"$venv/lib" >>"$log" 2>&1; then
    skip oneccl-shm "oneccl_allreduce.cpp did not build against $venv (see $log)"
  fi
fi

# DeepSpeed into the torch venv; its shm op builds itself (torch cpp_extension) on first use.
export TORCH_EXTENSIONS_DIR=$anchors/torch_extensions
if wanted deepspeed-shm; then
  if [ ! -x "$torch_venv/bin/python" ]; then
    skip deepspeed-shm "no torch venv at $torch_venv (bench/torch/run.sh makes one)"
  else
    if ! "$torch_venv/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
      echo "bench: installing $deepspeed_spec into $torch_venv" >&2
      "$torch_venv/bin/pip" install -q "$deepspeed_spec" >>"$log" 2>&1 || true
    fi
    "$torch_venv/bin/python" -c "import deepspeed" >/dev/null 2>&1 || skip deepspeed-shm "pip install $deepspeed_spec failed (see $log)"
  fi
fi

mpirun_flags=(--oversubscribe --bind-to none)
[ "$(id -u)" -eq 0 ] && mpirun_flags+=(--allow-run-as-root)
sweep=(--max-bytes "$max_bytes" --csv)
# oneCCL on 2 cores: its worker threads spin beside the ranks' own, so the rank thread does the
# work (CCL_WORKER_OFFLOAD=0); shm between the ranks of one host (CCL_ATL_SHM=1).
ccl_env=(env LD_LIBRARY_PATH="$venv/lib" FI_PROVIDER_PATH="$venv/lib" CCL_ATL_TRANSPORT=ofi CCL_ATL_SHM=1
         CCL_WORKER_OFFLOAD=0 CCL_LOG_LEVEL=error)

# system name -> command; every run is bounded (LIMIT seconds) so that a hung anchor costs one row
limit=${LIMIT:-900}
run_system() {
  local system=$1 np=$2
  shift 2
  case $system in
    ddp-shm-group) timeout "$limit" ${RUNNER:-} "$build/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport shm --buffer group --system "$system" "$@" ;;
    ddp-shm-user)  timeout "$limit" ${RUNNER:-} "$build/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport shm --buffer user --system "$system" "$@" ;;
    impi-shm)      timeout "$limit" ${RUNNER:-} "${impi_env[@]}" "$venv/bin/mpirun" -n "$np" "$anchors/impi_bench_allreduce" --in-place --system "$system" "$@" ;;
    impi-shm-heap) timeout "$limit" ${RUNNER:-} "${impi_env[@]}" I_MPI_SHM_HEAP=1 "$venv/bin/mpirun" -n "$np" "$anchors/impi_bench_allreduce" --in-place --alloc-mem --system "$system" "$@" ;;
    mpich-shm)     timeout "$limit" ${RUNNER:-} mpirun.mpich -n "$np" "$anchors/mpich_bench_allreduce" --in-place --system "$system" "$@" ;;
    oneccl-shm)    timeout "$limit" ${RUNNER:-} "${ccl_env[@]}" "$anchors/oneccl_bench_allreduce" --np "$np" --system "$system" "$@" ;;
    openmpi-shm-inplace) OMPI_MCA_btl=self,vader timeout "$limit" ${RUNNER:-} mpirun "${mpirun_flags[@]}" -n "$np" "$build/bench/compare/mpi_bench_allreduce" --in-place --system "$system" "$@" ;;
    deepspeed-shm) timeout "$limit" ${RUNNER:-} "$torch_venv/bin/python" "$here/compare/deepspeed_allreduce.py" --np "$np" --system "$system" "$@" ;;
  esac
}

# A short run of every anchor first: it must print its CSV rows (DeepSpeed builds its op here).
for system in "${systems[@]}"; do
  [ -n "${skipped[$system]:-}" ] && continue
  echo "bench: smoke run of $system" >&2
  out=$(run_system "$system" 2 --max-bytes 4096 --iters 2 --csv 2>"$anchors/smoke_$system.log") || true
  grep -q "^$system,2,4096," <<<"$out" || skip "$system" "its smoke run printed no rows: $(grep -v -e WARN -e '^\s*$' "$anchors/smoke_$system.log" | tail -n 1 | cut -c1-200)"
done

raw=$results/anchors_raw.csv
echo "rep,system,ranks,bytes,count,type,time_us,algbw_gbs,busbw_gbs" > "$raw"
{
  echo "# anchors.sh $(date -u +%FT%TZ) at $(git -C "$root" rev-parse --short HEAD), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  command -v mpichversion >/dev/null && echo "mpich: $(mpichversion | sed -n 's/MPICH Version:\s*//p') ($(mpichversion | sed -n 's/MPICH Device:\s*//p'))"
  [ -x "$venv/bin/pip" ] && "$venv/bin/pip" list 2>/dev/null | awk '$1 ~ /^(impi-rt|oneccl|oneccl-cpu)$/ {print $1 ": " $2}'
  [ -x "$torch_venv/bin/pip" ] && "$torch_venv/bin/pip" list 2>/dev/null | awk '$1 ~ /^(deepspeed|torch)$/ {print $1 ": " $2}'
  command -v ompi_info >/dev/null && echo "openmpi: $(ompi_info --version 2>/dev/null | head -n 1 | awk '{print $NF}')"
  for s in "${!skipped[@]}"; do echo "SKIPPED $s: ${skipped[$s]}"; done
} > "$results/anchors_versions.txt"
run=()
for s in "${systems[@]}"; do [ -z "${skipped[$s]:-}" ] && run+=("$s"); done
total=$(( reps * $(wc -w <<<"$nps") * ${#run[@]} ))
done_runs=0
started=$(date +%s)
for rep in $(seq 1 "$reps"); do
  for np in $nps; do
    for system in "${run[@]}"; do
      done_runs=$((done_runs + 1))
      printf '\rbench: rep %d/%d  p=%d  %-20s [%d/%d, %ds]' "$rep" "$reps" "$np" "$system" "$done_runs" "$total" $(( $(date +%s) - started )) >&2
      rc=0
      rows=$(run_system "$system" "$np" "${sweep[@]}" 2>>"$anchors/run.log") || rc=$?
      if [ "$rc" -eq 124 ]; then echo " bench: $system p=$np stopped after LIMIT=$limit s (rows so far kept)" >&2
      elif [ "$rc" -ne 0 ]; then echo " bench: $system p=$np failed, exit $rc (see $anchors/run.log)" >&2; fi
      grep "^$system," <<<"$rows" | sed "s/^/$rep,/" >> "$raw" || true
    done
  done
done
echo >&2
python3 "$here/report.py" --anchors "$results"
