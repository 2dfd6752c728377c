#pragma once
// Scalar ports of the float log and sincos that torch's AVX2/AVX512 randn kernel uses
// (ATen/native/cpu/avx_mathfun.h: log256_ps, sincos256_ps, Cephes polynomials).
//
// torch builds that kernel with -mfma, and GCC contracts every multiply whose only use is an
// add or subtract into an FMA (without those FMAs, 101 of the 10240 golden values differ); each site is an
// explicit std::fma below, and every other product is rounded on its own. Products that feed
// an add but must not be fused go through detail::rounded() so that a build of this header with
// -mfma / -march=native (and contraction on, GCC's default) cannot fuse them either.
// Only + - * sqrt, fma and int<->float conversions are used: no libm, so no dependence on glibc.

#include <cstdint>

#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <bit>
#include <cmath>
#endif

namespace ddp::detail {

/// Forces `v` to be a rounded float: the compiler cannot fuse the product that produced it
/// into a later add (volatile stores cannot be elided).
float rounded(float v) noexcept;
double rounded(double v) noexcept;

/// log256_ps for one lane: natural log of x > 0 (x = 0 gives -inf-like garbage as in Cephes;
/// the randn caller never passes 0 since u1 = 1 - u is in (0, 1]).
float cephes_logf(float x) noexcept;

/// sincos256_ps for one lane.
void cephes_sincosf(float x, float& sin_out, float& cos_out) noexcept;

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE float rounded(float v) noexcept {
  volatile float stored = v;
  return stored;
}

DDP_COMPILED_INLINE double rounded(double v) noexcept {
  volatile double stored = v;
  return stored;
}

DDP_COMPILED_INLINE float cephes_logf(float x) noexcept {
  const bool is_le_zero = x <= 0.0f;  // invalid_mask (_CMP_LE_OS)
  const float min_norm_pos = std::bit_cast<float>(0x00800000U);
  x = x > min_norm_pos ? x : min_norm_pos;  // _mm256_max_ps(x, min): returns the second operand on NaN

  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::int32_t exponent = static_cast<std::int32_t>(bits >> 23) - 0x7f;
  x = std::bit_cast<float>((bits & ~0x7f800000U) | std::bit_cast<std::uint32_t>(0.5f));
  float e = static_cast<float>(exponent);
  e = e + 1.0f;

  const bool below = x < 0.707106781186547524f;  // SQRTHF
  const float tmp = below ? x : 0.0f;
  x = x - 1.0f;
  e = e - (below ? 1.0f : 0.0f);
  x = x + tmp;

  const float z = x * x;
  float y = 7.0376836292E-2f;
  y = std::fma(y, x, -1.1514610310E-1f);
  y = std::fma(y, x, 1.1676998740E-1f);
  y = std::fma(y, x, -1.2420140846E-1f);
  y = std::fma(y, x, +1.4249322787E-1f);
  y = std::fma(y, x, -1.6668057665E-1f);
  y = std::fma(y, x, +2.0000714765E-1f);
  y = std::fma(y, x, -2.4999993993E-1f);
  y = std::fma(y, x, +3.3333331174E-1f);
  y = rounded(y * x);
  y = std::fma(y, z, rounded(e * -2.12194440e-4f));  // y*z + e*q1: the y*z product is fused
  y = y - z * 0.5f;                                  // z*0.5 is exact: fused or not, the same
  x = x + y;
  x = std::fma(e, 0.693359375f, x);                  // (x + y) + e*q2
  if (is_le_zero) x = std::bit_cast<float>(0xffffffffU);  // x | invalid_mask: a NaN
  return x;
}

DDP_COMPILED_INLINE void cephes_sincosf(float x, float& sin_out, float& cos_out) noexcept {
  const std::uint32_t sign_in = std::bit_cast<std::uint32_t>(x) & 0x80000000U;
  x = std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) & 0x7fffffffU);

  float y = rounded(x * 1.27323954473516f);  // 4/pi
  std::int32_t j = static_cast<std::int32_t>(y);  // _mm256_cvttps_epi32: truncation
  j = (j + 1) & ~1;
  y = static_cast<float>(j);

  const std::uint32_t swap_sign_sin = (static_cast<std::uint32_t>(j) & 4U) << 29;
  const bool small_quadrant = (j & 2) == 0;  // poly_mask: sin from the sin polynomial, cos from the cos one

  // "Extended precision modular arithmetic": x = ((x - y*DP1) - y*DP2) - y*DP3, each step fused.
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);

  const std::uint32_t sign_cos = (~static_cast<std::uint32_t>(j - 2) & 4U) << 29;
  const std::uint32_t sign_sin = sign_in ^ swap_sign_sin;

  const float z = x * x;
  float yc = std::fma(2.443315711809948E-005f, z, -1.388731625493765E-003f);
  yc = std::fma(yc, z, 4.166664568298827E-002f);
  yc = rounded(yc * z);
  yc = std::fma(yc, z, -(z * 0.5f));  // y*z - z*0.5: y*z fused, z*0.5 exact
  yc = yc + 1.0f;

  float ys = std::fma(-1.9515295891E-4f, z, 8.3321608736E-3f);
  ys = std::fma(ys, z, -1.6666654611E-1f);
  ys = rounded(ys * z);
  ys = std::fma(ys, x, x);  // y2*x + x

  // Select as the vector code does (and/andnot, then sub and add of the selected parts).
  const float ysin2 = small_quadrant ? ys : 0.0f;
  const float ysin1 = small_quadrant ? 0.0f : yc;
  ys = ys - ysin2;
  yc = yc - ysin1;
  const float s = ysin1 + ysin2;
  const float c = yc + ys;
  sin_out = std::bit_cast<float>(std::bit_cast<std::uint32_t>(s) ^ sign_sin);
  cos_out = std::bit_cast<float>(std::bit_cast<std::uint32_t>(c) ^ sign_cos);
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::detail
