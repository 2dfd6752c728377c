#pragma once
// Float math in the order PyTorch's AVX2/AVX-512 CPU kernels evaluate it, so that the tutorial
// job reproduces PyTorch's losses and parameters bit for bit:
//  - exp/log as Sleef's u10 single-precision kernels (Vectorized<float>::exp()/log() in ATen),
//    with fused multiply-adds exactly where Sleef's FMA build has them;
//  - the cascade sums of nll_loss (8 levels) and of sum(dim=0) (4 levels x 4-way ILP).
// Every fused operation is an explicit fmaf; the targets build with -ffp-contract=off (host)
// and -fmad=false (CUDA) so the compiler fuses nothing else. No -ffast-math.
// The functions are __host__ __device__ in a CUDA build: the device gets the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TRAIN_HD __host__ __device__
#else
#define TRAIN_HD
#endif

namespace train {

TRAIN_HD inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
TRAIN_HD inline std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

namespace detail {

// A float-float pair (hi, lo): Sleef's vfloat2.
struct ff {
  float x, y;
};

TRAIN_HD inline float pow2i(int q) { return from_bits(static_cast<std::uint32_t>(q + 0x7f) << 23); }
TRAIN_HD inline float ldexp2(float d, int e) { return d * pow2i(e >> 1) * pow2i(e - (e >> 1)); }

TRAIN_HD inline ff add2_f_f(float x, float y) {  // dfadd2_vf2_vf_vf
  const float s = x + y;
  const float v = s - x;
  return {s, (x - (s - v)) + (y - v)};
}
TRAIN_HD inline ff add_ff_ff(ff x, ff y) {  // dfadd_vf2_vf2_vf2, |x| >= |y|
  const float s = x.x + y.x;
  return {s, (((x.x - s) + y.x) + x.y) + y.y};
}
TRAIN_HD inline ff add_ff_f(ff x, float y) {  // dfadd_vf2_vf2_vf
  const float s = x.x + y;
  return {s, ((x.x - s) + y) + x.y};
}
TRAIN_HD inline ff scale(ff d, float s) { return {d.x * s, d.y * s}; }
TRAIN_HD inline ff mul_ff_f(ff x, float y) {  // dfmul_vf2_vf2_vf (FMA variant)
  const float s = x.x * y;
  return {s, fmaf(x.y, y, fmaf(x.x, y, -s))};
}
TRAIN_HD inline ff div_ff_ff(ff n, ff d) {  // dfdiv_vf2_vf2_vf2 (FMA variant)
  const float t = 1.0f / d.x;
  const float s = n.x * t;
  const float u = fmaf(t, n.x, -s);
  const float v = fmaf(-d.y, t, fmaf(-d.x, t, 1.0f));
  return {s, fmaf(s, v, fmaf(n.y, t, u))};
}

// _mm512_getexp_ps / _mm512_getmant_ps(_MM_MANT_NORM_p75_1p5) for positive normal floats.
TRAIN_HD inline float getexp(float d) {
  return static_cast<float>(static_cast<int>((to_bits(d) >> 23) & 0xff) - 0x7f);
}
TRAIN_HD inline float getmant_p75_1p5(float d) {
  const std::uint32_t b = to_bits(d) & 0x007fffffu;
  // significand >= 1.5 (top fraction bit set): exponent -1, else exponent 0
  return from_bits(b | ((b & 0x00400000u) ? 0x3f000000u : 0x3f800000u));
}

}  // namespace detail

/// Sleef_expf16_u10 (xexpf), as ATen's Vectorized<float>::exp() on AVX-512.
TRAIN_HD inline float torch_expf(float d) {
  const int q = static_cast<int>(rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f));
  const float qf = static_cast<float>(q);
  float s = fmaf(qf, -0.693145751953125f, d);
  s = fmaf(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = fmaf(u, s, 0.00139304355252534151077271f);
  u = fmaf(u, s, 0.00833336077630519866943359f);
  u = fmaf(u, s, 0.0416664853692054748535156f);
  u = fmaf(u, s, 0.166666671633720397949219f);
  u = fmaf(u, s, 0.5f);
  u = 1.0f + fmaf(s * s, u, s);
  u = detail::ldexp2(u, q);
  if (d < -104.0f) u = 0.0f;
  if (d > 100.0f) u = INFINITY;
  return u;
}

/// Sleef_logf16_u10 (xlogf_u1, AVX-512 path), as ATen's Vectorized<float>::log().
TRAIN_HD inline float torch_logf(float d) {
  if (!(d > 0.0f)) return d == 0.0f ? -INFINITY : NAN;
  if (std::isinf(d)) return INFINITY;
  float e = detail::getexp(d * (1.0f / 0.75f));
  if (d < 1.17549435e-38f) {  // subnormal: not reached by this job; fall back to the libm value
    return logf(d);
  }
  const float m = detail::getmant_p75_1p5(d);
  detail::ff s = detail::mul_ff_f({0.69314718246459960938f, -1.904654323148236017e-09f}, e);
  const detail::ff x = detail::div_ff_ff(detail::add2_f_f(-1.0f, m), detail::add2_f_f(1.0f, m));
  const float x2 = x.x * x.x;
  float t = +0.3027294874e+0f;
  t = fmaf(t, x2, +0.3996108174e+0f);
  t = fmaf(t, x2, +0.6666694880e+0f);
  s = detail::add_ff_ff(s, detail::scale(x, 2.0f));
  s = detail::add_ff_f(s, x2 * x.x * t);
  return s.x + s.y;
}

/// at::native's multi_row_sum/row_sum for one column: the order of x.sum(dim=0) on a
/// contiguous [n, c] float tensor (SumKernel.cpp: 4-way ILP, 4 cascade levels). `load` returns
/// a float, or a vector of floats (GCC's vector extension) to sum several columns at once: the
/// additions are elementwise, so each lane has the bits of its column's scalar sum.
template <class Load>
TRAIN_HD auto torch_column_sum(long n, const Load& load) {
  using V = decltype(load(0L));
  constexpr int ilp = 4, levels = 4;
  const long rows = n / ilp;  // the (rows, 4)-shaped view that multi_row_sum reduces
  long ceil_log2 = 0;
  while ((1L << ceil_log2) < rows) ++ceil_log2;
  const long power = ceil_log2 / levels > 4 ? ceil_log2 / levels : 4;
  const long step = 1L << power, mask = step - 1;
  V acc[levels][ilp] = {};
  long i = 0;
  for (; i + step <= rows;) {
    for (long j = 0; j < step; ++j, ++i)
      for (int k = 0; k < ilp; ++k) acc[0][k] += load(i * ilp + k);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < ilp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < ilp; ++k) acc[0][k] += load(i * ilp + k);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < ilp; ++k) acc[0][k] += acc[j][k];
  for (long r = rows * ilp; r < n; ++r) acc[0][0] += load(r);
  V total = acc[0][0];
  for (int k = 1; k < ilp; ++k) total += acc[0][k];
  return V{} + total;  // the output starts at zero and is accumulated into
}

/// The reduction of nll_loss_out_frame (LossNLL.cpp): sum of -x[b], 8 cascade levels.
template <class Load>
TRAIN_HD float torch_nll_sum(long n, const Load& load) {
  constexpr int levels = 8;
  long ceil_log2 = 0;
  while ((1L << ceil_log2) < n) ++ceil_log2;
  const long power = ceil_log2 / levels > 4 ? ceil_log2 / levels : 4;
  const long mask = (1L << power) - 1;
  float partial[levels] = {};
  for (long b = 0; b < n; ++b) {
    partial[0] -= load(b);
    for (int j = 0; j + 1 < levels; ++j) {
      if ((b & (mask << (j * power))) != 0) break;
      partial[j + 1] += partial[j];
      partial[j] = 0.0f;
    }
  }
  float total = 0.0f;
  for (int j = 0; j < levels; ++j) total += partial[j];
  return total;
}

}  // namespace train
