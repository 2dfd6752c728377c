// MPI_Allreduce over the same sweep and columns as ddp_bench_allreduce: Open MPI from CMake,
// MPICH and Intel MPI from their own wrappers (bench/anchors.sh). Run under that MPI's mpirun;
// --in-place uses MPI_IN_PLACE (Open MPI's fastest shared-memory path here), --alloc-mem takes
// both buffers from MPI_Alloc_mem (Intel MPI's shared heap with I_MPI_SHM_HEAP=1).
// The time of a size is the slowest rank's mean over the iterations.
#include <mpi.h>

#include <algorithm>
#include <vector>

#include "../common/bench_table.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ddp::bench::sweep_options options;
  options.system = "openmpi";
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, options, rest)) MPI_Abort(MPI_COMM_WORLD, 2);
  bool in_place = false, alloc_mem = false;
  for (const auto& a : rest) {
    if (a == "--in-place") in_place = true;
    else if (a == "--alloc-mem") alloc_mem = true;
    else {
      if (rank == 0) std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  if (rank == 0) ddp::bench::print_header(options, size, in_place ? "MPI_Allreduce (MPI_IN_PLACE)" : "MPI_Allreduce");
  const auto sizes = ddp::bench::sizes(options);
  const std::size_t most = sizes.back() / 4;
  std::vector<float> in_vector, out_vector;
  float* in = nullptr;
  float* out = nullptr;
  if (alloc_mem) {
    const auto bytes = static_cast<MPI_Aint>(most * sizeof(float));
    if (MPI_Alloc_mem(bytes, MPI_INFO_NULL, &in) != MPI_SUCCESS || MPI_Alloc_mem(bytes, MPI_INFO_NULL, &out) != MPI_SUCCESS) {
      std::fprintf(stderr, "MPI_Alloc_mem failed\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  } else {
    in_vector.resize(most);
    out_vector.resize(most);
    in = in_vector.data();
    out = out_vector.data();
  }
  std::fill_n(in, most, 1.0f);  // pre-touched
  std::fill_n(out, most, 0.0f);
  for (std::size_t bytes : sizes) {
    const int count = static_cast<int>(bytes / 4);
    auto once = [&] {
      if (in_place) MPI_Allreduce(MPI_IN_PLACE, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    };
    for (int i = 0, n = ddp::bench::warmup_for(bytes, options); i < n; ++i) once();
    const int iters = ddp::bench::iterations_for(bytes, options.iters);
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) once();
    double mean = (MPI_Wtime() - start) / iters, slowest = 0;
    MPI_Reduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) ddp::bench::print_row(options, size, bytes, slowest);
  }
  if (alloc_mem) {
    MPI_Free_mem(in);
    MPI_Free_mem(out);
  }
  MPI_Finalize();
  return 0;
}
