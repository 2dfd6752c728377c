// Hierarchical all-reduce of ring_backend with forked ranks posing as several hosts
// (ring_options::host_identity): 2 hosts x 2 ranks and 3 hosts x 2 ranks, against closed forms;
// the leaders' inter-host traffic (about 2 (h - 1) / h of the buffer); when `automatic` picks
// the hierarchy; the other collectives and sub-groups on a hierarchical backend; a killed rank
// seen as peer_lost by every other rank at once; disagreeing choices are a config error.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ddp/backends/ring.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "support/multiprocess.hpp"
#include "support/sizes.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_hierarchical {

using namespace std::chrono_literals;
using ddp::test::check;
using hier = ddp::ring_options::hierarchy_kind;

namespace {

struct store_file {
  explicit store_file(const std::string& n)
      : path(std::string(DDP_TEST_BINARY_DIR) + "/hierarchical_" + n + "_" + std::to_string(::getpid()) + ".store") {
    std::remove(path.c_str());
  }
  ~store_file() { std::remove(path.c_str()); }
  std::string path;
};

// Rank r poses as host hosts_of[r].
ddp::ring_backend make_backend(const std::string& path, int rank, const std::vector<int>& host_of, hier h = hier::automatic,
                               const std::string& prefix = "ddp") {
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::ring_options o;
  o.prefix = prefix;
  o.hierarchy = h;
  o.timeout = 60s;
  o.host_identity = "test-host-" + std::to_string(host_of[static_cast<std::size_t>(rank)]);
  return ddp::ring_backend(store, rank, static_cast<int>(host_of.size()), o);
}

std::vector<int> hosts_of(int hosts, int per_host) {  // ranks of a host are contiguous
  std::vector<int> v;
  for (int h = 0; h < hosts; ++h)
    for (int k = 0; k < per_host; ++k) v.push_back(h);
  return v;
}

double input(int r, std::size_t i) { return static_cast<double>((static_cast<std::size_t>(r) * 7 + i) % 19) - 5.0; }

template <class T>
void check_all_reduce(ddp::process_group<ddp::ring_backend>& g, std::size_t n) {
  const int p = g.size(), me = g.rank();
  for (auto k : {ddp::reduce_kind::sum, ddp::reduce_kind::avg, ddp::reduce_kind::max}) {
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<T>(input(me, i));
    ddp::visit_reduce_kind(k, [&](auto op) { g.all_reduce(std::span<T>(data), op); });
    for (std::size_t i = 0; i < n; ++i) {
      double want = input(0, i);
      for (int r = 1; r < p; ++r) want = k == ddp::reduce_kind::max ? std::max(want, input(r, i)) : want + input(r, i);
      if (k == ddp::reduce_kind::avg) want = std::is_integral_v<T> ? std::trunc(want / p) : want / p;
      const auto expected = static_cast<T>(want);  // one rounding of the float64 reference
      if (data[i] != expected) {
        check(false, "all_reduce " + std::string(ddp::to_string(k)) + " " + std::string(ddp::to_string(ddp::dtype_of<T>)) + " n=" +
                         std::to_string(n) + " rank " + std::to_string(me) + " element " + std::to_string(i) + ": got " +
                         std::to_string(static_cast<double>(data[i])) + ", want " + std::to_string(want));
      }
    }
  }
}

void sweep(int hosts, int per_host) {
  store_file file("sweep" + std::to_string(hosts));
  const auto host_of = hosts_of(hosts, per_host);
  const int p = hosts * per_host;
  const auto result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 60s});
        check(g.backend().hierarchical() && g.backend().transport_name() == "shm+tcp", "automatic picks hierarchical");
        check(g.backend().hosts() == hosts, "host count");
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1023}, ddp::test::large_count}) {
          check_all_reduce<float>(g, n);
          check_all_reduce<double>(g, n);
          check_all_reduce<std::int64_t>(g, n);
        }
        // On group-allocated (shared) memory as well: zero copy within each host.
        auto buf = g.allocate<float>(300001);
        check(buf.shared(), "allocate gives shared memory within a host");
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(input(rank, i));
        g.all_reduce(buf);
        for (std::size_t i = 0; i < buf.size(); i += 7) {
          double want = 0;
          for (int r = 0; r < p; ++r) want += input(r, i);
          check(buf[i] == static_cast<float>(want), "all_reduce on allocated memory");
        }
      },
      170s);
  INFO(result.describe());
  REQUIRE(result.ok());
}

// The first rank an error names after its own "ddp: rank R: " prefix (-1: none): the rank it
// blames, as the kill campaign reads it. Every level of the hierarchy must name the backend's
// ranks, not its own (a host's ranks 0..1, the leaders 0..h-1).
int first_named_rank(const std::string& what) {
  const auto prefix = what.find("ddp: rank ");
  auto at = what.find(": ", prefix == std::string::npos ? 0 : prefix + 10);
  for (at = what.find("rank ", at); at != std::string::npos; at = what.find("rank ", at + 1)) {
    if (at + 5 < what.size() && std::isdigit(static_cast<unsigned char>(what[at + 5])) != 0) return std::atoi(what.c_str() + at + 5);
  }
  return -1;
}

// The bytes a rank sends over TCP in one float32 all_reduce of n elements.
std::uint64_t bytes_of_one(ddp::process_group<ddp::ring_backend>& g, std::size_t n) {
  std::vector<float> v(n, 1.0f);
  g.barrier();
  const auto before = g.backend().tcp_bytes_sent();
  g.all_reduce(v);
  const auto sent = g.backend().tcp_bytes_sent() - before;
  for (float x : v) check(x == static_cast<float>(g.size()), "all_reduce value");
  return sent;
}

}  // namespace

TEST_CASE("hierarchical: all_reduce sum/avg/max, float32/float64/int64, 2 hosts x 2 ranks") { sweep(2, 2); }
TEST_CASE("hierarchical: all_reduce sum/avg/max, float32/float64/int64, 3 hosts x 2 ranks") { sweep(3, 2); }

TEST_CASE("hierarchical: a leader sends about 2(h-1)/h of the buffer between hosts, the others nothing") {
  for (int hosts : {2, 3}) {
    store_file file("bytes" + std::to_string(hosts));
    const auto host_of = hosts_of(hosts, 2);
    const std::size_t n = std::size_t{1} << 20;  // 4 MiB of float32: the ring, not the direct algorithm
    const double bytes = static_cast<double>(n * sizeof(float));
    const auto result = ddp::test::run_ranks(static_cast<int>(host_of.size()), [&](int rank) {
      for (hier h : {hier::hierarchical, hier::flat}) {
        ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of, h, std::string(ddp::to_string(h))));
        check(g.backend().hierarchical() == (h == hier::hierarchical), "hierarchy as asked");
        const auto sent = static_cast<double>(bytes_of_one(g, n));
        const bool leader = rank % 2 == 0;
        const double p = static_cast<double>(host_of.size());
        const double want = h == hier::flat ? 2 * (p - 1) / p * bytes : leader ? 2.0 * (hosts - 1) / hosts * bytes : 0.0;
        std::printf("rank %d %s: sent %.0f bytes, expected about %.0f\n", rank, std::string(ddp::to_string(h)).c_str(), sent, want);
        if (want == 0) check(sent == 0, "a non-leader sends nothing over TCP in a hierarchical all_reduce");
        else check(std::abs(sent - want) <= 0.03 * want, "bytes sent within 3% of the expected");
        if (h == hier::hierarchical && leader) check(g.backend().inter_host_leader_bytes_sent() >= static_cast<std::uint64_t>(sent), "leader counter");
      }
    });
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("hierarchical: automatic picks the hierarchy only when every host has at least 2 ranks") {
  struct layout {
    std::vector<int> host_of;
    bool hierarchical;
    std::string_view transport;
  };
  const std::vector<layout> cases = {
      {{0, 0, 1, 1}, true, "shm+tcp"},  // 2 x 2
      {{0, 1, 0, 1}, true, "shm+tcp"},  // 2 x 2, interleaved ranks
      {{0, 0, 0, 1}, false, "tcp"},     // one host has a single rank
      {{0, 1, 2}, false, "tcp"},        // one rank per host
      {{0, 0, 0}, false, "shm"},        // one host
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    store_file file("auto" + std::to_string(c));
    const auto& l = cases[c];
    const auto result = ddp::test::run_ranks(static_cast<int>(l.host_of.size()), [&](int rank) {
      ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, l.host_of));
      check(g.backend().hierarchical() == l.hierarchical, "hierarchical chosen as expected");
      check(g.backend().transport_name() == l.transport, "transport " + std::string(g.backend().transport_name()));
      std::vector<std::int64_t> v{rank + 1};
      g.all_reduce(v);
      const auto p = static_cast<std::int64_t>(l.host_of.size());
      check(v[0] == p * (p + 1) / 2, "all_reduce");
    });
    INFO("case " << c << "\n" << result.describe());
    REQUIRE(result.ok());
  }
  // Forced hierarchical on hosts of one rank each, and forced flat on 2 x 2.
  for (hier h : {hier::hierarchical, hier::flat}) {
    store_file file(std::string("forced") + std::string(ddp::to_string(h)));
    const std::vector<int> host_of = h == hier::hierarchical ? std::vector<int>{0, 1, 1} : std::vector<int>{0, 0, 1, 1};
    const auto result = ddp::test::run_ranks(static_cast<int>(host_of.size()), [&](int rank) {
      ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of, h));
      check(g.backend().hierarchical() == (h == hier::hierarchical), "forced choice");
      std::vector<double> v(5000, rank + 1.0);
      g.all_reduce(v, ddp::avg{});
      const double p = static_cast<double>(host_of.size());
      for (double x : v) check(x == (p + 1) / 2, "avg");
    });
    INFO(result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("hierarchical: ranks that disagree on the hierarchy fail with a config error") {
  store_file file("disagree");
  const auto host_of = hosts_of(2, 2);
  const auto result = ddp::test::run_ranks(4, [&](int rank) {
    try {
      auto b = make_backend(file.path, rank, host_of, rank == 3 ? hier::flat : hier::automatic);
      check(false, "no error");
    } catch (const ddp::error& e) {
      check(e.code() == ddp::errc::config, e.what());
      check(std::string(e.what()).find("disagree") != std::string::npos, e.what());
    }
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("hierarchical: the other collectives, allocate and sub-groups on a hierarchical backend") {
  store_file file("others");
  const auto host_of = hosts_of(2, 2);
  const auto result = ddp::test::run_ranks(4, [&](int rank) {
    ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 60s});
    check(g.backend().hierarchical(), "hierarchical");
    std::vector<std::int64_t> b(1000, rank == 3 ? 42 : 0);
    g.broadcast(b, 3);
    for (auto x : b) check(x == 42, "broadcast");
    std::vector<std::int64_t> mine(10, rank), all(40);
    g.all_gather(mine, all);
    for (std::size_t i = 0; i < all.size(); ++i) check(all[i] == static_cast<std::int64_t>(i / 10), "all_gather");
    std::vector<float> r(100000, 1.0f);
    g.reduce(r, 1, ddp::sum{});
    if (rank == 1)
      for (float x : r) check(x == 4.0f, "reduce");
    std::vector<double> in(8, rank + 1.0), out(2);
    g.reduce_scatter(in, out, ddp::sum{});
    for (double x : out) check(x == 10.0, "reduce_scatter");
    g.barrier();
    // Sub-groups: {0, 2} spans 2 hosts with one rank each (flat); {0, 1, 2, 3} reversed is 2 x 2.
    auto leaders = g.new_group({0, 2});
    auto everyone = g.new_group({0, 1, 2, 3});
    if (rank % 2 == 0) {
      check(!leaders.backend().hierarchical() && leaders.backend().transport_name() == "tcp", "a sub-group of one rank per host is flat");
      std::vector<int> v{rank};
      leaders.all_reduce(v);
      check(v[0] == 2, "sub-group all_reduce");
    }
    check(everyone.backend().hierarchical(), "a 2 x 2 sub-group is hierarchical");
    std::vector<std::int64_t> v(70000, rank);
    everyone.all_reduce(v, ddp::max{});
    for (auto x : v) check(x == 3, "sub-group hierarchical all_reduce");
    // Async all_reduces keep their order.
    std::vector<std::vector<std::int64_t>> bufs(20, std::vector<std::int64_t>(33));
    std::vector<ddp::work> works;
    for (int k = 0; k < 20; ++k) {
      for (auto& x : bufs[static_cast<std::size_t>(k)]) x = k + rank;
      works.push_back(g.all_reduce_async(bufs[static_cast<std::size_t>(k)]));
    }
    for (auto& w : works) w.wait();
    for (int k = 0; k < 20; ++k)
      for (auto x : bufs[static_cast<std::size_t>(k)]) check(x == 4 * k + 6, "async all_reduce " + std::to_string(k));
  });
  INFO(result.describe());
  REQUIRE(result.ok());
}

TEST_CASE("hierarchical: a killed rank is peer_lost on every other rank within 2 s") {
  // The victim: a non-leader (seen through shared memory first) and a leader (through TCP first).
  for (int victim : {3, 2, 0}) {
    store_file file("death" + std::to_string(victim));
    const auto host_of = hosts_of(2, 2);
    const auto result = ddp::test::run_ranks(
        4,
        [&](int rank) {
          ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 60s});
          std::vector<float> v(100000, 1.0f);
          g.all_reduce(v);  // every level is connected
          if (rank == victim) ::_exit(0);
          const auto start = std::chrono::steady_clock::now();
          try {
            for (int i = 0; i < 1000; ++i) g.all_reduce(v);
            check(false, "no error after a peer exited");
          } catch (const ddp::error& e) {
            const auto took = std::chrono::steady_clock::now() - start;
            std::printf("rank %d after %lld ms: %s\n", rank, static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
                        e.what());
            check(e.code() == ddp::errc::peer_lost, e.what());
            check(took < 2s, "within 2 s, not at the 60 s deadline");
            check(first_named_rank(e.what()) == victim, std::string("names the victim first: ") + e.what());
          }
          try {
            g.all_reduce(v);
            check(false, "a call after the failure succeeded");
          } catch (const ddp::error& e) {
            check(e.code() == ddp::errc::peer_lost, e.what());
          }
        },
        60s);
    INFO("victim " << victim << "\n" << result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("hierarchical: a rank that dies instead of allocating is named by every other rank") {
  // The victim: a non-leader and a leader. Its host's ranks fail in allocate (shared memory);
  // the other host's allocate succeeds and its ranks fail in the next all_reduce (the leaders).
  for (int victim : {3, 2}) {
    store_file file("allocate_death" + std::to_string(victim));
    const auto host_of = hosts_of(2, 2);
    const auto result = ddp::test::run_ranks(
        4,
        [&](int rank) {
          ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 60s});
          std::vector<float> v(1000, 1.0f);
          g.all_reduce(v);  // every level is connected
          if (rank == victim) ::_exit(0);
          const auto start = std::chrono::steady_clock::now();
          try {
            auto buffer = g.allocate<float>(100000);
            for (int i = 0; i < 100; ++i) g.all_reduce(buffer);
            check(false, "no error after a peer exited");
          } catch (const ddp::error& e) {
            std::printf("rank %d: %s\n", rank, e.what());
            check(e.code() == ddp::errc::peer_lost, e.what());
            check(std::chrono::steady_clock::now() - start < 2s, "within 2 s, not at the 60 s deadline");
            check(first_named_rank(e.what()) == victim, std::string("names the victim first: ") + e.what());
          }
        },
        60s);
    INFO("victim " << victim << "\n" << result.describe());
    REQUIRE(result.ok());
  }
}

TEST_CASE("hierarchical: DDP_RING_HIERARCHY is parsed; bad values are a config error") {
  CHECK(ddp::hierarchy_from_environment(nullptr) == hier::automatic);
  CHECK(ddp::hierarchy_from_environment("") == hier::automatic);
  CHECK(ddp::hierarchy_from_environment("auto") == hier::automatic);
  CHECK(ddp::hierarchy_from_environment("flat") == hier::flat);
  CHECK(ddp::hierarchy_from_environment("hierarchical") == hier::hierarchical);
  try {
    ddp::hierarchy_from_environment("tree");
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK(std::string(e.what()).find("DDP_RING_HIERARCHY") != std::string::npos);
  }
}

TEST_CASE("hierarchical: mismatched all_reduces are a mismatch, within a host and between hosts") {
  // within: rank 3 reduces doubles, its host peer floats; between: host 1 reduces 99 elements, host 0 100.
  for (const bool within : {true, false}) {
    store_file file(within ? "mismatch_within" : "mismatch_between");
    const auto host_of = hosts_of(2, 2);
    const auto result = ddp::test::run_ranks(
        4,
        [&](int rank) {
          ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 20s});
          const auto start = std::chrono::steady_clock::now();
          try {
            if (within && rank == 3) {
              std::vector<double> d(100000, 1.0);
              g.all_reduce(d);
            } else {
              std::vector<float> f(!within && rank >= 2 ? 99999 : 100000, 1.0f);
              g.all_reduce(f);
            }
            check(false, "no error");
          } catch (const ddp::error& e) {
            check(e.code() == ddp::errc::mismatch || e.code() == ddp::errc::peer_lost, e.what());
            check(std::chrono::steady_clock::now() - start < 5s, "well before the deadline");
            std::printf("%s\n", e.what());
          }
        },
        60s);
    INFO(result.describe());
    REQUIRE(result.ok());
    int mismatches = 0;
    for (const auto& r : result.ranks) mismatches += r.output.find("mismatched collectives") != std::string::npos ? 1 : 0;
    CHECK(mismatches >= (within ? 2 : 1));
  }
}

TEST_CASE("hierarchical: a rank that does not arrive fails the others at the group deadline") {
  store_file file("deadline");
  const auto host_of = hosts_of(2, 2);
  const auto result = ddp::test::run_ranks(
      4,
      [&](int rank) {
        ddp::process_group<ddp::ring_backend> g(make_backend(file.path, rank, host_of), {.timeout = 1s});
        std::vector<float> v(100000, 1.0f);
        g.all_reduce(v);
        ddp::store::file_store notes(file.path);
        if (rank == 1) {
          // Late: stays away until every other rank has given up (an event, bounded by 20 s).
          notes.wait({"test/gave_up/0", "test/gave_up/2", "test/gave_up/3"}, std::chrono::milliseconds(20000));
          ::_exit(0);
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          g.all_reduce(v);
          check(false, "no error");
        } catch (const ddp::error& e) {
          const auto took = std::chrono::steady_clock::now() - start;
          std::printf("rank %d after %lld ms: %s\n", rank,
                      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()), e.what());
          check(e.code() == ddp::errc::timeout || e.code() == ddp::errc::peer_lost, e.what());
          check(took >= 900ms || e.code() == ddp::errc::peer_lost, "not before the deadline");
          check(took < 3s, "soon after the deadline");
        }
        notes.set_string("test/gave_up/" + std::to_string(rank), "1");
      },
      60s);
  INFO(result.describe());
  REQUIRE(result.ok());
  int timeouts = 0;
  for (const auto& r : result.ranks) timeouts += r.output.find("timeout") != std::string::npos || r.output.find("deadline") != std::string::npos ? 1 : 0;
  CHECK(timeouts >= 1);
}

}  // namespace ddp_test_hierarchical
