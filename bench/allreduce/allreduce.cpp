// ddp_bench_allreduce: float32 sum all-reduce over ddp::process_group<ring_backend>, sizes
// 4 B .. 64 MiB, in the nccl-tests columns (size, count, type, time us, algbw, busbw with
// busbw = algbw * 2(p-1)/p). Forks --np ranks itself; rendezvous through a file_store.
//
//   ddp_bench_allreduce --np 2 --transport shm|tcp|auto --buffer user|group [--out-of-place]
//                       [--bind cpus|none] [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N]
//                       [--check] [--csv]
//
// --buffer group: the buffer comes from group.allocate<float>() (shared memory on one host:
// zero copy); user: an ordinary std::vector. Buffers are pre-touched. The time of a size is the
// slowest rank's mean over the iterations. --check verifies one all-reduce per size against
// p (p + 1) / 2. Progress goes to stderr, the table to stdout (rank 0).
//
// --bind cpus (the default): rank r runs on the r-th CPU this program may use, as Intel MPI and
// Open MPI place their ranks by default; when there are more ranks than CPUs nothing is bound.
// Unbound, both ranks of a 2-rank run start on the CPU they were forked on, and until the
// kernel moves one, each one's wait takes that CPU from the peer it waits for: a size whose
// timed calls fall in those first milliseconds measures several times its steady time
// (bench/results/rank_placement.md).
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../common/bench_table.hpp"
#include "../common/rank_binding.hpp"
#include "ddp/backends/ring.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"

namespace {

struct options {
  ddp::bench::sweep_options sweep;
  int np = 2;
  ddp::ring_options::transport_kind transport = ddp::ring_options::transport_kind::shm;
  bool group_buffer = false;
  bool in_place = true;
  bool check = false;
  bool bind = true;
};

template <class Buffer>
int sweep(ddp::process_group<ddp::ring_backend>& g, Buffer& data, std::vector<float>& in, const options& o) {
  const int p = g.size(), rank = g.rank();
  int failures = 0;
  for (std::size_t bytes : ddp::bench::sizes(o.sweep)) {
    const std::size_t count = bytes / 4;
    const std::span<float> buf(data.data(), count);
    const std::span<const float> src(in.data(), count);
    auto once = [&] {
      if (o.in_place) g.all_reduce(buf);
      else g.all_reduce(src, buf);
    };
    for (int i = 0, n = ddp::bench::warmup_for(bytes, o.sweep); i < n; ++i) once();
    const int iters = ddp::bench::iterations_for(bytes, o.sweep.iters);
    g.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) once();
    std::vector<double> mean{std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters};
    g.all_reduce(mean, ddp::max{});  // the slowest rank
    if (o.check) {
      for (std::size_t i = 0; i < count; ++i) buf[i] = in[i] = static_cast<float>(rank + 1);
      once();
      const float want = static_cast<float>(p * (p + 1) / 2);
      for (std::size_t i = 0; i < count; ++i)
        if (buf[i] != want) {
          std::fprintf(stderr, "rank %d: check failed at %zu bytes, element %zu: %g != %g\n", rank, bytes, i, buf[i], want);
          ++failures;
          break;
        }
      for (std::size_t i = 0; i < count; ++i) buf[i] = in[i] = 0.0f;  // zeros keep timing runs finite
    }
    if (rank == 0) {
      ddp::bench::print_row(o.sweep, p, bytes, mean[0]);
      std::fprintf(stderr, "  %zu bytes done\n", bytes);
    }
  }
  return failures;
}

int run_rank(int rank, const options& o, const std::string& path) {
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::ring_options ro;
  ro.transport = o.transport;
  ddp::process_group<ddp::ring_backend> g(ddp::ring_backend(store, rank, o.np, ro));
  const std::size_t max_count = o.sweep.max_bytes / 4;
  std::vector<float> in(max_count, 0.0f);  // pre-touched
  if (rank == 0) {
    const std::string what = std::string("ddp all_reduce float32 sum over ") + std::string(g.backend().transport_name()) + ", " +
                             (o.group_buffer ? "group" : "user") + " buffers, " + (o.in_place ? "in place" : "out of place");
    ddp::bench::print_header(o.sweep, o.np, what.c_str());
  }
  if (o.group_buffer) {
    auto data = g.allocate<float>(max_count);
    for (auto& x : data) x = 0.0f;
    return sweep(g, data, in, o);
  }
  std::vector<float> data(max_count, 0.0f);
  return sweep(g, data, in, o);
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "%s\nusage: ddp_bench_allreduce [--np N] [--transport shm|tcp|auto] [--buffer user|group] [--out-of-place] [--bind cpus|none]\n"
                       "       [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] [--check] [--csv] [--system NAME]\n", why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, o.sweep, rest)) return 2;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const std::string& a = rest[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= rest.size()) usage((a + " needs a value").c_str());
      return rest[++i];
    };
    if (a == "--np") o.np = std::atoi(value().c_str());
    else if (a == "--transport") {
      const std::string& t = value();
      if (t == "shm") o.transport = ddp::ring_options::transport_kind::shm;
      else if (t == "tcp") o.transport = ddp::ring_options::transport_kind::tcp;
      else if (t == "auto") o.transport = ddp::ring_options::transport_kind::automatic;
      else usage(("--transport " + t + ": expected shm, tcp or auto").c_str());
    } else if (a == "--buffer") {
      const std::string& b = value();
      if (b != "user" && b != "group") usage(("--buffer " + b + ": expected user or group").c_str());
      o.group_buffer = b == "group";
    } else if (a == "--out-of-place") o.in_place = false;
    else if (a == "--in-place") o.in_place = true;
    else if (a == "--check") o.check = true;
    else if (a == "--bind") {
      const std::string& b = value();
      if (b != "cpus" && b != "none") usage(("--bind " + b + ": expected cpus or none").c_str());
      o.bind = b == "cpus";
    }
    else usage(("unknown flag " + a).c_str());
  }
  if (o.np < 1 || o.np > 64) usage("--np must be 1..64");
  if (o.sweep.system == "ddp") o.sweep.system = std::string("ddp-") + std::string(ddp::to_string(o.transport)) + (o.group_buffer ? "-group" : "-user");

  const std::string path = "/tmp/ddp_bench_allreduce_" + std::to_string(::getpid()) + ".store";
  std::remove(path.c_str());
  const ddp::bench::rank_binding binding(o.bind, o.np, "ddp_bench_allreduce");
  std::vector<pid_t> pids;
  for (int r = 0; r < o.np; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) usage("fork failed");
    if (pid == 0) {
      binding.apply(r, "ddp_bench_allreduce");
      int code = 1;
      try {
        code = run_rank(r, o, path) == 0 ? 0 : 3;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::remove(path.c_str());
  if (failed) std::fprintf(stderr, "%d rank(s) failed\n", failed);
  return failed ? 1 : 0;
}
