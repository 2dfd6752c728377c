#pragma once
// tcp_store: the rendezvous store of a multi-process job (like torch's TCPStore).
//
// One process (rank 0, or the launcher) runs a tcp_store_server at MASTER_ADDR:MASTER_PORT;
// every rank, the server's own process included, is a tcp_store client of it:
//
//   auto s = ddp::store::make_tcp_store(env.master_addr, env.master_port, rank == 0, timeout);
//   s->set_string("rank0/addr", "...");   auto peer = s->get_string("rank1/addr");
//
// Server: one thread, poll() over non-blocking sockets with a buffer per connection, so a slow
// or hostile client never holds up the others. get() of a missing key and wait() are parked
// server side and answered when the keys appear (or the client's timeout passes): clients never
// poll. It binds exactly the address it is given (127.0.0.1 by default) and refuses a wildcard
// address (0.0.0.0, ::) unless authentication is on. Port 0 picks a free port; port() tells which.
// Protocol, limits and the parser: store/detail/frame.hpp; the protocol logic and the bounds on
// what clients can make it buffer (idle and unfinished connections): detail/server_core.hpp.
// A connection that sends a malformed, oversized or unauthenticated frame is closed with one
// line on stderr (or options::log) naming the peer and the reason; the server keeps serving.
//
// Authentication, on by default (detail::resolve_auth): the token is options::token, else
// $DDP_STORE_TOKEN, else derived from a per-user secret file and the job identity
// (detail/secret.hpp); DDP_STORE_AUTH=off, an empty options::token, or a secret that cannot be
// made turn it off, and the server says so in one line. It is mutual (frame.hpp): the server
// proves it knows the token, bound to the client's nonce, before the client sends its own proof
// or anything about itself; then the client proves it, bound to the server's nonce, before any
// key traffic. Both compare in constant time. The token is never sent, logged or put in an error
// message. There is no per-message integrity: after the handshake, frames travel as they are.
//
// Job identity: a server and a client given one (options::job, from launch_environment::job_id)
// refuse each other when they differ: the client fails with errc::config naming both jobs and the
// port before it sends anything but its hello, so two jobs on one port never mix. A server that
// cannot bind because the port is taken asks the holder's greeting who it is, and says so.
//
// Alternate ports (options::alternate_ports, for a port derived from the job's identity rather
// than given, launch_environment::master_port_alternates): a server whose port is held by
// anything but a store of its own job takes the first free alternate and logs the move; a client
// looks on the port and each alternate, in turn, for the store that greets with its job, skipping
// the ports another job's store or another program holds. Two jobs whose ids meet on one port,
// or a port that an unrelated process holds, then cost a move instead of the job. A given port
// has no alternates: another holder stays an error, naming it.
//
// Client: connects with retry until its deadline (the server may start after its clients), then
// every call is bounded by timeout(). A server that goes away is errc::store at once ("store
// server 127.0.0.1:29500 closed the connection"; with options::hosted_by "rank 0": "the store
// server at 127.0.0.1:29500 (hosted by rank 0) closed the connection: rank 0 exited?", so that a
// rank's error names the process that died), not after the timeout; the client then stays
// failed (no silent reconnect to a restarted server with none of the keys). Thread-safe: calls
// from several threads are serialized on the one connection. Neither a client nor a server may
// be used across fork(): create them in the process that uses them (the socket would be shared).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"
#include "ddp/store/detail/secret.hpp"
#include "ddp/store/detail/server_core.hpp"
#include "ddp/store/detail/socket.hpp"
#include "ddp/store/store.hpp"

namespace ddp::store {

using store_log_fn = std::function<void(const std::string&)>;

namespace detail {

/// The token a server or client uses, and why there is none when authentication is off.
struct store_auth {
  std::string token;       // empty: authentication off
  std::string off_reason;  // when off: why, for the one line that says so
  std::string derived_from;  // when derived: the secret's path, for hints (never the token)
};

/// options::token if given (empty: off); else off when DDP_STORE_AUTH=off; else $DDP_STORE_TOKEN
/// when non-empty; else derived from the per-user secret and the job identity (secret.hpp); off
/// when that secret cannot be made. An empty DDP_STORE_TOKEN counts as unset: a stray
/// `export DDP_STORE_TOKEN=` must not open the store.
inline store_auth resolve_auth(const std::optional<std::string>& token, std::string_view job) {
  if (token) return {*token, token->empty() ? "options::token is empty" : "", ""};
  if (const char* a = read_env_nonempty("DDP_STORE_AUTH"); a != nullptr) {
    const std::string_view v(a);
    if (v == "off" || v == "0" || v == "false" || v == "no") return {"", "DDP_STORE_AUTH=" + std::string(v), ""};
    if (v != "on" && v != "1" && v != "true" && v != "yes")
      throw error(errc::config, "DDP_STORE_AUTH='" + std::string(v) + "' (expected on or off)");
  }
  if (const char* env = read_env_nonempty("DDP_STORE_TOKEN"); env != nullptr) return {env, "", ""};
  const std::string path = secret_path();
  std::string why_not;
  if (const auto secret = load_or_create_secret(path, why_not)) return {derive_token(*secret, job), "", path};
  return {"", why_not, ""};
}

inline bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::" || host == "*"; }

/// What a connection to a port found: the store of this job, another holder (another job's
/// store, another ddp version, a program that is not a ddp store), or nothing yet (no greeting:
/// a program that never greets, or a store too busy to greet in time).
enum class port_holder { store_of_job, other, silent };

struct port_greeting {
  port_holder holder = port_holder::silent;
  std::array<std::byte, server_hello_bytes> hello{};
  std::string description;  // " by ...", for messages
};

/// Sends this client's hello on a connected fd and reads who answers: a ddp store greets every
/// new connection at once, and its hello names its job.
inline port_greeting read_port_greeting(int fd, std::span<const std::byte, nonce_bytes> mine, const std::string& my_job,
                                        const deadline& until) {
  port_greeting g;
  const std::string of_mine = my_job.empty() ? std::string() : " (this rank is of job " + job_field_text(my_job) + ")";
  // A ddp store of any version greets with magic and version (an older one without being asked).
  (void)send_all_by(fd, encode_client_hello(mine), until);
  const auto got = recv_exact_by(fd, std::span(g.hello).first(8), until);
  const bool store_magic = got.status == transfer_status::done && get_le<std::uint32_t>(g.hello.data()) == protocol_magic;
  if (!store_magic) {
    g.holder = got.status == transfer_status::done ? port_holder::other : port_holder::silent;
    g.description = " by a program that is not a ddp store (under torchrun: its agent's TCPStore, which ddp joins when "
                    "TORCHELASTIC_USE_AGENT_STORE=True; else another program or a PyTorch job)" + of_mine;
    return g;
  }
  g.holder = port_holder::other;
  if (const auto version = get_le<std::uint16_t>(g.hello.data() + 4); version != protocol_version) {
    g.description = " by a ddp store of protocol version " + std::to_string(version) + " (another ddp version: another job or a leftover process)" + of_mine;
    return g;
  }
  if (recv_exact_by(fd, std::span(g.hello).subspan(8), until).status != transfer_status::done) {
    g.holder = port_holder::silent;
    g.description = " by a ddp store that did not finish its greeting" + of_mine;
    return g;
  }
  const std::string theirs = server_hello_job(g.hello);
  if (theirs.empty()) {
    g.description = " by the ddp store of another job or a leftover process" + of_mine;
  } else if (theirs == job_field_text(my_job)) {
    g.holder = port_holder::store_of_job;
    g.description = " by a store of this same job " + theirs + " (several launchers each started a whole job? e.g. srun -n2 over ddprun --nnodes=1)";
  } else {
    g.description = " by the ddp store of job " + theirs + of_mine + " (two jobs on one port: give each its own MASTER_PORT)";
  }
  return g;
}

/// Who holds host:port, for the "already in use" message and for a server deciding whether to
/// move to an alternate port.
inline port_greeting identify_port_holder(const std::string& host, std::uint16_t port, const std::string& my_job) {
  unique_fd fd;
  try {
    fd = connect_with_retry(host.empty() ? std::string("127.0.0.1") : host, port, deadline::after(std::chrono::milliseconds(300)));
  } catch (const error&) {
    return {.holder = port_holder::silent, .description = " (another job or a leftover process?)"};
  }
  nonce probe{};
  random_bytes(probe);
  return read_port_greeting(fd.get(), probe, my_job, deadline::after(std::chrono::milliseconds(300)));
}

}  // namespace detail

// ---- server ------------------------------------------------------------------------------

class tcp_store_server {
 public:
  struct options {
    std::string host = "127.0.0.1";
    std::uint16_t port = 0;            // 0: pick a free port (see port())
    std::optional<std::string> token = {};  // nullopt: see detail::resolve_auth; empty: no authentication
    std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
    store_log_fn log = {};  // default: "ddp: store server H:P: <reason>" on stderr
    std::string job = {};   // the job this store serves; empty: no identity check
    // Where to serve when `port` is held by anything but a store of this job ("Alternate
    // ports" above); needs a job. Empty: a held port is an error.
    std::vector<std::uint16_t> alternate_ports = {};
    // The bounds of detail/server_core.hpp ("Bounds").
    std::chrono::milliseconds frame_timeout = std::chrono::seconds(60);
    std::size_t frame_budget = detail::server_core::default_frame_budget;
    std::size_t max_unauthenticated = 512;
    // Stopping, the server keeps serving while members (tcp_store::options::member) are still
    // connected, at most this long: a failing store host must not take the store away from
    // ranks that are reading the failure reports it posted (ring_communicator.hpp).
    std::chrono::milliseconds linger = std::chrono::seconds(1);
  };

  explicit tcp_store_server(options opts) : host_(opts.host), linger_(opts.linger) {
    const auto auth = detail::resolve_auth(opts.token, opts.job);
    const std::string& token = auth.token;
    const std::string wanted = detail::host_port(opts.host, opts.port);
    // A derived token is as hard to guess as a given one, so it is enough for a wildcard address.
    if (detail::is_wildcard(opts.host) && token.empty()) {
      throw error(errc::config, "refusing to listen on all interfaces (" + wanted + ") with authentication off (" +
                                    auth.off_reason +
                                    "): set DDP_STORE_TOKEN, or give the address of one interface (127.0.0.1 for a single host)");
    }
    if (!opts.alternate_ports.empty() && opts.job.empty()) {
      throw error(errc::invalid_argument, "tcp_store_server: alternate ports need a job identity, which the clients look for");
    }
    const std::string moved = listen_on(opts.host == "*" ? std::string() : opts.host, opts.port, opts.job, opts.alternate_ports);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0) throw error(errc::store, system_message("pipe2"));
    wake_read_.reset(pipe_fds[0]);
    wake_write_.reset(pipe_fds[1]);
    log_ = opts.log ? std::move(opts.log) : store_log_fn([addr = address()](const std::string& line) {
      std::fprintf(stderr, "ddp: store server %s: %s\n", addr.c_str(), line.c_str());
    });
    if (token.empty()) log_("authentication is off (" + auth.off_reason + "): any local process can read and write this store");
    if (!moved.empty()) log_(moved);
    core_ = std::make_unique<detail::server_core>(detail::server_core::options{.token = token,
                                                                               .job = opts.job,
                                                                               .handshake_timeout = opts.handshake_timeout,
                                                                               .log = log_,
                                                                               .frame_timeout = opts.frame_timeout,
                                                                               .frame_budget = opts.frame_budget,
                                                                               .max_unauthenticated = opts.max_unauthenticated});
    thread_ = std::thread([this] { run(); });
  }

  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;

  /// Stops serving once no member is connected (at most options::linger from now): every client
  /// connection is then closed (clients see errc::store).
  ~tcp_store_server() {
    stop_.store(true);
    const char b = 1;
    [[maybe_unused]] const auto n = ::write(wake_write_.get(), &b, 1);
    if (thread_.joinable()) thread_.join();
  }

  std::uint16_t port() const noexcept { return port_; }
  const std::string& host() const noexcept { return host_; }
  std::string address() const { return detail::host_port(host_, port_); }

 private:
  // Binds and listens on the first of port, alternates... that is free (see "Alternate ports");
  // returns what the log should say about the ports passed over, or "".
  std::string listen_on(const std::string& host, std::uint16_t port, const std::string& job, const std::vector<std::uint16_t>& alternates) {
    const auto where = [&](std::uint16_t p) { return detail::host_port(host.empty() ? "0.0.0.0" : host, p); };
    std::string passed_over;
    for (std::size_t i = 0; i <= alternates.size(); ++i) {
      const std::uint16_t candidate = i == 0 ? port : alternates[i - 1];
      const char* refused_by = bind_and_listen(host, candidate, where(candidate));
      if (refused_by == nullptr) {
        return passed_over.empty() ? std::string()
                                   : passed_over + "; serving on " + std::to_string(port_) + ", alternate " + std::to_string(i) +
                                         " of the job's derived port, where its ranks look for it";
      }
      const auto holder = detail::identify_port_holder(host, candidate, job);
      if (alternates.empty() || holder.holder == detail::port_holder::store_of_job) {
        throw error(errc::config, where(candidate) + " is already in use" + holder.description + ": " + system_message(refused_by, EADDRINUSE),
                    {.op = "store.listen", .backend_code = EADDRINUSE});
      }
      passed_over += (passed_over.empty() ? "" : "; ") + where(candidate) + " is in use" + holder.description;
    }
    throw error(errc::config, "the job's derived port and its " + std::to_string(alternates.size()) +
                                  " alternates are all in use: " + passed_over + " (set MASTER_PORT to a free port)",
                {.op = "store.listen", .backend_code = EADDRINUSE});
  }

  // Binds and listens on host:port: nullptr when listening, else the call ("bind" or "listen")
  // that found the port in use; any other failure throws.
  const char* bind_and_listen(const std::string& host, std::uint16_t port, const std::string& where) {
    const auto list = detail::resolve(host, port, true);
    int last = 0;
    for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
      detail::unique_fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
      if (!fd) {
        last = errno;
        continue;
      }
      // Lets a restarted job bind a port whose old connections are in TIME_WAIT; it does not
      // let two live servers share a port on Linux.
      int one = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      // In use: bind() says so, or, when another server bound the port in the same instant
      // (SO_REUSEADDR lets two sockets bind until one listens), listen() does.
      if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
        last = errno;
        if (last == EADDRINUSE) return "bind";
        continue;
      }
      if (::listen(fd.get(), SOMAXCONN) != 0) {
        last = errno;
        if (last == EADDRINUSE) return "listen";
        continue;
      }
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      listen_ = std::move(fd);
      return nullptr;
    }
    throw error(errc::config, "cannot listen on " + where + ": " + system_message("bind", last) +
                                  (last == EADDRNOTAVAIL ? " (that address is not on this host)" : ""),
                {.op = "store.listen", .backend_code = last});
  }

  void run() noexcept {
    try {
      loop();
    } catch (const std::exception& e) {
      log_(std::string("server stopped: ") + e.what());
    }
    fds_.clear();  // closes every connection
  }

  void loop() {
    std::vector<std::byte> chunk(std::size_t{256} << 10);
    std::vector<pollfd> pfds;
    std::vector<std::uint64_t> ids;
    std::vector<std::uint64_t> dead;
    std::optional<deadline> linger_until;
    for (;;) {
      if (stop_.load()) {
        if (!linger_until) linger_until = deadline::after(linger_);
        // After a departure a rank may still be on its way (started late): it is given a short
        // quiet spell to connect and hear who died, instead of finding no store.
        const bool quiet = core_->departed().empty() || clock::now() >= last_open_ + quiet_spell;
        if ((core_->num_awaited() == 0 && quiet) || linger_until->expired()) break;
      }
      pfds.clear();
      ids.clear();
      pfds.push_back({wake_read_.get(), POLLIN, 0});
      const bool accepting = clock::now() >= accept_pause_until_;
      pfds.push_back({accepting ? listen_.get() : -1, POLLIN, 0});
      for (const auto& [id, fd] : fds_) {
        short events = POLLRDHUP;
        if (core_->input_allowance(id) > 0) events |= POLLIN;
        if (!core_->output(id).empty()) events |= POLLOUT;
        pfds.push_back({fd.get(), events, 0});
        ids.push_back(id);
      }
      int timeout_ms = -1;
      if (auto next = core_->next_deadline()) timeout_ms = deadline(*next).poll_timeout_ms();
      if (!accepting) timeout_ms = timeout_ms < 0 ? 100 : std::min(timeout_ms, 100);
      if (linger_until) {  // wakes for the linger's end and the quiet spell's, whichever is first
        const int quiet_left = static_cast<int>(std::clamp<std::int64_t>(
            std::chrono::duration_cast<std::chrono::milliseconds>(last_open_ + quiet_spell - clock::now()).count() + 1, 1, 250));
        const int left = std::min(linger_until->poll_timeout_ms(), quiet_left);
        timeout_ms = timeout_ms < 0 ? left : std::min(timeout_ms, left);
      }
      if (::poll(pfds.data(), pfds.size(), timeout_ms) < 0) {
        if (errno == EINTR) continue;
        throw error(errc::store, system_message("poll"));
      }
      if (pfds[0].revents & POLLIN) {  // the stop request: drained, so that lingering polls sleep
        char sink[16];
        while (::read(wake_read_.get(), sink, sizeof sink) > 0) {
        }
        continue;
      }
      const auto now = clock::now();

      dead.clear();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto id = ids[i];
        const short rev = pfds[i + 2].revents;
        bool gone = false;
        // Only what the core allows: the rest waits in the kernel (server_core.hpp, "Bounds").
        if (const std::size_t allowed = core_->input_allowance(id); (rev & POLLIN) && allowed > 0) {
          const ssize_t n = ::recv(pfds[i + 2].fd, chunk.data(), std::min(chunk.size(), allowed), 0);
          if (n > 0) core_->receive(id, std::span(chunk.data(), static_cast<std::size_t>(n)), now);
          else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) gone = true;
        } else if (rev & (POLLERR | POLLHUP | POLLRDHUP)) {
          gone = true;  // the peer is gone (our clients never half-close)
        }
        if (gone) dead.push_back(id);
      }
      if (!dead.empty() || core_->num_connections() > 0) last_open_ = now;
      for (const auto id : dead) drop(id);
      // After the reads: accepting may evict (close) connections polled above, whose descriptor
      // numbers a new connection may then reuse.
      if (pfds[1].revents & POLLIN) accept_all(now);
      core_->expire(clock::now());
      flush_all();
    }
  }

  void accept_all(clock::time_point now) {
    for (int i = 0; i < 64; ++i) {
      const int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: an unauthenticated connection (idle ones first) makes room, else
          // idle connections could keep every rank out until their handshake timeout.
          if (const auto victim = core_->evict_unauthenticated("out of file descriptors")) {
            drop(*victim);
            continue;
          }
        }
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Nothing to evict: pause accepting instead of spinning on a readable listener.
          log_(system_message("accept") + "; not accepting connections for 100 ms");
          accept_pause_until_ = now + std::chrono::milliseconds(100);
        }
        return;
      }
      detail::set_nodelay(fd);
      const auto id = next_id_++;
      fds_.emplace(id, detail::unique_fd(fd));
      std::array<std::byte, detail::nonce_bytes> nonce{};
      detail::random_bytes(nonce);
      core_->open(id, detail::peer_address(fd), nonce, now);
    }
  }

  // Writes what each connection has queued, as far as its socket takes it; closes the ones the
  // core gave up on once their last bytes (e.g. a refusal verdict) are out.
  void flush_all() {
    bool progress = true;
    for (int round = 0; progress && round < 4; ++round) {  // writing may unpark and queue more
      progress = false;
      std::vector<std::uint64_t> dead;
      for (const auto& [id, fd] : fds_) {
        auto out = core_->output(id);
        while (!out.empty()) {
          const ssize_t n = ::send(fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          if (n > 0) {
            core_->sent(id, static_cast<std::size_t>(n), clock::now());
            progress = true;
            out = core_->output(id);
            continue;
          }
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (n < 0 && errno == EINTR) continue;
          dead.push_back(id);
          break;
        }
        if (core_->closing(id)) dead.push_back(id);
      }
      for (const auto id : dead) drop(id);
    }
  }

  void drop(std::uint64_t id) {
    core_->close(id);
    fds_.erase(id);
  }

  std::string host_;
  std::chrono::milliseconds linger_;
  std::uint16_t port_ = 0;
  detail::unique_fd listen_;
  detail::unique_fd wake_read_, wake_write_;
  store_log_fn log_;
  std::unique_ptr<detail::server_core> core_;
  std::unordered_map<std::uint64_t, detail::unique_fd> fds_;
  std::uint64_t next_id_ = 1;
  clock::time_point accept_pause_until_{};
  clock::time_point last_open_{};  // the last loop that saw a connection open
  static constexpr std::chrono::milliseconds quiet_spell{250};
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts after everything above exists
};

// ---- client ------------------------------------------------------------------------------

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
    // Where else the server may be ("Alternate ports" above); needs a job.
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
        detail::unique_fd fd;
        try {
          const auto list = detail::resolve(host_, ports[i], false);
          int err = 0;
          for (const addrinfo* ai = list.get(); ai != nullptr && !fd; ai = ai->ai_next) fd = detail::try_connect(ai, attempt, err);
          if (!fd) found[i] = ": " + system_message("connect", err);
        } catch (const error& e) {
          found[i] = ": " + e.message();  // the name may resolve later
        }
        if (!fd) continue;
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
