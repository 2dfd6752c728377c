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

/// A collective backend. Collectives are templates over the element type and the op; the
/// concept checks them for float32 and sum, and ddp::supports_dtype_v / supports_op_v
/// say what else a backend accepts (default: every dtype and op).
///
/// `B::memory` names the memory space its spans point into. A backend whose operations are
/// natively asynchronous (stream-ordered, e.g. NCCL) sets `static constexpr bool natively_async = true`.
/// abort() must be noexcept, must not block, and must make every blocked call of the
/// backend return with a ddp::error promptly: process_group calls it when a deadline expires.
template <class B>
concept backend = requires(B& b, const B& cb, std::span<float> data, std::span<const float> in, int root) {
  { cb.rank() } -> std::convertible_to<int>;
  { cb.size() } -> std::convertible_to<int>;
  { B::memory } -> std::convertible_to<memory_space>;
  b.all_reduce(data, sum{});
  b.broadcast(data, root);
  b.all_gather(in, data);
  b.reduce_scatter(in, data, sum{});
  b.barrier();
  { b.abort() } noexcept;
};

/// Optional capabilities of a backend.
template <class B>
concept backend_with_send_recv = backend<B> && requires(B& b, std::span<float> data, std::span<const float> in, int peer) {
  b.send(in, peer);
  b.recv(data, peer);
};
template <class B>
concept backend_with_all_to_all = backend<B> && requires(B& b, std::span<float> out, std::span<const float> in) {
  b.all_to_all(in, out);
};

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
