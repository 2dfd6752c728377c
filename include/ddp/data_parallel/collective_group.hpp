#pragma once
// collective_group: what distributed_data_parallel needs of a group. Alone so that a group's
// author (and a comm hook) can check against it without the wrapper.

#include <concepts>
#include <cstdint>
#include <span>

#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel/waitable.hpp"

namespace ddp {

/// What distributed_data_parallel needs of a group: ddp::process_group, ddp::group, or your own.
/// Collectives must accept every dtype; all_reduce_async returns something with wait()
/// (optionally wait(deadline) -> bool).
template <class G>
concept collective_group =
    requires(G& g, const G& cg, std::span<float> data, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      { cg.rank() } -> std::convertible_to<int>;
      { cg.size() } -> std::convertible_to<int>;
      g.broadcast(data, 0);
      g.all_gather(in, out);
      { g.all_reduce_async(data, avg{}) } -> detail::waitable;
    };

}  // namespace ddp
