#include <ddp/core/error.hpp>

#include <catch2/catch.hpp>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_error {

TEST_CASE("error::what names rank, collective, sequence and cause") {
  const ddp::error e(ddp::errc::peer_lost, "peer rank 1 closed the connection",
                     {.rank = 0, .op = "all_reduce", .seq = 17, .detail = "float32 x 1024, sum"});
  CHECK(std::string(e.what()) == "ddp: rank 0: all_reduce #17 (float32 x 1024, sum): peer rank 1 closed the connection");
  CHECK(e.code() == ddp::errc::peer_lost);
  CHECK(e.rank() == 0);
  CHECK(e.op() == "all_reduce");
  CHECK(e.seq() == 17u);
  CHECK(e.message() == "peer rank 1 closed the connection");
}

TEST_CASE("error without context prints only the cause") {
  const ddp::error e(ddp::errc::config, "WORLD_SIZE='abc' is not an integer");
  CHECK(std::string(e.what()) == "ddp: WORLD_SIZE='abc' is not an integer");
  CHECK_FALSE(e.seq().has_value());
}

TEST_CASE("errc is a std::error_code enum with readable messages") {
  const std::error_code code = ddp::errc::timeout;
  CHECK(code.category().name() == std::string("ddp"));
  CHECK(code.message() == "timeout");
  CHECK(ddp::make_error_code(ddp::errc::mismatch).message() == "mismatch");
}

TEST_CASE("error derives from std::runtime_error") {
  try {
    throw ddp::error(ddp::errc::store, "server gone");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find("server gone") != std::string::npos);
  }
}

}  // namespace ddp_test_error
