#pragma once
// Reduce operations as function objects.
//
// A backend either maps an op to a native one through its `kind` (NCCL's ncclSum,
// MPI's MPI_SUM) or applies it elementwise with operator(). `avg` combines like `sum`;
// its finish() divides by the number of contributions once, at the end.

#include <algorithm>
#include <concepts>
#include <string_view>
#include <type_traits>
#include <utility>

#include "ddp/core/dtype.hpp"

namespace ddp {

enum class reduce_kind : std::uint8_t { sum, avg, min, max, prod };

constexpr std::string_view to_string(reduce_kind k) noexcept {
  switch (k) {
    case reduce_kind::sum: return "sum";
    case reduce_kind::avg: return "avg";
    case reduce_kind::min: return "min";
    case reduce_kind::max: return "max";
    case reduce_kind::prod: return "prod";
  }
  return "unknown";
}

namespace detail {
// Combines in the accumulation type and finishes as identity, so only avg overrides finish().
template <reduce_kind K>
struct reduce_op_base {
  static constexpr reduce_kind kind = K;
  static constexpr std::string_view name = to_string(K);
  template <class T>
  constexpr T finish(T value, int /*contributions*/) const noexcept {
    return value;
  }
};

// Signed integers wrap on overflow (two's complement, as torch's integer tensors do) instead of
// the undefined behaviour of a signed overflow; the unsigned arithmetic vectorizes the same.
template <class T>
constexpr T wrapping_plus(T a, T b) noexcept {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return static_cast<T>(a + b);
  }
}
template <class T>
constexpr T wrapping_times(T a, T b) noexcept {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return static_cast<T>(a * b);
  }
}
}  // namespace detail

struct sum : detail::reduce_op_base<reduce_kind::sum> {
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return detail::wrapping_plus(a, b); }
};

struct avg : detail::reduce_op_base<reduce_kind::avg> {
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return detail::wrapping_plus(a, b); }
  /// Integers divide with truncation toward zero, like torch's integer division of a sum.
  template <class T>
  constexpr T finish(T value, int contributions) const noexcept { return static_cast<T>(value / static_cast<T>(contributions)); }
};

struct min : detail::reduce_op_base<reduce_kind::min> {
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return b < a ? b : a; }
};

struct max : detail::reduce_op_base<reduce_kind::max> {
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return a < b ? b : a; }
};

struct prod : detail::reduce_op_base<reduce_kind::prod> {
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return detail::wrapping_times(a, b); }
};

/// A reduce operation: a function object with a kind, usable on every dtype's accumulation type.
template <class Op>
concept reduce_op = requires(const Op& op, float f, double d, std::int32_t i, std::int64_t l, std::uint8_t u) {
  { Op::kind } -> std::convertible_to<reduce_kind>;
  { op(f, f) } -> std::convertible_to<float>;
  { op(d, d) } -> std::convertible_to<double>;
  { op(i, i) } -> std::convertible_to<std::int32_t>;
  { op(l, l) } -> std::convertible_to<std::int64_t>;
  { op(u, u) } -> std::convertible_to<std::uint8_t>;
  { op.finish(f, 2) } -> std::convertible_to<float>;
};

/// Runtime dispatch from a kind to the function object.
template <class F>
constexpr decltype(auto) visit_reduce_kind(reduce_kind k, F&& f) {
  switch (k) {
    case reduce_kind::sum: return f(sum{});
    case reduce_kind::avg: return f(avg{});
    case reduce_kind::min: return f(min{});
    case reduce_kind::max: return f(max{});
    case reduce_kind::prod: break;
  }
  return f(prod{});
}

/// A reduction chosen at run time. ddp::group passes one to backends that declare
/// `runtime_reductions` (ring, MPI, NCCL), so that a program using init_process_group compiles
/// each reducing collective once per dtype instead of once per (dtype, reduction): the
/// collectives' code is the same for every kind, only the elementwise loops differ. Those loops
/// take it through with_static_op(), which switches once per range, never per element; it has
/// no operator() so that a loop that forgot to do so does not compile.
struct runtime_op {
  reduce_kind kind = reduce_kind::sum;
};

/// A static reduce operation or a runtime_op.
template <class Op>
concept any_reduce_op = reduce_op<Op> || std::same_as<Op, runtime_op>;

/// ddp's own operations. They are stateless, so a runtime_op of their kind is the same
/// reduction: process_group, ring_backend and the ring and hierarchical communicators forward
/// them as one (see runtime_op), so a program that uses all five kinds compiles each collective
/// once per dtype, not five times (the shared-memory and ring reduce-scatter code below them is
/// type-erased already). A user's own reduce_op keeps its type (its operator() is what must run).
template <class Op>
concept builtin_reduce_op =
    std::same_as<Op, sum> || std::same_as<Op, avg> || std::same_as<Op, min> || std::same_as<Op, max> || std::same_as<Op, prod>;

/// f(op) with the static function object: op itself, or the one runtime_op names.
template <any_reduce_op Op, class F>
constexpr decltype(auto) with_static_op(const Op& op, F&& f) {
  if constexpr (std::same_as<Op, runtime_op>) return visit_reduce_kind(op.kind, std::forward<F>(f));
  else return f(op);
}

/// The kind of a static op or a runtime_op.
template <any_reduce_op Op>
constexpr reduce_kind kind_of(const Op& op) noexcept {
  return op.kind;
}

/// op.finish(value, contributions) for a static op or a runtime_op (only avg changes the value).
template <any_reduce_op Op, class T>
constexpr T finish_reduction(const Op& op, T value, int contributions) noexcept {
  if constexpr (std::same_as<Op, runtime_op>) return op.kind == reduce_kind::avg ? avg{}.finish(value, contributions) : value;
  else return op.finish(value, contributions);
}

}  // namespace ddp
