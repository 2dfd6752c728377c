// float16 / bfloat16 conversions against independent references:
//  - every one of the 65536 bit patterns of each type round-trips through float;
//  - float -> half / bfloat16 over float32 bit patterns (a stride through all 2^32) and the
//    tie / overflow / subnormal edge cases, against (a) GCC's _Float16 conversion where the
//    compiler has it and (b) a reference that picks the nearer of the two neighbouring
//    representable values in double arithmetic, ties to the even one.
#include <ddp/core/dtype.hpp>

#include <catch2/catch.hpp>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_dtype {

namespace {

// Sanitizers make the loops ~10x slower: walk the float32 space with a bigger stride there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr std::uint64_t float_stride = 997;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(undefined_behavior_sanitizer)
constexpr std::uint64_t float_stride = 997;
#else
constexpr std::uint64_t float_stride = 97;
#endif
#else
constexpr std::uint64_t float_stride = 97;
#endif

struct format {
  int mantissa_bits;  // stored mantissa bits
  int min_exponent;   // exponent of the smallest normal value
  double max_finite;
};
constexpr format half_format{10, -14, 65504.0};
constexpr format bfloat16_format{7, -126, 0x1.fep127};  // (2 - 2^-7) * 2^127

// The value x rounds to in `fmt`, to nearest, ties to even; +-inf past the largest finite value.
// Only double arithmetic on values: no bit layout of the target format is used.
double reference_round(float value, const format& fmt) {
  const double x = value;
  const double a = std::fabs(x);
  if (a == 0.0) return x;
  int e = 0;
  (void)std::frexp(a, &e);                       // a = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, fmt.min_exponent);  // subnormals share the smallest exponent
  const double ulp = std::ldexp(1.0, exponent - fmt.mantissa_bits);
  const double k = std::floor(a / ulp);          // exact: ulp is a power of two
  const double lower = k * ulp;
  const double upper = (k + 1) * ulp;
  const double below = a - lower;
  const double above = upper - a;
  double r = below < above ? lower : above < below ? upper : (std::fmod(k, 2.0) == 0.0 ? lower : upper);
  if (r > fmt.max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

bool same_value(double want, float got) {
  // Equal values with equal signs (so that -0 and +0 differ); both infinite counts as equal.
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

std::string hex(std::uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

bool half_is_nan(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool bfloat16_is_nan(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

}  // namespace

TEST_CASE("float16: all 65536 bit patterns round-trip through float") {
  int failures = 0;
  std::string first;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float f = static_cast<float>(ddp::float16::from_bits(h));
    const std::uint16_t back = ddp::float16(f).bits;
    bool ok;
    if (half_is_nan(h)) {
      // NaN stays NaN, quiet, with its sign.
      ok = std::isnan(f) && half_is_nan(back) && (back & 0x0200u) != 0 && (back & 0x8000u) == (h & 0x8000u);
    } else {
      ok = back == h;
      // The value itself: (-1)^s * 2^(e-15) * 1.m, or 2^-14 * 0.m for subnormals.
      const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
      double want = e == 0x1f ? std::numeric_limits<double>::infinity()
                    : e == 0  ? std::ldexp(m, -24)
                              : std::ldexp(1024 + m, e - 25);
      if (s) want = -want;
      ok = ok && same_value(want, f);
    }
    if (!ok && failures++ == 0) first = hex(h) + " -> " + std::to_string(f) + " -> " + hex(back);
  }
  INFO("first failure: " << first);
  CHECK(failures == 0);
}

TEST_CASE("bfloat16: all 65536 bit patterns round-trip through float") {
  int failures = 0;
  std::string first;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const float f = static_cast<float>(ddp::bfloat16::from_bits(b));
    const std::uint16_t back = ddp::bfloat16(f).bits;
    bool ok;
    if (bfloat16_is_nan(b)) {
      ok = std::isnan(f) && bfloat16_is_nan(back) && (back & 0x0040u) != 0 && (back & 0x8000u) == (b & 0x8000u);
    } else {
      const int s = b >> 15, e = (b >> 7) & 0xff, m = b & 0x7f;
      double want = e == 0xff ? std::numeric_limits<double>::infinity()
                    : e == 0  ? std::ldexp(m, -133)
                              : std::ldexp(128 + m, e - 134);
      if (s) want = -want;
      ok = back == b && same_value(want, f);
    }
    if (!ok && failures++ == 0) first = hex(b) + " -> " + std::to_string(f) + " -> " + hex(back);
  }
  INFO("first failure: " << first);
  CHECK(failures == 0);
}

#ifdef __FLT16_MAX__
TEST_CASE("float16: half -> float agrees with the compiler's _Float16 for all bit patterns") {
  int failures = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float ours = static_cast<float>(ddp::float16::from_bits(h));
    const float theirs = static_cast<float>(std::bit_cast<_Float16>(h));
    if (std::isnan(theirs) ? !std::isnan(ours) : std::bit_cast<std::uint32_t>(ours) != std::bit_cast<std::uint32_t>(theirs)) {
      ++failures;
    }
  }
  CHECK(failures == 0);
}
#endif

TEST_CASE("float16 and bfloat16: float -> half rounds to nearest even over a stride of float32") {
  std::uint64_t checks = 0, half_failures = 0, bf_failures = 0, gcc_failures = 0;
  std::string first_half, first_bf, first_gcc;
  for (std::uint64_t i = 0; i <= 0xffffffffull; i += float_stride) {
    const auto bits = static_cast<std::uint32_t>(i);
    const float f = std::bit_cast<float>(bits);
    ++checks;
    const ddp::float16 h(f);
    const ddp::bfloat16 b(f);
    if (std::isnan(f)) {
      if (!half_is_nan(h.bits) || (h.bits & 0x8000u) != ((bits >> 16) & 0x8000u)) {
        if (half_failures++ == 0) first_half = hex(bits) + " -> " + hex(h.bits);
      }
      if (!bfloat16_is_nan(b.bits) || (b.bits & 0x8000u) != ((bits >> 16) & 0x8000u)) {
        if (bf_failures++ == 0) first_bf = hex(bits) + " -> " + hex(b.bits);
      }
      continue;
    }
    if (!same_value(reference_round(f, half_format), static_cast<float>(h))) {
      if (half_failures++ == 0) first_half = hex(bits) + " -> " + hex(h.bits);
    }
    if (!same_value(reference_round(f, bfloat16_format), static_cast<float>(b))) {
      if (bf_failures++ == 0) first_bf = hex(bits) + " -> " + hex(b.bits);
    }
#ifdef __FLT16_MAX__
    const auto theirs = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    if (theirs != h.bits) {
      if (gcc_failures++ == 0) first_gcc = hex(bits) + " -> ours " + hex(h.bits) + ", _Float16 " + hex(theirs);
    }
#endif
  }
  INFO("float32 patterns checked: " << checks << " (stride " << float_stride << ")");
  INFO("first float16 failure: " << first_half);
  INFO("first bfloat16 failure: " << first_bf);
  INFO("first disagreement with _Float16: " << first_gcc);
  CHECK(checks > 4'000'000);
  CHECK(half_failures == 0);
  CHECK(bf_failures == 0);
  CHECK(gcc_failures == 0);
}

TEST_CASE("float16: ties, overflow, subnormals and specials") {
  struct edge {
    float in;
    std::uint16_t want;
  };
  const std::vector<edge> table = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3c00}, {-2.0f, 0xc000},
      {65504.0f, 0x7bff},                                  // largest finite
      {65519.99f, 0x7bff},                                 // just below the overflow tie
      {65520.0f, 0x7c00},                                  // tie between 65504 (odd) and "65536" (even): inf
      {-65520.0f, 0xfc00}, {65536.0f, 0x7c00}, {FLT_MAX, 0x7c00}, {-FLT_MAX, 0xfc00},
      {std::numeric_limits<float>::infinity(), 0x7c00}, {-std::numeric_limits<float>::infinity(), 0xfc00},
      {0x1p-24f, 0x0001},                                  // smallest subnormal
      {0x1p-25f, 0x0000},                                  // tie between 0 (even) and 2^-24: 0
      {-0x1p-25f, 0x8000},
      {0x1.000002p-25f, 0x0001},                           // just above the tie
      {0x1.8p-24f, 0x0002},                                // 1.5 units: tie, to even 2
      {0x1.4p-23f, 0x0002},                                // 2.5 units: tie, to even 2
      {0x1.ff8p-15f, 0x03ff},                              // largest subnormal (1023 * 2^-24)
      {0x1.ffcp-15f, 0x0400},                              // 1023.5 units: tie, to even 1024 = smallest normal
      {0x1.ffap-15f, 0x03ff},                              // 1023.25 units
      {0x1p-14f, 0x0400},
      {1.0f + 0x1p-11f, 0x3c00},                           // tie: 1 (even)
      {1.0f + 0x1.8p-10f, 0x3c02},                         // tie between 0x3c01 and 0x3c02: even
      {std::bit_cast<float>(0x3f801001u), 0x3c01},         // 1 + 2^-11 + 2^-23: just above the tie
      {FLT_TRUE_MIN, 0x0000}, {-FLT_TRUE_MIN, 0x8000}, {FLT_MIN, 0x0000},
      {2048.0f + 1.0f, 0x6800},                            // 2049: tie between 2048 and 2050: even 2048
      {2048.0f + 3.0f, 0x6802},                            // 2051: tie to 2052
  };
  for (const auto& e : table) {
    INFO("input " << hex(std::bit_cast<std::uint32_t>(e.in)) << " (" << e.in << ")");
    CHECK(hex(ddp::float16(e.in).bits) == hex(e.want));
  }
  const ddp::float16 nan(std::numeric_limits<float>::quiet_NaN());
  CHECK(half_is_nan(nan.bits));
  const ddp::float16 snan(std::bit_cast<float>(0xff800001u));  // signalling NaN whose payload is below half's bits
  CHECK(half_is_nan(snan.bits));
  CHECK((snan.bits & 0x8000u) != 0);
}

TEST_CASE("bfloat16: ties, overflow, subnormals and specials") {
  struct edge {
    std::uint32_t in;  // float32 bits
    std::uint16_t want;
  };
  const std::vector<edge> table = {
      {0x00000000u, 0x0000}, {0x80000000u, 0x8000}, {0x3f800000u, 0x3f80},
      {0x3f808000u, 0x3f80},  // 1 + 2^-8: tie, to even 1
      {0x3f818000u, 0x3f82},  // tie between 0x3f81 and 0x3f82: even
      {0x3f808001u, 0x3f81},  // just above the tie
      {0x3f80ffffu, 0x3f81},
      {0x7f7f0000u, 0x7f7f},  // largest finite bfloat16
      {0x7f7f7fffu, 0x7f7f},  // just below the overflow tie
      {0x7f7f8000u, 0x7f80},  // tie between 0x7f7f (odd) and inf (even)
      {0x7f7fffffu, 0x7f80},  // FLT_MAX
      {0xff7fffffu, 0xff80},
      {0x7f800000u, 0x7f80}, {0xff800000u, 0xff80},
      {0x00000001u, 0x0000},  // FLT_TRUE_MIN: far below the smallest bfloat16 subnormal
      {0x00010000u, 0x0001},  // smallest bfloat16 subnormal
      {0x00008000u, 0x0000},  // tie between 0 and it: 0
      {0x00018000u, 0x0002},  // tie between 1 and 2 units: 2
      {0x007f8000u, 0x0080},  // largest subnormal + half: tie, to even smallest normal
      {0x00800000u, 0x0080},
  };
  for (const auto& e : table) {
    INFO("input " << hex(e.in));
    CHECK(hex(ddp::bfloat16(std::bit_cast<float>(e.in)).bits) == hex(e.want));
  }
  // Signalling NaNs whose payload lies in the low half must not become infinity.
  for (std::uint32_t nan_bits : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f80ffffu}) {
    INFO("input " << hex(nan_bits));
    const ddp::bfloat16 b(std::bit_cast<float>(nan_bits));
    CHECK(bfloat16_is_nan(b.bits));
    CHECK((b.bits & 0x8000u) == ((nan_bits >> 16) & 0x8000u));
  }
}

TEST_CASE("dtype names, sizes and traits") {
  CHECK(ddp::to_string(ddp::dtype::float32) == "float32");
  CHECK(ddp::to_string(ddp::dtype::float64) == "float64");
  CHECK(ddp::to_string(ddp::dtype::float16) == "float16");
  CHECK(ddp::to_string(ddp::dtype::bfloat16) == "bfloat16");
  CHECK(ddp::to_string(ddp::dtype::int32) == "int32");
  CHECK(ddp::to_string(ddp::dtype::int64) == "int64");
  CHECK(ddp::to_string(ddp::dtype::uint8) == "uint8");
  CHECK(ddp::size_of(ddp::dtype::float32) == sizeof(float));
  CHECK(ddp::size_of(ddp::dtype::float64) == sizeof(double));
  CHECK(ddp::size_of(ddp::dtype::float16) == sizeof(ddp::float16));
  CHECK(ddp::size_of(ddp::dtype::bfloat16) == sizeof(ddp::bfloat16));
  CHECK(ddp::size_of(ddp::dtype::int32) == 4);
  CHECK(ddp::size_of(ddp::dtype::int64) == 8);
  CHECK(ddp::size_of(ddp::dtype::uint8) == 1);
  STATIC_REQUIRE(sizeof(ddp::float16) == 2);
  STATIC_REQUIRE(sizeof(ddp::bfloat16) == 2);
  STATIC_REQUIRE(ddp::dtype_of<const float> == ddp::dtype::float32);
  STATIC_REQUIRE(ddp::dtype_of<ddp::bfloat16> == ddp::dtype::bfloat16);
  STATIC_REQUIRE(ddp::dtype_of<std::uint8_t> == ddp::dtype::uint8);
  STATIC_REQUIRE(ddp::dtype_like<std::int64_t>);
  STATIC_REQUIRE_FALSE(ddp::dtype_like<char16_t>);
  STATIC_REQUIRE_FALSE(ddp::dtype_like<std::uint32_t>);
  STATIC_REQUIRE(std::is_same_v<ddp::accumulate_t<ddp::float16>, float>);
  STATIC_REQUIRE(std::is_same_v<ddp::accumulate_t<const ddp::bfloat16>, float>);
  STATIC_REQUIRE(std::is_same_v<ddp::accumulate_t<std::int32_t>, std::int32_t>);
  // Conversions are constexpr.
  STATIC_REQUIRE(ddp::float16(1.0f).bits == 0x3c00);
  STATIC_REQUIRE(ddp::bfloat16(-2.0f).bits == 0xc000);
  // == compares values: +0 == -0, NaN != NaN.
  CHECK(ddp::float16(0.0f) == ddp::float16(-0.0f));
  CHECK_FALSE(ddp::float16(NAN) == ddp::float16(NAN));
  CHECK(ddp::bfloat16(0.0f) == ddp::bfloat16(-0.0f));
}

}  // namespace ddp_test_dtype
