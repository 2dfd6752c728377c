#pragma once
// train_ddp's --precision bf16|fp16: the model's parameters and gradients are stored in bfloat16
// or float16 and the optimizer steps a float32 master copy. The model computes in float32 on the
// widened values (every bfloat16 / float16 is a float), so the only roundings are the storage's:
// the parameters after each step and each rank's gradients after the backward pass.
//
// Each step: this rank's gradients, times the loss scale, are rounded to the low type; the ranks
// average them in float32 (never rounding the mean); the scaler (fp16 only, torch.amp.GradScaler's
// rules) unscales them and the ranks agree whether any overflowed, in which case every rank skips
// the step and the scale backs off; otherwise --clip and the optimizer step the master, which the
// model gets back rounded to nearest even.
//
//   --zero 0: ddp::optim::master_weights over the model, distributed_data_parallel over the master
//             (float32), unscale_and_agree, then the full step on every rank.
//   --zero 1, 2: sharded_data_parallel over the low-precision model with reduce_dtype float32:
//             it keeps the master of this rank's shard, and amp_shard_optimizer unscales, agrees,
//             clips with the global norm and steps it.
//
// bench/torch/train_ddp_cpu.py --precision writes the same job out in torch (a comm hook that
// rounds and averages, a float32 master, GradScaler); tests/data/precision_golden.json holds it.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ddp/data_parallel.hpp"
#include "ddp/group.hpp"
#include "ddp/optim.hpp"
#include "ddp/optim/distributed.hpp"
#include "ddp/optim/master_weights.hpp"
#include "flat_params.hpp"
#include "optimizer.hpp"
#include "options.hpp"

namespace train {

/// What a checkpoint keeps of --precision (checkpoint_state() in train_ddp.cpp names the parts).
struct precision_snapshot {
  std::vector<float> master;
  std::vector<float> loss_scale{1.0f};
  std::vector<std::int32_t> growth_tracker{0};
};

template <ddp::half_precision Low>
class mixed_precision_step {
 public:
  using shard_optimizer = ddp::optim::amp_shard_optimizer<chosen_optimizer, ddp::group>;

  /// Rounds `values` (the model's float32 parameters) to Low and writes them back widened; the
  /// master starts from the rounded values on every rank. Builds the wrapper --zero asks for
  /// (its construction checks shapes on every rank and broadcasts rank 0).
  mixed_precision_step(const options& o, ddp::group& group, chosen_optimizer& optimizer, const std::vector<tensor_slot>& slots,
                       std::span<float> values)
      : clip_(o.clip),
        slots_(&slots),
        group_(&group),
        optimizer_(&optimizer),
        scaler_({.init_scale = o.loss_scale, .enabled = std::same_as<Low, ddp::float16>}),
        shard_step_(optimizer, group, scaler_, {.max_norm = o.clip}),
        values_(values.size()),
        grads_(values.size()),
        model_{values_, grads_, &slots, ddp::memory_space::host} {
    std::transform(values.begin(), values.end(), values_.begin(), [](float x) { return Low(x); });
    if (o.zero == 0) {
      master_.emplace(std::span<const Low>(values_));
      replicated_.emplace(*master_, group);
    } else {
      sharded_.emplace(model_, group, shard_step_, ddp::sharded_options{.stage = o.zero, .reduce_dtype = ddp::dtype::float32});
    }
    widen_into(values);
  }

  /// After the backward pass (`grads`: this rank's float32 gradients): rounds them, times the
  /// loss scale, to Low, averages in float32, steps the master unless some rank overflowed, and
  /// writes the parameters back into `values`, rounded to Low and widened.
  void step(std::span<const float> grads, std::span<float> values) {
    const float scale = scaler_.get_scale();
    std::transform(grads.begin(), grads.end(), grads_.begin(), [&](float g) { return Low(scale == 1.0f ? g : g * scale); });
    bool stepped = true;
    if (master_) {
      master_->load_gradients(std::span<const Low>(grads_));
      replicated_->synchronize();
      const auto verdict = ddp::optim::unscale_and_agree(*group_, scaler_, master_->gradients());
      if (verdict.step) step_replicated(*optimizer_, clip_, *slots_, master_->parameters(), master_->gradients());
      scaler_.update(verdict.found_inf);
      stepped = verdict.step;
      master_->store_parameters(values_);
    } else {
      for (std::size_t i = 0; i < slots_->size(); ++i) sharded_->mark_ready(i);
      sharded_->finish();
      sharded_->step();
      stepped = shard_step_.last().step;
    }
    if (!stepped) ++skipped_steps_;
    widen_into(values);
  }

  float loss_scale() const noexcept { return scaler_.get_scale(); }
  std::int64_t skipped_steps() const noexcept { return skipped_steps_; }

  /// What a checkpoint keeps besides the model and the optimizer: the float32 master (--zero 0:
  /// all of it, the same on every rank; 1 and 2: this rank's shard) and the scaler's state.
  precision_snapshot snapshot() const {
    const std::span<const float> master = master_ ? std::span<const float>(master_->parameters()) : sharded_->shard_parameters();
    const auto& st = scaler_.state();
    return {{master.begin(), master.end()}, {st.scale}, {st.growth_tracker}};
  }
  /// Restores a snapshot after the model's parameters were restored (they are the master
  /// rounded, so values_ is already what it was).
  void restore(const precision_snapshot& in) {
    const std::span<float> master = master_ ? master_->parameters() : sharded_->shard_parameters();
    if (in.master.size() != master.size())
      throw ddp::error(ddp::errc::config, "checkpoint: the float32 master holds " + std::to_string(in.master.size()) +
                                              " values, this rank's has " + std::to_string(master.size()));
    std::copy(in.master.begin(), in.master.end(), master.begin());
    scaler_.load_state({.scale = in.loss_scale.at(0), .growth_tracker = in.growth_tracker.at(0)});
  }

 private:
  void widen_into(std::span<float> values) const {
    std::transform(values_.begin(), values_.end(), values.begin(), [](Low x) { return static_cast<float>(x); });
  }

  double clip_;
  const std::vector<tensor_slot>* slots_;
  ddp::group* group_;
  chosen_optimizer* optimizer_;
  ddp::optim::grad_scaler scaler_;
  shard_optimizer shard_step_;
  std::vector<Low> values_, grads_;
  flat_params<Low> model_;
  std::optional<ddp::optim::master_weights<Low>> master_;
  std::optional<ddp::distributed_data_parallel<ddp::optim::master_weights<Low>, ddp::group>> replicated_;
  std::optional<ddp::sharded_data_parallel<flat_params<Low>, ddp::group, shard_optimizer>> sharded_;
  std::int64_t skipped_steps_ = 0;
};

/// --precision bf16 or fp16 (nothing for fp32).
class mixed_precision {
 public:
  mixed_precision(const options& o, ddp::group& group, chosen_optimizer& optimizer, const std::vector<tensor_slot>& slots,
                  std::span<float> values) {
    // Built in place: the steps hold pointers into themselves.
    if (o.precision == "bf16") bf16_.emplace(o, group, optimizer, slots, values);
    else fp16_.emplace(o, group, optimizer, slots, values);
  }
  void step(std::span<const float> grads, std::span<float> values) {
    bf16_ ? bf16_->step(grads, values) : fp16_->step(grads, values);
  }
  float loss_scale() const { return bf16_ ? bf16_->loss_scale() : fp16_->loss_scale(); }
  std::int64_t skipped_steps() const { return bf16_ ? bf16_->skipped_steps() : fp16_->skipped_steps(); }
  precision_snapshot snapshot() const { return bf16_ ? bf16_->snapshot() : fp16_->snapshot(); }
  void restore(const precision_snapshot& in) { bf16_ ? bf16_->restore(in) : fp16_->restore(in); }

 private:
  std::optional<mixed_precision_step<ddp::bfloat16>> bf16_;
  std::optional<mixed_precision_step<ddp::float16>> fp16_;
};

}  // namespace train
