// Run by the network-namespace tests under ddprun on every "host": init_process_group from
// the launcher's environment, then collectives checked against closed forms. Prints one
// line per rank and exits non-zero on any difference.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main() {
  try {
    auto group = ddp::init_process_group("ring");
    const int p = group.size(), me = group.rank();
    for (std::size_t n : {std::size_t{1}, std::size_t{1023}, (std::size_t{1} << 20) + 3}) {
      std::vector<double> data(n);
      for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<double>(me + 1) * static_cast<double>(i % 13);
      group.all_reduce(std::span<double>(data), ddp::sum{});
      const double ranks_sum = p * (p + 1) / 2.0;
      for (std::size_t i = 0; i < n; ++i) {
        if (data[i] != ranks_sum * static_cast<double>(i % 13)) {
          std::fprintf(stderr, "rank %d: all_reduce of %zu doubles: element %zu is %g, expected %g\n", me, n, i, data[i],
                       ranks_sum * static_cast<double>(i % 13));
          return 1;
        }
      }
    }
    std::vector<std::int64_t> value(4, me == p - 1 ? 12345 : 0);
    group.broadcast(std::span<std::int64_t>(value), p - 1);
    for (auto v : value)
      if (v != 12345) {
        std::fprintf(stderr, "rank %d: broadcast from rank %d gave %lld\n", me, p - 1, static_cast<long long>(v));
        return 1;
      }
    group.barrier();
    std::printf("collectives ok: rank %d of %d\n", me, p);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
