// tcp_transport: mesh set-up, full-duplex transfers larger than the socket buffers, byte counters,
// deadlines, peer loss, abort from another thread, strangers on the port, fd hygiene, addresses,
// busy-polling before sleeping (budget, adaptation, deadline and abort while spinning).
// Ranks are threads sharing a hash_store; every blocking call has a deadline.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/hash_store.hpp"
#include "ddp/backends/ring/transport/tcp.hpp"
#include "ddp/launch/root_cause.hpp"
#include "support/leaks.hpp"
#include "support/threads.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_tcp_transport {

using ddp::test::open_fds;
using namespace std::chrono_literals;

namespace {

using ddp::test::run_threads;

ddp::tcp_options short_setup() {
  ddp::tcp_options o;
  o.timeout = 20s;
  return o;
}

std::vector<std::byte> pattern(int rank, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(rank) * 17 + i / 4096) & 0xff);
  return v;
}

// Waits (bounded) for the other side to close: true if EOF or reset is seen within `within`.
bool closed_by_peer(int fd, std::chrono::milliseconds within) {
  const auto until = ddp::deadline::after(within);
  while (!until.expired()) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, until.poll_timeout_ms()) <= 0) return false;
    char buf[256];
    const ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("tcp: a ring of 4 ranks sends and receives 8 MiB at once in both directions, counted exactly") {
  ddp::store::hash_store store;
  constexpr std::size_t n = std::size_t{8} << 20;
  run_threads(4, [&](int r) {
    ddp::tcp_transport t(store, r, 4, "ring4", short_setup());
    const int next = (r + 1) % 4, prev = (r + 3) % 4;
    const auto out = pattern(r, n);
    std::vector<std::byte> in(n);
    t.send_recv(next, out, prev, in, ddp::deadline::after(60s));
    if (in != pattern(prev, n)) throw std::runtime_error("rank " + std::to_string(r) + ": wrong bytes from " + std::to_string(prev));
    if (t.bytes_sent(next) != n || t.bytes_received(prev) != n || t.total_bytes_sent() != n || t.total_bytes_received() != n) {
      throw std::runtime_error("byte counters do not match the transfer");
    }
  });
}

TEST_CASE("tcp: two ranks exchange 16 MiB with each other on one connection without deadlock") {
  ddp::store::hash_store store;
  constexpr std::size_t n = std::size_t{16} << 20;
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, "pair", short_setup());
    const auto out = pattern(r, n);
    std::vector<std::byte> in(n);
    t.send_recv(1 - r, out, 1 - r, in, ddp::deadline::after(60s));
    if (in != pattern(1 - r, n)) throw std::runtime_error("wrong bytes");
    // send and recv alone, and scatter-gather pieces that straddle the reader's pieces.
    if (r == 0) {
      const std::byte a[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
      const std::byte b[5] = {std::byte{4}, std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8}};
      const ddp::send_piece pieces[2] = {a, b};
      t.send_recv_v(1, pieces, -1, {}, ddp::deadline::after(10s), [](std::size_t) {});
    } else {
      std::byte x[6] = {}, y[2] = {};
      const ddp::recv_piece pieces[2] = {x, y};
      std::size_t first_report = 0;
      t.send_recv_v(-1, {}, 0, pieces, ddp::deadline::after(10s), [&](std::size_t got) {
        if (first_report == 0) first_report = got;
      });
      if (first_report != 6) throw std::runtime_error("progress did not report the first piece alone");
      for (int i = 0; i < 6; ++i)
        if (x[i] != std::byte(i + 1)) throw std::runtime_error("wrong piece bytes");
      if (y[0] != std::byte{7} || y[1] != std::byte{8}) throw std::runtime_error("wrong piece bytes");
    }
  });
}

namespace {

// Rank 0 receives 16 bytes that rank 1 never sends (rank 1 keeps the connection open until rank 0
// is done): the recv must fail with errc::timeout at its 300 ms deadline. Returns the error text.
std::string expect_recv_timeout(const ddp::tcp_options& o, const std::string& prefix) {
  ddp::store::hash_store store;
  std::latch done(2);
  std::string what;
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, prefix, o);
    if (r == 1) {
      done.arrive_and_wait();
      return;
    }
    std::byte buf[16];
    const auto start = std::chrono::steady_clock::now();
    try {
      t.recv(1, buf, ddp::deadline::after(300ms));
      done.count_down();
      throw std::runtime_error("recv returned without data");
    } catch (const ddp::error& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      done.count_down();
      if (e.code() != ddp::errc::timeout) throw;
      if (took < 290ms || took > 3s) throw std::runtime_error("timeout fired after " + std::to_string(took.count()) + " ns");
      what = e.what();
    }
  });
  return what;
}

}  // namespace

TEST_CASE("tcp: a recv nobody answers fails with timeout at its deadline") {
  const std::string what = expect_recv_timeout(short_setup(), "timeout");
  CHECK(what.find("received 0 of 16 bytes from rank 1") != std::string::npos);
}

TEST_CASE("tcp: a peer that goes away is peer_lost naming it, at once") {
  ddp::store::hash_store store;
  std::latch ready(2);
  run_threads(2, [&](int r) {
    auto t = std::make_unique<ddp::tcp_transport>(store, r, 2, "lost", short_setup());
    ready.arrive_and_wait();
    if (r == 1) {
      t.reset();  // closes the sockets
      return;
    }
    std::vector<std::byte> buf(1 << 20);
    const auto start = std::chrono::steady_clock::now();
    try {
      t->recv(1, buf, ddp::deadline::after(30s));
      throw std::runtime_error("recv returned");
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::peer_lost) throw;
      if (std::string(e.what()).find("peer rank 1 closed the connection") == std::string::npos) throw std::runtime_error(e.what());
      if (std::chrono::steady_clock::now() - start > 5s) throw std::runtime_error("peer loss noticed late");
      if (t->lost_peer() != 1) throw std::runtime_error("lost_peer() does not name rank 1");
    }
  });
}

TEST_CASE("tcp: abort() from another thread unblocks a blocked recv promptly") {
  ddp::store::hash_store store;
  std::latch done(2);
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, "abort", short_setup());
    if (r == 1) {
      done.arrive_and_wait();
      return;
    }
    std::atomic<bool> returned{false};
    std::chrono::steady_clock::duration took{};
    ddp::errc code{};
    std::thread waiter([&] {
      std::byte buf[8];
      const auto start = std::chrono::steady_clock::now();
      try {
        t.recv(1, buf, ddp::deadline::after(30s));
      } catch (const ddp::error& e) {
        code = e.code();
      }
      took = std::chrono::steady_clock::now() - start;
      returned = true;
    });
    // Whether abort lands before or during the recv, the recv must fail fast.
    pollfd none{-1, 0, 0};
    ::poll(&none, 0, 50);
    t.abort();
    t.abort();  // idempotent
    waiter.join();
    done.count_down();
    if (!returned || code != ddp::errc::peer_lost) throw std::runtime_error("recv did not fail with peer_lost after abort");
    if (took > 2s) throw std::runtime_error("abort took too long to unblock");
    std::byte b[1] = {};
    try {
      t.send(1, b, ddp::deadline::after(1s));
      throw std::runtime_error("send after abort succeeded");
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::peer_lost) throw;
    }
  });
}

TEST_CASE("tcp: strangers on a rank's port are rejected without disturbing the group") {
  ddp::store::hash_store store;
  std::latch strangers_in(1);
  int garbage = -1, forged = -1, silent = -1;
  std::thread group([&] {
    run_threads(2, [&](int r) {
      if (r == 1) strangers_in.wait();  // rank 1 joins only once the strangers are connected
      auto o = short_setup();
      o.listen_address = "127.0.0.1";  // the host-identity count waits until the mesh is built, not before listening
      ddp::tcp_transport t(store, r, 2, "strangers", o);
      const auto out = pattern(r, 100000);
      std::vector<std::byte> in(out.size());
      t.send_recv(1 - r, out, 1 - r, in, ddp::deadline::after(20s));
      if (in != pattern(1 - r, out.size())) throw std::runtime_error("group disturbed: wrong bytes");
    });
  });
  std::exception_ptr failure;
  try {
    // Rank 0 listens; read its address like any rank would.
    const std::string v = store.get_string("strangers/tcp/addr/0");
    const auto hp = ddp::detail::tcp::parse_host_port(v.substr(0, v.find(' ')));
    auto c1 = ddp::detail::tcp::connect_before(hp, ddp::deadline::after(5s));
    auto c2 = ddp::detail::tcp::connect_before(hp, ddp::deadline::after(5s));
    auto c3 = ddp::detail::tcp::connect_before(hp, ddp::deadline::after(5s));
    garbage = c1.get(), forged = c2.get(), silent = c3.get();
    const char junk[] = "GET / HTTP/1.1\r\nHost: example\r\n\r\nand then some more garbage bytes";
    ddp::detail::tcp::write_all(garbage, reinterpret_cast<const unsigned char*>(junk), sizeof junk, ddp::deadline::after(5s), "rank 0");
    // A well-formed hello claiming to be rank 1, but without rank 0's nonce from the store.
    const auto hello = ddp::detail::tcp::hello{1, 1, 2, ddp::detail::tcp::nonce{}, ddp::detail::tcp::fnv1a("strangers")}.encode();
    ddp::detail::tcp::write_all(forged, hello.data(), hello.size(), ddp::deadline::after(5s), "rank 0");
    CHECK(closed_by_peer(garbage, 10s));
    CHECK(closed_by_peer(forged, 10s));
    strangers_in.count_down();
    CHECK(closed_by_peer(silent, 20s));  // closed with the listener once the mesh is complete
  } catch (...) {
    failure = std::current_exception();
    strangers_in.count_down();
  }
  group.join();
  if (failure) std::rethrow_exception(failure);
}

TEST_CASE("tcp: a peer that resets the connection in the handshake is named as gone, which a launcher reads as a consequence") {
  // Rank 0 is played by the test: it takes rank 1's hello and resets the connection, as a rank
  // does that exits (another rank died) while its peers connect. Launchers name the root cause
  // by telling such lines from causes of a rank's own (ddp/launch/root_cause.hpp).
  ddp::store::hash_store store;
  auto listener = ddp::detail::tcp::listen_ephemeral("127.0.0.1", 4);
  store.set_string("reset/tcp/addr/0", "127.0.0.1:" + std::to_string(ddp::detail::tcp::port_of(listener.get())) + " " +
                                           ddp::detail::tcp::to_hex(ddp::detail::tcp::nonce{}));
  std::thread rank0([&] {
    pollfd p{listener.get(), POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) return;
    ddp::detail::tcp::unique_fd c(::accept(listener.get(), nullptr, nullptr));
    if (!c) return;
    unsigned char hello[ddp::detail::tcp::hello_size];
    ddp::detail::tcp::read_all(c.get(), hello, sizeof hello, ddp::deadline::after(20s), "rank 1");
    const linger reset{1, 0};  // close with RST, as the kernel does for an exiting process's unread data
    ::setsockopt(c.get(), SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  });
  auto o = short_setup();
  o.listen_address = "127.0.0.1";
  std::string message;
  try {
    ddp::tcp_transport t(store, 1, 2, "reset", o);
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::peer_lost);
    message = e.what();
  }
  rank0.join();
  INFO(message);
  CHECK(message.find("peer rank 0 at 127.0.0.1:") != std::string::npos);
  CHECK(message.find("reset the connection during the handshake") != std::string::npos);
  CHECK(ddp::detail::is_consequence(message, "ddprun"));
}

TEST_CASE("tcp: building, using and destroying a mesh leaves no file descriptor behind") {
  const int before = open_fds();
  REQUIRE(before > 0);
  {
    ddp::store::hash_store store;
    run_threads(3, [&](int r) {
      ddp::tcp_transport t(store, r, 3, "fds", short_setup());
      const auto out = pattern(r, 4096);
      std::vector<std::byte> in(out.size());
      t.send_recv((r + 1) % 3, out, (r + 2) % 3, in, ddp::deadline::after(10s));
    });
  }
  CHECK(open_fds() == before);
}

TEST_CASE("tcp: the listen address comes from the options, then DDP_SOCKET_ADDR, then 127.0.0.1") {
  ddp::store::hash_store store;
  auto address_of = [&](const std::string& prefix, ddp::tcp_options o) {
    std::string a0;
    run_threads(2, [&](int r) {
      ddp::tcp_transport t(store, r, 2, prefix, o);
      if (r == 0) a0 = t.address();
    });
    return a0;
  };
  ::unsetenv("DDP_SOCKET_ADDR");
  CHECK(address_of("a1", short_setup()).rfind("127.0.0.1:", 0) == 0);
  ::setenv("DDP_SOCKET_ADDR", "127.0.0.2", 1);
  CHECK(address_of("a2", short_setup()).rfind("127.0.0.2:", 0) == 0);
  auto o = short_setup();
  o.listen_address = "127.0.0.3";
  CHECK(address_of("a3", o).rfind("127.0.0.3:", 0) == 0);
  ::unsetenv("DDP_SOCKET_ADDR");
}

TEST_CASE("tcp: a rank that never joins makes the others time out naming it") {
  ddp::store::hash_store store;
  ddp::tcp_options o;
  o.timeout = 400ms;
  std::vector<std::string> messages(2);
  run_threads(2, [&](int r) {
    try {
      ddp::tcp_transport t(store, r, 3, "absent", o);
    } catch (const ddp::error& e) {
      if (e.code() != ddp::errc::timeout) throw;
      messages[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (const auto& m : messages) {
    INFO(m);
    CHECK(m.find("rank(s) 2") != std::string::npos);
  }
}

TEST_CASE("tcp: spinning is off when the host runs more of the group's ranks than it has CPUs, or when asked") {
  using ddp::detail::tcp::spin_budget;
  CHECK(spin_budget(50us, 2, 2) == 50us);
  CHECK(spin_budget(50us, 1, 64) == 50us);
  CHECK(spin_budget(50us, 3, 2) == 0us);
  CHECK(spin_budget(0us, 1, 64) == 0us);
  CHECK(spin_budget(-5us, 1, 64) == 0us);
}

TEST_CASE("tcp: the spin budget halves on a miss, comes back on a catch, and probes now and then at zero") {
  ddp::detail::tcp::spin_policy s(40us);
  CHECK(s.next() == 40us);
  s.missed();
  CHECK(s.next() == 20us);
  s.caught();
  CHECK(s.next() == 40us);
  for (int i = 0; i < 6; ++i) s.missed();  // 40 -> 20 -> 10 -> 5 -> 2.5 -> 1.25 -> below 1 us: off
  int probes = 0;
  for (unsigned i = 0; i < 10 * ddp::detail::tcp::spin_policy::probe_every; ++i) {
    const auto budget = s.next();
    if (budget == 0ns) continue;
    CHECK(budget == 40us);
    ++probes;
  }
  CHECK(probes == 10);
  s.caught();  // a probe that caught data restores the budget
  CHECK(s.next() == 40us);
  ddp::detail::tcp::spin_policy off(0us);
  for (unsigned i = 0; i < 2 * ddp::detail::tcp::spin_policy::probe_every; ++i) CHECK(off.next() == 0ns);
}

TEST_CASE("tcp: the spin comes from the options, then DDP_TCP_SPIN_US, then 50 us; a bad value is a config error") {
  ddp::store::hash_store store;
  const int cpus = ddp::detail::shm::usable_cpus();
  auto spin_of = [&](const std::string& prefix, ddp::tcp_options o) {
    std::chrono::microseconds spin[2];
    run_threads(2, [&](int r) {
      ddp::tcp_transport t(store, r, 2, prefix, o);
      spin[static_cast<std::size_t>(r)] = t.spin();
    });
    CHECK(spin[0] == spin[1]);
    return spin[0];
  };
  auto on = [&](std::chrono::microseconds us) { return cpus >= 2 ? us : 0us; };  // 2 ranks on this host
  ::unsetenv("DDP_TCP_SPIN_US");
  CHECK(spin_of("s1", short_setup()) == on(50us));
  ::setenv("DDP_TCP_SPIN_US", "7", 1);
  CHECK(spin_of("s2", short_setup()) == on(7us));
  ::setenv("DDP_TCP_SPIN_US", "0", 1);
  CHECK(spin_of("s3", short_setup()) == 0us);
  auto o = short_setup();
  o.spin = 20us;
  CHECK(spin_of("s4", o) == on(20us));
  o.listen_address = "127.0.0.1";  // counted after the mesh is built
  CHECK(spin_of("s5", o) == on(20us));
  ::setenv("DDP_TCP_SPIN_US", "fast", 1);
  try {
    ddp::tcp_transport t(store, 0, 2, "s6", short_setup());
    FAIL("a bad DDP_TCP_SPIN_US was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK(std::string(e.what()).find("DDP_TCP_SPIN_US='fast'") != std::string::npos);
  }
  ::unsetenv("DDP_TCP_SPIN_US");
  // More ranks on this host than CPUs: they would spin on each other's cores.
  if (cpus <= 16) {
    const int p = cpus + 1;
    o = short_setup();
    o.spin = 50us;
    std::vector<std::chrono::microseconds> spins(static_cast<std::size_t>(p));
    run_threads(p, [&](int r) { spins[static_cast<std::size_t>(r)] = ddp::tcp_transport(store, r, p, "s7", o).spin(); });
    for (const auto x : spins) CHECK(x == 0us);
  }
}

TEST_CASE("tcp: small exchanges with and without spinning deliver every byte") {
  ddp::store::hash_store store;
  for (const auto spin : {0us, 50us}) {
    auto o = short_setup();
    o.spin = spin;
    run_threads(3, [&](int r) {
      ddp::tcp_transport t(store, r, 3, "small" + std::to_string(spin.count()), o);
      const int next = (r + 1) % 3, prev = (r + 2) % 3;
      for (std::size_t n : {std::size_t{1}, std::size_t{4}, std::size_t{96}, std::size_t{1056}, std::size_t{70000}}) {
        for (int i = 0; i < 200; ++i) {
          const auto out = pattern(r + i, n);
          std::vector<std::byte> in(n);
          t.send_recv(next, out, prev, in, ddp::deadline::after(20s));
          if (in != pattern(prev + i, n)) throw std::runtime_error("wrong bytes at " + std::to_string(n) + " bytes, round " + std::to_string(i));
        }
      }
    });
  }
}

TEST_CASE("tcp: a spin longer than the deadline still ends at the deadline") {
  auto o = short_setup();
  o.spin = 10s;  // every wait would spin past the deadline if the deadline did not bound it
  expect_recv_timeout(o, "spin-deadline");
}

TEST_CASE("tcp: abort() from another thread ends a spinning recv promptly") {
  ddp::store::hash_store store;
  std::latch done(2);
  auto o = short_setup();
  o.spin = 10s;
  run_threads(2, [&](int r) {
    ddp::tcp_transport t(store, r, 2, "spin-abort", o);
    if (r == 1) {
      done.arrive_and_wait();
      return;
    }
    std::latch waiting(1);
    ddp::errc code{};
    std::chrono::steady_clock::duration took{};
    std::thread waiter([&] {
      std::byte buf[8];
      waiting.count_down();
      const auto start = std::chrono::steady_clock::now();
      try {
        t.recv(1, buf, ddp::deadline::after(30s));
      } catch (const ddp::error& e) {
        code = e.code();
      }
      took = std::chrono::steady_clock::now() - start;
    });
    waiting.wait();
    t.abort();
    waiter.join();
    done.count_down();
    if (code != ddp::errc::peer_lost) throw std::runtime_error("recv did not fail with peer_lost after abort");
    if (took > 2s) throw std::runtime_error("abort took too long to end the spin");
  });
}

}  // namespace ddp_test_tcp_transport
