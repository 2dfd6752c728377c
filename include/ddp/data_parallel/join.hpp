#pragma once
// join_context: uneven inputs for distributed_data_parallel (PyTorch's Join + DDP's join hook).
//
//   ddp::join_context join{net, group, {.divide_by_initial_world_size = true}};
//   for (auto& batch : my_batches) {               // each rank may have a different number
//     join.begin_step();                           // before the backward of every synchronized step
//     backward(..., [&](std::size_t i) { net.mark_ready(i); });
//     net.finish();
//     step(model);
//   }
//   join.finish();                                 // out of data: shadow the others, then sync
//
// How, and why it does not hang:
//  - begin_step() is one all_reduce (sum) of one int64: 1 from each rank still training, 0 from
//    each joined rank. That is torch's per-iteration "not joined" count (notify_join_context's
//    all_reduce of ones, matched by the joined ranks' all_reduce of zeros).
//  - finish() loops: the same all_reduce with 0; while the count is positive some rank still
//    trains, so this rank runs a shadow step: it zeroes its gradients and calls the wrapper's
//    synchronize(), which issues the very buckets, in the very order and with the same op as the
//    training ranks' mark_ready/finish (the bucket plan is a function of the model, identical on
//    every rank). The zeros add nothing to the sum. Torch's _DDPJoinHook.main_hook does the same
//    (_match_all_reduce_for_bwd_pass with zero buckets).
//  - When the count is 0 every rank is in finish(): one all_reduce (max) of "rank if this rank
//    never shadowed a step, else -1" picks the last rank to join (ties: the highest rank, as
//    torch's _find_common_rank), and every parameter is broadcast from it (_sync_final_model).
//    Joined ranks never step their optimizer, so only a last joiner holds the trained weights.
//  - The divisor: the wrapper averages with ddp::avg, i.e. sum / W, W the group size; the
//    joined ranks' zeros make that torch's divide_by_initial_world_size = true. With false torch
//    divides by the number of ranks that ran this iteration's forward (the count above). Here
//    the join then installs a comm hook on the wrapper: all_reduce(sum) of the bucket, then
//    divide by that step's count. In both modes torch multiplies each rank's gradient by 1/div
//    before summing (the reducer's copy into the bucket); here the sum is divided once, so the
//    two agree to rounding, and bitwise with a plain sum / div whenever the sum is exact. A hook
//    rather than a rescale after finish(): the training loop keeps calling net.finish() and the
//    division is by the count itself, not sum / W * (W / count) with two roundings. (A hooked
//    wrapper hands its last bucket to the communication thread instead of reducing it inline.)
//  - throw_on_early_termination: begin_step() is instead an all_reduce (min) of {W, -1} from a
//    training rank and {its rank, 0} from a rank in finish(): a first value below W means some
//    rank ran out in this iteration, the second below 0 that some rank still trains; then every
//    rank (the one in finish() as well) throws ddp::error(errc::mismatch) naming the rank (the
//    lowest, if several ran out together) and the iteration. When all ranks reach finish()
//    together the inputs were even: no error, parameters synchronized. Torch uses a second
//    all_reduce for the check; one suffices because no count is needed once everyone throws.
//    (Torch's training ranks raise without naming the rank; its joined rank names itself.)
//
// Differences from torch, on purpose:
//  - begin_step() is explicit (torch hooks DDP's forward). Call it once per step that ends in a
//    synchronizing net.finish(); micro-batches under no_sync() communicate nothing and need no
//    shadow, so they need no begin_step() either (torch also all-reduces require_backward_grad_sync
//    every iteration to let joined ranks skip those: here the caller states it by not calling).
//  - The options must be the same on every rank, and `group` must be the group the wrapper was
//    built with (the wrapper does not expose its group).
//  - divide_by_initial_world_size = false replaces any comm hook the wrapper had (it cannot be
//    read back to compose with), and the destructor clears the hook again.
//  - Parameters must be in host memory: a shadow step zeroes the gradients on the CPU.
// Joined ranks count their shadow steps in net.stats().steps; their gradients after finish()
// are meaningless (torch leaves them unspecified too).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel/any_work.hpp"
#include "ddp/data_parallel/bucket_view.hpp"
#include "ddp/data_parallel/distributed_data_parallel.hpp"
#include "ddp/data_parallel/waitable.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

struct join_options {
  /// Average over the initial world size W even when fewer ranks contribute (torch's default);
  /// false: over the ranks still training in that step.
  bool divide_by_initial_world_size = true;
  /// Every rank throws ddp::error (errc::mismatch) in the iteration the first rank runs out.
  bool throw_on_early_termination = false;
  /// false: begin_step() and finish() do nothing (torch's enable=False): inputs must be even.
  bool enable = true;
};

namespace detail {

/// A bucket's sum all-reduce, divided by the step's divisor once it is done.
template <class T, class Work>
class divide_work {
 public:
  divide_work(Work inner, std::span<T> data, std::int64_t divisor)
      : state_(std::make_shared<state>(state{std::move(inner), data, divisor, false})) {}
  void wait() {
    state_->inner.wait();
    divide();
  }
  bool wait(deadline d) {
    if constexpr (deadline_waitable<Work>) {
      if (!state_->inner.wait(d)) return false;
    } else {
      state_->inner.wait();
    }
    divide();
    return true;
  }

 private:
  struct state {
    Work inner;
    std::span<T> data;
    std::int64_t divisor;
    bool done;
  };
  void divide() {
    if (std::exchange(state_->done, true) || state_->divisor == 1) return;
    for (auto& v : state_->data) {
      if constexpr (half_precision<T>) {
        v = static_cast<T>(static_cast<float>(v) / static_cast<float>(state_->divisor));
      } else {
        v = static_cast<T>(v / static_cast<T>(state_->divisor));
      }
    }
  }
  std::shared_ptr<state> state_;  // any_work copies of the handle share one division
};

}  // namespace detail

template <class Params, class Group>
class join_context {
 public:
  using ddp_type = distributed_data_parallel<Params, Group>;

  join_context(ddp_type& net, Group& group, join_options options = {})
      : net_(&net), group_(&group), options_(options), world_(static_cast<std::int64_t>(group.size())), active_(world_) {
    for (std::size_t k = 0; k < net.parameters().size(); ++k) {
      const auto& p = net.parameters()[k];
      if (p.memory != memory_space::host) {
        // Every rank has the same model, so every rank throws here: nobody is left waiting.
        throw error(errc::unavailable,
                    describe_parameter(k, p.name) +
                        " is in device memory: join_context zeroes the gradients of a joined rank on the CPU",
                    {.rank = group.rank(), .op = "join"});
      }
    }
    if (options_.enable && !options_.divide_by_initial_world_size) install_hook();
  }
  join_context(const join_context&) = delete;
  join_context& operator=(const join_context&) = delete;
  ~join_context() {
    if (hooked_) net_->clear_comm_hook();
  }

  /// Before the backward of a synchronized step: agrees with the other ranks on how many train.
  void begin_step() {
    if (!options_.enable) return;
    if (joined_) throw error(errc::invalid_argument, "begin_step() after finish()", context());
    ++step_;
    if (options_.throw_on_early_termination) {
      const auto seen = exchange_termination(false);
      if (seen[0] < world_) throw ran_out(seen[0]);
      active_ = world_;
      return;
    }
    std::int64_t count = 1;
    reduce(std::span<std::int64_t>(&count, 1), sum{});
    active_ = count;
  }

  /// This rank has no more inputs: shadow the others' steps with zero gradients until every rank
  /// is here, then copy the parameters of the last rank to join to every rank.
  void finish() {
    if (!options_.enable) return;
    if (joined_) throw error(errc::invalid_argument, "finish() called twice", context());
    joined_ = true;
    ++step_;  // the iteration this rank has no input for
    if (options_.throw_on_early_termination) {
      const auto seen = exchange_termination(true);
      // Nobody trains any more: every rank ran out in this iteration, an even run, no error.
      if (seen[1] < 0) throw ran_out(seen[0]);
      sync_parameters(true);
      return;
    }
    bool last = true;
    for (;; ++step_) {
      std::int64_t count = 0;
      reduce(std::span<std::int64_t>(&count, 1), sum{});
      if (count == 0) break;
      last = false;
      ++shadowed_;
      active_ = count;
      for (const auto& p : net_->parameters())
        if (!p.grad.empty()) std::memset(p.grad.data(), 0, p.grad.size());
      net_->synchronize();
    }
    sync_parameters(last);
  }

  /// The rank every parameter was broadcast from (after finish(); -1 before).
  int authoritative_rank() const noexcept { return authoritative_; }
  /// How many of the others' steps this rank shadowed in finish().
  std::size_t shadowed_steps() const noexcept { return shadowed_; }
  /// The number of ranks training in the current step (W with throw_on_early_termination).
  std::int64_t active_ranks() const noexcept { return active_; }
  const join_options& options() const noexcept { return options_; }

 private:
  // The blocking all_reduce where the group has one; collective_group only promises the async one.
  template <class Op>
  void reduce(std::span<std::int64_t> v, Op op) {
    if constexpr (requires { group_->all_reduce(v, op); }) {
      group_->all_reduce(v, op);
    } else {
      auto w = group_->all_reduce_async(v, op);
      w.wait();
    }
  }

  error_context context() const { return {.rank = group_->rank(), .op = "join"}; }

  error ran_out(std::int64_t rank) const {
    return error(errc::mismatch,
                 "rank " + std::to_string(rank) + " ran out of inputs before iteration " + std::to_string(step_) +
                     " (throw_on_early_termination: every rank stops in this iteration)",
                 context());
  }

  // One all_reduce (min) of {W, -1} from a training rank, {rank, 0} from a rank out of inputs:
  // [0] < W when some rank ran out (the lowest such rank), [1] < 0 while some rank still trains.
  std::array<std::int64_t, 2> exchange_termination(bool out) {
    std::array<std::int64_t, 2> v = {out ? static_cast<std::int64_t>(group_->rank()) : world_, out ? 0 : -1};
    reduce(std::span<std::int64_t>(v), min{});
    return v;
  }

  void sync_parameters(bool last) {
    // In the throw_on_early_termination mode everyone arrives together: all are last joiners.
    std::int64_t root = last ? static_cast<std::int64_t>(group_->rank()) : -1;
    reduce(std::span<std::int64_t>(&root, 1), max{});
    authoritative_ = static_cast<int>(root);
    if (group_->size() <= 1) return;
    for (const auto& p : net_->parameters()) {
      if (p.value.empty()) continue;
      visit_dtype(p.type, [&](auto tag) {
        using T = typename decltype(tag)::type;
        group_->broadcast(p.template values<T>(), authoritative_);
      });
    }
  }

  void install_hook() {
    net_->set_comm_hook([this](const bucket_view& b, Group& g) {
      return visit_dtype(b.type, [&](auto tag) -> detail::any_work {
        using T = typename decltype(tag)::type;
        auto data = b.as<T>();
        auto inner = g.all_reduce_async(data, sum{});
        return detail::any_work(detail::divide_work<T, decltype(inner)>(std::move(inner), data, active_));
      });
    });
    hooked_ = true;
  }

  ddp_type* net_;
  Group* group_;
  join_options options_;
  std::int64_t world_;
  std::int64_t active_;
  std::size_t step_ = 0;
  std::size_t shadowed_ = 0;
  int authoritative_ = -1;
  bool joined_ = false;
  bool hooked_ = false;
};

template <class Params, class Group>
join_context(distributed_data_parallel<Params, Group>&, Group&) -> join_context<Params, Group>;
template <class Params, class Group>
join_context(distributed_data_parallel<Params, Group>&, Group&, join_options) -> join_context<Params, Group>;

}  // namespace ddp
