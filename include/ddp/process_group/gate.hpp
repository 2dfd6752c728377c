#pragma once
// pg_gate: who may execute a process_group's next collective (one at a time), the group's
// sequence counter, and whether calls are queued for its communication thread, in one atomic
// word. A blocking call on a group with nothing queued and nobody waiting takes the gate with
// one compare-exchange (which also draws its sequence number) and returns it with one
// fetch_and: no mutex on the latency path (the mutex and condition variable it replaced were a
// measurable share of a small shared-memory all-reduce).
//
// Everything that must wait does so under the group's mutex, on its condition variable, after
// setting the `waiters` bit; while that bit is set no caller takes the fast path, and whoever
// returns the gate and sees the bit takes the mutex and notifies. The `queued` bit is set by
// the submitter of the first queued call and cleared by the communication thread when it takes
// the last one (both under the mutex), so a blocking call never overtakes a queued one.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>

namespace ddp::detail {

class pg_gate {
 public:
  /// The sequence number the next call will get.
  std::uint64_t next_sequence() const noexcept { return word_.load(std::memory_order_acquire) >> sequence_shift; }

  /// A blocking call's fast path: takes the gate and a sequence number when the gate is free,
  /// nothing is queued and nobody waits; nullopt otherwise (then enter_waiting()).
  std::optional<std::uint64_t> try_enter() noexcept {
    std::uint64_t w = word_.load(std::memory_order_relaxed);
    if ((w & (busy | waiters | queued)) != 0) return std::nullopt;
    if (!word_.compare_exchange_strong(w, w + sequence_one + busy, std::memory_order_acquire, std::memory_order_relaxed)) return std::nullopt;
    return w >> sequence_shift;
  }

  /// Under `lock` (the group's mutex): waits until the gate is free and nothing is queued, calling
  /// check() before each wait and once more before entering (it may throw), then takes the gate,
  /// with a sequence number when `sequenced` (a collective) and without one otherwise (a section
  /// that must not run concurrently with a collective, such as a collective allocation).
  template <class Check>
  std::uint64_t enter_waiting(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, bool sequenced, Check&& check) {
    waiting_registration registered(*this);
    for (;;) {
      check();
      std::uint64_t w = word_.load(std::memory_order_acquire);
      if ((w & (busy | queued)) == 0) {
        // Only a returning holder may change the word now (waiters keep callers off the fast path,
        // submitters need the mutex), and the gate is free: the exchange succeeds at once.
        while (!word_.compare_exchange_weak(w, w + (sequenced ? sequence_one : 0) + busy, std::memory_order_acquire, std::memory_order_acquire)) {
        }
        return w >> sequence_shift;
      }
      cv.wait(lock);
    }
  }

  /// Returns the gate; wakes the waiters, if any.
  void leave(std::mutex& mutex, std::condition_variable& cv) noexcept {
    const std::uint64_t before = word_.fetch_and(~busy, std::memory_order_release);
    if ((before & waiters) != 0) {
      { std::lock_guard lock(mutex); }  // a waiter registers and checks under the mutex: it is now asleep in wait()
      cv.notify_all();
    }
  }

  /// Under the mutex, by the submitter of a queued call: its sequence number; `first` when the
  /// queue was empty (from now on blocking calls wait for the queue).
  std::uint64_t sequence_for_queued(bool first) noexcept {
    return word_.fetch_add(sequence_one + (first ? queued : 0), std::memory_order_acq_rel) >> sequence_shift;
  }

  /// Under `lock`, by the communication thread with a queued call to run: takes the gate if it
  /// is free; else waits until it has been returned (or a spurious wake-up) and says false.
  bool enter_queued(std::unique_lock<std::mutex>& lock, std::condition_variable& cv) {
    std::uint64_t w = word_.load(std::memory_order_relaxed);
    while ((w & busy) == 0) {
      if (word_.compare_exchange_weak(w, w | busy, std::memory_order_acquire, std::memory_order_relaxed)) return true;
    }
    waiting_registration registered(*this);
    if ((word_.load(std::memory_order_acquire) & busy) != 0) cv.wait(lock);
    return false;
  }

  /// Under the mutex, by the communication thread once it has taken the last queued call.
  void queue_drained() noexcept { word_.fetch_and(~queued, std::memory_order_release); }

 private:
  static constexpr std::uint64_t busy = 1;     // a call or exclusive section holds the gate
  static constexpr std::uint64_t waiters = 2;  // someone waits under the mutex
  static constexpr std::uint64_t queued = 4;   // calls are queued for the communication thread
  static constexpr unsigned sequence_shift = 3;
  static constexpr std::uint64_t sequence_one = std::uint64_t{1} << sequence_shift;

  // Counted under the mutex; the waiters bit is set while the count is not zero.
  struct waiting_registration {
    explicit waiting_registration(pg_gate& g) : gate(g) {
      if (gate.waiting_++ == 0) gate.word_.fetch_or(waiters, std::memory_order_acq_rel);
    }
    waiting_registration(const waiting_registration&) = delete;
    waiting_registration& operator=(const waiting_registration&) = delete;
    ~waiting_registration() {
      if (--gate.waiting_ == 0) gate.word_.fetch_and(~waiters, std::memory_order_acq_rel);
    }
    pg_gate& gate;
  };

  std::atomic<std::uint64_t> word_{0};
  int waiting_ = 0;  // under the group's mutex
};

}  // namespace ddp::detail
