#pragma once
// ddp::optim::adamw: torch.optim.AdamW over one contiguous span of parameters and its gradients
// (a whole model or one rank's flat shard: the update is elementwise).
//
// Agreement with torch (torch 2.15, tests/data/optim_golden.json, optim_test):
//   the state (exp_avg, exp_avg_sq, max_exp_avg_sq, step): bit for bit, float and double, with
//   AdamW(..., foreach=False, fused=False, capturable=False) on CPU under torch's AVX2/AVX512
//   kernels, every option. The parameters: within adamw_param_ulp_bound ulps (16; 8 float ulps and
//   0 double ulps seen over 20 steps), because torch's PyPI wheel takes sqrt from MKL's vector
//   math, which on the recording machine (AMD EPYC) is 1 ulp off the correctly rounded sqrt for
//   about a fifth of float inputs (and 1 % of doubles); std::sqrt here is correctly rounded. Given
//   torch's sqrt values, every other operation below reproduces torch bit for bit. The kernels,
//   element by element, with each Python float cast to T where torch casts it:
//     g = maximize ? -g : g
//     p = p * T(1 - lr*wd)                                   p.mul_(1 - lr*wd), wd != 0
//     m = |w| < 0.5 ? fma(w, g - m, m) : fma(w - 1, g - m, g)  m.lerp_(g, w), w = T(1 - beta1)
//     v = fma(T(1 - beta2) * g, g, v * T(beta2))             v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
//     vmax = maximum(vmax, v)                                amsgrad (NaN propagates, as torch.maximum)
//     denom = sqrt(v or vmax) / T(bc2_sqrt) + T(eps)
//     p = p + (T(-step_size) * m) / denom                    p.addcdiv_(m, denom, value=-step_size)
//   with bc1 = 1 - beta1**step, bc2 = 1 - beta2**step, step_size = lr / bc1, bc2_sqrt = bc2**0.5
//   in double through pow() as Python computes them. lerp, add and addcmul are fused in torch's
//   vectorized kernels and in their scalar tails; addcdiv and mul are not. std::fma gives the
//   fused ones, and the products torch rounds on their own (p * decay, 1 - lr*wd) pass through an
//   empty asm barrier so that -ffp-contract=fast with -mfma (GCC's default in GNU mode with
//   -march=native) cannot fuse them into the following addition. torch's DEFAULT (no AVX2)
//   kernels round every product and differ in the last bits. -ffast-math voids all of this.
//
// torch keeps the step count in a float32 tensor, which stops growing at 2^24 steps; there
// 1 - beta**step is 1 for any beta < 1 - 2^-20, so counting in int64 here changes no value for
// usual betas.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp::optim {

namespace detail {
/// x, rounded: the compiler cannot see through the asm, so it cannot fuse the product that made x
/// into a later addition.
template <std::floating_point T>
inline T adamw_rounded(T x) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  __asm__("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
#elif defined(__GNUC__)
  __asm__("" : "+m"(x));
#endif
  return x;
}
}  // namespace detail

/// The parameters' agreement with torch, in ulps (see the top of this file): optim_test's bound.
inline constexpr std::int64_t adamw_param_ulp_bound = 16;

/// torch.optim.AdamW's hyperparameters (its defaults).
struct adamw_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

/// What a checkpoint saves: torch's state["step"], ["exp_avg"], ["exp_avg_sq"] and, with amsgrad,
/// ["max_exp_avg_sq"] (all empty before the first step).
template <std::floating_point T>
struct adamw_state {
  std::int64_t step = 0;
  std::vector<T> exp_avg;
  std::vector<T> exp_avg_sq;
  std::vector<T> max_exp_avg_sq;
};

namespace detail {

/// Throws std::invalid_argument for the options torch.optim.AdamW rejects (the host class here and
/// the device one in ddp/optim/cuda.hpp).
inline void validate(const adamw_options& o) {
  auto fail = [](const std::string& what, double value) {
    throw std::invalid_argument("ddp::optim::adamw: invalid " + what + " " + std::to_string(value));
  };
  if (!(o.lr >= 0.0)) fail("learning rate", o.lr);
  if (!(o.eps >= 0.0)) fail("epsilon value", o.eps);
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) fail("beta parameter at index 0:", o.beta1);
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) fail("beta parameter at index 1:", o.beta2);
  if (!(o.weight_decay >= 0.0)) fail("weight_decay value", o.weight_decay);
}

/// The scalars of step number `step` (1 for the first), computed in double and cast to T where
/// torch casts them (see the top of this file): one place for the host loop below and the device
/// kernel (ddp/optim/cuda.hpp), so both use the same values.
template <std::floating_point T>
struct adamw_coefficients {
  T decay;             // T(1 - lr*wd), for p * decay
  T w_coeff;           // lerp's weight w = T(1 - beta1) when |w| < 0.5, else w - 1
  T beta2;
  T one_minus_beta2;
  T bc2_sqrt;          // T(sqrt(1 - beta2**step))
  T eps;
  T neg_step_size;     // T(-lr / (1 - beta1**step))
  bool w_small;        // |w| < 0.5: lerp from the average, else from the gradient
  bool use_weight_decay;
  bool amsgrad;
  bool maximize;
};

template <std::floating_point T>
adamw_coefficients<T> adamw_step_coefficients(const adamw_options& o, std::int64_t step_count) noexcept {
  const double step = static_cast<double>(step_count);
  const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
  const double step_size = o.lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);  // Python's bc2**0.5

  const T w = static_cast<T>(1.0 - o.beta1);
  const bool w_small = std::abs(w) < T(0.5);
  return {.decay = static_cast<T>(1.0 - adamw_rounded(o.lr * o.weight_decay)),
          .w_coeff = w_small ? w : w - T(1),
          .beta2 = static_cast<T>(o.beta2),
          .one_minus_beta2 = static_cast<T>(1.0 - o.beta2),
          .bc2_sqrt = static_cast<T>(bias_correction2_sqrt),
          .eps = static_cast<T>(o.eps),
          .neg_step_size = static_cast<T>(-step_size),
          .w_small = w_small,
          .use_weight_decay = o.weight_decay != 0.0,
          .amsgrad = o.amsgrad,
          .maximize = o.maximize};
}

}  // namespace detail

template <std::floating_point T = float>
class adamw {
 public:
  using value_type = T;
  using state_type = adamw_state<T>;

  /// Throws std::invalid_argument for the options torch rejects.
  explicit adamw(adamw_options options = {}) : options_(options) { detail::validate(options_); }

  /// One step. The spans must have equal lengths, and the same length at every step (the state is
  /// sized, zero-filled, at the first).
  void step(std::span<T> params, std::span<const T> grads) {
    const std::size_t n = params.size();
    if (grads.size() != n) {
      throw std::invalid_argument("ddp::optim::adamw::step: " + std::to_string(n) + " parameters but " +
                                  std::to_string(grads.size()) + " gradients");
    }
    if (state_.exp_avg.empty() && state_.exp_avg_sq.empty()) {
      state_.exp_avg.assign(n, T(0));
      state_.exp_avg_sq.assign(n, T(0));
      state_.max_exp_avg_sq.assign(options_.amsgrad ? n : 0, T(0));
    }
    if (state_.exp_avg.size() != n || state_.exp_avg_sq.size() != n ||
        (options_.amsgrad && state_.max_exp_avg_sq.size() != n)) {
      throw std::invalid_argument("ddp::optim::adamw::step: the state holds " + std::to_string(state_.exp_avg.size()) +
                                  " values per buffer, the parameters " + std::to_string(n));
    }
    ++state_.step;
    const auto c = detail::adamw_step_coefficients<T>(options_, state_.step);
    const bool use_wd = c.use_weight_decay;
    const T decay = c.decay;
    const bool w_small = c.w_small;
    const T w_coeff = c.w_coeff;
    const T beta2 = c.beta2;
    const T one_minus_beta2 = c.one_minus_beta2;
    const T bc2_sqrt = c.bc2_sqrt;
    const T eps = c.eps;
    const T neg_step_size = c.neg_step_size;
    const bool maximize = c.maximize;
    const bool amsgrad = c.amsgrad;

    T* p = params.data();
    const T* gp = grads.data();
    T* m = state_.exp_avg.data();
    T* v = state_.exp_avg_sq.data();
    T* vmax = state_.max_exp_avg_sq.data();
    for (std::size_t i = 0; i < n; ++i) {
      const T g = maximize ? -gp[i] : gp[i];
      T pi = p[i];
      if (use_wd) {
        pi = detail::adamw_rounded(pi * decay);
      }
      // torch's lerp: fma(w, end - self, self) for |w| < 0.5, else fma(w - 1, end - self, end).
      const T diff = g - m[i];
      m[i] = std::fma(w_coeff, diff, w_small ? m[i] : g);
      v[i] = std::fma(one_minus_beta2 * g, g, v[i] * beta2);
      T second = v[i];
      if (amsgrad) {
        const T a = vmax[i];
        vmax[i] = std::isnan(a) ? a : (std::isnan(second) ? second : std::max(a, second));
        second = vmax[i];
      }
      const T denom = std::sqrt(second) / bc2_sqrt + eps;
      p[i] = pi + (neg_step_size * m[i]) / denom;
    }
  }

  const adamw_options& options() const noexcept { return options_; }
  /// For learning-rate schedules (torch's param_group["lr"] = ...).
  void set_lr(double lr) {
    adamw_options o = options_;
    o.lr = lr;
    detail::validate(o);
    options_ = o;
  }

  const state_type& state() const noexcept { return state_; }
  /// Restores a saved state (empty buffers: before the first step).
  void load_state(state_type state) { state_ = std::move(state); }

 private:
  adamw_options options_;
  state_type state_;
};

}  // namespace ddp::optim
