#!/usr/bin/env bash
# The heartbeat across hosts: two network-namespace "hosts" (topology.sh) run a training job
# under ddprun (2 ranks each) with a long collective timeout (DDP_TIMEOUT=60) and a short
# heartbeat (DDP_HEARTBEAT_TIMEOUT=2); once it trains, host 1's link is set down. Both hosts
# must fail within the heartbeat timeout + 1 s, each naming a rank of the other host, its
# hostname and "heartbeat". Prints the measured times.
# usage: heartbeat_test.sh DDPRUN TRAIN_DDP [ARGS...]
# Without root or `ip`, prints SKIPPED and exits 77. Namespaces are removed on every exit path.
set -uo pipefail
ddprun=$1 program=$2
shift 2
args=("$@")
hosts=2
heartbeat=${DDP_HEARTBEAT_TIMEOUT:-2}
timeout_s=${NETNS_TIMEOUT:-60}

skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
command -v unshare >/dev/null || skip "unshare (util-linux) is not installed"
command -v bc >/dev/null || skip "bc is not installed"

tag=ddphb$$
work=$(mktemp -d)
# shellcheck source=topology.sh
. "$(dirname "$0")/topology.sh"
trap netns_cleanup EXIT
netns_create 10.231.9 || skip "cannot create network namespaces here"
master=10.231.9.1
port=$((20000 + $$ % 20000))

# run_host i: ddprun on host i in the background; its exit code and end time in $work/done$i.
run_host() {
  local i=$1
  (
    ip netns exec "${tag}h$i" unshare --uts sh -c "hostname host$i && exec timeout $timeout_s \"\$0\" \"\$@\"" \
      env DDP_TIMEOUT=60 DDP_HEARTBEAT_TIMEOUT="$heartbeat" \
      "$ddprun" --nnodes="$hosts" --node-rank="$i" --master-addr="$master" --master-port="$port" --nproc-per-node=2 \
      "$program" "${args[@]}" > "$work/host$i.log" 2>&1
    echo "$? $(date +%s.%N)" > "$work/done$i"
  ) &
  pids[$i]=$!
}

declare -a pids
for i in $(seq 0 $((hosts - 1))); do run_host "$i"; done

# Wait until the job trains (host 0 printed its first epoch), then cut host 1 off the network.
timeout "$timeout_s" tail -n +1 -F "$work/host0.log" 2>/dev/null | grep -q -m1 "Epoch 1"
if ! grep -q "Epoch 1" "$work/host0.log"; then  # (the pipeline's status is tail's SIGPIPE)
  echo "FAIL: the job did not start training"; cat "$work"/host*.log; exit 1
fi
cut_at=$(date +%s.%N)
ip -n "${tag}h1" link set "${tag}v1" down
for i in $(seq 0 $((hosts - 1))); do wait "${pids[$i]}"; done
for i in $(seq 0 $((hosts - 1))); do echo "--- host $i: $(cat "$work/done$i" 2>/dev/null)"; cat "$work/host$i.log"; done

bound=$(echo "$heartbeat + 1" | bc -l)
fail=0
for i in 0 1; do
  other=$((1 - i))
  read -r code ended < "$work/done$i"
  took=$(echo "$ended - $cut_at" | bc -l)
  printf 'host %d: exit %d, %.2f s after the link went down (heartbeat timeout %s s, bound %s s)\n' "$i" "$code" "$took" "$heartbeat" "$bound"
  [ "$code" -ne 0 ] || { echo "FAIL: host $i exited 0"; fail=1; }
  [ "$(echo "$took <= $bound" | bc -l)" -eq 1 ] || { echo "FAIL: host $i took ${took}s"; fail=1; }
  # The other host's ranks are 2*other and 2*other+1.
  grep -qE "no heartbeat from rank ($((2 * other))|$((2 * other + 1))) \(host host$other" "$work/host$i.log" \
    || { echo "FAIL: host $i does not name a rank of host $other and its host"; fail=1; }
done
[ "$fail" -eq 0 ] || exit 1
echo "PASS: a cut link between 2 hosts is found by the heartbeat on both sides"
