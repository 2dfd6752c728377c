#pragma once
// Element types that collectives accept, and host float16 / bfloat16.
//
// float16 and bfloat16 are storage types: conversions from float round to nearest,
// ties to even (as IEEE 754 and every GPU do); NaN stays NaN (quiet), infinities and
// signed zeros are kept. Arithmetic goes through float (collectives accumulate
// half-precision data in float32).

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace ddp {

enum class dtype : std::uint8_t { float32, float64, float16, bfloat16, int32, int64, uint8 };

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float64: return "float64";
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::uint8: return "uint8";
  }
  return "unknown";
}

constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return 4;
    case dtype::float64: return 8;
    case dtype::float16: return 2;
    case dtype::bfloat16: return 2;
    case dtype::int32: return 4;
    case dtype::int64: return 8;
    case dtype::uint8: return 1;
  }
  return 0;
}

namespace detail {

constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (f >> 16) & 0x8000u;
  const std::uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u | ((abs >> 13) & 0x3ffu) : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                                   // result is subnormal or zero
    // Value in units of 2^-24 (the half subnormal step), rounded to nearest even.
    const std::uint32_t exponent = abs >> 23;
    if (exponent < 102) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exponent;  // 14..24
    const std::uint32_t result = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    const std::uint32_t rounded = result + ((rest > half || (rest == half && (result & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  const std::uint32_t rebased = abs - (112u << 23);
  const std::uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal half: normalize.
  std::uint32_t e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((f >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounded = f + 0x7fffu + ((f >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE 754 binary16 (1 sign, 5 exponent, 10 mantissa bits).
struct float16 {
  std::uint16_t bits = 0;

  constexpr float16() noexcept = default;
  constexpr explicit float16(float value) noexcept : bits(detail::float_to_half_bits(value)) {}
  static constexpr float16 from_bits(std::uint16_t b) noexcept {
    float16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  friend constexpr bool operator==(float16 a, float16 b) noexcept { return float(a) == float(b); }
};

/// bfloat16 (1 sign, 8 exponent, 7 mantissa bits): the top half of a float32.
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() noexcept = default;
  constexpr explicit bfloat16(float value) noexcept : bits(detail::float_to_bfloat16_bits(value)) {}
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::bfloat16_bits_to_float(bits); }
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return float(a) == float(b); }
};

template <class T> struct dtype_traits;  // specialized for every supported element type
template <> struct dtype_traits<float> { static constexpr dtype value = dtype::float32; };
template <> struct dtype_traits<double> { static constexpr dtype value = dtype::float64; };
template <> struct dtype_traits<float16> { static constexpr dtype value = dtype::float16; };
template <> struct dtype_traits<bfloat16> { static constexpr dtype value = dtype::bfloat16; };
template <> struct dtype_traits<std::int32_t> { static constexpr dtype value = dtype::int32; };
template <> struct dtype_traits<std::int64_t> { static constexpr dtype value = dtype::int64; };
template <> struct dtype_traits<std::uint8_t> { static constexpr dtype value = dtype::uint8; };

/// A type collectives accept (cv-qualifiers ignored).
template <class T>
concept dtype_like = requires { dtype_traits<std::remove_cv_t<T>>::value; };

template <dtype_like T>
inline constexpr dtype dtype_of = dtype_traits<std::remove_cv_t<T>>::value;

/// f(std::type_identity<T>{}) for the element type that `t` names: where a record's runtime
/// dtype becomes a type again (the reduction loops).
template <class F>
constexpr decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::float32: return f(std::type_identity<float>{});
    case dtype::float64: return f(std::type_identity<double>{});
    case dtype::float16: return f(std::type_identity<float16>{});
    case dtype::bfloat16: return f(std::type_identity<bfloat16>{});
    case dtype::int32: return f(std::type_identity<std::int32_t>{});
    case dtype::int64: return f(std::type_identity<std::int64_t>{});
    case dtype::uint8: break;
  }
  return f(std::type_identity<std::uint8_t>{});
}

/// What the data-movement collectives (broadcast, all_gather, all_to_all, send, recv) of the
/// algorithms take: an element type, or std::byte for a call of any element type moved as its
/// bytes. A backend that passes bytes compiles those collectives once, not once per type; the
/// collective's description (and so the mismatch check) still names the caller's type and count.
template <class T>
concept movable_element = dtype_like<T> || std::same_as<std::remove_cv_t<T>, std::byte>;

/// float16 and bfloat16: reduced in float32.
template <class T>
concept half_precision = std::same_as<std::remove_cv_t<T>, float16> || std::same_as<std::remove_cv_t<T>, bfloat16>;

/// The type arithmetic on T is done in: float for the half types, T otherwise.
template <dtype_like T>
using accumulate_t = std::conditional_t<half_precision<T>, float, std::remove_cv_t<T>>;

}  // namespace ddp
