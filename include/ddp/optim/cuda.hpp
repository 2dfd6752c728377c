#pragma once
// ddp::optim::cuda: the shipped optimizers, the loss scaler's unscale and gradient clipping on
// spans of CUDA device (or managed) memory, giving the same bits as their host counterparts:
//
//   ddp::optim::cuda::sgd<float> opt({.lr = 0.1, .momentum = 0.9}, stream);
//   opt.step(params, grads);                   // spans over device memory; enqueued on `stream`
//   ddp::optim::sgd_state<float> s = opt.state();   // host copy, for a checkpoint
//   opt.load_state(s);
//
//   sgd<T>, adamw<T>                  sgd.hpp's and adamw.hpp's classes: same options, same
//                                     validation, same state (kept in device memory), float and double
//   unscale(grads, scaler)            grad_scaler::unscale on device memory; records found_inf in the
//                                     scaler and returns this span's verdict
//   clip_grads_with_norm(grads, max_norm, total)   clip.hpp's, bit for bit
//   clip_grad_norm(grads, max_norm)   clip.hpp's, with total_norm_squared's norm
//   clip_grad_norm(group, grads, max_norm, layout) distributed.hpp's, over device gradients: the
//                                     sharded form all-reduces one double, a host scalar
//   total_norm_squared(grads)         clip.hpp's sum of squares in double, summed in another order
//                                     (a tree, not left to right), so it may differ in the last bits
//
// Why the same bits: every per-step scalar (bias corrections, T(1 - lr*wd), T(-lr), ...) comes from
// the host headers' own functions (detail::sgd_step_coefficients, detail::adamw_step_coefficients,
// grad_scaler::inv_scale, clip_coefficient), and the kernels repeat the host loops operation for
// operation through CUDA's explicitly rounded intrinsics: __fma*_rn where the host calls std::fma,
// and __*mul_rn, __*add_rn, __*div_rn, __*sqrt_rn (correctly rounded, round to nearest) for the
// operations the host rounds on their own. nvcc fuses a plain a*b+c into an fma by default
// (--fmad=true), which would round once where the host rounds twice; the intrinsics are never fused.
// Compiling with --use_fast_math or -ftz=true (flushing subnormals) voids this, as -ffast-math voids
// the host headers' agreement with torch.
//
// Ordering: step(), unscale() and the clipping run on the stream given (the legacy default stream
// when none is), after the work already queued there; step() returns without waiting, like a torch
// optimizer on CUDA. unscale() and total_norm_squared() wait for their answer. state() and
// load_state() wait for the stream, so the copy holds the values of every step queued before.
//
// CUDA only: this header defines kernels, so it is compiled by nvcc (a .cu file); host builds keep
// to ddp/optim.hpp, which does not include it.

#if !defined(__CUDACC__)
#error "<ddp/optim/cuda.hpp> defines CUDA kernels: compile it with nvcc (a .cu file); host code uses <ddp/optim.hpp>"
#endif

#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/transform_reduce.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/backends/cuda_memory.hpp"
#include "ddp/optim/adamw.hpp"
#include "ddp/optim/clip.hpp"
#include "ddp/optim/distributed.hpp"
#include "ddp/optim/grad_scaler.hpp"
#include "ddp/optim/sgd.hpp"

namespace ddp::optim::cuda {

/// The element types the kernels take: those with correctly rounded CUDA intrinsics.
template <class T>
concept device_floating_point = std::same_as<T, float> || std::same_as<T, double>;

namespace detail {

// Each operation rounded to nearest on its own (never contracted with a neighbour).
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ inline float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ inline double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ inline double sqrt_rn(double a) { return __dsqrt_rn(a); }
__device__ inline float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ inline double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

inline constexpr unsigned threads_per_block = 256;

/// Blocks for n elements in a grid-stride loop: one element per thread up to a cap that fills any
/// current GPU, then several per thread.
inline unsigned blocks_for(std::size_t n) noexcept {
  constexpr std::size_t max_blocks = 8192;
  return static_cast<unsigned>(std::min<std::size_t>((n + threads_per_block - 1) / threads_per_block, max_blocks));
}

/// sgd.hpp's loop, element by element.
template <device_floating_point T>
__global__ void sgd_step_kernel(T* p, const T* g, T* buf, std::size_t n, optim::detail::sgd_coefficients<T> c, bool first) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    T d = c.maximize ? -g[i] : g[i];
    if (c.use_weight_decay) {
      d = fma_rn(c.weight_decay, p[i], d);
    }
    if (c.use_momentum) {
      buf[i] = first ? d : fma_rn(c.one_minus_dampening, d, mul_rn(buf[i], c.momentum));
      d = c.nesterov ? fma_rn(c.momentum, buf[i], d) : buf[i];
    }
    p[i] = fma_rn(c.neg_lr, d, p[i]);
  }
}

/// adamw.hpp's loop, element by element.
template <device_floating_point T>
__global__ void adamw_step_kernel(T* p, const T* gp, T* m, T* v, T* vmax, std::size_t n, optim::detail::adamw_coefficients<T> c) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    const T g = c.maximize ? -gp[i] : gp[i];
    T pi = p[i];
    if (c.use_weight_decay) {
      pi = mul_rn(pi, c.decay);
    }
    const T mi = m[i];
    m[i] = fma_rn(c.w_coeff, sub_rn(g, mi), c.w_small ? mi : g);
    v[i] = fma_rn(mul_rn(c.one_minus_beta2, g), g, mul_rn(v[i], c.beta2));
    T second = v[i];
    if (c.amsgrad) {
      const T a = vmax[i];
      // std::max(a, second) is `a < second ? second : a`; NaN propagates as in the host loop.
      vmax[i] = isnan(a) ? a : (isnan(second) ? second : (a < second ? second : a));
      second = vmax[i];
    }
    const T denom = add_rn(div_rn(sqrt_rn(second), c.bc2_sqrt), c.eps);
    p[i] = add_rn(pi, div_rn(mul_rn(c.neg_step_size, m[i]), denom));
  }
}

/// grad_scaler::unscale's loop: g * inv (when multiply), and a 1 in *found for any inf or NaN.
template <device_floating_point T>
__global__ void unscale_kernel(T* g, std::size_t n, T inv, bool multiply, std::int32_t* found) {
  bool seen = false;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    seen |= !isfinite(g[i]);
    if (multiply) {
      g[i] = mul_rn(g[i], inv);
    }
  }
  if (seen) {
    *found = 1;  // every writer writes the same value
  }
}

template <device_floating_point T>
__global__ void scale_kernel(T* g, std::size_t n, T coef) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    g[i] = mul_rn(g[i], coef);
  }
}

/// x*x in double, rounded before it is summed (as clip.hpp's host loop reads when not contracted).
template <device_floating_point T>
struct square_in_double {
  __device__ double operator()(T x) const {
    const double d = static_cast<double>(x);
    return __dmul_rn(d, d);
  }
};

inline void check_launch(const char* what) { ddp::detail::cuda_check(cudaGetLastError(), what); }

/// Throws std::invalid_argument unless both spans are device (or managed) memory.
template <class P, class G>
void require_device(std::span<P> params, std::span<G> grads, const char* where) {
  if (!ddp::detail::device_addressable(params.data()) || !ddp::detail::device_addressable(grads.data())) {
    throw std::invalid_argument(std::string(where) + ": the parameters and gradients must be device (or managed) memory");
  }
}

/// Copies a device buffer to a host vector, after the work queued on `stream`.
template <device_floating_point T>
std::vector<T> to_host(const ddp::device_buffer<T>& buffer, cudaStream_t stream) {
  std::vector<T> host(buffer.size());
  if (!host.empty()) {
    ddp::detail::cuda_check(cudaMemcpyAsync(host.data(), buffer.data(), buffer.size() * sizeof(T), cudaMemcpyDeviceToHost, stream),
                            "cudaMemcpyAsync (device to host)");
  }
  ddp::detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return host;
}

/// A device buffer holding `host`'s values; waits for the copy (the host vector may go away).
template <device_floating_point T>
ddp::device_buffer<T> to_device(const std::vector<T>& host, cudaStream_t stream) {
  ddp::device_buffer<T> buffer(host.size());
  if (!host.empty()) {
    ddp::detail::cuda_check(cudaMemcpyAsync(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
                            "cudaMemcpyAsync (host to device)");
  }
  ddp::detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return buffer;
}

}  // namespace detail

/// torch.optim.SGD on device memory: ddp::optim::sgd's update (see sgd.hpp), bit for bit with it.
template <device_floating_point T = float>
class sgd {
 public:
  using value_type = T;
  using state_type = sgd_state<T>;

  /// Throws std::invalid_argument for the options torch rejects (as the host class).
  explicit sgd(sgd_options options = {}, cudaStream_t stream = nullptr) : options_(options), stream_(stream) {
    optim::detail::validate(options_);
  }

  /// One step on `stream()`: params -= lr * (update from grads and the state), both spans over
  /// device memory of equal lengths, the same length at every step (the buffer is sized at the first).
  void step(std::span<T> params, std::span<const T> grads) {
    const std::size_t n = params.size();
    if (grads.size() != n) {
      throw std::invalid_argument("ddp::optim::cuda::sgd::step: " + std::to_string(n) + " parameters but " +
                                  std::to_string(grads.size()) + " gradients");
    }
    detail::require_device(params, grads, "ddp::optim::cuda::sgd::step");
    const auto c = optim::detail::sgd_step_coefficients<T>(options_);
    const bool first = momentum_buffer_.empty();
    if (c.use_momentum && !first && momentum_buffer_.size() != n) {
      throw std::invalid_argument("ddp::optim::cuda::sgd::step: the momentum buffer holds " +
                                  std::to_string(momentum_buffer_.size()) + " values, the parameters " + std::to_string(n));
    }
    if (c.use_momentum && first) {
      momentum_buffer_ = ddp::device_buffer<T>(n);  // every value written by this step
    }
    if (n != 0) {
      detail::sgd_step_kernel<<<detail::blocks_for(n), detail::threads_per_block, 0, stream_>>>(
          params.data(), grads.data(), momentum_buffer_.data(), n, c, first);
      detail::check_launch("ddp::optim::cuda::sgd::step: kernel launch");
    }
    ++step_;
  }

  const sgd_options& options() const noexcept { return options_; }
  /// For learning-rate schedules (torch's param_group["lr"] = ...).
  void set_lr(double lr) {
    sgd_options o = options_;
    o.lr = lr;
    optim::detail::validate(o);
    options_ = o;
  }
  cudaStream_t stream() const noexcept { return stream_; }

  /// A host copy of the state (for a checkpoint), after the steps queued on the stream.
  state_type state() const { return {.step = step_, .momentum_buffer = detail::to_host(momentum_buffer_, stream_)}; }
  /// Restores a saved state (host memory); an empty buffer means "before the first step" as in torch.
  void load_state(const state_type& state) {
    ddp::detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // no step still reads the old buffer
    momentum_buffer_ = detail::to_device(state.momentum_buffer, stream_);
    step_ = state.step;
  }

 private:
  sgd_options options_;
  cudaStream_t stream_;
  std::int64_t step_ = 0;
  ddp::device_buffer<T> momentum_buffer_;
};

/// torch.optim.AdamW on device memory: ddp::optim::adamw's update (see adamw.hpp), bit for bit with
/// it (the parameters too: both take the correctly rounded sqrt).
template <device_floating_point T = float>
class adamw {
 public:
  using value_type = T;
  using state_type = adamw_state<T>;

  /// Throws std::invalid_argument for the options torch rejects (as the host class).
  explicit adamw(adamw_options options = {}, cudaStream_t stream = nullptr) : options_(options), stream_(stream) {
    optim::detail::validate(options_);
  }

  /// One step on `stream()`, both spans over device memory of equal lengths, the same length at
  /// every step (the state is sized, zero-filled, at the first).
  void step(std::span<T> params, std::span<const T> grads) {
    const std::size_t n = params.size();
    if (grads.size() != n) {
      throw std::invalid_argument("ddp::optim::cuda::adamw::step: " + std::to_string(n) + " parameters but " +
                                  std::to_string(grads.size()) + " gradients");
    }
    detail::require_device(params, grads, "ddp::optim::cuda::adamw::step");
    if (exp_avg_.empty() && exp_avg_sq_.empty()) {
      exp_avg_ = zeros(n);
      exp_avg_sq_ = zeros(n);
      max_exp_avg_sq_ = zeros(options_.amsgrad ? n : 0);
    }
    if (exp_avg_.size() != n || exp_avg_sq_.size() != n || (options_.amsgrad && max_exp_avg_sq_.size() != n)) {
      throw std::invalid_argument("ddp::optim::cuda::adamw::step: the state holds " + std::to_string(exp_avg_.size()) +
                                  " values per buffer, the parameters " + std::to_string(n));
    }
    ++step_;
    const auto c = optim::detail::adamw_step_coefficients<T>(options_, step_);
    if (n != 0) {
      detail::adamw_step_kernel<<<detail::blocks_for(n), detail::threads_per_block, 0, stream_>>>(
          params.data(), grads.data(), exp_avg_.data(), exp_avg_sq_.data(), max_exp_avg_sq_.data(), n, c);
      detail::check_launch("ddp::optim::cuda::adamw::step: kernel launch");
    }
  }

  const adamw_options& options() const noexcept { return options_; }
  /// For learning-rate schedules (torch's param_group["lr"] = ...).
  void set_lr(double lr) {
    adamw_options o = options_;
    o.lr = lr;
    optim::detail::validate(o);
    options_ = o;
  }
  cudaStream_t stream() const noexcept { return stream_; }

  /// A host copy of the state (for a checkpoint), after the steps queued on the stream.
  state_type state() const {
    return {.step = step_,
            .exp_avg = detail::to_host(exp_avg_, stream_),
            .exp_avg_sq = detail::to_host(exp_avg_sq_, stream_),
            .max_exp_avg_sq = detail::to_host(max_exp_avg_sq_, stream_)};
  }
  /// Restores a saved state (host memory; empty buffers: before the first step).
  void load_state(const state_type& state) {
    ddp::detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // no step still reads the old buffers
    exp_avg_ = detail::to_device(state.exp_avg, stream_);
    exp_avg_sq_ = detail::to_device(state.exp_avg_sq, stream_);
    max_exp_avg_sq_ = detail::to_device(state.max_exp_avg_sq, stream_);
    step_ = state.step;
  }

 private:
  /// n zeros (all bits clear: +0.0, as the host's T(0)), set on the stream.
  ddp::device_buffer<T> zeros(std::size_t n) const {
    ddp::device_buffer<T> buffer(n);
    if (n != 0) {
      ddp::detail::cuda_check(cudaMemsetAsync(buffer.data(), 0, n * sizeof(T), stream_), "cudaMemsetAsync");
    }
    return buffer;
  }

  adamw_options options_;
  cudaStream_t stream_;
  std::int64_t step_ = 0;
  ddp::device_buffer<T> exp_avg_;
  ddp::device_buffer<T> exp_avg_sq_;
  ddp::device_buffer<T> max_exp_avg_sq_;
};

/// grad_scaler::unscale on device memory: grads *= T(scaler.inv_scale()) (skipped when that is 1)
/// and whether any gradient was inf or NaN, which is also recorded in the scaler (found_inf() stays
/// set until update(), as after the host unscale). Returns false, touching nothing, when the scaler
/// is disabled. Waits for its answer.
template <device_floating_point T>
bool unscale(std::span<T> grads, grad_scaler& scaler, cudaStream_t stream = nullptr) {
  if (!scaler.enabled()) {
    return false;
  }
  if (!ddp::detail::device_addressable(grads.data())) {
    throw std::invalid_argument("ddp::optim::cuda::unscale: the gradients must be device (or managed) memory");
  }
  const float inv = scaler.inv_scale();
  bool found = false;
  if (!grads.empty()) {
    ddp::device_buffer<std::int32_t> flag(1);
    ddp::detail::cuda_check(cudaMemsetAsync(flag.data(), 0, sizeof(std::int32_t), stream), "cudaMemsetAsync");
    detail::unscale_kernel<<<detail::blocks_for(grads.size()), detail::threads_per_block, 0, stream>>>(
        grads.data(), grads.size(), static_cast<T>(inv), inv != 1.0f, flag.data());
    detail::check_launch("ddp::optim::cuda::unscale: kernel launch");
    std::int32_t seen = 0;
    ddp::detail::cuda_check(cudaMemcpyAsync(&seen, flag.data(), sizeof seen, cudaMemcpyDeviceToHost, stream),
                            "cudaMemcpyAsync (device to host)");
    ddp::detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    found = seen != 0;
  }
  scaler.record_found_inf(found);
  return found;
}

/// clip.hpp's total_norm_squared on device memory: the sum of squares in double, for the
/// distributed total norm. Each square is rounded on its own and the sum is a tree (Thrust's reduction),
/// so it may differ from the host's left-to-right sum in the last bits. Waits for its answer.
template <device_floating_point T>
double total_norm_squared(std::span<const T> x, cudaStream_t stream = nullptr) {
  if (x.empty()) {
    return 0.0;
  }
  return thrust::transform_reduce(thrust::cuda::par.on(stream), x.data(), x.data() + x.size(), detail::square_in_double<T>{},
                                  0.0, thrust::plus<double>{});
}

/// clip.hpp's clip_grads_with_norm on device memory: every gradient *= clip_coefficient(max_norm,
/// total_norm), bit for bit with the host. Returns the coefficient; the multiplication is queued on
/// the stream.
template <device_floating_point T>
T clip_grads_with_norm(const std::vector<std::span<T>>& grads, double max_norm, T total_norm, cudaStream_t stream = nullptr) {
  const T coef = clip_coefficient(max_norm, total_norm);
  for (const std::span<T> g : grads) {
    if (g.empty()) continue;
    detail::scale_kernel<<<detail::blocks_for(g.size()), detail::threads_per_block, 0, stream>>>(g.data(), g.size(), coef);
    detail::check_launch("ddp::optim::cuda::clip_grads_with_norm: kernel launch");
  }
  return coef;
}

namespace detail {
template <device_floating_point T>
double squared_norm(const std::vector<std::span<T>>& grads, cudaStream_t stream) {
  double squared = 0.0;
  for (const std::span<T> g : grads) squared += total_norm_squared(std::span<const T>(g.data(), g.size()), stream);
  return squared;
}
template <device_floating_point T>
T clip_with_squared_norm(const std::vector<std::span<T>>& grads, double max_norm, double squared, cudaStream_t stream) {
  const T total = static_cast<T>(std::sqrt(squared));
  clip_grads_with_norm(grads, max_norm, total, stream);
  return total;
}
}  // namespace detail

/// clip.hpp's clip_grad_norm on device memory: every gradient *= clip_coefficient(max_norm, total)
/// with total the norm of all of them; returns total (before clipping). The norm is the square root
/// of total_norm_squared's sum in double, not torch's float lanes as on the host, so it may differ
/// from the host's total in the last bits.
template <device_floating_point T>
T clip_grad_norm(const std::vector<std::span<T>>& grads, double max_norm, cudaStream_t stream = nullptr) {
  return detail::clip_with_squared_norm(grads, max_norm, detail::squared_norm(grads, stream), stream);
}

/// distributed.hpp's clip_grad_norm over gradients in device memory: torch.nn.utils.clip_grad_norm_
/// across a group; returns the total norm (before clipping), the same on every rank. replicated:
/// every rank holds the same gradients, so its own norm is the total (the form above, no
/// communication); sharded: one all_reduce(sum) of this rank's squared norm in double (a host
/// scalar, so any group will do), then every shard *= clip_coefficient(max_norm, total).
template <class Group, device_floating_point T>
T clip_grad_norm(Group& group, const std::vector<std::span<T>>& grads, double max_norm, grad_layout layout, cudaStream_t stream = nullptr) {
  double squared = detail::squared_norm(grads, stream);
  if (layout == grad_layout::sharded) group.all_reduce(std::span<double>(&squared, 1), ddp::sum{});
  return detail::clip_with_squared_norm(grads, max_norm, squared, stream);
}
}  // namespace ddp::optim::cuda
