// Collectives on one variable (float loss; g.all_reduce(loss, ddp::avg{})) through process_group
// and the type-erased ddp::group: ranks are threads over the example store backend, results are
// compared with closed forms computed here in float64 (or exactly for integers), p = 1..4.
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/custom_backend/store_backend.hpp"
#include "ddp/group.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/hash_store.hpp"
#include "support/threads.hpp"
#include "support/element_values.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_scalar_collectives {

using namespace std::chrono_literals;
using group_t = ddp::process_group<example::store_backend>;

namespace {

using ddp::test::run_threads;

using ddp::test::from;
using ddp::test::to;

// Rank r's contribution: r + 2 (the product over 4 ranks, 120, fits uint8; every sum and mean
// is exact in float16).
double value(int r) { return r + 2.0; }

struct expected {
  double sum = 0, prod = 1, min = 0, max = 0, avg = 0;
};

template <class T>
expected closed_form(int p) {
  expected e;
  e.min = value(0);
  e.max = value(p - 1);
  for (int r = 0; r < p; ++r) e.sum += value(r), e.prod *= value(r);
  // avg: integers divide the sum with truncation toward zero (the sum is positive here).
  if constexpr (std::is_integral_v<T>) e.avg = static_cast<double>(static_cast<std::int64_t>(e.sum) / p);
  else e.avg = e.sum / p;
  return e;
}

// Every scalar form on group g (process_group<B> or ddp::group), checked against closed forms.
// Failures are collected as strings on the rank's thread; Catch's macros stay on the main thread.
template <class T, class G>
std::vector<std::string> scalar_collectives(G& g) {
  std::vector<std::string> failures;
  auto check = [&](bool ok, const std::string& what, double got, double want) {
    if (!ok) failures.push_back("rank " + std::to_string(g.rank()) + ": " + what + ": " + std::to_string(got) + ", expected " + std::to_string(want));
  };
  const int p = g.size(), me = g.rank();
  const expected e = closed_form<T>(p);
  auto reduced = [&](auto op, double want, const char* what) {
    T x = to<T>(value(me));
    g.all_reduce(x, op);
    check(from(x) == from(to<T>(want)), what, from(x), want);
  };
  reduced(ddp::sum{}, e.sum, "all_reduce sum");
  reduced(ddp::avg{}, e.avg, "all_reduce avg");
  reduced(ddp::min{}, e.min, "all_reduce min");
  reduced(ddp::max{}, e.max, "all_reduce max");
  reduced(ddp::prod{}, e.prod, "all_reduce prod");

  T d = to<T>(value(me));  // the default reduction is sum
  g.all_reduce(d);
  check(from(d) == e.sum, "all_reduce (default sum)", from(d), e.sum);

  T a = to<T>(value(me));
  auto w = g.all_reduce_async(a, ddp::avg{});
  w.wait();
  check(from(a) == from(to<T>(e.avg)), "all_reduce_async avg", from(a), e.avg);

  const int root = p - 1;
  T b = to<T>(10.0 * me + 1);
  g.broadcast(b, root);
  check(from(b) == 10.0 * root + 1, "broadcast", from(b), 10.0 * root + 1);

  T ba = to<T>(me == 0 ? 7.0 : 0.0);
  g.broadcast_async(ba, 0).wait();
  check(from(ba) == 7.0, "broadcast_async", from(ba), 7.0);

  T r = to<T>(value(me));
  g.reduce(r, 0, ddp::max{});
  if (me == 0) check(from(r) == e.max, "reduce max on the root", from(r), e.max);
  return failures;
}

template <class T>
void run_all(bool erased) {
  for (int p = 1; p <= 4; ++p) {
    INFO("p = " << p << (erased ? ", ddp::group" : ", process_group"));
    auto store = std::make_shared<ddp::store::hash_store>();
    std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(p));
    run_threads(p, [&](int rank) {
      group_t typed(example::store_backend(store, rank, p), {.timeout = 30s});
      auto& out = failures[static_cast<std::size_t>(rank)];
      if (erased) {
        ddp::group g(std::move(typed));
        out = scalar_collectives<T>(g);
      } else {
        out = scalar_collectives<T>(typed);
      }
    });
    std::string all;
    for (const auto& rank_failures : failures)
      for (const auto& f : rank_failures) all += f + "\n";
    CHECK(all == "");
  }
}

}  // namespace

TEMPLATE_TEST_CASE("process_group: collectives on one variable, p = 1..4", "[process_group][scalar]", float, double, ddp::float16,
                   ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  run_all<TestType>(false);
}

TEMPLATE_TEST_CASE("group (type-erased): collectives on one variable, p = 1..4", "[group][scalar]", float, double, ddp::float16,
                   ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  run_all<TestType>(true);
}

TEST_CASE("one variable is a buffer of one element: a rank passing a scalar meets one passing a vector of one") {
  auto store = std::make_shared<ddp::store::hash_store>();
  std::vector<double> results(2);
  run_threads(2, [&](int rank) {
    group_t g(example::store_backend(store, rank, 2), {.timeout = 30s});
    double total = 0;
    if (rank == 0) {
      double x = 1.5;
      g.all_reduce(x);
      total = x;
    } else {
      std::vector<double> v{2.5};
      g.all_reduce(v);
      total = v[0];
    }
    results[static_cast<std::size_t>(rank)] = total;
  });
  CHECK(results[0] == 4.0);
  CHECK(results[1] == 4.0);
}

TEST_CASE("send and recv of one variable go through the same argument checks") {
  auto store = std::make_shared<ddp::store::hash_store>();
  group_t typed(example::store_backend(store, 0, 1), {.timeout = 30s});
  ddp::group erased(group_t(example::store_backend(store, 0, 1), {.timeout = 30s}));
  float x = 1.0f;
  const std::int64_t c = 3;
  // One rank: peer 1 does not exist, and the error says so (the call reached process_group).
  CHECK_THROWS_WITH(typed.send(c, 1), Catch::Contains("peer 1 is out of range"));
  CHECK_THROWS_WITH(typed.recv(x, 1), Catch::Contains("peer 1 is out of range"));
  CHECK_THROWS_WITH(erased.send(2.0f, 1), Catch::Contains("peer 1 is out of range"));
  CHECK_THROWS_WITH(erased.recv(x, 1), Catch::Contains("peer 1 is out of range"));
}

}  // namespace ddp_test_scalar_collectives
