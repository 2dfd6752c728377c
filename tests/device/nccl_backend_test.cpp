// ddp::nccl_backend on real devices, through ddp::process_group, against references computed on
// the host. Ranks are threads, one device each (NCCL refuses two ranks on one device), so the
// world is as large as the visible devices: 1 on a one-GPU machine. Without a GPU every case
// says SKIPPED and why.
#include <ddp/nccl.hpp>
#include <ddp/store/hash_store.hpp>

#include <catch2/catch.hpp>
#include "device/nccl_ranks.hpp"
#include "support/skip.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace nccl_backend_tests {

using ddp::test::nccl_group;

using ddp::test::check_nccl_ranks;
using ddp::test::devices_or_skip;

// Device copies of host vectors, freed at scope exit.
template <class T>
struct device_array {
  ddp::device_buffer<T> memory;
  explicit device_array(const std::vector<T>& host) : memory(host.size()) {
    if (!host.empty())
      ddp::detail::cuda_check(cudaMemcpy(memory.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  explicit device_array(std::size_t n) : memory(n) {}
  std::span<T> span() { return memory.span(); }
  std::vector<T> to_host() const {
    std::vector<T> host(memory.size());
    if (!host.empty())
      ddp::detail::cuda_check(cudaMemcpy(host.data(), memory.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return host;
  }
};

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, ddp::float16> || std::is_same_v<T, ddp::bfloat16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}
template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, ddp::float16> || std::is_same_v<T, ddp::bfloat16>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

// 1, 2 or 3: exact in every dtype; sums and products of up to 8 ranks stay below float16's
// largest value (3^8 = 6561). uint8 products wrap, as NCCL's do, and so does the reference.
template <class T>
T input_value(int rank, std::size_t i) {
  return from_double<T>(static_cast<double>((i + static_cast<std::size_t>(rank)) % 3 + 1));
}

template <class T>
double reference(ddp::reduce_kind kind, int ranks, std::size_t i) {
  double acc = as_double(input_value<T>(0, i));
  std::uint8_t wrapped = static_cast<std::uint8_t>(acc);
  for (int r = 1; r < ranks; ++r) {
    const double v = as_double(input_value<T>(r, i));
    switch (kind) {
      case ddp::reduce_kind::sum:
      case ddp::reduce_kind::avg: acc += v; break;
      case ddp::reduce_kind::min: acc = std::min(acc, v); break;
      case ddp::reduce_kind::max: acc = std::max(acc, v); break;
      case ddp::reduce_kind::prod: acc *= v; wrapped = static_cast<std::uint8_t>(wrapped * static_cast<std::uint8_t>(v)); break;
    }
  }
  if (kind == ddp::reduce_kind::prod && std::is_same_v<T, std::uint8_t>) return wrapped;
  if (kind == ddp::reduce_kind::avg) return std::is_integral_v<T> ? std::trunc(acc / ranks) : acc / ranks;
  return acc;
}

template <class T>
double tolerance(double want) {
  if constexpr (std::is_same_v<T, ddp::float16> || std::is_same_v<T, ddp::bfloat16>) return 2e-2 * std::abs(want) + 2e-2;  // avg pre-multiplies by 1/p in the type itself
  else if constexpr (std::is_same_v<T, float>) return 1e-6 * std::abs(want);
  else if constexpr (std::is_same_v<T, double>) return 1e-12 * std::abs(want);
  else return 0;
}

template <class T>
void check_all_reduce(nccl_group& g, ddp::reduce_kind kind, std::size_t n) {
  std::vector<T> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = input_value<T>(g.rank(), i);
  device_array<T> data(host);
  g.all_reduce(data.span(), ddp::runtime_op{kind});
  const auto got = data.to_host();
  for (std::size_t i = 0; i < n; ++i) {
    const double want = reference<T>(kind, g.size(), i);
    if (std::abs(as_double(got[i]) - want) > tolerance<T>(want)) {
      throw std::runtime_error(std::string(ddp::to_string(ddp::dtype_of<T>)) + " " + std::string(ddp::to_string(kind)) + " n=" +
                               std::to_string(n) + ": element " + std::to_string(i) + " is " + std::to_string(as_double(got[i])) +
                               ", expected " + std::to_string(want));
    }
  }
}

TEST_CASE("nccl_backend: all_reduce of every dtype and reduction, sizes 0 to 2^20 + 3, against host references") {
  const int devices = devices_or_skip();
  check_nccl_ranks(devices, [](nccl_group& g) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1023}, (std::size_t{1} << 20) + 3}) {
      for (auto kind : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max, ddp::reduce_kind::prod}) {
        check_all_reduce<float>(g, kind, n);
        check_all_reduce<double>(g, kind, n);
        check_all_reduce<ddp::float16>(g, kind, n);
        check_all_reduce<ddp::bfloat16>(g, kind, n);
        check_all_reduce<std::int32_t>(g, kind, n);
        check_all_reduce<std::int64_t>(g, kind, n);
        check_all_reduce<std::uint8_t>(g, kind, n);
      }
    }
  });
}

TEST_CASE("nccl_backend: broadcast, reduce, all_gather, reduce_scatter, all_to_all and barrier against host references") {
  const int devices = devices_or_skip();
  check_nccl_ranks(devices, [](nccl_group& g) {
    const int p = g.size(), me = g.rank();
    const std::size_t n = 1000 * static_cast<std::size_t>(p) + 3 * static_cast<std::size_t>(p);
    auto value = [](int rank, std::size_t i) { return static_cast<std::int64_t>(rank) * 1000003 + static_cast<std::int64_t>(i); };

    for (int root = 0; root < p; ++root) {
      std::vector<std::int64_t> host(n);
      for (std::size_t i = 0; i < n; ++i) host[i] = value(me, i);
      device_array<std::int64_t> data(host);
      g.broadcast(data.span(), root);
      const auto got = data.to_host();
      for (std::size_t i = 0; i < n; ++i)
        if (got[i] != value(root, i)) throw std::runtime_error("broadcast from " + std::to_string(root) + ": element " + std::to_string(i));

      device_array<std::int64_t> reduced(host);
      g.reduce(reduced.span(), root, ddp::sum{});
      if (me == root) {
        const auto sums = reduced.to_host();
        for (std::size_t i = 0; i < n; ++i) {
          std::int64_t want = 0;
          for (int r = 0; r < p; ++r) want += value(r, i);
          if (sums[i] != want) throw std::runtime_error("reduce to " + std::to_string(root) + ": element " + std::to_string(i));
        }
      }
    }

    const std::size_t block = n / static_cast<std::size_t>(p);
    std::vector<float> mine(block);
    for (std::size_t i = 0; i < block; ++i) mine[i] = static_cast<float>(value(me, i) % 4096);
    device_array<float> in(mine), gathered(block * static_cast<std::size_t>(p));
    g.all_gather(std::span<const float>(in.span()), gathered.span());
    const auto all = gathered.to_host();
    for (int r = 0; r < p; ++r)
      for (std::size_t i = 0; i < block; ++i)
        if (all[static_cast<std::size_t>(r) * block + i] != static_cast<float>(value(r, i) % 4096))
          throw std::runtime_error("all_gather: block " + std::to_string(r) + " element " + std::to_string(i));

    std::vector<float> contribution(block * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < contribution.size(); ++i) contribution[i] = static_cast<float>((i + static_cast<std::size_t>(me)) % 13);
    device_array<float> scatter_in(contribution), scatter_out(block);
    g.reduce_scatter(std::span<const float>(scatter_in.span()), scatter_out.span(), ddp::sum{});
    const auto part = scatter_out.to_host();
    for (std::size_t i = 0; i < block; ++i) {
      const std::size_t global = static_cast<std::size_t>(me) * block + i;
      float want = 0;
      for (int r = 0; r < p; ++r) want += static_cast<float>((global + static_cast<std::size_t>(r)) % 13);
      if (part[i] != want) throw std::runtime_error("reduce_scatter: element " + std::to_string(i));
    }

    std::vector<std::int32_t> outgoing(block * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < outgoing.size(); ++i) outgoing[i] = me * 100000 + static_cast<std::int32_t>(i);
    device_array<std::int32_t> send(outgoing), received(outgoing.size());
    g.all_to_all(std::span<const std::int32_t>(send.span()), received.span());
    const auto incoming = received.to_host();
    for (int r = 0; r < p; ++r)
      for (std::size_t i = 0; i < block; ++i) {
        const std::int32_t want = r * 100000 + static_cast<std::int32_t>(static_cast<std::size_t>(me) * block + i);
        if (incoming[static_cast<std::size_t>(r) * block + i] != want) throw std::runtime_error("all_to_all: from " + std::to_string(r));
      }

    g.barrier();
  });
}

TEST_CASE("nccl_backend: host-memory operands are staged through the device") {
  const int devices = devices_or_skip();
  check_nccl_ranks(devices, [](nccl_group& g) {
    const int p = g.size();
    std::vector<double> totals{1.5, static_cast<double>(g.rank())};
    g.all_reduce(std::span<double>(totals), ddp::sum{});
    if (totals[0] != 1.5 * p || totals[1] != p * (p - 1) / 2.0) throw std::runtime_error("host all_reduce");
    const std::vector<std::int64_t> mine{g.rank(), 7};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(p));
    g.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    for (int r = 0; r < p; ++r)
      if (all[2 * static_cast<std::size_t>(r)] != r || all[2 * static_cast<std::size_t>(r) + 1] != 7) throw std::runtime_error("host all_gather");
    // Mixed: host input, device output.
    device_array<std::int64_t> out(all.size());
    g.all_gather(std::span<const std::int64_t>(mine), out.span());
    if (out.to_host() != all) throw std::runtime_error("host in, device out all_gather");
  });
}

TEST_CASE("nccl_backend: a collective waits for the work queued before it on the compute stream") {
  devices_or_skip();
  check_nccl_ranks(1, [](nccl_group& g) {
    // A big copy on the legacy default stream writes `in`; the all_gather (world of one: a copy
    // on the backend's own stream) must read what it wrote, not what was there before.
    const std::size_t n = std::size_t{256} << 20;  // 1 GiB of float: long enough to be still running
    device_array<float> source(n), in(n), out(n);
    ddp::detail::cuda_check(cudaMemset(source.memory.data(), 0x3f, n * sizeof(float)), "cudaMemset");
    ddp::detail::cuda_check(cudaMemset(in.memory.data(), 0, n * sizeof(float)), "cudaMemset");
    ddp::detail::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    ddp::detail::cuda_check(cudaMemcpyAsync(in.memory.data(), source.memory.data(), n * sizeof(float), cudaMemcpyDeviceToDevice, cudaStreamLegacy),
                            "cudaMemcpyAsync");
    g.all_gather(std::span<const float>(in.span()), out.span());
    std::vector<float> tail(1024);
    ddp::detail::cuda_check(cudaMemcpy(tail.data(), out.memory.data() + n - tail.size(), tail.size() * sizeof(float), cudaMemcpyDeviceToHost),
                            "cudaMemcpy");
    float want = 0;
    std::memset(&want, 0x3f, sizeof want);
    for (float v : tail)
      if (v != want) throw std::runtime_error("the all_gather read `in` before the copy on the compute stream had written it");
  });
}

TEST_CASE("nccl_backend: ranks calling different collectives get errc::mismatch, not wrong data") {
  const int devices = devices_or_skip(2);
  check_nccl_ranks(devices, [](nccl_group& g) {
    device_array<float> data(static_cast<std::size_t>(10 + (g.rank() == 0 ? 0 : 1)));
    try {
      g.all_reduce(data.span(), ddp::sum{});
      throw std::runtime_error("expected errc::mismatch");
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::mismatch) throw;
    }
  });
}

TEST_CASE("nccl_backend: a peer that never arrives is errc::timeout within the deadline") {
  const int devices = devices_or_skip(2);
  check_nccl_ranks(
      devices,
      [](nccl_group& g) {
        if (g.rank() != 0) return;  // the others never call
        device_array<float> data(std::size_t{1024});
        const auto start = std::chrono::steady_clock::now();
        try {
          g.all_reduce(data.span(), ddp::sum{});
          throw std::runtime_error("expected errc::timeout");
        } catch (const ddp::error& e) {
          if (e.code() != ddp::errc::timeout) throw;
        }
        if (std::chrono::steady_clock::now() - start > std::chrono::seconds(10)) throw std::runtime_error("the timeout took over 10 s");
      },
      std::chrono::seconds(2));
}

TEST_CASE("nccl_backend: more local ranks than devices is a clear error") {
  const int devices = devices_or_skip();
  ddp::store::hash_store store;
  try {
    ddp::nccl_backend backend(store, 0, 1, {.local_rank = devices});
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::cuda);
    CHECK(std::string(e.what()).find("CUDA device(s) are visible") != std::string::npos);
  }
}

TEST_CASE("init_process_group(\"nccl\"): a world of one on device 0") {
  devices_or_skip();
  auto group = ddp::init_process_group("nccl", {.rank = 0, .world_size = 1});
  CHECK(group.memory() == ddp::memory_space::device);
  const std::size_t n = 4096;
  std::vector<int> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<int>(i);
  device_array<int> data(host);
  group.all_reduce(data.span(), ddp::max{});
  CHECK(data.to_host() == host);
  auto buffer = group.allocate<float>(100);
  CHECK(ddp::detail::device_addressable(buffer.data()));
  CHECK_FALSE(buffer.shared());
}

}  // namespace nccl_backend_tests
