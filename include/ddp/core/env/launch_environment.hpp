#pragma once
// ddp::launch_environment: this process's rank, world, local layout and rendezvous address, and
// where each value came from; the launchers it recognises (launch_source). Reading it from the
// environment is in ddp/core/env/read.hpp; include ddp/core/env.hpp to use it.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/env_registry.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <cstdio>
#endif

namespace ddp {

/// Which launcher's variables a launch_environment came from (see ddp/core/env.hpp).
enum class launch_source : std::uint8_t { none, torchrun, openmpi, pmi, slurm, flux, pals, lsf };

constexpr std::string_view to_string(launch_source s) noexcept {
  switch (s) {
    case launch_source::none: return "none";
    case launch_source::torchrun: return "torchrun";
    case launch_source::openmpi: return "openmpi";
    case launch_source::pmi: return "pmi";
    case launch_source::slurm: return "slurm";
    case launch_source::flux: return "flux";
    case launch_source::pals: return "pals";
    case launch_source::lsf: return "lsf";
  }
  return "unknown";
}

/// Reads one variable; nullptr when unset. The process environment by default (read_registered_env).
using env_lookup = std::function<const char*(const char*)>;

/// Where each value of a launch_environment came from: a variable name, "default",
/// "derived (...)" or, with local_layout_from_rendezvous, "derived at rendezvous (...)".
struct launch_origins {
  std::string source = "default";  // why this source: the variable that chose it, and the rule
  std::string rank = "default";
  std::string world_size = "default";
  std::string local_rank = "default";
  std::string local_world_size = "default";
  std::string node_rank = "default";
  std::string num_nodes = "default";
  std::string master_addr = "default";
  std::string master_port = "default";
  std::string timeout = "default";
  std::string job_id = "default";
  std::string store = "default";
};

/// The origin of the local layout's values that init_process_group works out at rendezvous.
inline constexpr std::string_view rendezvous_origin = "derived at rendezvous (ranks sharing a host)";

/// This process's rank, world and rendezvous address, and where each value came from.
class launch_environment {
 public:
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // rank among the processes on this node
  int local_world_size = 1;  // processes on this node
  int node_rank = 0;         // GROUP_RANK in torchrun's terms
  int num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// With a master_port derived from the job's identity (no MASTER_PORT): the ports rank 0's
  /// store takes, in order, when something else holds master_port, and where every rank looks
  /// for it (store/tcp_store_server.hpp, "Alternate ports"). Empty when the port was given.
  std::vector<int> master_port_alternates;
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  /// The job's identity, the same on every rank, e.g. "slurm:1234.0"; "" when none.
  std::string job_id;
  /// The environment does not say which ranks share a host (torchrun's RANK and WORLD_SIZE alone
  /// with a master address that is not loopback, as in Kubeflow's PyTorchJob): the values whose
  /// origin is rendezvous_origin (local_rank 0, local_world_size 1, node_rank = rank,
  /// num_nodes = world_size) are provisional, to be derived at rendezvous from the ranks that
  /// share a host.
  bool local_layout_from_rendezvous = false;
  /// torchrun's elastic agent already serves a PyTorch TCPStore at MASTER_ADDR:MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True): ranks join it as its clients, with their keys under
  /// "/worker/attempt_<restart_count>", instead of rank 0 serving ddp's own store there.
  bool use_agent_store = false;
  /// The launcher serves ddp's store at MASTER_ADDR:MASTER_PORT (DDP_STORE_SERVER=launcher, what
  /// ddprun sets on one node): every rank is its client, so the store outlives any rank, and the
  /// launcher tells it which rank ended (store/detail/server_core.hpp, "Departures").
  bool store_served_by_launcher = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: which attempt of an elastic job this is
  launch_origins origin;

  launch_source source() const noexcept { return source_; }
  /// With local_layout_from_rendezvous, from the provisional values: true when world_size > 1.
  bool multi_node() const noexcept { return num_nodes > 1 || world_size > local_world_size; }

  /// Reads and checks the environment (see the precedence in ddp/core/env.hpp).
  static launch_environment from_environment(const env_lookup& lookup = read_registered_env);

  /// A table of value <- origin, one line each, e.g. "  rank              1   <- RANK"; the
  /// launcher that was recognised and why, the job id, and "(provisional)" after the values
  /// that are derived at rendezvous.
  std::string describe() const;

 private:
  /// from_environment(), where a multi-node job without a master address is an error only with
  /// require_master_addr (off when reading an enclosing launcher's layout).
  static launch_environment read_environment(const env_lookup& lookup, bool require_master_addr);

  launch_source source_ = launch_source::none;
};

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::string launch_environment::describe() const {
  std::string out = "launch environment (source: " + std::string(to_string(source_)) + ")\n";
  const auto row = [&out](std::string_view name, const std::string& value, const std::string& from) {
    std::string line = "  " + std::string(name);
    line.resize(20, ' ');
    line += value;
    if (line.size() < 40) line.resize(40, ' ');
    out += line + " <- " + from + "\n";
  };
  const auto layout = [this](int value, const std::string& from) {
    return std::to_string(value) + (local_layout_from_rendezvous && from == rendezvous_origin ? " (provisional)" : "");
  };
  row("source", std::string(to_string(source_)), origin.source);
  row("job", job_id.empty() ? "(none)" : job_id, origin.job_id);
  row("rank", std::to_string(rank), origin.rank);
  row("world_size", std::to_string(world_size), origin.world_size);
  row("local_rank", layout(local_rank, origin.local_rank), origin.local_rank);
  row("local_world_size", layout(local_world_size, origin.local_world_size), origin.local_world_size);
  row("node_rank", layout(node_rank, origin.node_rank), origin.node_rank);
  row("num_nodes", layout(num_nodes, origin.num_nodes), origin.num_nodes);
  row("master_addr", master_addr, origin.master_addr);
  row("master_port", std::to_string(master_port), origin.master_port);
  if (!master_port_alternates.empty()) {
    std::string ports;
    for (const int p : master_port_alternates) ports += (ports.empty() ? "" : " ") + std::to_string(p);
    row("port_alternates", ports, "derived (in turn, where master_port is held)");
  }
  row("store", use_agent_store ? "torchrun agent's TCPStore, keys under /worker/attempt_" + std::to_string(restart_count)
               : world_size <= 1        ? std::string("none (world of one)")
               : store_served_by_launcher ? std::string("ddp tcp_store served by the launcher")
                                        : std::string("ddp tcp_store served by rank 0"),
      origin.store);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g s", static_cast<double>(timeout.count()) / 1000.0);
  row("timeout", seconds, origin.timeout);
  return out;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
