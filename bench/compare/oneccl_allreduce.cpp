// oneCCL's ccl::allreduce on host buffers over the same sweep and columns as ddp_bench_allreduce.
// Forks --np ranks itself; rank 0 creates the main KVS and passes its address to the others
// through a file (no MPI launcher). In place (send == recv) unless --out-of-place; buffers are
// ordinary std::vectors, pre-touched. The time of a size is the slowest rank's mean over the
// iterations (a max all-reduce of one double).
//
//   oneccl_bench_allreduce --np 2 [--out-of-place] [--min-bytes B] [--max-bytes B] [--iters N] [--csv]
//
// Built by bench/anchors.sh against the oneccl-cpu wheel; run with its libfabric on the
// library path (CCL_ATL_TRANSPORT=ofi, FI_PROVIDER=shm for one host).
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <oneapi/ccl.hpp>
#include <string>
#include <thread>
#include <vector>

#include "../common/bench_table.hpp"

namespace {

ccl::kvs::address_type read_address(const std::filesystem::path& file) {
  ccl::kvs::address_type address{};
  for (;;) {
    if (std::filesystem::exists(file)) {
      std::ifstream in(file, std::ios::binary);
      in.read(address.data(), static_cast<std::streamsize>(address.size()));
      if (in.gcount() == static_cast<std::streamsize>(address.size())) return address;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int run_rank(int rank, int size, const std::filesystem::path& file, const ddp::bench::sweep_options& options,
             bool in_place) {
  ccl::init();
  std::shared_ptr<ccl::kvs> kvs;
  if (rank == 0) {
    kvs = ccl::create_main_kvs();
    const auto address = kvs->get_address();
    const auto partial = file.string() + ".part";
    {
      std::ofstream out(partial, std::ios::binary);
      out.write(address.data(), static_cast<std::streamsize>(address.size()));
    }
    std::filesystem::rename(partial, file);
  } else {
    kvs = ccl::create_kvs(read_address(file));
  }
  auto comm = ccl::create_communicator(size, rank, kvs);
  std::vector<float> probe(4, static_cast<float>(rank + 1));  // the settings in use must sum right
  ccl::allreduce(probe.data(), probe.data(), probe.size(), ccl::reduction::sum, comm).wait();
  if (probe[0] != static_cast<float>(size * (size + 1) / 2)) {
    std::fprintf(stderr, "rank %d: check failed: %g\n", rank, probe[0]);
    return 1;
  }
  const auto sizes = ddp::bench::sizes(options);
  std::vector<float> in(sizes.back() / 4, 1.0f), out(sizes.back() / 4, 0.0f);  // pre-touched
  std::vector<double> timing(1);
  for (std::size_t bytes : sizes) {
    const std::size_t count = bytes / 4;
    auto once = [&] {
      if (in_place) ccl::allreduce(out.data(), out.data(), count, ccl::reduction::sum, comm).wait();
      else ccl::allreduce(in.data(), out.data(), count, ccl::reduction::sum, comm).wait();
    };
    for (int i = 0, n = ddp::bench::warmup_for(bytes, options); i < n; ++i) once();
    const int iters = ddp::bench::iterations_for(bytes, options.iters);
    ccl::barrier(comm).wait();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) once();
    timing[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    ccl::allreduce(timing.data(), timing.data(), 1, ccl::reduction::max, comm).wait();
    if (rank == 0) ddp::bench::print_row(options, size, bytes, timing[0]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::bench::sweep_options options;
  options.system = "oneccl";
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, options, rest)) return 2;
  int np = 2;
  bool in_place = true;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--np" && i + 1 < rest.size()) {
      const auto value = ddp::bench::parse_int(rest[++i], 1, 1024);
      if (!value) {
        std::fprintf(stderr, "--np needs a whole number in [1, 1024]\n");
        return 2;
      }
      np = *value;
    } else if (rest[i] == "--out-of-place") {
      in_place = false;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", rest[i].c_str());
      return 2;
    }
  }
  const auto dir = std::filesystem::temp_directory_path() / ("oneccl_bench_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "main_kvs_address";
  ddp::bench::print_header(options, np, in_place ? "oneCCL ccl::allreduce (in place)" : "oneCCL ccl::allreduce");
  std::vector<pid_t> children;
  for (int rank = 0; rank < np; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = run_rank(rank, np, file, options, in_place);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      }
      std::fflush(stdout);
      _exit(rc);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::filesystem::remove_all(dir);
  return failed ? 1 : 0;
}
