#pragma once
// POSIX shared-memory primitives for the shm transport and the shm algorithms:
// named segments (shm_open + mmap, unlinked as soon as every rank has mapped them),
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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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
inline int usable_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
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
// registered process. A fence on the frequent side cost 10-35 ns of a 110 ns small collective.
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

/// A segment name: '/' + a portable file name (letters, digits, '.', '_', '-'), at most 200 characters.
inline std::string segment_name(std::string_view prefix, std::string_view job, std::string_view what) {
  std::string clean;
  for (char c : prefix) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    clean += ok ? c : '_';
  }
  if (clean.size() > 100) clean.resize(100);
  return "/ddp-" + clean + "-" + std::string(job) + "-" + std::string(what);
}

/// One mapping of a named shared-memory segment. The creator unlinks it (unlink(), or at the
/// latest in the destructor), so a segment outlives its name only while ranks are mapping it.
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
      linked_ = std::exchange(o.linked_, false);
    }
    return *this;
  }
  ~shm_segment() { release(); }

  /// Creates a new zero-filled segment; its memory is reserved now (posix_fallocate) so that a
  /// full /dev/shm is a clear error here rather than a SIGBUS on first touch.
  static shm_segment create(const std::string& name, std::size_t bytes) {
    shm_segment s;
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw error(errc::unavailable, system_message("shm_open(" + name + ", O_CREAT)"));
    s.name_ = name;
    s.linked_ = true;
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (rc != 0) {
      ::close(fd);
      throw error(errc::unavailable, system_message("reserving " + std::to_string(bytes) + " bytes of shared memory for " + name +
                                                        " (is /dev/shm too small? e.g. docker needs --ipc=host or --shm-size)",
                                                    rc));
    }
    s.map(fd, bytes);
    return s;
  }

  /// Maps an existing segment created by another rank, checking its size.
  static shm_segment open(const std::string& name, std::size_t bytes) {
    shm_segment s;
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw error(errc::unavailable, system_message("shm_open(" + name + ")"));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
      ::close(fd);
      throw error(errc::internal, "shared-memory segment " + name + " is " + std::to_string(st.st_size) + " bytes, expected " +
                                      std::to_string(bytes));
    }
    s.name_ = name;
    s.map(fd, bytes);
    return s;
  }

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  const std::string& name() const noexcept { return name_; }

  /// Removes the name (the memory stays until the last mapping goes). Only the creator calls it.
  void unlink() noexcept {
    if (linked_) ::shm_unlink(name_.c_str());
    linked_ = false;
  }

 private:
  void map(int fd, std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the memory; no descriptor stays open
    if (p == MAP_FAILED) {
      unlink();
      throw error(errc::unavailable, system_message("mmap of " + std::to_string(bytes) + " bytes of " + name_, err));
    }
    data_ = static_cast<std::byte*>(p);
    bytes_ = bytes;
  }
  void release() noexcept {
    unlink();
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }

  std::string name_;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool linked_ = false;
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
  /// The first watched peer r with relevant(r) that has exited, if any (never blocks).
  template <class Relevant>
  std::optional<dead_peer> first_dead(Relevant&& relevant) const noexcept {
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
    if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return std::nullopt;
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
