#!/usr/bin/env bash
# Two ranks on one machine that look like one host (same hostname, same kernel) but do not share
# what shared memory needs, as containers with host networking do:
#   shm     rank 1 runs in a mount namespace of its own with a private tmpfs on /dev/shm;
#   pid     rank 1 runs in a PID namespace of its own;
#   kill    as pid, with a long job, and rank 1 is SIGKILLed mid-run.
# The ring backend must notice at rendezvous (by probing /dev/shm's mount and the PID namespace,
# not by the hostname), say so in one line, and use tcp between them: the job prints PyTorch's
# lines for two ranks (tests/data/training.json). In `kill`, rank 0 must fail naming rank 1
# within 5 s of the kill, not at the deadline.
# usage: containers_test.sh CASE TRAIN_DDP GOLDEN_JSON      (root and unshare(1); otherwise SKIPPED)
set -uo pipefail
case=${1:?usage: containers_test.sh shm|pid|kill TRAIN_DDP GOLDEN_JSON}
train_ddp=${2:?}
golden=${3:?}
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || skip "namespaces and mounts need root"
command -v unshare >/dev/null || skip "unshare(1) not found (util-linux)"
unshare --mount --pid --fork true 2>/dev/null || skip "this kernel or sandbox refuses new mount/PID namespaces"

dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$dir"; }
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
common=(WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_JOB_ID=containers-$case-$$ DDP_TIMEOUT=60 OMP_NUM_THREADS=1)
args=(--init-seed 0)
[ "$case" = kill ] && args+=(--epochs 1000000)

case $case in
  shm) wrap=(unshare --mount --propagation private -- sh -c 'mount -t tmpfs -o size=256m ddp-private-shm /dev/shm && exec "$0" "$@"') ;;
  pid|kill) wrap=(unshare --pid --fork --kill-child --) ;;
  *) fail "unknown case $case" ;;
esac

env "${common[@]}" RANK=0 LOCAL_RANK=0 "$train_ddp" "${args[@]}" >"$dir/r0.out" 2>"$dir/r0.err" &
pids+=($!); r0=$!
env "${common[@]}" RANK=1 LOCAL_RANK=1 "${wrap[@]}" "$train_ddp" "${args[@]}" >"$dir/r1.out" 2>"$dir/r1.err" &
pids+=($!); r1=$!

if [ "$case" = kill ]; then
  # Mid-run: once rank 0 has printed its first epoch line.
  grep -q -m1 '^Epoch ' < <(timeout 60 tail -n +1 -F "$dir/r0.out" 2>/dev/null) || fail "rank 0 printed no epoch line within 60 s"
  # The train_ddp inside the namespace is a child of unshare; kill it, not unshare.
  victim=$(pgrep -P "$r1" -f train_ddp | head -1)
  [ -n "$victim" ] || victim=$(pgrep -P "$(pgrep -P "$r1" | head -1)" | head -1)
  [ -n "$victim" ] || fail "rank 1's process inside its PID namespace not found"
  t0=$(date +%s.%N)
  kill -9 "$victim"
  wait "$r0"; rc0=$?
  t1=$(date +%s.%N)
  took=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
  grep -q "rank 1" "$dir/r0.err" || fail "rank 0's error does not name rank 1: $(tail -3 "$dir/r0.err")"
  [ "$rc0" -ne 0 ] || fail "rank 0 exited 0 after its peer was killed"
  python3 -c "import sys; sys.exit(0 if $took <= 5 else 1)" || fail "rank 0 took $took s to notice (limit 5 s)"
  echo "ok: rank 1 killed inside its own PID namespace; rank 0 failed after $took s: $(grep -m1 'rank 1' "$dir/r0.err")"
  exit 0
fi

wait "$r0"; rc0=$?
wait "$r1"; rc1=$?
[ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || fail "exit codes $rc0 $rc1; rank 0: $(tail -3 "$dir/r0.err"); rank 1: $(tail -3 "$dir/r1.err")"
expected=$(python3 -c "import json,sys; print('\n'.join(json.load(open(sys.argv[1]))['W2_simulated']['tutorial_print_lines']))" "$golden")
got=$(grep '^Epoch ' "$dir/r0.out")
[ "$got" = "$expected" ] || fail "printed lines differ from PyTorch's: $got"
grep -q "do not share its /dev/shm or PID namespace" "$dir/r0.err" "$dir/r1.err" ||
  fail "no line saying the ranks were found apart; stderr: $(cat "$dir/r0.err" "$dir/r1.err")"
echo "ok ($case): PyTorch's lines over tcp; $(cat "$dir/r0.err" "$dir/r1.err" | grep -m1 'do not share')"
