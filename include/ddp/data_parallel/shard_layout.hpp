#pragma once
// shard_layout: where every gradient and parameter element lives in sharded_data_parallel's
// padded flat space, and which part of it each rank owns. Pure arithmetic over the parameter
// list, apart from the wrapper so that it can be checked on its own.
//
// Buckets are assign_buckets' (reduce order, one dtype each). Inside a bucket the parameters are
// laid out by ascending index, as in distributed_data_parallel; the bucket is then padded with
// zeros to a multiple of the world size W, so that reduce_scatter and all_gather cut it into W
// equal contiguous shards: rank r owns [r * shard, (r + 1) * shard). A rank's flat shard buffer
// (one per dtype) is its shards of that dtype's buckets, one after the other in bucket order.
// Padding costs at most W - 1 elements per bucket, and nobody outside this layout sees it.

#include <cstddef>
#include <map>
#include <span>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/data_parallel/bucket_plan.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

struct shard_bucket {
  std::size_t index = 0;                 // reduce order
  dtype type = dtype::float32;
  std::vector<std::size_t> parameters;   // ascending index (the bucket's flat order)
  std::vector<std::size_t> offsets;      // element offset of parameters[j] in the bucket
  std::size_t numel = 0;                 // elements of the parameters
  std::size_t padded = 0;                // numel rounded up to a multiple of the world size
  std::size_t shard = 0;                 // padded / world size: what each rank owns
  std::size_t shard_offset = 0;          // where this bucket's shard starts in a rank's shard buffer of its dtype
};

struct shard_layout {
  int world_size = 1;
  std::vector<shard_bucket> buckets;
  std::map<dtype, std::size_t> shard_numel;  // per dtype: one rank's shard buffer length
  std::size_t numel = 0;                      // all parameters' elements
  std::size_t padded = 0;                     // sum of the buckets' padded sizes
  std::size_t largest_padded = 0;             // the largest bucket, padded
  std::size_t largest_shard = 0;              // its shard
};

/// The layout of `params` over `world_size` ranks with assign_buckets' caps.
inline shard_layout make_shard_layout(std::span<const parameter_ref> params, int world_size, std::size_t first_bucket_bytes,
                                      std::size_t bucket_cap_bytes) {
  shard_layout layout;
  layout.world_size = world_size < 1 ? 1 : world_size;
  const auto w = static_cast<std::size_t>(layout.world_size);
  const auto assignment = assign_buckets(params, first_bucket_bytes, bucket_cap_bytes);
  layout.buckets.reserve(assignment.size());
  for (std::size_t b = 0; b < assignment.size(); ++b) {
    shard_bucket sb;
    sb.index = b;
    sb.type = params[assignment[b].front()].type;
    sb.parameters.assign(assignment[b].rbegin(), assignment[b].rend());
    for (std::size_t k : sb.parameters) {
      sb.offsets.push_back(sb.numel);
      sb.numel += params[k].numel();
    }
    sb.shard = (sb.numel + w - 1) / w;
    sb.padded = sb.shard * w;
    auto& total = layout.shard_numel[sb.type];
    sb.shard_offset = total;
    total += sb.shard;
    layout.numel += sb.numel;
    layout.padded += sb.padded;
    if (sb.padded > layout.largest_padded) {
      layout.largest_padded = sb.padded;
      layout.largest_shard = sb.shard;
    }
    layout.buckets.push_back(std::move(sb));
  }
  return layout;
}

/// Calls f(parameter, first element in the parameter, first element in the shard, count) for each
/// piece of a parameter that falls into `rank`'s shard of bucket b (padding is in no parameter).
template <class F>
void for_each_owned(const shard_bucket& b, int rank, F&& f) {
  const std::size_t begin = static_cast<std::size_t>(rank) * b.shard, end = begin + b.shard;
  for (std::size_t j = 0; j < b.parameters.size(); ++j) {
    const std::size_t first = b.offsets[j];
    const std::size_t last = j + 1 < b.parameters.size() ? b.offsets[j + 1] : b.numel;
    const std::size_t lo = first > begin ? first : begin, hi = last < end ? last : end;
    if (lo < hi) f(b.parameters[j], lo - first, lo - begin, hi - lo);
  }
}

}  // namespace ddp
