#pragma once
// Every environment variable ddp reads, in one table, and the one function that reads them.
//
// A name passed to ddp::read_env must be in the table: env_name's constructor is consteval, so
// an unregistered literal does not compile. The launch environment (core/env.hpp) reads the
// launchers' variables through an injectable lookup; tests/unit/env_registry_test.cpp checks
// that every variable name in the library's sources is registered here and that nothing else
// calls getenv. `ddprun --env` prints the table.

#include <array>
#include <cstdlib>
#include <string_view>

namespace ddp {

struct env_variable {
  std::string_view name;
  std::string_view meaning;
};

// Names that end in '*' are families (PET_* etc. are listed one by one; '*' marks the prefixes
// read as a group, like OMPI_MCA_*).
inline constexpr std::array env_variables{
    // ddp's own knobs
    env_variable{"DDP_TIMEOUT", "default collective and set-up timeout, seconds"},
    env_variable{"DDP_HEARTBEAT_TIMEOUT", "a peer silent this long (seconds) is lost; 0 turns the heartbeat off"},
    env_variable{"DDP_RING_HIERARCHY", "ring backend across hosts: auto, flat or hierarchical"},
    env_variable{"DDP_TCP_SPIN_US", "microseconds a tcp wait spins before it sleeps in poll"},
    env_variable{"DDP_SOCKET_ADDR", "the address this rank's tcp transport listens on"},
    env_variable{"DDP_JOB_ID", "the job's identity when no launcher gives one"},
    env_variable{"DDP_STORE_SERVER", "set by ddprun: the launcher hosts the store, ranks only connect"},
    env_variable{"DDP_STORE_TOKEN", "the job's store credential (set by ddprun, or by the user on every host)"},
    env_variable{"DDP_STORE_AUTH", "store authentication: a token, a secret file, or off"},
    env_variable{"DDP_CHECKPOINT_TEST_HOOK", "tests only: kill this rank at a named point of a checkpoint save"},
    // torchrun / torchelastic / PyTorchJob
    env_variable{"RANK", "global rank (torchrun, PyTorchJob, ddprun)"},
    env_variable{"WORLD_SIZE", "number of ranks (torchrun, PyTorchJob, ddprun)"},
    env_variable{"LOCAL_RANK", "rank on this node"},
    env_variable{"LOCAL_WORLD_SIZE", "ranks on this node"},
    env_variable{"GROUP_RANK", "node rank (torchrun)"},
    env_variable{"GROUP_WORLD_SIZE", "number of nodes (torchrun)"},
    env_variable{"ROLE_RANK", "rank within the role (torchrun)"},
    env_variable{"ROLE_WORLD_SIZE", "ranks in the role (torchrun)"},
    env_variable{"MASTER_ADDR", "the store's host"},
    env_variable{"MASTER_PORT", "the store's port"},
    env_variable{"TORCHELASTIC_RUN_ID", "torchrun's job id"},
    env_variable{"TORCHELASTIC_RESTART_COUNT", "torchrun's restart count"},
    env_variable{"TORCHELASTIC_MAX_RESTARTS", "torchrun's restart limit"},
    env_variable{"TORCHELASTIC_USE_AGENT_STORE", "torchrun hosts the store in its agent"},
    env_variable{"PET_MASTER_ADDR", "PyTorchJob: the store's host"},
    env_variable{"PET_MASTER_PORT", "PyTorchJob: the store's port"},
    env_variable{"PET_NNODES", "PyTorchJob: number of nodes"},
    env_variable{"PET_NODE_RANK", "PyTorchJob: node rank"},
    env_variable{"PET_NPROC_PER_NODE", "PyTorchJob: ranks per node"},
    // Slurm
    env_variable{"SLURM_PROCID", "srun: global rank"},
    env_variable{"SLURM_NTASKS", "srun: number of ranks"},
    env_variable{"SLURM_NPROCS", "srun: number of ranks (older name)"},
    env_variable{"SLURM_STEP_NUM_TASKS", "srun: ranks of this step"},
    env_variable{"SLURM_LOCALID", "srun: rank on this node"},
    env_variable{"SLURM_NODEID", "srun: node rank"},
    env_variable{"SLURM_NNODES", "srun: number of nodes"},
    env_variable{"SLURM_JOB_NUM_NODES", "srun: number of nodes (job)"},
    env_variable{"SLURM_STEP_TASKS_PER_NODE", "srun: ranks per node of this step"},
    env_variable{"SLURM_TASKS_PER_NODE", "srun: ranks per node (job)"},
    env_variable{"SLURM_NTASKS_PER_NODE", "srun: ranks per node (requested)"},
    env_variable{"SLURM_STEP_NODELIST", "srun: the step's hosts; the first hosts the store"},
    env_variable{"SLURM_JOB_NODELIST", "srun: the job's hosts"},
    env_variable{"SLURM_NODELIST", "srun: the job's hosts (older name)"},
    env_variable{"SLURM_JOB_ID", "srun: job id"},
    env_variable{"SLURM_JOBID", "srun: job id (older name)"},
    env_variable{"SLURM_STEP_ID", "srun: step id"},
    env_variable{"SLURM_STEPID", "srun: step id (older name)"},
    // Open MPI, MPICH/Hydra, PMI, PMIx
    env_variable{"OMPI_COMM_WORLD_RANK", "mpirun: global rank"},
    env_variable{"OMPI_COMM_WORLD_SIZE", "mpirun: number of ranks"},
    env_variable{"OMPI_COMM_WORLD_LOCAL_RANK", "mpirun: rank on this node"},
    env_variable{"OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun: ranks on this node"},
    env_variable{"OMPI_MCA_ess_base_jobid", "mpirun: job id (Open MPI 4)"},
    env_variable{"OMPI_MCA_orte_ess_jobid", "mpirun: job id (Open MPI 3)"},
    env_variable{"PMIX_NAMESPACE", "PMIx: job namespace"},
    env_variable{"PMI_RANK", "PMI: global rank"},
    env_variable{"PMI_SIZE", "PMI: number of ranks"},
    env_variable{"PMI_LOCAL_RANK", "PMI: rank on this node"},
    env_variable{"PMI_LOCAL_SIZE", "PMI: ranks on this node"},
    env_variable{"MPI_LOCALRANKID", "Hydra: rank on this node"},
    env_variable{"MPI_LOCALNRANKS", "Hydra: ranks on this node"},
    // Flux, PALS (Cray), LSF (jsrun)
    env_variable{"FLUX_TASK_RANK", "Flux: global rank"},
    env_variable{"FLUX_JOB_SIZE", "Flux: number of ranks"},
    env_variable{"FLUX_TASK_LOCAL_ID", "Flux: rank on this node"},
    env_variable{"FLUX_JOB_NNODES", "Flux: number of nodes"},
    env_variable{"FLUX_JOB_ID", "Flux: job id"},
    env_variable{"PALS_RANKID", "PALS: global rank"},
    env_variable{"PALS_SIZE", "PALS: number of ranks"},
    env_variable{"PALS_LOCAL_RANKID", "PALS: rank on this node"},
    env_variable{"PALS_LOCAL_SIZE", "PALS: ranks on this node"},
    env_variable{"PALS_NODEID", "PALS: node rank"},
    env_variable{"PALS_APID", "PALS: application id"},
    env_variable{"JSM_NAMESPACE_RANK", "jsrun: global rank"},
    env_variable{"JSM_NAMESPACE_SIZE", "jsrun: number of ranks"},
    env_variable{"JSM_NAMESPACE_LOCAL_RANK", "jsrun: rank on this node"},
    env_variable{"JSM_NAMESPACE_LOCAL_SIZE", "jsrun: ranks on this node"},
    env_variable{"LSB_JOBID", "LSF: job id"},
    env_variable{"LSB_JOBINDEX", "LSF: array index"},
    // the system's
    env_variable{"PATH", "ddprun: where a program without a slash is looked up"},
    env_variable{"HOME", "where the store's secret file lives (~/.config/ddp/secret)"},
    env_variable{"XDG_CONFIG_HOME", "where the store's secret file lives, when set"},
    env_variable{"OMP_NUM_THREADS", "ddprun sets it to 1 for its ranks unless it is set"},
};

constexpr bool env_registered(std::string_view name) noexcept {
  for (const auto& v : env_variables)
    if (v.name == name) return true;
  return false;
}

/// A variable name checked against the table when it is compiled.
class env_name {
 public:
  consteval env_name(const char* name) : name_(name) {  // NOLINT: implicit from a literal on purpose
    if (!env_registered(name)) throw "ddp: this environment variable is not in ddp's registry (core/env_registry.hpp)";
  }
  constexpr const char* c_str() const noexcept { return name_; }

 private:
  const char* name_;
};

/// The value of a registered variable; nullptr when it is unset.
inline const char* read_env(env_name name) noexcept { return std::getenv(name.c_str()); }

/// The same for a name chosen at run time (the launch environment's lookups); an unregistered
/// name reads as unset, so a variable the table does not list can never steer the library.
inline const char* read_registered_env(const char* name) noexcept { return env_registered(name) ? std::getenv(name) : nullptr; }

/// read_env, with an empty value read as unset.
inline const char* read_env_nonempty(env_name name) noexcept {
  const char* v = read_env(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace ddp
