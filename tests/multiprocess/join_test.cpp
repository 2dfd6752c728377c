// join_context (ddp/data_parallel/join.hpp): uneven inputs over forked ranks, shm and tcp.
//
// W = 3 ranks with 3, 5 and 7 batches. Each gradient is a function of (rank, batch, parameter,
// element) on a 2^-12 grid, so every order of summing a step's gradients gives the same float;
// the reference is a plain loop in one process that sums the gradients of the ranks still
// active at each step, divides by W or by their count, and applies the same SGD step. Every
// rank must end bitwise equal to it (so to each other), with no hang, in both divisor modes.
// throw_on_early_termination: every rank throws in the 4th iteration, naming rank 0.
// Golden: nn.Linear(3, 2) + MSELoss under torch's Join (tests/data/join_golden.json, made by
// tests/scripts/make_join_golden.py), both divisor modes, within 2e-7.
#include <unistd.h>

#include <catch2/catch.hpp>

#include "ddp/backends/ring.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "ddp/group.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ddp/data_parallel.hpp"
#include "ddp/parameters.hpp"
#include "support/multiprocess.hpp"

namespace ddp_test_join {

using namespace std::chrono_literals;


using ddp::test::check;
using kind = ddp::ring_options::transport_kind;

namespace {

constexpr int world = 3;
constexpr int batches_of[world] = {3, 5, 7};
constexpr float lr = 0.25f;
const std::vector<std::size_t> sizes = {5, 3, 4, 6};

// On a 2^-12 grid with |g| <= 8 * 2^-12: any sum of three is exact in float.
float grad_of(int rank, int batch, std::size_t k, std::size_t j) {
  const auto v = static_cast<int>((static_cast<std::size_t>(rank) * 7 + static_cast<std::size_t>(batch) * 5 + k * 3 + j * 11) % 17) - 8;
  return static_cast<float>(v) / 4096.0f;
}
// Rank 0's start (the wrapper broadcasts it); the others start elsewhere on purpose.
float init_of(int rank, std::size_t k, std::size_t j) { return static_cast<float>(k + j) / 16.0f + static_cast<float>(rank); }

struct model {
  std::vector<std::vector<float>> values, grads;
  explicit model(int rank) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      values.emplace_back(sizes[k]);
      grads.emplace_back(sizes[k]);
      for (std::size_t j = 0; j < sizes[k]; ++j) values[k][j] = init_of(rank, k, j);
    }
  }
  friend std::vector<ddp::parameter_ref> parameters(model& m) {
    std::vector<ddp::parameter_ref> out;
    for (std::size_t k = 0; k < sizes.size(); ++k)
      out.push_back(ddp::make_parameter(std::span(m.values[k]), std::span(m.grads[k]), {}, "p" + std::to_string(k)));
    return out;
  }
  void sgd() {
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t j = 0; j < sizes[k]; ++j) values[k][j] = values[k][j] - lr * grads[k][j];
  }
  std::string hex() const {
    std::string s;
    char buf[16];
    for (const auto& v : values)
      for (float x : v) {
        std::snprintf(buf, sizeof buf, "%08x", std::bit_cast<std::uint32_t>(x));
        s += buf;
      }
    return s;
  }
};

/// One process, no wrapper: the averaged gradient over the ranks active at each step.
model reference(bool divide_by_initial_world_size) {
  model m(0);
  for (int s = 0; s < batches_of[world - 1]; ++s) {
    int active = 0;
    for (int r = 0; r < world; ++r) active += batches_of[r] > s ? 1 : 0;
    const float divisor = static_cast<float>(divide_by_initial_world_size ? world : active);
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t j = 0; j < sizes[k]; ++j) {
        float sum = 0;
        for (int r = 0; r < world; ++r)
          if (batches_of[r] > s) sum += grad_of(r, s, k, j);
        m.grads[k][j] = sum / divisor;
      }
    m.sgd();
  }
  return m;
}

struct store_file {
  explicit store_file(const std::string& name)
      : path(std::string(DDP_TEST_BINARY_DIR) + "/join_" + name + "_" + std::to_string(::getpid()) + ".store") {
    std::remove(path.c_str());
  }
  ~store_file() { std::remove(path.c_str()); }
  std::string path;
};

ddp::process_group<ddp::ring_backend> make_group(const std::string& path, int rank, kind transport) {
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::ring_options o;
  o.transport = transport;
  o.timeout = 60s;
  return ddp::process_group<ddp::ring_backend>(ddp::ring_backend(store, rank, world, o), {.timeout = 60s});
}

// As in data_parallel_mp_test: nobody exits before every rank has finished its last collective
// (the shm transport takes a peer that exited for a lost one while a third rank still sends).
void leave_together(const std::string& path, int rank) {
  ddp::store::file_store store(path);
  store.set_string("left/" + std::to_string(rank), "1");
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("left/" + std::to_string(r));
  store.wait(keys, 60s);
}

struct run_config {
  kind transport = kind::shm;
  ddp::join_options join{};
  ddp::data_parallel_options ddp{};
  const int* batches = batches_of;
  bool type_erased = false;  // through ddp::group (what init_process_group returns)
};

// One rank's training loop; prints the final parameters as hex.
template <class Group>
void train_in(const run_config& c, int rank, Group& group) {
  model m(rank);
  ddp::distributed_data_parallel net{m, group, c.ddp};
  ddp::join_context join{net, group, c.join};
  for (int b = 0; b < c.batches[rank]; ++b) {
    join.begin_step();
    check(join.active_ranks() == (c.join.throw_on_early_termination ? world : [&] {
            int a = 0;
            for (int r = 0; r < world; ++r) a += c.batches[r] > b ? 1 : 0;
            return a;
          }()),
          "the step's count of active ranks");
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t j = 0; j < sizes[k]; ++j) m.grads[k][j] = grad_of(rank, b, k, j);
    for (std::size_t k = sizes.size(); k-- > 0;) net.mark_ready(k);
    net.finish();
    m.sgd();
  }
  join.finish();
  std::printf("authoritative %d shadowed %zu\nparams %s\n", join.authoritative_rank(), join.shadowed_steps(), m.hex().c_str());
}

void train(const run_config& c, int rank, const std::string& path) {
  auto group = make_group(path, rank, c.transport);
  check(group.backend().on_shared_memory() == (c.transport == kind::shm), "transport chosen as asked");
  if (c.type_erased) {
    ddp::group erased(std::move(group));
    train_in(c, rank, erased);
  } else {
    train_in(c, rank, group);
  }
  leave_together(path, rank);
}

std::string params_line(const std::string& output) {
  const auto at = output.find("params ");
  if (at == std::string::npos) return {};
  return output.substr(at + 7, output.find('\n', at) - at - 7);
}

void run_uneven(const run_config& c, const std::string& name) {
  store_file sf(name);
  const auto result = ddp::test::run_ranks(world, [&](int rank) { train(c, rank, sf.path); }, 120s);
  INFO(result.describe());
  REQUIRE(result.ok());
  const std::string expected = reference(c.join.divide_by_initial_world_size).hex();
  for (int r = 0; r < world; ++r) {
    const auto& out = result.ranks[static_cast<std::size_t>(r)].output;
    INFO("rank " << r << ": " << out);
    CHECK(params_line(out) == expected);
    CHECK(out.find("authoritative 2 ") != std::string::npos);
    // Rank r shadows the steps it has no batch for: 7 - batches.
    CHECK(out.find("shadowed " + std::to_string(batches_of[world - 1] - batches_of[r]) + "\n") != std::string::npos);
  }
}


// --- against real PyTorch: nn.Linear(3, 2), MSELoss, SGD, Join (tests/data/join_golden.json) --

constexpr int g_batch = 4, g_in = 3, g_out = 2;
constexpr float g_lr = 0.125f;
// Torch divides each rank's gradient by the divisor before summing, and its mse/addmm kernels
// round in another order: about one float32 ulp after 7 steps (measured 1.5e-8 on x86-64).
constexpr double g_tolerance = 2e-7;

// The formulas of make_join_golden.py: small multiples of powers of two, exact in float.
float g_x(int r, int b, int n, int i) { return static_cast<float>((7 * r + 3 * b + 5 * n + 11 * i) % 13 - 6) / 8.0f; }
float g_y(int r, int b, int n, int k) { return static_cast<float>((5 * r + 2 * b + 3 * n + 7 * k) % 11 - 5) / 4.0f; }

struct linear {
  std::vector<float> w, gw, b, gb;
  linear() : w(g_in * g_out), gw(g_in * g_out), b(g_out), gb(g_out) {
    for (int k = 0; k < g_out; ++k) {
      for (int i = 0; i < g_in; ++i) w[static_cast<std::size_t>(k * g_in + i)] = static_cast<float>((3 * k + i) % 5 - 2) / 8.0f;
      b[static_cast<std::size_t>(k)] = static_cast<float>(2 * k - 1) / 8.0f;
    }
  }
  friend std::vector<ddp::parameter_ref> parameters(linear& m) {
    return {ddp::make_parameter(std::span(m.w), std::span(m.gw), {g_out, g_in}, "weight"),
            ddp::make_parameter(std::span(m.b), std::span(m.gb), {g_out}, "bias")};
  }
  // Gradient of mean((W x + b - y)^2) over batch x outputs.
  void backward(int r, int bt) {
    std::fill(gw.begin(), gw.end(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    for (int n = 0; n < g_batch; ++n)
      for (int k = 0; k < g_out; ++k) {
        float o = b[static_cast<std::size_t>(k)];
        for (int i = 0; i < g_in; ++i) o += w[static_cast<std::size_t>(k * g_in + i)] * g_x(r, bt, n, i);
        const float e = 2.0f * (o - g_y(r, bt, n, k)) / static_cast<float>(g_batch * g_out);
        gb[static_cast<std::size_t>(k)] += e;
        for (int i = 0; i < g_in; ++i) gw[static_cast<std::size_t>(k * g_in + i)] += e * g_x(r, bt, n, i);
      }
  }
  void sgd() {
    for (std::size_t j = 0; j < w.size(); ++j) w[j] -= g_lr * gw[j];
    for (std::size_t j = 0; j < b.size(); ++j) b[j] -= g_lr * gb[j];
  }
};

std::vector<float> from_hex(const std::string& hex) {
  std::vector<float> out;
  for (std::size_t at = 0; at + 8 <= hex.size(); at += 8) {
    std::uint32_t bits = 0;
    for (int byte = 0; byte < 4; ++byte)
      bits |= static_cast<std::uint32_t>(std::stoul(hex.substr(at + 2 * static_cast<std::size_t>(byte), 2), nullptr, 16)) << (8 * byte);
    out.push_back(std::bit_cast<float>(bits));
  }
  return out;
}

void golden_rank(int rank, const std::string& path, kind transport, bool divide) {
  std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/join_golden.json");
  check(in.good(), "tests/data/join_golden.json is readable");
  const auto golden = nlohmann::json::parse(in)["divide_by_initial_world_size"][divide ? "true" : "false"];
  auto group = make_group(path, rank, transport);
  linear m;
  ddp::distributed_data_parallel net{m, group};
  ddp::join_context join{net, group, {.divide_by_initial_world_size = divide}};
  for (int bt = 0; bt < batches_of[rank]; ++bt) {
    join.begin_step();
    m.backward(rank, bt);
    net.mark_ready(1);
    net.mark_ready(0);
    net.finish();
    m.sgd();
  }
  join.finish();
  const auto w = from_hex(golden["weight"].get<std::string>()), b = from_hex(golden["bias"].get<std::string>());
  check(w.size() == m.w.size() && b.size() == m.b.size(), "golden sizes");
  double worst = 0;
  for (std::size_t j = 0; j < w.size(); ++j) worst = std::max(worst, std::abs(static_cast<double>(w[j]) - m.w[j]));
  for (std::size_t j = 0; j < b.size(); ++j) worst = std::max(worst, std::abs(static_cast<double>(b[j]) - m.b[j]));
  std::printf("rank %d: max |torch - ddp| = %.3g\n", rank, worst);
  check(worst <= g_tolerance, "within " + std::to_string(g_tolerance) + " of torch's Join: " + std::to_string(worst));
  leave_together(path, rank);
}

}  // namespace

TEST_CASE("join: the reference is not the even run (the test can tell the divisors apart)") {
  CHECK(reference(true).hex() != reference(false).hex());
}

TEST_CASE("join: 3, 5 and 7 batches, divide by the initial world size, shm") {
  run_uneven({.transport = kind::shm}, "init_shm");
}
TEST_CASE("join: 3, 5 and 7 batches, divide by the initial world size, tcp") {
  run_uneven({.transport = kind::tcp}, "init_tcp");
}
TEST_CASE("join: 3, 5 and 7 batches, divide by the ranks still training, shm") {
  run_uneven({.transport = kind::shm, .join = {.divide_by_initial_world_size = false}}, "active_shm");
}
TEST_CASE("join: 3, 5 and 7 batches, divide by the ranks still training, tcp") {
  run_uneven({.transport = kind::tcp, .join = {.divide_by_initial_world_size = false}}, "active_tcp");
}
TEST_CASE("join: one parameter per bucket, overlap off, both divisors, shm") {
  const ddp::data_parallel_options tiny{.bucket_cap_bytes = 1, .first_bucket_bytes = 1, .overlap = false};
  run_uneven({.transport = kind::shm, .ddp = tiny}, "tiny_init");
  run_uneven({.transport = kind::shm, .join = {.divide_by_initial_world_size = false}, .ddp = tiny}, "tiny_active");
}

TEST_CASE("join: through the type-erased ddp::group, both divisors, tcp") {
  static_assert(ddp::collective_group<ddp::group>);
  run_uneven({.transport = kind::tcp, .type_erased = true}, "erased_init");
  run_uneven({.transport = kind::tcp, .join = {.divide_by_initial_world_size = false}, .type_erased = true}, "erased_active");
}

TEST_CASE("join: throw_on_early_termination throws on every rank in the 4th iteration, naming rank 0") {
  for (const kind transport : {kind::shm, kind::tcp}) {
    store_file sf(transport == kind::shm ? "throw_shm" : "throw_tcp");
    const auto result = ddp::test::run_ranks(
        world,
        [&](int rank) {
          auto group = make_group(sf.path, rank, transport);
          model m(rank);
          ddp::distributed_data_parallel net{m, group};
          ddp::join_context join{net, group, {.throw_on_early_termination = true}};
          int iteration = 0;
          try {
            for (int b = 0; b < batches_of[rank]; ++b) {
              ++iteration;
              join.begin_step();
              for (std::size_t k = 0; k < sizes.size(); ++k)
                for (std::size_t j = 0; j < sizes[k]; ++j) m.grads[k][j] = grad_of(rank, b, k, j);
              net.synchronize();
              m.sgd();
            }
            ++iteration;
            join.finish();
          } catch (const ddp::error& e) {
            std::printf("iteration %d: %s\n", iteration, e.what());
            check(e.code() == ddp::errc::mismatch, "errc::mismatch");
            leave_together(sf.path, rank);
            return;
          }
          check(false, "rank " + std::to_string(rank) + " should have thrown");
        },
        120s);
    INFO(result.describe());
    REQUIRE(result.ok());
    for (const auto& r : result.ranks) {
      INFO(r.output);
      CHECK(r.output.find("iteration 4: ") != std::string::npos);
      CHECK(r.output.find("rank 0 ran out of inputs") != std::string::npos);
    }
  }
}

TEST_CASE("join: throw_on_early_termination with even inputs does not throw") {
  static constexpr int even[world] = {4, 4, 4};
  store_file sf("even");
  const auto result = ddp::test::run_ranks(
      world, [&](int rank) { train({.join = {.throw_on_early_termination = true}, .batches = even}, rank, sf.path); }, 120s);
  INFO(result.describe());
  REQUIRE(result.ok());
  const auto first = params_line(result.ranks[0].output);
  CHECK(!first.empty());
  for (const auto& r : result.ranks) CHECK(params_line(r.output) == first);
}

TEST_CASE("join: equals real PyTorch's Join on nn.Linear(3, 2) + MSE, both divisors, shm and tcp") {
  {
    // The tolerance tells the two divisors apart: torch's results for them differ far more.
    std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/join_golden.json");
    REQUIRE(in.good());
    const auto modes = nlohmann::json::parse(in)["divide_by_initial_world_size"];
    const auto a = from_hex(modes["true"]["weight"].get<std::string>()), b = from_hex(modes["false"]["weight"].get<std::string>());
    REQUIRE(a.size() == b.size());
    double apart = 0;
    for (std::size_t j = 0; j < a.size(); ++j) apart = std::max(apart, std::abs(static_cast<double>(a[j]) - b[j]));
    CHECK(apart > 1000 * g_tolerance);
  }
  for (const kind transport : {kind::shm, kind::tcp})
    for (const bool divide : {true, false}) {
      store_file sf(std::string("golden_") + (transport == kind::shm ? "shm" : "tcp") + (divide ? "_init" : "_active"));
      const auto result = ddp::test::run_ranks(world, [&](int rank) { golden_rank(rank, sf.path, transport, divide); }, 120s);
      for (const auto& r : result.ranks) std::printf("golden %s %s: %s", transport == kind::shm ? "shm" : "tcp", divide ? "W" : "active", r.output.c_str());
      INFO(result.describe());
      CHECK(result.ok());
    }
}

}  // namespace ddp_test_join
