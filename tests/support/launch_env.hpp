#pragma once
// Forked ranks that find each other the way torchrun's workers do: a free loopback port, and
// torchrun's variables set after every other launcher's have been cleared (the test may itself
// run under srun or mpirun, whose variables would win).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <stdexcept>
#include <string>

namespace ddp::test {

/// A port that was free a moment ago (the kernel's choice for port 0 on loopback).
inline int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (fd >= 0) ::close(fd);
  if (!ok) throw std::runtime_error("no free port");
  return ntohs(a.sin_port);
}

/// Unsets every launcher's rank and size variables, and DDP_TIMEOUT.
inline void clear_launcher_variables() {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS",
                        "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "DDP_TIMEOUT"}) {
    ::unsetenv(v);
  }
}

/// torchrun's variables for rank `rank` of `world` on one host, the store at 127.0.0.1:port.
inline void set_torchrun_variables(int rank, int world, int port) {
  clear_launcher_variables();
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

/// The first "rank N" of an error's own message (after the "ddp: rank R: op:" prefix).
inline int first_named_rank(const std::string& message) {
  std::smatch m;
  if (!std::regex_search(message, m, std::regex(R"(\brank (\d+)\b)"))) return -1;
  return std::stoi(m[1].str());
}

}  // namespace ddp::test
