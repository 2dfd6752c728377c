// The store contract: one set of checks run against hash_store, file_store and tcp_store, so
// the three agree on every operation's semantics (torch.distributed Store semantics, store.hpp).
// Expected values come from the contract itself (closed form), never from another store.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/file_store.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/store/tcp_store.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_hash_store {

using namespace std::chrono_literals;
using ddp::store::store;
using ddp::store::to_bytes;

namespace {

constexpr auto short_timeout = 300ms;

// Each fixture gives handles onto one fresh store; open() may be called again for a second
// handle (another client / another open of the file / the same object).
struct hash_fixture {
  std::shared_ptr<ddp::store::hash_store> s = std::make_shared<ddp::store::hash_store>();
  std::shared_ptr<store> open() {
    s->set_timeout(short_timeout);
    return s;
  }
};

struct file_fixture {
  static inline std::atomic<int> counter{0};
  std::string path = std::string(DDP_TEST_BINARY_DIR) + "/contract_store." + std::to_string(::getpid()) + "." +
                     std::to_string(counter++);
  file_fixture() { ::unlink(path.c_str()); }
  ~file_fixture() { ::unlink(path.c_str()); }
  std::shared_ptr<store> open() { return std::make_shared<ddp::store::file_store>(path, ddp::store::file_store::options{.timeout = short_timeout}); }
};

struct tcp_fixture {
  ddp::store::tcp_store_server server{{.port = 0, .token = std::string()}};
  std::shared_ptr<store> open() {
    return std::make_shared<ddp::store::tcp_store>(
        ddp::store::tcp_store::options{.port = server.port(), .timeout = short_timeout, .token = std::string()});
  }
};

std::string str(const std::vector<std::byte>& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

template <class F>
ddp::error expect_error(F&& f) {
  try {
    f();
  } catch (const ddp::error& e) {
    return e;
  }
  FAIL("expected a ddp::error");
  throw std::logic_error("unreachable");
}

}  // namespace

#define STORE_TYPES hash_fixture, file_fixture, tcp_fixture

TEMPLATE_TEST_CASE("store contract: set, get, overwrite, binary and empty values", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  s->set_string("a", "1");
  CHECK(s->get_string("a") == "1");
  s->set_string("a", "overwritten");
  CHECK(s->get_string("a") == "overwritten");
  s->set_string("empty", "");
  CHECK(s->get("empty").empty());
  std::vector<std::byte> binary;
  for (int i = 0; i < 256; ++i) binary.push_back(static_cast<std::byte>(i));
  s->set("binary", binary);
  CHECK(s->get("binary") == binary);
  // A second handle sees the same data.
  auto t = fx.open();
  CHECK(t->get_string("a") == "overwritten");
  CHECK(t->get("binary") == binary);
  CHECK(t->num_keys() == 3);
}

TEMPLATE_TEST_CASE("store contract: add counts from a missing key, goes negative, refuses non-integers", "[store]",
                   STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  CHECK(s->add("c", 5) == 5);  // missing key counts as 0
  CHECK(s->add("c", -12) == -7);
  CHECK(s->add("c", 0) == -7);
  CHECK(s->get_string("c") == "-7");  // stored as decimal text, like torch
  s->set_string("n", "40");
  CHECK(s->add("n", 2) == 42);
  CHECK(s->add("big", 9'000'000'000'000'000'000) == 9'000'000'000'000'000'000);
  s->set_string("text", "hello");
  const auto e = expect_error([&] { s->add("text", 1); });
  CHECK(e.code() == ddp::errc::invalid_argument);
  CHECK_THAT(e.what(), Catch::Contains("'text'") && Catch::Contains("integer"));
  CHECK(s->get_string("text") == "hello");  // unchanged
}

TEMPLATE_TEST_CASE("store contract: add wraps at the int64 limits, the same in every store", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  constexpr auto max = std::numeric_limits<std::int64_t>::max(), min = std::numeric_limits<std::int64_t>::min();
  CHECK(s->add("c", max) == max);
  CHECK(s->add("c", 1) == min);  // two's complement: max + 1 == min
  CHECK(s->get_string("c") == std::to_string(min));
  CHECK(s->add("c", -1) == max);
}

TEMPLATE_TEST_CASE("store contract: compare_set corner cases", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  const auto none = std::vector<std::byte>{};
  // Missing key, empty expected: the key is created.
  CHECK(str(s->compare_set("k", none, to_bytes("first"))) == "first");
  CHECK(s->get_string("k") == "first");
  // Missing key, non-empty expected: nothing is created; the expected value comes back.
  CHECK(str(s->compare_set("missing", to_bytes("x"), to_bytes("y"))) == "x");
  CHECK(s->num_keys() == 1);
  // Matching expected: swapped.
  CHECK(str(s->compare_set("k", to_bytes("first"), to_bytes("second"))) == "second");
  // Mismatch: unchanged, the current value comes back.
  CHECK(str(s->compare_set("k", to_bytes("first"), to_bytes("third"))) == "second");
  CHECK(s->get_string("k") == "second");
  // Prefix is not a match.
  CHECK(str(s->compare_set("k", to_bytes("sec"), to_bytes("third"))) == "second");
  // Existing empty value matches an empty expected.
  s->set_string("e", "");
  CHECK(str(s->compare_set("e", none, to_bytes("filled"))) == "filled");
  // Swap to empty.
  CHECK(s->compare_set("e", to_bytes("filled"), none).empty());
  CHECK(s->get("e").empty());
  CHECK(s->num_keys() == 2);
}

TEMPLATE_TEST_CASE("store contract: wait returns for present keys and times out naming only the missing ones",
                   "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  s->set_string("here1", "x");
  s->set_string("here2", "y");
  s->wait({"here1", "here2"}, 100ms);
  s->wait({});
  const auto start = std::chrono::steady_clock::now();
  const auto e = expect_error([&] { s->wait({"here1", "gone1", "gone2"}, 250ms); });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(e.code() == ddp::errc::timeout);
  CHECK(e.op() == "store.wait");
  CHECK_THAT(e.what(), Catch::Contains("'gone1', 'gone2'") && Catch::Contains("250 ms") && !Catch::Contains("here1"));
  CHECK(elapsed >= 250ms);
  CHECK(elapsed < 250ms + 400ms);
  // The default timeout is the store's.
  const auto start2 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(s->wait({"gone3"}), ddp::error);
  CHECK(std::chrono::steady_clock::now() - start2 >= short_timeout);
}

TEMPLATE_TEST_CASE("store contract: get of a missing key is errc::timeout after timeout()", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  const auto start = std::chrono::steady_clock::now();
  const auto e = expect_error([&] { s->get("absent"); });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(e.code() == ddp::errc::timeout);
  CHECK(e.op() == "store.get");
  CHECK_THAT(e.what(), Catch::Contains("'absent'"));
  CHECK(elapsed >= short_timeout);
  CHECK(elapsed < short_timeout + 400ms);
  // The store is still usable afterwards.
  s->set_string("absent", "now here");
  CHECK(s->get_string("absent") == "now here");
  // An unbounded timeout is valid (no overflow in deadline arithmetic).
  s->set_timeout(std::chrono::milliseconds::max());
  CHECK(s->get_string("absent") == "now here");
  s->wait({"absent"}, std::chrono::milliseconds::max());
}

TEMPLATE_TEST_CASE("store contract: a blocked get is released by a set through another handle", "[store]", STORE_TYPES) {
  TestType fx;
  auto reader = fx.open();
  auto writer = fx.open();
  reader->set_timeout(10s);
  std::string got, failure;
  std::thread t([&] {
    try {
      got = reader->get_string("later");
      reader->wait({"later", "later2"}, 10s);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  writer->set_string("later", "value");
  writer->add("later2", 1);
  t.join();
  CHECK(failure.empty());
  CHECK(got == "value");
}

TEMPLATE_TEST_CASE("store contract: erase and num_keys", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  CHECK(s->num_keys() == 0);
  CHECK_FALSE(s->erase("nothing"));
  s->set_string("a", "1");
  s->add("b", 1);
  s->compare_set("c", {}, to_bytes("3"));
  CHECK(s->num_keys() == 3);
  CHECK(s->erase("b"));
  CHECK_FALSE(s->erase("b"));
  CHECK(s->num_keys() == 2);
  CHECK(s->add("b", 1) == 1);  // an erased counter starts over
  s->erase("a");
  CHECK(expect_error([&] { s->get("a"); }).code() == ddp::errc::timeout);
  CHECK(s->num_keys() == 2);
}

TEMPLATE_TEST_CASE("store contract: key and value limits are errc::invalid_argument", "[store]", STORE_TYPES) {
  TestType fx;
  auto s = fx.open();
  const std::string longest(ddp::store::max_key_bytes, 'k');
  s->set_string(longest, "ok");
  CHECK(s->get_string(longest) == "ok");
  const std::string too_long(ddp::store::max_key_bytes + 1, 'k');
  auto e = expect_error([&] { s->set_string(too_long, "x"); });
  CHECK(e.code() == ddp::errc::invalid_argument);
  CHECK_THAT(e.what(), Catch::Contains("4097 bytes") && Catch::Contains("4096"));
  CHECK(expect_error([&] { s->get(too_long); }).code() == ddp::errc::invalid_argument);
  CHECK(expect_error([&] { s->add(too_long, 1); }).code() == ddp::errc::invalid_argument);
  CHECK(expect_error([&] { s->set_string("", "x"); }).code() == ddp::errc::invalid_argument);
  const std::vector<std::byte> huge(ddp::store::max_value_bytes + 1);
  e = expect_error([&] { s->set("huge", huge); });
  CHECK(e.code() == ddp::errc::invalid_argument);
  CHECK_THAT(e.what(), Catch::Contains("67108865 bytes"));
  CHECK(expect_error([&] { s->compare_set("huge", {}, huge); }).code() == ddp::errc::invalid_argument);
  CHECK(s->num_keys() == 1);
}

TEMPLATE_TEST_CASE("store contract: concurrent adds from threads lose nothing", "[store]", STORE_TYPES) {
  TestType fx;
  constexpr int threads = 4, per_thread = 250;
  std::vector<std::shared_ptr<store>> handles;
  for (int i = 0; i < threads; ++i) handles.push_back(fx.open());
  std::vector<std::thread> pool;
  std::atomic<int> non_increasing{0};
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&, i] {
      std::int64_t last = 0;
      for (int j = 0; j < per_thread; ++j) {
        const auto v = handles[static_cast<std::size_t>(i)]->add("n", 1);
        if (v <= last) ++non_increasing;
        last = v;
      }
    });
  for (auto& t : pool) t.join();
  CHECK(non_increasing == 0);
  CHECK(handles[0]->add("n", 0) == threads * per_thread);
}

TEST_CASE("hash_store: models key_value_store and is shared by reference") {
  static_assert(ddp::key_value_store<ddp::store::hash_store>);
  static_assert(ddp::key_value_store<ddp::store::file_store>);
  static_assert(ddp::key_value_store<ddp::store::tcp_store>);
  ddp::store::hash_store s;
  s.set_timeout(50ms);
  store& base = s;
  base.set_string("k", "v");
  CHECK(s.get_string("k") == "v");
  CHECK(s.timeout() == 50ms);
}

TEST_CASE("wait_for_ranks names the ranks whose keys are missing at the timeout") {
  ddp::store::hash_store st;
  auto key = [](int r) { return "hb/" + std::to_string(r); };
  for (int r : {0, 1, 3}) st.set_string(key(r), "x");
  ddp::store::wait_for_ranks(st, 4, 2, key, std::chrono::milliseconds(50), "their address");  // all but its own: no throw
  try {
    ddp::store::wait_for_ranks(st, 6, 1, key, std::chrono::milliseconds(50), "their address");
    FAIL("no timeout");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::timeout);
    CHECK(e.context().rank == 1);
    CHECK(e.message() == "ranks 2, 4, 5 did not publish their address within 50 ms: exited, hung, or never started?");
  }
}

}  // namespace ddp_test_hash_store
