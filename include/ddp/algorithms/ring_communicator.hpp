#pragma once
// ddp::algo::ring_communicator<Transport>: every collective of the communicator interface over any
// ddp::transport (tcp_transport, the shared-memory byte-stream transport, ...), using the ring,
// small-message and pairwise algorithms of this folder.
//
// Algorithm choice (all_reduce and reduce): `automatic` uses the direct small-message algorithm
// when what a rank sends with it, (p - 1) * bytes, is at most small_message_bytes (default 64 KiB;
// measured at p = 2 over loopback: direct 54 us vs ring 80 us at 64 KiB, ring 2x faster at 1 MiB),
// the ring otherwise; `ring` and `small_message` force one (benchmarks,
// tests). broadcast is a pipelined chain, all_gather / reduce_scatter the ring, all_to_all pairwise,
// barrier dissemination.
//
// Failure: any error inside a collective (mismatch, timeout, peer lost) leaves the byte streams in
// an unknown state, so the communicator aborts its transport (peers see EOF at once and fail too,
// which is how an error travels around the ring) and every later call fails with the first error.
// With options::failure_store set, a failing rank first posts its error under
// <failure_prefix>/failure/<rank>; a rank that then loses that peer quotes it, so the rank that
// actually died or disagreed is named on every rank:
//   "peer rank 1 closed the connection (rank 1 reported: peer rank 0 closed the connection)".

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "ddp/algorithms/exchange.hpp"
#include "ddp/algorithms/pairwise.hpp"
#include "ddp/algorithms/ring.hpp"
#include "ddp/algorithms/small_message.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/detail/function_ref.hpp"
#include "ddp/store/store.hpp"

namespace ddp::algo {

enum class algorithm_choice : std::uint8_t { automatic, ring, small_message };

constexpr std::string_view to_string(algorithm_choice a) noexcept {
  switch (a) {
    case algorithm_choice::automatic: return "automatic";
    case algorithm_choice::ring: return "ring";
    case algorithm_choice::small_message: return "small_message";
  }
  return "unknown";
}

struct ring_communicator_options {
  algorithm_choice algorithm = algorithm_choice::automatic;
  std::size_t small_message_bytes = std::size_t{64} << 10;
  algo_options tuning{};
  ddp::store::store* failure_store = nullptr;  // optional: where failures are posted (see above)
  std::string failure_prefix = "ddp";
};

/// all_gather's and all_to_all's argument checks, in elements. A caller that moves a typed call
/// as bytes (ring_backend) checks first, so the message counts the caller's elements (and a
/// count that is no multiple of the group size cannot pass as a byte count that is one).
inline void check_all_gather_counts(std::size_t in, std::size_t out, int size, const collective_desc& d, int rank) {
  if (out != in * static_cast<std::size_t>(size)) {
    throw error(errc::invalid_argument, "all_gather: the output holds " + std::to_string(out) + " elements, expected size * input = " +
                                            std::to_string(in * static_cast<std::size_t>(size)), d.context(rank));
  }
}
inline void check_all_to_all_counts(std::size_t in, std::size_t out, int size, const collective_desc& d, int rank) {
  if (in != out || in % static_cast<std::size_t>(size) != 0) {
    throw error(errc::invalid_argument, "all_to_all: input and output must hold the same number of elements, a multiple of the group size " +
                                            std::to_string(size) + " (got " + std::to_string(in) + " and " + std::to_string(out) + ")",
                d.context(rank));
  }
}

/// Transport may be a transport type (owned, moved in) or an lvalue reference to one (borrowed).
template <class Transport>
  requires ddp::transport<std::remove_reference_t<Transport>>
class ring_communicator {
 public:
  using transport_type = std::remove_reference_t<Transport>;
  using options = ring_communicator_options;

  template <class U>
  explicit ring_communicator(U&& t, options o = {}) : t_(std::forward<U>(t)), o_(std::move(o)) {}

  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }
  transport_type& transport() noexcept { return t_; }
  const transport_type& transport() const noexcept { return t_; }
  const options& config() const noexcept { return o_; }

  /// Which algorithm all_reduce / reduce use for `bytes` per rank.
  algorithm_choice choose(std::size_t bytes) const noexcept {
    if (o_.algorithm != algorithm_choice::automatic) return o_.algorithm;
    const auto fan_out = static_cast<std::size_t>(std::max(1, size() - 1));
    return bytes <= o_.small_message_bytes / fan_out ? algorithm_choice::small_message : algorithm_choice::ring;
  }

  // ddp's own ops run as the runtime_op of their kind (builtin_reduce_op): the reducing
  // collectives compile once for the five kinds.
  template <dtype_like E, builtin_reduce_op Op>
  void all_reduce(std::span<E> data, Op, const collective_desc& d, deadline dl) {
    all_reduce(data, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void all_reduce(std::span<E> data, Op op, const collective_desc& d, deadline dl) {
    run(d, [&] {
      if (size() == 1) return finish_local(data, op);
      if (choose(data.size_bytes()) == algorithm_choice::small_message) direct_all_reduce(t_, data, op, d, dl);
      else ring_all_reduce(t_, data, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void broadcast(std::span<E> data, int root, const collective_desc& d, deadline dl) {
    check_root(root, d);
    run(d, [&] {
      if (size() > 1) chain_broadcast(t_, data, root, d, dl, o_.tuning);
    });
  }

  template <dtype_like E, builtin_reduce_op Op>
  void reduce(std::span<E> data, int root, Op, const collective_desc& d, deadline dl) {
    reduce(data, root, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce(std::span<E> data, int root, Op op, const collective_desc& d, deadline dl) {
    check_root(root, d);
    run(d, [&] {
      if (size() == 1) return finish_local(data, op);
      if (choose(data.size_bytes()) == algorithm_choice::small_message) direct_reduce(t_, data, root, op, d, dl);
      else ring_reduce(t_, data, root, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void all_gather(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    check_all_gather_counts(in.size(), out.size(), size(), d, rank());
    run(d, [&] {
      if (size() == 1) return void(std::copy(in.begin(), in.end(), out.begin()));
      ring_all_gather(t_, in, out, d, dl, o_.tuning);
    });
  }

  template <dtype_like E, builtin_reduce_op Op>
  void reduce_scatter(std::span<const E> in, std::span<E> out, Op, const collective_desc& d, deadline dl) {
    reduce_scatter(in, out, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce_scatter(std::span<const E> in, std::span<E> out, Op op, const collective_desc& d, deadline dl) {
    if (in.size() != out.size() * static_cast<std::size_t>(size())) {
      throw error(errc::invalid_argument, "reduce_scatter: the input holds " + std::to_string(in.size()) + " elements, expected size * output = " +
                                              std::to_string(out.size() * static_cast<std::size_t>(size())), d.context(rank()));
    }
    run(d, [&] {
      if (size() == 1) {
        std::copy(in.begin(), in.end(), out.begin());
        return finish_local(out, op);
      }
      ring_reduce_scatter(t_, in, out, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void all_to_all(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    check_all_to_all_counts(in.size(), out.size(), size(), d, rank());
    run(d, [&] {
      if (size() == 1) return void(std::copy(in.begin(), in.end(), out.begin()));
      pairwise_all_to_all(t_, in, out, d, dl);
    });
  }

  void barrier(const collective_desc& d, deadline dl) {
    run(d, [&] {
      if (size() > 1) dissemination_barrier(t_, d, dl);
    });
  }

  template <movable_element E>
  void send(std::span<const E> data, int peer, const collective_desc& d, deadline dl) {
    check_peer(peer, d);
    run(d, [&] { algo::send(t_, data, peer, d, dl); });
  }

  template <movable_element E>
  void recv(std::span<E> data, int peer, const collective_desc& d, deadline dl) {
    check_peer(peer, d);
    run(d, [&] { algo::recv(t_, data, peer, d, dl); });
  }

  /// Unblocks every waiter (they fail with peer_lost) and makes later calls fail. Never blocks.
  void abort() noexcept {
    aborted_.store(true, std::memory_order_release);
    t_.abort();
  }

 private:
  template <dtype_like E, any_reduce_op Op>
  static void finish_local(std::span<E> data, Op op) {
    if (kind_of(op) == reduce_kind::avg) {
      for (auto& x : data) x = narrow<E>(finish_reduction(op, widen(x), 1));
    }
  }

  void check_root(int root, const collective_desc& d) const {
    if (root < 0 || root >= size()) {
      throw error(errc::invalid_argument, "root " + std::to_string(root) + " is not a rank of this group of size " + std::to_string(size()),
                  d.context(rank()));
    }
  }
  void check_peer(int peer, const collective_desc& d) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      throw error(errc::invalid_argument, "peer " + std::to_string(peer) + " is not another rank of this group of size " + std::to_string(size()),
                  d.context(rank()));
    }
  }

  // Not a template over the body: compiled once, not once per collective x element type.
  void run(const collective_desc& d, ddp::detail::function_ref<void()> body) {
    if (!failure_.empty()) {
      throw error(errc::peer_lost, "the communicator is unusable after an earlier failure: " + failure_, d.context(rank()));
    }
    if (aborted_.load(std::memory_order_acquire)) {
      throw error(errc::peer_lost, "the communicator was aborted", d.context(rank()));
    }
    try {
      body();
    } catch (const error& e) {
      fail(e, d);
    }
  }

  [[noreturn]] void fail(const error& e, const collective_desc& d) {
    std::string message = e.message();
    if (o_.failure_store != nullptr && e.code() == errc::peer_lost && !aborted_.load(std::memory_order_acquire)) {
      message += reported_by_lost_peer();
    }
    failure_ = message;
    if (o_.failure_store != nullptr && !aborted_.load(std::memory_order_acquire)) {
      try {
        o_.failure_store->set_string(failure_key(rank()), message);
      } catch (...) {  // the store is a courtesy channel: its failure must not mask this one
      }
    }
    t_.abort();
    throw error(e.code(), message, d.context(rank()));
  }

  std::string failure_key(int r) const { return o_.failure_prefix + "/failure/" + std::to_string(r); }

  /// " (rank N reported: ...)" when the lost peer posted why it left. A transport that names
  /// the lost peer (lost_peer()) gets that peer's post; otherwise the first post found is quoted.
  std::string reported_by_lost_peer() {
    auto posted = [&](int peer, std::chrono::milliseconds wait) -> std::string {
      try {
        o_.failure_store->wait({failure_key(peer)}, wait);
        return " (rank " + std::to_string(peer) + " reported: " + o_.failure_store->get_string(failure_key(peer)) + ")";
      } catch (...) {
        return {};
      }
    };
    if constexpr (requires { t_.lost_peer(); }) {
      // The peer posts before it shuts its sockets, so the key is normally there already;
      // a peer that was killed posts nothing, and this waits only briefly.
      const int peer = t_.lost_peer();
      if (peer >= 0) return posted(peer, std::chrono::milliseconds(10));
    }
    for (int k = 0; k < size(); ++k) {
      if (k == rank()) continue;
      if (auto s = posted(k, std::chrono::milliseconds(0)); !s.empty()) return s;
    }
    return {};
  }

  Transport t_;
  options o_;
  std::atomic<bool> aborted_{false};
  std::string failure_;
};

template <class U>
ring_communicator(U&&) -> ring_communicator<std::remove_cvref_t<U>>;
template <class U>
ring_communicator(U&&, ring_communicator_options) -> ring_communicator<std::remove_cvref_t<U>>;

}  // namespace ddp::algo
