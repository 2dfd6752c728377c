#pragma once
// ddp::rank_numbering: the number each rank of a group goes by in messages. A level of the ring
// backend's hierarchy (a host's shared memory, the hosts' leaders) is a group with ranks of its
// own (0..n-1), yet its errors must name the ranks the user knows: the transports and
// communicators of a level format every rank through the numbering their topology carries
// (rank_topology::part). Everywhere else a rank goes by its own number.

#include <concepts>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ddp {

/// The number each rank of a group goes by in messages: its own, or, for a part of a larger
/// group that works on the larger group's behalf, its number there.
class rank_numbering {
 public:
  rank_numbering() = default;
  explicit rank_numbering(std::vector<int> numbers) : numbers_(std::move(numbers)) {}

  int operator()(int r) const noexcept {
    return r >= 0 && static_cast<std::size_t>(r) < numbers_.size() ? numbers_[static_cast<std::size_t>(r)] : r;
  }
  /// "rank N", N as rank r goes by.
  std::string rank(int r) const { return "rank " + std::to_string((*this)(r)); }
  /// "N, M, ..." for a list of ranks.
  template <class Ranks>
  std::string list(const Ranks& ranks) const {
    std::string out;
    for (const auto r : ranks) out += (out.empty() ? "" : ", ") + std::to_string((*this)(static_cast<int>(r)));
    return out;
  }

 private:
  std::vector<int> numbers_;  // empty: every rank goes by its own number
};

/// The numbering of a transport that has one (tcp, shm), else every rank's own number.
template <class Transport>
const rank_numbering& numbering_of(const Transport& t) noexcept {
  if constexpr (requires { { t.numbering() } noexcept -> std::same_as<const rank_numbering&>; }) {
    return t.numbering();
  } else {
    static const rank_numbering own;
    return own;
  }
}

}  // namespace ddp
