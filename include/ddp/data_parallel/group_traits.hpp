#pragma once
// What distributed_data_parallel detects on a group beyond collective_group, each one member
// whose absence has one meaning: copy_memory, whole collective_call records, its memory space.

#include <concepts>
#include <cstddef>
#include <type_traits>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/work.hpp"

namespace ddp::detail {

/// The group copies memory in its backend's space (device memory): group.copy_memory(dst, src, n).
template <class G>
concept copies_memory = requires(G& g, void* dst, const void* src, std::size_t n) { g.copy_memory(dst, src, n); };

/// A group that takes a whole collective_call (process_group over a backend with call records,
/// ddp::group): a bucket goes down as (dtype, bytes), never as a type.
template <class G>
concept takes_call_records = requires(G& g, const collective_call& c) {
  { g.call(c, true) } -> std::same_as<work>;
};

/// The memory space a group's collectives work on: g.memory(), G::memory, G's backend's, or host.
template <class G>
memory_space group_memory(G& g) {
  if constexpr (requires { { g.memory() } -> std::convertible_to<memory_space>; }) {
    return g.memory();
  } else if constexpr (requires { { G::memory } -> std::convertible_to<memory_space>; }) {
    return G::memory;
  } else if constexpr (requires { { std::remove_cvref_t<decltype(g.backend())>::memory } -> std::convertible_to<memory_space>; }) {
    return std::remove_cvref_t<decltype(g.backend())>::memory;
  } else {
    return memory_space::host;
  }
}

}  // namespace ddp::detail
