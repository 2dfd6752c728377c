#pragma once
// ddp::optim gradient-norm clipping: torch.nn.utils.clip_grad_norm_ (the 2-norm), whole or split
// for a sharded model.
//
// torch's algorithm (torch 2.15, CPU): norm_i = torch.linalg.vector_norm(g_i) for each gradient
// tensor (torch._foreach_norm falls back to it on CPU), total = vector_norm(stack(norm_i)),
// clip_coef = (total + 1e-6).reciprocal() * max_norm (Python's max_norm / tensor is
// tensor.__rtruediv__), clamped to at most 1 (a NaN stays NaN), and every gradient *= clip_coef.
// vector_norm on a contiguous float tensor runs the AVX2 kernel on AVX2 and AVX512 machines (its
// reduction has no AVX512 variant): 8 float (4 double) lanes of acc += x*x, each product rounded
// (no FMA), the lanes summed in order, the tail added one by one, then sqrt in T.
//
//   vector_norm(span)                 that per-tensor norm: bit for bit on 9 of the 10 golden
//                                     tensors, within vector_norm_ulp_bound (2) ulps always (1 seen:
//                                     a 3-value tensor, which some other reduction path of torch's
//                                     takes; not found).
//   clip_grad_norm(grads, max_norm)   all gradients in this process, each span one of torch's
//                                     gradient tensors: the total within vector_norm_ulp_bound + 1
//                                     ulps of torch's, and the clipped gradients bit for bit
//                                     whenever the total is.
//   total_norm_squared(span)          sum of squares in double, for the distributed form: each rank
//                                     sums its shard, one all_reduce(SUM) across ranks, then
//                                     clip_grads_with_norm(grads, max_norm, T(sqrt(sum))). Not bit
//                                     for bit with torch: the summation differs (torch's float lanes
//                                     per tensor, then a norm of norms). It is the more accurate
//                                     one; the difference is torch's float rounding, within
//                                     (n/8 + 16) * 2^-24 relative for n values (optim_test prints
//                                     the ulps seen on the golden data).
//   clip_grads_with_norm(grads, max_norm, total)   torch.nn.utils.clip_grads_with_norm_, bit for bit
//                                     given the same total.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

namespace ddp::optim {

namespace detail {
/// x, rounded: keeps -ffp-contract=fast from fusing the product into the sum (torch rounds it).
template <std::floating_point T>
inline T clip_rounded(T x) noexcept {
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

/// vector_norm's agreement with torch, in ulps (see the top of this file): optim_test's bound.
inline constexpr std::int64_t vector_norm_ulp_bound = 2;

/// torch.linalg.vector_norm(x) (2-norm) as torch's AVX2 CPU kernel computes it.
template <std::floating_point T>
T vector_norm(std::span<const T> x) noexcept {
  constexpr std::size_t lanes = 32 / sizeof(T);  // one AVX2 register
  std::array<T, lanes> acc{};
  const std::size_t n = x.size();
  const std::size_t vectorized = n - n % lanes;
  std::size_t d = 0;
  for (; d < vectorized; d += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) {
      acc[j] = acc[j] + detail::clip_rounded(x[d + j] * x[d + j]);
    }
  }
  T sum = acc[0];
  for (std::size_t j = 1; j < lanes; ++j) {
    sum = sum + acc[j];
  }
  for (; d < n; ++d) {
    sum = sum + detail::clip_rounded(x[d] * x[d]);
  }
  return std::sqrt(sum);
}

/// Sum of squares of x in double, for a distributed total norm (see above).
template <std::floating_point T>
double total_norm_squared(std::span<const T> x) noexcept {
  double sum = 0.0;
  for (const T v : x) {
    const double d = static_cast<double>(v);
    sum += d * d;
  }
  return sum;
}

/// torch's clip coefficient: min((total + 1e-6)^-1 * max_norm, 1) in T, NaN kept.
template <std::floating_point T>
T clip_coefficient(double max_norm, T total_norm) noexcept {
  const T shifted = total_norm + static_cast<T>(1e-6);
  const T coef = (T(1) / shifted) * static_cast<T>(max_norm);
  return std::isnan(coef) ? coef : std::min(coef, T(1));
}

/// torch.nn.utils.clip_grads_with_norm_: every gradient *= clip_coefficient(max_norm, total_norm).
/// Returns the coefficient.
template <std::floating_point T>
T clip_grads_with_norm(const std::vector<std::span<T>>& grads, double max_norm, T total_norm) noexcept {
  const T coef = clip_coefficient(max_norm, total_norm);
  for (const std::span<T> g : grads) {
    for (T& v : g) {
      v = v * coef;
    }
  }
  return coef;
}

/// torch.nn.utils.clip_grad_norm_(tensors, max_norm) with each span one gradient tensor; returns
/// the total norm (before clipping).
template <std::floating_point T>
T clip_grad_norm(const std::vector<std::span<T>>& grads, double max_norm) {
  if (grads.empty()) {
    return T(0);
  }
  std::vector<T> norms;
  norms.reserve(grads.size());
  for (const std::span<T> g : grads) {
    norms.push_back(vector_norm(std::span<const T>(g.data(), g.size())));
  }
  const T total = vector_norm(std::span<const T>(norms));
  clip_grads_with_norm(grads, max_norm, total);
  return total;
}

}  // namespace ddp::optim
