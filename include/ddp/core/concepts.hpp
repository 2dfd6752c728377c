#pragma once
// The extension points of ddp, as C++20 concepts.
//
//  - backend:        in-place collectives on contiguous spans (ring, nccl, mpi, or yours);
//  - transport:      full-duplex byte streams to peers, with deadlines (tcp, shm);
//  - key_value_store: rendezvous only, never on the data path (tcp_store, file_store, hash_store);
//  - parameter_container: see ddp/parameters.hpp.
//
// The store concept is named key_value_store, not `store`, because `ddp::store` is the
// namespace that holds the store implementations.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"

namespace ddp {

/// Where a backend's buffers live.
enum class memory_space : std::uint8_t { host, device };

constexpr std::string_view to_string(memory_space m) noexcept { return m == memory_space::host ? "host" : "device"; }

/// A collective backend: at least rank(), size(), `B::memory` (the memory space its spans
/// point into), all_reduce, broadcast and abort(). Collectives are templates over the element
/// type and the op; the concept checks them for float32 and sum, and ddp::supports_dtype_v /
/// supports_op_v say what else a backend accepts (default: every dtype and op). What it has
/// beyond that it declares in `B::capabilities` (ddp::backend_capabilities); process_group
/// supplies the rest from all_reduce and broadcast.
///
/// A backend whose operations are natively asynchronous (stream-ordered, e.g. NCCL) sets
/// `static constexpr bool natively_async = true`. abort() must be noexcept, must not block, and
/// must make every blocked call of the backend return with a ddp::error promptly:
/// process_group calls it when a deadline expires.
template <class B>
concept backend = requires(B& b, const B& cb, std::span<float> data, int root) {
  { cb.rank() } -> std::convertible_to<int>;
  { cb.size() } -> std::convertible_to<int>;
  { B::memory } -> std::convertible_to<memory_space>;
  b.all_reduce(data, sum{});
  b.broadcast(data, root);
  { b.abort() } noexcept;
};

/// What a backend declares it has beyond ddp::backend, as
/// `static constexpr ddp::backend_capabilities capabilities{.all_gather = true, ...};`.
/// process_group uses exactly what is declared, and a declared member that does not compile
/// with the documented signature is a static_assert naming it (never a silent fallback).
/// Without a declaration (or for what is not declared) it falls back to:
///   all_gather      one broadcast from each rank in turn;
///   reduce_scatter  an all_reduce of a copy of the input, of which this rank keeps its block;
///   barrier         an all_reduce of one element;
///   reduce          all_reduce (every rank gets the result);
///   all_to_all      all_gather (p times the traffic);
///   send / recv     none: group.send is errc::unavailable.
struct backend_capabilities {
  /// Every collective it has also takes (..., const ddp::collective_desc&, ddp::deadline): it
  /// gets the call's fingerprint and enforces the deadline itself (the watchdog only backs it up).
  bool deadlines = false;
  bool all_gather = false;      // all_gather(std::span<const T> in, std::span<T> out)
  bool reduce_scatter = false;  // reduce_scatter(std::span<const T> in, std::span<T> out, Op)
  bool barrier = false;         // barrier()
  bool reduce = false;          // reduce(std::span<T>, int root, Op)
  bool all_to_all = false;      // all_to_all(std::span<const T> in, std::span<T> out)
  bool send_recv = false;       // send(std::span<const T>, int peer), recv(std::span<T>, int peer)
};

/// Every capability: what the built-in backends declare.
inline constexpr backend_capabilities all_capabilities{
    .deadlines = true, .all_gather = true, .reduce_scatter = true, .barrier = true, .reduce = true, .all_to_all = true, .send_recv = true};

template <class B, class T> inline constexpr bool supports_dtype_v = dtype_like<T>;
template <class B, class Op> inline constexpr bool supports_op_v = reduce_op<Op>;

/// Point-to-point, full-duplex byte streams between the ranks of a group.
/// send_recv sends to one peer while receiving from another, so a ring step cannot deadlock.
/// A closed or dead peer is errc::peer_lost naming it; an expired deadline is errc::timeout.
template <class T>
concept transport = requires(T& t, const T& ct, int peer, std::span<const std::byte> out, std::span<std::byte> in, deadline d) {
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  t.send(peer, out, d);
  t.recv(peer, in, d);
  t.send_recv(peer, out, peer, in, d);
  { t.abort() } noexcept;
};

/// A rendezvous key-value store. get() waits for the key (up to the store's timeout);
/// wait() waits for all keys until the timeout and then throws errc::timeout.
template <class S>
concept key_value_store = requires(S& s, const std::string& key, std::span<const std::byte> value, std::int64_t delta,
                                   const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  s.set(key, value);
  { s.get(key) } -> std::same_as<std::vector<std::byte>>;
  { s.add(key, delta) } -> std::same_as<std::int64_t>;
  { s.compare_set(key, value, value) } -> std::same_as<std::vector<std::byte>>;
  s.wait(keys, timeout);
  { s.erase(key) } -> std::same_as<bool>;
  { s.num_keys() } -> std::same_as<std::int64_t>;
};

}  // namespace ddp
