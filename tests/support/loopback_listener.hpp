#pragma once
// A socket listening on 127.0.0.1, on a free port the kernel picks: a program that holds a port
// and answers nobody, or the listening end of a test's own fake server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <cstdint>

#include "ddp/core/unique_fd.hpp"

namespace ddp::test {

struct loopback_listener {
  ddp::detail::unique_fd fd{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  std::uint16_t port = 0;

  loopback_listener() {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(fd.get(), 8) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port = ntohs(addr.sin_port);
  }
};

}  // namespace ddp::test
