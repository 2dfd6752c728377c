// ring_communicator over tcp_transport with ranks as forked processes (file_store rendezvous):
// collectives against independent references, a rank SIGKILLed mid all_reduce (survivors fail
// with peer_lost naming it, measured), mismatched calls, and a rank that never arrives.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ddp/backends/ring/ring_communicator.hpp"
#include "ddp/store/file_store.hpp"
#include "ddp/backends/ring/transport/tcp.hpp"
#include "support/multiprocess.hpp"
#include "support/sizes.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_tcp_collectives {

using namespace std::chrono_literals;
using ddp::test::check;

namespace {

std::string fresh_store_path() {
  static int counter = 0;
  const std::string path = "/tmp/ddp-tcp-collectives-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  ::unlink(path.c_str());
  return path;
}

struct store_file {
  std::string path = fresh_store_path();
  ~store_file() { ::unlink(path.c_str()); }
};

ddp::collective_desc make_desc(std::uint64_t seq, ddp::collective op, ddp::dtype t, std::size_t count,
                               ddp::reduce_kind k = ddp::reduce_kind::sum, int root = -1) {
  ddp::collective_desc d;
  d.seq = seq;
  d.op = op;
  d.type = t;
  d.reduction = k;
  d.root = root;
  d.count = count;
  return d;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Integer inputs: exact references. Floats: multiples of 1/4, exact too.
double input(int rank, std::size_t i) { return static_cast<double>(static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 13) % 17) - 8); }

// Wraps a transport and SIGKILLs the process at its n-th call: a death in the middle of a
// collective, at a point fixed by the test rather than by timing. It offers only the plain
// transport interface, so this also runs the algorithms' generic (non-vectored) path.
struct dying_transport {
  ddp::tcp_transport& t;
  ddp::store::store& store;
  int die_at_call;
  int calls = 0;

  int rank() const { return t.rank(); }
  int size() const { return t.size(); }
  void tick() {
    if (++calls == die_at_call) {
      store.set_string("killed_at", std::to_string(now_ns()));
      ::raise(SIGKILL);
    }
  }
  void send(int peer, std::span<const std::byte> out, ddp::deadline dl) {
    tick();
    t.send(peer, out, dl);
  }
  void recv(int peer, std::span<std::byte> in, ddp::deadline dl) {
    tick();
    t.recv(peer, in, dl);
  }
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, ddp::deadline dl) {
    tick();
    t.send_recv(to, out, from, in, dl);
  }
  void abort() noexcept { t.abort(); }
};
static_assert(ddp::transport<dying_transport>);

}  // namespace

TEST_CASE("tcp processes: collectives match independent references at p = 3 and 4") {
  for (int p : {3, 4}) {
    store_file sf;
    const auto result = ddp::test::run_ranks(
        p,
        [&](int r) {
          ddp::store::file_store store(sf.path);
          ddp::tcp_transport t(store, r, p, "mp");
          ddp::algo::ring_communicator<ddp::tcp_transport&> c(t);
          const auto dl = [] { return ddp::deadline::after(60s); };
          std::uint64_t seq = 0;
          for (std::size_t n : {std::size_t{0}, std::size_t{7}, std::size_t{1023}, ddp::test::large_count}) {
            std::vector<float> f(n);
            std::vector<std::int64_t> l(n);
            for (std::size_t i = 0; i < n; ++i) f[i] = static_cast<float>(input(r, i) * 0.25), l[i] = static_cast<std::int64_t>(input(r, i));
            c.all_reduce(std::span<float>(f), ddp::sum{}, make_desc(++seq, ddp::collective::all_reduce, ddp::dtype::float32, n), dl());
            c.all_reduce(std::span<std::int64_t>(l), ddp::max{}, make_desc(++seq, ddp::collective::all_reduce, ddp::dtype::int64, n, ddp::reduce_kind::max), dl());
            for (std::size_t i = 0; i < n; ++i) {
              double sum = 0, mx = -1e9;
              for (int k = 0; k < p; ++k) sum += input(k, i) * 0.25, mx = std::max(mx, input(k, i));
              check(f[i] == static_cast<float>(sum), "float32 sum at " + std::to_string(i));
              check(l[i] == static_cast<std::int64_t>(mx), "int64 max at " + std::to_string(i));
            }
            std::vector<ddp::bfloat16> b(n);
            for (std::size_t i = 0; i < n; ++i) b[i] = ddp::bfloat16(static_cast<float>(input(r, i)));
            c.broadcast(std::span<ddp::bfloat16>(b), 1, make_desc(++seq, ddp::collective::broadcast, ddp::dtype::bfloat16, n, ddp::reduce_kind::sum, 1), dl());
            for (std::size_t i = 0; i < n; ++i) check(static_cast<float>(b[i]) == static_cast<float>(input(1, i)), "broadcast at " + std::to_string(i));
            std::vector<std::int32_t> in(n), out(n * static_cast<std::size_t>(p));
            for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<std::int32_t>(input(r, i));
            c.all_gather(std::span<const std::int32_t>(in), std::span<std::int32_t>(out), make_desc(++seq, ddp::collective::all_gather, ddp::dtype::int32, n), dl());
            for (int k = 0; k < p; ++k)
              for (std::size_t i = 0; i < n; ++i) check(out[static_cast<std::size_t>(k) * n + i] == static_cast<std::int32_t>(input(k, i)), "all_gather");
            c.barrier(make_desc(++seq, ddp::collective::barrier, ddp::dtype::uint8, 0), dl());
          }
        },
        120s);
    INFO("p = " << p << "\n" << result.describe());
    CHECK(result.ok());
  }
}

TEST_CASE("tcp processes: a rank SIGKILLed mid all_reduce makes every survivor fail with peer_lost naming it within 2 s") {
  for (int p : {2, 4}) {
    store_file sf;
    constexpr int victim = 1;
    const auto result = ddp::test::run_ranks(
        p,
        [&](int r) {
          ddp::store::file_store store(sf.path);
          ddp::tcp_transport t(store, r, p, "kill");
          std::vector<float> data(std::size_t{4} << 20, 1.0f);  // 16 MiB: many chunks in flight
          const auto d = make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, data.size());
          const ddp::algo::ring_communicator_options o{.algorithm = ddp::algo::algorithm_choice::ring,
                                                       .tuning = {.chunk_bytes = 64 << 10},
                                                       .failure_store = &store,
                                                       .failure_prefix = "kill"};
          if (r == victim) {
            ddp::algo::ring_communicator<dying_transport> c(dying_transport{t, store, 20}, o);
            c.all_reduce(std::span<float>(data), ddp::sum{}, d, ddp::deadline::after(60s));
            check(false, "the victim survived its all_reduce");
          }
          ddp::algo::ring_communicator<ddp::tcp_transport&> c(t, o);
          try {
            c.all_reduce(std::span<float>(data), ddp::sum{}, d, ddp::deadline::after(60s));
          } catch (const ddp::error& e) {
            const std::int64_t at = now_ns();
            const double ms = static_cast<double>(at - std::stoll(store.get_string("killed_at"))) / 1e6;
            std::printf("detected_ms=%.1f message=%s\n", ms, e.what());
            check(e.code() == ddp::errc::peer_lost, std::string("not peer_lost: ") + e.what());
            // The first rank named is the dead one, not the neighbour that relayed its loss.
            const auto named = e.message().find("rank ");
            check(named != std::string::npos && e.message().compare(named, 7, "rank 1 ") == 0,
                  std::string("does not name rank 1 first: ") + e.what());
            check(ms < 2000, "noticed after " + std::to_string(ms) + " ms");
            return;
          }
          check(false, "all_reduce succeeded without rank 1");
        },
        60s);
    INFO("p = " << p << "\n" << result.describe());
    for (const auto& rr : result.ranks) {
      if (rr.rank == victim) {
        CHECK(rr.signal == SIGKILL);
      } else {
        CHECK(rr.ok());
        WARN("p = " << p << ", rank " << rr.rank << ": " << rr.output);
      }
    }
  }
}

TEST_CASE("tcp processes: mismatched collectives fail on every rank with both calls described") {
  constexpr int p = 3;
  store_file sf;
  const auto result = ddp::test::run_ranks(
      p,
      [&](int r) {
        ddp::store::file_store store(sf.path);
        ddp::tcp_transport t(store, r, p, "mm");
        ddp::algo::ring_communicator<ddp::tcp_transport&> c(t, {.failure_store = &store, .failure_prefix = "mm"});
        std::vector<float> data(1 << 16, 1.0f);
        try {
          if (r == 2) c.broadcast(std::span<float>(data), 0, make_desc(3, ddp::collective::broadcast, ddp::dtype::float32, data.size(), ddp::reduce_kind::sum, 0), ddp::deadline::after(10s));
          else c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(3, ddp::collective::all_reduce, ddp::dtype::float32, data.size()), ddp::deadline::after(10s));
        } catch (const ddp::error& e) {
          std::printf("%s\n", e.what());
          check(e.code() == ddp::errc::mismatch || e.code() == ddp::errc::peer_lost, e.what());
          check(std::string(e.what()).find("mismatched collectives") != std::string::npos, e.what());
          check(std::string(e.what()).find("broadcast #3 (float32 x 65536, root 0)") != std::string::npos, e.what());
          return;
        }
        check(false, "the collective returned");
      },
      30s);
  INFO(result.describe());
  CHECK(result.ok());
}

TEST_CASE("tcp processes: a rank that never arrives makes the other time out at the deadline") {
  store_file sf;
  const auto result = ddp::test::run_ranks(
      2,
      [&](int r) {
        ddp::store::file_store store(sf.path);
        ddp::tcp_transport t(store, r, 2, "late");
        ddp::algo::ring_communicator<ddp::tcp_transport&> c(t);
        if (r == 1) {
          store.wait({"rank0_done"}, 30s);  // stays connected, never calls
          return;
        }
        std::vector<float> data(100, 1.0f);
        const auto start = std::chrono::steady_clock::now();
        try {
          c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, 100), ddp::deadline::after(500ms));
          store.set_string("rank0_done", "1");
          check(false, "all_reduce returned");
        } catch (const ddp::error& e) {
          const auto took = std::chrono::steady_clock::now() - start;
          store.set_string("rank0_done", "1");
          check(e.code() == ddp::errc::timeout, e.what());
          check(took >= 490ms && took < 3s, "timed out after " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) + " ms");
        }
      },
      30s);
  INFO(result.describe());
  CHECK(result.ok());
}

}  // namespace ddp_test_tcp_collectives
