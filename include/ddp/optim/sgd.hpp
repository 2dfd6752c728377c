#pragma once
// ddp::optim::sgd: torch.optim.SGD over one contiguous span of parameters and its gradients (a
// whole model's flat parameters or one rank's shard: the update is elementwise, so both give the
// same values).
//
// Agreement with torch (torch 2.15, tests/data/optim_golden.json, optim_test):
//   float and double: bit for bit with SGD(..., foreach=False) on CPU under torch's AVX2/AVX512
//   kernels (any x86-64 CPU with AVX2), for every option. torch computes `x.add(y, alpha=a)` as
//   one fused multiply-add, fma(a, y, x) (vec::fmadd, and its scalar tail compiled with
//   contraction), with the Python-float alpha cast to the tensor's type first; this header calls
//   std::fma with the same operands, so the result does not depend on -ffp-contract or -march
//   (without hardware FMA, std::fma is glibc's exact software fma: slower, same values). torch's
//   DEFAULT kernel (no AVX2) rounds a*y separately and differs from this in the last bit.
//   -ffast-math voids all of this.
//
// The operations of torch's _single_tensor_sgd, element by element:
//   d = maximize ? -g : g
//   d = fma(wd, p, d)                                     weight_decay != 0: d.add(p, alpha=wd)
//   first step: buf = d; later: buf = fma(1 - dampening, d, buf * momentum)   momentum != 0
//   d = nesterov ? fma(momentum, buf, d) : buf
//   p = fma(-lr, d, p)                                    p.add_(d, alpha=-lr)
// with each Python float cast to T once (wd, momentum, float(1 - dampening), float(-lr)).
//
// momentum == 0 keeps no buffer and touches no memory besides params and grads.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp::optim {

/// torch.optim.SGD's hyperparameters (its defaults).
struct sgd_options {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

/// What a checkpoint saves: torch's state["momentum_buffer"] (empty until the first step, and
/// always when momentum == 0) and the number of steps taken (torch's SGD keeps none; kept here for
/// the caller's bookkeeping, it changes no value).
template <std::floating_point T>
struct sgd_state {
  std::int64_t step = 0;
  std::vector<T> momentum_buffer;
};

namespace detail {

/// Throws std::invalid_argument for the options torch.optim.SGD rejects (the host class here and
/// the device one in ddp/optim/cuda.hpp).
inline void validate(const sgd_options& o) {
  if (!(o.lr >= 0.0)) throw std::invalid_argument("ddp::optim::sgd: invalid learning rate " + std::to_string(o.lr));
  if (!(o.momentum >= 0.0)) throw std::invalid_argument("ddp::optim::sgd: invalid momentum " + std::to_string(o.momentum));
  if (!(o.weight_decay >= 0.0)) {
    throw std::invalid_argument("ddp::optim::sgd: invalid weight_decay " + std::to_string(o.weight_decay));
  }
  if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0)) {
    throw std::invalid_argument("ddp::optim::sgd: nesterov momentum requires a momentum and zero dampening");
  }
}

/// The scalars of one step, each Python float cast to T once as torch casts it: computed here for
/// the host loop below and for the device kernel (ddp/optim/cuda.hpp), so both use the same values.
template <std::floating_point T>
struct sgd_coefficients {
  T weight_decay;
  T momentum;
  T one_minus_dampening;
  T neg_lr;
  bool use_weight_decay;
  bool use_momentum;
  bool nesterov;
  bool maximize;
};

template <std::floating_point T>
sgd_coefficients<T> sgd_step_coefficients(const sgd_options& o) noexcept {
  return {.weight_decay = static_cast<T>(o.weight_decay),
          .momentum = static_cast<T>(o.momentum),
          .one_minus_dampening = static_cast<T>(1.0 - o.dampening),
          .neg_lr = static_cast<T>(-o.lr),
          .use_weight_decay = o.weight_decay != 0.0,
          .use_momentum = o.momentum != 0.0,
          .nesterov = o.nesterov,
          .maximize = o.maximize};
}

}  // namespace detail

template <std::floating_point T = float>
class sgd {
 public:
  using value_type = T;
  using state_type = sgd_state<T>;

  /// Throws std::invalid_argument for the options torch rejects.
  explicit sgd(sgd_options options = {}) : options_(options) { detail::validate(options_); }

  /// One step: params -= lr * (update from grads and the state). The spans must have equal
  /// lengths, and the same length at every step (the momentum buffer is sized at the first).
  void step(std::span<T> params, std::span<const T> grads) {
    if (params.size() != grads.size()) {
      throw std::invalid_argument("ddp::optim::sgd::step: " + std::to_string(params.size()) + " parameters but " +
                                  std::to_string(grads.size()) + " gradients");
    }
    const auto c = detail::sgd_step_coefficients<T>(options_);
    const bool use_momentum = c.use_momentum;
    const bool first = state_.momentum_buffer.empty();
    if (use_momentum && !first && state_.momentum_buffer.size() != params.size()) {
      throw std::invalid_argument("ddp::optim::sgd::step: the momentum buffer holds " +
                                  std::to_string(state_.momentum_buffer.size()) + " values, the parameters " +
                                  std::to_string(params.size()));
    }
    if (use_momentum && first) {
      state_.momentum_buffer.resize(params.size());
    }
    const bool use_wd = c.use_weight_decay;
    const T wd = c.weight_decay;
    const T momentum = c.momentum;
    const T one_minus_dampening = c.one_minus_dampening;
    const T neg_lr = c.neg_lr;
    const bool maximize = c.maximize;
    const bool nesterov = c.nesterov;
    T* p = params.data();
    const T* g = grads.data();
    T* buf = state_.momentum_buffer.data();
    const std::size_t n = params.size();
    for (std::size_t i = 0; i < n; ++i) {
      T d = maximize ? -g[i] : g[i];
      if (use_wd) {
        d = std::fma(wd, p[i], d);
      }
      if (use_momentum) {
        // buf * momentum is rounded on its own: torch's mul_ and add_ are two kernels.
        buf[i] = first ? d : std::fma(one_minus_dampening, d, buf[i] * momentum);
        d = nesterov ? std::fma(momentum, buf[i], d) : buf[i];
      }
      p[i] = std::fma(neg_lr, d, p[i]);
    }
    ++state_.step;
  }

  const sgd_options& options() const noexcept { return options_; }
  /// For learning-rate schedules (torch's param_group["lr"] = ...).
  void set_lr(double lr) {
    sgd_options o = options_;
    o.lr = lr;
    detail::validate(o);
    options_ = o;
  }

  const state_type& state() const noexcept { return state_; }
  /// Restores a saved state; an empty buffer means "before the first step" as in torch.
  void load_state(state_type state) { state_ = std::move(state); }

 private:
  sgd_options options_;
  state_type state_;
};

}  // namespace ddp::optim
