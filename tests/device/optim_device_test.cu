// ddp/optim/cuda.hpp: the device optimizers, unscale and clipping against the host classes of
// ddp/optim.hpp on the same inputs, bit for bit. The host classes are the reference (optim_test
// checks them against torch), so equal bits here carry that agreement over to device memory.
// Each optimizer runs 20 steps on pseudo-random gradients, float and double, for sizes 1, 7, 1000
// and 100003 (one block, a partial block, several blocks, more elements than threads in the grid);
// the parameters and every state buffer are compared. Without a GPU the cases that need one say
// SKIPPED and why; the option checks run anyway (no device is touched before a step).
#include <ddp/backends/cuda_memory.hpp>
#include <ddp/optim.hpp>
#include <ddp/optim/cuda.hpp>
#include <ddp/optim/cuda.hpp>  // twice: include guards

#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include "support/skip.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ddp_optim_device_tests {

namespace optim = ddp::optim;

void gpu_or_skip() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) ddp::test::skip(std::string("no CUDA device visible on this machine (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")");
  if (n == 0) ddp::test::skip("no CUDA device visible on this machine");
}

constexpr int steps = 20;
constexpr std::size_t sizes[] = {1, 7, 1000, 100003};

/// A non-blocking CUDA stream, destroyed at scope exit: the optimizers run on it, not on the
/// default stream, so their ordering on a caller's stream is exercised too.
struct stream {
  cudaStream_t s = nullptr;
  stream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream() { cudaStreamDestroy(s); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
};

/// A device copy of a host vector, and back, ordered on `s`.
template <class T>
struct device_array {
  ddp::device_buffer<T> buffer;
  cudaStream_t s;

  device_array(std::size_t n, cudaStream_t stream_) : buffer(n), s(stream_) {}
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == buffer.size());
    REQUIRE(cudaMemcpyAsync(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, s) == cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(buffer.size());
    REQUIRE(cudaMemcpyAsync(host.data(), buffer.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost, s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    return host;
  }
  std::span<T> span() { return buffer.span(); }
  std::span<const T> cspan() const { return buffer.span(); }
};

/// n values around 0 with spread `scale` and a few exact zeros (both signs).
template <class T>
std::vector<T> random_values(std::size_t n, double scale, std::mt19937_64& gen) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = (i % 97 == 3) ? T(0) : (i % 97 == 5) ? -T(0) : static_cast<T>(normal(gen));
  }
  return v;
}

/// The first index where a and b differ in their bits, or a description of the size mismatch;
/// empty when they are equal.
template <class T>
std::string difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " and " + std::to_string(want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      std::ostringstream os;
      os << "index " << i << ": device " << std::hexfloat << got[i] << ", host " << want[i];
      return os.str();
    }
  }
  return {};
}

template <class T>
const char* type_name() {
  return sizeof(T) == 4 ? "float" : "double";
}

/// Steps a host optimizer and a device optimizer of the same options on the same inputs for `steps`
/// steps (when `reload_at` > 0, the device state is copied out after that step and loaded into a
/// fresh device optimizer, as a checkpoint would), then compares the parameters and the states.
template <class T, class Host, class Device, class Options>
void run_and_compare(const Options& options, std::size_t n, int reload_at, const char* what) {
  INFO(what << ", " << type_name<T>() << ", " << n << " elements" << (reload_at > 0 ? ", state reloaded mid-run" : ""));
  stream s;
  std::mt19937_64 gen(n * 31 + sizeof(T));
  std::vector<T> host_params = random_values<T>(n, 1.0, gen);
  device_array<T> params(n, s.s), grads(n, s.s);
  params.upload(host_params);

  Host host(options);
  Device device(options, s.s);
  for (int step = 1; step <= steps; ++step) {
    // Gradients of varying magnitude, so that the state sees both large and small updates.
    const std::vector<T> g = random_values<T>(n, std::ldexp(1.0, (step * 7) % 13 - 6), gen);
    grads.upload(g);
    device.step(params.span(), grads.cspan());
    host.step(std::span<T>(host_params), std::span<const T>(g));
    if (step == reload_at) {
      const auto saved = device.state();
      Device restored(options, s.s);
      restored.load_state(saved);
      device = std::move(restored);
    }
  }
  const std::string p = difference(params.download(), host_params);
  INFO("parameters: " << p);
  CHECK(p.empty());
  const auto got = device.state();
  const auto& want = host.state();
  CHECK(got.step == want.step);
  if constexpr (std::is_same_v<typename Host::state_type, optim::sgd_state<T>>) {
    const std::string d = difference(got.momentum_buffer, want.momentum_buffer);
    INFO("momentum_buffer: " << d);
    CHECK(d.empty());
  } else {
    const std::string m = difference(got.exp_avg, want.exp_avg);
    const std::string v = difference(got.exp_avg_sq, want.exp_avg_sq);
    const std::string vmax = difference(got.max_exp_avg_sq, want.max_exp_avg_sq);
    INFO("exp_avg: " << m << "; exp_avg_sq: " << v << "; max_exp_avg_sq: " << vmax);
    CHECK(m.empty());
    CHECK(v.empty());
    CHECK(vmax.empty());
  }
}

struct named_sgd {
  const char* name;
  optim::sgd_options options;
};
const named_sgd sgd_cases[] = {
    {"plain", {.lr = 0.1}},
    {"momentum", {.lr = 0.05, .momentum = 0.9}},
    {"momentum, dampening, weight decay", {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-2}},
    {"nesterov, weight decay", {.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}},
    {"maximize, momentum", {.lr = 0.02, .momentum = 0.5, .maximize = true}},
    {"maximize, weight decay, no momentum", {.lr = 0.03, .weight_decay = 0.1, .maximize = true}},
};

struct named_adamw {
  const char* name;
  optim::adamw_options options;
};
const named_adamw adamw_cases[] = {
    {"defaults", {}},
    {"amsgrad", {.lr = 1e-2, .amsgrad = true}},
    {"weight decay, eps", {.lr = 3e-3, .eps = 1e-6, .weight_decay = 0.1}},
    {"maximize, no weight decay", {.lr = 2e-3, .weight_decay = 0.0, .maximize = true}},
    // 1 - beta1 >= 0.5: torch's lerp takes its other form (from the gradient).
    {"beta1 0.4, amsgrad, maximize", {.lr = 1e-3, .beta1 = 0.4, .beta2 = 0.99, .amsgrad = true, .maximize = true}},
};

TEST_CASE("optim::cuda: the option checks are the host classes' (no device needed)") {
  CHECK_THROWS_AS(optim::cuda::sgd<float>({.lr = -1.0}), std::invalid_argument);
  CHECK_THROWS_AS(optim::cuda::sgd<double>({.lr = 0.1, .momentum = 0.0, .nesterov = true}), std::invalid_argument);
  CHECK_THROWS_AS(optim::cuda::adamw<float>({.beta1 = 1.0}), std::invalid_argument);
  CHECK_THROWS_AS(optim::cuda::adamw<double>({.eps = -1.0}), std::invalid_argument);
  optim::cuda::sgd<float> s({.lr = 0.1});
  CHECK_THROWS_AS(s.set_lr(-0.5), std::invalid_argument);
  CHECK(s.options().lr == 0.1);
  s.set_lr(0.25);
  CHECK(s.options().lr == 0.25);
  optim::cuda::adamw<float> a;
  CHECK_THROWS_AS(a.set_lr(-0.5), std::invalid_argument);
}

TEST_CASE("optim::cuda::sgd: parameters and momentum buffer bit for bit with optim::sgd, float and double") {
  gpu_or_skip();
  for (const auto& c : sgd_cases) {
    for (const std::size_t n : sizes) {
      run_and_compare<float, optim::sgd<float>, optim::cuda::sgd<float>>(c.options, n, 0, c.name);
      run_and_compare<double, optim::sgd<double>, optim::cuda::sgd<double>>(c.options, n, 0, c.name);
    }
  }
}

TEST_CASE("optim::cuda::adamw: parameters and state bit for bit with optim::adamw, float and double") {
  gpu_or_skip();
  for (const auto& c : adamw_cases) {
    for (const std::size_t n : sizes) {
      run_and_compare<float, optim::adamw<float>, optim::cuda::adamw<float>>(c.options, n, 0, c.name);
      run_and_compare<double, optim::adamw<double>, optim::cuda::adamw<double>>(c.options, n, 0, c.name);
    }
  }
}

TEST_CASE("optim::cuda: state() copied out and load_state() into a fresh optimizer continue bit for bit") {
  gpu_or_skip();
  run_and_compare<float, optim::sgd<float>, optim::cuda::sgd<float>>(sgd_cases[2].options, 1000, 9, sgd_cases[2].name);
  run_and_compare<double, optim::sgd<double>, optim::cuda::sgd<double>>(sgd_cases[3].options, 1000, 9, sgd_cases[3].name);
  run_and_compare<float, optim::adamw<float>, optim::cuda::adamw<float>>(adamw_cases[1].options, 1000, 9, adamw_cases[1].name);
  run_and_compare<double, optim::adamw<double>, optim::cuda::adamw<double>>(adamw_cases[4].options, 1000, 9, adamw_cases[4].name);

  // A host optimizer's state loads into a device one (and the device's back into a host one).
  const optim::adamw_options o{.lr = 1e-2, .amsgrad = true};
  std::mt19937_64 gen(5);
  std::vector<float> p = random_values<float>(7, 1.0, gen);
  const std::vector<float> g = random_values<float>(7, 1.0, gen);
  optim::adamw<float> host(o);
  host.step(std::span(p), std::span<const float>(g));
  optim::cuda::adamw<float> device(o);
  device.load_state(host.state());
  const auto back = device.state();
  CHECK(back.step == 1);
  CHECK(difference(back.exp_avg, host.state().exp_avg).empty());
  CHECK(difference(back.exp_avg_sq, host.state().exp_avg_sq).empty());
  CHECK(difference(back.max_exp_avg_sq, host.state().max_exp_avg_sq).empty());
}

TEST_CASE("optim::cuda: wrong lengths and host memory are refused before anything runs") {
  gpu_or_skip();
  ddp::device_buffer<float> p(8), g(7);
  optim::cuda::sgd<float> s({.lr = 0.1, .momentum = 0.9});
  CHECK_THROWS_AS(s.step(p.span(), std::span<const float>(g.data(), g.size())), std::invalid_argument);
  std::vector<float> host(8);
  CHECK_THROWS_AS(s.step(std::span(host), std::span<const float>(p.data(), p.size())), std::invalid_argument);
  s.step(p.span().first(7), std::span<const float>(g.data(), g.size()));  // values do not matter here
  CHECK_THROWS_AS(s.step(p.span(), std::span<const float>(p.data(), p.size())), std::invalid_argument);  // buffer holds 7

  optim::cuda::adamw<double> a;
  ddp::device_buffer<double> pd(3), gd(3);
  CHECK_THROWS_AS(a.step(pd.span(), std::span<const double>(gd.data(), 2)), std::invalid_argument);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

TEST_CASE("optim::cuda::unscale: grad_scaler::unscale's values and found_inf on device memory") {
  gpu_or_skip();
  for (const double init_scale : {65536.0, 3.0, 1.0}) {
    INFO("init_scale " << init_scale);
    std::mt19937_64 gen(11);
    std::vector<float> f = random_values<float>(100003, 1e3, gen);
    std::vector<double> d = random_values<double>(1000, 1e3, gen);
    f[77777] = std::numeric_limits<float>::infinity();

    optim::grad_scaler host_scaler({.init_scale = init_scale});
    optim::grad_scaler device_scaler({.init_scale = init_scale});
    device_array<float> df(f.size(), nullptr);
    device_array<double> dd(d.size(), nullptr);
    df.upload(f);
    dd.upload(d);

    CHECK(optim::cuda::unscale(dd.span(), device_scaler) == false);
    CHECK(device_scaler.found_inf() == false);
    CHECK(host_scaler.unscale(std::span(d)) == false);
    CHECK(difference(dd.download(), d).empty());

    CHECK(optim::cuda::unscale(df.span(), device_scaler) == true);
    CHECK(host_scaler.unscale(std::span(f)) == true);
    CHECK(device_scaler.found_inf() == true);
    CHECK(difference(df.download(), f).empty());  // inf * inv_scale is inf on both

    device_scaler.update(true);
    CHECK(device_scaler.found_inf() == false);
  }
  optim::grad_scaler disabled({.enabled = false});
  ddp::device_buffer<float> g(4);
  CHECK(optim::cuda::unscale(g.span(), disabled) == false);
}

TEST_CASE("optim::cuda: clip_grads_with_norm bit for bit, total_norm_squared near the host's sum") {
  gpu_or_skip();
  std::mt19937_64 gen(13);
  std::vector<float> a = random_values<float>(100003, 1.0, gen);
  std::vector<float> b = random_values<float>(7, 3.0, gen);
  device_array<float> da(a.size(), nullptr), db(b.size(), nullptr);
  da.upload(a);
  db.upload(b);

  const double host_sum = optim::total_norm_squared(std::span<const float>(a)) + optim::total_norm_squared(std::span<const float>(b));
  const double device_sum = optim::cuda::total_norm_squared(da.cspan()) + optim::cuda::total_norm_squared(db.cspan());
  CHECK(std::abs(device_sum - host_sum) <= 1e-12 * host_sum);  // the order of the sum differs, not its terms
  CHECK(optim::cuda::total_norm_squared(std::span<const double>()) == 0.0);

  const float total = static_cast<float>(std::sqrt(host_sum));
  const float host_coef = optim::clip_grads_with_norm(std::vector<std::span<float>>{std::span(a), std::span(b)}, 1.0, total);
  const float device_coef = optim::cuda::clip_grads_with_norm(std::vector<std::span<float>>{da.span(), db.span()}, 1.0, total);
  CHECK(host_coef == device_coef);
  CHECK(host_coef < 1.0f);
  CHECK(difference(da.download(), a).empty());
  CHECK(difference(db.download(), b).empty());
}

// Stands for the other ranks of a group: all_reduce(sum) adds their squared norms to this rank's.
struct other_shards_group {
  double others_squared = 0.0;
  int calls = 0;
  void all_reduce(std::span<double> x, ddp::sum) {
    x[0] += others_squared;
    ++calls;
  }
};

TEST_CASE("optim::cuda::clip_grad_norm: the sharded form all-reduces once, the replicated and group-free forms not at all; all clip by the norm of the sum of squares") {
  gpu_or_skip();
  std::mt19937_64 gen(17);
  for (const auto layout : {optim::grad_layout::sharded, optim::grad_layout::replicated}) {
    const bool sharded = layout == optim::grad_layout::sharded;
    std::vector<float> shard = random_values<float>(100003, 1.0, gen);
    device_array<float> d(shard.size(), nullptr);
    d.upload(shard);
    other_shards_group group{.others_squared = 2.5e4};
    const float total = optim::cuda::clip_grad_norm(group, std::vector<std::span<float>>{d.span()}, 1.0, layout);
    CHECK(group.calls == (sharded ? 1 : 0));
    if (!sharded) {  // the group-free form is the replicated one, bit for bit
      device_array<float> again(shard.size(), nullptr);
      again.upload(shard);
      CHECK(optim::cuda::clip_grad_norm(std::vector<std::span<float>>{again.span()}, 1.0) == total);
      CHECK(difference(again.download(), d.download()).empty());
    }
    // The reference: the host's sum of squares in double (another order than the device's tree,
    // so the totals may differ in their last float bit), then the host's clip with it.
    const double squared = optim::total_norm_squared(std::span<const float>(shard)) + (sharded ? group.others_squared : 0.0);
    const auto expected = static_cast<float>(std::sqrt(squared));
    CHECK(std::abs(total - expected) <= std::numeric_limits<float>::epsilon() * expected);
    optim::clip_grads_with_norm(std::vector<std::span<float>>{std::span(shard)}, 1.0, expected);
    const auto clipped = d.download();
    for (std::size_t i = 0; i < shard.size(); ++i) {
      if (std::abs(clipped[i] - shard[i]) > 2 * std::numeric_limits<float>::epsilon() * std::abs(shard[i])) {
        FAIL("element " << i << ": " << clipped[i] << " on the device, " << shard[i] << " on the host");
      }
    }
  }
}
}  // namespace ddp_optim_device_tests
