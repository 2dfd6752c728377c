// ensure_descriptors: a soft file limit below what a job needs is raised toward the hard one; a
// hard limit below it is errc::config naming the limit, the need and `ulimit -n`. Each case runs
// in a forked child, so the test process keeps its own limits.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "ddp/core/descriptor_limit.hpp"

namespace ddp_test_descriptor_limit {

namespace {

// Runs body() in a child with the given limits; the child's exit code: 0 when body returned true.
template <class Body>
int in_child(rlim_t soft, rlim_t hard, Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    rlimit lim{soft, hard};
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(3);
    ::_exit(body() ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace

TEST_CASE("ensure_descriptors raises a low soft limit to what is needed when the hard limit allows") {
  rlimit now{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &now) == 0);
  if (now.rlim_max != RLIM_INFINITY && now.rlim_max < 1024) {
    WARN("SKIPPED: this process's hard file limit is " << now.rlim_max << ", below the 1024 the case needs");
    return;
  }
  CHECK(in_child(64, 1024, [] {
          ddp::ensure_descriptors(500, "a rendezvous of 500 ranks");
          rlimit after{};
          ::getrlimit(RLIMIT_NOFILE, &after);
          return after.rlim_cur >= 500 + ddp::open_descriptors() && after.rlim_cur <= 1024;
        }) == 0);
}

TEST_CASE("ensure_descriptors leaves a sufficient limit alone") {
  CHECK(in_child(256, 256, [] {
          ddp::ensure_descriptors(16, "a small job");
          rlimit after{};
          ::getrlimit(RLIMIT_NOFILE, &after);
          return after.rlim_cur == 256;
        }) == 0);
}

TEST_CASE("ensure_descriptors names the limit, the need and the fix when the hard limit is too low") {
  CHECK(in_child(64, 64, [] {
          try {
            ddp::ensure_descriptors(200, "a rendezvous of 200 ranks", 3);
          } catch (const ddp::error& e) {
            const std::string what = e.what();
            const std::string need = std::to_string(200 + ddp::open_descriptors());
            return e.code() == ddp::errc::config && what.find("rank 3") != std::string::npos &&
                   what.find("a rendezvous of 200 ranks needs about " + need) != std::string::npos &&
                   what.find("its limit is 64 (hard limit 64)") != std::string::npos && what.find("ulimit -n " + need) != std::string::npos;
          }
          return false;
        }) == 0);
}

}  // namespace ddp_test_descriptor_limit
