// ring_backend under process_group, with real forked ranks over real transports (shared memory
// and TCP loopback), rendezvous through a file_store: every collective x every dtype x sizes
// {0, 1, 7, 1023, 65539} (small-message and ring paths) x p in {1, 2, 3, 4}, against references
// computed here in int64 / double from the inputs' closed form. Also: a large all_reduce, a
// mismatch seen on every rank, a killed peer noticed at once, sub-groups, async order, a
// decorator over the ring backend built with make_ring_backend.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../../examples/custom_backend/traced_backend.hpp"
#include "ddp/backends/ring.hpp"
#include "ddp/group.hpp"
#include "ddp/init.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "support/multiprocess.hpp"
#include "support/sizes.hpp"
#include "support/element_values.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_ring_backend {

using namespace std::chrono_literals;
using ddp::test::check;
using kind = ddp::ring_options::transport_kind;

namespace {

std::string store_path(const std::string& name) {
  return std::string(DDP_TEST_BINARY_DIR) + "/ring_backend_" + name + "_" + std::to_string(::getpid()) + ".store";
}

// The store file is made fresh per run and removed by the parent afterwards.
struct store_file {
  explicit store_file(std::string n) : path(store_path(n)) { std::remove(path.c_str()); }
  ~store_file() { std::remove(path.c_str()); }
  std::string path;
};

ddp::process_group<ddp::ring_backend> make_group(const std::string& path, int rank, int p, kind transport,
                                                 std::chrono::milliseconds timeout = 60s) {
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::ring_options o;
  o.transport = transport;
  o.timeout = 60s;
  ddp::ring_backend b(store, rank, p, o);
  check(p == 1 || transport == kind::automatic || b.on_shared_memory() == (transport == kind::shm), "transport chosen as asked");
  return ddp::process_group<ddp::ring_backend>(std::move(b), {.timeout = timeout});
}

// Reducing inputs in 1..3: sums, products (<= 81) and averages are exact in every dtype.
double red_in(int r, std::size_t i) { return 1.0 + static_cast<double>((static_cast<std::size_t>(r) + i) % 3); }
// Moving inputs: distinct per rank and element, < 256 so exact in uint8 and bfloat16.
double mov_in(int r, std::size_t i) { return static_cast<double>((static_cast<std::size_t>(r) * 37 + i * 11) % 251); }

using ddp::test::from;
using ddp::test::to;

template <class T>
double reference(ddp::reduce_kind k, int p, std::size_t i) {
  double acc = red_in(0, i);
  for (int r = 1; r < p; ++r) {
    const double v = red_in(r, i);
    if (k == ddp::reduce_kind::sum || k == ddp::reduce_kind::avg) acc += v;
    else if (k == ddp::reduce_kind::min) acc = std::min(acc, v);
    else if (k == ddp::reduce_kind::max) acc = std::max(acc, v);
    else acc *= v;
  }
  if (k == ddp::reduce_kind::avg) acc = std::is_integral_v<T> ? std::trunc(acc / p) : acc / p;
  return from(to<T>(acc));  // one rounding into T, as accumulation in float32/float64 gives
}

template <class T>
void every_collective(ddp::process_group<ddp::ring_backend>& g, std::size_t n) {
  const int p = g.size(), me = g.rank();
  const std::string where = std::string(ddp::to_string(ddp::dtype_of<T>)) + " n=" + std::to_string(n) + " rank " + std::to_string(me);
  for (auto k : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::min, ddp::reduce_kind::max, ddp::reduce_kind::prod}) {
    std::vector<T> data(n), out(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = to<T>(red_in(me, i));
    const std::vector<T> in = data;
    ddp::visit_reduce_kind(k, [&](auto op) {
      g.all_reduce(std::span<T>(data), op);
      g.all_reduce(in, out, op);
    });
    for (std::size_t i = 0; i < n; ++i) {
      const double want = reference<T>(k, p, i);
      if (from(data[i]) != want || from(out[i]) != want) {
        check(false, "all_reduce " + std::string(ddp::to_string(k)) + " " + where + " element " + std::to_string(i) + ": got " +
                         std::to_string(from(data[i])) + " / " + std::to_string(from(out[i])) + ", want " + std::to_string(want));
      }
    }
  }
  {  // broadcast from the last rank
    std::vector<T> b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = to<T>(mov_in(me, i));
    g.broadcast(b, p - 1);
    for (std::size_t i = 0; i < n; ++i) check(from(b[i]) == mov_in(p - 1, i), "broadcast " + where);
  }
  {  // reduce to rank p / 2
    std::vector<T> r(n);
    for (std::size_t i = 0; i < n; ++i) r[i] = to<T>(red_in(me, i));
    const int root = p / 2;
    g.reduce(r, root, ddp::max{});
    if (me == root)
      for (std::size_t i = 0; i < n; ++i) check(from(r[i]) == reference<T>(ddp::reduce_kind::max, p, i), "reduce " + where);
  }
  {  // all_gather
    std::vector<T> mine(n), all(n * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < n; ++i) mine[i] = to<T>(mov_in(me, i));
    g.all_gather(mine, all);
    for (int r = 0; r < p; ++r)
      for (std::size_t i = 0; i < n; ++i) check(from(all[static_cast<std::size_t>(r) * n + i]) == mov_in(r, i), "all_gather " + where);
  }
  {  // reduce_scatter: element j of rank r is red_in(r, j); rank me gets block me
    std::vector<T> in(n * static_cast<std::size_t>(p)), out(n);
    for (std::size_t j = 0; j < in.size(); ++j) in[j] = to<T>(red_in(me, j));
    g.reduce_scatter(in, out, ddp::sum{});
    for (std::size_t i = 0; i < n; ++i)
      check(from(out[i]) == reference<T>(ddp::reduce_kind::sum, p, static_cast<std::size_t>(me) * n + i), "reduce_scatter " + where);
  }
  {  // all_to_all: block b of rank r holds mov_in(r, b * n + e)
    std::vector<T> in(n * static_cast<std::size_t>(p)), out(in.size());
    for (std::size_t j = 0; j < in.size(); ++j) in[j] = to<T>(mov_in(me, j));
    g.all_to_all(in, out);
    for (int src = 0; src < p; ++src)
      for (std::size_t e = 0; e < n; ++e)
        check(from(out[static_cast<std::size_t>(src) * n + e]) == mov_in(src, static_cast<std::size_t>(me) * n + e), "all_to_all " + where);
  }
  if (p > 1) {  // send to the next rank, receive from the previous (even ranks send first: no cycle)
    std::vector<T> s(n), r(n);
    for (std::size_t i = 0; i < n; ++i) s[i] = to<T>(mov_in(me, i));
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    if (me % 2 == 0) {
      g.send(s, next);
      g.recv(r, prev);
    } else {
      g.recv(r, prev);
      g.send(s, next);
    }
    for (std::size_t i = 0; i < n; ++i) check(from(r[i]) == mov_in(prev, i), "send/recv " + where);
  }
  g.barrier();
}

template <class... T>
void all_dtypes(ddp::process_group<ddp::ring_backend>& g, std::size_t n) {
  (every_collective<T>(g, n), ...);
}

void sweep(kind transport, int p) {
  store_file file(std::string(ddp::to_string(transport)) + std::to_string(p));
  const auto result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        auto g = make_group(file.path, rank, p, transport);
        // The last size takes the ring (not the small-message path) for every dtype and p <= 4;
        // under a sanitizer a quarter of it still does (the chunked ring is covered with small
        // chunks by ring_algorithms_test and tcp_collectives_test).
        const std::size_t ring_sized = ddp::test::sanitized_build ? 16411 : 65539;
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1023}, ring_sized}) {
          all_dtypes<float, double, ddp::float16, ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t>(g, n);
        }
        // one large buffer: many chunks of the pipelined ring
        std::vector<float> big(ddp::test::large_count);
        for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>((i + static_cast<std::size_t>(rank)) % 1000);
        g.all_reduce(big);
        for (std::size_t i = 0; i < big.size(); ++i) {
          double want = 0;
          for (int r = 0; r < p; ++r) want += static_cast<double>((i + static_cast<std::size_t>(r)) % 1000);
          if (big[i] != static_cast<float>(want)) check(false, "large all_reduce element " + std::to_string(i));
        }
      },
      170s);
  INFO(result.describe());
  REQUIRE(result.ok());
}

}  // namespace

TEST_CASE("ring_backend: every collective and dtype over shm, p = 1") { sweep(kind::shm, 1); }
TEST_CASE("ring_backend: every collective and dtype over shm, p = 2") { sweep(kind::shm, 2); }
TEST_CASE("ring_backend: every collective and dtype over shm, p = 3") { sweep(kind::shm, 3); }
TEST_CASE("ring_backend: every collective and dtype over shm, p = 4") { sweep(kind::shm, 4); }
TEST_CASE("ring_backend: every collective and dtype over tcp, p = 2") { sweep(kind::tcp, 2); }
TEST_CASE("ring_backend: every collective and dtype over tcp, p = 3") { sweep(kind::tcp, 3); }
TEST_CASE("ring_backend: every collective and dtype over tcp, p = 4") { sweep(kind::tcp, 4); }

// A user's own reduction, not one of ddp's five: the element of larger magnitude. Its kind says
// max, but max would give a different answer, so a backend that ran the kind instead of this
// operator() fails the test.
struct larger_magnitude {
  static constexpr ddp::reduce_kind kind = ddp::reduce_kind::max;
  template <class T>
  static constexpr T magnitude(T v) noexcept {
    if constexpr (std::is_signed_v<T>) return v < T{} ? static_cast<T>(-v) : v;
    else return v;
  }
  template <class T>
  constexpr T operator()(T a, T b) const noexcept { return magnitude(b) > magnitude(a) ? b : a; }
  template <class T>
  constexpr T finish(T v, int) const noexcept { return v; }
};
static_assert(ddp::reduce_op<larger_magnitude> && !ddp::builtin_reduce_op<larger_magnitude>);

// Inputs of distinct magnitudes per element, most of them negative: max and larger_magnitude disagree.
double signed_in(int r, std::size_t i) {
  const double m = static_cast<double>((static_cast<std::size_t>(r) * 7 + i * 3) % 23) + 1;
  return (static_cast<std::size_t>(r) + i) % 4 == 0 ? m : -m;
}

template <class T>
void user_op_collectives(ddp::process_group<ddp::ring_backend>& g, int p, std::size_t n) {
  const int rank = g.rank();
  auto want = [&](std::size_t i) {
    double best = signed_in(0, i);
    for (int r = 1; r < p; ++r)
      if (std::fabs(signed_in(r, i)) > std::fabs(best)) best = signed_in(r, i);
    return best;
  };
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = to<T>(signed_in(rank, i));
  g.all_reduce(std::span<T>(v), larger_magnitude{});
  for (std::size_t i = 0; i < n; ++i)
    if (from(v[i]) != want(i)) check(false, "all_reduce with a user's op, n = " + std::to_string(n) + ", element " + std::to_string(i));
  std::vector<T> in(n * static_cast<std::size_t>(p)), out(n);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = to<T>(signed_in(rank, i));
  g.reduce_scatter(std::span<const T>(in), std::span<T>(out), larger_magnitude{});
  for (std::size_t i = 0; i < n; ++i)
    if (from(out[i]) != want(static_cast<std::size_t>(rank) * n + i)) check(false, "reduce_scatter with a user's op, element " + std::to_string(i));
  for (std::size_t i = 0; i < n; ++i) v[i] = to<T>(signed_in(rank, i));
  g.reduce(std::span<T>(v), p - 1, larger_magnitude{});
  if (rank == p - 1)
    for (std::size_t i = 0; i < n; ++i)
      if (from(v[i]) != want(i)) check(false, "reduce with a user's op, element " + std::to_string(i));
}

TEST_CASE("ring_backend: a user's own reduce op runs its operator() on shm, tcp and the hierarchy, small and large") {
  using hier = ddp::ring_options::hierarchy_kind;
  struct setup {
    kind transport;
    hier hierarchy;
    const char* name;
  };
  for (const setup s : {setup{kind::shm, hier::automatic, "shm"}, setup{kind::tcp, hier::automatic, "tcp"},
                        setup{kind::automatic, hier::hierarchical, "hierarchical"}}) {
    INFO(s.name);
    const int p = 4;
    store_file file(std::string("userop_") + s.name);
    const auto result = ddp::test::run_ranks(
        p,
        [&](int rank) {
          auto store = std::make_shared<ddp::store::file_store>(file.path);
          ddp::ring_options o;
          o.transport = s.transport;
          o.hierarchy = s.hierarchy;
          o.timeout = 60s;
          if (s.hierarchy == hier::hierarchical) o.host_identity = "host" + std::to_string(rank / 2);  // two hosts of two ranks
          ddp::process_group<ddp::ring_backend> g(ddp::ring_backend(store, rank, p, o), {.timeout = 60s});
          check(s.hierarchy != hier::hierarchical || g.backend().hierarchical(), "two posed hosts make a hierarchy");
          for (std::size_t n : {std::size_t{5}, std::size_t{70001}}) {  // the small-message path and the ring
            user_op_collectives<float>(g, p, n);
            user_op_collectives<std::int32_t>(g, p, n);
          }
        },
        170s);
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("ring_backend: automatic transport picks shared memory on one host") {
  store_file file("auto");
  const auto result = ddp::test::run_ranks(2, [&](int rank) {
    auto store = std::make_shared<ddp::store::file_store>(file.path);
    ddp::ring_backend b(store, rank, 2, {.timeout = 30s});
    check(b.on_shared_memory() && b.transport_name() == "shm", "same host -> shm");
    ddp::process_group g(std::move(b));
    std::vector<double> v{1.0 + rank};
    g.all_reduce(v);
    check(v[0] == 3.0, "all_reduce");
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("ring_backend: different collectives at one sequence number are a mismatch on every rank") {
  for (kind transport : {kind::shm, kind::tcp}) {
    store_file file(std::string("mismatch") + std::string(ddp::to_string(transport)));
    const auto result = ddp::test::run_ranks(
        3,
        [&](int rank) {
          auto g = make_group(file.path, rank, 3, transport, 20s);
          std::vector<float> f(100, 1.0f);
          std::vector<std::int64_t> l(8);
          const auto start = std::chrono::steady_clock::now();
          try {
            if (rank == 1) g.broadcast(l, 0);
            else g.all_reduce(f);
            check(false, "no error");
          } catch (const ddp::error& e) {
            check(e.code() == ddp::errc::mismatch || e.code() == ddp::errc::peer_lost, e.what());
            check(std::chrono::steady_clock::now() - start < 10s, "well before the deadline");
            std::printf("%s\n", e.what());
          }
        },
        60s);
    INFO(result.describe());
    REQUIRE(result.ok());
    int mismatches = 0;
    for (const auto& r : result.ranks) mismatches += r.output.find("mismatched collectives") != std::string::npos ? 1 : 0;
    CHECK(mismatches >= 1);  // whoever compared headers with the odd one out; the others see it abort (peer_lost)
  }
}

TEST_CASE("ring_backend: a rank that exits is noticed at once by the others") {
  for (kind transport : {kind::shm, kind::tcp}) {
    store_file file(std::string("death") + std::string(ddp::to_string(transport)));
    store_file done_file(std::string("death-done") + std::string(ddp::to_string(transport)));
    const auto result = ddp::test::run_ranks(
        3,
        [&](int rank) {
          auto g = make_group(file.path, rank, 3, transport, 60s);
          std::vector<float> v(1000, 1.0f);
          g.all_reduce(v);  // everyone is connected
          // Rank 2 leaves only once the others have returned from that all_reduce: its own return
          // does not mean theirs, and a peer lost inside it would fail it.
          ddp::store::file_store done(done_file.path);
          if (rank != 2) done.set_string("returned/" + std::to_string(rank), "1");
          if (rank == 2) {
            done.wait({"returned/0", "returned/1"}, 30s);
            ::_exit(0);
          }
          const auto start = std::chrono::steady_clock::now();
          try {
            for (int i = 0; i < 100; ++i) g.all_reduce(v);
            check(false, "no error after a peer exited");
          } catch (const ddp::error& e) {
            check(e.code() == ddp::errc::peer_lost, e.what());
            check(std::chrono::steady_clock::now() - start < 10s, "at once, not at the 60 s deadline");
          }
        },
        90s);
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("ring_backend: sub-groups and async order across processes") {
  store_file file("sub");
  const auto result = ddp::test::run_ranks(4, [&](int rank) {
    auto g = make_group(file.path, rank, 4, kind::automatic);
    auto evens = g.new_group({0, 2});
    auto odds = g.new_group({1, 3});
    auto& mine = rank % 2 == 0 ? evens : odds;
    check(mine.valid() && mine.size() == 2 && mine.rank() == rank / 2, "membership");
    check(!(rank % 2 == 0 ? odds : evens).valid(), "not a member of the other");
    std::vector<int> v{rank};
    mine.all_reduce(v);
    check(v[0] == (rank % 2 == 0 ? 0 + 2 : 1 + 3), "sub-group sum");
    std::vector<std::vector<std::int64_t>> bufs(50, std::vector<std::int64_t>(33));
    std::vector<ddp::work> works;
    for (int k = 0; k < 50; ++k) {
      for (auto& x : bufs[static_cast<std::size_t>(k)]) x = k + rank;
      works.push_back(g.all_reduce_async(bufs[static_cast<std::size_t>(k)]));
    }
    for (auto& w : works) w.wait();
    for (int k = 0; k < 50; ++k)
      for (auto x : bufs[static_cast<std::size_t>(k)]) check(x == 4 * k + 6, "async all_reduce " + std::to_string(k));
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("ring_backend: allocate gives shared memory on shm and heap memory on tcp; collectives take both") {
  for (kind transport : {kind::shm, kind::tcp}) {
    store_file file(std::string("alloc") + std::string(ddp::to_string(transport)));
    const auto result = ddp::test::run_ranks(3, [&](int rank) {
      auto g = make_group(file.path, rank, 3, transport);
      for (std::size_t n : {std::size_t{5}, std::size_t{3000}, std::size_t{300000}}) {
        auto buf = g.allocate<float>(n);
        check(buf.size() == n && buf.shared() == (transport == kind::shm), "buffer kind");
        for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 7);
        g.all_reduce(buf);
        for (std::size_t i = 0; i < n; ++i) check(buf[i] == 6.0f * static_cast<float>(i % 7), "all_reduce on allocated memory");
        auto gathered = g.allocate<std::int32_t>(3 * n);
        auto mine = g.allocate<std::int32_t>(n);
        for (std::size_t i = 0; i < n; ++i) mine[i] = rank * 1000 + static_cast<std::int32_t>(i % 999);
        g.all_gather(mine, gathered);
        for (int r = 0; r < 3; ++r)
          for (std::size_t i = 0; i < n; i += 97)
            check(gathered[static_cast<std::size_t>(r) * n + i] == r * 1000 + static_cast<std::int32_t>(i % 999), "all_gather on allocated memory");
        g.broadcast(buf, 2);
      }
    });
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("ring_backend: a decorator over it (examples/custom_backend/traced_backend.hpp) gets every call as one record") {
  using traced = example::traced_backend<ddp::ring_backend>;
  for (kind transport : {kind::shm, kind::tcp}) {
    store_file file(std::string("traced") + std::string(ddp::to_string(transport)));
    const auto result = ddp::test::run_ranks(3, [&](int rank) {
      ddp::backend_context c;
      c.name = "traced";
      c.rank = rank;
      c.world_size = 3;
      c.store = std::make_shared<ddp::store::file_store>(file.path);
      c.prefix = "traced";
      c.options.init_timeout = 60s;
      ddp::group g(ddp::process_group<traced>(traced(ddp::make_ring_backend(c, transport)), {.timeout = 60s}));
      check(g.backend_name() == "traced", "the decorator's name");
      std::vector<double> x(1000, rank + 1.0);
      g.all_reduce(x, ddp::avg{});
      for (double v : x) check(v == 2.0, "all_reduce through the decorator");
      std::vector<std::int64_t> mine(4, rank), everyone(12);
      g.all_gather(mine, everyone);
      for (std::size_t i = 0; i < everyone.size(); ++i) check(everyone[i] == static_cast<std::int64_t>(i / 4), "all_gather through the decorator");
      auto w = g.all_reduce_async(std::span(x));
      w.wait();
      g.barrier();
      auto sub = g.new_group({0, 2});
      if (sub.valid()) {
        std::vector<float> y{float(rank)};
        sub.all_reduce(y);
        check(y[0] == 2.0f, "a sub-group of decorated backends");
      }
      const traced& t = g.get_if<traced>()->backend();
      check(t.of(ddp::collective::all_reduce).calls == 2 && t.of(ddp::collective::all_reduce).bytes == 2 * 1000 * sizeof(double),
            "all_reduce calls and bytes seen by the decorator");
      check(t.of(ddp::collective::all_gather).calls == 1 && t.of(ddp::collective::all_gather).bytes == 12 * sizeof(std::int64_t),
            "all_gather seen by the decorator");
      check(t.of(ddp::collective::barrier).calls == 1, "barrier seen by the decorator");
    });
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

}  // namespace ddp_test_ring_backend
