#pragma once
// data_parallel_options: the wrapper's settings. Plain data, apart from the class that reads them
// (the libtorch adapter's options hold one too).

#include <cstddef>

namespace ddp {

struct data_parallel_options {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Start each bucket's all-reduce as soon as it is ready (false: all of them in finish()).
  bool overlap = true;
  /// Broadcast parameter values from rank 0 at construction.
  bool broadcast_parameters = true;
  /// Parameters not marked ready by finish() count as zero gradient instead of being an error.
  bool find_unused_parameters = false;
  /// finish() reduces the last bucket on the calling thread (blocking all_reduce) instead of
  /// mark_ready starting it asynchronously. Applies without a comm hook, with more than one rank,
  /// when the group has a blocking all_reduce and finish() has no deadline of its own.
  bool reduce_last_bucket_inline = true;
};

}  // namespace ddp
