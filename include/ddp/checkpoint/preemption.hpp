#pragma once
// ddp::preemption: a scheduler's "you are about to be stopped" signal, turned into a decision
// every rank takes at the same step.
//
//   ddp::preemption preempt;                          // SIGUSR1 and SIGTERM by default
//   for (...) {
//     step();
//     if (preempt.agreed(group)) {                    // one all_reduce(max) of a flag
//       ddp::checkpoint::save(group, dir, step, st);
//       return ddp::preemption::requeue_exit_code;    // 75: "requeue me"
//     }
//   }
//
// Why: a signal reaches one rank (or the ranks at different times). A rank that saved and left on
// its own would leave the others blocked in the next collective and the checkpoint of mixed
// steps. agreed() all-reduces the flag with max at a step boundary, so either every rank sees it
// or none does, and all save the same step.
// The handler only stores the signal number in a lock-free atomic (async-signal-safe) and is
// installed with SA_RESTART; ddp's transports retry the calls a signal still interrupts (poll).
// One instance at a time; the destructor restores the previous handlers.
// Exit code: 75 (EX_TEMPFAIL, "temporary failure, try again" in sysexits.h). Under Slurm the batch
// script maps it to `scontrol requeue $SLURM_JOB_ID` (examples/slurm/train_ddp_requeue.sbatch:
// Slurm itself requeues no job for its exit code); under ddprun --max-restarts any non-zero exit
// restarts the group, which then resumes from the checkpoint.

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp {

struct preemption_options {
  std::vector<int> signals = {SIGUSR1, SIGTERM};
};

namespace detail {
inline std::atomic<int> preemption_signal{0};
inline std::atomic<bool> preemption_installed{false};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");
inline void preemption_handler(int sig) { preemption_signal.store(sig, std::memory_order_relaxed); }
}  // namespace detail

class preemption {
 public:
  /// EX_TEMPFAIL: the job saved a checkpoint because it was asked to stop; run it again.
  static constexpr int requeue_exit_code = 75;

  explicit preemption(preemption_options options = {}) : options_(std::move(options)) {
    if (detail::preemption_installed.exchange(true))
      throw error(errc::invalid_argument, "ddp::preemption: only one instance may exist at a time", {.op = "preemption"});
    detail::preemption_signal.store(0);
    for (const int sig : options_.signals) {
      struct sigaction sa {};
      sa.sa_handler = &detail::preemption_handler;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;
      struct sigaction old {};
      if (::sigaction(sig, &sa, &old) != 0) {
        restore();
        detail::preemption_installed.store(false);
        throw error(errc::invalid_argument, "ddp::preemption: cannot handle signal " + std::to_string(sig),
                    {.op = "preemption"});
      }
      previous_.emplace_back(sig, old);
    }
  }
  preemption(const preemption&) = delete;
  preemption& operator=(const preemption&) = delete;
  ~preemption() {
    restore();
    detail::preemption_installed.store(false);
  }

  /// The signal this process received (0: none yet).
  int signal() const noexcept { return detail::preemption_signal.load(std::memory_order_relaxed); }
  /// This process was asked to stop (its own view; use agreed() to act on it).
  bool requested() const noexcept { return signal() != 0; }
  /// Asks this rank to stop, as the signal would (tests, or a time limit of the job's own).
  void request(int sig = SIGUSR1) noexcept { detail::preemption_signal.store(sig, std::memory_order_relaxed); }

  /// Collective: true on every rank when any rank was asked to stop. Call it at the same point of
  /// every step on every rank.
  template <class Group>
  bool agreed(Group& group) {
    std::int32_t flag[1] = {requested() ? 1 : 0};
    group.all_reduce(std::span<std::int32_t>(flag), max{});
    return flag[0] != 0;
  }

 private:
  void restore() noexcept {
    for (auto& [sig, old] : previous_) ::sigaction(sig, &old, nullptr);
    previous_.clear();
  }
  preemption_options options_;
  std::vector<std::pair<int, struct sigaction>> previous_;
};

}  // namespace ddp
