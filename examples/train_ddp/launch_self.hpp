#pragma once
// `train_ddp --nproc-per-node N` without RANK set: start N copies of this binary on this host
// with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
// a free MASTER_PORT), like `torchrun --standalone --nproc-per-node N`.
// One failed rank stops the job: the others get SIGTERM, then SIGKILL after a grace period; the
// exit status names the first failure. Children die with this process (PR_SET_PDEATHSIG).
// (A stand-in until ddp::spawn from <ddp/launch.hpp> is available.)

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace train {

/// A loopback port that was free a moment ago (the kernel's choice for port 0).
inline int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

/// Runs argv as `n` ranks; returns the exit code for the launcher (0 when every rank succeeded).
inline int launch_self(int n, char** argv) {
  const std::string port = std::to_string(free_loopback_port());
  std::vector<pid_t> pids;
  const pid_t parent = ::getpid();
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("train_ddp: fork");
      for (pid_t p : pids) ::kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);  // the launcher is already gone
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("GROUP_RANK", "0", 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execv("/proc/self/exe", argv);
      std::fprintf(stderr, "train_ddp: cannot re-execute itself: %s\n", std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int result = 0;
  int alive = n;
  std::chrono::steady_clock::time_point kill_at{};
  bool stopping = false;
  while (alive > 0) {
    int status = 0;
    const pid_t got = ::waitpid(-1, &status, stopping ? WNOHANG : 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (got == 0) {  // stopping: poll until the grace period ends
      if (std::chrono::steady_clock::now() >= kill_at)
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGKILL);
      ::poll(nullptr, 0, 20);
      continue;
    }
    int rank = -1;
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<std::size_t>(r)] == got) rank = r;
    if (rank < 0) continue;
    pids[static_cast<std::size_t>(rank)] = -1;
    --alive;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && result == 0) {
      if (WIFSIGNALED(status)) {
        std::fprintf(stderr, "train_ddp: rank %d was killed by signal %d (%s); stopping the other ranks\n", rank,
                     WTERMSIG(status), strsignal(WTERMSIG(status)));
        result = 128 + WTERMSIG(status);
      } else {
        std::fprintf(stderr, "train_ddp: rank %d exited with code %d; stopping the other ranks\n", rank,
                     WEXITSTATUS(status));
        result = WEXITSTATUS(status);
      }
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGTERM);
      stopping = true;
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
  }
  return result;
}

}  // namespace train
