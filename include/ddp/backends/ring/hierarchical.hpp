#pragma once
// ddp::algo::hierarchical_communicator: the communicator interface for a world that spans several
// hosts with several ranks each. all_reduce is composed of three levels:
//   1. the ranks of each host reduce to their host's leader (its lowest rank) through shared
//      memory (shm_communicator over the host's ranks);
//   2. the h leaders all-reduce over TCP (a ring_communicator over a tcp mesh of the leaders
//      only, leader index = host index), so each leader sends about 2 (h - 1) / h of the buffer
//      across the network instead of every rank sending 2 (p - 1) / p of it;
//   3. each leader broadcasts the result to its host's ranks through shared memory.
// Every other collective (and reduce, whose root need not be a leader) goes to the flat
// communicator over all p ranks, so rank numbers, roots and peers keep their meaning.
//
// avg combines as sum at every level and is finished (divided by p) once, by the leaders.
// float16 / bfloat16 partial sums are rounded to the element type between the levels (two
// roundings where the flat ring has one); integer results are exact as on the flat ring.
//
// Failure: any error on any level (peer lost, timeout, mismatch) aborts all three levels on this
// rank, so the failure travels: a dead rank is seen by its host's ranks through shared memory
// (its pid watch), its leader aborts the leaders' mesh, the other leaders see EOF at once and
// abort their hosts' shared memory, quoting the cause to their host's ranks. Every rank fails
// with the first error it saw, with a note saying on which level it happened; later calls fail
// at once. Each level's ranks go by the backend's numbers in messages (its topology is a
// rank_topology::part of the backend's), so every error names ranks the user knows. A failed
// allocate() aborts every level as well. Headers (sequence, collective, dtype, count, reduction)
// are checked on both levels. A rank that calls a different collective from its peers takes a
// different path (flat versus hierarchical), so it is not always told "mismatch": it may instead
// reach the deadline (errc::timeout), as process_group's watchdog enforces.
// Not thread-safe: one collective at a time; abort() may be called from any thread.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/backends/ring/exchange.hpp"
#include "ddp/backends/ring/ring_communicator.hpp"
#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/backends/ring/transport/rank_numbering.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/core/function_ref.hpp"
#include "ddp/store/store.hpp"

namespace ddp::algo {

/// Which host each rank of a group runs on: host indices in order of first appearance (the host
/// of rank 0 is host 0), from the identity strings the ranks published.
struct host_layout {
  std::vector<int> host_of;  // host index of every rank
  int hosts = 0;

  static host_layout from_identities(const std::vector<std::string>& ids) {
    host_layout l;
    std::vector<const std::string*> seen;
    for (const auto& id : ids) {
      auto it = std::find_if(seen.begin(), seen.end(), [&](const std::string* s) { return *s == id; });
      if (it == seen.end()) {
        l.host_of.push_back(static_cast<int>(seen.size()));
        seen.push_back(&id);
      } else {
        l.host_of.push_back(static_cast<int>(it - seen.begin()));
      }
    }
    l.hosts = static_cast<int>(seen.size());
    return l;
  }
  int size() const noexcept { return static_cast<int>(host_of.size()); }
  /// The ranks on host h, ascending.
  std::vector<int> ranks_on(int h) const {
    std::vector<int> r;
    for (int k = 0; k < size(); ++k)
      if (host_of[static_cast<std::size_t>(k)] == h) r.push_back(k);
    return r;
  }
  int local_rank(int rank) const {
    const auto on = ranks_on(host_of[static_cast<std::size_t>(rank)]);
    return static_cast<int>(std::find(on.begin(), on.end(), rank) - on.begin());
  }
  int smallest_host() const {
    std::size_t m = host_of.size();
    for (int h = 0; h < hosts; ++h) m = std::min(m, ranks_on(h).size());
    return static_cast<int>(m);
  }
  /// Several hosts, every one with several ranks: where the hierarchy pays.
  bool worth_a_hierarchy() const { return hosts >= 2 && smallest_host() >= 2; }
};

/// Flat: the communicator over every rank (ring_communicator<tcp_transport>); Inter: the one over
/// the hosts' leaders (the same type, over a mesh of the leaders only).
template <class Flat, class Inter>
class hierarchical_communicator {
 public:
  struct options {
    // Optional: where a leader posts a failure of its host (as ring_communicator does, under
    // <leaders_failure_prefix>/failure/<host>), so the other leaders quote it when they lose it.
    ddp::store::store* failure_store = nullptr;
    std::string leaders_failure_prefix;
  };

  /// `local` may be null for a host with one rank; `leaders` is null on every rank but the leaders.
  hierarchical_communicator(std::unique_ptr<Flat> flat, std::unique_ptr<shm_communicator> local, std::unique_ptr<Inter> leaders,
                            host_layout layout, options o = {})
      : flat_(std::move(flat)), local_(std::move(local)), leaders_(std::move(leaders)), layout_(std::move(layout)), o_(std::move(o)) {
    const int host = layout_.host_of[static_cast<std::size_t>(flat_->rank())];
    const auto on = layout_.ranks_on(host);
    local_note_ = " [on the shared-memory level of host " + std::to_string(host) + ": ranks " + rank_numbering{}.list(on) + "]";
    std::vector<int> leads;
    for (int h = 0; h < layout_.hosts; ++h) leads.push_back(layout_.ranks_on(h).front());
    leader_note_ = " [on the inter-host level: the hosts' leaders, ranks " + rank_numbering{}.list(leads) + "]";
  }
  hierarchical_communicator(const hierarchical_communicator&) = delete;
  hierarchical_communicator& operator=(const hierarchical_communicator&) = delete;

  int rank() const { return flat_->rank(); }
  int size() const { return flat_->size(); }
  int hosts() const noexcept { return layout_.hosts; }
  const host_layout& layout() const noexcept { return layout_; }
  bool leader() const noexcept { return leaders_ != nullptr; }
  Flat& flat() noexcept { return *flat_; }
  shm_communicator* local() noexcept { return local_.get(); }
  /// The leaders' communicator (null unless this rank leads its host).
  Inter* leaders() noexcept { return leaders_.get(); }

  // ddp's own ops run as the runtime_op of their kind (builtin_reduce_op): the reducing
  // collectives compile once for the five kinds.
  template <dtype_like E, builtin_reduce_op Op>
  void all_reduce(std::span<E> data, Op, const collective_desc& d, deadline dl) {
    all_reduce(data, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void all_reduce(std::span<E> data, Op op, const collective_desc& d, deadline dl) {
    // avg combines as sum on both levels; the leaders divide once, by the world size.
    const bool average = kind_of(op) == reduce_kind::avg;
    const auto c = combining(op);
    guard(&d, [&] {
      if (local_) level(local_note_, [&] { local_->reduce(data, 0, c, d, dl); });
      if (leaders_) {
        level(leader_note_, [&] { leaders_->all_reduce(data, c, d, dl); });
        if (average) {
          for (auto& x : data) x = narrow<E>(finish_reduction(op, widen(x), size()));
        }
      }
      if (local_) level(local_note_, [&] { local_->broadcast(data, 0, d, dl); });
    });
  }

  template <movable_element E>
  void broadcast(std::span<E> data, int root, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->broadcast(data, root, d, dl); });
  }
  template <dtype_like E, builtin_reduce_op Op>
  void reduce(std::span<E> data, int root, Op, const collective_desc& d, deadline dl) {
    reduce(data, root, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce(std::span<E> data, int root, Op op, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->reduce(data, root, op, d, dl); });
  }
  template <movable_element E>
  void all_gather(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->all_gather(in, out, d, dl); });
  }
  template <dtype_like E, builtin_reduce_op Op>
  void reduce_scatter(std::span<const E> in, std::span<E> out, Op, const collective_desc& d, deadline dl) {
    reduce_scatter(in, out, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like E, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce_scatter(std::span<const E> in, std::span<E> out, Op op, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->reduce_scatter(in, out, op, d, dl); });
  }
  template <movable_element E>
  void all_to_all(std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->all_to_all(in, out, d, dl); });
  }
  void barrier(const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->barrier(d, dl); });
  }
  template <movable_element E>
  void send(std::span<const E> data, int peer, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->send(data, peer, d, dl); });
  }
  template <movable_element E>
  void recv(std::span<E> data, int peer, const collective_desc& d, deadline dl) {
    guard(&d, [&] { flat_->recv(data, peer, d, dl); });
  }

  /// A buffer in this host's shared memory (shm_communicator::allocate; collective over the
  /// host's ranks). Requires local() (a host with several ranks).
  template <class T>
  shared_buffer<T> allocate(std::size_t n, deadline dl) {
    std::optional<shared_buffer<T>> out;
    guard(nullptr, [&] { level(local_note_, [&] { out.emplace(local_->template allocate<T>(n, dl)); }); });
    return std::move(*out);
  }

  /// Unblocks every waiter on every level (they fail with peer_lost); never blocks.
  void abort() noexcept {
    flat_->abort();
    if (local_) local_->abort();
    if (leaders_) leaders_->abort();
  }
  /// abort(), this host's other ranks quoting `why`: a failure this rank saw outside its
  /// collectives (the heartbeat's verdict).
  void abort_relaying(std::string_view why) noexcept {
    flat_->abort();
    if (local_) local_->abort_relaying(why);
    if (leaders_) leaders_->abort();
  }
  /// abort(), this host's shared memory naming a peer this rank sees dead, or quoting `why`
  /// without one (shm_communicator).
  void abort_noticing(std::chrono::milliseconds grace = std::chrono::milliseconds(0), std::string_view why = {}) noexcept {
    flat_->abort();
    if (local_) local_->abort_noticing(grace, why);
    if (leaders_) leaders_->abort();
  }

 private:
  // The op both levels combine with: sum for avg (divided once at the end), the op otherwise.
  template <any_reduce_op Op>
  static auto combining(Op op) noexcept {
    if constexpr (std::is_same_v<Op, runtime_op>) {
      return runtime_op{op.kind == reduce_kind::avg ? reduce_kind::sum : op.kind};
    } else {
      return std::conditional_t<Op::kind == reduce_kind::avg, ddp::sum, Op>{};
    }
  }

  // Runs one level; its error gets the level's note (its rank numbers are that level's).
  void level(const std::string& note, ddp::detail::function_ref<void()> body) {
    try {
      body();
    } catch (const error& e) {
      throw error(e.code(), e.message() + note, e.context());
    }
  }

  // One collective (or allocation, d null): the first error aborts every level, is kept, and is
  // rethrown as the call's; later calls fail at once. Not a template over the body: compiled
  // once, not once per collective x element type.
  void guard(const collective_desc* d, ddp::detail::function_ref<void()> body) {
    if (failed_) {
      throw error(failed_->first == errc::mismatch ? errc::mismatch : errc::peer_lost,
                  "the communicator is unusable after an earlier failure: " + failed_->second,
                  d != nullptr ? d->context(rank()) : error_context{.rank = rank(), .op = "allocate"});
    }
    try {
      body();
    } catch (const error& e) {
      failed_.emplace(e.code(), e.message());
      if (leaders_ && o_.failure_store != nullptr) {
        // Before the abort: the other leaders see EOF from this one and look for this post. A
        // lost peer is named in the message (often a rank of this host, no leader), so the
        // report blames no leader: the others quote the cause, seen by this leader.
        const int me = leaders_->rank();
        const detail::failure_report report{.root = e.code() == errc::peer_lost ? -1 : me, .chain = {me}, .cause = e.message()};
        const std::string key = o_.leaders_failure_prefix + "/failure/" + std::to_string(me);
        try {
          o_.failure_store->set_string(key, report.encode());
        } catch (...) {  // a courtesy channel: its failure must not mask this one
        }
      }
      // Every level; this host's other ranks quote the cause (they would otherwise see only
      // that this rank aborted their shared memory).
      flat_->abort();
      if (local_) local_->abort_relaying(e.message());
      if (leaders_) leaders_->abort();
      throw error(e.code(), e.message(), d != nullptr ? d->context(rank()) : e.context());
    }
  }

  std::unique_ptr<Flat> flat_;
  std::unique_ptr<shm_communicator> local_;
  std::unique_ptr<Inter> leaders_;
  host_layout layout_;
  options o_;
  std::string local_note_, leader_note_;
  std::optional<std::pair<errc, std::string>> failed_;
};

}  // namespace ddp::algo
