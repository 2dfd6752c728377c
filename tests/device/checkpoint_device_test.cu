// ddp/checkpoint.hpp with parameters in device memory (ddp/checkpoint/cuda.hpp): saved from
// device memory, loaded into other device memory and into host memory, and a host-saved
// checkpoint loaded into device memory. Values are compared bit for bit against the host arrays
// they were uploaded from (random bit patterns: NaN payloads, -0.0 and subnormals included), and
// a device-saved file must equal, byte for byte, the host-saved file of the same values: the
// format is one, so Python reads both alike. Without a GPU every case says SKIPPED and why.
#include <ddp/adapters/thrust.hpp>
#include <ddp/backends/cuda_memory.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/checkpoint/cuda.hpp>  // included by checkpoint.hpp in this build already: checks that twice is fine

#include <cuda_runtime.h>
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>

#include <catch2/catch.hpp>
#include "support/skip.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ddp_checkpoint_device_tests {

namespace fs = std::filesystem;
namespace ckpt = ddp::checkpoint;

void gpu_or_skip() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) ddp::test::skip(std::string("no CUDA device visible on this machine (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")");
  if (n == 0) ddp::test::skip("no CUDA device visible on this machine");
}

/// A world of one: what save() needs of a process group.
struct solo_group {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void broadcast(std::span<T>, int) {}
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    std::memcpy(out.data(), in.data(), in.size_bytes());
  }
  void barrier() {}
};

struct temp_dir {
  fs::path path;
  temp_dir() {
    char tmpl[] = "/tmp/ddp_checkpoint_device_test.XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<std::byte> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  if (!c.empty()) std::memcpy(out.data(), c.data(), c.size());
  return out;
}

/// Random bit patterns of type T (as its unsigned integer of that size, then reinterpreted).
template <class T, class U>
std::vector<T> random_bits(std::size_t n, std::uint32_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<T> v(n);
  for (auto& x : v) {
    const U bits = static_cast<U>(gen());
    std::memcpy(&x, &bits, sizeof x);
  }
  return v;
}

/// The host reference: what every copy of the model must hold, bit for bit.
struct reference {
  std::vector<float> weight = random_bits<float, std::uint32_t>(3 * 1003, 1);
  std::vector<double> bias = random_bits<double, std::uint64_t>(37, 2);
  std::vector<std::int64_t> counts = random_bits<std::int64_t, std::uint64_t>(5, 3);
  std::vector<float> empty;
};

/// A model in device memory: each parameter's value and gradient in device buffers.
struct device_model {
  ddp::device_buffer<float> weight, weight_grad;
  ddp::device_buffer<double> bias, bias_grad;
  ddp::device_buffer<std::int64_t> counts, counts_grad;
  ddp::device_buffer<float> empty, empty_grad;

  explicit device_model(const reference& r)
      : weight(r.weight.size()), weight_grad(r.weight.size()), bias(r.bias.size()), bias_grad(r.bias.size()),
        counts(r.counts.size()), counts_grad(r.counts.size()) {}

  /// Fills every value with `byte` (so a load that copies nothing is seen).
  void clear(int byte) {
    REQUIRE(cudaMemset(weight.data(), byte, weight.size() * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMemset(bias.data(), byte, bias.size() * sizeof(double)) == cudaSuccess);
    REQUIRE(cudaMemset(counts.data(), byte, counts.size() * sizeof(std::int64_t)) == cudaSuccess);
  }
  void upload(const reference& r) {
    REQUIRE(cudaMemcpy(weight.data(), r.weight.data(), r.weight.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(bias.data(), r.bias.data(), r.bias.size() * sizeof(double), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(counts.data(), r.counts.data(), r.counts.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice) ==
            cudaSuccess);
  }
  reference download() const {
    reference r;
    REQUIRE(cudaMemcpy(r.weight.data(), weight.data(), r.weight.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(r.bias.data(), bias.data(), r.bias.size() * sizeof(double), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(r.counts.data(), counts.data(), r.counts.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    return r;
  }
  std::vector<ddp::parameter_ref> parameters() {
    const auto d = ddp::memory_space::device;
    return {ddp::make_parameter(weight.span(), weight_grad.span(), {3, 1003}, "weight", d),
            ddp::make_parameter(bias.span(), bias_grad.span(), {}, "bias", d),
            ddp::make_parameter(counts.span(), counts_grad.span(), {5}, "counts", d),
            ddp::make_parameter(empty.span(), empty_grad.span(), {0}, "empty", d)};
  }
};

/// The same model in host memory.
struct host_model {
  reference values, grads;
  std::vector<ddp::parameter_ref> parameters() {
    return {ddp::make_parameter(std::span(values.weight), std::span(grads.weight), {3, 1003}, "weight"),
            ddp::make_parameter(std::span(values.bias), std::span(grads.bias), {}, "bias"),
            ddp::make_parameter(std::span(values.counts), std::span(grads.counts), {5}, "counts"),
            ddp::make_parameter(std::span(values.empty), std::span(grads.empty), {0}, "empty")};
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void check_equal(const reference& got, const reference& want) {
  CHECK(same_bits(got.weight, want.weight));
  CHECK(same_bits(got.bias, want.bias));
  CHECK(same_bits(got.counts, want.counts));
}

/// Saves `params` (with an optimizer span in host memory next to them) as step 7 under dir.
fs::path save(const fs::path& dir, const std::vector<ddp::parameter_ref>& params) {
  std::vector<float> momentum{1.0f, -2.0f, 3.5f};
  ckpt::state st;
  st.add_parameters(params);
  st.add("optim.momentum", std::span(momentum));
  st.sampler = {.seed = 4, .epoch = 2, .batches_done = 9};
  st.metadata["loss"] = "0.25";
  solo_group g;
  return ckpt::save(g, dir, 7, st);
}

ckpt::loaded load(const fs::path& step_dir, const std::vector<ddp::parameter_ref>& params) {
  std::vector<float> momentum(3);
  ckpt::state st;
  st.add_parameters(params);
  st.add("optim.momentum", std::span(momentum));
  const auto info = ckpt::load(step_dir, 0, 1, st);
  CHECK(momentum == std::vector<float>{1.0f, -2.0f, 3.5f});
  return info;
}

TEST_CASE("checkpoint: parameters in device memory save and load back into device and host memory, bit for bit") {
  gpu_or_skip();
  const reference ref;
  temp_dir dir;

  device_model saved(ref);
  saved.upload(ref);
  const fs::path step = save(dir.path / "device", saved.parameters());
  REQUIRE(ckpt::latest(dir.path / "device").has_value());

  // Into other device memory.
  device_model other(ref);
  other.clear(0x5a);
  const auto info = load(step, other.parameters());
  CHECK(info.step == 7);
  CHECK(info.sampler == ckpt::sampler_position{.seed = 4, .epoch = 2, .batches_done = 9});
  check_equal(other.download(), ref);

  // Into host memory.
  host_model host;
  load(step, host.parameters());
  check_equal(host.values, ref);

  // The same file as a host save of the same values: one format, whatever memory it came from.
  host_model from_host;
  from_host.values = ref;
  const fs::path host_step = save(dir.path / "host", from_host.parameters());
  CHECK(file_bytes(step / "replicated.safetensors") == file_bytes(host_step / "replicated.safetensors"));
  CHECK(file_bytes(step / "index.json") == file_bytes(host_step / "index.json"));
}

TEST_CASE("checkpoint: a host-saved checkpoint loads into device memory") {
  gpu_or_skip();
  const reference ref;
  temp_dir dir;
  host_model host;
  host.values = ref;
  const fs::path step = save(dir.path, host.parameters());

  device_model dev(ref);
  dev.clear(0xa5);
  load(step, dev.parameters());
  check_equal(dev.download(), ref);
}

TEST_CASE("checkpoint: thrust::device_vector parameters, through the adapter, round trip") {
  gpu_or_skip();
  const reference ref;
  using pair = std::pair<thrust::device_vector<float>, thrust::device_vector<float>>;
  std::vector<pair> model;
  model.emplace_back(thrust::device_vector<float>(ref.weight.begin(), ref.weight.end()),
                     thrust::device_vector<float>(ref.weight.size(), 0.0f));
  REQUIRE(ddp::parameters(model).at(0).memory == ddp::memory_space::device);
  temp_dir dir;
  ckpt::state st;
  st.add_parameters(model);
  solo_group g;
  const fs::path step = ckpt::save(g, dir.path, 1, st);

  std::vector<pair> other;
  other.emplace_back(thrust::device_vector<float>(ref.weight.size(), 0.0f), thrust::device_vector<float>(ref.weight.size(), 0.0f));
  ckpt::state back;
  back.add_parameters(other);
  ckpt::load(step, 0, 1, back);
  const thrust::host_vector<float> got = other[0].first;
  CHECK(same_bits(std::vector<float>(got.begin(), got.end()), ref.weight));
}

TEST_CASE("checkpoint: a device load whose shape differs is refused before anything is copied") {
  gpu_or_skip();
  const reference ref;
  temp_dir dir;
  device_model saved(ref);
  saved.upload(ref);
  const fs::path step = save(dir.path, saved.parameters());

  ddp::device_buffer<double> bias(ref.bias.size() + 1), grad(ref.bias.size() + 1);
  REQUIRE(cudaMemset(bias.data(), 0x11, bias.size() * sizeof(double)) == cudaSuccess);
  ckpt::state st;
  st.add_parameters({ddp::make_parameter(bias.span(), grad.span(), {}, "bias", ddp::memory_space::device)});
  try {
    ckpt::load(step, 0, 1, st);
    FAIL("expected errc::config");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK(std::string(e.what()).find("'model.bias': shape [37] in the checkpoint, [38] here") != std::string::npos);
  }
  std::vector<double> after(bias.size());
  REQUIRE(cudaMemcpy(after.data(), bias.data(), after.size() * sizeof(double), cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<double> untouched(bias.size());
  std::memset(untouched.data(), 0x11, untouched.size() * sizeof(double));
  CHECK(same_bits(after, untouched));
}

}  // namespace ddp_checkpoint_device_tests
