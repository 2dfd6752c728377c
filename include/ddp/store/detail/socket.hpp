#pragma once
// POSIX socket helpers for the tcp_store: an owning fd, address resolution and formatting,
// connect-with-retry, and exact reads/writes bounded by a deadline. Every socket is
// non-blocking and close-on-exec; waiting is poll() on the remaining time of the deadline.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/unique_fd.hpp"

namespace ddp::store::detail {

using ddp::detail::unique_fd;

/// "host:port", with brackets for IPv6 literals.
inline std::string host_port(const std::string& host, std::uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string format_address(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = "?";
  std::uint16_t port = 0;
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
    port = ntohs(in6->sin6_port);
  }
  return host_port(text, port);
}

inline std::string peer_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return format_address(reinterpret_cast<sockaddr*>(&ss));
}

struct addrinfo_deleter {
  void operator()(addrinfo* a) const noexcept { ::freeaddrinfo(a); }
};
using addrinfo_ptr = std::unique_ptr<addrinfo, addrinfo_deleter>;

/// getaddrinfo for TCP; the error names host:port and the resolver's reason.
inline addrinfo_ptr resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* out = nullptr;
  const auto service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out);
  if (rc != 0) {
    throw error(errc::config, "cannot resolve store address " + host_port(host, port) + ": " + ::gai_strerror(rc) +
                                  " (check MASTER_ADDR)");
  }
  return addrinfo_ptr(out);
}

inline void set_nodelay(int fd) noexcept {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// poll() one fd for `events` until the deadline; returns revents, 0 on timeout.
inline short poll_one(int fd, short events, const deadline& until) {
  while (true) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, until.poll_timeout_ms());
    if (rc > 0) return p.revents;
    if (rc == 0) return 0;
    if (errno != EINTR) throw error(errc::store, system_message("poll"));
  }
}

/// How a whole transfer on a non-blocking socket ended: done, the deadline passed, the peer closed
/// the connection (recv read 0), or an error (errno in `err`).
enum class transfer_status { done, timed_out, closed, failed };
struct transfer_result {
  transfer_status status = transfer_status::done;
  int err = 0;
};

/// Sends all of `data` by `until` (short writes and EINTR handled); the store clients' only send loop.
inline transfer_result send_all_by(int fd, std::span<const std::byte> data, const deadline& until) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (poll_one(fd, POLLOUT, until) == 0) return {transfer_status::timed_out, 0};
      continue;
    }
    return {transfer_status::failed, errno};
  }
  return {};
}

/// Receives exactly data.size() bytes by `until`; the store clients' only receive loop.
inline transfer_result recv_exact_by(int fd, std::span<std::byte> data, const deadline& until) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::recv(fd, data.data() + done, data.size() - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return {transfer_status::closed, 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (poll_one(fd, POLLIN, until) == 0) return {transfer_status::timed_out, 0};
      continue;
    }
    return {transfer_status::failed, errno};
  }
  return {};
}

/// One non-blocking connect attempt; returns the connected fd, or an empty one with `err` set.
inline unique_fd try_connect(const addrinfo* ai, const deadline& until, int& err) {
  unique_fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
  if (!fd) {
    err = errno;
    return {};
  }
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      err = errno;
      return {};
    }
    const short rev = poll_one(fd.get(), POLLOUT, until);
    if (rev == 0) {
      err = ETIMEDOUT;
      return {};
    }
    int so_error = 0;
    socklen_t len = sizeof so_error;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      err = so_error;
      return {};
    }
  }
  set_nodelay(fd.get());
  return fd;
}

/// One attempt at host:port, on each address the name resolves to in turn. Returns the connected
/// fd, or an empty one with `why` saying what failed (and `err` the errno of a failed connect).
inline unique_fd connect_once(const std::string& host, std::uint16_t port, const deadline& until, int& err, std::string& why) {
  try {
    const auto list = resolve(host, port, false);
    for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
      if (auto fd = try_connect(ai, until, err)) return fd;
      why = system_message("connect", err);
    }
  } catch (const error& e) {
    why = e.message();  // the name may resolve later (DNS, /etc/hosts written at start-up)
  }
  return {};
}

/// Connects, retrying refused/unreachable attempts until the deadline: ranks race at start-up,
/// and the server may come up after its clients.
inline unique_fd connect_with_retry(const std::string& host, std::uint16_t port, const deadline& until) {
  int pause_ms = 10;
  int last_err = 0;
  std::string last_what = "no attempt made";
  while (true) {
    if (auto fd = connect_once(host, port, until, last_err, last_what)) return fd;
    if (until.expired()) {
      throw error(errc::timeout, "could not connect to the store server " + host_port(host, port) + " before the deadline (" +
                                     last_what + "); is rank 0 running and MASTER_ADDR/MASTER_PORT right?",
                  {.op = "store.connect", .backend_code = last_err});
    }
    const int left = until.poll_timeout_ms();
    ::poll(nullptr, 0, left < 0 ? pause_ms : std::min(pause_ms, left));
    pause_ms = std::min(pause_ms * 2, 200);
  }
}

}  // namespace ddp::store::detail
