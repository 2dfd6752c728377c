#pragma once
// POSIX socket helpers for the TCP transport: an owning fd, "host:port" parsing, a
// non-blocking listener on an ephemeral port, a connect bounded by a deadline, and the
// socket options the data path wants (TCP_NODELAY, large buffers, non-blocking).
// Users do not touch these; tcp_transport does. (ddp::detail::tcp, not ddp::transport::detail:
// `ddp::transport` is the name of the transport concept, so it cannot also be a namespace.)

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/unique_fd.hpp"

namespace ddp::detail::tcp {

using ddp::detail::unique_fd;

struct host_port {
  std::string host;
  int port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};

/// "host:port" (IPv4 or a name; "[v6]:port" for IPv6).
inline host_port parse_host_port(std::string_view text) {
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 >= text.size()) {
    throw error(errc::config, "address '" + std::string(text) + "' is not host:port");
  }
  std::string host(text.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  for (char c : text.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) throw error(errc::config, "address '" + std::string(text) + "' has a bad port");
    port = port * 10 + (c - '0');
  }
  if (port <= 0 || port > 65535) throw error(errc::config, "address '" + std::string(text) + "' has a port out of range");
  return {std::move(host), port};
}

inline void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throw error(errc::internal, system_message("fcntl(O_NONBLOCK)"));
}

/// TCP_NODELAY (latency of small messages) and large kernel buffers (a whole ring chunk in flight).
/// Buffer sizes are a request the kernel may cap (net.core.[rw]mem_max); failures are not errors.
inline void tune_data_socket(int fd, int buffer_bytes) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
  }
}

struct resolved {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};

inline resolved resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0 || list == nullptr) {
    throw error(errc::config, "cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  resolved r;
  std::memcpy(&r.addr, list->ai_addr, list->ai_addrlen);
  r.len = static_cast<socklen_t>(list->ai_addrlen);
  r.family = list->ai_family;
  ::freeaddrinfo(list);
  return r;
}

inline int port_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) throw error(errc::internal, system_message("getsockname"));
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

/// A non-blocking listener on host:0 (the kernel picks a free port, so jobs never collide).
inline unique_fd listen_ephemeral(const std::string& host, int backlog) {
  const resolved r = resolve(host, 1);  // port replaced below
  unique_fd fd(::socket(r.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw error(errc::config, system_message("socket()"));
  sockaddr_storage a = r.addr;
  if (r.family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = 0;
  else reinterpret_cast<sockaddr_in*>(&a)->sin_port = 0;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), r.len) != 0) {
    throw error(errc::config, system_message("bind(" + host + ":0)") + "; is " + host + " an address of this host?");
  }
  if (::listen(fd.get(), backlog) != 0) throw error(errc::config, system_message("listen(" + host + ")"));
  set_nonblocking(fd.get());
  return fd;
}

/// Connects to `to` before the deadline; retries while the listener is not there yet.
inline unique_fd connect_before(const host_port& to, deadline dl) {
  const resolved r = resolve(to.host, to.port);
  int last_err = 0;
  while (true) {
    unique_fd fd(::socket(r.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw error(errc::config, system_message("socket()"));
    set_nonblocking(fd.get());
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&r.addr), r.len);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      rc = ::poll(&p, 1, dl.poll_timeout_ms());
      if (rc == 0) break;  // deadline
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) return fd;
    last_err = errno;
    if (last_err != ECONNREFUSED && last_err != EINTR && last_err != ETIMEDOUT && last_err != EAGAIN) {
      throw error(errc::peer_lost, system_message("connect(" + to.str() + ")", last_err));
    }
    if (dl.expired()) break;
    ::poll(nullptr, 0, 10);  // the listener is not up yet: retry shortly, within the deadline
  }
  throw error(errc::timeout, "could not connect to " + to.str() + " before the deadline" +
                                 (last_err != 0 ? " (" + system_message("last attempt", last_err) + ")" : std::string()));
}

}  // namespace ddp::detail::tcp
