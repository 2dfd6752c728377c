// shm_transport with ranks as threads of one process (hash_store): streams arrive intact and in
// order, send_recv is full duplex, abort() and deadlines end waits, and nothing stays in /dev/shm.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/hash_store.hpp"
#include "ddp/backends/ring/transport/shm.hpp"

#include "support/leaks.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_shm_transport {

using ddp::test::shm_entries;
using ddp::test::open_fds;
using namespace std::chrono_literals;

namespace {

// Byte i of the stream from `src` to `dst`: independent of the code under test.
std::byte pattern(int src, int dst, std::size_t i) {
  return static_cast<std::byte>((i * 131 + static_cast<std::size_t>(src) * 17 + static_cast<std::size_t>(dst) * 5 + (i >> 12)) & 0xff);
}

std::string unique_prefix(const char* what) { return std::string(what) + std::to_string(::getpid()) + "/"; }

// Runs fn(rank, transport) on `n` threads, each with its own transport over one hash_store.
template <class Fn>
std::vector<std::string> run_threads(int n, const std::string& prefix, ddp::shm_transport::options opts, Fn fn) {
  ddp::store::hash_store store;
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        ddp::shm_transport t(store, prefix, r, n, ddp::deadline::after(20s), opts);
        fn(r, t);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("shm transport: every ordered pair streams bytes intact, larger than the ring") {
  const auto prefix = unique_prefix("shmt-pairs");
  const int fds_before = open_fds();
  ddp::shm_transport::options opts;
  opts.ring_bytes = 64 << 10;  // small ring: the streams wrap many times
  for (int n : {2, 3, 4}) {
    const std::size_t bytes = (1 << 20) + 7;
    const auto errors = run_threads(n, prefix + std::to_string(n), opts, [&](int rank, ddp::shm_transport& t) {
      // Ring exchange with every distance: send to rank+d, receive from rank-d, at once.
      for (int d = 1; d < n; ++d) {
        const int to = (rank + d) % n, from = (rank - d + n) % n;
        std::vector<std::byte> out(bytes), in(bytes);
        for (std::size_t i = 0; i < bytes; ++i) out[i] = pattern(rank, to, i);
        t.send_recv(to, out, from, in, ddp::deadline::after(20s));
        for (std::size_t i = 0; i < bytes; ++i)
          if (in[i] != pattern(from, rank, i)) throw std::runtime_error("byte " + std::to_string(i) + " from rank " + std::to_string(from) + " differs");
      }
    });
    for (int r = 0; r < n; ++r) {
      INFO("p=" << n << " rank " << r);
      CHECK(errors[static_cast<std::size_t>(r)].empty());
      if (!errors[static_cast<std::size_t>(r)].empty()) WARN(errors[static_cast<std::size_t>(r)]);
    }
  }
  CHECK(shm_entries(prefix.substr(0, prefix.size() - 1)).empty());
  CHECK(open_fds() == fds_before);
}

TEST_CASE("shm transport: send and recv in pieces of odd sizes keep the stream order") {
  const auto prefix = unique_prefix("shmt-pieces");
  ddp::shm_transport::options opts;
  opts.ring_bytes = 4096;
  const auto errors = run_threads(2, prefix, opts, [](int rank, ddp::shm_transport& t) {
    std::size_t offset = 0;
    for (std::size_t piece : {1u, 3u, 4095u, 4096u, 4097u, 10000u, 0u, 5u}) {
      std::vector<std::byte> buf(piece);
      if (rank == 0) {
        for (std::size_t i = 0; i < piece; ++i) buf[i] = pattern(0, 1, offset + i);
        t.send(1, buf, ddp::deadline::after(10s));
      } else {
        t.recv(0, buf, ddp::deadline::after(10s));
        for (std::size_t i = 0; i < piece; ++i)
          if (buf[i] != pattern(0, 1, offset + i)) throw std::runtime_error("stream byte " + std::to_string(offset + i) + " differs");
      }
      offset += piece;
    }
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  INFO(errors[0] << errors[1]);
}

TEST_CASE("shm transport: a receive with nothing sent ends at its deadline with errc::timeout") {
  const auto prefix = unique_prefix("shmt-timeout");
  std::atomic<bool> done{false};
  const auto errors = run_threads(2, prefix, {}, [&](int rank, ddp::shm_transport& t) {
    if (rank == 0) {
      std::byte b[4];
      const auto start = ddp::clock::now();
      try {
        t.recv(1, b, ddp::deadline::after(300ms));
        throw std::runtime_error("recv returned");
      } catch (const ddp::error& e) {
        const auto took = ddp::clock::now() - start;
        if (e.code() != ddp::errc::timeout) throw std::runtime_error(std::string("wrong code: ") + e.what());
        if (took < 290ms || took > 2s) throw std::runtime_error("timeout after " + std::to_string((took / 1ms)) + " ms");
      }
      done = true;
      std::byte one{1};
      t.send(1, std::span(&one, 1), ddp::deadline::after(5s));
    } else {
      std::byte b{0};
      t.recv(0, std::span(&b, 1), ddp::deadline::after(10s));  // keeps rank 1 alive until rank 0 is done
    }
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  INFO(errors[0] << errors[1]);
  CHECK(done);
}

TEST_CASE("shm transport: abort() on one rank ends the peer's blocked recv with errc::peer_lost") {
  const auto prefix = unique_prefix("shmt-abort");
  const auto errors = run_threads(2, prefix, {}, [&](int rank, ddp::shm_transport& t) {
    if (rank == 0) {
      std::byte b[8];
      const auto start = ddp::clock::now();
      try {
        t.recv(1, b, ddp::deadline::after(20s));
        throw std::runtime_error("recv returned");
      } catch (const ddp::error& e) {
        if (e.code() != ddp::errc::peer_lost) throw std::runtime_error(std::string("wrong code: ") + e.what());
        if (std::string(e.what()).find("rank 1") == std::string::npos) throw std::runtime_error(std::string("not named: ") + e.what());
        if (ddp::clock::now() - start > 2s) throw std::runtime_error("abort noticed late");
      }
    } else {
      // Let rank 0 reach its wait (any order works: the aborted flag stays set).
      t.abort();
    }
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  INFO(errors[0] << errors[1]);
}

TEST_CASE("shm transport: bad arguments are errc::invalid_argument") {
  const auto prefix = unique_prefix("shmt-args");
  const auto errors = run_threads(2, prefix, {}, [&](int rank, ddp::shm_transport& t) {
    std::byte b[1];
    for (int peer : {-1, rank, 2}) {
      try {
        t.send(peer, b, ddp::deadline::after(1s));
        throw std::runtime_error("send to " + std::to_string(peer) + " accepted");
      } catch (const ddp::error& e) {
        if (e.code() != ddp::errc::invalid_argument) throw;
      }
    }
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  ddp::store::hash_store store;
  ddp::shm_transport::options bad;
  bad.ring_bytes = 5000;
  try {
    ddp::shm_transport t(store, prefix + "x", 0, 1, ddp::deadline::after(1s), bad);
    FAIL("a ring of 5000 bytes was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
  }
}

}  // namespace ddp_test_shm_transport
