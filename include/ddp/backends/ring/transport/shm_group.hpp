#pragma once
// shm_group: the ranks of one host sharing one segment each, set up through the store.
//
// Rendezvous (keys under "<prefix>shm/<tag>/"): rank 0 draws a random job id; every rank creates
// its segment (anonymous memory, shm_segment.hpp), publishes "ready/<rank>" = "<pid> <fd> <host>",
// maps every peer's segment through /proc/<pid>/fd/<fd>, publishes "mapped/<rank>", and once all
// ranks have mapped it closes its descriptor. No segment ever has a name, so nothing can be left
// in /dev/shm whatever happens to the processes, at any moment.
//
// Waiting: spin (cpu pause), then sched_yield, then FUTEX_WAIT in slices on one doorbell word
// of the group (in rank 0's segment). A waiter registers in `sleepers` before sleeping, and a
// publisher rings the doorbell only when someone sleeps, so the fast path has no system call.
// The publisher's side of that handshake (store, then load `sleepers`) needs a store->load
// fence; where every rank registered for membarrier(2) it is only a compiler barrier and a
// sleeper runs membarrier_global() after registering instead (see shm_segment.hpp).
// Between slices the waiter looks at the peers' pidfds (a dead peer is errc::peer_lost within a
// slice, 10 ms), the group's aborted word and its deadline.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// Under ThreadSanitizer (which models neither atomic_thread_fence nor membarrier) the
// publisher/sleeper handshake uses read-modify-writes instead of fences.
#if defined(__SANITIZE_THREAD__)
#define DDP_SHM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DDP_SHM_TSAN 1
#endif
#endif
#ifndef DDP_SHM_TSAN
#define DDP_SHM_TSAN 0
#endif

#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/store/store.hpp"
#include "ddp/backends/ring/transport/shm_segment.hpp"
#include "ddp/backends/ring/transport/topology.hpp"

namespace ddp::detail::shm {

/// How long a waiter spins and yields before it sleeps. Defaults suit latency-bound collectives;
/// when there are more ranks than CPUs the spin is cut short so the awaited rank can run.
struct shm_wait_policy {
  std::chrono::nanoseconds spin = std::chrono::microseconds(50);
  std::chrono::nanoseconds spin_oversubscribed = std::chrono::microseconds(2);
  std::chrono::nanoseconds yield = std::chrono::milliseconds(2);
  std::chrono::nanoseconds slice = std::chrono::milliseconds(10);  // futex timeout between liveness checks
};

class shm_group {
 public:
  static constexpr std::size_t header_bytes = 4096;  // identity + job line; the payload starts page aligned

  /// Collective over the `size` ranks: each calls it with the same prefix and tag. Each rank's
  /// payload is backed by memory up to `reserved_payload` bytes; the rest when it is populate()d
  /// or written.
  shm_group(ddp::store::store& st, const std::string& prefix, const std::string& tag, int rank, int size,
            std::size_t payload_bytes, deadline dl, shm_wait_policy policy = {}, std::size_t reserved_payload = SIZE_MAX,
            const rank_topology* topology = nullptr)
      : rank_(rank), size_(size), policy_(policy), payload_bytes_(round_up(payload_bytes, 4096)),
        numbering_(topology != nullptr ? topology->numbering() : rank_numbering()) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw error(errc::invalid_argument, "shm group: rank " + std::to_string(rank) + " of size " + std::to_string(size) + " is out of range");
    }
    // The CPUs of every rank of the group together (topology.hpp): one CPU each is no
    // oversubscription.
    const int cpus = topology != nullptr ? topology->cpus_of_this_host() : 0;
    oversubscribed_ = size > (cpus > 0 ? cpus : usable_cpus());
    try {
      set_up(st, prefix, tag, rank, size, dl, reserved_payload, topology);
    } catch (const error& e) {
      post_failure(st, keys_of(prefix, tag), e);
      if (e.rank() >= 0) throw;
      auto c = e.context();  // the reporting rank, so that its line says who it is
      c.rank = numbering_(rank);
      throw e.with_context(std::move(c));
    }
  }

 private:
  void set_up(ddp::store::store& st, const std::string& prefix, const std::string& tag, int rank, int size, deadline dl,
              std::size_t reserved_payload, const rank_topology* topology) {
    // One host: from the topology when the caller has it (the ring backend), else each rank
    // publishes its host name with its segment.
    if (topology != nullptr) {
      for (int r = 0; r < size; ++r) {
        if (!topology->shares_host_with(r)) {
          throw error(errc::config, numbering_.rank(r) + " runs on host '" + topology->of(r).hostname() + "', this rank on '" +
                                        topology->mine().hostname() + "': shared memory needs every rank of the group on one host");
        }
      }
    }
    const std::string keys = keys_of(prefix, tag);
    const std::string job_key = keys + "job";
    std::string job;
    if (rank == 0) {
      job = random_job_id();
      st.set_string(job_key, job);
    } else {
      store_wait(st, keys, {job_key}, {0}, dl, "publish the group's identity");
      job = st.get_string(job_key);
    }
    base_ = segment_name(prefix, job, tag);
    const std::size_t bytes = header_bytes + payload_bytes_;
    segments_.resize(static_cast<std::size_t>(size));
    segments_[static_cast<std::size_t>(rank)] = shm_segment::create(base_ + "-r" + std::to_string(rank), bytes,
                                                                            header_bytes + std::min(reserved_payload, payload_bytes_));
    auto* me = identity_of(segments_[static_cast<std::size_t>(rank)].data());
    me->pid = ::getpid();
    me->rank = rank;
    me->size = size;
    me->membarrier = DDP_SHM_TSAN ? 0 : register_membarrier() ? 1 : 0;
    me->magic = identity::magic_value;
    asymmetric_ = me->membarrier == 1;
    const std::string host = topology != nullptr ? std::string() : hostname();
    st.set_string(keys + "ready/" + std::to_string(rank),
                  std::to_string(::getpid()) + " " + std::to_string(segments_[static_cast<std::size_t>(rank)].fd()) + " " + host);

    std::vector<std::string> ready;
    for (int r = 0; r < size; ++r) ready.push_back(keys + "ready/" + std::to_string(r));
    std::vector<int> owners;
    for (int r = 0; r < size; ++r) owners.push_back(r);
    store_wait(st, keys, ready, owners, dl, "publish its segment");
    pids_.assign(static_cast<std::size_t>(size), 0);
    pids_[static_cast<std::size_t>(rank)] = ::getpid();
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const std::string value = st.get_string(ready[static_cast<std::size_t>(r)]);
      long long peer_pid = 0;
      int peer_fd = -1, host_at = 0;
      if (std::sscanf(value.c_str(), "%lld %d %n", &peer_pid, &peer_fd, &host_at) < 2 || host_at <= 0) {
        throw error(errc::internal, "shm group: " + numbering_.rank(r) + " published '" + value + "', not '<pid> <fd> [<host>]'");
      }
      const std::string peer_host = value.substr(static_cast<std::size_t>(host_at));
      if (topology == nullptr && peer_host != host) {
        throw error(errc::config, numbering_.rank(r) + " runs on host '" + peer_host + "', this rank on '" + host +
                                      "': shared memory needs every rank of the group on one host");
      }
      auto& seg = segments_[static_cast<std::size_t>(r)];
      try {
        seg = shm_segment::open(static_cast<pid_t>(peer_pid), peer_fd, bytes, "peer " + numbering_.rank(r));
      } catch (const error& e) {
        if (e.code() != errc::peer_lost) throw;
        peer_exited(st, keys, r, e.message());
      }
      const auto* id = identity_of(seg.data());
      if (id->magic != identity::magic_value || id->rank != r || id->size != size) {
        throw error(errc::internal, "shared-memory segment " + seg.name() + " does not belong to " + numbering_.rank(r));
      }
      pids_[static_cast<std::size_t>(r)] = id->pid;
      watch_.add(r, id->pid);
      if (id->membarrier != 1) asymmetric_ = false;  // every rank decides the same, from the same flags
    }
    job_ = reinterpret_cast<job_line*>(segments_[0].data() + cache_line);
    st.set_string(keys + "mapped/" + std::to_string(rank), "1");
    std::vector<std::string> mapped;
    for (int r = 0; r < size; ++r) mapped.push_back(keys + "mapped/" + std::to_string(r));
    store_wait(st, keys, mapped, owners, dl, "map the others' segments");
    segments_[static_cast<std::size_t>(rank)].close_descriptor();
  }

 public:

  shm_group(const shm_group&) = delete;
  shm_group& operator=(const shm_group&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  /// The numbers the ranks go by in messages (the topology's: a host's shared memory in the
  /// hierarchy names the backend's ranks).
  const rank_numbering& numbering() const noexcept { return numbering_; }
  pid_t pid_of(int r) const noexcept { return pids_[static_cast<std::size_t>(r)]; }
  bool oversubscribed() const noexcept { return oversubscribed_; }
  /// "ddp-<prefix>-<job>-<tag>": labels of further segments of this group start with it.
  const std::string& name_base() const noexcept { return base_; }

  /// Publishes this process's descriptor `fd` of a further segment, as number `seq`, in this
  /// rank's header. Peers open it with open_offer() once they know it is there (after a barrier
  /// that follows the offer); one offer at a time, as collective allocations come one at a time.
  void offer(std::uint32_t seq, int fd) noexcept {
    identity_of(segments_[static_cast<std::size_t>(rank_)].data())
        ->offer.store(static_cast<std::uint64_t>(seq) << 32 | static_cast<std::uint32_t>(fd), std::memory_order_release);
  }
  /// Maps the segment that rank r offered as number `seq`.
  shm_segment open_offer(int r, std::uint32_t seq, std::size_t bytes, const std::string& what) const {
    const std::uint64_t word = identity_of(segments_[static_cast<std::size_t>(r)].data())->offer.load(std::memory_order_acquire);
    if (static_cast<std::uint32_t>(word >> 32) != seq) {
      throw error(errc::internal, numbering_.rank(r) + " offered segment " + std::to_string(word >> 32) + " for " + what +
                                      ", expected " + std::to_string(seq));
    }
    return shm_segment::open(pid_of(r), static_cast<int>(static_cast<std::uint32_t>(word)), bytes, "peer " + numbering_.rank(r));
  }

  /// Backs [offset, offset + bytes) of rank r's payload with memory now (see shm_segment::populate).
  void populate(int r, std::size_t offset, std::size_t bytes) const {
    segments_[static_cast<std::size_t>(r)].populate(header_bytes + offset, bytes);
  }

  /// Rank r's payload, mapped in this process.
  std::byte* payload(int r) const noexcept { return segments_[static_cast<std::size_t>(r)].data() + header_bytes; }
  std::size_t payload_bytes() const noexcept { return payload_bytes_; }

  /// Call after publishing anything a peer may wait for.
  void notify() noexcept {
#if DDP_SHM_TSAN
    // TSan models no fences: an RMW on `sleepers`, which every sleeper also modifies, gives
    // the same store->load order (and TSan can check it).
    if (job_->sleepers.fetch_add(0, std::memory_order_seq_cst) != 0) ring();
#else
    if (asymmetric_) std::atomic_signal_fence(std::memory_order_seq_cst);  // a sleeper's membarrier orders the CPU
    else std::atomic_thread_fence(std::memory_order_seq_cst);
    if (job_->sleepers.load(std::memory_order_relaxed) != 0) ring();
#endif
  }

  bool aborted() const noexcept { return job_->aborted.load(std::memory_order_relaxed) != 0; }

  /// Marks the whole group aborted (every rank's waiters fail with errc::peer_lost) and wakes them.
  /// `cause` is a dead peer this rank noticed, so the others can name it; `why`, without one, is
  /// a failure this rank saw elsewhere (the hierarchy's other levels), which the others quote.
  void abort(int cause_rank = -1, pid_t cause_pid = 0, std::string_view why = {}) noexcept {
    if (job_ == nullptr) return;
    std::uint32_t expected = 0;
    const std::uint32_t word = static_cast<std::uint32_t>(rank_ + 1) | (static_cast<std::uint32_t>(cause_rank + 1) << 16);
    if (job_->claim.compare_exchange_strong(expected, 1)) {
      auto* note = note_of(segments_[0].data());
      const std::size_t n = std::min(why.size(), sizeof note->text);
      if (n != 0) std::memcpy(note->text, why.data(), n);  // an empty view's data() may be null
      note->length = static_cast<std::uint32_t>(n);  // published by the release below
      job_->cause_pid.store(cause_pid, std::memory_order_relaxed);
      job_->aborted.store(word, std::memory_order_release);
    }
    ring();
  }

  /// abort(), naming a dead peer if this rank sees one: called when a wait on this rank failed.
  /// With a grace, waits up to that long for a peer's exit to show: a failure elsewhere (a
  /// store connection reset by its dying host) can come before the kernel marks that host
  /// exited, since a dying process closes its sockets before it becomes a zombie. Without a dead
  /// peer here, `why` (this rank's own failure, e.g. a store whose host died) is what the others
  /// quote.
  void abort_noticing(std::chrono::milliseconds grace = std::chrono::milliseconds(0), std::string_view why = {}) noexcept {
    if (job_ == nullptr) return;
    const auto dead = watch_.first_dead_within(grace);
    if (dead) abort(dead->rank, dead->pid);
    else abort(-1, 0, why);
  }

  /// Why a wait cannot succeed: a dead peer or an abort; nullopt when neither.
  std::optional<std::pair<errc, std::string>> failure() const {
    return failure([](int) { return true; });
  }
  /// As failure(), counting only dead peers r with waits_on(r).
  template <class WaitsOn>
  std::optional<std::pair<errc, std::string>> failure(WaitsOn&& waits_on) const {
    // An abort first: a peer that aborted may have exited since, and the abort is the cause.
    const std::uint32_t word = job_->aborted.load(std::memory_order_acquire);
    if (word != 0) {
      const int by = static_cast<int>(word & 0xffffu) - 1;
      const int cause = static_cast<int>(word >> 16) - 1;
      if (cause >= 0) {
        return std::pair{errc::peer_lost, "peer " + numbering_.rank(cause) + " (pid " + std::to_string(job_->cause_pid.load()) +
                                              ") exited (noticed by " + numbering_.rank(by) + ")"};
      }
      const auto* note = note_of(segments_[0].data());
      const std::string why(note->text, std::min<std::size_t>(note->length, sizeof note->text));
      if (by == rank_) return std::pair{errc::peer_lost, why.empty() ? std::string("the communicator was aborted on this rank") : why};
      if (!why.empty()) return std::pair{errc::peer_lost, why + "; relayed by " + numbering_.rank(by) + " (pid " + std::to_string(pid_of(by)) + ")"};
      return std::pair{errc::peer_lost, "peer " + numbering_.rank(by) + " (pid " + std::to_string(pid_of(by)) + ") aborted the communicator"};
    }
    if (auto dead = watch_.first_dead(waits_on)) {
      return std::pair{errc::peer_lost, "peer " + numbering_.rank(dead->rank) + " (pid " + std::to_string(dead->pid) + ") exited"};
    }
    return std::nullopt;
  }

  /// Waits until ready() holds. On the death of a peer r with waits_on(r) (only those can still
  /// hold up ready(): one that did its part may exit normally meanwhile), an abort or the deadline
  /// it calls fail(errc, message), which must throw. ready() is called often: keep it to a few loads.
  template <class Ready, class Fail, class WaitsOn>
  void wait(Ready&& ready, deadline dl, Fail&& fail, WaitsOn&& waits_on) {
    if (ready()) return;
    // The spin's clock starts at its first check, 64 pauses in (about a microsecond): most waits
    // of a small collective end before that, and a clock read is a noticeable share of such a
    // call. Not so with more ranks than CPUs: there the short spin must stay short (the awaited
    // rank may need this CPU), and a wait costs a trip through the scheduler anyway.
    clock::time_point start = oversubscribed_ ? clock::now() : clock::time_point{};
    const auto spin_for = oversubscribed_ ? policy_.spin_oversubscribed : policy_.spin;
    for (unsigned i = 1;; ++i) {
      cpu_relax();
      if (ready()) return;
      if ((i & 63u) == 0) {
        if (aborted()) fail_now(fail, waits_on);
        const auto now = clock::now();
        if (i == 64 && !oversubscribed_) start = now;
        if (now - start >= spin_for) break;
        if (!dl.is_never() && now >= dl.time_point()) fail_timeout(ready, fail, start);
      }
    }
    auto last_check = clock::now();
    for (unsigned i = 1;; ++i) {
      ::sched_yield();
      if (ready()) return;
      if ((i & 7u) == 0) {
        if (aborted()) fail_now(fail, waits_on);
        const auto now = clock::now();
        if (now - last_check >= std::chrono::milliseconds(1)) {
          last_check = now;
          // A peer may satisfy the wait and exit between ready() and this check: a dead
          // peer writes nothing more, so ready() after seeing it is the final answer.
          if (watch_.first_dead(waits_on) && !ready()) fail_now(fail, waits_on);
        }
        if (now - start >= policy_.yield) break;
        if (!dl.is_never() && now >= dl.time_point()) fail_timeout(ready, fail, start);
      }
    }
    for (;;) {
      job_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      // A publisher that skipped its fence may hold its last store in its store buffer and have
      // read `sleepers` as 0: the membarrier drains it before ready() below looks. Should the
      // kernel refuse now, short slices bound what a missed ring can cost.
      bool bounded_slice = false;
#if !DDP_SHM_TSAN
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (asymmetric_) bounded_slice = !membarrier_global();
#endif
      const std::uint32_t bell = job_->doorbell.load(std::memory_order_seq_cst);
      bool done = ready();
      if (!done && !aborted()) {
        auto slice = bounded_slice ? std::min(policy_.slice, std::chrono::nanoseconds(std::chrono::milliseconds(1))) : policy_.slice;
        if (!dl.is_never()) {
          const auto left = dl.time_point() - clock::now();
          if (left < slice) slice = std::max(std::chrono::nanoseconds(left), std::chrono::nanoseconds(0));
        }
        if (slice > std::chrono::nanoseconds(0)) futex_wait(&job_->doorbell, bell, slice);
      }
      job_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (done || ready()) return;
      if (aborted() || (watch_.first_dead(waits_on) && !ready())) fail_now(fail, waits_on);
      if (dl.expired()) fail_timeout(ready, fail, start);
    }
  }

 private:
  struct identity {
    static constexpr std::uint64_t magic_value = 0x6464702d73686d33;  // "ddp-shm3"
    std::uint64_t magic;
    std::int32_t pid;
    std::int32_t rank;
    std::int32_t size;
    std::int32_t membarrier;  // 1: this rank's process is registered for membarrier_global()
    std::atomic<std::uint64_t> offer;  // see offer()
  };
  struct alignas(cache_line) job_line {
    std::atomic<std::uint32_t> doorbell;
    std::atomic<std::uint32_t> sleepers;
    std::atomic<std::uint32_t> claim;    // first aborter wins
    std::atomic<std::uint32_t> aborted;  // (aborter + 1) | (dead peer + 1) << 16, or 0
    std::atomic<std::int32_t> cause_pid;
  };
  static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
  // Why the group was aborted, when the aborting rank saw the failure elsewhere: in rank 0's
  // header page, written by the abort's winner before it publishes the abort.
  struct abort_note {
    std::uint32_t length;
    char text[1020];
  };
  static constexpr std::size_t note_offset = 2048;
  static_assert(note_offset >= 2 * cache_line && note_offset + sizeof(abort_note) <= header_bytes);
  static abort_note* note_of(std::byte* segment) noexcept { return reinterpret_cast<abort_note*>(segment + note_offset); }

  static identity* identity_of(std::byte* segment) noexcept { return reinterpret_cast<identity*>(segment); }

  void ring() noexcept {
    job_->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&job_->doorbell);
  }

  template <class Fail, class WaitsOn>
  [[noreturn]] void fail_now(Fail& fail, WaitsOn& waits_on) {
    auto why = failure(waits_on);
    if (why) fail(why->first, why->second);
    fail(errc::internal, "wait failed without a cause");
    std::terminate();  // fail must throw
  }
  template <class Ready, class Fail>
  void fail_timeout(Ready& ready, Fail& fail, clock::time_point start) {
    if (ready()) return;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start).count();
    fail(errc::timeout, "deadline expired after waiting " + std::to_string(waited) + " ms");
    std::terminate();
  }

  static std::string keys_of(const std::string& prefix, const std::string& tag) { return prefix + "shm/" + tag + "/"; }
  static std::string failure_key(const std::string& keys, int r) { return keys + "failed/" + std::to_string(r); }

  /// A rank whose set-up fails says why in the store before its error leaves the constructor,
  /// so before it can exit: a peer that then finds it gone quotes the cause (peer_exited) instead
  /// of naming the messenger. A store that failed gets no post: it is the cause, and the peers see it too.
  void post_failure(ddp::store::store& st, const std::string& keys, const error& e) const noexcept {
    if (e.code() == errc::store) return;
    try {
      st.set_string(failure_key(keys, rank_), e.message());
    } catch (...) {  // a courtesy to the peers: its failure must not mask this one
    }
  }

  /// errc::peer_lost for peer r seen exited (`seen`), which may have exited because another rank
  /// died: the store's news of that one comes first (its server saw the connection close), then
  /// what r posted before it exited (post_failure), which names the rank that r saw fail.
  [[noreturn]] void peer_exited(ddp::store::store& st, const std::string& keys, int r, const std::string& seen) const {
    if (auto news = ddp::store::departure_news(st); !news.empty()) throw error(errc::peer_lost, news + " (and " + seen + ")");
    const std::string posted = failure_key(keys, r);
    std::string cause;
    try {
      st.wait({posted}, std::chrono::milliseconds(0));  // posted before r exited, so no wait
      cause = st.get_string(posted);
    } catch (const error&) {  // nothing posted: r's exit is the news
    }
    if (!cause.empty()) throw error(errc::peer_lost, cause + "; relayed by " + numbering_.rank(r) + " before it exited");
    throw error(errc::peer_lost, seen);
  }

  /// A set-up wait for keys[i], published by rank owners[i], of the group whose keys start with
  /// `group_keys` (keys_of). It waits in short slices and between them looks at the peers it
  /// watches (known after 'ready'): one that exited ends the wait at once. Failures name the ranks
  /// whose keys are missing, not the keys.
  void store_wait(ddp::store::store& st, const std::string& group_keys, const std::vector<std::string>& keys,
                  const std::vector<int>& owners, deadline dl, const std::string& what) const {
    constexpr std::chrono::milliseconds slice{100};
    constexpr auto look_every = std::chrono::seconds(1);  // how often the missing ranks are asked for
    const auto total = dl.remaining();
    std::vector<std::size_t> missing;  // indices of keys not yet set, as last looked at
    for (std::size_t i = 0; i < keys.size(); ++i) missing.push_back(i);
    bool looked = false;
    auto look = [&] {
      std::vector<std::size_t> still;
      for (const auto i : missing) {
        try {
          st.wait({keys[i]}, std::chrono::milliseconds(0));
        } catch (const error& x) {
          if (x.code() != errc::timeout) throw;
          still.push_back(i);
        }
      }
      missing = std::move(still);
      looked = true;
    };
    auto who = [&] {
      std::vector<int> ranks;
      for (const auto i : missing) ranks.push_back(owners[i]);
      return (missing.size() == 1 ? "rank " : "rank(s) ") + numbering_.list(ranks);
    };
    auto not_done = [&] {
      return who() + " did not " + what + " within " + std::to_string(total.count()) + " ms (shared-memory setup): " + who() +
             " exited, hung, or never started?";
    };
    auto next_look = clock::now() + look_every;
    while (true) {
      try {
        st.wait(keys, std::min(dl.remaining(), std::chrono::milliseconds(slice)));
        return;
      } catch (const error& e) {
        if (e.code() == errc::store) {
          // Late in the wait, the store's host most likely gave up on the same missing ranks:
          // they are the cause, not the host. Earlier, the host itself went away.
          if (looked && !missing.empty() && dl.remaining() <= std::max<std::chrono::milliseconds>(std::chrono::milliseconds(500), total / 2)) {
            throw error(errc::timeout, not_done() + " (then: " + e.message() + ")");
          }
          throw error(e.code(), "shared-memory setup: " + e.message(), e.context());
        }
        if (e.code() != errc::timeout) throw error(e.code(), "shared-memory setup: " + e.message(), e.context());
      }
      if (const auto dead = watch_.first_dead()) {
        peer_exited(st, group_keys, dead->rank, numbering_.rank(dead->rank) + " (pid " + std::to_string(dead->pid) +
                            ") exited during shared-memory setup, while this rank waited for it to " + what);
      }
      if (dl.expired()) {
        look();
        if (missing.empty()) return;  // set in the last moment
        throw error(errc::timeout, not_done());
      }
      if (clock::now() >= next_look) {
        look();
        if (missing.empty()) return;
        next_look = clock::now() + look_every;
      }
    }
  }

  static std::string random_job_id() {
    std::random_device rd;
    const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                            static_cast<std::uint64_t>(clock::now().time_since_epoch().count()) ^
                            (static_cast<std::uint64_t>(::getpid()) << 20);
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return std::string(buf, 12);
  }

  static std::string hostname() {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
    return buf;
  }

  int rank_;
  int size_;
  shm_wait_policy policy_;
  std::size_t payload_bytes_;
  rank_numbering numbering_;
  bool oversubscribed_ = false;
  bool asymmetric_ = false;  // see notify()
  std::string base_;
  std::vector<shm_segment> segments_;
  std::vector<pid_t> pids_;
  peer_watch watch_;
  job_line* job_ = nullptr;
};

}  // namespace ddp::detail::shm
