#pragma once
// Latency-optimized algorithms over any ddp::transport, for small messages:
//  - direct_all_reduce: in p - 1 rounds every rank sends its whole buffer (header in front, one
//    syscall) to every peer; each rank then reduces the p buffers locally in rank order, so the
//    result is bit-identical everywhere and the message pays one hop per round, no reduce chain.
//    A rank sends (p - 1) * bytes, so it pays off only below a threshold (ring_communicator's
//    small_message_bytes);
//  - direct_reduce: the same exchange (every rank checks every other's header), only the root
//    writes the result;
//  - dissemination_barrier: ceil(log2 p) rounds of header-only messages.

#include <cstddef>
#include <cstring>
#include <span>

#include "ddp/backends/ring/exchange.hpp"
#include "ddp/backends/ring/scratch.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp::algo {

namespace detail {

/// Every peer's header and buffer, one contiguous slot per rank (this rank's slot unused: it
/// reads `data`). A slot is one receive piece, so header and payload arrive in one read (the
/// payload lands in scratch, never in the output); the header is checked as soon as it is in.
struct direct_slot_memory;  // scratch tag

template <class E>
struct direct_slots {
  direct_slots(std::size_t count, int p)
      : n(count), bytes((wire_header::size + count * sizeof(E)) * static_cast<std::size_t>(p)) {}
  std::size_t n;
  scratch<direct_slot_memory> bytes;
  std::size_t slot() const noexcept { return wire_header::size + n * sizeof(E); }
  recv_piece piece(int k) noexcept { return {bytes.data() + slot() * static_cast<std::size_t>(k), slot()}; }
  const E* values(int k) const noexcept {
    // The header is 32 bytes and slots are multiples of sizeof(E): every payload is aligned.
    return reinterpret_cast<const E*>(bytes.data() + slot() * static_cast<std::size_t>(k) + wire_header::size);
  }
};

/// Fills `all` (made for data.size() elements and p ranks) with every peer's header and data.
template <class T, dtype_like E>
void direct_exchange(T& t, std::span<const E> data, direct_slots<E>& all, const collective_desc& d, deadline dl) {
  const int p = t.size(), r = t.rank();
  const wire_header mine = wire_header::encode(d);
  for (int k = 1; k < p; ++k) {
    const int to = mod(r + k, p), from = mod(r - k, p);
    const send_piece out[2] = {send_piece(reinterpret_cast<const std::byte*>(mine.bytes), wire_header::size), bytes_of(data.data(), data.size())};
    const recv_piece slot = all.piece(from);
    bool checked = false;
    auto check = [&] {
      if (checked) return;
      checked = true;
      wire_header theirs;
      std::memcpy(theirs.bytes, slot.data(), wire_header::size);
      check_header(theirs, d, numbering_of(t)(r), numbering_of(t)(from));
    };
    // A peer that sends a different amount must be caught by its header, not waited for: the
    // header is checked as soon as it is in (the transport reports progress before it waits).
    auto progress = [&](std::size_t received) {
      if (received >= wire_header::size) check();
    };
    if constexpr (vectored_transport<T>) {
      const recv_piece in[1] = {slot};
      exchange(t, to, std::span<const send_piece>(out), from, std::span<const recv_piece>(in), dl, progress);
    } else {  // piece by piece: the header alone first
      const recv_piece in[2] = {slot.first(wire_header::size), slot.subspan(wire_header::size)};
      exchange(t, to, std::span<const send_piece>(out), from, std::span<const recv_piece>(in), dl, progress);
    }
    check();
  }
}

template <dtype_like E, any_reduce_op Op>
void reduce_in_rank_order(std::span<E> data, const direct_slots<E>& all, int p, int r, Op op) {
  const std::size_t n = data.size();
  with_static_op(op, [&](auto sop) {
    for (std::size_t i = 0; i < n; ++i) {
      auto acc = widen(r == 0 ? data[i] : all.values(0)[i]);
      for (int k = 1; k < p; ++k) acc = sop(acc, widen(k == r ? data[i] : all.values(k)[i]));
      data[i] = narrow<E>(sop.finish(acc, p));
    }
  });
}

}  // namespace detail

template <class T, dtype_like E, any_reduce_op Op>
void direct_all_reduce(T& t, std::span<E> data, Op op, const collective_desc& d, deadline dl) {
  detail::direct_slots<E> all(data.size(), t.size());
  detail::direct_exchange(t, std::span<const E>(data), all, d, dl);
  detail::reduce_in_rank_order(data, all, t.size(), t.rank(), op);
}

template <class T, dtype_like E, any_reduce_op Op>
void direct_reduce(T& t, std::span<E> data, int root, Op op, const collective_desc& d, deadline dl) {
  detail::direct_slots<E> all(data.size(), t.size());
  detail::direct_exchange(t, std::span<const E>(data), all, d, dl);
  if (t.rank() == root) detail::reduce_in_rank_order(data, all, t.size(), t.rank(), op);
}

/// Dissemination barrier: in round k a rank signals rank + 2^k and waits for rank - 2^k; after
/// ceil(log2 p) rounds every rank has (transitively) heard from every other.
template <class T>
void dissemination_barrier(T& t, const collective_desc& d, deadline dl) {
  const int p = t.size(), r = t.rank();
  header_check hdr(d, t);
  for (int k = 1; k < p; k *= 2) {
    const int to = mod(r + k, p), from = mod(r - k, p);
    const send_piece out[1] = {hdr.out()};
    const recv_piece in[1] = {hdr.in(from)};
    exchange(t, to, std::span<const send_piece>(out), from, std::span<const recv_piece>(in), dl,
             [&](std::size_t received) { hdr.on_progress(received); });
    hdr.check();
  }
}

}  // namespace ddp::algo
