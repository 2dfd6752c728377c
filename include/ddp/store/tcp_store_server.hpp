#pragma once
// tcp_store_server: the server of a job's rendezvous store (tcp_store.hpp is its client, and
// the overview). Rank 0 runs it inside its tcp_store (options::is_server), or a launcher runs
// it alone (launch/store_host.hpp).
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

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/port_holder.hpp"
#include "ddp/store/detail/secret.hpp"
#include "ddp/store/detail/server_core.hpp"
#include "ddp/store/detail/socket.hpp"

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

}  // namespace detail

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

}  // namespace ddp::store
