// deadline: after / never / remaining / poll timeout, and DDP_TIMEOUT parsing.
// DDP_TIMEOUT is read from the real environment, so those cases run in a forked child.
#include <ddp/core/deadline.hpp>
#include <ddp/core/env.hpp>

#include <poll.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_deadline {

using namespace std::chrono_literals;

TEST_CASE("deadline::never never expires") {
  const auto d = ddp::deadline::never();
  CHECK(d.is_never());
  CHECK_FALSE(d.expired());
  CHECK(d.remaining() == std::chrono::milliseconds::max());
  CHECK(d.poll_timeout_ms() == -1);
  CHECK(d == ddp::deadline{});
}

TEST_CASE("deadline::after counts down from now") {
  const auto before = ddp::clock::now();
  const auto d = ddp::deadline::after(1h);
  const auto after = ddp::clock::now();
  CHECK_FALSE(d.is_never());
  CHECK_FALSE(d.expired());
  CHECK(d.time_point() >= before + 1h);
  CHECK(d.time_point() <= after + 1h);
  CHECK(d.remaining() <= std::chrono::milliseconds(3'600'000));
  CHECK(d.remaining() > std::chrono::milliseconds(3'590'000));
  CHECK(d.poll_timeout_ms() <= 3'600'000);
  CHECK(d.poll_timeout_ms() > 3'590'000);
}

TEST_CASE("a deadline in the past is expired with nothing remaining") {
  const ddp::deadline past(ddp::clock::now() - 1ms);
  CHECK(past.expired());
  CHECK(past.remaining() == 0ms);
  CHECK(past.poll_timeout_ms() == 0);
  CHECK(ddp::deadline::after(0ms).expired());
  CHECK(ddp::deadline::after(-5s).expired());
}

TEST_CASE("deadline::after saturates instead of overflowing") {
  CHECK(ddp::deadline::after(std::chrono::hours::max()).is_never());
  CHECK(ddp::deadline::after(std::chrono::milliseconds::max()).is_never());
  CHECK(ddp::deadline::after(std::chrono::hours(24 * 365 * 1000)).is_never());  // 1000 years
  CHECK(ddp::deadline::after(-std::chrono::hours::max()).expired());
  // 30 days is more milliseconds than poll() takes: capped, not wrapped.
  const auto month = ddp::deadline::after(std::chrono::hours(24 * 30));
  CHECK_FALSE(month.is_never());
  CHECK(month.poll_timeout_ms() == std::numeric_limits<int>::max());
}

TEST_CASE("deadlines order by their time points") {
  const auto soon = ddp::deadline::after(1s);
  const auto later = ddp::deadline::after(1h);
  CHECK(soon < later);
  CHECK(later < ddp::deadline::never());
  CHECK(std::min(later, soon) == soon);
}

TEST_CASE("poll() with a deadline's timeout returns at the deadline, not before") {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const auto start = ddp::clock::now();
  const auto d = ddp::deadline::after(150ms);
  pollfd p{fds[0], POLLIN, 0};
  int ready = 0;
  // Loop as callers do: poll may return early on EINTR.
  while (!d.expired()) {
    ready = ::poll(&p, 1, d.poll_timeout_ms());
    if (ready != 0) break;
  }
  const auto elapsed = ddp::clock::now() - start;
  ::close(fds[0]);
  ::close(fds[1]);
  CHECK(ready == 0);
  CHECK(d.expired());
  CHECK(elapsed >= 150ms);
  CHECK(elapsed < 5s);
}

TEST_CASE("DDP_TIMEOUT sets the default timeout, bad values name the variable") {
  struct timeout_case {
    const char* value;  // nullptr: unset
    long long want_ms;  // -1: errc::config expected
  };
  const std::vector<timeout_case> table = {
      {nullptr, 300'000}, {"", 300'000}, {"300", 300'000}, {"2.5", 2'500}, {"0.25", 250}, {"1e3", 1'000'000},
      {"abc", -1},       {"0", -1},     {"-1", -1},       {"5s", -1},     {"nan", -1},  {"inf", -1},
      {"1e10", -1},      {"1.5.2", -1},
  };
  for (const auto& c : table) {
    INFO("DDP_TIMEOUT=" << (c.value ? c.value : "(unset)"));
    const auto result = ddp::test::run_ranks(
        1,
        [&c](int) {
          if (c.value) ::setenv("DDP_TIMEOUT", c.value, 1);
          else ::unsetenv("DDP_TIMEOUT");
          long long got = -1;
          std::string message;
          try {
            got = ddp::default_timeout().count();
          } catch (const ddp::error& e) {
            ddp::test::check(e.code() == ddp::errc::config, "errc::config");
            message = e.what();
            ddp::test::check(message.find("DDP_TIMEOUT") != std::string::npos, "message names DDP_TIMEOUT: " + message);
            ddp::test::check(message.find('\n') == std::string::npos, "one line: " + message);
          }
          ddp::test::check(got == c.want_ms, "default_timeout() = " + std::to_string(got) + " ms, expected " +
                                                 std::to_string(c.want_ms) + " " + message);
          // launch_environment reads the same variable with the same rules.
          long long env_ms = -1;
          try {
            env_ms = ddp::launch_environment::from_environment().timeout.count();
          } catch (const ddp::error& e) {
            ddp::test::check(std::string(e.what()).find("DDP_TIMEOUT") != std::string::npos, e.what());
          }
          ddp::test::check(env_ms == c.want_ms, "launch_environment timeout = " + std::to_string(env_ms));
        },
        30s);
    CHECK(result.ok());
    if (!result.ok()) WARN(result.describe());
  }
}

}  // namespace ddp_test_deadline
