#pragma once
// Clocks for the per-collective bookkeeping of process_group, where two reads of steady_clock
// (on a VM the vDSO reads the TSC, scales it and retries on a seqlock) were a sizeable part of a
// small collective (bench/README):
//  - tick_clock: an interval counter for statistics. The raw TSC where the kernel itself
//    keeps time with it (clocksource "tsc": invariant and synchronized across CPUs), else
//    steady_clock's nanoseconds. Ticks become time only when someone reads the statistics, at
//    the TSC rate measured from the clock's first use in this process until then; a total is
//    thereby off by about one clock read, however long the process ran.
//  - coarse_now(): steady_clock's time as of the last timer tick (a memory read, Linux's
//    CLOCK_MONOTONIC_COARSE, same epoch as steady_clock), for deadlines of whole milliseconds.
//    It lags by up to the tick period, which coarse_resolution() gives (more only while a
//    timer tick is late, as on a busy VM host), so a deadline of coarse_now() +
//    coarse_resolution() + timeout does not fire early and fires at most a tick late.

#include <chrono>
#include <cstdint>
#include <tuple>
#include <utility>

#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <fstream>
#include <string>
#endif

// The compiler's builtin rather than <x86intrin.h>'s __rdtsc: that header declares every x86
// intrinsic, a large part of what any file that includes process_group.hpp parses.
#if defined(__x86_64__) || defined(__i386__)
#define DDP_HAVE_TSC 1
#else
#define DDP_HAVE_TSC 0
#endif

#if defined(__linux__)
#include <time.h>
#endif

namespace ddp::detail {

class tick_clock {
 public:
  using ticks = std::uint64_t;

  static ticks now() noexcept {
#if DDP_HAVE_TSC
    if (origin().tsc) return __builtin_ia32_rdtsc();
#endif
    return steady_ticks();
  }

  /// Ticks as time, at the rate measured over this process's use of the clock so far.
  static std::chrono::nanoseconds to_duration(ticks t) noexcept {
    const origin_point& o = origin();
    if (!o.tsc) return std::chrono::nanoseconds(static_cast<std::int64_t>(t));
    const auto [tsc_now, steady_now] = paired_reading();
    const double ns = static_cast<double>(steady_now - o.steady);
    const double tsc = static_cast<double>(tsc_now - o.tsc_ticks);
    if (ns <= 0 || tsc <= 0) return std::chrono::nanoseconds(0);
    return std::chrono::nanoseconds(static_cast<std::int64_t>(static_cast<double>(t) * (ns / tsc)));
  }

 private:
  struct origin_point {
    bool tsc;
    std::uint64_t tsc_ticks;
    std::uint64_t steady;
  };

  // The TSC and steady_clock at one moment: steady_clock read between two TSC reads, the
  // tightest pair of three tries, so that a preemption between the reads does not skew the rate.
  static std::pair<std::uint64_t, std::uint64_t> paired_reading() noexcept {
    std::pair<std::uint64_t, std::uint64_t> best{0, 0};
    std::uint64_t best_gap = ~std::uint64_t{0};
#if DDP_HAVE_TSC
    for (int i = 0; i < 3; ++i) {
      const std::uint64_t before = __builtin_ia32_rdtsc();
      const std::uint64_t steady = steady_ticks();
      const std::uint64_t after = __builtin_ia32_rdtsc();
      if (after - before < best_gap) {
        best_gap = after - before;
        best = {before + (after - before) / 2, steady};
      }
    }
#else
    (void)best_gap;
#endif
    return best;
  }

  static std::uint64_t steady_ticks() noexcept {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
  }

  static bool kernel_keeps_time_with_tsc() noexcept;

  static const origin_point& origin() noexcept {
    static const origin_point o = [] {
      origin_point p{kernel_keeps_time_with_tsc(), 0, steady_ticks()};
      if (p.tsc) std::tie(p.tsc_ticks, p.steady) = paired_reading();
      return p;
    }();
    return o;
  }
};

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE bool tick_clock::kernel_keeps_time_with_tsc() noexcept {
#if DDP_HAVE_TSC && defined(__linux__)
  try {
    std::ifstream in("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    std::string name;
    return static_cast<bool>(in >> name) && name == "tsc";
  } catch (...) {
    return false;
  }
#else
  return false;
#endif
}
#endif  // !DDP_DECLARATIONS_ONLY

inline std::chrono::steady_clock::time_point coarse_now() noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  timespec ts;
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0) {
    return std::chrono::steady_clock::time_point(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
  }
#endif
  return std::chrono::steady_clock::now();
}

/// How far coarse_now() may lag steady_clock::now().
inline std::chrono::nanoseconds coarse_resolution() noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  static const std::chrono::nanoseconds resolution = [] {
    timespec ts;
    if (::clock_getres(CLOCK_MONOTONIC_COARSE, &ts) != 0) return std::chrono::nanoseconds(0);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }();
  return resolution;
#else
  return std::chrono::nanoseconds(0);
#endif
}

}  // namespace ddp::detail
