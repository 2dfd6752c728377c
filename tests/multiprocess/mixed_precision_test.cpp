// Mixed precision against real PyTorch (tests/data/mixed_precision_golden.json, made by
// tests/scripts/make_mixed_precision_golden.py): bfloat16 / float16 parameters with a float32
// master stepped by SGD (momentum) or AdamW, the gradients averaged in float32 or in the low
// dtype, over forked ranks (ring backend, file_store), W = 2 and 3, shm and tcp:
//  * sharded_data_parallel, stages 1 and 2, reduce_dtype float32 and the parameters' own;
//  * distributed_data_parallel + ddp::optim::master_weights: the bf16 / fp16 model reduced with
//    the default average and with ddp::reduce_in_float32, and the fp32 master gradient reduced;
//  * an inf in one rank's float16 gradient under amp_shard_optimizer: every rank skips that step,
//    the scale backs off as torch's GradScaler, and the run then equals torch's without the step.
// The script's gradients are exact in the low dtypes and their sums exact in float32, so the mean
// is one rounded division everywhere: SGD is compared bit for bit; AdamW's master within
// adamw_param_ulp_bound float ulps (adamw.hpp: torch's MKL sqrt) and its low-precision
// parameters within one ulp of their dtype (a master a few ulps off may round the other way).
// AdamW's ulps are those of max(|torch's value|, lr): each step moves a parameter by about lr
// whatever its size, so a sqrt one ulp off shows at the scale of lr, and a parameter that
// crossed zero (measured: 1e-4 after 10 steps from -0.1) is off by hundreds of its own ulps
// but at most 4 of lr's.
// Each rank starts from other values than rank 0's on purpose: the wrappers broadcast rank 0's.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "ddp/backends/ring.hpp"
#include "ddp/compression.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/optim/adamw.hpp"
#include "ddp/optim/distributed.hpp"
#include "ddp/optim/grad_scaler.hpp"
#include "ddp/optim/master_weights.hpp"
#include "ddp/optim/sgd.hpp"
#include "ddp/parameters.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "support/multiprocess.hpp"
#include "support/ring_ranks.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ddp_test_mixed_precision {

using namespace std::chrono_literals;

using ddp::test::check;
using kind = ddp::ring_options::transport_kind;

namespace {

// --- groups (tests/support/ring_ranks.hpp) ----------------------------------------------------

using group_type = ddp::test::ring_group;

template <class Fn>
void on_ranks(int p, kind transport, const std::string& name, Fn fn) {
  ddp::test::on_ring_ranks("mixed_precision", p, transport, name, std::move(fn));
}

// --- the golden data ---------------------------------------------------------------------------

const nlohmann::json& golden() {
  static const nlohmann::json data = [] {
    std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/mixed_precision_golden.json");
    REQUIRE(in.good());
    return nlohmann::json::parse(in);
  }();
  return data;
}

/// The script's case for (dtype, numel, W, reduce "float32" / "low", optimizer).
const nlohmann::json& golden_case(const std::string& dtype, std::size_t n, int w, const std::string& reduce, const std::string& opt) {
  for (const auto& c : golden()["cases"])
    if (c["dtype"] == dtype && c["numel"] == n && c["world_size"] == w && c["reduce"] == reduce && c["optimizer"] == opt) return c;
  throw std::runtime_error("no golden case " + dtype + " " + std::to_string(n) + " W=" + std::to_string(w) + " " + reduce + " " + opt);
}

std::uint32_t hex_word(const std::string& hex, std::size_t at, std::size_t bytes) {
  std::uint32_t v = 0;
  for (std::size_t b = 0; b < bytes; ++b)  // little-endian bytes
    v |= static_cast<std::uint32_t>(std::stoul(hex.substr(at + 2 * b, 2), nullptr, 16)) << (8 * b);
  return v;
}

/// Bits of every value of a hex string of `bytes`-byte little-endian values.
std::vector<std::uint32_t> bits_of(const std::string& hex, std::size_t bytes) {
  std::vector<std::uint32_t> out;
  for (std::size_t at = 0; at < hex.size(); at += 2 * bytes) out.push_back(hex_word(hex, at, bytes));
  return out;
}

/// Ulps between two IEEE values given as bits of `bits` width (sign-magnitude to a line).
std::int64_t ulps(std::uint32_t a, std::uint32_t b, int bits) {
  const std::uint32_t sign = 1u << (bits - 1);
  auto line = [&](std::uint32_t x) { return (x & sign) ? -static_cast<std::int64_t>(x & (sign - 1)) : static_cast<std::int64_t>(x); };
  return std::abs(line(a) - line(b));
}

template <class Low>
const char* dtype_name() {
  return std::is_same_v<Low, ddp::bfloat16> ? "bfloat16" : "float16";
}

// The script's formulas (exact in both low dtypes).
float init_value(std::size_t j) { return static_cast<float>(static_cast<int>((29 * j + 7) % 251) - 125) / 128.0f; }
float grad_value(int rank, int step, std::size_t j) {
  const int n = static_cast<int>((37 * j + 11 * static_cast<std::size_t>(step) + 53 * static_cast<std::size_t>(rank)) % 401) - 200;
  return std::ldexp(static_cast<float>(n), -static_cast<int>(10 + j % 3));
}

constexpr int steps = 10;

/// A flat low-precision model seen as two parameters (so buckets and shards cut it unevenly).
template <class Low>
struct model {
  std::vector<Low> values, grads;
  std::vector<ddp::parameter_ref> params;
  std::size_t split = 0;

  model(std::size_t n, int rank) : values(n), grads(n), split(n / 3 + 1) {
    for (std::size_t j = 0; j < n; ++j) values[j] = Low(init_value(j) + 3.0f * static_cast<float>(rank));
    params.push_back(ddp::make_parameter(std::span<Low>(values).first(split), std::span<Low>(grads).first(split), {}, "a"));
    params.push_back(ddp::make_parameter(std::span<Low>(values).subspan(split), std::span<Low>(grads).subspan(split), {}, "b"));
  }
  std::size_t offset(std::size_t k) const { return k == 0 ? 0 : split; }
  void load_gradients(int rank, int step, float scale = 1.0f) {
    for (std::size_t j = 0; j < grads.size(); ++j) grads[j] = Low(grad_value(rank, step, j) * scale);
  }
};

template <class Low>
std::uint32_t bits(Low x) {
  return x.bits;
}
std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// Float32 values a and b apart in ulps of max(|b|, floor).
std::int64_t ulps_above(std::uint32_t a, std::uint32_t b, float floor) {
  float x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  const float m = std::max(std::abs(y), floor);
  return static_cast<std::int64_t>(std::ceil(std::abs(static_cast<double>(x) - y) / (std::nextafter(m, 2 * m) - m)));
}

/// Compares values (flat index -> what this run holds) with the golden hex; returns failures.
/// exact: bitwise; else within `bound` ulps (of float32 values: ulps of max(|torch's|, floor)).
template <class Get>
std::string compare(const std::string& what, const std::string& hex, std::size_t bytes, std::size_t n, Get get, bool exact,
                    std::int64_t bound, float floor = 0.0f, std::size_t* compared = nullptr) {
  const auto want = bits_of(hex, bytes);
  std::size_t bad = 0, worst_at = 0;
  std::int64_t worst = 0;
  std::uint32_t worst_got = 0;
  for (std::size_t j = 0; j < n; ++j) {
    const std::optional<std::uint32_t> got = get(j);
    if (!got) continue;
    if (compared != nullptr) ++*compared;
    const std::int64_t d = bytes == 4 && !exact ? ulps_above(*got, want[j], floor) : ulps(*got, want[j], static_cast<int>(8 * bytes));
    if (d > worst) {
      worst = d;
      worst_at = j;
      worst_got = *got;
    }
    if (exact ? d != 0 : d > bound) ++bad;
  }
  if (bad == 0) return "";
  char buf[160];
  std::snprintf(buf, sizeof buf, " values off (worst %lld ulps at %zu: bits %08x, torch's %08x)\n", static_cast<long long>(worst), worst_at,
                worst_got, want[worst_at]);
  return what + ": " + std::to_string(bad) + " of " + std::to_string(n) + buf;
}

constexpr float adamw_lr = 1e-2f;
ddp::optim::sgd<float> make_sgd() { return ddp::optim::sgd<float>({.lr = 0.05, .momentum = 0.9}); }
ddp::optim::adamw<float> make_adamw() {
  return ddp::optim::adamw<float>({.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2});
}

/// Low-precision parameters and the fp32 master (flat index -> value; nullopt where this rank
/// does not hold it) against the golden record after `step`.
template <class Low, class MasterAt>
std::string check_record(const std::string& what, const nlohmann::json& c, int step, const model<Low>& m, MasterAt master_at,
                         bool sgd) {
  const auto key = std::to_string(step);
  if (!c["after"].contains(key)) return "";
  const auto& rec = c["after"][key];
  const std::size_t n = m.values.size();
  const std::string at = what + " after step " + key;
  std::size_t masters = 0;
  std::string f = compare(at + ": parameters", rec["params"], 2, n, [&](std::size_t j) { return std::optional(bits(m.values[j])); }, sgd, 1);
  f += compare(at + ": master", rec["master"], 4, n, master_at, sgd, ddp::optim::adamw_param_ulp_bound, adamw_lr, &masters);
  if (masters == 0 && n >= static_cast<std::size_t>(c["world_size"])) f += at + ": this rank holds no master value\n";
  return f;
}

// --- sharded_data_parallel ------------------------------------------------------------------------

template <class Low, class Opt>
std::string sharded_run(int rank, group_type& group, std::size_t n, int stage, bool reduce_f32, Opt opt, bool sgd) {
  const int w = static_cast<int>(group.size());
  const auto& c = golden_case(dtype_name<Low>(), n, w, reduce_f32 ? "float32" : "low", sgd ? "sgd" : "adamw");
  model<Low> m(n, rank);
  ddp::sharded_options o{.stage = stage, .bucket_cap_bytes = 256, .first_bucket_bytes = 64};
  if (reduce_f32) o.reduce_dtype = ddp::dtype::float32;
  ddp::sharded_data_parallel net(m.params, group, opt, o);
  const std::string what = std::string(dtype_name<Low>()) + " n=" + std::to_string(n) + " stage " + std::to_string(stage) +
                           (reduce_f32 ? " reduce float32 " : " reduce low ") + (sgd ? "sgd" : "adamw");
  std::string f;
  if (net.parameter_dtype() != ddp::dtype_of<Low>) f += what + ": parameter_dtype\n";
  if (net.reduce_dtype() != (reduce_f32 ? ddp::dtype::float32 : ddp::dtype_of<Low>)) f += what + ": reduce_dtype\n";
  // Flat index -> position in this rank's master shard.
  std::vector<std::optional<std::size_t>> shard_at(n);
  for (const auto& b : net.layout().buckets)
    ddp::for_each_owned(b, rank, [&](std::size_t k, std::size_t from, std::size_t to, std::size_t count) {
      for (std::size_t i = 0; i < count; ++i) shard_at[m.offset(k) + from + i] = b.shard_offset + to + i;
    });
  auto master_at = [&](std::size_t j) -> std::optional<std::uint32_t> {
    if (!shard_at[j]) return std::nullopt;
    return bits(net.shard_parameters()[*shard_at[j]]);
  };
  // The master starts from rank 0's broadcast values, widened.
  for (std::size_t j = 0; j < n; ++j)
    if (shard_at[j] && net.shard_parameters()[*shard_at[j]] != init_value(j)) f += what + ": the master starts off rank 0's values\n";
  for (int s = 1; s <= steps; ++s) {
    m.load_gradients(rank, s);
    net.synchronize();
    net.step();
    f += check_record(what, c, s, m, master_at, sgd);
  }
  const auto st = net.stats();
  if (st.master_parameter_bytes != st.shard_numel * sizeof(float) || st.shard_gradient_bytes != st.shard_numel * sizeof(float))
    f += what + ": the master and shard gradient are float32\n";
  if (stage == 1 && st.accumulation_bytes != n * sizeof(Low)) f += what + ": stage 1 accumulates in the model's gradients\n";
  return f;
}

template <class Low>
std::string sharded_suite(int rank, group_type& group) {
  std::string f;
  for (std::size_t n : {std::size_t{7}, std::size_t{1000}})
    for (int stage : {1, 2})
      for (bool reduce_f32 : {false, true}) {
        f += sharded_run<Low>(rank, group, n, stage, reduce_f32, make_sgd(), true);
        f += sharded_run<Low>(rank, group, n, stage, reduce_f32, make_adamw(), false);
      }
  return f;
}

// --- distributed_data_parallel + master_weights ----------------------------------------------------

enum class ddp_mode { model_average, model_float32_hook, master_float32 };

template <class Low, class Opt>
std::string ddp_run(int rank, group_type& group, std::size_t n, ddp_mode mode, Opt opt, bool sgd) {
  const int w = static_cast<int>(group.size());
  const bool f32 = mode == ddp_mode::master_float32;
  const auto& c = golden_case(dtype_name<Low>(), n, w, f32 ? "float32" : "low", sgd ? "sgd" : "adamw");
  const std::string what = std::string(dtype_name<Low>()) + " n=" + std::to_string(n) +
                           (mode == ddp_mode::model_average ? " DDP average" : mode == ddp_mode::model_float32_hook ? " DDP reduce_in_float32" : " DDP over the master") +
                           (sgd ? " sgd" : " adamw");
  model<Low> m(n, rank);
  std::optional<ddp::distributed_data_parallel<std::vector<ddp::parameter_ref>, group_type>> model_net;
  if (!f32) {
    model_net.emplace(m.params, group, ddp::data_parallel_options{.bucket_cap_bytes = 256, .first_bucket_bytes = 64});
    if (mode == ddp_mode::model_float32_hook) model_net->set_comm_hook(ddp::reduce_in_float32);
  } else {
    // Every rank's model starts from rank 0's values, as a DDP over the model would make it.
    group.broadcast(std::span<Low>(m.values), 0);
  }
  ddp::optim::master_weights<Low> master(m.values);
  std::optional<ddp::distributed_data_parallel<ddp::optim::master_weights<Low>, group_type>> master_net;
  if (f32) master_net.emplace(master, group);
  auto master_at = [&](std::size_t j) { return std::optional(bits(master.parameters()[j])); };
  std::string f;
  for (int s = 1; s <= steps; ++s) {
    m.load_gradients(rank, s);
    if (f32) {
      master.load_gradients(m.grads);
      master_net->synchronize();
    } else {
      model_net->synchronize();
      master.load_gradients(m.grads);
    }
    opt.step(master.parameters(), std::span<const float>(master.gradients()));
    master.store_parameters(m.values);
    f += check_record(what, c, s, m, master_at, sgd);
  }
  return f;
}

template <class Low>
std::string ddp_suite(int rank, group_type& group) {
  std::string f;
  for (std::size_t n : {std::size_t{7}, std::size_t{1000}})
    for (ddp_mode mode : {ddp_mode::model_average, ddp_mode::model_float32_hook, ddp_mode::master_float32}) {
      f += ddp_run<Low>(rank, group, n, mode, make_sgd(), true);
      f += ddp_run<Low>(rank, group, n, mode, make_adamw(), false);
    }
  return f;
}

// --- an inf in one rank's float16 gradient ------------------------------------------------------------

constexpr int inf_iteration = 6;  // the 6th of steps + 1 iterations: skipped everywhere
const ddp::optim::grad_scaler_options scaler_options{.init_scale = 1024.0, .growth_interval = 3};

/// torch's _amp_update_scale_ written out over the found_inf flags (backoff 0.5, growth 2, in double).
std::vector<float> expected_scales(const std::vector<int>& found_inf) {
  std::vector<float> out;
  float scale = static_cast<float>(scaler_options.init_scale);
  std::int64_t tracker = 0;
  for (const int inf : found_inf) {
    if (inf != 0) {
      scale = static_cast<float>(static_cast<double>(scale) * 0.5);
      tracker = 0;
    } else if (++tracker == scaler_options.growth_interval) {
      scale = static_cast<float>(static_cast<double>(scale) * 2.0);
      tracker = 0;
    }
    out.push_back(scale);
  }
  return out;
}

std::string inf_run(int rank, group_type& group, int stage, bool reduce_f32) {
  using Low = ddp::float16;
  constexpr std::size_t n = 7;
  const int w = static_cast<int>(group.size());
  const auto& c = golden_case("float16", n, w, reduce_f32 ? "float32" : "low", "sgd");
  const std::string what = "inf, stage " + std::to_string(stage) + (reduce_f32 ? " reduce float32" : " reduce float16");
  model<Low> m(n, rank);
  ddp::optim::grad_scaler scaler(scaler_options);
  auto sgd = make_sgd();
  ddp::optim::amp_shard_optimizer amp(sgd, group, scaler);
  ddp::sharded_options o{.stage = stage, .bucket_cap_bytes = 8, .first_bucket_bytes = 8};
  if (reduce_f32) o.reduce_dtype = ddp::dtype::float32;
  ddp::sharded_data_parallel net(m.params, group, amp, o);
  std::vector<std::optional<std::size_t>> shard_at(n);
  for (const auto& b : net.layout().buckets)
    ddp::for_each_owned(b, rank, [&](std::size_t k, std::size_t from, std::size_t to, std::size_t count) {
      for (std::size_t i = 0; i < count; ++i) shard_at[m.offset(k) + from + i] = b.shard_offset + to + i;
    });
  auto master_at = [&](std::size_t j) -> std::optional<std::uint32_t> {
    if (!shard_at[j]) return std::nullopt;
    return bits(net.shard_parameters()[*shard_at[j]]);
  };
  std::string f;
  std::vector<float> scales;
  std::vector<int> flags;
  int step = 0;  // torch's steps taken
  for (int it = 1; it <= steps + 1; ++it) {
    const bool inject = it == inf_iteration;
    // A power-of-two scale: the scaled float16 gradients and their unscaling are exact.
    m.load_gradients(rank, step + 1, scaler.get_scale());
    if (inject && rank == w - 1) m.grads[2] = Low(std::numeric_limits<float>::infinity());
    const auto before = m.values;
    net.synchronize();
    net.step();
    flags.push_back(inject ? 1 : 0);
    scales.push_back(scaler.get_scale());
    if (amp.last().found_inf != inject) f += what + ": iteration " + std::to_string(it) + ": the agreed found_inf\n";
    if (inject) {
      for (std::size_t j = 0; j < n; ++j)
        if (bits(m.values[j]) != bits(before[j])) f += what + ": the skipped step changed the parameters\n";
    } else {
      ++step;
      f += check_record(what, c, step, m, master_at, true);
    }
  }
  if (step != steps) f += what + ": " + std::to_string(step) + " steps taken\n";
  const auto want = expected_scales(flags);
  for (std::size_t i = 0; i < want.size(); ++i)
    if (scales[i] != want[i])
      f += what + ": scale after iteration " + std::to_string(i + 1) + " is " + std::to_string(scales[i]) + ", torch's rule gives " +
           std::to_string(want[i]) + "\n";
  return f;
}

// --- what is rejected ---------------------------------------------------------------------------------

std::string rejections(group_type& group) {
  std::string f;
  auto rejected = [&](const std::string& what, auto make, const std::string& needle) {
    try {
      make();
      f += what + ": accepted\n";
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::invalid_argument || std::string(e.what()).find(needle) == std::string::npos)
        f += what + ": " + e.what() + "\n";
    }
  };
  std::vector<ddp::bfloat16> lv(5), lg(5);
  std::vector<float> fv(4), fg(4);
  std::vector<double> dv(4), dg(4);
  std::vector<ddp::parameter_ref> mixed{ddp::make_parameter(std::span<ddp::bfloat16>(lv), std::span<ddp::bfloat16>(lg)),
                                        ddp::make_parameter(std::span<float>(fv), std::span<float>(fg))};
  std::vector<ddp::parameter_ref> low{ddp::make_parameter(std::span<ddp::bfloat16>(lv), std::span<ddp::bfloat16>(lg))};
  std::vector<ddp::parameter_ref> wide{ddp::make_parameter(std::span<double>(dv), std::span<double>(dg))};
  auto sgd = make_sgd();
  ddp::optim::sgd<double> sgd64;
  rejected("bf16 and float parameters in one model", [&] { ddp::sharded_data_parallel net(mixed, group, sgd); }, "one dtype");
  rejected("bf16 parameters under a double optimizer", [&] { ddp::sharded_data_parallel net(low, group, sgd64); }, "float16 / bfloat16 under a float");
  rejected("double parameters under a float optimizer", [&] { ddp::sharded_data_parallel net(wide, group, sgd); }, "optimizer's value_type");
  rejected("reduce_dtype float16 for bf16 parameters",
           [&] { ddp::sharded_data_parallel net(low, group, sgd, ddp::sharded_options{.reduce_dtype = ddp::dtype::float16}); }, "reduce_dtype float16");
  return f;
}

}  // namespace

TEST_CASE("mixed precision: sharded_data_parallel with bf16 / fp16 parameters and an fp32 master equals torch") {
  golden();  // read before the ranks fork
  for (kind t : {kind::shm, kind::tcp})
    for (int p : {2, 3})
      on_ranks(p, t, "sharded", [](int rank, group_type& group) {
        const std::string f = rejections(group) + sharded_suite<ddp::bfloat16>(rank, group) + sharded_suite<ddp::float16>(rank, group);
        check(f.empty(), "\n" + f);
      });
}

TEST_CASE("mixed precision: distributed_data_parallel + master_weights, reduced in the low dtype or float32, equals torch") {
  golden();
  for (kind t : {kind::shm, kind::tcp})
    for (int p : {2, 3})
      on_ranks(p, t, "ddp", [](int rank, group_type& group) {
        const std::string f = ddp_suite<ddp::bfloat16>(rank, group) + ddp_suite<ddp::float16>(rank, group);
        check(f.empty(), "\n" + f);
      });
}

TEST_CASE("mixed precision: an inf in one rank's fp16 gradient skips the step on every rank and backs the scale off") {
  golden();
  for (kind t : {kind::shm, kind::tcp})
    for (int p : {2, 3})
      on_ranks(p, t, "inf", [](int rank, group_type& group) {
        std::string f;
        for (int stage : {1, 2})
          for (bool reduce_f32 : {false, true}) f += inf_run(rank, group, stage, reduce_f32);
        check(f.empty(), "\n" + f);
      });
}

}  // namespace ddp_test_mixed_precision
