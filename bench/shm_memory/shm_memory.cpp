// Shared memory per rank of a one-host ring job, against the number of ranks:
//   ddp_bench_shm_memory [--ranks 8,16,32,64,128] [--ring-peers]
// For each p it starts p processes, each of which calls init_process_group("ring") (shared
// memory between them), does one all_reduce and, with --ring-peers, one send/recv with each ring
// neighbour; then, while all p are alive, it adds up the memory of every shared segment they
// have mapped (each segment once, by inode, through /proc/<pid>/map_files: needs root) and the
// names in /dev/shm. The table shows total and per-rank bytes: per rank should stay flat
// as p grows.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddp/ddp.hpp"

namespace {

struct shared_bytes {
  std::size_t segments = 0;
  std::size_t bytes = 0;  // backed by memory (st_blocks), not just the segments' sizes
  std::size_t dev_shm_entries = 0;
};

// Every ddp segment mapped by one of `pids`, counted once.
shared_bytes measure(const std::vector<pid_t>& pids) {
  shared_bytes out;
  std::set<std::pair<dev_t, ino_t>> seen;
  for (pid_t pid : pids) {
    const std::string dir = "/proc/" + std::to_string(pid) + "/map_files";
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      const std::string path = dir + "/" + e->d_name;
      char target[512] = {};
      const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
      if (n <= 0 || std::strstr(target, "ddp-") == nullptr) continue;
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || !seen.insert({st.st_dev, st.st_ino}).second) continue;
      ++out.segments;
      out.bytes += static_cast<std::size_t>(st.st_blocks) * 512;
    }
    ::closedir(d);
  }
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, "ddp-", 4) == 0) ++out.dev_shm_entries;
    ::closedir(d);
  }
  return out;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// One rank: rendezvous, an all_reduce (and ring send/recv), report ready on `ready`, then stay
// alive until the parent closes `release` (or a minute passes).
[[noreturn]] void rank_main(int rank, int p, int port, bool ring_peers, int ready, int release) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(p).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(p).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  int code = 0;
  try {
    auto group = ddp::init_process_group("ring");
    std::vector<float> x(1024, 1.0f);
    group.all_reduce(std::span(x));
    if (x[0] != static_cast<float>(p)) throw std::runtime_error("all_reduce gave " + std::to_string(x[0]));
    if (ring_peers && p > 1) {
      std::vector<float> out(256, static_cast<float>(rank)), in(256);
      const int next = (rank + 1) % p, prev = (rank + p - 1) % p;
      // Even ranks send first, odd ranks receive first: no cycle of blocked sends.
      if (rank % 2 == 0) {
        group.send(std::span<const float>(out), next);
        group.recv(std::span(in), prev);
      } else {
        group.recv(std::span(in), prev);
        group.send(std::span<const float>(out), next);
      }
      if (in[0] != static_cast<float>(prev)) throw std::runtime_error("recv gave " + std::to_string(in[0]));
    }
    const char byte = 1;
    if (::write(ready, &byte, 1) != 1) throw std::runtime_error("ready pipe");
    pollfd pfd{release, POLLIN, 0};
    ::poll(&pfd, 1, 60'000);
    group.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ranks = {8, 16, 32, 64, 128};
  bool ring_peers = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc) {
      ranks.clear();
      for (char* tok = std::strtok(argv[++i], ","); tok != nullptr; tok = std::strtok(nullptr, ",")) ranks.push_back(std::atoi(tok));
    } else if (a == "--ring-peers") {
      ring_peers = true;
    } else {
      std::fprintf(stderr, "usage: %s [--ranks 8,16,...] [--ring-peers]\n", argv[0]);
      return 2;
    }
  }
  if (::geteuid() != 0) std::fprintf(stderr, "note: not root, /proc/<pid>/map_files is unreadable: the byte counts will be 0\n");
  std::printf("%6s %10s %14s %14s %14s\n", "ranks", "segments", "shared MiB", "MiB per rank", "/dev/shm names");
  int status_all = 0;
  for (int p : ranks) {
    int ready[2], release[2];
    if (::pipe(ready) != 0 || ::pipe(release) != 0) return 1;
    const int port = free_port();
    const std::size_t names_before = measure({}).dev_shm_entries;
    std::fflush(stdout);  // or the children would print what the parent has buffered
    std::vector<pid_t> pids;
    for (int r = 0; r < p; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(ready[0]);
        ::close(release[1]);
        rank_main(r, p, port, ring_peers, ready[1], release[0]);
      }
      pids.push_back(pid);
    }
    ::close(ready[1]);
    ::close(release[0]);
    int arrived = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30 + p);
    while (arrived < p) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      if (left <= 0) break;
      pollfd pfd{ready[0], POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) break;
      char buf[256];
      const ssize_t n = ::read(ready[0], buf, sizeof buf);
      if (n <= 0) break;  // every rank has exited
      arrived += static_cast<int>(n);
    }
    const shared_bytes m = measure(pids);
    ::close(release[1]);
    bool ok = arrived == p;
    for (pid_t pid : pids) {
      int status = 0;
      if (!ok) ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    ::close(ready[0]);
    const double mib = static_cast<double>(m.bytes) / (1 << 20);
    if (ok) {
      std::printf("%6d %10zu %14.1f %14.2f %14zu\n", p, m.segments, mib, mib / p, m.dev_shm_entries - names_before);
    } else {
      std::printf("%6d  failed (%d of %d ranks ready)\n", p, arrived, p);
      status_all = 1;
    }
    std::fflush(stdout);
  }
  return status_all;
}
