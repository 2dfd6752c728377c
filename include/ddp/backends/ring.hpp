#pragma once
// ddp::ring_backend: collectives on host memory among processes, over shared memory when every
// rank is on this host and over TCP otherwise. Models ddp::backend, with the extended
// signatures (collective_desc + deadline) that process_group uses.
//
// Transport choice (ring_options::transport):
//   automatic  every rank publishes its host identity (hostname + /proc/sys/kernel/random/boot_id,
//              so two containers or VMs that share a hostname are told apart) in the store; all on
//              one host -> shared memory, otherwise TCP (a hierarchical shm + tcp mix is future work);
//   shm, tcp   forced (shm among ranks of different hosts is errc::config).
// A world of one needs no store (and does no communication).
//
// Over TCP the collectives are ddp::algo::ring_communicator<tcp_transport>; on shared memory
// ddp::algo::shm_communicator (direct algorithms, zero copy on group-allocated buffers).
// allocate<T>(n) returns a ring_buffer<T>: a shared_buffer every same-host rank can address
// when on shared memory (a collective call: every rank allocates, in the same order), an
// ordinary heap buffer with the same interface over TCP.
//
// Sub-groups: split(ranks, tag) builds a ring_backend over the member ranks (same store, key
// prefix <prefix>/<tag>), which is what process_group::new_group calls.

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ddp/algorithms/ring_communicator.hpp"
#include "ddp/algorithms/shm_communicator.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/host.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/shared_buffer.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/store/store.hpp"
#include "ddp/transport/shm.hpp"
#include "ddp/transport/tcp.hpp"

namespace ddp {

struct ring_options {
  enum class transport_kind : std::uint8_t { automatic, shm, tcp };
  transport_kind transport = transport_kind::automatic;
  algo::algorithm_choice algorithm = algo::algorithm_choice::automatic;  // all_reduce / reduce: by size, or forced
  std::size_t small_message_bytes = std::size_t{16} << 10;
  std::string prefix = "ddp";                              // store key prefix of this backend
  std::chrono::milliseconds timeout = default_timeout();   // set-up: host exchange and connections
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

class ring_backend {
 public:
  static constexpr memory_space memory = memory_space::host;
  static constexpr std::string_view name = "ring";

  /// Collective over the ranks: each constructs one with the same store, size and options.
  /// `store` may be null for a world of one.
  ring_backend(std::shared_ptr<store::store> store, int rank, int size, ring_options opts = {})
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
    s_->on_shm = decide_shm(setup);
    algo::ring_communicator_options co;
    co.algorithm = s_->options.algorithm;
    co.small_message_bytes = s_->options.small_message_bytes;
    co.failure_store = s_->store.get();
    co.failure_prefix = s_->options.prefix;
    if (s_->on_shm) {
      s_->shm = std::make_unique<algo::shm_communicator>(*s_->store, s_->options.prefix + "/shm/", rank, size, setup, s_->options.shm);
    } else {
      tcp_options to = s_->options.tcp;
      to.timeout = s_->options.timeout;
      s_->tcp = std::make_unique<tcp_comm>(tcp_transport(*s_->store, rank, size, s_->options.prefix + "/tcp", to), co);
    }
  }

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  /// "shm" or "tcp": what the collectives run over.
  std::string_view transport_name() const noexcept { return s_->on_shm ? "shm" : "tcp"; }
  bool on_shared_memory() const noexcept { return s_->on_shm; }
  const ring_options& options() const noexcept { return s_->options; }

  // --- the extended interface (process_group passes its fingerprint and deadline) ------------
  template <dtype_like T, reduce_op Op>
  void all_reduce(std::span<T> data, Op op, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.all_reduce(data, op, d, dl); });
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.broadcast(data, root, d, dl); });
  }
  template <dtype_like T, reduce_op Op>
  void reduce(std::span<T> data, int root, Op op, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.reduce(data, root, op, d, dl); });
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.all_gather(in, out, d, dl); });
  }
  template <dtype_like T, reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.reduce_scatter(in, out, op, d, dl); });
  }
  template <dtype_like T>
  void all_to_all(std::span<const T> in, std::span<T> out, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.all_to_all(in, out, d, dl); });
  }
  void barrier(const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.barrier(d, dl); });
  }
  template <dtype_like T>
  void send(std::span<const T> data, int peer, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.send(data, peer, d, dl); });
  }
  template <dtype_like T>
  void recv(std::span<T> data, int peer, const collective_desc& d, deadline dl) {
    with([&](auto& c) { c.recv(data, peer, d, dl); });
  }

  // --- the plain interface (used directly, without process_group): own sequence, set-up timeout
  template <dtype_like T, reduce_op Op>
  void all_reduce(std::span<T> data, Op op) {
    all_reduce(data, op, next<T>(collective::all_reduce, data.size(), Op::kind), plain_deadline());
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root) {
    broadcast(data, root, next<T>(collective::broadcast, data.size(), reduce_kind::sum, root), plain_deadline());
  }
  template <dtype_like T, reduce_op Op>
  void reduce(std::span<T> data, int root, Op op) {
    reduce(data, root, op, next<T>(collective::reduce, data.size(), Op::kind, root), plain_deadline());
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    all_gather(in, out, next<T>(collective::all_gather, in.size()), plain_deadline());
  }
  template <dtype_like T, reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    reduce_scatter(in, out, op, next<T>(collective::reduce_scatter, out.size(), Op::kind), plain_deadline());
  }
  template <dtype_like T>
  void all_to_all(std::span<const T> in, std::span<T> out) {
    all_to_all(in, out, next<T>(collective::all_to_all, in.size()), plain_deadline());
  }
  void barrier() { barrier(next<std::uint8_t>(collective::barrier, 0), plain_deadline()); }
  template <dtype_like T>
  void send(std::span<const T> data, int peer) {
    send(data, peer, next<T>(collective::send, data.size()), plain_deadline());
  }
  template <dtype_like T>
  void recv(std::span<T> data, int peer) {
    recv(data, peer, next<T>(collective::recv, data.size()), plain_deadline());
  }

  /// n zero-filled elements; shared with the same-host ranks when on shared memory. On shared
  /// memory this is collective: every rank calls it with the same n, in the same order.
  template <dtype_like T>
  ring_buffer<T> allocate(std::size_t n) {
    if (s_->shm) return ring_buffer<T>(s_->shm->template allocate<T>(n, deadline::after(s_->options.timeout)));
    return ring_buffer<T>(n);
  }

  /// Unblocks every waiter of this backend promptly; the backend is unusable afterwards.
  void abort() noexcept {
    if (s_->shm) s_->shm->abort();
    if (s_->tcp) s_->tcp->abort();
  }

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
    return ring_backend(s_->store, sub_rank, static_cast<int>(ranks.size()), o);
  }

 private:
  using tcp_comm = algo::ring_communicator<tcp_transport>;

  struct state {
    std::shared_ptr<store::store> store;
    int rank = 0;
    int size = 1;
    ring_options options;
    bool on_shm = false;
    std::unique_ptr<algo::shm_communicator> shm;
    std::unique_ptr<tcp_comm> tcp;
    std::uint64_t plain_seq = 0;
  };

  template <class F>
  void with(F&& f) {
    if (s_->shm) f(*s_->shm);
    else f(*s_->tcp);
  }

  template <class T>
  collective_desc next(collective op, std::size_t n, reduce_kind reduction = reduce_kind::sum, int root = -1) {
    return collective_desc{.seq = s_->plain_seq++, .op = op, .type = dtype_of<T>, .reduction = reduction, .root = root, .count = n};
  }
  deadline plain_deadline() const { return deadline::after(s_->options.timeout); }

  bool decide_shm(deadline setup) {
    using kind = ring_options::transport_kind;
    const auto choice = s_->options.transport;
    if (s_->size == 1) return choice != kind::tcp;
    if (choice == kind::tcp) return false;
    // Every rank publishes where it runs; all on this host -> shared memory.
    auto& st = *s_->store;
    const std::string key = s_->options.prefix + "/host/";
    const std::string mine = host_identity();
    st.set_string(key + std::to_string(s_->rank), mine);
    std::vector<std::string> keys;
    for (int r = 0; r < s_->size; ++r) keys.push_back(key + std::to_string(r));
    st.wait(keys, setup.remaining());
    int other = -1;
    std::string theirs;
    for (int r = 0; r < s_->size && other < 0; ++r) {
      std::string id = st.get_string(keys[static_cast<std::size_t>(r)]);
      if (id != mine) {
        other = r;
        theirs = std::move(id);
      }
    }
    if (other < 0) return true;
    if (choice == kind::shm) {
      throw error(errc::config,
                  "transport 'shm' needs every rank on one host, but rank " + std::to_string(other) + " runs on '" + theirs +
                      "' and this rank on '" + mine + "' (use 'ring' or 'tcp')",
                  {.rank = s_->rank, .op = "ring_backend"});
    }
    return false;
  }

  // On the heap so the backend is movable (communicators hold atomics and are not).
  std::unique_ptr<state> s_;
};

static_assert(backend<ring_backend>);
static_assert(backend_with_send_recv<ring_backend>);
static_assert(backend_with_all_to_all<ring_backend>);

}  // namespace ddp
