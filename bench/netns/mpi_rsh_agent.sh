#!/usr/bin/env bash
# Open MPI's rsh launcher agent for bench/netns/run.sh (mpirun --mca plm_rsh_agent THIS): mpirun
# runs `AGENT HOST COMMAND...` to start its orted on HOST, as it would run ssh. The hostfile's
# names are network namespaces (run.sh's ${tag}hI), so the command runs in namespace HOST, in a
# new UTS namespace whose hostname is HOST (each "host" has its own name, as under ddprun; Open
# MPI's session directory and vader segments carry it), through sh -c as ssh would hand it to a
# remote shell (mpirun sends one shell command line, split over the arguments).
set -u
# ssh options, should mpirun pass any (-x, -T, -o Opt=value, -p 22 ...), are skipped
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; break ;;
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=${1:?mpi_rsh_agent.sh: no host}
shift
[ -e "/run/netns/$host" ] || { echo "mpi_rsh_agent.sh: no network namespace '$host'" >&2; exit 255; }
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' sh "$host" "$@"
