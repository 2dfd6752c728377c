// Measurement, not a test (hidden: run it by name in a Release build):
//   shm_bench_test "[.bench]"     (DDP_BENCH_P=2 by default; DDP_BENCH_CHUNK=<staging chunk bytes>)
// p forked ranks, float32 sum all_reduce at 4 B .. 64 MiB, three systems interleaved:
//  - probe: the bare limit (one shared mapping holds every rank's buffer; each rank sums its
//    slice in place and writes the sum into every buffer; spin barriers before and after);
//  - group: shm_communicator on shared_buffer memory (zero copy);
//  - user:  shm_communicator on ordinary memory (staged).
// Prints the median of 7 repetitions per system and size: time, algbw, busbw = algbw * 2(p-1)/p.
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/store/file_store.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_shm_bench {

using namespace std::chrono_literals;

namespace {

struct alignas(64) flag {
  std::atomic<std::uint64_t> value;
};

// The bare probe's shared state: a flag per rank and every rank's buffer, in one mapping.
struct probe {
  int p;
  std::size_t max_floats;
  flag* flags;
  float* buffers;
  std::uint64_t epoch = 0;

  float* buffer(int r) const { return buffers + static_cast<std::size_t>(r) * max_floats; }
  void barrier(int rank) {
    ++epoch;
    flags[rank].value.store(epoch, std::memory_order_release);
    for (int r = 0; r < p; ++r)
      while (flags[r].value.load(std::memory_order_acquire) < epoch) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
  }
  void all_reduce(int rank, std::size_t n) {
    barrier(rank);
    const std::size_t lo = n * static_cast<std::size_t>(rank) / static_cast<std::size_t>(p);
    const std::size_t hi = n * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(p);
    if (p == 2) {
      float* a = buffer(0);
      float* b = buffer(1);
      for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] = a[i] + b[i];
    } else {
      for (std::size_t i = lo; i < hi; ++i) {
        float s = 0;
        for (int r = 0; r < p; ++r) s += buffer(r)[i];
        for (int r = 0; r < p; ++r) buffer(r)[i] = s;
      }
    }
    barrier(rank);
  }
};

ddp::collective_desc desc(std::uint64_t seq, std::size_t n) {
  ddp::collective_desc d;
  d.seq = seq;
  d.op = ddp::collective::all_reduce;
  d.type = ddp::dtype::float32;
  d.count = n;
  return d;
}

}  // namespace

TEST_CASE("shm bench: all_reduce float32 sum, probe vs group vs user buffers", "[.bench]") {
  const int p = std::getenv("DDP_BENCH_P") ? std::atoi(std::getenv("DDP_BENCH_P")) : 2;
  const std::vector<std::size_t> sizes = {4, 1024, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  const std::size_t max_floats = sizes.back() / 4;
  const std::size_t map_bytes = 64 * static_cast<std::size_t>(p) + static_cast<std::size_t>(p) * max_floats * 4;
  void* mem = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  probe pr{p, max_floats, static_cast<flag*>(mem), reinterpret_cast<float*>(static_cast<char*>(mem) + 64 * p)};
  const std::string tag = "shmbench" + std::to_string(::getpid());
  const std::string path = "/tmp/ddp-" + tag + ".store";
  ::unlink(path.c_str());

  const auto result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        ddp::store::file_store st(path);
        ddp::algo::shm_communicator::options opts;
        if (const char* c = std::getenv("DDP_BENCH_CHUNK")) opts.chunk_bytes = std::strtoull(c, nullptr, 10);
        ddp::algo::shm_communicator comm(st, tag + "/", rank, p, ddp::deadline::after(30s), opts);
        auto group = comm.allocate<float>(max_floats, ddp::deadline::after(30s));
        std::vector<float> user(max_floats, 0.0f);
        std::fill(group.begin(), group.end(), 0.0f);
        std::fill(pr.buffer(rank), pr.buffer(rank) + max_floats, 0.0f);
        std::uint64_t seq = 0;
        if (rank == 0) std::printf("p=%d  %10s %8s %12s %10s %10s\n", p, "bytes", "system", "time_us", "algbw_GBs", "busbw_GBs");
        for (std::size_t bytes : sizes) {
          const std::size_t n = bytes / 4;
          const int iters = bytes <= 1024 ? 20000 : bytes <= (64 << 10) ? 2000 : bytes <= (1 << 20) ? 200 : bytes <= (16 << 20) ? 20 : 6;
          std::vector<double> t[3];
          for (int rep = 0; rep < 7; ++rep) {
            for (int system = 0; system < 3; ++system) {
              comm.barrier(desc(++seq, 0), ddp::deadline::after(60s));
              const auto start = std::chrono::steady_clock::now();
              for (int i = 0; i < iters; ++i) {
                if (system == 0) pr.all_reduce(rank, n);
                else if (system == 1) comm.all_reduce(group.span().first(n), ddp::sum{}, desc(++seq, n), ddp::deadline::after(60s));
                else comm.all_reduce(std::span<float>(user).first(n), ddp::sum{}, desc(++seq, n), ddp::deadline::after(60s));
              }
              t[system].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters);
            }
          }
          if (rank != 0) continue;
          const char* names[3] = {"probe", "group", "user"};
          for (int system = 0; system < 3; ++system) {
            std::sort(t[system].begin(), t[system].end());
            const double sec = t[system][t[system].size() / 2];
            const double algbw = static_cast<double>(bytes) / sec / 1e9;
            std::printf("     %10zu %8s %12.3f %10.2f %10.2f\n", bytes, names[system], sec * 1e6, algbw, algbw * 2.0 * (p - 1) / p);
          }
        }
      },
      600s);
  ::unlink(path.c_str());
  ::munmap(mem, map_bytes);
  std::printf("%s", result.ranks[0].output.c_str());
  INFO(result.describe());
  CHECK(result.ok());
}

}  // namespace ddp_test_shm_bench
