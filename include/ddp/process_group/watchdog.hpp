#pragma once
// The watchdog of a process group: one thread that aborts the backend when the running
// collective passes its deadline.
//
// The executing thread only stores two atomics per collective (no lock, no wake-up), so the
// watchdog costs nothing on the fast path. It can sleep without being told about new
// collectives because every collective's firing time is at least (its start + the group
// timeout): after it sees the group idle it sleeps one timeout, and no collective that starts
// meanwhile can expire before it wakes. Shortening the timeout wakes it (set_idle_wait).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "ddp/core/deadline.hpp"

namespace ddp::detail {

class pg_watchdog {
 public:
  pg_watchdog(std::function<void()> on_expiry, std::chrono::milliseconds idle_wait)
      : on_expiry_(std::move(on_expiry)), idle_wait_(clamp(idle_wait)) {
    thread_ = std::thread([this] { loop(); });
  }
  pg_watchdog(const pg_watchdog&) = delete;
  pg_watchdog& operator=(const pg_watchdog&) = delete;
  ~pg_watchdog() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// The collective `token` (never 0) is running and must finish by `fire_at`.
  void begin(std::uint64_t token, deadline fire_at) noexcept {
    fire_at_.store(fire_at.time_point().time_since_epoch().count(), std::memory_order_relaxed);
    token_.store(token, std::memory_order_release);
  }
  void end() noexcept { token_.store(0, std::memory_order_release); }
  /// Whether the watchdog aborted the backend during collective `token`.
  bool tripped(std::uint64_t token) const noexcept { return tripped_.load(std::memory_order_acquire) == token; }

  void set_idle_wait(std::chrono::milliseconds wait) {
    {
      std::lock_guard lock(mutex_);
      idle_wait_ = clamp(wait);
    }
    wake_.notify_all();
  }

 private:
  static std::chrono::milliseconds clamp(std::chrono::milliseconds w) {
    // Sleeping longer than a day would only overflow time arithmetic; waking daily is free.
    return std::min(std::max(w, std::chrono::milliseconds(1)), std::chrono::milliseconds(std::chrono::hours(24)));
  }

  void loop() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      const std::uint64_t token = token_.load(std::memory_order_acquire);
      if (token == 0) {
        wake_.wait_for(lock, idle_wait_);
        continue;
      }
      const clock::time_point at{clock::duration(fire_at_.load(std::memory_order_relaxed))};
      if (at == clock::time_point::max()) {
        wake_.wait_for(lock, idle_wait_);
        continue;
      }
      if (clock::now() < at) {
        wake_.wait_until(lock, at);
        continue;
      }
      // Expired: abort only if the same collective is still running (it may have just ended).
      if (token_.load(std::memory_order_acquire) == token && tripped_.load(std::memory_order_relaxed) != token) {
        tripped_.store(token, std::memory_order_release);
        on_expiry_();
      }
      // Until the aborted collective returns, look again now and then (failure path only).
      wake_.wait_for(lock, std::chrono::milliseconds(5));
    }
  }

  std::function<void()> on_expiry_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::chrono::milliseconds idle_wait_;
  bool stop_ = false;
  std::atomic<std::uint64_t> token_{0};
  std::atomic<clock::rep> fire_at_{0};
  std::atomic<std::uint64_t> tripped_{0};
  std::thread thread_;
};

}  // namespace ddp::detail
