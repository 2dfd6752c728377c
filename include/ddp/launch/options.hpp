#pragma once
// ddp::launch_options: what a launcher is asked to run (nodes, workers per node, rendezvous,
// periods, output), and validate(), which names the option that is wrong.

#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

struct launch_options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: 127.0.0.1, single node only
  int master_port = 29500;  // 0: a free loopback port
  bool standalone = false;  // one node, master 127.0.0.1, a free port
  int max_restarts = 0;     // launch() restarts the whole group up to this many times
  std::chrono::milliseconds grace_period = std::chrono::seconds(5);  // SIGTERM -> SIGKILL
  // First failure -> SIGTERM to the others, unless they all end before (see ddp/launch/job.hpp).
  std::chrono::milliseconds settle_period = std::chrono::milliseconds(500);
  bool prefix_output = false;  // "[rank N] " before each line the workers print
  // --cpu-bind cores: local rank i runs on the i-th of nproc_per_node equal, contiguous shares of
  // the CPUs the launcher may use (as srun --cpu-bind=cores); with more workers than CPUs, none
  // is bound. Off by default, as under torchrun.
  bool bind_cpus = false;
  std::string name = "ddprun";  // how the launcher's own lines start
  std::vector<std::pair<std::string, std::string>> env;  // more variables for every worker
  std::string store_token;  // empty: see "Tokens" in ddp/launch/job.hpp
  std::string job_id;       // empty: see "Job identity" in ddp/launch/job.hpp
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT for this group (set by launch())
  std::FILE* log = stderr;  // where the launcher's own lines go
};

/// Throws ddp::error(errc::config) naming the option that is wrong.
void validate(const launch_options& o);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE void validate(const launch_options& o) {
  const auto bad = [](std::string m) { throw error(errc::config, std::move(m)); };
  if (o.nproc_per_node < 1) bad("--nproc-per-node=" + std::to_string(o.nproc_per_node) + " must be at least 1");
  if (o.nnodes < 1) bad("--nnodes=" + std::to_string(o.nnodes) + " must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    bad("--node-rank=" + std::to_string(o.node_rank) + " is out of range for --nnodes=" + std::to_string(o.nnodes) +
        " (expected 0 <= node rank < nnodes)");
  }
  if (o.standalone && o.nnodes > 1) {
    bad("--standalone runs one node; it cannot be combined with --nnodes=" + std::to_string(o.nnodes));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    bad("--master-port=" + std::to_string(o.master_port) + " is out of range (expected 1-65535)");
  }
  if (o.nnodes > 1 && o.master_addr.empty()) {
    bad("--nnodes=" + std::to_string(o.nnodes) + " needs --master-addr (the address of node 0, where rank 0 runs)");
  }
  if (o.nnodes > 1 && o.master_port == 0) bad("a multi-node job needs a fixed --master-port, the same on every node");
  if (o.max_restarts < 0) bad("--max-restarts=" + std::to_string(o.max_restarts) + " must be at least 0");
  if (o.grace_period.count() < 0) bad("the grace period must not be negative");
  if (o.settle_period.count() < 0) bad("the settle period must not be negative");
  if (static_cast<long long>(o.nproc_per_node) * o.nnodes > 1'000'000) bad("--nproc-per-node x --nnodes is too large");
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
