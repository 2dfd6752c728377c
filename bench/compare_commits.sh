#!/usr/bin/env bash
# A data-path change against the code before it: builds ddp_bench_allreduce at two commits
# (git worktrees under build/compare/), runs them interleaved on the same configurations, and
# prints per size the median times and new/old (< 1: the new code is faster), with a geometric
# mean per configuration. Side by side in one invocation, so machine noise hits both alike.
#   bench/compare_commits.sh OLD [NEW]      (NEW defaults to the working tree)
#   REPS=15 CONFIGS="2:shm:group 2:shm:user 2:tcp:user" MIN_BYTES=64 MAX_BYTES=16777216 bench/compare_commits.sh HEAD~3
# RUNNER: a command the benchmark runs under (not the builds), e.g. RUNNER="chrt -f 10" on a machine
# busy with compilers, where preemptions of a spinning rank otherwise swamp every size below 1 MiB.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
old=${1:?usage: bench/compare_commits.sh OLD [NEW]}
new=${2:-}
reps=${REPS:-5}
configs=${CONFIGS:-"2:shm:group 2:shm:user 2:tcp:user 4:shm:user 4:tcp:user"}
max_bytes=${MAX_BYTES:-16777216}
min_bytes=${MIN_BYTES:-64}
work=${WORK:-$root/build/compare}  # WORK: another directory, for two comparisons at once
mkdir -p "$work"

"$root/tools/install-deps.sh"
source_of() {  # a commit's tree as a worktree, or the working tree for ""
  local rev=$1 dir=$work/src-$2
  if [ -z "$rev" ]; then echo "$root"; return; fi
  git -C "$root" worktree remove --force "$dir" >/dev/null 2>&1 || rm -rf "$dir"
  git -C "$root" worktree add -q --detach "$dir" "$rev"
  echo "$dir"
}
for side in old new; do
  rev=$old; [ $side = new ] && rev=$new
  src=$(source_of "$rev" $side)
  echo "compare: building $side (${rev:-working tree})" >&2
  cmake -S "$src" -B "$work/build-$side" -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF \
        -DDDP_ENABLE_CUDA=OFF >/dev/null
  cmake --build "$work/build-$side" -j2 --target ddp_bench_allreduce >/dev/null
  if grep -q -- '"--bind"' "$src/bench/allreduce/allreduce.cpp"; then declare "binds_$side=1"; fi
done
# Both sides place their ranks alike: bound to CPUs (the benchmark's default), or both unbound
# when one side's benchmark predates --bind.
placement_old=() placement_new=()
if [ -z "${binds_old:-}" ] || [ -z "${binds_new:-}" ]; then
  [ -n "${binds_old:-}" ] && placement_old=(--bind none)
  [ -n "${binds_new:-}" ] && placement_new=(--bind none)
  echo "compare: one side's benchmark cannot bind its ranks: both run unbound" >&2
fi

raw=$work/raw.csv
: > "$raw"
for rep in $(seq 1 "$reps"); do
  for cfg in $configs; do
    IFS=: read -r np transport buffer <<< "$cfg"
    # Odd repetitions run old first, even ones new first: in one run with old always first,
    # sizes whose code both sides share read new/old 0.75-0.9, a bias on every ratio.
    sides="old new"; [ $((rep % 2)) = 0 ] && sides="new old"
    for side in $sides; do
      side_placement=("${placement_old[@]}"); [ $side = new ] && side_placement=("${placement_new[@]}")
      timeout 300 ${RUNNER:-} "$work/build-$side/bench/allreduce/ddp_bench_allreduce" --np "$np" --transport "$transport" --buffer "$buffer" "${side_placement[@]}" \
          --min-bytes "$min_bytes" --max-bytes "$max_bytes" --csv 2>/dev/null | tail -n +2 | sed "s/^/$side,/" >> "$raw"
    done
  done
  echo "compare: repetition $rep of $reps done" >&2
done
for side in old new; do
  [ -d "$work/src-$side" ] && git -C "$root" worktree remove --force "$work/src-$side"
done

python3 - "$raw" <<'EOF'
import collections, csv, statistics, sys
times = collections.defaultdict(list)
for side, system, ranks, size, *rest in csv.reader(open(sys.argv[1])):
    times[(system, int(ranks), int(size), side)].append(float(rest[2]))
cells = sorted({k[:3] for k in times})
print(f"| system | p | bytes | old us | new us | new/old |\n|---|---|---|---|---|---|")
ratios = collections.defaultdict(list)
for system, p, size in cells:
    o, n = statistics.median(times[(system, p, size, "old")]), statistics.median(times[(system, p, size, "new")])
    ratios[(system, p)].append(n / o)
    print(f"| {system} | {p} | {size} | {o:.2f} | {n:.2f} | {n / o:.3f} |")
print()
for (system, p), r in ratios.items():
    print(f"geometric mean new/old, {system}, p = {p}: {statistics.geometric_mean(r):.3f}")
EOF
