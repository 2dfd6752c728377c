#pragma once
// ddp::detail::heartbeat::liveness_monitor: finds a silent peer within a bound of its own, not at
// the collective's deadline. A thread of its own sends a small UDP datagram to every peer each
// timeout/8 and reads theirs; a peer not heard from for `timeout` is declared lost. A peer whose
// process is visible (same host and PID namespace) is watched through a pidfd too: its exit,
// which the transports report, ends the watch, and a stop is named as such. The
// verdict names the rank, its host and pid and says what was seen; on_lost gets it once (the
// ring backend aborts its communicators with it). The thread runs whatever the main thread
// does, so a collective that is merely slow, or a rank busy elsewhere, never trips it.
//
// Every peer is watched, not just the ring neighbours: each rank then names the silent rank by
// itself, with no relay through the store (whose host may be the silent rank).
//
// Datagrams: magic, kind (beat or goodbye), rank, the sender's token, sequence. The token is a
// random number each rank publishes with its address in the store; a datagram whose token,
// rank or source address does not match what that rank published is dropped (another job, a
// stranger). A monitor that is destroyed says goodbye, so its peers stop watching it: a rank
// that finishes before the others is not taken for a lost one.
//
// guarded_store: the store as a failing collective's report path sees it. Once a peer is
// suspect (silent for several beats), its calls fail at once instead of waiting on a store
// whose host may be that very peer.

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/host.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/topology.hpp"

namespace ddp::detail::heartbeat {

using clock = std::chrono::steady_clock;

inline constexpr std::uint32_t magic = 0x48504444;  // "DDPH"
inline constexpr std::uint32_t kind_beat = 1;
inline constexpr std::uint32_t kind_goodbye = 2;

struct datagram {
  std::uint32_t magic;
  std::uint32_t kind;
  std::int32_t rank;
  std::uint32_t reserved;
  std::uint64_t token;
  std::uint64_t seq;
};
static_assert(sizeof(datagram) == 32);

/// What the monitor thread, the failure path and guarded_store share.
struct status {
  mutable std::mutex mutex;
  mutable std::condition_variable changed;
  std::chrono::milliseconds timeout{0};
  std::vector<clock::time_point> last_heard;  // by rank; this rank's entry unused
  std::vector<bool> watched;                  // false: this rank, or a peer that said goodbye
  std::optional<std::string> verdict;

  /// Whether a watched peer has been silent for at least `fraction` of the timeout, or one is lost.
  bool troubled(double fraction = 0.375) const {
    std::lock_guard lock(mutex);
    if (verdict) return true;
    const auto now = clock::now();
    const auto limit = std::chrono::duration_cast<clock::duration>(timeout * fraction);
    for (std::size_t r = 0; r < watched.size(); ++r)
      if (watched[r] && now - last_heard[r] >= limit) return true;
    return false;
  }

  /// The verdict, waiting for it while a peer is suspect (silent for several beats) and the
  /// verdict on it is due, but not past `until` (the failing collective's deadline: a collective
  /// never fails later than its timeout for want of the heartbeat's word). What a collective that
  /// lost a peer reports: the verdict, else the suspect when `until` came first, else nothing.
  std::optional<std::string> verdict_after_suspicion(clock::time_point until) const {
    std::unique_lock lock(mutex);
    if (timeout.count() <= 0) return std::nullopt;
    const auto suspect_after = std::chrono::duration_cast<clock::duration>(timeout * 0.375);
    const auto slack = std::chrono::duration_cast<clock::duration>(timeout / 4);
    while (!verdict) {
      const auto now = clock::now();
      std::optional<clock::time_point> due;
      std::size_t suspect = 0;
      for (std::size_t r = 0; r < watched.size(); ++r) {
        if (!watched[r] || now - last_heard[r] < suspect_after) continue;
        const auto at = last_heard[r] + timeout + slack;
        if (!due || at < *due) {
          due = at;
          suspect = r;
        }
      }
      if (!due || now >= *due) break;
      if (now >= until) return describe_suspect(suspect, now);
      changed.wait_until(lock, std::min(*due, until));
    }
    return verdict;
  }

  /// What the monitor knows of each rank ("rank R (host H, pid P)"), for the messages.
  std::vector<std::string> names;

 private:
  std::string describe_suspect(std::size_t r, clock::time_point now) const {
    char text[96];
    std::snprintf(text, sizeof text, " for %.1f s (declared lost after %.1f s of silence; the collective's deadline came first)",
                  std::chrono::duration<double>(now - last_heard[r]).count(), std::chrono::duration<double>(timeout).count());
    return "no heartbeat from " + (r < names.size() ? names[r] : "rank " + std::to_string(r)) + text;
  }
};

/// A store whose calls fail at once (errc::timeout) while the monitor suspects a peer.
class guarded_store final : public ddp::store::store {
 public:
  guarded_store(std::shared_ptr<ddp::store::store> inner, std::shared_ptr<const status> s) : inner_(std::move(inner)), s_(std::move(s)) {}
  void set(const std::string& key, std::span<const std::byte> value) override {
    check();
    inner_->set(key, value);
  }
  std::vector<std::byte> get(const std::string& key) override {
    check();
    return inner_->get(key);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check();
    return inner_->add(key, delta);
  }
  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected, std::span<const std::byte> desired) override {
    check();
    return inner_->compare_set(key, expected, desired);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    check();
    inner_->wait(keys, timeout);
  }
  bool erase(const std::string& key) override {
    check();
    return inner_->erase(key);
  }
  std::int64_t num_keys() override {
    check();
    return inner_->num_keys();
  }

 private:
  void check() const {
    if (s_->troubled()) throw error(errc::timeout, "the store is not consulted while a peer is silent (heartbeat)");
  }
  std::shared_ptr<ddp::store::store> inner_;
  std::shared_ptr<const status> s_;
};

class fd_guard {
 public:
  explicit fd_guard(int fd = -1) noexcept : fd_(fd) {}
  fd_guard(fd_guard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_guard& operator=(fd_guard&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() { reset(); }
  int get() const noexcept { return fd_; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

/// One peer as published in the store.
struct peer_entry {
  int rank = -1;
  std::uint64_t token = 0;
  long pid = 0;
  std::string host;      // its hostname, for messages
  std::string identity;  // its host_identity(): equal to ours when its process is visible
  sockaddr_storage addr{};
  socklen_t addr_len = 0;
  fd_guard pidfd;
};

/// "host:port", "[v6]:port" or a bare host -> the host part, unbracketed.
inline std::string host_of_address(const std::string& address) {
  std::string h = address;
  if (!h.empty() && h.front() == '[') {
    const auto close = h.find(']');
    return h.substr(1, close == std::string::npos ? std::string::npos : close - 1);
  }
  const auto colon = h.rfind(':');
  if (colon != std::string::npos && h.find(':') == colon) h.resize(colon);  // one colon: host:port
  return h;
}

class liveness_monitor {
 public:
  using on_lost_fn = std::function<void(const std::string&)>;

  /// Binds a UDP socket on `bind_host` (the address this rank's transport uses), publishes it
  /// under <prefix>/hb/<rank>, reads every peer's, and starts the thread. Collective: every rank
  /// of the group constructs one, after its transport is built.
  liveness_monitor(ddp::store::store& st, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout,
                   const std::string& bind_host, deadline setup, const rank_topology& topology, std::shared_ptr<status> shared,
                   on_lost_fn on_lost)
      : rank_(rank), size_(size), timeout_(timeout), s_(std::move(shared)), on_lost_(std::move(on_lost)) {
    const error_context here{.rank = rank, .op = "heartbeat"};
    token_ = std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32);
    bind_socket(bind_host, here);
    wake_ = fd_guard(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (wake_.get() < 0) throw error(errc::internal, system_message("eventfd"), here);

    char numeric[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
    if (::getnameinfo(reinterpret_cast<const sockaddr*>(&my_addr_), my_len_, numeric, sizeof numeric, port, sizeof port,
                      NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
      throw error(errc::internal, "heartbeat: cannot print the bound address", here);
    }
    auto key = [&](int r) { return prefix + "/hb/" + std::to_string(r); };
    std::ostringstream mine;
    mine << token_ << ' ' << numeric << ' ' << port;
    st.set_string(key(rank), mine.str());
    ddp::store::wait_for_ranks(st, size, rank, key, setup.remaining(), "their heartbeat address");
    peers_.resize(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      auto& p = peers_[static_cast<std::size_t>(r)];
      p.rank = r;
      std::istringstream in(st.get_string(key(r)));
      std::string addr, service;
      in >> p.token >> addr >> service;
      if (p.token == 0 || service.empty()) throw error(errc::store, "store key '" + key(r) + "' does not hold a ddp heartbeat address", here);
      p.pid = static_cast<long>(topology.of(r).pid);
      p.identity = topology.of(r).identity;
      p.host = topology.of(r).hostname();
      resolve(addr, service, p, here);
      if (topology.shares_host_with(r) && p.pid > 0) {
        // Its process is visible: its exit is seen at once, and a stop can be told apart.
        p.pidfd = fd_guard(static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(p.pid), 0)));
      }
    }
    {
      std::lock_guard lock(s_->mutex);
      s_->timeout = timeout_;
      s_->last_heard.assign(static_cast<std::size_t>(size), clock::now());
      s_->watched.assign(static_cast<std::size_t>(size), true);
      s_->watched[static_cast<std::size_t>(rank)] = false;
      s_->names.resize(static_cast<std::size_t>(size));
      for (const auto& p : peers_)
        if (p.rank >= 0) s_->names[static_cast<std::size_t>(p.rank)] = name_of(p);
    }
    thread_ = std::thread([this] { loop(); });
  }

  liveness_monitor(const liveness_monitor&) = delete;
  liveness_monitor& operator=(const liveness_monitor&) = delete;

  ~liveness_monitor() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto w = ::write(wake_.get(), &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    send_all(kind_goodbye);  // the socket is this thread's alone now
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  void bind_socket(const std::string& host, const error_context& here) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0 || found == nullptr) {
      throw error(errc::config, "heartbeat: cannot resolve this rank's address '" + host + "': " + ::gai_strerror(rc), here);
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
    sock_ = fd_guard(::socket(found->ai_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (sock_.get() < 0) throw error(errc::internal, system_message("heartbeat: socket"), here);
    if (::bind(sock_.get(), found->ai_addr, found->ai_addrlen) != 0) {
      throw error(errc::config, system_message("heartbeat: bind to " + host), here);
    }
    my_len_ = sizeof my_addr_;
    if (::getsockname(sock_.get(), reinterpret_cast<sockaddr*>(&my_addr_), &my_len_) != 0) {
      throw error(errc::internal, system_message("heartbeat: getsockname"), here);
    }
  }

  static void resolve(const std::string& addr, const std::string& service, peer_entry& p, const error_context& here) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (::getaddrinfo(addr.c_str(), service.c_str(), &hints, &found) != 0 || found == nullptr) {
      throw error(errc::store, "heartbeat: rank " + std::to_string(p.rank) + " published an address that does not parse: '" + addr + "'", here);
    }
    std::memcpy(&p.addr, found->ai_addr, found->ai_addrlen);
    p.addr_len = static_cast<socklen_t>(found->ai_addrlen);
    ::freeaddrinfo(found);
  }

  static bool same_address(const sockaddr_storage& a, socklen_t alen, const sockaddr_storage& b, socklen_t blen) {
    if (a.ss_family != b.ss_family) return false;
    if (a.ss_family == AF_INET) {
      const auto& x = reinterpret_cast<const sockaddr_in&>(a);
      const auto& y = reinterpret_cast<const sockaddr_in&>(b);
      return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
    }
    if (a.ss_family == AF_INET6) {
      const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
      const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
      return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
    }
    return alen == blen && std::memcmp(&a, &b, alen) == 0;
  }

  void send_all(std::uint32_t kind) noexcept {
    const datagram d{.magic = magic, .kind = kind, .rank = rank_, .reserved = 0, .token = token_, .seq = seq_++};
    for (const auto& p : peers_) {
      if (p.rank < 0) continue;
      // Best effort: a full buffer or an unreachable peer is what the receiver's silence reports.
      [[maybe_unused]] const auto n =
          ::sendto(sock_.get(), &d, sizeof d, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&p.addr), p.addr_len);
    }
  }

  // Reads every queued datagram; records who was heard from and who said goodbye.
  void drain() {
    const auto now = clock::now();
    std::lock_guard lock(s_->mutex);
    for (;;) {
      datagram d{};
      sockaddr_storage from{};
      socklen_t from_len = sizeof from;
      const ssize_t n = ::recvfrom(sock_.get(), &d, sizeof d, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &from_len);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;  // EAGAIN, or an ICMP error from a peer that is gone: its silence will tell
      }
      if (n != static_cast<ssize_t>(sizeof d) || d.magic != magic || d.rank < 0 || d.rank >= size_ || d.rank == rank_) continue;
      const auto& p = peers_[static_cast<std::size_t>(d.rank)];
      if (d.token != p.token || !same_address(from, from_len, p.addr, p.addr_len)) continue;  // not from this job
      const auto r = static_cast<std::size_t>(d.rank);
      s_->last_heard[r] = now;
      if (d.kind == kind_goodbye) s_->watched[r] = false;
    }
  }

  std::string describe_silent(const peer_entry& p, clock::duration silent) const {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.1f", std::chrono::duration<double>(silent).count());
    const std::string who = name_of(p);
    if (p.pidfd.get() >= 0 && process_stopped(p.pid)) {
      return "no heartbeat from " + who + " for " + seconds + " s: the process is stopped (SIGSTOP or a debugger)";
    }
    return "no heartbeat from " + who + " for " + seconds + " s: the process is stopped, or its host or the network is down";
  }

  static std::string name_of(const peer_entry& p) {
    return "rank " + std::to_string(p.rank) + " (host " + p.host + ", pid " + std::to_string(p.pid) + ")";
  }

  // State 'T' (stopped) or 't' (traced) in /proc/<pid>/stat.
  static bool process_stopped(long pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto paren = text.rfind(')');
    if (paren == std::string::npos || paren + 2 >= text.size()) return false;
    const char state = text[paren + 2];
    return state == 'T' || state == 't';
  }

  void declare(std::string why) {
    {
      std::lock_guard lock(s_->mutex);
      if (s_->verdict) return;
      s_->verdict = why;
    }
    s_->changed.notify_all();
    if (on_lost_) on_lost_(why);
  }

  void loop() {
    const auto beat = std::max<clock::duration>(std::chrono::duration_cast<clock::duration>(timeout_ / 8), std::chrono::milliseconds(10));
    auto next_beat = clock::now();
    std::vector<pollfd> fds;
    std::vector<int> pid_rank;  // the rank of fds[i] for i >= 2
    for (;;) {
      auto now = clock::now();
      if (now >= next_beat) {
        send_all(kind_beat);
        next_beat = now + beat;
      }
      // Wake for the next beat, or when a peer's silence reaches the timeout.
      // After a verdict it only beats (its peers must not take this rank for the silent one).
      auto wake_at = next_beat;
      bool lost = false;
      fds.clear();
      pid_rank.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({sock_.get(), POLLIN, 0});
      {
        std::lock_guard lock(s_->mutex);
        lost = s_->verdict.has_value();
        for (std::size_t r = 0; r < s_->watched.size() && !lost; ++r) {
          if (!s_->watched[r]) continue;  // its pidfd, readable for good once it exits, would spin this loop
          wake_at = std::min(wake_at, s_->last_heard[r] + timeout_);
          if (const int fd = peers_[r].pidfd.get(); fd >= 0) {
            fds.push_back({fd, POLLIN, 0});
            pid_rank.push_back(static_cast<int>(r));
          }
        }
      }
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(std::max(wake_at - now, clock::duration::zero()));
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<std::int64_t>(wait.count(), 60'000)));
      if (ready < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) return;  // destroyed
      drain();
      if (lost) continue;
      for (std::size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        // An exit is the transports' to report, and only to a rank that needs that peer: stop
        // watching it rather than take it for a silent one.
        std::lock_guard lock(s_->mutex);
        s_->watched[static_cast<std::size_t>(pid_rank[i - 2])] = false;
      }
      now = clock::now();
      std::optional<std::pair<int, clock::duration>> silent;
      {
        std::lock_guard lock(s_->mutex);
        if (s_->verdict) continue;
        for (std::size_t r = 0; r < s_->watched.size(); ++r) {
          if (s_->watched[r] && now - s_->last_heard[r] >= timeout_) {
            silent = {static_cast<int>(r), now - s_->last_heard[r]};
            break;
          }
        }
      }
      if (silent) declare(describe_silent(peers_[static_cast<std::size_t>(silent->first)], silent->second));
    }
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<status> s_;
  on_lost_fn on_lost_;
  std::uint64_t token_ = 0;
  std::uint64_t seq_ = 0;
  fd_guard sock_;
  fd_guard wake_;
  sockaddr_storage my_addr_{};
  socklen_t my_len_ = 0;
  std::vector<peer_entry> peers_;
  std::thread thread_;  // last: started once everything above is set
};

}  // namespace ddp::detail::heartbeat
