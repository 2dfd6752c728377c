// Reduce ops on every dtype against closed forms: contributions x_r = r + 1 for r in [0, n)
// give sum n(n+1)/2, prod n!, min 1, max n, avg (n+1)/2; each is folded the way a backend
// does (in the accumulation type, then finish()), and compared with values computed here
// in int64 / double without the ops.
#include <ddp/core/reduce_op.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "support/element_values.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_reduce_op {

namespace {

using ddp::test::to;
using ddp::test::from;

// Folds n contributions with op, in accumulate_t<T>, then finishes and stores as T.
template <class T, class Op>
T reduce(const std::vector<T>& contributions, Op op) {
  using A = ddp::accumulate_t<T>;
  A acc = static_cast<A>(contributions.front());
  for (std::size_t i = 1; i < contributions.size(); ++i) acc = op(acc, static_cast<A>(contributions[i]));
  acc = op.finish(acc, static_cast<int>(contributions.size()));
  if constexpr (ddp::half_precision<T>) return T(acc);
  else return acc;
}

template <class T>
void check_closed_forms() {
  const bool is_integer = std::numeric_limits<ddp::accumulate_t<T>>::is_integer;
  // Small enough that every result is exact in each type (5! = 120 fits uint8 and float16).
  for (int n : {1, 2, 3, 4, 5}) {
    std::vector<T> xs;
    for (int r = 0; r < n; ++r) xs.push_back(to<T>(r + 1.0));
    std::int64_t factorial = 1;
    for (int k = 2; k <= n; ++k) factorial *= k;
    const double sum = n * (n + 1) / 2.0;
    const double avg = is_integer ? static_cast<double>(n * (n + 1) / 2 / n) : (n + 1) / 2.0;
    INFO("dtype " << ddp::to_string(ddp::dtype_of<T>) << ", n = " << n);
    CHECK(from(reduce(xs, ddp::sum{})) == sum);
    CHECK(from(reduce(xs, ddp::prod{})) == static_cast<double>(factorial));
    CHECK(from(reduce(xs, ddp::min{})) == 1.0);
    CHECK(from(reduce(xs, ddp::max{})) == static_cast<double>(n));
    CHECK(from(reduce(xs, ddp::avg{})) == avg);
    // The order of contributions does not matter for these.
    std::vector<T> reversed(xs.rbegin(), xs.rend());
    CHECK(from(reduce(reversed, ddp::min{})) == 1.0);
    CHECK(from(reduce(reversed, ddp::max{})) == static_cast<double>(n));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("reduce ops match closed forms on every dtype", "", float, double, ddp::float16, ddp::bfloat16,
                   std::int32_t, std::int64_t, std::uint8_t) {
  check_closed_forms<TestType>();
}

TEST_CASE("reduce ops on signed and fractional values") {
  // min / max with negatives; avg of floats is exact division.
  CHECK(ddp::min{}(-3, 2) == -3);
  CHECK(ddp::max{}(-3, -7) == -3);
  CHECK(ddp::min{}(-0.5, 0.25) == -0.5);
  CHECK(ddp::avg{}.finish(7.0, 2) == 3.5);
  CHECK(ddp::avg{}.finish(7.0f, 4) == 1.75f);
  // Integer avg truncates toward zero (like C++ division of the sum).
  CHECK(ddp::avg{}.finish(std::int32_t{7}, 2) == 3);
  CHECK(ddp::avg{}.finish(std::int32_t{-7}, 2) == -3);
  CHECK(ddp::avg{}.finish(std::int64_t{-9}, 4) == -2);
  CHECK(ddp::prod{}(-2.0, 3.0) == -6.0);
  // Non-avg ops finish as the identity.
  CHECK(ddp::sum{}.finish(7, 3) == 7);
  CHECK(ddp::max{}.finish(2.5, 3) == 2.5);
}

TEST_CASE("uint8 arithmetic wraps modulo 256") {
  const std::uint8_t a = 200, b = 100;
  CHECK(ddp::sum{}(a, b) == static_cast<std::uint8_t>((200 + 100) % 256));
  CHECK(ddp::prod{}(std::uint8_t{16}, std::uint8_t{16}) == 0);
  CHECK(ddp::prod{}(std::uint8_t{17}, std::uint8_t{16}) == static_cast<std::uint8_t>(17 * 16 % 256));
  // avg of a wrapped sum: (250 + 10) mod 256 = 4, / 2 = 2 (what NCCL does for uint8).
  CHECK(ddp::avg{}.finish(ddp::avg{}(std::uint8_t{250}, std::uint8_t{10}), 2) == 2);
  CHECK(ddp::min{}(std::uint8_t{255}, std::uint8_t{0}) == 0);
  CHECK(ddp::max{}(std::uint8_t{255}, std::uint8_t{0}) == 255);
  // 8 ranks contributing 40 each: 320 mod 256 = 64.
  std::vector<std::uint8_t> xs(8, 40);
  CHECK(reduce(xs, ddp::sum{}) == 64);
}

TEST_CASE("signed integers wrap in two's complement, as torch's integer tensors do") {
  constexpr auto imax = std::numeric_limits<std::int32_t>::max(), imin = std::numeric_limits<std::int32_t>::min();
  CHECK(ddp::sum{}(imax, std::int32_t{1}) == imin);
  CHECK(ddp::avg{}(imin, std::int32_t{-1}) == imax);
  CHECK(ddp::prod{}(std::int32_t{65536}, std::int32_t{65536}) == 0);  // 2^32 mod 2^32
  CHECK(ddp::prod{}(std::int32_t{65537}, std::int32_t{65537}) == 131073);  // 2^32 + 2^17 + 1 mod 2^32
  constexpr auto lmax = std::numeric_limits<std::int64_t>::max(), lmin = std::numeric_limits<std::int64_t>::min();
  CHECK(ddp::sum{}(lmax, std::int64_t{1}) == lmin);
  CHECK(ddp::prod{}(lmin, std::int64_t{-1}) == lmin);
}

TEST_CASE("half-precision values reduce in float32 and round once") {
  // 2048 + 1 + 1 in float16: pairwise in float16 would stay at 2048 (2049 rounds to even);
  // accumulating in float gives 2050, which float16 represents.
  std::vector<ddp::float16> xs{ddp::float16(2048.0f), ddp::float16(1.0f), ddp::float16(1.0f)};
  CHECK(from(reduce(xs, ddp::sum{})) == 2050.0);
  std::vector<ddp::bfloat16> ys{ddp::bfloat16(256.0f), ddp::bfloat16(1.0f), ddp::bfloat16(1.0f)};
  CHECK(from(reduce(ys, ddp::sum{})) == 258.0);
}

TEST_CASE("reduce kinds, names and runtime dispatch") {
  STATIC_REQUIRE(ddp::reduce_op<ddp::sum>);
  STATIC_REQUIRE(ddp::reduce_op<ddp::avg>);
  STATIC_REQUIRE(ddp::reduce_op<ddp::min>);
  STATIC_REQUIRE(ddp::reduce_op<ddp::max>);
  STATIC_REQUIRE(ddp::reduce_op<ddp::prod>);
  STATIC_REQUIRE_FALSE(ddp::reduce_op<int>);
  CHECK(ddp::sum::name == "sum");
  CHECK(ddp::avg::name == "avg");
  CHECK(ddp::min::name == "min");
  CHECK(ddp::max::name == "max");
  CHECK(ddp::prod::name == "prod");
  for (auto k : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max,
                 ddp::reduce_kind::prod}) {
    const auto got = ddp::visit_reduce_kind(k, [](auto op) { return decltype(op)::kind; });
    CHECK(got == k);
    // And the dispatched op computes that kind: 3 op 4, finished over 2 contributions.
    const double v = ddp::visit_reduce_kind(k, [](auto op) { return op.finish(op(3.0, 4.0), 2); });
    const double want = k == ddp::reduce_kind::sum   ? 7.0
                        : k == ddp::reduce_kind::avg ? 3.5
                        : k == ddp::reduce_kind::min ? 3.0
                        : k == ddp::reduce_kind::max ? 4.0
                                                     : 12.0;
    CHECK(v == want);
  }
}

TEST_CASE("runtime_op: the same results as the static op it names") {
  STATIC_REQUIRE(ddp::any_reduce_op<ddp::runtime_op>);
  STATIC_REQUIRE(ddp::any_reduce_op<ddp::sum>);
  // No operator(): an elementwise loop must go through with_static_op, never switch per element.
  STATIC_REQUIRE_FALSE(ddp::reduce_op<ddp::runtime_op>);
  for (auto k : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max,
                 ddp::reduce_kind::prod}) {
    const ddp::runtime_op op{k};
    CHECK(ddp::kind_of(op) == k);
    CHECK(ddp::with_static_op(op, [](auto s) { return decltype(s)::kind; }) == k);
    // 3 op 4 op 5 over three contributions, against the closed form of each kind.
    const double v = ddp::with_static_op(op, [](auto s) { return ddp::finish_reduction(s, s(s(3.0, 4.0), 5.0), 3); });
    const double want = k == ddp::reduce_kind::sum   ? 12.0
                        : k == ddp::reduce_kind::avg ? 4.0
                        : k == ddp::reduce_kind::min ? 3.0
                        : k == ddp::reduce_kind::max ? 5.0
                                                     : 60.0;
    CHECK(v == want);
    // finish_reduction on the runtime op divides only for avg.
    CHECK(ddp::finish_reduction(op, 12.0, 3) == (k == ddp::reduce_kind::avg ? 4.0 : 12.0));
    CHECK(ddp::finish_reduction(op, std::int64_t{12}, 3) == (k == ddp::reduce_kind::avg ? 4 : 12));
  }
}

}  // namespace ddp_test_reduce_op
