#pragma once
// Where a benchmark's forked ranks run: with binding, rank r on the r-th CPU this program may
// use (as Intel MPI and Open MPI place theirs), so no rank starts on its peer's CPU; without it
// (or with more ranks than CPUs) where the kernel puts them.
#include <sched.h>

#include <cstdio>
#include <vector>

#include "ddp/core/cpus.hpp"

namespace ddp::bench {

struct rank_binding {
  std::vector<int> cpus = ddp::detail::allowed_cpus();
  bool on = false;

  /// `wanted`: binding asked for; it happens when there is a CPU for each of `ranks`.
  rank_binding(bool wanted, int ranks, const char* program) : on(wanted && static_cast<int>(cpus.size()) >= ranks) {
    if (wanted && !on) std::fprintf(stderr, "%s: %d ranks on %zu CPUs: ranks not bound\n", program, ranks, cpus.size());
  }
  /// In the forked rank r.
  void apply(int rank, const char* program) const {
    if (!on) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[static_cast<std::size_t>(rank)], &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) std::fprintf(stderr, "%s: sched_setaffinity failed\n", program);
  }
};

}  // namespace ddp::bench
