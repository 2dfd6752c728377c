#pragma once
// ddp::distributed_sampler: torch.utils.data.distributed.DistributedSampler, index for index.
//
// Same semantics as torch 2.15 (checked against every case of tests/data/sampler.json):
//   * order: randperm(n) from a torch_generator seeded with seed + epoch when shuffling, else 0..n-1;
//   * num_samples = ceil((n - W) / W) when drop_last and n % W != 0, else ceil(n / W);
//     total_size = num_samples * W;
//   * without drop_last the order is padded to total_size by repeating it from the start (as often
//     as needed, also when the padding is longer than n); with drop_last it is cut to total_size;
//   * this rank gets positions rank, rank + W, rank + 2W, ... of that list.
// Beyond torch, for the two mistakes its users keep making:
//   * iterating a shuffled sampler a second time in the same epoch (set_epoch() forgotten) prints a
//     one-time warning, through an injectable sink;
//   * exact() is this rank's share of the samples without the padding duplicates: the ranks' exact()
//     lists together hold every sample exactly once, so evaluation metrics do not depend on W.
// shard_indices() applies the same padding and striding to any index sequence (a weighted
// sampler's draw, a filtered subset). A sampler is not thread-safe, like torch's.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"
#include "ddp/random/distributions.hpp"
#include "ddp/random/generator.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <iostream>
#endif

namespace ddp {

struct sampler_options {
  bool shuffle = true;
  std::int64_t seed = 0;   // the permutation of epoch e uses seed + e, as torch does
  bool drop_last = false;  // cut the tail instead of padding it (every rank gets floor(n / W))
  // Where warnings go; empty: std::cerr. Tests and loggers replace it.
  std::function<void(std::string_view)> warn = {};
};

namespace detail {

/// Writes a sampler warning to std::cerr: out of line, so that a compiled-library user's file does
/// not parse <iostream> for it.
void print_sampler_warning(const std::string& message);

inline void check_replicas(std::int64_t num_replicas, std::int64_t rank, const char* op) {
  if (rank >= num_replicas || rank < 0 || num_replicas < 1) {
    // torch's ValueError text first, so messages match PyTorch's; then what to do about it.
    std::string message = "Invalid rank " + std::to_string(rank) + ", rank should be in the interval [0, " +
                          std::to_string(num_replicas - 1) + "]";
    message += num_replicas < 1 ? " (num_replicas = " + std::to_string(num_replicas) + ": it must be at least 1)"
                                : " (num_replicas = " + std::to_string(num_replicas) +
                                      ": pass the process group's rank() and size())";
    throw error(errc::invalid_argument, message, {.op = op});
  }
}

template <std::integral T>
std::int64_t checked_int64(T value, const char* what, const char* op) {
  if constexpr (std::is_unsigned_v<T>) {
    if (static_cast<std::uintmax_t>(value) > static_cast<std::uintmax_t>(std::numeric_limits<std::int64_t>::max()))
      throw error(errc::invalid_argument, std::string(what) + " " + std::to_string(value) + " does not fit in int64",
                  {.op = op});
  } else {
    if (static_cast<std::intmax_t>(value) < std::numeric_limits<std::int64_t>::min() ||
        static_cast<std::intmax_t>(value) > std::numeric_limits<std::int64_t>::max())
      throw error(errc::invalid_argument, std::string(what) + " " + std::to_string(value) + " does not fit in int64",
                  {.op = op});
  }
  return static_cast<std::int64_t>(value);
}

// torch: ceil((n - W) / W) when drop_last and n % W != 0 (that is floor(n / W), 0 when n < W),
// else ceil(n / W).
inline std::int64_t sampler_num_samples(std::int64_t n, std::int64_t num_replicas, bool drop_last) noexcept {
  if (drop_last && n % num_replicas != 0) return n / num_replicas;
  return n / num_replicas + (n % num_replicas != 0 ? 1 : 0);
}

// Positions rank, rank + W, ... below total_size of `base` padded by repetition (position p is
// base[p % n]); with `exact`, only the positions below n, i.e. no padding duplicates.
inline std::vector<std::int64_t> stride_positions(std::span<const std::int64_t> base, std::int64_t num_replicas,
                                                  std::int64_t rank, std::int64_t total_size, bool exact) {
  const auto n = static_cast<std::int64_t>(base.size());
  const std::int64_t end = exact ? n : total_size;
  std::vector<std::int64_t> out;
  if (rank < end) out.reserve(static_cast<std::size_t>((end - rank + num_replicas - 1) / num_replicas));
  for (std::int64_t p = rank; p < end; p += num_replicas) out.push_back(base[static_cast<std::size_t>(p % n)]);
  return out;
}

inline void check_batch_size(std::int64_t batch_size) {
  if (batch_size < 1)
    throw error(errc::invalid_argument,
                "batch_size should be a positive integer value, but got batch_size=" + std::to_string(batch_size),
                {.op = "batches"});
}

}  // namespace detail

/// Consecutive batches of an index list, like a DataLoader's: each batch is a span of up to
/// batch_size indices; the last partial batch is kept unless drop_last_batch is set.
/// It may share ownership of the list (a sampler's), so it stays valid after set_epoch().
class index_batches {
 public:
  class iterator {
   public:
    using value_type = std::span<const std::int64_t>;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::forward_iterator_tag;
    using iterator_category = std::forward_iterator_tag;

    iterator() = default;
    value_type operator*() const noexcept {
      return {pos_, static_cast<std::size_t>(std::min<std::ptrdiff_t>(step_, end_ - pos_))};
    }
    iterator& operator++() noexcept {
      pos_ += std::min<std::ptrdiff_t>(step_, end_ - pos_);
      return *this;
    }
    iterator operator++(int) noexcept {
      auto copy = *this;
      ++*this;
      return copy;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.pos_ == b.pos_; }

   private:
    friend class index_batches;
    iterator(const std::int64_t* pos, const std::int64_t* end, std::ptrdiff_t step) noexcept
        : pos_(pos), end_(end), step_(step) {}
    const std::int64_t* pos_ = nullptr;
    const std::int64_t* end_ = nullptr;
    std::ptrdiff_t step_ = 1;
  };

  index_batches(std::span<const std::int64_t> indices, std::int64_t batch_size, bool drop_last_batch = false,
                std::shared_ptr<const void> owner = {})
      : indices_(indices), owner_(std::move(owner)) {
    detail::check_batch_size(batch_size);
    step_ = static_cast<std::ptrdiff_t>(std::min<std::int64_t>(batch_size, std::numeric_limits<std::ptrdiff_t>::max()));
    if (drop_last_batch) indices_ = indices_.first(indices_.size() - indices_.size() % static_cast<std::size_t>(step_));
  }

  iterator begin() const noexcept { return {indices_.data(), indices_.data() + indices_.size(), step_}; }
  iterator end() const noexcept {
    const auto* last = indices_.data() + indices_.size();
    return {last, last, step_};
  }
  /// Number of batches.
  std::size_t size() const noexcept {
    return (indices_.size() + static_cast<std::size_t>(step_) - 1) / static_cast<std::size_t>(step_);
  }
  bool empty() const noexcept { return indices_.empty(); }
  std::span<const std::int64_t> operator[](std::size_t i) const noexcept {
    const std::size_t from = i * static_cast<std::size_t>(step_);
    return indices_.subspan(from, std::min(static_cast<std::size_t>(step_), indices_.size() - from));
  }

  /// The same batches without the first `count` (all of them when count >= size()): where a run
  /// resumed from a checkpoint taken `count` steps into the epoch continues.
  index_batches skip(std::size_t count) const {
    index_batches rest = *this;
    const std::size_t from = std::min(count, size()) * static_cast<std::size_t>(step_);
    rest.indices_ = indices_.subspan(std::min(from, indices_.size()));
    return rest;
  }

 private:
  std::span<const std::int64_t> indices_;
  std::ptrdiff_t step_ = 1;
  std::shared_ptr<const void> owner_;
};

/// Batches of any index list; the list must outlive the result.
inline index_batches batches(std::span<const std::int64_t> indices, std::int64_t batch_size,
                             bool drop_last_batch = false) {
  return index_batches(indices, batch_size, drop_last_batch);
}

/// DistributedSampler's padding and striding applied to `base` instead of 0..n-1: the result is
/// what this rank gets when the sampler's order is `base` (n = base.size()).
inline std::vector<std::int64_t> shard_indices(std::span<const std::int64_t> base, std::int64_t num_replicas,
                                               std::int64_t rank, bool drop_last = false) {
  detail::check_replicas(num_replicas, rank, "shard_indices");
  const auto n = static_cast<std::int64_t>(base.size());
  const std::int64_t total = detail::sampler_num_samples(n, num_replicas, drop_last) * num_replicas;
  return detail::stride_positions(base, num_replicas, rank, total, false);
}

/// This rank's share of `base` with no padding duplicates: over all ranks, each element once.
inline std::vector<std::int64_t> shard_indices_exact(std::span<const std::int64_t> base, std::int64_t num_replicas,
                                                     std::int64_t rank) {
  detail::check_replicas(num_replicas, rank, "shard_indices");
  return detail::stride_positions(base, num_replicas, rank, 0, true);
}

class distributed_sampler {
 public:
  using value_type = std::int64_t;
  using iterator = std::vector<std::int64_t>::const_iterator;

  /// n = len(dataset). Any integer types (a container's size(), a group's int rank); a rank
  /// outside [0, num_replicas) or num_replicas < 1 is errc::invalid_argument, as in torch.
  template <std::integral N, std::integral W, std::integral R>
  distributed_sampler(N dataset_size, W num_replicas, R rank, sampler_options options = {})
      : n_(detail::checked_int64(dataset_size, "dataset size", "distributed_sampler")),
        num_replicas_(detail::checked_int64(num_replicas, "num_replicas", "distributed_sampler")),
        rank_(detail::checked_int64(rank, "rank", "distributed_sampler")),
        options_(std::move(options)) {
    detail::check_replicas(num_replicas_, rank_, "distributed_sampler");
    if (n_ < 0)
      throw error(errc::invalid_argument, "dataset size must be >= 0, got " + std::to_string(n_),
                  {.op = "distributed_sampler"});
    num_samples_ = detail::sampler_num_samples(n_, num_replicas_, options_.drop_last);
    total_size_ = num_samples_ * num_replicas_;
  }

  /// Selects the permutation of the coming epoch; call it at the start of every epoch.
  void set_epoch(std::int64_t epoch) noexcept { epoch_ = epoch; }
  std::int64_t epoch() const noexcept { return epoch_; }

  /// This rank's number of indices per epoch (torch's num_samples, len(sampler)).
  std::size_t size() const noexcept { return static_cast<std::size_t>(num_samples_); }
  std::int64_t num_samples() const noexcept { return num_samples_; }
  std::int64_t total_size() const noexcept { return total_size_; }
  std::int64_t dataset_size() const noexcept { return n_; }
  std::int64_t num_replicas() const noexcept { return num_replicas_; }
  std::int64_t rank() const noexcept { return rank_; }
  const sampler_options& options() const noexcept { return options_; }

  /// Iteration, like iter(sampler): one pass over this epoch's indices. The iterators stay valid
  /// until the next pass after a set_epoch() to a different epoch.
  iterator begin() const {
    note_pass();
    return lists().indices.begin();
  }
  iterator end() const { return lists().indices.end(); }

  /// This epoch's indices for this rank (does not count as a pass).
  const std::vector<std::int64_t>& indices() const { return lists().indices; }

  /// A pass in batches: consecutive chunks of batch_size indices, the last partial one kept
  /// (DataLoader's default) unless drop_last_batch. Valid across later set_epoch() calls.
  index_batches batches(std::int64_t batch_size, bool drop_last_batch = false) const {
    detail::check_batch_size(batch_size);
    note_pass();
    const auto& current = lists_ptr();
    return index_batches(current->indices, batch_size, drop_last_batch, current);
  }

  /// batches(batch_size, drop_last_batch) from batch `start_batch` on: the rest of an epoch that a
  /// checkpoint interrupted after start_batch steps (see ddp/checkpoint.hpp, sampler_position).
  /// Counts as a pass, like batches().
  index_batches batches_from(std::int64_t batch_size, std::int64_t start_batch, bool drop_last_batch = false) const {
    if (start_batch < 0)
      throw error(errc::invalid_argument, "start_batch must be >= 0, got " + std::to_string(start_batch),
                  {.op = "batches_from"});
    return batches(batch_size, drop_last_batch).skip(static_cast<std::size_t>(start_batch));
  }

  /// This rank's share without padding duplicates, whatever drop_last says: the ranks' exact()
  /// lists partition 0..n-1, so sums and counts reduced over ranks equal a one-process evaluation.
  /// Ranks may differ in length by one, so reduce (sum, count) pairs, not per-rank means.
  const std::vector<std::int64_t>& exact() const { return lists().exact; }
  index_batches exact_batches(std::int64_t batch_size, bool drop_last_batch = false) const {
    const auto& current = lists_ptr();
    return index_batches(current->exact, batch_size, drop_last_batch, current);
  }

  /// How many of this rank's indices() are padding duplicates (0 or 1; 0 with drop_last).
  std::int64_t num_padded() const noexcept {
    if (options_.drop_last || num_samples_ == 0) return 0;
    const std::int64_t last = rank_ + (num_samples_ - 1) * num_replicas_;
    return last >= n_ ? 1 : 0;
  }

  /// The permutation of 0..n-1 (or 0..n-1 itself without shuffle) that epoch `epoch` uses.
  std::vector<std::int64_t> epoch_order(std::int64_t epoch) const {
    if (!options_.shuffle) {
      std::vector<std::int64_t> order(static_cast<std::size_t>(n_));
      std::iota(order.begin(), order.end(), std::int64_t{0});
      return order;
    }
    // torch: g.manual_seed(self.seed + self.epoch); wraps like two's complement, then mod 2^32.
    torch_generator gen{static_cast<std::uint64_t>(options_.seed) + static_cast<std::uint64_t>(epoch)};
    return randperm(n_, gen);
  }

 private:
  struct epoch_lists {
    std::int64_t epoch = 0;
    std::vector<std::int64_t> indices;
    std::vector<std::int64_t> exact;
  };

  const std::shared_ptr<const epoch_lists>& lists_ptr() const {
    if (!lists_ || lists_->epoch != epoch_) {
      auto fresh = std::make_shared<epoch_lists>();
      fresh->epoch = epoch_;
      const auto order = epoch_order(epoch_);
      fresh->indices = detail::stride_positions(order, num_replicas_, rank_, total_size_, false);
      fresh->exact = detail::stride_positions(order, num_replicas_, rank_, 0, true);
      lists_ = std::move(fresh);
    }
    return lists_;
  }
  const epoch_lists& lists() const { return *lists_ptr(); }

  // A second pass over the same shuffled epoch repeats the order: almost always a forgotten set_epoch().
  void note_pass() const {
    if (options_.shuffle && last_pass_epoch_ == epoch_ && !warned_) {
      warned_ = true;
      const std::string message = "ddp: distributed_sampler iterated again for epoch " + std::to_string(epoch_) +
                                  " without set_epoch(): the order repeats; call set_epoch(epoch) at the start of "
                                  "every epoch";
      if (options_.warn)
        options_.warn(message);
      else
        detail::print_sampler_warning(message);
    }
    last_pass_epoch_ = epoch_;
  }

  std::int64_t n_ = 0;
  std::int64_t num_replicas_ = 1;
  std::int64_t rank_ = 0;
  sampler_options options_;
  std::int64_t num_samples_ = 0;
  std::int64_t total_size_ = 0;
  std::int64_t epoch_ = 0;
  mutable std::shared_ptr<const epoch_lists> lists_;
  mutable std::optional<std::int64_t> last_pass_epoch_;
  mutable bool warned_ = false;
};

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE void detail::print_sampler_warning(const std::string& message) { std::cerr << message << '\n'; }
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
