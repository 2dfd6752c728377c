# Sourced by tests/netns/netns_test.sh and bench/netns/run.sh: the test topology of several
# "hosts" on one machine. The caller sets `tag` (a unique prefix), `hosts` and `work` (a temp
# dir, removed by netns_cleanup).
#   netns_create SUBNET [DELAY]  namespaces ${tag}h0.., joined by veth pairs to a bridge in
#                                ${tag}sw, host i at SUBNET.(i+1)/24, lo up; with DELAY, tc netem
#                                delay on every host's link. Returns 2 when no namespace can be
#                                created here, 3 when the delay cannot be set (no sch_netem).
#   netns_cleanup                kills what runs in them, removes them and $work.
netns_cleanup() {
  local i
  for i in $(seq 0 $((hosts - 1))); do
    ip netns pids "${tag}h$i" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "${tag}h$i" 2>/dev/null
  done
  ip netns del "${tag}sw" 2>/dev/null
  rm -rf "$work"
}

netns_create() {
  local subnet=$1 delay=${2:-} i ns
  local switch=${tag}sw
  ip netns add "$switch" || return 2
  ip -n "$switch" link add br0 type bridge
  ip -n "$switch" link set br0 up
  for i in $(seq 0 $((hosts - 1))); do
    ns=${tag}h$i
    ip netns add "$ns"
    ip link add "${tag}v$i" type veth peer name "${tag}p$i"
    ip link set "${tag}v$i" netns "$ns"
    ip link set "${tag}p$i" netns "$switch"
    ip -n "$switch" link set "${tag}p$i" master br0 up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev "${tag}v$i"
    ip -n "$ns" link set "${tag}v$i" up
    ip -n "$ns" link set lo up
    if [ -n "$delay" ]; then ip netns exec "$ns" tc qdisc add dev "${tag}v$i" root netem delay "$delay" || return 3; fi
  done
  return 0
}
