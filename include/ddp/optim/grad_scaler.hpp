#pragma once
// ddp::optim::grad_scaler: torch.amp.GradScaler's dynamic loss scaling for mixed-precision steps.
//
//   auto loss_for_backward = scaler.scale(loss);            // loss * scale
//   ... backward ...
//   scaler.unscale(grads);                                  // grads *= 1/scale, notes non-finite values
//   bool inf = scaler.found_inf();                          // this rank's verdict
//   // ALL RANKS MUST AGREE before stepping: all-reduce `inf` with max (or any) across the group
//   // and pass the result on. This header does no communication; a rank that skips a step that
//   // another rank takes puts the replicas out of step for good.
//   if (scaler.should_step(inf_anywhere)) optimizer.step(params, grads);
//   scaler.update(inf_anywhere);
//
// Agreement with torch 2.15 (tests/data/optim_golden.json, optim_test), bit for bit:
//   * the scale is a float, initialised to float(init_scale);
//   * unscale multiplies by inv_scale = float(1 / double(scale)) (GradScaler's
//     `scale.double().reciprocal().float()`, equal to the float division 1.0f / scale: a quotient of
//     24-bit numbers is never near enough to a float midpoint for the double rounding to show),
//     as T: g * T(inv_scale), skipped when inv_scale == 1 (torch's kernel does so too); inf, -inf
//     and NaN set found_inf;
//   * update is torch._amp_update_scale_'s CPU kernel: on inf, scale = float(scale * backoff)
//     (in double) and the tracker resets; otherwise the tracker counts successful steps and at
//     growth_interval the scale becomes float(scale * growth) unless that is not finite, and the
//     tracker resets.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace ddp::optim {

/// torch.amp.GradScaler's options (its defaults).
struct grad_scaler_options {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  bool enabled = true;
};

/// What a checkpoint saves (torch's GradScaler.state_dict(): "scale", "_growth_tracker").
struct grad_scaler_state {
  float scale = 65536.0f;
  std::int32_t growth_tracker = 0;
};

class grad_scaler {
 public:
  /// Throws std::invalid_argument for the options torch rejects.
  explicit grad_scaler(grad_scaler_options options = {}) : options_(options) {
    if (!(options_.growth_factor > 1.0)) {
      throw std::invalid_argument("ddp::optim::grad_scaler: growth_factor should be > 1, got " +
                                  std::to_string(options_.growth_factor));
    }
    if (!(options_.backoff_factor < 1.0)) {
      throw std::invalid_argument("ddp::optim::grad_scaler: backoff_factor should be < 1, got " +
                                  std::to_string(options_.backoff_factor));
    }
    if (options_.growth_interval <= 0) {
      throw std::invalid_argument("ddp::optim::grad_scaler: growth_interval should be a positive integer, got " +
                                  std::to_string(options_.growth_interval));
    }
    state_.scale = static_cast<float>(options_.init_scale);
  }

  bool enabled() const noexcept { return options_.enabled; }
  const grad_scaler_options& options() const noexcept { return options_; }

  /// The current scale (1 when disabled).
  float get_scale() const noexcept { return options_.enabled ? state_.scale : 1.0f; }

  /// loss * scale in T (torch multiplies by the float scale promoted to the loss's type).
  template <std::floating_point T>
  T scale(T loss) const noexcept {
    return options_.enabled ? loss * static_cast<T>(state_.scale) : loss;
  }

  /// GradScaler's inv_scale: float(1 / double(scale)).
  float inv_scale() const noexcept { return static_cast<float>(1.0 / static_cast<double>(state_.scale)); }

  /// Multiplies grads by inv_scale() and records whether any was inf or NaN (found_inf() stays set
  /// until update(), across calls: call it once per gradient span). Returns whether this span had
  /// one. Does nothing when disabled.
  template <std::floating_point T>
  bool unscale(std::span<T> grads) noexcept {
    if (!options_.enabled) {
      return false;
    }
    const float inv = inv_scale();
    const T inv_t = static_cast<T>(inv);
    bool found = false;
    if (inv == 1.0f) {
      for (const T g : grads) found |= !std::isfinite(g);
    } else {
      for (T& g : grads) {
        found |= !std::isfinite(g);
        g = g * inv_t;
      }
    }
    record_found_inf(found);
    return found;
  }

  /// Records an unscale's verdict made elsewhere (the device unscale of ddp/optim/cuda.hpp):
  /// found_inf() becomes true with it and stays so until update().
  void record_found_inf(bool found) noexcept { found_inf_ = found_inf_ || found; }

  /// Whether this rank's unscale() calls since the last update() saw an inf or NaN.
  bool found_inf() const noexcept { return found_inf_; }

  /// Whether the optimizer should step, given the found_inf agreed across ranks.
  bool should_step(bool found_inf_anywhere) const noexcept { return !options_.enabled || !found_inf_anywhere; }

  /// torch._amp_update_scale_ with the found_inf agreed across ranks (this header's caller
  /// all-reduces found_inf() with max first); clears found_inf(). Does nothing when disabled.
  void update(bool found_inf_anywhere) noexcept {
    found_inf_ = false;
    if (!options_.enabled) {
      return;
    }
    if (found_inf_anywhere) {
      state_.scale = static_cast<float>(static_cast<double>(state_.scale) * options_.backoff_factor);
      state_.growth_tracker = 0;
      return;
    }
    const std::int64_t successful = static_cast<std::int64_t>(state_.growth_tracker) + 1;
    if (successful == options_.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(state_.scale) * options_.growth_factor);
      if (std::isfinite(grown)) {  // never grow past float's range
        state_.scale = grown;
      }
      state_.growth_tracker = 0;
    } else {
      state_.growth_tracker = static_cast<std::int32_t>(successful);
    }
  }

  const grad_scaler_state& state() const noexcept { return state_; }
  void load_state(const grad_scaler_state& state) noexcept {
    state_ = state;
    found_inf_ = false;
  }

 private:
  grad_scaler_options options_;
  grad_scaler_state state_;
  bool found_inf_ = false;
};

}  // namespace ddp::optim
