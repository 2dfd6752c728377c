// The shared-memory reduction kernel (shm_direct::erased_fold), both walks, against a float64
// reference computed here: every source count, one to three destinations (each aliasing the
// source of its index, where there is one, as the zero-copy all-reduce calls it), lengths around
// the kernel's block and cache-line boundaries, and guard elements on both sides that must stay
// untouched.
#include <ddp/backends/ring/shm_direct.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace ddp_test_shm_fold {

namespace {

namespace shm_direct = ddp::algo::shm_direct;
using ddp::reduce_kind;

constexpr std::size_t guard = 40;  // elements before and after each array's range
constexpr double guard_value = -12345;

// Small integers: exact in every element type, so sums, minima and maxima are exact too.
double input(int source, std::size_t i) { return static_cast<double>((i * 7 + static_cast<std::size_t>(source) * 3) % 11) + source + 1; }

double reference(int p, std::size_t i, reduce_kind kind) {
  double acc = input(0, i);
  for (int j = 1; j < p; ++j) {
    const double x = input(j, i);
    if (kind == reduce_kind::sum || kind == reduce_kind::avg) acc += x;
    else if (kind == reduce_kind::min) acc = x < acc ? x : acc;
    else acc = x > acc ? x : acc;
  }
  return kind == reduce_kind::avg ? acc / p : acc;
}

template <class E>
void check_fold(int p, int ndst, std::size_t n, shm_direct::walk direction, reduce_kind kind) {
  // Array a holds guard + n + guard elements; source d doubles as destination d.
  const int arrays = std::max(p, ndst);
  std::vector<std::vector<E>> store(static_cast<std::size_t>(arrays), std::vector<E>(n + 2 * guard, static_cast<E>(guard_value)));
  for (int a = 0; a < arrays; ++a)
    for (std::size_t i = 0; i < n; ++i) store[static_cast<std::size_t>(a)][guard + i] = static_cast<E>(a < p ? input(a, i) : guard_value);
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  for (int j = 0; j < p; ++j) srcs.push_back(reinterpret_cast<const std::byte*>(store[static_cast<std::size_t>(j)].data() + guard));
  for (int d = 0; d < ndst; ++d) dsts.push_back(reinterpret_cast<std::byte*>(store[static_cast<std::size_t>(d)].data() + guard));

  ddp::visit_reduce_kind(kind, [&](auto op) { shm_direct::erase_fold<E>(op)(srcs.data(), p, dsts.data(), ndst, n, direction); });

  const std::string what = "p=" + std::to_string(p) + " ndst=" + std::to_string(ndst) + " n=" + std::to_string(n) +
                           (direction == shm_direct::walk::descending ? " descending " : " ascending ") + std::string(ddp::to_string(kind));
  INFO(what);
  for (int a = 0; a < arrays; ++a) {
    const auto& v = store[static_cast<std::size_t>(a)];
    for (std::size_t i = 0; i < guard; ++i) {
      REQUIRE(static_cast<double>(v[i]) == guard_value);
      REQUIRE(static_cast<double>(v[guard + n + i]) == guard_value);
    }
    for (std::size_t i = 0; i < n; ++i) {
      const double want = a < ndst ? reference(p, i, kind) : input(a, i);  // a source that is no destination is left alone
      const double got = static_cast<double>(v[guard + i]);
      if (std::is_floating_point_v<E> || kind != reduce_kind::avg) {
        if (got != Approx(want).epsilon(1e-6)) FAIL_CHECK("array " << a << " element " << i << ": " << got << " != " << want);
      } else if (got != static_cast<double>(static_cast<E>(want))) {  // integer avg: truncated like the op
        FAIL_CHECK("array " << a << " element " << i << ": " << got << " != " << static_cast<E>(want));
      }
    }
  }
}

}  // namespace

TEST_CASE("shm fold: both walks reduce every element once, for every source and destination count, and touch nothing else") {
  for (auto direction : {shm_direct::walk::ascending, shm_direct::walk::descending})
    for (int p = 1; p <= 5; ++p)
      for (int ndst = 1; ndst <= 3; ++ndst)
        for (std::size_t n : {0, 1, 15, 16, 17, 63, 2047, 2048, 2049, 4096 + 5})
          for (auto kind : {reduce_kind::sum, reduce_kind::avg, reduce_kind::min, reduce_kind::max}) {
            check_fold<float>(p, ndst, n, direction, kind);
            check_fold<double>(p, ndst, n, direction, kind);
            check_fold<std::int32_t>(p, ndst, n, direction, kind);
          }
}

}  // namespace ddp_test_shm_fold
