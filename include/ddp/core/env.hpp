#pragma once
// ddp::launch_environment: this process's place in the job, read from the variables of the
// launcher that started it, and the job's identity.
//
// Sources (launch_source) and their variables:
//   torchrun  torchrun, ddprun, Kubeflow's PyTorchJob or a script: RANK, WORLD_SIZE, LOCAL_RANK,
//             LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE (present when RANK or WORLD_SIZE is);
//             job id TORCHELASTIC_RUN_ID
//   openmpi   mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//             job id OMPI_MCA_ess_base_jobid | PMIX_NAMESPACE | OMPI_MCA_orte_ess_jobid
//   pmi       hydra's mpiexec (MPICH, Intel MPI), any PMI-1 launcher: PMI_RANK, PMI_SIZE,
//             MPI_LOCALRANKID, MPI_LOCALNRANKS; no job id
//   flux      flux run / submit: FLUX_TASK_RANK, FLUX_JOB_SIZE, FLUX_TASK_LOCAL_ID, FLUX_JOB_NNODES
//             (tasks per node = FLUX_JOB_SIZE / FLUX_JOB_NNODES; node rank assumes the default
//             block task map); job id FLUX_JOB_ID
//   pals      HPE Cray PALS mpiexec: PALS_RANKID, PMI_SIZE | PALS_SIZE, PALS_LOCAL_RANKID |
//             PMI_LOCAL_RANK, PMI_LOCAL_SIZE | PALS_LOCAL_SIZE, PALS_NODEID; job id PALS_APID
//   lsf       IBM LSF jsrun: JSM_NAMESPACE_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//             job id LSB_JOBID (LSB_JOBID[LSB_JOBINDEX] for an element of a job array)
//   slurm     srun: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID,
//             SLURM_NTASKS_PER_NODE | SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE ("2(x3),1"),
//             SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_NODEID,
//             SLURM_STEP_NODELIST | SLURM_JOB_NODELIST | SLURM_NODELIST (master = first host);
//             job id SLURM_JOB_ID.SLURM_STEP_ID (or SLURM_JOBID, SLURM_STEPID; step optional)
//   none      a world of one: rank 0 of 1, master 127.0.0.1:29500
//
// Which source: the launcher that started this process. A launcher started inside another's
// job (torchrun or mpirun inside a Slurm allocation, hydra inside an srun step) inherits the
// outer one's variables, which describe the inner launcher's own task, not this process. The
// first of these that applies wins:
//   1. torchrun's variables. Only a launcher of single processes sets them (torchrun and ddprun
//      per worker), never a scheduler.
//   2. Open MPI's, over every scheduler's: mpirun sets them per process. Except that jsrun sets
//      OMPI_COMM_WORLD_* as well: when they give the same rank and size as JSM_NAMESPACE_*, the
//      process is jsrun's (lsf).
//   3. PMI_RANK/PMI_SIZE with MPI_LOCALRANKID or MPI_LOCALNRANKS: hydra sets those per process,
//      and no scheduler does. Inside Slurm, hydra's proxies run as an srun step (one task per
//      node), so that step's SLURM_PROCID numbers proxies, not ranks.
//   4. PMI_RANK/PMI_SIZE that differ from the scheduler's task rank and size (5-8): a PMI
//      launcher started inside the scheduler's task.
//   5. Flux, 6. PALS, 7. LSF, 8. Slurm: their task variables. Each of these schedulers may set
//      PMI_RANK/PMI_SIZE as well (srun --mpi=pmi2, Flux's pmi plugin, PALS), with the same values;
//      those are its own (PMI-1 has no local rank: reading them gave every task local rank 0).
//      Flux comes before Slurm because a Flux instance can run inside a Slurm allocation.
//   9. PMI_RANK/PMI_SIZE alone.
// The rule behind 2 and 4: a second launcher's variables that give the same rank and size are
// the first one's duplicates; different values mean a launcher inside it started this process.
// (srun --mpi=pmix sets PMIX_RANK, PMIX_NAMESPACE: read as plain Slurm.)
//
// torchrun's variables without any of LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE
// (Kubeflow's PyTorchJob sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK only; scripts export
// RANK=$SLURM_PROCID) give the local layout thus, the first that applies:
//   a. Kubeflow's PET_* (torchrun's arguments as variables: PET_NNODES, PET_NPROC_PER_NODE,
//      PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT): PET_NPROC_PER_NODE=1, or WORLD_SIZE ==
//      PET_NNODES, is one process per pod: local rank 0 of 1 on node PET_NODE_RANK of PET_NNODES.
//      A larger PET_NPROC_PER_NODE without LOCAL_RANK is an error: the pod was to run torchrun.
//   b. a launcher of 2-8 whose rank and size are the same: its local layout (and its job id).
//   c. a master address (MASTER_ADDR, PET_MASTER_ADDR) that is not loopback: nothing says which
//      ranks share a host. local_layout_from_rendezvous is set; local_rank 0, local_world_size 1,
//      node_rank = rank and num_nodes = world_size are provisional, for init_process_group to
//      replace with what the ranks that share a host work out at rendezvous.
//   d. one node: local_rank = RANK.
// The source stays torchrun (the variables and their meaning are torchrun's; nothing tells a
// PyTorchJob from a script that sets the same four); the origins say where the layout came from.
// Flux without an even FLUX_JOB_SIZE / FLUX_JOB_NNODES also leaves the layout to the rendezvous.
//
// Job identity (job_id): one string, the same on every rank, for messages ("job slurm:1234.0")
// and the default port. DDP_JOB_ID verbatim when set (ddprun sets it); else the source's own id
// above, prefixed with the source's name ("slurm:1234.0", "torchrun:<run id>"; torchrun's static
// default run id "none" is none); else "". An enclosing allocation's id is not borrowed by a
// source without one (hydra inside Slurm, torchrun without a run id): several launches may share
// it, and ranks started over ssh may not have it.
//
// MASTER_ADDR (else PET_MASTER_ADDR) overrides the address of every source. Without either, a
// single-node job uses 127.0.0.1 and a Slurm job the first host of its node list; a multi-node
// job from any other source is an error. MASTER_PORT (else PET_MASTER_PORT) sets the port; without
// either, a job with an identity uses 20000 + n % 12768, with n = JOB + 7919 x STEP for a numeric
// "JOB" or "JOB.STEP" id (Slurm, LSF, Open MPI 4) and an FNV-1a hash of the id otherwise, so that
// two jobs, or two steps of one job, sharing a node do not collide (7919 is prime to 12768: the
// steps of one job get distinct ports), below the kernel's ephemeral ports (32768 and up by
// default). Step 0 of a Slurm job gets 20000 + SLURM_JOB_ID % 12768 (examples/slurm/train_ddp.sbatch
// leaves the port to this). Two ids can still meet on one port, and anything else
// may hold it: a derived port comes with 7 alternates (master_port_alternates), which rank 0's
// store moves to and every rank searches. Otherwise 29500.
// DDP_TIMEOUT (seconds) sets the default deadline.
// DDP_HEARTBEAT_TIMEOUT (seconds, 0 = off, default 5) sets how long the ring backend tolerates a
// peer whose heartbeat has stopped (default_heartbeat_timeout()).
//
// Empty variables count as unset. Every bad value is a ddp::error(errc::config) whose message
// names the variable and the expected form; from_environment() also cross-checks the values
// (rank < world size, local rank < local world size, local world size x nodes == world size).
//
// The lookup is injectable so that tests (and tools) can describe an environment as a table
// without touching the real one.
//
// The pieces: ddp/core/env/parse.hpp (the values' forms: integers, ports, Slurm's lists),
// ddp/core/env/launch_environment.hpp (the type and its origins), ddp/core/env/read.hpp (the
// reading itself, in the order above, and the job's identity).

#include "ddp/core/env/launch_environment.hpp"
#include "ddp/core/env/parse.hpp"
#include "ddp/core/env/read.hpp"
