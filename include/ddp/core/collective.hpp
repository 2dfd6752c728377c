#pragma once
// The fingerprint of one collective call: (sequence, op, dtype, count, root, reduce op).
//
// It travels with the messages of every collective, so ranks that call different
// collectives at the same sequence number are told so on every rank (errc::mismatch,
// both calls described) instead of hanging or exchanging garbage.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp {

enum class collective : std::uint8_t {
  all_reduce = 1, broadcast, reduce, all_gather, reduce_scatter, all_to_all, barrier, send, recv
};

constexpr std::string_view to_string(collective c) noexcept {
  switch (c) {
    case collective::all_reduce: return "all_reduce";
    case collective::broadcast: return "broadcast";
    case collective::reduce: return "reduce";
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_to_all: return "all_to_all";
    case collective::barrier: return "barrier";
    case collective::send: return "send";
    case collective::recv: return "recv";
  }
  return "unknown";
}

/// What a rank is calling. `count` is the per-rank element count the call was given
/// (for all_gather / reduce_scatter: the count of the per-rank slice).
struct collective_desc {
  std::uint64_t seq = 0;
  collective op = collective::barrier;
  dtype type = dtype::uint8;
  reduce_kind reduction = reduce_kind::sum;  // meaningful for all_reduce, reduce, reduce_scatter
  std::int32_t root = -1;                    // meaningful for broadcast, reduce, gather, scatter
  std::uint64_t count = 0;

  constexpr bool has_reduction() const noexcept {
    return op == collective::all_reduce || op == collective::reduce || op == collective::reduce_scatter;
  }
  constexpr bool has_root() const noexcept {
    return op == collective::broadcast || op == collective::reduce;
  }

  /// e.g. "float32 x 1024, sum" or "int64 x 8, root 0": the detail part of an error message.
  std::string detail() const {
    std::string s = std::string(to_string(type)) + " x " + std::to_string(count);
    if (has_reduction()) s += ", " + std::string(to_string(reduction));
    if (has_root()) s += ", root " + std::to_string(root);
    return s;
  }
  /// e.g. "all_reduce #17 (float32 x 1024, sum)".
  std::string describe() const { return std::string(to_string(op)) + " #" + std::to_string(seq) + " (" + detail() + ")"; }

  error_context context(int rank) const { return {.rank = rank, .op = std::string(to_string(op)), .seq = seq, .detail = detail()}; }

  /// The same call with the fields that do not matter for its op cleared (reduction sum, root
  /// -1), so that comparing fingerprints never finds a false mismatch.
  constexpr collective_desc normalized() const noexcept {
    collective_desc d = *this;
    if (!d.has_reduction()) d.reduction = reduce_kind::sum;
    if (!d.has_root()) d.root = -1;
    return d;
  }

  friend constexpr bool operator==(const collective_desc&, const collective_desc&) = default;
};

/// One collective call as data: what process_group builds from a typed call, checks once, and
/// hands whole to a backend that declares `takes_call_records` (see ddp/core/concepts.hpp).
/// Buffers are untyped; `type` says what they hold. The collectives that work in place
/// (all_reduce, broadcast, reduce) use `out` only; `root` is the root of broadcast and reduce and
/// the peer of send and recv (-1 otherwise). Counts are elements, as the user gave them.
struct collective_call {
  collective op = collective::barrier;
  dtype type = dtype::uint8;
  reduce_kind reduction = reduce_kind::sum;
  std::int32_t root = -1;
  const void* in = nullptr;
  std::size_t in_count = 0;
  void* out = nullptr;
  std::size_t out_count = 0;

  /// The record of a call on spans of `U` elements (in place: the same span as `in` and `out`).
  template <class T, class U>
  static constexpr collective_call of(collective op, std::span<T> in, std::span<U> out, reduce_kind reduction = reduce_kind::sum,
                                      int root = -1) noexcept {
    return {.op = op, .type = dtype_of<std::remove_cv_t<U>>, .reduction = reduction, .root = root, .in = in.data(), .in_count = in.size(),
            .out = out.data(), .out_count = out.size()};
  }

  std::size_t in_bytes() const noexcept { return in_count * size_of(type); }
  std::size_t out_bytes() const noexcept { return out_count * size_of(type); }

  /// The fingerprint every rank compares (sequence 0 until the group numbers it): the count is
  /// the per-rank slice of all_gather and reduce_scatter, the peer of send/recv is left out
  /// (the two ends name different peers).
  constexpr collective_desc describe() const noexcept {
    collective_desc d{.seq = 0, .op = op, .type = type, .reduction = reduction, .root = -1, .count = 0};
    switch (op) {
      case collective::all_gather:
      case collective::all_to_all:
      case collective::send: d.count = in_count; break;
      case collective::barrier: d.type = dtype::uint8; break;
      default: d.count = out_count; break;
    }
    if (d.has_root()) d.root = root;
    if (!d.has_reduction()) d.reduction = reduce_kind::sum;
    return d;
  }

  /// The statistics' size of the call (nccl-tests' "size"): the data of all_reduce, broadcast,
  /// reduce, send and recv, the output of all_gather, the input of reduce_scatter and all_to_all.
  std::size_t traffic_bytes() const noexcept {
    switch (op) {
      case collective::reduce_scatter:
      case collective::all_to_all:
      case collective::send: return in_bytes();
      case collective::barrier: return 0;
      default: return out_bytes();
    }
  }
};

/// A fixed 32-byte, little-endian wire form of collective_desc, with a magic so garbage is recognized.
struct wire_header {
  static constexpr std::uint32_t magic_value = 0x44445043;  // "CPDD"
  static constexpr std::size_t size = 32;
  unsigned char bytes[size] = {};

  static wire_header encode(const collective_desc& d) noexcept {
    wire_header h;
    encode_to(d, h.bytes);
    return h;
  }
  /// Writes the wire form of d straight to out (32 bytes): a shared-memory slot is written in
  /// place, without a copy through the stack.
  static void encode_to(const collective_desc& d, unsigned char* out) noexcept {
    put32(out + 0, magic_value);
    put32(out + 4, kinds_of(d));
    put64(out + 8, d.seq);
    put64(out + 16, d.count);
    put32(out + 24, static_cast<std::uint32_t>(d.root));
    put32(out + 28, 0);
  }
  bool has_magic() const noexcept { return get32(bytes + 0) == magic_value; }
  /// FNV-1a of the 32 bytes: what backends that can only compare numbers agree on (NCCL, MPI:
  /// MAX over {h, ~h} is {h, ~h} on every rank only if every rank's h is the same).
  std::uint64_t fingerprint() const noexcept {
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
    return h;
  }
  /// Whether the 32 bytes at p are exactly the wire form of d: four word compares, no decoding
  /// and no copy (the check of a peer's header on the latency path of a small collective).
  static bool matches(const unsigned char* p, const collective_desc& d) noexcept {
    return ((get64(p) ^ (magic_value | std::uint64_t{kinds_of(d)} << 32)) | (get64(p + 8) ^ d.seq) | (get64(p + 16) ^ d.count) |
            (get64(p + 24) ^ static_cast<std::uint32_t>(d.root))) == 0;
  }
  collective_desc decode() const noexcept {
    collective_desc d;
    d.op = static_cast<collective>(bytes[4]);
    d.type = static_cast<dtype>(bytes[5]);
    d.reduction = static_cast<reduce_kind>(bytes[6]);
    d.seq = get64(bytes + 8);
    d.count = get64(bytes + 16);
    d.root = static_cast<std::int32_t>(get32(bytes + 24));
    return d;
  }

 private:
  // Bytes 4-7: op, dtype, reduction, 0.
  static std::uint32_t kinds_of(const collective_desc& d) noexcept {
    return static_cast<std::uint32_t>(d.op) | static_cast<std::uint32_t>(d.type) << 8 | static_cast<std::uint32_t>(d.reduction) << 16;
  }
  // Whole words on a little-endian host (one store or load each), bytes elsewhere.
  template <class U>
  static void put(unsigned char* p, U v) noexcept {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(p, &v, sizeof v);
    } else {
      for (std::size_t i = 0; i < sizeof v; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
    }
  }
  template <class U>
  static U get(const unsigned char* p) noexcept {
    U v = 0;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&v, p, sizeof v);
    } else {
      for (std::size_t i = 0; i < sizeof v; ++i) v |= static_cast<U>(static_cast<U>(p[i]) << (8 * i));
    }
    return v;
  }
  static void put32(unsigned char* p, std::uint32_t v) noexcept { put(p, v); }
  static void put64(unsigned char* p, std::uint64_t v) noexcept { put(p, v); }
  static std::uint32_t get32(const unsigned char* p) noexcept { return get<std::uint32_t>(p); }
  static std::uint64_t get64(const unsigned char* p) noexcept { return get<std::uint64_t>(p); }
};

/// Compares this rank's call with what a peer announced; on any difference throws
/// errc::mismatch describing both calls, e.g.
///   "mismatched collectives: this rank called all_reduce #3 (float32 x 1024, sum), rank 1 called broadcast #3 (int64 x 8, root 0)"
/// Only the fields that matter for the op are compared (root for rooted ops, reduction for reducing ops).
inline void check_same_collective(const collective_desc& mine, const collective_desc& theirs, int my_rank, int peer) {
  bool same = mine.seq == theirs.seq && mine.op == theirs.op && mine.type == theirs.type && mine.count == theirs.count;
  if (same && mine.has_reduction()) same = mine.reduction == theirs.reduction;
  if (same && mine.has_root()) same = mine.root == theirs.root;
  if (same) return;
  throw error(errc::mismatch,
              "mismatched collectives: this rank called " + mine.describe() + ", rank " + std::to_string(peer) + " called " +
                  theirs.describe(),
              mine.context(my_rank));
}

/// Decodes a header received from `peer` and checks it; a header without the magic is garbage on the wire.
inline void check_header(const wire_header& received, const collective_desc& mine, int my_rank, int peer) {
  if (!received.has_magic()) {
    throw error(errc::mismatch, "rank " + std::to_string(peer) + " sent data that is not a ddp collective header (garbage on the connection, or a different ddp version)",
                mine.context(my_rank));
  }
  check_same_collective(mine, received.decode(), my_rank, peer);
}

}  // namespace ddp
