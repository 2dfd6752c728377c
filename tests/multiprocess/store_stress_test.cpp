// 8 client processes, each doing 10,000 mixed operations on one store, every result checked
// against what that client can know on its own:
//  - its own keys (set/get/add/compare_set/erase): exactly, against a local model;
//  - shared counters: each add is larger than the last one this client saw, and the final totals
//    equal 8 x the (fixed) number of increments per client;
//  - a shared compare_set chain "count|rank|op": a swap succeeded iff the store answers with our
//    unique value; the final count equals the sum of successes the clients report.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>

#include "ddp/store/file_store.hpp"
#include "ddp/store/tcp_store.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_store_stress {

using namespace std::chrono_literals;
using ddp::test::check;

namespace {

constexpr int clients = 8;
constexpr int shared_counters = 4;

std::string str(const std::vector<std::byte>& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

// Returns the number of successful swaps on the shared chain.
int workload(ddp::store::store& s, int rank, int ops) {
  std::mt19937_64 rng(0x5eed0000u + static_cast<unsigned>(rank));
  std::map<std::string, std::string> model;  // this client's keys, as they must be in the store
  std::int64_t own_counter = 0;
  std::int64_t last_shared[shared_counters] = {};
  int swaps = 0;
  const std::string me = "c" + std::to_string(rank) + "/";
  for (int i = 0; i < ops; ++i) {
    const std::string at = " (rank " + std::to_string(rank) + ", op " + std::to_string(i) + ")";
    if (i % 5 == 0) {  // fixed schedule: ops/5 increments spread over the shared counters
      const int c = (i / 5) % shared_counters;
      const auto v = s.add("shared/ctr" + std::to_string(c), 1);
      check(v > last_shared[c], "shared counter went backwards" + at);
      last_shared[c] = v;
      continue;
    }
    if (i % 50 == 1) {  // shared compare_set chain
      const auto now = s.compare_set("shared/chain", {}, ddp::store::to_bytes("0|-|-"));
      const std::string cur = str(now);
      const auto bar = cur.find('|');
      check(bar != std::string::npos, "chain value malformed: " + cur + at);
      const long count = std::stol(cur.substr(0, bar));
      const std::string mine = std::to_string(count + 1) + "|" + std::to_string(rank) + "|" + std::to_string(i);
      const auto after = str(s.compare_set("shared/chain", now, ddp::store::to_bytes(mine)));
      if (after == mine) ++swaps;
      else check(std::stol(after.substr(0, after.find('|'))) >= count + 1 || after == cur, "chain lost a swap" + at);
      continue;
    }
    const std::string key = me + "k" + std::to_string(rng() % 32);
    const auto it = model.find(key);
    switch (rng() % 8) {
      case 0:
      case 1: {
        const std::string v = "v" + std::to_string(rng());
        s.set_string(key, v);
        model[key] = v;
        break;
      }
      case 2:
      case 3:
        if (it != model.end()) check(s.get_string(key) == it->second, "own key " + key + " reads back" + at);
        break;
      case 4: {
        const std::int64_t delta = static_cast<std::int64_t>(rng() % 1000) - 500;
        own_counter += delta;
        check(s.add(me + "counter", delta) == own_counter, "own counter exact" + at);
        break;
      }
      case 5: {  // compare_set with the right or a wrong expectation
        const bool right = rng() % 2 == 0;
        const std::string expected = it == model.end() ? (right ? "" : "nope") : (right ? it->second : it->second + "x");
        const std::string desired = "cas" + std::to_string(i);
        const auto got = str(s.compare_set(key, ddp::store::to_bytes(expected), ddp::store::to_bytes(desired)));
        if (right) {
          check(got == desired, "own compare_set swaps" + at);
          model[key] = desired;
        } else {
          check(got == (it == model.end() ? expected : it->second), "own compare_set refuses" + at);
        }
        break;
      }
      case 6: {
        const bool existed = s.erase(key);
        check(existed == (it != model.end()), "erase reports existence of " + key + at);
        model.erase(key);
        break;
      }
      case 7: {
        // Other clients' keys come and go; ours are certainly there (plus our counter).
        const auto n = s.num_keys();
        check(n >= static_cast<std::int64_t>(model.size()), "num_keys counts at least our keys" + at);
        break;
      }
    }
  }
  // Every key in the model must still be exactly as modelled.
  for (const auto& [k, v] : model) check(s.get_string(k) == v, "final value of " + k);
  std::printf("swaps=%d\n", swaps);
  return swaps;
}

int sum_swaps(const ddp::test::run_result& r) {
  int total = 0;
  for (const auto& rank : r.ranks) {
    const auto at = rank.output.find("swaps=");
    if (at != std::string::npos) total += std::stoi(rank.output.substr(at + 6));
  }
  return total;
}

void check_totals(ddp::store::store& s, int ops, int swaps) {
  const int per_counter = ops / 5 / shared_counters;  // each client's increments per counter
  for (int c = 0; c < shared_counters; ++c) CHECK(s.add("shared/ctr" + std::to_string(c), 0) == clients * per_counter);
  const auto chain = s.get_string("shared/chain");
  CHECK(std::stol(chain.substr(0, chain.find('|'))) == swaps);
  CHECK(swaps > 0);
}

// The tcp_store server in a process of its own, started before any client is forked. Forking the
// clients from a process whose server thread is busy can leave a child blocked for good on a lock
// that thread held at the fork (likely the allocator's, under ASan: in one CI run 3 of 8 clients
// printed nothing and were killed at the deadline). The server process ends when the test kills
// it, or once every holder of the stop pipe's write end (this process and the clients forked
// from it) has exited: its read of the stop pipe then returns.
struct server_process {
  pid_t pid = -1;
  std::uint16_t port = 0;
  int stop_fd = -1;

  explicit server_process(const std::string& token) {
    int port_pipe[2], stop_pipe[2];
    REQUIRE(::pipe(port_pipe) == 0);
    REQUIRE(::pipe(stop_pipe) == 0);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(port_pipe[0]);
      ::close(stop_pipe[1]);
      try {
        ddp::store::tcp_store_server server({.port = 0, .token = token});
        const std::uint16_t p = server.port();
        if (::write(port_pipe[1], &p, sizeof p) != sizeof p) ::_exit(2);
        char byte;
        while (::read(stop_pipe[0], &byte, 1) < 0 && errno == EINTR) {
        }
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    ::close(port_pipe[1]);
    ::close(stop_pipe[0]);
    stop_fd = stop_pipe[1];
    // Bounded: the child writes the port once its server listens, or exits (end of file).
    pollfd pfd{port_pipe[0], POLLIN, 0};
    const bool ready = ::poll(&pfd, 1, 30000) == 1 && ::read(port_pipe[0], &port, sizeof port) == sizeof port;
    ::close(port_pipe[0]);
    if (!ready) {
      stop();
      FAIL("the store server process did not report its port within 30 s");
    }
  }
  server_process(const server_process&) = delete;
  server_process& operator=(const server_process&) = delete;
  ~server_process() { stop(); }

  void stop() noexcept {
    if (pid <= 0) return;
    ::close(stop_fd);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

}  // namespace

TEST_CASE("store stress: 8 client processes x 10,000 mixed operations on a tcp_store") {
  constexpr int ops = 10000;
  const server_process server(std::string("stress-token"));
  const auto port = server.port;
  const auto start = std::chrono::steady_clock::now();
  const auto r = ddp::test::run_ranks(
      clients,
      [&](int rank) {
        ddp::store::tcp_store s({.port = port, .timeout = 60s, .token = std::string("stress-token")});
        workload(s, rank, ops);
      },
      150s);
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.describe());
  REQUIRE(r.ok());
  WARN("tcp_store: " << clients * ops << " operations in " << seconds << " s (" << clients * ops / seconds << " ops/s)");
  ddp::store::tcp_store s({.port = port, .timeout = 5s, .token = std::string("stress-token")});
  check_totals(s, ops, sum_swaps(r));
}

TEST_CASE("store stress: 8 client processes x 10,000 mixed operations on a file_store") {
  constexpr int ops = 10000;
  const std::string path = std::string(DDP_TEST_BINARY_DIR) + "/stress_store." + std::to_string(::getpid());
  ::unlink(path.c_str());
  const auto start = std::chrono::steady_clock::now();
  const auto r = ddp::test::run_ranks(
      clients,
      [&](int rank) {
        ddp::store::file_store s(path, {.timeout = 60s});
        workload(s, rank, ops);
      },
      150s);
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.describe());
  REQUIRE(r.ok());
  WARN("file_store: " << clients * ops << " operations in " << seconds << " s (" << clients * ops / seconds << " ops/s)");
  ddp::store::file_store s(path, {.timeout = 5s, .remove_on_destroy = true});
  check_totals(s, ops, sum_swaps(r));
}

}  // namespace ddp_test_store_stress
