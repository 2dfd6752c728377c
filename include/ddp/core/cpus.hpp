#pragma once
// The CPUs this process may run on: its affinity mask, which a launcher that binds ranks
// (srun --cpu-bind, mpirun --bind-to, ddprun --cpu-bind) narrows.

#include <sched.h>

#include <vector>

namespace ddp::detail {

/// The ids of the CPUs this process may run on, ascending; empty when the mask cannot be read.
inline std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

}  // namespace ddp::detail
