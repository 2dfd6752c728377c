// ddp::nccl_backend on real devices. Without a GPU every case says SKIPPED and why.
#include <ddp/nccl.hpp>
#include <ddp/store/hash_store.hpp>

#include <catch2/catch.hpp>
#include "support/skip.hpp"
#include <thread>
#include <vector>

namespace {

int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Ranks as threads, one device each (NCCL refuses two ranks on one device).
template <class F>
void run_on_devices(int ranks, F&& body) {
  ddp::store::hash_store store;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        ddp::nccl_backend backend(store, r, ranks, {.local_rank = r});
        body(backend);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failures) CHECK(f.empty());
}

template <class T>
std::vector<T> to_host(const T* device, std::size_t n) {
  std::vector<T> host(n);
  REQUIRE(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

}  // namespace

TEST_CASE("nccl_backend: all_reduce sum and avg on device memory match the closed form") {
  const int devices = visible_devices();
  if (devices == 0) ddp::test::skip("no CUDA device visible on this machine");
  run_on_devices(devices, [](ddp::nccl_backend& backend) {
    const std::size_t n = (std::size_t{1} << 20) + 3;
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((i % 7) + static_cast<std::size_t>(backend.rank()));
    float* device = nullptr;
    ddp::detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&device), n * sizeof(float)), "cudaMalloc");
    ddp::detail::cuda_check(cudaMemcpy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    backend.all_reduce(std::span<float>(device, n), ddp::sum{});
    const auto result = to_host(device, n);
    const int p = backend.size();
    for (std::size_t i = 0; i < n; ++i) {
      const float expected = static_cast<float>(static_cast<std::size_t>(p) * (i % 7) + static_cast<std::size_t>(p * (p - 1) / 2));
      if (result[i] != expected) throw std::runtime_error("element " + std::to_string(i) + " wrong");
    }
    cudaFree(device);
  });
}

TEST_CASE("nccl_backend: more local ranks than devices is a clear error") {
  const int devices = visible_devices();
  if (devices == 0) ddp::test::skip("no CUDA device visible on this machine");
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
  const int devices = visible_devices();
  if (devices == 0) ddp::test::skip("no CUDA device visible on this machine");
  auto group = ddp::init_process_group("nccl", {.rank = 0, .world_size = 1});
  CHECK(group.memory() == ddp::memory_space::device);
  const std::size_t n = 4096;
  std::vector<int> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<int>(i);
  int* device = nullptr;
  ddp::detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&device), n * sizeof(int)), "cudaMalloc");
  ddp::detail::cuda_check(cudaMemcpy(device, host.data(), n * sizeof(int), cudaMemcpyHostToDevice), "cudaMemcpy");
  group.all_reduce(std::span<int>(device, n), ddp::max{});
  const auto result = to_host(device, n);
  cudaFree(device);
  CHECK(result == host);
}
