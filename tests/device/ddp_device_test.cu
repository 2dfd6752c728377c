// distributed_data_parallel with parameters in thrust::device_vector over the NCCL backend,
// against averages computed on the host. Ranks are threads, one device each; a one-GPU machine
// runs a world of one, where a communication hook still moves every bucket through its device
// buffer. Without a GPU every case says SKIPPED and why.
#include <ddp/adapters/thrust.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/nccl.hpp>
#include <ddp/store/hash_store.hpp>

#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/host_vector.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

#include <catch2/catch.hpp>
#include "device/nccl_ranks.hpp"
#include "support/skip.hpp"

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ddp_device_tests {

using ddp::test::nccl_group;
using device_tensor = thrust::device_vector<float>;
using model = std::vector<std::pair<device_tensor, device_tensor>>;  // (value, grad) per parameter

using ddp::test::check_nccl_ranks;
using ddp::test::devices_or_skip;

// Sizes that make several buckets with the caps below, and no two parameters adjacent in memory.
const std::vector<std::size_t> parameter_sizes = {1000, 37, 300000, 5};

struct gradient_of_rank {
  float rank;
  __host__ __device__ float operator()(long i) const { return (rank + 1.0f) * static_cast<float>(i % 11) - 3.0f; }
};

model make_model(int rank) {
  model m;
  for (std::size_t k = 0; k < parameter_sizes.size(); ++k) {
    thrust::host_vector<float> values(parameter_sizes[k]);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(rank * 1000 + static_cast<int>(k * 7 + i % 97));
    m.emplace_back(device_tensor(values), device_tensor(parameter_sizes[k], 0.0f));
  }
  return m;
}

// Gradients written by a kernel that may still be running when DDP starts: par_nosync on the
// legacy default stream, which the backend orders its collectives after.
void backward(model& m, int rank, const std::function<void(std::size_t)>& ready) {
  for (std::size_t k = m.size(); k-- > 0;) {
    auto& grad = m[k].second;
    thrust::transform(thrust::cuda::par_nosync, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(long(grad.size())),
                      grad.begin(), gradient_of_rank{float(rank)});
    ready(k);
  }
}

TEST_CASE("ddp on thrust::device_vector: rank 0's values everywhere, gradients averaged in device buckets") {
  const int devices = devices_or_skip();
  check_nccl_ranks(devices, [](nccl_group& g) {
    const int p = g.size(), me = g.rank();
    model m = make_model(me);
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 600000, .first_bucket_bytes = 4096}};
    if (net.stats().buckets < 2) throw std::runtime_error("expected several buckets");
    if (net.stats().in_place_buckets == net.stats().buckets) throw std::runtime_error("expected buckets copied into device buffers");

    const model rank0 = make_model(0);
    for (std::size_t k = 0; k < m.size(); ++k) {
      const thrust::host_vector<float> got = m[k].first, want = rank0[k].first;
      for (std::size_t i = 0; i < got.size(); ++i)
        if (got[i] != want[i]) throw std::runtime_error("parameter " + std::to_string(k) + " differs from rank 0's after construction");
    }

    for (int step = 0; step < 3; ++step) {
      backward(m, me, [&](std::size_t k) { net.mark_ready(k); });
      net.finish();
      for (std::size_t k = 0; k < m.size(); ++k) {
        const thrust::host_vector<float> got = m[k].second;
        for (std::size_t i = 0; i < got.size(); ++i) {
          double want = 0;  // the mean over ranks, in double
          for (int r = 0; r < p; ++r) want += double(gradient_of_rank{float(r)}(long(i)));
          want /= p;
          if (std::abs(got[i] - want) > 1e-5 * std::abs(want) + 1e-6)
            throw std::runtime_error("step " + std::to_string(step) + ", parameter " + std::to_string(k) + ", element " + std::to_string(i) +
                                     ": " + std::to_string(got[i]) + ", expected " + std::to_string(want));
        }
      }
    }
  });
}

TEST_CASE("ddp on thrust::device_vector: a hook sees each bucket in device memory and its result lands in every gradient") {
  devices_or_skip();
  check_nccl_ranks(1, [](nccl_group& g) {
    model m = make_model(0);
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 600000, .first_bucket_bytes = 4096}};
    // The hook writes element j of bucket b as b * 1e6 + j (through device memory), so after
    // finish() each gradient shows where the bucket layout put it.
    std::vector<std::pair<std::size_t, std::size_t>> seen;  // (bucket, elements)
    net.set_comm_hook([&](const ddp::bucket_view& b, nccl_group& group) {
      if (!ddp::detail::device_addressable(b.data.data())) throw std::runtime_error("bucket " + std::to_string(b.index) + " is not in device memory");
      std::vector<float> pattern(b.numel());
      for (std::size_t j = 0; j < pattern.size(); ++j) pattern[j] = float(b.index) * 1e6f + float(j);
      group.copy_memory(b.data.data(), pattern.data(), b.data.size());
      seen.emplace_back(b.index, b.numel());
      struct done {
        void wait() {}
      };
      return done{};
    });
    net.synchronize();
    if (seen.size() != net.stats().buckets) throw std::runtime_error("the hook saw " + std::to_string(seen.size()) + " buckets");
    // Inside a bucket, gradients are laid out by ascending parameter index.
    for (const auto& [bucket, elements] : seen) {
      std::size_t offset = 0, found = 0;
      for (std::size_t k = 0; k < m.size(); ++k) {
        const thrust::host_vector<float> grad = m[k].second;
        if (grad.empty() || grad[0] < float(bucket) * 1e6f || grad[0] >= float(bucket) * 1e6f + float(elements)) continue;
        for (std::size_t i = 0; i < grad.size(); ++i)
          if (grad[i] != float(bucket) * 1e6f + float(offset + i))
            throw std::runtime_error("parameter " + std::to_string(k) + " element " + std::to_string(i) + " did not come back from bucket " +
                                     std::to_string(bucket));
        offset += grad.size();
        found += grad.size();
      }
      if (found != elements) throw std::runtime_error("bucket " + std::to_string(bucket) + ": " + std::to_string(found) + " of " +
                                                      std::to_string(elements) + " elements came back");
    }
  });
}

}  // namespace ddp_device_tests
