#pragma once
// Entry header of the MPI backend: link the CMake target ddp::mpi.
//
// Including it registers the backend "mpi" with init_process_group: under mpirun or srun,
//   auto group = ddp::init_process_group("mpi");
// initialises MPI on first use (finalised at exit) and wraps MPI_COMM_WORLD. MPI does its own
// rendezvous, so no tcp_store is made and MASTER_ADDR/MASTER_PORT are not needed.
#if !defined(DDP_HAS_MPI)
#error "<ddp/mpi.hpp> needs MPI: link the CMake target ddp::mpi (find_package(MPI) must find an MPI library)"
#endif
#include <string>

#include "ddp/backends/mpi.hpp"
#include "ddp/init.hpp"

namespace ddp {
namespace detail {

inline group pg_make_mpi(const backend_context& c) {
  static mpi_environment environment;  // MPI_Init_thread on first use unless the program did it
  mpi_backend backend(MPI_COMM_WORLD);
  if (backend.size() != c.world_size || backend.rank() != c.rank) {
    throw error(errc::config,
                "MPI_COMM_WORLD has this process as rank " + std::to_string(backend.rank()) + " of " +
                    std::to_string(backend.size()) + ", but the launch environment (source: " +
                    std::string(to_string(c.env.source())) + ") says rank " + std::to_string(c.rank) + " of " +
                    std::to_string(c.world_size) + ": launch with mpirun or srun, without RANK/WORLD_SIZE overrides",
                {.rank = c.rank, .op = "init_process_group"});
  }
  return group(process_group<mpi_backend>(std::move(backend), {.timeout = c.options.timeout}));
}

}  // namespace detail

inline const bool mpi_backend_registered = register_backend("mpi", detail::pg_make_mpi, {.store = false});

}  // namespace ddp
