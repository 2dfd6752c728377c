#pragma once
// The primitive every algorithm is built from: one full-duplex exchange of scatter-gather pieces
// over any ddp::transport, with a progress hook, plus the pieces of collective bookkeeping the
// algorithms share (block layout, chunking, the collective header, element conversion).
//
// A transport with send_recv_v (tcp_transport) moves a header and its payload in one syscall and
// calls the hook while bytes are in flight; any other transport gets the same semantics piece by
// piece through send_recv. Algorithms never see sockets.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/backends/ring/transport/pieces.hpp"
#include "ddp/backends/ring/transport/rank_numbering.hpp"

namespace ddp::algo {

/// A transport that moves scatter-gather pieces and reports progress (see tcp_transport::send_recv_v).
template <class T>
concept vectored_transport =
    transport<T> && requires(T& t, std::span<const send_piece> o, std::span<const recv_piece> i, deadline d) {
      t.send_recv_v(0, o, 0, i, d, [](std::size_t) {});
    };

/// A non-owning reference to a progress hook. The transport's send_recv_v is compiled once for
/// it instead of once per algorithm lambda (an indirect call per chunk costs nothing next to a
/// syscall, and every collective of every dtype shares the transport's code).
class progress_ref {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, progress_ref>)
  progress_ref(F& f) noexcept  // NOLINT(google-explicit-constructor): a reference wrapper
      : object_(static_cast<void*>(&f)), call_([](void* o, std::size_t received) { (*static_cast<F*>(o))(received); }) {}
  void operator()(std::size_t received) const { call_(object_, received); }

 private:
  void* object_;
  void (*call_)(void*, std::size_t);
};

/// Sends `out` to `to` while receiving `in` from `from`. progress(received_bytes) runs once the
/// first incoming piece is complete and before anything after it is received (so the header in
/// it can be checked before a payload lands in an output), and whenever the transport would wait.
template <class T, class Progress>
void exchange(T& t, int to, std::span<const send_piece> out, int from, std::span<const recv_piece> in, deadline dl,
              Progress&& progress) {
  if constexpr (vectored_transport<T>) {
    t.send_recv_v(to, out, from, in, dl, progress_ref(progress));
  } else {
    std::size_t received = 0;
    const std::size_t n = std::max(out.size(), in.size());
    for (std::size_t i = 0; i < n; ++i) {
      const send_piece o = i < out.size() ? out[i] : send_piece{};
      const recv_piece r = i < in.size() ? in[i] : recv_piece{};
      if (!o.empty() && !r.empty()) t.send_recv(to, o, from, r, dl);
      else if (!o.empty()) t.send(to, o, dl);
      else if (!r.empty()) t.recv(from, r, dl);
      received += r.size();
      if (!r.empty()) progress(received);
    }
  }
}

template <class E>
send_piece bytes_of(const E* p, std::size_t n) noexcept {
  return {reinterpret_cast<const std::byte*>(p), n * sizeof(E)};
}
template <class E>
recv_piece bytes_of(E* p, std::size_t n) noexcept {
  return {reinterpret_cast<std::byte*>(p), n * sizeof(E)};
}

/// The header exchanged with one peer: ours goes out, theirs is checked before any data is used.
struct header_check {
  wire_header mine;
  wire_header theirs;
  const collective_desc* desc;
  const rank_numbering* names;  // how the transport's ranks go by in messages
  int rank;
  int peer = -1;
  bool pending = false;

  /// For a call of `d` on transport `t`.
  template <class T>
  header_check(const collective_desc& d, const T& t) : mine(wire_header::encode(d)), desc(&d), names(&numbering_of(t)), rank(t.rank()) {}

  send_piece out() const noexcept { return {reinterpret_cast<const std::byte*>(mine.bytes), wire_header::size}; }
  /// Arms the check for a header arriving from `from`.
  recv_piece in(int from) noexcept {
    peer = from;
    pending = true;
    return {reinterpret_cast<std::byte*>(theirs.bytes), wire_header::size};
  }
  /// Call from the progress hook with the bytes received so far.
  void on_progress(std::size_t received) {
    if (pending && received >= wire_header::size) check();
  }
  void check() {
    if (!pending) return;
    pending = false;
    check_header(theirs, *desc, (*names)(rank), (*names)(peer));
  }
};

/// The algorithms' tuning knobs.
struct algo_options {
  // Pipelining unit of the ring and the chain. Over TCP each chunk is one exchange with its own
  // wait; 512 KiB beat 256 KiB at every size from 1 MiB (p = 2 and 4 over loopback, 1-2 MiB by
  // 20-33 %), and 1 MiB lost again at 2 MiB and up (bench/README.md).
  std::size_t chunk_bytes = std::size_t{512} << 10;
};

/// count elements split into p blocks: the first count % p blocks have one more element.
struct block_layout {
  std::size_t count = 0;
  int parts = 1;
  std::size_t begin(int k) const noexcept {
    const auto q = count / static_cast<std::size_t>(parts), rem = count % static_cast<std::size_t>(parts);
    const auto kk = static_cast<std::size_t>(k);
    return kk * q + std::min(kk, rem);
  }
  std::size_t size(int k) const noexcept { return begin(k + 1) - begin(k); }
  std::size_t largest() const noexcept { return size(0); }
};

/// A block of `length` elements cut into `n` chunks of near-equal size (chunk c: [first(c), first(c+1))).
inline std::size_t chunk_first(std::size_t length, std::size_t n, std::size_t c) noexcept {
  return length / n * c + std::min(c, length % n);
}

/// The largest of those chunks: chunk_first(length, n, 1).
inline std::size_t chunk_largest(std::size_t length, std::size_t n) noexcept { return (length + n - 1) / n; }

/// How many chunks a block of `elements` elements of `bytes_per_element` bytes is cut into.
inline std::size_t chunk_count(std::size_t elements, std::size_t bytes_per_element, const algo_options& o) noexcept {
  const std::size_t per = std::max<std::size_t>(1, o.chunk_bytes / std::max<std::size_t>(1, bytes_per_element));
  return std::max<std::size_t>(1, (elements + per - 1) / per);
}

inline int mod(int a, int p) noexcept { return ((a % p) + p) % p; }

/// Element <-> accumulation type (float16 / bfloat16 accumulate in float32).
template <class E>
constexpr accumulate_t<E> widen(E v) noexcept {
  return static_cast<accumulate_t<E>>(v);
}
template <class E>
constexpr E narrow(accumulate_t<E> v) noexcept {
  return static_cast<E>(v);
}

}  // namespace ddp::algo
