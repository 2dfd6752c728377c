// ring_communicator over tcp_transport, ranks as threads: every collective x dtype x size x p,
// both all_reduce / reduce algorithms, against references computed here without communication
// (each rank's input is a function of (rank, index); float64 or exact integer folds in rank order).
// Plus: bit-identical results, bytes on the wire, mismatches, deadlines, abort.
#include <poll.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <latch>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ddp/backends/ring/ring_communicator.hpp"
#include "ddp/backends/ring/scratch.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/backends/ring/transport/tcp.hpp"
#include "support/sizes.hpp"
#include "support/threads.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_ring_algorithms {

using namespace std::chrono_literals;
using ddp::algo::algorithm_choice;
using comm_t = ddp::algo::ring_communicator<ddp::tcp_transport&>;

namespace {

using ddp::test::run_threads;

// --- inputs and references -----------------------------------------------------------------

template <class E>
double to_double(E v) {
  if constexpr (ddp::half_precision<E>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}
template <class E>
E from_double(double v) {
  if constexpr (ddp::half_precision<E>) return E(static_cast<float>(v));
  else return static_cast<E>(v);
}

// Multiples of 1/4 in [-2, 2] (exact in every float type, sums too); small integers otherwise.
// For prod: 1 or 2, so products stay exact and in range.
template <class E>
double input(int rank, std::size_t i, ddp::reduce_kind k) {
  const auto r = static_cast<std::size_t>(rank);
  if (k == ddp::reduce_kind::prod) return static_cast<double>(1 + (r + i) % 2);
  if constexpr (std::is_same_v<E, std::uint8_t>) return static_cast<double>((r * 3 + i * 5) % 7);
  const double v = static_cast<double>(static_cast<int>((r * 7 + i * 13) % 17) - 8);
  if constexpr (std::is_integral_v<E>) return v;
  else return v * 0.25;
}

template <class E>
double fold(int p, std::size_t i, ddp::reduce_kind k) {
  double acc = input<E>(0, i, k);
  for (int r = 1; r < p; ++r) {
    const double x = input<E>(r, i, k);
    switch (k) {
      case ddp::reduce_kind::sum:
      case ddp::reduce_kind::avg: acc += x; break;
      case ddp::reduce_kind::min: acc = std::min(acc, x); break;
      case ddp::reduce_kind::max: acc = std::max(acc, x); break;
      case ddp::reduce_kind::prod: acc *= x; break;
    }
  }
  if (k == ddp::reduce_kind::avg) acc = std::is_integral_v<E> ? std::trunc(acc / p) : acc / p;
  return acc;
}

// Inputs repeat with period 17 * 7 * 2 in the index, so the references of a (p, op) are a table
// of that period: the big sizes are checked in O(n) instead of O(n p).
constexpr std::size_t period = 17 * 7 * 2;

template <class E>
double reference(int p, std::size_t i, ddp::reduce_kind k) {
  thread_local std::vector<double> table;
  thread_local int table_p = -1;
  thread_local ddp::reduce_kind table_k{};
  if (table_p != p || table_k != k || table.empty()) {
    table.resize(period);
    for (std::size_t j = 0; j < period; ++j) table[j] = fold<E>(p, j, k);
    table_p = p;
    table_k = k;
  }
  return table[i % period];
}

template <class E>
double tolerance(double ref) {
  double eps = 0;
  if constexpr (std::is_same_v<E, float>) eps = 0x1p-23;
  else if constexpr (std::is_same_v<E, double>) eps = 0x1p-52;
  else if constexpr (std::is_same_v<E, ddp::float16>) eps = 0x1p-10;
  else if constexpr (std::is_same_v<E, ddp::bfloat16>) eps = 0x1p-7;
  return 2 * eps * std::max(1.0, std::abs(ref));  // exact for integers
}

template <class E>
void expect_near(const char* what, std::size_t i, E got, double ref) {
  const double g = to_double(got);
  if (!(std::abs(g - ref) <= tolerance<E>(ref))) {
    throw std::runtime_error(std::string(what) + ": element " + std::to_string(i) + " is " + std::to_string(g) + ", expected " +
                             std::to_string(ref));
  }
}

template <class E>
std::vector<E> inputs(int rank, std::size_t n, ddp::reduce_kind k) {
  E one_period[period];
  for (std::size_t j = 0; j < period; ++j) one_period[j] = from_double<E>(input<E>(rank, j, k));
  std::vector<E> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = one_period[i % period];
  return v;
}

// --- one rank's sweep --------------------------------------------------------------------------

// The plain transport interface only (no send_recv_v): runs the algorithms' generic path, as
// over a transport that is not tcp_transport.
struct plain_transport {
  ddp::tcp_transport& t;
  int rank() const { return t.rank(); }
  int size() const { return t.size(); }
  void send(int peer, std::span<const std::byte> out, ddp::deadline dl) { t.send(peer, out, dl); }
  void recv(int peer, std::span<std::byte> in, ddp::deadline dl) { t.recv(peer, in, dl); }
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, ddp::deadline dl) {
    t.send_recv(to, out, from, in, dl);
  }
  void abort() noexcept { t.abort(); }
};
static_assert(ddp::transport<plain_transport> && !ddp::algo::vectored_transport<plain_transport>);
using plain_comm_t = ddp::algo::ring_communicator<plain_transport>;

template <class C>
struct sweep {
  int rank, p;
  C& ring;
  C& small;
  std::uint64_t seq = 0;

  ddp::collective_desc desc(ddp::collective op, ddp::dtype t, std::size_t count, ddp::reduce_kind k = ddp::reduce_kind::sum,
                            int root = -1) {
    ddp::collective_desc d;
    d.seq = ++seq;
    d.op = op;
    d.type = t;
    d.reduction = k;
    d.root = root;
    d.count = count;
    return d;
  }
  static ddp::deadline dl() { return ddp::deadline::after(60s); }

  template <class E, class Op>
  void all_reduce(std::size_t n, Op op, C& c) {
    auto data = inputs<E>(rank, n, Op::kind);
    c.all_reduce(std::span<E>(data), op, desc(ddp::collective::all_reduce, ddp::dtype_of<E>, n, Op::kind), dl());
    for (std::size_t i = 0; i < n; ++i) expect_near("all_reduce", i, data[i], reference<E>(p, i, Op::kind));
  }

  template <class E, class Op>
  void reduce(std::size_t n, Op op, C& c, int root) {
    auto data = inputs<E>(rank, n, Op::kind);
    c.reduce(std::span<E>(data), root, op, desc(ddp::collective::reduce, ddp::dtype_of<E>, n, Op::kind, root), dl());
    if (rank == root)
      for (std::size_t i = 0; i < n; ++i) expect_near("reduce", i, data[i], reference<E>(p, i, Op::kind));
  }

  template <class E>
  void broadcast(std::size_t n, int root) {
    auto data = inputs<E>(rank, n, ddp::reduce_kind::sum);
    ring.broadcast(std::span<E>(data), root, desc(ddp::collective::broadcast, ddp::dtype_of<E>, n, ddp::reduce_kind::sum, root), dl());
    for (std::size_t i = 0; i < n; ++i) expect_near("broadcast", i, data[i], input<E>(root, i, ddp::reduce_kind::sum));
  }

  template <class E>
  void all_gather(std::size_t n) {
    const auto in = inputs<E>(rank, n, ddp::reduce_kind::sum);
    std::vector<E> out(n * static_cast<std::size_t>(p));
    ring.all_gather(std::span<const E>(in), std::span<E>(out), desc(ddp::collective::all_gather, ddp::dtype_of<E>, n), dl());
    for (int k = 0; k < p; ++k)
      for (std::size_t i = 0; i < n; ++i) expect_near("all_gather", i, out[static_cast<std::size_t>(k) * n + i], input<E>(k, i, ddp::reduce_kind::sum));
  }

  template <class E, class Op>
  void reduce_scatter(std::size_t n, Op op) {
    const auto in = inputs<E>(rank, n * static_cast<std::size_t>(p), Op::kind);
    std::vector<E> out(n);
    ring.reduce_scatter(std::span<const E>(in), std::span<E>(out), op, desc(ddp::collective::reduce_scatter, ddp::dtype_of<E>, n, Op::kind), dl());
    const std::size_t base = n * static_cast<std::size_t>(rank);
    for (std::size_t i = 0; i < n; ++i) expect_near("reduce_scatter", i, out[i], reference<E>(p, base + i, Op::kind));
  }

  template <class E>
  void all_to_all(std::size_t b) {
    const std::size_t n = b * static_cast<std::size_t>(p);
    const auto in = inputs<E>(rank, n, ddp::reduce_kind::sum);
    std::vector<E> out(n);
    ring.all_to_all(std::span<const E>(in), std::span<E>(out), desc(ddp::collective::all_to_all, ddp::dtype_of<E>, n), dl());
    // Block k of the output is block `rank` of rank k's input.
    for (int k = 0; k < p; ++k)
      for (std::size_t i = 0; i < b; ++i)
        expect_near("all_to_all", i, out[static_cast<std::size_t>(k) * b + i], input<E>(k, static_cast<std::size_t>(rank) * b + i, ddp::reduce_kind::sum));
  }

  template <class E>
  void send_recv(std::size_t n) {
    if (p == 1) return;
    const int to = (rank + 1) % p, from = (rank + p - 1) % p;
    const auto out = inputs<E>(rank, n, ddp::reduce_kind::sum);
    std::vector<E> in(n);
    const auto ds = desc(ddp::collective::send, ddp::dtype_of<E>, n);
    const auto dr = desc(ddp::collective::recv, ddp::dtype_of<E>, n);
    // Even ranks send first, odd ranks receive first: no cycle of blocked senders at any size.
    if (rank % 2 == 0) {
      ring.send(std::span<const E>(out), to, ds, dl());
      ring.recv(std::span<E>(in), from, dr, dl());
    } else {
      ring.recv(std::span<E>(in), from, dr, dl());
      ring.send(std::span<const E>(out), to, ds, dl());
    }
    for (std::size_t i = 0; i < n; ++i) expect_near("send/recv", i, in[i], input<E>(from, i, ddp::reduce_kind::sum));
  }

  // At 2^20 + 3 elements: the bandwidth paths for every dtype; the rest (the direct all_reduce
  // and reduce, all_to_all, send/recv) for float32 and float16, to keep the matrix fast.
  template <class E>
  void big(std::size_t n) {
    all_reduce<E>(n, ddp::sum{}, ring);
    all_reduce<E>(n, ddp::avg{}, ring);
    broadcast<E>(n, p - 1);
    all_gather<E>(n);
    reduce_scatter<E>(n, ddp::sum{});
    if constexpr (std::is_same_v<E, float> || std::is_same_v<E, ddp::float16>) {
      all_reduce<E>(n, ddp::sum{}, small);
      reduce<E>(n, ddp::sum{}, ring, 0);
      reduce<E>(n, ddp::max{}, small, 1);
      all_to_all<E>(n / static_cast<std::size_t>(p));
      send_recv<E>(n);
    }
  }

  template <class E>
  void everything(std::size_t n, bool all_ops) {
    for (C* c : {&ring, &small}) {
      all_reduce<E>(n, ddp::sum{}, *c);
      if (all_ops) {
        all_reduce<E>(n, ddp::avg{}, *c);
        all_reduce<E>(n, ddp::min{}, *c);
        all_reduce<E>(n, ddp::max{}, *c);
        all_reduce<E>(n, ddp::prod{}, *c);
      }
      reduce<E>(n, ddp::sum{}, *c, p - 1);
    }
    broadcast<E>(n, 0);
    broadcast<E>(n, p / 2);
    all_gather<E>(n);
    reduce_scatter<E>(n, ddp::sum{});
    if (all_ops) reduce_scatter<E>(n, ddp::max{});
    all_to_all<E>(n);
    send_recv<E>(n);
    ring.barrier(desc(ddp::collective::barrier, ddp::dtype::uint8, 0), dl());
  }
};

template <class F>
void for_each_dtype(F&& f) {
  std::apply([&](auto... tag) { (f(tag), ...); },
             std::tuple<float, double, ddp::float16, ddp::bfloat16, std::int32_t, std::int64_t, std::uint8_t>{});
}

template <class C, class Wrap>
void run_matrix_over(int p, const std::vector<std::size_t>& sizes, bool all_ops, const std::string& prefix, Wrap wrap) {
  ddp::store::hash_store store;
  run_threads(p, [&](int r) {
    ddp::tcp_options o;
    o.timeout = 30s;
    ddp::tcp_transport t(store, r, p, prefix, o);
    C ring(wrap(t), {.algorithm = algorithm_choice::ring, .tuning = {.chunk_bytes = 64 << 10}});
    C small(wrap(t), {.algorithm = algorithm_choice::small_message});
    sweep<C> s{r, p, ring, small};
    for_each_dtype([&](auto tag) {
      using E = decltype(tag);
      for (std::size_t n : sizes) {
        try {
          if (n > 100000) s.template big<E>(n);
          else s.template everything<E>(n, all_ops);
        } catch (const std::exception& e) {
          throw std::runtime_error("rank " + std::to_string(r) + " of " + std::to_string(p) + ", " + std::string(ddp::to_string(ddp::dtype_of<E>)) +
                                   " x " + std::to_string(n) + ": " + e.what());
        }
      }
    });
  });
}

void run_matrix(int p, const std::vector<std::size_t>& sizes, bool all_ops, const std::string& prefix) {
  run_matrix_over<comm_t>(p, sizes, all_ops, prefix, [](ddp::tcp_transport& t) -> ddp::tcp_transport& { return t; });
}

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

}  // namespace

TEST_CASE("ring: every collective, dtype and op at sizes 0, 1, 7, 1023 for p = 1, 2, 3, 4, 8") {
  for (int p : {1, 2, 3, 4, 8}) {
    INFO("p = " << p);
    try {
      run_matrix(p, {0, 1, 7, 1023}, true, "small" + std::to_string(p));
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
  }
}

TEST_CASE("ring: every collective and dtype at 2^20 + 3 elements (2^16 + 3 under sanitizers), p = 2") {
  try {
    run_matrix(2, {ddp::test::large_count}, false, "big2");
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

TEST_CASE("ring: every collective and dtype at 2^20 + 3 elements (2^16 + 3 under sanitizers), p = 3") {
  try {
    run_matrix(3, {ddp::test::large_count}, false, "big3");
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

TEST_CASE("ring: every collective and dtype at 2^20 + 3 elements (2^16 + 3 under sanitizers), p = 4") {
  try {
    run_matrix(4, {ddp::test::large_count}, false, "big4");
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

TEST_CASE("ring: every collective and dtype at 2^20 + 3 elements (2^16 + 3 under sanitizers), p = 8") {
  try {
    run_matrix(8, {ddp::test::large_count}, false, "big8");
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

TEST_CASE("ring: the same collectives over a transport without scatter-gather (the generic path), p = 2, 3") {
  for (int p : {2, 3}) {
    INFO("p = " << p);
    try {
      run_matrix_over<plain_comm_t>(p, {0, 1, 7, 1023, 100000}, false, "plain" + std::to_string(p),
                                    [](ddp::tcp_transport& t) { return plain_transport{t}; });
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
  }
}

TEST_CASE("ring: all_reduce of arbitrary floats is bit-identical on every rank and close to float64") {
  for (int p : {3, 4}) {
    ddp::store::hash_store store;
    constexpr std::size_t n = 100003;
    auto value = [](int r, std::size_t i) {
      // Arbitrary-looking floats of mixed magnitude, so rounding depends on the summation order.
      const auto h = (static_cast<std::uint64_t>(i) * 2654435761u) ^ (static_cast<std::uint64_t>(r) * 40503u);
      return static_cast<float>(std::sin(static_cast<double>(h % 100000)) * std::pow(10.0, static_cast<double>(h % 7) - 3));
    };
    std::vector<std::vector<float>> results(static_cast<std::size_t>(p));
    run_threads(p, [&](int r) {
      ddp::tcp_transport t(store, r, p, "bits");
      comm_t c(t, {.algorithm = algorithm_choice::ring, .tuning = {.chunk_bytes = 16 << 10}});
      std::vector<float> data(n);
      for (std::size_t i = 0; i < n; ++i) data[i] = value(r, i);
      c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(60s));
      results[static_cast<std::size_t>(r)] = std::move(data);
    });
    for (int r = 1; r < p; ++r) CHECK(std::memcmp(results[0].data(), results[static_cast<std::size_t>(r)].data(), n * sizeof(float)) == 0);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double ref = 0, mag = 0;
      for (int r = 0; r < p; ++r) ref += value(r, i), mag += std::abs(value(r, i));
      if (std::abs(results[0][i] - ref) > 4 * p * 0x1p-24 * mag) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("ring: all_reduce sends 2 (p - 1) / p of the buffer per rank, plus one header") {
  constexpr int p = 4;
  constexpr std::size_t n = 1 << 18;  // 1 MiB of float32, divisible by p
  ddp::store::hash_store store;
  std::vector<std::uint64_t> sent(p);
  run_threads(p, [&](int r) {
    ddp::tcp_transport t(store, r, p, "bytes");
    comm_t c(t, {.algorithm = algorithm_choice::ring});
    std::vector<float> data(n, 1.0f);
    c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(60s));
    sent[static_cast<std::size_t>(r)] = t.total_bytes_sent();
    if (data[12345] != 4.0f) throw std::runtime_error("wrong sum");
  });
  const std::uint64_t expected = 2 * (p - 1) * (n * sizeof(float)) / p + ddp::wire_header::size;
  for (auto s : sent) CHECK(s == expected);
}

namespace {

struct odd_call {
  const char* name;
  ddp::collective_desc (*make)(std::uint64_t seq, std::size_t n);
};

// Rank 2 of 3 calls something different at sequence 5; every rank must fail within the deadline,
// with mismatch (or peer_lost quoting the mismatch), never hang or return.
template <class C = comm_t>
void expect_mismatch(const odd_call& odd, algorithm_choice choice, const std::string& prefix) {
  constexpr int p = 3;
  constexpr std::size_t n = 4096;
  ddp::store::hash_store store;
  std::vector<std::string> messages(p);
  std::vector<ddp::errc> codes(p, ddp::errc::internal);
  const auto start = std::chrono::steady_clock::now();
  run_threads(p, [&](int r) {
    ddp::tcp_transport t(store, r, p, prefix);
    auto wrap = [&]() -> decltype(auto) {
      if constexpr (std::is_same_v<C, comm_t>) return static_cast<ddp::tcp_transport&>(t);
      else return plain_transport{t};
    };
    C c(wrap(), {.algorithm = choice, .failure_store = &store, .failure_prefix = prefix});
    const auto normal = make_desc(5, ddp::collective::all_reduce, ddp::dtype::float32, n);
    const auto d = r == 2 ? odd.make(5, n) : normal;
    std::vector<std::byte> buf(8 * n * p);  // big enough for any of the odd calls
    auto dl = ddp::deadline::after(10s);
    try {
      switch (d.op) {
        case ddp::collective::all_reduce:
          if (d.type == ddp::dtype::float32) c.all_reduce(std::span<float>(reinterpret_cast<float*>(buf.data()), d.count), ddp::sum{}, d, dl);
          else c.all_reduce(std::span<std::int64_t>(reinterpret_cast<std::int64_t*>(buf.data()), d.count), ddp::sum{}, d, dl);
          break;
        case ddp::collective::broadcast: c.broadcast(std::span<float>(reinterpret_cast<float*>(buf.data()), d.count), d.root, d, dl); break;
        case ddp::collective::reduce:
          c.reduce(std::span<float>(reinterpret_cast<float*>(buf.data()), d.count), d.root, ddp::sum{}, d, dl);
          break;
        default: c.barrier(d, dl); break;
      }
    } catch (const ddp::error& e) {
      codes[static_cast<std::size_t>(r)] = e.code();
      messages[static_cast<std::size_t>(r)] = e.what();
      return;
    }
    messages[static_cast<std::size_t>(r)] = "returned normally";
  });
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < 8s);
  int mismatches = 0;
  for (int r = 0; r < p; ++r) {
    INFO(odd.name << ", " << ddp::algo::to_string(choice) << ", rank " << r << ": " << messages[static_cast<std::size_t>(r)]);
    const auto code = codes[static_cast<std::size_t>(r)];
    CHECK((code == ddp::errc::mismatch || code == ddp::errc::peer_lost));
    CHECK(messages[static_cast<std::size_t>(r)].find("mismatched") != std::string::npos);
    if (code == ddp::errc::mismatch) {
      ++mismatches;
      CHECK(messages[static_cast<std::size_t>(r)].find("all_reduce #5 (float32 x 4096, sum)") != std::string::npos);
    }
  }
  CHECK(mismatches >= 1);
}

}  // namespace

TEST_CASE("ring: ranks calling different ops, dtypes, counts or roots all fail with the mismatch described") {
  const odd_call calls[] = {
      {"other op", [](std::uint64_t s, std::size_t n) { return make_desc(s, ddp::collective::broadcast, ddp::dtype::float32, n, ddp::reduce_kind::sum, 0); }},
      {"other dtype", [](std::uint64_t s, std::size_t n) { return make_desc(s, ddp::collective::all_reduce, ddp::dtype::int64, n); }},
      {"other count", [](std::uint64_t s, std::size_t n) { return make_desc(s, ddp::collective::all_reduce, ddp::dtype::float32, n * 2 + 1); }},
      {"barrier", [](std::uint64_t s, std::size_t) { return make_desc(s, ddp::collective::barrier, ddp::dtype::uint8, 0); }},
      {"other seq", [](std::uint64_t s, std::size_t n) { return make_desc(s + 1, ddp::collective::all_reduce, ddp::dtype::float32, n); }},
  };
  int i = 0;
  for (const auto& odd : calls)
    for (auto choice : {algorithm_choice::ring, algorithm_choice::small_message}) {
      expect_mismatch(odd, choice, "mm" + std::to_string(i++));
      expect_mismatch<plain_comm_t>(odd, choice, "mm" + std::to_string(i++));
    }
}

TEST_CASE("ring: a failure report names its root first, whatever path it travelled") {
  using ddp::algo::detail::failure_report;
  const ddp::rank_numbering own_numbers;  // every rank by its own number
  // Rank 2 saw rank 1 die; rank 3 relayed it to rank 0.
  const failure_report seen{.root = 1, .chain = {2}, .cause = "peer rank 1 closed the connection"};
  CHECK(seen.describe(own_numbers) == "peer rank 1 closed the connection");
  auto relayed = failure_report::decode(seen.encode(), 2);
  CHECK(relayed.root == 1);
  relayed.chain.push_back(3);
  CHECK(relayed.describe(own_numbers) == "peer rank 1 closed the connection; seen by rank 2");
  auto at_zero = failure_report::decode(relayed.encode(), 3);
  at_zero.chain.push_back(0);
  CHECK(at_zero.describe(own_numbers) == "peer rank 1 closed the connection; seen by rank 2, relayed by rank 3");
  // A rank that failed by itself (a deadline, a mismatch) is the root of its own report.
  auto own = failure_report::decode(failure_report{.root = 2, .chain = {2}, .cause = "deadline expired"}.encode(), 2);
  own.chain.push_back(0);
  CHECK(own.describe(own_numbers) == "rank 2 failed: deadline expired");
  // A post of another form is the poster's own cause.
  auto plain = failure_report::decode("something broke", 3);
  CHECK(plain.root == 3);
  CHECK(plain.cause == "something broke");
  // Spaces in the cause survive.
  CHECK(failure_report::decode(seen.encode(), 2).cause == seen.cause);
  // A part of a larger group (the hierarchy's leaders: ranks 0 and 2 of the backend) names the
  // backend's ranks: leader 1 is rank 2.
  const ddp::rank_numbering leaders(std::vector<int>{0, 2});
  auto leader_failed = failure_report::decode(failure_report{.root = 1, .chain = {1}, .cause = "deadline expired"}.encode(), 1);
  leader_failed.chain.push_back(0);
  CHECK(leader_failed.describe(leaders) == "rank 2 failed: deadline expired");
  // A leader that lost a rank of its host blames no leader: the cause names the rank.
  auto host_rank_lost = failure_report::decode(failure_report{.root = -1, .chain = {1}, .cause = "peer rank 3 exited"}.encode(), 1);
  host_rank_lost.chain.push_back(0);
  CHECK(host_rank_lost.describe(leaders) == "peer rank 3 exited; seen by rank 2");
}

TEST_CASE("rank_numbering: a part of a topology keeps the numbers its ranks go by") {
  std::vector<ddp::rank_place> places(6);
  for (std::size_t r = 0; r < places.size(); ++r) places[r].identity = "host-" + std::to_string(r / 2);
  const ddp::rank_topology world(4, places);
  CHECK(world.numbering()(4) == 4);
  CHECK(world.numbering().rank(5) == "rank 5");
  // Host 2's ranks (4, 5) as a level of the hierarchy: its rank 1 is rank 5.
  const std::vector<int> host2{4, 5};
  const auto level = world.part(host2, 0);
  CHECK(level.size() == 2);
  CHECK(level.numbering()(0) == 4);
  CHECK(level.numbering().rank(1) == "rank 5");
  CHECK(level.numbering().list(std::vector<int>{1, 0}) == "5, 4");
  // A part of a part: the leaders (0, 2, 4), then the last two of them.
  const auto leads = world.part(std::vector<int>{0, 2, 4}, 2).part(std::vector<int>{1, 2}, 1);
  CHECK(leads.numbering().list(std::vector<int>{0, 1}) == "2, 4");
  // A sub-group of the user's (subset) numbers its ranks afresh.
  CHECK(world.subset(host2, 0).numbering().rank(1) == "rank 1");
  // Out of range: the number itself (a message must not fail).
  CHECK(level.numbering()(7) == 7);
}

TEST_CASE("ring: when a rank aborts without posting, every rank names it first, not its neighbour") {
  constexpr int p = 4;
  constexpr int victim = 1;
  ddp::store::hash_store store;
  std::vector<std::string> messages(p);
  run_threads(p, [&](int r) {
    ddp::tcp_transport t(store, r, p, "relay");
    comm_t c(t, {.algorithm = algorithm_choice::ring, .failure_store = &store, .failure_prefix = "relay"});
    std::vector<float> data(std::size_t{1} << 20, 1.0f);
    const auto d = make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, data.size());
    if (r == victim) {
      t.abort();  // dies without a word: no report in the store
      return;
    }
    try {
      c.all_reduce(std::span<float>(data), ddp::sum{}, d, ddp::deadline::after(10s));
      messages[static_cast<std::size_t>(r)] = "returned normally";
    } catch (const ddp::error& e) {
      messages[static_cast<std::size_t>(r)] = e.message();
    }
  });
  for (int r = 0; r < p; ++r) {
    if (r == victim) continue;
    const auto& m = messages[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << m);
    const auto at = m.find("rank ");
    REQUIRE(at != std::string::npos);
    CHECK(m.substr(at, 7) == "rank 1 ");
  }
}

namespace {

// A store whose calls block, once hang() is called, until release(): a store host that was stopped.
class hanging_store final : public ddp::store::store {
 public:
  void hang() {
    std::lock_guard lock(mutex_);
    hung_ = true;
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      hung_ = false;
    }
    cv_.notify_all();
  }
  void set(const std::string& key, std::span<const std::byte> value) override {
    block();
    inner_.set(key, value);
  }
  std::vector<std::byte> get(const std::string& key) override {
    block();
    return inner_.get(key);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    block();
    return inner_.add(key, delta);
  }
  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                     std::span<const std::byte> desired) override {
    block();
    return inner_.compare_set(key, expected, desired);
  }
  using ddp::store::store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) override {
    block();
    inner_.wait(keys, t);
  }
  bool erase(const std::string& key) override {
    block();
    return inner_.erase(key);
  }
  std::int64_t num_keys() override {
    block();
    return inner_.num_keys();
  }

 private:
  void block() {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, 30s, [&] { return !hung_; });
  }
  ddp::store::hash_store inner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool hung_ = false;
};

}  // namespace

TEST_CASE("ring: a failure waits for a hung failure store only briefly, and reports its own cause") {
  constexpr int p = 2;
  auto store = std::make_shared<hanging_store>();
  std::latch meshed(p), hung(p);
  std::string message;
  std::chrono::steady_clock::duration took{};
  run_threads(p, [&](int r) {
    ddp::tcp_transport t(*store, r, p, "hung");
    comm_t c(t, {.algorithm = algorithm_choice::ring, .failure_store = store.get(), .failure_prefix = "hung", .failure_store_owner = store});
    meshed.arrive_and_wait();
    if (r == 0) store->hang();
    hung.arrive_and_wait();
    if (r == 1) {
      t.abort();  // the peer dies while the store's host is stopped
      return;
    }
    std::vector<float> data(1 << 16, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, data.size()),
                   ddp::deadline::after(60s));
      message = "returned normally";
    } catch (const ddp::error& e) {
      took = std::chrono::steady_clock::now() - start;
      message = e.message();
    }
  });
  store->release();
  INFO(message);
  CHECK(message.find("peer rank 1 ") == 0);
  CHECK(took < 1500ms);  // the bound is 1 s; without it, the store's 30 s
}

TEST_CASE("ring: ranks calling broadcast or reduce with different roots are told so") {
  constexpr int p = 3;
  for (auto op : {ddp::collective::broadcast, ddp::collective::reduce}) {
    ddp::store::hash_store store;
    std::vector<ddp::errc> codes(p, ddp::errc::internal);
    std::vector<std::string> messages(p);
    run_threads(p, [&](int r) {
      ddp::tcp_transport t(store, r, p, "roots");
      comm_t c(t, {.algorithm = algorithm_choice::ring, .failure_store = &store, .failure_prefix = "roots"});
      const int root = r == 1 ? 1 : 0;  // rank 1 believes it is the root
      std::vector<float> data(1 << 16, 1.0f);
      const auto d = make_desc(1, op, ddp::dtype::float32, data.size(), ddp::reduce_kind::sum, root);
      try {
        if (op == ddp::collective::broadcast) c.broadcast(std::span<float>(data), root, d, ddp::deadline::after(10s));
        else c.reduce(std::span<float>(data), root, ddp::sum{}, d, ddp::deadline::after(10s));
        messages[static_cast<std::size_t>(r)] = "returned normally";
      } catch (const ddp::error& e) {
        codes[static_cast<std::size_t>(r)] = e.code();
        messages[static_cast<std::size_t>(r)] = e.what();
      }
    });
    for (int r = 0; r < p; ++r) {
      INFO(ddp::to_string(op) << " rank " << r << ": " << messages[static_cast<std::size_t>(r)]);
      CHECK((codes[static_cast<std::size_t>(r)] == ddp::errc::mismatch || codes[static_cast<std::size_t>(r)] == ddp::errc::peer_lost));
      CHECK(messages[static_cast<std::size_t>(r)].find("root") != std::string::npos);
    }
  }
}

TEST_CASE("ring: a rank that never calls makes the others time out at the deadline, and the communicator stays failed") {
  ddp::store::hash_store store;
  std::latch done(2);
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, "late");
    comm_t c(t);
    if (r == 1) {
      done.arrive_and_wait();
      return;
    }
    std::vector<float> data(1000, 1.0f);
    const auto d = make_desc(7, ddp::collective::all_reduce, ddp::dtype::float32, data.size());
    const auto start = std::chrono::steady_clock::now();
    try {
      c.all_reduce(std::span<float>(data), ddp::sum{}, d, ddp::deadline::after(300ms));
      done.count_down();
      throw std::runtime_error("all_reduce returned");
    } catch (const ddp::error& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      done.count_down();
      if (e.code() != ddp::errc::timeout) throw;
      const std::string m = e.what();
      if (m.find("rank 0: all_reduce #7 (float32 x 1000, sum)") == std::string::npos || m.find("rank 1") == std::string::npos) throw std::runtime_error(m);
      if (took < 290ms || took > 3s) throw std::runtime_error("timeout after " + std::to_string(took.count()) + " ns");
    }
    try {
      c.barrier(make_desc(8, ddp::collective::barrier, ddp::dtype::uint8, 0), ddp::deadline::after(1s));
      throw std::runtime_error("a call after the failure succeeded");
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::peer_lost || std::string(e.what()).find("earlier failure") == std::string::npos) throw;
    }
  });
}

TEST_CASE("ring: abort() from another thread unblocks a collective promptly") {
  ddp::store::hash_store store;
  std::latch done(2);
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, "cabort");
    comm_t c(t);
    if (r == 1) {
      done.arrive_and_wait();
      return;
    }
    std::atomic<int> code{0};
    std::chrono::steady_clock::duration took{};
    std::thread waiter([&] {
      std::vector<float> data(1 << 20, 1.0f);
      const auto start = std::chrono::steady_clock::now();
      try {
        c.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, ddp::collective::all_reduce, ddp::dtype::float32, data.size()),
                     ddp::deadline::after(30s));
      } catch (const ddp::error& e) {
        code = static_cast<int>(e.code());
      }
      took = std::chrono::steady_clock::now() - start;
    });
    pollfd none{-1, 0, 0};
    ::poll(&none, 0, 50);  // usually lets the all_reduce block first; either order must fail fast
    c.abort();
    waiter.join();
    done.count_down();
    if (code != static_cast<int>(ddp::errc::peer_lost)) throw std::runtime_error("all_reduce did not fail with peer_lost");
    if (took > 2s) throw std::runtime_error("abort took too long");
  });
}

struct scratch_test_site;
struct other_scratch_test_site;

TEST_CASE("scratch: a use site's buffer is reused on its thread, while nested uses, other sites and threads get their own") {
  using ddp::algo::detail::scratch;
  auto address = [](const auto& s) { return reinterpret_cast<std::uintptr_t>(s.data()); };
  std::uintptr_t first = 0;
  {
    const scratch<scratch_test_site> a(1000);
    first = address(a);
    CHECK(first % 64 == 0);
    std::memset(a.data(), 0x5a, 1000);  // all of it is writable
    const scratch<scratch_test_site> nested(1000);
    CHECK(address(nested) != first);
    const scratch<other_scratch_test_site> other(1000);
    CHECK(address(other) != first);
    std::uintptr_t on_another_thread = 0;
    std::thread([&] { on_another_thread = address(scratch<scratch_test_site>(1000)); }).join();
    CHECK(on_another_thread != first);
  }
  // Smaller: the same memory, not a new allocation; its bytes are as left (a freed and
  // reallocated block would have had malloc's list pointers written over its first bytes).
  const scratch<scratch_test_site> again(500);
  CHECK(address(again) == first);
  CHECK(again.as<unsigned char>()[0] == 0x5a);
  CHECK(again.as<unsigned char>()[8] == 0x5a);
}

}  // namespace ddp_test_ring_algorithms
