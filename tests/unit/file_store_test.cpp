// file_store: cross-process atomicity, crash recovery, fork safety, descriptor hygiene.
// (The operation semantics shared by every store are checked in hash_store_test.cpp.)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>

#include "ddp/store/file_store.hpp"
#include "support/leaks.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_file_store {

using ddp::test::open_fds;
using namespace std::chrono_literals;
using ddp::store::file_store;

namespace {

// A fresh path under the build tree, removed at scope exit.
struct temp_path {
  std::string path;
  explicit temp_path(const std::string& name)
      : path(std::string(DDP_TEST_BINARY_DIR) + "/" + name + "." + std::to_string(::getpid())) {
    ::unlink(path.c_str());
  }
  ~temp_path() { ::unlink(path.c_str()); }
};

std::string file_text(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

}  // namespace

TEST_CASE("file_store: add from 8 processes is atomic (total is exact)") {
  temp_path tmp("fs_add");
  constexpr int ranks = 8, per_rank = 300;
  const auto r = ddp::test::run_ranks(
      ranks,
      [&](int rank) {
        file_store s(tmp.path, {.timeout = 30s});
        std::int64_t last = 0;
        for (int i = 0; i < per_rank; ++i) {
          const auto v = s.add("counter", 1);
          ddp::test::check(v > last, "add results must increase within one process");
          last = v;
          // Per-rank keys: exact values.
          s.set_string("r" + std::to_string(rank), std::to_string(i));
          ddp::test::check(s.get_string("r" + std::to_string(rank)) == std::to_string(i), "own key reads back");
        }
      },
      120s);
  INFO(r.describe());
  REQUIRE(r.ok());
  file_store s(tmp.path, {.timeout = 1s});
  CHECK(s.add("counter", 0) == ranks * per_rank);
  CHECK(s.num_keys() == ranks + 1);
  for (int rank = 0; rank < ranks; ++rank) CHECK(s.get_string("r" + std::to_string(rank)) == std::to_string(per_rank - 1));
}

TEST_CASE("file_store: compare_set elects exactly one winner across processes") {
  temp_path tmp("fs_cas");
  constexpr int ranks = 8;
  const auto r = ddp::test::run_ranks(ranks, [&](int rank) {
    file_store s(tmp.path, {.timeout = 30s});
    const std::string me = "rank" + std::to_string(rank);
    const auto now = s.compare_set("leader", {}, ddp::store::to_bytes(me));
    const std::string winner(reinterpret_cast<const char*>(now.data()), now.size());
    // Everyone must see the same winner; the winner's claim is what is stored.
    s.add(winner == me ? "won" : "lost", 1);
    s.wait({"leader"}, 5s);
    ddp::test::check(s.get_string("leader") == winner, "leader is stable");
  });
  INFO(r.describe());
  REQUIRE(r.ok());
  file_store s(tmp.path, {.timeout = 1s});
  CHECK(s.add("won", 0) == 1);
  CHECK(s.add("lost", 0) == ranks - 1);
}

TEST_CASE("file_store: a get() in one process is answered by a set() in another") {
  temp_path tmp("fs_wait");
  const auto r = ddp::test::run_ranks(2, [&](int rank) {
    file_store s(tmp.path, {.timeout = 20s});
    if (rank == 0) {
      s.set_string("ping", "1");
      ddp::test::check(s.get_string("pong") == "2", "rank 0 sees pong");
    } else {
      ddp::test::check(s.get_string("ping") == "1", "rank 1 sees ping");
      s.set_string("pong", "2");
    }
  }, 60s);
  INFO(r.describe());
  REQUIRE(r.ok());
}

TEST_CASE("file_store: a truncated tail (writer died mid-record) is ignored, then cut off") {
  temp_path tmp("fs_tail");
  {
    file_store s(tmp.path);
    s.set_string("good", "value");
  }
  const auto good_size = file_text(tmp.path).size();
  {  // half a record, as a writer killed mid-pwrite leaves it
    const int fd = ::open(tmp.path.c_str(), O_WRONLY | O_APPEND);
    REQUIRE(fd >= 0);
    const unsigned char partial[] = {1, 4, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 'l', 'o'};
    REQUIRE(::write(fd, partial, sizeof partial) == static_cast<ssize_t>(sizeof partial));
    ::close(fd);
  }
  file_store s(tmp.path, {.timeout = 100ms});
  CHECK(s.get_string("good") == "value");
  CHECK(s.num_keys() == 1);
  s.set_string("next", "x");
  // Header 13 bytes + "next" + "x": appended right after the last good record.
  CHECK(file_text(tmp.path).size() == good_size + 13 + 4 + 1);
  file_store fresh(tmp.path, {.timeout = 100ms});
  CHECK(fresh.get_string("next") == "x");
  CHECK(fresh.num_keys() == 2);
}

TEST_CASE("file_store: a corrupt file is a clear errc::store naming the path") {
  temp_path tmp("fs_corrupt");
  {
    FILE* f = std::fopen(tmp.path.c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fputs("this is not a store log, just some text that is long enough", f);
    std::fclose(f);
  }
  file_store s(tmp.path, {.timeout = 100ms});
  try {
    s.num_keys();
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::store);
    CHECK_THAT(e.what(), Catch::Contains(tmp.path) && Catch::Contains("corrupt"));
  }
}

TEST_CASE("file_store: an unopenable path is errc::config naming it") {
  try {
    file_store s("/nonexistent-dir-for-ddp/store");
    FAIL("expected an error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("/nonexistent-dir-for-ddp/store") && Catch::Contains("No such file"));
  }
}

TEST_CASE("file_store: an object created before fork() still locks correctly in the children") {
  temp_path tmp("fs_fork");
  file_store shared(tmp.path, {.timeout = 30s});
  shared.set_string("counter", "0");
  constexpr int ranks = 4, per_rank = 200;
  const auto r = ddp::test::run_ranks(ranks, [&](int) {
    for (int i = 0; i < per_rank; ++i) shared.add("counter", 1);
  }, 120s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(shared.add("counter", 0) == ranks * per_rank);
}

TEST_CASE("file_store: no file descriptor leaks, and remove_on_destroy unlinks the file") {
  temp_path tmp("fs_fds");
  const int before = open_fds();
  for (int i = 0; i < 20; ++i) {
    file_store s(tmp.path, {.timeout = 100ms, .remove_on_destroy = true});
    s.set_string("k", "v");
    CHECK(s.get_string("k") == "v");
    CHECK_THROWS(s.get_string("missing"));
  }
  CHECK(open_fds() == before);
  struct stat st {};
  CHECK(::stat(tmp.path.c_str(), &st) != 0);
}

}  // namespace ddp_test_file_store
