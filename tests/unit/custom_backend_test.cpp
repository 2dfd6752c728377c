// The user-written example backend (examples/custom_backend/store_backend.hpp), used unchanged
// by process_group: ranks as threads over a hash_store and as forked processes over a
// file_store, results against closed forms; the watchdog aborts it when a rank never comes.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../../examples/custom_backend/store_backend.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/group.hpp"
#include "ddp/optim/sgd.hpp"
#include "ddp/parameters.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "ddp/store/hash_store.hpp"
#include "support/multiprocess.hpp"
#include "support/threads.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_custom_backend {

using namespace std::chrono_literals;
using ddp::test::check;
using group_t = ddp::process_group<example::store_backend>;

namespace {

using ddp::test::run_threads;

template <class T>
void collectives(group_t& g) {
  const int p = g.size(), me = g.rank();
  const std::size_t n = 5;
  auto val = [](int r, std::size_t i) { return static_cast<double>(1 + (static_cast<std::size_t>(r) + i) % 3); };
  auto to = [](double v) {
    if constexpr (ddp::half_precision<T>) return T(static_cast<float>(v));
    else return static_cast<T>(v);
  };
  auto from = [](T v) {
    if constexpr (ddp::half_precision<T>) return static_cast<double>(static_cast<float>(v));
    else return static_cast<double>(v);
  };
  std::vector<T> s(n), pr(n);
  for (std::size_t i = 0; i < n; ++i) s[i] = pr[i] = to(val(me, i));
  g.all_reduce(s, ddp::sum{});
  g.all_reduce(pr, ddp::prod{});
  for (std::size_t i = 0; i < n; ++i) {
    double sum = 0, prod = 1;
    for (int r = 0; r < p; ++r) sum += val(r, i), prod *= val(r, i);
    check(from(s[i]) == sum && from(pr[i]) == prod, "all_reduce sum/prod");
  }
  std::vector<T> b(n, to(static_cast<double>(me)));
  g.broadcast(b, p - 1);
  check(from(b[0]) == p - 1, "broadcast");
  std::vector<T> all(n * static_cast<std::size_t>(p));
  std::vector<T> mine(n, to(static_cast<double>(me + 1)));
  g.all_gather(mine, all);
  for (int r = 0; r < p; ++r) check(from(all[static_cast<std::size_t>(r) * n]) == r + 1, "all_gather");
  std::vector<T> rs(n);
  g.reduce_scatter(all, rs, ddp::max{});  // every rank holds the same `all`: max = the value itself
  check(from(rs[0]) == me + 1, "reduce_scatter");
  std::vector<T> a_in(static_cast<std::size_t>(p)), a_out(static_cast<std::size_t>(p));
  for (int j = 0; j < p; ++j) a_in[static_cast<std::size_t>(j)] = to(static_cast<double>(me * 10 + j));
  g.all_to_all(a_in, a_out);  // the backend has none: process_group provides it
  for (int src = 0; src < p; ++src) check(from(a_out[static_cast<std::size_t>(src)]) == src * 10 + me, "all_to_all");
  g.barrier();
}

}  // namespace

TEST_CASE("custom backend: ranks as threads over a hash_store, several dtypes, p = 1..3") {
  for (int p = 1; p <= 3; ++p) {
    auto store = std::make_shared<ddp::store::hash_store>();
    run_threads(p, [&](int rank) {
      group_t g(example::store_backend(store, rank, p), {.timeout = 30s});
      collectives<float>(g);
      collectives<double>(g);
      collectives<ddp::bfloat16>(g);
      collectives<std::int32_t>(g);
      collectives<std::uint8_t>(g);
      check(g.next_sequence() == 5 * 7, "sequence numbers");
    });
    CHECK(store->num_keys() == 0);  // the backend cleans up after itself
  }
}

TEST_CASE("custom backend: forked processes over a file_store, async in order") {
  const std::string path = std::string(DDP_TEST_BINARY_DIR) + "/custom_backend_" + std::to_string(::getpid()) + ".store";
  std::remove(path.c_str());
  const auto result = ddp::test::run_ranks(3, [&](int rank) {
    group_t g(example::store_backend(std::make_shared<ddp::store::file_store>(path), rank, 3), {.timeout = 30s});
    collectives<float>(g);
    std::vector<std::vector<std::int64_t>> bufs(10, std::vector<std::int64_t>(4));
    std::vector<ddp::work> works;
    for (int k = 0; k < 10; ++k) {
      for (auto& x : bufs[static_cast<std::size_t>(k)]) x = k * rank;
      works.push_back(g.all_reduce_async(bufs[static_cast<std::size_t>(k)]));
    }
    for (auto& w : works) w.wait();
    for (int k = 0; k < 10; ++k) check(bufs[static_cast<std::size_t>(k)][3] == 3 * k, "async result " + std::to_string(k));
  });
  std::remove(path.c_str());
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("custom backend: the watchdog aborts it when a rank never arrives") {
  auto store = std::make_shared<ddp::store::hash_store>();
  group_t g(example::store_backend(store, 0, 2), {.timeout = 300ms});
  std::vector<float> v(4, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  try {
    g.all_reduce(v);
    FAIL("returned without rank 1");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("all_reduce #0") && Catch::Contains("300 ms"));
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK_THROWS_AS(g.barrier(), ddp::error);  // broken from now on
}

}  // namespace ddp_test_custom_backend

// A backend that opts out of uint8 through ddp::supports_dtype_v (below): the other dtypes and
// barrier (which moves no elements) still work.
namespace ddp_test_custom_backend {
struct no_uint8_backend : example::store_backend {
  using example::store_backend::store_backend;
};
}  // namespace ddp_test_custom_backend

namespace ddp {
template <>
inline constexpr bool supports_dtype_v<ddp_test_custom_backend::no_uint8_backend, std::uint8_t> = false;
}  // namespace ddp

namespace ddp_test_custom_backend {

TEST_CASE("custom backend: opting out of uint8 (supports_dtype_v) keeps barrier, through process_group and ddp::group, p = 1..3") {
  static_assert(ddp::backend<no_uint8_backend> && !ddp::supports_dtype_v<no_uint8_backend, std::uint8_t>);
  for (int p = 1; p <= 3; ++p) {
    auto store = std::make_shared<ddp::store::hash_store>();
    run_threads(p, [&](int rank) {
      ddp::process_group<no_uint8_backend> g(no_uint8_backend(store, rank, p), {.timeout = 30s});
      g.barrier();
      std::vector<float> v(3, 1.0f);
      g.all_reduce(v);
      check(v[2] == static_cast<float>(p), "all_reduce after a barrier");
      g.barrier_async().wait();
      g.barrier();
      check(g.next_sequence() == 4, "sequence numbers");
      ddp::group erased(std::move(g));  // and through the run-time group
      erased.barrier();
      erased.barrier_async().wait();
      check(erased.next_sequence() == 6, "sequence numbers through ddp::group");
    });
    CHECK(store->num_keys() == 0);
  }
}

}  // namespace ddp_test_custom_backend

// sharded_data_parallel (ZeRO 1 and 2) over the user-written backend, which has no reduce_scatter
// or all_gather of its own (process_group's fallbacks provide them): after 30 steps of SGD with
// momentum the parameters equal distributed_data_parallel + the same optimizer over the full
// parameters, bit for bit. Gradients lie on the 2^-8 grid with |g| <= 4, so every sum over three
// ranks is exact in any order; what follows the sum (/ W, the optimizer) is the same operation in
// both runs. Parameters of 7 and 13 elements: no divisibility by the world size.
namespace ddp_test_custom_backend {

struct two_tensors {
  std::vector<float> a = std::vector<float>(7), a_grad = std::vector<float>(7);
  std::vector<float> b = std::vector<float>(13), b_grad = std::vector<float>(13);
};

std::vector<ddp::parameter_ref> parameters(two_tensors& m) {
  return {ddp::make_parameter(m.a, m.a_grad, "a"), ddp::make_parameter(m.b, m.b_grad, "b")};
}

float grid_gradient(int rank, int step, std::size_t i, float value) {
  const double x = std::sin(0.7 * static_cast<double>(i) + 1.3 * step + 2.1 * rank) * 3.0 + 0.25 * static_cast<double>(value);
  return static_cast<float>(std::round(std::clamp(x, -4.0, 4.0) * 256.0) / 256.0);
}

void fill_gradients(two_tensors& m, int rank, int step) {
  for (std::size_t i = 0; i < m.a.size(); ++i) m.a_grad[i] = grid_gradient(rank, step, i, m.a[i]);
  for (std::size_t i = 0; i < m.b.size(); ++i) m.b_grad[i] = grid_gradient(rank, step, 100 + i, m.b[i]);
}

TEST_CASE("custom backend: sharded_data_parallel (ZeRO 1 and 2) over it equals DDP + the same optimizer bit for bit, p = 3") {
  constexpr int p = 3, steps = 30;
  const ddp::optim::sgd_options sgd{.lr = 0.01, .momentum = 0.9};
  for (int stage : {1, 2}) {
    auto store = std::make_shared<ddp::store::hash_store>();
    run_threads(p, [&](int rank) {
      group_t g(example::store_backend(store, rank, p), {.timeout = 30s});
      two_tensors sharded_model, reference;
      for (std::size_t i = 0; i < reference.a.size(); ++i) reference.a[i] = sharded_model.a[i] = 0.5f - 0.1f * static_cast<float>(i);
      for (std::size_t i = 0; i < reference.b.size(); ++i) reference.b[i] = sharded_model.b[i] = 0.25f * static_cast<float>(i) - 1.0f;
      ddp::optim::sgd<float> shard_optimizer(sgd);
      ddp::sharded_data_parallel net{sharded_model, g, shard_optimizer, {.stage = stage, .bucket_cap_bytes = 32, .first_bucket_bytes = 16}};
      check(net.stats().buckets == 2, "one bucket per parameter");
      ddp::distributed_data_parallel ddp_net{reference, g};
      ddp::optim::sgd<float> optimizer_a(sgd), optimizer_b(sgd);  // elementwise: as one over both
      for (int s = 0; s < steps; ++s) {
        fill_gradients(sharded_model, rank, s);
        net.synchronize();
        net.step();
        fill_gradients(reference, rank, s);
        ddp_net.synchronize();
        optimizer_a.step(reference.a, reference.a_grad);
        optimizer_b.step(reference.b, reference.b_grad);
      }
      check(std::memcmp(sharded_model.a.data(), reference.a.data(), reference.a.size() * sizeof(float)) == 0 &&
                std::memcmp(sharded_model.b.data(), reference.b.data(), reference.b.size() * sizeof(float)) == 0,
            "ZeRO-" + std::to_string(stage) + " parameters differ from DDP's");
      check(reference.a[0] != 0.5f, "the reference did not train");
    });
    CHECK(store->num_keys() == 0);
  }
}

}  // namespace ddp_test_custom_backend
