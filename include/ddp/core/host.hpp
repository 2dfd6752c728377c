#pragma once
// Which host a process runs on, and the address it reaches other hosts from.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace ddp {

/// "hostname boot-id": equal for two processes exactly when they run on one kernel under
/// one hostname. The boot id tells apart machines (and containers' VMs) that share a name;
/// the hostname tells apart network namespaces or containers that share a kernel but not a
/// network, which must talk over TCP.
inline std::string host_identity() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return std::string(host) + " " + boot;
}

/// The local IPv4 address this host uses to reach `remote_host` (a name or an address), found
/// by connecting a UDP socket (no packet is sent); empty when there is no route.
inline std::string local_address_towards(const std::string& remote_host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(remote_host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return {};
  std::string result;
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_in local{};
    socklen_t length = sizeof local;
    if (::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET_ADDRSTRLEN] = {};
      if (::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr) result = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return result;
}

}  // namespace ddp
