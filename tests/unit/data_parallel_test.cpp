// distributed_data_parallel against references computed without it, over a fake group whose
// ranks are threads of this process exchanging through a shared object. The fake reduces in
// float64 (an independent reference implementation of all_reduce), records every call, can
// delay or hold completions, and can fail a chosen collective.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddp/compression.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/parameters.hpp"

#if __has_include(<eigen3/Eigen/Core>) || __has_include(<Eigen/Core>)
#include "ddp/adapters/eigen.hpp"
#define DDP_TEST_HAVE_EIGEN 1
#endif

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_data_parallel {

using namespace std::chrono_literals;

namespace {

// --- the fake group ----------------------------------------------------------------------

struct call_record {
  int rank;
  std::string op;        // "all_reduce", "broadcast", "all_gather"
  ddp::dtype type;
  std::size_t count;
  const void* data;      // the span the caller passed
  std::uint64_t order;   // position in the world's event log
};

struct fake_world {
  explicit fake_world(int n) : size(n) {}
  const int size;
  std::mutex mutex;
  std::condition_variable changed;

  struct slot {
    int arrived = 0, departed = 0;
    std::vector<std::vector<double>> contributions;
    std::vector<double> result;
    bool done = false;
  };
  std::map<std::uint64_t, slot> slots;

  // Event log shared by the fake's calls and the test's own notes, in one order.
  std::vector<call_record> calls;
  std::vector<std::pair<std::uint64_t, std::string>> notes;
  std::uint64_t next_order = 0;

  // Knobs.
  std::chrono::milliseconds delay{0};  // a collective completes no sooner than this after its call
  bool hold = false;                   // completions wait for release()
  std::uint64_t hold_from_seq = 0;     // ... those with this sequence number or later
  std::uint64_t fail_seq = ~0ull;      // every rank's collective with this sequence number fails

  void note(int rank, const std::string& what) {
    std::lock_guard lock(mutex);
    notes.emplace_back(next_order++, std::to_string(rank) + ":" + what);
  }
  void release() {
    {
      std::lock_guard lock(mutex);
      hold = false;
    }
    changed.notify_all();
  }
  std::vector<call_record> calls_of(int rank, const std::string& op) {
    std::lock_guard lock(mutex);
    std::vector<call_record> out;
    for (const auto& c : calls)
      if (c.rank == rank && c.op == op) out.push_back(c);
    return out;
  }
};

struct fake_work_state {
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr failure;
};

class fake_work {
 public:
  explicit fake_work(std::shared_ptr<fake_work_state> s) : s_(std::move(s)) {}
  void wait() {
    if (!wait(ddp::deadline::after(20s))) throw ddp::error(ddp::errc::timeout, "fake work: not done in 20 s");
  }
  bool wait(ddp::deadline d) {
    std::unique_lock lock(s_->mutex);
    if (!s_->changed.wait_until(lock, d.is_never() ? ddp::clock::now() + 20s : d.time_point(), [&] { return s_->done; }))
      return false;
    if (s_->failure) std::rethrow_exception(s_->failure);
    return true;
  }
  bool is_completed() const {
    std::lock_guard lock(s_->mutex);
    return s_->done;
  }

 private:
  std::shared_ptr<fake_work_state> s_;
};

// One rank of the fake world: collectives run in call order on a communication thread.
class fake_group {
 public:
  fake_group(fake_world& w, int rank) : w_(&w), rank_(rank), thread_([this] { loop(); }) {}
  fake_group(const fake_group&) = delete;
  fake_group& operator=(const fake_group&) = delete;
  ~fake_group() {
    {
      std::lock_guard lock(qm_);
      stop_ = true;
    }
    qcv_.notify_all();
    thread_.join();
  }

  int rank() const { return rank_; }
  int size() const { return w_->size; }

  template <ddp::dtype_like T, ddp::reduce_op Op = ddp::sum>
  fake_work all_reduce_async(std::span<T> data, Op = {}) {
    record("all_reduce", ddp::dtype_of<T>, data.size(), data.data());
    return submit([this, data](std::uint64_t seq) {
      std::vector<double> mine(data.size());
      for (std::size_t i = 0; i < data.size(); ++i) mine[i] = to_double(data[i]);
      const auto all = exchange(seq, std::move(mine));
      for (std::size_t i = 0; i < data.size(); ++i) {
        double s = 0;
        for (const auto& c : all) s += c[i];  // float64, rank order: the reference reduction
        if constexpr (Op::kind == ddp::reduce_kind::avg) s /= static_cast<double>(all.size());
        data[i] = from_double<T>(s);
      }
    });
  }
  template <ddp::dtype_like T, ddp::reduce_op Op = ddp::sum>
  void all_reduce(std::span<T> data, Op op = {}) {
    all_reduce_async(data, op).wait();
  }
  template <ddp::dtype_like T>
  void broadcast(std::span<T> data, int root) {
    record("broadcast", ddp::dtype_of<T>, data.size(), data.data());
    submit([this, data, root](std::uint64_t seq) {
      std::vector<double> mine(data.size());
      for (std::size_t i = 0; i < data.size(); ++i) mine[i] = to_double(data[i]);
      const auto all = exchange(seq, std::move(mine));
      for (std::size_t i = 0; i < data.size(); ++i) data[i] = from_double<T>(all[static_cast<std::size_t>(root)][i]);
    }).wait();
  }
  template <ddp::dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    record("all_gather", ddp::dtype_of<T>, in.size(), in.data());
    submit([this, in, out](std::uint64_t seq) {
      // int64 fingerprints do not survive a trip through double: exchange their bytes.
      std::vector<double> mine(in.size());
      std::memcpy(mine.data(), in.data(), in.size_bytes());
      const auto all = exchange(seq, std::move(mine));
      for (std::size_t r = 0; r < all.size(); ++r) std::memcpy(out.data() + r * in.size(), all[r].data(), in.size_bytes());
    }).wait();
  }

 private:
  template <class T>
  static double to_double(T v) {
    if constexpr (ddp::half_precision<T>) return static_cast<double>(static_cast<float>(v));
    else return static_cast<double>(v);
  }
  template <class T>
  static T from_double(double v) {
    if constexpr (ddp::half_precision<T>) return T(static_cast<float>(v));
    else return static_cast<T>(v);
  }

  void record(const char* op, ddp::dtype t, std::size_t n, const void* p) {
    std::lock_guard lock(w_->mutex);
    w_->calls.push_back({rank_, op, t, n, p, w_->next_order++});
  }

  fake_work submit(std::function<void(std::uint64_t)> fn) {
    auto st = std::make_shared<fake_work_state>();
    const auto not_before = ddp::clock::now() + w_->delay;
    {
      std::lock_guard lock(qm_);
      queue_.push_back({std::move(fn), st, seq_++, not_before});
    }
    qcv_.notify_all();
    return fake_work(st);
  }

  // Deposit this rank's contribution for `seq`; wait for everyone's.
  std::vector<std::vector<double>> exchange(std::uint64_t seq, std::vector<double> mine) {
    std::unique_lock lock(w_->mutex);
    if (seq == w_->fail_seq) throw ddp::error(ddp::errc::peer_lost, "fake: injected failure", {.rank = rank_, .seq = seq});
    auto& s = w_->slots[seq];
    if (s.contributions.empty()) s.contributions.resize(static_cast<std::size_t>(w_->size));
    s.contributions[static_cast<std::size_t>(rank_)] = std::move(mine);
    if (++s.arrived == w_->size) {
      s.done = true;
      w_->changed.notify_all();
    }
    if (!w_->changed.wait_for(lock, 20s, [&] { return s.done; }))
      throw ddp::error(ddp::errc::timeout, "fake: peers did not arrive", {.rank = rank_, .seq = seq});
    auto all = s.contributions;
    if (++s.departed == w_->size) w_->slots.erase(seq);
    return all;
  }

  struct task {
    std::function<void(std::uint64_t)> fn;
    std::shared_ptr<fake_work_state> state;
    std::uint64_t seq;
    ddp::clock::time_point not_before;
  };

  void loop() {
    while (true) {
      task t;
      {
        std::unique_lock lock(qm_);
        qcv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failure;
      try {
        t.fn(t.seq);
      } catch (...) {
        failure = std::current_exception();
      }
      {
        // Simulated network time and held completions: timed waits on the world, not sleeps.
        std::unique_lock lock(w_->mutex);
        w_->changed.wait_until(lock, t.not_before, [] { return false; });
        w_->changed.wait_for(lock, 20s, [&] { return !w_->hold || t.seq < w_->hold_from_seq; });
      }
      {
        std::lock_guard lock(t.state->mutex);
        t.state->done = true;
        t.state->failure = failure;
      }
      t.state->changed.notify_all();
    }
  }

  fake_world* w_;
  int rank_;
  std::mutex qm_;
  std::condition_variable qcv_;
  std::deque<task> queue_;
  std::uint64_t seq_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// A fake group whose allocate() hands out bucket buffers (and counts them).
class fake_group_with_allocate : public fake_group {
 public:
  using fake_group::fake_group;
  template <ddp::dtype_like T>
  std::vector<T> allocate(std::size_t n) {
    ++allocations;
    return std::vector<T>(n);
  }
  int allocations = 0;
};

static_assert(ddp::collective_group<fake_group>);
static_assert(ddp::collective_group<fake_group_with_allocate>);

/// Runs fn(rank, group) on n threads; returns each rank's error text ("" when it returned).
template <class Group = fake_group, class F>
std::vector<std::string> run_threads(fake_world& world, F fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(world.size));
  std::vector<std::thread> threads;
  for (int r = 0; r < world.size; ++r) {
    threads.emplace_back([&, r] {
      try {
        Group g(world, r);
        fn(r, g);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::string("exception: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::string joined(const std::vector<std::string>& errors) {
  std::string s;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) s += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return s;
}

// --- models ----------------------------------------------------------------------------

// Gradient of element j of parameter i on rank r in step s: a known function.
double grad_value(int r, std::size_t i, std::size_t j, int s = 0) {
  return std::sin(0.37 * static_cast<double>(j) + 1.3 * static_cast<double>(i)) * (1.0 + 0.5 * r) + 0.01 * r * r +
         0.25 * s - 0.1 * static_cast<double>(i);
}

/// Separate vectors per parameter (the copy path).
template <class T>
struct separate_model {
  std::vector<std::pair<std::vector<T>, std::vector<T>>> layers;
  explicit separate_model(const std::vector<std::size_t>& sizes) {
    for (auto n : sizes) layers.emplace_back(std::vector<T>(n, T(0)), std::vector<T>(n, T(0)));
  }
  void fill_grads(int r, int s = 0) {
    for (std::size_t i = 0; i < layers.size(); ++i)
      for (std::size_t j = 0; j < layers[i].second.size(); ++j) layers[i].second[j] = static_cast<T>(grad_value(r, i, j, s));
  }
  std::vector<T>& grad(std::size_t i) { return layers[i].second; }
  std::size_t count() const { return layers.size(); }
  friend auto& parameters(separate_model& m) { return m.layers; }  // (value, grad) pairs, by ADL
};

/// One flat value buffer and one flat gradient buffer, parameters in declaration order (in place).
template <class T>
struct flat_model {
  std::vector<T> values, grads;
  std::vector<std::size_t> sizes, offsets;
  explicit flat_model(const std::vector<std::size_t>& s) : sizes(s) {
    std::size_t total = 0;
    for (auto n : sizes) {
      offsets.push_back(total);
      total += n;
    }
    values.assign(total, T(0));
    grads.assign(total, T(0));
  }
  void fill_grads(int r, int s = 0) {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::size_t j = 0; j < sizes[i]; ++j) grads[offsets[i] + j] = static_cast<T>(grad_value(r, i, j, s));
  }
  std::span<T> grad(std::size_t i) { return std::span<T>(grads).subspan(offsets[i], sizes[i]); }
  std::size_t count() const { return sizes.size(); }
  friend std::vector<ddp::parameter_ref> parameters(flat_model& m) {
    std::vector<ddp::parameter_ref> out;
    for (std::size_t i = 0; i < m.sizes.size(); ++i)
      out.push_back(ddp::make_parameter(std::span<T>(m.values).subspan(m.offsets[i], m.sizes[i]),
                                        std::span<T>(m.grads).subspan(m.offsets[i], m.sizes[i]), {},
                                        "p" + std::to_string(i)));
    return out;
  }
};

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-6 : 1e-13;
}

/// Every gradient equals the float64 mean over ranks of grad_value (summed over `steps`).
template <class Model>
std::string check_mean(Model& m, int world, int steps = 1) {
  using T = std::remove_cvref_t<decltype(m.grad(0)[0])>;
  for (std::size_t i = 0; i < m.count(); ++i) {
    auto g = m.grad(i);
    for (std::size_t j = 0; j < g.size(); ++j) {
      double ref = 0;
      for (int r = 0; r < world; ++r)
        for (int s = 0; s < steps; ++s) ref += grad_value(r, i, j, s);
      ref /= world;
      const double got = static_cast<double>(g[j]);
      if (std::abs(got - ref) > tolerance<T>() * std::max(1.0, std::abs(ref)))
        return "parameter " + std::to_string(i) + "[" + std::to_string(j) + "] = " + std::to_string(got) +
               ", expected " + std::to_string(ref);
    }
  }
  return {};
}

const std::vector<std::size_t> sizes = {5, 300, 17, 1, 1000, 64, 3, 250};

}  // namespace

// --- exact mean ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("ddp: after finish() every rank holds the exact mean (copied buckets)", "[ddp]", float, double) {
  for (int p : {1, 2, 3, 4}) {
    for (std::size_t cap : {std::size_t{1}, std::size_t{512}, std::size_t{4096}, std::size_t{1} << 30}) {
      for (bool overlap : {true, false}) {
        fake_world world(p);
        const auto errors = run_threads(world, [&](int r, fake_group& g) {
          separate_model<TestType> m(sizes);
          ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = cap, .first_bucket_bytes = cap / 2 + 1, .overlap = overlap}};
          for (int step = 0; step < 2; ++step) {
            m.fill_grads(r);
            // Ranks mark in different orders; launches stay in bucket order on all of them.
            std::vector<std::size_t> order(m.count());
            std::iota(order.rbegin(), order.rend(), 0);
            if (r % 2 == 1) std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(r + step)));
            for (auto i : order) net.mark_ready(i);
            net.finish();
            const auto bad = check_mean(m, p);
            if (!bad.empty()) throw std::runtime_error(bad);
          }
          // Separate vectors are copied, except a bucket of one parameter: that is its own buffer.
          for (const auto& b : net.buckets())
            if (b.in_place != (b.parameters.size() == 1)) throw std::runtime_error("in-place decision");
        });
        INFO("p=" << p << " cap=" << cap << " overlap=" << overlap);
        CHECK(joined(errors).empty());
        CHECK(joined(errors) == "");
      }
    }
  }
}

TEMPLATE_TEST_CASE("ddp: a flat parameter set is reduced in place, with no copy", "[ddp]", float, double) {
  for (int p : {1, 2, 3, 4}) {
    fake_world world(p);
    std::vector<int> in_place(static_cast<std::size_t>(p)), buckets(static_cast<std::size_t>(p));
    std::vector<std::uint64_t> copied(static_cast<std::size_t>(p), 99);
    std::vector<std::string> pointers_ok(static_cast<std::size_t>(p));
    const auto errors = run_threads(world, [&](int r, fake_group& g) {
      flat_model<TestType> m(sizes);
      ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 2048, .first_bucket_bytes = 256}};
      m.fill_grads(r);
      net.synchronize();
      const auto bad = check_mean(m, p);
      if (!bad.empty()) throw std::runtime_error(bad);
      const auto s = net.stats();
      in_place[static_cast<std::size_t>(r)] = static_cast<int>(s.in_place_buckets);
      buckets[static_cast<std::size_t>(r)] = static_cast<int>(s.buckets);
      copied[static_cast<std::size_t>(r)] = s.bytes_copied_last_step;
      // Every all_reduce ran on the gradient buffer itself.
      for (const auto& c : world.calls_of(r, "all_reduce")) {
        const auto* lo = reinterpret_cast<const std::byte*>(m.grads.data());
        const auto* at = static_cast<const std::byte*>(c.data);
        if (at < lo || at >= lo + m.grads.size() * sizeof(TestType)) pointers_ok[static_cast<std::size_t>(r)] = "outside";
      }
    });
    INFO("p=" << p);
    REQUIRE(joined(errors) == "");
    for (int r = 0; r < p; ++r) {
      CHECK(buckets[static_cast<std::size_t>(r)] > 1);
      CHECK(in_place[static_cast<std::size_t>(r)] == buckets[static_cast<std::size_t>(r)]);
      CHECK(copied[static_cast<std::size_t>(r)] == 0);
      CHECK(pointers_ok[static_cast<std::size_t>(r)] == "");
    }
  }
}

TEST_CASE("ddp: bucket buffers come from group.allocate when the group has it", "[ddp]") {
  fake_world world(2);
  std::vector<int> allocations(2);
  const auto errors = run_threads<fake_group_with_allocate>(world, [&](int r, fake_group_with_allocate& g) {
    separate_model<float> m(sizes);
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1024, .first_bucket_bytes = 100}};
    m.fill_grads(r);
    net.synchronize();
    const auto bad = check_mean(m, 2);
    if (!bad.empty()) throw std::runtime_error(bad);
    allocations[static_cast<std::size_t>(r)] = g.allocations;
    const auto s = net.stats();
    if (static_cast<std::size_t>(g.allocations) != s.buckets - s.in_place_buckets)
      throw std::runtime_error("one allocation per copied bucket expected");
  });
  REQUIRE(joined(errors) == "");
  CHECK(allocations[0] > 1);
}

TEST_CASE("ddp: ranks may mix flat and separate gradients; group.allocate is then not used", "[ddp]") {
  // The bucket layout (ascending index inside a bucket) is the same whatever the memory: a flat
  // rank reduces in place while a separate rank copies, and the elements still line up. An
  // allocate() that may be collective (shared memory) is called only when every rank would
  // make the same calls.
  fake_world world(3);
  std::vector<int> allocations(3, -1);
  const auto errors = run_threads<fake_group_with_allocate>(world, [&](int r, fake_group_with_allocate& g) {
    const ddp::data_parallel_options o{.bucket_cap_bytes = 2048, .first_bucket_bytes = 256};
    std::string bad;
    if (r == 1) {
      separate_model<float> m(sizes);
      ddp::distributed_data_parallel net{m, g, o};
      m.fill_grads(r);
      net.synchronize();
      bad = check_mean(m, 3);
    } else {
      flat_model<float> m(sizes);
      ddp::distributed_data_parallel net{m, g, o};
      m.fill_grads(r);
      net.synchronize();
      bad = check_mean(m, 3);
    }
    if (!bad.empty()) throw std::runtime_error(bad);
    allocations[static_cast<std::size_t>(r)] = g.allocations;
  });
  REQUIRE(joined(errors) == "");
  CHECK(allocations == std::vector<int>{0, 0, 0});
}

// --- construction -------------------------------------------------------------------------

TEST_CASE("ddp: construction broadcasts rank 0's values", "[ddp]") {
  for (int p : {2, 3, 4}) {
    fake_world world(p);
    std::vector<std::string> bad(static_cast<std::size_t>(p));
    const auto errors = run_threads(world, [&](int r, fake_group& g) {
      separate_model<double> m(sizes);
      for (std::size_t i = 0; i < m.count(); ++i)
        for (std::size_t j = 0; j < m.layers[i].first.size(); ++j) m.layers[i].first[j] = 1000.0 * r + 10.0 * i + 0.5 * j;
      ddp::distributed_data_parallel net{m, g};
      for (std::size_t i = 0; i < m.count(); ++i)
        for (std::size_t j = 0; j < m.layers[i].first.size(); ++j)
          if (m.layers[i].first[j] != 10.0 * i + 0.5 * j) bad[static_cast<std::size_t>(r)] = "value differs from rank 0's";
    });
    REQUIRE(joined(errors) == "");
    for (const auto& b : bad) CHECK(b == "");
  }
}

TEST_CASE("ddp: a shape mismatch names the parameter on every rank", "[ddp]") {
  fake_world world(3);
  std::vector<ddp::errc> codes(3, ddp::errc::internal);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    std::vector<float> a(32), ga(32), b(32), gb(32), c(7), gc(7);
    std::vector<ddp::parameter_ref> params = {
        ddp::make_parameter(std::span(a), std::span(ga), {32}, "embed"),
        ddp::make_parameter(std::span(b), std::span(gb), r == 2 ? std::vector<std::int64_t>{8, 4} : std::vector<std::int64_t>{4, 8},
                            "fc.weight"),
        ddp::make_parameter(std::span(c), std::span(gc), {7}, "fc.bias")};
    try {
      ddp::distributed_data_parallel net{params, g};
    } catch (const ddp::error& e) {
      codes[static_cast<std::size_t>(r)] = e.code();
      throw;
    }
  });
  for (int r = 0; r < 3; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << e);
    CHECK(codes[static_cast<std::size_t>(r)] == ddp::errc::mismatch);
    CHECK(e.find("parameter 1") != std::string::npos);
    CHECK(e.find("'fc.weight'") != std::string::npos);
    CHECK(e.find("[4, 8]") != std::string::npos);
    CHECK(e.find("[8, 4]") != std::string::npos);
    CHECK(e.find("this rank (" + std::to_string(r) + ")") != std::string::npos);
  }
  // Ranks 0 and 1 compare with rank 2, rank 2 with rank 0.
  CHECK(errors[0].find("rank 2 has 'fc.weight' float32 [8, 4]") != std::string::npos);
  CHECK(errors[2].find("rank 0 has 'fc.weight' float32 [4, 8]") != std::string::npos);
}

TEST_CASE("ddp: a parameter count or dtype mismatch is named too", "[ddp]") {
  SECTION("count") {
    fake_world world(2);
    const auto errors = run_threads(world, [&](int r, fake_group& g) {
      std::vector<std::pair<std::vector<float>, std::vector<float>>> m(r == 1 ? 3 : 2, {std::vector<float>(4), std::vector<float>(4)});
      ddp::distributed_data_parallel net{m, g};
    });
    for (const auto& e : errors) {
      INFO(e);
      CHECK(e.find("parameter 2") != std::string::npos);
      CHECK(e.find("no parameter 2") != std::string::npos);
      CHECK(e.find("float32 [4]") != std::string::npos);
    }
    CHECK(errors[0].find("parameter counts: 2 here, 3 on rank 1") != std::string::npos);
    CHECK(errors[1].find("parameter counts: 3 here, 2 on rank 0") != std::string::npos);
  }
  SECTION("dtype") {
    fake_world world(2);
    const auto errors = run_threads(world, [&](int r, fake_group& g) {
      std::vector<float> f(4), gf(4);
      std::vector<double> d(4), gd(4);
      std::vector<ddp::parameter_ref> params = {r == 0 ? ddp::make_parameter(std::span(f), std::span(gf), {}, "w")
                                                       : ddp::make_parameter(std::span(d), std::span(gd), {}, "w")};
      ddp::distributed_data_parallel net{params, g};
    });
    CHECK(errors[0].find("this rank (0) has 'w' float32 [4], rank 1 has 'w' float64 [4]") != std::string::npos);
    CHECK(errors[1].find("this rank (1) has 'w' float64 [4], rank 0 has 'w' float32 [4]") != std::string::npos);
  }
}

TEST_CASE("ddp: device-memory parameters are refused by a host group", "[ddp]") {
  fake_world world(1);
  const auto errors = run_threads(world, [&](int, fake_group& g) {
    std::vector<float> v(4), gr(4);
    std::vector<ddp::parameter_ref> params = {ddp::make_parameter(std::span(v), std::span(gr), {}, "gpu.w", ddp::memory_space::device)};
    ddp::distributed_data_parallel net{params, g};
  });
  INFO(errors[0]);
  CHECK(errors[0].find("parameter 0 ('gpu.w') is in device memory, but this group's backend works on host memory") !=
        std::string::npos);
}

namespace {
// A group that says its backend works on device memory, with the two things DDP then needs of it:
// allocate<T>(n) for bucket buffers and copy_memory for moving gradients in and out. The
// "device" is host memory, so the averages can be checked here.
class fake_device_group : public fake_group_with_allocate {
 public:
  using fake_group_with_allocate::fake_group_with_allocate;
  static constexpr ddp::memory_space memory() { return ddp::memory_space::device; }
  void copy_memory(void* dst, const void* src, std::size_t bytes) {
    ++copies;
    copied_bytes += bytes;
    std::memcpy(dst, src, bytes);
  }
  int copies = 0;
  std::size_t copied_bytes = 0;
};
class fake_device_group_without_copy : public fake_group_with_allocate {
 public:
  using fake_group_with_allocate::fake_group_with_allocate;
  static constexpr ddp::memory_space memory() { return ddp::memory_space::device; }
};

std::vector<ddp::parameter_ref> device_refs(separate_model<float>& m) {
  std::vector<ddp::parameter_ref> refs;
  for (std::size_t i = 0; i < m.count(); ++i)
    refs.push_back(ddp::make_parameter(std::span(m.layers[i].first), std::span(m.layers[i].second), {}, "", ddp::memory_space::device));
  return refs;
}
}  // namespace

TEST_CASE("ddp: device parameters apart in memory go through group.allocate buffers and group.copy_memory", "[ddp]") {
  for (int p : {1, 2, 3}) {
    fake_world world(p);
    const auto errors = run_threads<fake_device_group>(world, [&](int r, fake_device_group& g) {
      separate_model<float> m(sizes);
      auto refs = device_refs(m);
      ddp::distributed_data_parallel net{refs, g, {.bucket_cap_bytes = 2048, .first_bucket_bytes = 256}};
      const auto stats = net.stats();
      std::size_t copied_buckets_bytes = 0;
      for (const auto& b : net.buckets())
        if (!b.in_place) copied_buckets_bytes += b.bytes;
      if (g.allocations != static_cast<int>(stats.buckets - stats.in_place_buckets)) throw std::runtime_error("allocations");
      m.fill_grads(r);
      g.copies = 0;
      g.copied_bytes = 0;
      net.synchronize();
      const auto bad = check_mean(m, p);
      if (!bad.empty()) throw std::runtime_error(bad);
      // In and out, every copied bucket (a world of one communicates nothing and copies nothing).
      const std::size_t want = p == 1 ? 0 : 2 * copied_buckets_bytes;
      if (g.copied_bytes != want)
        throw std::runtime_error("copy_memory moved " + std::to_string(g.copied_bytes) + " bytes, expected " + std::to_string(want));
    });
    INFO("p=" << p);
    CHECK(joined(errors) == "");
  }
}

TEST_CASE("ddp: device parameters apart in memory need a group with copy_memory; compression hooks need host buckets", "[ddp]") {
  {
    fake_world world(1);
    const auto errors = run_threads<fake_device_group_without_copy>(world, [&](int, fake_device_group_without_copy& g) {
      separate_model<float> m(sizes);
      auto refs = device_refs(m);
      ddp::distributed_data_parallel net{refs, g};
    });
    INFO(errors[0]);
    CHECK(errors[0].find("has no copy_memory") != std::string::npos);
  }
  {
    fake_world world(2);
    const auto errors = run_threads<fake_device_group>(world, [&](int r, fake_device_group& g) {
      separate_model<float> m(sizes);
      auto refs = device_refs(m);
      ddp::distributed_data_parallel net{refs, g};
      net.set_comm_hook(ddp::fp16_compress);
      m.fill_grads(r);
      net.synchronize();
    });
    for (const auto& e : errors) {
      INFO(e);
      CHECK(e.find("fp16_compress / bf16_compress round on the host, but bucket") != std::string::npos);
    }
  }
}

// --- buckets ------------------------------------------------------------------------------

namespace {
std::vector<ddp::parameter_ref> refs_of_bytes(const std::vector<std::size_t>& elements, std::vector<std::vector<float>>& storage) {
  storage.assign(elements.size() * 2, {});
  std::vector<ddp::parameter_ref> out;
  for (std::size_t i = 0; i < elements.size(); ++i) {
    storage[2 * i].resize(elements[i]);
    storage[2 * i + 1].resize(elements[i]);
    out.push_back(ddp::make_parameter(std::span(storage[2 * i]), std::span(storage[2 * i + 1])));
  }
  return out;
}
using layout = std::vector<std::vector<std::size_t>>;
}  // namespace

TEST_CASE("ddp: bucket layout is reverse order with a small first bucket and a cap", "[ddp]") {
  std::vector<std::vector<float>> storage;
  // float32 bytes: 40 80 120 20 160 200 4 32.  First cap 100: 32+4+200 -> close {7,6,5};
  // cap 250: 160+20+120 = 300 -> close {4,3,2}; the rest {1,0}.
  const auto refs = refs_of_bytes({10, 20, 30, 5, 40, 50, 1, 8}, storage);
  CHECK(ddp::assign_buckets(refs, 100, 250) == layout{{7, 6, 5}, {4, 3, 2}, {1, 0}});
  // A cap of one byte: one parameter per bucket. A huge cap: one bucket.
  CHECK(ddp::assign_buckets(refs, 1, 1) == layout{{7}, {6}, {5}, {4}, {3}, {2}, {1}, {0}});
  CHECK(ddp::assign_buckets(refs, 1 << 30, 1 << 30) == layout{{7, 6, 5, 4, 3, 2, 1, 0}});
  // Exactly reaching the cap closes the bucket: 32+4 = 36.
  CHECK(ddp::assign_buckets(refs, 36, 200) == layout{{7, 6}, {5}, {4, 3, 2}, {1, 0}});

  // The defaults: 1 MiB first, 25 MiB after. float32 elements: 4 MiB, 1 MiB, 40 B, 30 MiB, 8 MiB x 3.
  const std::size_t mib = 1 << 18;  // float32 elements per MiB
  const auto big = refs_of_bytes({4 * mib, mib, 10, 30 * mib, 8 * mib, 8 * mib, 8 * mib}, storage);
  // reverse: 8+8+8 = 24 MiB >= 1 MiB after the first -> {6}; then 8+8+30 >= 25 -> {5,4,3}; 40 B + 1 MiB + 4 MiB -> {2,1,0}
  CHECK(ddp::assign_buckets(big, 1 << 20, 25 << 20) == layout{{6}, {5, 4, 3}, {2, 1, 0}});

  // The wrapper uses the same layout, and its defaults.
  fake_world world(1);
  std::vector<ddp::bucket_info> seen;
  const auto errors = run_threads(world, [&](int, fake_group& g) {
    auto params = big;
    ddp::distributed_data_parallel net{params, g};
    seen = net.buckets();
  });
  REQUIRE(joined(errors) == "");
  REQUIRE(seen.size() == 3);
  CHECK(seen[0].parameters == std::vector<std::size_t>{6});
  CHECK(seen[1].parameters == std::vector<std::size_t>{5, 4, 3});
  CHECK(seen[2].parameters == std::vector<std::size_t>{2, 1, 0});
  CHECK(seen[1].bytes == (8 + 8 + 30) * (std::size_t{1} << 20));
  CHECK(seen[2].bytes == 5 * (std::size_t{1} << 20) + 40);
}

TEST_CASE("ddp: buckets hold one dtype each, every dtype with its own first bucket", "[ddp]") {
  std::vector<float> f[8];
  std::vector<double> d[4];
  for (auto& v : f) v.resize(10);  // 40 B
  for (auto& v : d) v.resize(10);  // 80 B
  // indices: 0 f, 1 d, 2 f, 3 d, 4 f, 5 f
  std::vector<ddp::parameter_ref> refs = {
      ddp::make_parameter(std::span(f[0]), std::span(f[1])), ddp::make_parameter(std::span(d[0]), std::span(d[1])),
      ddp::make_parameter(std::span(f[2]), std::span(f[3])), ddp::make_parameter(std::span(d[2]), std::span(d[3])),
      ddp::make_parameter(std::span(f[4]), std::span(f[5])), ddp::make_parameter(std::span(f[6]), std::span(f[7]))};
  // first cap 80, cap 1000. float32: 5 (40), 4 (80 -> close {5,4}); 2, 0 -> {2,0}. float64: 3 (80 -> close {3}); 1 -> {1}.
  CHECK(ddp::assign_buckets(refs, 80, 1000) == layout{{5, 4}, {3}, {2, 0}, {1}});
}

// --- overlap ------------------------------------------------------------------------------

TEST_CASE("ddp: a bucket's all_reduce starts as soon as it is ready, before the last mark_ready", "[ddp]") {
  const bool last_inline = GENERATE(true, false);
  INFO("reduce_last_bucket_inline = " << last_inline);
  fake_world world(2);
  world.delay = 20ms;
  std::vector<std::vector<std::size_t>> launched_after(2);
  std::vector<std::int64_t> wait_ns(2);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 4, 4, 4});
    ddp::distributed_data_parallel net{
        m, g, {.bucket_cap_bytes = 1, .first_bucket_bytes = 1, .reduce_last_bucket_inline = last_inline}};  // one parameter per bucket
    m.fill_grads(r);
    auto count = [&] { return world.calls_of(r, "all_reduce").size(); };
    auto& log = launched_after[static_cast<std::size_t>(r)];
    // Out of order: parameter 0's bucket is ready first but must wait for the buckets before it.
    for (std::size_t i : {0, 3, 1, 2}) {
      net.mark_ready(i);
      world.note(r, "marked " + std::to_string(i));
      log.push_back(count());
    }
    net.finish();
    wait_ns[static_cast<std::size_t>(r)] = net.stats().wait_last_step.count();
    const auto bad = check_mean(m, 2);
    if (!bad.empty()) throw std::runtime_error(bad);
  });
  REQUIRE(joined(errors) == "");
  for (int r = 0; r < 2; ++r) {
    // after marking 0: nothing (bucket {3} comes first); 3: one; 1: still one; 2: the other three,
    // or two when the last bucket ({0}) is left to finish(), which reduces it on its own thread.
    const std::size_t after_last = last_inline ? 3 : 4;
    CHECK(launched_after[static_cast<std::size_t>(r)] == std::vector<std::size_t>{0, 1, 1, after_last});
    // The first all_reduce was called before the last parameter was marked (event order).
    const auto calls = world.calls_of(r, "all_reduce");
    REQUIRE(calls.size() == 4);
    std::uint64_t last_mark = 0;
    for (const auto& [order, what] : world.notes)
      if (what == std::to_string(r) + ":marked 2") last_mark = order;
    CHECK(calls[0].order < last_mark);
    CHECK(calls[0].count == 4);
    CHECK((calls[3].order > last_mark) == last_inline);
    // finish() waited for the simulated network time.
    CHECK(wait_ns[static_cast<std::size_t>(r)] > 0);
  }
}

TEST_CASE("ddp: with overlap off nothing is communicated before finish()", "[ddp]") {
  fake_world world(2);
  std::vector<std::size_t> before(2, 99);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 4, 4});
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1, .first_bucket_bytes = 1, .overlap = false}};
    m.fill_grads(r);
    for (std::size_t i : {2, 1, 0}) net.mark_ready(i);
    before[static_cast<std::size_t>(r)] = world.calls_of(r, "all_reduce").size();
    net.finish();
    const auto bad = check_mean(m, 2);
    if (!bad.empty()) throw std::runtime_error(bad);
  });
  REQUIRE(joined(errors) == "");
  CHECK(before == std::vector<std::size_t>{0, 0});
}

TEST_CASE("ddp: finish(deadline) reports a bucket that is not done in time", "[ddp]") {
  fake_world world(2);
  world.hold = true;
  world.hold_from_seq = 2;  // construction's all_gather (0) and broadcast (1) complete
  std::vector<std::string> messages(2);
  std::vector<ddp::errc> codes(2, ddp::errc::internal);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 4});
    ddp::distributed_data_parallel net{m, g};
    m.fill_grads(r);
    try {
      net.synchronize(ddp::deadline::after(50ms));
    } catch (const ddp::error& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
      codes[static_cast<std::size_t>(r)] = e.code();
    }
    world.release();  // the first rank to time out lets every bucket complete
    m.fill_grads(r);
    net.synchronize();  // the wrapper is usable again once the group is
    const auto bad = check_mean(m, 2);
    if (!bad.empty()) throw std::runtime_error(bad);
  });
  REQUIRE(joined(errors) == "");
  int timed_out = 0;
  for (int r = 0; r < 2; ++r) {
    if (messages[static_cast<std::size_t>(r)].empty()) continue;  // released before its deadline
    ++timed_out;
    CHECK(codes[static_cast<std::size_t>(r)] == ddp::errc::timeout);
    CHECK(messages[static_cast<std::size_t>(r)].find("not done by the deadline") != std::string::npos);
  }
  CHECK(timed_out >= 1);
}

TEST_CASE("ddp: a world of one issues no gradient all-reduce and leaves the gradients as they are", "[ddp]") {
  fake_world world(1);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 1000, 3});
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1, .first_bucket_bytes = 1}};
    for (int step = 0; step < 3; ++step) {
      m.fill_grads(r);
      net.synchronize();
      const auto bad = check_mean(m, 1);
      if (!bad.empty()) throw std::runtime_error(bad);
    }
  });
  REQUIRE(joined(errors) == "");
  CHECK(world.calls_of(0, "all_reduce").empty());
}

TEST_CASE("ddp: a failed collective is rethrown by finish() on every rank, and the next step works", "[ddp]") {
  fake_world world(3);
  std::vector<std::string> failures(3);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 4, 4});
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1, .first_bucket_bytes = 1}};
    {
      std::lock_guard lock(world.mutex);
      world.fail_seq = 2;  // construction used seq 0 (all_gather) and 1 (broadcast); fail the first bucket
    }
    m.fill_grads(r);
    try {
      net.synchronize();
    } catch (const ddp::error& e) {
      failures[static_cast<std::size_t>(r)] = e.what();
    }
    m.fill_grads(r);
    net.synchronize();
    const auto bad = check_mean(m, 3);
    if (!bad.empty()) throw std::runtime_error(bad);
  });
  REQUIRE(joined(errors) == "");
  for (const auto& f : failures) CHECK(f.find("injected failure") != std::string::npos);
}

// --- unused parameters --------------------------------------------------------------------

TEST_CASE("ddp: a parameter that produced no gradient is named; peers are not left hanging", "[ddp]") {
  fake_world world(2);
  std::vector<ddp::errc> codes(2, ddp::errc::internal);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    std::vector<float> v[3], gr[3];
    for (auto& x : v) x.assign(4, 0.f);
    for (auto& x : gr) x.assign(4, 1.f);
    std::vector<ddp::parameter_ref> params = {ddp::make_parameter(std::span(v[0]), std::span(gr[0]), {}, "layer.weight"),
                                              ddp::make_parameter(std::span(v[1]), std::span(gr[1]), {}, "layer.bias"),
                                              ddp::make_parameter(std::span(v[2]), std::span(gr[2]), {}, "head")};
    ddp::distributed_data_parallel net{params, g};
    net.mark_ready(2);
    net.mark_ready(0);
    if (r == 0) net.mark_ready(1);
    try {
      net.finish();
    } catch (const ddp::error& e) {
      codes[static_cast<std::size_t>(r)] = e.code();
      throw;
    }
    // Rank 0 completed: rank 1 took part with a zero gradient for layer.bias.
    if (r == 0 && gr[1][0] != 0.5f) throw std::runtime_error("layer.bias should average 1 and 0");
  });
  CHECK(errors[0] == "");
  INFO(errors[1]);
  CHECK(codes[1] == ddp::errc::invalid_argument);
  CHECK(errors[1].find("parameter 1 ('layer.bias')") != std::string::npos);
  CHECK(errors[1].find("find_unused_parameters") != std::string::npos);
  CHECK(errors[1].find("layer.weight") == std::string::npos);
}

TEST_CASE("ddp: find_unused_parameters treats a missing gradient as zero", "[ddp]") {
  fake_world world(3);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<double> m(sizes);
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1000, .first_bucket_bytes = 100, .find_unused_parameters = true}};
    m.fill_grads(r);
    for (std::size_t i = 0; i < m.count(); ++i)
      if (!(r == 1 && i == 4)) net.mark_ready(i);
    net.finish();
    for (std::size_t i = 0; i < m.count(); ++i)
      for (std::size_t j = 0; j < m.layers[i].second.size(); ++j) {
        double ref = 0;
        for (int q = 0; q < 3; ++q) ref += (q == 1 && i == 4) ? 0.0 : grad_value(q, i, j);
        ref /= 3;
        if (std::abs(m.layers[i].second[j] - ref) > 1e-13) throw std::runtime_error("wrong mean at parameter " + std::to_string(i));
      }
  });
  CHECK(joined(errors) == "");
}

TEST_CASE("ddp: misuse of mark_ready is a clear error", "[ddp]") {
  fake_world world(1);
  std::vector<std::string> messages;
  const auto errors = run_threads(world, [&](int, fake_group& g) {
    separate_model<float> m({4, 4});
    ddp::distributed_data_parallel net{m, g};
    try {
      net.mark_ready(2);
    } catch (const ddp::error& e) {
      messages.push_back(e.what());
    }
    net.mark_ready(1);
    try {
      net.mark_ready(1);
    } catch (const ddp::error& e) {
      messages.push_back(e.what());
    }
    try {
      auto guard = net.no_sync();
    } catch (const ddp::error& e) {
      messages.push_back(e.what());
    }
    net.synchronize();
  });
  REQUIRE(joined(errors) == "");
  REQUIRE(messages.size() == 3);
  CHECK(messages[0].find("mark_ready(2): the model has 2 parameters") != std::string::npos);
  CHECK(messages[1].find("parameter 1 was marked ready twice") != std::string::npos);
  CHECK(messages[2].find("no_sync() entered in the middle of a step") != std::string::npos);
}

// --- no_sync ------------------------------------------------------------------------------

TEST_CASE("ddp: no_sync accumulation over k steps averages the sums", "[ddp]") {
  for (int p : {1, 2, 3, 4}) {
    for (int k : {1, 3}) {
      fake_world world(p);
      std::vector<std::size_t> calls_during(static_cast<std::size_t>(p), 99);
      const auto errors = run_threads(world, [&](int r, fake_group& g) {
        separate_model<double> m(sizes);
        ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 2000, .first_bucket_bytes = 100}};
        const auto before = world.calls_of(r, "all_reduce").size();
        auto micro_step = [&](int s) {
          for (std::size_t i = 0; i < m.count(); ++i)  // backward accumulates into the gradients
            for (std::size_t j = 0; j < m.layers[i].second.size(); ++j) m.layers[i].second[j] += grad_value(r, i, j, s);
          for (std::size_t i = m.count(); i-- > 0;) net.mark_ready(i);
          net.finish();
        };
        {
          auto guard = net.no_sync();
          for (int s = 0; s + 1 < k; ++s) micro_step(s);
        }
        calls_during[static_cast<std::size_t>(r)] = world.calls_of(r, "all_reduce").size() - before;
        micro_step(k - 1);
        const auto bad = check_mean(m, p, k);
        if (!bad.empty()) throw std::runtime_error(bad);
        const auto st = net.stats();
        if (st.skipped_steps != static_cast<std::uint64_t>(k - 1) || st.steps != 1) throw std::runtime_error("step counts");
      });
      INFO("p=" << p << " k=" << k);
      REQUIRE(joined(errors) == "");
      for (auto c : calls_during) CHECK(c == 0);
    }
  }
}

// --- hooks --------------------------------------------------------------------------------

namespace {
double round_half(double x) { return static_cast<double>(static_cast<float>(ddp::float16(static_cast<float>(x)))); }
double round_bf16(double x) { return static_cast<double>(static_cast<float>(ddp::bfloat16(static_cast<float>(x)))); }
}  // namespace

TEST_CASE("ddp: the fp16 hook sends half precision and equals the reference rounded to half", "[ddp]") {
  for (int p : {1, 2, 3, 4}) {
    fake_world world(p);
    const auto errors = run_threads(world, [&](int r, fake_group& g) {
      separate_model<float> m({7, 300, 33});
      ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 600, .first_bucket_bytes = 100}};
      net.set_comm_hook(ddp::fp16_compress);
      m.fill_grads(r);
      net.synchronize();
      for (const auto& c : world.calls_of(r, "all_reduce"))
        if (c.type != ddp::dtype::float16) throw std::runtime_error("an all_reduce was not float16");
      // Reference: each rank's g/p rounded to half, summed exactly, rounded to half (the fake
      // sums in float64 and rounds once).
      for (std::size_t i = 0; i < m.count(); ++i)
        for (std::size_t j = 0; j < m.grad(i).size(); ++j) {
          double sum = 0, exact = 0;
          for (int q = 0; q < p; ++q) {
            const float g32 = static_cast<float>(grad_value(q, i, j));
            sum += round_half(static_cast<double>(g32 * (1.0f / static_cast<float>(p))));
            exact += g32;
          }
          const double ref = round_half(sum);
          const double got = m.grad(i)[j];
          if (got != ref) throw std::runtime_error("fp16 result differs from the rounded reference at " + std::to_string(i));
          // and it is the mean within float16's precision
          if (std::abs(got - exact / p) > 2e-3 * std::max(1.0, std::abs(exact / p))) throw std::runtime_error("far from the mean");
        }
    });
    INFO("p=" << p);
    CHECK(joined(errors) == "");
  }
}

TEST_CASE("ddp: the fp16 hook result is exact when the values are exact in half precision", "[ddp]") {
  fake_world world(3);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    flat_model<double> m({16, 5});
    ddp::distributed_data_parallel net{m, g};
    net.set_comm_hook(ddp::fp16_compress);
    // g = k * 3 / 64: g / 3 = k / 64 is exact in half; so is the sum.
    for (std::size_t e = 0; e < m.grads.size(); ++e) m.grads[e] = static_cast<double>(static_cast<int>(e) - 7 + r) * 3.0 / 64.0;
    net.synchronize();
    for (std::size_t e = 0; e < m.grads.size(); ++e) {
      const double ref = (3.0 * (static_cast<double>(e) - 7) + 3.0) * 3.0 / 64.0 / 3.0;  // mean over r = 0, 1, 2
      if (m.grads[e] != ref) throw std::runtime_error("element " + std::to_string(e) + ": " + std::to_string(m.grads[e]));
    }
  });
  CHECK(joined(errors) == "");
}

TEST_CASE("ddp: the bf16 hook equals the reference rounded to bfloat16", "[ddp]") {
  fake_world world(2);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({50, 9});
    ddp::distributed_data_parallel net{m, g};
    net.set_comm_hook(ddp::bf16_compress);
    m.fill_grads(r);
    net.synchronize();
    for (const auto& c : world.calls_of(r, "all_reduce"))
      if (c.type != ddp::dtype::bfloat16) throw std::runtime_error("an all_reduce was not bfloat16");
    for (std::size_t i = 0; i < m.count(); ++i)
      for (std::size_t j = 0; j < m.grad(i).size(); ++j) {
        double sum = 0;
        for (int q = 0; q < 2; ++q) sum += round_bf16(static_cast<double>(static_cast<float>(grad_value(q, i, j)) * 0.5f));
        if (m.grad(i)[j] != round_bf16(sum)) throw std::runtime_error("bf16 result differs at " + std::to_string(i));
      }
  });
  CHECK(joined(errors) == "");
}

TEST_CASE("ddp: a user hook gets every bucket and the group", "[ddp]") {
  fake_world world(2);
  std::vector<std::vector<std::size_t>> seen(2);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m({4, 4, 4});
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1, .first_bucket_bytes = 1}};
    // Sum then halve, by hand: a hook returns any work; this one finishes with the division.
    struct halving_work {
      fake_work inner;
      std::span<float> data;
      void wait() {
        inner.wait();
        for (auto& x : data) x *= 0.5f;
      }
    };
    net.set_comm_hook([&, r](const ddp::bucket_view& b, fake_group& group) {
      seen[static_cast<std::size_t>(r)].push_back(b.parameters.front());
      return halving_work{group.all_reduce_async(b.as<float>(), ddp::sum{}), b.as<float>()};
    });
    m.fill_grads(r);
    net.synchronize();
    const auto bad = check_mean(m, 2);
    if (!bad.empty()) throw std::runtime_error(bad);
  });
  REQUIRE(joined(errors) == "");
  CHECK(seen[0] == std::vector<std::size_t>{2, 1, 0});
  CHECK(seen[1] == std::vector<std::size_t>{2, 1, 0});
}

// --- statistics ---------------------------------------------------------------------------

TEST_CASE("ddp: statistics count buckets, bytes and reductions", "[ddp]") {
  fake_world world(2);
  std::vector<ddp::data_parallel_stats> stats(2);
  std::vector<std::size_t> copied_bytes(2);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    separate_model<float> m(sizes);
    ddp::distributed_data_parallel net{m, g, {.bucket_cap_bytes = 1024, .first_bucket_bytes = 256}};
    for (int s = 0; s < 3; ++s) {
      m.fill_grads(r, s);
      net.synchronize();
    }
    stats[static_cast<std::size_t>(r)] = net.stats();
    for (const auto& b : net.buckets())
      if (!b.in_place) copied_bytes[static_cast<std::size_t>(r)] += b.bytes;
  });
  REQUIRE(joined(errors) == "");
  const std::size_t total_bytes = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}) * sizeof(float);
  std::vector<ddp::parameter_ref> refs;
  std::vector<std::vector<float>> storage;
  const auto expected_buckets = ddp::assign_buckets(refs_of_bytes(sizes, storage), 256, 1024).size();
  for (std::size_t r = 0; r < 2; ++r) {
    const auto& s = stats[r];
    CHECK(copied_bytes[r] > 0);
    CHECK(s.bytes_copied_last_step == 2 * copied_bytes[r]);  // in and out
    CHECK(s.buckets == expected_buckets);
    CHECK(s.steps == 3);
    CHECK(s.all_reduces == 3 * expected_buckets);
    CHECK(s.bytes_last_step == total_bytes);
    CHECK(s.bytes_total == 3 * total_bytes);
  }
}

#ifdef DDP_TEST_HAVE_EIGEN
TEST_CASE("ddp: Eigen matrices are synchronized like any other parameters", "[ddp][eigen]") {
  fake_world world(2);
  const auto errors = run_threads(world, [&](int r, fake_group& g) {
    std::vector<std::pair<Eigen::MatrixXf, Eigen::MatrixXf>> layers;
    layers.emplace_back(Eigen::MatrixXf::Zero(3, 4), Eigen::MatrixXf::Zero(3, 4));
    layers.emplace_back(Eigen::MatrixXf::Zero(3, 1), Eigen::MatrixXf::Zero(3, 1));
    ddp::distributed_data_parallel net{layers, g};
    for (std::size_t i = 0; i < layers.size(); ++i)
      for (Eigen::Index e = 0; e < layers[i].second.size(); ++e)
        layers[i].second.data()[e] = static_cast<float>(grad_value(r, i, static_cast<std::size_t>(e)));
    net.synchronize();
    for (std::size_t i = 0; i < layers.size(); ++i)
      for (Eigen::Index e = 0; e < layers[i].second.size(); ++e) {
        const double ref = (grad_value(0, i, static_cast<std::size_t>(e)) + grad_value(1, i, static_cast<std::size_t>(e))) / 2;
        if (std::abs(layers[i].second.data()[e] - ref) > 2e-6) throw std::runtime_error("wrong mean");
      }
    if (net.parameters()[0].shape != std::vector<std::int64_t>{3, 4}) throw std::runtime_error("shape");
  });
  CHECK(joined(errors) == "");
}
#endif

}  // namespace ddp_test_data_parallel
