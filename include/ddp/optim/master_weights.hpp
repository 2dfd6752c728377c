#pragma once
// ddp::optim::master_weights<Low>: a float32 master copy of a model whose parameters are
// float16 or bfloat16, for distributed_data_parallel (sharded_data_parallel keeps its own, over
// the shard). The model computes in Low; the optimizer steps the float32 copy; the model gets it
// back rounded to nearest even.
//
//   ddp::optim::master_weights<ddp::bfloat16> master(model_values);   // widened copy
//   ddp::optim::sgd<float> opt({.lr = 0.05, .momentum = 0.9});
//   // a) reduce in the model's dtype: DDP over the bf16 model, then widen the mean
//   //      (net.set_comm_hook(ddp::reduce_in_float32) makes any backend add in float32)
//   net.finish(); master.load_gradients(model_grads);
//   // b) reduce in float32: widen first, DDP over the master (a parameter container itself)
//   master.load_gradients(model_grads); master_net.synchronize();
//   opt.step(master.parameters(), master.gradients());
//   master.store_parameters(model_values);
//
// b) never rounds the mean to Low; a) rounds it once (the ring backend adds half-precision
// data in float32 and rounds the result once, with or without the hook). Memory: 4 bytes of
// master and 4 of master gradient per parameter besides the model's own 2 + 2.
//
// load_gradients can unscale as it widens: g * inv_scale in float, which is grad_scaler's
// unscale() of the widened gradient bit for bit (pass scaler.inv_scale(), and agree on the
// returned flag across ranks as unscale_and_agree does).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/parameters.hpp"

namespace ddp::optim {

template <half_precision Low>
class master_weights {
 public:
  using low_type = Low;
  using value_type = float;

  /// The float32 copy of `params` (exact: every Low is a float); gradients start at zero.
  explicit master_weights(std::span<const Low> params) : values_(params.size()), grads_(params.size(), 0.0f) {
    std::transform(params.begin(), params.end(), values_.begin(), [](Low x) { return static_cast<float>(x); });
  }

  std::size_t size() const noexcept { return values_.size(); }
  std::span<float> parameters() noexcept { return values_; }
  std::span<const float> parameters() const noexcept { return values_; }
  std::span<float> gradients() noexcept { return grads_; }
  std::span<const float> gradients() const noexcept { return grads_; }

  /// gradients() = float(grads) * inv_scale (the multiplication skipped when inv_scale is 1).
  /// Returns whether any gradient was inf or NaN.
  bool load_gradients(std::span<const Low> grads, float inv_scale = 1.0f) {
    check_size(grads.size(), "load_gradients");
    bool found = false;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const float g = static_cast<float>(grads[i]);
      found |= !std::isfinite(g);
      grads_[i] = inv_scale == 1.0f ? g : g * inv_scale;
    }
    return found;
  }

  /// params = Low(parameters()), rounded to nearest even.
  void store_parameters(std::span<Low> params) const {
    check_size(params.size(), "store_parameters");
    std::transform(values_.begin(), values_.end(), params.begin(), [](float x) { return Low(x); });
  }

  /// As a parameter container (ddp/parameters.hpp): one float32 parameter "master" over the copy
  /// and its gradients, for a distributed_data_parallel that reduces in float32.
  friend std::vector<parameter_ref> parameters(master_weights& m) {
    return {make_parameter(std::span<float>(m.values_), std::span<float>(m.grads_), {}, "master")};
  }

 private:
  void check_size(std::size_t n, const char* what) const {
    if (n != values_.size()) {
      throw error(errc::invalid_argument, std::string("ddp::optim::master_weights::") + what + ": " + std::to_string(n) +
                                              " values for a master copy of " + std::to_string(values_.size()));
    }
  }

  std::vector<float> values_;
  std::vector<float> grads_;
};

}  // namespace ddp::optim
