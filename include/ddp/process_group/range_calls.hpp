#pragma once
// The collectives on any contiguous range (std::vector, std::array, thrust::host_vector, ...)
// and on one variable (float loss; g.all_reduce(loss, ddp::avg{})), written once for
// process_group<B> and the type-erased ddp::group: each forwards to the std::span overload of
// the class that derives from pg_range_calls<Class> (which names these with using-declarations,
// so both kinds of overload are found together).
//
// These overloads take any argument and check it with a static_assert, instead of constraining
// it: a wrong element type, a non-contiguous container or a wrong reduction is then one short
// error that says what is accepted (the 'with R = ...' line above it names what was passed),
// not a list of every overload that did not match. The std::span overloads of the class are
// more specialized, so a call they accept still goes to them directly. The only constraint is
// the one that tells all_reduce(data, op) from all_reduce(in, out): out is a range, an op is not.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <type_traits>

#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/work.hpp"

namespace ddp::detail {

/// How a collective uses a buffer argument.
enum class pg_use : std::uint8_t {
  read,          // a range or one element, read only (send)
  write,         // a range or one element, written (all_reduce, broadcast, reduce, recv)
  read_range,    // the `in` of an (in, out) collective: ranges only
  write_range,   // the `out` of an (in, out) collective: ranges only
};

enum class pg_arg_error : std::uint8_t { none, not_contiguous, element, const_range, not_buffer, not_range, const_element };

template <class R>
concept pg_contiguous = std::ranges::contiguous_range<R> && std::ranges::sized_range<R>;

template <class R, pg_use Use>
consteval pg_arg_error pg_buffer_error() {
  constexpr bool written = Use == pg_use::write || Use == pg_use::write_range;
  if constexpr (std::ranges::range<R>) {
    if constexpr (!pg_contiguous<R>) return pg_arg_error::not_contiguous;
    else if constexpr (!dtype_like<std::ranges::range_value_t<R>>) return pg_arg_error::element;
    else if constexpr (written && std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
      return pg_arg_error::const_range;
    else return pg_arg_error::none;
  } else if constexpr (Use == pg_use::read_range || Use == pg_use::write_range) {
    return pg_arg_error::not_range;
  } else if constexpr (!dtype_like<std::remove_cvref_t<R>>) {
    return pg_arg_error::not_buffer;
  } else if constexpr (written && (!std::is_lvalue_reference_v<R> || std::is_const_v<std::remove_reference_t<R>>)) {
    return pg_arg_error::const_element;
  } else {
    return pg_arg_error::none;
  }
}

/// Whether R (as deduced by a forwarding reference) is a buffer a collective can use as Use;
/// a static_assert that says what is accepted when it is not.
template <class R, pg_use Use>
consteval bool pg_check_buffer() {
  // One named bool per check: g++ then prints just the message, no note about the condition.
  constexpr pg_arg_error e = pg_buffer_error<R, Use>();
  constexpr bool contiguous = e != pg_arg_error::not_contiguous, element_type = e != pg_arg_error::element;
  constexpr bool buffer = e != pg_arg_error::not_buffer, range = e != pg_arg_error::not_range;
  constexpr bool writable_range = e != pg_arg_error::const_range, writable_element = e != pg_arg_error::const_element;
  static_assert(contiguous,
                "ddp: a collective's buffer must be a contiguous range (std::vector, std::array, std::span, a C array, "
                "ddp::group_buffer, ...) of float, double, ddp::float16, ddp::bfloat16, int32_t, int64_t or uint8_t; "
                "this range is not contiguous (std::list, std::deque, std::set, std::vector<bool>, a view...): copy it into a std::vector");
  static_assert(element_type,
                "ddp: the elements of a collective's buffer must be one of float, double, ddp::float16, ddp::bfloat16, "
                "int32_t, int64_t, uint8_t; this range holds another type (a struct, bool, char as in std::string, ...): "
                "pass a std::span of one of those types over the same memory");
  static_assert(buffer,
                "ddp: a collective's buffer must be a contiguous range (std::vector, std::array, std::span, a C array, "
                "ddp::group_buffer, ...) of float, double, ddp::float16, ddp::bfloat16, int32_t, int64_t or uint8_t, "
                "or one variable of one of those types; this argument is neither");
  static_assert(range,
                "ddp: the in and out of a collective must be contiguous ranges (std::vector, std::array, std::span, a C array, "
                "ddp::group_buffer, ...) of float, double, ddp::float16, ddp::bfloat16, int32_t, int64_t or uint8_t; "
                "this argument is not a range");
  static_assert(writable_range,
                "ddp: this collective writes into this buffer, so it must not be a const range or a span of const elements");
  static_assert(writable_element,
                "ddp: this collective writes into this buffer, so one element must be a non-const variable (an lvalue), "
                "not a const or a temporary");
  return e == pg_arg_error::none;
}

/// Whether Op is a reduction; a static_assert that says what is accepted when it is not.
template <class Op>
consteval bool pg_check_op() {
  constexpr bool is_reduce_op = reduce_op<Op>;
  static_assert(is_reduce_op,
                "ddp: a collective's reduction must be ddp::sum, ddp::avg, ddp::min, ddp::max, ddp::prod or a type "
                "modelling ddp::reduce_op (a static `kind` and an operator() for every element type); std::plus<>, "
                "lambdas and function pointers are not reductions");
  return is_reduce_op;
}

template <class R, bool Range = std::ranges::range<R>>
struct pg_element {
  using type = std::remove_cvref_t<R>;
};
template <class R>
struct pg_element<R, true> {
  using type = std::ranges::range_value_t<R>;
};

/// Whether in and out hold the same element type; a static_assert when they do not.
template <class In, class Out>
consteval bool pg_check_same_element() {
  constexpr bool same = std::is_same_v<typename pg_element<In>::type, typename pg_element<Out>::type>;
  static_assert(same, "ddp: the in and out of a collective must have the same element type");
  return same;
}

/// The std::span a checked buffer argument is passed on as (one element: a span of one).
template <class R>
auto pg_span(R&& r) {
  if constexpr (std::ranges::range<R>) return std::span(std::ranges::data(r), std::ranges::size(r));
  else return std::span<std::remove_reference_t<R>>(std::addressof(r), 1);
}
template <class R>
auto pg_const_span(R&& r) {
  using T = std::remove_cv_t<typename pg_element<R>::type>;
  if constexpr (std::ranges::range<R>) return std::span<const T>(std::ranges::data(r), std::ranges::size(r));
  else return std::span<const T>(std::addressof(r), 1);
}

template <class Group>
class pg_range_calls {
 public:
  // One buffer (a range or one variable), reduced in place. all_reduce(data, op) and
  // all_reduce(in, out) are told apart by the second argument: a range is an out, anything
  // else an op. The checks run one after the other (nested if constexpr), so a call is
  // reported for its first wrong argument only, which keeps the error short.
  template <class R, class Op = sum>
    requires(!std::ranges::range<Op>)
  void all_reduce(R&& data, Op op = {}) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) {
      if constexpr (pg_check_op<Op>()) self().all_reduce(pg_span(data), op);
    }
  }
  template <class In, class Out>
    requires std::ranges::range<Out>
  void all_reduce(In&& in, Out&& out) {
    if constexpr (in_out_ok<In, Out>()) self().all_reduce(pg_const_span(in), pg_span(out), sum{});
  }
  template <class In, class Out, class Op>
  void all_reduce(In&& in, Out&& out, Op op) {
    if constexpr (in_out_ok<In, Out>()) {
      if constexpr (pg_check_op<Op>()) self().all_reduce(pg_const_span(in), pg_span(out), op);
    }
  }
  template <class R, class Op = sum>
    requires(!std::ranges::range<Op>)
  work all_reduce_async(R&& data, Op op = {}) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) {
      if constexpr (pg_check_op<Op>()) return self().all_reduce_async(pg_span(data), op);
    }
    return {};
  }
  template <class In, class Out>
    requires std::ranges::range<Out>
  work all_reduce_async(In&& in, Out&& out) {
    if constexpr (in_out_ok<In, Out>()) return self().all_reduce_async(pg_const_span(in), pg_span(out), sum{});
    return {};
  }
  template <class In, class Out, class Op>
  work all_reduce_async(In&& in, Out&& out, Op op) {
    if constexpr (in_out_ok<In, Out>()) {
      if constexpr (pg_check_op<Op>()) return self().all_reduce_async(pg_const_span(in), pg_span(out), op);
    }
    return {};
  }
  template <class R>
  void broadcast(R&& data, int root) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) self().broadcast(pg_span(data), root);
  }
  template <class R>
  work broadcast_async(R&& data, int root) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) return self().broadcast_async(pg_span(data), root);
    return {};
  }
  template <class R, class Op = sum>
  void reduce(R&& data, int root, Op op = {}) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) {
      if constexpr (pg_check_op<Op>()) self().reduce(pg_span(data), root, op);
    }
  }
  template <class In, class Out>
  void all_gather(In&& in, Out&& out) {
    if constexpr (in_out_ok<In, Out>()) self().all_gather(pg_const_span(in), pg_span(out));
  }
  template <class In, class Out>
  work all_gather_async(In&& in, Out&& out) {
    if constexpr (in_out_ok<In, Out>()) return self().all_gather_async(pg_const_span(in), pg_span(out));
    return {};
  }
  template <class In, class Out, class Op = sum>
  void reduce_scatter(In&& in, Out&& out, Op op = {}) {
    if constexpr (in_out_ok<In, Out>()) {
      if constexpr (pg_check_op<Op>()) self().reduce_scatter(pg_const_span(in), pg_span(out), op);
    }
  }
  template <class In, class Out, class Op = sum>
  work reduce_scatter_async(In&& in, Out&& out, Op op = {}) {
    if constexpr (in_out_ok<In, Out>()) {
      if constexpr (pg_check_op<Op>()) return self().reduce_scatter_async(pg_const_span(in), pg_span(out), op);
    }
    return {};
  }
  template <class In, class Out>
  void all_to_all(In&& in, Out&& out) {
    if constexpr (in_out_ok<In, Out>()) self().all_to_all(pg_const_span(in), pg_span(out));
  }
  template <class R>
  void send(R&& data, int peer) {
    if constexpr (pg_check_buffer<R, pg_use::read>()) self().send(pg_const_span(data), peer);
  }
  template <class R>
  void recv(R&& data, int peer) {
    if constexpr (pg_check_buffer<R, pg_use::write>()) self().recv(pg_span(data), peer);
  }

 private:
  Group& self() noexcept { return static_cast<Group&>(*this); }

  template <class In, class Out>
  static consteval bool in_out_ok() {
    if constexpr (!pg_check_buffer<In, pg_use::read_range>()) return false;
    else if constexpr (!pg_check_buffer<Out, pg_use::write_range>()) return false;
    else return pg_check_same_element<In, Out>();
  }
};

}  // namespace ddp::detail
