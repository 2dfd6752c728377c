#pragma once
// ddp::algo::ring_communicator<Transport>: every collective of the communicator interface over any
// ddp::transport (tcp_transport, the shared-memory byte-stream transport, ...), using the ring,
// small-message and pairwise algorithms of this folder.
//
// Algorithm choice (all_reduce and reduce): `automatic` uses the direct small-message algorithm
// when what a rank sends with it, (p - 1) * bytes, is at most small_message_bytes (default 64 KiB,
// where the ring's extra steps stop paying for themselves over loopback; bench/README), the ring
// otherwise; `ring` and `small_message` force one (benchmarks, tests). broadcast is a pipelined
// chain, all_gather / reduce_scatter the ring, all_to_all pairwise, barrier dissemination.
// Arguments (root, peer, counts) are the caller's to check: process_group checks every call once.
//
// Failure: any error inside a collective (mismatch, timeout, peer lost) leaves the byte streams in
// an unknown state, so the communicator aborts its transport (peers see EOF at once and fail too,
// which is how an error travels around the ring) and every later call fails with the first error.
// With options::failure_store set, a failing rank first posts a failure report under
// <failure_prefix>/failure/<rank>: the rank it blames (the root), the chain of ranks the news
// travelled through, and the cause as first seen. A rank that then loses that peer adopts the
// report and names the root first, the path after it, so every rank names the rank that
// actually died or disagreed, not the neighbour that relayed it:
//   "peer rank 1 closed the connection; seen by rank 2, relayed by rank 3".
// A store that is gone is itself news: its server's host is named (tcp_store's hosted_by).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/backends/ring/exchange.hpp"
#include "ddp/backends/ring/pairwise.hpp"
#include "ddp/backends/ring/ring_algorithms.hpp"
#include "ddp/backends/ring/small_message.hpp"
#include "ddp/backends/ring/transport/rank_numbering.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/core/function_ref.hpp"
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
  // Optional: shares ownership of failure_store, so that a store call the failure path gave up
  // on (a hung store host) may outlive the communicator; without it the destructor waits for it.
  std::shared_ptr<ddp::store::store> failure_store_owner = {};
};

namespace detail {

/// What a failing rank posts in the failure store, so that the ranks that lose it can name the
/// rank at the root of the failure rather than the messenger.
struct failure_report {
  int root = -1;           // the rank the cause blames; -1: none known (e.g. the store is gone)
  std::vector<int> chain;  // the rank that saw the cause, then each rank that relayed it
  std::string cause;       // the cause as the first rank of the chain saw it

  static constexpr std::string_view tag = "ddp-failure-v1 ";

  /// "ddp-failure-v1 <root> <chain, comma separated> <cause>"
  std::string encode() const {
    std::string out(tag);
    out += std::to_string(root) + " ";
    for (std::size_t i = 0; i < chain.size(); ++i) out += (i == 0 ? "" : ",") + std::to_string(chain[i]);
    return out + " " + cause;
  }

  /// A post of another form (an older rank, another poster) counts as the poster's own cause.
  static failure_report decode(const std::string& text, int poster) {
    failure_report r;
    if (text.starts_with(tag)) {
      const std::string_view rest = std::string_view(text).substr(tag.size());
      const auto a = rest.find(' ');
      const auto b = a == std::string_view::npos ? a : rest.find(' ', a + 1);
      if (b != std::string_view::npos) {
        try {
          r.root = std::stoi(std::string(rest.substr(0, a)));
          std::string_view list = rest.substr(a + 1, b - a - 1);
          while (!list.empty()) {
            const auto comma = list.find(',');
            r.chain.push_back(std::stoi(std::string(list.substr(0, comma))));
            list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
          }
          r.cause = std::string(rest.substr(b + 1));
          if (!r.chain.empty()) return r;
        } catch (const std::exception&) {  // malformed: fall through to the plain form
        }
      }
    }
    return failure_report{.root = poster, .chain = {poster}, .cause = text};
  }

  /// The message a rank shows: the root's cause first (the first rank it names is the root),
  /// then who saw it and who passed it on; ranks as they go by in messages (`names`).
  std::string describe(const rank_numbering& names) const {
    if (chain.empty()) return cause;
    const int seer = chain.front();
    if (chain.size() == 1) return cause;
    std::string out = root == seer ? names.rank(seer) + " failed: " + cause : cause + "; seen by " + names.rank(seer);
    // The last rank of the chain is the one describing it: the relays lie between.
    for (std::size_t i = 1; i + 1 < chain.size(); ++i) out += (i == 1 ? ", relayed by " : ", then ") + names.rank(chain[i]);
    return out;
  }
};

}  // namespace detail

/// Transport may be a transport type (owned, moved in) or an lvalue reference to one (borrowed).
template <class Transport>
  requires ddp::transport<std::remove_reference_t<Transport>>
class ring_communicator {
 public:
  using transport_type = std::remove_reference_t<Transport>;
  using options = ring_communicator_options;

  template <class U>
  explicit ring_communicator(U&& t, options o = {}) : t_(std::forward<U>(t)), o_(std::move(o)) {}
  ring_communicator(const ring_communicator&) = delete;
  ring_communicator& operator=(const ring_communicator&) = delete;
  ~ring_communicator() {
    if (store_call_.joinable()) store_call_.join();
  }

  int rank() const { return t_.rank(); }
  /// This rank's number in messages (the leaders' ring of the hierarchy names the backend's ranks).
  int named() const noexcept { return numbering_of(t_)(t_.rank()); }
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
    run(d, dl, [&] {
      if (size() == 1) return finish_local(data, op);
      if (choose(data.size_bytes()) == algorithm_choice::small_message) direct_all_reduce(t_, data, op, d, dl);
      else ring_all_reduce(t_, data, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void broadcast(std::span<E> data, int root, const collective_desc& d, deadline dl) {
    run(d, dl, [&] {
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
    run(d, dl, [&] {
      if (size() == 1) return finish_local(data, op);
      if (choose(data.size_bytes()) == algorithm_choice::small_message) direct_reduce(t_, data, root, op, d, dl);
      else ring_reduce(t_, data, root, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void all_gather(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    run(d, dl, [&] {
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
    run(d, dl, [&] {
      if (size() == 1) {
        std::copy(in.begin(), in.end(), out.begin());
        return finish_local(out, op);
      }
      ring_reduce_scatter(t_, in, out, op, d, dl, o_.tuning);
    });
  }

  template <movable_element E>
  void all_to_all(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    run(d, dl, [&] {
      if (size() == 1) return void(std::copy(in.begin(), in.end(), out.begin()));
      pairwise_all_to_all(t_, in, out, d, dl);
    });
  }

  void barrier(const collective_desc& d, deadline dl) {
    run(d, dl, [&] {
      if (size() > 1) dissemination_barrier(t_, d, dl);
    });
  }

  template <movable_element E>
  void send(std::span<const E> data, int peer, const collective_desc& d, deadline dl) {
    run(d, dl, [&] { algo::send(t_, data, peer, d, dl); });
  }

  template <movable_element E>
  void recv(std::span<E> data, int peer, const collective_desc& d, deadline dl) {
    run(d, dl, [&] { algo::recv(t_, data, peer, d, dl); });
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

  // Not a template over the body: compiled once, not once per collective x element type.
  void run(const collective_desc& d, const deadline& dl, ddp::detail::function_ref<void()> body) {
    if (!failure_.empty()) {
      throw error(errc::peer_lost, "the communicator is unusable after an earlier failure: " + failure_, d.context(named()));
    }
    if (aborted_.load(std::memory_order_acquire)) {
      throw error(errc::peer_lost, "the communicator was aborted", d.context(named()));
    }
    try {
      body();
    } catch (const error& e) {
      fail(e, d, dl);
    }
  }

  /// The longest a failure path waits for the failure store: its host may be the rank that hung.
  static constexpr std::chrono::milliseconds store_bound_max{1000};
  /// ... and at least this, so that a report reaches a healthy store even at the deadline.
  static constexpr std::chrono::milliseconds store_bound_min{100};

  [[noreturn]] void fail(const error& e, const collective_desc& d, const deadline& dl) {
    std::string message = e.message();
    if (o_.failure_store != nullptr && !aborted_.load(std::memory_order_acquire)) {
      message = exchange_reports(e, std::clamp(dl.remaining(), store_bound_min, store_bound_max)).describe(numbering_of(t_));
    }
    failure_ = message;
    t_.abort();
    throw error(e.code(), message, d.context(named()));
  }

  // What fail() and the thread that talks to the store share.
  struct report_exchange {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    detail::failure_report report;
  };

  /// Reads the lost peer's report and posts this rank's, on a thread of its own, waiting for it
  /// at most `bound`: a store whose host is stopped must not hold the failure up (its calls
  /// block until the store's own timeout). A call still blocked after `bound` is left to finish
  /// on its own; this rank then reports what it has (the lost peer's report if that was read).
  detail::failure_report exchange_reports(const error& e, std::chrono::milliseconds bound) {
    int lost = -1;
    if constexpr (requires { t_.lost_peer(); }) lost = t_.lost_peer();
    auto x = std::make_shared<report_exchange>();
    x->report = detail::failure_report{.root = e.code() == errc::peer_lost ? lost : rank(), .chain = {rank()}, .cause = e.message()};
    if (store_call_.joinable()) store_call_.join();  // an earlier failure's, left behind
    try {
      store_call_ = std::thread([x, store = o_.failure_store, owner = o_.failure_store_owner, prefix = o_.failure_prefix, me = rank(),
                                 n = size(), lost, code = e.code(), cause = e.message()] {
        (void)owner;  // held, not used: keeps the store alive while this call may outlive fail()
        const auto report = report_for(*store, prefix, me, n, lost, code, cause);
        {
          std::lock_guard lock(x->mutex);
          x->report = report;
        }
        try {
          store->set_string(failure_key(prefix, me), report.encode());
        } catch (...) {  // the store is a courtesy channel: its failure must not mask this one
        }
        std::lock_guard lock(x->mutex);
        x->done = true;
        x->done_cv.notify_all();
      });
    } catch (const std::system_error&) {  // no thread to be had: report without the store
      return x->report;
    }
    std::unique_lock lock(x->mutex);
    if (x->done_cv.wait_for(lock, bound, [&] { return x->done; })) {
      lock.unlock();
      store_call_.join();
      return x->report;
    }
    // The lost peer's report when that much was read, else this rank's own.
    auto report = x->report;
    lock.unlock();
    if (o_.failure_store_owner) store_call_.detach();  // it holds the store; the process may end first
    return report;
  }

  static std::string failure_key(const std::string& prefix, int r) { return prefix + "/failure/" + std::to_string(r); }

  /// This rank's report of its error: the lost peer's own report when it posted one (this rank
  /// joins its chain), else this rank's cause, blaming the lost peer or this rank itself.
  /// `lost`: the peer whose connection failed, -1 when unknown (then any posted report is taken).
  static detail::failure_report report_for(ddp::store::store& store, const std::string& prefix, int me, int n, int lost, errc code,
                                           const std::string& cause) {
    detail::failure_report mine{.root = me, .chain = {me}, .cause = cause};
    if (code != errc::peer_lost) return mine;
    auto posted = [&](int peer, std::chrono::milliseconds wait) {
      store.wait({failure_key(prefix, peer)}, wait);
      auto r = detail::failure_report::decode(store.get_string(failure_key(prefix, peer)), peer);
      r.chain.push_back(me);
      return r;
    };
    try {
      if (lost >= 0) {
        // The peer posts before it shuts its sockets, so the key is normally there already;
        // a peer that was killed posts nothing, and this waits only briefly.
        mine.root = lost;
        try {
          return posted(lost, std::chrono::milliseconds(10));
        } catch (const error& x) {
          if (x.code() != errc::timeout) throw;
          return mine;
        }
      }
      mine.root = -1;
      for (int k = 0; k < n; ++k) {
        if (k == me) continue;
        try {
          return posted(k, std::chrono::milliseconds(0));
        } catch (const error& x) {
          if (x.code() != errc::timeout) throw;
        }
      }
      return mine;
    } catch (const error& x) {
      // The store saw a rank die (tcp_store's departures): that rank is the root, whichever
      // neighbour this rank saw close.
      if (x.code() == errc::peer_lost) return detail::failure_report{.root = -1, .chain = {me}, .cause = x.message() + " (and " + cause + ")"};
      if (x.code() != errc::store) return mine;
      // The store's server is gone: its host died (the store says which rank that is), which
      // is the likelier root than the peer whose connection this rank saw close.
      return detail::failure_report{.root = -1, .chain = {me}, .cause = x.message() + " (and " + cause + ")"};
    } catch (...) {
      return mine;
    }
  }

  Transport t_;
  options o_;
  std::atomic<bool> aborted_{false};
  std::string failure_;
  std::thread store_call_;  // the failure path's store exchange (see exchange_reports)
};

template <class U>
ring_communicator(U&&) -> ring_communicator<std::remove_cvref_t<U>>;
template <class U>
ring_communicator(U&&, ring_communicator_options) -> ring_communicator<std::remove_cvref_t<U>>;

}  // namespace ddp::algo
