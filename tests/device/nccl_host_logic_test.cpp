// The NCCL backend's host-side logic, which needs no GPU: dtype and op mapping, the unique id's
// trip through the store, the translation of CUDA and NCCL codes into ddp::error, and what a
// machine without a device gets when it asks for the backend.
#include <ddp/nccl.hpp>
#include <ddp/store/hash_store.hpp>

#include <catch2/catch.hpp>
#include "device/nccl_ranks.hpp"
#include "support/skip.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace nccl_host_logic {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_CASE("nccl mapping: every ddp dtype has the NCCL type of the same width and kind") {
  using ddp::dtype;
  const std::vector<std::pair<dtype, ncclDataType_t>> expected = {
      {dtype::float32, ncclFloat}, {dtype::float64, ncclDouble},   {dtype::float16, ncclHalf}, {dtype::bfloat16, ncclBfloat16},
      {dtype::int32, ncclInt},     {dtype::int64, ncclInt64},      {dtype::uint8, ncclUint8},
  };
  for (const auto& [type, nccl] : expected) {
    INFO(ddp::to_string(type));
    CHECK(ddp::detail::nccl_datatype(type) == nccl);
  }
}

TEST_CASE("nccl mapping: every reduction kind, avg included, is NCCL's own") {
  using ddp::reduce_kind;
  CHECK(ddp::detail::nccl_op(reduce_kind::sum) == ncclSum);
  CHECK(ddp::detail::nccl_op(reduce_kind::avg) == ncclAvg);
  CHECK(ddp::detail::nccl_op(reduce_kind::min) == ncclMin);
  CHECK(ddp::detail::nccl_op(reduce_kind::max) == ncclMax);
  CHECK(ddp::detail::nccl_op(reduce_kind::prod) == ncclProd);
  CHECK(ddp::detail::nccl_op(ddp::kind_of(ddp::runtime_op{reduce_kind::avg})) == ncclAvg);
}

TEST_CASE("nccl records: each collective's NCCL arguments, by the NCCL API's definition of each call") {
  // process_group hands every call down as one record (no per-type instantiation).
  static_assert(ddp::detail::pg_takes_call_records<ddp::nccl_backend>);
  using ddp::collective;
  using ddp::dtype;
  constexpr int world = 4;
  const auto call = [](collective op, dtype type, std::size_t in_count, std::size_t out_count, ddp::reduce_kind reduction, int root) {
    return ddp::collective_call{.op = op, .type = type, .reduction = reduction, .root = root, .in_count = in_count, .out_count = out_count};
  };
  struct expectation {
    ddp::collective_call record;
    std::size_t count;  // ncclAllGather: per rank; ncclReduceScatter: per rank's result; all_to_all: per peer
  };
  using ddp::reduce_kind;
  const std::vector<expectation> cases = {
      {call(collective::all_reduce, dtype::float32, 10, 10, reduce_kind::avg, -1), 10},
      {call(collective::broadcast, dtype::int64, 7, 7, reduce_kind::sum, 2), 7},
      {call(collective::reduce, dtype::bfloat16, 5, 5, reduce_kind::max, 3), 5},
      {call(collective::all_gather, dtype::float16, 3, 3 * world, reduce_kind::sum, -1), 3},
      {call(collective::reduce_scatter, dtype::float64, 6 * world, 6, reduce_kind::min, -1), 6},
      {call(collective::all_to_all, dtype::int32, 2 * world, 2 * world, reduce_kind::sum, -1), 2},
      {call(collective::send, dtype::uint8, 9, 0, reduce_kind::sum, 1), 9},
      {call(collective::recv, dtype::uint8, 0, 9, reduce_kind::sum, 1), 9},
  };
  for (const auto& [record, count] : cases) {
    INFO(ddp::to_string(record.op));
    const auto a = ddp::detail::nccl_arguments_of(record, world);
    CHECK(a.count == count);
    CHECK(a.type == ddp::detail::nccl_datatype(record.type));
    CHECK(a.root == record.root);
    if (record.describe().has_reduction()) CHECK(a.op == ddp::detail::nccl_op(record.reduction));
  }
}

TEST_CASE("nccl unique id: rank 0 makes it once, every rank reads the same bytes through the store") {
  constexpr int ranks = 4;
  ddp::store::hash_store store;
  std::atomic<int> made{0};
  std::vector<ncclUniqueId> ids(ranks);
  std::vector<std::string> failures(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        ids[std::size_t(r)] = ddp::detail::share_unique_id(store, r, "job/nccl/unique_id", [&] {
          ++made;
          ncclUniqueId id;
          for (std::size_t i = 0; i < sizeof id.internal; ++i) id.internal[i] = static_cast<char>((i * 37 + 11) & 0xff);
          return id;
        });
      } catch (const std::exception& e) {
        failures[std::size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failures) CHECK(f.empty());
  CHECK(made == 1);
  for (std::size_t i = 0; i < sizeof(ncclUniqueId::internal); ++i) {
    const char want = static_cast<char>((i * 37 + 11) & 0xff);
    for (int r = 0; r < ranks; ++r) REQUIRE(ids[std::size_t(r)].internal[i] == want);
  }
}

TEST_CASE("nccl unique id: a key holding something else is errc::store naming the key") {
  ddp::store::hash_store store;
  store.set_string("job/nccl/unique_id", "not an id");
  try {
    ddp::detail::share_unique_id(store, 1, "job/nccl/unique_id", [] { return ncclUniqueId{}; });
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::store);
    CHECK(contains(e.what(), "job/nccl/unique_id"));
    CHECK(contains(e.what(), "9 bytes"));
  }
}

TEST_CASE("nccl errors: success and in-progress pass, failures become errc::nccl with NCCL's text") {
  CHECK_NOTHROW(ddp::detail::nccl_check(ncclSuccess, "ncclAllReduce"));
  CHECK_NOTHROW(ddp::detail::nccl_check(ncclInProgress, "ncclAllReduce"));
  for (ncclResult_t code : {ncclUnhandledCudaError, ncclSystemError, ncclInternalError, ncclInvalidArgument, ncclInvalidUsage,
                            ncclRemoteError}) {
    try {
      ddp::detail::nccl_check(code, "ncclAllReduce", nullptr, {.rank = 3, .op = "all_reduce"});
      FAIL("expected an error");
    } catch (const ddp::error& e) {
      INFO(e.what());
      CHECK(e.code() == ddp::errc::nccl);
      CHECK(e.backend_code() == static_cast<int>(code));
      CHECK(e.context().rank == 3);
      CHECK(contains(e.what(), "ncclAllReduce failed"));
      CHECK(contains(e.what(), ncclGetErrorString(code)));
      CHECK(contains(e.what(), "/dev/shm") == (code == ncclSystemError));  // the container hint, only where it applies
    }
  }
}

TEST_CASE("cuda errors: failures become errc::cuda with the error's name and text") {
  CHECK_NOTHROW(ddp::detail::cuda_check(cudaSuccess, "cudaMalloc"));
  try {
    ddp::detail::cuda_check(cudaErrorMemoryAllocation, "cudaMalloc", {.rank = 1});
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::cuda);
    CHECK(e.backend_code() == static_cast<int>(cudaErrorMemoryAllocation));
    CHECK(contains(e.what(), "cudaMalloc failed"));
    CHECK(contains(e.what(), "cudaErrorMemoryAllocation"));
    CHECK(contains(e.what(), cudaGetErrorString(cudaErrorMemoryAllocation)));
  }
}

TEST_CASE("nccl staging: host memory is not device-addressable, an empty range needs nothing") {
  std::vector<float> host(16);
  CHECK_FALSE(ddp::detail::device_addressable(host.data()));
  CHECK(ddp::detail::device_addressable(nullptr));
}

TEST_CASE("nccl without a device: the backend and init_process_group(\"nccl\") fail at once with errc::cuda") {
  if (ddp::test::visible_devices() > 0) ddp::test::skip("a CUDA device is visible here; this case checks a machine without one");
  ddp::store::hash_store store;
  const auto start = std::chrono::steady_clock::now();
  try {
    ddp::nccl_backend backend(store, 0, 1);
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    INFO(e.what());
    CHECK(e.code() == ddp::errc::cuda);
    CHECK(contains(e.what(), "cudaGetDeviceCount"));
  }
  try {
    auto group = ddp::init_process_group("nccl", {.rank = 0, .world_size = 1});
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    INFO(e.what());
    CHECK(e.code() == ddp::errc::cuda);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

}  // namespace nccl_host_logic
