#pragma once
// shm_transport: point-to-point byte streams between ranks of one host, through shared memory.
//
// Every ordered pair (src -> dst) has a single-producer/single-consumer ring buffer (4 MiB by
// default) in dst's segment: a head counter written only by src, a tail counter written only by
// dst, each on its own cache line, and the data. Counters are byte totals (never wrap in
// practice), so full and empty are never confused. Segments are anonymous memory (see
// detail/shm_segment.hpp), so a SIGKILL leaves nothing in /dev/shm. A ring takes memory only once
// its pair exchanges data (the first send or receive backs it), so a rank's memory grows with
// the peers it talks to (two in a ring), not with the group.
//
// Waiting spins, yields, then sleeps on a futex; a dead peer (its pidfd) is errc::peer_lost
// "peer rank N (pid P) exited" within one futex slice (10 ms); abort() marks the group aborted in
// shared memory and wakes every waiter of every rank. Models ddp::transport.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/shm_group.hpp"

namespace ddp {

// In namespace ddp, not ddp::transport: that name is taken by the transport concept (as for tcp_transport).

class shm_transport {
 public:
  struct options {
    std::size_t ring_bytes = std::size_t{4} << 20;  // per ordered pair; a power of two
    detail::shm::shm_wait_policy wait{};
  };

  /// Collective over the group: every rank constructs one with the same store, prefix and size.
  /// The prefix keeps several transports (sub-groups) apart in one store.
  shm_transport(ddp::store::store& st, const std::string& prefix, int rank, int size, deadline setup)
      : shm_transport(st, prefix, rank, size, setup, options{}) {}
  /// `topology`: where the ranks run, when the caller has it (see rank_topology).
  shm_transport(ddp::store::store& st, const std::string& prefix, int rank, int size, deadline setup, options opts,
                const rank_topology* topology = nullptr)
      : capacity_(checked_capacity(opts.ring_bytes)),
        group_(st, prefix, "t", rank, size, ring_stride(capacity_) * static_cast<std::size_t>(std::max(size - 1, 1)), setup,
               opts.wait, 0, topology),
        backed_(static_cast<std::size_t>(size), 0) {}

  int rank() const noexcept { return group_.rank(); }
  int size() const noexcept { return group_.size(); }
  /// The numbers the ranks go by in messages (the group's).
  const rank_numbering& numbering() const noexcept { return group_.numbering(); }

  void send(int peer, std::span<const std::byte> out, deadline dl) {
    check_peer(peer, "shm.send");
    exchange(peer, out, peer, {}, dl, "shm.send");
  }
  void recv(int peer, std::span<std::byte> in, deadline dl) {
    check_peer(peer, "shm.recv");
    exchange(peer, {}, peer, in, dl, "shm.recv");
  }
  /// Sends to `to` while receiving from `from`, so a ring step cannot deadlock on full buffers.
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, deadline dl) {
    check_peer(to, "shm.send_recv");
    check_peer(from, "shm.send_recv");
    exchange(to, out, from, in, dl, "shm.send_recv");
  }

  void abort() noexcept { group_.abort(); }

 private:
  struct alignas(detail::shm::cache_line) counter {
    std::atomic<std::uint64_t> value;
  };
  struct ring_view {
    counter* head;  // bytes written, by the producer
    counter* tail;  // bytes read, by the consumer
    std::byte* data;
  };

  static std::size_t ring_stride(std::size_t capacity) noexcept { return 2 * detail::shm::cache_line + capacity; }
  static std::size_t checked_capacity(std::size_t bytes) {
    if (bytes < 4096 || (bytes & (bytes - 1)) != 0) {
      throw error(errc::invalid_argument, "shm_transport: ring_bytes " + std::to_string(bytes) + " must be a power of two >= 4096");
    }
    return bytes;
  }

  // The ring src -> dst lives in dst's segment, slot src (skipping dst itself).
  static std::size_t ring_offset(int src, int dst, std::size_t capacity) noexcept {
    const int slot = src < dst ? src : src - 1;
    return static_cast<std::size_t>(slot) * ring_stride(capacity);
  }
  ring_view ring(int src, int dst) const noexcept {
    std::byte* base = group_.payload(dst) + ring_offset(src, dst, capacity_);
    return {reinterpret_cast<counter*>(base), reinterpret_cast<counter*>(base + detail::shm::cache_line), base + 2 * detail::shm::cache_line};
  }

  // Moves what fits now; returns the number of bytes moved. At most a quarter ring per step, so
  // the consumer starts while the producer is still copying.
  std::size_t push(int to, const std::byte* p, std::size_t n) noexcept {
    const auto r = ring(rank(), to);
    const std::uint64_t head = r.head->value.load(std::memory_order_relaxed);
    const std::uint64_t tail = r.tail->value.load(std::memory_order_acquire);
    const std::size_t k = std::min({n, capacity_ - static_cast<std::size_t>(head - tail), capacity_ / 4});
    if (k == 0) return 0;
    const std::size_t at = static_cast<std::size_t>(head) & (capacity_ - 1);
    const std::size_t first = std::min(k, capacity_ - at);
    ddp::detail::bulk_copy(r.data + at, p, first);
    ddp::detail::bulk_copy(r.data, p + first, k - first);
    r.head->value.store(head + k, std::memory_order_release);
    return k;
  }
  std::size_t pull(int from, std::byte* p, std::size_t n) noexcept {
    const auto r = ring(from, rank());
    const std::uint64_t tail = r.tail->value.load(std::memory_order_relaxed);
    const std::uint64_t head = r.head->value.load(std::memory_order_acquire);
    const std::size_t k = std::min({n, static_cast<std::size_t>(head - tail), capacity_ / 4});
    if (k == 0) return 0;
    const std::size_t at = static_cast<std::size_t>(tail) & (capacity_ - 1);
    const std::size_t first = std::min(k, capacity_ - at);
    ddp::detail::bulk_copy(p, r.data + at, first);
    ddp::detail::bulk_copy(p + first, r.data, k - first);
    r.tail->value.store(tail + k, std::memory_order_release);
    return k;
  }
  bool can_push(int to) const noexcept {
    const auto r = ring(rank(), to);
    return r.head->value.load(std::memory_order_relaxed) - r.tail->value.load(std::memory_order_acquire) < capacity_;
  }
  bool can_pull(int from) const noexcept {
    const auto r = ring(from, rank());
    return r.head->value.load(std::memory_order_acquire) != r.tail->value.load(std::memory_order_relaxed);
  }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      throw error(errc::invalid_argument, "peer " + std::to_string(peer) + " is not another rank of this group of " + std::to_string(size()),
                  {.rank = group_.numbering()(rank()), .op = op});
    }
  }

  // Backs the rings this exchange uses with memory, once per ring.
  void back(int to, bool sending, int from, bool receiving, const char* op) {
    auto once = [&](int src, int dst, std::uint8_t bit, int peer) {
      auto& done = backed_[static_cast<std::size_t>(peer)];
      if ((done & bit) != 0) return;
      try {
        group_.populate(dst, ring_offset(src, dst, capacity_), ring_stride(capacity_));
      } catch (const error& e) {
        throw error(e.code(), e.message(), {.rank = group_.numbering()(rank()), .op = op});
      }
      done = static_cast<std::uint8_t>(done | bit);
    };
    if (sending) once(rank(), to, 1, to);
    if (receiving) once(from, rank(), 2, from);
  }

  void exchange(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, deadline dl, const char* op) {
    back(to, !out.empty(), from, !in.empty(), op);
    std::size_t sent = 0, got = 0;
    while (sent < out.size() || got < in.size()) {
      std::size_t moved = 0;
      if (sent < out.size()) {
        const std::size_t k = push(to, out.data() + sent, out.size() - sent);
        sent += k;
        moved += k;
      }
      if (got < in.size()) {
        const std::size_t k = pull(from, in.data() + got, in.size() - got);
        got += k;
        moved += k;
      }
      if (moved != 0) {
        group_.notify();
        continue;
      }
      group_.wait([&] { return (sent < out.size() && can_push(to)) || (got < in.size() && can_pull(from)); }, dl,
                  [&](errc code, const std::string& why) {
                    std::string what;
                    if (sent < out.size()) what += "sent " + std::to_string(sent) + " of " + std::to_string(out.size()) + " bytes to " + group_.numbering().rank(to);
                    if (got < in.size()) {
                      if (!what.empty()) what += ", ";
                      what += "received " + std::to_string(got) + " of " + std::to_string(in.size()) + " bytes from " + group_.numbering().rank(from);
                    }
                    throw error(code, why + " (" + what + ")", {.rank = group_.numbering()(rank()), .op = op});
                  },
                  [&](int r) { return (sent < out.size() && r == to) || (got < in.size() && r == from); });
    }
  }

  std::size_t capacity_;
  mutable detail::shm::shm_group group_;
  std::vector<std::uint8_t> backed_;  // by peer: 1 the ring to it is backed, 2 the ring from it
};

static_assert(ddp::transport<shm_transport>);

}  // namespace ddp
