#pragma once
// POSIX shared-memory primitives for the shm transport and the shm algorithms:
// anonymous segments (memfd_create + mmap, shared through /proc/<pid>/fd, never named),
// futex waits on shared words, and pidfds to notice a dead peer.
//
// Why pidfds: a SIGKILLed peer stays a zombie until its parent reaps it, so kill(pid, 0)
// still succeeds; a pidfd becomes readable the moment the process exits.

#include <fcntl.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/cpus.hpp"
#include "ddp/core/error.hpp"

namespace ddp::detail::shm {

inline constexpr std::size_t cache_line = 64;

constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// Number of CPUs this process may run on: above it, spinning waiters starve the ranks they wait for.
inline int usable_cpus() {
  if (const auto cpus = allowed_cpus(); !cpus.empty()) return static_cast<int>(cpus.size());
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// Process-shared futexes (not FUTEX_PRIVATE: the word lives in memory mapped by several processes).
inline void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
inline void futex_wake_all(std::atomic<std::uint32_t>* word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// An asymmetric fence (membarrier(2)): the frequent side of a store->load handshake between
// processes needs only a compiler barrier, and the rare side pays for both with
// membarrier_global(), which runs a full memory barrier on every CPU that is running a
// registered process. A fence on the frequent side was a large share of a small collective.
// Each call is false where the kernel or a seccomp filter refuses.
inline bool membarrier_command(int command) noexcept {
#if defined(SYS_membarrier)
  return ::syscall(SYS_membarrier, command, 0, 0) == 0;
#else
  (void)command;
  return false;
#endif
}
/// Registers this process (its threads, present and future) for membarrier_global(). Per
/// process, and not inherited by fork: call it in the process that will take part.
inline bool register_membarrier() noexcept { return membarrier_command(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED); }
/// A full memory barrier on every CPU running a registered process.
inline bool membarrier_global() noexcept { return membarrier_command(MEMBARRIER_CMD_GLOBAL_EXPEDITED); }

/// A label for a segment, shown in /proc/<pid>/fd and /proc/<pid>/maps as "memfd:<label>": a
/// portable file name (letters, digits, '.', '_', '-') of at most 200 characters.
inline std::string segment_name(std::string_view prefix, std::string_view job, std::string_view what) {
  std::string clean;
  for (char c : prefix) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    clean += ok ? c : '_';
  }
  if (clean.size() > 100) clean.resize(100);
  return "ddp-" + clean + "-" + std::string(job) + "-" + std::string(what);
}

/// What limits the memory a segment needs: the memory cgroup's limit when there is one (then
/// `headroom` is what is left under it), else the machine's available memory.
inline std::string shared_memory_limit(std::optional<std::size_t>* headroom = nullptr) {
  auto first_line = [](const std::string& path) {
    std::string line;
    if (FILE* f = std::fopen(path.c_str(), "re")) {
      char buf[256];
      if (std::fgets(buf, sizeof buf, f) != nullptr) line = buf;
      std::fclose(f);
    }
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
    return line;
  };
  auto left_under = [](const std::string& max, const std::string& used) -> std::size_t {
    const unsigned long long m = std::strtoull(max.c_str(), nullptr, 10), u = std::strtoull(used.c_str(), nullptr, 10);
    return m > u ? static_cast<std::size_t>(m - u) : 0;
  };
  // cgroup v2: "0::/path"; v1: a line "N:memory:/path" (limit_in_bytes is huge when unlimited).
  std::string v2, v1;
  if (FILE* f = std::fopen("/proc/self/cgroup", "re")) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, f) != nullptr) {
      std::string line = buf;
      while (!line.empty() && line.back() == '\n') line.pop_back();
      if (line.rfind("0::", 0) == 0) v2 = line.substr(3);
      const auto at = line.find(":memory:");
      if (at != std::string::npos) v1 = line.substr(at + 8);
    }
    std::fclose(f);
  }
  if (!v1.empty()) {
    const std::string dir = "/sys/fs/cgroup/memory" + v1;
    const std::string max = first_line(dir + "/memory.limit_in_bytes");
    if (!max.empty() && max.size() < 19) {
      const std::string used = first_line(dir + "/memory.usage_in_bytes");
      if (headroom != nullptr && !used.empty()) *headroom = left_under(max, used);
      return "this job's memory cgroup allows " + max + " bytes (memory.limit_in_bytes) and uses " + first_line(dir + "/memory.usage_in_bytes");
    }
  } else if (!v2.empty()) {
    const std::string dir = "/sys/fs/cgroup" + v2;
    const std::string max = first_line(dir + "/memory.max");
    if (!max.empty() && max != "max") {
      const std::string used = first_line(dir + "/memory.current");
      if (headroom != nullptr && !used.empty()) *headroom = left_under(max, used);
      return "this job's cgroup allows " + max + " bytes (memory.max) and uses " + first_line(dir + "/memory.current");
    }
  }
  std::string available;
  if (FILE* f = std::fopen("/proc/meminfo", "re")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, f) != nullptr)
      if (std::string_view(buf).rfind("MemAvailable:", 0) == 0) available = buf + 13;
    std::fclose(f);
  }
  while (!available.empty() && (available.front() == ' ' || available.back() == '\n')) {
    if (available.front() == ' ') available.erase(0, 1);
    else available.pop_back();
  }
  return "the machine has " + (available.empty() ? std::string("?") : available) + " available";
}

/// One mapping of anonymous shared memory (memfd_create). It has no name in /dev/shm or
/// anywhere else, so nothing outlives the processes whatever is killed when, and /dev/shm's
/// size (a container's 64 MiB, say) does not limit it. The creator keeps a descriptor open
/// until its peers have mapped the memory: they open it as /proc/<pid>/fd/<fd>, which the
/// kernel allows a process of the same user in the same PID namespace (the ring backend only
/// puts such ranks in one shared-memory group, see core/host.hpp).
class shm_segment {
 public:
  shm_segment() = default;
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  shm_segment(shm_segment&& o) noexcept { *this = std::move(o); }
  shm_segment& operator=(shm_segment&& o) noexcept {
    if (this != &o) {
      release();
      name_ = std::move(o.name_);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~shm_segment() { release(); }

  /// Creates a new zero-filled segment. Its first `reserved` bytes (all by default) are backed
  /// now (posix_fallocate), so that too little memory is a clear error here rather than a SIGBUS
  /// on first touch; the rest takes memory only where some rank calls populate() or writes. The
  /// descriptor stays open (fd()) until close_descriptor().
  static shm_segment create(const std::string& name, std::size_t bytes, std::size_t reserved = SIZE_MAX) {
    shm_segment s;
    s.name_ = name;
    s.fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC);
    if (s.fd_ < 0) {
      const int err = errno;
      throw error(errc::unavailable, system_message("memfd_create(" + name + ")", err) +
                                         (err == EMFILE || err == ENFILE ? "; " + descriptor_limit_hint() : ""));
    }
    if (::ftruncate(s.fd_, static_cast<off_t>(bytes)) != 0) throw error(errc::unavailable, system_message("ftruncate(" + name + ")"));
    const std::size_t reserve = std::min(reserved, bytes);
    // Over a memory cgroup's limit the kernel kills the process instead of failing the call:
    // check first, so that the common case is a line that says what happened.
    std::optional<std::size_t> headroom;
    shared_memory_limit(&headroom);
    if (headroom && *headroom < reserve) throw out_of_memory(reserve, name, "not enough memory left under the limit");
    int rc = reserve == 0 ? 0 : ::posix_fallocate(s.fd_, 0, static_cast<off_t>(reserve));
    if (rc == EOPNOTSUPP || rc == EINVAL) rc = 0;  // a file system without fallocate: backed on first touch
    if (rc != 0) throw out_of_memory(reserve, name, std::strerror(rc));
    s.map(s.fd_, bytes);
    return s;
  }

  /// Backs [offset, offset + bytes) of the mapping with memory now (MADV_POPULATE_WRITE), so a
  /// shortage is this error and not a SIGBUS later. Kernels before 5.14 lack it: there the
  /// memory comes on first touch.
  void populate(std::size_t offset, std::size_t bytes) const {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t begin = offset / page * page;
    const std::size_t end = std::min(bytes_, (offset + bytes + page - 1) / page * page);
    if (end <= begin) return;
#if defined(MADV_POPULATE_WRITE)
    if (::madvise(data_ + begin, end - begin, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
      throw out_of_memory(end - begin, name_, std::strerror(errno));
    }
#endif
  }

  /// Maps the segment that process `pid` created and holds open as descriptor `fd`, checking its
  /// size. `who` names the creator in messages ("peer rank 3"). A creator that has exited (or closed
  /// the descriptor) is errc::peer_lost.
  static shm_segment open(pid_t pid, int fd, std::size_t bytes, const std::string& who) {
    shm_segment s;
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    s.name_ = who + "'s shared memory (" + path + ")";
    const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (mine < 0) {
      const int err = errno;
      if (err == ENOENT || err == ESRCH) {
        throw error(errc::peer_lost, who + " (pid " + std::to_string(pid) + ") exited before its shared memory was mapped");
      }
      throw error(errc::unavailable, system_message("opening " + s.name_, err) +
                                         (err == EACCES || err == EPERM
                                              ? "; the peer must run as the same user and stay dumpable (prctl PR_SET_DUMPABLE), "
                                                "and /proc must not be mounted with hidepid"
                                              : err == EMFILE || err == ENFILE ? "; " + descriptor_limit_hint() : ""));
    }
    struct stat st {};
    if (::fstat(mine, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
      ::close(mine);
      throw error(errc::internal, s.name_ + " is " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes));
    }
    s.map(mine, bytes);
    ::close(mine);  // the mapping keeps the memory
    return s;
  }

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  const std::string& name() const noexcept { return name_; }
  /// The creator's open descriptor, for peers to open through /proc; -1 once closed.
  int fd() const noexcept { return fd_; }

  /// Closes the creator's descriptor (the mapping stays). Call once every peer has mapped it.
  void close_descriptor() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  static error out_of_memory(std::size_t bytes, const std::string& name, const char* why) {
    return error(errc::unavailable, "shared memory: cannot back " + std::to_string(bytes) + " bytes of " + name + " (" + why +
                                        "): " + shared_memory_limit() + "; give the job more memory or run fewer ranks per host");
  }
  static std::string descriptor_limit_hint() {
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    return "this process may open " + std::to_string(static_cast<unsigned long long>(lim.rlim_cur)) +
           " files (ulimit -n); raise it (e.g. ulimit -n " + std::to_string(static_cast<unsigned long long>(lim.rlim_max)) + ")";
  }

  void map(int fd, std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw error(errc::unavailable, system_message("mmap of " + std::to_string(bytes) + " bytes of " + name_));
    data_ = static_cast<std::byte*>(p);
    bytes_ = bytes;
  }
  void release() noexcept {
    close_descriptor();
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }

  std::string name_;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  int fd_ = -1;
};

/// Watches peer processes through pidfds. Peers that are this process (ranks as threads) are skipped.
class peer_watch {
 public:
  peer_watch() = default;
  peer_watch(const peer_watch&) = delete;
  peer_watch& operator=(const peer_watch&) = delete;
  ~peer_watch() {
    for (const auto& p : peers_) ::close(p.fd);
  }

  void add(int rank, pid_t pid) {
    if (pid == ::getpid()) return;
    const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (fd < 0) {
      if (errno == ESRCH) {  // already gone: remember it as dead
        peers_.push_back({rank, pid, -1});
        return;
      }
      throw error(errc::unavailable, system_message("pidfd_open(" + std::to_string(pid) + ") for rank " + std::to_string(rank)));
    }
    peers_.push_back({rank, pid, fd});
  }

  struct dead_peer {
    int rank;
    pid_t pid;
  };
  /// The first watched peer that has exited, if any (never blocks).
  std::optional<dead_peer> first_dead() const noexcept {
    return first_dead([](int) { return true; });
  }
  /// The first watched peer that has exited, waiting up to `grace` for one to.
  std::optional<dead_peer> first_dead_within(std::chrono::milliseconds grace) const noexcept {
    return first_dead([](int) { return true; }, static_cast<int>(grace.count()));
  }
  /// The first watched peer r with relevant(r) that has exited, if any (never blocks; with
  /// wait_ms, waits up to that long for one).
  template <class Relevant>
  std::optional<dead_peer> first_dead(Relevant&& relevant, int wait_ms = 0) const noexcept {
    if (peers_.empty()) return std::nullopt;
    std::vector<pollfd> fds;
    std::vector<const peer*> polled;
    fds.reserve(peers_.size());
    polled.reserve(peers_.size());
    for (const auto& p : peers_) {
      if (!relevant(p.rank)) continue;
      if (p.fd < 0) return dead_peer{p.rank, p.pid};
      fds.push_back({p.fd, POLLIN, 0});
      polled.push_back(&p);
    }
    if (fds.empty() || ::poll(fds.data(), fds.size(), wait_ms) <= 0) return std::nullopt;
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents != 0) return dead_peer{polled[i]->rank, polled[i]->pid};
    return std::nullopt;
  }

 private:
  struct peer {
    int rank;
    pid_t pid;
    int fd;
  };
  std::vector<peer> peers_;
};

}  // namespace ddp::detail::shm
