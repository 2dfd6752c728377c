#pragma once
// ddp::launch_environment: this process's place in the job, read from the launcher's variables.
//
// Sources, in order of precedence (the first one present wins, the others are not read):
//   1. torchrun / ddprun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE
//                          (present when RANK or WORLD_SIZE is set)
//   2. Open MPI (mpirun)   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   3. PMI (MPICH, Intel MPI, hydra)   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   4. Slurm (srun)        SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID,
//                          SLURM_NTASKS_PER_NODE | SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE ("2(x3),1"),
//                          SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_NODEID,
//                          SLURM_STEP_NODELIST | SLURM_JOB_NODELIST | SLURM_NODELIST (master = first host)
//   5. none                a world of one: rank 0 of 1, master 127.0.0.1:29500
// Why this order: a launcher started inside a Slurm allocation (torchrun, mpirun) sees the
// allocation's SLURM_* variables, which describe the launcher's step, not the worker; the
// variables the launcher sets for its workers are the more specific ones.
//
// MASTER_ADDR and MASTER_PORT override the address of every source. Without MASTER_ADDR a
// single-node job uses 127.0.0.1 and a Slurm job the first host of its node list; a multi-node
// job from any other source is an error. DDP_TIMEOUT (seconds) sets the default deadline.
// Empty variables count as unset. Every bad value is a ddp::error(errc::config) whose message
// names the variable and the expected form; from_environment() also cross-checks the values
// (rank < world size, local rank < local world size, local world size x nodes == world size).
//
// The lookup is injectable so that tests (and tools) can describe an environment as a table
// without touching the real one.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

/// Which launcher's variables a launch_environment came from.
enum class launch_source : std::uint8_t { none, torchrun, openmpi, pmi, slurm };

constexpr std::string_view to_string(launch_source s) noexcept {
  switch (s) {
    case launch_source::none: return "none";
    case launch_source::torchrun: return "torchrun";
    case launch_source::openmpi: return "openmpi";
    case launch_source::pmi: return "pmi";
    case launch_source::slurm: return "slurm";
  }
  return "unknown";
}

/// Reads one variable; nullptr when unset. ::getenv by default.
using env_lookup = std::function<const char*(const char*)>;

namespace detail {

[[noreturn]] inline void config_error(std::string message) { throw error(errc::config, std::move(message)); }

inline bool all_digits(std::string_view s) noexcept {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

/// Parses a decimal integer (optional leading '-'); nullopt when malformed or beyond int64.
inline std::optional<std::int64_t> parse_int64(std::string_view s) noexcept {
  const bool negative = !s.empty() && s.front() == '-';
  if (negative) s.remove_prefix(1);
  if (!all_digits(s) || s.size() > 18) return std::nullopt;
  std::int64_t v = 0;
  for (char c : s) v = v * 10 + (c - '0');
  return negative ? -v : v;
}

/// The variable `name`, which must hold an integer >= `min_value`; `example` is a valid value.
inline int env_int(std::string_view name, const char* text, int min_value, std::string_view example) {
  const std::string expected = std::string(min_value > 0 ? "a positive integer" : "a non-negative integer") +
                               ", e.g. " + std::string(name) + "=" + std::string(example);
  const auto v = parse_int64(text);
  if (!v) config_error(std::string(name) + "='" + text + "' is not an integer (expected " + expected + ")");
  if (*v < min_value) {
    config_error(std::string(name) + "=" + text + " is " + (*v == 0 ? "zero" : "negative") + " (expected " + expected + ")");
  }
  if (*v > 1'000'000'000) config_error(std::string(name) + "=" + text + " is too large (expected " + expected + ")");
  return static_cast<int>(*v);
}

inline int parse_port(std::string_view name, const char* text) {
  const auto v = parse_int64(text);
  if (!v) config_error(std::string(name) + "='" + text + "' is not a port number (expected an integer 1-65535, e.g. " + std::string(name) + "=29500)");
  if (*v < 1 || *v > 65535) config_error(std::string(name) + "=" + text + " is out of range (expected 1-65535)");
  return static_cast<int>(*v);
}

/// Slurm's tasks-per-node syntax, "2(x3),1" -> {2, 2, 2, 1}.
inline std::vector<int> expand_tasks_per_node(std::string_view name, std::string_view text) {
  const auto bad = [&](std::string_view why) -> std::vector<int> {
    config_error(std::string(name) + "='" + std::string(text) + "' " + std::string(why) +
                 " (expected counts like '4' or '2(x3),1')");
  };
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    std::string_view item = text.substr(pos, comma - pos);
    std::string_view count = item;
    std::int64_t repeat = 1;
    if (const auto paren = item.find('('); paren != std::string_view::npos) {
      count = item.substr(0, paren);
      std::string_view rest = item.substr(paren + 1);
      if (rest.size() < 3 || rest.front() != 'x' || rest.back() != ')') return bad("is malformed");
      const auto r = parse_int64(rest.substr(1, rest.size() - 2));
      if (!r || *r < 1 || *r > 1'000'000) return bad("has a bad repeat count");
      repeat = *r;
    }
    const auto c = parse_int64(count);
    if (!c || *c < 1 || *c > 1'000'000) return bad("is malformed");
    if (out.size() + static_cast<std::size_t>(repeat) > 1'000'000) return bad("names too many nodes");
    out.insert(out.end(), static_cast<std::size_t>(repeat), static_cast<int>(*c));
    pos = comma + 1;
  }
  return out;
}

}  // namespace detail

/// Expands a Slurm host list: "node[01-03,7],gpu5" -> node01 node02 node03 node7 gpu5.
/// Zero padding follows the lower bound ("[08-10]" -> 08 09 10); several bracket groups in one
/// name give every combination ("a[1-2]-b[3,5]" -> a1-b3 a1-b5 a2-b3 a2-b5). Malformed lists
/// (unbalanced or nested brackets, empty names or ranges, a range that runs backwards) are a
/// ddp::error(errc::config) quoting the list.
inline std::vector<std::string> expand_nodelist(std::string_view list) {
  constexpr std::size_t max_hosts = 1'000'000;
  const auto bad = [&](std::string_view why) -> std::vector<std::string> {
    detail::config_error("node list '" + std::string(list) + "' " + std::string(why) +
                         " (expected host names and bracket ranges, e.g. node[01-03,7],gpu5)");
  };
  std::vector<std::string> hosts;
  std::size_t pos = 0;
  if (list.empty()) return bad("is empty");
  while (pos <= list.size()) {
    // One host expression runs to the next comma outside brackets.
    std::size_t end = pos;
    int depth = 0;
    while (end < list.size() && (depth > 0 || list[end] != ',')) {
      if (list[end] == '[') {
        if (++depth > 1) return bad("has nested brackets");
      } else if (list[end] == ']') {
        if (--depth < 0) return bad("has a ']' without '['");
      }
      ++end;
    }
    if (depth != 0) return bad("has a '[' without ']'");
    const std::string_view expr = list.substr(pos, end - pos);
    if (expr.empty()) return bad("has an empty host name");

    std::vector<std::string> names{""};  // partial expansions of expr so far
    std::size_t i = 0;
    while (i < expr.size()) {
      if (expr[i] != '[') {
        const std::size_t next = std::min(expr.find('[', i), expr.size());
        for (auto& n : names) n.append(expr.substr(i, next - i));
        i = next;
        continue;
      }
      const std::size_t close = expr.find(']', i);
      const std::string_view ranges = expr.substr(i + 1, close - i - 1);
      if (ranges.empty()) return bad("has an empty range '[]'");
      std::vector<std::string> suffixes;
      std::size_t r = 0;
      while (r <= ranges.size()) {
        const std::size_t comma = std::min(ranges.find(',', r), ranges.size());
        const std::string_view range = ranges.substr(r, comma - r);
        const std::size_t dash = range.find('-');
        const std::string_view lo = range.substr(0, dash);
        const std::string_view hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
        if (!detail::all_digits(lo) || !detail::all_digits(hi) || lo.size() > 18 || hi.size() > 18) {
          return bad("has a bad range '" + std::string(range) + "'");
        }
        const std::int64_t a = *detail::parse_int64(lo);
        const std::int64_t b = *detail::parse_int64(hi);
        if (b < a) return bad("has a range that runs backwards '" + std::string(range) + "'");
        if (static_cast<std::uint64_t>(b - a) >= max_hosts || suffixes.size() + static_cast<std::size_t>(b - a) >= max_hosts) {
          return bad("names too many hosts");
        }
        for (std::int64_t v = a; v <= b; ++v) {
          std::string digits = std::to_string(v);
          if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');
          suffixes.push_back(std::move(digits));
        }
        r = comma + 1;
      }
      if (names.size() * suffixes.size() + hosts.size() > max_hosts) return bad("names too many hosts");
      std::vector<std::string> product;
      product.reserve(names.size() * suffixes.size());
      for (const auto& n : names)
        for (const auto& s : suffixes) product.push_back(n + s);
      names = std::move(product);
      i = close + 1;
    }
    for (auto& n : names) hosts.push_back(std::move(n));
    pos = end + 1;
  }
  return hosts;
}

/// Where each value of a launch_environment came from: a variable name, "default", or
/// "derived (...)".
struct launch_origins {
  std::string rank = "default";
  std::string world_size = "default";
  std::string local_rank = "default";
  std::string local_world_size = "default";
  std::string node_rank = "default";
  std::string num_nodes = "default";
  std::string master_addr = "default";
  std::string master_port = "default";
  std::string timeout = "default";
};

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
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  launch_origins origin;

  launch_source source() const noexcept { return source_; }
  bool multi_node() const noexcept { return num_nodes > 1 || world_size > local_world_size; }

  /// Reads and checks the environment (see the precedence at the top of this header).
  static launch_environment from_environment(const env_lookup& lookup = ::getenv);

  /// A table of value <- origin, one line each, e.g. "  rank              1   <- RANK".
  std::string describe() const {
    std::string out = "launch environment (source: " + std::string(to_string(source_)) + ")\n";
    const auto row = [&out](std::string_view name, const std::string& value, const std::string& from) {
      std::string line = "  " + std::string(name);
      line.resize(20, ' ');
      line += value;
      if (line.size() < 40) line.resize(40, ' ');
      out += line + " <- " + from + "\n";
    };
    row("rank", std::to_string(rank), origin.rank);
    row("world_size", std::to_string(world_size), origin.world_size);
    row("local_rank", std::to_string(local_rank), origin.local_rank);
    row("local_world_size", std::to_string(local_world_size), origin.local_world_size);
    row("node_rank", std::to_string(node_rank), origin.node_rank);
    row("num_nodes", std::to_string(num_nodes), origin.num_nodes);
    row("master_addr", master_addr, origin.master_addr);
    row("master_port", std::to_string(master_port), origin.master_port);
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g s", static_cast<double>(timeout.count()) / 1000.0);
    row("timeout", seconds, origin.timeout);
    return out;
  }

 private:
  launch_source source_ = launch_source::none;
};

inline launch_environment launch_environment::from_environment(const env_lookup& lookup) {
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

  launch_environment env;
  // Variable names as the chosen source spells them, for the cross-check messages.
  std::string rank_var = "RANK", world_var = "WORLD_SIZE", local_rank_var = "LOCAL_RANK",
              local_world_var = "LOCAL_WORLD_SIZE", node_rank_var = "GROUP_RANK", nodes_var = "GROUP_WORLD_SIZE";
  bool have_local_world = false;  // given, not derived
  bool have_nodes = false;
  std::vector<int> tasks_per_node;  // Slurm's per-node counts when known
  std::optional<std::string> first_host;

  const auto read = [&](const char* name, int& field, std::string& from, int min_value, std::string_view example) {
    if (const char* v = get(name)) {
      field = detail::env_int(name, v, min_value, example);
      from = name;
      return true;
    }
    return false;
  };
  const auto require = [&](const char* name, const char* present) {
    detail::config_error(std::string(present) + " is set but " + name + " is not (expected both, e.g. " + present +
                         "=0 " + name + "=2)");
  };

  if (get("RANK") || get("WORLD_SIZE")) {
    env.source_ = launch_source::torchrun;
    if (!read("RANK", env.rank, env.origin.rank, 0, "0")) require("RANK", "WORLD_SIZE");
    if (!read("WORLD_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("WORLD_SIZE", "RANK");
    read("LOCAL_RANK", env.local_rank, env.origin.local_rank, 0, "0");
    have_local_world = read("LOCAL_WORLD_SIZE", env.local_world_size, env.origin.local_world_size, 1, "2");
    read("GROUP_RANK", env.node_rank, env.origin.node_rank, 0, "0");
    have_nodes = read("GROUP_WORLD_SIZE", env.num_nodes, env.origin.num_nodes, 1, "1");
    if (!get("LOCAL_RANK") && !have_local_world && !have_nodes) {
      // Only RANK/WORLD_SIZE: one node.
      env.local_rank = env.rank;
      env.origin.local_rank = "derived (RANK, single node)";
    }
  } else if (get("OMPI_COMM_WORLD_RANK") || get("OMPI_COMM_WORLD_SIZE")) {
    env.source_ = launch_source::openmpi;
    rank_var = "OMPI_COMM_WORLD_RANK", world_var = "OMPI_COMM_WORLD_SIZE";
    local_rank_var = "OMPI_COMM_WORLD_LOCAL_RANK", local_world_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
    if (!read("OMPI_COMM_WORLD_RANK", env.rank, env.origin.rank, 0, "0")) require("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    if (!read("OMPI_COMM_WORLD_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK");
    read("OMPI_COMM_WORLD_LOCAL_RANK", env.local_rank, env.origin.local_rank, 0, "0");
    have_local_world = read("OMPI_COMM_WORLD_LOCAL_SIZE", env.local_world_size, env.origin.local_world_size, 1, "2");
  } else if (get("PMI_RANK") || get("PMI_SIZE")) {
    env.source_ = launch_source::pmi;
    rank_var = "PMI_RANK", world_var = "PMI_SIZE", local_rank_var = "MPI_LOCALRANKID", local_world_var = "MPI_LOCALNRANKS";
    if (!read("PMI_RANK", env.rank, env.origin.rank, 0, "0")) require("PMI_RANK", "PMI_SIZE");
    if (!read("PMI_SIZE", env.world_size, env.origin.world_size, 1, "2")) require("PMI_SIZE", "PMI_RANK");
    read("MPI_LOCALRANKID", env.local_rank, env.origin.local_rank, 0, "0");
    have_local_world = read("MPI_LOCALNRANKS", env.local_world_size, env.origin.local_world_size, 1, "2");
  } else if (get("SLURM_PROCID")) {
    env.source_ = launch_source::slurm;
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
  }

  // Values the source did not give: a single node unless the node count says otherwise.
  if (env.source_ != launch_source::none) {
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
  const auto range_error = [](const std::string& var, int value, const std::string& bound_var, int bound) {
    detail::config_error(var + "=" + std::to_string(value) + " is out of range for " + bound_var + "=" + std::to_string(bound) +
                         " (expected 0 <= " + var + " < " + bound_var + ")");
  };
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
  } else if (have_local_world && have_nodes &&
             static_cast<long long>(env.local_world_size) * env.num_nodes != env.world_size) {
    detail::config_error(local_world_var + "=" + std::to_string(env.local_world_size) + " x " + nodes_var + "=" +
                         std::to_string(env.num_nodes) + " != " + world_var + "=" + std::to_string(env.world_size) +
                         " (expected " + local_world_var + " x " + nodes_var + " == " + world_var + ")");
  }

  if (const char* addr = get("MASTER_ADDR")) {
    env.master_addr = addr;
    env.origin.master_addr = "MASTER_ADDR";
  } else if (env.multi_node() && !first_host) {
    detail::config_error("the job spans " + std::to_string(env.num_nodes) + " nodes (" + world_var + "=" +
                         std::to_string(env.world_size) + ", " + local_world_var + "=" + std::to_string(env.local_world_size) +
                         ") but MASTER_ADDR is not set (expected MASTER_ADDR=<address of the node of rank 0>)");
  }
  if (const char* port = get("MASTER_PORT")) {
    env.master_port = detail::parse_port("MASTER_PORT", port);
    env.origin.master_port = "MASTER_PORT";
  }
  if (const char* t = get("DDP_TIMEOUT")) {
    env.timeout = detail::parse_timeout(t);
    env.origin.timeout = "DDP_TIMEOUT";
  }
  return env;
}

}  // namespace ddp
