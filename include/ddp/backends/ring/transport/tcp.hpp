#pragma once
// ddp::tcp_transport: a full mesh of TCP connections between the ranks of a group, models ddp::transport.
//
// Rendezvous (through the store, under `prefix`): every rank listens on an ephemeral port of its
// listen address and publishes "host:port nonce" under <prefix>/tcp/addr/<rank>. Rank i connects to
// every rank j < i and sends a hello (magic, version, i, world size, j's nonce, a hash of the prefix);
// j accepts only a hello that carries its own nonce from a rank it still expects, and answers with
// i's nonce. Anything else on the port (a port scanner, a stranger, garbage, a silent socket) is
// closed without disturbing the group. The listener is closed once the mesh is complete.
//
// Listen address: tcp_options::listen_address, else DDP_SOCKET_ADDR, else 127.0.0.1 when every
// rank runs on this host (decided from the host identities the ranks publish); on several hosts,
// the local address this host reaches MASTER_ADDR from; failing all of these, a config error that
// says what to set (binding 0.0.0.0 silently would expose the job to the network).
//
// Data path: non-blocking sockets, TCP_NODELAY, large SO_SNDBUF/SO_RCVBUF; send_recv moves both
// directions in one poll loop, so a ring step cannot deadlock at any size; scatter-gather pieces
// (send_recv_v) put a header and its payload in one syscall. EOF or reset is errc::peer_lost naming
// the peer at once; an expired deadline is errc::timeout saying how far the transfer got.
//
// Waiting: a transfer that would block first busy-polls its sockets for up to tcp_options::spin
// (else DDP_TCP_SPIN_US, else 50 us; 0: never) and only then sleeps in poll(). A rank asleep in
// poll() pays a scheduler wake-up when the peer's bytes land (on a VM whose idle vCPUs halt, an
// interrupt into a halted vCPU too), several times what a small message takes over loopback. The budget adapts: a spin that ends without
// data halves it (down to 0, then one full spin every 64 waits to look again), one that catches
// data restores it, so a rank on a loaded host soon stops taking CPU from the ranks it waits
// for. Spinning is off when this host runs more of the group's ranks than they may use CPUs
// together (rank_topology::cpus_of_this_host).
//
// abort() shuts every socket down and wakes pollers through an eventfd, from any thread.
// One thread at a time may move data; abort() and the counters may be used from any thread.
// It lives in namespace ddp, not ddp::transport: that name is taken by the transport concept.

#include <sys/eventfd.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/host.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/pieces.hpp"
#include "ddp/backends/ring/transport/shm_segment.hpp"
#include "ddp/backends/ring/transport/socket.hpp"
#include "ddp/backends/ring/transport/topology.hpp"

namespace ddp {

struct tcp_options {
  std::string listen_address;                               // empty: DDP_SOCKET_ADDR, else see above
  std::chrono::milliseconds timeout = default_timeout();    // for building the mesh
  int socket_buffer_bytes = 4 << 20;                        // SO_SNDBUF / SO_RCVBUF request
  std::optional<std::chrono::microseconds> spin;            // busy-poll before sleeping; empty: DDP_TCP_SPIN_US, else 50 us
};

namespace detail::tcp {

inline constexpr std::uint32_t hello_magic = 0x54504444;  // "DDPT"
inline constexpr std::uint32_t hello_version = 1;
inline constexpr std::size_t hello_size = 48;
using nonce = std::array<unsigned char, 16>;

inline std::uint64_t fnv1a(std::string_view s) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

struct hello {
  std::uint32_t kind = 1;  // 1: hello from the connecting rank, 2: its answer
  std::uint32_t rank = 0;
  std::uint32_t size = 0;
  nonce token{};
  std::uint64_t prefix_hash = 0;

  std::array<unsigned char, hello_size> encode() const noexcept {
    std::array<unsigned char, hello_size> b{};
    auto put = [&](std::size_t at, std::uint64_t v, int bytes) {
      for (int i = 0; i < bytes; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
    };
    put(0, hello_magic, 4);
    put(4, hello_version, 4);
    put(8, kind, 4);
    put(12, rank, 4);
    put(16, size, 4);
    for (std::size_t i = 0; i < token.size(); ++i) b[20 + i] = token[i];
    put(36, prefix_hash, 8);
    return b;
  }
  /// False for anything that is not a well-formed hello of this version.
  static bool decode(const unsigned char* b, hello& out) noexcept {
    auto get = [&](std::size_t at, int bytes) {
      std::uint64_t v = 0;
      for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(b[at + static_cast<std::size_t>(i)]) << (8 * i);
      return v;
    };
    if (get(0, 4) != hello_magic || get(4, 4) != hello_version) return false;
    out.kind = static_cast<std::uint32_t>(get(8, 4));
    out.rank = static_cast<std::uint32_t>(get(12, 4));
    out.size = static_cast<std::uint32_t>(get(16, 4));
    for (std::size_t i = 0; i < out.token.size(); ++i) out.token[i] = b[20 + i];
    out.prefix_hash = get(36, 8);
    return true;
  }
};

inline std::string to_hex(const nonce& n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : n) {
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

inline bool from_hex(std::string_view s, nonce& n) {
  if (s.size() != 2 * n.size()) return false;
  auto val = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  for (std::size_t i = 0; i < n.size(); ++i) {
    const int hi = val(s[2 * i]), lo = val(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    n[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

inline nonce random_nonce() {
  std::random_device rd;
  nonce n{};
  for (std::size_t i = 0; i < n.size(); i += 4) {
    const auto v = rd();
    for (std::size_t k = 0; k < 4; ++k) n[i + k] = static_cast<unsigned char>(v >> (8 * k));
  }
  return n;
}

/// A handshake's socket error, worded as the transport's lost() words it later: a peer that
/// exited or aborted is named as the one that went, which launchers read as another rank's
/// failure (ddp/launch/root_cause.hpp), not as a cause of this rank's own.
[[noreturn]] inline void handshake_failed(const std::string& who, const char* call, int err) {
  if (err == ECONNRESET) throw error(errc::peer_lost, "peer " + who + " reset the connection during the handshake (it exited or aborted)");
  if (err == EPIPE) throw error(errc::peer_lost, "peer " + who + " closed the connection during the handshake");
  throw error(errc::peer_lost, system_message(std::string(call) + who, err));
}

/// Writes all of `bytes` on a non-blocking socket before the deadline (rendezvous only).
inline void write_all(int fd, const unsigned char* bytes, std::size_t n, deadline dl, const std::string& who) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t w = ::send(fd, bytes + done, n - done, MSG_NOSIGNAL);
    if (w > 0) {
      done += static_cast<std::size_t>(w);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) handshake_failed(who, "send to ", errno);
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, dl.poll_timeout_ms()) == 0) throw error(errc::timeout, "timed out sending the hello to " + who);
  }
}

inline void read_all(int fd, unsigned char* bytes, std::size_t n, deadline dl, const std::string& who) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::recv(fd, bytes + done, n - done, 0);
    if (r > 0) {
      done += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) throw error(errc::peer_lost, who + " closed the connection during the handshake");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) handshake_failed(who, "recv from ", errno);
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, dl.poll_timeout_ms()) == 0) throw error(errc::timeout, "timed out waiting for the answer of " + who);
  }
}

/// A cursor over scatter-gather pieces.
template <class Piece>
struct piece_cursor {
  std::span<const Piece> pieces;
  std::size_t index = 0, offset = 0, total = 0, done_bytes = 0;

  explicit piece_cursor(std::span<const Piece> p) : pieces(p) {
    for (const auto& x : p) total += x.size();
    skip_empty();
  }
  bool done() const noexcept { return index >= pieces.size(); }
  void skip_empty() noexcept {
    while (index < pieces.size() && offset >= pieces[index].size()) {
      ++index;
      offset = 0;
    }
  }
  void advance(std::size_t n) noexcept {
    done_bytes += n;
    while (n > 0) {
      const std::size_t left = pieces[index].size() - offset;
      const std::size_t take = n < left ? n : left;
      offset += take;
      n -= take;
      if (offset == pieces[index].size()) {
        ++index;
        offset = 0;
      }
    }
    skip_empty();
  }
  /// iovecs for what is left; `first_only` stops at the end of the current piece.
  int fill(iovec* iov, int max, bool first_only) const noexcept {
    int n = 0;
    for (std::size_t i = index, off = offset; i < pieces.size() && n < max; ++i, off = 0) {
      if (pieces[i].size() == off) continue;
      iov[n].iov_base = const_cast<std::byte*>(pieces[i].data()) + off;  // sendmsg does not write
      iov[n].iov_len = pieces[i].size() - off;
      ++n;
      if (first_only) break;
    }
    return n;
  }
};

struct no_progress {
  void operator()(std::size_t) const noexcept {}
};

/// tcp_options::spin, else DDP_TCP_SPIN_US (whole microseconds), else 50 us.
inline std::chrono::microseconds wanted_spin(const std::optional<std::chrono::microseconds>& option) {
  if (option) return *option;
  if (const char* env = read_env_nonempty("DDP_TCP_SPIN_US"); env != nullptr) {
    return std::chrono::microseconds(ddp::detail::env_int("DDP_TCP_SPIN_US", env, 0, "50"));
  }
  return std::chrono::microseconds(50);
}

/// The busy-poll budget of a rank: `wanted` unless this host runs more of the group's ranks
/// than they may use CPUs together (a spinning rank would then hold the core its peer needs).
inline std::chrono::microseconds spin_budget(std::chrono::microseconds wanted, int ranks_on_host, int cpus) noexcept {
  if (wanted <= std::chrono::microseconds::zero() || ranks_on_host > cpus) return std::chrono::microseconds::zero();
  return wanted;
}

/// The adaptive spin of one transport (see the header comment); used by the data thread only.
class spin_policy {
 public:
  static constexpr unsigned probe_every = 64;

  spin_policy() = default;
  explicit spin_policy(std::chrono::microseconds max) noexcept : max_(max), now_(max) {}

  std::chrono::microseconds max() const noexcept { return max_; }
  /// How long to spin at the start of a wait.
  std::chrono::nanoseconds next() noexcept {
    if (now_ > std::chrono::nanoseconds::zero()) return now_;
    if (max_ > std::chrono::microseconds::zero() && ++idle_waits_ % probe_every == 0) return max_;
    return std::chrono::nanoseconds::zero();
  }
  void caught() noexcept { now_ = max_; }
  void missed() noexcept {
    now_ /= 2;
    if (now_ < std::chrono::microseconds(1)) now_ = std::chrono::nanoseconds::zero();
  }

 private:
  std::chrono::microseconds max_{0};
  std::chrono::nanoseconds now_{0};
  unsigned idle_waits_ = 0;
};

}  // namespace detail::tcp

class tcp_transport {
 public:
  /// The kernel copies every receive into place (algo::detail::lands_receives_page_aligned).
  static constexpr bool lands_receives_page_aligned = true;

  /// `topology`: where the ranks run, when the caller has exchanged it already (the ring
  /// backend); without it the transport exchanges its own.
  tcp_transport(ddp::store::store& store, int rank, int size, std::string prefix, tcp_options opts = {}, const rank_topology* topology = nullptr)
      : s_(std::make_unique<state>()) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw error(errc::invalid_argument, "tcp_transport: rank " + std::to_string(rank) + " is not in a group of size " + std::to_string(size));
    }
    s_->rank = rank;
    s_->size = size;
    if (topology != nullptr) s_->numbering = topology->numbering();
    s_->peers = std::vector<peer_link>(static_cast<std::size_t>(size));
    s_->wake = detail::tcp::unique_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!s_->wake) throw error(errc::internal, system_message("eventfd"));
    if (size > 1) {
      try {
        connect_mesh(store, prefix, opts, topology);
      } catch (const error& e) {
        if (e.code() == errc::peer_lost || e.code() == errc::timeout) throw_store_trouble(store, named_self(), &e);
        throw;
      }
    }
  }
  tcp_transport(tcp_transport&&) noexcept = default;
  tcp_transport& operator=(tcp_transport&&) noexcept = default;
  ~tcp_transport() = default;  // unique_fds close every socket and the eventfd

  int rank() const noexcept { return s_->rank; }
  /// The numbers the ranks go by in messages (the topology's: a level of the hierarchy names the
  /// backend's ranks).
  const rank_numbering& numbering() const noexcept { return s_->numbering; }
  int size() const noexcept { return s_->size; }
  /// "host:port" this rank listened on while the mesh was built.
  const std::string& address() const noexcept { return s_->address; }
  /// The most a wait busy-polls before it sleeps: tcp_options::spin, or 0 where spinning is off.
  std::chrono::microseconds spin() const noexcept { return s_->spin.max(); }

  void send(int peer, std::span<const std::byte> out, deadline dl) {
    const send_piece p[1] = {out};
    send_recv_v(peer, p, -1, {}, dl, detail::tcp::no_progress{});
  }
  void recv(int peer, std::span<std::byte> in, deadline dl) {
    const recv_piece p[1] = {in};
    send_recv_v(-1, {}, peer, p, dl, detail::tcp::no_progress{});
  }
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, deadline dl) {
    const send_piece o[1] = {out};
    const recv_piece i[1] = {in};
    send_recv_v(to, o, from, i, dl, detail::tcp::no_progress{});
  }

  /// Sends the pieces of `out` to `to` while receiving into the pieces of `in` from `from`
  /// (either side may be empty, `to`/`from` may be the same peer). progress(received_bytes) is
  /// called when the first incoming piece is complete, before any byte past it is read (so a
  /// header can be checked before its payload lands), and each time the loop would block (so the
  /// caller can do useful work, e.g. reduce the previous chunk, while bytes are in flight).
  template <class Progress>
  void send_recv_v(int to, std::span<const send_piece> out, int from, std::span<const recv_piece> in, deadline dl,
                   Progress&& progress) {
    detail::tcp::piece_cursor<send_piece> oc(out);
    detail::tcp::piece_cursor<recv_piece> ic(in);
    const int to_fd = oc.done() ? -1 : fd_of(to);
    const int from_fd = ic.done() ? -1 : fd_of(from);
    const bool report_first = !in.empty() && !in[0].empty();
    bool spinning = false;
    clock::time_point spin_end{};
    while (!oc.done() || !ic.done()) {
      if (s_->aborted.load(std::memory_order_acquire)) throw aborted_error();
      bool moved = false;
      if (!oc.done()) {
        iovec iov[16];
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = static_cast<std::size_t>(oc.fill(iov, 16, false));
        const ssize_t w = ::sendmsg(to_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
          oc.advance(static_cast<std::size_t>(w));
          s_->peers[static_cast<std::size_t>(to)].sent.fetch_add(static_cast<std::uint64_t>(w), std::memory_order_relaxed);
          moved = true;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          lost(to, errno);
        }
      }
      if (!ic.done()) {
        iovec iov[16];
        const bool first = ic.index == 0;
        const int n = ic.fill(iov, 16, first);
        const ssize_t r = ::readv(from_fd, iov, n);
        if (r > 0) {
          ic.advance(static_cast<std::size_t>(r));
          s_->peers[static_cast<std::size_t>(from)].received.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
          moved = true;
          if (first && report_first && ic.index > 0) progress(ic.done_bytes);
        } else if (r == 0) {
          lost(from, 0);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          lost(from, errno);
        }
      }
      if (moved || (oc.done() && ic.done())) {
        if (spinning) s_->spin.caught();
        spinning = false;
        continue;
      }
      progress(ic.done_bytes);
      // Busy-poll before sleeping (see the header comment); the deadline still bounds it.
      if (!spinning) {
        if (const auto budget = s_->spin.next(); budget > clock::duration::zero()) {
          spinning = true;
          spin_end = std::min(clock::now() + budget, dl.time_point());
          continue;
        }
      } else {
        if (clock::now() < spin_end) continue;
        s_->spin.missed();
        spinning = false;
      }
      pollfd p[3];
      nfds_t n = 0;
      if (to_fd >= 0 && to_fd == from_fd) {
        p[n++] = {to_fd, static_cast<short>((oc.done() ? 0 : POLLOUT) | (ic.done() ? 0 : POLLIN)), 0};
      } else {
        if (!oc.done()) p[n++] = {to_fd, POLLOUT, 0};
        if (!ic.done()) p[n++] = {from_fd, POLLIN, 0};
      }
      p[n++] = {s_->wake.get(), POLLIN, 0};
      const int rc = ::poll(p, n, dl.poll_timeout_ms());
      if (rc == 0) throw error(errc::timeout, timeout_message(to, oc, from, ic), {.rank = named_self()});
      if (rc < 0 && errno != EINTR) throw error(errc::internal, system_message("poll"));
    }
  }

  /// Unblocks every call of this transport from any thread, for good: sockets are shut down
  /// (peers see EOF at once) and pollers are woken. Never blocks.
  void abort() noexcept {
    if (!s_) return;
    s_->aborted.store(true, std::memory_order_release);
    for (auto& p : s_->peers)
      if (p.fd) ::shutdown(p.fd.get(), SHUT_RDWR);
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto w = ::write(s_->wake.get(), &one, sizeof one);
  }
  bool aborted() const noexcept { return s_->aborted.load(std::memory_order_acquire); }

  /// The peer whose connection failed last (-1 if none): lets a caller name the origin of a failure.
  int lost_peer() const noexcept { return s_->lost_peer.load(std::memory_order_relaxed); }

  /// Payload bytes moved on the connection to `peer` since construction (handshake excluded).
  std::uint64_t bytes_sent(int peer) const { return s_->peers.at(static_cast<std::size_t>(peer)).sent.load(std::memory_order_relaxed); }
  std::uint64_t bytes_received(int peer) const {
    return s_->peers.at(static_cast<std::size_t>(peer)).received.load(std::memory_order_relaxed);
  }
  std::uint64_t total_bytes_sent() const {
    std::uint64_t t = 0;
    for (const auto& p : s_->peers) t += p.sent.load(std::memory_order_relaxed);
    return t;
  }
  std::uint64_t total_bytes_received() const {
    std::uint64_t t = 0;
    for (const auto& p : s_->peers) t += p.received.load(std::memory_order_relaxed);
    return t;
  }

 private:
  // This rank's number in its errors (the backend's, on a level of the hierarchy).
  int named_self() const noexcept { return s_->numbering(s_->rank); }

  struct peer_link {
    detail::tcp::unique_fd fd;
    std::atomic<std::uint64_t> sent{0}, received{0};
  };
  struct state {
    int rank = 0, size = 1;
    std::vector<peer_link> peers;
    detail::tcp::unique_fd wake;
    std::atomic<bool> aborted{false};
    std::atomic<int> lost_peer{-1};
    std::string address;
    detail::tcp::spin_policy spin;
    rank_numbering numbering;
  };

  int fd_of(int peer) const {
    if (peer < 0 || peer >= s_->size || peer == s_->rank) {
      throw error(errc::invalid_argument, "tcp_transport: rank " + std::to_string(peer) + " is not a peer of rank " +
                                              std::to_string(s_->rank) + " in a group of size " + std::to_string(s_->size),
                  {.rank = named_self()});
    }
    const int fd = s_->peers[static_cast<std::size_t>(peer)].fd.get();
    if (fd < 0) throw aborted_error();
    return fd;
  }

  error aborted_error() const {
    return error(errc::peer_lost, "the transport was aborted (abort() on this rank, after an error or a deadline)", {.rank = named_self()});
  }

  [[noreturn]] void lost(int peer, int err) {
    if (s_->aborted.load(std::memory_order_acquire)) throw aborted_error();
    s_->lost_peer.store(peer, std::memory_order_relaxed);
    const std::string who = "peer " + s_->numbering.rank(peer);
    if (err == 0 || err == EPIPE) throw error(errc::peer_lost, who + " closed the connection", {.rank = named_self()});
    if (err == ECONNRESET) throw error(errc::peer_lost, who + " reset the connection (it exited or aborted)", {.rank = named_self(), .backend_code = err});
    throw error(errc::peer_lost, system_message("connection to " + who, err), {.rank = named_self(), .backend_code = err});
  }

  template <class O, class I>
  std::string timeout_message(int to, const O& oc, int from, const I& ic) const {
    std::string s = "deadline expired";
    if (oc.total > 0) s += ": sent " + std::to_string(oc.done_bytes) + " of " + std::to_string(oc.total) + " bytes to " + s_->numbering.rank(to);
    if (ic.total > 0) {
      s += oc.total > 0 ? ", " : ": ";
      s += "received " + std::to_string(ic.done_bytes) + " of " + std::to_string(ic.total) + " bytes from " + s_->numbering.rank(from);
    }
    if (!ic.done()) s += " (" + s_->numbering.rank(from) + " has not sent its part: not arrived at this call, or stalled)";
    return s;
  }

  /// tcp_options::listen_address, else DDP_SOCKET_ADDR; empty when neither is set.
  static std::string given_listen_address(const tcp_options& opts) {
    if (!opts.listen_address.empty()) return opts.listen_address;
    if (const char* env = read_env_nonempty("DDP_SOCKET_ADDR"); env != nullptr) return env;
    return {};
  }

  /// Where the group's ranks run, from the topology every rank of a transport built on its own
  /// publishes before it listens or connects (see connect_mesh).
  rank_topology published_topology(ddp::store::store& store, const std::string& prefix, const tcp_options& opts) {
    std::vector<std::string> keys;
    for (int r = 0; r < s_->size; ++r) keys.push_back(prefix + "/topology/" + std::to_string(r));
    wait_for_ranks(store, keys, opts.timeout, "publish their host identity");
    return rank_topology::read(store, prefix + "/topology/", s_->rank, s_->size);
  }

  /// The listen address when none is given: loopback when every rank runs on this host.
  std::string choose_listen_address(int ranks_on_host) {
    if (ranks_on_host != s_->size) {
      // Several hosts: listen where this host reaches the rendezvous host from.
      if (const char* master = read_env_nonempty("MASTER_ADDR"); master != nullptr) {
        if (auto address = local_address_towards(master); !address.empty()) return address;
      }
      throw error(errc::config, "the ranks run on several hosts: set DDP_SOCKET_ADDR (or tcp_options::listen_address) to "
                                "this host's address on the network the ranks share", {.rank = named_self()});
    }
    return "127.0.0.1";
  }

  /// Whether a store that went away while this rank waited on it late in its wait most likely went
  /// with a host that gave up on the same missing ranks (then they are the cause, not the host).
  static bool store_gone_at_deadline(const deadline& dl, std::chrono::milliseconds timeout) {
    return dl.remaining() <= std::max<std::chrono::milliseconds>(std::chrono::milliseconds(500), timeout / 2);
  }

  /// store.wait, with failures that name the ranks that never published their key (keys[r] is rank r's).
  void wait_for_ranks(ddp::store::store& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                      const std::string& what) {
    const deadline dl = deadline::after(timeout);
    // Slices: a store that goes away mid-wait is told from one that gave up at the deadline.
    constexpr std::chrono::milliseconds slice{1000};
    std::vector<std::size_t> missing;  // as last looked at; only these are asked again
    for (std::size_t r = 0; r < keys.size(); ++r) missing.push_back(r);
    bool looked = false;
    auto look = [&] {
      std::vector<std::size_t> still;
      for (const auto r : missing) {
        try {
          store.wait({keys[r]}, std::chrono::milliseconds(0));
        } catch (const error& x) {
          if (x.code() != errc::timeout) throw;
          still.push_back(r);
        }
      }
      missing = std::move(still);
      looked = true;
    };
    auto not_done = [&] {
      const std::string names = s_->numbering.list(missing);
      return "timed out building the tcp mesh: rank(s) " + names + " did not " + what + " within " + std::to_string(timeout.count()) +
             " ms: exited, hung, or never started (or a different store / prefix)?";
    };
    while (true) {
      try {
        store.wait(keys, std::min(dl.remaining(), slice));
        return;
      } catch (const error& e) {
        if (e.code() == errc::store && looked && !missing.empty() && store_gone_at_deadline(dl, timeout)) {
          throw error(errc::timeout, not_done() + " (then: " + e.message() + ")", {.rank = named_self()});
        }
        if (e.code() != errc::timeout) {
          auto c = e.context();
          c.rank = named_self();
          throw e.with_context(std::move(c));
        }
      }
      look();
      if (missing.empty()) return;
      if (dl.expired()) throw error(errc::timeout, not_done(), {.rank = named_self()});
    }
  }

  // Throws the store's trouble, if it has any: a death it heard of, or the store gone with its
  // host (often rank 0). A peer that closed its connection or never came while the mesh was
  // built may have left because of it, so that is the cause every rank names; this rank's own
  // finding (`seen`, unless it already is that trouble) follows it.
  static void throw_store_trouble(ddp::store::store& store, int rank, const error* seen = nullptr) {
    const auto trouble = ddp::store::store_trouble(store);
    if (!trouble) return;
    std::string then;
    if (seen != nullptr) {
      if (seen->message().find(trouble->message()) != std::string::npos) return;
      then = "; then: " + seen->message();
    }
    throw error(trouble->code(), trouble->message() + " (while building the tcp mesh" + then + ")", {.rank = rank});
  }

  void connect_mesh(ddp::store::store& store, const std::string& prefix, const tcp_options& opts, const rank_topology* topology) {
    const deadline dl = deadline::after(opts.timeout);
    const int rank = s_->rank, size = s_->size;
    const int named = named_self();  // this rank's number in messages
    const auto& numbering = s_->numbering;
    const std::uint64_t prefix_hash = detail::tcp::fnv1a(prefix);
    const auto spin = detail::tcp::wanted_spin(opts.spin);  // a bad DDP_TCP_SPIN_US fails before any waiting
    // The ranks on this host decide the listen address (when none is given) and whether waits
    // may spin. With an address given, the count waits until the mesh is built, so a rank
    // listens before the others arrive; by then every rank has published (before connecting).
    int ranks_on_host = topology != nullptr ? topology->ranks_on_this_host() : 0;
    int host_cpus = topology != nullptr ? topology->cpus_of_this_host() : 0;
    if (topology == nullptr) rank_topology::publish(store, prefix + "/topology/", rank);
    const auto learn_this_host = [&] {
      if (ranks_on_host != 0) return;
      const rank_topology published = published_topology(store, prefix, opts);
      ranks_on_host = published.ranks_on_this_host();
      host_cpus = published.cpus_of_this_host();
    };
    std::string host = given_listen_address(opts);
    if (host.empty()) {
      learn_this_host();
      host = choose_listen_address(ranks_on_host);
    }
    detail::tcp::unique_fd listener = detail::tcp::listen_ephemeral(host, size + 64);
    const detail::tcp::host_port me{host, detail::tcp::port_of(listener.get())};
    s_->address = me.str();
    const detail::tcp::nonce my_nonce = detail::tcp::random_nonce();
    auto key = [&](int r) { return prefix + "/tcp/addr/" + std::to_string(r); };
    // The waits for peers below ask the store this often whether it heard of a death or is gone.
    constexpr std::chrono::milliseconds departure_check_every{100};
    store.set_string(key(rank), me.str() + " " + detail::tcp::to_hex(my_nonce));

    auto published = [&](int r, detail::tcp::host_port& addr, detail::tcp::nonce& n) {
      try {
        store.wait({key(r)}, dl.remaining());
      } catch (const error& e) {
        const std::string late = "timed out building the tcp mesh: " + numbering.rank(r) + " did not publish an address within " +
                                 std::to_string(opts.timeout.count()) + " ms: " + numbering.rank(r) + " exited, hung, or never started?";
        if (e.code() == errc::store && store_gone_at_deadline(dl, opts.timeout)) throw error(errc::timeout, late + " (then: " + e.message() + ")", {.rank = named});
        if (e.code() != errc::timeout) throw;
        throw error(errc::timeout, late, {.rank = named});
      }
      const std::string v = store.get_string(key(r));
      const auto space = v.find(' ');
      if (space == std::string::npos || !detail::tcp::from_hex(std::string_view(v).substr(space + 1), n)) {
        throw error(errc::store, "store key '" + key(r) + "' does not hold a ddp tcp address ('" + v + "')", {.rank = named});
      }
      addr = detail::tcp::parse_host_port(std::string_view(v).substr(0, space));
    };

    // Phase 1: connect to every lower rank. Lower ranks answer only after their own phase 1,
    // so the chain of waits ends at rank 0 and cannot deadlock.
    for (int j = 0; j < rank; ++j) {
      detail::tcp::host_port addr;
      detail::tcp::nonce theirs{};
      published(j, addr, theirs);
      const std::string who = numbering.rank(j) + " at " + addr.str();
      detail::tcp::unique_fd fd;
      while (!fd) {  // in slices: between them, the store may already know that rank j died
        try {
          fd = detail::tcp::connect_before(addr, deadline::after(std::min(dl.remaining(), departure_check_every)));
        } catch (const error& e) {  // it published its address, so it was listening: it has gone since
          if (e.code() != errc::timeout || dl.expired()) {
            throw error(e.code(), who + " published its address but could not be reached: " + e.message() + ": " +
                                      numbering.rank(j) + " exited or hung?",
                        {.rank = named});
          }
          throw_store_trouble(store, named);
        }
      }
      const auto out = detail::tcp::hello{1, static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(size), theirs, prefix_hash}.encode();
      detail::tcp::write_all(fd.get(), out.data(), out.size(), dl, who);
      unsigned char in[detail::tcp::hello_size];
      detail::tcp::read_all(fd.get(), in, sizeof in, dl, who);
      detail::tcp::hello h;
      if (!detail::tcp::hello::decode(in, h) || h.kind != 2 || h.rank != static_cast<std::uint32_t>(j) || h.token != my_nonce ||
          h.prefix_hash != prefix_hash) {
        throw error(errc::config, who + " did not answer as a rank of this job (another program on that port?)", {.rank = named});
      }
      if (h.size != static_cast<std::uint32_t>(size)) {
        throw error(errc::config, who + " believes the world size is " + std::to_string(h.size) + ", this rank " + std::to_string(size), {.rank = named});
      }
      detail::tcp::tune_data_socket(fd.get(), opts.socket_buffer_bytes);
      s_->peers[static_cast<std::size_t>(j)].fd = std::move(fd);
    }

    // Phase 2: accept the higher ranks; strangers and garbage are closed, silent sockets ignored.
    struct pending {
      detail::tcp::unique_fd fd;
      unsigned char buf[detail::tcp::hello_size];
      std::size_t got = 0;
    };
    std::vector<pending> waiting;
    int missing = size - 1 - rank;
    while (missing > 0) {
      std::vector<pollfd> p;
      p.push_back({listener.get(), POLLIN, 0});
      for (auto& w : waiting) p.push_back({w.fd.get(), POLLIN, 0});
      // In slices: a rank that died before connecting is a departure the store has heard of (or
      // the store went with its host).
      const int slice_ms = static_cast<int>(departure_check_every.count());
      const int left_ms = dl.poll_timeout_ms();
      const int rc = ::poll(p.data(), p.size(), left_ms < 0 ? slice_ms : std::min(left_ms, slice_ms));
      if (rc < 0 && errno != EINTR) throw error(errc::internal, system_message("poll"));
      if (rc == 0 && !dl.expired()) {
        throw_store_trouble(store, named);
        continue;
      }
      if (rc == 0 || dl.expired()) {
        std::vector<int> absent;
        for (int r = rank + 1; r < size; ++r)
          if (!s_->peers[static_cast<std::size_t>(r)].fd) absent.push_back(r);
        const std::string who = numbering.list(absent);
        throw error(errc::timeout, "timed out building the tcp mesh: no connection from rank(s) " + who + " to " + me.str() +
                                       " within " + std::to_string(opts.timeout.count()) + " ms",
                    {.rank = named});
      }
      // Read the hellos that arrived; p[i + 1] is waiting[i].
      for (std::size_t i = 0; i < waiting.size(); ++i) {
        if (p[i + 1].revents == 0) continue;
        auto& w = waiting[i];
        const ssize_t r = ::recv(w.fd.get(), w.buf + w.got, detail::tcp::hello_size - w.got, 0);
        if (r <= 0) {
          if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
          w.fd.reset();  // closed before saying hello
          continue;
        }
        w.got += static_cast<std::size_t>(r);
        if (w.got < detail::tcp::hello_size) continue;
        detail::tcp::hello h;
        const bool ok = detail::tcp::hello::decode(w.buf, h) && h.kind == 1 && h.token == my_nonce && h.prefix_hash == prefix_hash &&
                        h.rank > static_cast<std::uint32_t>(rank) && h.rank < static_cast<std::uint32_t>(size) &&
                        !s_->peers[h.rank].fd;
        if (!ok) {
          w.fd.reset();  // a stranger: not a rank of this job
          continue;
        }
        if (h.size != static_cast<std::uint32_t>(size)) {
          throw error(errc::config, numbering.rank(static_cast<int>(h.rank)) + " believes the world size is " + std::to_string(h.size) +
                                        ", this rank " + std::to_string(size), {.rank = named});
        }
        detail::tcp::host_port addr;
        detail::tcp::nonce theirs{};
        published(static_cast<int>(h.rank), addr, theirs);
        const auto out = detail::tcp::hello{2, static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(size), theirs, prefix_hash}.encode();
        detail::tcp::write_all(w.fd.get(), out.data(), out.size(), dl, numbering.rank(static_cast<int>(h.rank)));
        detail::tcp::tune_data_socket(w.fd.get(), opts.socket_buffer_bytes);
        s_->peers[h.rank].fd = std::move(w.fd);
        --missing;
      }
      std::erase_if(waiting, [](const pending& w) { return !w.fd; });
      if (p[0].revents != 0) {
        while (true) {
          const int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) break;
          if (waiting.size() >= 256) {  // a flood of silent sockets: drop the oldest
            waiting.erase(waiting.begin());
          }
          waiting.push_back(pending{detail::tcp::unique_fd(fd), {}, 0});
        }
      }
    }
    learn_this_host();
    s_->spin = detail::tcp::spin_policy(detail::tcp::spin_budget(spin, ranks_on_host, host_cpus > 0 ? host_cpus : detail::shm::usable_cpus()));
    // The listener and any stranger still waiting are closed here.
  }

  std::unique_ptr<state> s_;
};

static_assert(ddp::transport<tcp_transport>);

}  // namespace ddp
