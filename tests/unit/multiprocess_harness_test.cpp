// The harness itself: exit codes, signals, exceptions and the deadline are reported per rank.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>

#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_multiprocess_harness {

using namespace std::chrono_literals;

TEST_CASE("harness: every rank runs and succeeds") {
  const auto r = ddp::test::run_ranks(4, [](int rank) { std::printf("hello from %d\n", rank); });
  INFO(r.describe());
  REQUIRE(r.ok());
  for (int i = 0; i < 4; ++i) CHECK(r.ranks[i].output == "hello from " + std::to_string(i) + "\n");
}

TEST_CASE("harness: an exception, an exit code and a signal are told apart") {
  const auto r = ddp::test::run_ranks(3, [](int rank) {
    if (rank == 0) throw std::runtime_error("boom");
    if (rank == 1) ::_exit(7);
    ::raise(SIGKILL);
  });
  CHECK_FALSE(r.ok());
  CHECK(r.ranks[0].exit_code == 1);
  CHECK(r.ranks[0].output.find("boom") != std::string::npos);
  CHECK(r.ranks[1].exit_code == 7);
  CHECK(r.ranks[2].signal == SIGKILL);
}

TEST_CASE("harness: a hung rank is killed at the deadline") {
  const auto start = std::chrono::steady_clock::now();
  const auto r = ddp::test::run_ranks(
      2,
      [](int rank) {
        if (rank == 1) ::pause();  // blocks until killed
      },
      500ms);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK(r.ranks[0].ok());
  CHECK(r.ranks[1].timed_out);
  CHECK(r.ranks[1].signal == SIGKILL);
}

}  // namespace ddp_test_multiprocess_harness
