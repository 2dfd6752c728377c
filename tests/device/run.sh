#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with CUDA, NCCL and at least one GPU:
#
#   tools/install-deps.sh          # once (Debian packages; CUDA and NCCL come with the toolkit)
#   tests/device/run.sh            # configure with CUDA, build, run every GPU check, print a summary
#
# On a GPU machine without a package manager: run tests/device/pack-deps.sh where the packages
# are installed and bring .device-deps/ along (used when present). NCCL is found in the CUDA
# toolkit, at NCCL_ROOT, or in Python's nvidia-nccl wheel.
#
# 1. configure (CMAKE_CUDA_ARCHITECTURES=native unless CUDA_ARCH says otherwise) and build the
#    device targets;
# 2. ctest -L "gpu|nccl": NCCL collectives of every dtype and reduction against host references,
#    host operands, compute-stream ordering, mismatch and deadline (these two need 2 GPUs), DDP on
#    thrust::device_vector, checkpoints of device memory (saved, loaded into device and host
#    memory, bit for bit), the optimizers on device memory (SGD and AdamW stepped on device and on
#    host, parameters and state bit for bit; unscale and clipping), sharded_data_parallel (ZeRO 1
#    and 2) on device parameters with those optimizers against the host arithmetic, bit for bit
#    (W = 1, and W = 2 with 2+ GPUs), the host-side logic, the benchmark's checked short sweep;
# 3. train_ddp_cuda --init-seed 0 (NCCL backend; exact and cuBLAS GEMM) against the CPU build's
#    printed lines, within 1e-4; with 2+ GPUs also as two ranks (--nproc-per-node 2); the same with
#    --optimizer adamw --clip (ddp/optim/cuda.hpp on device memory), --zero 1 and 2 on device
#    shards over nccl, and with --zero 1 over the
#    ring backend (host mirrors);
# 4. ddp_bench_nccl: the all-reduce busbw sweep through ddp next to ncclAllReduce called directly
#    (the ratio is the wrapper's cost; goal >= 0.95 from 64 KiB), in place (as DDP calls it) and
#    out of place (with one GPU NCCL's in-place all-reduce moves nothing, so only the
#    out-of-place sweep moves data there); ddp_bench_nccl_calls: the cost of each call on the path.
#
# Results (logs, the benchmark's table and CSV, train reports) go to $DDP_DEVICE_OUT (default
# build/device/results). Exit status: 0 when every step passed, 1 when one failed, 77 (skipped)
# when no GPU is visible: then the GPU tests only prove that they skip.
set -uo pipefail
cd "$(dirname "$0")/../.."

build=${DDP_DEVICE_BUILD:-build/device}
out=${DDP_DEVICE_OUT:-$build/results}
arch=${CUDA_ARCH:-native}
jobs=${JOBS:-$(nproc)}
mkdir -p "$out"

summary=()
failed=0
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records PASS/FAIL
  local name=$1
  shift
  echo
  echo "=== $name"
  local log="$out/${name// /_}.log"
  if "$@" 2>&1 | tee "$log"; then
    summary+=("PASS  $name")
  else
    summary+=("FAIL  $name (log: $log)")
    failed=1
  fi
}
finish() {
  echo
  echo "=== summary"
  printf '%s\n' "${summary[@]}"
  if [ "$failed" -ne 0 ]; then exit 1; fi
  if [ "$gpus" -eq 0 ]; then
    echo "SKIPPED: no GPU visible; the GPU tests reported SKIPPED, nothing ran on a device"
    exit 77
  fi
  exit 0
}

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
  gpus=$(find /dev -maxdepth 1 -name 'nvidia[0-9]*' 2>/dev/null | wc -l)
fi
echo "GPUs visible: $gpus"
if [ "$gpus" -eq 0 ]; then arch=${CUDA_ARCH:-75}; fi  # "native" needs a GPU to look at

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" -DDDP_BUILD_HOST_TESTS=OFF -DDDP_EXAMPLES=train_ddp)
# A machine without a package manager: the header-only dependencies packed by pack-deps.sh.
if [ -d .device-deps/usr ]; then cmake_args+=(-DCMAKE_PREFIX_PATH="$PWD/.device-deps/usr"); fi
# NCCL outside the CUDA toolkit: NCCL_ROOT, else the nvidia-nccl wheel of a Python installation.
if [ -z "${NCCL_ROOT:-}" ] && command -v python3 >/dev/null 2>&1; then
  # nvidia-nccl-cu12 installs under nvidia/nccl, the CUDA 13 wheels under nvidia/cu13.
  wheel=$(python3 - <<'PY' 2>/dev/null || true
import os, site, sys
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for sub in ("nvidia/nccl", "nvidia/cu13", "nvidia/cu12"):
        root = os.path.join(base, sub)
        if os.path.exists(os.path.join(root, "include", "nccl.h")):
            print(root)
            sys.exit()
PY
)
  if [ -n "$wheel" ]; then export NCCL_ROOT=$wheel; fi
fi
if [ -n "${NCCL_ROOT:-}" ]; then
  cmake_args+=(-DNCCL_ROOT="$NCCL_ROOT")
  export LD_LIBRARY_PATH="$NCCL_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

step "configure" cmake -S . -B "$build" "${cmake_args[@]}"
if ! grep -q 'NCCL ON' "$out/configure.log"; then
  summary+=("FAIL  CMake found no CUDA compiler or no NCCL (see $out/configure.log): install the CUDA toolkit and NCCL")
  failed=1
  finish
fi
build_targets() {  # one make per target, side by side (a make given several targets runs them in turn)
  cmake --build "$build" --target ddp_catch_main || return 1
  local pids=() target status=0
  for target in nccl_host_logic_test nccl_backend_test ddp_device_test checkpoint_device_test optim_device_test sharded_device_test ddp_bench_nccl ddp_bench_nccl_calls train_ddp train_ddp_cuda; do
    cmake --build "$build" -j "$jobs" --target "$target" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}
step "build" build_targets
[ "$failed" -eq 0 ] || finish

step "gpu tests" ctest --test-dir "$build" -L "gpu|nccl" --output-on-failure --timeout 300

# The CUDA build against the CPU build: the numbers of "Epoch N: Rank 0 local loss sum = X".
cpu="$build/examples/train_ddp/train_ddp"
cuda="$build/examples/train_ddp/train_ddp_cuda"
compare_lines() {  # compare_lines EXPECTED_FILE ACTUAL_FILE
  paste -d' ' <(grep -o '= [-0-9.]*$' "$1" | cut -c3-) <(grep -o '= [-0-9.]*$' "$2" | cut -c3-) |
    awk 'BEGIN { n = 0; bad = 0 } { n++; d = $1 - $2; if (d < 0) d = -d; if ($2 == "" || d > 1e-4) bad++;
         printf "epoch %d: cpu %s cuda %s |diff| %.2g\n", n, $1, $2, d }
         END { if (n != 3 || bad) { print "MISMATCH"; exit 1 } }'
}
train_check() {  # train_check LABEL EXTRA_ARGS...
  local label=$1
  shift
  "$cpu" --init-seed 0 "$@" --backend ring > "$out/train_cpu_$label.txt" || return 1
  "$cuda" --init-seed 0 "$@" --gemm exact --report "$out/train_cuda_exact_$label.json" > "$out/train_cuda_exact_$label.txt" || return 1
  "$cuda" --init-seed 0 "$@" --gemm cublas --report "$out/train_cuda_cublas_$label.json" > "$out/train_cuda_cublas_$label.txt" || return 1
  cat "$out/train_cuda_exact_$label.txt"
  echo "exact GEMM:"
  compare_lines "$out/train_cpu_$label.txt" "$out/train_cuda_exact_$label.txt" || return 1
  echo "cuBLAS GEMM:"
  compare_lines "$out/train_cpu_$label.txt" "$out/train_cuda_cublas_$label.txt" || return 1
  grep -o '"peak_device_memory_bytes": *[0-9-]*' "$out/train_cuda_exact_$label.json" || true
}
zero_check() {  # ZeRO-1 in the CUDA build: host mirrors over the ring backend, AdamW on the host shard
  "$cpu" --init-seed 0 --optimizer adamw --zero 1 --backend ring > "$out/train_cpu_zero1.txt" || return 1
  "$cuda" --init-seed 0 --optimizer adamw --zero 1 --backend ring --gemm exact > "$out/train_cuda_zero1.txt" || return 1
  compare_lines "$out/train_cpu_zero1.txt" "$out/train_cuda_zero1.txt"
}
if [ "$gpus" -ge 1 ]; then
  step "train_ddp_cuda vs cpu, 1 rank" train_check w1
  # ddp/optim/cuda.hpp on the parameters in device memory (nccl), clipped on the device.
  step "train_ddp_cuda --optimizer adamw --clip vs cpu, 1 rank" train_check w1_adamw_clip --optimizer adamw --clip 0.05
  step "train_ddp_cuda --optimizer adamw --zero 1 --backend ring vs cpu, 1 rank" zero_check
  # ZeRO on device memory over nccl: device shards, device_shard_step's sharded clip, device AdamW.
  step "train_ddp_cuda --optimizer adamw --clip --zero 2 (nccl, device shards) vs cpu, 1 rank" \
    train_check w1_adamw_clip_zero2 --optimizer adamw --clip 0.05 --zero 2
  if [ "$gpus" -ge 2 ]; then
    step "train_ddp_cuda vs cpu, 2 ranks" train_check w2 --nproc-per-node 2
    step "train_ddp_cuda --optimizer sgd --momentum --zero 1 (nccl, device shards) vs cpu, 2 ranks" \
      train_check w2_sgd_zero1 --nproc-per-node 2 --optimizer sgd --momentum 0.9 --zero 1
  fi
  step "nccl all-reduce sweep, in place" "$build/bench/nccl/ddp_bench_nccl" --np "$gpus" --check
  step "nccl all-reduce sweep, out of place" "$build/bench/nccl/ddp_bench_nccl" --np "$gpus" --check --out-of-place
  step "nccl call costs" "$build/bench/nccl/ddp_bench_nccl_calls"
else
  summary+=("SKIP  train_ddp_cuda vs cpu: no GPU")
  summary+=("SKIP  nccl all-reduce sweep: no GPU")
fi

# libtorch's CUDA path (examples/libtorch_ddp --device cuda, nccl backend) needs a PyTorch venv on
# this machine (the CUDA wheel and its nvidia-* libraries, about 3 GB: too large to travel with
# the tree); where one exists (DDP_TORCH_VENV, or build/torch-venv from tools/torch-venv.sh) it is
# built and run against the golden lines.
venv=${DDP_TORCH_VENV:-$PWD/build/torch-venv}
if [ "$gpus" -ge 1 ] && [ -x "$venv/bin/python" ]; then
  libtorch_cuda() {
    cmake -S . -B "$build-libtorch" -DCMAKE_BUILD_TYPE=Release -DDDP_LIBTORCH_CUDA=ON -DDDP_TORCH_VENV="$venv" \
          -DDDP_ENABLE_MPI=OFF -DDDP_BUILD_BENCH=OFF >/dev/null &&
      cmake --build "$build-libtorch" -j "$jobs" --target libtorch_ddp ddprun &&
      ctest --test-dir "$build-libtorch" -R "libtorch_cuda_w[12]$" --output-on-failure --timeout 300
  }
  step "libtorch CUDA path (libtorch_ddp --device cuda)" libtorch_cuda
else
  summary+=("SKIP  libtorch CUDA path: needs a GPU and a PyTorch venv on this machine ($venv)")
fi
finish
