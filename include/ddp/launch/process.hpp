#pragma once
// Process helpers for the launcher: file descriptors, PATH lookup, random tokens, free ports,
// signal names, and a scope that routes SIGCHLD / SIGINT / SIGTERM / SIGHUP into a signalfd.
// Internal: users call ddp::spawn / ddp::launch (ddp/launch.hpp).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/unique_fd.hpp"

namespace ddp::detail {


/// A pipe whose ends are close-on-exec; {read, write}.
inline std::pair<unique_fd, unique_fd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw error(errc::internal, system_message("pipe2"));
  return {unique_fd(fds[0]), unique_fd(fds[1])};
}

/// The path execve() should run for `program`: as given when it contains a '/', otherwise the
/// first executable match in PATH (like execvp, but resolved before fork so that the child
/// only calls async-signal-safe functions).
inline std::string find_executable(const std::string& program) {
  const auto executable = [](const std::string& path) {
    struct stat st{};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (program.empty()) throw error(errc::config, "no program given");
  if (program.find('/') != std::string::npos) {
    if (!executable(program)) {
      throw error(errc::config, "cannot execute '" + program + "': " +
                                    (::access(program.c_str(), F_OK) == 0 ? "not an executable file" : "no such file"));
    }
    return program;
  }
  const char* path_env = read_env("PATH");
  const std::string_view path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::size_t pos = 0;
  while (pos <= path.size()) {
    const std::size_t colon = std::min(path.find(':', pos), path.size());
    const std::string_view dir = colon == pos ? std::string_view(".") : path.substr(pos, colon - pos);
    // Built by appending: GCC 12's -Wrestrict misfires on string assignment and + here at -O2.
    std::string candidate;
    candidate.reserve(dir.size() + 1 + program.size());
    candidate.append(dir).append(1, '/').append(program);
    if (executable(candidate)) return candidate;
    pos = colon + 1;
  }
  throw error(errc::config, "program '" + program + "' not found in PATH (give a path, e.g. ./" + program + ")");
}

/// `bytes` random bytes from /dev/urandom, as lowercase hex.
inline std::string random_hex(std::size_t bytes) {
  unique_fd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (!fd) throw error(errc::internal, system_message("open /dev/urandom"));
  std::string raw(bytes, '\0');
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::read(fd.get(), raw.data() + got, bytes - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw error(errc::internal, system_message("read /dev/urandom"));
    got += static_cast<std::size_t>(n);
  }
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (unsigned char c : raw) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 0xf]);
  }
  return out;
}

/// A TCP port that is free on the IPv4 address `addr` right now: bind port 0, read the port
/// the kernel chose, close. Another process may take it before the store binds it (a small
/// race); the store reports the address in use, and the launcher's restarts pick a new port.
inline int pick_free_port(const std::string& addr = "127.0.0.1") {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
    throw error(errc::config, "cannot pick a free port on '" + addr + "': not an IPv4 address");
  }
  unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw error(errc::config, system_message("socket"));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0) {
    throw error(errc::config, system_message("cannot bind " + addr + ":0 to pick a free port"));
  }
  socklen_t len = sizeof sa;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    throw error(errc::config, system_message("getsockname"));
  }
  return ntohs(sa.sin_port);
}

/// "9 (Killed)".
inline std::string describe_signal(int sig) {
  const char* name = ::strsignal(sig);
  return std::to_string(sig) + " (" + (name != nullptr ? name : "unknown") + ")";
}

/// While alive, SIGCHLD, SIGINT, SIGTERM and SIGHUP are blocked in the calling thread and
/// readable from fd() (a signalfd), so a supervisor loop can poll() children, signals and
/// pipes together with no handler and no race between waitpid and a signal. SIGCHLD's
/// disposition is set to default (an ignored SIGCHLD would reap children behind our back).
/// The previous mask and disposition come back on destruction; original_mask() is what
/// children must restore before exec.
class signal_scope {
 public:
  signal_scope() {
    sigemptyset(&blocked_);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&blocked_, s);
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGCHLD, &dfl, &old_chld_);
    if (const int rc = ::pthread_sigmask(SIG_BLOCK, &blocked_, &old_mask_); rc != 0) {
      ::sigaction(SIGCHLD, &old_chld_, nullptr);
      throw error(errc::internal, system_message("pthread_sigmask", rc));
    }
    fd_.reset(::signalfd(-1, &blocked_, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!fd_) {
      const int err = errno;
      ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
      ::sigaction(SIGCHLD, &old_chld_, nullptr);
      throw error(errc::internal, system_message("signalfd", err));
    }
  }
  signal_scope(const signal_scope&) = delete;
  signal_scope& operator=(const signal_scope&) = delete;
  ~signal_scope() {
    fd_.reset();
    // Signals that arrived and were not read stay pending and are delivered here, as they
    // would have been without the scope.
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    ::sigaction(SIGCHLD, &old_chld_, nullptr);
  }

  int fd() const noexcept { return fd_.get(); }
  const sigset_t& original_mask() const noexcept { return old_mask_; }

  /// The next signal read from fd(), 0 when none is pending.
  int next() const noexcept {
    signalfd_siginfo info{};
    while (true) {
      const ssize_t n = ::read(fd_.get(), &info, sizeof info);
      if (n == static_cast<ssize_t>(sizeof info)) return static_cast<int>(info.ssi_signo);
      if (n < 0 && errno == EINTR) continue;
      return 0;
    }
  }

 private:
  sigset_t blocked_{};
  sigset_t old_mask_{};
  struct sigaction old_chld_{};
  unique_fd fd_;
};

}  // namespace ddp::detail
