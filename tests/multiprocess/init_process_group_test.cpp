// init_process_group: from torchrun-style environment variables in forked children (rank 0
// serves the tcp_store at MASTER_ADDR:MASTER_PORT), a world of one without any store, explicit
// overrides with a given store, the backend registry, and the errors for unknown or
// not-compiled-in backends, bad environments and a file limit too low for the job.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ddp/init.hpp"
#include "ddp/store/file_store.hpp"
#include "support/launch_env.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_init_process_group {

using namespace std::chrono_literals;
using ddp::test::check;

namespace {

template <class F>
ddp::errc error_code_of(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const ddp::error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  return ddp::errc::internal;
}

}  // namespace

TEST_CASE("init_process_group: ranks from torchrun's variables, store served by rank 0") {
  for (const char* name : {"ring", "tcp", "shm"}) {
    for (int p : {2, 3}) {
      INFO(name << " p = " << p);
      const int port = ddp::test::free_loopback_port();
      const auto result = ddp::test::run_ranks(
          p,
          [&](int rank) {
            ddp::test::set_torchrun_variables(rank, p, port);
            auto g = ddp::init_process_group(name, {.timeout = 30s, .init_timeout = 30s});
            check(g.valid() && g.rank() == rank && g.size() == p, "rank and size from the environment");
            check(g.backend_name() == "ring", "ring backend");
            auto* concrete = g.get_if<ddp::ring_backend>();
            check(concrete != nullptr, "a ring_backend behind the group");
            const std::string_view want = std::string_view(name) == "tcp" ? "tcp" : "shm";
            check(concrete->backend().transport_name() == want, "transport for '" + std::string(name) + "'");
            check(g.timeout() == 30s, "timeout from the options");
            std::vector<double> v{static_cast<double>(rank + 1), 0.5};
            g.all_reduce(v);
            check(v[0] == p * (p + 1) / 2.0 && v[1] == 0.5 * p, "all_reduce");
            std::vector<std::int32_t> b{rank == 0 ? 42 : -1};
            g.broadcast(b, 0);
            check(b[0] == 42, "broadcast");
            g.barrier();
          },
          90s);
      INFO(result.describe());
      REQUIRE(result.ok());
    }
  }
}

// ddp::group hands the ring backend its reduction at run time (ddp::runtime_op): every kind, on
// the small-message and the ring/zero-copy paths of both transports, against closed forms.
// Contributions x_r[i] = r + 1 + (i % 3): sum, min, max, prod and avg follow from p alone.
TEST_CASE("init_process_group: every reduction through the type-erased group matches its closed form") {
  for (const char* name : {"tcp", "shm"}) {
    const int p = 3;
    INFO(name);
    const int port = ddp::test::free_loopback_port();
    const auto result = ddp::test::run_ranks(
        p,
        [&](int rank) {
          ddp::test::set_torchrun_variables(rank, p, port);
          auto g = ddp::init_process_group(name, {.timeout = 30s, .init_timeout = 30s});
          for (std::size_t n : {std::size_t{5}, std::size_t{100003}}) {  // direct / ring and staged paths
            for (auto kind : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max,
                              ddp::reduce_kind::prod}) {
              std::vector<double> d(n);
              std::vector<std::int32_t> k(n), rs_out(n / p);
              for (std::size_t i = 0; i < n; ++i) d[i] = k[i] = rank + 1 + static_cast<int>(i % 3);
              const std::vector<std::int32_t> rs_in = k;
              ddp::visit_reduce_kind(kind, [&](auto op) {
                g.all_reduce(d, op);
                g.all_reduce(k, op);
                g.reduce_scatter(std::span<const std::int32_t>(rs_in.data(), rs_out.size() * p), rs_out, op);
              });
              auto want = [&](std::size_t i) {
                const double c = static_cast<double>(i % 3);  // x_r = r + 1 + c for r < p
                switch (kind) {
                  case ddp::reduce_kind::sum: return p * c + p * (p + 1) / 2.0;
                  case ddp::reduce_kind::avg: return c + (p + 1) / 2.0;
                  case ddp::reduce_kind::min: return 1 + c;
                  case ddp::reduce_kind::max: return p + c;
                  case ddp::reduce_kind::prod: break;
                }
                return (1 + c) * (2 + c) * (3 + c);
              };
              // int32 avg divides the integer sum with truncation, like torch's integer tensors.
              auto want_int = [&](std::size_t i) {
                if (kind == ddp::reduce_kind::avg) return static_cast<std::int32_t>(std::trunc(want(i) * p) / p);
                return static_cast<std::int32_t>(want(i));
              };
              const std::string what = std::string(ddp::to_string(kind)) + " n = " + std::to_string(n);
              bool ok = true;
              for (std::size_t i = 0; i < n && ok; ++i) ok = d[i] == want(i) && k[i] == want_int(i);
              check(ok, "all_reduce " + what);
              const std::size_t base = static_cast<std::size_t>(rank) * rs_out.size();
              bool rs_ok = true;
              for (std::size_t i = 0; i < rs_out.size() && rs_ok; ++i) rs_ok = rs_out[i] == want_int(base + i);
              check(rs_ok, "reduce_scatter " + what);
            }
          }
        },
        120s);
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("init_process_group: a world of one needs no store and no variables") {
  const auto result = ddp::test::run_ranks(1, [](int) {
    ddp::test::clear_launcher_variables();
    auto g = ddp::init_process_group();
    check(g.rank() == 0 && g.size() == 1, "world of one");
    std::vector<float> v{2.5f};
    g.all_reduce(v, ddp::avg{});
    check(v[0] == 2.5f, "all_reduce of one");
    g.barrier();
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("init_process_group: explicit rank, world size and store override the environment") {
  const std::string path = std::string(DDP_TEST_BINARY_DIR) + "/init_pg_" + std::to_string(::getpid()) + ".store";
  std::remove(path.c_str());
  const auto result = ddp::test::run_ranks(2, [&](int rank) {
    ddp::test::clear_launcher_variables();
    ::setenv("RANK", "0", 1);  // wrong on purpose: the options win
    ::setenv("WORLD_SIZE", "1", 1);
    ddp::init_options o;
    o.store = std::make_shared<ddp::store::file_store>(path);
    o.rank = rank;
    o.world_size = 2;
    o.init_timeout = 30s;
    auto g = ddp::init_process_group("ring", o);
    check(g.rank() == rank && g.size() == 2, "overrides");
    std::vector<std::int64_t> v{rank + 10};
    g.all_reduce(v, ddp::max{});
    check(v[0] == 11, "all_reduce max");
  });
  std::remove(path.c_str());
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("init_process_group: unknown and not-compiled-in backends") {
  std::string what;
  CHECK(error_code_of([] { (void)ddp::init_process_group("glooo"); }, &what) == ddp::errc::config);
  CHECK_THAT(what, Catch::Contains("unknown backend 'glooo'") && Catch::Contains("ring") && Catch::Contains("shm") && Catch::Contains("tcp"));
  CHECK(error_code_of([] { (void)ddp::init_process_group("nccl"); }, &what) == ddp::errc::unavailable);
  CHECK_THAT(what, Catch::Contains("backend 'nccl' is not available: build with CUDA and NCCL (target ddp::nccl) and include <ddp/nccl.hpp>"));
  CHECK(error_code_of([] { (void)ddp::init_process_group("mpi"); }, &what) == ddp::errc::unavailable);
  CHECK_THAT(what, Catch::Contains("include <ddp/mpi.hpp>"));
}

TEST_CASE("init_process_group: a registered factory gets the context") {
  const auto result = ddp::test::run_ranks(1, [](int) {
    ddp::test::clear_launcher_variables();
    std::string seen;
    check(ddp::register_backend("mine", [&seen](const ddp::backend_context& c) {
            seen = c.name + " " + std::to_string(c.rank) + "/" + std::to_string(c.world_size) + " " + c.prefix +
                   (c.store ? " store" : " no-store");
            return ddp::group(ddp::process_group<ddp::ring_backend>(ddp::ring_backend(nullptr, 0, 1)));
          }),
          "register_backend returns true");
    const auto names = ddp::registered_backends();
    check(std::find(names.begin(), names.end(), "mine") != names.end(), "listed");
    auto g = ddp::init_process_group("mine", {.prefix = "job"});
    check(seen == "mine 0/1 job/0 no-store", "context: " + seen);
    check(g.size() == 1, "the factory's group");
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("init_process_group: a registered factory replaces a built-in name") {
  const auto result = ddp::test::run_ranks(1, [](int) {
    ddp::test::clear_launcher_variables();
    int calls = 0;
    check(ddp::register_backend("tcp", [&calls](const ddp::backend_context&) {
            ++calls;
            return ddp::group(ddp::process_group<ddp::ring_backend>(ddp::ring_backend(nullptr, 0, 1)));
          }),
          "register_backend returns true");
    const auto names = ddp::registered_backends();
    check(std::count(names.begin(), names.end(), "tcp") == 1, "tcp listed once");
    check(std::is_sorted(names.begin(), names.end()), "sorted");
    auto g = ddp::init_process_group("tcp");
    check(calls == 1, "the registered factory built the group: " + std::to_string(calls));
    auto ring = ddp::init_process_group("ring");
    check(calls == 1 && ring.size() == 1, "the other built-in names still build the ring backend");
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("init_process_group: a bad environment is one clear error naming the variable") {
  const auto result = ddp::test::run_ranks(1, [](int) {
    ddp::test::clear_launcher_variables();
    ::setenv("RANK", "2", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    std::string what;
    check(error_code_of([] { (void)ddp::init_process_group(); }, &what) == ddp::errc::config, "config error");
    check(what.find("RANK") != std::string::npos, what);
    ddp::test::clear_launcher_variables();
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "abc", 1);
    check(error_code_of([] { (void)ddp::init_process_group(); }, &what) == ddp::errc::config, "config error");
    check(what.find("WORLD_SIZE") != std::string::npos, what);
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

// Every rank of a job that needs more files than its hard limit allows fails at once with one
// line naming the limit, the need and the fix, before anyone connects (otherwise the store's host
// runs out of descriptors halfway and the others wait for their deadline).
TEST_CASE("init_process_group: a file limit too low for the job is one line on every rank, at once") {
  const int p = 8;
  const int port = ddp::test::free_loopback_port();
  const auto start = std::chrono::steady_clock::now();
  const auto result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        ddp::test::set_torchrun_variables(rank, p, port);
        rlimit lim{24, 24};
        check(::setrlimit(RLIMIT_NOFILE, &lim) == 0, "setrlimit");
        std::string what;
        const auto code = error_code_of([&] { (void)ddp::init_process_group("ring", {.timeout = 30s, .init_timeout = 30s}); }, &what);
        check(code == ddp::errc::config, "errc::config, got: " + what);
        check(what.find("rank " + std::to_string(rank)) != std::string::npos, "names the rank: " + what);
        check(what.find("a job of 8 ranks needs about") != std::string::npos && what.find("its limit is 24 (hard limit 24)") != std::string::npos &&
                  what.find("ulimit -n") != std::string::npos,
              "names the need, the limit and the fix: " + what);
      },
      30s);
  INFO(result.describe());
  REQUIRE(result.ok());
  CHECK(std::chrono::steady_clock::now() - start < 2s);
}

}  // namespace ddp_test_init_process_group
