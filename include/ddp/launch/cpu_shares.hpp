#pragma once
// Internal: the CPU shares of ddprun --cpu-bind cores (launch_options::bind_cpus). Worker i of n
// gets the i-th of n contiguous, equal shares of the CPUs the launcher may use (the first
// n_cpus % n shares one CPU more), as srun --cpu-bind=cores hands out cores: workers that spin
// while they wait then never share a CPU, and each keeps its caches.

#include <sched.h>

#include <string>
#include <vector>

#include "ddp/core/cpus.hpp"

namespace ddp::detail {

// A named type around the C one: nvcc's front end fails on a container of cpu_set_t, an
// anonymous struct.
struct cpu_share {
  cpu_set_t cpus;
};

/// One CPU set per worker, or none (and `why_not` says why) when there are more workers than
/// CPUs or the launcher's own set cannot be read.
inline std::vector<cpu_share> cpu_shares(int workers, std::string& why_not) {
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.empty()) {
    why_not = "cannot read this launcher's CPUs (sched_getaffinity)";
    return {};
  }
  const int n = static_cast<int>(cpus.size());
  if (workers < 1 || workers > n) {
    why_not = std::to_string(workers) + " workers on " + std::to_string(n) + " CPUs: no worker is bound";
    return {};
  }
  std::vector<cpu_share> shares(static_cast<std::size_t>(workers));
  int next = 0;
  for (int w = 0; w < workers; ++w) {
    cpu_set_t& set = shares[static_cast<std::size_t>(w)].cpus;
    CPU_ZERO(&set);
    const int size = n / workers + (w < n % workers ? 1 : 0);
    for (int k = 0; k < size; ++k) CPU_SET(cpus[static_cast<std::size_t>(next++)], &set);
  }
  return shares;
}

}  // namespace ddp::detail
