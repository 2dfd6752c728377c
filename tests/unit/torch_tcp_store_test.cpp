// torch_tcp_store against PyTorch's TCPStore wire protocol:
//  - byte for byte against exchanges recorded from real torch (tests/data/torch_store_exchanges.json,
//    made by tests/scripts/record_torch_store.py), replayed by a fake server: needs no torch;
//  - servers that close, answer garbage or stay silent, and wait() past its deadline;
//  - live against torch.distributed.TCPStore, both server backends, when DDP_TORCH_PYTHON names a
//    python with torch (else SKIPPED).
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/tcp_store.hpp"
#include "ddp/store/torch_tcp_store.hpp"
#include "support/skip.hpp"

extern char** environ;

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace torch_store_test {

using namespace std::chrono_literals;
using ddp::store::torch_tcp_store;
using bytes_t = std::vector<std::byte>;
using steady = std::chrono::steady_clock;

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

bytes_t unhex(std::string_view h) {
  bytes_t out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

bytes_t to_bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return bytes_t(p, p + s.size());
}

std::string text(const bytes_t& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

long long ms_since(steady::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(steady::now() - t0).count();
}

/// The ddp::error a call throws, if any.
template <class F>
std::optional<ddp::error> error_of(F&& f) {
  try {
    f();
  } catch (const ddp::error& e) {
    return e;
  }
  return std::nullopt;
}

// ---- the recording --------------------------------------------------------------------------

struct step {
  bool from_client;
  bytes_t bytes;
};
using script = std::vector<step>;

struct recording {
  nlohmann::json doc;
  explicit recording(nlohmann::json d) : doc(std::move(d)) {}

  const nlohmann::json& exchanges(std::size_t server) const { return doc.at("servers").at(server).at("exchanges"); }
  std::size_t servers() const { return doc.at("servers").size(); }

  static script steps_of(const nlohmann::json& exchange) {
    script out;
    for (const auto& s : exchange.at("steps")) out.push_back({s.at(0).get<std::string>() == "c", unhex(s.at(1).get<std::string>())});
    return out;
  }

  /// The first exchange of `call` whose args match `args` (a subset).
  const nlohmann::json& find(const std::string& call, const nlohmann::json& args, std::size_t server = 0) const {
    for (const auto& e : exchanges(server)) {
      if (e.at("call") != call) continue;
      bool match = true;
      for (const auto& [k, v] : args.items()) match = match && e.at("args").contains(k) && e.at("args").at(k) == v;
      if (match) return e;
    }
    throw std::runtime_error("no recorded " + call + " " + args.dump());
  }
  script find_steps(const std::string& call, const nlohmann::json& args) const { return steps_of(find(call, args)); }

  /// torch's VALIDATE + PING and the server's echo, with this process's nonce (torch's client
  /// and ours both send getpid()).
  script connect_steps(std::size_t server = 0) const {
    const auto& e = find("connect", nlohmann::json::object(), server);
    auto s = steps_of(e);
    const auto nonce = e.at("args").at("nonce").get<std::uint32_t>();
    const auto ours = static_cast<std::uint32_t>(::getpid());
    for (auto& st : s) {
      REQUIRE(st.bytes.size() >= 4);
      std::uint32_t recorded = 0;
      std::memcpy(&recorded, st.bytes.data() + st.bytes.size() - 4, 4);
      REQUIRE(recorded == nonce);
      std::memcpy(st.bytes.data() + st.bytes.size() - 4, &ours, 4);
    }
    return s;
  }
};

const recording& torch_recording() {
  static const recording r = [] {
    std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/torch_store_exchanges.json");
    if (!in) throw std::runtime_error("cannot open tests/data/torch_store_exchanges.json");
    return recording(nlohmann::json::parse(in));
  }();
  return r;
}

// ---- a fake server --------------------------------------------------------------------------

// Listens on 127.0.0.1, accepts one connection and runs `handler` on it in its own thread.
// Problems are collected (Catch's assertions belong to the test's thread) and read after join().
class fake_server {
 public:
  using handler_fn = std::function<void(fake_server&, int)>;

  explicit fake_server(handler_fn handler, std::uint16_t port = 0, std::chrono::milliseconds start_after = 0ms)
      : handler_(std::move(handler)), port_(port) {
    if (start_after == 0ms) listen_now();
    thread_ = std::thread([this, start_after] {
      if (start_after > 0ms) {
        std::this_thread::sleep_for(start_after);
        listen_now();
      }
      serve();
    });
  }
  ~fake_server() { join(); }
  fake_server(const fake_server&) = delete;
  fake_server& operator=(const fake_server&) = delete;

  std::uint16_t port() const { return port_; }

  void join() {
    if (thread_.joinable()) thread_.join();
  }
  std::string problems() {
    std::lock_guard g(mutex_);
    return problems_;
  }
  void note(const std::string& problem) {
    std::lock_guard g(mutex_);
    problems_ += problem + "\n";
  }

  /// Reads n bytes, up to 10 s; false (with what came) on EOF, reset or timeout.
  static bool read_exact(int fd, std::size_t n, bytes_t& out) {
    out.clear();
    const auto until = steady::now() + 10s;
    while (out.size() < n) {
      pollfd p{fd, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      std::byte buf[4096];
      const ssize_t r = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
      if (r <= 0) return false;
      out.insert(out.end(), buf, buf + r);
    }
    return true;
  }
  /// Everything until the client closes (up to 10 s).
  static bytes_t read_to_end(int fd) {
    bytes_t out, chunk;
    while (read_exact(fd, 1, chunk)) out.insert(out.end(), chunk.begin(), chunk.end());
    return out;
  }
  static void write_all(int fd, std::span<const std::byte> data) {
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t r = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (r <= 0) return;
      done += static_cast<std::size_t>(r);
    }
  }

  /// Plays `steps` (reading the client's bytes and comparing them, writing the server's), then
  /// checks that the client sends nothing more before it closes.
  void play(int fd, const script& steps) {
    for (const auto& st : steps) {
      if (!st.from_client) {
        write_all(fd, st.bytes);
        continue;
      }
      bytes_t got;
      const bool complete = read_exact(fd, st.bytes.size(), got);
      if (!complete || got != st.bytes) {
        note("the client sent " + hex(got) + (complete ? "" : " (then nothing more)") + ", torch's client sent " + hex(st.bytes));
        return;
      }
    }
    const auto extra = read_to_end(fd);
    if (!extra.empty()) note("after the script, the client sent " + hex(extra));
  }

 private:
  void listen_now() {
    listener_.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    int one = 1;
    ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port_);
    if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listener_.get(), 8) != 0) {
      note("cannot listen on 127.0.0.1:" + std::to_string(port_));
      return;
    }
    socklen_t len = sizeof a;
    ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }

  void serve() {
    pollfd p{listener_.get(), POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) {
      note("no client connected within 10 s");
      return;
    }
    ddp::detail::unique_fd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    listener_.reset();
    if (conn) handler_(*this, conn.get());
  }

  handler_fn handler_;
  std::uint16_t port_;
  ddp::detail::unique_fd listener_;
  std::mutex mutex_;
  std::string problems_;
  std::thread thread_;
};

script concat(std::initializer_list<script> parts) {
  script out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Answers VALIDATE + PING as a torch server does; false if the client did not send them.
bool torch_handshake(fake_server& s, int fd) {
  const auto expected = torch_recording().connect_steps();
  bytes_t got;
  if (!fake_server::read_exact(fd, expected.at(0).bytes.size(), got) || got != expected.at(0).bytes) {
    s.note("handshake: the client sent " + hex(got));
    return false;
  }
  fake_server::write_all(fd, expected.at(1).bytes);
  return true;
}

constexpr const char* prefix = "/worker/attempt_0";

// A port nothing listens on now (bound, read back, released).
std::uint16_t free_port() {
  ddp::detail::unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("bind");
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

// ---- replaying the recording ----------------------------------------------------------------

// What the fake server plays for one recorded exchange: torch's steps, and after a wait on
// several keys that timed out, one CHECK per key (ddp names the missing keys; torch does not).
script expected_steps(const recording& rec, const nlohmann::json& e) {
  auto steps = recording::steps_of(e);
  if (e.at("call") == "wait" && e.contains("error") && e.at("args").at("keys").size() > 1) {
    for (const auto& k : e.at("args").at("keys")) steps = concat({steps, rec.find_steps("check", {{"keys", {k}}})});
  }
  return steps;
}

// Drives `client` through one recorded exchange and checks the decoded answer.
void drive(const nlohmann::json& e, torch_tcp_store& client) {
  const std::string call = e.at("call");
  const auto& args = e.at("args");
  INFO("call " << call << " " << args.dump());
  const auto result_bytes = [&] { return unhex(e.at("result_hex").get<std::string>()); };
  if (call == "set") {
    client.set(args.at("key"), unhex(args.at("value_hex").get<std::string>()));
  } else if (call == "get") {
    CHECK(client.get(args.at("key")) == result_bytes());
  } else if (call == "add") {
    CHECK(client.add(args.at("key"), args.at("delta").get<std::int64_t>()) == e.at("result").get<std::int64_t>());
  } else if (call == "compare_set") {
    CHECK(client.compare_set(args.at("key"), unhex(args.at("expected_hex").get<std::string>()),
                             unhex(args.at("desired_hex").get<std::string>())) == result_bytes());
  } else if (call == "check") {
    CHECK(client.check(args.at("keys").get<std::vector<std::string>>()) == e.at("result").get<bool>());
  } else if (call == "wait") {
    const auto keys = args.at("keys").get<std::vector<std::string>>();
    const auto timeout = std::chrono::milliseconds(args.at("timeout_ms").get<int>());
    if (!e.contains("error")) {
      client.wait(keys, timeout);
    } else {
      const auto t0 = steady::now();
      const auto err = error_of([&] { client.wait(keys, timeout); });
      REQUIRE(err.has_value());
      CHECK(err->code() == ddp::errc::timeout);
      CHECK(ms_since(t0) >= timeout.count() - 5);
      CHECK(err->message().find("'missing'") != std::string::npos);
      CHECK(err->message().find("'key'") == std::string::npos);  // it exists: not named
    }
  } else if (call == "delete_key") {
    CHECK(client.erase(args.at("key")) == e.at("result").get<bool>());
  } else if (call == "num_keys") {
    CHECK(client.num_keys() == e.at("result").get<std::int64_t>());
  } else {
    FAIL("unknown recorded call " << call);
  }
}

// Replays the exchanges of one recorded server whose no_prefix flag is `no_prefix`: the fake
// server reads and compares every byte our client sends, and answers with torch's bytes.
void replay(std::size_t server, bool no_prefix) {
  const auto& rec = torch_recording();
  std::vector<const nlohmann::json*> calls;
  script steps;
  for (const auto& e : rec.exchanges(server)) {
    if (e.at("call") == "connect" || e.at("args").value("no_prefix", false) != no_prefix) continue;
    calls.push_back(&e);
    steps = concat({steps, expected_steps(rec, e)});
  }
  REQUIRE(calls.size() >= (no_prefix ? 2u : 20u));
  fake_server server_side([&](fake_server& s, int fd) {
    if (torch_handshake(s, fd)) s.play(fd, steps);
  });
  std::string call_error;
  try {
    torch_tcp_store client("127.0.0.1", server_side.port(), 10s, no_prefix ? "" : prefix);
    CHECK(client.key_prefix() == (no_prefix ? "" : prefix));
    for (const auto* e : calls) drive(*e, client);
  } catch (const std::exception& e) {
    call_error = e.what();
  }
  server_side.join();
  INFO("server: " << server_side.problems());
  CHECK(server_side.problems().empty());
  REQUIRE(call_error.empty());
}

}  // namespace

TEST_CASE("torch_tcp_store: the recording of real torch holds the protocol facts the client relies on") {
  const auto& rec = torch_recording();
  INFO("torch " << rec.doc.at("torch_version").get<std::string>());
  REQUIRE(rec.servers() == 2);  // use_libuv=True and False
  CHECK(rec.doc.at("prefix") == prefix);
  // VALIDATE = 0 with the magic 0x3C85F7CE, PING = 13 with a uint32 nonce, echoed.
  const auto c = torch_recording().connect_steps();
  CHECK(hex(c.at(0).bytes).substr(0, 12) == "00cef7853c0d");
  // Every key travels as "/" + prefix + "/" + key, its length a uint64.
  const auto set = rec.find_steps("set", {{"key", "key"}});
  CHECK(hex(set.at(0).bytes).substr(0, 18) == "011600000000000000");
  CHECK(text(set.at(0).bytes).substr(9, 22) == "//worker/attempt_0/key");
  // Both server backends answered identically.
  for (std::size_t i = 0; i < rec.exchanges(0).size(); ++i) CHECK(rec.exchanges(0)[i].at("steps") == rec.exchanges(1)[i].at("steps"));
}

TEST_CASE("torch_tcp_store: sends torch's client's bytes and decodes its server's answers (replayed recording)") {
  const auto& rec = torch_recording();
  for (std::size_t server = 0; server < rec.servers(); ++server) {
    for (bool no_prefix : {false, true}) {
      DYNAMIC_SECTION("use_libuv=" << rec.doc.at("servers")[server].at("use_libuv") << (no_prefix ? ", no prefix" : ", prefix")) {
        replay(server, no_prefix);
      }
    }
  }
}

TEST_CASE("torch_tcp_store: get() is WAIT then GET and waits for a key that comes later") {
  const auto& rec = torch_recording();
  const auto get = rec.find_steps("get", {{"key", "key"}});
  REQUIRE(get.size() == 4);  // WAIT, STOP_WAITING, GET, value
  fake_server server([&](fake_server& s, int fd) {
    if (!torch_handshake(s, fd)) return;
    bytes_t got;
    if (!fake_server::read_exact(fd, get[0].bytes.size(), got) || got != get[0].bytes) return s.note("WAIT: " + hex(got));
    std::this_thread::sleep_for(300ms);  // the key is set later
    s.play(fd, {get[1], get[2], get[3]});
  });
  {
    torch_tcp_store client("127.0.0.1", server.port(), 10s, prefix);
    const auto t0 = steady::now();
    CHECK(client.get_string("key") == "value");
    CHECK(ms_since(t0) >= 250);
  }
  server.join();
  INFO(server.problems());
  CHECK(server.problems().empty());
}

TEST_CASE("torch_tcp_store: wait() past its deadline cancels and an answer crossing the cancel means the keys came") {
  const auto& rec = torch_recording();
  const auto timed_out = rec.find_steps("wait", {{"keys", {"missing"}}});
  REQUIRE(timed_out.size() == 2);  // WAIT + CANCEL_WAIT, then WAIT_CANCELED
  REQUIRE(hex(timed_out[0].bytes).substr(hex(timed_out[0].bytes).size() - 2) == "0c");
  const auto num_keys = rec.find_steps("num_keys", nlohmann::json::object());
  fake_server server([&](fake_server& s, int fd) {
    if (!torch_handshake(s, fd)) return;
    // STOP_WAITING was on its way when the client cancelled; WAIT_CANCELED follows.
    s.play(fd, concat({{timed_out[0], step{false, {std::byte{0}, std::byte{1}}}}, num_keys}));
  });
  {
    torch_tcp_store client("127.0.0.1", server.port(), 10s, prefix);
    const auto t0 = steady::now();
    client.wait({"missing"}, 200ms);  // no throw: the key came as the deadline passed
    CHECK(ms_since(t0) >= 195);
    CHECK(client.num_keys() == 4);  // both answers were drained: the stream is in step
  }
  server.join();
  INFO(server.problems());
  CHECK(server.problems().empty());
}

TEST_CASE("torch_tcp_store: wait() with a zero timeout is one CHECK and errc::timeout names the missing keys") {
  const auto& rec = torch_recording();
  const auto check_both = rec.find_steps("check", {{"keys", {"key", "missing"}}});
  const auto check_key = rec.find_steps("check", {{"keys", {"key"}}});
  const auto check_missing = rec.find_steps("check", {{"keys", {"missing"}}});
  fake_server server([&](fake_server& s, int fd) {
    if (!torch_handshake(s, fd)) return;
    s.play(fd, concat({check_key, check_both, check_key, check_missing}));
  });
  {
    torch_tcp_store client("127.0.0.1", server.port(), 10s, prefix);
    client.wait({"key"}, 0ms);
    const auto err = error_of([&] { client.wait({"key", "missing"}, 0ms); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::timeout);
    CHECK(err->message().find("keys 'missing' not set within 0 ms") != std::string::npos);
    CHECK(err->message().find("prefix '/worker/attempt_0'") != std::string::npos);
  }
  server.join();
  INFO(server.problems());
  CHECK(server.problems().empty());
}

TEST_CASE("torch_tcp_store: a server that closes mid-call is errc::store at once and the client stays failed") {
  const auto& rec = torch_recording();
  const auto add = rec.find_steps("add", {{"key", "counter"}, {"delta", 5}});
  const auto wait = rec.find_steps("wait", {{"keys", {"key", "counter"}}});
  const auto get = rec.find_steps("get", {{"key", "key"}});

  SECTION("after reading a request") {
    fake_server server([&](fake_server& s, int fd) {
      if (!torch_handshake(s, fd)) return;
      bytes_t got;
      fake_server::read_exact(fd, add[0].bytes.size(), got);  // then close
    });
    torch_tcp_store client("127.0.0.1", server.port(), 60s, prefix);
    const auto t0 = steady::now();
    const auto err = error_of([&] { client.add("counter", 5); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::store);
    CHECK(err->message().find("store server 127.0.0.1:" + std::to_string(server.port()) + " closed the connection") == 0);
    CHECK(ms_since(t0) < 2000);
    const auto later = error_of([&] { client.num_keys(); });
    REQUIRE(later.has_value());
    CHECK(later->code() == ddp::errc::store);
    CHECK(later->message().find("failed earlier") != std::string::npos);
  }
  SECTION("while the client waits") {
    fake_server server([&](fake_server& s, int fd) {
      if (!torch_handshake(s, fd)) return;
      bytes_t got;
      fake_server::read_exact(fd, wait[0].bytes.size(), got);
      std::this_thread::sleep_for(100ms);
    });
    torch_tcp_store client("127.0.0.1", server.port(), 60s, prefix);
    const auto t0 = steady::now();
    const auto err = error_of([&] { client.wait({"key", "counter"}, 60s); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::store);
    CHECK(err->message().find("closed the connection") != std::string::npos);
    CHECK(ms_since(t0) < 2000);
  }
  SECTION("in the middle of an answer") {
    fake_server server([&](fake_server& s, int fd) {
      if (!torch_handshake(s, fd)) return;
      bytes_t got;
      fake_server::read_exact(fd, get[0].bytes.size(), got);
      fake_server::write_all(fd, get[1].bytes);
      fake_server::read_exact(fd, get[2].bytes.size(), got);
      fake_server::write_all(fd, std::span(get[3].bytes).first(10));  // length, then 2 of 5 bytes
    });
    torch_tcp_store client("127.0.0.1", server.port(), 60s, prefix);
    const auto t0 = steady::now();
    const auto err = error_of([&] { client.get("key"); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::store);
    CHECK(err->message().find("closed the connection") != std::string::npos);
    CHECK(ms_since(t0) < 2000);
  }
}

TEST_CASE("torch_tcp_store: a server that does not speak PyTorch's protocol is one errc::store line") {
  const auto check_line = [](const ddp::error& e, const std::string& why) {
    INFO(e.what());
    CHECK(e.code() == ddp::errc::store);
    CHECK(e.message().find("does not speak PyTorch's TCPStore protocol") != std::string::npos);
    CHECK(e.message().find(why) != std::string::npos);
    CHECK(std::string(e.what()).find('\n') == std::string::npos);
  };
  SECTION("garbage answer to PING") {
    fake_server server([](fake_server&, int fd) {
      bytes_t got;
      fake_server::read_exact(fd, 10, got);
      fake_server::write_all(fd, to_bytes("HTTP/1.1 400\r\n"));
    });
    const auto t0 = steady::now();
    const auto err = error_of([&] { torch_tcp_store("127.0.0.1", server.port(), 30s, prefix); });
    REQUIRE(err.has_value());
    check_line(*err, "answered PING with 0x");
    CHECK(ms_since(t0) < 2000);
  }
  SECTION("closes after VALIDATE and PING") {
    fake_server server([](fake_server&, int fd) {
      bytes_t got;
      fake_server::read_exact(fd, 10, got);
    });
    const auto t0 = steady::now();
    const auto err = error_of([&] { torch_tcp_store("127.0.0.1", server.port(), 30s, prefix); });
    REQUIRE(err.has_value());
    check_line(*err, "closed the connection");
    CHECK(ms_since(t0) < 2000);
  }
  SECTION("stays silent") {
    fake_server server([](fake_server&, int fd) { fake_server::read_to_end(fd); });
    const auto err = error_of([&] { torch_tcp_store("127.0.0.1", server.port(), 300ms, prefix); });
    REQUIRE(err.has_value());
    check_line(*err, "no answer to PING");
  }
  SECTION("ddp's own store server") {
    ddp::store::tcp_store_server::options opts;
    opts.host = "127.0.0.1";
    opts.port = 0;
    opts.token = std::string();
    opts.log = [](const std::string&) {};
    ddp::store::tcp_store_server ddp_server(opts);
    const auto t0 = steady::now();
    const auto err = error_of([&] { torch_tcp_store("127.0.0.1", ddp_server.port(), 5s, prefix); });
    REQUIRE(err.has_value());
    check_line(*err, "verified with PyTorch 2.15");
    CHECK(ms_since(t0) < 4000);
  }
}

TEST_CASE("torch_tcp_store: connects to a server that starts later and no server is errc::timeout at the deadline") {
  const std::uint16_t port = free_port();
  SECTION("later") {
    const auto num_keys = torch_recording().find_steps("num_keys", nlohmann::json::object());
    fake_server server(
        [&](fake_server& s, int fd) {
          if (torch_handshake(s, fd)) s.play(fd, num_keys);
        },
        port, 500ms);
    {
      torch_tcp_store client("127.0.0.1", port, 10s, prefix);
      CHECK(client.num_keys() == 4);
    }
    server.join();
    INFO(server.problems());
    CHECK(server.problems().empty());
  }
  SECTION("never") {
    const auto t0 = steady::now();
    const auto err = error_of([&] { torch_tcp_store("127.0.0.1", port, 300ms, prefix); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::timeout);
    CHECK(err->message().find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
    CHECK(ms_since(t0) >= 250);
  }
}

TEST_CASE("torch_tcp_store: keys and values PyTorch's server would reset on are errc::invalid_argument before sending") {
  const auto num_keys = torch_recording().find_steps("num_keys", nlohmann::json::object());
  fake_server server([&](fake_server& s, int fd) {
    if (torch_handshake(s, fd)) s.play(fd, num_keys);
  });
  {
    torch_tcp_store client("127.0.0.1", server.port(), 10s, std::string(5000, 'p'));
    const bytes_t big((8u << 20) + 1, std::byte{1});
    auto err = error_of([&] { client.set("k", big); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::invalid_argument);
    err = error_of([&] { client.compare_set("k", {}, big); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::invalid_argument);
    err = error_of([&] { client.set_string(std::string(4000, 'k'), "v"); });  // 1 + 5000 + 1 + 4000 > 8192
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::invalid_argument);
    err = error_of([&] { client.get(""); });
    REQUIRE(err.has_value());
    CHECK(err->code() == ddp::errc::invalid_argument);
    CHECK(client.num_keys() == 4);  // still in step
  }
  server.join();
  INFO(server.problems());
  CHECK(server.problems().empty());
}

TEST_CASE("torch_tcp_store: calls from several threads share the one connection") {
  constexpr int threads = 4, calls = 25;
  const auto num_keys = torch_recording().find_steps("num_keys", nlohmann::json::object());
  fake_server server([&](fake_server& s, int fd) {
    if (!torch_handshake(s, fd)) return;
    for (std::int64_t i = 0; i < threads * calls; ++i) {
      bytes_t got;
      if (!fake_server::read_exact(fd, num_keys[0].bytes.size(), got) || got != num_keys[0].bytes) return s.note("got " + hex(got));
      bytes_t answer(8);
      std::memcpy(answer.data(), &i, 8);
      fake_server::write_all(fd, answer);
    }
  });
  std::vector<std::int64_t> seen;
  {
    torch_tcp_store client("127.0.0.1", server.port(), 10s, prefix);
    std::mutex m;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        for (int c = 0; c < calls; ++c) {
          const auto n = client.num_keys();
          std::lock_guard g(m);
          seen.push_back(n);
        }
      });
    }
    for (auto& th : pool) th.join();
  }
  server.join();
  std::sort(seen.begin(), seen.end());
  std::vector<std::int64_t> expected(threads * calls);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::int64_t>(i);
  CHECK(seen == expected);
  CHECK(server.problems().empty());
}

// ---- live, against real PyTorch ------------------------------------------------------------

namespace {

// The torch side: a TCPStore server (is_master=True) and, in the same process, a torch client
// with the PrefixStore that reads what ddp wrote and writes for ddp to read.
constexpr const char* torch_side = R"PY(
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
use_libuv, prefix = sys.argv[1] == "1", sys.argv[2]
server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=use_libuv, wait_for_workers=False,
                       timeout=timedelta(seconds=60))
raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
store = dist.PrefixStore(prefix, raw)
store.set("from_torch", "hello from torch")
store.add("torch_counter", 7)
print("PORT", server.port, torch.__version__, flush=True)
assert sys.stdin.readline().strip() == "go"
seen = [store.get("from_ddp").decode().replace(" ", "_"), store.get("ddp_counter").decode(),
        store.compare_set("ddp_cas", "one", "two").decode(), str(raw.check([prefix + "/from_ddp"]))]
print("TORCH_SAW", *seen, flush=True)
time.sleep(0.3)
store.set("late", "set late by torch")
assert sys.stdin.readline().strip() == "bye"
print("TORCH_DONE", flush=True)
)PY";

class python_process {
 public:
  python_process(const std::string& python, const std::vector<std::string>& args) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    std::vector<std::string> argv{python, "-c", torch_side};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, python.c_str(), &fa, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    in_.reset(in[1]);
    out_.reset(out[0]);
    if (rc != 0) {
      pid_ = -1;
      throw std::runtime_error("cannot start " + python + ": " + std::strerror(rc));
    }
  }
  ~python_process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  python_process(const python_process&) = delete;
  python_process& operator=(const python_process&) = delete;

  /// The next line of its stdout, "" at EOF or after the timeout.
  std::string read_line(std::chrono::milliseconds timeout) {
    const auto until = steady::now() + timeout;
    while (buf_.find('\n') == std::string::npos) {
      pollfd p{out_.get(), POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return "";
      char chunk[1024];
      const ssize_t n = ::read(out_.get(), chunk, sizeof chunk);
      if (n <= 0) return "";
      buf_.append(chunk, static_cast<std::size_t>(n));
    }
    const auto nl = buf_.find('\n');
    std::string line = buf_.substr(0, nl);
    buf_.erase(0, nl + 1);
    return line;
  }
  void write_line(const std::string& line) {
    const std::string s = line + "\n";
    if (::write(in_.get(), s.data(), s.size()) != static_cast<ssize_t>(s.size())) throw std::runtime_error("write to python");
  }
  int wait_exit() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  ddp::detail::unique_fd in_, out_;
  std::string buf_;
};

void live_against_torch(bool use_libuv) {
  const char* python = std::getenv("DDP_TORCH_PYTHON");
  if (python == nullptr || *python == '\0') {
    ddp::test::skip("DDP_TORCH_PYTHON is not set (a python with torch, e.g. $(tools/torch-venv.sh)/bin/python)");  // exits 77
  }
  if (::access(python, X_OK) != 0) {
    ddp::test::skip(std::string("no python at DDP_TORCH_PYTHON=") + python + " (make it with tools/torch-venv.sh)");
  }
  const std::string live_prefix = "/worker/attempt_3";
  python_process py(python, {use_libuv ? "1" : "0", live_prefix});
  const auto hello = py.read_line(120s);
  INFO("python said: " << hello);
  REQUIRE(hello.rfind("PORT ", 0) == 0);
  const auto port = static_cast<std::uint16_t>(std::stoi(hello.substr(5)));

  torch_tcp_store s("127.0.0.1", port, 30s, live_prefix);
  s.set_string("from_ddp", "hello from ddp");
  CHECK(s.add("ddp_counter", 40) == 40);
  CHECK(s.add("ddp_counter", 2) == 42);
  CHECK(text(s.compare_set("ddp_cas", {}, to_bytes("one"))) == "one");
  py.write_line("go");
  CHECK(py.read_line(60s) == "TORCH_SAW hello_from_ddp 42 two True");

  CHECK(s.get_string("from_torch") == "hello from torch");
  CHECK(s.add("torch_counter", 0) == 7);
  CHECK(s.get_string("ddp_cas") == "two");
  CHECK(s.get_string("late") == "set late by torch");  // WAIT, then GET, on a key torch sets later
  CHECK(s.check({"from_torch", "from_ddp"}));
  CHECK_FALSE(s.check({"from_torch", "nope"}));
  const auto t0 = steady::now();
  const auto err = error_of([&] { s.wait({"nope", "from_torch"}, 200ms); });
  REQUIRE(err.has_value());
  CHECK(err->code() == ddp::errc::timeout);
  CHECK(err->message().find("keys 'nope' not set") != std::string::npos);
  CHECK(ms_since(t0) >= 195);
  s.wait({"from_torch", "late"}, 5s);  // still in step after the cancelled wait
  s.wait({"late"}, 0ms);
  CHECK(s.num_keys() == 6);  // from_torch, torch_counter, from_ddp, ddp_counter, ddp_cas, late
  CHECK(s.erase("from_ddp"));
  CHECK_FALSE(s.erase("from_ddp"));
  CHECK_FALSE(s.check({"from_ddp"}));
  CHECK(text(s.compare_set("absent", to_bytes("x"), to_bytes("y"))) == "x");
  {
    torch_tcp_store plain("127.0.0.1", port, 30s);  // no prefix: the full names
    CHECK(plain.get_string(live_prefix + "/from_torch") == "hello from torch");
  }
  py.write_line("bye");
  CHECK(py.read_line(30s) == "TORCH_DONE");
  CHECK(py.wait_exit() == 0);
}

}  // namespace

TEST_CASE("torch_tcp_store: live against torch.distributed.TCPStore(use_libuv=True)", "[torch]") { live_against_torch(true); }

TEST_CASE("torch_tcp_store: live against torch.distributed.TCPStore(use_libuv=False)", "[torch]") { live_against_torch(false); }

}  // namespace torch_store_test
