#pragma once
// Ranks as threads, one CUDA device each (NCCL refuses two ranks on one device), for the device
// tests: run_nccl_ranks(n, body) builds rank r's process_group<nccl_backend> on device r and runs
// body(group) on its own thread; it returns each rank's error text ("" when body returned).
// check_nccl_ranks does the same and fails the test case for each rank that threw, with its text.
// devices_or_skip(k) returns the visible devices, or ends the case as SKIPPED with fewer than k.
#include <catch2/catch.hpp>
#include <ddp/nccl.hpp>
#include <ddp/store/hash_store.hpp>

#include "support/skip.hpp"

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace ddp::test {

using nccl_group = ddp::process_group<ddp::nccl_backend>;

inline int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

inline int devices_or_skip(int at_least = 1) {
  const int n = visible_devices();
  if (n == 0) skip("no CUDA device visible on this machine");
  if (n < at_least) skip("needs " + std::to_string(at_least) + " CUDA devices, " + std::to_string(n) + " visible");
  return n;
}

inline std::vector<std::string> run_nccl_ranks(int ranks, const std::function<void(nccl_group&)>& body,
                                               std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ddp::store::hash_store store;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        nccl_group group(ddp::nccl_backend(store, r, ranks, {.local_rank = r}), {.timeout = timeout});
        body(group);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

inline void check_nccl_ranks(int ranks, const std::function<void(nccl_group&)>& body,
                             std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const auto failures = run_nccl_ranks(ranks, body, timeout);
  for (std::size_t r = 0; r < failures.size(); ++r) {
    INFO("rank " << r << ": " << failures[r]);
    CHECK(failures[r].empty());
  }
}

}  // namespace ddp::test
