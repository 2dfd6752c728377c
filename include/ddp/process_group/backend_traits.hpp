#pragma once
// What process_group needs to know of a backend beyond the ddp::backend concept:
//
//  - B::capabilities (ddp::backend_capabilities): the collectives it has beyond all_reduce and
//    broadcast, and whether they take the extended signatures (..., const collective_desc&,
//    deadline); each declared form is checked below with a static_assert (pg_check_declared), so
//    a near-miss signature is a compile error, not a silent fallback;
//  - split(ranks, tag) -> B: a backend over a subset of the ranks (new_group);
//  - allocate<T>(n): memory that every same-host rank can address (or, for a device backend,
//    device memory of its own);
//  - copy_memory(dst, src, bytes): copies in the backend's memory space (device memory);
//  - missing_ranks(): after abort(), the ranks that had not joined the collective;
//  - runtime_reductions: reducing collectives take a ddp::runtime_op (one instantiation for all kinds);
//  - takes_call_records: run(const collective_call&, const collective_desc&, deadline) takes
//    every collective of ddp's own reductions as one record.
// The last five are detected (each is one member whose absence has one meaning).

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
template <class B, class T>
concept pg_plain_all_gather = requires(B& b, std::span<const T> in, std::span<T> out) { b.all_gather(in, out); };
template <class B, class T, class Op>
concept pg_plain_reduce_scatter = requires(B& b, std::span<const T> in, std::span<T> out, Op op) { b.reduce_scatter(in, out, op); };
template <class B>
concept pg_plain_barrier = requires(B& b) { b.barrier(); };
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
/// The backend declares `static constexpr bool takes_call_records = true` ...
template <class B>
concept pg_declares_call_records = requires { requires B::takes_call_records; };
/// ... and has the run() that takes them.
template <class B>
concept pg_has_run = requires(B& b, const collective_call& c, const collective_desc& d, deadline dl) { b.run(c, d, dl); };
template <class B>
concept pg_takes_call_records = pg_declares_call_records<B> && pg_has_run<B>;

template <class B>
concept pg_has_name = requires { { B::name } -> std::convertible_to<std::string_view>; };

/// What B declares (nothing when it declares nothing).
template <class B>
constexpr backend_capabilities pg_capabilities() {
  if constexpr (requires { { B::capabilities } -> std::convertible_to<backend_capabilities>; }) return B::capabilities;
  else return {};
}

/// The backend enforces deadlines itself (it declares the extended signatures or takes call
/// records); the watchdog then only backs it up, after a grace period.
template <class B>
concept pg_enforces_deadlines = pg_takes_call_records<B> || pg_capabilities<B>().deadlines;

/// Compiles only when every form B declares exists (checked for float32 and sum): each missing
/// one is a static_assert that names it.
template <class B>
consteval bool pg_check_declared() {
  constexpr backend_capabilities c = pg_capabilities<B>();
  constexpr bool ext = c.deadlines;
  static_assert(!ext || pg_ext_all_reduce<B, float, sum>,
                "capabilities.deadlines: the backend needs all_reduce(std::span<T>, Op, const ddp::collective_desc&, ddp::deadline)");
  static_assert(!ext || pg_ext_broadcast<B, float>,
                "capabilities.deadlines: the backend needs broadcast(std::span<T>, int root, const ddp::collective_desc&, ddp::deadline)");
  static_assert(!c.all_gather || (ext ? pg_ext_all_gather<B, float> : pg_plain_all_gather<B, float>),
                "capabilities.all_gather: the backend needs all_gather(std::span<const T>, std::span<T>) (with "
                "const ddp::collective_desc&, ddp::deadline after them when capabilities.deadlines)");
  static_assert(!c.reduce_scatter || (ext ? pg_ext_reduce_scatter<B, float, sum> : pg_plain_reduce_scatter<B, float, sum>),
                "capabilities.reduce_scatter: the backend needs reduce_scatter(std::span<const T>, std::span<T>, Op) (with "
                "const ddp::collective_desc&, ddp::deadline after them when capabilities.deadlines)");
  static_assert(!c.barrier || (ext ? pg_ext_barrier<B> : pg_plain_barrier<B>),
                "capabilities.barrier: the backend needs barrier() (barrier(const ddp::collective_desc&, ddp::deadline) when capabilities.deadlines)");
  static_assert(!c.reduce || (ext ? pg_ext_reduce<B, float, sum> : pg_plain_reduce<B, float, sum>),
                "capabilities.reduce: the backend needs reduce(std::span<T>, int root, Op) (with const ddp::collective_desc&, "
                "ddp::deadline after them when capabilities.deadlines)");
  static_assert(!c.all_to_all || (ext ? pg_ext_all_to_all<B, float> : pg_plain_all_to_all<B, float>),
                "capabilities.all_to_all: the backend needs all_to_all(std::span<const T>, std::span<T>) (with const "
                "ddp::collective_desc&, ddp::deadline after them when capabilities.deadlines)");
  static_assert(!c.send_recv || (ext ? pg_ext_send<B, float> && pg_ext_recv<B, float> : pg_plain_send<B, float> && pg_plain_recv<B, float>),
                "capabilities.send_recv: the backend needs send(std::span<const T>, int peer) and recv(std::span<T>, int peer) "
                "(with const ddp::collective_desc&, ddp::deadline after them when capabilities.deadlines)");
  return true;
}

template <class B>
constexpr std::string_view pg_backend_name() {
  if constexpr (pg_has_name<B>) return B::name;
  else return "custom";
}

}  // namespace ddp::detail
