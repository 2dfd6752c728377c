// tcp_store: hashing and framing units, then a live server under hostile, slow and dying peers.
// (The operation semantics shared by every store are checked in hash_store_test.cpp.)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"
#include "ddp/store/tcp_store.hpp"
#include "support/leaks.hpp"
#include "support/log_capture.hpp"
#include "support/loopback_listener.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_tcp_store {

using ddp::test::open_fds;
using namespace std::chrono_literals;
namespace ds = ddp::store::detail;
using ddp::store::tcp_store;
using ddp::store::tcp_store_server;

namespace {

std::string hex(std::span<const std::byte> d) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (auto b : d) {
    s += digits[std::to_integer<unsigned>(b) >> 4];
    s += digits[std::to_integer<unsigned>(b) & 15];
  }
  return s;
}

std::vector<std::byte> unhex(std::string_view h) {
  std::vector<std::byte> out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<std::byte>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  return out;
}

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// A client hello with a fixed nonce (the server's side does not depend on it being random).
std::vector<std::byte> client_hello(std::uint16_t version = ds::protocol_version) {
  ds::nonce n{};
  n[0] = std::byte{42};
  return ds::encode_client_hello(n, version);
}

// A client's proof message without a token: zeros, and its job.
std::vector<std::byte> zero_proof(std::string_view job = {}) {
  const ds::digest zeros{};
  return ds::encode_client_proof(zeros, job);
}

using ddp::test::log_capture;

tcp_store::options client_of(const tcp_store_server& s, std::chrono::milliseconds timeout = 10s) {
  return {.host = "127.0.0.1", .port = s.port(), .timeout = timeout, .token = std::string()};
}

// A raw TCP peer of the server, for sending what no well-behaved client would.
struct raw_peer {
  ds::unique_fd fd;
  explicit raw_peer(std::uint16_t port) : fd(ds::connect_with_retry("127.0.0.1", port, ddp::deadline::after(5s))) {}

  bool send(std::span<const std::byte> data) {
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::send(fd.get(), data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
          if (ds::poll_one(fd.get(), POLLOUT, ddp::deadline::after(5s)) == 0) return false;
          continue;
        }
        return false;  // the server closed on us
      }
      done += static_cast<std::size_t>(n);
    }
    return true;
  }
  bool send(const std::vector<std::byte>& data) { return send(std::span<const std::byte>(data)); }

  /// Reads exactly n bytes, or fewer at EOF/deadline.
  std::vector<std::byte> read(std::size_t n, std::chrono::milliseconds within = 5s) {
    std::vector<std::byte> out;
    const auto until = ddp::deadline::after(within);
    std::byte buf[4096];
    while (out.size() < n) {
      if (ds::poll_one(fd.get(), POLLIN, until) == 0) break;
      const ssize_t got = ::recv(fd.get(), buf, std::min(sizeof buf, n - out.size()), MSG_DONTWAIT);
      if (got == 0) break;
      if (got < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        break;
      }
      out.insert(out.end(), buf, buf + got);
    }
    return out;
  }

  /// True when the server closes the connection within the time (bytes before EOF are discarded).
  bool closed_by_server(std::chrono::milliseconds within = 5s) {
    const auto until = ddp::deadline::after(within);
    std::byte buf[4096];
    while (true) {
      if (ds::poll_one(fd.get(), POLLIN, until) == 0) return false;
      const ssize_t got = ::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (got == 0) return true;
      if (got < 0 && errno != EAGAIN && errno != EINTR) return true;  // reset
    }
  }

  /// Hello + an all-zero proof (fine when the server has no token); true when accepted.
  bool handshake() {
    if (!send(client_hello())) return false;
    const auto hello = read(ds::server_hello_bytes);
    if (hello.size() != ds::server_hello_bytes) return false;
    if (!send(zero_proof())) return false;
    const auto verdict = read(1);
    return verdict.size() == 1 && verdict[0] == std::byte{1};
  }
};

// Reads a response frame from a raw peer.
std::pair<int, std::vector<std::byte>> read_response(raw_peer& p) {
  const auto h = p.read(ds::response_header_bytes);
  if (h.size() != ds::response_header_bytes) return {-1, {}};
  const auto len = ds::get_le<std::uint32_t>(h.data() + 1);
  return {std::to_integer<int>(h[0]), p.read(len)};
}

// The good client's view must stay correct after each abuse.
void check_still_serves(tcp_store& good, int round) {
  const std::string key = "good/" + std::to_string(round);
  good.set_string(key, "v" + std::to_string(round));
  CHECK(good.get_string(key) == "v" + std::to_string(round));
  CHECK(good.add("good/counter", 1) == round + 1);
}

}  // namespace

// ---- units -------------------------------------------------------------------------------

TEST_CASE("sha256 matches the FIPS 180-2 test vectors") {
  CHECK(hex(ds::sha256_of(bytes(""))) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(ds::sha256_of(bytes("abc"))) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(ds::sha256_of(bytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  ds::sha256 h;  // one million 'a', fed in uneven pieces to exercise the block buffering
  const std::string piece(997, 'a');
  std::size_t left = 1000000;
  while (left > 0) {
    const auto n = std::min(left, piece.size());
    h.update(std::string_view(piece.data(), n));
    left -= n;
  }
  CHECK(hex(h.finish()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("hmac_sha256 matches the RFC 4231 test vectors") {
  const auto k1 = std::vector<std::byte>(20, std::byte{0x0b});
  CHECK(hex(ds::hmac_sha256(k1, bytes("Hi There"))) == "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hex(ds::hmac_sha256(bytes("Jefe"), bytes("what do ya want for nothing?"))) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const auto k3 = std::vector<std::byte>(20, std::byte{0xaa});
  const auto m3 = std::vector<std::byte>(50, std::byte{0xdd});
  CHECK(hex(ds::hmac_sha256(k3, m3)) == "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  const auto k4 = unhex("0102030405060708090a0b0c0d0e0f10111213141516171819");
  const auto m4 = std::vector<std::byte>(50, std::byte{0xcd});
  CHECK(hex(ds::hmac_sha256(k4, m4)) == "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  const auto k6 = std::vector<std::byte>(131, std::byte{0xaa});  // a key longer than the block is hashed first
  CHECK(hex(ds::hmac_sha256(k6, bytes("Test Using Larger Than Block-Size Key - Hash Key First"))) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(hex(ds::hmac_sha256(k6, bytes("This is a test using a larger than block-size key and a larger than block-size "
                                      "data. The key needs to be hashed before being used by the HMAC algorithm."))) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
  CHECK(ds::constant_time_equal(k1, k1));
  CHECK_FALSE(ds::constant_time_equal(k1, k3));
  CHECK_FALSE(ds::constant_time_equal(k1, k4));
}

TEST_CASE("frame parser: every encoder round-trips, and every strict prefix needs more") {
  const std::vector<std::byte> v = ddp::store::to_bytes("value");
  const std::vector<std::vector<std::byte>> frames = {
      ds::encode_request(ds::opcode::set, "k", v),  ds::encode_get("key", 1234), ds::encode_add("ctr", -7),
      ds::encode_compare_set("k", ddp::store::to_bytes("old"), v), ds::encode_wait({"a", "bb"}, 99),
      ds::encode_request(ds::opcode::erase, "k", {}), ds::encode_request(ds::opcode::num_keys, {}, {})};
  for (const auto& f : frames) {
    for (std::size_t n = 0; n < f.size(); ++n) {
      const auto r = ds::parse_request(std::span(f).first(n));
      INFO("prefix " << n << " of " << f.size());
      REQUIRE(r.status == ds::parse_status::need_more);
    }
    auto twice = f;
    twice.insert(twice.end(), f.begin(), f.end());
    const auto r = ds::parse_request(twice);
    REQUIRE(r.status == ds::parse_status::complete);
    CHECK(r.consumed == f.size());
  }
  auto r = ds::parse_request(frames[1]);
  CHECK((r.req.op == ds::opcode::get && r.req.key == "key" && r.req.timeout_ms == 1234));
  r = ds::parse_request(frames[2]);
  CHECK((r.req.op == ds::opcode::add && r.req.delta == -7));
  r = ds::parse_request(frames[3]);
  CHECK((r.req.expected == ddp::store::to_bytes("old") && r.req.value == v));
  r = ds::parse_request(frames[4]);
  CHECK((r.req.keys == std::vector<std::string>{"a", "bb"} && r.req.timeout_ms == 99));
}

TEST_CASE("frame parser: oversized, unknown and inconsistent headers are refused before their payload") {
  auto header = [](std::uint8_t op, std::uint32_t klen, std::uint32_t vlen) {
    std::vector<std::byte> h;
    ds::put_le(h, op);
    ds::put_le(h, klen);
    ds::put_le(h, vlen);
    return h;
  };
  auto verdict = [](const std::vector<std::byte>& f) { return ds::parse_request(f); };
  CHECK(verdict(header(0, 1, 0)).status == ds::parse_status::invalid);
  CHECK(verdict(header(99, 1, 0)).status == ds::parse_status::invalid);
  // Only the 9 header bytes are present: the verdict must not wait for the payload.
  CHECK(verdict(header(1, ddp::store::max_key_bytes + 1, 0)).status == ds::parse_status::invalid);
  CHECK(verdict(header(1, 0, 0)).status == ds::parse_status::invalid);
  CHECK(verdict(header(1, 1, ddp::store::max_value_bytes + 1)).status == ds::parse_status::invalid);
  CHECK(verdict(header(1, 1, ddp::store::max_value_bytes)).status == ds::parse_status::need_more);
  CHECK(verdict(header(2, 3, 7)).status == ds::parse_status::invalid);             // get needs an 8-byte timeout
  CHECK(verdict(header(5, 2, 12)).status == ds::parse_status::invalid);            // wait takes no key
  CHECK(verdict(header(7, 0, 1)).status == ds::parse_status::invalid);             // num_keys takes nothing
  CHECK(verdict(header(4, 1, 0xffffffffu)).status == ds::parse_status::invalid);   // compare_set too large
  // compare_set whose expected length overruns the frame.
  auto cas = header(4, 1, 6);
  cas.push_back(std::byte{'k'});
  ds::put_le(cas, std::uint32_t{100});
  cas.push_back(std::byte{'x'});
  cas.push_back(std::byte{'y'});
  CHECK(verdict(cas).status == ds::parse_status::invalid);
  // wait whose key list lies about its count.
  std::vector<std::byte> list;
  ds::put_le(list, std::uint64_t{10});
  ds::put_le(list, std::uint32_t{1000000});
  ds::put_le(list, std::uint32_t{1});
  list.push_back(std::byte{'a'});
  CHECK(ds::parse_request(ds::encode_request(ds::opcode::wait, {}, list)).status == ds::parse_status::invalid);
  const auto r = ds::parse_request(header(1, ddp::store::max_key_bytes + 1, 0));
  CHECK_THAT(r.reason, Catch::Contains("key of 4097 bytes"));
}

// ---- the live server ----------------------------------------------------------------------

TEST_CASE("tcp_store: port 0 picks a free port, and a second server on it is errc::config naming addr:port") {
  tcp_store_server first({.port = 0, .token = std::string()});
  REQUIRE(first.port() != 0);
  try {
    tcp_store_server second({.port = first.port(), .token = std::string()});
    FAIL("a second server bound the same port");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    const std::string where = "127.0.0.1:" + std::to_string(first.port());
    CHECK_THAT(e.what(), Catch::Contains(where + " is already in use") && Catch::Contains("Address already in use"));
  }
  // The first one still works.
  tcp_store c(client_of(first));
  c.set_string("k", "v");
  CHECK(c.get_string("k") == "v");
}

TEST_CASE("tcp_store: is_server runs the server in-process and port() reports the chosen port") {
  tcp_store s({.port = 0, .is_server = true, .timeout = 5s});  // the default token, as make_tcp_store's
  REQUIRE(s.port() != 0);
  REQUIRE(s.owned_server() != nullptr);
  CHECK(s.owned_server()->port() == s.port());
  auto other = ddp::store::make_tcp_store("127.0.0.1", s.port(), false, 5s);
  s.set_string("from", "server-side client");
  CHECK(other->get_string("from") == "server-side client");
}

TEST_CASE("tcp_store: listening on all interfaces needs a token") {
  try {
    tcp_store_server s({.host = "0.0.0.0", .port = 0, .token = std::string()});
    FAIL("bound 0.0.0.0 without a token");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("0.0.0.0") && Catch::Contains("DDP_STORE_TOKEN"));
  }
  tcp_store_server s({.host = "0.0.0.0", .port = 0, .token = std::string("job-secret-1")});
  tcp_store c({.port = s.port(), .timeout = 5s, .token = std::string("job-secret-1")});
  c.set_string("k", "v");
  CHECK(c.get_string("k") == "v");
}

TEST_CASE("tcp_store: a client started before its server connects once the server is up") {
  std::uint16_t port = 0;
  {
    tcp_store_server probe({.port = 0, .token = std::string()});
    port = probe.port();
  }
  std::atomic<bool> done{false};
  std::string result, failure;
  std::thread client([&] {
    try {
      tcp_store c({.port = port, .timeout = 20s, .token = std::string()});
      result = c.get_string("hello");
    } catch (const std::exception& e) {
      failure = e.what();
    }
    done = true;
  });
  ::poll(nullptr, 0, 300);  // let the client fail a few connection attempts first
  CHECK_FALSE(done.load());
  tcp_store_server late({.port = port, .token = std::string()});
  tcp_store setter(client_of(late));
  setter.set_string("hello", "world");
  client.join();
  CHECK(failure.empty());
  CHECK(result == "world");
}

TEST_CASE("tcp_store: no server at all is errc::timeout at the connect deadline, naming addr:port") {
  std::uint16_t port = 0;
  {
    tcp_store_server probe({.port = 0, .token = std::string()});
    port = probe.port();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    tcp_store c({.port = port, .timeout = 400ms, .token = std::string()});
    FAIL("connected to nothing");
  } catch (const ddp::error& e) {
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(e.code() == ddp::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + std::to_string(port)) && Catch::Contains("MASTER_ADDR"));
    CHECK(elapsed >= 400ms);
    CHECK(elapsed < 2s);
  }
}

TEST_CASE("tcp_store: a parked get() is answered by another client's set(), without polling") {
  tcp_store_server server({.port = 0, .token = std::string()});
  tcp_store waiter(client_of(server));
  tcp_store setter(client_of(server));
  std::string got, failure;
  std::thread t([&] {
    try {
      got = waiter.get_string("late");
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  ::poll(nullptr, 0, 100);  // the get is parked server side meanwhile (not required for correctness)
  setter.set_string("late", "arrived");
  t.join();
  CHECK(failure.empty());
  CHECK(got == "arrived");
}

TEST_CASE("tcp_store: a stopped server is errc::store at once on its clients") {
  auto server = std::make_unique<tcp_store_server>(tcp_store_server::options{.port = 0, .token = std::string()});
  const auto port = server->port();
  tcp_store c(client_of(*server, 30s));
  c.set_string("k", "v");
  std::string failure;
  ddp::errc code{};
  std::chrono::steady_clock::duration elapsed{};
  std::thread t([&] {
    const auto start = std::chrono::steady_clock::now();
    try {
      c.get("never-set");
    } catch (const ddp::error& e) {
      failure = e.what();
      code = e.code();
    }
    elapsed = std::chrono::steady_clock::now() - start;
  });
  ::poll(nullptr, 0, 100);
  server.reset();
  t.join();
  CHECK(code == ddp::errc::store);
  CHECK_THAT(failure, Catch::Contains("store server 127.0.0.1:" + std::to_string(port) + " closed the connection"));
  CHECK(elapsed < 2s);
  // Later calls fail at once too, with the original reason.
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(c.set_string("k", "v"), ddp::error);
  CHECK(std::chrono::steady_clock::now() - start < 100ms);
}

TEST_CASE("tcp_store: with hosted_by, a lost server names the process that hosted it first") {
  auto server = std::make_unique<tcp_store_server>(tcp_store_server::options{.port = 0, .token = std::string()});
  const auto port = server->port();
  auto o = client_of(*server, 30s);
  o.hosted_by = "rank 0";
  tcp_store c(o);
  c.set_string("k", "v");
  server.reset();
  std::string first, later;
  try {
    c.get("never-set");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::store);
    first = e.message();
  }
  try {
    c.set_string("k", "v");
  } catch (const ddp::error& e) {
    later = e.message();
  }
  CHECK(first.find("the store server at 127.0.0.1:" + std::to_string(port) + " (hosted by rank 0) closed the connection") == 0);
  CHECK_THAT(first, Catch::EndsWith(": rank 0 exited?"));
  CHECK_THAT(later, Catch::Contains("(hosted by rank 0) closed the connection"));
}

TEST_CASE("tcp_store: server process killed while clients wait in get(): errc::store in well under 2 s") {
  std::uint16_t port = 0;
  {
    tcp_store_server probe({.port = 0, .token = std::string()});
    port = probe.port();
  }
  constexpr int clients = 3;
  const auto r = ddp::test::run_ranks(
      clients + 1,
      [&](int rank) {
        if (rank == 0) {
          tcp_store s({.port = port, .is_server = true, .timeout = 30s, .token = std::string()});
          std::vector<std::string> arrived;
          for (int i = 1; i <= clients; ++i) arrived.push_back("arrived/" + std::to_string(i));
          s.wait(arrived);
          ::poll(nullptr, 0, 200);  // the clients are now parked in get()
          ::raise(SIGKILL);
        }
        tcp_store c({.port = port, .timeout = 30s, .token = std::string()});
        c.set_string("arrived/" + std::to_string(rank), "1");
        const auto start = std::chrono::steady_clock::now();
        try {
          c.get("never-set");
          ddp::test::check(false, "get returned a value nobody set");
        } catch (const ddp::error& e) {
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
          std::printf("noticed after %lld ms: %s\n", static_cast<long long>(ms.count()), e.what());
          ddp::test::check(e.code() == ddp::errc::store, std::string("code store, got: ") + e.what());
          ddp::test::check(std::string(e.what()).find("closed the connection") != std::string::npos, e.what());
          ddp::test::check(ms < 2s, "noticed within 2 s");
        }
      },
      60s);
  INFO(r.describe());
  CHECK(r.ranks[0].signal == SIGKILL);
  for (int i = 1; i <= clients; ++i) CHECK(r.ranks[static_cast<std::size_t>(i)].ok());
}

TEST_CASE("tcp_store: a member killed without leaving is named at once to every parked and every later wait") {
  std::uint16_t port = 0;
  {
    tcp_store_server probe({.port = 0, .token = std::string()});
    port = probe.port();
  }
  constexpr int ranks = 4;
  constexpr int victim = 3;
  const auto r = ddp::test::run_ranks(
      ranks,
      [&](int rank) {
        tcp_store s({.port = port, .is_server = rank == 0, .timeout = 30s, .token = std::string(), .member = "rank " + std::to_string(rank)});
        s.set_string("arrived/" + std::to_string(rank), "1");
        if (rank == victim) {
          std::vector<std::string> others;
          for (int i = 0; i < ranks; ++i)
            if (i != victim) others.push_back("arrived/" + std::to_string(i));
          s.wait(others);  // everyone is connected and about to wait on a key only the victim would set
          ::raise(SIGKILL);
        }
        const auto start = std::chrono::steady_clock::now();
        for (int round = 0; round < 2; ++round) {  // the parked wait, then one made after the death
          try {
            s.wait({"never-set"}, 20s);
            ddp::test::check(false, "a wait on a key nobody sets returned");
          } catch (const ddp::error& e) {
            ddp::test::check(e.code() == ddp::errc::peer_lost, std::string("code peer_lost, got: ") + e.what());
            ddp::test::check(e.message().find("rank 3 left the job") == 0, e.what());
          }
        }
        const auto ms = std::chrono::steady_clock::now() - start;
        ddp::test::check(ms < 2s, "the death was heard within 2 s, not at the 20 s deadline");
        if (rank == 0) s.set_string("survivors/done", "1");  // keys can still be written and read
      },
      60s);
  INFO(r.describe());
  CHECK(r.ranks[static_cast<std::size_t>(victim)].signal == SIGKILL);
  for (int i = 0; i < ranks; ++i)
    if (i != victim) CHECK(r.ranks[static_cast<std::size_t>(i)].ok());
}

TEST_CASE("tcp_store: a member that leaves (its store destroyed) is no departure, nor is an anonymous client's close") {
  tcp_store_server server({.port = 0, .token = std::string()});
  auto member = client_of(server, 30s);
  member.member = "rank 1";
  tcp_store waiter(client_of(server, 30s));
  {
    tcp_store leaving(member);
    leaving.set_string("k", "v");
  }
  {
    tcp_store anonymous(client_of(server, 30s));
    anonymous.set_string("k2", "v");
  }
  try {
    waiter.wait({"never-set"}, 300ms);
    FAIL("a wait on a key nobody sets returned");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::timeout);
  }
}

TEST_CASE("tcp_store: a stopping server keeps serving members still connected, until they leave or the linger ends") {
  using clock = std::chrono::steady_clock;
  auto server = std::make_unique<tcp_store_server>(tcp_store_server::options{.port = 0, .token = std::string(), .linger = 3s});
  auto o = client_of(*server, 30s);
  o.member = "rank 1";
  auto member = std::make_unique<tcp_store>(o);
  std::atomic<bool> stopping{false};
  clock::duration stop_took{};
  std::thread stopper([&] {
    stopping = true;
    const auto t0 = clock::now();
    server.reset();
    stop_took = clock::now() - t0;
  });
  while (!stopping.load()) std::this_thread::yield();
  // Whether or not the stop has begun, the member is served.
  member->set_string("report", "rank 2 died");
  CHECK(member->get_string("report") == "rank 2 died");
  member.reset();  // leaves: the server stops now, not at the 3 s linger
  stopper.join();
  CHECK(stop_took < 2s);

  // A member that never leaves holds a stop only for the linger.
  auto server2 = std::make_unique<tcp_store_server>(tcp_store_server::options{.port = 0, .token = std::string(), .linger = 300ms});
  auto o2 = client_of(*server2, 30s);
  o2.member = "rank 1";
  tcp_store stays(o2);
  const auto t0 = clock::now();
  server2.reset();
  const auto took = clock::now() - t0;
  CHECK(took >= 250ms);
  CHECK(took < 2s);
}

TEST_CASE("tcp_store: malformed frames close only the offending connection, with a logged reason") {
  log_capture log;
  tcp_store_server server({.port = 0, .token = std::string(), .log = log.sink()});
  tcp_store good(client_of(server));
  int round = 0;
  check_still_serves(good, round++);

  {  // garbage instead of a hello
    raw_peer p(server.port());
    p.send(ddp::store::to_bytes("GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(p.closed_by_server());
    check_still_serves(good, round++);
  }
  {  // right magic, wrong version
    raw_peer p(server.port());
    p.send(client_hello(7));
    const auto notice = p.read(ds::version_notice_bytes);  // the server names its own version first
    REQUIRE(notice.size() == ds::version_notice_bytes);
    CHECK(ds::get_le<std::uint16_t>(notice.data() + 4) == ds::protocol_version);
    CHECK(p.closed_by_server());
    check_still_serves(good, round++);
  }
  {  // unknown opcode after a good handshake
    raw_peer p(server.port());
    REQUIRE(p.handshake());
    p.send(std::vector<std::byte>{std::byte{0xee}, std::byte{1}, std::byte{2}});
    CHECK(p.closed_by_server());
    check_still_serves(good, round++);
  }
  {  // a key length over the limit: refused from the header alone
    raw_peer p(server.port());
    REQUIRE(p.handshake());
    std::vector<std::byte> h;
    ds::put_le(h, std::uint8_t{1});
    ds::put_le(h, std::uint32_t{0xffffffffu});
    ds::put_le(h, std::uint32_t{0});
    p.send(h);
    CHECK(p.closed_by_server());
    check_still_serves(good, round++);
  }
  {  // a value length over 64 MiB, payload never sent
    raw_peer p(server.port());
    REQUIRE(p.handshake());
    std::vector<std::byte> h;
    ds::put_le(h, std::uint8_t{1});
    ds::put_le(h, std::uint32_t{1});
    ds::put_le(h, static_cast<std::uint32_t>(ddp::store::max_value_bytes + 1));
    h.push_back(std::byte{'k'});
    p.send(h);
    CHECK(p.closed_by_server());
    check_still_serves(good, round++);
  }
  {  // a truncated frame, then the peer hangs up: nothing is applied
    raw_peer p(server.port());
    REQUIRE(p.handshake());
    auto f = ds::encode_request(ds::opcode::set, "truncated", ddp::store::to_bytes("never stored"));
    f.resize(f.size() - 3);
    p.send(f);
  }
  check_still_serves(good, round++);
  good.set_timeout(200ms);
  CHECK_THROWS_AS(good.get("truncated"), ddp::error);
  good.set_timeout(10s);
  {  // a valid frame from a raw peer is answered correctly (the raw path itself is sound)
    raw_peer p(server.port());
    REQUIRE(p.handshake());
    p.send(ds::encode_request(ds::opcode::set, "raw", ddp::store::to_bytes("ok")));
    CHECK(read_response(p).first == 0);
    CHECK(good.get_string("raw") == "ok");
  }
  {  // random bytes from many peers, some after a handshake
    std::mt19937 rng(12345);
    for (int i = 0; i < 40; ++i) {
      raw_peer p(server.port());
      if (i % 2 == 1) REQUIRE(p.handshake());
      std::vector<std::byte> junk(1 + rng() % 300);
      for (auto& b : junk) b = static_cast<std::byte>(rng());
      p.send(junk);
      // Either the server refuses it, or it is waiting for more of a frame that looks plausible.
      (void)p.closed_by_server(50ms);
    }
    check_still_serves(good, round++);
  }
  CHECK(log.contains("bad magic"));
  CHECK(log.contains("protocol version 7"));
  CHECK(log.contains("unknown opcode 238"));
  CHECK(log.contains("key of 4294967295 bytes"));
  CHECK(log.contains("exceeds 67108864"));
  CHECK(log.contains("closing the connection from 127.0.0.1:"));
  INFO(log.all());
  CHECK(good.num_keys() == round + 1 + 1);  // good/0..N-1, good/counter, raw
}

TEST_CASE("tcp_store: a slow-loris peer (one byte per 50 ms) does not delay other clients") {
  log_capture log;
  tcp_store_server server({.port = 0, .token = std::string(), .log = log.sink()});
  tcp_store good(client_of(server));
  raw_peer loris(server.port());
  std::vector<std::byte> script = client_hello();
  const auto proof = zero_proof();  // no token on this server
  script.insert(script.end(), proof.begin(), proof.end());
  const auto request = ds::encode_request(ds::opcode::set, "loris", ddp::store::to_bytes("finally"));
  script.insert(script.end(), request.begin(), request.end());

  std::chrono::steady_clock::duration worst{};
  int ops = 0;
  for (std::size_t i = 0; i < script.size(); ++i) {
    REQUIRE(loris.send(std::span(script).subspan(i, 1)));
    for (int j = 0; j < 5; ++j, ++ops) {  // the good client works between the loris's bytes
      const auto start = std::chrono::steady_clock::now();
      good.set_string("g", std::to_string(ops));
      const bool right = good.get_string("g") == std::to_string(ops);
      worst = std::max(worst, std::chrono::steady_clock::now() - start);
      REQUIRE(right);
    }
    ::poll(nullptr, 0, 50);  // pacing of the slow peer
  }
  // The loris's own request, complete at last, is applied and answered.
  const auto hello = loris.read(ds::server_hello_bytes + 1);
  CHECK(hello.size() == ds::server_hello_bytes + 1);
  CHECK(read_response(loris).first == 0);
  CHECK(good.get_string("loris") == "finally");
  INFO("ops " << ops << ", worst set+get " << std::chrono::duration_cast<std::chrono::microseconds>(worst).count() << " us");
  CHECK(worst < 250ms);
  CHECK_FALSE(log.contains("closing"));
}

TEST_CASE("tcp_store: a peer that never finishes its handshake is dropped at the handshake timeout") {
  log_capture log;
  tcp_store_server server({.port = 0, .token = std::string(), .handshake_timeout = 300ms, .log = log.sink()});
  raw_peer idle(server.port());
  const auto start = std::chrono::steady_clock::now();
  CHECK(idle.closed_by_server(5s));
  CHECK(std::chrono::steady_clock::now() - start >= 250ms);
  CHECK(log.contains("handshake not completed within 300 ms"));
}

TEST_CASE("tcp_store: with a token, the right one works and a wrong or missing one can do nothing") {
  const std::string token = "s3cr3t-token-value-42";
  log_capture log;
  tcp_store_server server({.port = 0, .token = token, .log = log.sink()});
  tcp_store right({.port = server.port(), .timeout = 5s, .token = token});
  right.set_string("secret", "only for the job");
  CHECK(right.get_string("secret") == "only for the job");

  for (const std::string& bad : {std::string("wrong-token"), std::string()}) {
    try {
      tcp_store wrong({.port = server.port(), .timeout = 5s, .token = bad});
      FAIL("a client with token '" << bad << "' got in");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::store);
      // With a token, the client finds first that the server cannot prove it knows that token.
      CHECK_THAT(e.what(), Catch::Contains(bad.empty() ? "store refused the connection: wrong or missing DDP_STORE_TOKEN"
                                                       : "does not know this job's token: another job or a stranger holds the port"));
      CHECK_THAT(e.what(), !Catch::Contains(token));
      if (!bad.empty()) CHECK_THAT(e.what(), !Catch::Contains(bad));
    }
  }
  {  // a raw peer skipping the proof: its request is taken as a (wrong) proof; nothing is written or read
    raw_peer p(server.port());
    p.send(client_hello());
    CHECK(p.read(ds::server_hello_bytes).size() == ds::server_hello_bytes);
    auto f = ds::encode_request(ds::opcode::set, "intruder", ddp::store::to_bytes("was here"));
    f.resize(std::max(f.size(), ds::client_proof_bytes));
    p.send(f);
    const auto verdict = p.read(1);
    CHECK((verdict.size() == 1 && verdict[0] == std::byte{0}));
    CHECK(p.closed_by_server());
  }
  {  // and one that asks for the secret right after the hello gets no value back
    raw_peer p(server.port());
    p.send(client_hello());
    auto f = ds::encode_get("secret", 100);
    f.resize(std::max(f.size(), ds::client_proof_bytes));
    p.send(f);
    std::string everything;
    for (const auto b : p.read(1 << 16, 2s)) everything += static_cast<char>(b);
    CHECK(everything.find("only for the job") == std::string::npos);
  }
  CHECK(right.num_keys() == 1);
  right.set_timeout(100ms);
  CHECK_THROWS_AS(right.get("intruder"), ddp::error);
  CHECK(log.contains("wrong or missing token"));
  CHECK_FALSE(log.contains(token));
}

TEST_CASE("tcp_store: DDP_STORE_TOKEN from the environment is used by server and client") {
  ::setenv("DDP_STORE_TOKEN", "env-token-123", 1);
  try {
    tcp_store s({.port = 0, .is_server = true, .timeout = 5s});
    s.set_string("k", "v");
    tcp_store c({.port = s.port(), .timeout = 5s});
    CHECK(c.get_string("k") == "v");
    CHECK_THROWS_WITH(tcp_store({.port = s.port(), .timeout = 5s, .token = std::string()}),
                      Catch::Contains("wrong or missing DDP_STORE_TOKEN"));
  } catch (...) {
    ::unsetenv("DDP_STORE_TOKEN");
    throw;
  }
  ::unsetenv("DDP_STORE_TOKEN");
}

TEST_CASE("tcp_store: a value of exactly 64 MiB round-trips, and one byte more is invalid_argument client side") {
  tcp_store_server server({.port = 0, .token = std::string()});
  tcp_store c(client_of(server, 60s));
  std::vector<std::byte> big(ddp::store::max_value_bytes);
  std::uint32_t x = 2463534242u;  // xorshift: content the server cannot fake
  for (auto& b : big) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x);
  }
  c.set("big", big);
  CHECK(c.get("big") == big);
  big.push_back(std::byte{0});
  try {
    c.set("too-big", big);
    FAIL("accepted a value over the limit");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Contains("exceeds the limit of 67108864 bytes"));
  }
  CHECK(c.num_keys() == 1);  // and the connection is still good
}

TEST_CASE("tcp_store: no file descriptor leaks across servers, clients and refused peers") {
  const int before = open_fds();
  for (int i = 0; i < 10; ++i) {
    tcp_store s({.port = 0, .is_server = true, .timeout = 2s, .token = std::string("t")});
    tcp_store c({.port = s.port(), .timeout = 2s, .token = std::string("t")});
    c.set_string("k", "v");
    CHECK(s.get_string("k") == "v");
    CHECK_THROWS(tcp_store({.port = s.port(), .timeout = 2s, .token = std::string("x")}));
    raw_peer junk(s.port());
    junk.send(ddp::store::to_bytes("junk junk"));
    CHECK(junk.closed_by_server());
  }
  {
    tcp_store_server a({.port = 0, .token = std::string()});
    CHECK_THROWS(tcp_store_server({.port = a.port(), .token = std::string()}));
  }
  CHECK(open_fds() == before);
}

TEST_CASE("tcp_store: one client shared by threads keeps answers matched to their calls") {
  tcp_store_server server({.port = 0, .token = std::string()});
  tcp_store c(client_of(server));
  constexpr int threads = 4, per_thread = 500;
  std::vector<std::thread> pool;
  std::atomic<int> wrong{0};
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        const auto key = "t" + std::to_string(t);
        c.set_string(key, std::to_string(i));
        if (c.get_string(key) != std::to_string(i)) ++wrong;
        c.add("total", 1);
      }
    });
  for (auto& th : pool) th.join();
  CHECK(wrong == 0);
  CHECK(c.add("total", 0) == threads * per_thread);
}

TEST_CASE("tcp_store: a rank of another job is refused at the handshake, naming both jobs and the port") {
  log_capture log;
  tcp_store_server server({.port = 0, .token = std::string(), .log = log.sink(), .job = "slurm:41.0"});
  const std::string where = "127.0.0.1:" + std::to_string(server.port());
  tcp_store mine({.port = server.port(), .timeout = 5s, .token = std::string(), .job = "slurm:41.0"});
  mine.set_string("k", "of job 41");

  const auto start = std::chrono::steady_clock::now();
  try {
    tcp_store stranger({.port = server.port(), .timeout = 30s, .token = std::string(), .job = "slurm:42.0"});
    FAIL("a rank of job slurm:42.0 joined the store of job slurm:41.0");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("slurm:41.0") && Catch::Contains("slurm:42.0") && Catch::Contains(where));
  }
  CHECK(std::chrono::steady_clock::now() - start < 1s);
  CHECK(mine.num_keys() == 1);  // it wrote nothing
  CHECK(mine.get_string("k") == "of job 41");
  {  // a client that names its job only after the server's proof, and ignores the server's job
    raw_peer p(server.port());
    p.send(client_hello());
    CHECK(p.read(ds::server_hello_bytes).size() == ds::server_hello_bytes);
    p.send(zero_proof("slurm:42.0"));
    const auto verdict = p.read(1);
    CHECK((verdict.size() == 1 && verdict[0] == std::byte{0}));
    CHECK(p.closed_by_server());
  }
  CHECK(log.contains("refused a rank of job slurm:42.0: this store serves job slurm:41.0"));

  // A client or a server without an identity checks nothing (a store used directly, not by a job).
  tcp_store anonymous({.port = server.port(), .timeout = 5s, .token = std::string()});
  CHECK(anonymous.get_string("k") == "of job 41");
}

TEST_CASE("tcp_store: identities longer than the hello's field stay apart when they differ") {
  const std::string a = "torchrun:" + std::string(100, 'x') + "-a";
  const std::string b = "torchrun:" + std::string(100, 'x') + "-b";
  CHECK(ds::job_field_text(a).size() == ds::job_field_bytes);
  CHECK(ds::job_field_text(a) != ds::job_field_text(b));
  tcp_store_server server({.port = 0, .token = std::string(), .job = a});
  tcp_store same({.port = server.port(), .timeout = 5s, .token = std::string(), .job = a});
  CHECK_THROWS_AS(tcp_store({.port = server.port(), .timeout = 5s, .token = std::string(), .job = b}), ddp::error);
}

TEST_CASE("tcp_store: a port held by another job's store says whose it is") {
  tcp_store_server holder({.port = 0, .token = std::string(), .job = "slurm:41.0"});
  try {
    tcp_store_server second({.port = holder.port(), .token = std::string(), .job = "slurm:42.0"});
    FAIL("a second server bound the same port");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("is already in use by the ddp store of job slurm:41.0 (this rank is of job slurm:42.0)"));
  }
  try {
    tcp_store_server twin({.port = holder.port(), .token = std::string(), .job = "slurm:41.0"});
    FAIL("a second server bound the same port");
  } catch (const ddp::error& e) {
    CHECK_THAT(e.what(), Catch::Contains("by a store of this same job slurm:41.0 (several launchers"));
  }
}

// A listener that never greets, as PyTorch's TCPStore (torchrun's agent) does; port() says where.
// A program that holds a port and answers nobody.
using silent_listener = ddp::test::loopback_listener;

TEST_CASE("tcp_store: a port held by a program that is not a ddp store is named as such") {
  const silent_listener listener;
  try {
    tcp_store_server server({.port = listener.port, .token = std::string(), .job = "slurm:42.0"});
    FAIL("bound a port that is in use");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("by a program that is not a ddp store") && Catch::Contains("TORCHELASTIC_USE_AGENT_STORE"));
  }
}

// A port free a moment ago (a server bound it and stopped).
std::uint16_t recently_free_port() {
  tcp_store_server probe({.port = 0, .token = std::string()});
  return probe.port();
}

TEST_CASE("tcp_store: with alternate ports, a server passes over another job's store and a silent program, and its ranks find it") {
  tcp_store_server other_job({.port = 0, .token = std::string(), .job = "slurm:41.0"});
  tcp_store other_rank({.port = other_job.port(), .timeout = 5s, .token = std::string(), .job = "slurm:41.0"});
  other_rank.set_string("k", "of job 41");
  const silent_listener stranger;
  const std::uint16_t free = recently_free_port();
  const std::vector<std::uint16_t> alternates{stranger.port, free};

  // A rank that starts looking before its server is up.
  std::string early_result, early_failure;
  std::uint16_t early_port = 0;
  std::thread early([&] {
    try {
      tcp_store c({.port = other_job.port(), .timeout = 20s, .token = std::string(), .job = "slurm:42.0", .alternate_ports = alternates});
      early_port = c.port();
      early_result = c.get_string("hello");
    } catch (const std::exception& e) {
      early_failure = e.what();
    }
  });
  ::poll(nullptr, 0, 300);  // let it find nothing for a while
  log_capture log;
  tcp_store rank0({.port = other_job.port(),
                   .is_server = true,
                   .timeout = 10s,
                   .token = std::string(),
                   .log = log.sink(),
                   .job = "slurm:42.0",
                   .alternate_ports = alternates});
  CHECK(rank0.port() == free);
  CHECK(log.contains("is in use by the ddp store of job slurm:41.0"));
  CHECK(log.contains("is in use by a program that is not a ddp store"));
  CHECK(log.contains("serving on " + std::to_string(free) + ", alternate 2"));
  rank0.set_string("hello", "job 42");
  early.join();
  CHECK(early_failure.empty());
  CHECK(early_port == free);
  CHECK(early_result == "job 42");

  // A rank that starts after it, and the other job, untouched.
  tcp_store late({.port = other_job.port(), .timeout = 10s, .token = std::string(), .job = "slurm:42.0", .alternate_ports = alternates});
  CHECK(late.port() == free);
  CHECK(late.get_string("hello") == "job 42");
  CHECK(other_rank.num_keys() == 1);
  CHECK(other_rank.get_string("k") == "of job 41");
}

TEST_CASE("tcp_store: with alternate ports, a store of the same job on the port is still an error, and so are all ports held") {
  tcp_store_server twin({.port = 0, .token = std::string(), .job = "slurm:41.0"});
  const std::uint16_t free = recently_free_port();
  try {
    tcp_store_server second({.port = twin.port(), .token = std::string(), .job = "slurm:41.0", .alternate_ports = {free}});
    FAIL("a second store of one job took an alternate port");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("by a store of this same job slurm:41.0 (several launchers"));
  }
  const silent_listener stranger;
  try {
    tcp_store_server boxed_in({.port = twin.port(), .token = std::string(), .job = "slurm:42.0", .alternate_ports = {stranger.port}});
    FAIL("a server bound a port in use");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("derived port and its 1 alternates are all in use") && Catch::Contains("slurm:41.0") &&
                             Catch::Contains(std::to_string(stranger.port)) && Catch::Contains("set MASTER_PORT"));
  }
  // A client whose every port is held by another job's store says so at once.
  tcp_store_server other({.port = 0, .token = std::string(), .job = "slurm:43.0"});
  const auto start = std::chrono::steady_clock::now();
  try {
    tcp_store c({.port = twin.port(), .timeout = 30s, .token = std::string(), .job = "slurm:42.0", .alternate_ports = {other.port()}});
    FAIL("joined a store of another job");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK_THAT(e.what(), Catch::Contains("all held by others") && Catch::Contains("slurm:41.0") && Catch::Contains("slurm:43.0"));
  }
  CHECK(std::chrono::steady_clock::now() - start < 2s);
  CHECK_THROWS_AS(tcp_store({.port = twin.port(), .timeout = 1s, .token = std::string(), .alternate_ports = {free}}), ddp::error);
}

TEST_CASE("tcp_store: with alternate ports and no server, the connect deadline names every port and what held it") {
  const silent_listener stranger;
  const std::uint16_t free = recently_free_port();
  const auto start = std::chrono::steady_clock::now();
  try {
    tcp_store c({.port = free, .timeout = 1500ms, .token = std::string(), .job = "slurm:42.0", .alternate_ports = {stranger.port}});
    FAIL("connected to nothing");
  } catch (const ddp::error& e) {
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(e.code() == ddp::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("could not find the store of job slurm:42.0 at 127.0.0.1") &&
                             Catch::Contains(std::to_string(free) + ": connect: Connection refused") &&
                             Catch::Contains(std::to_string(stranger.port) + " is held by a program that is not a ddp store") &&
                             Catch::Contains("MASTER_ADDR"));
    CHECK(elapsed >= 1500ms);
    CHECK(elapsed < 3s);
  }
}

}  // namespace ddp_test_tcp_store
