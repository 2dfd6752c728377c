#pragma once
// The tcp_store server without its sockets: per-connection protocol state (handshake, token
// proof, request frames), the key-value map, and the parked get()/wait() requests. The socket
// loop in tcp_store.hpp feeds it received bytes and writes out what it queues; the fuzzer
// (tests/fuzz) drives it directly with many virtual connections.
//
// A parked request stops its connection's processing (responses stay in request order); bytes
// that arrive meanwhile are buffered, up to a small cap, and processed once it is answered.
// A connection that breaks the protocol is marked closing with one logged reason; the others
// never notice.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/core/reduce_op.hpp"  // detail::wrapping_plus: add() wraps like the sum op
#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"

namespace ddp::store::detail {

class server_core {
 public:
  using conn_id = std::uint64_t;
  using log_fn = std::function<void(const std::string&)>;

  struct options {
    std::string token;  // empty: no authentication
    std::string job;    // the job identity this store serves; empty: any (see frame.hpp)
    std::chrono::milliseconds handshake_timeout = std::chrono::seconds(30);
    log_fn log;  // one line per closed-for-cause connection; never given the token
  };

  /// Stop processing a connection's requests while it has this much output not yet written.
  static constexpr std::size_t output_backlog_limit = std::size_t{4} << 20;
  /// Bytes buffered from a connection whose processing is paused.
  static constexpr std::size_t paused_input_limit = std::size_t{64} << 10;

  explicit server_core(options opts) : opts_(std::move(opts)) {}

  /// A new connection: queues the server hello. `nonce` must be unpredictable when a token is set.
  void open(conn_id id, std::string peer, std::span<const std::byte, nonce_bytes> nonce, clock::time_point now) {
    connection& c = conns_[id];
    c.peer = std::move(peer);
    c.handshake_deadline = now + opts_.handshake_timeout;
    if (!opts_.token.empty()) {
      std::vector<std::byte> msg;
      put_bytes(msg, auth_context);
      put_bytes(msg, nonce);
      c.expected_proof = hmac_sha256(std::as_bytes(std::span(opts_.token.data(), opts_.token.size())), msg);
    }
    const auto hello = encode_server_hello(!opts_.token.empty(), nonce, opts_.job);
    c.out.insert(c.out.end(), hello.begin(), hello.end());
  }

  /// Bytes received from a connection; processes every complete frame it can.
  void receive(conn_id id, std::span<const std::byte> data, clock::time_point now) {
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second.state == phase::closing) return;
    it->second.in.insert(it->second.in.end(), data.begin(), data.end());
    process(id, now);
    drain_resumed(now);
  }

  /// Whether the socket loop should read from this connection now.
  bool wants_input(conn_id id) const {
    const auto it = conns_.find(id);
    if (it == conns_.end() || it->second.state == phase::closing) return false;
    return !paused(it->second) || it->second.in.size() < paused_input_limit;
  }

  std::span<const std::byte> output(conn_id id) const {
    const auto it = conns_.find(id);
    if (it == conns_.end()) return {};
    return std::span<const std::byte>(it->second.out).subspan(it->second.out_sent);
  }

  /// `n` bytes of output were written; may resume a connection held back by its backlog.
  void sent(conn_id id, std::size_t n, clock::time_point now) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    connection& c = it->second;
    c.out_sent += n;
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
    } else if (c.out_sent > (std::size_t{1} << 20) && c.out_sent * 2 > c.out.size()) {
      c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(c.out_sent));
      c.out_sent = 0;
    }
    if (!paused(c) && !c.in.empty()) {
      process(id, now);
      drain_resumed(now);
    }
  }

  bool closing(conn_id id) const {
    const auto it = conns_.find(id);
    return it == conns_.end() || it->second.state == phase::closing;
  }

  /// The connection is gone (closed by us or by the peer): forget it and its parked request.
  void close(conn_id id) {
    conns_.erase(id);
    std::erase_if(waiters_, [&](const waiter& w) { return w.conn == id; });
  }

  /// Answers parked requests whose deadline passed, and drops connections stuck in the handshake.
  void expire(clock::time_point now) {
    for (auto& w : waiters_) {
      if (w.until > now) continue;
      std::vector<std::string> missing;
      for (const auto& k : w.keys)
        if (!data_.contains(k)) missing.push_back(k);
      respond(w.conn, status::timeout, encode_key_list(missing));
      w.done = true;
    }
    finish_waiters();
    for (auto& [id, c] : conns_) {
      if ((c.state == phase::hello || c.state == phase::proof) && c.handshake_deadline <= now)
        close_for_cause(c, "handshake not completed within " + std::to_string(opts_.handshake_timeout.count()) + " ms");
    }
    drain_resumed(now);
  }

  /// The earliest time expire() has work to do.
  std::optional<clock::time_point> next_deadline() const {
    std::optional<clock::time_point> t;
    auto take = [&](clock::time_point x) {
      if (!t || x < *t) t = x;
    };
    for (const auto& w : waiters_) take(w.until);
    for (const auto& [id, c] : conns_)
      if (c.state == phase::hello || c.state == phase::proof) take(c.handshake_deadline);
    return t;
  }

  std::size_t num_keys() const noexcept { return data_.size(); }
  std::size_t num_connections() const noexcept { return conns_.size(); }
  std::size_t num_parked() const noexcept { return waiters_.size(); }

 private:
  enum class phase { hello, proof, ready, closing };

  struct connection {
    phase state = phase::hello;
    std::string peer;
    digest expected_proof{};
    std::vector<std::byte> in;
    std::vector<std::byte> out;
    std::size_t out_sent = 0;
    bool parked = false;
    clock::time_point handshake_deadline{};
  };

  struct waiter {
    conn_id conn;
    bool is_get;                    // get answers with the value of keys[0]; wait answers empty
    std::vector<std::string> keys;  // all must exist
    clock::time_point until;
    bool done = false;
  };

  static bool paused(const connection& c) { return c.parked || c.out.size() - c.out_sent >= output_backlog_limit; }

  void close_for_cause(connection& c, const std::string& reason) {
    if (c.state == phase::closing) return;
    c.state = phase::closing;
    c.in.clear();
    if (opts_.log) opts_.log("closing the connection from " + c.peer + ": " + reason);
  }

  void respond(conn_id id, status s, std::span<const std::byte> payload) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    const auto frame = encode_response(s, payload);
    it->second.out.insert(it->second.out.end(), frame.begin(), frame.end());
  }

  void process(conn_id id, clock::time_point now) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    connection& c = it->second;
    std::size_t at = 0;
    while (c.state != phase::closing && !paused(c)) {
      const std::span<const std::byte> rest = std::span<const std::byte>(c.in).subspan(at);
      if (c.state == phase::hello) {
        if (auto why = check_client_hello(rest.first(std::min(rest.size(), client_hello_bytes))); !why.empty()) {
          close_for_cause(c, why);
          return;
        }
        if (rest.size() < client_hello_bytes) break;
        if (const std::string job = client_hello_job(rest); jobs_clash(job, job_field_text(opts_.job))) {
          close_for_cause(c, "refused a rank of job " + job + ": this store serves job " + job_field_text(opts_.job) +
                                 " (two jobs on one port)");
          return;
        }
        at += client_hello_bytes;
        c.state = phase::proof;
      } else if (c.state == phase::proof) {
        if (rest.size() < proof_bytes) break;
        const bool ok = opts_.token.empty() || constant_time_equal(rest.first(proof_bytes), c.expected_proof);
        at += proof_bytes;
        c.out.push_back(std::byte{ok ? std::uint8_t{1} : std::uint8_t{0}});
        if (!ok) {
          close_for_cause(c, "wrong or missing token (DDP_STORE_TOKEN)");
          return;
        }
        c.state = phase::ready;
      } else {
        auto parsed = parse_request(rest);
        if (parsed.status == parse_status::need_more) break;
        if (parsed.status == parse_status::invalid) {
          close_for_cause(c, parsed.reason);
          return;
        }
        at += parsed.consumed;
        handle(id, c, std::move(parsed.req), now);
      }
    }
    if (c.state != phase::closing) c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(at));
  }

  void handle(conn_id id, connection& c, request&& req, clock::time_point now) {
    switch (req.op) {
      case opcode::set:
        data_[req.key] = std::move(req.value);
        respond(id, status::ok, {});
        changed();
        return;
      case opcode::get:
      case opcode::wait: {
        const bool is_get = req.op == opcode::get;
        std::vector<std::string> keys = is_get ? std::vector<std::string>{req.key} : std::move(req.keys);
        if (std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.contains(k); })) {
          if (is_get) respond(id, status::ok, data_.at(keys[0]));
          else respond(id, status::ok, {});
          return;
        }
        // Parked until every key exists or the client's timeout passes; the client never polls.
        const auto limit = clock::time_point::max() - now;
        const auto wait = std::chrono::duration_cast<clock::duration>(
            std::chrono::milliseconds(std::min<std::uint64_t>(req.timeout_ms, std::uint64_t{1} << 40)));
        waiters_.push_back({id, is_get, std::move(keys), wait >= limit ? clock::time_point::max() : now + wait});
        c.parked = true;
        return;
      }
      case opcode::add: {
        auto& value = data_[req.key];
        std::int64_t current = 0;
        try {
          current = parse_counter(value, req.key);
        } catch (const error& e) {
          const auto& m = e.message();
          respond(id, status::invalid_argument, std::as_bytes(std::span(m.data(), m.size())));
          return;
        }
        const auto result = ddp::detail::wrapping_plus(current, req.delta);
        value = to_bytes(std::to_string(result));
        std::vector<std::byte> out;
        put_le(out, result);
        respond(id, status::ok, out);
        changed();
        return;
      }
      case opcode::compare_set: {
        auto it = data_.find(req.key);
        if (it == data_.end()) {
          if (!req.expected.empty()) {
            respond(id, status::ok, req.expected);
            return;
          }
          it = data_.emplace(req.key, std::move(req.value)).first;
          respond(id, status::ok, it->second);
          changed();
          return;
        }
        if (it->second == req.expected) {
          it->second = std::move(req.value);
          respond(id, status::ok, it->second);
          changed();
          return;
        }
        respond(id, status::ok, it->second);
        return;
      }
      case opcode::erase: {
        const bool existed = data_.erase(req.key) > 0;
        const std::byte b{existed ? std::uint8_t{1} : std::uint8_t{0}};
        respond(id, status::ok, std::span(&b, 1));
        return;
      }
      case opcode::num_keys: {
        std::vector<std::byte> out;
        put_le(out, static_cast<std::int64_t>(data_.size()));
        respond(id, status::ok, out);
        return;
      }
    }
  }

  // A key was written: answer every parked request that can now be answered.
  void changed() {
    for (auto& w : waiters_) {
      if (!std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return data_.contains(k); })) continue;
      if (w.is_get) respond(w.conn, status::ok, data_.at(w.keys[0]));
      else respond(w.conn, status::ok, {});
      w.done = true;
    }
    finish_waiters();
  }

  void finish_waiters() {
    for (const auto& w : waiters_) {
      if (!w.done) continue;
      if (auto it = conns_.find(w.conn); it != conns_.end()) {
        it->second.parked = false;
        resumed_.push_back(w.conn);
      }
    }
    std::erase_if(waiters_, [](const waiter& w) { return w.done; });
  }

  // Connections unparked by a write continue with the requests they had buffered. A worklist
  // instead of recursion: their requests may unpark others in turn.
  void drain_resumed(clock::time_point now) {
    while (!resumed_.empty()) {
      const conn_id id = resumed_.front();
      resumed_.pop_front();
      process(id, now);
    }
  }

  options opts_;
  std::unordered_map<conn_id, connection> conns_;
  std::map<std::string, std::vector<std::byte>, std::less<>> data_;
  std::vector<waiter> waiters_;
  std::deque<conn_id> resumed_;
};

}  // namespace ddp::store::detail
