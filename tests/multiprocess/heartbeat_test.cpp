// The ring backend's heartbeat (backends/ring/transport/heartbeat.hpp), with forked ranks started the way
// torchrun starts them (rank 0 hosts the tcp_store): a SIGSTOPped rank, rank 0 included, fails
// every other rank within the heartbeat timeout + 1 s with errc::peer_lost naming it, though the
// collective's own timeout is long; a hung rank 0 costs at most 1.1 x the heartbeat timeout; a
// rank that is merely slow to join a collective (asleep or busy for 3 x the heartbeat timeout)
// does not trip it. Each rank prints what it measured.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <regex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ddp/init.hpp"
#include "support/launch_env.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_heartbeat {

using namespace std::chrono_literals;
using ddp::test::check;

namespace {

constexpr auto heartbeat = 2s;     // DDP_HEARTBEAT_TIMEOUT in these tests
constexpr auto collective = 60s;   // the collectives' own timeout: far beyond what any check allows

void launch_env(int rank, int world, int port) {
  ddp::test::set_torchrun_variables(rank, world, port);
  ::setenv("DDP_HEARTBEAT_TIMEOUT", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(heartbeat).count()).c_str(), 1);
}

long long ms(std::chrono::steady_clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

struct temp_file {
  std::string path = "/tmp/ddp-heartbeat-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++);
  ~temp_file() { ::unlink(path.c_str()); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

// The largest "took_ms=N" the ranks printed.
long long worst_took_ms(const ddp::test::run_result& result) {
  long long worst = -1;
  for (const auto& rr : result.ranks) {
    std::smatch m;
    if (std::regex_search(rr.output, m, std::regex(R"(took_ms=(\d+))"))) worst = std::max(worst, std::stoll(m[1].str()));
  }
  return worst;
}

// p ranks over `backend`; `victim` stops itself (SIGSTOP) while the others enter an all_reduce.
// Each other rank checks it failed with peer_lost naming the victim within `bound`, then kills it.
ddp::test::run_result stop_one(const char* backend, int p, int victim, std::chrono::milliseconds bound) {
  const int port = ddp::test::free_loopback_port();
  temp_file pid_file, done_file;
  return ddp::test::run_ranks(
      p,
      [&](int r) {
        launch_env(r, p, port);
        auto group = ddp::init_process_group(backend, {.timeout = collective, .init_timeout = 30s});
        std::vector<float> data(std::size_t{1} << 16, 1.0f);
        for (int step = 0; step < 3; ++step) group.all_reduce(std::span<float>(data));
        if (r == victim) std::ofstream(pid_file.path) << ::getpid() << "\n";
        group.barrier();  // the pid file is written before anyone looks for it
        if (r == victim) {
          ::raise(SIGSTOP);
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        std::string what, own;
        ddp::errc code = ddp::errc::internal;
        try {
          group.all_reduce(std::span<float>(data));
        } catch (const ddp::error& e) {
          what = e.what();
          own = e.message();
          code = e.code();
        }
        const auto took = std::chrono::steady_clock::now() - start;
        std::printf("took_ms=%lld %s\n", ms(took), what.c_str());
        // The last rank to fail kills the stopped one (the harness would wait for it until its
        // deadline); an earlier kill would let the others see it exit instead of go silent.
        {
          std::ofstream(done_file.path, std::ios::app) << r << "\n";
        }
        std::ifstream done(done_file.path);
        int failed = 0;
        for (std::string line; std::getline(done, line);) ++failed;
        int pid = 0;
        std::ifstream(pid_file.path) >> pid;
        if (pid > 0 && failed >= p - 1) ::kill(pid, SIGKILL);
        check(!what.empty(), "all_reduce returned with rank " + std::to_string(victim) + " stopped");
        check(code == ddp::errc::peer_lost, "not peer_lost: " + what);
        check(ddp::test::first_named_rank(own) == victim, "does not name rank " + std::to_string(victim) + " first: " + what);
        check(what.find("heartbeat") != std::string::npos, "does not say what was seen: " + what);
        check(took <= bound, "the failure took " + std::to_string(ms(took)) + " ms, more than " + std::to_string(bound.count()) + " ms");
      },
      90s);
}

void expect_stopped_found(const char* backend, int victim, std::chrono::milliseconds bound) {
  constexpr int p = 4;
  const auto result = stop_one(backend, p, victim, bound);
  std::printf("heartbeat %s: rank %d of %d SIGSTOPped, heartbeat timeout %lld ms, collective timeout %lld s: slowest rank failed after %lld ms (bound %lld ms)\n",
              backend, victim, p, static_cast<long long>(std::chrono::milliseconds(heartbeat).count()),
              static_cast<long long>(collective.count()), worst_took_ms(result), static_cast<long long>(bound.count()));
  INFO(result.describe());
  for (const auto& rr : result.ranks) {
    if (rr.rank == victim) {
      CHECK(rr.signal == SIGKILL);
    } else {
      CHECK(rr.ok());
    }
  }
}

int random_rank(int p) {
  std::random_device rd;
  return static_cast<int>(rd() % static_cast<unsigned>(p));
}

// `slow` joins the all_reduce 3 x the heartbeat timeout late, asleep or spinning; the sum is checked.
void expect_slow_rank_tolerated(const char* backend, bool busy) {
  constexpr int p = 4;
  const int slow = random_rank(p);
  const int port = ddp::test::free_loopback_port();
  const auto result = ddp::test::run_ranks(
      p,
      [&](int r) {
        launch_env(r, p, port);
        auto group = ddp::init_process_group(backend, {.timeout = collective, .init_timeout = 30s});
        std::vector<float> data(std::size_t{1} << 16, static_cast<float>(r + 1));
        group.barrier();
        const auto start = std::chrono::steady_clock::now();
        if (r == slow) {
          // The scenario itself, not synchronisation: a rank that computes (or waits) for longer
          // than the heartbeat timeout before it joins the collective.
          const auto until = start + 3 * heartbeat;
          if (busy) {
            while (std::chrono::steady_clock::now() < until) {
            }
          } else {
            std::this_thread::sleep_until(until);
          }
        }
        group.all_reduce(std::span<float>(data));
        const auto took = std::chrono::steady_clock::now() - start;
        std::printf("took_ms=%lld\n", ms(took));
        for (float x : data) check(x == static_cast<float>(p * (p + 1) / 2), "wrong sum " + std::to_string(x));
      },
      90s);
  std::printf("heartbeat %s: rank %d %s for 3 x %lld ms before its all_reduce: all ranks completed, the slowest after %lld ms\n", backend, slow,
              busy ? "busy" : "asleep", static_cast<long long>(std::chrono::milliseconds(heartbeat).count()), worst_took_ms(result));
  INFO(result.describe());
  CHECK(result.ok());
}

}  // namespace

TEST_CASE("heartbeat over tcp: a SIGSTOPped rank fails every other rank within the heartbeat timeout + 1 s, naming it") {
  expect_stopped_found("tcp", random_rank(4), heartbeat + 1s);
}

TEST_CASE("heartbeat over shm: a SIGSTOPped rank fails every other rank within the heartbeat timeout + 1 s, naming it") {
  expect_stopped_found("shm", random_rank(4), heartbeat + 1s);
}

TEST_CASE("heartbeat over tcp: a SIGSTOPped rank 0 (the store's host) costs at most 1.1 x the heartbeat timeout") {
  expect_stopped_found("tcp", 0, std::chrono::duration_cast<std::chrono::milliseconds>(heartbeat) * 11 / 10);
}

TEST_CASE("heartbeat over tcp: a rank asleep for 3 x the heartbeat timeout before its all_reduce does not trip it") {
  expect_slow_rank_tolerated("tcp", false);
}

TEST_CASE("heartbeat over shm: a rank busy for 3 x the heartbeat timeout before its all_reduce does not trip it") {
  expect_slow_rank_tolerated("shm", true);
}

}  // namespace ddp_test_heartbeat
