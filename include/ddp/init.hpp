#pragma once
// ddp::init_process_group: the job's process group, from the launch environment.
//
//   auto group = ddp::init_process_group();            // "ring": shm on one host, tcp across hosts
//   auto group = ddp::init_process_group("tcp", {.timeout = 30s});
//
// 1. rank and world size come from ddp::launch_environment (torchrun, ddprun, Open MPI, hydra
//    PMI, Flux, PALS, LSF, Slurm, Kubeflow; nothing set is a world of one), unless init_options
//    overrides them;
// 2. the rendezvous store is init_options::store when given; otherwise, for a world larger
//    than one, a tcp_store at MASTER_ADDR:MASTER_PORT whose server rank 0 runs (a world of one
//    needs no store at all; nor does a backend registered with {.store = false}, such as "mpi").
//    Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True) the agent already serves
//    a PyTorch TCPStore there: every rank is a client of it (torch_tcp_store), keys under
//    "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", and nothing binds. Ranks carry the job's
//    identity (launch_environment::job_id) into ddp's own store, which refuses another job's;
//    when the launcher gave no local rank (PyTorchJob: RANK and WORLD_SIZE only), the local
//    rank and local world size are derived here from the ranks that share a host;
// 3. the backend is built by the factory registered under the name. Built in: "ring", "tcp",
//    "shm" (ring_backend with that transport choice). <ddp/nccl.hpp> and <ddp/mpi.hpp> register
//    "nccl" and "mpi" (register_backend, through an inline variable); without them the name is
//    errc::unavailable saying what to build and include. Unknown names are errc::config listing
//    the registered ones.
//
// Every rank calls init_process_group the same number of times in the same order: each call
// uses its own store key prefix ("<prefix>/<n>"), so calls never read each other's keys.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/descriptor_limit.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/host.hpp"
#include "ddp/group.hpp"
#include "ddp/store/store.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "ddp/backends/ring.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/tcp_store.hpp"
#include "ddp/store/torch_tcp_store.hpp"
#endif

namespace ddp {

struct init_options {
  std::chrono::milliseconds timeout = default_timeout();       // every collective
  std::chrono::milliseconds init_timeout = default_timeout();  // rendezvous: store connection, backend set-up
  std::shared_ptr<store::store> store;                         // default: tcp_store at MASTER_ADDR:MASTER_PORT
  std::optional<int> rank;                                     // default: from the environment
  std::optional<int> world_size;                               // default: from the environment
  std::string prefix = "ddp";                                  // store key prefix
};

/// What a backend factory gets: everything init_process_group worked out.
struct backend_context {
  std::string name;                     // the name asked for ("ring", "tcp", ...)
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<store::store> store;  // null for a world of one without init_options::store
  std::string prefix;                   // unique to this init_process_group call
  launch_environment env;
  init_options options;
};

using backend_factory = std::function<group(const backend_context&)>;

/// What init_process_group prepares for a backend before calling its factory.
struct backend_requirements {
  bool store = true;  // false: the backend rendezvouses by itself (MPI), so no tcp_store is made
};

namespace detail {

/// Local rank, local world size, node rank and node count from the host identities of all
/// ranks, for launchers that give only RANK and WORLD_SIZE: nodes are numbered in the order of
/// their lowest rank, ranks within a node by global rank.
void pg_derive_local_layout(launch_environment& env, store::store& st, const std::string& prefix, int rank, int world_size,
                            const std::string& identity = host_identity());

}  // namespace detail

/// Makes `name` available to init_process_group (replacing an earlier factory of that name).
/// Returns true, so a header can register with `inline const bool registered = ddp::register_backend(...)`.
bool register_backend(std::string name, backend_factory factory, backend_requirements requirements = {});

/// The registered backend names, sorted.
std::vector<std::string> registered_backends();

#if DDP_DECLARATIONS_ONLY
group init_process_group(std::string_view backend = "ring", init_options opts = {});
#endif

// Compiled once with the compiled library (ddp/core/compiled.hpp), with the registry.
#if !DDP_DECLARATIONS_ONLY
/// The ring backend as init_process_group builds it for "ring" (and "tcp", "shm": the transport)
/// from a factory's context: for a backend that wraps it (a decorator, see
/// examples/custom_backend/traced_backend.hpp) and registers under a name of its own. Header-only
/// (the compiled library keeps the ring backend out of a user's files).
inline ring_backend make_ring_backend(const backend_context& c, ring_options::transport_kind transport = ring_options::transport_kind::automatic) {
  ring_options o;
  o.transport = transport;
  o.prefix = c.prefix;
  o.timeout = c.options.init_timeout;
  return ring_backend(c.store, c.rank, c.world_size, o);
}

namespace detail {

struct pg_registry {
  std::mutex mutex;
  struct entry {
    backend_factory factory;
    backend_requirements requirements;
  };
  std::map<std::string, entry, std::less<>> factories;  // the registered backends; the ring's names are built in
  std::uint64_t calls = 0;
};

/// The ring backend's names and the transport each asks for; nullopt for any other name.
inline std::optional<ring_options::transport_kind> pg_ring_transport(std::string_view name) {
  if (name == "ring") return ring_options::transport_kind::automatic;
  if (name == "tcp") return ring_options::transport_kind::tcp;
  if (name == "shm") return ring_options::transport_kind::shm;
  return std::nullopt;
}

// A template, like init_process_group, so that only a file that calls init_process_group
// instantiates the ring backend for every dtype and reduction (most of what such a program
// compiles): a file that only includes <ddp/ddp.hpp> and calls collectives on a ddp::group
// compiles none of it. With the compiled library it is compiled once, in src/ddp_compiled.cpp.
template <class Ring>
group pg_make_ring(const backend_context& c, ring_options::transport_kind transport) {
  return group(process_group<Ring>(make_ring_backend(c, transport), {.timeout = c.options.timeout}));
}

/// Everything init_process_group does before building the backend: the factory registered
/// under `backend` (empty for the ring's built-in names, unless a factory replaced them), the
/// rank and world size, the store, the local layout.
backend_context pg_prepare(std::string_view backend, init_options opts, backend_factory& factory);

/// The job's store when init_options gives none: torchrun's agent store, or ddp's own.
DDP_COMPILED_INLINE std::shared_ptr<store::store> pg_make_store(const launch_environment& env, int rank,
                                                                 std::chrono::milliseconds timeout) {
  const auto port = static_cast<std::uint16_t>(env.master_port);
  if (env.use_agent_store) {
    return std::make_shared<store::torch_tcp_store>(env.master_addr, port, timeout,
                                                    "/worker/attempt_" + std::to_string(env.restart_count));
  }
  // Rank 0 runs the server, unless the launcher does: a rank that loses the store then names
  // its host (hosted_by).
  const bool launcher = env.store_served_by_launcher;
  std::vector<std::uint16_t> alternates;
  for (const int p : env.master_port_alternates) alternates.push_back(static_cast<std::uint16_t>(p));
  return std::make_shared<store::tcp_store>(store::tcp_store::options{.host = env.master_addr,
                                                                      .port = port,
                                                                      .is_server = rank == 0 && !launcher,
                                                                      .timeout = timeout,
                                                                      .job = env.job_id,
                                                                      .hosted_by = launcher ? "the launcher" : "rank 0",
                                                                      .member = "rank " + std::to_string(rank),
                                                                      .alternate_ports = std::move(alternates)});
}

DDP_COMPILED_INLINE void pg_derive_local_layout(launch_environment& env, store::store& st, const std::string& prefix, int rank,
                                                int world_size, const std::string& identity) {
  const std::string key = prefix + "/layout/host/";
  st.set_string(key + std::to_string(rank), identity);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(key + std::to_string(r));
  st.wait(keys);
  std::vector<std::string> all, hosts;  // hosts in order of first appearance = node order
  for (int r = 0; r < world_size; ++r) {
    all.push_back(st.get_string(keys[static_cast<std::size_t>(r)]));
    if (std::find(hosts.begin(), hosts.end(), all.back()) == hosts.end()) hosts.push_back(all.back());
  }
  const std::string& mine = all[static_cast<std::size_t>(rank)];
  int local_rank = 0, local_size = 0;
  for (int r = 0; r < world_size; ++r) {
    if (all[static_cast<std::size_t>(r)] != mine) continue;
    if (r < rank) ++local_rank;
    ++local_size;
  }
  env.local_rank = local_rank;
  env.local_world_size = local_size;
  env.num_nodes = static_cast<int>(hosts.size());
  env.node_rank = static_cast<int>(std::find(hosts.begin(), hosts.end(), mine) - hosts.begin());
  const std::string from(rendezvous_origin);
  env.origin.local_rank = env.origin.local_world_size = env.origin.node_rank = env.origin.num_nodes = from;
  env.local_layout_from_rendezvous = false;
}

// A function-local static: registration from other headers' inline variables may run before
// anything else here is initialised.
inline pg_registry& pg_backends() {
  static pg_registry registry;
  return registry;
}

/// The ring's names and the registered ones, sorted; the caller holds r.mutex.
inline std::vector<std::string> pg_backend_names(const pg_registry& r) {
  std::vector<std::string> names{"ring", "shm", "tcp"};
  for (const auto& [name, entry] : r.factories) {
    if (!pg_ring_transport(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace detail

DDP_COMPILED_INLINE bool register_backend(std::string name, backend_factory factory, backend_requirements requirements) {
  auto& r = detail::pg_backends();
  std::lock_guard lock(r.mutex);
  r.factories[std::move(name)] = {std::move(factory), requirements};
  return true;
}

DDP_COMPILED_INLINE std::vector<std::string> registered_backends() {
  auto& r = detail::pg_backends();
  std::lock_guard lock(r.mutex);
  return detail::pg_backend_names(r);
}

DDP_COMPILED_INLINE backend_context detail::pg_prepare(std::string_view backend, init_options opts, backend_factory& factory) {
  backend_requirements requirements;
  std::uint64_t call = 0;
  {
    auto& r = pg_backends();
    std::lock_guard lock(r.mutex);
    if (auto it = r.factories.find(backend); it != r.factories.end()) {
      factory = it->second.factory;
      requirements = it->second.requirements;
    }
    if (!factory && !pg_ring_transport(backend)) {
      if (backend == "nccl") {
        throw error(errc::unavailable,
                    "backend 'nccl' is not available: build with CUDA and NCCL (target ddp::nccl) and include <ddp/nccl.hpp>",
                    {.op = "init_process_group"});
      }
      if (backend == "mpi") {
        throw error(errc::unavailable, "backend 'mpi' is not available: build with MPI (target ddp::mpi) and include <ddp/mpi.hpp>",
                    {.op = "init_process_group"});
      }
      std::string known;
      for (const auto& name : pg_backend_names(r)) known += (known.empty() ? "" : ", ") + name;
      throw error(errc::config, "unknown backend '" + std::string(backend) + "': known backends are " + known +
                                    " (and nccl, mpi when their headers are included)",
                  {.op = "init_process_group"});
    }
    call = r.calls++;
  }

  backend_context c;
  c.name = std::string(backend);
  c.env = launch_environment::from_environment();
  c.rank = opts.rank.value_or(c.env.rank);
  c.world_size = opts.world_size.value_or(c.env.world_size);
  if (c.world_size < 1) {
    throw error(errc::config, "world size " + std::to_string(c.world_size) + ": it must be at least 1", {.op = "init_process_group"});
  }
  if (c.rank < 0 || c.rank >= c.world_size) {
    throw error(errc::config, "rank " + std::to_string(c.rank) + " is out of range for a world of " + std::to_string(c.world_size) +
                                  " (expected 0.." + std::to_string(c.world_size - 1) + ")",
                {.rank = c.rank, .op = "init_process_group"});
  }
  c.prefix = opts.prefix + "/" + std::to_string(call);
  c.store = opts.store;
  if (c.world_size > 1) {
    // The store's host holds a connection per rank; a rank, up to a socket per tcp peer, two
    // pidfds per shared-memory peer and the heartbeat's pidfd per peer and two sockets. Checked
    // now, a low limit is one line on every rank.
    const auto w = static_cast<std::size_t>(c.world_size);
    ensure_descriptors((c.rank == 0 ? w : 0) + 4 * w + 18, "a job of " + std::to_string(w) + " ranks", c.rank);
  }
  if (!c.store && c.world_size > 1 && requirements.store) c.store = pg_make_store(c.env, c.rank, opts.init_timeout);
  if (c.env.local_layout_from_rendezvous) {
    if (c.store) pg_derive_local_layout(c.env, *c.store, c.prefix, c.rank, c.world_size);
    else if (c.world_size == 1) c.env.local_layout_from_rendezvous = false;  // rank 0 of 1 is local rank 0 of 1
  }
  c.options = std::move(opts);
  return c;
}

/// The job's process group (see the top of this file). A template only so that a file which
/// never calls it does not instantiate the ring backend; call it as a function.
template <class Ring = ring_backend>
group init_process_group(std::string_view backend = "ring", init_options opts = {}) {
  backend_factory factory;
  const backend_context c = detail::pg_prepare(backend, std::move(opts), factory);
  if (factory) return factory(c);
  return detail::pg_make_ring<Ring>(c, *detail::pg_ring_transport(backend));
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
