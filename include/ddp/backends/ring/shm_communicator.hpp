#pragma once
// shm_communicator: every collective for the ranks of one host, by direct shared-memory
// algorithms (see shm_direct.hpp for the layout and the fixed reduction order).
//
// Each call starts the same way: a rank writes its wire_header (and, for small calls, its data)
// into its slot for the call, then waits until every peer's slot carries the same call number,
// and checks every peer's header before it reads any data (errc::mismatch on every rank,
// describing both calls). Then, by size and buffer kind:
//  - small (a rank's payload <= options::small_bytes, 8 KiB, except all_reduce / reduce above
//    options::slot_direct_above, 256 B, up to options::slot_direct_max, 2 KiB, which take the
//    direct path below when it can hold them): the data came with the header; each rank reduces
//    / copies what it needs from the peers' slots. One flag handoff. From
//    options::small_zero_copy_bytes (1 KiB) an all-reduce / reduce also says where its buffer is,
//    and takes the zero-copy path below when every rank's is shared.
//  - zero copy (every rank's span lies in a shared_buffer from allocate()): each rank reduces
//    its 1/p slice reading the peers' buffers in place and writes the result into every
//    buffer (all_reduce) or the root's (reduce), or copies straight out of the peers' buffers
//    (broadcast, all_gather, reduce_scatter, all_to_all); one more flag handoff at the end.
//  - direct (all_reduce / reduce of ordinary memory up to options::direct_bytes / (p - 1)): each
//    rank copies its buffer into one half of its staging area (halves alternate by call) before
//    its header, and every rank that needs the result reduces every rank's copy straight into its
//    own buffer. One flag handoff, where the staged pipeline has three.
//  - staged (ordinary memory): chunks of options::chunk_bytes go through each rank's staging
//    area, `depth` chunks in flight: copy-in of chunk k+1 overlaps the peers' reduction of
//    chunk k. all_reduce: copy in the slices the peers reduce, reduce the own slice (from the
//    own buffer) into staging and the buffer, copy the peers' reduced slices out.
// send/recv go through an shm_transport (header first, checked by the receiver).
//
// Errors: a dead peer is errc::peer_lost "peer rank N (pid P) exited" within ~10 ms; a deadline
// is errc::timeout; either aborts the communicator for every rank (peers fail at once rather than
// at their own deadline). After an error the communicator refuses further calls.
// Not thread-safe: one collective at a time (abort() may be called from any thread). Arguments
// (root, peer, counts) are the caller's to check: process_group checks every call once.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ddp/backends/ring/shm_direct.hpp"
#include "ddp/backends/ring/staging_copy_choice.hpp"
#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/core/function_ref.hpp"
#include "ddp/backends/ring/streaming_copy.hpp"
#include "ddp/shared_buffer.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/shm_group.hpp"
#include "ddp/backends/ring/transport/shm.hpp"

namespace ddp::algo {

class shm_communicator {
 public:
  struct options {
    std::size_t small_bytes = 8192;          // largest per-rank payload sent with the header
    std::size_t small_zero_copy_bytes = 1024;  // small all-reduce / reduce on shared buffers from here: zero copy
    // All-reduce / reduce of more than slot_direct_above bytes, up to slot_direct_max, take the
    // direct path (when direct_bytes holds them) rather than the slots, which measured slower
    // there on one VM (bench/README): a slot's payload lies next to the header line the peers
    // poll, so their polling can pull its lines away from the writer while it fills them; the
    // direct path's copy lies apart, in staging. Above slot_direct_max another VM measured the
    // slots faster.
    std::size_t slot_direct_above = 256;
    std::size_t slot_direct_max = 2048;
    // Staging chunk for ordinary buffers. Small enough that a chunk's staging, its source and the
    // peers' copies stay in cache while the pipeline moves through a large call (bench/README).
    std::size_t chunk_bytes = 256 << 10;
    // All-reduce / reduce of ordinary buffers up to this many bytes times (p - 1): every rank
    // stages its whole buffer (in one half of its staging area) with its header, and reduces every
    // rank's staged copy straight into its own buffer. Capped at half the staging area. Up to the
    // whole half: with more ranks than CPUs the direct path's one handoff measured faster than the
    // staged pipeline's three, and with a CPU per rank the two measured level within the
    // machine's noise (bench/README).
    std::size_t direct_bytes = 512 << 10;
    // Direct copies of at least direct_spread_from bytes take turns through this many bytes of
    // their half rather than its start: a rank then writes lines its peers last read several
    // calls ago, which measured cheaper to take back than the lines they read two calls ago
    // (bench/README).
    std::size_t direct_spread_bytes = 64 << 10;
    std::size_t direct_spread_from = 2048;
    std::size_t streaming_copy_bytes = 128 << 10;  // staging chunks up to this size: streaming or ordinary stores, as measured
    int depth = 4;                           // staging chunks per rank (>= 2)
    std::size_t p2p_ring_bytes = 1 << 20;    // send/recv ring per ordered pair
    ddp::detail::shm::shm_wait_policy wait{};
  };

  /// Collective: every rank of the group constructs one with the same store, prefix and size.
  shm_communicator(ddp::store::store& st, const std::string& prefix, int rank, int size, deadline setup)
      : shm_communicator(st, prefix, rank, size, setup, options{}) {}
  /// `topology`: where the ranks run, when the caller has exchanged it (the ring backend).
  shm_communicator(ddp::store::store& st, const std::string& prefix, int rank, int size, deadline setup, options opts,
                   const rank_topology* topology = nullptr)
      : opts_(checked(opts)),
        layout_{opts_.small_bytes, opts_.chunk_bytes, opts_.depth},
        rank_(rank),
        size_(size),
        group_(st, prefix, "c", rank, size, layout_.total_bytes(), setup, opts_.wait, SIZE_MAX, topology),
        p2p_(st, prefix + "p2p/", rank, size, setup, {opts_.p2p_ring_bytes, opts_.wait}, topology),
        registry_(std::make_shared<ddp::detail::shared_registry>()) {}

  shm_communicator(const shm_communicator&) = delete;
  shm_communicator& operator=(const shm_communicator&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }

  /// Unblocks every waiter of every rank promptly (errc::peer_lost); never blocks.
  void abort() noexcept {
    group_.abort();
    p2p_.abort();
  }
  /// abort() for a failure this rank saw elsewhere (another level of the hierarchy): the peers
  /// quote `why`, so they name its cause rather than this rank.
  void abort_relaying(std::string_view why) noexcept {
    group_.abort(-1, 0, why);
    p2p_.abort();
  }
  /// abort(), naming a peer this rank sees dead as the cause: for a failure outside a
  /// collective (the rest of the set-up), so the peers name that peer, not this rank's exit.
  /// Without one, the peers quote `why`.
  void abort_noticing(std::chrono::milliseconds grace = std::chrono::milliseconds(0), std::string_view why = {}) noexcept {
    group_.abort_noticing(grace, why);
    p2p_.abort();
  }

  /// Collective allocation: every rank calls it with the same n, in the same order. The buffer
  /// is zero-filled; collectives on spans inside it read the peers' memory in place.
  template <class T>
  shared_buffer<T> allocate(std::size_t n, deadline dl) {
    static_assert(std::is_trivially_copyable_v<T>);
    collective_desc d;
    d.seq = ++allocations_;
    d.op = collective::barrier;
    if constexpr (dtype_like<T>) d.type = dtype_of<T>;
    d.count = n;
    const std::size_t bytes = std::max<std::size_t>(4096, (n * sizeof(T) + 4095) / 4096 * 4096);
    const std::string name = group_.name_base() + "-a" + std::to_string(d.seq) + "-r";
    auto a = std::make_shared<ddp::detail::shared_allocation>();
    a->id = d.seq;
    a->rank = rank_;
    a->bytes = bytes;
    a->segments.resize(static_cast<std::size_t>(size_));
    run(d, [&] {
      auto& own = a->segments[static_cast<std::size_t>(rank_)];
      own = ddp::detail::shm::shm_segment::create(name + std::to_string(rank_), bytes);
      group_.offer(static_cast<std::uint32_t>(d.seq), own.fd());
      barrier_steps(d, dl);  // every rank has created and offered its segment (and asks for the same n)
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        try {
          a->segments[static_cast<std::size_t>(r)] = group_.open_offer(r, static_cast<std::uint32_t>(d.seq), bytes, "a shared buffer");
        } catch (const error& e) {
          std::string why = e.message();
          if (e.code() == errc::peer_lost) {
            // Rank r may have exited because another rank died first: if a rank already aborted
            // the group naming a cause, that is the one to name, and rank r's exit follows from it.
            // Otherwise name rank r to every rank (an abort without a cause would name this one).
            if (const auto cause = group_.aborted() ? group_.failure() : std::nullopt) why = cause->second + " (and " + why + ")";
            else group_.abort(r, group_.pid_of(r));
          }
          throw error(e.code(), why, {.rank = named(), .op = "allocate"});
        }
      }
      barrier_steps(d, dl);  // every rank has mapped every segment
      own.close_descriptor();
    }, true);
    registry_->add(a);
    return shared_buffer<T>(std::move(a), n);
  }

  template <dtype_like E, any_reduce_op Op>
  void all_reduce(std::span<E> data, Op op, const collective_desc& desc, deadline dl) {
    const auto d = canonical(desc, dtype_of<E>, data.size(), kind_of(op));
    if (size_ == 1) return;
    reduce_erased(std::as_writable_bytes(data).data(), data.size(), shm_direct::erase_fold<E>(op), -1, d, dl);
  }

  template <dtype_like E, any_reduce_op Op>
  void reduce(std::span<E> data, int root, Op op, const collective_desc& desc, deadline dl) {
    auto d = canonical(desc, dtype_of<E>, data.size(), kind_of(op));
    d.root = root;
    if (size_ == 1) return;
    reduce_erased(std::as_writable_bytes(data).data(), data.size(), shm_direct::erase_fold<E>(op), root, d, dl);
  }

  template <movable_element E>
  void broadcast(std::span<E> data, int root, const collective_desc& desc, deadline dl) {
    auto d = canonical_moved<E>(desc, data.size());
    d.root = root;
    if (size_ == 1) return;
    run(d, [&] {
      const std::uint64_t c = ++calls_;
      const std::size_t bytes = data.size_bytes();
      if (bytes <= opts_.small_bytes) {
        publish(c, d, data.data(), rank_ == root ? bytes : 0);
        enter(c, d, dl, rank_ == root ? 0 : bytes);
        if (rank_ != root && bytes != 0) ddp::detail::bulk_copy(data.data(), peer_payload<E>(root, c, bytes), bytes);
        return;
      }
      enter_with_buffer(c, d, dl, data.data(), bytes, false);
      if (const std::byte* src = resolve(root, c, bytes)) {
        if (rank_ != root) ddp::detail::bulk_copy(data.data(), src, bytes);
        sync_all(d, dl, rank_ == root);  // the root's buffer stays untouched until every rank has read it
        return;
      }
      staged_broadcast(reinterpret_cast<std::byte*>(data.data()), bytes, root, d, dl);
    });
  }

  template <movable_element E>
  void all_gather(std::span<const E> in, std::span<E> out, const collective_desc& desc, deadline dl) {
    const auto d = canonical_moved<E>(desc, in.size());
    const std::size_t n = in.size(), bytes = in.size_bytes();
    E* own = out.data() + static_cast<std::size_t>(rank_) * n;
    if (size_ == 1) {
      if (bytes) std::memmove(own, in.data(), bytes);
      return;
    }
    run(d, [&] {
      const std::uint64_t c = ++calls_;
      if (bytes <= opts_.small_bytes) {
        publish(c, d, in.data(), bytes);
        enter(c, d, dl, bytes);
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && bytes) ddp::detail::bulk_copy(out.data() + static_cast<std::size_t>(j) * n, peer_payload<E>(j, c, bytes), bytes);
        if (bytes) std::memmove(own, in.data(), bytes);
        return;
      }
      enter_with_buffer(c, d, dl, in.data(), bytes, overlaps(in, out) && in.data() != own);
      ptrs<E> bufs(size_);
      if (zero_copy(c, bytes, bufs)) {
        for (int j = 0; j < size_; ++j)
          if (j != rank_) ddp::detail::bulk_copy(out.data() + static_cast<std::size_t>(j) * n, bufs[j], bytes);
        std::memmove(own, in.data(), bytes);
        sync_all(d, dl, true);
        return;
      }
      staged_gather(in.data(), out.data(), n, d, dl);
      std::memmove(own, in.data(), bytes);
    });
  }

  template <dtype_like E, any_reduce_op Op>
  void reduce_scatter(std::span<const E> in, std::span<E> out, Op op, const collective_desc& desc, deadline dl) {
    const auto d = canonical(desc, dtype_of<E>, out.size(), kind_of(op));
    const std::size_t n = out.size();
    if (size_ == 1) {
      if (n) std::memmove(out.data(), in.data(), out.size_bytes());
      return;
    }
    // Writing out while peers read in is safe only where out is this rank's own block of in.
    const bool out_elsewhere_in_in = overlaps(in, out) && out.data() != in.data() + static_cast<std::size_t>(rank_) * n;
    reduce_scatter_erased(std::as_bytes(in).data(), std::as_writable_bytes(out).data(), n, shm_direct::erase_fold<E>(op),
                          out_elsewhere_in_in, d, dl);
  }

  template <movable_element E>
  void all_to_all(std::span<const E> in, std::span<E> out, const collective_desc& desc, deadline dl) {
    const std::size_t n = in.size() / static_cast<std::size_t>(size_);
    const auto d = canonical_moved<E>(desc, in.size());
    if (size_ == 1) {
      if (n) std::memmove(out.data(), in.data(), in.size_bytes());
      return;
    }
    run(d, [&] {
      const std::uint64_t c = ++calls_;
      const std::size_t offset = static_cast<std::size_t>(rank_) * n, block = n * sizeof(E);
      if (in.size_bytes() <= opts_.small_bytes) {
        publish(c, d, in.data(), in.size_bytes());
        enter(c, d, dl, in.size_bytes());
        if (block == 0) return;
        std::memmove(out.data() + offset, in.data() + offset, block);
        for (int j = 0; j < size_; ++j)
          if (j != rank_) ddp::detail::bulk_copy(out.data() + static_cast<std::size_t>(j) * n, peer_payload<E>(j, c, in.size_bytes()) + offset, block);
        return;
      }
      enter_with_buffer(c, d, dl, in.data(), in.size_bytes(), overlaps(in, out));
      ptrs<E> bufs(size_);
      if (zero_copy(c, in.size_bytes(), bufs)) {
        for (int j = 0; j < size_; ++j) ddp::detail::bulk_copy(out.data() + static_cast<std::size_t>(j) * n, bufs[j] + offset, block);
        sync_all(d, dl, true);
        return;
      }
      auto* to = std::as_writable_bytes(out).data();
      staged_blocks(std::as_bytes(in).data(), n, sizeof(E), d, dl, [&](const std::byte* const* pieces, std::size_t at, std::size_t len) {
        for (int j = 0; j < size_; ++j) ddp::detail::bulk_copy(to + (static_cast<std::size_t>(j) * n + at) * sizeof(E), pieces[j], len * sizeof(E));
      });
    });
  }

  void barrier(const collective_desc& desc, deadline dl) {
    auto d = desc;
    d.count = 0;
    if (size_ == 1) return;
    run(d, [&] { barrier_steps(d, dl); });
  }

  template <movable_element E>
  void send(std::span<const E> data, int peer, const collective_desc& desc, deadline dl) {
    auto d = canonical_moved<E>(desc, data.size());
    d.op = collective::send;
    run(d, [&] {
      const auto h = wire_header::encode(d);
      try {
        p2p_.send(peer, std::as_bytes(std::span(h.bytes)), dl);
        p2p_.send(peer, std::as_bytes(data), dl);
      } catch (const error& e) {
        throw e.with_context(d.context(named()));
      }
    });
  }

  template <movable_element E>
  void recv(std::span<E> data, int peer, const collective_desc& desc, deadline dl) {
    auto d = canonical_moved<E>(desc, data.size());
    d.op = collective::recv;
    run(d, [&] {
      wire_header h;
      try {
        p2p_.recv(peer, std::as_writable_bytes(std::span(h.bytes)), dl);
      } catch (const error& e) {
        throw e.with_context(d.context(named()));
      }
      if (!h.has_magic()) {
        throw error(errc::mismatch, group_.numbering().rank(peer) + " sent data that is not a ddp message header", d.context(named()));
      }
      const auto theirs = h.decode();
      if (theirs.op != collective::send || theirs.type != d.type || theirs.count != d.count) {
        throw error(errc::mismatch, "mismatched point-to-point calls: this rank called recv (" + d.detail() + ") from " +
                                        group_.numbering().rank(peer) + ", " + group_.numbering().rank(peer) + " called " + theirs.describe(),
                    d.context(named()));
      }
      try {
        p2p_.recv(peer, std::as_writable_bytes(data), dl);
      } catch (const error& e) {
        throw e.with_context(d.context(named()));
      }
    });
  }

 private:
  using slot = shm_direct::slot;
  static constexpr std::size_t cache_line = shm_direct::cache_line;
  // Payload lines prefetched while waiting for a peer's header (see enter): up to 1 KiB, where it
  // shortened small all-reduces; more lines gained nothing at 2-8 KiB, where the fold's own
  // streaming reads overlap anyway.
  static constexpr std::size_t max_prefetch_lines = 16;
  using counter_index = shm_direct::counter_index;

  // Pointer arrays without a heap allocation for groups of up to 16 ranks.
  template <class T>
  class ptrs {
   public:
    explicit ptrs(int n) {
      if (n > 16) heap_.resize(static_cast<std::size_t>(n));
      p_ = n > 16 ? heap_.data() : local_;
    }
    T*& operator[](int i) noexcept { return p_[i]; }
    T* const* data() const noexcept { return p_; }
    T** data() noexcept { return p_; }

   private:
    T* local_[16];  // only the first n are used, each written before it is read
    std::vector<T*> heap_;
    T** p_;
  };

  static options checked(options o) {
    if (o.depth < 2) throw error(errc::invalid_argument, "shm_communicator: depth must be at least 2 (got " + std::to_string(o.depth) + ")");
    if (o.chunk_bytes < 4096 || o.chunk_bytes % 64 != 0)
      throw error(errc::invalid_argument, "shm_communicator: chunk_bytes must be a multiple of 64, at least 4096");
    o.direct_bytes = std::min(o.direct_bytes, static_cast<std::size_t>(o.depth) * o.chunk_bytes / 2);
    return o;
  }

  collective_desc canonical(const collective_desc& desc, dtype type, std::size_t count, reduce_kind kind) const {
    auto d = desc;
    d.type = type;
    d.count = count;
    if (d.has_reduction()) d.reduction = kind;
    return d;
  }
  // The description of a data-movement call on n elements of E: std::byte is a typed call moved
  // as bytes, whose caller described its own type and count.
  template <class E>
  collective_desc canonical_moved(const collective_desc& desc, std::size_t n) const {
    if constexpr (std::is_same_v<std::remove_cv_t<E>, std::byte>) return desc;
    else return canonical(desc, dtype_of<E>, n, desc.reduction);
  }
  template <class A, class B>
  static bool overlaps(std::span<A> a, std::span<B> b) noexcept {
    const auto* a0 = reinterpret_cast<const std::byte*>(a.data());
    const auto* b0 = reinterpret_cast<const std::byte*>(b.data());
    return a0 < b0 + b.size_bytes() && b0 < a0 + a.size_bytes();
  }

  // Runs one collective; any failure leaves the communicator unusable, and all but a mismatch
  // (which every rank sees for itself) abort it for the peers. Not a template over the body:
  // compiled once, not once per collective x element type.
  void run(const collective_desc& d, ddp::detail::function_ref<void()> body, bool abort_on_any = false) {
    if (failed_) {
      throw error(failed_->code(), "this communicator failed in an earlier call (" + failed_->message() + ") and cannot be used", d.context(named()));
    }
    // Allocations this call reads that are not its own buffer's (a peer passed memory of another
    // buffer) stay mapped until it returns, however the user's other threads free buffers
    // meanwhile; then they are let go (capacity kept: no allocation).
    struct release_held {
      shm_communicator& c;
      ~release_held() {
        c.own_allocation_ = nullptr;
        if (!c.held_.empty()) c.held_.clear();
      }
    } released{*this};
    try {
      body();
    } catch (const error& e) {
      failed_ = e;
      if (abort_on_any || e.code() != errc::mismatch) {
        group_.abort_noticing();
        p2p_.abort();
      }
      throw;
    }
  }

  std::byte* base(int r) const noexcept { return group_.payload(r); }
  slot* slot_of(int r, std::uint64_t c) const noexcept { return layout_.slot_at(base(r), c); }
  std::atomic<std::uint64_t>& counter(int r, counter_index i) const noexcept { return layout_.counter_at(base(r), i)->value; }
  // Where rank r's payload of `bytes` for call c is (see slot::payload: in the header line up to 24).
  template <class E>
  const E* peer_payload(int r, std::uint64_t c, std::size_t bytes) const noexcept {
    return reinterpret_cast<const E*>(slot_of(r, c)->payload(bytes));
  }
  void set(counter_index i, std::uint64_t v) noexcept {
    counter(rank_, i).store(v, std::memory_order_release);
    group_.notify();
  }

  // The descriptor, or else a payload of at most 24 bytes, goes into the header line with the
  // header: a peer spinning on this line then pays one ownership transfer for both, not one
  // each. A larger payload goes to the lines after it. Everything is written in place, in
  // whole words: building the line on the stack and copying it cost store-forwarding stalls.
  void publish(std::uint64_t c, const collective_desc& d, const void* payload, std::size_t bytes,
               const shm_direct::buffer_descriptor* descriptor = nullptr) noexcept {
    slot* s = slot_of(rank_, c);
    static_assert(offsetof(slot, descriptor) == offsetof(slot, header) + wire_header::size);
    wire_header::encode_to(d, s->header);
    own_descriptor_ = descriptor != nullptr ? *descriptor : shm_direct::buffer_descriptor{};
    if (descriptor != nullptr) std::memcpy(s->descriptor, descriptor, sizeof *descriptor);
    else if (bytes != 0 && bytes <= slot::inline_bytes) std::memcpy(s->descriptor, payload, bytes);
    if (bytes > slot::inline_bytes) ddp::detail::bulk_copy(s->payload(bytes), payload, bytes);
    s->call.store(c, std::memory_order_release);
    group_.notify();
  }

  // Waits until ready(); waits_on(r): whether ready() still depends on rank r, so that only the
  // death of such a peer fails the wait (one that did its part may finish and exit meanwhile).
  template <class Ready, class WaitsOn, class Why>
  void wait(Ready&& ready, WaitsOn&& waits_on, const collective_desc& d, deadline dl, Why&& why) {
    group_.wait(
        ready, dl, [&](errc code, const std::string& message) { throw error(code, message + " (" + why() + ")", d.context(named())); },
        waits_on);
  }

  // "rank 2" or "ranks 1, 3": the peers for which pred holds.
  template <class Pred>
  std::string ranks_where(Pred&& pred) const {
    std::vector<int> peers;
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && pred(r)) peers.push_back(r);
    return (peers.size() == 1 ? "rank " : "ranks ") + group_.numbering().list(peers);
  }
  // This rank's number in messages (a host's shared memory in the hierarchy names the backend's ranks).
  int named() const noexcept { return group_.numbering()(rank_); }

  // Waits for every peer's slot of call c, then checks every peer's header. `peer_bytes`: the
  // payload each peer sends with its header. Its lines after the header line are prefetched
  // with every look at the header, so that they travel with it rather than after it (the
  // prefetched copy is only a hint: the data is read after the header's acquire, as always).
  void enter(std::uint64_t c, const collective_desc& d, deadline dl, std::size_t peer_bytes = 0) {
    int next = 0;
    const std::size_t lines = peer_bytes > slot::inline_bytes ? std::min(max_prefetch_lines, (peer_bytes + cache_line - 1) / cache_line) : 0;
    const auto not_entered = [&](int r) { return slot_of(r, c)->call.load(std::memory_order_acquire) != c; };
    wait(
        [&] {
          for (; next < size_; ++next) {
            if (next == rank_) continue;
            const std::byte* payload = peer_payload<std::byte>(next, c, peer_bytes);
            for (std::size_t l = 0; l < lines; ++l) __builtin_prefetch(payload + l * cache_line, 0, 3);
            if (not_entered(next)) return false;
          }
          return true;
        },
        not_entered, d, dl, [&] { return "waiting for " + ranks_where(not_entered) + " to enter " + d.describe(); });
    // The usual case, every header the wire form of this rank's own call, is four word compares
    // per peer; any difference is decoded and judged field by field. Not against this rank's
    // own slot: reading back the line the peers have just read stalls on their copies of it.
    for (int j = 0; j < size_; ++j) {
      if (j == rank_ || wire_header::matches(slot_of(j, c)->header, d)) continue;
      wire_header h;
      std::memcpy(h.bytes, slot_of(j, c)->header, wire_header::size);
      check_header(h, d, named(), group_.numbering()(j));
    }
    // A peer that gave up on this call (deadline, abort) may have published its slot first.
    if (group_.aborted()) {
      const auto why = group_.failure();
      throw error(errc::peer_lost, why ? why->second : "the communicator was aborted", d.context(named()));
    }
  }

  // Waits until counter i of rank r (or of every peer, r < 0) is at least v.
  void wait_counter(counter_index i, std::uint64_t v, int r, const collective_desc& d, deadline dl, const char* what) {
    if (r >= 0) {
      wait([&] { return counter(r, i).load(std::memory_order_acquire) >= v; }, [r](int q) { return q == r; }, d, dl,
           [&] { return "waiting for " + group_.numbering().rank(r) + " to " + what; });
      return;
    }
    int next = 0;
    const auto behind = [&](int q) { return counter(q, i).load(std::memory_order_acquire) < v; };
    wait(
        [&] {
          for (; next < size_; ++next)
            if (next != rank_ && behind(next)) return false;
          return true;
        },
        behind, d, dl, [&] { return "waiting for " + ranks_where(behind) + " to " + what; });
  }

  void barrier_steps(const collective_desc& d, deadline dl) {
    const std::uint64_t c = ++calls_;
    publish(c, d, nullptr, 0);
    enter(c, d, dl);
  }

  // The end of a zero-copy call: this rank is done with the peers' buffers; `wait_all`: and
  // waits until every peer is done with this rank's.
  void sync_all(const collective_desc& d, deadline dl, bool wait_all) {
    const std::uint64_t s = ++syncs_;
    set(shm_direct::synced, s);
    if (wait_all) wait_counter(shm_direct::synced, s, -1, d, dl, "finish reading the shared buffers");
  }

  // Where this rank's buffer is. Its allocation, when shared, is remembered for the call
  // (own_allocation_) without a reference: the caller keeps its buffer alive until the call returns.
  shm_direct::buffer_descriptor describe(const void* p, std::size_t bytes, bool unsafe_overlap) {
    shm_direct::buffer_descriptor b;
    if (unsafe_overlap) return b;
    if (auto where = registry_->find_span(p, bytes)) {
      b.kind = 1;
      b.allocation = where->allocation->id;
      b.offset = where->offset;
      own_allocation_ = where->allocation;
    }
    return b;
  }

  // Publishes where this rank's buffer for call c is, then waits until every peer has published
  // the same call (headers checked): the start of every call that is not small.
  void enter_with_buffer(std::uint64_t c, const collective_desc& d, deadline dl, const void* p, std::size_t bytes, bool unsafe_overlap) {
    const auto mine = describe(p, bytes, unsafe_overlap);
    publish(c, d, nullptr, 0, &mine);
    enter(c, d, dl);
  }

  // Rank r's buffer descriptor of call c (in the header line). This rank's own is the copy kept
  // by publish(), not its slot: reading back a line just written, while its stores still wait
  // for the line to come back from the peers that read it last, stalls on store forwarding.
  shm_direct::buffer_descriptor descriptor_of(int r, std::uint64_t c) const noexcept {
    if (r == rank_) return own_descriptor_;
    shm_direct::buffer_descriptor b;
    std::memcpy(&b, slot_of(r, c)->descriptor, sizeof b);
    return b;
  }

  // Where rank r's buffer is mapped here, when it is a shared buffer; nullptr otherwise. Usually
  // every rank's buffer lies in the same collective allocation as this rank's: then no lookup.
  std::byte* resolve(int r, std::uint64_t c, std::size_t bytes) {
    const auto b = descriptor_of(r, c);
    if (b.kind != 1) return nullptr;
    const ddp::detail::shared_allocation* hold = own_allocation_ != nullptr && own_allocation_->id == b.allocation ? own_allocation_ : nullptr;
    for (const auto& a : held_)
      if (hold == nullptr && a->id == b.allocation) hold = a.get();
    if (hold == nullptr) {
      if (auto found = registry_->find(b.allocation)) {
        hold = found.get();
        held_.push_back(std::move(found));
      }
    }
    if (!hold || b.offset + bytes > hold->bytes) {
      throw error(errc::invalid_argument, group_.numbering().rank(r) + " passed memory of shared buffer #" + std::to_string(b.allocation) +
                                              ", which this rank has already freed: free shared buffers on every rank together",
                  {.rank = named()});
    }
    return hold->base(r) + b.offset;
  }

  template <class E>
  bool zero_copy(std::uint64_t c, std::size_t bytes, ptrs<E>& bufs) {
    for (int j = 0; j < size_; ++j)
      if (descriptor_of(j, c).kind != 1) return false;
    for (int j = 0; j < size_; ++j) bufs[j] = reinterpret_cast<E*>(resolve(j, c, bytes));
    return true;
  }

  // --- staged pipeline (ordinary memory) ---------------------------------------------------

  // Copies into this rank's staging area, part of a chunk of chunk_bytes. The peers read these
  // lines `depth` chunks ago; while that is little staging, their copies may still be in their
  // caches, and ordinary stores must first take every line back, which streaming stores skip.
  // Whether that beats leaving the data in cache for the readers depends on where the ranks'
  // cores sit, so for chunks up to streaming_copy_bytes the all-reduces measure it
  // (staging_copy_choice.hpp); larger chunks, whose lines the peers' caches no longer hold, take
  // ordinary stores. With more ranks than CPUs a reader often runs on this very core, whose cache
  // ordinary stores hit: ordinary stores.
  void copy_to_staging(void* dst, const void* src, std::size_t bytes, std::size_t chunk, bool streaming_chosen) const noexcept {
    copy_with(streaming_chosen && copy_choice_matters(chunk), dst, src, bytes);
  }

  static void copy_with(bool streaming, void* dst, const void* src, std::size_t bytes) noexcept {
    if (streaming) ddp::detail::streaming_copy(dst, src, bytes);
    else ddp::detail::bulk_copy(dst, src, bytes);
  }

  // Whether a call's copies into staging can be streamed at all, so that choosing matters: the
  // same on every rank (size and placement), so every rank counts the same calls of each kind.
  bool copy_choice_matters(std::size_t chunk) const noexcept { return chunk <= opts_.streaming_copy_bytes && !group_.oversubscribed(); }

  // The direct path chooses at every size it takes, up to direct_bytes: its peers read the whole
  // copy right after it is made, as they read a small staged chunk. With ordinary stores only,
  // its larger sizes slowed down most while a VM's two vCPUs sat far apart (bench/README).
  bool direct_copy_choice_matters() const noexcept { return !group_.oversubscribed(); }

  // Before writing staging chunk g: every peer has finished reading chunk g - depth.
  void wait_reuse(std::uint64_t g, const collective_desc& d, deadline dl) {
    const auto depth = static_cast<std::uint64_t>(opts_.depth);
    if (g >= depth) wait_counter(shm_direct::done, g - depth + 1, -1, d, dl, "release a staging chunk");
  }

  // The reducing collectives with the element type and op erased in f: compiled once.
  // all_reduce (root < 0) or reduce to root of n elements at data.
  void reduce_erased(std::byte* data, std::size_t n, const shm_direct::erased_fold& f, int root, const collective_desc& d, deadline dl) {
    run(d, [&] {
      const std::uint64_t c = ++calls_;
      const std::size_t es = f.element_size, bytes = n * es;
      const bool direct = (bytes > opts_.small_bytes || (bytes > opts_.slot_direct_above && bytes <= opts_.slot_direct_max)) &&
                          bytes * static_cast<std::size_t>(size_ - 1) <= opts_.direct_bytes;
      if (bytes <= opts_.small_bytes && !direct) {
        // Shared buffers of a few KiB: reducing one slice in place, with no copy into the slot,
        // beats folding the whole message from every slot from about 1 KiB (p = 2; below it the
        // slots win).
        // Each rank says where its buffer is beside the data, and copies
        // the data only when its buffer is not shared; once the headers are in, every rank sees
        // the same descriptors and makes the same choice: all shared, zero copy; none, the slots
        // of this call; a mix (rare), a second round in which every rank sends its data.
        // Only once shared buffers exist: allocate() is collective, so every rank agrees on that,
        // and a program that never allocates keeps the plain slot path (the offer costs time).
        std::uint64_t data_call = c;
        const bool reads_peers = root < 0 || rank_ == root;
        if (bytes >= opts_.small_zero_copy_bytes && bytes > slot::inline_bytes && allocations_ > 0) {
          // More ranks than CPUs: each handoff may cost a trip through the scheduler, and zero
          // copy has two to the slots' one, so such a rank offers nothing (p = 3 on 2 CPUs: 1.3-1.6x).
          const auto mine = group_.oversubscribed() ? shm_direct::buffer_descriptor{} : describe(data, bytes, false);
          publish(c, d, data, mine.kind == 1 ? 0 : bytes, &mine);
          enter(c, d, dl);
          int shared = 0;
          for (int j = 0; j < size_; ++j) shared += descriptor_of(j, c).kind == 1 ? 1 : 0;
          if (shared == size_ && reduce_zero_copy(c, n, f, root, d, dl)) return;
          if (shared != 0) {
            data_call = ++calls_;
            publish(data_call, d, data, bytes);
            enter(data_call, d, dl, reads_peers ? bytes : 0);
          }
        } else {
          publish(c, d, data, bytes);
          enter(c, d, dl, reads_peers ? bytes : 0);
        }
        if (root >= 0 && rank_ != root) return;
        ptrs<const std::byte> src(size_);
        for (int j = 0; j < size_; ++j) src[j] = j == rank_ ? data : peer_payload<std::byte>(j, data_call, bytes);
        std::byte* dst = data;
        f(src.data(), size_, &dst, 1, n);
        return;
      }
      if (direct) {
        auto way = direct_copy_choice_matters() ? direct_copy_.begin() : detail::staging_copy_choice::call{.streaming = false};
        direct_reduce(c, data, n, f, root, d, dl, way);
        direct_copy_.end(way, bytes);
        return;
      }
      enter_with_buffer(c, d, dl, data, bytes, false);
      if (reduce_zero_copy(c, n, f, root, d, dl)) return;
      const auto way = copy_choice_matters(std::min(bytes, opts_.chunk_bytes)) ? staged_copy_.begin() : detail::staging_copy_choice::call{};
      staged_reduce(data, n, f, root, d, dl, way.streaming);
      staged_copy_.end(way, bytes);
    });
  }

  // Where in half c % 2 of rank r's staging area the direct path's copy of call c lies. A rank
  // writes it before it waits for the peers' headers of call c, while they may still be in call
  // c - 1; they all entered c - 1, so none still reads any earlier copy in this half. Copies of
  // direct_spread_from bytes or more take turns through the half's first direct_spread_bytes, one
  // page-aligned place per call of this half; every rank computes the same place from c and bytes.
  std::byte* direct_area(int r, std::uint64_t c, std::size_t bytes) const noexcept {
    const std::size_t half = static_cast<std::size_t>(opts_.depth) * opts_.chunk_bytes / 2;
    std::size_t offset = 0;
    if (bytes >= opts_.direct_spread_from) {
      const std::size_t stride = (bytes + 4095) / 4096 * 4096;
      const std::size_t places = std::max<std::size_t>(1, std::min(opts_.direct_spread_bytes, half) / stride);
      offset = static_cast<std::size_t>((c >> 1) % places) * stride;
    }
    return base(r) + layout_.staging_offset() + (c & 1u) * half + offset;
  }

  // The pipelines' chunks of earlier calls may lie anywhere in staging: before the direct path
  // writes there, every peer has finished reading them (at once when the last call was not staged).
  void wait_staging_free(const collective_desc& d, deadline dl) {
    if (staging_released_ == chunks_) return;
    wait_counter(shm_direct::done, chunks_, -1, d, dl, "release a staging chunk");
    staging_released_ = chunks_;
  }

  // all_reduce / reduce of ordinary memory (see direct at the top): each rank copies its buffer
  // into its staging area (or, when it lies in a shared buffer, offers it in place) and publishes
  // its header; the next call's copy goes to the other half of staging. All shared, the zero-copy
  // path (and `way` is not timed: nothing was copied); a mix (rare), a second round, all staged.
  void direct_reduce(std::uint64_t c, std::byte* data, std::size_t n, const shm_direct::erased_fold& f, int root,
                     const collective_desc& d, deadline dl, detail::staging_copy_choice::call& way) {
    const std::size_t bytes = n * f.element_size;
    // A call that fits a slot offers its buffer as the slot path does: from small_zero_copy_bytes,
    // and not with more ranks than CPUs (zero copy's second handoff may cost a trip through the
    // scheduler).
    const bool offer = allocations_ > 0 && (bytes > opts_.small_bytes || (bytes >= opts_.small_zero_copy_bytes && !group_.oversubscribed()));
    const auto mine = offer ? describe(data, bytes, false) : shm_direct::buffer_descriptor{};
    wait_staging_free(d, dl);
    if (mine.kind != 1) copy_with(way.streaming, direct_area(rank_, c, bytes), data, bytes);
    else way.timed = false;
    publish(c, d, nullptr, 0, &mine);
    enter(c, d, dl);
    std::uint64_t data_call = c;
    if (allocations_ > 0) {
      int shared = 0;
      for (int j = 0; j < size_; ++j) shared += descriptor_of(j, c).kind == 1 ? 1 : 0;
      if (shared == size_ && reduce_zero_copy(c, n, f, root, d, dl)) return;
      if (shared != 0) {
        data_call = ++calls_;
        const shm_direct::buffer_descriptor staged{};
        way.timed = false;  // two rounds: not the time of either way of copying
        copy_with(way.streaming, direct_area(rank_, data_call, bytes), data, bytes);
        publish(data_call, d, nullptr, 0, &staged);
        enter(data_call, d, dl);
      }
    }
    if (root >= 0 && rank_ != root) return;
    ptrs<const std::byte> src(size_);
    for (int j = 0; j < size_; ++j) src[j] = j == rank_ ? data : direct_area(j, data_call, bytes);
    std::byte* dst = data;
    f(src.data(), size_, &dst, 1, n);
  }

  // How this rank walks its slice of a shared buffer it writes: even slices downwards, odd ones
  // upwards, so that neighbours start at their common boundary and walk apart (shm_direct::walk).
  shm_direct::walk own_slice_walk() const noexcept { return rank_ % 2 == 0 ? shm_direct::walk::descending : shm_direct::walk::ascending; }

  // When every rank's buffer of call c is shared: reduces this rank's slice of every buffer
  // (all_reduce) or of the root's (reduce) in place and returns true.
  bool reduce_zero_copy(std::uint64_t c, std::size_t n, const shm_direct::erased_fold& f, int root,
                        const collective_desc& d, deadline dl) {
    const std::size_t es = f.element_size;
    ptrs<std::byte> bufs(size_);
    if (!zero_copy(c, n * es, bufs)) return false;
    const std::size_t lo = shm_direct::slice_begin(n, size_, rank_, es), hi = shm_direct::slice_begin(n, size_, rank_ + 1, es);
    ptrs<const std::byte> src(size_);
    ptrs<std::byte> dst(size_);
    for (int j = 0; j < size_; ++j) {
      src[j] = bufs[j] + lo * es;
      dst[j] = bufs[j] + lo * es;
    }
    if (root < 0) f(src.data(), size_, dst.data(), size_, hi - lo, own_slice_walk());
    else f(src.data(), size_, dst.data() + root, 1, hi - lo, own_slice_walk());
    sync_all(d, dl, true);
    return true;
  }

  // reduce_scatter: in holds size() blocks of n elements, out gets block rank() reduced.
  void reduce_scatter_erased(const std::byte* in, std::byte* out, std::size_t n, const shm_direct::erased_fold& f, bool out_elsewhere_in_in,
                             const collective_desc& d, deadline dl) {
    run(d, [&] {
      const std::uint64_t c = ++calls_;
      const std::size_t es = f.element_size, in_bytes = n * es * static_cast<std::size_t>(size_);
      const std::size_t offset = static_cast<std::size_t>(rank_) * n * es;
      if (in_bytes <= opts_.small_bytes) {
        publish(c, d, in, in_bytes);
        enter(c, d, dl, in_bytes);
        ptrs<const std::byte> src(size_);
        for (int j = 0; j < size_; ++j) src[j] = (j == rank_ ? in : peer_payload<std::byte>(j, c, in_bytes)) + offset;
        f(src.data(), size_, &out, 1, n);
        return;
      }
      enter_with_buffer(c, d, dl, in, in_bytes, out_elsewhere_in_in);
      ptrs<std::byte> bufs(size_);
      if (zero_copy(c, in_bytes, bufs)) {
        ptrs<const std::byte> src(size_);
        for (int j = 0; j < size_; ++j) src[j] = bufs[j] + offset;
        f(src.data(), size_, &out, 1, n);
        sync_all(d, dl, true);
        return;
      }
      staged_blocks(in, n, es, d, dl, [&](const std::byte* const* pieces, std::size_t at, std::size_t len) {
        std::byte* dst = out + at * es;
        f(pieces, size_, &dst, 1, len);
      });
    });
  }

  void staged_reduce(std::byte* data, std::size_t n, const shm_direct::erased_fold& f, int root, const collective_desc& d, deadline dl,
                     bool streaming) {
    const std::size_t es = f.element_size;
    const std::size_t m = opts_.chunk_bytes / es;
    const std::size_t chunks = (n + m - 1) / m;
    const std::uint64_t g0 = chunks_;
    chunks_ += chunks;
    auto length = [&](std::size_t k) { return std::min(m, n - k * m); };
    auto stage = [&](int r, std::size_t k) { return layout_.staging_at(base(r), g0 + k); };
    auto own_slice = [&](std::size_t k) {
      return std::pair{shm_direct::slice_begin(length(k), size_, rank_, es), shm_direct::slice_begin(length(k), size_, rank_ + 1, es)};
    };
    // Only the slices the peers reduce are staged: this rank reads its own slice from `data`, and
    // its place in staging receives the reduced slice.
    auto copy_in = [&](std::size_t k) {
      wait_reuse(g0 + k, d, dl);
      const std::size_t len = length(k);
      const auto [lo, hi] = own_slice(k);
      std::byte* to = stage(rank_, k);
      const std::byte* from = data + k * m * es;
      copy_to_staging(to, from, lo * es, len * es, streaming);
      copy_to_staging(to + hi * es, from + hi * es, (len - hi) * es, len * es, streaming);
      set(shm_direct::arrived, g0 + k + 1);
    };
    ptrs<const std::byte> src(size_);
    copy_in(0);
    for (std::size_t k = 0; k < chunks; ++k) {
      const std::uint64_t g = g0 + k;
      const std::size_t len = length(k);
      const auto [lo, hi] = own_slice(k);
      wait_counter(shm_direct::arrived, g + 1, -1, d, dl, "stage its chunk");
      for (int j = 0; j < size_; ++j) src[j] = j == rank_ ? data + (k * m + lo) * es : stage(j, k) + lo * es;
      // The own slice goes to staging (for the peers) and straight into the result.
      const bool result_here = root < 0 || root == rank_;
      std::byte* dst[2] = {stage(rank_, k) + lo * es, data + (k * m + lo) * es};
      f(src.data(), size_, dst, result_here ? 2 : 1, hi - lo, own_slice_walk());
      set(shm_direct::reduced, g + 1);
      if (k + 1 < chunks) copy_in(k + 1);
      if (result_here) {
        wait_counter(shm_direct::reduced, g + 1, -1, d, dl, "reduce its slice");
        for (int j = 0; j < size_; ++j) {
          if (j == rank_) continue;
          const std::size_t a = shm_direct::slice_begin(len, size_, j, es), b = shm_direct::slice_begin(len, size_, j + 1, es);
          ddp::detail::bulk_copy(data + (k * m + a) * es, stage(j, k) + a * es, (b - a) * es);
        }
      }
      set(shm_direct::done, g + 1);
    }
  }

  void staged_broadcast(std::byte* data, std::size_t bytes, int root, const collective_desc& d, deadline dl) {
    const std::size_t m = opts_.chunk_bytes;
    const std::size_t chunks = (bytes + m - 1) / m;
    const std::uint64_t g0 = chunks_;
    chunks_ += chunks;
    for (std::size_t k = 0; k < chunks; ++k) {
      const std::uint64_t g = g0 + k;
      const std::size_t len = std::min(m, bytes - k * m);
      if (rank_ == root) {
        wait_reuse(g, d, dl);
        copy_to_staging(layout_.staging_at(base(rank_), g), data + k * m, len, len, staged_copy_.streaming());
        set(shm_direct::arrived, g + 1);
      } else {
        wait_counter(shm_direct::arrived, g + 1, root, d, dl, "stage its chunk");
        ddp::detail::bulk_copy(data + k * m, layout_.staging_at(base(root), g), len);
      }
      set(shm_direct::done, g + 1);
    }
  }

  template <class E>
  void staged_gather(const E* in, E* out, std::size_t n, const collective_desc& d, deadline dl) {
    const std::size_t m = opts_.chunk_bytes / sizeof(E);
    const std::size_t chunks = (n + m - 1) / m;
    const std::uint64_t g0 = chunks_;
    chunks_ += chunks;
    auto length = [&](std::size_t k) { return std::min(m, n - k * m); };
    auto stage = [&](int r, std::size_t k) { return reinterpret_cast<E*>(layout_.staging_at(base(r), g0 + k)); };
    auto copy_in = [&](std::size_t k) {
      wait_reuse(g0 + k, d, dl);
      copy_to_staging(stage(rank_, k), in + k * m, length(k) * sizeof(E), length(k) * sizeof(E), staged_copy_.streaming());
      set(shm_direct::arrived, g0 + k + 1);
    };
    copy_in(0);
    for (std::size_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) copy_in(k + 1);
      wait_counter(shm_direct::arrived, g0 + k + 1, -1, d, dl, "stage its chunk");
      for (int j = 0; j < size_; ++j)
        if (j != rank_) ddp::detail::bulk_copy(out + static_cast<std::size_t>(j) * n + k * m, stage(j, k), length(k) * sizeof(E));
      set(shm_direct::done, g0 + k + 1);
    }
  }

  // in holds size() blocks of n elements of es bytes; each chunk stages the same piece of every
  // block, and use(pieces, at, len) gets, for every rank j, rank j's piece of block rank()
  // (element offsets and counts).
  void staged_blocks(const std::byte* in, std::size_t n, std::size_t es, const collective_desc& d, deadline dl,
                     ddp::detail::function_ref<void(const std::byte* const*, std::size_t, std::size_t)> use) {
    const std::size_t piece = std::max<std::size_t>(1, opts_.chunk_bytes / es / static_cast<std::size_t>(size_));
    const std::size_t chunks = (n + piece - 1) / piece;
    const std::uint64_t g0 = chunks_;
    chunks_ += chunks;
    auto length = [&](std::size_t k) { return std::min(piece, n - k * piece); };
    auto stage = [&](int r, std::size_t k) { return layout_.staging_at(base(r), g0 + k); };
    auto copy_in = [&](std::size_t k) {
      wait_reuse(g0 + k, d, dl);
      std::byte* s = stage(rank_, k);
      for (int b = 0; b < size_; ++b)
        copy_to_staging(s + static_cast<std::size_t>(b) * piece * es, in + (static_cast<std::size_t>(b) * n + k * piece) * es, length(k) * es,
                        static_cast<std::size_t>(size_) * length(k) * es, staged_copy_.streaming());
      set(shm_direct::arrived, g0 + k + 1);
    };
    ptrs<const std::byte> src(size_);
    copy_in(0);
    for (std::size_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) copy_in(k + 1);
      wait_counter(shm_direct::arrived, g0 + k + 1, -1, d, dl, "stage its chunk");
      for (int j = 0; j < size_; ++j) src[j] = stage(j, k) + static_cast<std::size_t>(rank_) * piece * es;
      use(src.data(), k * piece, length(k));
      set(shm_direct::done, g0 + k + 1);
    }
  }

  options opts_;
  shm_direct::layout layout_;
  int rank_;
  int size_;
  mutable ddp::detail::shm::shm_group group_;
  shm_transport p2p_;
  std::shared_ptr<ddp::detail::shared_registry> registry_;
  shm_direct::buffer_descriptor own_descriptor_;                       // in this rank's latest published slot
  const ddp::detail::shared_allocation* own_allocation_ = nullptr;     // of this rank's buffer in the running call (describe)
  std::vector<std::shared_ptr<ddp::detail::shared_allocation>> held_;  // other allocations the running call reads (resolve)
  std::uint64_t calls_ = 0;        // collective calls (slot numbers), the same on every rank
  std::uint64_t chunks_ = 0;       // staged chunks so far
  std::uint64_t staging_released_ = 0;  // staged chunks every peer is known to have finished reading
  std::uint64_t syncs_ = 0;        // zero-copy end-of-call handoffs so far
  std::uint64_t allocations_ = 0;  // shared buffers allocated so far
  detail::staging_copy_choice direct_copy_;  // how the direct path's all-reduces copy in
  detail::staging_copy_choice staged_copy_;  // how staged chunks up to streaming_copy_bytes are copied in
  std::optional<error> failed_;
};

}  // namespace ddp::algo
