#pragma once
// What a backend offers beyond the ddp::backend concept, detected with requires-expressions,
// so process_group can use the richer form where there is one and fall back otherwise:
//
//  - the extended signatures (..., const collective_desc&, deadline): the backend gets the
//    group's fingerprint and deadline and enforces both itself;
//  - reduce, all_to_all, send/recv (optional collectives);
//  - split(ranks, tag) -> B: a backend over a subset of the ranks (new_group);
//  - allocate<T>(n): memory that every same-host rank can address (or, for a device backend,
//    device memory of its own);
//  - copy_memory(dst, src, bytes): copies in the backend's memory space (device memory);
//  - missing_ranks(): after abort(), the ranks that had not joined the collective;
//  - runtime_reductions: reducing collectives take a ddp::runtime_op (one instantiation for all kinds).

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"

namespace ddp::detail {

template <class B, class T, class Op>
concept pg_ext_all_reduce = requires(B& b, std::span<T> d, Op op, const collective_desc& c, deadline dl) { b.all_reduce(d, op, c, dl); };
template <class B, class T>
concept pg_ext_broadcast = requires(B& b, std::span<T> d, int root, const collective_desc& c, deadline dl) { b.broadcast(d, root, c, dl); };
template <class B, class T, class Op>
concept pg_ext_reduce =
    requires(B& b, std::span<T> d, int root, Op op, const collective_desc& c, deadline dl) { b.reduce(d, root, op, c, dl); };
template <class B, class T, class Op>
concept pg_plain_reduce = requires(B& b, std::span<T> d, int root, Op op) { b.reduce(d, root, op); };
template <class B, class T>
concept pg_ext_all_gather =
    requires(B& b, std::span<const T> in, std::span<T> out, const collective_desc& c, deadline dl) { b.all_gather(in, out, c, dl); };
template <class B, class T, class Op>
concept pg_ext_reduce_scatter = requires(B& b, std::span<const T> in, std::span<T> out, Op op, const collective_desc& c, deadline dl) {
  b.reduce_scatter(in, out, op, c, dl);
};
template <class B, class T>
concept pg_ext_all_to_all =
    requires(B& b, std::span<const T> in, std::span<T> out, const collective_desc& c, deadline dl) { b.all_to_all(in, out, c, dl); };
template <class B, class T>
concept pg_plain_all_to_all = requires(B& b, std::span<const T> in, std::span<T> out) { b.all_to_all(in, out); };
template <class B>
concept pg_ext_barrier = requires(B& b, const collective_desc& c, deadline dl) { b.barrier(c, dl); };
template <class B, class T>
concept pg_ext_send = requires(B& b, std::span<const T> d, int peer, const collective_desc& c, deadline dl) { b.send(d, peer, c, dl); };
template <class B, class T>
concept pg_plain_send = requires(B& b, std::span<const T> d, int peer) { b.send(d, peer); };
template <class B, class T>
concept pg_ext_recv = requires(B& b, std::span<T> d, int peer, const collective_desc& c, deadline dl) { b.recv(d, peer, c, dl); };
template <class B, class T>
concept pg_plain_recv = requires(B& b, std::span<T> d, int peer) { b.recv(d, peer); };

template <class B>
concept pg_has_split = requires(const B& b, std::span<const int> ranks, const std::string& tag) {
  { b.split(ranks, tag) } -> std::convertible_to<B>;
};
template <class B, class T>
concept pg_has_allocate = requires(B& b, std::size_t n) { b.template allocate<T>(n); };
template <class B>
concept pg_has_copy_memory = requires(B& b, void* dst, const void* src, std::size_t n) { b.copy_memory(dst, src, n); };
template <class B>
concept pg_has_missing_ranks = requires(const B& b) {
  { b.missing_ranks() } -> std::convertible_to<std::vector<int>>;
};
/// The backend's reducing collectives accept a ddp::runtime_op (B::runtime_reductions).
template <class B>
concept pg_runtime_reductions = requires { requires B::runtime_reductions; };
template <class B>
concept pg_has_name = requires { { B::name } -> std::convertible_to<std::string_view>; };

/// The backend enforces deadlines itself (the common collectives take one); the watchdog then
/// only backs it up, after a grace period.
template <class B>
concept pg_enforces_deadlines = pg_ext_all_reduce<B, float, sum> && pg_ext_broadcast<B, float> && pg_ext_all_gather<B, float> &&
                                pg_ext_reduce_scatter<B, float, sum> && pg_ext_barrier<B>;

template <class B>
constexpr std::string_view pg_backend_name() {
  if constexpr (pg_has_name<B>) return B::name;
  else return "custom";
}

}  // namespace ddp::detail
