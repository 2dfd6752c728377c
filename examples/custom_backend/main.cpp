// custom_backend_example [--np N]: forks N ranks that meet through a file_store and run a few
// collectives over example::store_backend, a backend of ~100 lines (store_backend.hpp), under
// ddp::process_group and, registered by name, through ddp::init_process_group.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ddp/group.hpp>
#include <ddp/init.hpp>
#include <ddp/process_group.hpp>
#include <ddp/store/file_store.hpp>

#include "store_backend.hpp"

namespace {

int run_rank(int rank, int np, const std::string& path) {
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::process_group<example::store_backend> group{example::store_backend{store, rank, np}};

  std::vector<float> grads{1.0f * static_cast<float>(rank), 2.0f, 3.0f};
  group.all_reduce(grads, ddp::avg{});  // argument checks, sequencing, deadline: process_group's
  std::vector<std::int64_t> everyone(static_cast<std::size_t>(np));
  const std::vector<std::int64_t> mine{rank * 10};
  auto w = group.all_gather_async(mine, everyone);
  w.wait();
  group.barrier();

  // The same backend by name, through init_process_group.
  ddp::register_backend("store", [](const ddp::backend_context& c) {
    return ddp::group(ddp::process_group<example::store_backend>(example::store_backend{c.store, c.rank, c.world_size, c.prefix},
                                                                 {.timeout = c.options.timeout}));
  });
  auto g = ddp::init_process_group("store", {.store = store, .rank = rank, .world_size = np});
  std::vector<double> x{static_cast<double>(rank + 1)};
  g.all_reduce(x, ddp::max{});

  if (rank == 0) {
    std::printf("avg grads: %.3f %.3f %.3f\n", grads[0], grads[1], grads[2]);
    std::printf("all_gather:");
    for (auto v : everyone) std::printf(" %lld", static_cast<long long>(v));
    std::printf("\nmax through init_process_group(\"store\"): %.0f\n", x[0]);
    std::printf("%llu all_reduce calls, %llu bytes\n", static_cast<unsigned long long>(group.stats()[ddp::collective::all_reduce].calls),
                static_cast<unsigned long long>(group.stats()[ddp::collective::all_reduce].bytes));
  }
  const float want = static_cast<float>(np - 1) / 2.0f;
  const bool ok = grads[0] == want && everyone.back() == (np - 1) * 10 && x[0] == np;
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int np = 3;
  if (argc == 3 && std::strcmp(argv[1], "--np") == 0) np = std::atoi(argv[2]);
  if (np < 1 || np > 64) {
    std::fprintf(stderr, "usage: %s [--np N], 1 <= N <= 64\n", argv[0]);
    return 2;
  }
  const std::string path = "/tmp/ddp_custom_backend_" + std::to_string(::getpid()) + ".store";
  std::vector<pid_t> pids;
  for (int r = 0; r < np; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 1;
      try {
        code = run_rank(r, np, path);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::remove(path.c_str());
  if (failures) std::fprintf(stderr, "%d rank(s) failed\n", failures);
  return failures ? 1 : 0;
}
