// ddp_bench_netns_allreduce: the float32 sum all-reduce sweep of bench/allreduce, but for ranks
// started by a launcher (ddprun, torchrun, srun): the group comes from init_process_group("ring"),
// so DDP_RING_HIERARCHY=flat|hierarchical picks the multi-host algorithm. Rank 0 prints the
// nccl-tests columns (or CSV) with busbw = algbw * 2(p-1)/p, p = every rank of the job, and
// one line saying what the backend ran over. Buffers are pre-touched; --check verifies one
// all-reduce per size; the time of a size is the slowest rank's mean over the iterations.
//
//   ddprun ... ddp_bench_netns_allreduce [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N]
//                                        [--check] [--csv] [--system NAME] [--buffer user|group]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "../common/bench_table.hpp"
#include "ddp/ddp.hpp"

int main(int argc, char** argv) {
  ddp::bench::sweep_options o;
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, o, rest)) return 2;
  bool check = false, group_buffer = true;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--check") check = true;
    else if (rest[i] == "--buffer" && i + 1 < rest.size()) group_buffer = rest[++i] == "group";
    else {
      std::fprintf(stderr, "unknown flag %s\n", rest[i].c_str());
      return 2;
    }
  }
  try {
    auto g = ddp::init_process_group("ring");
    auto* pg = g.get_if<ddp::ring_backend>();
    if (pg == nullptr) throw std::runtime_error("not a ring backend");
    const int p = pg->size(), rank = pg->rank();
    const auto& b = pg->backend();
    if (rank == 0) {
      const std::string what = "ddp all_reduce float32 sum over " + std::string(b.transport_name()) + " (" +
                               (b.hierarchical() ? "hierarchical" : "flat") + ", " + std::to_string(b.hosts()) + " hosts), " +
                               (group_buffer ? "group" : "user") + " buffers, in place";
      ddp::bench::print_header(o, p, what.c_str());
      if (o.csv) std::fprintf(stderr, "# %s\n", what.c_str());
    }
    const std::size_t max_count = o.max_bytes / 4;
    auto run = [&](auto& data) {
      for (auto& x : data) x = 0.0f;  // pre-touched; zeros keep repeated sums finite
      int failures = 0;
      for (std::size_t bytes : ddp::bench::sizes(o)) {
        const std::size_t count = bytes / 4;
        const std::span<float> buf(data.data(), count);
        for (int i = 0, n = ddp::bench::warmup_for(bytes, o); i < n; ++i) pg->all_reduce(buf);
        const int iters = ddp::bench::iterations_for(bytes, o.iters);
        pg->barrier();
        const auto tcp_before = b.tcp_bytes_sent();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) pg->all_reduce(buf);
        std::vector<double> mean{std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters};
        const double sent = static_cast<double>(b.tcp_bytes_sent() - tcp_before) / iters / static_cast<double>(bytes);
        pg->all_reduce(std::span<double>(mean), ddp::max{});
        if (check) {
          for (std::size_t i = 0; i < count; ++i) buf[i] = static_cast<float>(rank + 1);
          pg->all_reduce(buf);
          const float want = static_cast<float>(p * (p + 1) / 2);
          for (std::size_t i = 0; i < count; ++i)
            if (buf[i] != want) {
              std::fprintf(stderr, "rank %d: check failed at %zu bytes, element %zu: %g != %g\n", rank, bytes, i, buf[i], want);
              ++failures;
              break;
            }
          for (std::size_t i = 0; i < count; ++i) buf[i] = 0.0f;
        }
        if (rank == 0) {
          ddp::bench::print_row(o, p, bytes, mean[0]);
          std::fprintf(stderr, "  %zu bytes done; rank 0 sent %.3f x the buffer over tcp per all_reduce\n", bytes, sent);
        }
      }
      return failures;
    };
    int failures = 0;
    if (group_buffer) {
      auto data = pg->allocate<float>(max_count);
      failures = run(data);
    } else {
      std::vector<float> data(max_count);
      failures = run(data);
    }
    pg->barrier();
    return failures == 0 ? 0 : 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
