#pragma once
// ddp::launch_environment: this process's place in the job, read from the variables of the
// launcher that started it, and the job's identity.
//
// Sources (launch_source) and their variables:
//   torchrun  torchrun, ddprun, Kubeflow's PyTorchJob or a script: RANK, WORLD_SIZE, LOCAL_RANK,
//             LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE (present when RANK or WORLD_SIZE is);
//             job id TORCHELASTIC_RUN_ID
//   openmpi   mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//             job id OMPI_MCA_ess_base_jobid | PMIX_NAMESPACE | OMPI_MCA_orte_ess_jobid
//   pmi       hydra's mpiexec (MPICH, Intel MPI), any PMI-1 launcher: PMI_RANK, PMI_SIZE,
//             MPI_LOCALRANKID, MPI_LOCALNRANKS; no job id
//   flux      flux run / submit: FLUX_TASK_RANK, FLUX_JOB_SIZE, FLUX_TASK_LOCAL_ID, FLUX_JOB_NNODES
//             (tasks per node = FLUX_JOB_SIZE / FLUX_JOB_NNODES; node rank assumes the default
//             block task map); job id FLUX_JOB_ID
//   pals      HPE Cray PALS mpiexec: PALS_RANKID, PMI_SIZE | PALS_SIZE, PALS_LOCAL_RANKID |
//             PMI_LOCAL_RANK, PMI_LOCAL_SIZE | PALS_LOCAL_SIZE, PALS_NODEID; job id PALS_APID
//   lsf       IBM LSF jsrun: JSM_NAMESPACE_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//             job id LSB_JOBID (LSB_JOBID[LSB_JOBINDEX] for an element of a job array)
//   slurm     srun: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID,
//             SLURM_NTASKS_PER_NODE | SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE ("2(x3),1"),
//             SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_NODEID,
//             SLURM_STEP_NODELIST | SLURM_JOB_NODELIST | SLURM_NODELIST (master = first host);
//             job id SLURM_JOB_ID.SLURM_STEP_ID (or SLURM_JOBID, SLURM_STEPID; step optional)
//   none      a world of one: rank 0 of 1, master 127.0.0.1:29500
//
// Which source: the launcher that started this process. A launcher started inside another's
// job (torchrun or mpirun inside a Slurm allocation, hydra inside an srun step) inherits the
// outer one's variables, which describe the inner launcher's own task, not this process. The
// first of these that applies wins:
//   1. torchrun's variables. Only a launcher of single processes sets them (torchrun and ddprun
//      per worker), never a scheduler.
//   2. Open MPI's, over every scheduler's: mpirun sets them per process. Except that jsrun sets
//      OMPI_COMM_WORLD_* as well: when they give the same rank and size as JSM_NAMESPACE_*, the
//      process is jsrun's (lsf).
//   3. PMI_RANK/PMI_SIZE with MPI_LOCALRANKID or MPI_LOCALNRANKS: hydra sets those per process,
//      and no scheduler does. Inside Slurm, hydra's proxies run as an srun step (one task per
//      node), so that step's SLURM_PROCID numbers proxies, not ranks.
//   4. PMI_RANK/PMI_SIZE that differ from the scheduler's task rank and size (5-8): a PMI
//      launcher started inside the scheduler's task.
//   5. Flux, 6. PALS, 7. LSF, 8. Slurm: their task variables. Each of these schedulers may set
//      PMI_RANK/PMI_SIZE as well (srun --mpi=pmi2, Flux's pmi plugin, PALS), with the same values;
//      those are its own (PMI-1 has no local rank: reading them gave every task local rank 0).
//      Flux comes before Slurm because a Flux instance can run inside a Slurm allocation.
//   9. PMI_RANK/PMI_SIZE alone.
// The rule behind 2 and 4: a second launcher's variables that give the same rank and size are
// the first one's duplicates; different values mean a launcher inside it started this process.
// (srun --mpi=pmix sets PMIX_RANK, PMIX_NAMESPACE: read as plain Slurm.)
//
// torchrun's variables without any of LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE
// (Kubeflow's PyTorchJob sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK only; scripts export
// RANK=$SLURM_PROCID) give the local layout thus, the first that applies:
//   a. Kubeflow's PET_* (torchrun's arguments as variables: PET_NNODES, PET_NPROC_PER_NODE,
//      PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT): PET_NPROC_PER_NODE=1, or WORLD_SIZE ==
//      PET_NNODES, is one process per pod: local rank 0 of 1 on node PET_NODE_RANK of PET_NNODES.
//      A larger PET_NPROC_PER_NODE without LOCAL_RANK is an error: the pod was to run torchrun.
//   b. a launcher of 2-8 whose rank and size are the same: its local layout (and its job id).
//   c. a master address (MASTER_ADDR, PET_MASTER_ADDR) that is not loopback: nothing says which
//      ranks share a host. local_layout_from_rendezvous is set; local_rank 0, local_world_size 1,
//      node_rank = rank and num_nodes = world_size are provisional, for init_process_group to
//      replace with what the ranks that share a host work out at rendezvous.
//   d. one node: local_rank = RANK.
// The source stays torchrun (the variables and their meaning are torchrun's; nothing tells a
// PyTorchJob from a script that sets the same four); the origins say where the layout came from.
// Flux without an even FLUX_JOB_SIZE / FLUX_JOB_NNODES also leaves the layout to the rendezvous.
//
// Job identity (job_id): one string, the same on every rank, for messages ("job slurm:1234.0")
// and the default port. DDP_JOB_ID verbatim when set (ddprun sets it); else the source's own id
// above, prefixed with the source's name ("slurm:1234.0", "torchrun:<run id>"; torchrun's static
// default run id "none" is none); else "". An enclosing allocation's id is not borrowed by a
// source without one (hydra inside Slurm, torchrun without a run id): several launches may share
// it, and ranks started over ssh may not have it.
//
// MASTER_ADDR (else PET_MASTER_ADDR) overrides the address of every source. Without either, a
// single-node job uses 127.0.0.1 and a Slurm job the first host of its node list; a multi-node
// job from any other source is an error. MASTER_PORT (else PET_MASTER_PORT) sets the port; without
// either, a job with an identity uses 20000 + n % 20000, with n = JOB + 7919 x STEP for a numeric
// "JOB" or "JOB.STEP" id (Slurm, LSF, Open MPI 4) and an FNV-1a hash of the id otherwise, so that
// two jobs, or two steps of one job, sharing a node do not collide (7919 is prime to 20000: the
// steps of one job get distinct ports). Step 0 of a Slurm job gets 20000 + SLURM_JOB_ID % 20000,
// the port examples/slurm/train_ddp.sbatch exports. Otherwise 29500.
// DDP_TIMEOUT (seconds) sets the default deadline.
// DDP_HEARTBEAT_TIMEOUT (seconds, 0 = off, default 5) sets how long the ring backend tolerates a
// peer whose heartbeat has stopped (default_heartbeat_timeout()).
//
// Empty variables count as unset. Every bad value is a ddp::error(errc::config) whose message
// names the variable and the expected form; from_environment() also cross-checks the values
// (rank < world size, local rank < local world size, local world size x nodes == world size).
//
// The lookup is injectable so that tests (and tools) can describe an environment as a table
// without touching the real one.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <utility>
#endif

namespace ddp {

/// DDP_HEARTBEAT_TIMEOUT (seconds; 0 turns the heartbeat off) or 5 s: a ring backend fails once
/// a peer has sent no heartbeat for this long (backends/ring/transport/heartbeat.hpp). A malformed value
/// is a ddp::error naming the variable.
std::chrono::milliseconds default_heartbeat_timeout();

/// Which launcher's variables a launch_environment came from (see the top of this header).
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

namespace detail {

[[noreturn]] void config_error(std::string message);

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
int env_int(std::string_view name, const char* text, int min_value, std::string_view example);

int parse_port(std::string_view name, const char* text);

/// Whether a master address names this host only (127.x.x.x, ::1, localhost).
inline bool is_loopback(std::string_view addr) noexcept {
  return addr == "localhost" || addr == "::1" || addr == "[::1]" || addr.substr(0, 4) == "127.";
}

/// The default port of a job with an identity (see the top of this header): 20000 + n % 20000,
/// n = JOB + 7919 x STEP for an id "<launcher>:JOB" or "<launcher>:JOB.STEP" of digits, else an
/// FNV-1a hash of the whole id.
int port_from_job_id(std::string_view job_id) noexcept;

/// Slurm's tasks-per-node syntax, "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> expand_tasks_per_node(std::string_view name, std::string_view text);

}  // namespace detail

/// Expands a Slurm host list: "node[01-03,7],gpu5" -> node01 node02 node03 node7 gpu5.
/// Zero padding follows the lower bound ("[08-10]" -> 08 09 10); several bracket groups in one
/// name give every combination ("a[1-2]-b[3,5]" -> a1-b3 a1-b5 a2-b3 a2-b5). Malformed lists
/// (unbalanced or nested brackets, empty names or ranges, a range that runs backwards) are a
/// ddp::error(errc::config) quoting the list.
std::vector<std::string> expand_nodelist(std::string_view list);

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

  /// Reads and checks the environment (see the precedence at the top of this header).
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

// Reading the environment is compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::chrono::milliseconds default_heartbeat_timeout() {
  const char* text = read_env("DDP_HEARTBEAT_TIMEOUT");
  if (text == nullptr || *text == '\0') return std::chrono::seconds(5);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds >= 0) || seconds > 1e9) {
    throw error(errc::config, std::string("DDP_HEARTBEAT_TIMEOUT='") + text +
                                  "' is not a number of seconds >= 0 (e.g. DDP_HEARTBEAT_TIMEOUT=5; 0 turns the heartbeat off)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}

namespace detail {

[[noreturn]] DDP_COMPILED_INLINE void config_error(std::string message) { throw error(errc::config, std::move(message)); }

DDP_COMPILED_INLINE int env_int(std::string_view name, const char* text, int min_value, std::string_view example) {
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

DDP_COMPILED_INLINE int parse_port(std::string_view name, const char* text) {
  const auto v = parse_int64(text);
  if (!v) config_error(std::string(name) + "='" + text + "' is not a port number (expected an integer 1-65535, e.g. " + std::string(name) + "=29500)");
  if (*v < 1 || *v > 65535) config_error(std::string(name) + "=" + text + " is out of range (expected 1-65535)");
  return static_cast<int>(*v);
}

DDP_COMPILED_INLINE int port_from_job_id(std::string_view job_id) noexcept {
  constexpr std::uint64_t range = 20000;
  std::string_view id = job_id;
  if (const auto colon = id.find(':'); colon != std::string_view::npos) id.remove_prefix(colon + 1);
  const auto dot = id.find('.');
  const std::string_view job = id.substr(0, dot);
  const std::string_view step = dot == std::string_view::npos ? std::string_view("0") : id.substr(dot + 1);
  std::uint64_t n = 0;
  if (all_digits(job) && all_digits(step) && job.size() <= 18 && step.size() <= 18) {
    n = static_cast<std::uint64_t>(*parse_int64(job)) % range + static_cast<std::uint64_t>(*parse_int64(step)) % range * 7919;
  } else {
    n = 14695981039346656037ull;  // FNV-1a, 64 bits
    for (const char c : job_id) n = (n ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  }
  return static_cast<int>(range + n % range);
}

DDP_COMPILED_INLINE std::vector<int> expand_tasks_per_node(std::string_view name, std::string_view text) {
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

DDP_COMPILED_INLINE std::vector<std::string> expand_nodelist(std::string_view list) {
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

  // The scheduler whose task this is, if any (5-8 at the top of this header): its source and
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

      // Only RANK and WORLD_SIZE: where is the local layout? (a-d at the top of this header)
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
