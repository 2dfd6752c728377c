#pragma once
// Who holds a TCP port, asked by connecting to it: a ddp store greets every new connection at
// once, and its hello names its protocol version and its job; anything else stays silent or
// sends something else. A server whose port is taken says who holds it, and decides whether to
// move to an alternate port; a client looking for its job's store over the alternates skips the
// ports others hold (tcp_store.hpp, "Alternate ports").

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/secret.hpp"
#include "ddp/store/detail/socket.hpp"

namespace ddp::store::detail {

/// What a connection to a port found: the store of this job, another holder (another job's
/// store, another ddp version, a program that is not a ddp store), or nothing yet (no greeting:
/// a program that never greets, or a store too busy to greet in time).
enum class port_holder { store_of_job, other, silent };

struct port_greeting {
  port_holder holder = port_holder::silent;
  std::array<std::byte, server_hello_bytes> hello{};
  std::string description;  // " by ...", for messages
};

/// Sends this client's hello on a connected fd and reads who answers: a ddp store greets every
/// new connection at once, and its hello names its job.
inline port_greeting read_port_greeting(int fd, std::span<const std::byte, nonce_bytes> mine, const std::string& my_job,
                                        const deadline& until) {
  port_greeting g;
  const std::string of_mine = my_job.empty() ? std::string() : " (this rank is of job " + job_field_text(my_job) + ")";
  // A ddp store of any version greets with magic and version (an older one without being asked).
  (void)send_all_by(fd, encode_client_hello(mine), until);
  const auto got = recv_exact_by(fd, std::span(g.hello).first(8), until);
  const bool store_magic = got.status == transfer_status::done && get_le<std::uint32_t>(g.hello.data()) == protocol_magic;
  if (!store_magic) {
    g.holder = got.status == transfer_status::done ? port_holder::other : port_holder::silent;
    g.description = " by a program that is not a ddp store (under torchrun: its agent's TCPStore, which ddp joins when "
                    "TORCHELASTIC_USE_AGENT_STORE=True; else another program or a PyTorch job)" + of_mine;
    return g;
  }
  g.holder = port_holder::other;
  if (const auto version = get_le<std::uint16_t>(g.hello.data() + 4); version != protocol_version) {
    g.description = " by a ddp store of protocol version " + std::to_string(version) + " (another ddp version: another job or a leftover process)" + of_mine;
    return g;
  }
  if (recv_exact_by(fd, std::span(g.hello).subspan(8), until).status != transfer_status::done) {
    g.holder = port_holder::silent;
    g.description = " by a ddp store that did not finish its greeting" + of_mine;
    return g;
  }
  const std::string theirs = server_hello_job(g.hello);
  if (theirs.empty()) {
    g.description = " by the ddp store of another job or a leftover process" + of_mine;
  } else if (theirs == job_field_text(my_job)) {
    g.holder = port_holder::store_of_job;
    g.description = " by a store of this same job " + theirs + " (several launchers each started a whole job? e.g. srun -n2 over ddprun --nnodes=1)";
  } else {
    g.description = " by the ddp store of job " + theirs + of_mine + " (two jobs on one port: give each its own MASTER_PORT)";
  }
  return g;
}

/// Who holds host:port, for the "already in use" message and for a server deciding whether to
/// move to an alternate port.
inline port_greeting identify_port_holder(const std::string& host, std::uint16_t port, const std::string& my_job) {
  unique_fd fd;
  try {
    fd = connect_with_retry(host.empty() ? std::string("127.0.0.1") : host, port, deadline::after(std::chrono::milliseconds(300)));
  } catch (const error&) {
    return {.holder = port_holder::silent, .description = " (another job or a leftover process?)"};
  }
  nonce probe{};
  random_bytes(probe);
  return read_port_greeting(fd.get(), probe, my_job, deadline::after(std::chrono::milliseconds(300)));
}

}  // namespace ddp::store::detail
