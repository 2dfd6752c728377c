#pragma once
// What distributed_data_parallel asks of a work handle (a group's all_reduce_async result, or a
// comm hook's): wait(), and optionally wait(deadline) -> bool; is_completed() for ddp/compression.hpp.
// Apart from the group concept because work handles and hooks need it without the group.

#include <concepts>

#include "ddp/core/deadline.hpp"

namespace ddp::detail {

template <class W>
concept waitable = requires(W& w) { w.wait(); };
template <class W>
concept deadline_waitable = requires(W& w, deadline d) {
  { w.wait(d) } -> std::convertible_to<bool>;
};
template <class W>
concept completion_queryable = requires(const W& w) {
  { w.is_completed() } -> std::convertible_to<bool>;
};

}  // namespace ddp::detail
