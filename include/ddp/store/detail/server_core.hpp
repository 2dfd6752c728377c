#pragma once
// The tcp_store server without its sockets: per-connection protocol state (handshake, token
// proof, request frames), the key-value map, and the parked get()/wait() requests. The socket
// loop in tcp_store_server.hpp feeds it received bytes and writes out what it queues; the fuzzer
// (tests/fuzz) drives it directly with many virtual connections.
//
// A parked request stops its connection's processing (responses stay in request order); bytes
// that arrive meanwhile are buffered, up to a small cap, and processed once it is answered.
// A connection that breaks the protocol is marked closing with one logged reason; the others
// never notice.
//
// Bounds, so that no client can make the server grow (input_allowance() tells the socket loop
// how much to read from each connection; the rest stays in the kernel, pushing back on the peer):
// - before authentication a connection is given only the bytes of its next handshake message,
//   and at most max_unauthenticated such connections exist: a new one past that, or one accepted
//   when descriptors run out, evicts the oldest (those that have sent nothing first). So idle
//   connections cannot keep a rank out, and they hold at most max_unauthenticated x
//   (client proof + server hello) bytes;
// - a request frame up to small_frame_bytes is read as it comes; a larger one (the parser knows
//   its size from its header) is read only once its whole size fits frame_budget, shared by all
//   connections and taken in arrival order. Input memory is at most frame_budget + connections x
//   small_frame_bytes, whatever the clients send;
// - a frame that stays unfinished for frame_timeout while the server is reading it closes its
//   connection (one line naming the peer and the limit), so a stalled client cannot hold the budget.
//
// Departures: a connection may say which participant it speaks for (`member`, e.g. "rank 3") and,
// when that participant is done, `leave`. A member's connection that closes without `leave` means
// its process died (the kernel closed the socket) or gave up on the store: every parked get/wait
// is answered `departed`, naming it, and so is every later one that would park. A rank waiting in
// rendezvous for keys that a dead rank will never write learns who died at once, instead of at
// its deadline. Connections this server closes for cause are not members' departures. A launcher
// that saw a participant end says so with `depart` (its words become the answer): that covers a
// rank that died before it reached the store.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
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

  /// Frames up to this size are read as they arrive; larger ones wait for room in the budget.
  static constexpr std::size_t small_frame_bytes = std::size_t{64} << 10;
  static constexpr std::size_t default_frame_budget = std::size_t{256} << 20;
  static_assert(max_request_bytes <= default_frame_budget, "the largest frame must fit the budget");

  struct options {
    std::string token;  // empty: no authentication
    std::string job;    // the job identity this store serves; empty: any (see frame.hpp)
    std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
    log_fn log;  // one line per closed-for-cause connection; never given the token
    std::chrono::milliseconds frame_timeout = std::chrono::seconds(60);  // see "Bounds" above
    std::size_t frame_budget = default_frame_budget;  // raised to max_request_bytes if below
    std::size_t max_unauthenticated = 512;
  };

  /// Stop processing a connection's requests while it has this much output not yet written.
  static constexpr std::size_t output_backlog_limit = std::size_t{4} << 20;
  /// Bytes buffered from a connection whose processing is paused.
  static constexpr std::size_t paused_input_limit = std::size_t{64} << 10;

  explicit server_core(options opts) : opts_(std::move(opts)) {
    opts_.frame_budget = std::max(opts_.frame_budget, max_request_bytes);
    opts_.max_unauthenticated = std::max<std::size_t>(opts_.max_unauthenticated, 1);
  }

  /// A new connection, which speaks first (frame.hpp). `server_nonce` must be unpredictable when
  /// a token is set. Past max_unauthenticated, the oldest unauthenticated connection is evicted.
  void open(conn_id id, std::string peer, std::span<const std::byte, nonce_bytes> server_nonce, clock::time_point now) {
    now_ = now;
    connection& c = conns_[id];
    c.id = id;
    c.peer = std::move(peer);
    c.handshake_deadline = now + opts_.handshake_timeout;
    std::copy(server_nonce.begin(), server_nonce.end(), c.server_nonce.begin());
    if (unauthenticated_.size() >= opts_.max_unauthenticated)
      evict_unauthenticated("more than " + std::to_string(opts_.max_unauthenticated) + " at once");
    unauthenticated_.insert(id);  // after: the newcomer has had no chance to speak yet
  }

  /// Marks the oldest unauthenticated connection closing (one that has sent nothing, if any),
  /// to make room; returns it, for the socket loop to close at once. Logged in summary by expire().
  std::optional<conn_id> evict_unauthenticated(const std::string& why) {
    std::optional<conn_id> victim;
    for (const auto id : unauthenticated_) {
      const connection& c = conns_.at(id);
      if (c.state == phase::closing) continue;
      if (c.received == 0) {
        victim = id;
        break;
      }
      if (!victim) victim = id;
    }
    if (!victim) return std::nullopt;
    connection& c = conns_.at(*victim);
    c.state = phase::closing;
    release(c);
    unauthenticated_.erase(*victim);
    ++evicted_unlogged_;
    evict_reason_ = why;
    return victim;
  }

  /// Bytes received from a connection; processes every complete frame it can.
  /// Give it at most input_allowance(id) bytes: the bounds above assume so.
  void receive(conn_id id, std::span<const std::byte> data, clock::time_point now) {
    now_ = now;
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second.state == phase::closing) return;
    it->second.in.insert(it->second.in.end(), data.begin(), data.end());
    it->second.received += data.size();
    process(id, now);
    drain_resumed(now);
  }

  /// How many bytes the socket loop may read from this connection now (0: do not poll for input).
  std::size_t input_allowance(conn_id id) const {
    const auto it = conns_.find(id);
    if (it == conns_.end()) return 0;
    const connection& c = it->second;
    auto upto = [&](std::size_t limit) { return c.in.size() < limit ? limit - c.in.size() : std::size_t{0}; };
    switch (c.state) {
      case phase::closing: return 0;
      case phase::hello: return upto(client_hello_bytes);
      case phase::proof: return upto(client_proof_bytes);
      case phase::ready: break;
    }
    if (paused(c)) return upto(paused_input_limit);
    if (c.waiting_budget) return 0;
    if (c.reserved > 0) return upto(c.reserved);
    return upto(small_frame_bytes);
  }

  bool wants_input(conn_id id) const { return input_allowance(id) > 0; }

  std::span<const std::byte> output(conn_id id) const {
    const auto it = conns_.find(id);
    if (it == conns_.end()) return {};
    return std::span<const std::byte>(it->second.out).subspan(it->second.out_sent);
  }

  /// `n` bytes of output were written; may resume a connection held back by its backlog.
  void sent(conn_id id, std::size_t n, clock::time_point now) {
    now_ = now;
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    connection& c = it->second;
    const bool was_paused = paused(c);
    c.out_sent += n;
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
      if (c.out.capacity() > small_frame_bytes) std::vector<std::byte>().swap(c.out);  // a large answer is gone
    } else if (c.out_sent > (std::size_t{1} << 20) && c.out_sent * 2 > c.out.size()) {
      c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(c.out_sent));
      c.out_sent = 0;
    }
    if (was_paused && !paused(c)) c.frame_started = now;  // the frame clock stood while we did not read
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
    std::string departed;
    if (auto it = conns_.find(id); it != conns_.end()) {
      release(it->second);
      if (!it->second.member.empty() && !it->second.left && it->second.state != phase::closing) departed = it->second.member;
    }
    conns_.erase(id);
    unauthenticated_.erase(id);
    std::erase_if(waiters_, [&](const waiter& w) { return w.conn == id; });
    if (!departed.empty()) depart(departed, departed + " left the job without a word: its connection to the store closed (the process died?)");
    admit_waiting();
  }

  /// The members whose connections closed without leaving, in the order they went.
  const std::vector<std::string>& departed() const noexcept { return departed_; }
  /// Connections that may still need the store: every open one but those whose member left
  /// and anonymous clients past their handshake (what a stopping server waits for: tcp_store_server.hpp).
  /// A connection in its handshake counts: it may be a rank about to become a member.
  std::size_t num_awaited() const noexcept {
    return static_cast<std::size_t>(std::count_if(conns_.begin(), conns_.end(), [](const auto& kv) {
      const connection& c = kv.second;
      return c.state != phase::closing && !c.left && (c.state != phase::ready || !c.member.empty());
    }));
  }

  /// Answers parked requests whose deadline passed, and drops connections stuck in the handshake.
  void expire(clock::time_point now) {
    now_ = now;
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
      if (frame_clock_runs(c) && c.frame_started + opts_.frame_timeout <= now) {
        close_for_cause(c, "an unfinished request frame (" + std::to_string(c.in.size()) +
                               (c.frame_bytes > 0 ? " of " + std::to_string(c.frame_bytes) : std::string()) +
                               " bytes) for longer than the frame timeout of " + std::to_string(opts_.frame_timeout.count()) +
                               " ms");
      }
    }
    if (evicted_unlogged_ > 0 && now >= next_evict_log_) {
      if (opts_.log)
        opts_.log("dropped " + std::to_string(evicted_unlogged_) + " unauthenticated connection(s), oldest idle first (" +
                  evict_reason_ + ")");
      evicted_unlogged_ = 0;
      next_evict_log_ = now + std::chrono::seconds(1);  // a flood gets a line a second, not one per connection
    }
    admit_waiting();  // frames of connections closed above gave their budget back
    drain_resumed(now);
  }

  /// The earliest time expire() has work to do.
  std::optional<clock::time_point> next_deadline() const {
    std::optional<clock::time_point> t;
    auto take = [&](clock::time_point x) {
      if (!t || x < *t) t = x;
    };
    for (const auto& w : waiters_) take(w.until);
    for (const auto& [id, c] : conns_) {
      if (c.state == phase::hello || c.state == phase::proof) take(c.handshake_deadline);
      if (frame_clock_runs(c)) take(c.frame_started + opts_.frame_timeout);
    }
    if (evicted_unlogged_ > 0) take(next_evict_log_);
    return t;
  }

  std::size_t num_keys() const noexcept { return data_.size(); }
  std::size_t num_connections() const noexcept { return conns_.size(); }
  std::size_t num_parked() const noexcept { return waiters_.size(); }
  std::size_t num_unauthenticated() const noexcept { return unauthenticated_.size(); }
  /// Memory held for input by every connection (buffer capacities), and by the unauthenticated
  /// ones for input and output: what the bounds above bound.
  std::size_t input_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& [id, c] : conns_) n += c.in.capacity();
    return n;
  }
  std::size_t unauthenticated_bytes() const {
    std::size_t n = 0;
    for (const auto id : unauthenticated_) n += conns_.at(id).in.capacity() + conns_.at(id).out.capacity();
    return n;
  }
  std::size_t reserved_bytes() const noexcept { return budget_used_; }

 private:
  enum class phase { hello, proof, ready, closing };

  struct connection {
    phase state = phase::hello;
    conn_id id = 0;
    std::string peer;
    nonce server_nonce{};
    digest expected_proof{};
    std::vector<std::byte> in;
    std::vector<std::byte> out;
    std::size_t out_sent = 0;
    bool parked = false;
    clock::time_point handshake_deadline{};
    std::size_t received = 0;     // bytes ever received; 0: idle since accepted
    std::size_t frame_bytes = 0;  // the size of the frame at the head of `in`, once its header is in
    std::size_t reserved = 0;     // budget held for that frame
    bool waiting_budget = false;  // in budget_queue_
    bool frame_clock = false;     // `in` holds part of a frame since frame_started
    clock::time_point frame_started{};
    std::string member;  // the participant it speaks for ("rank 3"); empty: not said
    bool left = false;   // the member said `leave`: its close is orderly
  };

  struct waiter {
    conn_id conn;
    bool is_get;                    // get answers with the value of keys[0]; wait answers empty
    std::vector<std::string> keys;  // all must exist
    clock::time_point until;
    bool done = false;
  };

  static bool paused(const connection& c) { return c.parked || c.out.size() - c.out_sent >= output_backlog_limit; }

  // Only while the server is willing to read: a paused or budget-waiting client is not stalling.
  static bool frame_clock_runs(const connection& c) {
    return c.state == phase::ready && c.frame_clock && !paused(c) && !c.waiting_budget;
  }

  void close_for_cause(connection& c, const std::string& reason) {
    if (c.state == phase::closing) return;
    c.state = phase::closing;
    std::vector<std::byte>().swap(c.in);
    release(c);
    unauthenticated_.erase(c.id);
    if (opts_.log) opts_.log("closing the connection from " + c.peer + ": " + reason);
  }

  // Gives back the budget of a connection's frame; waiting frames are admitted by the caller
  // (admit_waiting), outside any loop over connections.
  void release(connection& c) {
    budget_used_ -= c.reserved;
    c.reserved = 0;
    c.frame_bytes = 0;
  }

  bool admit(connection& c, std::size_t bytes) {
    if (budget_used_ + bytes > opts_.frame_budget) return false;
    budget_used_ += bytes;
    c.reserved = bytes;
    c.in.reserve(bytes);  // exactly once: growth by doubling would take up to twice the frame
    c.frame_started = now_;
    c.frame_clock = true;
    return true;
  }

  // In arrival order, and no overtaking: a large frame is never starved by smaller ones.
  void admit_waiting() {
    while (!budget_queue_.empty()) {
      auto it = conns_.find(budget_queue_.front());
      if (it == conns_.end() || !it->second.waiting_budget || it->second.state == phase::closing) {
        budget_queue_.pop_front();
        continue;
      }
      if (!admit(it->second, it->second.frame_bytes)) return;
      it->second.waiting_budget = false;
      budget_queue_.pop_front();
    }
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
    bool released = false;
    while (c.state != phase::closing && !paused(c)) {
      const std::span<const std::byte> rest = std::span<const std::byte>(c.in).subspan(at);
      if (c.state == phase::hello) {
        if (auto why = check_client_hello(rest.first(std::min(rest.size(), client_hello_bytes))); !why.empty()) {
          if (get_le<std::uint32_t>(rest.data()) == protocol_magic) {
            const auto notice = encode_version_notice();  // lets the client name both versions
            c.out.insert(c.out.end(), notice.begin(), notice.end());
          }
          close_for_cause(c, why);
          return;
        }
        if (rest.size() < client_hello_bytes) break;
        const auto client_nonce = rest.subspan(8, nonce_bytes);
        const auto proof = server_proof(opts_.token, client_nonce, c.server_nonce);
        c.expected_proof = client_proof(opts_.token, c.server_nonce, client_nonce);
        const auto hello = encode_server_hello(!opts_.token.empty(), c.server_nonce, proof, opts_.job);
        c.out.insert(c.out.end(), hello.begin(), hello.end());
        at += client_hello_bytes;
        c.state = phase::proof;
      } else if (c.state == phase::proof) {
        if (rest.size() < client_proof_bytes) break;
        const bool ok = opts_.token.empty() || constant_time_equal(rest.first(proof_bytes), c.expected_proof);
        const std::string job = client_proof_job(rest);
        at += client_proof_bytes;
        const bool clash = jobs_clash(job, job_field_text(opts_.job));
        c.out.push_back(ok && !clash ? std::byte{1} : std::byte{0});
        unauthenticated_.erase(id);
        if (!ok) {
          close_for_cause(c, "wrong or missing token (DDP_STORE_TOKEN)");
          return;
        }
        if (clash) {
          close_for_cause(c, "refused a rank of job " + job + ": this store serves job " + job_field_text(opts_.job) +
                                 " (two jobs on one port)");
          return;
        }
        c.state = phase::ready;
      } else {
        auto parsed = parse_request(rest);
        if (parsed.status == parse_status::need_more) {
          if (parsed.frame_bytes > small_frame_bytes && c.reserved == 0 && !c.waiting_budget) {
            c.frame_bytes = parsed.frame_bytes;
            if (!admit(c, parsed.frame_bytes)) {
              c.waiting_budget = true;
              budget_queue_.push_back(id);
            }
          }
          break;
        }
        if (parsed.status == parse_status::invalid) {
          close_for_cause(c, parsed.reason);
          released = true;
          break;
        }
        at += parsed.consumed;
        if (c.reserved > 0) released = true;
        release(c);
        c.frame_clock = false;
        handle(id, c, std::move(parsed.req), now);
      }
    }
    if (c.state != phase::closing) {
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(at));
      if (c.reserved == 0 && c.in.capacity() > 2 * small_frame_bytes && c.in.size() <= small_frame_bytes)
        std::vector<std::byte>(c.in.begin(), c.in.end()).swap(c.in);  // a large frame is done: give its memory back
      if (c.state == phase::ready) {
        if (c.in.empty()) c.frame_clock = false;
        else if (!c.frame_clock) {
          c.frame_clock = true;
          c.frame_started = now;
        }
      }
    }
    if (released) admit_waiting();
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
        if (!departed_.empty()) {  // a key that a dead member was to write never comes
          respond(id, status::departed, departure_message());
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
      case opcode::member:
        c.member = std::move(req.key);
        respond(id, status::ok, {});
        return;
      case opcode::leave:  // no answer: the client closes right after
        c.left = true;
        return;
      case opcode::depart:
        depart(req.key, to_string(req.value));
        respond(id, status::ok, {});
        return;
    }
  }

  // A member's process is gone: every parked request is answered with its name. The first word
  // on a member stands (its launcher's and its closed connection may both arrive).
  void depart(const std::string& member, const std::string& what) {
    if (std::find(departed_.begin(), departed_.end(), member) != departed_.end()) return;
    departed_.push_back(member);
    if (departures_.empty()) departures_ = what;  // not logged: the ranks that wait say it, and the launcher
    const auto message = departure_message();
    for (auto& w : waiters_) {
      respond(w.conn, status::departed, message);
      w.done = true;
    }
    finish_waiters();
  }

  std::vector<std::byte> departure_message() const {
    std::string m = departures_;
    if (departed_.size() > 1) m += "; " + std::to_string(departed_.size() - 1) + " more since";
    const auto* p = reinterpret_cast<const std::byte*>(m.data());
    return std::vector<std::byte>(p, p + m.size());
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
        it->second.frame_started = now_;  // the frame clock stood while it was parked
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
  clock::time_point now_{};  // of the latest call, for admissions made by close()
  std::unordered_map<conn_id, connection> conns_;
  std::set<conn_id> unauthenticated_;  // ids grow with age: the oldest first
  std::deque<conn_id> budget_queue_;   // connections whose frame waits for the budget
  std::size_t budget_used_ = 0;
  std::size_t evicted_unlogged_ = 0;
  std::string evict_reason_;
  clock::time_point next_evict_log_{};
  std::map<std::string, std::vector<std::byte>, std::less<>> data_;
  std::vector<waiter> waiters_;
  std::deque<conn_id> resumed_;
  std::vector<std::string> departed_;
  std::string departures_;  // what is said of the first departed member
};

}  // namespace ddp::store::detail
