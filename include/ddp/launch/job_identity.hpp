#pragma once
// The job identity the launcher hands its workers (DDP_JOB_ID), and its refusal to run as one of
// several srun / mpirun tasks, each of which would start a whole job of its own.

#include <string>

#include "ddp/core/env.hpp"
#include "ddp/core/env_registry.hpp"
#include "ddp/core/error.hpp"
#include "ddp/launch/options.hpp"
#include "ddp/launch/process.hpp"

namespace ddp::detail {

/// The job identity a launcher hands its workers when none is given (see "Job identity" in
/// ddp/launch/job.hpp).
inline std::string launcher_job_id(int nnodes) {
  if (const char* id = read_env("DDP_JOB_ID"); id != nullptr && *id != '\0') return id;
  try {
    if (auto outer = launch_environment::from_environment().job_id; !outer.empty()) return outer;
  } catch (const error&) {
    // An environment the launcher's own launcher left inconsistent: it identifies nothing.
  }
  return nnodes == 1 ? "ddprun:" + random_hex(8) : std::string();
}

/// A launcher started as one of several tasks (srun -n2 ddprun --nnodes=1) would run that many
/// separate jobs, each believing it is the whole job: refuse, in one line.
inline void check_not_one_of_many(const launch_options& o) {
  if (o.nnodes != 1) return;
  const auto count = [](const char* name) -> long long {
    const char* v = read_registered_env(name);
    if (v == nullptr || *v == '\0') return 0;
    const auto n = parse_int64(v);
    return n ? *n : 0;
  };
  for (const char* var : {"SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const long long tasks = count(var); tasks > 1) {
      throw error(errc::config, o.name + " was started as one of " + std::to_string(tasks) + " tasks (" + var + "=" +
                                    std::to_string(tasks) + ") with --nnodes=1, so each task would run a whole job of its own: "
                                    "start one " + o.name + " per node with --nnodes=<nodes> --node-rank=<this node> "
                                    "(e.g. srun --ntasks-per-node=1 " + o.name + " --nnodes=$SLURM_NNODES "
                                    "--node-rank=$SLURM_NODEID ...), or let srun/mpirun start the ranks themselves");
    }
  }
}

}  // namespace ddp::detail
