// The ddprun binary, run as a user runs it: real processes, real signals, its exit code and
// its lines on stderr. The workers are this binary (tests/scripts/launch_worker.hpp).
// Also its command line parser (tools/ddprun/command_line.hpp), called directly.
#include <catch2/catch.hpp>

#include <poll.h>
#include <signal.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "command_line.hpp"
#include "ddp/core/env_registry.hpp"
#include "scripts/launch_worker.hpp"
#include "support/skip.hpp"

using namespace std::chrono_literals;

namespace {

#ifdef DDPRUN_EXE
const std::string ddprun_exe = DDPRUN_EXE;
#else
const std::string ddprun_exe;
#endif

void require_ddprun() {
  if (ddprun_exe.empty() || ::access(ddprun_exe.c_str(), X_OK) != 0)
    ddp::test::skip("the ddprun binary was not built with this test (configure tools/ddprun)");  // exits 77
}

// ddprun [launcher args...] <this binary> --ddp-test-worker [worker args...]
std::vector<std::string> ddprun(std::vector<std::string> launcher_args, const std::vector<std::string>& worker_args) {
  launcher_args.insert(launcher_args.begin(), ddprun_exe);
  launcher_args.push_back(ddp::test::self_exe());
  launcher_args.push_back("--ddp-test-worker");
  launcher_args.insert(launcher_args.end(), worker_args.begin(), worker_args.end());
  return launcher_args;
}

std::vector<pid_t> all_pids(const std::map<int, std::vector<pid_t>>& recorded) {
  std::vector<pid_t> out;
  for (const auto& [rank, pids] : recorded) out.insert(out.end(), pids.begin(), pids.end());
  return out;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) out.push_back(text.substr(start, nl - start));
  if (start < text.size()) out.push_back(text.substr(start));
  return out;
}

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

bool all_digits(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

// N from the first "port N bound" in `text`, or "".
std::string bound_port(const std::string& text) {
  const auto bound = text.find(" bound");
  if (bound == std::string::npos) return {};
  const auto port = text.rfind("port ", bound);
  if (port == std::string::npos) return {};
  const std::string digits = text.substr(port + 5, bound - port - 5);
  return all_digits(digits) ? digits : std::string{};
}

// "ddprun: [root cause: ]rank R (local L, pid P) exited with code 1" with R, L in {0, 1}.
bool is_rank_exit_line(const std::string& line) {
  auto w = words(line);
  if (w.size() > 2 && w[1] == "root" && w[2] == "cause:") w.erase(w.begin() + 1, w.begin() + 3);
  return w.size() == 11 && w[0] == "ddprun:" && w[1] == "rank" && (w[2] == "0" || w[2] == "1") &&
         (w[3] == "(local") && (w[4] == "0," || w[4] == "1,") && w[5] == "pid" && w[6].size() > 1 &&
         w[6].back() == ')' && all_digits(w[6].substr(0, w[6].size() - 1)) && w[7] == "exited" && w[8] == "with" &&
         w[9] == "code" && w[10] == "1";
}

bool has_line_with_words(const std::string& text, const std::vector<std::string>& expected) {
  for (const auto& line : lines(text))
    if (words(line) == expected) return true;
  return false;
}

std::vector<std::string> launcher_lines(const std::string& text) {
  std::vector<std::string> out;
  for (const auto& line : lines(text))
    if (line.rfind("ddprun: ", 0) == 0) out.push_back(line);
  return out;
}

// A worker of this file (started as <binary> --ddprun-test-cause DIR N): the store host's failure
// with its consequences reaped first. Every rank records its pid; rank 0 prints its own error and
// marks it; the others then print a consequence ("store server ... closed the connection") and
// exit 1; rank 0 exits 1 only once the launcher has reaped them (their /proc entries are gone),
// so the launcher sees the consequences end before the cause.
int cause_worker(const std::string& dir, int n) {
  const int rank = std::atoi(ddp::test::env_or("RANK", "-1").c_str());
  ddp::test::write_file_atomically(dir + "/" + std::to_string(rank) + ".pid", std::to_string(::getpid()) + " 0\n");
  if (!ddp::test::wait_for_files(dir, ".pid", n, 60s)) return 99;
  if (rank != 0) {
    if (!ddp::test::wait_for_files(dir, ".failed", 1, 60s)) return 99;
    std::fprintf(stderr, "ddp: rank %d: store.get: store server 127.0.0.1:1 closed the connection\n", rank);
    return 1;
  }
  std::fprintf(stderr, "ddp: rank 0: the distinctive root cause 4711\n");
  std::fflush(stderr);
  ddp::test::write_file_atomically(dir + "/0.failed", "");
  const auto until = std::chrono::steady_clock::now() + 60s;
  for (const auto& [r, pids] : ddp::test::recorded_pids(dir)) {
    if (r == 0) continue;
    if (!ddp::test::wait_process_end(pids[0], 60s)) return 99;
    // Ended; now wait for the launcher to reap it (there is no event for that: poll, bounded).
    while (!ddp::test::stat_fields(pids[0]).empty()) {
      if (std::chrono::steady_clock::now() > until) return 99;
      ::poll(nullptr, 0, 1);
    }
  }
  return 1;
}

bool run_cause_worker_if_asked() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> argv;
  for (std::string a; std::getline(in, a, '\0');) argv.push_back(a);
  if (argv.size() < 4 || argv[1] != "--ddprun-test-cause") return false;
  const int code = cause_worker(argv[2], std::atoi(argv[3].c_str()));
  std::fflush(nullptr);
  ::_exit(code);
}

const bool cause_dispatch = run_cause_worker_if_asked();

}  // namespace

TEST_CASE("ddprun --standalone --nnodes=1 --nproc-per-node=2 runs two consistent workers") {
  require_ddprun();
  ddp::test::temp_dir dir;
  ddp::test::child_process p(ddprun({"--standalone", "--nnodes=1", "--nproc-per-node=2"}, {"env", dir.path}));
  const int code = p.wait(60s);
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  CHECK(code == 0);
  CHECK(p.err_text.empty());
  std::set<std::string> ports, tokens, jobs;
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(dir.path + "/" + std::to_string(r) + ".env");
    std::map<std::string, std::string> env;
    for (std::string line; std::getline(in, line);) env[line.substr(0, line.find('='))] = line.substr(line.find('=') + 1);
    CHECK(env["RANK"] == std::to_string(r));
    CHECK(env["LOCAL_RANK"] == std::to_string(r));
    CHECK(env["WORLD_SIZE"] == "2");
    CHECK(env["LOCAL_WORLD_SIZE"] == "2");
    CHECK(env["GROUP_RANK"] == "0");
    CHECK(env["MASTER_ADDR"] == "127.0.0.1");
    CHECK(env["MASTER_PORT"] != "29500");
    ports.insert(env["MASTER_PORT"]);
    tokens.insert(env["DDP_STORE_TOKEN"]);
    jobs.insert(env["DDP_JOB_ID"]);
    CHECK(env["job"] == env["DDP_JOB_ID"]);  // the identity the workers' store handshake carries
    CHECK(env["parsed"].rfind("torchrun " + std::to_string(r) + " 2 " + std::to_string(r) + " 2 127.0.0.1:", 0) == 0);
  }
  CHECK(ports.size() == 1);
  CHECK(tokens.size() == 1);
  CHECK(tokens.begin()->size() == 32);
  REQUIRE(jobs.size() == 1);  // one job identity for the whole job
  CHECK(jobs.begin()->rfind("ddprun:", 0) == 0);
  // Output is passed through verbatim by default.
  CHECK_THAT(p.out_text, Catch::Contains("worker RANK=0\n"));
  CHECK_THAT(p.out_text, Catch::Contains("worker RANK=1\n"));
}

TEST_CASE("ddprun: a worker that exits 3 takes the job down within the grace period, named, no process left") {
  require_ddprun();
  ddp::test::temp_dir dir;
  const auto start = std::chrono::steady_clock::now();
  ddp::test::child_process p(ddprun({"--nproc-per-node=3", "--grace-period=1"}, {"fail", dir.path, "3", "1", "3"}));
  const int code = p.wait(60s);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  CHECK(code == 3);
  CHECK(elapsed < 1s + 1s);
  const auto recorded = ddp::test::recorded_pids(dir.path);
  REQUIRE(recorded.size() == 3);
  CHECK(lines(p.err_text) ==
        std::vector<std::string>{"ddprun: rank 1 (local 1, pid " + std::to_string(recorded.at(1)[0]) + ") exited with code 3"});
  CHECK(ddp::test::survivors(all_pids(recorded), 5s).empty());
}

TEST_CASE("ddprun: a worker killed by SIGKILL is reported as a signal") {
  require_ddprun();
  ddp::test::temp_dir dir;
  ddp::test::child_process p(ddprun({"--nproc-per-node=2"}, {"killself", dir.path, "2", "1"}));
  const int code = p.wait(60s);
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  CHECK(code == 128 + SIGKILL);
  const auto recorded = ddp::test::recorded_pids(dir.path);
  REQUIRE(recorded.size() == 2);
  CHECK_THAT(p.err_text, Catch::Contains("ddprun: rank 1 (local 1, pid " + std::to_string(recorded.at(1)[0]) +
                                         ") was killed by signal 9 (Killed)\n"));
  CHECK(ddp::test::survivors(all_pids(recorded), 5s).empty());
}

TEST_CASE("ddprun: when rank 0 fails first and the others as a consequence, the summary names rank 0 first") {
  require_ddprun();
  (void)cause_dispatch;
  ddp::test::temp_dir dir;
  // A long settle period: the test is about the order of the ends, not about their speed.
  ddp::test::child_process p(
      {ddprun_exe, "--nproc-per-node=3", "--settle-period=30", ddp::test::self_exe(), "--ddprun-test-cause", dir.path, "3"});
  const int code = p.wait(60s);
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  const auto recorded = ddp::test::recorded_pids(dir.path);
  REQUIRE(recorded.size() == 3);
  const auto pid = [&](int r) { return std::to_string(recorded.at(r)[0]); };
  CHECK(code == 1);
  // The workers' lines pass through unchanged; the summary follows, root cause first.
  CHECK_THAT(p.err_text, Catch::Contains("\nddp: rank 0: the distinctive root cause 4711\n") ||
                             Catch::StartsWith("ddp: rank 0: the distinctive root cause 4711\n"));
  const std::string consequence = ": store.get: store server 127.0.0.1:1 closed the connection";
  CHECK(launcher_lines(p.err_text) ==
        std::vector<std::string>{
            "ddprun: root cause: rank 0 (local 0, pid " + pid(0) + ") exited with code 1: ddp: rank 0: the distinctive root cause 4711",
            "ddprun: rank 0 (local 0, pid " + pid(0) + ") exited with code 1: ddp: rank 0: the distinctive root cause 4711",
            "ddprun: rank 1 (local 1, pid " + pid(1) + ") exited with code 1: ddp: rank 1" + consequence,
            "ddprun: rank 2 (local 2, pid " + pid(2) + ") exited with code 1: ddp: rank 2" + consequence});
  CHECK(ddp::test::survivors(all_pids(recorded), 5s).empty());
}

TEST_CASE("ddprun: SIGTERM and SIGINT to the launcher stop every worker and their children") {
  require_ddprun();
  for (int sig : {SIGTERM, SIGINT}) {
    INFO("signal " << sig);
    ddp::test::temp_dir dir;
    ddp::test::child_process p(ddprun({"--nproc-per-node=2"}, {"block", dir.path, "2"}));
    REQUIRE(p.wait_for_output("ready ", 2, 60s));
    REQUIRE(ddp::test::wait_for_files(dir.path, ".pid", 2, 30s));
    const auto start = std::chrono::steady_clock::now();
    ::kill(p.pid(), sig);
    const int code = p.wait(30s);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
    CHECK(code == 128 + sig);
    CHECK(elapsed < 5s);
    CHECK_THAT(p.err_text, Catch::Contains(std::string("ddprun: received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") +
                                           ", stopping 2 workers\n"));
    const auto recorded = ddp::test::recorded_pids(dir.path);
    CHECK(recorded.size() == 2);
    CHECK(ddp::test::survivors(all_pids(recorded), 5s).empty());
  }
}

TEST_CASE("ddprun: workers die with the launcher even when it is SIGKILLed") {
  require_ddprun();
  ddp::test::temp_dir dir;
  ddp::test::child_process p(ddprun({"--nproc-per-node=2"}, {"block", dir.path, "2"}));
  REQUIRE(p.wait_for_output("ready ", 2, 60s));
  REQUIRE(ddp::test::wait_for_files(dir.path, ".pid", 2, 30s));
  ::kill(p.pid(), SIGKILL);
  // PR_SET_PDEATHSIG takes the workers down. (Their own children are out of reach once the
  // launcher is gone: a program that forks should set PDEATHSIG in its children too.)
  std::vector<pid_t> workers;
  for (const auto& [rank, pids] : ddp::test::recorded_pids(dir.path)) workers.push_back(pids[0]);
  CHECK(workers.size() == 2);
  CHECK(ddp::test::survivors(workers, 5s).empty());
  // The orphaned grandchildren still hold the output pipe: end them, then collect ddprun.
  for (const auto& [rank, pids] : ddp::test::recorded_pids(dir.path)) ::kill(pids[1], SIGKILL);
  CHECK(p.wait(30s) == 128 + SIGKILL);
}

TEST_CASE("ddprun --standalone: two concurrent launches get different ports") {
  require_ddprun();
  // Each job's rank 0 binds its MASTER_PORT (as the store would) and holds it until stdin
  // closes. The second job starts once the first holds its port, as a second job started on a
  // busy machine would: it must not be given the same port (torchrun's fixed 29500 would be).
  ddp::test::child_process a(ddprun({"--standalone", "--nproc-per-node=1"}, {"hold-port"}), {}, true);
  REQUIRE(a.wait_for_output(" bound\n", 1, 60s));
  ddp::test::child_process b(ddprun({"--standalone", "--nproc-per-node=1"}, {"hold-port"}), {}, true);
  REQUIRE(b.wait_for_output(" bound\n", 1, 60s));
  a.close_stdin();
  b.close_stdin();
  CHECK(a.wait(30s) == 0);
  CHECK(b.wait(30s) == 0);
  INFO("a: " << a.out_text << a.err_text << "b: " << b.out_text << b.err_text);
  const std::string port_a = bound_port(a.out_text), port_b = bound_port(b.out_text);
  REQUIRE(!port_a.empty());
  REQUIRE(!port_b.empty());
  CHECK(port_a != port_b);
}

TEST_CASE("ddprun: bad flags and bad configuration give one line and a non-zero exit") {
  require_ddprun();
  struct bad_case {
    std::vector<std::string> args;
    std::string message;
    int code;
  };
  const std::vector<bad_case> table = {
      {{"--bogus", "prog"}, "ddprun: unknown option '--bogus' (see --help)", 2},
      {{"--nproc-per-node"}, "ddprun: option '--nproc-per-node' needs a value", 2},
      {{"--nproc-per-node=abc", "prog"}, "ddprun: --nproc-per-node='abc' is not a positive integer, 'auto' or 'cpu'", 2},
      {{"--nnodes=1:2", "prog"}, "ddprun: --nnodes='1:2': elastic node ranges are not supported (expected N or N:N)", 2},
      {{"--master-port=70000", "prog"}, "ddprun: --master-port='70000' is out of range (expected 1-65535)", 2},
      {{}, "ddprun: no program given (usage: ddprun [options] program [args...])", 2},
      {{"--standalone", "--nnodes=2", "prog"}, "ddprun: --standalone runs one node; it cannot be combined with --nnodes=2", 2},
      {{"--nnodes=2", "prog"}, "ddprun: --nnodes=2 needs --master-addr (the address of node 0, where rank 0 runs)", 2},
      {{"--nnodes=2", "--node-rank=2", "--master-addr=127.0.0.1", "prog"},
       "ddprun: --node-rank=2 is out of range for --nnodes=2 (expected 0 <= node rank < nnodes)", 2},
      {{"ddp-no-such-program"}, "ddprun: program 'ddp-no-such-program' not found in PATH (give a path, e.g. ./ddp-no-such-program)", 2},
      {{"/nonexistent/prog"}, "ddprun: cannot execute '/nonexistent/prog': no such file", 2},
  };
  for (const auto& c : table) {
    std::vector<std::string> argv{ddprun_exe};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    ddp::test::child_process p(argv);
    const int code = p.wait(30s);
    INFO("expected: " << c.message << "\nstdout:\n" << p.out_text << "stderr:\n" << p.err_text);
    CHECK(code == c.code);
    CHECK(p.out_text.empty());
    CHECK(lines(p.err_text) == std::vector<std::string>{c.message});
  }
}

TEST_CASE("ddprun as one of several srun or mpirun tasks with --nnodes=1 is refused in one line") {
  require_ddprun();
  for (const auto& [var, value] : std::vector<std::pair<std::string, std::string>>{
           {"SLURM_STEP_NUM_TASKS", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}}) {
    ddp::test::child_process p({ddprun_exe, "--nproc-per-node=1", "/bin/true"}, {{var, value}});
    const int code = p.wait(30s);
    INFO("stderr:\n" << p.err_text);
    CHECK(code == 2);
    REQUIRE(lines(p.err_text).size() == 1);
    CHECK_THAT(p.err_text, Catch::StartsWith("ddprun: ddprun was started as one of " + value + " tasks (" + var + "=" + value +
                                             ") with --nnodes=1, so each task would run a whole job of its own"));
  }
}

TEST_CASE("ddprun: a bad environment gives one line on every rank and a non-zero exit") {
  require_ddprun();
  // Variables the launcher passes through to its workers; each worker reads its environment.
  const std::vector<std::pair<std::string, std::string>> table = {
      {"DDP_TIMEOUT", "abc"},
      {"DDP_TIMEOUT", "-1"},
  };
  for (const auto& [name, value] : table) {
    INFO(name << "=" << value);
    ddp::test::child_process p(ddprun({"--nproc-per-node=2", "--grace-period=5", "--settle-period=30"}, {"check-env"}), {{name, value}});
    const int code = p.wait(30s);
    INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
    CHECK(code == 1);
    int worker_lines = 0, summary_lines = 0;
    const std::string error = "ddp: " + name + "='" + value + "'";
    for (const auto& line : lines(p.err_text)) {
      if (line.rfind(error, 0) == 0) {
        ++worker_lines;
      } else if (is_rank_exit_line(line.substr(0, line.find(": " + error)))) {
        // The summary: "[root cause: ]rank R (local R, pid P) exited with code 1: <its line>".
        CHECK_THAT(line, Catch::Contains(": " + error));
        ++summary_lines;
      } else {
        FAIL_CHECK("unexpected line: " << line);
      }
    }
    // Each rank fails on its own within the settle period: each says why, and the summary
    // names the root cause, then repeats every rank's line.
    CHECK(worker_lines == 2);
    CHECK(summary_lines == 3);
    CHECK(launcher_lines(p.err_text).at(0).rfind("ddprun: root cause: rank ", 0) == 0);
  }
}

TEST_CASE("ddprun --help and --info exit 0") {
  require_ddprun();
  {
    ddp::test::child_process p({ddprun_exe, "--help"});
    CHECK(p.wait(30s) == 0);
    CHECK_THAT(p.out_text, Catch::Contains("--nproc-per-node"));
    CHECK_THAT(p.out_text, Catch::Contains("--standalone"));
  }
  {
    ddp::test::child_process p({ddprun_exe, "--info"}, {{"RANK", "1"}, {"WORLD_SIZE", "2"}});
    CHECK(p.wait(30s) == 0);
    INFO(p.out_text);
    CHECK_THAT(p.out_text, Catch::StartsWith("ddp 0."));
    CHECK_THAT(p.out_text, Catch::Contains("cuda: "));
    CHECK_THAT(p.out_text, Catch::Contains("launch environment (source: torchrun)"));
    CHECK(has_line_with_words(p.out_text, {"rank", "1", "<-", "RANK"}));
  }
}

TEST_CASE("ddprun --env prints every variable of ddp's registry, one per line, and exits 0") {
  require_ddprun();
  ddp::test::child_process p({ddprun_exe, "--env"});
  CHECK(p.wait(30s) == 0);
  INFO(p.out_text);
  const auto out = lines(p.out_text);
  // Counted from the registry itself, not from what ddprun prints.
  CHECK(out.size() == ddp::env_variables.size());
  std::set<std::string> printed;
  for (const auto& line : out) {
    const auto w = words(line);
    if (w.size() >= 2) printed.insert(w[0]);  // a name, then its meaning
  }
  for (const char* name : {"DDP_TIMEOUT", "MASTER_ADDR", "SLURM_PROCID"}) CHECK(printed.count(name) == 1);
  std::set<std::string> registered;
  for (const auto& v : ddp::env_variables) registered.insert(std::string(v.name));
  CHECK(printed == registered);
}

TEST_CASE("ddprun --prefix-output prefixes each worker line with its rank") {
  require_ddprun();
  ddp::test::child_process p(ddprun({"--nproc-per-node=2", "--prefix-output"}, {"echo"}));
  CHECK(p.wait(30s) == 0);
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  for (int r = 0; r < 2; ++r) {
    const std::string tag = "[rank " + std::to_string(r) + "] ";
    CHECK_THAT(p.out_text, Catch::Contains(tag + "hello from rank " + std::to_string(r) + "\n"));
    CHECK_THAT(p.out_text, Catch::Contains(tag + "tail " + std::to_string(r) + "\n"));  // unterminated line, flushed
    CHECK_THAT(p.err_text, Catch::Contains(tag + "error line from rank " + std::to_string(r) + "\n"));
  }
  for (const auto& line : lines(p.out_text)) CHECK(line.rfind("[rank ", 0) == 0);
}

TEST_CASE("ddprun --cpu-bind cores gives each worker its own equal share of the launcher's CPUs") {
  require_ddprun();
  // ddprun inherits this process's CPUs.
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(::sched_getaffinity(0, sizeof set, &set) == 0);
  std::vector<std::string> mine;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) mine.push_back(std::to_string(c));
  const auto join = [](const std::vector<std::string>& v, std::size_t from, std::size_t to) {
    std::string s;
    for (std::size_t i = from; i < to; ++i) s += (s.empty() ? "" : ",") + v[i];
    return s;
  };
  const auto cpus_of_workers = [](const std::string& out) {
    std::map<int, std::string> got;
    for (const auto& line : lines(out)) {
      const auto w = words(line);
      if (w.size() == 4 && w[0] == "rank" && w[2] == "cpus") got[std::stoi(w[1])] = w[3];
    }
    return got;
  };
  const std::string all = join(mine, 0, mine.size());

  ddp::test::child_process bound(ddprun({"--nproc-per-node=2", "--cpu-bind=cores"}, {"cpus"}));
  CHECK(bound.wait(30s) == 0);
  INFO("stdout:\n" << bound.out_text << "stderr:\n" << bound.err_text);
  auto got = cpus_of_workers(bound.out_text);
  REQUIRE(got.size() == 2);
  if (mine.size() >= 2) {
    // Two contiguous halves, the first one CPU larger when the count is odd.
    const std::size_t first = (mine.size() + 1) / 2;
    CHECK(got[0] == join(mine, 0, first));
    CHECK(got[1] == join(mine, first, mine.size()));
  } else {
    CHECK(got[0] == all);
    CHECK(got[1] == all);
    CHECK_THAT(bound.err_text, Catch::Contains("--cpu-bind cores: 2 workers on 1 CPUs: no worker is bound"));
  }

  ddp::test::child_process unbound(ddprun({"--nproc-per-node=2"}, {"cpus"}));  // the default: none
  CHECK(unbound.wait(30s) == 0);
  got = cpus_of_workers(unbound.out_text);
  REQUIRE(got.size() == 2);
  CHECK(got[0] == all);
  CHECK(got[1] == all);
}

TEST_CASE("ddprun --max-restarts restarts the group, and torchrun-only flags are accepted") {
  require_ddprun();
  ddp::test::child_process p(
      ddprun({"--max-restarts=1", "--nproc_per_node=2", "--no-python", "--rdzv-backend=c10d", "--rdzv-endpoint", "localhost:0"},
             {"fail-once", "0", "7"}));
  const int code = p.wait(60s);
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  CHECK(code == 0);
  CHECK_THAT(p.err_text, Catch::Contains("ddprun: warning: ignoring --rdzv-backend=c10d"));
  CHECK_THAT(p.err_text, Catch::Contains("ddprun: warning: ignoring --rdzv-endpoint=localhost:0"));
  CHECK_THAT(p.err_text, Catch::Contains(") exited with code 7\n"));
  CHECK_THAT(p.err_text, Catch::Contains("ddprun: restarting the worker group (restart 1 of 1)\n"));
  CHECK_THAT(p.out_text, Catch::Contains("attempt 1 rank 0\n"));
  CHECK_THAT(p.out_text, Catch::Contains("attempt 1 rank 1\n"));
}

TEST_CASE("parse_launcher_args accepts torchrun's flags in both spellings") {
  using args = std::vector<std::string>;
  {
    const auto c = ddp::parse_launcher_args(args{"--standalone", "--nnodes=1", "--nproc-per-node=2", "./train", "--epochs", "3"});
    CHECK(c.options.standalone);
    CHECK(c.options.nnodes == 1);
    CHECK(c.options.nproc_per_node == 2);
    CHECK(c.program == args{"./train", "--epochs", "3"});
  }
  {
    const auto c = ddp::parse_launcher_args(args{"--nnodes", "2:2", "--nproc_per_node", "4", "--node_rank=1", "--master_addr",
                                                 "10.0.0.1", "--master-port=1234", "--max_restarts", "3", "--no-python",
                                                 "--grace-period=0.5", "--tee", "3", "prog", "--nproc-per-node=9"});
    CHECK(c.options.nnodes == 2);
    CHECK(c.options.nproc_per_node == 4);
    CHECK(c.options.node_rank == 1);
    CHECK(c.options.master_addr == "10.0.0.1");
    CHECK(c.options.master_port == 1234);
    CHECK(c.options.max_restarts == 3);
    CHECK(c.options.grace_period == 500ms);
    CHECK(c.options.prefix_output);
    CHECK(c.program == args{"prog", "--nproc-per-node=9"});  // after the program: the program's
  }
  {
    const auto c = ddp::parse_launcher_args(args{"--rdzv-backend=c10d", "--rdzv_endpoint", "localhost:0", "--prefix-output", "--", "--odd-name"});
    CHECK(c.warnings.size() == 2);
    CHECK(c.options.prefix_output);
    CHECK(c.program == args{"--odd-name"});
  }
  {
    const auto c = ddp::parse_launcher_args(args{"--nproc-per-node=auto", "p"});
    // The CPUs this process may run on: at least one, at most the machine's.
    CHECK(c.options.nproc_per_node >= 1);
    CHECK(c.options.nproc_per_node <= static_cast<int>(::sysconf(_SC_NPROCESSORS_CONF)));
  }
  CHECK(ddp::parse_launcher_args(args{"--help"}).help);
  CHECK(ddp::parse_launcher_args(args{"-h", "whatever"}).help);
  CHECK(ddp::parse_launcher_args(args{"--info"}).info);
  CHECK(ddp::parse_launcher_args(args{"--env"}).env);
  CHECK_THAT(ddp::launcher_usage(), Catch::Contains("--nproc-per-node"));
}

TEST_CASE("parse_launcher_args rejects bad flags with one line naming the flag") {
  using args = std::vector<std::string>;
  const std::vector<std::pair<args, std::string>> table = {
      {{"--bogus", "p"}, "unknown option '--bogus'"},
      {{"-x", "p"}, "unknown option '-x'"},
      {{"--nnodes"}, "option '--nnodes' needs a value"},
      {{"--nnodes=abc", "p"}, "--nnodes='abc' is not a positive integer"},
      {{"--nnodes=1:4", "p"}, "elastic node ranges are not supported"},
      {{"--nproc-per-node=0", "p"}, "--nproc-per-node='0' is not a positive integer"},
      {{"--nproc_per_node=two", "p"}, "--nproc-per-node='two'"},
      {{"--master-port=70000", "p"}, "--master-port='70000' is out of range (expected 1-65535)"},
      {{"--node-rank=-1", "p"}, "--node-rank='-1' is not a non-negative integer"},
      {{"--standalone=yes", "p"}, "option '--standalone' takes no value"},
      {{"--grace-period=soon", "p"}, "--grace-period='soon'"},
      {{"--cpu-bind=sockets", "p"}, "--cpu-bind='sockets' is not none or cores"},
      {{"--module", "m"}, "--module runs Python modules"},
      {{"--standalone"}, "no program given"},
      {{}, "no program given"},
  };
  for (const auto& [input, message] : table) {
    std::string joined;
    for (const auto& a : input) joined += a + " ";
    INFO("args: " << joined);
    try {
      (void)ddp::parse_launcher_args(input);
      FAIL_CHECK("no error; expected: " << message);
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::invalid_argument);
      CHECK_THAT(e.message(), Catch::Contains(message));
      CHECK(e.message().find('\n') == std::string::npos);
    }
  }
}
