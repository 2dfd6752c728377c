// ddp::spawn / ddp::launch with real processes (this binary re-executed as the worker, see
// tests/scripts/launch_worker.hpp), and the launcher's option checks (ddprun's command line:
// tests/multiprocess/ddprun_test.cpp).
#include <ddp/launch.hpp>

#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "scripts/launch_worker.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_launch {

using namespace std::chrono_literals;

namespace {

// Captures the launcher's own lines (options.log).
struct log_capture {
  std::FILE* file = std::tmpfile();
  ~log_capture() {
    if (file) std::fclose(file);
  }
  std::string text() const {
    std::fflush(file);
    std::rewind(file);
    std::string out;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, file)) > 0;) out.append(buf, n);
    return out;
  }
};

std::vector<std::string> worker(std::vector<std::string> args) {
  args.insert(args.begin(), {ddp::test::self_exe(), "--ddp-test-worker"});
  return args;
}

std::map<std::string, std::string> read_env_file(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

std::vector<pid_t> all_pids(const std::map<int, std::vector<pid_t>>& recorded) {
  std::vector<pid_t> out;
  for (const auto& [rank, pids] : recorded) out.insert(out.end(), pids.begin(), pids.end());
  return out;
}

}  // namespace

TEST_CASE("spawn gives every worker consistent launch variables") {
  ddp::test::temp_dir dir;
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 3;
  o.standalone = true;
  o.log = log.file;
  const auto result = ddp::spawn(o, worker({"env", dir.path}));
  INFO(log.text());
  REQUIRE(result.exit_code == 0);
  REQUIRE(result.workers.size() == 3);
  CHECK(result.failed == -1);
  CHECK(result.master_addr == "127.0.0.1");
  CHECK(result.master_port > 0);
  std::set<std::string> tokens;
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    auto env = read_env_file(dir.path + "/" + std::to_string(r) + ".env");
    CHECK(env["RANK"] == std::to_string(r));
    CHECK(env["LOCAL_RANK"] == std::to_string(r));
    CHECK(env["WORLD_SIZE"] == "3");
    CHECK(env["LOCAL_WORLD_SIZE"] == "3");
    CHECK(env["GROUP_RANK"] == "0");
    CHECK(env["GROUP_WORLD_SIZE"] == "1");
    CHECK(env["MASTER_ADDR"] == "127.0.0.1");
    CHECK(env["MASTER_PORT"] == std::to_string(result.master_port));
    CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "0");
    CHECK(env["pid"] == std::to_string(result.workers[static_cast<std::size_t>(r)].pid));
    // What the library reads from these variables agrees.
    CHECK(env["parsed"] == "torchrun " + std::to_string(r) + " 3 " + std::to_string(r) + " 3 127.0.0.1:" +
                               std::to_string(result.master_port));
    CHECK(env["DDP_STORE_TOKEN"].size() == 32);
    CHECK(env["DDP_STORE_TOKEN"].find_first_not_of("0123456789abcdef") == std::string::npos);
    tokens.insert(env["DDP_STORE_TOKEN"]);
    CHECK(result.workers[static_cast<std::size_t>(r)].ok());
  }
  CHECK(tokens.size() == 1);
  // The token is never logged.
  CHECK(log.text().find(*tokens.begin()) == std::string::npos);
}

TEST_CASE("spawn: a failing worker stops the others, is named, and leaves no process behind") {
  ddp::test::temp_dir dir;
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 3;
  o.grace_period = 2s;
  o.log = log.file;
  const auto start = std::chrono::steady_clock::now();
  const auto result = ddp::spawn(o, worker({"fail", dir.path, "3", "1", "3"}));
  const auto elapsed = std::chrono::steady_clock::now() - start;
  const std::string text = log.text();
  INFO(text);
  CHECK(result.exit_code == 3);
  REQUIRE(result.failed == 1);
  const auto& w = result.workers[1];
  CHECK(w.exit_code == 3);
  CHECK(text == "ddprun: rank 1 (local 1, pid " + std::to_string(w.pid) + ") exited with code 3\n");
  // The others went down on SIGTERM, well within the grace period.
  CHECK(result.workers[0].signal == SIGTERM);
  CHECK(result.workers[2].signal == SIGTERM);
  CHECK(elapsed < o.grace_period + 1s);
  const auto recorded = ddp::test::recorded_pids(dir.path);
  CHECK(recorded.size() == 3);
  CHECK(ddp::test::survivors(all_pids(recorded), 5s).empty());
}

TEST_CASE("spawn: a worker killed by a signal is reported as such") {
  ddp::test::temp_dir dir;
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 2;
  o.log = log.file;
  const auto result = ddp::spawn(o, worker({"killself", dir.path, "2", "0"}));
  const std::string text = log.text();
  INFO(text);
  CHECK(result.exit_code == 128 + SIGKILL);
  REQUIRE(result.failed == 0);
  CHECK(result.workers[0].signal == SIGKILL);
  CHECK(text == "ddprun: rank 0 (local 0, pid " + std::to_string(result.workers[0].pid) +
                    ") was killed by signal 9 (Killed)\n");
  CHECK(ddp::test::survivors(all_pids(ddp::test::recorded_pids(dir.path)), 5s).empty());
}

TEST_CASE("spawn: workers that ignore SIGTERM get SIGKILL after the grace period") {
  ddp::test::temp_dir dir;
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 3;
  o.grace_period = 300ms;
  o.log = log.file;
  const auto start = std::chrono::steady_clock::now();
  const auto result = ddp::spawn(o, worker({"stubborn", dir.path, "3", "2", "5"}));
  const auto elapsed = std::chrono::steady_clock::now() - start;
  const std::string text = log.text();
  INFO(text);
  CHECK(result.exit_code == 5);
  CHECK(result.failed == 2);
  CHECK(result.workers[0].signal == SIGKILL);
  CHECK(result.workers[1].signal == SIGKILL);
  CHECK_THAT(text, Catch::Contains("rank 0 (local 0, pid " + std::to_string(result.workers[0].pid) +
                                   ") did not stop within 300 ms; sending SIGKILL"));
  CHECK(elapsed >= 300ms);
  CHECK(elapsed < 300ms + 1s);
  CHECK(ddp::test::survivors(all_pids(ddp::test::recorded_pids(dir.path)), 5s).empty());
}

TEST_CASE("launch restarts the worker group after a failure, up to max_restarts") {
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 2;
  o.max_restarts = 2;
  o.log = log.file;
  const auto result = ddp::launch(o, worker({"fail-once", "1", "4"}));
  const std::string text = log.text();
  INFO(text);
  CHECK(result.exit_code == 0);
  CHECK(result.restarts == 1);
  CHECK_THAT(text, Catch::Contains("exited with code 4\n"));
  CHECK_THAT(text, Catch::Contains("ddprun: restarting the worker group (restart 1 of 2)\n"));

  // Without restarts the failure is the result.
  log_capture log2;
  o.max_restarts = 0;
  o.log = log2.file;
  CHECK(ddp::launch(o, worker({"fail-once", "1", "4"})).exit_code == 4);
}

TEST_CASE("spawn reports a program that cannot be run before starting anything") {
  ddp::test::temp_dir dir;
  const std::string plain = dir.path + "/plain";
  { std::ofstream(plain) << "data\n"; }
  ::chmod(plain.c_str(), 0644);
  ddp::launch_options o;
  o.log = nullptr;
  for (const std::vector<std::string>& argv : {std::vector<std::string>{"/nonexistent/program"},
                                               std::vector<std::string>{"ddp-no-such-program-in-path"},
                                               std::vector<std::string>{plain}, std::vector<std::string>{}}) {
    INFO("argv[0] = " << (argv.empty() ? "(none)" : argv[0]));
    try {
      (void)ddp::spawn(o, argv);
      FAIL_CHECK("no error");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::config);
      if (!argv.empty()) CHECK_THAT(e.message(), Catch::Contains(argv[0]));
    }
  }
}

TEST_CASE("validate names the option that is wrong") {
  struct bad_case {
    ddp::launch_options options;
    std::string message;
  };
  const auto with = [](auto change) {
    ddp::launch_options o;
    change(o);
    return o;
  };
  const std::vector<bad_case> table = {
      {with([](auto& o) { o.nproc_per_node = 0; }), "--nproc-per-node=0 must be at least 1"},
      {with([](auto& o) { o.nnodes = 0; }), "--nnodes=0 must be at least 1"},
      {with([](auto& o) { o.standalone = true, o.nnodes = 2, o.master_addr = "h"; }),
       "--standalone runs one node; it cannot be combined with --nnodes=2"},
      {with([](auto& o) { o.nnodes = 2; }), "--nnodes=2 needs --master-addr"},
      {with([](auto& o) { o.nnodes = 2, o.node_rank = 2, o.master_addr = "h"; }),
       "--node-rank=2 is out of range for --nnodes=2"},
      {with([](auto& o) { o.node_rank = -1; }), "--node-rank=-1 is out of range"},
      {with([](auto& o) { o.master_port = 70000; }), "--master-port=70000 is out of range (expected 1-65535)"},
      {with([](auto& o) { o.nnodes = 2, o.master_addr = "h", o.master_port = 0; }), "needs a fixed --master-port"},
      {with([](auto& o) { o.max_restarts = -1; }), "--max-restarts=-1"},
  };
  for (const auto& c : table) {
    INFO("expected: " << c.message);
    try {
      ddp::validate(c.options);
      FAIL_CHECK("no error");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::config);
      CHECK_THAT(e.message(), Catch::Contains(c.message));
    }
  }
  CHECK_NOTHROW(ddp::validate(ddp::launch_options{}));
}

TEST_CASE("standalone picks a free loopback port that can be bound") {
  const int a = ddp::detail::pick_free_port();
  CHECK(a > 0);
  CHECK(a <= 65535);
  // It is free: binding it works.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(a));
  ::inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  // While it is held, the next pick is another port.
  CHECK(ddp::detail::pick_free_port() != a);
  ::close(fd);
  CHECK_THROWS_AS(ddp::detail::pick_free_port("not-an-address"), ddp::error);
}

TEST_CASE("spawn: an executable file that execve rejects is a failure with exit code 127") {
  ddp::test::temp_dir dir;
  const std::string garbage = dir.path + "/garbage";
  { std::ofstream(garbage) << "not a program\n"; }
  ::chmod(garbage.c_str(), 0755);
  log_capture log;
  ddp::launch_options o;
  o.nproc_per_node = 2;
  o.log = log.file;
  const auto result = ddp::spawn(o, {garbage});
  const std::string text = log.text();
  INFO(text);
  CHECK(result.exit_code == 127);
  CHECK(result.failed == 0);
  CHECK_THAT(text, Catch::Contains("ddprun: rank 0: cannot execute '" + garbage + "': Exec format error"));
}

}  // namespace ddp_test_launch
