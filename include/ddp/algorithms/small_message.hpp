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
#include <span>
#include <vector>

#include "ddp/algorithms/exchange.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp::algo {

namespace detail {

/// Every rank's buffer, rank-major, in `all` (this rank's slot left empty: it reads `data`).
template <class T, dtype_like E>
void direct_exchange(T& t, std::span<const E> data, std::vector<E>& all, const collective_desc& d, deadline dl) {
  const int p = t.size(), r = t.rank();
  const std::size_t n = data.size();
  all.resize(n * static_cast<std::size_t>(p));
  header_check hdr(d, r);
  for (int k = 1; k < p; ++k) {
    const int to = mod(r + k, p), from = mod(r - k, p);
    const send_piece out[2] = {hdr.out(), bytes_of(data.data(), n)};
    const recv_piece in[2] = {hdr.in(from), bytes_of(all.data() + n * static_cast<std::size_t>(from), n)};
    exchange(t, to, std::span<const send_piece>(out), from, std::span<const recv_piece>(in), dl,
             [&](std::size_t received) { hdr.on_progress(received); });
    hdr.check();
  }
}

template <dtype_like E, reduce_op Op>
void reduce_in_rank_order(std::span<E> data, const std::vector<E>& all, int p, int r, Op op) {
  const std::size_t n = data.size();
  for (std::size_t i = 0; i < n; ++i) {
    auto acc = widen(r == 0 ? data[i] : all[i]);
    for (int k = 1; k < p; ++k) acc = op(acc, widen(k == r ? data[i] : all[n * static_cast<std::size_t>(k) + i]));
    data[i] = narrow<E>(op.finish(acc, p));
  }
}

}  // namespace detail

template <class T, dtype_like E, reduce_op Op>
void direct_all_reduce(T& t, std::span<E> data, Op op, const collective_desc& d, deadline dl) {
  std::vector<E> all;
  detail::direct_exchange(t, std::span<const E>(data), all, d, dl);
  detail::reduce_in_rank_order(data, all, t.size(), t.rank(), op);
}

template <class T, dtype_like E, reduce_op Op>
void direct_reduce(T& t, std::span<E> data, int root, Op op, const collective_desc& d, deadline dl) {
  std::vector<E> all;
  detail::direct_exchange(t, std::span<const E>(data), all, d, dl);
  if (t.rank() == root) detail::reduce_in_rank_order(data, all, t.size(), t.rank(), op);
}

/// Dissemination barrier: in round k a rank signals rank + 2^k and waits for rank - 2^k; after
/// ceil(log2 p) rounds every rank has (transitively) heard from every other.
template <class T>
void dissemination_barrier(T& t, const collective_desc& d, deadline dl) {
  const int p = t.size(), r = t.rank();
  header_check hdr(d, r);
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
