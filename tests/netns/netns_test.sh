#!/usr/bin/env bash
# Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge on a
# private test subnet (10.231.7.0/24), each with its own hostname (UTS namespace) so ddp
# sees separate hosts. Runs `ddprun --nnodes=H --node-rank=i --master-addr=<host 0>
# --nproc-per-node=2` in each and checks:
#   collectives   the collectives program's checks pass on every rank;
#   train         train_ddp prints the same lines as a single-host run of the same world size;
#   kill          killing one host's processes brings the whole job down with a clear error.
# usage: netns_test.sh HOSTS collectives|train|kill DDPRUN PROGRAM [ARGS...]
# Without root or `ip`, prints SKIPPED and exits 77. Namespaces are removed on every exit path.
set -uo pipefail
hosts=$1 mode=$2 ddprun=$3 program=$4
shift 4
args=("$@")
timeout_s=${NETNS_TIMEOUT:-60}

skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
command -v unshare >/dev/null || skip "unshare (util-linux) is not installed"

tag=ddp$$
work=$(mktemp -d)
# shellcheck source=topology.sh
. "$(dirname "$0")/topology.sh"
trap netns_cleanup EXIT
netns_create 10.231.7 "${NETNS_DELAY:-}"
case $? in
  0) ;;
  2) skip "cannot create network namespaces here" ;;
  *) echo "FAILED: tc netem delay ${NETNS_DELAY:-} could not be set" >&2; exit 1 ;;
esac
master=10.231.7.1
port=$((20000 + $$ % 20000))

# run_host i [extra env...]: ddprun on host i in the background, output in $work/host$i.log
run_host() {
  local i=$1
  ip netns exec "${tag}h$i" unshare --uts sh -c "hostname host$i && exec timeout $timeout_s \"\$0\" \"\$@\"" \
    "$ddprun" --nnodes="$hosts" --node-rank="$i" --master-addr="$master" --master-port="$port" --nproc-per-node=2 \
    "$program" "${args[@]}" > "$work/host$i.log" 2>&1 &
  pids[$i]=$!
}

declare -a pids codes
for i in $(seq 0 $((hosts - 1))); do run_host "$i"; done

if [ "$mode" = kill ]; then
  # Wait until the job is training (host 0 printed its first epoch), then kill host 1's processes.
  timeout "$timeout_s" tail -n +1 -F "$work/host0.log" 2>/dev/null | grep -q -m1 "Epoch 1"
  killed_at=$(date +%s.%N)
  ip netns pids "${tag}h1" | xargs -r kill -9
fi

for i in $(seq 0 $((hosts - 1))); do
  wait "${pids[$i]}"
  codes[$i]=$?
done
for i in $(seq 0 $((hosts - 1))); do echo "--- host $i (exit ${codes[$i]})"; cat "$work/host$i.log"; done

case $mode in
  collectives)
    for i in $(seq 0 $((hosts - 1))); do [ "${codes[$i]}" -eq 0 ] || { echo "FAIL: host $i exited ${codes[$i]}"; exit 1; }; done
    ok=$(cat "$work"/host*.log | grep -c "collectives ok")
    [ "$ok" -eq $((hosts * 2)) ] || { echo "FAIL: $ok of $((hosts * 2)) ranks reported ok"; exit 1; }
    ;;
  train)
    for i in $(seq 0 $((hosts - 1))); do [ "${codes[$i]}" -eq 0 ] || { echo "FAIL: host $i exited ${codes[$i]}"; exit 1; }; done
    # The same world size on one host, for comparison.
    WORLD=$((hosts * 2))
    "$ddprun" --standalone --nnodes=1 --nproc-per-node="$WORLD" "$program" "${args[@]}" > "$work/single.log" 2>&1 \
      || { echo "FAIL: single-host run failed"; cat "$work/single.log"; exit 1; }
    if ! diff <(grep "^Epoch" "$work/host0.log") <(grep "^Epoch" "$work/single.log"); then
      echo "FAIL: multi-host lines differ from the single-host run"; exit 1
    fi
    [ "$(grep -c '^Epoch' "$work/host0.log")" -gt 0 ] || { echo "FAIL: no Epoch lines"; exit 1; }
    ;;
  kill)
    now=$(date +%s.%N)
    for i in $(seq 0 $((hosts - 1))); do
      [ "$i" -eq 1 ] && continue
      [ "${codes[$i]}" -ne 0 ] || { echo "FAIL: host $i exited 0 after host 1 was killed"; exit 1; }
      grep -qiE "peer|rank|lost|closed" "$work/host$i.log" || { echo "FAIL: host $i gave no clear error"; exit 1; }
    done
    elapsed=$(echo "$now - $killed_at" | bc -l 2>/dev/null || echo 0)
    echo "job down ${elapsed}s after host 1 was killed"
    ;;
esac
echo "PASS: $mode on $hosts hosts"
