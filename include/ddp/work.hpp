#pragma once
// ddp::work: the handle of an asynchronous collective.
//
// A work is copyable (the copies share one completion state). wait() rethrows the
// collective's ddp::error; wait(deadline) returns false when the deadline passes first
// (that is not an error: the collective keeps running, bounded by its group's timeout).
// A default-constructed work is already completed, so code can hold one unconditionally.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

namespace detail {

// Shared between the group's communication thread (which completes it) and every work copy.
struct work_state {
  collective_desc desc;
  int rank = -1;

  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr failure;
  // Set when the collective starts: its deadline plus the watchdog's grace. A waiter that is
  // still waiting after it knows the backend ignored abort(), and says so instead of hanging.
  deadline ceiling = deadline::never();

  void started(deadline until) {
    std::lock_guard lock(mutex);
    ceiling = until;
  }
  void complete(std::exception_ptr e) noexcept {
    {
      std::lock_guard lock(mutex);
      done = true;
      failure = std::move(e);
    }
    changed.notify_all();
  }
};

}  // namespace detail

class work {
 public:
  /// A completed work (nothing to wait for).
  work() = default;
  explicit work(std::shared_ptr<detail::work_state> state) : state_(std::move(state)) {}

  /// Blocks until the collective is done and rethrows its error. Bounded: the group aborts a
  /// collective at its deadline, and a backend that does not honour abort() is reported here
  /// as errc::timeout rather than waited for forever.
  void wait() {
    if (!state_) return;
    std::unique_lock lock(state_->mutex);
    while (!state_->done) {
      const deadline ceiling = state_->ceiling;
      if (ceiling.is_never()) {
        state_->changed.wait(lock);
      } else if (state_->changed.wait_until(lock, ceiling.time_point()) == std::cv_status::timeout && !state_->done &&
                 state_->ceiling == ceiling) {
        throw error(errc::timeout, "the collective did not finish although its deadline passed and its backend was aborted",
                    state_->desc.context(state_->rank));
      }
    }
    if (state_->failure) std::rethrow_exception(state_->failure);
  }

  /// True when done by `until` (rethrowing its error if it failed); false if still running then.
  bool wait(deadline until) {
    if (!state_) return true;
    {
      std::unique_lock lock(state_->mutex);
      while (!state_->done) {
        if (until.is_never()) {
          lock.unlock();
          wait();
          return true;
        }
        if (state_->changed.wait_until(lock, until.time_point()) == std::cv_status::timeout && !state_->done) return false;
      }
      if (!state_->failure) return true;
    }
    wait();  // rethrows
    return true;
  }
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    return wait(deadline::after(timeout));
  }

  /// Done (successfully or not); never blocks, never throws.
  bool is_completed() const noexcept {
    if (!state_) return true;
    std::lock_guard lock(state_->mutex);
    return state_->done;
  }
  /// Done and failed.
  bool failed() const noexcept {
    if (!state_) return false;
    std::lock_guard lock(state_->mutex);
    return state_->done && state_->failure != nullptr;
  }

  /// The collective this work stands for (sequence number, op, dtype, count, ...).
  collective_desc desc() const noexcept { return state_ ? state_->desc : collective_desc{}; }

 private:
  std::shared_ptr<detail::work_state> state_;
};

}  // namespace ddp
