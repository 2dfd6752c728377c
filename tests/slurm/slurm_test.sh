#!/usr/bin/env bash
# A real Slurm run: a single-node cluster on this machine (munged, slurmctld and slurmd of Debian's
# slurm-wlm, all state under a temporary directory), examples/slurm/train_ddp.sbatch submitted with
# sbatch (one node, srun with two tasks, the CPU build), and checks that
#   - the job's output file has the three epoch lines PyTorch printed for the same job
#     (tests/data/training.json, W2_real_torchrun_gloo: two ranks, --init-seed 0);
#   - `scontrol show job` reports JobState=COMPLETED and ExitCode=0:0;
#   - the daemons are gone afterwards and nothing with "ddp" in its name is left in /dev/shm.
#   - under `srun --mpi=pmi2` (which sets PMI_RANK/PMI_SIZE as well as SLURM_*), `ddprun --info`
#     in each task reports the Slurm source with local ranks 0 and 1 (given DDPRUN and the plugin);
# usage: slurm_test.sh [--requeue] TRAIN_DDP SOURCE_DIR [DDPRUN]
# --requeue: instead, examples/slurm/train_ddp_requeue.sbatch (train_ddp --checkpoint-dir) is
# submitted, held after its checkpoint of step 24 (epoch 2; DDP_CHECKPOINT_TEST_HOOK pause, which
# a preemption signal ends) and preempted with `scancel --signal=USR1 --batch` as --signal=B:USR1
# would; the batch shell forwards it to srun, the ranks save step 25 and exit 75, the script
# requeues the job, and the requeued run resumes from step 25. Checked: the save and resume
# lines, Restarts=1, COMPLETED with ExitCode=0:0, and the output file (both runs, appended) has
# exactly PyTorch's three epoch lines, epoch 1 before the requeue and 2-3 after it.
# Needs root. Without Slurm and munge installed it prints SKIPPED and exits 77, unless
# DDP_TEST_INSTALL_SLURM=1, which apt-get installs slurm-wlm and munge first.
# Every wait has a deadline, and all of them end within SLURM_TEST_BUDGET seconds (default 240) of
# the start, which leaves the cleanup time before ctest's TIMEOUT (300 s; ctest would SIGKILL the
# script and its traps with it). SLURM_TEST_TIMEOUT (default 150) bounds the job alone.
# Every daemon this script starts is stopped on every exit path.
set -uo pipefail
mode=plain
[ "${1:-}" = --requeue ] && { mode=requeue; shift; }
train_ddp=${1:?usage: slurm_test.sh TRAIN_DDP SOURCE_DIR}
src=${2:?usage: slurm_test.sh TRAIN_DDP SOURCE_DIR}
sbatch_script=$src/examples/slurm/train_ddp.sbatch
[ "$mode" = requeue ] && sbatch_script=$src/examples/slurm/train_ddp_requeue.sbatch
golden=$src/tests/data/training.json
job_timeout_s=${SLURM_TEST_TIMEOUT:-150}
budget_end=$(($(date +%s) + ${SLURM_TEST_BUDGET:-240}))

skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
# within SECONDS: SECONDS, or what is left of the budget when that is less (at least 1).
within() { local left=$((budget_end - $(date +%s))); [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"; }

[ "$(id -u)" -eq 0 ] || skip "a private Slurm cluster (slurmd, munged) needs root"
[ -x "$train_ddp" ] || fail "train_ddp '$train_ddp' is not an executable"
train_ddp=$(readlink -f "$train_ddp")   # the job runs in another directory
[ -f "$sbatch_script" ] || fail "no batch script at $sbatch_script"

# A Slurm job's (or an allocation's) variables would point the client commands at another cluster.
while IFS= read -r var; do unset "$var"; done < <(compgen -e | grep -E '^(SLURM|SBATCH|SALLOC|SRUN|SQUEUE|SINFO|SCONTROL)_')

export PATH=$PATH:/usr/sbin:/sbin
tools=(munged munge unmunge slurmctld slurmd sbatch srun scontrol scancel)
have_tools() {
  local t
  for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || return 1; done
}
if ! have_tools; then
  [ "${DDP_TEST_INSTALL_SLURM:-}" = 1 ] ||
    skip "Slurm and munge are not installed (apt-get install slurm-wlm munge, or DDP_TEST_INSTALL_SLURM=1 to let this test install them)"
  command -v apt-get >/dev/null || fail "DDP_TEST_INSTALL_SLURM=1 but there is no apt-get"
  echo "installing slurm-wlm and munge (DDP_TEST_INSTALL_SLURM=1)"
  # The packages' maintainer scripts must not start the system's munged/slurmd/slurmctld.
  policy=/usr/sbin/policy-rc.d made_policy=
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1; fi
  install() { DEBIAN_FRONTEND=noninteractive timeout "$(within 120)" apt-get install -y -q --no-install-recommends slurm-wlm munge; }
  install_start=$(date +%s)
  install || { DEBIAN_FRONTEND=noninteractive timeout "$(within 60)" apt-get update -q && install; }
  code=$?
  [ -n "$made_policy" ] && rm -f "$policy"
  [ "$code" -eq 0 ] || fail "apt-get install slurm-wlm munge failed (exit $code)"
  have_tools || fail "slurm-wlm and munge installed, but one of ${tools[*]} is still missing"
  echo "installed slurm-wlm and munge in $(($(date +%s) - install_start)) s"
fi

work=$(mktemp -d /tmp/ddp-slurm-test.XXXXXX)
chmod 711 "$work"   # munged wants its socket reachable by all: execute (search) only
conf=$work/slurm.conf
export SLURM_CONF=$conf
shm_before=$(ls /dev/shm 2>/dev/null | sort)
declare -A daemon_pid=()
job_id= passed= output_shown=

# Processes that carry our slurm.conf in their environment: the job's steps and tasks (sbatch
# exports this environment; they have SLURM_JOB_ID), and the daemons and slurmstepd (slurmd's).
# This script's own subshells carry it too, and are neither.
our_processes() {
  local p env
  for p in /proc/[0-9]*; do
    env=$({ tr '\0' '\n' < "$p/environ"; } 2>/dev/null) || continue
    grep -qxF "SLURM_CONF=$conf" <<< "$env" || continue
    grep -q '^SLURM_JOB_ID=' <<< "$env" && { echo "${p#/proc/}"; continue; }
    case $(cat "$p/comm" 2>/dev/null) in
      slurmstepd | munged | slurmd | slurmctld) echo "${p#/proc/}" ;;
    esac
  done
}
job_state() { scontrol show job "$1" -o 2>/dev/null | grep -oE 'JobState=[A-Z_]+' | cut -d= -f2; }
job_active() {
  case $(job_state "$1") in
    PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | REQUEUE_FED | REQUEUE_HOLD | RESIZING | SIGNALING | '') return 0 ;;
  esac
  return 1
}
# stop NAME: SIGTERM, up to 10 s for it to exit, then SIGKILL.
stop() {
  local name=$1 pid=${daemon_pid[$1]:-} i
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "$name (pid $pid) ignored SIGTERM for 10 s; killing it"; kill -KILL "$pid" 2>/dev/null; fi
  wait "$pid" 2>/dev/null
  unset "daemon_pid[$name]"
}
# On failure: each daemon's log file (or its stderr when it wrote none), and the job's output
# when it was not shown yet.
show_logs() {
  local name f
  for name in munged slurmctld slurmd; do
    f=$work/$name.log
    [ -s "$f" ] || f=$work/$name.out
    [ -s "$f" ] && { echo "--- $name: ${f#"$work"/} (last 40 lines)"; tail -n 40 "$f"; }
  done
  if [ -z "$output_shown" ]; then
    for f in "$work"/train_ddp*-*.out; do [ -f "$f" ] && { echo "--- job output ${f#"$work"/}"; cat "$f"; }; done
  fi
}
cleanup() {
  local code=$? pids i p steps alive
  trap - EXIT INT TERM
  # A job still running (a failure or timeout above): cancelled, and up to 20 s for its steps to end.
  if [ -n "$job_id" ] && [ -n "${daemon_pid[slurmctld]:-}" ] && job_active "$job_id"; then
    echo "cancelling job $job_id ($(job_state "$job_id"))"
    timeout 10 scancel "$job_id"
    for i in $(seq 100); do job_active "$job_id" || break; sleep 0.2; done
  fi
  [ "$code" -eq 0 ] || show_logs
  # slurmstepd of a finished job can outlive it by a moment (reporting to slurmd): up to 10 s
  # for them to end by themselves, after the daemons have stopped.
  steps=$(our_processes | grep -vxF -e "${daemon_pid[slurmd]:-x}" -e "${daemon_pid[slurmctld]:-x}" -e "${daemon_pid[munged]:-x}")
  stop slurmd
  stop slurmctld
  stop munged
  for i in $(seq 100); do
    alive=
    for p in $steps; do [ -n "$(ps -o pid= -p "$p" 2>/dev/null)" ] && [ "$(ps -o stat= -p "$p" 2>/dev/null | cut -c1)" != Z ] && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  pids=$(our_processes)
  if [ -n "$pids" ]; then
    echo "left behind by the job, killed:"; ps -o pid,args -p "$(echo $pids | tr ' ' ',')" 2>/dev/null
    kill -KILL $pids 2>/dev/null
    [ "$code" -eq 0 ] && code=1
  fi
  leaked=$(comm -13 <(echo "$shm_before") <(ls /dev/shm 2>/dev/null | sort) | grep -i ddp)
  if [ -n "$leaked" ]; then
    echo "FAIL: left in /dev/shm (removed now):"; echo "$leaked"
    (cd /dev/shm && echo "$leaked" | xargs -r -d '\n' rm -f --)
    [ "$code" -eq 0 ] && code=1
  fi
  rm -rf "$work"
  [ "$code" -eq 0 ] && echo "PASS: $passed; daemons stopped, nothing left in /dev/shm ($(elapsed) s)"
  exit "$code"
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 1' INT TERM

# start NAME COMMAND...: a daemon in the foreground mode, as our child, output in $work/NAME.out.
start() {
  local name=$1; shift
  "$@" > "$work/$name.out" 2>&1 &
  daemon_pid[$name]=$!
}
# wait_for WHAT SECONDS NAME COMMAND...: polls COMMAND until it succeeds; fails at the deadline or
# when daemon NAME has exited.
wait_for() {
  local what=$1 seconds name=$3 deadline
  seconds=$(within "$2")
  shift 3
  deadline=$(($(date +%s) + seconds))
  until "$@" >/dev/null 2>&1; do
    kill -0 "${daemon_pid[$name]}" 2>/dev/null || { wait "${daemon_pid[$name]}"; fail "$name exited (code $?) before $what"; }
    [ "$(date +%s)" -lt "$deadline" ] || fail "no $what after $seconds s"
    sleep 0.2
  done
}

# munged with its own key, socket, seed and log, all in $work.
mkdir -m 711 "$work/munge"
key=$work/munge/munge.key socket=$work/munge/munge.socket.2
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$key" --bits=1024 || fail "mungekey could not create a key"
else
  dd if=/dev/urandom of="$key" bs=1024 count=1 status=none || fail "could not create a munge key"
fi
chmod 400 "$key"
start munged munged --foreground --key-file="$key" --socket="$socket" --pid-file="$work/munge/munged.pid" \
  --seed-file="$work/munge/munged.seed" --log-file="$work/munged.log"
munge_round_trip() { munge -n -S "$socket" | unmunge -S "$socket"; }
wait_for "munge credential round trip" 20 munged munge_round_trip

# slurm.conf: this host as controller and only node, every path under $work, no accounting,
# no cgroups, no SPANK plugins. Ports outside Slurm's defaults (6817/6818), the batch script's
# 20000-32767 and the kernel's ephemeral range: inside it, an outgoing connection of a test
# running beside this one could hold the port, and slurmctld would fail with "Address already in use".
host=$(hostname -s)
cpus=$(nproc)
[ "$cpus" -ge 2 ] || cpus=2   # the job has two tasks; SlurmdParameters=config_overrides lets a 1-CPU host claim 2
read -r _ ephemeral_last < /proc/sys/net/ipv4/ip_local_port_range
if [ "$ephemeral_last" -le 64535 ]; then
  port_base=$((ephemeral_last + 1)) port_pairs=$(((65535 - ephemeral_last) / 2))
else
  port_base=10000 port_pairs=5000   # the ephemeral range reaches 65535: below the batch script's ports
fi
ctld_port=$((port_base + ($$ % port_pairs) * 2)) slurmd_port=$((port_base + 1 + ($$ % port_pairs) * 2))
mkdir -p "$work/state" "$work/spool"
# A requeued job waits cred_expire seconds (default 120) before it may start again.
auth_extra=
[ "$mode" = requeue ] && auth_extra=,cred_expire=10
: > "$work/plugstack.conf"   # no SPANK plugins from this host's /etc/slurm/plugstack.conf
cat > "$conf" <<EOF
ClusterName=ddptest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket$auth_extra
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
SlurmdParameters=config_overrides
PlugStackConfig=$work/plugstack.conf
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=ddptest Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

start slurmctld slurmctld -D -i -f "$conf"
wait_for "answer from slurmctld (scontrol ping)" 30 slurmctld scontrol ping
start slurmd slurmd -D -f "$conf" -N "$host"
node_idle() { scontrol show node "$host" -o | grep -qE 'State=IDLE( |$)'; }
wait_for "idle node $host (scontrol show node)" 30 slurmd node_idle
echo "cluster up after $(elapsed) s: slurmctld on port $ctld_port, slurmd on $slurmd_port, node $host with $cpus CPUs"

# job_wait WHAT SECONDS COMMAND...: polls COMMAND until it succeeds; fails at the deadline (or the
# budget's end) or when a daemon has exited.
job_wait() {
  local what=$1 seconds d deadline
  seconds=$(within "$2")
  shift 2
  deadline=$(($(date +%s) + seconds))
  until "$@" >/dev/null 2>&1; do
    for d in slurmctld slurmd; do kill -0 "${daemon_pid[$d]}" 2>/dev/null || fail "$d exited while waiting for $what (job $job_id $(job_state "$job_id"))"; done
    [ "$(date +%s)" -lt "$deadline" ] || fail "no $what after $seconds s (job $job_id $(job_state "$job_id"))"
    sleep 0.2
  done
}
golden_lines() {
  python3 -c 'import json, sys
print("\n".join(json.load(open(sys.argv[1]))["W2_real_torchrun_gloo"]["stdout_loss_lines"]))' "$golden"
}

if [ "$mode" = requeue ]; then
  command -v python3 >/dev/null || skip "python3 is needed to read the golden lines of $golden"
  expected=$(golden_lines) || fail "could not read the golden lines from $golden"
  # W = 2, 1024 samples, batch 32: 16 steps per epoch. Checkpoints every 8 steps; rank 0 holds
  # still right after checkpoint 24 (epoch 2, batch 8; epoch 1's line printed) until a preemption
  # signal reaches it. The marker file tells this script it is there; the hook acts once per job,
  # so the requeued run does not stop there again.
  marker=$work/preempt-point ckpt=$work/checkpoints
  out=$(cd "$work" && TRAIN_DDP=$train_ddp CHECKPOINT_DIR=$ckpt CHECKPOINT_EVERY=8 \
        DDP_CHECKPOINT_TEST_HOOK=pause:24:0:after:$marker sbatch --parsable "$sbatch_script" --init-seed 0) ||
    fail "sbatch failed: $out"
  job_id=${out%%;*}
  [[ "$job_id" =~ ^[0-9]+$ ]] || fail "sbatch printed '$out', not a job id"
  output_file=$work/train_ddp_requeue-$job_id.out
  echo "submitted job $job_id ($sbatch_script)"
  held() { [ -e "$marker" ] && grep -q '^Epoch 1: ' "$output_file"; }
  held_or_ended() { held || ! job_active "$job_id"; }
  job_wait "hold after checkpoint 24 with epoch 1's line in $output_file" "$job_timeout_s" held_or_ended
  held || fail "job $job_id ended ($(job_state "$job_id")) before it reached checkpoint 24"
  job_state "$job_id" | grep -qx RUNNING || fail "job $job_id is $(job_state "$job_id") at the preemption point, not RUNNING"
  [ -f "$ckpt/step-000000024/DONE" ] || fail "no complete checkpoint 24 at the preemption point: $(ls "$ckpt" 2>&1 | tr '\n' ' ')"
  echo "job $job_id holds after checkpoint 24 ($(elapsed) s); scancel --signal=USR1 --batch $job_id"
  timeout "$(within 20)" scancel --signal=USR1 --batch "$job_id" || fail "scancel --signal=USR1 --batch $job_id failed"
  restarts() { scontrol show job "$job_id" -o 2>/dev/null | grep -oE 'Restarts=[0-9]+' | cut -d= -f2; }
  requeued() { [ "$(restarts)" = 1 ]; }
  requeued_or_ended() { requeued || ! job_active "$job_id"; }
  job_wait "Restarts=1 (the job requeued)" 60 requeued_or_ended
  requeued || fail "job $job_id ended ($(job_state "$job_id")) without being requeued"
  echo "job $job_id requeued after $(elapsed) s ($(job_state "$job_id"))"
  ended() { ! job_active "$job_id"; }
  job_wait "end of the requeued run" "$job_timeout_s" ended
  info=$(scontrol show job "$job_id")
  echo "$info"
  echo "--- $output_file"
  cat "$output_file" 2>/dev/null || fail "the job wrote no output file $output_file"
  output_shown=1
  echo "---"
  grep -qE '(^|[[:space:]])JobState=COMPLETED([[:space:]]|$)' <<< "$info" || fail "job $job_id ended $(job_state "$job_id"), not COMPLETED"
  grep -qE '(^|[[:space:]])ExitCode=0:0([[:space:]]|$)' <<< "$info" || fail "job $job_id: $(grep -oE 'ExitCode=[^ ]+' <<< "$info"), not ExitCode=0:0"
  grep -qE '(^|[[:space:]])Restarts=1([[:space:]]|$)' <<< "$info" || fail "job $job_id: $(grep -oE 'Restarts=[^ ]+' <<< "$info"), not Restarts=1"
  # The story, in order: run 1, the forwarded signal, the agreed save of step 25, the requeue,
  # run 2 resuming from step 25 (epoch 2, batch 9 done), and the epoch lines around it. Within
  # run 2, srun copies the ranks' stderr (the resume line) and stdout (the epoch lines) as two
  # streams, so the resume line is only checked to follow the start of run 2.
  line_of() { grep -nE -- "$1" "$output_file" | head -1 | cut -d: -f1; }
  want=(
    "^train_ddp_requeue.sbatch: job $job_id, run 1,"
    "^Epoch 1: "
    "^train_ddp_requeue.sbatch: SIGUSR1: forwarding it to srun"
    "^train_ddp: preempted: saved checkpoint $ckpt/step-000000025; exiting with 75"
    "^train_ddp_requeue.sbatch: preempted, checkpoint saved: scontrol requeue $job_id"
    "^train_ddp_requeue.sbatch: job $job_id, run 2,"
    "^Epoch 2: "
    "^Epoch 3: "
  )
  at=0
  for w in "${want[@]}"; do
    n=$(line_of "$w")
    [ -n "$n" ] || fail "no line matching '$w' in $output_file"
    [ "$n" -gt "$at" ] || fail "the line matching '$w' (line $n) comes before an earlier event (line $at)"
    at=$n
  done
  run2=$(line_of "^train_ddp_requeue.sbatch: job $job_id, run 2,")
  resumed=$(line_of "^train_ddp: resumed from checkpoint $ckpt/step-000000025 \(step 25: epoch 2, batch 9\)")
  [ -n "$resumed" ] || fail "no resume line from step 25 in $output_file"
  [ "$resumed" -gt "$run2" ] || fail "the resume line (line $resumed) comes before run 2 starts (line $run2)"
  epochs=$(grep -E '^Epoch ' "$output_file")
  [ "$epochs" = "$expected" ] || { echo "PyTorch printed:"; echo "$expected"; fail "the epoch lines of both runs differ from PyTorch's (W2_real_torchrun_gloo)"; }
  echo "the three epoch lines of both runs equal PyTorch's (W2_real_torchrun_gloo in $golden)"
  passed="job $job_id preempted by USR1 to the batch shell at step 25, requeued (Restarts=1), resumed from step 25, COMPLETED with ExitCode=0:0 and PyTorch's three epoch lines"
  exit 0
fi

# What srun gives each task: rank, world and local rank, as ddp reads them.
tasks=$(timeout "$(within 60)" srun --nodes=1 --ntasks=2 --cpus-per-task=1 bash -c 'echo "$SLURM_PROCID $SLURM_NTASKS $SLURM_LOCALID"' | sort) ||
  fail "srun --ntasks=2 failed or did not end in time"
[ "$tasks" = $'0 2 0\n1 2 1' ] || fail "srun's tasks saw SLURM_PROCID SLURM_NTASKS SLURM_LOCALID = '$tasks', not '0 2 0' and '1 2 1'"
echo "srun --ntasks=2: SLURM_PROCID SLURM_NTASKS SLURM_LOCALID = 0 2 0 and 1 2 1"

# srun --mpi=pmi2: PMI_* and SLURM_* both set; ddp must read Slurm's local ranks, not PMI's.
ddprun=${3:-}
if [ -n "$ddprun" ] && srun --mpi=list 2>&1 | grep -qw pmi2; then
  info=$(timeout "$(within 60)" srun --mpi=pmi2 --nodes=1 --ntasks=2 --cpus-per-task=1 \
         bash -c '"$0" --info | grep -E "^  (source|rank|local_rank|job) " | tr -s " " | tr "\n" "|"; echo' "$ddprun" | sort) ||
    fail "srun --mpi=pmi2 ddprun --info failed or did not end in time"
  pmi_seen=$(timeout "$(within 30)" srun --mpi=pmi2 --nodes=1 --ntasks=1 bash -c 'echo "${PMI_RANK:-unset}"')
  for r in 0 1; do
    grep -q "source slurm .*| rank $r <- SLURM_PROCID| local_rank $r <- SLURM_LOCALID|" <<<"$info" ||
      fail "srun --mpi=pmi2 (PMI_RANK in a task: $pmi_seen): ddprun --info did not report rank $r, local rank $r from Slurm:
$info"
  done
  echo "srun --mpi=pmi2 (PMI_RANK=$pmi_seen in a task): ddprun --info reads Slurm: $(head -1 <<<"$info")"
else
  echo "srun --mpi=pmi2: not checked (no ddprun given, or Slurm has no pmi2 plugin: $(srun --mpi=list 2>&1 | tr '\n' ' '))"
fi

# The job, submitted as a user would: from the directory that receives train_ddp-<id>.out.
out=$(cd "$work" && TRAIN_DDP=$train_ddp sbatch --parsable "$sbatch_script" --init-seed 0) || fail "sbatch failed: $out"
job_id=${out%%;*}
[[ "$job_id" =~ ^[0-9]+$ ]] || fail "sbatch printed '$out', not a job id"
echo "submitted job $job_id"

job_timeout_s=$(within "$job_timeout_s")
deadline=$(($(date +%s) + job_timeout_s))
while job_active "$job_id"; do
  for d in slurmctld slurmd; do kill -0 "${daemon_pid[$d]}" 2>/dev/null || fail "$d exited while job $job_id was $(job_state "$job_id")"; done
  [ "$(date +%s)" -lt "$deadline" ] || fail "job $job_id still $(job_state "$job_id") after $job_timeout_s s"
  sleep 0.5
done
state=$(job_state "$job_id")
info=$(scontrol show job "$job_id")
echo "$info"
output_file=$work/train_ddp-$job_id.out
echo "--- $output_file"
cat "$output_file" 2>/dev/null || fail "the job wrote no output file $output_file"
output_shown=1
echo "---"

grep -qE '(^|[[:space:]])JobState=COMPLETED([[:space:]]|$)' <<< "$info" || fail "job $job_id ended $state, not COMPLETED"
grep -qE '(^|[[:space:]])ExitCode=0:0([[:space:]]|$)' <<< "$info" || fail "job $job_id: $(grep -oE 'ExitCode=[^ ]+' <<< "$info"), not ExitCode=0:0"

epochs=$(grep -E '^Epoch ' "$output_file")
for n in 1 2 3; do
  grep -qxE "Epoch $n: Rank 0 local loss sum = [0-9]+\.[0-9]{4}" <<< "$epochs" || fail "no line 'Epoch $n: Rank 0 local loss sum = X.XXXX'"
done
[ "$(grep -c . <<< "$epochs")" -eq 3 ] || fail "expected exactly three Epoch lines"
# Nothing else either: rank 1 prints nothing, and neither does srun when all goes well.
others=$(grep -vE '^Epoch ' "$output_file")
[ -z "$others" ] || fail "the output file has other lines besides the three epoch lines"
if command -v python3 >/dev/null; then
  expected=$(python3 -c 'import json, sys
print("\n".join(json.load(open(sys.argv[1]))["W2_real_torchrun_gloo"]["stdout_loss_lines"]))' "$golden") ||
    fail "could not read the golden lines from $golden"
  [ "$epochs" = "$expected" ] || { echo "PyTorch printed:"; echo "$expected"; fail "the job's lines differ from PyTorch's (W2_real_torchrun_gloo)"; }
  echo "the three lines equal PyTorch's (W2_real_torchrun_gloo in $golden)"
else
  echo "note: python3 not found; lines checked for their form only, not against $golden"
fi
passed="job $job_id COMPLETED with ExitCode=0:0 and PyTorch's three epoch lines"
