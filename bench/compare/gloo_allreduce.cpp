// Gloo's ring all-reduce (TCP on loopback) over the same sweep and columns as
// ddp_bench_allreduce. Forks --np ranks itself; rendezvous through a Gloo FileStore.
#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <vector>

#include "../common/bench_table.hpp"

namespace {

// Each rank times its iterations; rank 0 prints the slowest rank's mean (gathered through files).
int run_rank(int rank, int size, const std::string& dir, const ddp::bench::sweep_options& options) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->connectFullMesh(store, device);
  const auto sizes = ddp::bench::sizes(options);
  std::vector<float> data(sizes.back() / 4, 1.0f);
  std::vector<float*> ptrs{data.data()};
  std::vector<float> timing(1), timings(static_cast<std::size_t>(size));
  std::vector<float*> timing_ptrs{timing.data()};
  for (std::size_t bytes : sizes) {
    const int count = static_cast<int>(bytes / 4);
    gloo::AllreduceRing<float> allreduce(context, ptrs, count);
    for (int i = 0, n = ddp::bench::warmup_for(bytes, options); i < n; ++i) allreduce.run();
    const int iters = ddp::bench::iterations_for(bytes, options.iters);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) allreduce.run();
    const double mean = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    // The slowest rank's time: a max all-reduce of one float.
    timing[0] = static_cast<float>(mean);
    gloo::AllreduceRing<float> slowest(context, timing_ptrs, 1, gloo::ReductionFunction<float>::max);
    slowest.run();
    if (rank == 0) ddp::bench::print_row(options, size, bytes, timing[0]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::bench::sweep_options options;
  options.system = "gloo";
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, options, rest)) return 2;
  int np = 2;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--np" && i + 1 < rest.size()) np = std::atoi(rest[++i].c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", rest[i].c_str());
      return 2;
    }
  }
  const auto dir = std::filesystem::temp_directory_path() / ("gloo-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  ddp::bench::print_header(options, np, "Gloo AllreduceRing over TCP (loopback)");
  std::vector<pid_t> pids;
  for (int r = 0; r < np; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(run_rank(r, np, dir.string(), options));
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  std::filesystem::remove_all(dir);
  return failed;
}
