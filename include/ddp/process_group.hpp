#pragma once
// ddp::process_group<B>: everything a collective needs besides moving bytes, over any
// ddp::backend B (ring, nccl, mpi, or a user's).
//
//  - argument checks (errc::invalid_argument naming the argument and the expected size);
//  - a sequence number per group, and the collective's fingerprint (collective_desc), handed
//    to backends that take it so they can detect ranks calling different collectives;
//  - one deadline per call from the group timeout (default ddp::default_timeout()). A backend
//    with the extended signatures (..., const collective_desc&, deadline) enforces it itself;
//    for any other a watchdog calls backend.abort() at the deadline and the call fails with
//    errc::timeout naming the collective, its sequence number and, when the backend can tell
//    (missing_ranks()), the ranks that did not arrive;
//  - async collectives (*_async -> ddp::work) executed in call order on ONE communication
//    thread per group. A blocking call first waits for the queued ones and then runs on the
//    calling thread (no thread hand-off on the latency path), so call order is kept;
//  - a failed collective breaks the group: every later call fails at once with the original
//    cause (a backend is in an unknown state after a failure, as NCCL and MPI are);
//  - statistics per collective kind (calls, bytes, time);
//  - sub-groups: new_group(ranks) builds a backend over the members (B::split), rank numbers
//    in a sub-group are its own (0..k-1), like an MPI or NCCL communicator. Every rank of the
//    parent calls new_group in the same order (as in torch); non-members get an invalid group.
//
// Buffers given to an async collective must stay alive and untouched until its work is done.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/process_group/cheap_clocks.hpp"
#include "ddp/core/function_ref.hpp"
#include "ddp/process_group/backend_calls.hpp"
#include "ddp/process_group/backend_traits.hpp"
#include "ddp/process_group/gate.hpp"
#include "ddp/process_group/range_calls.hpp"
#include "ddp/process_group/watchdog.hpp"
#include "ddp/work.hpp"

namespace ddp {

struct group_options {
  std::chrono::milliseconds timeout = default_timeout();  // per collective call
};

/// Counters of one collective kind. bytes: the size of the largest buffer of each call on this
/// rank (nccl-tests' "size": the data of all_reduce/broadcast/reduce, the output of all_gather,
/// the input of reduce_scatter). time: from the start of execution to its end.
struct collective_stats {
  std::uint64_t calls = 0;
  std::uint64_t failures = 0;
  std::uint64_t bytes = 0;
  std::chrono::nanoseconds time{0};
};

struct group_stats {
  std::array<collective_stats, 12> by_op{};  // indexed by ddp::collective
  const collective_stats& operator[](collective c) const noexcept { return by_op[static_cast<std::size_t>(c)]; }
  collective_stats& operator[](collective c) noexcept { return by_op[static_cast<std::size_t>(c)]; }
  collective_stats total() const noexcept {
    collective_stats t;
    for (const auto& s : by_op) {
      t.calls += s.calls;
      t.failures += s.failures;
      t.bytes += s.bytes;
      t.time += s.time;
    }
    return t;
  }
};

template <ddp::backend B>
class process_group : public detail::pg_range_calls<process_group<B>> {
  static_assert(detail::pg_check_declared<B>());
  static_assert(!detail::pg_declares_call_records<B> || detail::pg_has_run<B>,
                "the backend declares takes_call_records but has no run(const ddp::collective_call&, const ddp::collective_desc&, ddp::deadline)");

 public:
  using backend_type = B;

  /// An invalid group: what non-members get from new_group(). Every call on it throws.
  process_group() = default;
  explicit process_group(B backend, group_options opts = {}) : s_(std::make_unique<state>(std::move(backend), opts)) {}
  process_group(process_group&&) noexcept = default;
  process_group& operator=(process_group&&) noexcept = default;
  /// Waits for the queued collectives (each bounded by its deadline), then stops the threads.
  ~process_group() = default;

  bool valid() const noexcept { return s_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }
  /// This rank in the group, -1 in an invalid group.
  int rank() const noexcept { return s_ ? s_->rank : -1; }
  /// Ranks in the group, 0 in an invalid group.
  int size() const noexcept { return s_ ? s_->size : 0; }
  static constexpr std::string_view backend_name() noexcept { return detail::pg_backend_name<B>(); }
  static constexpr memory_space memory = B::memory;

  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(live().timeout_ms.load()); }
  void set_timeout(std::chrono::milliseconds t) {
    if (t <= std::chrono::milliseconds::zero()) {
      throw error(errc::invalid_argument, "timeout of " + std::to_string(t.count()) + " ms: it must be positive", {.rank = rank()});
    }
    live().timeout_ms.store(t.count());
    live().watchdog.set_idle_wait(t);
  }
  /// The sequence number the next collective call will get.
  std::uint64_t next_sequence() const { return live().gate.next_sequence(); }
  group_stats stats() const {
    group_stats out;
    for (std::size_t i = 0; i < out.by_op.size(); ++i) out.by_op[i] = live().counters[i].snapshot();
    return out;
  }
  /// Whether an earlier collective failed (then every call fails with that cause).
  bool broken() const noexcept { return s_ && s_->is_broken.load(); }

  B& backend() { return live().backend; }
  const B& backend() const { return live().backend; }

  // Every typed call below becomes one collective_call, checked once (check_call). A backend
  // that declares `takes_call_records` gets that record whole (call()); for any other backend,
  // and for a user's own reduce op, the typed span reaches the backend's template (issue()).

  // --- all_reduce ------------------------------------------------------------------------
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void all_reduce(std::span<T> data, Op op = {}) {
    issue<collective::all_reduce, T>(record(collective::all_reduce, data, data, kind_of(op)), false, op);
  }
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void all_reduce(std::span<const T> in, std::span<T> out, Op op = {}) {
    issue<collective::all_reduce, T>(record(collective::all_reduce, in, out, kind_of(op)), false, op);
  }
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work all_reduce_async(std::span<T> data, Op op = {}) {
    return issue<collective::all_reduce, T>(record(collective::all_reduce, data, data, kind_of(op)), true, op);
  }
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work all_reduce_async(std::span<const T> in, std::span<T> out, Op op = {}) {
    return issue<collective::all_reduce, T>(record(collective::all_reduce, in, out, kind_of(op)), true, op);
  }

  // --- broadcast ---------------------------------------------------------------------------
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void broadcast(std::span<T> data, int root) {
    issue<collective::broadcast, T>(record(collective::broadcast, data, data, reduce_kind::sum, root), false);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work broadcast_async(std::span<T> data, int root) {
    return issue<collective::broadcast, T>(record(collective::broadcast, data, data, reduce_kind::sum, root), true);
  }

  // --- reduce (result on root; other ranks' data is unspecified afterwards) ----------------
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void reduce(std::span<T> data, int root, Op op = {}) {
    issue<collective::reduce, T>(record(collective::reduce, data, data, kind_of(op), root), false, op);
  }
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work reduce_async(std::span<T> data, int root, Op op = {}) {
    return issue<collective::reduce, T>(record(collective::reduce, data, data, kind_of(op), root), true, op);
  }

  // --- all_gather: out = size() * in, rank-major ------------------------------------------
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void all_gather(std::span<const T> in, std::span<T> out) {
    issue<collective::all_gather, T>(record(collective::all_gather, in, out), false);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work all_gather_async(std::span<const T> in, std::span<T> out) {
    return issue<collective::all_gather, T>(record(collective::all_gather, in, out), true);
  }

  // --- reduce_scatter: in = size() * out --------------------------------------------------
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op = {}) {
    issue<collective::reduce_scatter, T>(record(collective::reduce_scatter, in, out, kind_of(op)), false, op);
  }
  template <dtype_like T, any_reduce_op Op = sum>
    requires(!std::is_const_v<T>)
  work reduce_scatter_async(std::span<const T> in, std::span<T> out, Op op = {}) {
    return issue<collective::reduce_scatter, T>(record(collective::reduce_scatter, in, out, kind_of(op)), true, op);
  }

  // --- all_to_all: equal blocks of in.size() / size() -------------------------------------
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void all_to_all(std::span<const T> in, std::span<T> out) {
    issue<collective::all_to_all, T>(record(collective::all_to_all, in, out), false);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work all_to_all_async(std::span<const T> in, std::span<T> out) {
    return issue<collective::all_to_all, T>(record(collective::all_to_all, in, out), true);
  }

  // --- barrier -------------------------------------------------------------------------------
  // A barrier moves no elements: its record says uint8 and count 0 (what every rank's
  // fingerprint agrees on) without record()'s dtype check, so a backend that opts out of uint8
  // (supports_dtype_v) still has barrier().
  void barrier() { issue<collective::barrier, std::uint8_t>(collective_call{.op = collective::barrier}, false); }
  work barrier_async() { return issue<collective::barrier, std::uint8_t>(collective_call{.op = collective::barrier}, true); }

  // --- point to point (sequenced like collectives: both ranks must agree on the order) ---
  template <dtype_like T>
  void send(std::span<const T> data, int peer) {
    issue<collective::send, T>(record(collective::send, data, std::span<T>(), reduce_kind::sum, peer), false);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  void recv(std::span<T> data, int peer) {
    issue<collective::recv, T>(record(collective::recv, std::span<const T>(), data, reduce_kind::sum, peer), false);
  }
  template <dtype_like T>
  work send_async(std::span<const T> data, int peer) {
    return issue<collective::send, T>(record(collective::send, data, std::span<T>(), reduce_kind::sum, peer), true);
  }
  template <dtype_like T>
    requires(!std::is_const_v<T>)
  work recv_async(std::span<T> data, int peer) {
    return issue<collective::recv, T>(record(collective::recv, std::span<const T>(), data, reduce_kind::sum, peer), true);
  }

  /// Any collective as one record (what ddp::group and the data-parallel wrapper hand down): it
  /// is checked here once, numbered, timed and given to the backend, whose takes_call_records
  /// form receives it whole; async when `async` (the returned work then completes it).
  work call(const collective_call& c, bool async = false)
    requires detail::pg_takes_call_records<B>
  {
    check_call(c);
    return dispatch(c.describe(), c.traffic_bytes(), [st = s_.get(), c](const collective_desc& d, deadline until) { execute_record(*st, c, d, until); },
                    async);
  }

  // --- any contiguous range (std::vector, std::array, thrust::host_vector, ...) ------------
  using ranges = detail::pg_range_calls<process_group<B>>;
  using ranges::all_reduce, ranges::all_reduce_async, ranges::broadcast, ranges::broadcast_async, ranges::reduce;
  using ranges::all_gather, ranges::all_gather_async, ranges::reduce_scatter, ranges::reduce_scatter_async;
  using ranges::all_to_all, ranges::send, ranges::recv;

  // --- memory ----------------------------------------------------------------------------------
  /// n elements that every same-host rank can address when the backend can provide such
  /// memory (collectives on it need no copy-in); an ordinary std::vector<T> otherwise.
  /// With a backend allocate this is collective (every rank, same n, same order) and runs after
  /// the queued collectives, never concurrently with one.
  template <dtype_like T>
  auto allocate(std::size_t n) {
    if constexpr (detail::pg_has_allocate<B, T>) {
      exclusive_section section(live());
      return live().backend.template allocate<T>(n);
    } else {
      return std::vector<T>(n);
    }
  }

  /// Copies bytes in the backend's memory space: std::memcpy for host memory, the backend's
  /// copy_memory where it has one (device memory). Not sequenced with the collectives.
  void copy_memory(void* dst, const void* src, std::size_t bytes) { calls::copy_within(live(), dst, src, bytes); }

  // --- sub-groups ------------------------------------------------------------------------------
  /// A group of the given ranks of this group (sorted; duplicates are an error). Every rank of
  /// this group calls it, in the same order; non-members get an invalid group.
  process_group new_group(std::vector<int> ranks) {
    state& s = live();
    std::sort(ranks.begin(), ranks.end());
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] < 0 || ranks[i] >= s.size) {
        throw error(errc::invalid_argument, "new_group: rank " + std::to_string(ranks[i]) + " is not in this group of size " + std::to_string(s.size),
                    {.rank = s.rank, .op = "new_group"});
      }
      if (i > 0 && ranks[i] == ranks[i - 1]) {
        throw error(errc::invalid_argument, "new_group: rank " + std::to_string(ranks[i]) + " is listed twice", {.rank = s.rank, .op = "new_group"});
      }
    }
    if (ranks.empty()) throw error(errc::invalid_argument, "new_group: the list of ranks is empty", {.rank = s.rank, .op = "new_group"});
    if constexpr (!detail::pg_has_split<B>) {
      throw error(errc::unavailable, std::string("new_group: backend '") + std::string(backend_name()) + "' cannot build sub-groups (it has no split(ranks, tag))",
                  {.rank = s.rank, .op = "new_group"});
    } else {
      exclusive_section section(s);  // after the queued collectives, never concurrently with one
      const std::string tag = "g" + std::to_string(s.subgroups++);
      if (!std::binary_search(ranks.begin(), ranks.end(), s.rank)) return process_group();
      return process_group(s.backend.split(std::span<const int>(ranks), tag), group_options{.timeout = timeout()});
    }
  }

 private:
  // What execute_on calls: any of the *_call lambdas, by reference, so that execution (error
  // wrapping, watchdog, statistics) is compiled once per backend rather than once per
  // collective x element type x reduction, and a blocking call still allocates nothing.
  using runner_ref = detail::function_ref<void(const collective_desc&, deadline)>;

  // A queued call: its lambda lives on the heap (`call`) until it has run, and is reached through
  // the same runner_ref thunk as a blocking call of that lambda (a std::function here would
  // compile a second copy of every collective call).
  struct task {
    collective_desc desc;
    std::size_t bytes = 0;
    runner_ref run;
    std::shared_ptr<void> call;
    std::shared_ptr<detail::work_state> work;
  };

  // Written only by the executing thread (one collective at a time), read by anyone: relaxed
  // atomics, so neither side takes a lock on the latency path.
  // Time is kept in tick_clock ticks (cheaper to read than steady_clock) until read.
  struct counters_of_op {
    std::atomic<std::uint64_t> calls{0}, failures{0}, bytes{0}, ticks{0};
    void add(std::size_t b, detail::tick_clock::ticks t, bool failed) noexcept {
      constexpr auto r = std::memory_order_relaxed;
      calls.store(calls.load(r) + 1, r);
      bytes.store(bytes.load(r) + b, r);
      ticks.store(ticks.load(r) + t, r);
      if (failed) failures.store(failures.load(r) + 1, r);
    }
    collective_stats snapshot() const noexcept {
      constexpr auto r = std::memory_order_relaxed;
      return {.calls = calls.load(r), .failures = failures.load(r), .bytes = bytes.load(r), .time = detail::tick_clock::to_duration(ticks.load(r))};
    }
  };

  static deadline after(clock::time_point now, std::chrono::milliseconds t) noexcept {
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(clock::time_point::max() - now);
    return t >= limit ? deadline::never() : deadline(now + t);
  }

  struct state {
    state(B b, group_options opts)
        : backend(std::move(b)),
          rank(static_cast<int>(backend.rank())),
          size(static_cast<int>(backend.size())),
          timeout_ms(opts.timeout.count()),
          watchdog([this]() noexcept { backend.abort(); }, opts.timeout) {
      if (opts.timeout <= std::chrono::milliseconds::zero()) {
        throw error(errc::invalid_argument, "group timeout of " + std::to_string(opts.timeout.count()) + " ms: it must be positive",
                    {.rank = rank});
      }
    }
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      std::thread t;
      {
        std::lock_guard lock(mutex);
        stopping = true;
        t = std::move(comm);
      }
      changed.notify_all();
      if (t.joinable()) t.join();
    }

    B backend;
    int rank;
    int size;
    std::atomic<std::int64_t> timeout_ms;

    mutable std::mutex mutex;
    std::condition_variable changed;
    std::deque<task> queue;
    detail::pg_gate gate;  // one collective at a time, the sequence numbers (see process_group/gate.hpp)
    bool stopping = false;
    std::thread comm;
    std::uint64_t subgroups = 0;  // while holding the gate
    std::optional<error> failure;  // the first error; the group is broken from then on
    std::atomic<bool> is_broken{false};

    std::array<counters_of_op, 12> counters{};  // indexed by ddp::collective
    std::uint64_t tokens = 0;  // watchdog tokens, touched only by the executing thread

    detail::pg_watchdog watchdog;  // last: stopped first, while the backend still exists
  };

  // Holds the gate for the calling thread once the queue is drained (no sequence number).
  struct exclusive_section {
    explicit exclusive_section(state& st) : s(st) {
      std::unique_lock lock(s.mutex);
      s.gate.enter_waiting(lock, s.changed, false, [] {});
    }
    exclusive_section(const exclusive_section&) = delete;
    exclusive_section& operator=(const exclusive_section&) = delete;
    ~exclusive_section() { s.gate.leave(s.mutex, s.changed); }
    state& s;
  };

  state& live() const {
    if (!s_) {
      throw error(errc::invalid_argument,
                  "this process is not a member of the group (an invalid group, e.g. from new_group() on a non-member rank)");
    }
    return *s_;
  }

  // --- one record per call, checked once ------------------------------------------------
  template <class T, class U>
  collective_call record(collective op, std::span<T> in, std::span<U> out, reduce_kind reduction = reduce_kind::sum, int root = -1) const {
    using V = std::remove_cv_t<U>;
    static_assert(supports_dtype_v<B, V>, "this backend does not support the element type");
    return collective_call::of(op, in, out, reduction, root);
  }

  error_context call_context(collective op) const { return {.rank = rank(), .op = std::string(to_string(op))}; }

  // Every argument check of every collective: the root or peer, the counts, a partial overlap.
  void check_call(const collective_call& c) const {
    const state& s = live();
    const auto p = static_cast<std::size_t>(s.size);
    auto fail = [&](const std::string& why) { throw error(errc::invalid_argument, why, call_context(c.op)); };
    auto check_scaled = [&](const char* big, std::size_t big_n, const char* small, std::size_t small_n) {
      if (big_n != small_n * p) {
        fail(std::string(big) + " has " + std::to_string(big_n) + " elements, expected " + small + ".size() * size() = " + std::to_string(small_n) +
             " * " + std::to_string(p) + " = " + std::to_string(small_n * p));
      }
    };
    auto check_same_size = [&] {
      if (c.in_count != c.out_count) {
        fail("out has " + std::to_string(c.out_count) + " elements, in has " + std::to_string(c.in_count) + ": they must be equal");
      }
    };
    auto check_rank = [&](const char* what) {
      if (c.root < 0 || c.root >= s.size) {
        fail(std::string(what) + " " + std::to_string(c.root) + " is out of range: the group has ranks 0.." + std::to_string(s.size - 1));
      }
    };
    switch (c.op) {
      case collective::all_reduce:
        check_same_size();
        if (c.in != c.out && detail::pg_overlap(c.in, c.in_bytes(), c.out, c.out_bytes())) {
          fail("in and out overlap partially: pass the same span for in-place");
        }
        break;
      case collective::broadcast:
      case collective::reduce: check_rank("root"); break;
      case collective::all_gather: check_scaled("out", c.out_count, "in", c.in_count); break;
      case collective::reduce_scatter: check_scaled("in", c.in_count, "out", c.out_count); break;
      case collective::all_to_all:
        check_same_size();
        if (c.in_count % p != 0) {
          fail("in has " + std::to_string(c.in_count) + " elements, not a multiple of the group size " + std::to_string(p) + " (equal blocks per rank)");
        }
        break;
      case collective::send:
      case collective::recv:
        check_rank("peer");
        if (c.root == s.rank) fail("peer " + std::to_string(c.root) + " is this rank itself");
        break;
      default: break;
    }
  }

  // A blocking call runs fn now; an async one queues it.
  template <class F>
  work dispatch(const collective_desc& desc, std::size_t bytes, F fn, bool async) {
    if (async) return submit(desc, bytes, std::move(fn));
    run(desc, bytes, fn);
    return {};
  }

  // A record at execution time: an out-of-place all_reduce becomes in place on out, an input
  // that overlaps the output is read from a private copy; then the backend runs it.
  static void execute_record(state& s, collective_call c, const collective_desc& d, deadline until) {
    std::shared_ptr<void> copy;
    if (c.op == collective::all_reduce && c.in != c.out) {
      calls::copy_within(s, c.out, c.in, c.out_bytes());
      c.in = c.out;
    } else if ((c.op == collective::all_gather || c.op == collective::reduce_scatter || c.op == collective::all_to_all) &&
               detail::pg_overlap(c.in, c.in_bytes(), c.out, c.out_bytes())) {
      const auto input = calls::unaliased(s, std::span<const std::byte>(static_cast<const std::byte*>(c.in), c.in_bytes()),
                                   std::span<std::byte>(static_cast<std::byte*>(c.out), c.out_bytes()));
      copy = input.owner;
      c.in = input.data.data();
    }
    s.backend.run(c, d, until);
  }

  // The typed path: a backend without call records, or a user's own reduce op (whose operator()
  // must run, so its type reaches the backend).
  template <collective C, class T, class Op = sum>
  work issue(const collective_call& c, bool async, const Op& op = {}) {
    if constexpr (detail::pg_takes_call_records<B> && (builtin_reduce_op<Op> || std::same_as<Op, runtime_op>)) {
      return call(c, async);
    } else {
      check_call(c);
      const std::span<const T> in(static_cast<const T*>(c.in), c.in_count);
      const std::span<T> out(static_cast<T*>(c.out), c.out_count);
      const collective_desc desc = c.describe();
      const std::size_t bytes = c.traffic_bytes();
      if constexpr (C == collective::all_reduce) {
        if (c.in == c.out) return dispatch(desc, bytes, calls::all_reduce_call(s_.get(), out, op), async);
        return dispatch(desc, bytes, calls::all_reduce_call(s_.get(), in, out, op), async);
      } else if constexpr (C == collective::broadcast) {
        return dispatch(desc, bytes, calls::broadcast_call(s_.get(), out, c.root), async);
      } else if constexpr (C == collective::reduce) {
        return dispatch(desc, bytes, calls::reduce_call(s_.get(), out, c.root, op), async);
      } else if constexpr (C == collective::all_gather) {
        return dispatch(desc, bytes, calls::all_gather_call(s_.get(), in, out), async);
      } else if constexpr (C == collective::reduce_scatter) {
        return dispatch(desc, bytes, calls::reduce_scatter_call(s_.get(), in, out, op), async);
      } else if constexpr (C == collective::all_to_all) {
        return dispatch(desc, bytes, calls::all_to_all_call(s_.get(), in, out), async);
      } else if constexpr (C == collective::barrier) {
        return dispatch(desc, bytes, calls::barrier_call(s_.get()), async);
      } else if constexpr (C == collective::send) {
        return dispatch(desc, bytes, calls::send_call(s_.get(), in, c.root), async);
      } else {
        static_assert(C == collective::recv);
        return dispatch(desc, bytes, calls::recv_call(s_.get(), out, c.root), async);
      }
    }
  }

  // The typed calls into the backend and their fallbacks (process_group/backend_calls.hpp).
  using calls = detail::pg_backend_calls<B, state>;

  // --- execution ---------------------------------------------------------------------------
  error fail_fast(const collective_desc& desc) const { return fail_fast_of(*s_, desc); }

  // A blocking call: after the queued collectives, on this thread. On an idle group (nothing
  // queued, nobody waiting, not broken) it takes the gate without the mutex.
  void run(collective_desc desc, std::size_t bytes, runner_ref fn) {
    state& s = *s_;
    std::optional<std::uint64_t> seq;
    if (!s.is_broken.load(std::memory_order_acquire)) seq = s.gate.try_enter();
    if (!seq) {
      std::unique_lock lock(s.mutex);
      seq = s.gate.enter_waiting(lock, s.changed, true, [&] {
        if (s.failure) throw fail_fast(desc);
      });
    }
    struct release {
      state& s;
      ~release() { s.gate.leave(s.mutex, s.changed); }
    } released{s};
    if (s.is_broken.load(std::memory_order_acquire)) {  // broke while this call took the gate
      std::lock_guard lock(s.mutex);
      throw fail_fast(desc);
    }
    desc.seq = *seq;
    execute_on(s, desc, bytes, fn, nullptr);
  }

  template <class F>
  work submit(collective_desc desc, std::size_t bytes, F fn) {
    auto call = std::make_shared<F>(std::move(fn));
    runner_ref run(std::move(*call));  // an rvalue, like a blocking call's: the same thunk
    return submit_task(desc, bytes, run, std::move(call));
  }
  work submit_task(collective_desc desc, std::size_t bytes, runner_ref run, std::shared_ptr<void> call) {
    state& s = *s_;
    auto ws = std::make_shared<detail::work_state>();
    ws->rank = s.rank;
    {
      std::lock_guard lock(s.mutex);
      if (s.failure) throw fail_fast(desc);
      desc.seq = s.gate.sequence_for_queued(s.queue.empty());
      ws->desc = desc;
      s.queue.push_back(task{desc, bytes, run, std::move(call), ws});
      if (!s.comm.joinable()) s.comm = std::thread([st = s_.get()] { communication_loop(*st); });
    }
    s.changed.notify_all();
    return work(std::move(ws));
  }

  // The communication thread. It must not touch `this` (the process_group may have been
  // moved); everything it needs is in the state, so execute() is static in spirit.
  static void communication_loop(state& s) {
    std::unique_lock lock(s.mutex);
    while (true) {
      if (s.queue.empty()) {
        if (s.stopping) return;
        s.changed.wait(lock);  // for a submit (or the destructor): each notifies
        continue;
      }
      if (!s.gate.enter_queued(lock, s.changed)) continue;  // a blocking call or section held it
      task t = std::move(s.queue.front());
      s.queue.pop_front();
      if (s.queue.empty()) s.gate.queue_drained();
      const bool broken_before = s.failure.has_value();
      lock.unlock();
      std::exception_ptr failure;
      try {
        if (broken_before) throw fail_fast_of(s, t.desc);
        execute_on(s, t.desc, t.bytes, t.run, t.work.get());
      } catch (...) {
        failure = std::current_exception();
      }
      t.call.reset();  // drop captured buffers before the waiter resumes
      t.work->complete(failure);
      s.gate.leave(s.mutex, s.changed);
      lock.lock();
    }
  }

  static error fail_fast_of(const state& s, const collective_desc& desc) {
    const error& first = *s.failure;
    return error(first.code(), "the group is unusable after an earlier failure: " + std::string(first.what()), desc.context(s.rank));
  }

  static std::chrono::milliseconds watchdog_grace(std::chrono::milliseconds timeout) {
    // A backend that enforces deadlines throws at the deadline by itself; the watchdog only
    // steps in when it did not, a little later.
    if constexpr (detail::pg_enforces_deadlines<B>) {
      return std::clamp(timeout / 4, std::chrono::milliseconds(200), std::chrono::milliseconds(10000));
    } else {
      return std::chrono::milliseconds(0);
    }
  }

  static void execute_on(state& s, const collective_desc& desc, std::size_t bytes, runner_ref fn, detail::work_state* ws) {
    const std::chrono::milliseconds timeout(s.timeout_ms.load(std::memory_order_relaxed));
    // Two cheap clocks rather than steady_clock (see cheap_clocks.hpp): one read for the
    // deadlines, never early, and two of the tick counter for the statistics.
    const auto start_ticks = detail::tick_clock::now();
    const auto start = detail::coarse_now() + detail::coarse_resolution();
    const deadline until = after(start, timeout);
    const deadline fire_at = after(start, timeout + watchdog_grace(timeout));
    const std::uint64_t token = ++s.tokens;
    // A waiter gives up on a backend that ignores abort() a while after the watchdog fired.
    if (ws) ws->started(after(start, timeout + watchdog_grace(timeout) + std::chrono::seconds(2)));
    s.watchdog.begin(token, fire_at);
    std::exception_ptr thrown;  // the failure path lives out of line: the fast path stays small
    try {
      fn(desc, until);
    } catch (...) {
      thrown = std::current_exception();
    }
    s.watchdog.end();
    const auto end_ticks = detail::tick_clock::now();
    const detail::tick_clock::ticks elapsed = end_ticks > start_ticks ? end_ticks - start_ticks : 0;
    const bool tripped = s.watchdog.tripped(token);
    s.counters[static_cast<std::size_t>(desc.op)].add(bytes, elapsed, thrown || tripped);
    if (thrown || tripped) fail_call(s, desc, timeout, tripped, thrown);
  }

  // A failed call: its error with the call's context, or a timeout when the watchdog fired;
  // recorded as the group's failure, then thrown.
  [[noreturn]] [[gnu::cold]] [[gnu::noinline]] static void fail_call(state& s, const collective_desc& desc, std::chrono::milliseconds timeout,
                                                                     bool tripped, std::exception_ptr thrown) {
    std::optional<error> failure;
    if (thrown) {
      try {
        std::rethrow_exception(thrown);
      } catch (const error& e) {
        failure = e.context().op.empty() ? e.with_context(desc.context(s.rank)) : e;
      } catch (const std::exception& e) {
        failure = error(errc::internal, std::string("the backend threw: ") + e.what(), desc.context(s.rank));
      } catch (...) {
        failure = error(errc::internal, "the backend threw a non-standard exception", desc.context(s.rank));
      }
    }
    if (tripped) {
      std::string message = "not completed within the group timeout of " + std::to_string(timeout.count()) + " ms; the backend was aborted";
      if constexpr (detail::pg_has_missing_ranks<B>) {
        const std::vector<int> missing = s.backend.missing_ranks();
        if (!missing.empty()) {
          message += "; ranks that did not arrive: ";
          for (std::size_t i = 0; i < missing.size(); ++i) message += (i ? ", " : "") + std::to_string(missing[i]);
        }
      }
      if (failure && failure->code() != errc::timeout) message += " (the backend then reported: " + failure->message() + ")";
      failure = error(errc::timeout, message, desc.context(s.rank));
    }
    {
      std::lock_guard lock(s.mutex);
      if (!s.failure) s.failure = *failure;
    }
    s.is_broken.store(true);
    throw *failure;
  }

  std::unique_ptr<state> s_;
};

}  // namespace ddp
