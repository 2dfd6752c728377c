// ddp::mpi_backend under mpirun (one ctest per process count). Every rank runs every test
// case in the same order; references are computed locally from each rank's known input.
#include <ddp/mpi.hpp>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

ddp::mpi_environment& environment() {
  static ddp::mpi_environment env;
  return env;
}

// Rank r's input element i: small integers, so sums and products are exact in every dtype.
template <class T>
T input(int rank, std::size_t i) {
  const int v = static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 3) % 5) + 1;
  return T(static_cast<float>(v));
}

template <class T>
double as_double(T v) {
  return static_cast<double>(static_cast<ddp::accumulate_t<T>>(v));
}

template <class T, class Op>
double reference(Op op, int size, std::size_t i) {
  using A = ddp::accumulate_t<T>;
  A acc = static_cast<A>(input<T>(0, i));
  for (int r = 1; r < size; ++r) acc = op(acc, static_cast<A>(input<T>(r, i)));
  return as_double(static_cast<T>(op.finish(acc, size)));
}

template <class T, class Op>
void check_all_reduce(ddp::mpi_backend& backend, Op op, std::size_t n) {
  std::vector<T> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = input<T>(backend.rank(), i);
  backend.all_reduce(std::span<T>(data), op);
  for (std::size_t i = 0; i < n; ++i) {
    // prod of up to 4 values <= 5 and uint8 wrap-around are exact in the accumulation type
    const double expected = reference<T>(op, backend.size(), i);
    if (as_double(data[i]) != expected) {
      FAIL("all_reduce " << Op::name << " element " << i << ": got " << as_double(data[i]) << ", expected " << expected);
    }
  }
}

template <class T>
void check_dtype(ddp::mpi_backend& backend) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1023}, (std::size_t{1} << 20) + 3}) {
    check_all_reduce<T>(backend, ddp::sum{}, n);
    check_all_reduce<T>(backend, ddp::max{}, n);
    check_all_reduce<T>(backend, ddp::min{}, n);
    if (n < 2000) check_all_reduce<T>(backend, ddp::prod{}, n);
    if constexpr (!std::is_same_v<T, std::uint8_t>) check_all_reduce<T>(backend, ddp::avg{}, n);
  }
}

}  // namespace

TEST_CASE("mpi_backend: all_reduce, every dtype and op, sizes 0 to 2^20+3") {
  environment();
  ddp::mpi_backend backend;
  check_dtype<float>(backend);
  check_dtype<double>(backend);
  check_dtype<ddp::float16>(backend);
  check_dtype<ddp::bfloat16>(backend);
  check_dtype<std::int32_t>(backend);
  check_dtype<std::int64_t>(backend);
  check_dtype<std::uint8_t>(backend);
}

TEST_CASE("mpi_backend: broadcast, all_gather, reduce_scatter, barrier") {
  environment();
  ddp::mpi_backend backend;
  const int p = backend.size(), me = backend.rank();
  for (int root = 0; root < p; ++root) {
    std::vector<std::int64_t> data(1023, me == root ? 1000 + root : -1);
    backend.broadcast(std::span<std::int64_t>(data), root);
    for (auto v : data) REQUIRE(v == 1000 + root);
  }
  std::vector<float> mine(7), all(7 * static_cast<std::size_t>(p));
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = input<float>(me, i);
  backend.all_gather(std::span<const float>(mine), std::span<float>(all));
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < 7; ++i) REQUIRE(all[static_cast<std::size_t>(r) * 7 + i] == input<float>(r, i));

  std::vector<double> in(5 * static_cast<std::size_t>(p)), out(5);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<double>(me, i);
  backend.reduce_scatter(std::span<const double>(in), std::span<double>(out), ddp::sum{});
  for (std::size_t i = 0; i < 5; ++i) REQUIRE(out[i] == reference<double>(ddp::sum{}, p, static_cast<std::size_t>(me) * 5 + i));
  backend.barrier();
}

namespace {

// reduce to every root in turn, and reduce_scatter, for one dtype and op: half types travel as
// float32 and avg divides once, on the rank that owns the result.
template <class T, class Op>
void check_reduce_and_reduce_scatter(ddp::mpi_backend& backend, Op op) {
  const int p = backend.size(), me = backend.rank();
  constexpr std::size_t n = 9;
  for (int root = 0; root < p; ++root) {
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = input<T>(me, i);
    backend.reduce(std::span<T>(data), root, op, ddp::collective_desc{.seq = 0, .op = ddp::collective::reduce, .type = ddp::dtype_of<T>,
                                                                     .reduction = Op::kind, .root = root, .count = n},
                   ddp::deadline::after(std::chrono::seconds(60)));
    for (std::size_t i = 0; i < n; ++i) {
      INFO(ddp::to_string(ddp::dtype_of<T>) << " reduce " << Op::name << " to root " << root << " element " << i);
      // Only the root's buffer holds the result; the others keep their input.
      const double expected = me == root ? reference<T>(op, p, i) : as_double(input<T>(me, i));
      REQUIRE(as_double(data[i]) == expected);
    }
  }
  std::vector<T> in(n * static_cast<std::size_t>(p)), out(n);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input<T>(me, i);
  backend.reduce_scatter(std::span<const T>(in), std::span<T>(out), op);
  for (std::size_t i = 0; i < n; ++i) {
    INFO(ddp::to_string(ddp::dtype_of<T>) << " reduce_scatter " << Op::name << " element " << i);
    REQUIRE(as_double(out[i]) == reference<T>(op, p, static_cast<std::size_t>(me) * n + i));
  }
}

}  // namespace

TEST_CASE("mpi_backend: reduce and reduce_scatter, every dtype, half types and avg included") {
  environment();
  ddp::mpi_backend backend;
  check_reduce_and_reduce_scatter<float>(backend, ddp::avg{});
  check_reduce_and_reduce_scatter<double>(backend, ddp::max{});
  check_reduce_and_reduce_scatter<ddp::float16>(backend, ddp::avg{});
  check_reduce_and_reduce_scatter<ddp::bfloat16>(backend, ddp::sum{});
  check_reduce_and_reduce_scatter<ddp::float16>(backend, ddp::min{});
  check_reduce_and_reduce_scatter<std::int32_t>(backend, ddp::avg{});
  check_reduce_and_reduce_scatter<std::int64_t>(backend, ddp::prod{});
  check_reduce_and_reduce_scatter<std::uint8_t>(backend, ddp::sum{});
}

TEST_CASE("mpi_backend: send/recv carry a header checked by the receiver", "[multirank]") {
  environment();
  ddp::mpi_backend backend;
  REQUIRE(backend.size() >= 2);  // registered only for np >= 2
  std::vector<std::int32_t> data(100);
  if (backend.rank() == 0) {
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::int32_t>(i * i);
    backend.send(std::span<const std::int32_t>(data), 1);
  } else if (backend.rank() == 1) {
    backend.recv(std::span<std::int32_t>(data), 0);
    for (std::size_t i = 0; i < data.size(); ++i) REQUIRE(data[i] == static_cast<std::int32_t>(i * i));
  }
  backend.barrier();
}

TEST_CASE("mpi_backend: ranks calling different collectives all get errc::mismatch", "[multirank]") {
  environment();
  ddp::mpi_backend backend;
  REQUIRE(backend.size() >= 2);  // registered only for np >= 2
  std::vector<float> data(backend.rank() == 1 ? 9 : 8, 1.0f);
  try {
    backend.all_reduce(std::span<float>(data), ddp::sum{});
    FAIL("expected a mismatch");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::mismatch);
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("float32 x 8") != std::string::npos);
    CHECK(what.find("float32 x 9") != std::string::npos);
  }
  // The communicator stays usable after a detected mismatch: nothing was exchanged.
  std::vector<float> after(4, 1.0f);
  backend.all_reduce(std::span<float>(after), ddp::sum{});
  CHECK(after[0] == static_cast<float>(backend.size()));
}

TEST_CASE("init_process_group(\"mpi\"): MPI_COMM_WORLD as a process group, no store, no MASTER_ADDR") {
  environment();
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  auto group = ddp::init_process_group("mpi", {.timeout = std::chrono::seconds(30)});
  CHECK(group.rank() == world_rank);
  CHECK(group.size() == world_size);
  // Closed form: the sum of (rank + 1) * (i + 1) over ranks is (i + 1) * W (W + 1) / 2.
  std::vector<double> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>((world_rank + 1) * static_cast<int>(i + 1));
  group.all_reduce(std::span<double>(data), ddp::sum{});
  for (std::size_t i = 0; i < data.size(); ++i) {
    REQUIRE(data[i] == static_cast<double>(i + 1) * world_size * (world_size + 1) / 2);
  }
  std::vector<int> root_value{world_rank == 0 ? 4242 : -1};
  group.broadcast(std::span<int>(root_value), 0);
  CHECK(root_value[0] == 4242);
  group.barrier();
}

TEST_CASE("mpi_backend: a rank that does not arrive is errc::timeout at the deadline", "[multirank]") {
  environment();
  ddp::mpi_backend backend;
  REQUIRE(backend.size() >= 2);  // registered only for np >= 2
  ddp::mpi_backend world_sync;  // a separate communicator to line the ranks up afterwards
  std::vector<float> data(4, 1.0f);
  const ddp::collective_desc desc{.seq = 0, .op = ddp::collective::all_reduce, .type = ddp::dtype::float32, .count = 4};
  if (backend.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    try {
      backend.all_reduce(std::span<float>(data), ddp::sum{}, desc, ddp::deadline::after(std::chrono::milliseconds(300)));
      FAIL("expected a timeout");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::timeout);
      CHECK(std::string(e.what()).find("all_reduce #0") != std::string::npos);
    }
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(elapsed >= std::chrono::milliseconds(300));
    CHECK(elapsed < std::chrono::seconds(3));
    world_sync.barrier();
  } else {
    world_sync.barrier();  // arrives only after rank 0 gave up
    backend.abort();       // and does not join the abandoned collective
  }
}
