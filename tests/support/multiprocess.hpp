#pragma once
// Multi-process test harness: fork N ranks that each run a function, with a deadline.
//
// Each child runs fn(rank) with its stdout/stderr captured. A child that returns normally
// exits 0; one that throws prints the exception and exits 1. When the deadline passes,
// every remaining child is killed (SIGKILL) and the result says which ranks timed out.
// Children leave through _exit, so the parent's test framework state is never run twice.

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::test {

struct rank_result {
  int rank = -1;
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // the signal that ended the child, 0 when it exited
  bool timed_out = false;
  std::string output;  // everything the child wrote to stdout and stderr
  bool ok() const { return !timed_out && signal == 0 && exit_code == 0; }
  std::string describe() const {
    std::string s = "rank " + std::to_string(rank) + ": ";
    if (timed_out) s += "killed at the deadline";
    else if (signal != 0) s += std::string("killed by signal ") + std::to_string(signal) + " (" + strsignal(signal) + ")";
    else s += "exit code " + std::to_string(exit_code);
    if (!output.empty()) s += "\n  output: " + output;
    return s;
  }
};

struct run_result {
  std::vector<rank_result> ranks;
  bool ok() const {
    for (const auto& r : ranks)
      if (!r.ok()) return false;
    return true;
  }
  std::string describe() const {
    std::string s;
    for (const auto& r : ranks) s += r.describe() + "\n";
    return s;
  }
};

/// Throws std::runtime_error(message) unless cond: the assertion to use inside children.
inline void check(bool cond, const std::string& message) {
  if (!cond) throw std::runtime_error("check failed: " + message);
}

inline run_result run_ranks(int n, const std::function<void(int)>& fn,
                            std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  std::fflush(nullptr);
  run_result result;
  result.ranks.resize(static_cast<std::size_t>(n));
  std::vector<pid_t> pids(static_cast<std::size_t>(n), -1);
  std::vector<int> pipes(static_cast<std::size_t>(n), -1);
  for (int r = 0; r < n; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(fds[0]);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[1]);
      for (int fd : pipes)
        if (fd >= 0) ::close(fd);
      int code = 0;
      try {
        fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "exception: %s\n", e.what());
        code = 1;
      } catch (...) {
        std::fprintf(stderr, "unknown exception\n");
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(fds[1]);
    pids[static_cast<std::size_t>(r)] = pid;
    pipes[static_cast<std::size_t>(r)] = fds[0];
    result.ranks[static_cast<std::size_t>(r)].rank = r;
  }

  const auto until = std::chrono::steady_clock::now() + timeout;
  int open = n;
  while (open > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> which;
    for (int r = 0; r < n; ++r)
      if (pipes[static_cast<std::size_t>(r)] >= 0) {
        pfds.push_back({pipes[static_cast<std::size_t>(r)], POLLIN, 0});
        which.push_back(r);
      }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int ready = ::poll(pfds.data(), pfds.size(), static_cast<int>(left.count()));
    if (ready < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const auto r = static_cast<std::size_t>(which[i]);
      char buf[4096];
      const ssize_t got = ::read(pipes[r], buf, sizeof buf);
      if (got > 0) {
        result.ranks[r].output.append(buf, static_cast<std::size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        ::close(pipes[r]);
        pipes[r] = -1;
        --open;
      }
    }
  }
  // Children whose pipe is still open at the deadline are hung (or left a grandchild holding it).
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (pipes[i] >= 0) {
      result.ranks[i].timed_out = true;
      ::kill(pids[i], SIGKILL);
      ::close(pipes[i]);
    }
  }
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    int status = 0;
    // A child that closed its output but has not exited yet gets until the deadline as well.
    while (true) {
      const pid_t got = ::waitpid(pids[i], &status, WNOHANG);
      if (got == pids[i]) break;
      if (got < 0 && errno != EINTR) break;
      if (std::chrono::steady_clock::now() >= until) {
        result.ranks[i].timed_out = true;
        ::kill(pids[i], SIGKILL);
        ::waitpid(pids[i], &status, 0);
        break;
      }
      ::poll(nullptr, 0, 1);
    }
    if (WIFSIGNALED(status)) result.ranks[i].signal = WTERMSIG(status);
    else if (WIFEXITED(status)) result.ranks[i].exit_code = WEXITSTATUS(status);
  }
  return result;
}

}  // namespace ddp::test
