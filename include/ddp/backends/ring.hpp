#pragma once
// ddp::ring_backend: collectives on host memory among processes, over shared memory when every
// rank is on this host and over TCP otherwise. Models ddp::backend; process_group hands it each
// call as one ddp::collective_call (run()), and a user's own reduce op through the typed forms.
//
// Transport choice (ring_options::transport):
//   automatic  every rank publishes its host identity (hostname + /proc/sys/kernel/random/boot_id,
//              so two containers or VMs that share a hostname are told apart) in the store; all on
//              one host -> shared memory, otherwise TCP, flat or hierarchical (below);
//   shm, tcp   forced (shm among ranks of different hosts is errc::config; tcp is always flat).
// Hierarchy (ring_options::hierarchy, with transport automatic on several hosts):
//   automatic     hierarchical when every host has at least 2 ranks, flat otherwise;
//   flat          one TCP ring over all ranks;
//   hierarchical  all_reduce reduces within each host over shared memory, runs a TCP ring among
//                 one leader per host, and broadcasts within each host (ring/hierarchical.hpp);
//                 the other collectives use the flat TCP communicator.
//   The environment variable DDP_RING_HIERARCHY=auto|flat|hierarchical overrides `automatic`
//   (an explicit option wins). Every rank must make the same choice: ranks that disagree fail
//   with errc::config at construction, naming both choices.
// ring_options::host_identity replaces this rank's host identity in that exchange (empty: the
// real one, ddp::host_identity()): a testing hook that lets one machine pose as several hosts.
// A world of one needs no store (and does no communication).
//
// Over TCP the collectives are ddp::algo::ring_communicator<tcp_transport>; on shared memory
// ddp::algo::shm_communicator (direct algorithms, zero copy on group-allocated buffers);
// hierarchical: ddp::algo::hierarchical_communicator over both.
// allocate<T>(n) returns a ring_buffer<T>: a shared_buffer every same-host rank can address
// when on shared memory or hierarchical (a collective call: every rank allocates, in the same
// order), an ordinary heap buffer with the same interface over flat TCP.
//
// Liveness: with ring_options::heartbeat_timeout > 0 (DDP_HEARTBEAT_TIMEOUT, default 5 s) a
// thread per backend exchanges heartbeats with every peer (ring/transport/heartbeat.hpp); a
// peer silent that long, or whose visible process exits, aborts the backend, and the failing
// collective reports errc::peer_lost naming that rank, its host and what was seen, whatever
// the collective's own deadline.
//
// Sub-groups: split(ranks, tag) builds a ring_backend over the member ranks (same store, key
// prefix <prefix>/<tag>), which is what process_group::new_group calls.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/backends/ring/hierarchical.hpp"
#include "ddp/backends/ring/ring_communicator.hpp"
#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/backends/ring/transport/topology.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/host.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/shared_buffer.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/shm.hpp"
#include "ddp/backends/ring/transport/heartbeat.hpp"
#include "ddp/backends/ring/transport/tcp.hpp"

namespace ddp {

struct ring_options {
  enum class transport_kind : std::uint8_t { automatic, shm, tcp };
  enum class hierarchy_kind : std::uint8_t { automatic, flat, hierarchical };
  transport_kind transport = transport_kind::automatic;
  hierarchy_kind hierarchy = hierarchy_kind::automatic;   // on several hosts; DDP_RING_HIERARCHY when automatic
  std::string host_identity;                               // testing: this rank's host identity (empty: the real one)
  algo::algorithm_choice algorithm = algo::algorithm_choice::automatic;  // all_reduce / reduce: by size, or forced
  std::size_t small_message_bytes = std::size_t{16} << 10;
  std::string prefix = "ddp";                              // store key prefix of this backend
  std::chrono::milliseconds timeout = default_timeout();   // set-up: host exchange and connections
  std::chrono::milliseconds heartbeat_timeout = default_heartbeat_timeout();  // a silent peer fails the backend; 0: off
  tcp_options tcp{};
  algo::shm_communicator::options shm{};
};

/// Memory from ring_backend::allocate: shared with the same-host ranks (shared()) or on the heap.
template <class T>
class ring_buffer {
 public:
  using value_type = T;
  ring_buffer() = default;
  explicit ring_buffer(shared_buffer<T> b) : storage_(std::move(b)) {}
  explicit ring_buffer(std::size_t n) : storage_(std::vector<T>(n)) {}

  T* data() noexcept { return std::visit([](auto& b) { return b.data(); }, storage_); }
  const T* data() const noexcept { return std::visit([](const auto& b) { return b.data(); }, storage_); }
  std::size_t size() const noexcept { return std::visit([](const auto& b) { return b.size(); }, storage_); }
  std::size_t size_bytes() const noexcept { return size() * sizeof(T); }
  bool empty() const noexcept { return size() == 0; }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size(); }
  const T* begin() const noexcept { return data(); }
  const T* end() const noexcept { return data() + size(); }
  std::span<T> span() noexcept { return {data(), size()}; }
  std::span<const T> span() const noexcept { return {data(), size()}; }
  /// Whether the same-host ranks can address this memory (collectives on it need no copy).
  bool shared() const noexcept { return storage_.index() == 1; }

 private:
  std::variant<std::vector<T>, shared_buffer<T>> storage_;
};

constexpr std::string_view to_string(ring_options::transport_kind t) noexcept {
  switch (t) {
    case ring_options::transport_kind::automatic: return "auto";
    case ring_options::transport_kind::shm: return "shm";
    case ring_options::transport_kind::tcp: return "tcp";
  }
  return "unknown";
}

constexpr std::string_view to_string(ring_options::hierarchy_kind h) noexcept {
  switch (h) {
    case ring_options::hierarchy_kind::automatic: return "auto";
    case ring_options::hierarchy_kind::flat: return "flat";
    case ring_options::hierarchy_kind::hierarchical: return "hierarchical";
  }
  return "unknown";
}

/// DDP_RING_HIERARCHY: unset or empty -> automatic; auto, flat, hierarchical; anything else is errc::config.
inline ring_options::hierarchy_kind hierarchy_from_environment(const char* value = read_env("DDP_RING_HIERARCHY")) {
  using h = ring_options::hierarchy_kind;
  if (value == nullptr || *value == '\0') return h::automatic;
  const std::string_view v(value);
  for (auto k : {h::automatic, h::flat, h::hierarchical})
    if (v == to_string(k)) return k;
  throw error(errc::config, "DDP_RING_HIERARCHY='" + std::string(v) + "': expected auto, flat or hierarchical");
}

class ring_backend {
 public:
  static constexpr memory_space memory = memory_space::host;
  static constexpr std::string_view name = "ring";
  /// Reducing collectives take a ddp::runtime_op as well as the static ops.
  static constexpr bool runtime_reductions = true;
  /// process_group hands every call of ddp's own reductions to run() as one record ...
  static constexpr bool takes_call_records = true;
  /// ... and a user's own reduce op to these typed forms, with the fingerprint and deadline.
  static constexpr backend_capabilities capabilities{.deadlines = true, .reduce_scatter = true, .reduce = true};

  /// Collective over the ranks: each constructs one with the same store, size and options.
  /// `store` may be null for a world of one.
  ring_backend(std::shared_ptr<store::store> store, int rank, int size, ring_options opts = {})
      : ring_backend(std::move(store), rank, size, std::move(opts), nullptr) {}

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  /// "shm", "tcp" or "shm+tcp" (hierarchical): what the collectives run over.
  std::string_view transport_name() const noexcept { return s_->on_shm ? "shm" : s_->hier ? "shm+tcp" : "tcp"; }
  bool on_shared_memory() const noexcept { return s_->on_shm; }
  /// Whether all_reduce is hierarchical (shared memory within hosts, a TCP ring among leaders).
  bool hierarchical() const noexcept { return s_->hier != nullptr; }
  /// The number of hosts the ranks run on (1 on shared memory; 0 when forced to tcp, which does not look).
  int hosts() const noexcept { return s_->hosts; }
  /// Payload bytes this rank has sent over TCP so far (the flat mesh and, on a leader, the
  /// leaders' mesh); 0 on shared memory. For tests and benchmarks of the traffic.
  std::uint64_t tcp_bytes_sent() const noexcept {
    if (s_->tcp) return s_->tcp->transport().total_bytes_sent();
    if (!s_->hier) return 0;
    std::uint64_t n = s_->hier->flat().transport().total_bytes_sent();
    if (auto* l = s_->hier->leaders()) n += l->transport().total_bytes_sent();
    return n;
  }
  /// Of which over the leaders' mesh (hierarchical, on a leader; 0 otherwise).
  std::uint64_t inter_host_leader_bytes_sent() const noexcept {
    if (!s_->hier || s_->hier->leaders() == nullptr) return 0;
    return s_->hier->leaders()->transport().total_bytes_sent();
  }
  const ring_options& options() const noexcept { return s_->options; }

  /// One collective as a record (process_group has checked it; in place for all_reduce,
  /// broadcast and reduce). The data-movement collectives reach the communicators as bytes; the
  /// reducing ones as a span of their element type, the one place a record's dtype becomes a
  /// type again (the reduction loops), with the reduction as a runtime_op.
  void run(const collective_call& c, const collective_desc& d, deadline dl) {
    const std::span<const std::byte> in(static_cast<const std::byte*>(c.in), c.in_bytes());
    const std::span<std::byte> out(static_cast<std::byte*>(c.out), c.out_bytes());
    const runtime_op op{c.reduction};
    switch (c.op) {
      case collective::all_reduce:
        return visit_dtype(c.type, [&](auto tag) {
          using T = typename decltype(tag)::type;
          with(dl, [&](auto& comm) { comm.all_reduce(std::span<T>(static_cast<T*>(c.out), c.out_count), op, d, dl); });
        });
      case collective::reduce:
        return visit_dtype(c.type, [&](auto tag) {
          using T = typename decltype(tag)::type;
          with(dl, [&](auto& comm) { comm.reduce(std::span<T>(static_cast<T*>(c.out), c.out_count), c.root, op, d, dl); });
        });
      case collective::reduce_scatter:
        return visit_dtype(c.type, [&](auto tag) {
          using T = typename decltype(tag)::type;
          with(dl, [&](auto& comm) {
            comm.reduce_scatter(std::span<const T>(static_cast<const T*>(c.in), c.in_count), std::span<T>(static_cast<T*>(c.out), c.out_count), op, d, dl);
          });
        });
      case collective::broadcast: return with(dl, [&](auto& comm) { comm.broadcast(out, c.root, d, dl); });
      case collective::all_gather: return with(dl, [&](auto& comm) { comm.all_gather(in, out, d, dl); });
      case collective::all_to_all: return with(dl, [&](auto& comm) { comm.all_to_all(in, out, d, dl); });
      case collective::barrier: return with(dl, [&](auto& comm) { comm.barrier(d, dl); });
      case collective::send: return with(dl, [&](auto& comm) { comm.send(in, c.root, d, dl); });
      case collective::recv: return with(dl, [&](auto& comm) { comm.recv(out, c.root, d, dl); });
    }
    throw error(errc::unavailable, std::string(to_string(c.op)) + " is not offered by the ring backend", d.context(s_->rank));
  }

  // --- typed forms: a user's own reduce op (whose operator() must run) and direct use -------
  // ddp's own ops run as the runtime_op of their kind (builtin_reduce_op): the reducing
  // collectives compile once for the five kinds.
  template <dtype_like T, builtin_reduce_op Op>
  void all_reduce(std::span<T> data, Op, const collective_desc& d, deadline dl) {
    all_reduce(data, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like T, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void all_reduce(std::span<T> data, Op op, const collective_desc& d, deadline dl) {
    with(dl, [&](auto& c) { c.all_reduce(data, op, d, dl); });
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root, const collective_desc& d, deadline dl) {
    with(dl, [&](auto& c) { c.broadcast(std::as_writable_bytes(data), root, d, dl); });
  }
  template <dtype_like T, builtin_reduce_op Op>
  void reduce(std::span<T> data, int root, Op, const collective_desc& d, deadline dl) {
    reduce(data, root, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like T, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce(std::span<T> data, int root, Op op, const collective_desc& d, deadline dl) {
    with(dl, [&](auto& c) { c.reduce(data, root, op, d, dl); });
  }
  template <dtype_like T, builtin_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op, const collective_desc& d, deadline dl) {
    reduce_scatter(in, out, runtime_op{Op::kind}, d, dl);
  }
  template <dtype_like T, any_reduce_op Op>
    requires(!builtin_reduce_op<Op>)
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const collective_desc& d, deadline dl) {
    with(dl, [&](auto& c) { c.reduce_scatter(in, out, op, d, dl); });
  }

  // Without process_group (the ddp::backend concept): a sequence of its own, the set-up timeout.
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op) {
    all_reduce(data, op, next<T>(collective::all_reduce, data.size(), kind_of(op)), plain_deadline());
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root) {
    broadcast(data, root, next<T>(collective::broadcast, data.size(), reduce_kind::sum, root), plain_deadline());
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce(std::span<T> data, int root, Op op) {
    reduce(data, root, op, next<T>(collective::reduce, data.size(), kind_of(op), root), plain_deadline());
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    reduce_scatter(in, out, op, next<T>(collective::reduce_scatter, out.size(), kind_of(op)), plain_deadline());
  }

  /// n zero-filled elements; shared with the same-host ranks when on shared memory. On shared
  /// memory this is collective: every rank calls it with the same n, in the same order.
  template <dtype_like T>
  ring_buffer<T> allocate(std::size_t n) {
    if (s_->shm) return ring_buffer<T>(s_->shm->template allocate<T>(n, deadline::after(s_->options.timeout)));
    if (s_->hier && s_->hier->local() != nullptr)
      return ring_buffer<T>(s_->hier->template allocate<T>(n, deadline::after(s_->options.timeout)));
    return ring_buffer<T>(n);
  }

  /// Unblocks every waiter of this backend promptly; the backend is unusable afterwards.
  void abort() noexcept { s_->abort_all(); }

  /// A backend over `ranks` (sorted, containing this rank), keys under <prefix>/<tag>.
  ring_backend split(std::span<const int> ranks, const std::string& tag) const {
    int sub_rank = -1;
    for (std::size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == s_->rank) sub_rank = static_cast<int>(i);
    if (sub_rank < 0) {
      throw error(errc::invalid_argument, "ring_backend::split: this rank " + std::to_string(s_->rank) + " is not among the members",
                  {.rank = s_->rank, .op = "new_group"});
    }
    ring_options o = s_->options;
    o.prefix = s_->options.prefix + "/" + tag;
    if (ranks.size() == 1) return ring_backend(nullptr, 0, 1, o);
    const auto members = s_->topology.subset(ranks, sub_rank);
    return ring_backend(s_->store, sub_rank, static_cast<int>(ranks.size()), o, &members);
  }

 private:
  // `known`: the parent's topology of these ranks (split), so that a sub-group does not exchange it again.
  ring_backend(std::shared_ptr<store::store> store, int rank, int size, ring_options opts, const rank_topology* known)
      : s_(std::make_unique<state>()) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw error(errc::invalid_argument, "ring_backend: rank " + std::to_string(rank) + " is not in a group of size " + std::to_string(size),
                  {.rank = rank, .op = "ring_backend"});
    }
    if (!store) {
      if (size > 1) throw error(errc::invalid_argument, "ring_backend: a group of " + std::to_string(size) + " ranks needs a store", {.rank = rank});
      store = std::make_shared<store::hash_store>();  // nothing to meet: a private one
    }
    s_->store = std::move(store);
    s_->rank = rank;
    s_->size = size;
    s_->options = std::move(opts);
    const auto setup = deadline::after(s_->options.timeout);
    if (known != nullptr) {
      s_->topology = *known;
      s_->hierarchy_choice = hierarchy_from_environment(known->mine().note.c_str());  // the note is its to_string
    } else {
      exchange_topology(setup);
    }
    const auto layout = decide();
    algo::ring_communicator_options co;
    co.algorithm = s_->options.algorithm;
    co.small_message_bytes = s_->options.small_message_bytes;
    // The failure paths see the store through the heartbeat: while a peer is silent (it may be
    // the store's host) they do not wait on it.
    s_->liveness = std::make_shared<detail::heartbeat::status>();
    const auto failure_store = std::make_shared<detail::heartbeat::guarded_store>(s_->store, s_->liveness);
    co.failure_store = failure_store.get();
    co.failure_store_owner = failure_store;  // a hung store host must not hold up a failure (ring_communicator)
    co.failure_prefix = s_->options.prefix;
    tcp_options to = s_->options.tcp;
    to.timeout = s_->options.timeout;
    if (s_->on_shm) {
      s_->shm = std::make_unique<algo::shm_communicator>(*s_->store, s_->options.prefix + "/shm/", rank, size, setup, s_->options.shm, &s_->topology);
    } else if (!layout) {
      s_->tcp = std::make_unique<tcp_comm>(tcp_transport(*s_->store, rank, size, s_->options.prefix + "/tcp", to, &s_->topology), co);
    } else {
      // Built in the same order on every rank: the flat mesh (all ranks), this host's shared
      // memory (its ranks), the leaders' mesh (leaders only); no rank waits on a later step.
      auto flat = std::make_unique<tcp_comm>(tcp_transport(*s_->store, rank, size, s_->options.prefix + "/tcp", to, &s_->topology), co);
      const int host = layout->host_of[static_cast<std::size_t>(rank)];
      const auto on = layout->ranks_on(host);
      const int local_rank = layout->local_rank(rank);
      const std::string hier = s_->options.prefix + "/hier/";
      std::unique_ptr<algo::shm_communicator> local;
      if (on.size() > 1) {
        // A non-leader's wait for the broadcast spans its leader's whole inter-host ring: spin
        // briefly, then yield the core (to the leader, when they share one) instead of spinning.
        auto so = s_->options.shm;
        so.wait.spin = std::min(so.wait.spin, so.wait.spin_oversubscribed);
        const auto local_topology = s_->topology.part(on, local_rank);
        local = std::make_unique<algo::shm_communicator>(*s_->store, hier + "host" + std::to_string(host) + "/", local_rank,
                                                         static_cast<int>(on.size()), setup, so, &local_topology);
      }
      std::unique_ptr<tcp_comm> leaders;
      if (local_rank == 0) {
        algo::ring_communicator_options lo = co;
        lo.failure_prefix = hier + "leaders";
        std::vector<int> leader_ranks;
        for (int h = 0; h < layout->hosts; ++h) leader_ranks.push_back(layout->ranks_on(h).front());
        const auto leaders_topology = s_->topology.part(leader_ranks, host);
        leaders = std::make_unique<tcp_comm>(tcp_transport(*s_->store, host, layout->hosts, hier + "leaders", to, &leaders_topology), lo);
      }
      s_->hier = std::make_unique<hier_comm>(std::move(flat), std::move(local), std::move(leaders), *layout,
                                             hier_comm::options{.failure_store = failure_store.get(), .leaders_failure_prefix = hier + "leaders"});
    }
    s_->failure_store = failure_store;
    if (size > 1 && s_->options.heartbeat_timeout.count() > 0) {
      try {
        start_heartbeat(setup);
      } catch (const error& e) {
        // Peers that finished their set-up already wait in a collective on the communicators:
        // they must learn of this failure now, and of its cause (a dead peer, often the store's
        // host) rather than of this rank's exit: a dead peer on this host if one shows within
        // the grace (its sockets close before its exit shows), this failure's message if not.
        s_->abort_noticing_all(std::chrono::milliseconds(200), e.message());
        throw;
      } catch (...) {
        s_->abort_noticing_all(std::chrono::milliseconds(200), {});
        throw;
      }
    }
  }


  using tcp_comm = algo::ring_communicator<tcp_transport>;
  using hier_comm = algo::hierarchical_communicator<tcp_comm, tcp_comm>;

  struct state {
    std::shared_ptr<store::store> store;
    int rank = 0;
    int size = 1;
    ring_options options;
    bool on_shm = false;
    int hosts = 0;
    rank_topology topology;  // where every rank runs: exchanged once, handed to every layer below
    ring_options::hierarchy_kind hierarchy_choice = ring_options::hierarchy_kind::automatic;  // published with it
    std::shared_ptr<detail::heartbeat::status> liveness;  // before the communicators: they see the store through it
    std::shared_ptr<store::store> failure_store;
    std::unique_ptr<algo::shm_communicator> shm;
    std::unique_ptr<tcp_comm> tcp;
    std::unique_ptr<hier_comm> hier;
    std::uint64_t plain_seq = 0;
    std::unique_ptr<detail::heartbeat::liveness_monitor> monitor;  // last: its thread stops before the communicators go

    void abort_all() noexcept {
      if (shm) shm->abort();
      if (tcp) tcp->abort();
      if (hier) hier->abort();
    }
    // For a failure seen outside a collective: the shared-memory peers quote `why`.
    void abort_relaying_all(std::string_view why) noexcept {
      if (shm) shm->abort_relaying(why);
      if (tcp) tcp->abort();
      if (hier) hier->abort_relaying(why);
    }
    void abort_noticing_all(std::chrono::milliseconds grace, std::string_view why) noexcept {
      if (shm) shm->abort_noticing(grace, why);
      if (tcp) tcp->abort();
      if (hier) hier->abort_noticing(grace, why);
    }
  };

  // `dl`: the collective's deadline, which bounds how long a failure waits for the heartbeat's word.
  template <class F>
  void with(const deadline& dl, F&& f) {
    try {
      if (s_->shm) f(*s_->shm);
      else if (s_->hier) f(*s_->hier);
      else f(*s_->tcp);
    } catch (const error& e) {
      explain(e, dl);
      throw;
    }
  }

  // A lost peer or an abort that the heartbeat explains fails with the heartbeat's verdict: the
  // silent rank, its host and what was seen, rather than the neighbour whose connection closed.
  // Over shared memory a peer seen exited may have exited because another rank died: the store
  // knows which (a departure), or is gone with its host, the likelier cause then.
  [[gnu::cold]] [[gnu::noinline]] void explain(const error& e, const deadline& dl) const {
    if (e.code() != errc::peer_lost && e.code() != errc::timeout) return;
    if (s_->monitor) {
      // A deadline is the collective's own verdict: take the heartbeat's only when it is in.
      std::optional<std::string> verdict;
      if (e.code() == errc::timeout) {
        std::lock_guard lock(s_->liveness->mutex);
        verdict = s_->liveness->verdict;
      } else {
        verdict = s_->liveness->verdict_after_suspicion(dl.time_point());
      }
      if (verdict) throw error(errc::peer_lost, *verdict, e.context());
    }
    if (e.code() == errc::peer_lost && !s_->tcp && s_->failure_store) {
      if (const auto trouble = store::store_trouble(*s_->failure_store))
        throw error(errc::peer_lost, trouble->message() + " (and " + e.message() + ")", e.context());
    }
  }

  void start_heartbeat(deadline setup) {
    std::string host = "127.0.0.1";
    if (s_->tcp) host = detail::heartbeat::host_of_address(s_->tcp->transport().address());
    else if (s_->hier) host = detail::heartbeat::host_of_address(s_->hier->flat().transport().address());
    state* st = s_.get();
    s_->monitor = std::make_unique<detail::heartbeat::liveness_monitor>(*s_->store, s_->options.prefix, s_->rank, s_->size, s_->options.heartbeat_timeout,
                                                                host, setup, s_->topology, s_->liveness, [st](const std::string& why) { st->abort_relaying_all(why); });
  }

  template <class T>
  collective_desc next(collective op, std::size_t n, reduce_kind reduction = reduce_kind::sum, int root = -1) {
    return collective_desc{.seq = s_->plain_seq++, .op = op, .type = dtype_of<T>, .reduction = reduction, .root = root, .count = n};
  }
  deadline plain_deadline() const { return deadline::after(s_->options.timeout); }

  // Where every rank runs, with its hierarchy choice (every rank must choose the same): one
  // exchange for the whole set-up (the layout below, the transports, the heartbeat).
  void exchange_topology(deadline setup) {
    using kind = ring_options::transport_kind;
    using hier = ring_options::hierarchy_kind;
    s_->hierarchy_choice = s_->options.hierarchy;
    if (s_->size > 1 && s_->hierarchy_choice == hier::automatic && s_->options.transport == kind::automatic)
      s_->hierarchy_choice = hierarchy_from_environment();
    s_->topology = rank_topology::exchange(*s_->store, s_->options.prefix + "/topology/", s_->rank, s_->size, setup,
                                           std::string(to_string(s_->hierarchy_choice)), s_->options.host_identity);
  }

  // Sets on_shm and hosts; returns the host layout when all_reduce is to be hierarchical.
  std::optional<algo::host_layout> decide() {
    using kind = ring_options::transport_kind;
    using hier = ring_options::hierarchy_kind;
    const auto choice = s_->options.transport;
    const auto hierarchy = s_->hierarchy_choice;  // options.hierarchy, or DDP_RING_HIERARCHY's under 'auto'
    const error_context here{.rank = s_->rank, .op = "ring_backend"};
    if (hierarchy == hier::hierarchical && choice != kind::automatic) {
      throw error(errc::config, "hierarchy 'hierarchical' needs transport 'auto' (it mixes shm and tcp), not '" + std::string(to_string(choice)) + "'",
                  here);
    }
    if (s_->size == 1) {
      s_->hosts = 1;
      s_->on_shm = choice != kind::tcp;
      return std::nullopt;
    }
    if (choice == kind::tcp) return std::nullopt;
    // Every rank published its choice with where it runs (exchange_topology).
    std::vector<std::string> ids;
    for (int r = 0; r < s_->size; ++r) {
      const auto& place = s_->topology.of(r);
      if (place.note != to_string(hierarchy)) {
        throw error(errc::config, "ranks disagree on the hierarchy: rank " + std::to_string(r) + " chose '" + place.note + "', this rank '" +
                                      std::string(to_string(hierarchy)) + "' (ring_options::hierarchy or DDP_RING_HIERARCHY)", here);
      }
      ids.push_back(place.layout_identity);
    }
    const std::string& mine = s_->topology.mine().layout_identity;
    auto layout = algo::host_layout::from_identities(ids);
    s_->hosts = layout.hosts;
    log_containers(ids, mine);
    if (layout.hosts == 1) {
      s_->on_shm = true;
      return std::nullopt;
    }
    if (choice == kind::shm) {
      const auto other = std::find_if(ids.begin(), ids.end(), [&](const std::string& id) { return id != mine; });
      throw error(errc::config,
                  "transport 'shm' needs every rank on one host, but rank " + std::to_string(other - ids.begin()) + " runs on '" + *other +
                      "' and this rank on '" + mine + "' (use 'ring' or 'tcp')",
                  here);
    }
    const bool hierarchical = hierarchy == hier::hierarchical || (hierarchy == hier::automatic && layout.worth_a_hierarchy());
    if (!hierarchical) return std::nullopt;
    return layout;
  }

  // Ranks on one machine that cannot share memory (containers with host networking but their
  // own /dev/shm or PID namespace) count as separate hosts; say so once, from the lowest such rank.
  void log_containers(const std::vector<std::string>& ids, const std::string& mine) const {
    std::string apart;
    int first = -1;
    for (int r = 0; r < s_->size; ++r) {
      const auto& id = ids[static_cast<std::size_t>(r)];
      if (id != mine && machine_of(id) == machine_of(mine)) {
        apart += (apart.empty() ? "" : ",") + std::to_string(r);
        if (first < 0) first = r;
      }
    }
    if (apart.empty() || first < s_->rank) return;  // the lower rank of such a pair reports
    std::fprintf(stderr,
                 "ddp: rank %d: ranks %s run on this machine (%s) but do not share its /dev/shm or PID namespace "
                 "(containers?): using tcp between them\n",
                 s_->rank, apart.c_str(), machine_of(mine).c_str());
  }

  // On the heap so the backend is movable (communicators hold atomics and are not).
  std::unique_ptr<state> s_;
};

static_assert(backend<ring_backend>);

}  // namespace ddp
