#pragma once
// Entry header of the MPI backend: link the CMake target ddp::mpi.
#if !defined(DDP_HAS_MPI)
#error "<ddp/mpi.hpp> needs MPI: link the CMake target ddp::mpi (find_package(MPI) must find an MPI library)"
#endif
#include "ddp/backends/mpi.hpp"
