#pragma once
// Reading the launch environment: launch_environment::from_environment (which launcher started
// this process, its variables, the cross-checks and the job's identity) and DDP_HEARTBEAT_TIMEOUT.
// The precedence and the variables are documented in ddp/core/env.hpp. Over 400 lines because
// read_environment is one function whose rules share its locals: splitting it is a rewrite.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/env/launch_environment.hpp"
#include "ddp/core/env/parse.hpp"
#include "ddp/core/env_registry.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <algorithm>
#include <initializer_list>
#include <utility>
#endif

namespace ddp {

/// DDP_HEARTBEAT_TIMEOUT (seconds; 0 turns the heartbeat off) or 5 s: a ring backend fails once
/// a peer has sent no heartbeat for this long (backends/ring/transport/heartbeat.hpp). A malformed value
/// is a ddp::error naming the variable.
std::chrono::milliseconds default_heartbeat_timeout();

// Reading the environment is compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::chrono::milliseconds default_heartbeat_timeout() {
  const char* text = read_env_nonempty("DDP_HEARTBEAT_TIMEOUT");
  if (text == nullptr) return std::chrono::seconds(5);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds >= 0) || seconds > 1e9) {
    throw error(errc::config, std::string("DDP_HEARTBEAT_TIMEOUT='") + text +
                                  "' is not a number of seconds >= 0 (e.g. DDP_HEARTBEAT_TIMEOUT=5; 0 turns the heartbeat off)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}

DDP_COMPILED_INLINE launch_environment launch_environment::from_environment(const env_lookup& lookup) {
  return read_environment(lookup, true);
}

DDP_COMPILED_INLINE launch_environment launch_environment::read_environment(const env_lookup& lookup, bool require_master_addr) {
  // Empty values count as unset, like an unset variable in a shell script.
  const auto get = [&lookup](const char* name) -> const char* {
    const char* v = lookup ? lookup(name) : nullptr;
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  // The first of several spellings that is set; {nullptr, ""} when none.
  const auto first = [&get](std::initializer_list<const char*> names) -> std::pair<const char*, std::string> {
    for (const char* n : names)
      if (const char* v = get(n)) return {v, n};
    return {nullptr, ""};
  };
  // Whether two launchers give the same rank (both set) and the same size (where both are set).
  const auto agree = [&get](const char* rank_a, const char* size_a, const char* rank_b, const std::string& size_b) {
    const auto same = [&get](const char* a, const char* b) {
      const char* va = get(a);
      const char* vb = get(b);
      if (va == nullptr || vb == nullptr) return false;
      const auto ia = detail::parse_int64(va), ib = detail::parse_int64(vb);
      return ia && ib && *ia == *ib;
    };
    if (!same(rank_a, rank_b)) return false;
    return get(size_a) == nullptr || size_b.empty() || get(size_b.c_str()) == nullptr || same(size_a, size_b.c_str());
  };

  launch_environment env;
  // Variable names as the chosen source spells them, for the cross-check messages.
  std::string rank_var = "RANK", world_var = "WORLD_SIZE", local_rank_var = "LOCAL_RANK",
              local_world_var = "LOCAL_WORLD_SIZE", node_rank_var = "GROUP_RANK", nodes_var = "GROUP_WORLD_SIZE";
  bool have_local_world = false;  // given, not derived
  bool have_nodes = false;
  bool layout_checked = false;      // the layout is complete and checked (or provisional): no derivation, no product check
  std::vector<int> tasks_per_node;  // Slurm's per-node counts when known
  std::optional<std::string> first_host;
  std::optional<std::pair<std::string, std::string>> borrowed_job;  // {id, origin} of the launcher that agreed

  const auto read = [&](const char* name, int& field, std::string& from, int min_value, std::string_view example) {
    if (const char* v = get(name)) {
      field = detail::env_int(name, v, min_value, example);
      from = name;
      return true;
    }
    return false;
  };
  const auto range_error = [](const std::string& var, int value, const std::string& bound_var, int bound) {
    detail::config_error(var + "=" + std::to_string(value) + " is out of range for " + bound_var + "=" + std::to_string(bound) +
                         " (expected 0 <= " + var + " < " + bound_var + ")");
  };
  const auto require = [&](const char* name, const char* present) {
    detail::config_error(std::string(present) + " is set but " + name + " is not (expected both, e.g. " + present +
                         "=0 " + name + "=2)");
  };
  // No variable says which ranks share a host: provisional values, derived at rendezvous.
  const auto layout_from_rendezvous = [&](bool local_rank_known) {
    env.local_layout_from_rendezvous = true;
    if (!local_rank_known) {
      env.local_rank = 0;
      env.origin.local_rank = std::string(rendezvous_origin);
    }
    env.local_world_size = std::max(env.local_rank + 1, have_nodes ? (env.world_size + env.num_nodes - 1) / env.num_nodes : 1);
    env.origin.local_world_size = std::string(rendezvous_origin);
    if (have_nodes) {
      env.node_rank = std::min(env.rank / env.local_world_size, env.num_nodes - 1);
    } else {
      env.node_rank = env.rank;
      env.num_nodes = env.world_size;
      env.origin.num_nodes = std::string(rendezvous_origin);
    }
    env.origin.node_rank = std::string(rendezvous_origin);
    have_local_world = have_nodes = layout_checked = true;
  };

  // The scheduler whose task this is, if any (5-8 in ddp/core/env.hpp): its source and
  // the spellings of its rank and size.
  struct task_scheduler {
    launch_source source;
    const char* rank;
    std::string size;
  };
  std::optional<task_scheduler> scheduler;
  if (get("FLUX_TASK_RANK") || get("FLUX_JOB_SIZE")) {
    scheduler = task_scheduler{launch_source::flux, "FLUX_TASK_RANK", "FLUX_JOB_SIZE"};
  } else if (get("PALS_RANKID")) {
    scheduler = task_scheduler{launch_source::pals, "PALS_RANKID", "PALS_SIZE"};
  } else if (get("JSM_NAMESPACE_RANK") || get("JSM_NAMESPACE_SIZE")) {
    scheduler = task_scheduler{launch_source::lsf, "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"};
  } else if (get("SLURM_PROCID")) {
    scheduler = task_scheduler{launch_source::slurm, "SLURM_PROCID", first({"SLURM_NTASKS", "SLURM_NPROCS"}).second};
  }
  const bool ompi = get("OMPI_COMM_WORLD_RANK") || get("OMPI_COMM_WORLD_SIZE");
  const bool pmi = get("PMI_RANK") || get("PMI_SIZE");
  const char* const hydra_var = get("MPI_LOCALRANKID") ? "MPI_LOCALRANKID" : get("MPI_LOCALNRANKS") ? "MPI_LOCALNRANKS" : nullptr;

  launch_source chosen = launch_source::none;
  std::string why = "no launcher variables (a world of one)";
  if (get("RANK") || get("WORLD_SIZE")) {
    chosen = launch_source::torchrun;
    why = get("RANK") ? "RANK" : "WORLD_SIZE";
  } else if (ompi && !(scheduler && scheduler->source == launch_source::lsf &&
                       agree("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"))) {
    chosen = launch_source::openmpi;
    why = get("OMPI_COMM_WORLD_RANK") ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE";
    if (scheduler) why += " (mpirun inside a " + std::string(to_string(scheduler->source)) + " job: over " + scheduler->rank + ")";
  } else if (pmi && hydra_var != nullptr) {
    chosen = launch_source::pmi;
    why = std::string("PMI_RANK with ") + hydra_var + " (hydra's mpiexec)";
  } else if (pmi && scheduler && !agree("PMI_RANK", "PMI_SIZE", scheduler->rank, scheduler->size)) {
    chosen = launch_source::pmi;
    why = std::string("PMI_RANK (differs from ") + scheduler->rank + ": a PMI launcher inside the " +
          std::string(to_string(scheduler->source)) + " task)";
  } else if (scheduler) {
    chosen = scheduler->source;
    why = scheduler->rank;
    if (pmi) why += " (PMI_RANK, PMI_SIZE agree: " + std::string(to_string(chosen)) + "'s own PMI)";
    if (ompi) why += " (OMPI_COMM_WORLD_RANK, _SIZE agree: jsrun's own)";
  } else if (pmi) {
    chosen = launch_source::pmi;
    why = get("PMI_RANK") ? "PMI_RANK" : "PMI_SIZE";
  }
  env.source_ = chosen;
  env.origin.source = why;

  switch (chosen) {
    case launch_source::none: break;
    case launch_source::torchrun: {
      if (!read("RANK", env.rank, env.origin.rank, 0, "0")) require("RANK", "WORLD_SIZE");
      if (!read("WORLD_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("WORLD_SIZE", "RANK");
      const bool have_local_rank = read("LOCAL_RANK", env.local_rank, env.origin.local_rank, 0, "0");
      have_local_world = read("LOCAL_WORLD_SIZE", env.local_world_size, env.origin.local_world_size, 1, "2");
      const bool have_node_rank = read("GROUP_RANK", env.node_rank, env.origin.node_rank, 0, "0");
      have_nodes = read("GROUP_WORLD_SIZE", env.num_nodes, env.origin.num_nodes, 1, "1");
      if (have_local_rank || have_local_world || have_node_rank || have_nodes) break;

      // Only RANK and WORLD_SIZE: where is the local layout? (a-d in ddp/core/env.hpp)
      const char* pet_nproc = get("PET_NPROC_PER_NODE");
      const char* pet_nnodes = get("PET_NNODES");
      const char* pet_node_rank = get("PET_NODE_RANK");
      if (pet_nproc != nullptr || pet_nnodes != nullptr || pet_node_rank != nullptr) {
        std::optional<int> nproc, nnodes;
        if (pet_nproc != nullptr) {
          const std::string_view v = pet_nproc;
          if (detail::parse_int64(v)) {
            nproc = detail::env_int("PET_NPROC_PER_NODE", pet_nproc, 1, "1");
          } else if (v != "auto" && v != "gpu" && v != "cpu" && v != "xpu") {
            detail::config_error(std::string("PET_NPROC_PER_NODE='") + pet_nproc +
                                 "' is not a process count (expected a positive integer, auto, gpu, cpu or xpu, e.g. "
                                 "PET_NPROC_PER_NODE=1)");
          }
        }
        if (pet_nnodes != nullptr) {
          const std::string_view v = pet_nnodes;
          const auto colon = v.find(':');
          if (detail::parse_int64(v)) {
            nnodes = detail::env_int("PET_NNODES", pet_nnodes, 1, "2");
          } else if (colon == std::string_view::npos || !detail::all_digits(v.substr(0, colon)) ||
                     !detail::all_digits(v.substr(colon + 1))) {
            detail::config_error(std::string("PET_NNODES='") + pet_nnodes +
                                 "' is not a node count (expected a positive integer or an elastic range MIN:MAX, e.g. "
                                 "PET_NNODES=2 or PET_NNODES=1:4)");
          }  // else elastic: torchrun picks the node count
        }
        if (nproc && *nproc > 1) {
          detail::config_error("PET_NPROC_PER_NODE=" + std::to_string(*nproc) +
                               " asks for that many processes per pod but LOCAL_RANK is not set (expected the pod to "
                               "start torchrun or ddprun, which start them and set LOCAL_RANK; or PET_NPROC_PER_NODE=1)");
        }
        if (nproc || (nnodes && *nnodes == env.world_size)) {
          const std::string one = nproc ? "derived (PET_NPROC_PER_NODE=1)"
                                        : "derived (WORLD_SIZE == PET_NNODES: one process per pod)";
          env.local_rank = 0;
          env.origin.local_rank = one;
          env.local_world_size = 1;
          env.origin.local_world_size = nproc ? "PET_NPROC_PER_NODE" : one;
          local_world_var = "PET_NPROC_PER_NODE";
          have_local_world = true;
          if (nnodes) {
            env.num_nodes = *nnodes;
            env.origin.num_nodes = nodes_var = "PET_NNODES";
            have_nodes = true;
          }
          if (pet_node_rank != nullptr) {
            env.node_rank = detail::env_int("PET_NODE_RANK", pet_node_rank, 0, "0");
            env.origin.node_rank = node_rank_var = "PET_NODE_RANK";
          }
          break;
        }
      } else {
        // A launcher's variables with the same rank and size: the script exported them from it.
        std::optional<launch_environment> inner;
        try {
          inner = read_environment(
              [&lookup](const char* name) -> const char* {
                const std::string_view n = name;
                return n == "RANK" || n == "WORLD_SIZE" || n == "DDP_JOB_ID" || !lookup ? nullptr : lookup(name);
              },
              false);
        } catch (const error&) {
          inner.reset();  // a launcher whose variables do not parse does not describe this process
        }
        if (inner && inner->source() != launch_source::none && inner->rank == env.rank && inner->world_size == env.world_size) {
          env.local_rank = inner->local_rank;
          env.local_world_size = inner->local_world_size;
          env.node_rank = inner->node_rank;
          env.num_nodes = inner->num_nodes;
          env.local_layout_from_rendezvous = inner->local_layout_from_rendezvous;
          env.origin.local_rank = inner->origin.local_rank;
          env.origin.local_world_size = inner->origin.local_world_size;
          env.origin.node_rank = inner->origin.node_rank;
          env.origin.num_nodes = inner->origin.num_nodes;
          env.origin.source += ", WORLD_SIZE (the same as " + inner->origin.rank + ", " + inner->origin.world_size +
                               ": local layout from " + std::string(to_string(inner->source())) + ")";
          local_rank_var = inner->origin.local_rank, local_world_var = inner->origin.local_world_size;
          node_rank_var = inner->origin.node_rank, nodes_var = inner->origin.num_nodes;
          if (inner->origin.master_addr.rfind("derived", 0) == 0) {
            first_host = inner->master_addr;
            env.master_addr = inner->master_addr;
            env.origin.master_addr = inner->origin.master_addr;
          }
          if (!inner->job_id.empty()) borrowed_job = {inner->job_id, inner->origin.job_id};
          have_local_world = have_nodes = layout_checked = true;
          break;
        }
      }
      if (const char* addr = first({"MASTER_ADDR", "PET_MASTER_ADDR"}).first; addr != nullptr && !detail::is_loopback(addr)) {
        layout_from_rendezvous(false);
      } else if (!have_local_world) {
        // One node.
        env.local_rank = env.rank;
        env.origin.local_rank = "derived (RANK, single node)";
      }
      break;
    }
    case launch_source::openmpi:
      rank_var = "OMPI_COMM_WORLD_RANK", world_var = "OMPI_COMM_WORLD_SIZE";
      local_rank_var = "OMPI_COMM_WORLD_LOCAL_RANK", local_world_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
      if (!read("OMPI_COMM_WORLD_RANK", env.rank, env.origin.rank, 0, "0")) require("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
      if (!read("OMPI_COMM_WORLD_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK");
      read("OMPI_COMM_WORLD_LOCAL_RANK", env.local_rank, env.origin.local_rank, 0, "0");
      have_local_world = read("OMPI_COMM_WORLD_LOCAL_SIZE", env.local_world_size, env.origin.local_world_size, 1, "2");
      break;
    case launch_source::pmi:
      rank_var = "PMI_RANK", world_var = "PMI_SIZE", local_rank_var = "MPI_LOCALRANKID", local_world_var = "MPI_LOCALNRANKS";
      if (!read("PMI_RANK", env.rank, env.origin.rank, 0, "0")) require("PMI_RANK", "PMI_SIZE");
      if (!read("PMI_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("PMI_SIZE", "PMI_RANK");
      read("MPI_LOCALRANKID", env.local_rank, env.origin.local_rank, 0, "0");
      have_local_world = read("MPI_LOCALNRANKS", env.local_world_size, env.origin.local_world_size, 1, "2");
      break;
    case launch_source::flux:
      rank_var = "FLUX_TASK_RANK", world_var = "FLUX_JOB_SIZE", local_rank_var = "FLUX_TASK_LOCAL_ID";
      local_world_var = "FLUX_JOB_SIZE / FLUX_JOB_NNODES", nodes_var = "FLUX_JOB_NNODES", node_rank_var = "node rank";
      if (!read("FLUX_TASK_RANK", env.rank, env.origin.rank, 0, "0")) require("FLUX_TASK_RANK", "FLUX_JOB_SIZE");
      if (!read("FLUX_JOB_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("FLUX_JOB_SIZE", "FLUX_TASK_RANK");
      read("FLUX_TASK_LOCAL_ID", env.local_rank, env.origin.local_rank, 0, "0");
      if (env.local_rank >= env.world_size) range_error("FLUX_TASK_LOCAL_ID", env.local_rank, "FLUX_JOB_SIZE", env.world_size);
      have_nodes = read("FLUX_JOB_NNODES", env.num_nodes, env.origin.num_nodes, 1, "1");
      if (have_nodes && env.num_nodes > 1) {
        // Flux sets no per-node count: an even split, or the rendezvous's count.
        if (env.world_size % env.num_nodes != 0) {
          layout_from_rendezvous(true);
        } else {
          env.local_world_size = env.world_size / env.num_nodes;
          env.origin.local_world_size = "derived (FLUX_JOB_SIZE / FLUX_JOB_NNODES)";
          have_local_world = true;
          env.node_rank = env.rank / env.local_world_size;
          env.origin.node_rank = "derived (FLUX_TASK_RANK / tasks per node, block task map)";
        }
      }
      break;
    case launch_source::pals: {
      rank_var = "PALS_RANKID", node_rank_var = "PALS_NODEID";
      if (!read("PALS_RANKID", env.rank, env.origin.rank, 0, "0")) require("PALS_RANKID", "PMI_SIZE");
      const auto [size, size_name] = first({"PMI_SIZE", "PALS_SIZE"});
      if (size == nullptr) require("PMI_SIZE", "PALS_RANKID");
      world_var = size_name;
      read(size_name.c_str(), env.world_size, env.origin.world_size, 1, "2");
      if (const auto [lr, lr_name] = first({"PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"}); lr != nullptr) {
        local_rank_var = lr_name;
        read(lr_name.c_str(), env.local_rank, env.origin.local_rank, 0, "0");
      } else {
        local_rank_var = "PALS_LOCAL_RANKID";
      }
      if (const auto [ls, ls_name] = first({"PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE"}); ls != nullptr) {
        local_world_var = ls_name;
        have_local_world = read(ls_name.c_str(), env.local_world_size, env.origin.local_world_size, 1, "2");
      } else {
        local_world_var = "PMI_LOCAL_SIZE";
      }
      read("PALS_NODEID", env.node_rank, env.origin.node_rank, 0, "0");
      break;
    }
    case launch_source::lsf:
      rank_var = "JSM_NAMESPACE_RANK", world_var = "JSM_NAMESPACE_SIZE";
      local_rank_var = "JSM_NAMESPACE_LOCAL_RANK", local_world_var = "JSM_NAMESPACE_LOCAL_SIZE";
      if (!read("JSM_NAMESPACE_RANK", env.rank, env.origin.rank, 0, "0")) require("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE");
      if (!read("JSM_NAMESPACE_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK");
      read("JSM_NAMESPACE_LOCAL_RANK", env.local_rank, env.origin.local_rank, 0, "0");
      have_local_world = read("JSM_NAMESPACE_LOCAL_SIZE", env.local_world_size, env.origin.local_world_size, 1, "2");
      break;
    case launch_source::slurm: {
      rank_var = "SLURM_PROCID", local_rank_var = "SLURM_LOCALID", node_rank_var = "SLURM_NODEID";
      read("SLURM_PROCID", env.rank, env.origin.rank, 0, "0");
      const auto [ntasks, ntasks_name] = first({"SLURM_NTASKS", "SLURM_NPROCS"});
      if (ntasks == nullptr) require("SLURM_NTASKS", "SLURM_PROCID");
      world_var = ntasks_name;
      read(ntasks_name.c_str(), env.world_size, env.origin.world_size, 1, "2");
      read("SLURM_LOCALID", env.local_rank, env.origin.local_rank, 0, "0");
      read("SLURM_NODEID", env.node_rank, env.origin.node_rank, 0, "0");
      if (const auto [nodes, nodes_name] = first({"SLURM_NNODES", "SLURM_JOB_NUM_NODES"}); nodes != nullptr) {
        nodes_var = nodes_name;
        have_nodes = read(nodes_name.c_str(), env.num_nodes, env.origin.num_nodes, 1, "1");
      }
      if (const auto [tpn, tpn_name] = first({"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
          tpn != nullptr) {
        tasks_per_node = detail::expand_tasks_per_node(tpn_name, tpn);
        local_world_var = tpn_name;
        // SLURM_NTASKS_PER_NODE is one number for every node; the others list each node.
        if (tpn_name == "SLURM_NTASKS_PER_NODE") {
          if (tasks_per_node.size() != 1) detail::config_error(tpn_name + "='" + tpn + "' is not one count (expected e.g. SLURM_NTASKS_PER_NODE=2)");
          tasks_per_node.assign(static_cast<std::size_t>(env.num_nodes), tasks_per_node.front());
        }
        if (have_nodes && tasks_per_node.size() != static_cast<std::size_t>(env.num_nodes)) {
          detail::config_error(tpn_name + "='" + tpn + "' lists " + std::to_string(tasks_per_node.size()) + " nodes but " +
                               nodes_var + "=" + std::to_string(env.num_nodes) + " (expected one count per node)");
        }
        if (env.node_rank >= static_cast<int>(tasks_per_node.size())) {
          detail::config_error("SLURM_NODEID=" + std::to_string(env.node_rank) + " is out of range for " + tpn_name + "='" + tpn +
                               "' (expected 0 <= SLURM_NODEID < number of nodes)");
        }
        env.local_world_size = tasks_per_node[static_cast<std::size_t>(env.node_rank)];
        env.origin.local_world_size = tpn_name;
        have_local_world = true;
        if (!have_nodes) {
          env.num_nodes = static_cast<int>(tasks_per_node.size());
          env.origin.num_nodes = "derived (" + tpn_name + ")";
        }
      }
      if (const auto [list, list_name] = first({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}); list != nullptr) {
        try {
          first_host = expand_nodelist(list).front();
        } catch (const error& e) {
          detail::config_error(list_name + ": " + e.message());
        }
        env.master_addr = *first_host;
        env.origin.master_addr = "derived (first host of " + list_name + ")";
      }
      break;
    }
  }

  // Values the source did not give: a single node unless the node count says otherwise.
  if (env.source_ != launch_source::none && !layout_checked) {
    if (!have_local_world) {
      if (have_nodes && env.num_nodes > 1) {
        if (env.world_size % env.num_nodes != 0) {
          detail::config_error(world_var + "=" + std::to_string(env.world_size) + " is not divisible by " + nodes_var + "=" +
                               std::to_string(env.num_nodes) + " and " + local_world_var + " is not set (expected " +
                               local_world_var + ")");
        }
        env.local_world_size = env.world_size / env.num_nodes;
        env.origin.local_world_size = "derived (" + world_var + " / " + nodes_var + ")";
      } else {
        env.local_world_size = env.world_size;
        env.origin.local_world_size = "derived (" + world_var + ", single node)";
      }
    }
    if (!have_nodes) {
      if (have_local_world && env.local_world_size > 0 && env.world_size > env.local_world_size) {
        env.num_nodes = (env.world_size + env.local_world_size - 1) / env.local_world_size;
        env.origin.num_nodes = "derived (" + world_var + " / " + local_world_var + ")";
      } else if (env.origin.num_nodes == "default") {
        env.origin.num_nodes = "derived (single node)";
      }
    }
    if (env.origin.node_rank == "default" && env.num_nodes > 1 && env.local_world_size > 0) {
      env.node_rank = env.rank / env.local_world_size;
      env.origin.node_rank = "derived (" + rank_var + " / " + local_world_var + ")";
    }
  }

  // Cross-checks, in the source's own spelling.
  if (env.rank >= env.world_size) range_error(rank_var, env.rank, world_var, env.world_size);
  if (env.local_rank >= env.local_world_size) range_error(local_rank_var, env.local_rank, local_world_var, env.local_world_size);
  if (env.local_world_size > env.world_size) {
    detail::config_error(local_world_var + "=" + std::to_string(env.local_world_size) + " is larger than " + world_var + "=" +
                         std::to_string(env.world_size) + " (expected " + local_world_var + " <= " + world_var + ")");
  }
  if (env.node_rank >= env.num_nodes) range_error(node_rank_var, env.node_rank, nodes_var, env.num_nodes);
  if (!tasks_per_node.empty()) {
    long long total = 0;
    for (int t : tasks_per_node) total += t;
    if (total != env.world_size) {
      detail::config_error(local_world_var + " adds up to " + std::to_string(total) + " tasks but " + world_var + "=" +
                           std::to_string(env.world_size) + " (expected the per-node counts to sum to " + world_var + ")");
    }
  } else if (have_local_world && have_nodes && !layout_checked &&
             static_cast<long long>(env.local_world_size) * env.num_nodes != env.world_size) {
    detail::config_error(local_world_var + "=" + std::to_string(env.local_world_size) + " x " + nodes_var + "=" +
                         std::to_string(env.num_nodes) + " != " + world_var + "=" + std::to_string(env.world_size) +
                         " (expected " + local_world_var + " x " + nodes_var + " == " + world_var + ")");
  }

  // The job's identity: DDP_JOB_ID, else the launcher's own.
  if (const char* id = get("DDP_JOB_ID")) {
    const std::string_view v = id;
    if (v.size() > 200) detail::config_error("DDP_JOB_ID is " + std::to_string(v.size()) + " characters long (expected at most 200, e.g. DDP_JOB_ID=ddprun:1a2b3c)");
    for (const char c : v) {
      if (static_cast<unsigned char>(c) <= ' ' || c == '\x7f') {
        detail::config_error(std::string("DDP_JOB_ID='") + id + "' contains a space or control character (expected one word, e.g. DDP_JOB_ID=ddprun:1a2b3c)");
      }
    }
    env.job_id = id;
    env.origin.job_id = "DDP_JOB_ID";
  } else if (borrowed_job) {
    env.job_id = borrowed_job->first;
    env.origin.job_id = borrowed_job->second;
  } else {
    const std::string prefix = std::string(to_string(env.source_)) + ":";
    const auto own = [&](std::initializer_list<const char*> names) {
      if (const auto [v, name] = first(names); v != nullptr) {
        env.job_id = prefix + v;
        env.origin.job_id = name;
      }
    };
    switch (env.source_) {
      case launch_source::none:
      case launch_source::pmi: break;  // hydra and PMI-1 name no job
      case launch_source::torchrun:
        // torchrun's static rendezvous has the run id "none" unless --rdzv-id is given.
        if (const char* v = get("TORCHELASTIC_RUN_ID"); v != nullptr && std::string_view(v) != "none") own({"TORCHELASTIC_RUN_ID"});
        break;
      case launch_source::openmpi: own({"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"}); break;
      case launch_source::flux: own({"FLUX_JOB_ID"}); break;
      case launch_source::pals: own({"PALS_APID"}); break;
      case launch_source::lsf:
        own({"LSB_JOBID"});
        if (const char* index = get("LSB_JOBINDEX"); index != nullptr && !env.job_id.empty() && std::string_view(index) != "0") {
          env.job_id += std::string("[") + index + "]";
          env.origin.job_id += ", LSB_JOBINDEX";
        }
        break;
      case launch_source::slurm:
        own({"SLURM_JOB_ID", "SLURM_JOBID"});
        if (const auto [step, step_name] = first({"SLURM_STEP_ID", "SLURM_STEPID"}); step != nullptr && !env.job_id.empty()) {
          env.job_id += std::string(".") + step;
          env.origin.job_id += ", " + step_name;
        }
        break;
    }
  }

  if (const auto [addr, addr_name] = first({"MASTER_ADDR", "PET_MASTER_ADDR"}); addr != nullptr) {
    env.master_addr = addr;
    env.origin.master_addr = addr_name;
  } else if (require_master_addr && env.multi_node() && !first_host) {
    detail::config_error("the job spans " + std::to_string(env.num_nodes) + " nodes (" + world_var + "=" +
                         std::to_string(env.world_size) + ", " + local_world_var + "=" + std::to_string(env.local_world_size) +
                         ") but MASTER_ADDR is not set (expected MASTER_ADDR=<address of the node of rank 0>)");
  }
  if (const auto [port, port_name] = first({"MASTER_PORT", "PET_MASTER_PORT"}); port != nullptr) {
    env.master_port = detail::parse_port(port_name, port);
    env.origin.master_port = port_name;
  } else if (env.source_ != launch_source::none && !env.job_id.empty()) {
    env.master_port = detail::port_from_job_id(env.job_id);
    env.master_port_alternates = detail::derived_port_alternates(env.master_port);
    env.origin.master_port = "derived (" + env.origin.job_id + ")";
  }
  if (const char* t = get("DDP_TIMEOUT")) {
    env.timeout = detail::parse_timeout(t);
    env.origin.timeout = "DDP_TIMEOUT";
  }
  if (const char* server = get("DDP_STORE_SERVER")) {
    const std::string_view v = server;
    if (v != "launcher" && v != "rank0") detail::config_error("DDP_STORE_SERVER='" + std::string(v) + "' is not 'launcher' or 'rank0'");
    env.store_served_by_launcher = v == "launcher";
    env.origin.store = "DDP_STORE_SERVER";
  }
  if (env.source_ == launch_source::torchrun) {
    if (const char* agent = get("TORCHELASTIC_USE_AGENT_STORE")) {
      const std::string_view v = agent;
      if (v != "True" && v != "False" && v != "true" && v != "false" && v != "1" && v != "0") {
        detail::config_error("TORCHELASTIC_USE_AGENT_STORE='" + std::string(v) + "' is not a boolean (expected True or False, as torchrun sets it)");
      }
      env.use_agent_store = v == "True" || v == "true" || v == "1";
      env.origin.store = "TORCHELASTIC_USE_AGENT_STORE";
    }
    if (const char* count = get("TORCHELASTIC_RESTART_COUNT")) {
      env.restart_count = detail::env_int("TORCHELASTIC_RESTART_COUNT", count, 0, "0");
      if (env.use_agent_store) env.origin.store += ", TORCHELASTIC_RESTART_COUNT";
    }
  }
  return env;
}

#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
