#pragma once
// What the wrapper reports about itself: bucket_info (buckets()) and data_parallel_stats
// (stats()). Plain data, apart from the class that fills it.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ddp/core/dtype.hpp"

namespace ddp {

/// One bucket, as the statistics report it.
struct bucket_info {
  dtype type = dtype::float32;
  std::vector<std::size_t> parameters;  // descending index order
  std::size_t bytes = 0;
  bool in_place = false;                // reduced in the gradients' own memory, no copy
};

struct data_parallel_stats {
  std::size_t buckets = 0;
  std::size_t in_place_buckets = 0;
  std::uint64_t steps = 0;             // synchronized steps finished
  std::uint64_t skipped_steps = 0;     // finish() calls under no_sync()
  std::uint64_t all_reduces = 0;       // bucket reductions started, in total
  std::uint64_t bytes_last_step = 0;   // gradient bytes reduced in the last synchronized step
  std::uint64_t bytes_total = 0;
  std::uint64_t bytes_copied_last_step = 0;  // copied into and out of bucket buffers
  std::chrono::nanoseconds wait_last_step{0};  // time finish() spent waiting for communication
  std::chrono::nanoseconds wait_total{0};
};

}  // namespace ddp
