#pragma once
// assign_buckets: which parameters share a bucket, and the order buckets are reduced in. A pure
// function of the parameter list, apart from the wrapper so that it can be tested on its own.

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

/// A parameter list's assignment to buckets: reverse parameter order, one dtype per bucket (and
/// one memory space), the first bucket of each dtype capped at first_bucket_bytes and the rest at
/// bucket_cap_bytes; a bucket closes once it reaches its cap. Buckets are ordered by their
/// highest parameter index, descending: the order backward makes them ready, and the order they
/// are reduced in. Each bucket lists its parameters in descending index order.
inline std::vector<std::vector<std::size_t>> assign_buckets(std::span<const parameter_ref> params,
                                                            std::size_t first_bucket_bytes,
                                                            std::size_t bucket_cap_bytes) {
  struct open_bucket {
    dtype type;
    memory_space memory;
    std::vector<std::size_t> indices;
    std::size_t bytes = 0;
    bool first = true;
  };
  std::vector<open_bucket> open;
  std::vector<std::vector<std::size_t>> result;
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    auto it = std::find_if(open.begin(), open.end(), [&](const open_bucket& b) { return b.type == p.type && b.memory == p.memory; });
    if (it == open.end()) it = open.insert(open.end(), open_bucket{p.type, p.memory, {}, 0, true});
    it->indices.push_back(k);
    it->bytes += p.bytes();
    if (it->bytes >= (it->first ? first_bucket_bytes : bucket_cap_bytes)) {
      result.push_back(std::move(it->indices));
      it->indices.clear();
      it->bytes = 0;
      it->first = false;
    }
  }
  for (auto& b : open)
    if (!b.indices.empty()) result.push_back(std::move(b.indices));
  std::stable_sort(result.begin(), result.end(), [](const auto& a, const auto& b) { return a.front() > b.front(); });
  return result;
}

}  // namespace ddp
