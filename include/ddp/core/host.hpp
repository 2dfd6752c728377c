#pragma once
// Which host a process runs on, and the address it reaches other hosts from.

#include <string>

#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#endif

namespace ddp {

/// "hostname boot-id shm:<dev>:<inode> pidns:<inode>": equal for two processes exactly when
/// they can share memory and watch each other's processes. The boot id tells apart machines
/// (and containers' VMs) that share a name; the hostname tells apart network namespaces that
/// share a kernel but not a network. The last two are probes of what is really shared:
/// containers with host networking (same hostname, same kernel) but a private /dev/shm mount
/// or a private PID namespace differ there, and must talk over TCP.
std::string host_identity();

/// The part of a host_identity() that names the machine: "hostname boot-id".
std::string machine_of(const std::string& identity);

/// The local IPv4 address this host uses to reach `remote_host` (a name or an address), found
/// by connecting a UDP socket (no packet is sent); empty when there is no route.
std::string local_address_towards(const std::string& remote_host);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::string host_identity() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  std::string id = std::string(host) + " " + boot;
  struct stat shm{};
  if (::stat("/dev/shm", &shm) == 0) {
    id += " shm:" + std::to_string(static_cast<unsigned long long>(shm.st_dev)) + ":" +
          std::to_string(static_cast<unsigned long long>(shm.st_ino));
  } else {
    id += " shm:none";
  }
  struct stat pid_ns{};
  if (::stat("/proc/self/ns/pid", &pid_ns) == 0) id += " pidns:" + std::to_string(static_cast<unsigned long long>(pid_ns.st_ino));
  return id;
}

DDP_COMPILED_INLINE std::string machine_of(const std::string& identity) {
  const auto first = identity.find(' ');
  if (first == std::string::npos) return identity;
  const auto second = identity.find(' ', first + 1);
  return identity.substr(0, second);
}

DDP_COMPILED_INLINE std::string local_address_towards(const std::string& remote_host) {
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
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
