#pragma once
// staging_copy_choice: how a rank copies a small all-reduce's data into its shared staging area
// for the peers to read: with streaming stores (through memory, streaming_copy.hpp) or ordinary
// stores (through the caches). Which is faster depends on where the ranks' cores sit relative to
// each other: close cores hand cached lines over cheaply, so ordinary stores win; far apart,
// reading the peer's cached lines costs more than reading memory, so streaming stores win. A VM's
// vCPUs can be either, and can move between the two while a job runs (bench/README.md, issue 32's
// sections), so no fixed choice suits every machine: this measures.
//
// Every `period` calls of a kind (all-reduce through the direct path, or through small staged
// chunks) the next 2 x `samples` calls try both ways, alternating, and time the whole call. The
// faster median per byte is used until the next trial. Every rank counts the same calls (the
// choice of path depends only on the call's size, the same on every rank), so the ranks try each
// way at the same time and each times the pair's joint choice; a rank decides for its own copies
// only, so ranks that decide differently stay correct.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ddp::algo::detail {

class staging_copy_choice {
 public:
  static constexpr int samples = 8;              // timed calls per way and trial
  static constexpr std::uint64_t period = 1024;  // calls from one trial's start to the next's

  /// Starts a call of this kind: whether to copy in with streaming stores, and whether to time it.
  struct call {
    bool streaming = true;
    bool timed = false;
    std::chrono::steady_clock::time_point start{};
  };

  call begin() noexcept {
    const std::uint64_t phase = calls_++ % period;
    if (phase >= 2 * samples) return {.streaming = streaming_};
    return {.streaming = phase % 2 == 0, .timed = true, .start = std::chrono::steady_clock::now()};
  }

  /// Ends a call begun with `c` that moved `bytes`; a call that failed is not recorded.
  void end(const call& c, std::size_t bytes) noexcept {
    if (!c.timed || bytes == 0) return;
    const auto ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - c.start).count();
    record(c.streaming, ns / static_cast<double>(bytes));
  }

  /// One timed call of a trial: nanoseconds per byte with streaming or ordinary stores. With
  /// `samples` of each, the trial decides.
  void record(bool streaming, double ns_per_byte) noexcept {
    auto& way = streaming ? streaming_ns_ : ordinary_ns_;
    int& n = streaming ? streaming_n_ : ordinary_n_;
    if (n < samples) way[static_cast<std::size_t>(n++)] = ns_per_byte;
    if (streaming_n_ == samples && ordinary_n_ == samples) {
      streaming_ = median(streaming_ns_) <= median(ordinary_ns_);
      streaming_n_ = ordinary_n_ = 0;
    }
  }

  /// The way chosen by the last trial (streaming stores before the first).
  bool streaming() const noexcept { return streaming_; }

 private:
  static double median(std::array<double, samples> v) noexcept {
    std::nth_element(v.begin(), v.begin() + samples / 2, v.end());
    return v[samples / 2];
  }

  std::uint64_t calls_ = 0;
  bool streaming_ = true;
  std::array<double, samples> streaming_ns_{}, ordinary_ns_{};
  int streaming_n_ = 0, ordinary_n_ = 0;
};

}  // namespace ddp::algo::detail
