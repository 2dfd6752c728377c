// sharded_data_parallel (ZeRO stages 1 and 2) with parameters in thrust::device_vector over the
// NCCL backend, the optimizer of ddp/optim/cuda.hpp stepping the device shard, against the host
// arithmetic the wrapper documents (sharded_data_parallel.hpp: the mean over ranks and
// micro-steps, each division rounded once in float) and the host optimizer of ddp/optim.hpp over
// the full parameters, bit for bit. Ranks are threads, one device each: a world of one on one GPU,
// and of two where two are visible. Gradients are pseudo-random floats, so the sums and divisions
// round; a sum of two floats rounds the same in either order, so NCCL's reduction of two ranks
// gives the host's bits (its average scales by 1/2 exactly). Without a GPU the cases that need
// one say SKIPPED and why; the construction checks run anyway.
#include <ddp/adapters/thrust.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/data_parallel/sharded_cuda.hpp>
#include <ddp/nccl.hpp>
#include <ddp/optim.hpp>
#include <ddp/optim/cuda.hpp>

#include <thrust/device_vector.h>
#include <thrust/host_vector.h>

#include <catch2/catch.hpp>
#include "device/nccl_ranks.hpp"
#include "support/skip.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp_sharded_device_tests {

using ddp::test::check_nccl_ranks;
using ddp::test::devices_or_skip;
using ddp::test::nccl_group;
using device_tensor = thrust::device_vector<float>;
using model = std::vector<std::pair<device_tensor, device_tensor>>;  // (value, grad) per parameter

constexpr int steps = 20;
// With the caps below, three buckets of 794, 3009 and 1039 elements: a world of two pads two of them.
const std::vector<std::size_t> parameter_sizes = {1001, 38, 3001, 6, 2, 777, 13, 4};
const ddp::sharded_options layout_options{.bucket_cap_bytes = 4096, .first_bucket_bytes = 1024};

float initial_value(int rank, std::size_t k, std::size_t i) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 1.3 * static_cast<double>(k) + 100.0 * rank));
}
float gradient(int rank, int step, int micro, std::size_t k, std::size_t i) {
  const double x = 0.71 * static_cast<double>(i) + 2.9 * static_cast<double>(k) + 0.13 * step + 1.7 * micro + 5.3 * rank;
  return static_cast<float>(std::cos(x) * (1.0 + 0.1 * rank));
}

model make_model(int rank) {
  model m;
  for (std::size_t k = 0; k < parameter_sizes.size(); ++k) {
    thrust::host_vector<float> values(parameter_sizes[k]);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = initial_value(rank, k, i);
    m.emplace_back(device_tensor(values), device_tensor(parameter_sizes[k], 0.0f));
  }
  return m;
}

std::size_t total_numel() {
  std::size_t n = 0;
  for (std::size_t s : parameter_sizes) n += s;
  return n;
}

// The gradient the wrapper documents, over all parameters (flat, in parameter order), for a step
// of `micro` micro-steps over `world` ranks:
//   stage 1: ((sum_r (sum_m g_rm)) / W) / k     the model accumulates sum_m; reduce_scatter(avg)
//   stage 2: ((sum_m (sum_r g_rm)) / W) / k
// each "/" one rounded division in float, "/ W" only when W > 1, "/ k" only when k > 1.
std::vector<float> reference_gradient(int stage, int world, int step, int micro) {
  std::vector<float> out(total_numel(), 0.0f);
  std::size_t offset = 0;
  for (std::size_t k = 0; k < parameter_sizes.size(); ++k) {
    for (std::size_t i = 0; i < parameter_sizes[k]; ++i) {
      float g = 0.0f;
      if (stage == 1) {
        for (int r = 0; r < world; ++r) {
          float accumulated = 0.0f;
          for (int m = 0; m < micro; ++m) accumulated += gradient(r, step, m, k, i);
          g = r == 0 ? accumulated : g + accumulated;
        }
        if (world > 1) g = g / static_cast<float>(world);
      } else {
        for (int m = 0; m < micro; ++m) {
          float over_ranks = 0.0f;
          for (int r = 0; r < world; ++r) over_ranks = r == 0 ? gradient(r, step, m, k, i) : over_ranks + gradient(r, step, m, k, i);
          g = m == 0 ? over_ranks : g + over_ranks;
        }
        if (world > 1) g = g / static_cast<float>(world);
      }
      if (micro > 1) g = g / static_cast<float>(micro);
      out[offset + i] = g;
    }
    offset += parameter_sizes[k];
  }
  return out;
}

std::uint32_t bits(float x) {
  std::uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Trains `steps` steps (1 or 2 micro-steps each, alternating) on device parameters through the
// sharded wrapper, and the same steps on the host, comparing the parameters after every step.
// Stage 2 leaves step()'s all-gathers in flight and waits for each parameter before reading it.
template <class DeviceOptimizer, class HostOptimizer, class Options>
void train_and_compare(int world, int stage, const Options& optimizer_options) {
  check_nccl_ranks(world, [&](nccl_group& g) {
    const int me = g.rank();
    model m = make_model(me);
    DeviceOptimizer device_optimizer(optimizer_options);
    ddp::sharded_options options = layout_options;
    options.stage = stage;
    options.overlap_all_gather = stage == 2;
    ddp::sharded_data_parallel net{m, g, device_optimizer, options};
    const auto stats = net.stats();
    if (stats.buckets < 3) throw std::runtime_error("expected several buckets, got " + std::to_string(stats.buckets));
    if (world > 1 && stats.padded_numel == stats.numel) throw std::runtime_error("expected padded buckets");
    if (!ddp::detail::device_addressable(net.shard_parameters().data()) || !ddp::detail::device_addressable(net.shard_gradients().data()))
      throw std::runtime_error("the shard buffers are not in device memory");

    std::vector<float> reference;  // rank 0's initial values (broadcast), flat
    for (std::size_t k = 0; k < parameter_sizes.size(); ++k)
      for (std::size_t i = 0; i < parameter_sizes[k]; ++i) reference.push_back(initial_value(0, k, i));
    HostOptimizer host_optimizer(optimizer_options);

    for (int step = 0; step < steps; ++step) {
      const int micro = 1 + step % 2;
      std::vector<thrust::host_vector<float>> model_grads(parameter_sizes.size());
      for (std::size_t k = 0; k < parameter_sizes.size(); ++k) model_grads[k].assign(parameter_sizes[k], 0.0f);  // zero_grad
      auto micro_step = [&](int mi) {
        for (std::size_t k = parameter_sizes.size(); k-- > 0;) {  // backward: last parameter first
          auto& grad = model_grads[k];
          // Stage 1 accumulates in the model's gradients; stage 2 zeroed them when it took them.
          for (std::size_t i = 0; i < grad.size(); ++i)
            grad[i] = stage == 1 ? grad[i] + gradient(me, step, mi, k, i) : gradient(me, step, mi, k, i);
          m[k].second = grad;
          net.mark_ready(k);
        }
        net.finish();
      };
      for (int mi = 0; mi + 1 < micro; ++mi) {
        const auto guard = net.no_sync();
        micro_step(mi);
      }
      micro_step(micro - 1);
      net.step();

      const std::vector<float> grad = reference_gradient(stage, world, step, micro);
      host_optimizer.step(std::span<float>(reference), std::span<const float>(grad));
      std::size_t offset = 0;
      for (std::size_t k = 0; k < parameter_sizes.size(); ++k) {
        net.wait_parameter(k);
        const thrust::host_vector<float> got = m[k].first;
        for (std::size_t i = 0; i < got.size(); ++i) {
          if (bits(got[i]) != bits(reference[offset + i]))
            throw std::runtime_error("step " + std::to_string(step) + ", parameter " + std::to_string(k) + ", element " + std::to_string(i) +
                                     ": " + std::to_string(got[i]) + " on the device, " + std::to_string(reference[offset + i]) +
                                     " on the host");
        }
        offset += got.size();
      }
    }
    if (net.stats().steps != steps) throw std::runtime_error("stats().steps is " + std::to_string(net.stats().steps));
    if ((net.stats().all_gathers_overlapped > 0) != (stage == 2 && world > 1))
      throw std::runtime_error("stats().all_gathers_overlapped is " + std::to_string(net.stats().all_gathers_overlapped));
  });
}

template <class DeviceOptimizer, class HostOptimizer, class Options>
void every_world_and_stage(const Options& optimizer_options) {
  const int devices = devices_or_skip();
  for (int stage : {1, 2}) {
    DYNAMIC_SECTION("W = 1, stage " << stage) { train_and_compare<DeviceOptimizer, HostOptimizer>(1, stage, optimizer_options); }
    DYNAMIC_SECTION("W = 2, stage " << stage) {
      if (devices < 2) {
        WARN("SKIPPED: W = 2 needs 2 CUDA devices, " << devices << " visible");
      } else {
        train_and_compare<DeviceOptimizer, HostOptimizer>(2, stage, optimizer_options);
      }
    }
  }
}

// A world of one with a device group's members but no device: construction refuses the
// parameters before any collective, so none is ever called.
struct allocating_group {
  struct done {
    void wait() {}
  };
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void broadcast(std::span<T>, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>) {}
  template <class T, class Op>
  done all_reduce_async(std::span<T>, Op) { return {}; }
  template <class T, class Op>
  done reduce_scatter_async(std::span<const T>, std::span<T>, Op) { return {}; }
  template <class T>
  done all_gather_async(std::span<const T>, std::span<T>) { return {}; }
  void copy_memory(void*, const void*, std::size_t) {}
  template <class T>
  std::vector<T> allocate(std::size_t n) { return std::vector<T>(n); }
};

// One parameter marked as device memory (its bytes are host memory: construction refuses it
// before reading them).
std::vector<ddp::parameter_ref> marked_device_parameter(std::vector<float>& value, std::vector<float>& grad) {
  ddp::parameter_ref p;
  p.name = "w";
  p.shape = {static_cast<std::int64_t>(value.size())};
  p.memory = ddp::memory_space::device;
  p.value = std::as_writable_bytes(std::span<float>(value));
  p.grad = std::as_writable_bytes(std::span<float>(grad));
  return {p};
}

template <class Group>
std::string construction_error(Group& group, std::vector<ddp::parameter_ref>& params, ddp::errc want) {
  ddp::optim::sgd<float> optimizer({.lr = 0.1});
  try {
    ddp::sharded_data_parallel net{params, group, optimizer};
  } catch (const ddp::error& e) {
    if (e.code() != want) throw std::runtime_error(std::string("unexpected error code: ") + e.what());
    return e.what();
  }
  throw std::runtime_error("device parameters were accepted");
}

TEST_CASE("sharded_data_parallel on device memory: without sharded_cuda.hpp's kernels, construction says to include it (no device needed)") {
  std::vector<float> value(10, 1.0f), grad(10, 0.0f);
  auto params = marked_device_parameter(value, grad);
  struct uninstalled {
    const ddp::detail::sharded_device_ops* saved = std::exchange(ddp::detail::sharded_device, nullptr);
    ~uninstalled() { ddp::detail::sharded_device = saved; }
  } scope;
  allocating_group g;
  CHECK_THAT(construction_error(g, params, ddp::errc::unavailable), Catch::Contains("include <ddp/data_parallel/sharded_cuda.hpp>"));
}

TEST_CASE("sharded_data_parallel on device memory, SGD with momentum: parameters bit for bit with the host arithmetic") {
  every_world_and_stage<ddp::optim::cuda::sgd<float>, ddp::optim::sgd<float>>(
      ddp::optim::sgd_options{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
}

TEST_CASE("sharded_data_parallel on device memory, AdamW: parameters bit for bit with the host arithmetic") {
  every_world_and_stage<ddp::optim::cuda::adamw<float>, ddp::optim::adamw<float>>(ddp::optim::adamw_options{.lr = 1e-2, .weight_decay = 1e-2});
}

TEST_CASE("sharded_data_parallel on device memory: host and device parameters together are refused") {
  devices_or_skip();
  check_nccl_ranks(1, [](nccl_group& g) {
    device_tensor value(10, 1.0f), grad(10, 0.0f);
    std::vector<float> host_value(10, 1.0f), host_grad(10, 0.0f);
    std::vector<ddp::parameter_ref> params{ddp::make_parameter(value, grad), ddp::make_parameter(host_value, host_grad)};
    ddp::optim::cuda::sgd<float> optimizer({.lr = 0.1});
    try {
      ddp::sharded_data_parallel net{params, g, optimizer};
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::invalid_argument || std::string(e.what()).find("one memory space") == std::string::npos)
        throw std::runtime_error(std::string("unexpected error: ") + e.what());
      return;
    }
    throw std::runtime_error("mixed host and device parameters were accepted");
  });
}

}  // namespace ddp_sharded_device_tests
