#pragma once
// torch's CPU distributions on a ddp::torch_generator, value for value and draw for draw.
//
// Matches torch 2.15.0 (x86-64 CPU). Each function consumes exactly the generator words torch
// consumes for the same call, so mixing calls in torch's order reproduces a torch script:
//   randperm(n)          n < 214748364: a[i] <-> a[i + random() % (n-i)], n-1 words;
//                        larger n: inside-out Fisher-Yates with random64() % (i+1)
//   randint(lo, hi)      range >= 2^28: random64() % range + lo (2 words), else random() % range + lo
//   rand / uniform_      float: (w & 0xFFFFFF) * 2^-24, then fmaf(x, to-from, from), clamp to from
//                        if the result rounds up to `to`
//   rand_float64         (random64() & (2^53-1)) * 2^-53
//   randn, n < 16        double Box-Muller with glibc's log1p/sin/cos, second sample cached in
//                        the generator
//   randn, n >= 16       torch's normal_fill: n uniform floats, Box-Muller in blocks of 16 with
//                        avx_mathfun's float log/sincos, and the last block redrawn when n % 16 != 0
// Two results depend on the kernel torch dispatches to (torch.backends.cpu.get_cpu_capability()):
// randn for n >= 16 and uniform_. torch_cpu_kernel::avx2 (the default here) reproduces the AVX2
// and AVX512 kernels (identical bits); torch_cpu_kernel::scalar reproduces ATEN_CPU_CAPABILITY=default
// or a CPU without AVX2 (glibc logf/cosf/sinf, no FMA).
//
// Requirements for bit-exactness: IEEE float/double, round-to-nearest, no -ffast-math. The
// randn n < 16 path and the scalar kernel need glibc's libm (the library torch itself calls);
// other C libraries may differ in the last bit there.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"
#include "ddp/random/cephes.hpp"
#include "ddp/random/generator.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <cmath>
#include <limits>
#include <numbers>
#include <utility>
#endif

namespace ddp {

/// Which torch CPU kernel to reproduce where the kernels give different bits.
enum class torch_cpu_kernel {
  avx2,    // AVX2 and AVX512 builds (torch's choice on any x86-64 CPU with AVX2)
  scalar,  // the DEFAULT build (ATEN_CPU_CAPABILITY=default, non-AVX2 CPUs)
};

namespace detail {

inline float uniform_float(torch_generator& gen) noexcept {
  return static_cast<float>(gen.random() & 0xFFFFFFU) * 0x1p-24f;
}
inline double uniform_double(torch_generator& gen) noexcept {
  return static_cast<double>(gen.random64() & ((std::uint64_t{1} << 53) - 1)) * 0x1p-53;
}

// torch's at::normal_distribution<double> (mean 0, std 1): the cached sample first.
double normal_double(torch_generator& gen);

// normal_fill_16_AVX2 / normal_fill_16 on d[0..15], mean 0 and std 1.
void normal_block16(float* d, torch_cpu_kernel kernel);

std::size_t checked_count(std::int64_t n, const char* op);

}  // namespace detail

// ---- integers ------------------------------------------------------------------------------

namespace detail {
// torch's original algorithm, kept for n < 2^32 / 20: a[i] <-> a[i + random() % (n - i)].
void randperm_small(std::span<std::int64_t> a, torch_generator& gen) noexcept;
// Above that, random() % n would be visibly biased: inside-out Fisher-Yates with random64().
void randperm_large(std::span<std::int64_t> a, torch_generator& gen) noexcept;
}  // namespace detail

/// torch.randperm(n, generator=gen) (int64).
std::vector<std::int64_t> randperm(std::int64_t n, torch_generator& gen);

/// torch.randint(low, high, (n,), generator=gen): values in [low, high).
std::vector<std::int64_t> randint(std::int64_t low, std::int64_t high, std::int64_t n, torch_generator& gen);

/// torch.empty(n, dtype=torch.int32).random_(generator=gen): w % 2^31, one word each.
std::vector<std::int32_t> random_int32(std::int64_t n, torch_generator& gen);

/// torch.empty(n, dtype=torch.int64).random_(generator=gen): random64() % 2^63.
std::vector<std::int64_t> random_int64(std::int64_t n, torch_generator& gen);

// ---- uniform floats ------------------------------------------------------------------------

/// Tensor.uniform_(from, to) on a float32 tensor, in memory order.
void fill_uniform(std::span<float> out, double from, double to, torch_generator& gen,
                  torch_cpu_kernel kernel = torch_cpu_kernel::avx2);

std::vector<float> uniform(std::int64_t n, double from, double to, torch_generator& gen,
                           torch_cpu_kernel kernel = torch_cpu_kernel::avx2);

/// torch.rand(n, generator=gen): (w & 0xFFFFFF) * 2^-24, one word each (any kernel).
std::vector<float> rand(std::int64_t n, torch_generator& gen);

/// torch.rand(n, dtype=torch.float64, generator=gen): two words each.
std::vector<double> rand_float64(std::int64_t n, torch_generator& gen);

// ---- normal floats -------------------------------------------------------------------------

/// torch.randn(out.size(), generator=gen) written into a contiguous float32 buffer.
void fill_randn(std::span<float> out, torch_generator& gen, torch_cpu_kernel kernel = torch_cpu_kernel::avx2);

/// torch.randn(n, generator=gen). For a tensor of shape [a, b, ...] pass the element count:
/// torch fills contiguous tensors in row-major order.
std::vector<float> randn(std::int64_t n, torch_generator& gen, torch_cpu_kernel kernel = torch_cpu_kernel::avx2);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
namespace detail {

DDP_COMPILED_INLINE double normal_double(torch_generator& gen) {
  if (const auto cached = gen.next_double_normal_sample()) {
    gen.set_next_double_normal_sample(std::nullopt);
    return *cached;
  }
  const double u1 = uniform_double(gen);
  const double u2 = uniform_double(gen);
  const double r = std::sqrt(-2.0 * std::log1p(-u2));
  const double theta = 2.0 * std::numbers::pi * u1;
  gen.set_next_double_normal_sample(r * std::sin(theta));
  return r * std::cos(theta);
}

DDP_COMPILED_INLINE void normal_block16(float* d, torch_cpu_kernel kernel) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - d[j];  // [0,1) -> (0,1] for the log
    const float u2 = d[j + 8];
    float radius = 0, s = 0, c = 0;
    if (kernel == torch_cpu_kernel::avx2) {
      radius = std::sqrt(-2.0f * cephes_logf(u1));
      const float theta = static_cast<float>(2.0 * std::numbers::pi) * u2;
      cephes_sincosf(theta, s, c);
      // fmadd(n, std, mean) with std 1 and mean 0: exact, but turns -0 into +0 as torch does
      d[j] = std::fma(radius * c, 1.0f, 0.0f);
      d[j + 8] = std::fma(radius * s, 1.0f, 0.0f);
    } else {
      radius = std::sqrt(-2.0f * std::log(u1));
      const float theta = static_cast<float>(2.0 * std::numbers::pi * static_cast<double>(u2));
      d[j] = rounded(rounded(radius * std::cos(theta)) * 1.0f) + 0.0f;
      d[j + 8] = rounded(rounded(radius * std::sin(theta)) * 1.0f) + 0.0f;
    }
  }
}

DDP_COMPILED_INLINE std::size_t checked_count(std::int64_t n, const char* op) {
  if (n < 0)
    throw error(errc::invalid_argument, std::string(op) + ": the number of values must be >= 0, got " + std::to_string(n),
                {.op = op});
  return static_cast<std::size_t>(n);
}

DDP_COMPILED_INLINE void randperm_small(std::span<std::int64_t> a, torch_generator& gen) noexcept {
  const auto n = static_cast<std::int64_t>(a.size());
  for (std::int64_t i = 0; i < n; ++i) a[static_cast<std::size_t>(i)] = i;
  for (std::int64_t i = 0; i < n - 1; ++i) {
    const auto z = static_cast<std::int64_t>(gen.random() % static_cast<std::uint64_t>(n - i));
    std::swap(a[static_cast<std::size_t>(i)], a[static_cast<std::size_t>(i + z)]);
  }
}

DDP_COMPILED_INLINE void randperm_large(std::span<std::int64_t> a, torch_generator& gen) noexcept {
  const auto n = static_cast<std::int64_t>(a.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const auto z = static_cast<std::size_t>(gen.random64() % static_cast<std::uint64_t>(i + 1));
    a[static_cast<std::size_t>(i)] = a[z];
    a[z] = i;
  }
}

}  // namespace detail

DDP_COMPILED_INLINE std::vector<std::int64_t> randperm(std::int64_t n, torch_generator& gen) {
  std::vector<std::int64_t> a(detail::checked_count(n, "randperm"));
  constexpr std::int64_t small_limit = std::numeric_limits<std::uint32_t>::max() / 20;  // 214748364
  if (n < small_limit)
    detail::randperm_small(a, gen);
  else
    detail::randperm_large(a, gen);
  return a;
}

DDP_COMPILED_INLINE std::vector<std::int64_t> randint(std::int64_t low, std::int64_t high, std::int64_t n, torch_generator& gen) {
  const std::size_t count = detail::checked_count(n, "randint");
  if (low >= high)
    throw error(errc::invalid_argument,
                "randint: random_ expects 'from' to be less than 'to', but got from=" + std::to_string(low) +
                    " >= to=" + std::to_string(high),
                {.op = "randint"});
  const std::uint64_t range = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  std::vector<std::int64_t> out(count);
  for (auto& v : out) {
    const std::uint64_t w = range >= (std::uint64_t{1} << 28) ? gen.random64() : gen.random();
    v = static_cast<std::int64_t>(w % range + static_cast<std::uint64_t>(low));
  }
  return out;
}

DDP_COMPILED_INLINE std::vector<std::int32_t> random_int32(std::int64_t n, torch_generator& gen) {
  std::vector<std::int32_t> out(detail::checked_count(n, "random_int32"));
  for (auto& v : out) v = static_cast<std::int32_t>(gen.random() % (std::uint32_t{1} << 31));
  return out;
}

DDP_COMPILED_INLINE std::vector<std::int64_t> random_int64(std::int64_t n, torch_generator& gen) {
  std::vector<std::int64_t> out(detail::checked_count(n, "random_int64"));
  for (auto& v : out) v = static_cast<std::int64_t>(gen.random64() % (std::uint64_t{1} << 63));
  return out;
}

DDP_COMPILED_INLINE void fill_uniform(std::span<float> out, double from, double to, torch_generator& gen,
                                      torch_cpu_kernel kernel) {
  if (!(from <= to))
    throw error(errc::invalid_argument,
                "uniform_ expects to return a [from, to) range, but found from=" + std::to_string(from) +
                    " > to=" + std::to_string(to),
                {.op = "uniform"});
  const auto f = static_cast<float>(from);
  const auto t = static_cast<float>(to);
  const float width = t - f;
  for (auto& v : out) {
    const float x = detail::uniform_float(gen);
    const float value = kernel == torch_cpu_kernel::avx2 ? std::fma(x, width, f) : detail::rounded(x * width) + f;
    v = value == t ? f : value;  // torch's clamp: a value rounded up to `to` becomes `from`
  }
}

DDP_COMPILED_INLINE std::vector<float> uniform(std::int64_t n, double from, double to, torch_generator& gen,
                                               torch_cpu_kernel kernel) {
  std::vector<float> out(detail::checked_count(n, "uniform"));
  fill_uniform(out, from, to, gen, kernel);
  return out;
}

DDP_COMPILED_INLINE std::vector<float> rand(std::int64_t n, torch_generator& gen) {
  std::vector<float> out(detail::checked_count(n, "rand"));
  for (auto& v : out) v = detail::uniform_float(gen);
  return out;
}

DDP_COMPILED_INLINE std::vector<double> rand_float64(std::int64_t n, torch_generator& gen) {
  std::vector<double> out(detail::checked_count(n, "rand_float64"));
  for (auto& v : out) v = detail::uniform_double(gen);
  return out;
}

DDP_COMPILED_INLINE void fill_randn(std::span<float> out, torch_generator& gen, torch_cpu_kernel kernel) {
  const std::size_t n = out.size();
  if (n < 16) {
    // transformation::normal(x, mean 0, std 1) = x * 1 + 0: exact, except that -0 becomes +0
    for (auto& v : out) v = static_cast<float>(detail::normal_double(gen) * 1.0 + 0.0);
    return;
  }
  float* d = out.data();
  for (std::size_t i = 0; i < n; ++i) d[i] = detail::uniform_float(gen);
  for (std::size_t i = 0; i + 16 <= n; i += 16) detail::normal_block16(d + i, kernel);
  if (n % 16 != 0) {
    // torch redraws the last 16 values and transforms them as one block.
    float* tail = d + n - 16;
    for (std::size_t i = 0; i < 16; ++i) tail[i] = detail::uniform_float(gen);
    detail::normal_block16(tail, kernel);
  }
}

DDP_COMPILED_INLINE std::vector<float> randn(std::int64_t n, torch_generator& gen, torch_cpu_kernel kernel) {
  std::vector<float> out(detail::checked_count(n, "randn"));
  fill_randn(out, gen, kernel);
  return out;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
