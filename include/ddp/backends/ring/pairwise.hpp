#pragma once
// Pairwise algorithms over any ddp::transport:
//  - pairwise_all_to_all: p - 1 rounds; in round k a rank sends its block for rank + k and
//    receives the block of rank - k (header in front, checked before the block lands);
//  - send / recv of one buffer to / from a peer, header in front. Point-to-point calls are not
//    sequenced with the group (the peers' sequence numbers need not agree), so only dtype and
//    count are checked.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>

#include "ddp/backends/ring/exchange.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"

namespace ddp::algo {

/// in and out hold p equal blocks; block k of `in` goes to rank k, block k of `out` comes from rank k.
template <class T, movable_element E>
void pairwise_all_to_all(T& t, std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl) {
  const int p = t.size(), r = t.rank();
  const std::size_t b = in.size() / static_cast<std::size_t>(p);
  auto block = [&](int k) { return b * static_cast<std::size_t>(k); };
  std::copy_n(in.data() + block(r), b, out.data() + block(r));
  header_check hdr(d, t);
  for (int k = 1; k < p; ++k) {
    const int to = mod(r + k, p), from = mod(r - k, p);
    const send_piece o[2] = {hdr.out(), bytes_of(in.data() + block(to), b)};
    const recv_piece i[2] = {hdr.in(from), bytes_of(out.data() + block(from), b)};
    exchange(t, to, std::span<const send_piece>(o), from, std::span<const recv_piece>(i), dl,
             [&](std::size_t received) { hdr.on_progress(received); });
    hdr.check();
  }
}

namespace detail {
inline collective_desc p2p_desc(const collective_desc& d) {
  collective_desc x = d;
  x.seq = 0;
  x.op = collective::send;
  x.root = -1;
  x.reduction = reduce_kind::sum;
  return x;
}
}  // namespace detail

template <class T, movable_element E>
void send(T& t, std::span<const E> data, int peer, const collective_desc& d, deadline dl) {
  const wire_header h = wire_header::encode(detail::p2p_desc(d));
  const send_piece o[2] = {send_piece(reinterpret_cast<const std::byte*>(h.bytes), wire_header::size), bytes_of(data.data(), data.size())};
  exchange(t, peer, std::span<const send_piece>(o), -1, {}, dl, [](std::size_t) {});
}

template <class T, movable_element E>
void recv(T& t, std::span<E> data, int peer, const collective_desc& d, deadline dl) {
  const collective_desc mine = detail::p2p_desc(d);
  wire_header h;
  const rank_numbering& names = numbering_of(t);
  const int r = names(t.rank());
  auto check = [&] {
    if (!h.has_magic()) {
      throw error(errc::mismatch, names.rank(peer) + " sent data that is not a ddp message header (garbage on the connection, or a different ddp version)",
                  d.context(r));
    }
    const collective_desc theirs = h.decode();
    if (theirs.op != collective::send || theirs.type != mine.type || theirs.count != mine.count) {
      throw error(errc::mismatch, "mismatched point-to-point calls: this rank called recv of " + mine.detail() + " from " +
                                      names.rank(peer) + ", which sent " + theirs.detail(),
                  d.context(r));
    }
  };
  bool checked = false;
  const recv_piece i[2] = {recv_piece(reinterpret_cast<std::byte*>(h.bytes), wire_header::size), bytes_of(data.data(), data.size())};
  exchange(t, -1, {}, peer, std::span<const recv_piece>(i), dl, [&](std::size_t received) {
    if (!checked && received >= wire_header::size) checked = true, check();
  });
  if (!checked) check();
}

}  // namespace ddp::algo
