#pragma once
// clang reports each DDP_ELEMENTWISE_LOOP it cannot vectorize (-Wpass-failed, on by default, and an
// error under -Werror in a consumer's build); the scalar loop is correct, so the report is noise.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wpass-failed"
#endif
// Building blocks of the direct shared-memory algorithms (used by shm_communicator):
// the per-rank control layout, the partition of a buffer into per-rank slices, and the
// reduction kernel.
//
// The reduction order is fixed: element i of a reduction over p ranks is
//   finish(op(...op(op(x_0[i], x_1[i]), x_2[i])..., x_{p-1}[i]), p)
// computed in accumulate_t<E> (float for float16/bfloat16) and converted to E once. Every rank
// computes an element the same way (or reads the one rank that computed it), so results are
// bit-identical on all ranks, whichever path (small, staged, zero-copy) a call takes.
//
// Per-rank control layout, in that rank's segment (written only by its owner):
//   slot[2]      one per call parity, header line: u64 call number | 32-byte wire_header |
//                24 bytes that hold the buffer descriptor (where the rank's buffer is: staging,
//                or a shared_buffer allocation + offset) or, in a call without one, a payload of
//                at most 24 bytes; then the payload of a small collective, from the next line.
//                A slot is valid for call c only when its call number is c: stale slots are
//                never mistaken for new ones. Two slots suffice because no rank can enter
//                call c + 2 before every rank has entered call c + 1 (each call starts with
//                every rank waiting for every other's slot).
//   counters     monotonic, each on its own cache line: arrived / reduced / done chunk totals of
//                the staged pipeline and the sync count of the zero-copy path.
//   staging      `depth` chunks of `chunk_bytes` for user buffers.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/backends/ring/elementwise.hpp"
#include "ddp/backends/ring/transport/shm_segment.hpp"

namespace ddp::algo::shm_direct {

inline constexpr std::size_t cache_line = ddp::detail::shm::cache_line;

/// Where a rank's buffer for a call is: peers read it in place when every buffer is shared.
struct buffer_descriptor {
  std::uint32_t kind = 0;  // 0: ordinary memory (goes through staging), 1: shared_buffer
  std::uint32_t reserved = 0;
  std::uint64_t allocation = 0;
  std::uint64_t offset = 0;  // bytes from the start of the rank's own segment of the allocation
};
static_assert(sizeof(buffer_descriptor) == 24);

struct slot {
  static constexpr std::size_t payload_offset = 64;  // call (8) + header (32) + descriptor (24): one cache line
  static constexpr std::size_t inline_bytes = sizeof(buffer_descriptor);
  std::atomic<std::uint64_t> call;
  unsigned char header[wire_header::size];
  // In the line the peers read for the header anyway, so one ownership transfer brings both:
  // where the rank's buffer is, or a payload of at most inline_bytes (a call with no descriptor).
  unsigned char descriptor[sizeof(buffer_descriptor)];
  // a larger payload follows, on its own cache line
  std::byte* payload(std::size_t bytes) noexcept {
    return bytes <= inline_bytes ? reinterpret_cast<std::byte*>(descriptor) : reinterpret_cast<std::byte*>(this) + payload_offset;
  }
  const std::byte* payload(std::size_t bytes) const noexcept { return const_cast<slot*>(this)->payload(bytes); }
};
static_assert(offsetof(slot, header) == 8);
static_assert(offsetof(slot, descriptor) + sizeof(buffer_descriptor) == slot::payload_offset);

struct alignas(cache_line) counter_line {
  std::atomic<std::uint64_t> value;
};

enum counter_index { arrived = 0, reduced = 1, done = 2, synced = 3, counter_count = 4 };

/// Offsets in a rank's payload area.
struct layout {
  std::size_t small_bytes;  // payload capacity of a slot
  std::size_t chunk_bytes;
  int depth;
  std::size_t slot_bytes() const noexcept { return (slot::payload_offset + small_bytes + cache_line - 1) / cache_line * cache_line; }
  std::size_t counters_offset() const noexcept { return 2 * slot_bytes(); }
  std::size_t staging_offset() const noexcept {
    return (counters_offset() + counter_count * sizeof(counter_line) + 4095) / 4096 * 4096;
  }
  std::size_t total_bytes() const noexcept { return staging_offset() + static_cast<std::size_t>(depth) * chunk_bytes; }

  slot* slot_at(std::byte* base, std::uint64_t call) const noexcept {
    return reinterpret_cast<slot*>(base + (call & 1u) * slot_bytes());
  }
  counter_line* counter_at(std::byte* base, counter_index i) const noexcept {
    return reinterpret_cast<counter_line*>(base + counters_offset()) + i;
  }
  std::byte* staging_at(std::byte* base, std::uint64_t chunk) const noexcept {
    return base + staging_offset() + static_cast<std::size_t>(chunk % static_cast<std::uint64_t>(depth)) * chunk_bytes;
  }
};

/// Start of rank r's slice of n elements of `element_size` bytes split p ways, on cache-line
/// boundaries so that ranks writing neighbouring slices never share a line.
constexpr std::size_t slice_begin(std::size_t n, int p, int r, std::size_t element_size) noexcept {
  const std::size_t align = std::max<std::size_t>(1, cache_line / element_size);
  const std::size_t units = (n + align - 1) / align;
  return std::min(n, units * static_cast<std::size_t>(r) / static_cast<std::size_t>(p) * align);
}

template <class E>
inline accumulate_t<E> to_acc(E x) noexcept {
  if constexpr (half_precision<E>) return static_cast<float>(x);
  else return x;
}
template <class E>
inline E from_acc(accumulate_t<E> x) noexcept {
  if constexpr (half_precision<E>) return E(x);
  else return static_cast<E>(x);
}

// Element k of a pass over m elements: index k going up, m - 1 - k going down (the compiler
// vectorizes both alike).
template <bool Down>
constexpr std::size_t pass_index(std::size_t k, std::size_t m) noexcept {
  return Down ? m - 1 - k : k;
}

// The pass over the last source: v = op(acc[i], last[i]) (finished for avg) stored into d0 and,
// when not null, d1. acc is the partial result of the earlier sources, or source 0 itself.
template <bool Down, class E, class Acc, class Op>
void fold_last_source(const Acc* acc, const E* last, E* d0, E* d1, std::size_t m, int p, Op op) noexcept {
  auto value = [&](std::size_t i) {
    auto v = op(to_acc(acc[i]), to_acc(last[i]));
    if constexpr (Op::kind == reduce_kind::avg) v = op.finish(v, p);
    return from_acc<E>(v);
  };
  if (d1 != nullptr) {
    DDP_ELEMENTWISE_LOOP
    for (std::size_t k = 0; k < m; ++k) {
      const std::size_t i = pass_index<Down>(k, m);
      const E v = value(i);
      d0[i] = v;
      d1[i] = v;
    }
  } else {
    DDP_ELEMENTWISE_LOOP
    for (std::size_t k = 0; k < m; ++k) {
      const std::size_t i = pass_index<Down>(k, m);
      d0[i] = value(i);
    }
  }
}

// fold() over one block of m elements from i0, with a static op. The buffers are E arrays passed
// as bytes (see erased_fold). Sources 0 .. p - 2 are combined in a local buffer (not at all for
// p = 2), and the pass over the last source writes the first two destinations directly; further
// destinations copy the first. So p = 2 into 2 destinations reads each source and writes each
// destination once, like a hand-written loop.
template <bool Down, class E, class Op>
void fold_block(const std::byte* const* srcs, int p, std::byte* const* dsts, int ndst, std::size_t i0, std::size_t m, Op op,
                accumulate_t<E>* tmp) noexcept {
  using A = accumulate_t<E>;
  auto src = [&](int j) { return reinterpret_cast<const E*>(srcs[j]) + i0; };
  auto dst = [&](int d) { return reinterpret_cast<E*>(dsts[d]) + i0; };
  E* const d0 = dst(0);
  E* const d1 = ndst > 1 ? dst(1) : nullptr;
  if (p == 1) {
    const E* s = src(0);
    for (std::size_t k = 0; k < m; ++k) {
      const std::size_t i = pass_index<Down>(k, m);
      A v = to_acc(s[i]);
      if constexpr (Op::kind == reduce_kind::avg) v = op.finish(v, p);
      d0[i] = from_acc<E>(v);
    }
    if (d1 != nullptr) ddp::detail::bulk_copy(d1, d0, m * sizeof(E));
  } else if (p == 2) {
    fold_last_source<Down>(src(0), src(1), d0, d1, m, p, op);
  } else {
    {
      const E* a = src(0);
      const E* b = src(1);
      for (std::size_t k = 0; k < m; ++k) {
        const std::size_t i = pass_index<Down>(k, m);
        tmp[i] = op(to_acc(a[i]), to_acc(b[i]));
      }
    }
    for (int j = 2; j < p - 1; ++j) {
      const E* s = src(j);
      for (std::size_t k = 0; k < m; ++k) {
        const std::size_t i = pass_index<Down>(k, m);
        tmp[i] = op(tmp[i], to_acc(s[i]));
      }
    }
    fold_last_source<Down>(static_cast<const A*>(tmp), src(p - 1), d0, d1, m, p, op);
  }
  for (int d = 2; d < ndst; ++d) ddp::detail::bulk_copy(dst(d), d0, m * sizeof(E));
}

// Which way a rank walks its slice. All ascending, p = 2 at 32-64 KiB: the rank of the upper
// slice folded markedly slower than the other, whichever rank had that slice; the bare probe,
// started in lockstep, showed it too once one rank started a little late. The lower rank's hardware prefetcher runs on past the end of its slice into the
// lines the upper rank works on. Walking the lower slice downwards, both walks start at their
// common boundary and run apart.
enum class walk : bool { ascending, descending };

template <class E, class Op>
DDP_HOT_KERNEL void fold_static(const std::byte* const* srcs, int p, std::byte* const* dsts, int ndst, std::size_t n, Op op,
                                walk direction) noexcept {
  constexpr std::size_t block = 2048;
  accumulate_t<E> tmp[block];
  if (direction == walk::ascending) {
    for (std::size_t i0 = 0; i0 < n; i0 += block) fold_block<false, E>(srcs, p, dsts, ndst, i0, std::min(block, n - i0), op, tmp);
    return;
  }
  for (std::size_t end = n; end > 0;) {
    const std::size_t begin = end > block ? end - block : 0;
    fold_block<true, E>(srcs, p, dsts, ndst, begin, end - begin, op, tmp);
    end = begin;
  }
}

/// The reduction of one element type and op with both erased, so that the collectives' control
/// code (slots, zero copy, staging) compiles once and only this kernel once per type and op:
/// dsts[d][i] = the reduction of srcs[0..p)[i] for i < n, for every destination d, where each
/// pointer addresses E elements. Destinations may be sources (each block is read completely
/// before it is written). `op` must outlive the erased_fold.
struct erased_fold {
  std::size_t element_size;
  void (*kernel)(const void* op, const std::byte* const* srcs, int p, std::byte* const* dsts, int ndst, std::size_t n, walk direction) noexcept;
  const void* op;
  void operator()(const std::byte* const* srcs, int p, std::byte* const* dsts, int ndst, std::size_t n,
                  walk direction = walk::ascending) const noexcept {
    kernel(op, srcs, p, dsts, ndst, n, direction);
  }
};

template <class E, class Op>
erased_fold erase_fold(const Op& op) noexcept {
  return {sizeof(E),
          [](const void* o, const std::byte* const* srcs, int p, std::byte* const* dsts, int ndst, std::size_t n, walk direction) noexcept {
            with_static_op(*static_cast<const Op*>(o), [&](auto s) { fold_static<E>(srcs, p, dsts, ndst, n, s, direction); });
          },
          &op};
}

}  // namespace ddp::algo::shm_direct

#if defined(__clang__)
#pragma clang diagnostic pop
#endif
