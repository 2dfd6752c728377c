// process_group semantics over an in-process backend (ranks are threads): argument checks,
// sequence numbers, async ordering, work handles, error propagation, the watchdog, sub-groups,
// statistics, every dtype. Results are compared with closed forms computed here in float64 or
// exactly for integers, never with the group's own output.
#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "ddp/group.hpp"
#include "ddp/process_group.hpp"
#include "support/threads.hpp"
#include "support/element_values.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_process_group {

using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------------------------------------
// A tiny world of thread-ranks. Collective k of every rank meets in round k: each rank posts a
// copy of its input, waits for all, computes its own output from the copies.
struct local_world {
  explicit local_world(int n) : size(n) {}
  struct round {
    std::vector<std::vector<std::byte>> data;
    std::vector<bool> posted;
    std::vector<ddp::collective_desc> descs;
    int arrived = 0;
    int consumed = 0;
  };
  int size;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::uint64_t, round> rounds;
  bool aborted = false;
  std::map<std::string, std::shared_ptr<local_world>> children;

  std::shared_ptr<local_world> child(const std::string& key, int n) {
    std::lock_guard lock(mutex);
    auto& c = children[key];
    if (!c) c = std::make_shared<local_world>(n);
    return c;
  }
};

// Extended = the (..., collective_desc, deadline) signatures, with a fingerprint check across ranks.
// Minimal = only what ddp::backend requires (rank, size, all_reduce, broadcast, abort): the
// other collectives come from process_group's fallbacks.
template <bool Extended, bool Minimal = false>
class local_backend {
 public:
  static constexpr ddp::memory_space memory = ddp::memory_space::host;
  static constexpr std::string_view name = Minimal ? "local-minimal" : Extended ? "local-extended" : "local";
  static constexpr ddp::backend_capabilities capabilities =
      Minimal ? ddp::backend_capabilities{}
              : ddp::backend_capabilities{.deadlines = Extended, .all_gather = true, .reduce_scatter = true, .barrier = true, .reduce = !Extended};

  local_backend(std::shared_ptr<local_world> world, int rank) : world_(std::move(world)), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return world_->size; }

  std::vector<ddp::collective_desc> seen;  // descs this rank was given, in execution order

  template <ddp::dtype_like T, ddp::reduce_op Op>
  void all_reduce(std::span<T> data, Op op) {
    auto all = exchange(std::as_bytes(data), {});
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = combine<T>(all, i, op);
  }
  template <ddp::dtype_like T>
  void broadcast(std::span<T> data, int root) {
    auto all = exchange(std::as_bytes(data), {});
    if (!data.empty()) std::memcpy(data.data(), all[static_cast<std::size_t>(root)].data(), data.size_bytes());
  }
  template <ddp::dtype_like T, ddp::reduce_op Op>
    requires(!Minimal)
  void reduce(std::span<T> data, int root, Op op) {
    auto all = exchange(std::as_bytes(data), {});
    if (rank_ == root)
      for (std::size_t i = 0; i < data.size(); ++i) data[i] = combine<T>(all, i, op);
  }
  template <ddp::dtype_like T>
    requires(!Minimal)
  void all_gather(std::span<const T> in, std::span<T> out) {
    auto all = exchange(std::as_bytes(in), {});
    for (std::size_t r = 0; r < all.size(); ++r)
      if (!in.empty()) std::memcpy(out.data() + r * in.size(), all[r].data(), in.size_bytes());
  }
  template <ddp::dtype_like T, ddp::reduce_op Op>
    requires(!Minimal)
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    auto all = exchange(std::as_bytes(in), {});
    const std::size_t offset = static_cast<std::size_t>(rank_) * out.size();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = combine<T>(all, offset + i, op);
  }
  void barrier()
    requires(!Minimal)
  {
    exchange({}, {});
  }
  void abort() noexcept {
    {
      std::lock_guard lock(world_->mutex);
      world_->aborted = true;
    }
    world_->changed.notify_all();
  }
  std::vector<int> missing_ranks() const {
    std::lock_guard lock(world_->mutex);
    std::vector<int> missing;
    auto it = world_->rounds.find(round_ - 1);
    if (it == world_->rounds.end()) return missing;
    for (int r = 0; r < world_->size; ++r)
      if (!it->second.posted[static_cast<std::size_t>(r)]) missing.push_back(r);
    return missing;
  }
  local_backend split(std::span<const int> ranks, const std::string& tag) const {
    const auto it = std::find(ranks.begin(), ranks.end(), rank_);
    return local_backend(world_->child(tag, static_cast<int>(ranks.size())), static_cast<int>(it - ranks.begin()));
  }

  // The extended forms: record the desc, check it against every rank's, then do the same.
  template <ddp::dtype_like T, ddp::reduce_op Op>
    requires Extended
  void all_reduce(std::span<T> data, Op op, const ddp::collective_desc& d, ddp::deadline) {
    auto all = exchange(std::as_bytes(data), d);
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = combine<T>(all, i, op);
  }
  template <ddp::dtype_like T>
    requires Extended
  void broadcast(std::span<T> data, int root, const ddp::collective_desc& d, ddp::deadline) {
    auto all = exchange(std::as_bytes(data), d);
    if (!data.empty()) std::memcpy(data.data(), all[static_cast<std::size_t>(root)].data(), data.size_bytes());
  }
  template <ddp::dtype_like T>
    requires Extended
  void all_gather(std::span<const T> in, std::span<T> out, const ddp::collective_desc& d, ddp::deadline) {
    auto all = exchange(std::as_bytes(in), d);
    for (std::size_t r = 0; r < all.size(); ++r)
      if (!in.empty()) std::memcpy(out.data() + r * in.size(), all[r].data(), in.size_bytes());
  }
  template <ddp::dtype_like T, ddp::reduce_op Op>
    requires Extended
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const ddp::collective_desc& d, ddp::deadline) {
    auto all = exchange(std::as_bytes(in), d);
    const std::size_t offset = static_cast<std::size_t>(rank_) * out.size();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = combine<T>(all, offset + i, op);
  }
  void barrier(const ddp::collective_desc& d, ddp::deadline)
    requires Extended
  {
    exchange({}, d);
  }

 private:
  template <class T, class Op>
  static T combine(const std::vector<std::vector<std::byte>>& all, std::size_t i, Op op) {
    using A = ddp::accumulate_t<T>;
    auto at = [&](std::size_t r) {
      T v;
      std::memcpy(&v, all[r].data() + i * sizeof(T), sizeof(T));
      return static_cast<A>(v);
    };
    A acc = at(0);
    for (std::size_t r = 1; r < all.size(); ++r) acc = op(acc, at(r));
    return T(op.finish(acc, static_cast<int>(all.size())));
  }

  std::vector<std::vector<std::byte>> exchange(std::span<const std::byte> mine, std::optional<ddp::collective_desc> desc) {
    if (desc) seen.push_back(*desc);
    std::unique_lock lock(world_->mutex);
    const std::uint64_t k = round_++;
    auto& rd = world_->rounds[k];
    const auto n = static_cast<std::size_t>(world_->size);
    if (rd.data.empty()) {
      rd.data.resize(n);
      rd.posted.assign(n, false);
      rd.descs.resize(n);
    }
    rd.data[static_cast<std::size_t>(rank_)].assign(mine.begin(), mine.end());
    rd.posted[static_cast<std::size_t>(rank_)] = true;
    if (desc) rd.descs[static_cast<std::size_t>(rank_)] = *desc;
    ++rd.arrived;
    world_->changed.notify_all();
    world_->changed.wait(lock, [&] { return rd.arrived == world_->size || world_->aborted; });
    if (rd.arrived != world_->size) throw ddp::error(ddp::errc::peer_lost, "the local world was aborted");
    if (desc)
      for (int r = 0; r < world_->size; ++r) ddp::check_same_collective(*desc, rd.descs[static_cast<std::size_t>(r)], rank_, r);
    auto result = rd.data;
    if (++rd.consumed == world_->size) world_->rounds.erase(k);
    return result;
  }

  std::shared_ptr<local_world> world_;
  int rank_;
  std::uint64_t round_ = 0;
};

static_assert(ddp::backend<local_backend<false>>);
static_assert(ddp::backend<local_backend<true>>);
static_assert(ddp::backend<local_backend<false, true>>);
static_assert(ddp::detail::pg_enforces_deadlines<local_backend<true>>);
static_assert(!ddp::detail::pg_enforces_deadlines<local_backend<false>>);

using ddp::test::run_threads;

void check(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error("check failed: " + what);
}

template <bool Extended = false, bool Minimal = false>
ddp::process_group<local_backend<Extended, Minimal>> make_group(const std::shared_ptr<local_world>& world, int rank,
                                                                std::chrono::milliseconds timeout = 30s) {
  return ddp::process_group<local_backend<Extended, Minimal>>(local_backend<Extended, Minimal>(world, rank), {.timeout = timeout});
}

// Value of element i on rank r: small integers, exact in every dtype (uint8 products stay < 256).
double input(int r, std::size_t i) { return static_cast<double>((r + 1) + static_cast<int>(i % 3)); }

using ddp::test::from;
using ddp::test::to;

double reference(ddp::reduce_kind k, int p, std::size_t i, bool integral) {
  double acc = input(0, i);
  for (int r = 1; r < p; ++r) {
    const double v = input(r, i);
    switch (k) {
      case ddp::reduce_kind::sum:
      case ddp::reduce_kind::avg: acc += v; break;
      case ddp::reduce_kind::min: acc = std::min(acc, v); break;
      case ddp::reduce_kind::max: acc = std::max(acc, v); break;
      case ddp::reduce_kind::prod: acc *= v; break;
    }
  }
  if (k == ddp::reduce_kind::avg) acc = integral ? std::trunc(acc / p) : acc / p;
  return acc;
}

template <class T, bool Erased = false, bool Minimal = false>
void all_collectives(int p) {
  auto world = std::make_shared<local_world>(p);
  constexpr bool integral = std::is_integral_v<T>;
  run_threads(p, [&](int rank) {
    auto typed = make_group<false, Minimal>(world, rank);
    auto g = [&] {
      if constexpr (Erased) return ddp::group(std::move(typed));
      else return std::move(typed);
    }();
    const std::size_t n = 7;
    // all_reduce, every op, in place and out of place
    for (auto kind : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max, ddp::reduce_kind::prod}) {
      std::vector<T> data(n), out(n);
      for (std::size_t i = 0; i < n; ++i) data[i] = to<T>(input(rank, i));
      const std::vector<T> in = data;
      ddp::visit_reduce_kind(kind, [&](auto op) {
        g.all_reduce(std::span<T>(data), op);
        g.all_reduce(in, out, op);
      });
      for (std::size_t i = 0; i < n; ++i) {
        const double want = from(to<T>(reference(kind, p, i, integral)));
        check(from(data[i]) == want, std::string(ddp::to_string(kind)) + " in place, element " + std::to_string(i));
        check(from(out[i]) == want, std::string(ddp::to_string(kind)) + " out of place, element " + std::to_string(i));
      }
    }
    // broadcast from the last rank
    std::vector<T> b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = to<T>(input(rank, i));
    g.broadcast(b, p - 1);
    for (std::size_t i = 0; i < n; ++i) check(from(b[i]) == input(p - 1, i), "broadcast");
    // reduce to rank 0
    std::vector<T> rd(n);
    for (std::size_t i = 0; i < n; ++i) rd[i] = to<T>(input(rank, i));
    g.reduce(rd, 0, ddp::sum{});
    if (rank == 0)
      for (std::size_t i = 0; i < n; ++i) check(from(rd[i]) == reference(ddp::reduce_kind::sum, p, i, integral), "reduce");
    // all_gather
    std::vector<T> mine(n), everyone(n * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < n; ++i) mine[i] = to<T>(input(rank, i));
    g.all_gather(mine, everyone);
    for (int r = 0; r < p; ++r)
      for (std::size_t i = 0; i < n; ++i) check(from(everyone[static_cast<std::size_t>(r) * n + i]) == input(r, i), "all_gather");
    // reduce_scatter: input element j of rank r is input(r, j)
    std::vector<T> rs_in(n * static_cast<std::size_t>(p)), rs_out(n);
    for (std::size_t j = 0; j < rs_in.size(); ++j) rs_in[j] = to<T>(input(rank, j));
    g.reduce_scatter(rs_in, rs_out, ddp::max{});
    for (std::size_t i = 0; i < n; ++i)
      check(from(rs_out[i]) == reference(ddp::reduce_kind::max, p, static_cast<std::size_t>(rank) * n + i, integral), "reduce_scatter");
    // all_to_all (the backend has none: process_group falls back to all_gather)
    const std::size_t block = 3;
    std::vector<T> a_in(block * static_cast<std::size_t>(p)), a_out(a_in.size());
    for (std::size_t j = 0; j < a_in.size(); ++j) a_in[j] = to<T>(static_cast<double>(rank * 10 + static_cast<int>(j % 10)));
    g.all_to_all(a_in, a_out);
    for (int src = 0; src < p; ++src)
      for (std::size_t e = 0; e < block; ++e) {
        const std::size_t j = static_cast<std::size_t>(rank) * block + e;  // src's element destined here
        check(from(a_out[static_cast<std::size_t>(src) * block + e]) == static_cast<double>(src * 10 + static_cast<int>(j % 10)), "all_to_all");
      }
    g.barrier();
    check(g.next_sequence() == 5 * 2 + 5 + 1, "sequence after 16 calls");
  });
}

}  // namespace

TEMPLATE_TEST_CASE("process_group: every collective, every dtype, p = 1..4", "[process_group]", float, double, ddp::float16,
                   ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int p = 1; p <= 4; ++p) {
    INFO("p = " << p);
    all_collectives<TestType>(p);
  }
}

TEMPLATE_TEST_CASE("process_group over a minimal backend (rank, size, all_reduce, broadcast, abort): every collective, every dtype, p = 1..4",
                   "[process_group]", float, double, ddp::float16, ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int p = 1; p <= 4; ++p) {
    INFO("p = " << p);
    all_collectives<TestType, false, true>(p);
    all_collectives<TestType, true, true>(p);
  }
}

TEMPLATE_TEST_CASE("group (type-erased): every collective, every dtype, p = 1..4", "[group]", float, double, ddp::float16,
                   ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int p = 1; p <= 4; ++p) {
    INFO("p = " << p);
    all_collectives<TestType, true>(p);
  }
}

TEST_CASE("group (type-erased): async, errors, sub-groups and the concrete group behind it") {
  auto world = std::make_shared<local_world>(2);
  run_threads(2, [&](int rank) {
    ddp::group g(make_group<true>(world, rank, 30s));
    check(g.valid() && g.rank() == rank && g.size() == 2, "rank and size");
    check(g.backend_name() == "local-extended", "backend name");
    check(g.get_if<local_backend<true>>() != nullptr && g.get_if<local_backend<false>>() == nullptr, "get_if");
    std::vector<ddp::bfloat16> h(5, ddp::bfloat16(1.5f));
    auto w = g.all_reduce_async(h, ddp::avg{});
    w.wait();
    check(static_cast<float>(h[4]) == 1.5f, "bfloat16 avg");
    check(w.desc().seq == 0 && w.desc().reduction == ddp::reduce_kind::avg, "desc through the erasure");
    try {
      g.broadcast(h, 7);
      check(false, "root 7 accepted");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::invalid_argument, e.what());
    }
    auto sub = g.new_group({1});
    check(sub.valid() == (rank == 1), "sub-group membership");
    if (rank == 1) {
      std::vector<int> x{5};
      sub.all_reduce(x);
      check(x[0] == 5 && sub.size() == 1, "group of one");
    }
    auto buf = g.allocate<double>(6);
    check(buf.size() == 6 && !buf.shared(), "heap buffer from a backend without allocate");
    for (auto& x : buf) x = rank;
    g.all_reduce(buf);
    check(buf[5] == 1.0, "all_reduce on a group_buffer");
    g.set_timeout(5s);
    check(g.timeout() == 5s, "timeout");
    check(g.stats()[ddp::collective::all_reduce].calls == 2, "stats through the erasure");
    check(g.next_sequence() == 2, "next_sequence");
  });
  ddp::group none;
  CHECK_FALSE(none.valid());
  CHECK_THROWS_AS(none.barrier(), ddp::error);
}

TEST_CASE("process_group: sequence numbers and fingerprints reach an extended backend") {
  auto world = std::make_shared<local_world>(2);
  std::vector<std::vector<ddp::collective_desc>> seen(2);
  run_threads(2, [&](int rank) {
    auto g = make_group<true>(world, rank);
    std::vector<float> f(5, 1.0f);
    std::vector<std::int64_t> l(4 * 2), l1(4);
    g.all_reduce(f, ddp::avg{});
    g.broadcast(f, 1);
    g.all_gather(l1, l);
    // argument errors are not sequenced
    try {
      g.broadcast(f, 2);
      check(false, "root 2 accepted");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::invalid_argument, "invalid_argument");
    }
    g.reduce_scatter(l, l1, ddp::min{});
    g.barrier();
    check(g.next_sequence() == 5, "next_sequence");
    seen[static_cast<std::size_t>(rank)] = g.backend().seen;
  });
  for (const auto& s : seen) {
    REQUIRE(s.size() == 5);
    for (std::size_t i = 0; i < s.size(); ++i) CHECK(s[i].seq == i);
    CHECK(s[0].op == ddp::collective::all_reduce);
    CHECK(s[0].type == ddp::dtype::float32);
    CHECK(s[0].count == 5);
    CHECK(s[0].reduction == ddp::reduce_kind::avg);
    CHECK(s[1].op == ddp::collective::broadcast);
    CHECK(s[1].root == 1);
    CHECK(s[2].op == ddp::collective::all_gather);
    CHECK(s[2].count == 4);  // the per-rank slice
    CHECK(s[2].type == ddp::dtype::int64);
    CHECK(s[3].op == ddp::collective::reduce_scatter);
    CHECK(s[3].count == 4);
    CHECK(s[3].reduction == ddp::reduce_kind::min);
    CHECK(s[4].op == ddp::collective::barrier);
  }
}

TEST_CASE("process_group: 100 async all_reduces run in call order, then a blocking call after them") {
  auto world = std::make_shared<local_world>(3);
  std::vector<std::vector<ddp::collective_desc>> seen(3);
  run_threads(3, [&](int rank) {
    auto g = make_group<true>(world, rank);
    std::vector<std::vector<std::int64_t>> buffers(100, std::vector<std::int64_t>(9));
    std::vector<ddp::work> works;
    for (int k = 0; k < 100; ++k) {
      for (std::size_t i = 0; i < 9; ++i) buffers[static_cast<std::size_t>(k)][i] = k * 1000 + rank * 10 + static_cast<std::int64_t>(i);
      works.push_back(g.all_reduce_async(buffers[static_cast<std::size_t>(k)]));
      check(works.back().desc().seq == static_cast<std::uint64_t>(k), "seq of work " + std::to_string(k));
    }
    std::vector<double> last{static_cast<double>(rank)};
    g.all_reduce(last);  // blocking: after the queue, sequenced 100
    check(last[0] == 0 + 1 + 2, "blocking all_reduce after the async ones");
    for (auto& w : works) {
      w.wait();
      check(w.is_completed(), "completed after wait");
    }
    for (int k = 0; k < 100; ++k)
      for (std::size_t i = 0; i < 9; ++i)
        check(buffers[static_cast<std::size_t>(k)][i] == 3 * (k * 1000 + static_cast<std::int64_t>(i)) + 10 * (0 + 1 + 2),
              "async result " + std::to_string(k));
    seen[static_cast<std::size_t>(rank)] = g.backend().seen;
  });
  for (const auto& s : seen) {
    REQUIRE(s.size() == 101);
    for (std::size_t i = 0; i < s.size(); ++i) CHECK(s[i].seq == i);
  }
}

TEST_CASE("process_group: blocking calls from several threads, queued calls and sub-group creation never overlap, in sequence order") {
  // One rank, six threads: four make blocking calls, one queues calls and then makes a blocking
  // call that must run after them, one creates sub-groups (an exclusive section). The backend
  // appends each call to `seen` unsynchronized: overlapping calls would race (ThreadSanitizer
  // runs this) and break the order of the sequence numbers.
  auto world = std::make_shared<local_world>(1);
  auto g = make_group<true>(world, 0);
  constexpr int blocking_threads = 4, calls = 300, queued_rounds = 50;
  run_threads(blocking_threads + 2, [&](int t) {
    if (t < blocking_threads) {
      std::vector<std::int64_t> v(3, t);
      for (int k = 0; k < calls; ++k) {
        g.all_reduce(v);
        check(v[0] == t && v[2] == t, "a world of one leaves the data as it was");
      }
    } else if (t == blocking_threads) {
      for (int k = 0; k < queued_rounds; ++k) {
        std::vector<std::int64_t> a(2, k), b(2, k);
        auto first = g.all_reduce_async(a);
        auto second = g.all_reduce_async(b);
        std::vector<std::int64_t> c(1, k);
        g.all_reduce(c);
        check(first.is_completed() && second.is_completed(), "a blocking call ran before the calls its thread had queued");
        check(second.desc().seq > first.desc().seq, "queued calls sequenced in order");
      }
    } else {
      for (int k = 0; k < 20; ++k) check(g.new_group({0}).valid(), "sub-group of rank 0");
    }
  });
  const auto& seen = g.backend().seen;
  REQUIRE(seen.size() == static_cast<std::size_t>(blocking_threads * calls + 3 * queued_rounds));
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("call " << i);
    REQUIRE(seen[i].seq == i);
  }
  CHECK(g.next_sequence() == seen.size());
}

TEST_CASE("process_group: wait(deadline) is false while a peer is missing, then true") {
  auto world = std::make_shared<local_world>(2);
  std::mutex m;
  std::condition_variable cv;
  bool go = false;
  run_threads(2, [&](int rank) {
    auto g = make_group(world, rank);
    std::vector<float> v{static_cast<float>(rank + 1)};
    if (rank == 1) {
      std::unique_lock lock(m);
      check(cv.wait_for(lock, 30s, [&] { return go; }), "rank 0 never released rank 1");
      lock.unlock();
      g.all_reduce(v);
      return;
    }
    auto w = g.all_reduce_async(v);
    check(!w.wait(ddp::deadline::after(50ms)), "wait returned true without the peer");
    check(!w.is_completed(), "completed without the peer");
    {
      std::lock_guard lock(m);
      go = true;
    }
    cv.notify_all();
    check(w.wait(ddp::deadline::after(30s)), "not done after the peer joined");
    check(w.is_completed() && !w.failed(), "completed");
    check(v[0] == 3.0f, "result");
    check(ddp::work{}.is_completed(), "an empty work is completed");
  });
}

TEST_CASE("process_group: argument errors say what was expected") {
  auto world = std::make_shared<local_world>(1);
  auto g = make_group(world, 0);
  std::vector<float> a(4), b(3), c(8);
  auto expect = [](auto&& f, const std::string& needle) {
    try {
      f();
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(needle));
      return;
    }
    FAIL("no error for " << needle);
  };
  expect([&] { g.broadcast(a, 1); }, "root 1 is out of range: the group has ranks 0..0");
  expect([&] { g.reduce(a, -1); }, "root -1 is out of range");
  expect([&] { g.all_reduce(a, b); }, "out has 3 elements, in has 4");
  expect([&] { g.all_gather(a, b); }, "out has 3 elements, expected in.size() * size() = 4 * 1 = 4");
  expect([&] { g.reduce_scatter(c, a); }, "in has 8 elements, expected out.size() * size() = 4 * 1 = 4");
  expect([&] { g.all_reduce(std::span<const float>(c.data() + 1, 4), std::span<float>(c.data(), 4)); }, "overlap partially");
  expect([&] { g.set_timeout(0ms); }, "must be positive");
  CHECK(g.next_sequence() == 0);
  auto w4 = std::make_shared<local_world>(4);
  run_threads(4, [&](int rank) {
    auto g4 = make_group(w4, rank);
    std::vector<int> in(6), out(6);
    try {
      g4.all_to_all(in, out);
      check(false, "all_to_all of 6 over 4 ranks accepted");
    } catch (const ddp::error& e) {
      check(std::string(e.what()).find("not a multiple of the group size 4") != std::string::npos, e.what());
    }
  });
  ddp::process_group<local_backend<false>> invalid;
  CHECK_FALSE(invalid.valid());
  CHECK(invalid.rank() == -1);
  CHECK_THROWS_AS(invalid.barrier(), ddp::error);
}

TEST_CASE("process_group: a failure breaks the group; later calls fail at once with the cause") {
  auto world = std::make_shared<local_world>(2);
  std::vector<std::string> messages(2);
  run_threads(2, [&](int rank) {
    auto g = make_group<true>(world, rank);
    std::vector<float> f(4);
    std::vector<int> i(4);
    try {
      if (rank == 0) g.all_reduce(f);
      else g.broadcast(i, 0);  // a different collective: both ranks must see a mismatch
      check(false, "mismatch not detected");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::mismatch, e.what());
      messages[static_cast<std::size_t>(rank)] = e.what();
    }
    check(g.broken(), "broken");
    const auto start = std::chrono::steady_clock::now();
    try {
      g.barrier();
      check(false, "a broken group ran a barrier");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::mismatch, "the original code");
      check(std::string(e.what()).find("earlier failure") != std::string::npos, e.what());
      check(std::string(e.what()).find("mismatched collectives") != std::string::npos, e.what());
      check(e.op() == "barrier", "context of the new call");
    }
    try {
      g.all_reduce_async(f);
      check(false, "a broken group queued an all_reduce");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::mismatch, "async: the original code");
    }
    check(std::chrono::steady_clock::now() - start < 1s, "fail fast");
  });
  CHECK_THAT(messages[0], Catch::Contains("all_reduce #0 (float32 x 4, sum)"));
  CHECK_THAT(messages[0], Catch::Contains("broadcast #0 (int32 x 4, root 0)"));
  CHECK_THAT(messages[1], Catch::Contains("rank 1"));
}

TEST_CASE("process_group: an async failure is rethrown by wait() and fails the queued work") {
  auto world = std::make_shared<local_world>(2);
  run_threads(2, [&](int rank) {
    auto g = make_group<true>(world, rank);
    std::vector<float> f(4);
    std::vector<double> d(4);
    auto w1 = rank == 0 ? g.all_reduce_async(f) : g.all_reduce_async(d);  // dtype mismatch
    // The second call is queued, or, if the first already failed, refused at once: both fine.
    ddp::work w2;
    bool refused = false;
    try {
      w2 = g.all_reduce_async(f);
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::mismatch, e.what());
      refused = true;
    }
    try {
      w1.wait();
      check(false, "mismatch not reported by wait");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::mismatch, e.what());
      check(e.seq() == 0u, "seq 0");
    }
    if (!refused) {
      try {
        w2.wait();
        check(false, "queued work after a failure succeeded");
      } catch (const ddp::error& e) {
        check(e.code() == ddp::errc::mismatch && e.seq() == 1u, e.what());
      }
      check(w2.failed(), "failed()");
    }
    check(w1.failed(), "failed()");
  });
}

TEST_CASE("process_group: the watchdog aborts a backend that blocks and names the missing rank") {
  // Rank 2 never arrives. The first watchdog to fire aborts the shared world, so the other
  // waiting rank may see that abort (peer_lost) before its own watchdog fires: like a real
  // peer whose connections close. At least one rank reports the timeout in full.
  auto world = std::make_shared<local_world>(3);
  std::vector<std::string> timeouts(3);
  run_threads(3, [&](int rank) {
    auto g = make_group(world, rank, 300ms);
    std::vector<float> v(16, 1.0f);
    if (rank == 2) return;
    const auto start = std::chrono::steady_clock::now();
    ddp::errc code{};
    try {
      g.all_reduce(v);
      check(false, "returned without rank 2");
    } catch (const ddp::error& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      code = e.code();
      check(code == ddp::errc::timeout || code == ddp::errc::peer_lost, e.what());
      if (code == ddp::errc::timeout) timeouts[static_cast<std::size_t>(rank)] = e.what();
      check(took >= 290ms && took < 5s, "fired at the deadline");
    }
    try {
      g.barrier();
      check(false, "a failed group ran a barrier");
    } catch (const ddp::error& e) {
      check(e.code() == code, "fails fast with the first cause");
    }
  });
  const std::string what = timeouts[0].empty() ? timeouts[1] : timeouts[0];
  REQUIRE_FALSE(what.empty());
  CHECK_THAT(what, Catch::Contains("all_reduce #0 (float32 x 16, sum)"));
  CHECK_THAT(what, Catch::Contains("300 ms"));
  CHECK_THAT(what, Catch::Contains("ranks that did not arrive: 2"));
}

TEST_CASE("process_group: an async collective also times out, and wait() reports it") {
  auto world = std::make_shared<local_world>(2);
  run_threads(2, [&](int rank) {
    auto g = make_group(world, rank, 200ms);
    if (rank == 1) return;
    std::vector<float> v(3);
    auto w = g.broadcast_async(v, 1);
    try {
      w.wait();
      check(false, "no timeout");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::timeout, e.what());
      check(std::string(e.what()).find("broadcast #0") != std::string::npos, e.what());
    }
  });
}

TEST_CASE("process_group: sub-groups reduce over their members only") {
  auto world = std::make_shared<local_world>(4);
  run_threads(4, [&](int rank) {
    auto g = make_group(world, rank);
    auto odd = g.new_group({3, 1});
    auto all = g.new_group({0, 1, 2, 3});
    std::vector<int> v{rank};
    if (rank % 2 == 1) {
      check(odd.valid() && odd.size() == 2 && odd.rank() == rank / 2, "member ranks are the group's own");
      odd.all_reduce(v);
      check(v[0] == 1 + 3, "sum over {1, 3}");
    } else {
      check(!odd.valid() && odd.rank() == -1, "non-members get an invalid group");
      try {
        odd.all_reduce(v);
        check(false, "a non-member called a collective");
      } catch (const ddp::error& e) {
        check(e.code() == ddp::errc::invalid_argument, e.what());
      }
    }
    std::vector<int> w{rank};
    all.all_reduce(w);
    check(w[0] == 6, "the second sub-group is separate from the first");
    g.all_reduce(w);
    check(w[0] == 24, "the parent still works");
    try {
      (void)g.new_group({0, 0});
      check(false, "duplicate accepted");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::invalid_argument, e.what());
    }
  });
}

TEST_CASE("process_group: statistics count calls, bytes and time per collective kind") {
  auto world = std::make_shared<local_world>(2);
  std::vector<ddp::group_stats> stats(2);
  run_threads(2, [&](int rank) {
    auto g = make_group(world, rank);
    std::vector<float> v(256);
    std::vector<float> gathered(512);
    for (int i = 0; i < 3; ++i) g.all_reduce(v);
    g.all_gather(v, gathered);
    g.all_reduce_async(v).wait();
    stats[static_cast<std::size_t>(rank)] = g.stats();
  });
  for (const auto& s : stats) {
    CHECK(s[ddp::collective::all_reduce].calls == 4);
    CHECK(s[ddp::collective::all_reduce].bytes == 4 * 256 * 4);
    CHECK(s[ddp::collective::all_reduce].time.count() > 0);
    CHECK(s[ddp::collective::all_gather].calls == 1);
    CHECK(s[ddp::collective::all_gather].bytes == 512 * 4);
    CHECK(s.total().calls == 5);
    CHECK(s.total().failures == 0);
  }
}

TEST_CASE("process_group: contiguous ranges and aliasing buffers") {
  auto world = std::make_shared<local_world>(2);
  run_threads(2, [&](int rank) {
    auto g = make_group(world, rank);
    std::array<double, 3> a{1.0 * rank, 2.0, 3.0};
    g.all_reduce(a, ddp::max{});
    check(a[0] == 1.0 && a[1] == 2.0, "std::array");
    // all_gather in place: in is this rank's slice of out
    std::vector<std::int64_t> out(4);
    out[static_cast<std::size_t>(rank) * 2] = 10 + rank;
    out[static_cast<std::size_t>(rank) * 2 + 1] = 20 + rank;
    g.all_gather(std::span<const std::int64_t>(out.data() + rank * 2, 2), std::span<std::int64_t>(out));
    check(out == std::vector<std::int64_t>{10, 20, 11, 21}, "in-place all_gather");
    // same span for in and out: in-place all_reduce
    std::vector<float> f{1.0f, 2.0f};
    g.all_reduce(std::span<const float>(f), std::span<float>(f));
    check(f[0] == 2.0f && f[1] == 4.0f, "same span for in and out");
    auto mem = g.allocate<float>(10);
    check(mem.size() == 10, "allocate");
  });
}

TEST_CASE("process_group: send/recv on a backend without them is errc::unavailable") {
  auto world = std::make_shared<local_world>(2);
  auto g = make_group(world, 0);
  std::vector<float> v(2);
  try {
    g.send(v, 1);
    FAIL("send accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::unavailable);
  }
  CHECK(g.next_sequence() == 0);
}

}  // namespace ddp_test_process_group
