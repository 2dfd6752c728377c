#pragma once
// Ring algorithms over any ddp::transport (bandwidth-optimal for large messages):
//  - ring_reduce_scatter / ring_all_gather / ring_all_reduce (reduce-scatter then all-gather),
//  - ring_reduce (reduce-scatter, then the blocks are gathered at the root),
//  - chain_broadcast (a pipelined chain from the root along the ring).
//
// Layout: the buffer is cut into p blocks (block_layout); rank r ends the reduce-scatter owning
// block r. Each block is cut into chunks; the reduction of chunk c runs while chunk c + 1 is in
// flight (from the transport's progress hook; two receive buffers). Each element is reduced
// exactly once along the ring in a fixed order and then copied, so all_reduce gives bit-identical
// results on every rank. float16 / bfloat16 partial sums travel as float32 (accumulate_t), so
// precision is that of one rounding at the end, not one per hop; the all-gather moves the
// element type. A rank sends about 2 (p - 1) / p of the buffer in an all_reduce.
//
// Mismatch: the collective header goes with the first chunk to the next rank, and the header from
// the previous rank is checked before any byte of its payload is used. Callers (ring_communicator)
// abort the transport on any error so ranks further along the ring see peer_lost instead of hanging.

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>

#include "ddp/backends/ring/exchange.hpp"
#include "ddp/backends/ring/scratch.hpp"
#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp::algo {

namespace detail {

// Scratch buffers of the ring (one per thread each, see scratch.hpp).
struct ring_receive_chunks;
struct ring_partial_sums;
struct ring_own_block;
struct ring_gather_landing;

// A transport sets `lands_receives_page_aligned` when the kernel copies what it receives into
// the receiver's memory (TCP): that copy is slower into a buffer that starts a few bytes into
// its page, where a user's large std::vector starts, so the all-gather lands such a buffer's
// blocks in page-aligned scratch and copies them into place, which pays from chunks of
// `page_landing_min_bytes` (bench/README, "The receive buffer's place in its page").
inline constexpr std::size_t page_landing_min_bytes = std::size_t{64} << 10;
template <class T>
constexpr bool lands_receives_page_aligned() {
  if constexpr (requires { T::lands_receives_page_aligned; }) return T::lands_receives_page_aligned;
  return false;
}

/// The elementwise work of the reduce-scatter phase with the element type E and the op erased,
/// so that the phase (chunking, pipelining, headers) compiles once per transport and only these
/// three loops once per type and op. W = accumulate_t<E> (float for float16 / bfloat16).
struct ring_reduction {
  std::size_t element_size;     // sizeof(E)
  std::size_t accumulate_size;  // sizeof(W)
  bool widens;                  // W is not E: partial sums cannot live in the E buffer
  // dst[i] = W(src[i])                              (dst W, src E)
  void (*widen)(std::byte* dst, const std::byte* src, std::size_t n) noexcept;
  // dst[i] = op(got[i], W(mine[i]))                 (dst W, got W, mine E; dst may be mine)
  void (*combine)(const void* op, std::byte* dst, const std::byte* got, const std::byte* mine, std::size_t n) noexcept;
  // out[i] = E(op.finish(op(got[i], W(mine[i])), p))  (out E)
  void (*finish)(const void* op, std::byte* out, const std::byte* got, const std::byte* mine, std::size_t n, int p) noexcept;
  const void* op;  // must outlive the ring_reduction
};

template <dtype_like E, any_reduce_op Op>
ring_reduction erase_ring_reduction(const Op& op) noexcept {
  using W = accumulate_t<E>;
  return {sizeof(E), sizeof(W), !std::is_same_v<W, E>,
          [](std::byte* dst, const std::byte* src, std::size_t n) noexcept {
            W* d = reinterpret_cast<W*>(dst);
            const E* e = reinterpret_cast<const E*>(src);
            for (std::size_t i = 0; i < n; ++i) d[i] = widen(e[i]);
          },
          [](const void* o, std::byte* dst, const std::byte* got, const std::byte* mine, std::size_t n) noexcept {
            W* d = reinterpret_cast<W*>(dst);
            const W* g = reinterpret_cast<const W*>(got);
            const E* m = reinterpret_cast<const E*>(mine);
            with_static_op(*static_cast<const Op*>(o), [&](auto sop) {
              for (std::size_t i = 0; i < n; ++i) d[i] = sop(g[i], widen(m[i]));
            });
          },
          [](const void* o, std::byte* out, const std::byte* got, const std::byte* mine, std::size_t n, int p) noexcept {
            E* d = reinterpret_cast<E*>(out);
            const W* g = reinterpret_cast<const W*>(got);
            const E* m = reinterpret_cast<const E*>(mine);
            with_static_op(*static_cast<const Op*>(o), [&](auto sop) {
              for (std::size_t i = 0; i < n; ++i) d[i] = narrow<E>(sop.finish(sop(g[i], widen(m[i])), p));
            });
          },
          &op};
}

/// The reduce-scatter phase. Reads `in` (count elements), leaves rank r's block fully reduced and
/// finished in `own` (block r's size). With `in_place` (only when E is its own accumulation type)
/// partial sums are kept in `in` itself, which must then be writable (all_reduce's buffer).
template <class T>
void reduce_scatter_phase(T& t, const std::byte* in, std::size_t count, std::byte* own, bool in_place, const ring_reduction& k,
                          const collective_desc& d, deadline dl, const algo_options& o) {
  const std::size_t es = k.element_size, ws = k.accumulate_size;
  const int p = t.size(), r = t.rank(), next = mod(r + 1, p), prev = mod(r - 1, p);
  const block_layout blocks{count, p};
  in_place = in_place && !k.widens;
  const std::size_t largest = blocks.largest();
  const std::size_t nchunks = chunk_count(largest, ws, o);
  const std::size_t chunk_max = chunk_largest(largest, nchunks);
  // Two receive chunks and (unless in place) two blocks of partial sums, all of W elements.
  const scratch<ring_receive_chunks> received(2 * chunk_max * ws);
  std::byte* const rbuf[2] = {received.data(), received.data() + chunk_max * ws};
  const std::size_t partial_bytes = in_place ? 0 : largest * ws;
  const scratch<ring_partial_sums> partials(2 * partial_bytes);
  std::byte* const partial[2] = {partials.data(), partials.data() + partial_bytes};
  // Where step s keeps the partial sums of the block it receives.
  auto partial_of = [&](int s, int block) -> std::byte* {
    if (in_place) return const_cast<std::byte*>(in) + blocks.begin(block) * es;
    return partial[s % 2];
  };
  // Step 0 sends this rank's own input of block r - 1, widened when needed.
  const std::byte* first_send = in + blocks.begin(mod(r - 1, p)) * es;
  if (k.widens) {
    const int b = mod(r - 1, p);
    k.widen(partial[1], first_send, blocks.size(b));
    first_send = partial[1];
  }

  header_check hdr(d, t);
  struct pending_reduce {
    bool armed = false;
    int step = 0;
    std::size_t chunk = 0;
  } pending;
  auto reduce_chunk = [&](int s, std::size_t c) {
    const int block = mod(r - s - 2, p);
    const std::size_t len = blocks.size(block);
    const std::size_t a = chunk_first(len, nchunks, c), b = chunk_first(len, nchunks, c + 1);
    const std::byte* got = rbuf[c % 2];
    const std::byte* mine = in + (blocks.begin(block) + a) * es;
    if (s == p - 2) k.finish(k.op, own + a * es, got, mine, b - a, p);  // the last step: this rank's own block is complete
    else k.combine(k.op, partial_of(s, block) + a * ws, got, mine, b - a);
  };
  auto flush = [&] {
    if (pending.armed) {
      pending.armed = false;
      reduce_chunk(pending.step, pending.chunk);
    }
  };
  auto progress = [&](std::size_t bytes_in) {
    hdr.on_progress(bytes_in);
    if (!hdr.pending) flush();
  };

  for (int s = 0; s < p - 1; ++s) {
    flush();  // the next step sends what the last chunk of this step produced
    const int send_block = mod(r - s - 1, p), recv_block = mod(r - s - 2, p);
    const std::byte* send_base = s == 0 ? first_send : partial_of(s - 1, send_block);
    const std::size_t send_len = blocks.size(send_block), recv_len = blocks.size(recv_block);
    for (std::size_t c = 0; c < nchunks; ++c) {
      const std::size_t sa = chunk_first(send_len, nchunks, c), sb = chunk_first(send_len, nchunks, c + 1);
      const std::size_t ra = chunk_first(recv_len, nchunks, c), rb = chunk_first(recv_len, nchunks, c + 1);
      const bool first = s == 0 && c == 0;
      send_piece out[2];
      recv_piece inp[2];
      std::size_t no = 0, ni = 0;
      if (first) out[no++] = hdr.out(), inp[ni++] = hdr.in(prev);
      out[no++] = send_piece(send_base + sa * ws, (sb - sa) * ws);
      inp[ni++] = recv_piece(rbuf[c % 2], (rb - ra) * ws);
      exchange(t, next, std::span<const send_piece>(out, no), prev, std::span<const recv_piece>(inp, ni), dl, progress);
      hdr.check();  // no-op unless the transport completed without calling back
      flush();      // the previous chunk, when the transport never had to wait
      pending = {true, s, c};
    }
  }
  flush();
}

/// The all-gather phase over `data` (count elements, block r filled): afterwards every block is.
/// `hdr` non-null: the header travels with the first chunk (all_gather as its own collective).
template <class T, movable_element E>
void all_gather_phase(T& t, E* data, std::size_t count, header_check* hdr, deadline dl, const algo_options& o) {
  const int p = t.size(), r = t.rank(), next = mod(r + 1, p), prev = mod(r - 1, p);
  const block_layout blocks{count, p};
  const std::size_t nchunks = chunk_count(blocks.largest(), sizeof(E), o);
  auto progress = [&](std::size_t bytes_in) {
    if (hdr != nullptr) hdr->on_progress(bytes_in);
  };
  constexpr std::size_t page = 4096;
  const std::size_t chunk_bytes = chunk_largest(blocks.largest(), nchunks) * sizeof(E);
  const bool land = lands_receives_page_aligned<T>() && chunk_bytes >= page_landing_min_bytes &&
                    reinterpret_cast<std::uintptr_t>(data) % page != 0;
  const scratch<ring_gather_landing> landing(land ? chunk_bytes + page : 0);
  std::byte* const landing_page = landing.data() + (page - reinterpret_cast<std::uintptr_t>(landing.data()) % page) % page;
  for (int s = 0; s < p - 1; ++s) {
    const int send_block = mod(r - s, p), recv_block = mod(r - s - 1, p);
    const std::size_t send_len = blocks.size(send_block), recv_len = blocks.size(recv_block);
    E* send_base = data + blocks.begin(send_block);
    E* recv_base = data + blocks.begin(recv_block);
    for (std::size_t c = 0; c < nchunks; ++c) {
      const std::size_t sa = chunk_first(send_len, nchunks, c), sb = chunk_first(send_len, nchunks, c + 1);
      const std::size_t ra = chunk_first(recv_len, nchunks, c), rb = chunk_first(recv_len, nchunks, c + 1);
      send_piece out[2];
      recv_piece inp[2];
      std::size_t no = 0, ni = 0;
      if (hdr != nullptr && s == 0 && c == 0) out[no++] = hdr->out(), inp[ni++] = hdr->in(prev);
      out[no++] = bytes_of(send_base + sa, sb - sa);
      inp[ni++] = land ? recv_piece(landing_page, (rb - ra) * sizeof(E)) : bytes_of(recv_base + ra, rb - ra);
      exchange(t, next, std::span<const send_piece>(out, no), prev, std::span<const recv_piece>(inp, ni), dl, progress);
      if (land) ddp::detail::bulk_copy(reinterpret_cast<std::byte*>(recv_base + ra), landing_page, (rb - ra) * sizeof(E));
      if (hdr != nullptr) hdr->check();
    }
  }
}

}  // namespace detail

/// In-place all_reduce: ring reduce-scatter, then ring all-gather.
template <class T, dtype_like E, any_reduce_op Op>
void ring_all_reduce(T& t, std::span<E> data, Op op, const collective_desc& d, deadline dl, const algo_options& o = {}) {
  const block_layout blocks{data.size(), t.size()};
  const int r = t.rank();
  const auto k = detail::erase_ring_reduction<E>(op);
  auto* bytes = reinterpret_cast<std::byte*>(data.data());
  if constexpr (std::is_same_v<accumulate_t<E>, E>) {
    detail::reduce_scatter_phase(t, bytes, data.size(), bytes + blocks.begin(r) * sizeof(E), true, k, d, dl, o);
  } else {
    const detail::scratch<detail::ring_own_block> own(blocks.size(r) * sizeof(E));
    detail::reduce_scatter_phase(t, bytes, data.size(), own.data(), false, k, d, dl, o);
    if (blocks.size(r) != 0) ddp::detail::bulk_copy(bytes + blocks.begin(r) * sizeof(E), own.data(), blocks.size(r) * sizeof(E));  // data may be null when empty
  }
  detail::all_gather_phase(t, data.data(), data.size(), nullptr, dl, o);
}

/// reduce_scatter: in = size * out; this rank gets block `rank` of the reduction.
template <class T, dtype_like E, any_reduce_op Op>
void ring_reduce_scatter(T& t, std::span<const E> in, std::span<E> out, Op op, const collective_desc& d, deadline dl,
                         const algo_options& o = {}) {
  // Equal blocks: in.size() == size * out.size(), so block_layout puts block r exactly at r * out.size().
  detail::reduce_scatter_phase(t, reinterpret_cast<const std::byte*>(in.data()), in.size(), reinterpret_cast<std::byte*>(out.data()), false,
                               detail::erase_ring_reduction<E>(op), d, dl, o);
}

/// all_gather: out = size * in, rank-major.
template <class T, movable_element E>
void ring_all_gather(T& t, std::span<const E> in, std::span<E> out, const collective_desc& d, deadline dl,
                     const algo_options& o = {}) {
  std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(in.size() * static_cast<std::size_t>(t.rank())));
  header_check hdr(d, t);
  detail::all_gather_phase(t, out.data(), out.size(), &hdr, dl, o);
}

/// reduce to `root`: ring reduce-scatter into a scratch block, then every block goes to the root.
/// Buffers of ranks other than the root are left unchanged.
template <class T, dtype_like E, any_reduce_op Op>
void ring_reduce(T& t, std::span<E> data, int root, Op op, const collective_desc& d, deadline dl, const algo_options& o = {}) {
  const int p = t.size(), r = t.rank();
  const block_layout blocks{data.size(), p};
  const detail::scratch<detail::ring_own_block> own_block(blocks.size(r) * sizeof(E));
  const std::span<E> own(own_block.as<E>(), blocks.size(r));
  detail::reduce_scatter_phase(t, reinterpret_cast<const std::byte*>(data.data()), data.size(), own_block.data(), false,
                               detail::erase_ring_reduction<E>(op), d, dl, o);
  auto none = [](std::size_t) {};
  if (r != root) {
    const send_piece out[1] = {bytes_of(own.data(), own.size())};
    exchange(t, root, std::span<const send_piece>(out), -1, {}, dl, none);
    return;
  }
  for (int k = 0; k < p; ++k) {
    if (k == root) continue;
    const recv_piece in[1] = {bytes_of(data.data() + blocks.begin(k), blocks.size(k))};
    exchange(t, -1, {}, k, std::span<const recv_piece>(in), dl, none);
  }
  if (!own.empty()) ddp::detail::bulk_copy(data.data() + blocks.begin(r), own.data(), own.size_bytes());
}

/// broadcast from `root` along the ring r -> r + 1 -> ..., pipelined by chunks: a rank forwards
/// chunk c while receiving chunk c + 1. Every rank checks its predecessor's header; the last rank
/// sends its header back to the root once it has checked its own, so every rank checks one header
/// and the root learns that the chain agreed (two ranks that both believe they are the root, or a
/// mismatch anywhere, fail every rank instead of letting the root return).
template <class T, movable_element E>
void chain_broadcast(T& t, std::span<E> data, int root, const collective_desc& d, deadline dl, const algo_options& o = {}) {
  const int p = t.size(), r = t.rank(), next = mod(r + 1, p), prev = mod(r - 1, p);
  const int pos = mod(r - root, p);  // position in the chain: 0 is the root, p - 1 the last
  const std::size_t n = data.size();
  const std::size_t nchunks = chunk_count(n, sizeof(E), o);
  auto chunk = [&](std::size_t c) { return std::pair{chunk_first(n, nchunks, c), chunk_first(n, nchunks, c + 1)}; };
  header_check hdr(d, t);
  auto progress = [&](std::size_t bytes_in) { hdr.on_progress(bytes_in); };
  E* base = data.data();
  if (pos == 0) {
    for (std::size_t c = 0; c < nchunks; ++c) {
      const auto [a, b] = chunk(c);
      send_piece out[2];
      std::size_t no = 0;
      if (c == 0) out[no++] = hdr.out();
      out[no++] = bytes_of(base + a, b - a);
      exchange(t, next, std::span<const send_piece>(out, no), -1, {}, dl, progress);
    }
    // The last rank's header arrives only once every rank of the chain has checked its
    // predecessor's: a root that returns knows the whole chain agreed.
    const recv_piece in[1] = {hdr.in(prev)};
    exchange(t, -1, {}, prev, std::span<const recv_piece>(in), dl, progress);
    hdr.check();
    return;
  }
  // Receive the header and chunk 0, and check the header before the chunk lands.
  {
    const auto [a, b] = chunk(0);
    const recv_piece in[2] = {hdr.in(prev), bytes_of(base + a, b - a)};
    exchange(t, -1, {}, prev, std::span<const recv_piece>(in), dl, progress);
    hdr.check();
  }
  if (pos == p - 1) {
    const send_piece out[1] = {hdr.out()};
    exchange(t, next, std::span<const send_piece>(out), -1, {}, dl, progress);
    for (std::size_t c = 1; c < nchunks; ++c) {
      const auto [a, b] = chunk(c);
      const recv_piece in[1] = {bytes_of(base + a, b - a)};
      exchange(t, -1, {}, prev, std::span<const recv_piece>(in), dl, progress);
    }
    return;
  }
  for (std::size_t c = 0; c < nchunks; ++c) {
    const auto [a, b] = chunk(c);
    send_piece out[2];
    std::size_t no = 0;
    if (c == 0) out[no++] = hdr.out();
    out[no++] = bytes_of(base + a, b - a);
    if (c + 1 < nchunks) {
      const auto [a2, b2] = chunk(c + 1);
      const recv_piece in[1] = {bytes_of(base + a2, b2 - a2)};
      exchange(t, next, std::span<const send_piece>(out, no), prev, std::span<const recv_piece>(in), dl, progress);
    } else {
      exchange(t, next, std::span<const send_piece>(out, no), -1, {}, dl, progress);
    }
  }
}

}  // namespace ddp::algo
