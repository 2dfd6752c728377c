#pragma once
// ddp::optim distributed halves of grad_scaler.hpp and clip.hpp: the few collectives that make
// every rank take the same decision and clip with the same norm.
//
//   DDP (gradients identical on every rank after finish()):
//     auto v = ddp::optim::unscale_and_agree(group, scaler, grads);   // unscale + one all_reduce(max)
//     if (v.step) { ddp::optim::clip_grad_norm(group, grads, 1.0, grad_layout::replicated); opt.step(...); }
//     scaler.update(v.found_inf);
//
//   sharded_data_parallel (ZeRO-1/2): it hands the optimizer its shard gradient read-only
//   (shard_gradients() is std::span<const T>) and step() always runs the optimizer, so the
//   unscale, the agreement, the clip and the skip happen inside the optimizer it steps:
//     ddp::optim::amp_shard_optimizer amp{opt, group, scaler, {.max_norm = 1.0}};
//     ddp::sharded_data_parallel net{model, group, amp, {.stage = 2}};
//     ... backward(scaler.scale(loss)); net.finish(); net.step();   // amp also calls scaler.update
//
// Why the agreement: an inf in one rank's local gradient reaches only the rank whose shard holds
// that element after reduce_scatter (and only that rank when each rank unscales its own
// gradients before reducing). A rank that steps while another skips puts the replicas out of
// step for good, and their scales diverge from then on (the fairscale ShardedGradScaler /
// torch ZeRO issue where only one rank saw the inf). One all_reduce(max) of a flag fixes both.
//
// Why the sharded norm is a sum of squares: each rank owns a disjoint part of the gradients
// (sharded_data_parallel's padding is zero: launch() zero-fills [numel, padded) of every bucket
// before the reduce_scatter, so padded shard elements add 0). One all_reduce(sum) in double of
// each rank's total_norm_squared gives the global squared norm; T(sqrt) of it is within
// sharded_norm_exact_bound of the exact norm, and within sharded_norm_torch_bound of torch's
// single-process clip_grad_norm_ (clip.hpp's (n/8 + 16) * 2^-24 relative for float: torch sums in
// float lanes, this in double). The replicated form is clip.hpp's clip_grad_norm itself: torch's
// algorithm, within vector_norm_ulp_bound + 1 ulps of torch, no communication.
//
// Every rank must call these in the same order with the same layout and scaler.enabled(): they
// are collectives (a disabled scaler communicates nothing, as torch's disabled GradScaler).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "ddp/core/reduce_op.hpp"
#include "ddp/optim/clip.hpp"
#include "ddp/optim/grad_scaler.hpp"

namespace ddp::optim {

/// Whether any rank saw an inf or NaN: one all_reduce(max) of an int32 flag (any group with
/// all_reduce(std::span<std::int32_t>, ddp::max)).
template <class Group>
bool found_inf_anywhere(Group& group, bool found_inf_here) {
  std::int32_t flag = found_inf_here ? 1 : 0;
  group.all_reduce(std::span<std::int32_t>(&flag, 1), ddp::max{});
  return flag != 0;
}

/// unscale_and_agree's verdict: pass found_inf to scaler.update(), step when step.
struct agreed_step {
  bool found_inf = false;  // some rank saw an inf or NaN (the same on every rank)
  bool step = true;        // scaler.should_step(found_inf)
};

/// Unscales this rank's gradients (DDP: the full ones; ZeRO: this rank's shard), then agrees on
/// found_inf across the group (also counting earlier unscale() calls since the last update()).
/// The caller steps when .step and calls scaler.update(.found_inf).
template <class Group, std::floating_point T>
agreed_step unscale_and_agree(Group& group, grad_scaler& scaler, const std::vector<std::span<T>>& grads) {
  if (!scaler.enabled()) {
    return {};
  }
  for (const std::span<T> g : grads) {
    scaler.unscale(g);
  }
  const bool inf = found_inf_anywhere(group, scaler.found_inf());
  return {inf, scaler.should_step(inf)};
}

template <class Group, std::floating_point T, std::floating_point... More>
agreed_step unscale_and_agree(Group& group, grad_scaler& scaler, std::span<T> first, std::span<More>... rest) {
  static_assert((std::same_as<T, More> && ...), "ddp::optim::unscale_and_agree: every gradient span must be of the same type");
  return unscale_and_agree(group, scaler, std::vector<std::span<T>>{first, rest...});
}

/// Whether each rank holds the same full gradients (DDP after finish()) or a disjoint shard of them.
enum class grad_layout { replicated, sharded };

/// Relative bound of the sharded norm against the exact norm of n gradient elements over W ranks:
/// the double sum of n squares and W partials (at most (n + W) * 2^-53 relative, squares are
/// exact in double for float), halved by sqrt, then one rounding to T.
template <std::floating_point T>
constexpr double sharded_norm_exact_bound(std::size_t n, int world_size) noexcept {
  return static_cast<double>(std::numeric_limits<T>::epsilon()) / 2 +
         (static_cast<double>(n) + static_cast<double>(world_size) + 2.0) * std::numeric_limits<double>::epsilon() / 2;
}

/// Relative bound of the sharded norm against torch's single-process clip_grad_norm_ over the
/// same n elements: clip.hpp's (n/8 + 16) * 2^-24 (torch's float rounding; in T's epsilon) plus
/// this form's own rounding.
template <std::floating_point T>
constexpr double sharded_norm_torch_bound(std::size_t n, int world_size) noexcept {
  return (static_cast<double>(n / 8) + 16.0) * static_cast<double>(std::numeric_limits<T>::epsilon()) / 2 +
         sharded_norm_exact_bound<T>(n, world_size);
}

/// torch.nn.utils.clip_grad_norm_ across a group; returns the total norm (before clipping), the
/// same on every rank. replicated: clip.hpp's clip_grad_norm, no communication (every rank has the
/// same gradients, so the same norm). sharded: one all_reduce(sum) in double of this rank's
/// squared norm, then each shard *= clip_coefficient(max_norm, global norm).
template <class Group, std::floating_point T>
T clip_grad_norm(Group& group, const std::vector<std::span<T>>& grads, double max_norm, grad_layout layout) {
  if (layout == grad_layout::replicated) {
    return clip_grad_norm(grads, max_norm);
  }
  double squared = 0.0;
  for (const std::span<T> g : grads) {
    squared += total_norm_squared(std::span<const T>(g.data(), g.size()));
  }
  group.all_reduce(std::span<double>(&squared, 1), ddp::sum{});
  const T total = static_cast<T>(std::sqrt(squared));
  clip_grads_with_norm(grads, max_norm, total);
  return total;
}

struct amp_shard_options {
  /// > 0: clip the shard gradients to this global norm (after unscaling, on steps taken).
  double max_norm = 0.0;
};

/// An optimizer for sharded_data_parallel that unscales its shard gradient, agrees on found_inf,
/// clips with the global norm, steps the wrapped optimizer or skips, and calls scaler.update()
/// (torch's scaler.unscale_ / clip_grad_norm_ / scaler.step / scaler.update on a ZeRO shard).
/// The shard gradient arrives as std::span<const T>, so it is copied once per step into a
/// buffer of the shard's size (sharded_data_parallel has no mutable shard_gradients() accessor
/// nor a hook between the reduction and the optimizer). A skipped step leaves the master shard
/// as it was, so the all_gather after it restores the parameters unchanged; the wrapper's step
/// state resets either way. The group's collectives run inside sharded_data_parallel::step(),
/// after its reduce_scatters finished and before its all_gathers start, on every rank alike.
template <class Optimizer, class Group>
class amp_shard_optimizer {
 public:
  using value_type = typename Optimizer::value_type;

  /// The optimizer, group and scaler must outlive this object (held by reference).
  amp_shard_optimizer(Optimizer& inner, Group& group, grad_scaler& scaler, amp_shard_options options = {})
      : inner_(&inner), group_(&group), scaler_(&scaler), options_(options) {}

  void step(std::span<value_type> params, std::span<const value_type> grads) {
    grads_.assign(grads.begin(), grads.end());
    const std::vector<std::span<value_type>> mine{std::span<value_type>(grads_)};
    last_ = unscale_and_agree(*group_, *scaler_, mine);
    last_norm_ = std::numeric_limits<value_type>::quiet_NaN();
    if (last_.step) {
      if (options_.max_norm > 0.0) {
        last_norm_ = clip_grad_norm(*group_, mine, options_.max_norm, grad_layout::sharded);
      }
      inner_->step(params, std::span<const value_type>(grads_));
    }
    scaler_->update(last_.found_inf);
  }

  /// The last step's verdict, and its global norm (NaN when not clipped or skipped).
  const agreed_step& last() const noexcept { return last_; }
  value_type last_norm() const noexcept { return last_norm_; }
  /// The wrapped optimizer's state, so that sharded_stats counts its bytes.
  decltype(auto) state() const
    requires requires(const Optimizer& o) { o.state(); }
  {
    return inner_->state();
  }
  Optimizer& inner() noexcept { return *inner_; }

 private:
  Optimizer* inner_;
  Group* group_;
  grad_scaler* scaler_;
  amp_shard_options options_;
  std::vector<value_type> grads_;
  agreed_step last_;
  value_type last_norm_ = std::numeric_limits<value_type>::quiet_NaN();
};

}  // namespace ddp::optim
