// shm_communicator, ranks as forked processes over a file_store: every collective x dtype x size x
// group size, for ordinary (staged) and group-allocated (zero-copy) buffers, against references
// computed here in float64 (floats, with a tolerance) or exactly (integers), from inputs that are a
// function of (rank, index). All-reduce results are also compared bit for bit across ranks.
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/store/file_store.hpp"
#include "ddp/store/hash_store.hpp"
#include "support/leaks.hpp"
#include "support/multiprocess.hpp"
#include "support/sizes.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_shm_collectives {

using ddp::test::shm_entries;
using namespace std::chrono_literals;
using ddp::collective;
using ddp::reduce_kind;
using comm_t = ddp::algo::shm_communicator;

namespace {

const std::vector<std::size_t> all_sizes = {0, 1, 7, 1023, ddp::test::large_count};
const std::vector<int> group_sizes = {1, 2, 3, 4, 8};

// Runs fn(rank, comm) on p forked ranks; fails the test case on any rank's failure or a leftover segment.
template <class Fn>
void run_group(int p, const std::string& name, Fn fn, comm_t::options opts = {}) {
  static int counter = 0;
  const std::string tag = name + std::to_string(::getpid()) + "x" + std::to_string(++counter);
  const std::string path = "/tmp/ddp-" + tag + ".store";
  ::unlink(path.c_str());
  const auto result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        ddp::store::file_store st(path);
        comm_t comm(st, tag + "/", rank, p, ddp::deadline::after(60s), opts);
        fn(rank, comm);
      },
      170s);
  ::unlink(path.c_str());
  INFO("p=" << p << "\n" << result.describe());
  REQUIRE(result.ok());
  CHECK(shm_entries(tag + "_").empty());
  // Bit-identical results: every rank printed "H <label> <hash>" for the same labels.
  std::map<std::string, std::string> first;
  for (const auto& r : result.ranks) {
    std::istringstream lines(r.output);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.rfind("H ", 0) != 0) continue;
      const auto cut = line.rfind(' ');
      const auto label = line.substr(2, cut - 2), hash = line.substr(cut + 1);
      auto [it, fresh] = first.emplace(label, hash);
      INFO("rank " << r.rank << " " << label);
      if (!fresh) CHECK(it->second == hash);
    }
  }
}

template <class E>
const char* type_name() {
  return ddp::to_string(ddp::dtype_of<E>).data();
}

// A well-mixed value in [-10, 10) with all 53 bits of a double in play: summing these rounds
// differently in every order. A few integer operations, where a libm call per element was most
// of these tests' time (inputs and references are computed for millions of elements).
inline double mixed(std::size_t rank, std::size_t i) {
  std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (rank + 1) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
  z ^= z >> 29;
  return static_cast<double>(z >> 11) * 0x1.0p-53 * 20.0 - 10.0;
}

// Inputs: a function of (rank, index) only. Integers stay small enough not to overflow int32 sums;
// uint8 sums over 8 ranks stay below 256; products use {1, 1.5, 2} (floats) or {1, 2, 3} (integers).
template <class E>
E input(int rank, std::size_t i, reduce_kind k = reduce_kind::sum) {
  const auto r = static_cast<std::size_t>(rank);
  if constexpr (std::is_integral_v<E>) {
    if (k == reduce_kind::prod) return static_cast<E>(1 + (r + i) % 3);
    if constexpr (std::is_same_v<E, std::uint8_t>) return static_cast<E>((r * 131 + i * 31) % 29);
    else return static_cast<E>(static_cast<long>((r * 131 + i * 31) % 97) - 48);
  } else {
    double v = 0;
    if (k == reduce_kind::prod) v = 1.0 + static_cast<double>((r + i) % 3) * 0.5;
    else if constexpr (std::is_floating_point_v<E>) v = mixed(r, i);
    else v = static_cast<double>((r * 131 + i * 31) % 97) / 8.0 - 6.0;
    if constexpr (std::is_floating_point_v<E>) return static_cast<E>(v);
    else return E(static_cast<float>(v));
  }
}

template <class E>
double as_double(E x) {
  if constexpr (ddp::half_precision<E>) return static_cast<double>(static_cast<float>(x));
  else return static_cast<double>(x);
}

// The reference of a reduction over ranks 0..p-1 of element i, in rank order: float64 for floats,
// int64 wrapped to E for integers (what fixed-width integer arithmetic gives).
template <class E>
double reference(int p, std::size_t i, reduce_kind k) {
  if constexpr (std::is_integral_v<E>) {
    std::int64_t acc = static_cast<std::int64_t>(input<E>(0, i, k));
    for (int r = 1; r < p; ++r) {
      const auto x = static_cast<std::int64_t>(input<E>(r, i, k));
      switch (k) {
        case reduce_kind::sum: case reduce_kind::avg: acc += x; break;
        case reduce_kind::prod: acc *= x; break;
        case reduce_kind::min: acc = std::min(acc, x); break;
        case reduce_kind::max: acc = std::max(acc, x); break;
      }
    }
    E wrapped = static_cast<E>(acc);
    if (k == reduce_kind::avg) wrapped = static_cast<E>(wrapped / static_cast<E>(p));
    return static_cast<double>(wrapped);
  } else {
    double acc = as_double(input<E>(0, i, k));
    for (int r = 1; r < p; ++r) {
      const double x = as_double(input<E>(r, i, k));
      switch (k) {
        case reduce_kind::sum: case reduce_kind::avg: acc += x; break;
        case reduce_kind::prod: acc *= x; break;
        case reduce_kind::min: acc = std::min(acc, x); break;
        case reduce_kind::max: acc = std::max(acc, x); break;
      }
    }
    if (k == reduce_kind::avg) acc /= p;
    return acc;
  }
}

template <class E>
double tolerance() {
  if constexpr (std::is_integral_v<E>) return 0;
  else if constexpr (std::is_same_v<E, double>) return 1e-12;
  else if constexpr (std::is_same_v<E, float>) return 1e-5;
  else if constexpr (std::is_same_v<E, ddp::float16>) return 1.0 / 512;
  else return 1.0 / 64;  // bfloat16: 8 significant bits
}

template <class E>
void expect_near(E got, double want, const std::string& what, std::size_t i) {
  const double g = as_double(got);
  const double tol = tolerance<E>() * (1.0 + std::fabs(want));
  if (!(std::fabs(g - want) <= tol)) {
    throw std::runtime_error(what + ": element " + std::to_string(i) + " is " + std::to_string(g) + ", expected " + std::to_string(want));
  }
}
template <class E>
void expect_equal(E got, E want, const std::string& what, std::size_t i) {
  if (std::memcmp(&got, &want, sizeof(E)) != 0) {
    throw std::runtime_error(what + ": element " + std::to_string(i) + " is " + std::to_string(as_double(got)) + ", expected " +
                             std::to_string(as_double(want)));
  }
}

template <class E>
std::uint64_t hash_of(std::span<const E> v) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size_bytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

template <class F>
void for_each_dtype(F&& f) {
  f(std::type_identity<float>{});
  f(std::type_identity<double>{});
  f(std::type_identity<ddp::float16>{});
  f(std::type_identity<ddp::bfloat16>{});
  f(std::type_identity<std::int32_t>{});
  f(std::type_identity<std::int64_t>{});
  f(std::type_identity<std::uint8_t>{});
}

ddp::collective_desc make_desc(std::uint64_t seq, collective op, ddp::dtype t, std::size_t count, reduce_kind k = reduce_kind::sum,
                               int root = -1) {
  ddp::collective_desc d;
  d.seq = seq;
  d.op = op;
  d.type = t;
  d.count = count;
  d.reduction = k;
  d.root = root;
  return d;
}

// all_reduce (root < 0) or reduce to root of rank's float64 inputs shifted by `shift`, checked
// against the closed form (a reduce leaves the other ranks' inputs as they were).
void reduce_and_check(comm_t& comm, std::span<double> data, int root, int rank, int p, std::size_t shift, std::uint64_t& seq,
                      const std::string& what) {
  const std::size_t n = data.size();
  if (root < 0) {
    comm.all_reduce(data, ddp::sum{}, make_desc(++seq, collective::all_reduce, ddp::dtype::float64, n), ddp::deadline::after(60s));
    for (std::size_t i = 0; i < n; ++i) expect_near(data[i], reference<double>(p, i + shift, reduce_kind::sum), "all_reduce " + what, i);
    return;
  }
  comm.reduce(data, root, ddp::sum{}, make_desc(++seq, collective::reduce, ddp::dtype::float64, n, reduce_kind::sum, root),
              ddp::deadline::after(60s));
  for (std::size_t i = 0; i < n; ++i) {
    if (rank == root) expect_near(data[i], reference<double>(p, i + shift, reduce_kind::sum), "reduce " + what, i);
    else expect_equal(data[i], input<double>(rank, i + shift), "reduce (non-root) " + what, i);
  }
}

// A buffer of n elements: ordinary memory, or from the group (every rank allocates in the same order).
template <class E>
struct test_buffer {
  std::vector<E> own;
  ddp::shared_buffer<E> shared;
  bool group;
  test_buffer(comm_t& c, std::size_t n, bool g) : group(g) {
    if (g) shared = c.allocate<E>(n, ddp::deadline::after(30s));
    else own.resize(n);
  }
  std::span<E> span() { return group ? shared.span() : std::span<E>(own); }
};

std::vector<std::size_t> sizes_for(int p) {
  std::vector<std::size_t> s = all_sizes;
  if (p > 4) s.pop_back();  // the big size only for p <= 4
  return s;
}

std::string label(const char* op, const char* type, std::size_t n, bool group) {
  return std::string(op) + " " + type + " n=" + std::to_string(n) + (group ? " group" : " user");
}

}  // namespace

TEST_CASE("shm collectives: all_reduce (sum) matches the float64 / exact reference, bit-identical on every rank") {
  for (int p : group_sizes) {
    run_group(p, "shmar", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            test_buffer<E> buf(comm, n, group);
            auto data = buf.span();
            for (std::size_t i = 0; i < n; ++i) data[i] = input<E>(rank, i);
            comm.all_reduce(data, ddp::sum{}, make_desc(++seq, collective::all_reduce, ddp::dtype_of<E>, n), ddp::deadline::after(60s));
            const auto what = label("all_reduce", type_name<E>(), n, group);
            for (std::size_t i = 0; i < n; ++i) expect_near(data[i], reference<E>(p, i, reduce_kind::sum), what, i);
            std::printf("H %s %llx\n", what.c_str(), static_cast<unsigned long long>(hash_of<E>(data)));
          }
      });
    });
  }
}

TEST_CASE("shm collectives: every reduce op (sum avg min max prod) on every dtype, small and large, both buffer kinds") {
  for (int p : {2, 3, 8}) {
    run_group(p, "shmops", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : {std::size_t{7}, std::size_t{70001}})
          for (bool group : {false, true})
            for (auto kind : {reduce_kind::sum, reduce_kind::avg, reduce_kind::min, reduce_kind::max, reduce_kind::prod}) {
              test_buffer<E> buf(comm, n, group);
              auto data = buf.span();
              for (std::size_t i = 0; i < n; ++i) data[i] = input<E>(rank, i, kind);
              ddp::visit_reduce_kind(kind, [&](auto op) {
                comm.all_reduce(data, op, make_desc(++seq, collective::all_reduce, ddp::dtype_of<E>, n, kind), ddp::deadline::after(60s));
              });
              const auto what = label(ddp::to_string(kind).data(), type_name<E>(), n, group);
              for (std::size_t i = 0; i < n; ++i) expect_near(data[i], reference<E>(p, i, kind), what, i);
              std::printf("H %s %llx\n", what.c_str(), static_cast<unsigned long long>(hash_of<E>(data)));
            }
      });
    });
  }
}

TEST_CASE("shm collectives: reduce delivers the reduction to the root and leaves the others' buffers alone") {
  for (int p : group_sizes) {
    run_group(p, "shmred", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      const int root = p / 2;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            test_buffer<E> buf(comm, n, group);
            auto data = buf.span();
            for (std::size_t i = 0; i < n; ++i) data[i] = input<E>(rank, i);
            comm.reduce(data, root, ddp::sum{}, make_desc(++seq, collective::reduce, ddp::dtype_of<E>, n, reduce_kind::sum, root),
                        ddp::deadline::after(60s));
            const auto what = label("reduce", type_name<E>(), n, group) + (rank == root ? "" : " (non-root)");
            for (std::size_t i = 0; i < n; ++i) {
              if (rank == root) expect_near(data[i], reference<E>(p, i, reduce_kind::sum), what, i);
              else expect_equal(data[i], input<E>(rank, i), what, i);
            }
          }
      });
    });
  }
}

TEST_CASE("shm collectives: small all_reduce / reduce with group buffers on some ranks and ordinary memory on others") {
  // 4-8 KiB: each rank says whether its buffer is shared; all shared is zero copy, none the
  // header slots or (slot_direct_max raised) the direct path's staging, a mix a second round.
  // The calls after a mix must still line up.
  for (const std::size_t slot_direct_max : {comm_t::options{}.slot_direct_max, std::size_t{8192}}) {
    comm_t::options opts;
    opts.slot_direct_max = slot_direct_max;
    for (int p : {2, 3, 4}) {
      run_group(p, "shmmix", [p](int rank, comm_t& comm) {
        std::uint64_t seq = 0;
        for (std::size_t n : {std::size_t{700}, std::size_t{1023}}) {  // float64: 5600 and 8184 bytes
          for (int pattern = 0; pattern < 4; ++pattern) {
            // 0: all ordinary, 1: all shared, 2: even ranks shared, 3: only the last rank shared.
            const bool shared = pattern == 1 || (pattern == 2 && rank % 2 == 0) || (pattern == 3 && rank == p - 1);
            test_buffer<double> group_memory(comm, n, true);  // collective: every rank allocates
            std::vector<double> own(n);
            const std::span<double> data = shared ? group_memory.span() : std::span<double>(own);
            for (const int root : {-1, 0, p - 1}) {
              // Different values in every call: stale slot contents must not pass for this call's.
              const std::size_t shift = static_cast<std::size_t>(seq) * 7;
              for (std::size_t i = 0; i < n; ++i) data[i] = input<double>(rank, i + shift);
              reduce_and_check(comm, data, root, rank, p, shift, seq,
                               "n=" + std::to_string(n) + " pattern " + std::to_string(pattern) + " root " + std::to_string(root));
            }
          }
        }
      }, opts);
    }
  }
}

TEST_CASE("shm collectives: back-to-back calls of changing sizes across the small, direct and staged paths, with mixed buffers") {
  // A small staging area so that a few KiB cross every threshold: small (slot) up to 1 KiB, direct
  // (each rank's whole buffer in one half of staging, halves alternating by call) up to
  // 8 KiB / (p - 1), staged chunks above; the other collectives' slots also hold 1 KiB.
  // Broadcasts and all_gathers through the staging chunks come between the all-reduces, and some
  // calls mix shared and ordinary buffers: no call may read a peer's staged copy of another call,
  // whatever came before it.
  comm_t::options opts;
  opts.small_bytes = 1024;
  opts.slot_direct_max = 0;
  opts.chunk_bytes = 4096;
  opts.depth = 4;
  opts.direct_bytes = 8192;
  for (int p : {2, 3, 4, 8}) {
    run_group(
        p, "shmrot",
        [p](int rank, comm_t& comm) {
          std::uint64_t seq = 0;
          auto shared = comm.allocate<double>(4096, ddp::deadline::after(30s));
          const std::size_t counts[] = {3, 100, 129, 300, 700, 1023, 1024, 1500, 2049, 3000};
          constexpr std::size_t n_counts = sizeof counts / sizeof counts[0];
          for (std::size_t call = 0; call < 240; ++call) {
            const std::size_t n = counts[(call * 7 + call / n_counts) % n_counts];
            const std::size_t shift = call * 13;
            // Every fifth call: only even ranks pass shared memory; every seventh: all do.
            const bool use_shared = (call % 5 == 0 && rank % 2 == 0) || call % 7 == 0;
            std::vector<double> own(n);
            const std::span<double> data = use_shared ? shared.span().first(n) : std::span<double>(own);
            for (std::size_t i = 0; i < n; ++i) data[i] = input<double>(rank, i + shift);
            const auto what = "call " + std::to_string(call) + " n=" + std::to_string(n);
            const int root = call % 4 == 3 ? static_cast<int>(call / 4) % p : -1;
            reduce_and_check(comm, data, root, rank, p, shift, seq, what);
            if (call % 3 == 1) {  // staged chunks of another collective in between
              std::vector<float> b(1000 + call % 5 * 700);
              const int from = static_cast<int>(call) % p;
              for (std::size_t i = 0; i < b.size(); ++i) b[i] = rank == from ? input<float>(from, i + shift) : -1.0f;
              comm.broadcast(std::span<float>(b), from, make_desc(++seq, collective::broadcast, ddp::dtype::float32, b.size(), reduce_kind::sum, from),
                             ddp::deadline::after(60s));
              for (std::size_t i = 0; i < b.size(); ++i) expect_equal(b[i], input<float>(from, i + shift), "broadcast after " + what, i);
            } else if (call % 3 == 2) {
              const std::size_t m = 900 + call % 4 * 300;
              std::vector<float> in(m), out(m * static_cast<std::size_t>(p));
              for (std::size_t i = 0; i < m; ++i) in[i] = input<float>(rank, i + shift);
              comm.all_gather(std::span<const float>(in), std::span<float>(out), make_desc(++seq, collective::all_gather, ddp::dtype::float32, m),
                              ddp::deadline::after(60s));
              for (int j = 0; j < p; ++j)
                for (std::size_t i = 0; i < m; ++i)
                  expect_equal(out[static_cast<std::size_t>(j) * m + i], input<float>(j, i + shift), "all_gather after " + what, i);
            }
          }
        },
        opts);
  }
}

TEST_CASE("shm collectives: zero copy with each rank's buffer in a different group allocation, at an offset") {
  // Usually every rank passes its part of the same allocation; here rank r passes allocation
  // r % 3 of three, starting r + 1 elements in, so the peers' buffers are looked up by id.
  for (int p : {2, 3}) {
    run_group(p, "shmallocs", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for (std::size_t n : {std::size_t{700}, std::size_t{5000}}) {  // float64: the small offer path and the large path
        std::vector<test_buffer<double>> buffers;
        for (int a = 0; a < 3; ++a) buffers.emplace_back(comm, n + 8, true);  // collective: every rank allocates all three
        const std::span<double> data = buffers[static_cast<std::size_t>(rank % 3)].span().subspan(static_cast<std::size_t>(rank) + 1, n);
        const std::size_t shift = static_cast<std::size_t>(++seq) * 11;
        for (std::size_t i = 0; i < n; ++i) data[i] = input<double>(rank, i + shift);
        comm.all_reduce(data, ddp::sum{}, make_desc(seq, collective::all_reduce, ddp::dtype::float64, n), ddp::deadline::after(60s));
        const auto what = "p=" + std::to_string(p) + " n=" + std::to_string(n);
        for (std::size_t i = 0; i < n; ++i) expect_near(data[i], reference<double>(p, i + shift, reduce_kind::sum), "all_reduce " + what, i);
        for (std::size_t i = 0; i < n; ++i) data[i] = input<double>(rank, i);
        comm.broadcast(data, p - 1, make_desc(++seq, collective::broadcast, ddp::dtype::float64, n, reduce_kind::sum, p - 1), ddp::deadline::after(60s));
        for (std::size_t i = 0; i < n; ++i) expect_equal(data[i], input<double>(p - 1, i), "broadcast " + what, i);
      }
    });
  }
}

TEST_CASE("shm collectives: a peer passing memory of a shared buffer this rank has freed is an error on every rank, not a crash") {
  run_group(2, "shmfreed", [](int rank, comm_t& comm) {
    const std::size_t n = 5000;
    auto kept = std::make_unique<test_buffer<double>>(comm, n, true);
    auto dropped = std::make_unique<test_buffer<double>>(comm, n, true);
    // Rank 0 frees the second buffer; rank 1 still passes its part of it.
    std::span<double> data = rank == 0 ? kept->span() : dropped->span();
    if (rank == 0) dropped.reset();
    try {
      comm.all_reduce(data, ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float64, n), ddp::deadline::after(20s));
      ddp::test::check(false, "the all_reduce succeeded");
    } catch (const ddp::error& e) {
      const std::string what = e.what();
      if (rank == 0) {
        ddp::test::check(e.code() == ddp::errc::invalid_argument, "rank 0: wrong code: " + what);
        ddp::test::check(what.find("already freed") != std::string::npos && what.find("rank 1") != std::string::npos, "rank 0: " + what);
      } else {
        ddp::test::check(e.code() == ddp::errc::peer_lost || e.code() == ddp::errc::invalid_argument, "rank 1: wrong code: " + what);
      }
    }
  });
}

TEST_CASE("shm collectives: ordinary memory mapped where a freed shared buffer was is ordinary memory") {
  // The registry keeps a freed buffer's entry until the next allocation; a lookup that trusted it
  // would read the peers' unmapped copies (and their already-freed bookkeeping) for this span.
  run_group(2, "shmreuse", [](int rank, comm_t& comm) {
    const std::size_t n = 5000;  // beyond the slots: the zero-copy path, were the span taken as shared
    void* at = nullptr;
    std::size_t bytes = 0;
    {
      auto freed = comm.allocate<double>(n, ddp::deadline::after(30s));
      at = freed.data();
      bytes = (freed.size_bytes() + 4095) / 4096 * 4096;
    }
    void* mem = ::mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    ddp::test::check(mem == at, "rank " + std::to_string(rank) + ": could not map ordinary memory where the freed buffer was");
    std::span<double> data(static_cast<double*>(mem), n);
    for (std::size_t i = 0; i < n; ++i) data[i] = input<double>(rank, i);
    comm.all_reduce(data, ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float64, n), ddp::deadline::after(20s));
    for (std::size_t i = 0; i < n; ++i) expect_equal(data[i], input<double>(0, i) + input<double>(1, i), "all_reduce over reused addresses", i);
    ::munmap(mem, bytes);
  });
}

TEST_CASE("shm collectives: broadcast copies the root's buffer exactly") {
  for (int p : group_sizes) {
    run_group(p, "shmbc", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      const int root = p - 1;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            test_buffer<E> buf(comm, n, group);
            auto data = buf.span();
            for (std::size_t i = 0; i < n; ++i) data[i] = input<E>(rank, i);
            comm.broadcast(data, root, make_desc(++seq, collective::broadcast, ddp::dtype_of<E>, n, reduce_kind::sum, root), ddp::deadline::after(60s));
            const auto what = label("broadcast", type_name<E>(), n, group);
            for (std::size_t i = 0; i < n; ++i) expect_equal(data[i], input<E>(root, i), what, i);
          }
      });
    });
  }
}

TEST_CASE("shm collectives: all_gather puts rank j's input at block j of every rank's output") {
  for (int p : group_sizes) {
    run_group(p, "shmag", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            test_buffer<E> in(comm, n, group), out(comm, n * static_cast<std::size_t>(p), group);
            auto src = in.span();
            for (std::size_t i = 0; i < n; ++i) src[i] = input<E>(rank, i);
            comm.all_gather(std::span<const E>(src), out.span(), make_desc(++seq, collective::all_gather, ddp::dtype_of<E>, n),
                            ddp::deadline::after(60s));
            const auto what = label("all_gather", type_name<E>(), n, group);
            auto got = out.span();
            for (int j = 0; j < p; ++j)
              for (std::size_t i = 0; i < n; ++i) expect_equal(got[static_cast<std::size_t>(j) * n + i], input<E>(j, i), what, i);
          }
      });
    });
  }
}

TEST_CASE("shm collectives: reduce_scatter (sum) gives rank r the reduction of block r") {
  for (int p : group_sizes) {
    run_group(p, "shmrs", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            const std::size_t total = n * static_cast<std::size_t>(p);
            test_buffer<E> in(comm, total, group), out(comm, n, group);
            auto src = in.span();
            for (std::size_t i = 0; i < total; ++i) src[i] = input<E>(rank, i);
            comm.reduce_scatter(std::span<const E>(src), out.span(), ddp::sum{},
                                make_desc(++seq, collective::reduce_scatter, ddp::dtype_of<E>, n), ddp::deadline::after(60s));
            const auto what = label("reduce_scatter", type_name<E>(), n, group);
            auto got = out.span();
            const std::size_t offset = static_cast<std::size_t>(rank) * n;
            for (std::size_t i = 0; i < n; ++i) expect_near(got[i], reference<E>(p, offset + i, reduce_kind::sum), what, i);
          }
      });
    });
  }
}

TEST_CASE("shm collectives: all_to_all sends block j of rank r to block r of rank j") {
  for (int p : group_sizes) {
    run_group(p, "shma2a", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p))
          for (bool group : {false, true}) {
            const std::size_t total = n * static_cast<std::size_t>(p);
            test_buffer<E> in(comm, total, group), out(comm, total, group);
            auto src = in.span();
            for (std::size_t i = 0; i < total; ++i) src[i] = input<E>(rank, i);
            comm.all_to_all(std::span<const E>(src), out.span(), make_desc(++seq, collective::all_to_all, ddp::dtype_of<E>, total),
                            ddp::deadline::after(60s));
            const auto what = label("all_to_all", type_name<E>(), n, group);
            auto got = out.span();
            for (int j = 0; j < p; ++j)
              for (std::size_t i = 0; i < n; ++i)
                expect_equal(got[static_cast<std::size_t>(j) * n + i], input<E>(j, static_cast<std::size_t>(rank) * n + i), what, i);
          }
      });
    });
  }
}

TEST_CASE("shm collectives: in-place all_gather, reduce_scatter and all_to_all") {
  for (int p : {2, 3, 4}) {
    run_group(p, "shminpl", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      const auto pp = static_cast<std::size_t>(p);
      for (std::size_t n : {std::size_t{5}, std::size_t{300000}})
        for (bool group : {false, true}) {
          test_buffer<float> buf(comm, n * pp, group);
          auto b = buf.span();
          // all_gather: in is this rank's own block of out.
          for (std::size_t i = 0; i < n; ++i) b[static_cast<std::size_t>(rank) * n + i] = input<float>(rank, i);
          comm.all_gather(std::span<const float>(b.subspan(static_cast<std::size_t>(rank) * n, n)), b,
                          make_desc(++seq, collective::all_gather, ddp::dtype::float32, n), ddp::deadline::after(60s));
          for (int j = 0; j < p; ++j)
            for (std::size_t i = 0; i < n; ++i) expect_equal(b[static_cast<std::size_t>(j) * n + i], input<float>(j, i), "in-place all_gather", i);
          // reduce_scatter: out is this rank's own block of in.
          for (std::size_t i = 0; i < n * pp; ++i) b[i] = input<float>(rank, i);
          comm.reduce_scatter(std::span<const float>(b), b.subspan(static_cast<std::size_t>(rank) * n, n), ddp::sum{},
                              make_desc(++seq, collective::reduce_scatter, ddp::dtype::float32, n), ddp::deadline::after(60s));
          for (std::size_t i = 0; i < n; ++i)
            expect_near(b[static_cast<std::size_t>(rank) * n + i], reference<float>(p, static_cast<std::size_t>(rank) * n + i, reduce_kind::sum),
                        "in-place reduce_scatter", i);
          // all_to_all: in and out are the same memory.
          for (std::size_t i = 0; i < n * pp; ++i) b[i] = input<float>(rank, i);
          comm.all_to_all(std::span<const float>(b), b, make_desc(++seq, collective::all_to_all, ddp::dtype::float32, n * pp),
                          ddp::deadline::after(60s));
          for (int j = 0; j < p; ++j)
            for (std::size_t i = 0; i < n; ++i)
              expect_equal(b[static_cast<std::size_t>(j) * n + i], input<float>(j, static_cast<std::size_t>(rank) * n + i), "in-place all_to_all", i);
        }
    });
  }
}

TEST_CASE("shm collectives: send/recv around the ring and barriers") {
  for (int p : {2, 3, 4, 8}) {
    run_group(p, "shmp2p", [p](int rank, comm_t& comm) {
      std::uint64_t seq = 0;
      const int to = (rank + 1) % p, from = (rank - 1 + p) % p;
      for_each_dtype([&]<class E>(std::type_identity<E>) {
        for (std::size_t n : sizes_for(p)) {
          std::vector<E> out(n), in(n);
          for (std::size_t i = 0; i < n; ++i) out[i] = input<E>(rank, i);
          const auto send_desc = make_desc(++seq, collective::send, ddp::dtype_of<E>, n);
          auto recv_desc = send_desc;
          recv_desc.op = collective::recv;
          // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
          if (rank % 2 == 0) {
            comm.send(std::span<const E>(out), to, send_desc, ddp::deadline::after(60s));
            comm.recv(std::span<E>(in), from, recv_desc, ddp::deadline::after(60s));
          } else {
            comm.recv(std::span<E>(in), from, recv_desc, ddp::deadline::after(60s));
            comm.send(std::span<const E>(out), to, send_desc, ddp::deadline::after(60s));
          }
          const std::string what = std::string("recv ") + type_name<E>();
          for (std::size_t i = 0; i < n; ++i) expect_equal(in[i], input<E>(from, i), what, i);
          comm.barrier(make_desc(++seq, collective::barrier, ddp::dtype::uint8, 0), ddp::deadline::after(60s));
        }
      });
    });
  }
}

// Whether process pid is asleep (state S in /proc/<pid>/stat: blocked, as in a futex wait).
bool asleep(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto name_end = stat.rfind(')');  // the state follows the parenthesized command name
  return name_end != std::string::npos && name_end + 2 < stat.size() && stat[name_end + 2] == 'S';
}

TEST_CASE("shm collectives: a rank asleep in the futex is woken by its peers' calls, not by its time slice") {
  // Waits sleep after a microsecond of spinning (no yield phase), in slices of 30 s: a peer that
  // failed to ring the doorbell after publishing would leave a sleeper there for a whole slice,
  // past this test's budget. Each round one rank calls late: only once every other rank is
  // asleep in its wait (seen in /proc). Small calls (one handoff, the slot's call number) and
  // staged ones (the chunk counters) alternate.
  comm_t::options opts;
  opts.wait.spin = 1us;
  opts.wait.spin_oversubscribed = 1us;
  opts.wait.yield = 0ns;
  opts.wait.slice = 30s;
  for (int p : {2, 3}) {
    const std::string pids_path = "/tmp/ddp-shmwake-pids-" + std::to_string(::getpid()) + "-" + std::to_string(p) + ".store";
    ::unlink(pids_path.c_str());
    run_group(
        p, "shmwake",
        [p, &pids_path](int rank, comm_t& comm) {
          ddp::store::file_store pids(pids_path);
          pids.set_string("pid" + std::to_string(rank), std::to_string(::getpid()));
          std::vector<pid_t> pid_of(static_cast<std::size_t>(p));
          for (int r = 0; r < p; ++r) {
            pids.wait({"pid" + std::to_string(r)}, 30s);
            pid_of[static_cast<std::size_t>(r)] = static_cast<pid_t>(std::stol(pids.get_string("pid" + std::to_string(r))));
          }
          const auto start = ddp::clock::now();
          constexpr int rounds = 40;
          for (int round = 0; round < rounds; ++round) {
            if (round % p == rank) {
              for (int r = 0; r < p; ++r) {
                if (r == rank) continue;
                const auto until = ddp::deadline::after(10s);
                while (!asleep(pid_of[static_cast<std::size_t>(r)])) {
                  ddp::test::check(!until.expired(), "round " + std::to_string(round) + ": rank " + std::to_string(r) + " did not go to sleep within 10 s");
                  std::this_thread::yield();
                }
              }
            }
            const std::size_t n = round % 2 == 0 ? 2 : std::size_t{1} << 18;
            std::vector<std::int64_t> data(n, round);
            data[0] = rank + 1;
            comm.all_reduce(std::span<std::int64_t>(data), ddp::sum{}, make_desc(static_cast<std::uint64_t>(round) + 1, collective::all_reduce, ddp::dtype::int64, n),
                            ddp::deadline::after(60s));
            ddp::test::check(data[0] == p * (p + 1) / 2 && data[n - 1] == std::int64_t{p} * round,
                             "round " + std::to_string(round) + ": wrong sum " + std::to_string(data[0]) + ", " + std::to_string(data[n - 1]));
          }
          const auto took = ddp::clock::now() - start;
          std::printf("rank %d: %d rounds in %lld ms\n", rank, rounds, static_cast<long long>(took / 1ms));
          ddp::test::check(took < 20s, "a sleeping rank was not woken: " + std::to_string(rounds) + " rounds took " + std::to_string(took / 1ms) + " ms");
        },
        opts);
    ::unlink(pids_path.c_str());
  }
}

TEST_CASE("shm collectives: a group of one copies only") {
  ddp::store::hash_store st;
  comm_t comm(st, "solo/", 0, 1, ddp::deadline::after(10s));
  std::vector<float> in = {1, 2, 3}, out(3);
  comm.all_gather(std::span<const float>(in), std::span<float>(out), make_desc(1, collective::all_gather, ddp::dtype::float32, 3),
                  ddp::deadline::after(1s));
  CHECK(out == in);
  comm.all_reduce(std::span<float>(in), ddp::avg{}, make_desc(2, collective::all_reduce, ddp::dtype::float32, 3, reduce_kind::avg),
                  ddp::deadline::after(1s));
  CHECK(in == std::vector<float>{1, 2, 3});
  auto shared = comm.allocate<double>(10, ddp::deadline::after(1s));
  CHECK(shared.size() == 10);
  for (double x : shared) CHECK(x == 0.0);
}

}  // namespace ddp_test_shm_collectives
