// tcp_store bounds: what hostile or idle clients can make the server buffer, and a flood of idle
// connections against a rendezvous. The socket tests run the server in a forked process of its
// own, so that its memory (VmRSS) and its descriptor limit are its own.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/server_core.hpp"
#include "ddp/store/tcp_store.hpp"

namespace ddp_test_store_limits {

using namespace std::chrono_literals;
namespace ds = ddp::store::detail;
using core = ds::server_core;

namespace {

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool sanitized_build = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool sanitized_build = true;
#else
constexpr bool sanitized_build = false;
#endif
#else
constexpr bool sanitized_build = false;
#endif

constexpr std::size_t big_value = ddp::store::max_value_bytes;  // 64 MiB

// The header and key of a set() of a value of `n` bytes; the value is sent separately.
std::vector<std::byte> set_header(std::size_t n) {
  std::vector<std::byte> h;
  ds::put_le(h, static_cast<std::uint8_t>(ds::opcode::set));
  ds::put_le(h, std::uint32_t{1});
  ds::put_le(h, static_cast<std::uint32_t>(n));
  h.push_back(std::byte{'k'});
  return h;
}

// Authenticates virtual connection `id` of a core without a token.
void authenticate(core& c, core::conn_id id, ddp::clock::time_point now) {
  const ds::nonce server_nonce{};
  c.open(id, "10.0.0." + std::to_string(id) + ":1", server_nonce, now);
  const ds::nonce mine{};
  c.receive(id, ds::encode_client_hello(mine), now);
  c.sent(id, c.output(id).size(), now);
  const ds::digest zeros{};
  c.receive(id, ds::encode_client_proof(zeros), now);
  REQUIRE(c.output(id).size() == 1);
  c.sent(id, 1, now);
}

long rss_kib(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// A tcp_store_server in a child process: port() to reach it, log() for what it said so far.
struct forked_server {
  pid_t pid = -1;
  std::uint16_t port = 0;
  int log_fd = -1;
  std::string lines;

  forked_server(ddp::store::tcp_store_server::options opts, rlim_t fd_limit = 0) {
    int port_pipe[2], log_pipe[2];
    REQUIRE(::pipe(port_pipe) == 0);
    REQUIRE(::pipe2(log_pipe, O_CLOEXEC) == 0);
    std::fflush(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(port_pipe[0]);
      ::close(log_pipe[0]);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
      if (fd_limit != 0) {
        rlimit r{};
        ::getrlimit(RLIMIT_NOFILE, &r);
        r.rlim_cur = std::min(fd_limit, r.rlim_max);
        ::setrlimit(RLIMIT_NOFILE, &r);
      }
      const int out = log_pipe[1];
      opts.log = [out](const std::string& line) {
        const std::string l = line + "\n";
        (void)::write(out, l.data(), l.size());
      };
      try {
        ddp::store::tcp_store_server server(std::move(opts));
        const std::uint16_t p = server.port();
        (void)::write(port_pipe[1], &p, sizeof p);
        ::pause();  // until the parent kills it
      } catch (const std::exception& e) {
        std::fprintf(stderr, "server: %s\n", e.what());
      }
      ::_exit(1);
    }
    ::close(port_pipe[1]);
    ::close(log_pipe[1]);
    log_fd = log_pipe[0];
    REQUIRE(::read(port_pipe[0], &port, sizeof port) == sizeof port);
    ::close(port_pipe[0]);
  }
  ~forked_server() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ::close(log_fd);
  }
  const std::string& log() {
    char buf[4096];
    while (ds::poll_one(log_fd, POLLIN, ddp::deadline::after(0ms)) != 0) {
      const ssize_t n = ::read(log_fd, buf, sizeof buf);
      if (n <= 0) break;
      lines.append(buf, static_cast<std::size_t>(n));
    }
    return lines;
  }
  /// Polls the log until it contains `text` or the time is up.
  bool log_shows(const std::string& text, std::chrono::milliseconds within) {
    const auto until = ddp::deadline::after(within);
    while (log().find(text) == std::string::npos) {
      if (until.expired()) return false;
      ds::poll_one(log_fd, POLLIN, until);
    }
    return true;
  }
};

// A raw client that completes the handshake without a token.
ds::unique_fd handshaken(std::uint16_t port) {
  auto fd = ds::connect_with_retry("127.0.0.1", port, ddp::deadline::after(5s));
  const ds::nonce mine{};
  const auto until = ddp::deadline::after(5s);
  REQUIRE(ds::send_all_by(fd.get(), ds::encode_client_hello(mine), until).status == ds::transfer_status::done);
  std::vector<std::byte> hello(ds::server_hello_bytes);
  REQUIRE(ds::recv_exact_by(fd.get(), hello, until).status == ds::transfer_status::done);
  const ds::digest zeros{};
  REQUIRE(ds::send_all_by(fd.get(), ds::encode_client_proof(zeros), until).status == ds::transfer_status::done);
  std::vector<std::byte> verdict(1);
  REQUIRE(ds::recv_exact_by(fd.get(), verdict, until).status == ds::transfer_status::done);
  REQUIRE(verdict[0] == std::byte{1});
  return fd;
}

// Raises this process's descriptor limit to its hard limit; false when that is below `need`.
bool raise_fd_limit(rlim_t need) {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &r);
  return r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= need;
}

}  // namespace

TEST_CASE("server_core: 20 connections each holding an unfinished 64 MiB frame stay within the frame budget") {
  core c({.log = {}});
  auto now = ddp::clock::time_point{} + 1h;
  constexpr int clients = 20;
  for (core::conn_id id = 1; id <= clients; ++id) authenticate(c, id, now);
  const std::vector<std::byte> header = set_header(big_value);
  const std::vector<std::byte> chunk(1 << 20, std::byte{'v'});
  std::vector<std::size_t> sent(clients + 1, 0);
  const std::size_t frame = header.size() + big_value;
  // Every client sends all but the last byte of its frame, as far as the core lets it read.
  for (bool progress = true; progress;) {
    progress = false;
    for (core::conn_id id = 1; id <= clients; ++id) {
      std::vector<std::byte> next;
      if (sent[id] < header.size()) next.assign(header.begin() + static_cast<std::ptrdiff_t>(sent[id]), header.end());
      else next.assign(chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(std::min(chunk.size(), frame - 1 - sent[id])));
      const std::size_t n = std::min(next.size(), c.input_allowance(id));
      if (n == 0) continue;
      c.receive(id, std::span(next).first(n), now);
      sent[id] += n;
      progress = true;
    }
  }
  std::size_t admitted = 0;
  for (core::conn_id id = 1; id <= clients; ++id) admitted += sent[id] == frame - 1;
  const std::size_t bound = core::default_frame_budget + clients * 2 * core::small_frame_bytes;
  WARN(clients << " clients x unfinished 64 MiB frame: " << admitted << " admitted, the server buffers " << (c.input_bytes() >> 20)
               << " MiB (bound: frame budget " << (core::default_frame_budget >> 20) << " MiB + " << clients
               << " x 128 KiB)");
  CHECK(c.input_bytes() <= bound);
  CHECK(admitted >= 1);
  CHECK(c.reserved_bytes() <= core::default_frame_budget);

  // The admitted ones stall: at the frame timeout they are closed, and the next ones get the budget.
  now += 61s;
  c.expire(now);
  std::size_t closed = 0;
  for (core::conn_id id = 1; id <= clients; ++id) closed += c.closing(id);
  CHECK(closed == admitted);
  std::size_t reading = 0;
  for (core::conn_id id = 1; id <= clients; ++id) reading += !c.closing(id) && c.input_allowance(id) > core::small_frame_bytes;
  CHECK(reading >= 1);
  for (core::conn_id id = 1; id <= clients; ++id) c.close(id);
  CHECK(c.reserved_bytes() == 0);
}

TEST_CASE("server_core: unauthenticated connections are capped and hold at most one handshake message") {
  std::vector<std::string> lines;
  core c({.log = [&](const std::string& l) { lines.push_back(l); }, .max_unauthenticated = 64});
  const auto now = ddp::clock::time_point{} + 1h;
  const ds::nonce n{};
  for (core::conn_id id = 1; id <= 1000; ++id) {
    c.open(id, "flood:" + std::to_string(id), n, now);
    if (id % 2 == 0) {  // half of them send a hello and stall before their proof
      c.receive(id, ds::encode_client_hello(n), now);
      CHECK(c.input_allowance(id) == ds::client_proof_bytes);
    } else {
      CHECK(c.input_allowance(id) == ds::client_hello_bytes);
    }
  }
  CHECK(c.num_unauthenticated() <= 64);
  const std::size_t bound = 64 * (ds::client_proof_bytes + ds::server_hello_bytes) * 2;  // vector capacity slack
  INFO("unauthenticated bytes " << c.unauthenticated_bytes());
  CHECK(c.unauthenticated_bytes() <= bound);
  c.expire(now);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains("dropped 936 unauthenticated connection(s), oldest idle first (more than 64 at once)"));
  // The idle ones went first: the survivors all sent a hello.
  std::size_t idle_survivors = 0;
  for (core::conn_id id = 1; id <= 1000; id += 2) idle_survivors += !c.closing(id);
  CHECK(idle_survivors == 0);
}

TEST_CASE("tcp_store: 20 clients each holding an unfinished 64 MiB frame do not grow the server past the frame budget") {
  forked_server server({.port = 0, .token = std::string(), .frame_timeout = 3s});
  const long before = rss_kib(server.pid);
  constexpr int clients = 20;
  std::vector<ds::unique_fd> fds;
  for (int i = 0; i < clients; ++i) fds.push_back(handshaken(server.port));
  const std::vector<std::byte> payload(big_value - 1, std::byte{'v'});
  const auto header = set_header(big_value);
  for (auto& fd : fds) REQUIRE(ds::send_all_by(fd.get(), header, ddp::deadline::after(5s)).status == ds::transfer_status::done);
  std::vector<std::size_t> sent(clients, 0);
  // Push until no client can send more (the server reads no more, the kernel buffers are full).
  const auto until = ddp::deadline::after(60s);
  while (!until.expired()) {
    bool progress = false;
    std::vector<pollfd> want;
    for (int i = 0; i < clients; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      if (sent[ui] == payload.size()) continue;
      const ssize_t n = ::send(fds[ui].get(), payload.data() + sent[ui], payload.size() - sent[ui], MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        sent[ui] += static_cast<std::size_t>(n);
        progress = true;
      }
      want.push_back({fds[ui].get(), POLLOUT, 0});
    }
    if (progress) continue;
    if (want.empty() || ::poll(want.data(), want.size(), 1000) == 0) break;  // a second without room anywhere: settled
  }
  const long after = rss_kib(server.pid);
  std::size_t complete = 0;
  for (const auto s : sent) complete += s == payload.size();
  const long bound_kib = static_cast<long>((core::default_frame_budget + clients * 2 * core::small_frame_bytes) >> 10) + 64 * 1024;
  WARN(clients << " clients x unfinished 64 MiB frame (" << complete << " sent all but the last byte): server RSS "
               << before / 1024 << " MiB -> " << after / 1024 << " MiB (bound: " << bound_kib / 1024
               << " MiB = frame budget + 128 KiB a connection + 64 MiB for the program)");
  if (sanitized_build) {
    // Shadow memory (several bytes per byte the server touches) and ASan's quarantine make RSS
    // no measure of what the server holds; the release build checks the bound.
    WARN("SKIPPED: the RSS bound under a sanitizer (its shadow memory counts in RSS)");
  } else {
    CHECK(after - before <= bound_kib);
  }

  // They stall: each admitted one is closed at the frame timeout, with a line naming the peer and the limit.
  CHECK(server.log_shows("an unfinished request frame (67108873 of 67108874 bytes) for longer than the frame timeout of 3000 ms", 10s));
  CHECK_THAT(server.log(), Catch::Contains("closing the connection from 127.0.0.1:"));
}

TEST_CASE("tcp_store: 1,020 idle connections do not delay a rendezvous by more than 1 s") {
  if (!raise_fd_limit(2200)) {
    WARN("SKIPPED: the hard limit on open files (ulimit -Hn) is below the 2,200 descriptors this test holds");
    return;
  }
  // The server runs with the soft limit a login shell has by default; one variant relies on the
  // cap of unauthenticated connections, the other (a cap above the fd limit) on eviction when
  // descriptors run out.
  for (const std::size_t cap : {std::size_t{512}, std::size_t{4096}}) {
    forked_server server({.port = 0, .token = std::string("flood-token"), .max_unauthenticated = cap}, 1024);
    constexpr int idle = 1020;
    std::vector<ds::unique_fd> flood;
    for (int i = 0; i < idle; ++i) flood.push_back(ds::connect_with_retry("127.0.0.1", server.port, ddp::deadline::after(5s)));
    const auto start = std::chrono::steady_clock::now();
    ddp::store::tcp_store rank({.port = server.port, .timeout = 30s, .token = std::string("flood-token")});
    rank.set_string("rendezvous", "here");
    const bool right = rank.get_string("rendezvous") == "here";
    const auto delay = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // A second rank after the flood has been taken in.
    const auto start2 = std::chrono::steady_clock::now();
    ddp::store::tcp_store rank2({.port = server.port, .timeout = 30s, .token = std::string("flood-token")});
    const bool right2 = rank2.get_string("rendezvous") == "here";
    const auto delay2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count();
    server.log_shows("dropped", 2s);
    const std::string log = server.log();
    WARN(idle << " idle connections, server fd soft limit 1024, cap of unauthenticated connections " << cap
              << ": connect+set+get " << delay << " s, a second rank " << delay2 << " s; server said: " << log.substr(0, log.find('\n')));
    CHECK(right);
    CHECK(right2);
    CHECK(delay < 1.0);
    CHECK(delay2 < 1.0);
    CHECK_THAT(log, Catch::Contains(cap == 512 ? "more than 512 at once" : "out of file descriptors"));
  }
}

}  // namespace ddp_test_store_limits
