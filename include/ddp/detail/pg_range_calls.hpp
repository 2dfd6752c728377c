#pragma once
// The collectives on any contiguous range (std::vector, std::array, thrust::host_vector, ...),
// written once for process_group<B> and the type-erased ddp::group: each forwards to the
// std::span overload of the class that derives from pg_range_calls<Class> (which names these
// with using-declarations, so both kinds of overload are found together).

#include <cstddef>
#include <ranges>
#include <span>
#include <type_traits>

#include "ddp/core/dtype.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/work.hpp"

namespace ddp::detail {

template <class T> inline constexpr bool pg_is_span_v = false;
template <class T, std::size_t N> inline constexpr bool pg_is_span_v<std::span<T, N>> = true;

/// A contiguous range of a collective element type that is not already a std::span.
template <class R>
concept pg_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
                   dtype_like<std::ranges::range_value_t<R>> && !pg_is_span_v<std::remove_cvref_t<R>>;
template <class R>
concept pg_any_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> && dtype_like<std::ranges::range_value_t<R>>;

template <class R>
auto pg_span(R&& r) {
  return std::span(std::ranges::data(r), std::ranges::size(r));
}
template <class R>
auto pg_const_span(R&& r) {
  using T = std::remove_cv_t<std::ranges::range_value_t<R>>;
  return std::span<const T>(std::ranges::data(r), std::ranges::size(r));
}

template <class Group>
class pg_range_calls {
 public:
  template <pg_range R, reduce_op Op = sum>
  void all_reduce(R&& data, Op op = {}) { self().all_reduce(pg_span(data), op); }
  template <pg_any_range In, pg_any_range Out, reduce_op Op = sum>
  void all_reduce(In&& in, Out&& out, Op op = {}) { self().all_reduce(pg_const_span(in), pg_span(out), op); }
  template <pg_range R, reduce_op Op = sum>
  work all_reduce_async(R&& data, Op op = {}) { return self().all_reduce_async(pg_span(data), op); }
  template <pg_range R>
  void broadcast(R&& data, int root) { self().broadcast(pg_span(data), root); }
  template <pg_range R>
  work broadcast_async(R&& data, int root) { return self().broadcast_async(pg_span(data), root); }
  template <pg_range R, reduce_op Op = sum>
  void reduce(R&& data, int root, Op op = {}) { self().reduce(pg_span(data), root, op); }
  template <pg_any_range In, pg_any_range Out>
  void all_gather(In&& in, Out&& out) { self().all_gather(pg_const_span(in), pg_span(out)); }
  template <pg_any_range In, pg_any_range Out>
  work all_gather_async(In&& in, Out&& out) { return self().all_gather_async(pg_const_span(in), pg_span(out)); }
  template <pg_any_range In, pg_any_range Out, reduce_op Op = sum>
  void reduce_scatter(In&& in, Out&& out, Op op = {}) { self().reduce_scatter(pg_const_span(in), pg_span(out), op); }
  template <pg_any_range In, pg_any_range Out, reduce_op Op = sum>
  work reduce_scatter_async(In&& in, Out&& out, Op op = {}) {
    return self().reduce_scatter_async(pg_const_span(in), pg_span(out), op);
  }
  template <pg_any_range In, pg_any_range Out>
  void all_to_all(In&& in, Out&& out) { self().all_to_all(pg_const_span(in), pg_span(out)); }
  template <pg_any_range R>
  void send(R&& data, int peer) { self().send(pg_const_span(data), peer); }
  template <pg_range R>
  void recv(R&& data, int peer) { self().recv(pg_span(data), peer); }

 private:
  Group& self() noexcept { return static_cast<Group&>(*this); }
};

}  // namespace ddp::detail
