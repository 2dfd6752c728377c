// ddp::parameters and the parameter_container concept: built-in adapters, the customization
// points, Eigen and thrust adapters, and the rejection of non-contiguous containers.
#include <sys/wait.h>

#include <array>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "ddp/parameters.hpp"

#if __has_include(<eigen3/Eigen/Core>) || __has_include(<Eigen/Core>)
#include "ddp/adapters/eigen.hpp"
#define DDP_TEST_HAVE_EIGEN 1
#endif
#if __has_include(<thrust/host_vector.h>)
#ifndef THRUST_DEVICE_SYSTEM
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP  // host-only Thrust: no CUDA compiler here
#endif
#include "ddp/adapters/thrust.hpp"
#define DDP_TEST_HAVE_THRUST 1
#endif

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_parameters {

namespace user {
// Found by ADL.
struct mlp {
  std::vector<float> w1 = std::vector<float>(6), g1 = std::vector<float>(6), b1 = std::vector<float>(3), gb1 = std::vector<float>(3);
  friend std::vector<ddp::parameter_ref> parameters(mlp& m) {
    return {ddp::make_parameter(std::span(m.w1), std::span(m.g1), {3, 2}, "fc1.weight"),
            ddp::make_parameter(std::span(m.b1), std::span(m.gb1), {3}, "fc1.bias")};
  }
};
// Listed by a parameter_traits specialization (it also has an ADL function: the traits win).
struct legacy {
  std::array<double, 4> value{}, grad{};
};
inline std::vector<ddp::parameter_ref> parameters(legacy&) { return {}; }
// Returns (value, grad) pairs instead of parameter_refs.
struct pairs_model {
  std::vector<std::pair<std::vector<float>, std::vector<float>>> layers{{std::vector<float>(2), std::vector<float>(2)}};
};
inline auto& parameters(pairs_model& m) { return m.layers; }
// Nothing to list.
struct opaque {
  std::list<float> weights;
};
}  // namespace user

}  // namespace ddp_test_parameters

// A specialization belongs to the namespace of its template.
template <>
struct ddp::parameter_traits<ddp_test_parameters::user::legacy> {
  static std::vector<parameter_ref> parameters(ddp_test_parameters::user::legacy& m) {
    return {make_parameter(std::span(m.value), std::span(m.grad), {2, 2}, "legacy.w")};
  }
};

namespace ddp_test_parameters {

// --- the concept, at compile time -----------------------------------------------------------

using vec_pair = std::pair<std::vector<float>, std::vector<float>>;
static_assert(ddp::parameter_container<std::vector<ddp::parameter_ref>>);
static_assert(ddp::parameter_container<vec_pair>);
static_assert(ddp::parameter_container<std::vector<vec_pair>>);
static_assert(ddp::parameter_container<std::array<std::pair<std::array<double, 3>, std::array<double, 3>>, 2>>);
static_assert(ddp::parameter_container<std::pair<std::span<float>, std::span<float>>>);
static_assert(ddp::parameter_container<user::mlp>);
static_assert(ddp::parameter_container<user::legacy>);
static_assert(ddp::parameter_container<user::pairs_model>);
// Rejected: not contiguous, no dtype, mixed element types, read-only, nothing to list.
static_assert(!ddp::parameter_container<std::pair<std::list<float>, std::list<float>>>);
static_assert(!ddp::parameter_container<std::vector<std::pair<std::list<float>, std::list<float>>>>);
static_assert(!ddp::parameter_container<std::pair<std::deque<float>, std::deque<float>>>);
static_assert(!ddp::parameter_container<std::pair<std::vector<char>, std::vector<char>>>);
static_assert(!ddp::parameter_container<std::pair<std::vector<float>, std::vector<double>>>);
static_assert(!ddp::parameter_container<std::pair<std::span<const float>, std::span<const float>>>);
static_assert(!ddp::parameter_container<user::opaque>);
static_assert(!ddp::parameter_container<int>);
static_assert(ddp::tensor<std::vector<float>> && !ddp::tensor<std::list<float>>);

TEST_CASE("parameters: a (value, grad) pair of vectors is one parameter", "[parameters]") {
  vec_pair p{std::vector<float>(5, 1.f), std::vector<float>(5, 2.f)};
  const auto refs = ddp::parameters(p);
  REQUIRE(refs.size() == 1);
  CHECK(refs[0].type == ddp::dtype::float32);
  CHECK(refs[0].shape == std::vector<std::int64_t>{5});
  CHECK(refs[0].numel() == 5);
  CHECK(refs[0].bytes() == 20);
  CHECK(refs[0].memory == ddp::memory_space::host);
  CHECK(refs[0].values<float>().data() == p.first.data());
  CHECK(refs[0].grads<float>().data() == p.second.data());
  CHECK_THROWS_WITH(refs[0].values<double>(), Catch::Contains("holds float32, not float64"));
}

TEST_CASE("parameters: a vector of pairs lists them in order", "[parameters]") {
  std::vector<std::pair<std::vector<double>, std::vector<double>>> layers;
  for (std::size_t n : {3, 1, 4}) layers.emplace_back(std::vector<double>(n), std::vector<double>(n));
  const auto refs = ddp::parameters(layers);
  REQUIRE(refs.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(refs[i].type == ddp::dtype::float64);
    CHECK(refs[i].numel() == layers[i].first.size());
    CHECK(static_cast<const void*>(refs[i].grad.data()) == layers[i].second.data());
  }
}

TEST_CASE("parameters: a vector of parameter_refs is itself", "[parameters]") {
  std::vector<std::int32_t> v(4), g(4);
  std::vector<ddp::parameter_ref> list = {ddp::make_parameter(std::span(v), std::span(g), {2, 2}, "counts")};
  const auto refs = ddp::parameters(list);
  REQUIRE(refs.size() == 1);
  CHECK(refs[0].name == "counts");
  CHECK(refs[0].type == ddp::dtype::int32);
  CHECK(refs[0].shape == std::vector<std::int64_t>{2, 2});
}

TEST_CASE("parameters: user types through ADL and through parameter_traits", "[parameters]") {
  user::mlp m;
  const auto refs = ddp::parameters(m);
  REQUIRE(refs.size() == 2);
  CHECK(refs[0].name == "fc1.weight");
  CHECK(refs[0].shape == std::vector<std::int64_t>{3, 2});
  CHECK(refs[1].name == "fc1.bias");
  CHECK(static_cast<const void*>(refs[1].value.data()) == m.b1.data());

  user::legacy l;
  const auto lrefs = ddp::parameters(l);  // the specialization wins over the ADL function
  REQUIRE(lrefs.size() == 1);
  CHECK(lrefs[0].name == "legacy.w");
  CHECK(lrefs[0].type == ddp::dtype::float64);

  user::pairs_model pm;
  CHECK(ddp::parameters(pm).size() == 1);
}

TEST_CASE("parameters: make_parameter checks sizes and shapes", "[parameters]") {
  std::vector<float> v(6), g(5), g6(6);
  CHECK_THROWS_WITH(ddp::make_parameter(std::span(v), std::span(g), {}, "w"),
                    Catch::Contains("value has 6 elements but its gradient has 5"));
  CHECK_THROWS_WITH(ddp::make_parameter(std::span(v), std::span(g6), {4, 2}, "w"),
                    Catch::Contains("shape [4, 2] has 8 elements but the value has 6"));
  CHECK(ddp::make_parameter(std::span(v), std::span(g6), {3, 2}, "w").shape == std::vector<std::int64_t>{3, 2});
  CHECK(ddp::describe_parameter(3, "fc.bias") == "parameter 3 ('fc.bias')");
  CHECK(ddp::describe_parameter(3, "") == "parameter 3");
}

#ifdef DDP_TEST_HAVE_EIGEN
static_assert(ddp::tensor<Eigen::MatrixXf> && ddp::tensor<Eigen::VectorXd> && ddp::tensor<Eigen::Matrix3f>);
static_assert(ddp::tensor<Eigen::ArrayXXf> && ddp::tensor<Eigen::Map<Eigen::MatrixXf>>);
static_assert(!ddp::tensor<Eigen::Map<Eigen::MatrixXf, 0, Eigen::OuterStride<>>>);  // strided: not contiguous
#endif

TEST_CASE("parameters: Eigen matrices, vectors and maps", "[parameters][eigen]") {
#ifndef DDP_TEST_HAVE_EIGEN
  WARN("SKIPPED: Eigen is not installed (apt-get install libeigen3-dev)");
#else
  std::vector<std::pair<Eigen::MatrixXf, Eigen::MatrixXf>> layers;
  layers.emplace_back(Eigen::MatrixXf::Zero(32, 10), Eigen::MatrixXf::Zero(32, 10));
  layers.emplace_back(Eigen::MatrixXf::Zero(2, 32), Eigen::MatrixXf::Zero(2, 32));
  const auto refs = ddp::parameters(layers);
  REQUIRE(refs.size() == 2);
  CHECK(refs[0].shape == std::vector<std::int64_t>{32, 10});
  CHECK(refs[1].shape == std::vector<std::int64_t>{2, 32});
  CHECK(refs[0].type == ddp::dtype::float32);
  CHECK(static_cast<const void*>(refs[0].grad.data()) == layers[0].second.data());

  std::pair<Eigen::VectorXd, Eigen::VectorXd> bias{Eigen::VectorXd::Zero(7), Eigen::VectorXd::Zero(7)};
  const auto b = ddp::parameters(bias);
  REQUIRE(b.size() == 1);
  CHECK(b[0].shape == std::vector<std::int64_t>{7});
  CHECK(b[0].type == ddp::dtype::float64);

  float raw_v[6] = {}, raw_g[6] = {};
  std::pair<Eigen::Map<Eigen::MatrixXf>, Eigen::Map<Eigen::MatrixXf>> mapped{Eigen::Map<Eigen::MatrixXf>(raw_v, 2, 3),
                                                                             Eigen::Map<Eigen::MatrixXf>(raw_g, 2, 3)};
  const auto m = ddp::parameters(mapped);
  REQUIRE(m.size() == 1);
  CHECK(m[0].shape == std::vector<std::int64_t>{2, 3});
  CHECK(static_cast<const void*>(m[0].grad.data()) == raw_g);
#endif
}

TEST_CASE("parameters: thrust host and device vectors", "[parameters][thrust]") {
#ifndef DDP_TEST_HAVE_THRUST
  WARN("SKIPPED: Thrust is not installed (apt-get install libthrust-dev)");
#else
  std::pair<thrust::host_vector<float>, thrust::host_vector<float>> h{thrust::host_vector<float>(9), thrust::host_vector<float>(9)};
  const auto hr = ddp::parameters(h);
  REQUIRE(hr.size() == 1);
  CHECK(hr[0].memory == ddp::memory_space::host);
  CHECK(hr[0].numel() == 9);
  CHECK(static_cast<const void*>(hr[0].grad.data()) == thrust::raw_pointer_cast(h.second.data()));

  std::vector<std::pair<thrust::device_vector<double>, thrust::device_vector<double>>> d;
  d.emplace_back(thrust::device_vector<double>(4), thrust::device_vector<double>(4));
  const auto dr = ddp::parameters(d);
  REQUIRE(dr.size() == 1);
  CHECK(dr[0].type == ddp::dtype::float64);
  // With the CPP device system a device_vector is host memory; with CUDA it is device memory.
  CHECK(dr[0].memory == (THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA ? ddp::memory_space::device : ddp::memory_space::host));
#endif
}

// --- the compile-time rejection, as the compiler prints it -----------------------------------

namespace {
std::string compile(const std::string& source, std::string& output) {
#ifdef __clang__
  const std::string compiler = "clang++";
#else
  const std::string compiler = "g++";
#endif
  const std::string dir = DDP_TEST_BINARY_DIR;
  const std::string file = dir + "/parameters_compile_fail_" + std::to_string(std::hash<std::string>{}(source)) + ".cpp";
  std::ofstream(file) << source;
  const std::string include = std::string(DDP_TEST_DATA_DIR) + "/../../include";
  const std::string cmd = "command -v " + compiler + " >/dev/null 2>&1 || exit 127; " + compiler +
                          " -std=c++20 -fsyntax-only -I" + include + " " + file + " 2>&1";
  output.clear();
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "popen failed";
  char buf[4096];
  std::size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, got);
  const int status = ::pclose(pipe);
  std::remove(file.c_str());
  return WIFEXITED(status) ? std::to_string(WEXITSTATUS(status)) : "signal";
}

std::string program(const std::string& container) {
  return R"(
#include <list>
#include <span>
#include <vector>
#include "ddp/data_parallel.hpp"
struct work { void wait() {} };
struct group {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T> void broadcast(std::span<T>, int) {}
  template <class T> void all_gather(std::span<const T>, std::span<T>) {}
  template <class T, class Op> work all_reduce_async(std::span<T>, Op) { return {}; }
};
int main() {
  )" + container + R"( model;
  group g;
  ddp::distributed_data_parallel net{model, g};
  net.synchronize();
}
)";
}
}  // namespace

TEST_CASE("parameters: a std::list model is rejected at compile time with a readable message", "[parameters][compile]") {
  std::string output;
  // The control: the same program over std::vector compiles, so the failure below is the container.
  const auto ok = compile(program("std::vector<std::pair<std::vector<float>, std::vector<float>>>"), output);
  if (ok == "127") {
    WARN("SKIPPED: no C++ compiler on PATH to run the compile-fail check");
    return;
  }
  INFO(output);
  REQUIRE(ok == "0");
  const auto bad = compile(program("std::vector<std::pair<std::list<float>, std::list<float>>>"), output);
  INFO(output);
  CHECK(bad != "0");
  CHECK(output.find("is not a ddp::parameter_container") != std::string::npos);
  CHECK(output.find("std::list cannot be reduced") != std::string::npos);
}

}  // namespace ddp_test_parameters
