#pragma once
// ddp::no_sync_guard: what distributed_data_parallel::no_sync() and sharded_data_parallel::no_sync()
// return. While it lives the wrapper does not synchronize gradients; its destructor leaves the
// no_sync region (they nest: a depth the wrapper keeps under its own mutex).

#include <mutex>
#include <utility>

namespace ddp {

class no_sync_guard {
 public:
  /// `depth` was incremented under `mutex` by the wrapper that constructs the guard.
  no_sync_guard(std::mutex& mutex, int& depth) noexcept : mutex_(&mutex), depth_(&depth) {}
  no_sync_guard(no_sync_guard&& other) noexcept : mutex_(other.mutex_), depth_(std::exchange(other.depth_, nullptr)) {}
  no_sync_guard(const no_sync_guard&) = delete;
  no_sync_guard& operator=(const no_sync_guard&) = delete;
  no_sync_guard& operator=(no_sync_guard&&) = delete;
  ~no_sync_guard() {
    if (depth_ != nullptr) {
      std::lock_guard lock(*mutex_);
      --*depth_;
    }
  }

 private:
  std::mutex* mutex_;
  int* depth_;  // null once moved from
};

}  // namespace ddp
