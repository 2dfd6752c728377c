// ddp/optim/distributed.hpp over forked ranks (ring backend, file_store), W = 2, 3, 4, shm and tcp:
//  * found_inf agreement: an inf, -inf or NaN in ONE rank's gradients at one step of a 30-step
//    run makes every rank skip that step and back off; the scale trajectory is the same on every
//    rank and equals an independent plain loop of torch's update rule over the known schedule.
//    A second scaler per rank fed its own flag shows the trajectories the check would catch.
//  * the same through sharded_data_parallel (stage 1 and 2) with amp_shard_optimizer, where the
//    inf reaches the shard of one rank only;
//  * clip_grad_norm replicated (DDP) and sharded (padded shards of a known vector): the norm
//    against a long double one within the header's bounds, the clipped values bitwise grad * coef
//    with coef computed here, and max_norm above the norm leaving the gradients bitwise unchanged.
#include <unistd.h>

#include <catch2/catch.hpp>

#include "ddp/backends/ring.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ddp/data_parallel.hpp"
#include "ddp/optim/distributed.hpp"
#include "ddp/optim/grad_scaler.hpp"
#include "ddp/optim/sgd.hpp"
#include "ddp/parameters.hpp"
#include "support/multiprocess.hpp"
#include "support/ring_ranks.hpp"

namespace ddp_test_optim_distributed {

using namespace std::chrono_literals;


using ddp::test::check;
using kind = ddp::ring_options::transport_kind;

namespace {

// --- groups (tests/support/ring_ranks.hpp) ----------------------------------------------------

using group_type = ddp::test::ring_group;

template <class Fn>
void on_ranks(int p, kind transport, const std::string& name, Fn fn) {
  ddp::test::on_ring_ranks("optim_dist", p, transport, name, std::move(fn));
}

/// Every rank's `mine`, rank after rank.
template <class T>
std::vector<T> gather(group_type& group, const std::vector<T>& mine) {
  std::vector<T> all(mine.size() * static_cast<std::size_t>(group.size()));
  group.all_gather(std::span<const T>(mine), std::span<T>(all));
  return all;
}

template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// --- the inf schedule and the independent scale trajectory ---------------------------------------

constexpr int steps = 30;
const ddp::optim::grad_scaler_options scaler_options{.init_scale = 1024.0, .growth_interval = 3};

struct inf_schedule {
  int rank = 0;
  int step = 0;
  int kind = 0;  // 0: inf, 1: -inf, 2: NaN
};

/// Drawn by the parent (so every forked rank knows it): a random rank, step and kind of value.
inf_schedule draw(int p, unsigned salt) {
  std::mt19937 rng(20261205u + salt);
  inf_schedule s;
  s.rank = std::uniform_int_distribution<int>(0, p - 1)(rng);
  s.step = std::uniform_int_distribution<int>(1, steps - 2)(rng);
  s.kind = std::uniform_int_distribution<int>(0, 2)(rng);
  return s;
}

float bad_value(int k) {
  return k == 0 ? std::numeric_limits<float>::infinity()
                : k == 1 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
}

/// The scale after each step's update, for the given per-step found_inf: torch's
/// _amp_update_scale_ written out here (backoff 0.5 and growth 2 in double, rounded to float;
/// the tracker counts successes up to growth_interval), not the scaler's code.
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

/// Grid values (multiples of 2^-8, |g| < 4): times a power-of-two scale and back, exact.
float grid_grad(int step, std::size_t j, int rank = 0) {
  return static_cast<float>(std::round(256.0 * 3.0 * std::sin(0.37 * static_cast<double>(j) + 0.11 * step + 0.5 * rank)) / 256.0);
}

// --- found_inf agreement over plain gradients (DDP: every rank holds the full gradients) ----------

void agreement_run(int rank, group_type& group, const inf_schedule& sched) {
  const int p = static_cast<int>(group.size());
  constexpr std::size_t n = 10;
  ddp::optim::grad_scaler scaler(scaler_options);
  ddp::optim::grad_scaler local_only(scaler_options);  // fed its own rank's flag: what no agreement gives
  std::vector<float> params(n, 1.0f), grads(n);
  std::vector<float> scales, local_scales;
  std::vector<std::int32_t> local_flags, stepped;
  for (int s = 0; s < steps; ++s) {
    const float scale = scaler.get_scale();
    for (std::size_t j = 0; j < n; ++j) grads[j] = grid_grad(s, j) * scale;
    if (rank == sched.rank && s == sched.step) grads[3] = bad_value(sched.kind);
    bool local = false;
    for (const float g : grads) local |= !std::isfinite(g);
    local_flags.push_back(local ? 1 : 0);

    const auto v = ddp::optim::unscale_and_agree(group, scaler, std::span<float>(grads));
    check(v.found_inf == (s == sched.step), "step " + std::to_string(s) + ": the agreed found_inf is the schedule's");
    check(v.step == !v.found_inf, "step " + std::to_string(s) + ": step exactly when no rank found an inf");
    stepped.push_back(v.step ? 1 : 0);
    if (v.step) {
      for (std::size_t j = 0; j < n; ++j) {
        check(grads[j] == grid_grad(s, j), "unscaled gradients are the unscaled values (power-of-two scale)");
        params[j] -= 0.125f * grads[j];
      }
    }
    scaler.update(v.found_inf);
    scales.push_back(scaler.get_scale());
    local_only.update(local);
    local_scales.push_back(local_only.get_scale());
  }

  // Every rank: the same trajectory, and it is the independent one over the schedule.
  std::vector<int> schedule(steps, 0);
  schedule[static_cast<std::size_t>(sched.step)] = 1;
  const auto expected = expected_scales(schedule);
  const auto all_scales = gather(group, scales);
  const auto all_stepped = gather(group, stepped);
  const auto all_params = gather(group, params);
  for (int r = 0; r < p; ++r) {
    const auto at = static_cast<std::size_t>(r) * steps;
    check(same_bits(std::span<const float>(all_scales).subspan(at, steps), std::span<const float>(expected)),
          "rank " + std::to_string(r) + "'s scale trajectory is the independent one");
    for (int s = 0; s < steps; ++s)
      check(all_stepped[at + static_cast<std::size_t>(s)] == (s == sched.step ? 0 : 1),
            "rank " + std::to_string(r) + " skips exactly step " + std::to_string(sched.step));
    check(same_bits(std::span<const float>(all_params).subspan(static_cast<std::size_t>(r) * n, n), std::span<const float>(params)),
          "parameters identical on every rank");
  }
  const auto k = static_cast<std::size_t>(sched.step);
  const float before = k == 0 ? static_cast<float>(scaler_options.init_scale) : expected[k - 1];
  check(expected[k] == before * 0.5f, "the injected step backs off");

  // Without agreement: the local flags differ across ranks on the injected step, and the scalers
  // fed them end up on different trajectories, which the equality check above would reject.
  const auto all_local = gather(group, local_flags);
  const auto all_local_scales = gather(group, local_scales);
  bool flags_differ = false, trajectories_differ = false;
  for (int r = 0; r < p; ++r) {
    const auto at = static_cast<std::size_t>(r) * steps;
    flags_differ |= all_local[at + k] != all_local[k];
    trajectories_differ |= !same_bits(std::span<const float>(all_local_scales).subspan(at, steps),
                                      std::span<const float>(all_local_scales).subspan(0, steps));
    check(all_local[at + k] == (r == sched.rank ? 1 : 0), "only the injected rank saw the inf locally");
  }
  check(flags_differ, "the local flags differ across ranks on the injected step");
  check(trajectories_differ, "scalers fed their local flags diverge");
}

// --- the same through sharded_data_parallel ------------------------------------------------------

struct model {
  std::vector<std::size_t> sizes{7, 13};
  std::vector<std::vector<float>> values, grads;
  model() {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      values.emplace_back(sizes[k]);
      grads.emplace_back(sizes[k]);
      for (std::size_t j = 0; j < sizes[k]; ++j) values[k][j] = static_cast<float>(0.3 * std::sin(1.7 * static_cast<double>(j) + 0.9 * k));
    }
  }
  friend std::vector<ddp::parameter_ref> parameters(model& m) {
    std::vector<ddp::parameter_ref> out;
    for (std::size_t k = 0; k < m.sizes.size(); ++k)
      out.push_back(ddp::make_parameter(std::span<float>(m.values[k]), std::span<float>(m.grads[k]),
                                        {static_cast<std::int64_t>(m.sizes[k])}, "p" + std::to_string(k)));
    return out;
  }
};

void sharded_run(int rank, group_type& group, const inf_schedule& sched, int stage) {
  const int p = static_cast<int>(group.size());
  constexpr double lr = 0.25, max_norm = 2.0;
  model m;
  ddp::optim::grad_scaler scaler(scaler_options);
  ddp::optim::sgd<float> sgd({.lr = lr});
  ddp::optim::amp_shard_optimizer amp(sgd, group, scaler, {.max_norm = max_norm});
  // Small buckets: several, each padded, so that padding sits inside the shard too.
  ddp::sharded_data_parallel net(m, group, amp, {.stage = stage, .bucket_cap_bytes = 40, .first_bucket_bytes = 40});

  // The reference: SGD in double on the mean gradient, clipped with its exact norm.
  std::vector<std::vector<double>> ref(m.sizes.size());
  for (std::size_t k = 0; k < m.sizes.size(); ++k) ref[k].assign(m.values[k].begin(), m.values[k].end());
  std::vector<float> scales;
  std::vector<std::int32_t> shard_saw_inf;
  for (int s = 0; s < steps; ++s) {
    const float scale = scaler.get_scale();
    std::vector<std::vector<double>> mean(m.sizes.size());
    double squared = 0.0;
    for (std::size_t k = 0; k < m.sizes.size(); ++k) {
      mean[k].assign(m.sizes[k], 0.0);
      for (std::size_t j = 0; j < m.sizes[k]; ++j) {
        const std::size_t e = 100 * k + j;
        m.grads[k][j] = grid_grad(s, e, rank) * scale;
        for (int r = 0; r < p; ++r) mean[k][j] += grid_grad(s, e, r) / p;
        squared += mean[k][j] * mean[k][j];
      }
    }
    if (rank == sched.rank && s == sched.step) m.grads[1][5] = bad_value(sched.kind);
    const auto before = m.values;
    net.synchronize();
    net.step();

    check(amp.last().found_inf == (s == sched.step), "step " + std::to_string(s) + ": the agreed verdict is the schedule's");
    if (s == sched.step) {
      check(m.values == before, "the skipped step leaves the parameters as they were");
    } else {
      check(m.values != before, "a step taken changes the parameters");
      const double coef = std::min(max_norm / (std::sqrt(squared) + 1e-6), 1.0);
      for (std::size_t k = 0; k < m.sizes.size(); ++k)
        for (std::size_t j = 0; j < m.sizes[k]; ++j) ref[k][j] -= lr * coef * mean[k][j];
    }
    scales.push_back(scaler.get_scale());
    // Where the inf went: the shard gradient the optimizer saw is still in the wrapper.
    bool saw = false;
    for (const float g : net.shard_gradients()) saw |= !std::isfinite(g);
    shard_saw_inf.push_back(saw ? 1 : 0);
    // Padding (shard elements past a bucket's numel) is zero, so it adds nothing to the norm.
    for (const auto& b : net.layout().buckets)
      for (std::size_t i = 0; i < b.shard; ++i)
        if (static_cast<std::size_t>(rank) * b.shard + i >= b.numel)
          check(net.shard_gradients()[b.shard_offset + i] == 0.0f, "padding of the shard gradient is zero");
  }

  // The adapter forwards the wrapped optimizer's state(), so stats() counts it as before.
  const auto stats = net.stats();
  check(stats.steps == steps && stats.optimizer_state_bytes == ddp::detail::optimizer_state_bytes(sgd), "stats see the wrapped optimizer");

  std::vector<int> schedule(steps, 0);
  schedule[static_cast<std::size_t>(sched.step)] = 1;
  const auto expected = expected_scales(schedule);
  check(same_bits(std::span<const float>(scales), std::span<const float>(expected)), "the scale trajectory is the independent one");
  const auto all_scales = gather(group, scales);
  const auto all_saw = gather(group, shard_saw_inf);
  int ranks_that_saw = 0;
  for (int r = 0; r < p; ++r) {
    check(same_bits(std::span<const float>(all_scales).subspan(static_cast<std::size_t>(r) * steps, steps), std::span<const float>(scales)),
          "the same trajectory on every rank");
    ranks_that_saw += all_saw[static_cast<std::size_t>(r) * steps + static_cast<std::size_t>(sched.step)];
  }
  check(ranks_that_saw == 1, "the inf reached one rank's shard only (" + std::to_string(ranks_that_saw) + " ranks saw it)");
  for (std::size_t k = 0; k < m.sizes.size(); ++k)
    for (std::size_t j = 0; j < m.sizes[k]; ++j)
      check(std::abs(m.values[k][j] - ref[k][j]) <= 1e-5 * (1.0 + std::abs(ref[k][j])),
            "parameter " + std::to_string(k) + "[" + std::to_string(j) + "] = " + std::to_string(m.values[k][j]) +
                " against the reference " + std::to_string(ref[k][j]));
}

// --- clipping -----------------------------------------------------------------------------------

const std::vector<std::size_t> clip_sizes{7, 13, 300, 1001};

std::vector<std::vector<float>> clip_grads() {
  std::vector<std::vector<float>> g;
  std::size_t e = 0;
  for (std::size_t k = 0; k < clip_sizes.size(); ++k) {
    g.emplace_back(clip_sizes[k]);
    for (auto& v : g.back()) v = static_cast<float>(std::sin(0.37 * static_cast<double>(e++) + 0.1) * static_cast<double>(1 + k));
  }
  return g;
}

std::vector<std::span<float>> spans_of(std::vector<std::vector<float>>& g) {
  std::vector<std::span<float>> out;
  for (auto& v : g) out.emplace_back(v);
  return out;
}

/// torch's clip coefficient written out here: min((total + 1e-6)^-1 * max_norm, 1) in float.
float coefficient(float total, double max_norm) {
  const float shifted = total + 1e-6f;
  const float coef = (1.0f / shifted) * static_cast<float>(max_norm);
  return std::min(coef, 1.0f);
}

void clip_run(int rank, group_type& group) {
  using ddp::optim::grad_layout;
  const int p = static_cast<int>(group.size());
  const auto original = clip_grads();
  std::size_t n = 0;
  long double exact_sq = 0.0L;
  std::vector<float> flat;
  for (const auto& v : original)
    for (const float x : v) {
      exact_sq += static_cast<long double>(x) * static_cast<long double>(x);
      flat.push_back(x);
      ++n;
    }
  const long double exact = std::sqrt(exact_sq);
  const double max_norm = 1.5;
  char buf[256];

  // Replicated (DDP): every rank has the full gradients.
  auto full = original;
  const float total_full = ddp::optim::clip_grad_norm(group, spans_of(full), max_norm, grad_layout::replicated);
  const double err_full = static_cast<double>(std::abs(static_cast<long double>(total_full) - exact) / exact);
  std::snprintf(buf, sizeof buf, "replicated: norm %.9g, exact %.12Lg, relative %.3g (bound %.3g)\n", static_cast<double>(total_full), exact,
                err_full, ddp::optim::sharded_norm_torch_bound<float>(n, p));
  if (rank == 0) std::printf("%s", buf);
  check(err_full <= ddp::optim::sharded_norm_torch_bound<float>(n, p), buf);
  const float coef_full = coefficient(total_full, max_norm);
  check(coef_full < 1.0f, "this case clips");
  for (std::size_t k = 0; k < full.size(); ++k)
    for (std::size_t j = 0; j < full[k].size(); ++j) {
      const float want = original[k][j] * coef_full;
      check(std::memcmp(&full[k][j], &want, sizeof want) == 0, "replicated: clipped = grad * coef");
    }

  // Sharded: the flat vector padded to a multiple of W, rank r owning [r * shard, (r + 1) * shard),
  // held as two spans.
  const std::size_t shard = (n + static_cast<std::size_t>(p) - 1) / static_cast<std::size_t>(p);
  std::vector<float> mine(shard, 0.0f);
  for (std::size_t i = 0; i < shard; ++i) {
    const std::size_t e = static_cast<std::size_t>(rank) * shard + i;
    if (e < n) mine[i] = flat[e];
  }
  const auto mine_before = mine;
  const std::size_t cut = shard / 3;
  const std::vector<std::span<float>> parts{std::span<float>(mine).first(cut), std::span<float>(mine).subspan(cut)};
  const float total_sharded = ddp::optim::clip_grad_norm(group, parts, max_norm, grad_layout::sharded);
  const double err_sharded = static_cast<double>(std::abs(static_cast<long double>(total_sharded) - exact) / exact);
  std::snprintf(buf, sizeof buf, "sharded: norm %.9g, exact %.12Lg, relative %.3g (bound %.3g)\n", static_cast<double>(total_sharded), exact,
                err_sharded, ddp::optim::sharded_norm_exact_bound<float>(n, p));
  if (rank == 0) std::printf("%s", buf);
  check(err_sharded <= ddp::optim::sharded_norm_exact_bound<float>(n, p), buf);
  check(std::abs(static_cast<double>(total_sharded) - static_cast<double>(total_full)) <=
            ddp::optim::sharded_norm_torch_bound<float>(n, p) * static_cast<double>(total_full),
        "sharded against the replicated (torch's algorithm) norm within sharded_norm_torch_bound");
  const auto all_totals = gather(group, std::vector<float>{total_sharded});
  for (const float t : all_totals) check(std::memcmp(&t, &total_sharded, sizeof t) == 0, "the same norm on every rank");
  const float coef_sharded = coefficient(total_sharded, max_norm);
  for (std::size_t i = 0; i < shard; ++i) {
    const float want = mine_before[i] * coef_sharded;
    check(std::memcmp(&mine[i], &want, sizeof want) == 0, "sharded: clipped = grad * coef");
  }

  // max_norm above the norm: coefficient 1, gradients bitwise unchanged, both layouts.
  auto full2 = original;
  ddp::optim::clip_grad_norm(group, spans_of(full2), 1e6, grad_layout::replicated);
  for (std::size_t k = 0; k < full2.size(); ++k)
    check(same_bits(std::span<const float>(full2[k]), std::span<const float>(original[k])), "replicated: unchanged under a large max_norm");
  auto mine2 = mine_before;
  ddp::optim::clip_grad_norm(group, std::vector<std::span<float>>{std::span<float>(mine2)}, 1e6, grad_layout::sharded);
  check(same_bits(std::span<const float>(mine2), std::span<const float>(mine_before)), "sharded: unchanged under a large max_norm");
}

}  // namespace

TEST_CASE("optim distributed: an inf on one rank makes every rank skip and back off, W = 2, 3, 4 over shm and tcp") {
  for (kind t : {kind::shm, kind::tcp})
    for (int p : {2, 3, 4}) {
      const auto sched = draw(p, static_cast<unsigned>(p * 10 + (t == kind::shm ? 0 : 1)));
      INFO("inf kind " << sched.kind << " on rank " << sched.rank << " at step " << sched.step);
      on_ranks(p, t, "agree", [&](int rank, group_type& group) { agreement_run(rank, group, sched); });
    }
}

TEST_CASE("optim distributed: amp_shard_optimizer in sharded_data_parallel stage 1 and 2, W = 2, 3, 4 over shm and tcp") {
  for (int stage : {1, 2})
    for (kind t : {kind::shm, kind::tcp})
      for (int p : {2, 3, 4}) {
        const auto sched = draw(p, static_cast<unsigned>(100 * stage + p * 10 + (t == kind::shm ? 0 : 1)));
        INFO("stage " << stage << ", inf kind " << sched.kind << " on rank " << sched.rank << " at step " << sched.step);
        on_ranks(p, t, "sharded" + std::to_string(stage), [&](int rank, group_type& group) { sharded_run(rank, group, sched, stage); });
      }
}

TEST_CASE("optim distributed: clip_grad_norm replicated and sharded, W = 2, 3, 4 over shm and tcp") {
  for (kind t : {kind::shm, kind::tcp})
    for (int p : {2, 3, 4}) on_ranks(p, t, "clip", [&](int rank, group_type& group) { clip_run(rank, group); });
}

}  // namespace ddp_test_optim_distributed
