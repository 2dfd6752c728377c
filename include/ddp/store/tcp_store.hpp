#pragma once
// tcp_store: the rendezvous store of a multi-process job (like torch's TCPStore).
//
// One process (rank 0, or the launcher) runs a tcp_store_server at MASTER_ADDR:MASTER_PORT;
// every rank, the server's own process included, is a tcp_store client of it:
//
//   auto s = ddp::store::make_tcp_store(env.master_addr, env.master_port, rank == 0, timeout);
//   s->set_string("rank0/addr", "...");   auto peer = s->get_string("rank1/addr");
//
// The server's side (its loop, authentication, job identity, alternate ports):
// tcp_store_server.hpp.
//
// Client: connects with retry until its deadline (the server may start after its clients), then
// every call is bounded by timeout(). A server that goes away is errc::store at once ("store
// server 127.0.0.1:29500 closed the connection"; with options::hosted_by "rank 0": "the store
// server at 127.0.0.1:29500 (hosted by rank 0) closed the connection: rank 0 exited?", so that a
// rank's error names the process that died), not after the timeout; the client then stays
// failed (no silent reconnect to a restarted server with none of the keys). Thread-safe: calls
// from several threads are serialized on the one connection. Neither a client nor a server may
// be used across fork(): create them in the process that uses them (the socket would be shared).
// With alternate ports (options::alternate_ports), the client finds its job's store among them
// (tcp_store_server.hpp, "Alternate ports").

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"
#include "ddp/store/detail/port_holder.hpp"
#include "ddp/store/detail/socket.hpp"
#include "ddp/store/store.hpp"
#include "ddp/store/tcp_store_server.hpp"

namespace ddp::store {

class tcp_store final : public store {
 public:
  using server = tcp_store_server;

  struct options {
    std::string host = "127.0.0.1";
    std::uint16_t port = 29500;  // with is_server, 0 picks a free port (see port())
    bool is_server = false;      // also run the server in this process (rank 0)
    std::chrono::milliseconds timeout = default_timeout();  // connecting, and every call
    std::optional<std::string> token = {};                  // nullopt: see detail::resolve_auth
    store_log_fn log = {};                                  // the server's log, with is_server
    std::string job = {};                                   // this rank's job identity; empty: none
    std::string hosted_by = {};  // who runs the server, e.g. "rank 0": errors name it; empty: not named
    // The participant this connection speaks for, e.g. "rank 3" (server_core.hpp, "Departures"):
    // if this process dies, every rank waiting on the store hears it named at once. The
    // destructor says `leave`. Empty: an anonymous client, whose close means nothing.
    std::string member = {};
    // Where else the server may be (tcp_store_server.hpp, "Alternate ports"); needs a job.
    std::vector<std::uint16_t> alternate_ports = {};
  };

  explicit tcp_store(options opts)
      : host_(opts.host), port_(opts.port), alternates_(opts.alternate_ports), job_(opts.job), hosted_by_(opts.hosted_by), member_(opts.member) {
    set_timeout(opts.timeout);
    auth_ = detail::resolve_auth(opts.token, job_);
    if (!alternates_.empty() && job_.empty()) {
      throw error(errc::invalid_argument, "tcp_store: alternate ports need a job identity, to tell this job's store from others");
    }
    if (opts.is_server) {
      server_ = std::make_unique<tcp_store_server>(tcp_store_server::options{.host = opts.host,
                                                                             .port = opts.port,
                                                                             .token = opts.token,
                                                                             .log = std::move(opts.log),
                                                                             .job = opts.job,
                                                                             .alternate_ports = opts.alternate_ports});
      port_ = server_->port();
      alternates_.clear();  // this process knows where its server is
    }
    connect(auth_.token, deadline::after(opts.timeout));
    if (!member_.empty()) {
      call(detail::opcode::member, detail::encode_request(detail::opcode::member, member_, {}), deadline::after(timeout()));
    }
  }

  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;
  ~tcp_store() override {
    if (fd_ && !member_.empty()) {  // an orderly close: no departure for the other ranks to hear of
      const auto frame = detail::encode_request(detail::opcode::leave, {}, {});
      (void)detail::send_all_by(fd_.get(), frame, deadline::after(std::chrono::milliseconds(100)));
    }
    fd_.reset();  // close our connection before our server (if any) stops
    server_.reset();
  }

  const std::string& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::string address() const { return detail::host_port(host_, port_); }
  /// The server this object runs (is_server), else null.
  tcp_store_server* owned_server() noexcept { return server_.get(); }

  void set(const std::string& key, std::span<const std::byte> value) override {
    check_key(key);
    check_value(value);
    call(detail::opcode::set, detail::encode_request(detail::opcode::set, key, value), deadline::after(timeout()));
  }

  std::vector<std::byte> get(const std::string& key) override {
    check_key(key);
    return call(detail::opcode::get, detail::encode_get(key, timeout_ms(timeout())), blocking_deadline(timeout()), timeout());
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check_key(key);
    const auto r = call(detail::opcode::add, detail::encode_add(key, delta), deadline::after(timeout()));
    return read_i64(r, detail::opcode::add);
  }

  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                     std::span<const std::byte> desired) override {
    check_key(key);
    check_value(expected);
    check_value(desired);
    return call(detail::opcode::compare_set, detail::encode_compare_set(key, expected, desired), deadline::after(timeout()));
  }

  using store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) override {
    if (keys.empty()) return;
    std::size_t bytes = 12;
    for (const auto& k : keys) {
      check_key(k);
      bytes += 4 + k.size();
    }
    if (bytes > detail::max_wait_bytes) throw error(errc::invalid_argument, "store.wait: too many keys in one call");
    call(detail::opcode::wait, detail::encode_wait(keys, timeout_ms(t)), blocking_deadline(t), t);
  }

  /// Tells the server that `member` (e.g. "rank 2") is gone, in `what` (which should start with
  /// its name): every rank waiting on the store gets errc::peer_lost with it (server_core.hpp,
  /// "Departures"). What a launcher calls when it sees a rank end.
  void report_departure(const std::string& member, const std::string& what) {
    check_key(member);
    const auto* p = reinterpret_cast<const std::byte*>(what.data());
    call(detail::opcode::depart, detail::encode_request(detail::opcode::depart, member, std::span(p, std::min(what.size(), std::size_t{4096}))),
         deadline::after(timeout()));
  }

  bool erase(const std::string& key) override {
    check_key(key);
    const auto r = call(detail::opcode::erase, detail::encode_request(detail::opcode::erase, key, {}), deadline::after(timeout()));
    if (r.size() != 1) protocol_error(detail::opcode::erase, "bad erase answer");
    return r[0] != std::byte{0};
  }

  std::int64_t num_keys() override {
    const auto r = call(detail::opcode::num_keys, detail::encode_request(detail::opcode::num_keys, {}, {}),
                        deadline::after(timeout()));
    return read_i64(r, detail::opcode::num_keys);
  }

 private:
  static std::uint64_t timeout_ms(std::chrono::milliseconds t) { return t.count() < 0 ? 0 : static_cast<std::uint64_t>(t.count()); }

  // The server answers a parked get()/wait() at the timeout itself; the client allows a little
  // more before deciding the server is wedged.
  static deadline blocking_deadline(std::chrono::milliseconds t) {
    constexpr auto grace = std::chrono::seconds(2);
    if (t > std::chrono::milliseconds::max() - grace) return deadline::never();
    return deadline::after(t + grace);
  }

  void connect(const std::string& token, const deadline& until) {
    const char* op = "store.connect";
    detail::nonce mine{};
    detail::random_bytes(mine);
    std::array<std::byte, detail::server_hello_bytes> hello{};
    if (!alternates_.empty()) {
      hello = find_store_of_job(mine, until);
    } else {
      fd_ = detail::connect_with_retry(host_, port_, until);
      send_all(detail::encode_client_hello(mine), until, op);
      greet(hello, until, op);
    }
    const auto server_nonce = detail::server_hello_nonce(hello);
    if (!token.empty()) {
      // The server proves it knows the token before this rank sends anything about itself.
      const auto flags = detail::get_le<std::uint16_t>(hello.data() + 6);
      const auto expected = detail::server_proof(token, mine, server_nonce);
      if ((flags & detail::flag_token_required) == 0 || !detail::constant_time_equal(detail::server_hello_proof(hello), expected)) {
        fail(errc::store, "the store at " + address() +
                              " does not know this job's token: another job or a stranger holds the port" + auth_note(),
             op);
      }
    }
    send_all(detail::encode_client_proof(detail::client_proof(token, server_nonce, mine), job_), until, op);
    std::array<std::byte, 1> verdict{};
    recv_exact(verdict, until, op, " during the handshake (wrong or missing DDP_STORE_TOKEN?)" + auth_note());
    if (verdict[0] != std::byte{1}) fail(errc::store, "store refused the connection: wrong or missing DDP_STORE_TOKEN" + auth_note(), op);
  }

  // Reads the server's greeting on fd_ (this client's hello sent) and checks it is a ddp store of
  // this version and of this job.
  void greet(std::array<std::byte, detail::server_hello_bytes>& hello, const deadline& until, const char* op) {
    // Magic and version first: a server of another version sends a hello of another length.
    recv_exact(std::span(hello).first(8), until, op, " during the handshake");
    if (detail::get_le<std::uint32_t>(hello.data()) != detail::protocol_magic) {
      fail(errc::store, address() + " is not a ddp store server (bad magic in its greeting)", op);
    }
    const auto version = detail::get_le<std::uint16_t>(hello.data() + 4);
    if (version != detail::protocol_version) {
      fail(errc::store, "store server " + address() + " speaks protocol version " + std::to_string(version) +
                            ", this client " + std::to_string(detail::protocol_version) + " (mixed ddp versions?)",
           op);
    }
    recv_exact(std::span(hello).subspan(8), until, op, " during the handshake");
    if (const std::string theirs = detail::server_hello_job(hello); detail::jobs_clash(theirs, detail::job_field_text(job_))) {
      fail(errc::config, "the store at " + address() + " serves job " + theirs + ", not this rank's job " +
                             detail::job_field_text(job_) + " (two jobs on one port: give each its own MASTER_PORT)",
           op);
    }
  }

  // Looks on port_ and each alternate, in turn, for the store that greets with this job (this
  // client's hello sent); sets fd_ and port_ to it and returns its greeting. A port held by
  // another job's store or another program is skipped from then on; one that does not greet is
  // asked again on the next round, allowed longer each time (a loaded server greets late).
  std::array<std::byte, detail::server_hello_bytes> find_store_of_job(std::span<const std::byte, detail::nonce_bytes> mine,
                                                                      const deadline& until) {
    std::vector<std::uint16_t> ports{port_};
    ports.insert(ports.end(), alternates_.begin(), alternates_.end());
    std::vector<std::string> found(ports.size(), ": no answer");
    std::vector<bool> held_by_other(ports.size(), false);
    auto greeting_wait = std::chrono::milliseconds(500);
    int pause_ms = 10;
    while (true) {
      for (std::size_t i = 0; i < ports.size(); ++i) {
        if (held_by_other[i]) continue;
        const deadline attempt(std::min(until.time_point(), deadline::after(greeting_wait).time_point()));
        int err = 0;
        std::string why;
        detail::unique_fd fd = detail::connect_once(host_, ports[i], attempt, err, why);
        if (!fd) {
          found[i] = ": " + why;
          continue;
        }
        auto g = detail::read_port_greeting(fd.get(), mine, job_, attempt);
        if (g.holder == detail::port_holder::store_of_job) {
          fd_ = std::move(fd);
          port_ = ports[i];
          return g.hello;
        }
        held_by_other[i] = g.holder == detail::port_holder::other;
        found[i] = " is held" + g.description;
      }
      std::string seen;
      for (std::size_t i = 0; i < ports.size(); ++i) seen += (i == 0 ? "" : "; ") + std::to_string(ports[i]) + found[i];
      if (std::all_of(held_by_other.begin(), held_by_other.end(), [](bool b) { return b; })) {
        throw error(errc::config, "no store of job " + detail::job_field_text(job_) + " at " + host_ + " on its derived port or alternates, all held by others (" +
                                      seen + "); set MASTER_PORT to a free port",
                    {.op = "store.connect"});
      }
      if (until.expired()) {
        throw error(errc::timeout, "could not find the store of job " + detail::job_field_text(job_) + " at " + host_ +
                                       " on its derived port or alternates before the deadline (" + seen +
                                       "); is rank 0 running and MASTER_ADDR right?",
                    {.op = "store.connect"});
      }
      const int left = until.poll_timeout_ms();
      ::poll(nullptr, 0, left < 0 ? pause_ms : std::min(pause_ms, left));
      pause_ms = std::min(pause_ms * 2, 200);
      greeting_wait = std::min(greeting_wait * 2, std::chrono::milliseconds(4000));
    }
  }

  // Why this client's token may differ from the server's, for refusals; never the token itself.
  std::string auth_note() const {
    if (auth_.token.empty()) return " (authentication is off on this rank: " + auth_.off_reason + ")";
    if (!auth_.derived_from.empty()) {
      return " (the token is derived from " + auth_.derived_from + " and the job identity '" + job_ +
             "': ranks on several hosts need the same secret file, e.g. a shared home, or one DDP_STORE_TOKEN)";
    }
    return {};
  }

  std::vector<std::byte> call(detail::opcode op, const std::vector<std::byte>& frame, const deadline& until,
                              std::optional<std::chrono::milliseconds> server_timeout = std::nullopt) {
    std::lock_guard guard(mutex_);
    const std::string name(detail::to_string(op));
    if (!fd_) throw error(errc::store, broken_, {.op = name});
    send_all(frame, until, name.c_str());
    std::array<std::byte, detail::response_header_bytes> header{};
    recv_exact(header, until, name.c_str(), "");
    const auto st = std::to_integer<std::uint8_t>(header[0]);
    const auto len = detail::get_le<std::uint32_t>(header.data() + 1);
    if (len > detail::max_response_bytes) fail(errc::store, server_name() + " sent an oversized answer", name.c_str());
    std::vector<std::byte> payload(len);
    recv_exact(payload, until, name.c_str(), "");
    switch (static_cast<detail::status>(st)) {
      case detail::status::ok:
        return payload;
      case detail::status::timeout: {
        std::vector<std::string> missing;
        std::string why;
        if (!detail::decode_key_list(payload, missing, why)) fail(errc::store, "malformed timeout answer: " + why, name.c_str());
        const auto t = server_timeout.value_or(timeout());
        throw error(errc::timeout, "keys " + detail::quote_keys(missing) + " not set within " + std::to_string(t.count()) + " ms",
                    {.op = name});
      }
      case detail::status::invalid_argument:
        throw error(errc::invalid_argument, detail::to_string(payload), {.op = name});
      case detail::status::departed:
        throw error(errc::peer_lost, detail::to_string(payload), {.op = name});
    }
    fail(errc::store, server_name() + " sent an unknown status " + std::to_string(st), name.c_str());
  }

  std::int64_t read_i64(const std::vector<std::byte>& r, detail::opcode op) {
    if (r.size() != 8) protocol_error(op, "answer of " + std::to_string(r.size()) + " bytes, expected 8");
    return detail::get_le<std::int64_t>(r.data());
  }

  [[noreturn]] void protocol_error(detail::opcode op, const std::string& why) {
    std::lock_guard guard(mutex_);
    fail(errc::store, server_name() + ": " + why, std::string(detail::to_string(op)).c_str());
  }

  // "store server H:P", or with hosted_by "the store server at H:P (hosted by rank 0)": the
  // host's name comes first, so a rank's error about a lost store names the process behind it.
  std::string server_name() const {
    if (hosted_by_.empty()) return "store server " + address();
    return "the store server at " + address() + " (hosted by " + hosted_by_ + ")";
  }
  std::string gone_hint() const { return hosted_by_.empty() ? std::string() : ": " + hosted_by_ + " exited?"; }
  std::string hung_hint() const { return hosted_by_.empty() ? std::string() : ": " + hosted_by_ + " hung or stopped?"; }

  // Any failure on the connection leaves the stream in an unknown state: close it, and make every
  // later call fail at once with the same reason.
  [[noreturn]] void fail(errc code, const std::string& message, const char* op) {
    fd_.reset();
    broken_ = "the connection to " + (hosted_by_.empty() ? server_name() : "the store server at " + address()) + " failed earlier: " + message;
    throw error(code, message, {.op = op});
  }

  void send_all(std::span<const std::byte> data, const deadline& until, const char* op) {
    const auto r = detail::send_all_by(fd_.get(), data, until);
    if (r.status == detail::transfer_status::timed_out) {
      fail(errc::timeout, server_name() + " did not take the request in time" + hung_hint(), op);
    }
    if (r.status != detail::transfer_status::done) {
      fail(errc::store, server_name() + " closed the connection (" + system_message("send", r.err) + ")" + gone_hint(), op);
    }
  }

  void recv_exact(std::span<std::byte> data, const deadline& until, const char* op, const std::string& when) {
    const auto r = detail::recv_exact_by(fd_.get(), data, until);
    switch (r.status) {
      case detail::transfer_status::done: return;
      case detail::transfer_status::timed_out: fail(errc::timeout, server_name() + " did not answer in time" + when + hung_hint(), op);
      case detail::transfer_status::closed: fail(errc::store, server_name() + " closed the connection" + when + gone_hint(), op);
      case detail::transfer_status::failed:
        fail(errc::store, server_name() + " closed the connection" + when + " (" + system_message("recv", r.err) + ")" + gone_hint(), op);
    }
  }

  std::string host_;
  std::uint16_t port_;
  std::vector<std::uint16_t> alternates_;
  std::string job_;
  std::string hosted_by_;
  std::string member_;
  detail::store_auth auth_;
  std::unique_ptr<tcp_store_server> server_;
  detail::unique_fd fd_;
  std::mutex mutex_;
  std::string broken_;
};

static_assert(key_value_store<tcp_store>);

/// The store of a process group: rank 0 (is_server) runs the server at host:port, every rank
/// connects to it. Port 0 with is_server picks a free port; read it back with
/// static_cast<tcp_store&>(*s).port() to publish it. The token: detail::resolve_auth.
inline std::shared_ptr<store> make_tcp_store(const std::string& host, std::uint16_t port, bool is_server,
                                             std::chrono::milliseconds timeout = default_timeout(), std::string job = {}) {
  return std::make_shared<tcp_store>(
      tcp_store::options{.host = host, .port = port, .is_server = is_server, .timeout = timeout, .job = std::move(job)});
}

}  // namespace ddp::store
