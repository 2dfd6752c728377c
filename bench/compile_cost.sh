#!/usr/bin/env bash
# What a user pays to compile a ddp program: the CPU time (user + sys) and peak memory of g++ on
# one file that includes <ddp/ddp.hpp>, calls init_process_group("ring") and one all_reduce,
# header-only and with the compiled library (DDP_COMPILED, ddp::ddp_compiled), at -O0 and -O2;
# beside it the same program on MPI (mpicxx) and a file that includes only <vector> and <string>;
# and the other files of a larger program, which run collectives or the DDP wrapper on a
# ddp::group they are handed and never call init_process_group (tests/compile_cost/*_user.cpp),
# also with <ddp/mpi.hpp> or <ddp/nccl.hpp> included (they register their backend in every file
# that includes them) where MPI or the CUDA toolkit with NCCL is installed.
# Each figure is the median of REPS compiles (default 3). Writes bench/results/compile_cost.md.
#   bench/compile_cost.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
reps=${REPS:-3}
cxx=${CXX:-g++}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=$root/bench/results/compile_cost.md
mkdir -p "$root/bench/results"

cat >"$work/ddp_program.cpp" <<'CPP'
#include <ddp/ddp.hpp>
#include <vector>
int main() {
  auto group = ddp::init_process_group("ring");
  std::vector<float> grad(1 << 20, float(group.rank()));
  group.all_reduce(std::span(grad), ddp::avg{});
  return grad[0] == 0.0f ? 0 : 1;
}
CPP
cat >"$work/mpi_program.cpp" <<'CPP'
#include <mpi.h>
#include <vector>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<float> grad(1 << 20, float(rank));
  MPI_Allreduce(MPI_IN_PLACE, grad.data(), int(grad.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}
CPP
printf '#include <string>\n#include <vector>\nint main() { std::vector<std::string> v{"a"}; return int(v.size()) - 1; }\n' >"$work/std_program.cpp"
# The program again, including <ddp/init.hpp> (init_process_group and the group it returns)
# instead of the umbrella header, for the compiled library.
sed 's|#include <ddp/ddp.hpp>|#include <ddp/init.hpp>|' "$work/ddp_program.cpp" >"$work/ddp_program_narrow.cpp"
# The other files again, including <ddp/group.hpp> (and <ddp/data_parallel.hpp>) instead of
# <ddp/ddp.hpp>, which also declares the ring backend, the stores, checkpoints and the launcher.
sed 's|#include <ddp/ddp.hpp>|#include <ddp/group.hpp>|' "$root/tests/compile_cost/group_user.cpp" >"$work/group_user_narrow.cpp"
sed 's|#include <ddp/ddp.hpp>|#include <ddp/data_parallel.hpp>\n#include <ddp/group.hpp>|' "$root/tests/compile_cost/data_parallel_user.cpp" \
  >"$work/data_parallel_user_narrow.cpp"
# The collectives file of a program that registers the MPI or NCCL backend.
for backend in mpi nccl; do
  { echo "#include <ddp/$backend.hpp>"; cat "$root/tests/compile_cost/group_user.cpp"; } >"$work/group_user_$backend.cpp"
done
cuda_include=""
for dir in "${CUDA_HOME:-/usr/local/cuda}/include" /usr/include; do
  if [ -f "$dir/nccl.h" ] && [ -f "$dir/cuda_runtime.h" ]; then cuda_include=$dir; break; fi
done

# measure NAME COMMAND...: median CPU seconds and peak MiB of REPS runs, appended as a table row.
rows=()
measure() {
  local name=$1; shift
  local cpu=() mem=()
  for ((i = 0; i < reps; i++)); do
    /usr/bin/time -f '%U %S %M' -o "$work/time" "$@" >/dev/null 2>"$work/err" || { cat "$work/err" >&2; return 1; }
    read -r u s m <"$work/time"
    cpu+=("$(python3 -c "print(f'{$u + $s:.2f}')")")
    mem+=("$((m / 1024))")
  done
  local c m
  c=$(printf '%s\n' "${cpu[@]}" | sort -n | sed -n "$(((reps + 1) / 2))p")
  m=$(printf '%s\n' "${mem[@]}" | sort -n | sed -n "$(((reps + 1) / 2))p")
  printf '  %-58s %7s s %6s MiB\n' "$name" "$c" "$m" >&2
  rows+=("| $name | $c | $m |")
}

inc=(-std=c++20 -I"$root/include")
echo "compile cost ($cxx, median of $reps):" >&2
for opt in -O0 -O2; do
  measure "ddp header-only, $opt" "$cxx" "${inc[@]}" "$opt" -c "$work/ddp_program.cpp" -o "$work/a.o"
  measure "ddp compiled library (DDP_COMPILED), $opt" "$cxx" "${inc[@]}" -DDDP_COMPILED "$opt" -c "$work/ddp_program.cpp" -o "$work/b.o"
  measure "ddp compiled library, including only \`<ddp/init.hpp>\`, $opt" "$cxx" "${inc[@]}" -DDDP_COMPILED "$opt" -c "$work/ddp_program_narrow.cpp" -o "$work/b.o"
  if command -v mpicxx >/dev/null; then
    measure "MPI (mpicxx), $opt" mpicxx "$opt" -c "$work/mpi_program.cpp" -o "$work/c.o"
  fi
  for user in group_user data_parallel_user; do
    measure "another file: $user.cpp, header-only, $opt" "$cxx" "${inc[@]}" "$opt" -c "$root/tests/compile_cost/$user.cpp" -o "$work/e.o"
    measure "another file: $user.cpp including only what it uses, $opt" "$cxx" "${inc[@]}" "$opt" -c "$work/${user}_narrow.cpp" -o "$work/e.o"
  done
  if command -v mpicxx >/dev/null; then
    measure "another file: group_user.cpp with \`<ddp/mpi.hpp>\` (mpicxx), $opt" mpicxx "${inc[@]}" -DDDP_HAS_MPI "$opt" -c "$work/group_user_mpi.cpp" -o "$work/e.o"
  fi
  if [ -n "$cuda_include" ]; then
    measure "another file: group_user.cpp with \`<ddp/nccl.hpp>\`, $opt" "$cxx" "${inc[@]}" -DDDP_HAS_NCCL -isystem "$cuda_include" "$opt" -c "$work/group_user_nccl.cpp" -o "$work/e.o"
  fi
  measure "\`<string>\` + \`<vector>\` only, $opt" "$cxx" -std=c++20 "$opt" -c "$work/std_program.cpp" -o "$work/d.o"
done
measure "the compiled library itself (src/ddp_compiled.cpp, once), -O2" \
  "$cxx" "${inc[@]}" -O2 -c "$root/src/ddp_compiled.cpp" -o "$work/lib.o"

{
  echo "# Compile cost of a ddp program"
  echo
  echo "One file: \`#include <ddp/ddp.hpp>\`, \`init_process_group(\"ring\")\`, one \`all_reduce\` (the MPI row:"
  echo "\`MPI_Init\` + \`MPI_Allreduce\`); \"another file\": a file of the same program that runs collectives"
  echo "(group_user.cpp) or the DDP wrapper (data_parallel_user.cpp) on a ddp::group it is handed. CPU = user + sys seconds of the compiler, memory = its peak RSS;"
  echo "medians of $reps compiles with $($cxx --version | head -1) on $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))."
  echo
  echo "    bench/compile_cost.sh"
  echo
  echo "| build | CPU s | peak MiB |"
  echo "| --- | ---: | ---: |"
  printf '%s\n' "${rows[@]}"
} >"$out"
echo "wrote $out" >&2
