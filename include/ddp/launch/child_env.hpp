#pragma once
// Each worker's environment: the launcher's own, less the variables the launcher sets, plus
// torchrun's variables, the store's token, host and job id, and the options' extra variables.

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/launch/options.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddp::detail {

/// One environment per local rank, as NAME=value strings. Built before fork: after it the
/// children only make system calls. `store_hosted`: the launcher serves the job's store.
inline std::vector<std::vector<std::string>> worker_environments(const launch_options& options, const std::string& master_addr,
                                                                int master_port, const std::string& token,
                                                                const std::string& job_id, bool store_hosted) {
  const int nproc = options.nproc_per_node;
  const int world = nproc * options.nnodes;
  std::vector<std::string> names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DDP_STORE_TOKEN", "DDP_JOB_ID",
                                    "DDP_STORE_SERVER"};
  for (const auto& [k, v] : options.env) names.push_back(k);
  const bool set_omp = nproc > 1 && read_env("OMP_NUM_THREADS") == nullptr;
  if (set_omp) names.push_back("OMP_NUM_THREADS");
  std::vector<std::string> inherited;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view key = entry.substr(0, entry.find('='));
    if (std::find(names.begin(), names.end(), key) == names.end()) inherited.emplace_back(entry);
  }
  std::vector<std::vector<std::string>> envs(static_cast<std::size_t>(nproc));
  for (int local = 0; local < nproc; ++local) {
    auto& e = envs[static_cast<std::size_t>(local)];
    e = inherited;
    const int rank = options.node_rank * nproc + local;
    const auto set = [&e](const std::string& k, const std::string& v) { e.push_back(k + "=" + v); };
    set("RANK", std::to_string(rank));
    set("LOCAL_RANK", std::to_string(local));
    set("WORLD_SIZE", std::to_string(world));
    set("LOCAL_WORLD_SIZE", std::to_string(nproc));
    set("GROUP_RANK", std::to_string(options.node_rank));
    set("GROUP_WORLD_SIZE", std::to_string(options.nnodes));
    set("ROLE_RANK", std::to_string(rank));
    set("ROLE_WORLD_SIZE", std::to_string(world));
    set("MASTER_ADDR", master_addr);
    set("MASTER_PORT", std::to_string(master_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(options.restart_count));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts));
    if (!token.empty()) set("DDP_STORE_TOKEN", token);
    if (!job_id.empty()) set("DDP_JOB_ID", job_id);
    if (store_hosted) set("DDP_STORE_SERVER", "launcher");
    if (set_omp) set("OMP_NUM_THREADS", "1");
    for (const auto& [k, v] : options.env) set(k, v);
  }
  return envs;
}

}  // namespace ddp::detail
