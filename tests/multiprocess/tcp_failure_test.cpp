// Failures of the store's host over tcp, with ranks as forked processes started the way
// torchrun starts them (rank 0 serves the tcp_store): a SIGKILLed rank 0 is named first by every
// survivor (not the neighbour that relayed its loss), and a SIGSTOPped rank 0 costs the
// collective's timeout plus a short bound, not a second timeout spent on the stopped store.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <vector>

#include "ddp/init.hpp"
#include "support/launch_env.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_tcp_failure {

using namespace std::chrono_literals;
using ddp::test::check;

namespace {

struct temp_file {
  std::string path = "/tmp/ddp-tcp-failure-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++);
  ~temp_file() { ::unlink(path.c_str()); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

// What a rank saw of the all_reduce it started after rank 0 stopped.
struct failed_call {
  std::chrono::milliseconds took{0};
  std::string what, message;  // empty when the call returned
};

// Rank r of p over tcp (torchrun's variables, port): warm up, then rank 0 (the store's host) stops
// itself after writing its pid to pid_file, and every other rank times its next all_reduce.
// The store's own timeout is long: a failure path that waited on it would show.
// Rank 0 returns nothing once it is continued or killed.
std::optional<failed_call> all_reduce_with_rank0_stopped(int r, int p, int port, std::chrono::milliseconds timeout,
                                                         const temp_file& pid_file, const std::string& backend = "tcp") {
  ddp::test::set_torchrun_variables(r, p, port);
  auto group = ddp::init_process_group(backend, {.timeout = timeout, .init_timeout = 30s});
  std::vector<float> data(std::size_t{1} << 16, 1.0f);
  for (int step = 0; step < 5; ++step) group.all_reduce(std::span<float>(data));
  group.barrier();
  if (r == 0) {
    std::ofstream(pid_file.path) << ::getpid() << "\n";
    ::raise(SIGSTOP);
    return std::nullopt;
  }
  failed_call call;
  const auto start = std::chrono::steady_clock::now();
  try {
    group.all_reduce(std::span<float>(data));
  } catch (const ddp::error& e) {
    call.what = e.what();
    call.message = e.message();
  }
  call.took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  std::printf("took_ms=%lld %s\n", static_cast<long long>(call.took.count()), call.what.c_str());
  return call;
}

// SIGKILLs the stopped rank 0, which the harness would otherwise wait for until its deadline.
void kill_stopped_rank0(const temp_file& pid_file) {
  int pid0 = 0;
  std::ifstream(pid_file.path) >> pid0;
  if (pid0 > 0) ::kill(pid0, SIGKILL);
}

// Rank 0 ended by SIGKILL, every other rank passed its checks.
void check_rank0_killed_others_ok(const ddp::test::run_result& result) {
  INFO(result.describe());
  for (const auto& rr : result.ranks) {
    if (rr.rank == 0) {
      CHECK(rr.signal == SIGKILL);
    } else {
      CHECK(rr.ok());
    }
  }
}

}  // namespace

TEST_CASE("tcp processes: rank 0 (the store's host) SIGKILLed mid all_reduce is named first by every survivor") {
  constexpr int p = 4;
  const int port = ddp::test::free_loopback_port();
  const auto result = ddp::test::run_ranks(
      p,
      [&](int r) {
        ddp::test::set_torchrun_variables(r, p, port);
        auto group = ddp::init_process_group("tcp", {.timeout = 20s, .init_timeout = 20s});
        std::vector<float> data(std::size_t{1} << 16, 1.0f);
        for (int step = 0; step < 5; ++step) group.all_reduce(std::span<float>(data));
        if (r == 0) ::raise(SIGKILL);
        try {
          for (int step = 0; step < 1000; ++step) group.all_reduce(std::span<float>(data));
        } catch (const ddp::error& e) {
          std::printf("%s\n", e.what());
          check(ddp::test::first_named_rank(e.message()) == 0, std::string("does not name rank 0 first: ") + e.what());
          return;
        }
        check(false, "all_reduce went on without rank 0");
      },
      60s);
  check_rank0_killed_others_ok(result);
}

TEST_CASE("tcp processes: a SIGSTOPped rank 0 (the store's host) costs at most 1.1 x the collective's timeout") {
  constexpr int p = 3;
  constexpr std::chrono::milliseconds timeout = 2s;
  const int port = ddp::test::free_loopback_port();
  temp_file pid_file;
  const auto result = ddp::test::run_ranks(
      p,
      [&](int r) {
        const auto call = all_reduce_with_rank0_stopped(r, p, port, timeout, pid_file);
        if (!call) return;
        kill_stopped_rank0(pid_file);
        check(!call->what.empty(), "all_reduce returned with rank 0 stopped");
        check(call->took <= timeout * 11 / 10, "the failure took " + std::to_string(call->took.count()) + " ms");
      },
      60s);
  check_rank0_killed_others_ok(result);
}

TEST_CASE("tcp and shm processes: a rank whose neighbour gives up on a SIGSTOPped rank 0 first fails by its own deadline, naming rank 0") {
  // Rank 2's timeout is the longer: rank 1 gives up on the stopped rank 0 first and closes its
  // connections, so rank 2 sees a lost neighbour while rank 0 is only suspect to the heartbeat
  // (whose verdict is due later than rank 2's deadline). Rank 2 must fail by its own deadline,
  // naming the suspect, not wait for the verdict.
  const std::string backend = GENERATE(as<std::string>{}, "tcp", "ring");  // ring: shared memory, one host
  INFO("backend " << backend);
  constexpr int p = 3;
  const auto timeout_of = [](int r) { return r == 2 ? std::chrono::milliseconds(3000) : std::chrono::milliseconds(2000); };
  const int port = ddp::test::free_loopback_port();
  temp_file pid_file;
  const auto result = ddp::test::run_ranks(
      p,
      [&](int r) {
        ::setenv("DDP_HEARTBEAT_TIMEOUT", "5", 1);  // the default, pinned: its verdict must come after rank 2's deadline
        const auto call = all_reduce_with_rank0_stopped(r, p, port, timeout_of(r), pid_file, backend);
        if (!call) return;
        if (r == 2) kill_stopped_rank0(pid_file);  // rank 1 is done with rank 0 by now
        check(!call->what.empty(), "all_reduce returned with rank 0 stopped");
        check(call->took <= timeout_of(r) * 11 / 10, "the failure took " + std::to_string(call->took.count()) + " ms");
        if (r == 2) check(ddp::test::first_named_rank(call->message) == 0, "does not name rank 0 first: " + call->what);
      },
      60s);
  check_rank0_killed_others_ok(result);
}

}  // namespace ddp_test_tcp_failure
