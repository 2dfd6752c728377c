#pragma once
// torch_tcp_store: a client of PyTorch's c10d TCPStore server, behind ddp's store interface.
//
// Under torchrun the elastic agent itself serves a TCPStore at MASTER_ADDR:MASTER_PORT and sets
// TORCHELASTIC_USE_AGENT_STORE=True; its workers are clients of that store, with their keys under
// "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>". This class is such a client:
//
//   ddp::store::torch_tcp_store s(addr, port, timeout, "/worker/attempt_0");
//   s.set_string("k", "v");   // what torch's PrefixStore("/worker/attempt_0", TCPStore(...)).set("k", "v") sends
//
// PyTorch versions: it speaks to PyTorch servers that answer PING, which torch's own client sends
// at connect since 2024 (the first such release is not pinned here: 2.2's sources have no PING,
// 2.8's have it). Verified byte for byte against 2.15.0, both server backends
// (use_libuv=True and False): tests/data/torch_store_exchanges.json, recorded by
// tests/scripts/record_torch_store.py. The opcode table below is the same in PyTorch's sources of
// 2.8 and 2.15 (opcodes are only appended). Servers without PING (2.2), without VALIDATE and with
// another opcode table (2.0, 2.1), and ddp's own tcp_store server get one errc::store line saying
// that the server does not speak this protocol.
//
// Protocol (torch/csrc/distributed/c10d/TCPStore.cpp, TCPStoreBackend.hpp, Utils.hpp): requests
// are one opcode byte then arguments; a string or byte vector is its length as uint64 then its
// bytes; integers are in host byte order (as torch writes them; every platform here is
// little-endian). At connect the client sends VALIDATE + uint32 magic (no answer) and PING +
// uint32 nonce, which the server echoes. The TCPStore client puts "/" in front of every key, and
// PrefixStore joins prefix and key with "/": key k under prefix P travels as "/" + P + "/" + k.
// get() is WAIT then GET, as torch's client does it. wait() past its deadline sends CANCEL_WAIT
// and reads the answers still due (STOP_WAITING may have crossed the cancel on the wire).
//
// Semantics and errors are those of ddp's tcp_store client: connecting retries until the deadline
// (the server may come up later); a server that closes the connection is errc::store at once
// ("store server H:P closed the connection"), and the client then stays failed; errc::timeout
// names the missing keys; calls from several threads are serialized on the one connection; never
// use one across fork(). Differences that come from the server:
//  - num_keys() counts every key on the server, not only this prefix's (torch's own keys too);
//  - PyTorch's libuv server (torchrun's default) resets the connection on a wire key over 8 KiB or
//    a value over 8 MiB; this client refuses those with errc::invalid_argument instead;
//  - add() on a key that holds no integer makes PyTorch's server drop the connection (errc::store).

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/store/detail/bytes.hpp"
#include "ddp/store/detail/socket.hpp"
#include "ddp/store/store.hpp"

namespace ddp::store {

namespace torch_wire {

/// c10d::detail::QueryType (TCPStoreBackend.hpp): the opcode byte of each request.
enum class query : std::uint8_t {
  validate = 0,
  set = 1,
  compare_set = 2,
  get = 3,
  add = 4,
  check = 5,
  wait = 6,
  get_num_keys = 7,
  delete_key = 8,
  // append = 9, multi_get = 10, multi_set = 11: not used
  cancel_wait = 12,
  ping = 13,
};

/// c10d::detail::validationMagicNumber, the argument of VALIDATE.
inline constexpr std::uint32_t validation_magic = 0x3C85F7CE;

// CheckResponseType and WaitResponseType: one byte each.
inline constexpr std::uint8_t check_ready = 0;
inline constexpr std::uint8_t check_not_ready = 1;
inline constexpr std::uint8_t wait_stop_waiting = 0;
inline constexpr std::uint8_t wait_canceled = 1;

// The libuv server's limits (MAX_STRING_LEN, MAX_PAYLOAD_LEN): past them it resets the connection.
inline constexpr std::size_t max_wire_key_bytes = 8 * 1024;
inline constexpr std::size_t max_wire_value_bytes = 8 * 1024 * 1024;

template <class T>
inline void put(std::vector<std::byte>& out, T value) {
  const auto at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

template <class T>
inline T get(const std::byte* at) noexcept {
  T value{};
  std::memcpy(&value, at, sizeof(T));
  return value;
}

inline void put_blob(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  put<std::uint64_t>(out, bytes.size());
  out.insert(out.end(), bytes.begin(), bytes.end());
}

inline void put_string(std::vector<std::byte>& out, const std::string& s) {
  put_blob(out, std::as_bytes(std::span(s.data(), s.size())));
}

inline std::vector<std::byte> request(query q) { return {static_cast<std::byte>(q)}; }

}  // namespace torch_wire

class torch_tcp_store final : public store {
 public:
  /// Connects to the TCPStore server at host:port, retrying until connect_timeout, which is also
  /// the initial timeout() of every call. key_prefix "" uses keys as they are; otherwise key k is
  /// key_prefix + "/" + k, as torch's PrefixStore(key_prefix, store) makes it.
  torch_tcp_store(std::string host, std::uint16_t port, std::chrono::milliseconds connect_timeout,
                  std::string key_prefix = "")
      : host_(std::move(host)), port_(port), prefix_(std::move(key_prefix)) {
    set_timeout(connect_timeout);
    connect(deadline::after(connect_timeout));
  }

  torch_tcp_store(const torch_tcp_store&) = delete;
  torch_tcp_store& operator=(const torch_tcp_store&) = delete;
  ~torch_tcp_store() override = default;

  const std::string& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::string address() const { return detail::host_port(host_, port_); }
  const std::string& key_prefix() const noexcept { return prefix_; }

  void set(const std::string& key, std::span<const std::byte> value) override {
    auto req = torch_wire::request(torch_wire::query::set);
    torch_wire::put_string(req, wire_key(key));
    check_torch_value(value, "store.set");
    torch_wire::put_blob(req, value);
    std::lock_guard guard(mutex_);
    send_request(req, deadline::after(timeout()), "store.set");
  }

  std::vector<std::byte> get(const std::string& key) override {
    const auto wire = wire_key(key);
    std::lock_guard guard(mutex_);
    wait_locked({key}, {wire}, timeout(), "store.get");
    auto req = torch_wire::request(torch_wire::query::get);
    torch_wire::put_string(req, wire);
    const auto until = deadline::after(timeout());
    send_request(req, until, "store.get");
    return recv_blob(until, "store.get");
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    auto req = torch_wire::request(torch_wire::query::add);
    torch_wire::put_string(req, wire_key(key));
    torch_wire::put<std::int64_t>(req, delta);
    std::lock_guard guard(mutex_);
    const auto until = deadline::after(timeout());
    send_request(req, until, "store.add");
    return recv_value<std::int64_t>(until, "store.add");
  }

  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                     std::span<const std::byte> desired) override {
    auto req = torch_wire::request(torch_wire::query::compare_set);
    torch_wire::put_string(req, wire_key(key));
    check_torch_value(expected, "store.compare_set");
    check_torch_value(desired, "store.compare_set");
    torch_wire::put_blob(req, expected);
    torch_wire::put_blob(req, desired);
    std::lock_guard guard(mutex_);
    const auto until = deadline::after(timeout());
    send_request(req, until, "store.compare_set");
    return recv_blob(until, "store.compare_set");
  }

  using store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) override {
    if (keys.empty()) return;
    std::vector<std::string> wire;
    wire.reserve(keys.size());
    for (const auto& k : keys) wire.push_back(wire_key(k));
    std::lock_guard guard(mutex_);
    wait_locked(keys, wire, t, "store.wait");
  }

  /// Whether all keys exist now (torch's Store.check): one CHECK, no waiting.
  bool check(const std::vector<std::string>& keys) {
    std::vector<std::string> wire;
    wire.reserve(keys.size());
    for (const auto& k : keys) wire.push_back(wire_key(k));
    std::lock_guard guard(mutex_);
    return check_locked(wire, deadline::after(timeout()), "store.check");
  }

  bool erase(const std::string& key) override {
    auto req = torch_wire::request(torch_wire::query::delete_key);
    torch_wire::put_string(req, wire_key(key));
    std::lock_guard guard(mutex_);
    const auto until = deadline::after(timeout());
    send_request(req, until, "store.erase");
    return recv_value<std::int64_t>(until, "store.erase") == 1;
  }

  /// Every key on the server, not only this prefix's: the TCPStore protocol counts them all.
  std::int64_t num_keys() override {
    const auto req = torch_wire::request(torch_wire::query::get_num_keys);
    std::lock_guard guard(mutex_);
    const auto until = deadline::after(timeout());
    send_request(req, until, "store.num_keys");
    return recv_value<std::int64_t>(until, "store.num_keys");
  }

 private:
  // "/" from TCPStore, then PrefixStore's prefix + "/".
  std::string wire_key(const std::string& key) const {
    check_key(key);
    std::string wire = prefix_.empty() ? "/" + key : "/" + prefix_ + "/" + key;
    if (wire.size() > torch_wire::max_wire_key_bytes) {
      throw error(errc::invalid_argument, "store key of " + std::to_string(wire.size()) +
                                              " bytes with its prefix: PyTorch's TCPStore server takes at most " +
                                              std::to_string(torch_wire::max_wire_key_bytes));
    }
    return wire;
  }

  // Built field by field: the headers compile without -Wno-missing-field-initializers.
  static error_context context(const char* op) {
    error_context c;
    c.op = op;
    return c;
  }

  static void check_torch_value(std::span<const std::byte> value, const char* op) {
    if (value.size() > torch_wire::max_wire_value_bytes) {
      throw error(errc::invalid_argument, "store value of " + std::to_string(value.size()) +
                                              " bytes: PyTorch's TCPStore server takes at most " +
                                              std::to_string(torch_wire::max_wire_value_bytes),
                  context(op));
    }
  }

  std::string not_torch(const std::string& why) const {
    return "store server " + address() + " does not speak PyTorch's TCPStore protocol (" + why +
           "); it needs a PyTorch TCPStore server that answers PING (verified with PyTorch 2.15)";
  }

  // VALIDATE then PING, as torch's client starts. A reset before the answer is retried until the
  // deadline (torch retries too: a full listen backlog resets new connections); an answer that is
  // not our nonce, or the server closing, means another protocol.
  void connect(const deadline& until) {
    const char* op = "store.connect";
    const auto nonce = static_cast<std::uint32_t>(::getpid());
    auto hello = torch_wire::request(torch_wire::query::validate);
    torch_wire::put<std::uint32_t>(hello, torch_wire::validation_magic);
    hello.push_back(static_cast<std::byte>(torch_wire::query::ping));
    torch_wire::put<std::uint32_t>(hello, nonce);
    std::string last_reset;
    while (true) {
      fd_ = detail::connect_with_retry(host_, port_, until);
      std::byte answer[4]{};
      const auto r = handshake(hello, answer, until);
      if (r == handshake_result::answered) {
        const auto got = torch_wire::get<std::uint32_t>(answer);
        if (got == nonce) return;
        fail(errc::store, not_torch("it answered PING with 0x" + hex32(got) + ", not the nonce 0x" + hex32(nonce)), op);
      }
      if (r == handshake_result::closed) fail(errc::store, not_torch("it closed the connection after VALIDATE and PING"), op);
      if (r == handshake_result::silent) fail(errc::store, not_torch("no answer to PING before the connect deadline"), op);
      last_reset = system_message("handshake", reset_errno_);
      fd_.reset();
      if (until.expired()) fail(errc::store, not_torch("the connection was reset during VALIDATE and PING: " + last_reset), op);
      ::poll(nullptr, 0, std::min(50, until.poll_timeout_ms() < 0 ? 50 : until.poll_timeout_ms()));
    }
  }

  enum class handshake_result { answered, closed, reset, silent };

  handshake_result handshake(std::span<const std::byte> hello, std::byte (&answer)[4], const deadline& until) {
    auto r = detail::send_all_by(fd_.get(), hello, until);
    if (r.status == detail::transfer_status::done) r = detail::recv_exact_by(fd_.get(), std::span<std::byte>(answer), until);
    switch (r.status) {
      case detail::transfer_status::done: return handshake_result::answered;
      case detail::transfer_status::timed_out: return handshake_result::silent;
      case detail::transfer_status::closed: return handshake_result::closed;
      case detail::transfer_status::failed: break;
    }
    reset_errno_ = r.err;
    return handshake_result::reset;
  }

  static std::string hex32(std::uint32_t v) {
    static const char* digits = "0123456789abcdef";
    std::string s(8, '0');
    for (int i = 7; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 15u];
    return s;
  }

  bool check_locked(const std::vector<std::string>& wire, const deadline& until, const char* op) {
    auto req = torch_wire::request(torch_wire::query::check);
    torch_wire::put<std::uint64_t>(req, wire.size());
    for (const auto& k : wire) torch_wire::put_string(req, k);
    send_request(req, until, op);
    const auto r = recv_value<std::uint8_t>(until, op);
    if (r == torch_wire::check_ready) return true;
    if (r == torch_wire::check_not_ready) return false;
    fail(errc::store, "store server " + address() + " answered CHECK with " + std::to_string(r), op);
  }

  // WAIT with a deadline; past it, CANCEL_WAIT and read what is still due, as torch's client does.
  // A zero timeout is one CHECK. The timeout names the keys still missing (one CHECK each).
  void wait_locked(const std::vector<std::string>& keys, const std::vector<std::string>& wire, std::chrono::milliseconds t,
                   const char* op) {
    if (t.count() <= 0) {
      if (!check_locked(wire, deadline::after(timeout()), op)) throw_wait_timeout(keys, wire, t, op);
      return;
    }
    auto req = torch_wire::request(torch_wire::query::wait);
    torch_wire::put<std::uint64_t>(req, wire.size());
    for (const auto& k : wire) torch_wire::put_string(req, k);
    const auto until = deadline::after(t);
    send_request(req, until, op);
    if (readable(until, op)) {
      expect_byte(torch_wire::wait_stop_waiting, deadline::after(timeout()), op, "WAIT");
      return;
    }
    const auto drain = deadline::after(timeout());
    send_request(torch_wire::request(torch_wire::query::cancel_wait), drain, op);
    const auto first = recv_value<std::uint8_t>(drain, op);
    if (first == torch_wire::wait_stop_waiting) {  // the keys came as we cancelled
      expect_byte(torch_wire::wait_canceled, drain, op, "CANCEL_WAIT");
      return;
    }
    if (first != torch_wire::wait_canceled) {
      fail(errc::store, "store server " + address() + " answered CANCEL_WAIT with " + std::to_string(first), op);
    }
    throw_wait_timeout(keys, wire, t, op);
  }

  [[noreturn]] void throw_wait_timeout(const std::vector<std::string>& keys, const std::vector<std::string>& wire,
                                       std::chrono::milliseconds t, const char* op) {
    std::vector<std::string> missing;
    if (keys.size() == 1) {
      missing = keys;
    } else {
      const auto until = deadline::after(timeout());
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (!check_locked({wire[i]}, until, op)) missing.push_back(keys[i]);
      }
      if (missing.empty()) missing = keys;  // set and erased again meanwhile: name them all
    }
    std::string where = "PyTorch TCPStore at " + address();
    if (!prefix_.empty()) where += ", prefix '" + prefix_ + "'";
    throw error(errc::timeout, "keys " + detail::quote_keys(missing) + " not set within " + std::to_string(t.count()) +
                                   " ms (" + where + ")",
                context(op));
  }

  void expect_byte(std::uint8_t want, const deadline& until, const char* op, const char* what) {
    const auto r = recv_value<std::uint8_t>(until, op);
    if (r != want) {
      fail(errc::store, "store server " + address() + " answered " + what + " with " + std::to_string(r) +
                            ", expected " + std::to_string(want),
           op);
    }
  }

  // Whether an answer has started before the deadline; a closed connection is readable too.
  bool readable(const deadline& until, const char* op) {
    check_usable(op);
    return detail::poll_one(fd_.get(), POLLIN, until) != 0;
  }

  void check_usable(const char* op) const {
    if (!fd_) throw error(errc::store, broken_, context(op));
  }

  std::vector<std::byte> recv_blob(const deadline& until, const char* op) {
    const auto len = recv_value<std::uint64_t>(until, op);
    if (len > max_value_bytes) {
      fail(errc::store, "store server " + address() + " sent a value of " + std::to_string(len) +
                            " bytes, more than this client takes (" + std::to_string(max_value_bytes) + ")",
           op);
    }
    std::vector<std::byte> out(static_cast<std::size_t>(len));
    recv_exact(out, until, op);
    return out;
  }

  template <class T>
  T recv_value(const deadline& until, const char* op) {
    std::byte raw[sizeof(T)]{};
    recv_exact(raw, until, op);
    return torch_wire::get<T>(raw);
  }

  // Any failure leaves the stream in an unknown state: close it, and fail every later call at
  // once with the same reason.
  [[noreturn]] void fail(errc code, const std::string& message, const char* op) {
    fd_.reset();
    broken_ = "the connection to store server " + address() + " failed earlier: " + message;
    throw error(code, message, context(op));
  }

  void send_request(std::span<const std::byte> data, const deadline& until, const char* op) {
    check_usable(op);
    const auto r = detail::send_all_by(fd_.get(), data, until);
    if (r.status == detail::transfer_status::timed_out) {
      fail(errc::timeout, "store server " + address() + " did not take the request in time", op);
    }
    if (r.status != detail::transfer_status::done) {
      fail(errc::store, "store server " + address() + " closed the connection (" + system_message("send", r.err) + ")", op);
    }
  }

  void recv_exact(std::span<std::byte> data, const deadline& until, const char* op) {
    check_usable(op);
    const auto r = detail::recv_exact_by(fd_.get(), data, until);
    switch (r.status) {
      case detail::transfer_status::done: return;
      case detail::transfer_status::timed_out: fail(errc::timeout, "store server " + address() + " did not answer in time", op);
      case detail::transfer_status::closed: fail(errc::store, "store server " + address() + " closed the connection", op);
      case detail::transfer_status::failed:
        fail(errc::store, "store server " + address() + " closed the connection (" + system_message("recv", r.err) + ")", op);
    }
  }

  std::string host_;
  std::uint16_t port_;
  std::string prefix_;
  detail::unique_fd fd_;
  std::mutex mutex_;
  std::string broken_;
  int reset_errno_ = 0;  // of the last reset during the handshake
};

static_assert(key_value_store<torch_tcp_store>);

}  // namespace ddp::store
