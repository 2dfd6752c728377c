#pragma once
// distributed_data_parallel: gradient synchronization over any parameter container.
//
//   ddp::distributed_data_parallel net{model, group};   // checks shapes across ranks, broadcasts rank 0
//   for (...) {
//     backward(model, [&](std::size_t i) { net.mark_ready(i); });   // bucket all-reduces overlap backward
//     net.finish();                                                 // wait; gradients are now the mean
//     step(model);
//   }
//
// What it does, and why:
//  - Construction checks the parameter count, shapes and dtypes across ranks (one all_gather of a
//    fingerprint; on a difference, a second one of per-parameter descriptors so that every rank can
//    name the first differing parameter on both sides), then broadcasts the values from rank 0 so
//    every replica starts from the same weights.
//  - Buckets are filled in reverse parameter order (backward produces the last layer's gradients
//    first), one dtype per bucket, the first capped at first_bucket_bytes (1 MiB: it starts
//    communicating early), the others at bucket_cap_bytes (25 MiB). As in PyTorch, a bucket is
//    closed once it reaches its cap, so it may exceed it by less than one parameter.
//  - Inside a bucket, gradients are laid out by ascending parameter index. Then a flat parameter
//    set (one gradient buffer, parameters in declaration order) makes every bucket a subspan of it,
//    and that bucket is reduced in place with no copy. Otherwise gradients are copied into a bucket
//    buffer (from group.allocate when the group has it: memory the backend may share) and back.
//  - Device memory (parameters in thrust::device_vector with a device backend such as nccl):
//    the same, with bucket buffers from group.allocate (device memory) filled and emptied by
//    group.copy_memory; the backend orders its collectives after the kernels that wrote the
//    gradients (see nccl_options::compute_stream).
//  - mark_ready(i) says parameter i's gradient is final. When a bucket's last gradient is ready its
//    asynchronous all-reduce (avg) starts at once, but only after every earlier bucket has started:
//    all ranks then issue the same collectives in the same order whatever order their backward
//    marks parameters in. The last bucket is the exception: once it is ready backward is over and
//    nothing is left to overlap it with, so finish() reduces it on the calling thread with the
//    group's blocking all_reduce. Handing it to the communication thread and waiting for it to
//    come back cost more than the whole reduction for small models (4x the step of the tutorial
//    MLP at 2 ranks on 2 cores). options.reduce_last_bucket_inline = false restores the hand-off.
//  - finish() starts what is left, waits for every bucket, copies back; after it the gradients are
//    the mean over ranks. A parameter never marked ready is an error naming it (PyTorch's
//    "Expected to have finished reduction" without the names), or a zero gradient with
//    options.find_unused_parameters. synchronize() = mark everything + finish().
//  - no_sync() returns a guard under which nothing is communicated (gradient accumulation): the
//    next synchronized step averages the accumulated sums.
//  - set_comm_hook(h): h(bucket_view, group) returns something with wait() and must leave the
//    bucket averaged once that wait() returns (ddp/compression.hpp: fp16_compress, bf16_compress).
//
// Parameters are listed once, at construction: their memory must stay where it is (do not resize
// the vectors behind them) for the life of the wrapper. mark_ready may be called from any thread
// (calls are serialized); finish(), synchronize() and no_sync() belong to the training loop.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/parameters.hpp"
#include "ddp/work.hpp"

namespace ddp {

namespace detail {
template <class W>
concept waitable = requires(W& w) { w.wait(); };
template <class W>
concept deadline_waitable = requires(W& w, deadline d) {
  { w.wait(d) } -> std::convertible_to<bool>;
};
/// The group copies memory in its backend's space (device memory): group.copy_memory(dst, src, n).
template <class G>
concept copies_memory = requires(G& g, void* dst, const void* src, std::size_t n) { g.copy_memory(dst, src, n); };
template <class W>
concept completion_queryable = requires(const W& w) {
  { w.is_completed() } -> std::convertible_to<bool>;
};
}  // namespace detail

/// What distributed_data_parallel needs of a group: ddp::process_group, ddp::group, or your own.
/// Collectives must accept every dtype; all_reduce_async returns something with wait()
/// (optionally wait(deadline) -> bool and is_completed()).
template <class G>
concept collective_group =
    requires(G& g, const G& cg, std::span<float> data, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      { cg.rank() } -> std::convertible_to<int>;
      { cg.size() } -> std::convertible_to<int>;
      g.broadcast(data, 0);
      g.all_gather(in, out);
      { g.all_reduce_async(data, avg{}) } -> detail::waitable;
    };

namespace detail {

/// A type-erased handle on anything waitable (a group's work, or a hook's own result). A
/// ddp::work is held as it is (no allocation: what every bucket's reduction returns).
class any_work {
 public:
  any_work() = default;
  any_work(work w) : direct_(std::move(w)), is_direct_(true) {}  // NOLINT: implicit on purpose
  template <waitable W>
    requires(!std::same_as<std::remove_cvref_t<W>, any_work> && !std::same_as<std::remove_cvref_t<W>, work>)
  any_work(W w) : impl_(std::make_shared<model<W>>(std::move(w))) {}  // NOLINT: implicit on purpose

  explicit operator bool() const noexcept { return is_direct_ || impl_ != nullptr; }
  void wait() {
    if (is_direct_) direct_.wait();
    else if (impl_) impl_->wait();
  }
  /// False when not done by d. Works without wait(deadline) are waited for in full (their own
  /// group timeout bounds them).
  bool wait(deadline d) {
    if (is_direct_) return direct_.wait(d);
    return impl_ ? impl_->wait_until(d) : true;
  }
  bool is_completed() const {
    if (is_direct_) return direct_.is_completed();
    return impl_ ? impl_->completed() : true;
  }

 private:
  struct base {
    virtual ~base() = default;
    virtual void wait() = 0;
    virtual bool wait_until(deadline d) = 0;
    virtual bool completed() const = 0;
  };
  template <class W>
  struct model final : base {
    explicit model(W w) : work(std::move(w)) {}
    void wait() override { work.wait(); }
    bool wait_until(deadline d) override {
      if constexpr (deadline_waitable<W>) {
        return static_cast<bool>(work.wait(d));
      } else {
        work.wait();
        return true;
      }
    }
    bool completed() const override {
      if constexpr (completion_queryable<W>) {
        return static_cast<bool>(work.is_completed());
      } else {
        return false;
      }
    }
    W work;
  };
  work direct_;
  bool is_direct_ = false;
  std::shared_ptr<base> impl_;
};

/// A group that takes a whole collective_call (process_group over a backend with call records,
/// ddp::group): a bucket goes down as (dtype, bytes), never as a type.
template <class G>
concept takes_call_records = requires(G& g, const collective_call& c) {
  { g.call(c, true) } -> std::same_as<work>;
};

/// The memory space a group's collectives work on: g.memory(), G::memory, G's backend's, or host.
template <class G>
memory_space group_memory(G& g) {
  if constexpr (requires { { g.memory() } -> std::convertible_to<memory_space>; }) {
    return g.memory();
  } else if constexpr (requires { { G::memory } -> std::convertible_to<memory_space>; }) {
    return G::memory;
  } else if constexpr (requires { { std::remove_cvref_t<decltype(g.backend())>::memory } -> std::convertible_to<memory_space>; }) {
    return std::remove_cvref_t<decltype(g.backend())>::memory;
  } else {
    return memory_space::host;
  }
}

inline std::uint64_t fnv1a(std::uint64_t h, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace detail

/// One bucket as a communication hook sees it.
struct bucket_view {
  std::size_t index = 0;                     // 0 = the first bucket to be reduced
  dtype type = dtype::float32;
  std::span<std::byte> data;                 // the gradients, by ascending parameter index
  std::span<const std::size_t> parameters;   // the parameters in it (assignment order: descending)
  int world_size = 1;

  std::size_t numel() const noexcept { return data.size() / size_of(type); }
  template <dtype_like T>
  std::span<T> as() const {
    if (dtype_of<T> != type) {
      throw error(errc::invalid_argument, "bucket " + std::to_string(index) + " holds " + std::string(to_string(type)) +
                                              ", not " + std::string(to_string(dtype_of<T>)));
    }
    return {reinterpret_cast<T*>(data.data()), data.size() / sizeof(T)};
  }
  /// Memory that lives as long as the wrapper, one region per bucket (8-byte aligned), so a hook
  /// does not allocate every step. Valid until this bucket's next reduction.
  std::span<std::byte> scratch(std::size_t bytes) const {
    if (scratch_ == nullptr) throw error(errc::internal, "bucket_view without scratch storage");
    if (scratch_->size() * sizeof(std::uint64_t) < bytes) scratch_->resize((bytes + 7) / 8);
    return {reinterpret_cast<std::byte*>(scratch_->data()), bytes};
  }

  std::vector<std::uint64_t>* scratch_ = nullptr;  // owned by the wrapper
};

/// A parameter list's assignment to buckets: reverse parameter order, one dtype per bucket (and
/// one memory space), the first bucket of each dtype capped at first_bucket_bytes and the rest at
/// bucket_cap_bytes; a bucket closes once it reaches its cap. Buckets are ordered by their
/// highest parameter index, descending: the order backward makes them ready, and the order they
/// are reduced in. Each bucket lists its parameters in descending index order.
inline std::vector<std::vector<std::size_t>> assign_buckets(std::span<const parameter_ref> params,
                                                            std::size_t first_bucket_bytes,
                                                            std::size_t bucket_cap_bytes) {
  struct open_bucket {
    dtype type;
    memory_space memory;
    std::vector<std::size_t> indices;
    std::size_t bytes = 0;
    bool first = true;
  };
  std::vector<open_bucket> open;
  std::vector<std::vector<std::size_t>> result;
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    auto it = std::find_if(open.begin(), open.end(), [&](const open_bucket& b) { return b.type == p.type && b.memory == p.memory; });
    if (it == open.end()) it = open.insert(open.end(), open_bucket{p.type, p.memory, {}, 0, true});
    it->indices.push_back(k);
    it->bytes += p.bytes();
    if (it->bytes >= (it->first ? first_bucket_bytes : bucket_cap_bytes)) {
      result.push_back(std::move(it->indices));
      it->indices.clear();
      it->bytes = 0;
      it->first = false;
    }
  }
  for (auto& b : open)
    if (!b.indices.empty()) result.push_back(std::move(b.indices));
  std::stable_sort(result.begin(), result.end(), [](const auto& a, const auto& b) { return a.front() > b.front(); });
  return result;
}

struct data_parallel_options {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Start each bucket's all-reduce as soon as it is ready (false: all of them in finish()).
  bool overlap = true;
  /// Broadcast parameter values from rank 0 at construction.
  bool broadcast_parameters = true;
  /// Parameters not marked ready by finish() count as zero gradient instead of being an error.
  bool find_unused_parameters = false;
  /// finish() reduces the last bucket on the calling thread (blocking all_reduce) instead of
  /// mark_ready starting it asynchronously. Applies without a comm hook, with more than one rank,
  /// when the group has a blocking all_reduce and finish() has no deadline of its own.
  bool reduce_last_bucket_inline = true;
};

/// One bucket, as the statistics report it.
struct bucket_info {
  dtype type = dtype::float32;
  std::vector<std::size_t> parameters;  // descending index order
  std::size_t bytes = 0;
  bool in_place = false;                // reduced in the gradients' own memory, no copy
};

struct data_parallel_stats {
  std::size_t buckets = 0;
  std::size_t in_place_buckets = 0;
  std::uint64_t steps = 0;             // synchronized steps finished
  std::uint64_t skipped_steps = 0;     // finish() calls under no_sync()
  std::uint64_t all_reduces = 0;       // bucket reductions started, in total
  std::uint64_t bytes_last_step = 0;   // gradient bytes reduced in the last synchronized step
  std::uint64_t bytes_total = 0;
  std::uint64_t bytes_copied_last_step = 0;  // copied into and out of bucket buffers
  std::chrono::nanoseconds wait_last_step{0};  // time finish() spent waiting for communication
  std::chrono::nanoseconds wait_total{0};
};

template <class Params, class Group>
class distributed_data_parallel {
  static_assert(parameter_container<Params>,
                "ddp::distributed_data_parallel: the model type is not a ddp::parameter_container. Its parameters "
                "must be contiguous arrays of one dtype (std::vector, std::array, std::span, Eigen, thrust) listed "
                "by ddp::parameters(model): an ADL function parameters(Model&), a ddp::parameter_traits<Model> "
                "specialization, or a built-in adapter (std::vector<ddp::parameter_ref>, (value, grad) pairs). "
                "Non-contiguous containers such as std::list cannot be reduced.");
  static_assert(collective_group<Group>,
                "ddp::distributed_data_parallel: the group type lacks rank(), size(), broadcast(span, root), "
                "all_gather(in, out) or all_reduce_async(span, op) returning a waitable work");

 public:
  using group_type = Group;
  using hook_type = std::function<detail::any_work(const bucket_view&, Group&)>;

  class no_sync_guard {
   public:
    explicit no_sync_guard(distributed_data_parallel& owner) : owner_(&owner) {}
    no_sync_guard(no_sync_guard&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (owner_ != nullptr) {
        std::lock_guard lock(owner_->mutex_);
        --owner_->no_sync_depth_;
      }
    }

   private:
    distributed_data_parallel* owner_;
  };

  distributed_data_parallel(Params& model, Group& group, data_parallel_options options = {})
      : model_(&model), group_(&group), options_(options), params_(ddp::parameters(model)) {
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_bytes == 0) {
      throw error(errc::invalid_argument, "bucket_cap_bytes and first_bucket_bytes must be positive", context());
    }
    check_local();
    layout_buckets();
    const bool same_copies = check_across_ranks();
    if (options_.broadcast_parameters) broadcast_values();
    allocate_buffers(same_copies);
  }

  distributed_data_parallel(const distributed_data_parallel&) = delete;
  distributed_data_parallel& operator=(const distributed_data_parallel&) = delete;

  /// Waits for reductions still in flight (they write into memory this object owns); never throws.
  ~distributed_data_parallel() { drain_locked(); }

  /// The gradient of parameter i is final for this step.
  void mark_ready(std::size_t i) {
    std::lock_guard lock(mutex_);
    if (i >= params_.size()) {
      throw error(errc::invalid_argument,
                  "mark_ready(" + std::to_string(i) + "): the model has " + std::to_string(params_.size()) + " parameters",
                  context());
    }
    if (no_sync_depth_ > 0) return;
    if (marked_[i]) {
      throw error(errc::invalid_argument,
                  describe_parameter(i, params_[i].name) +
                      " was marked ready twice in one step (call finish() once per step, or use no_sync() to accumulate)",
                  context());
    }
    mark_locked(i);
    if (options_.overlap) launch_ready_locked(last_bucket_inline());
  }

  /// Starts what is left, waits for every bucket and copies back: the gradients are now the mean.
  void finish() { finish(deadline::never()); }
  /// As finish(), but a bucket not reduced by d is errc::timeout (the group's own timeout also applies).
  void finish(deadline d) {
    std::lock_guard lock(mutex_);
    if (no_sync_depth_ > 0) {
      ++stats_.skipped_steps;
      return;
    }
    struct reset_on_exit {
      distributed_data_parallel* self;
      ~reset_on_exit() { self->reset_step_locked(); }
    } reset{this};

    std::string missing;
    std::size_t missing_count = 0;
    for (std::size_t k = params_.size(); k-- > 0;) {
      if (marked_[k]) continue;
      // Peers are waiting for this rank's buckets: take part with a zero gradient either way.
      zero_gradient(k);
      if (missing_count < 16) missing += (missing.empty() ? "" : ", ") + describe_parameter(k, params_[k].name);
      ++missing_count;
      mark_locked(k);
    }

    const auto start = clock::now();
    // A deadline of its own needs wait(d): then the last bucket goes the asynchronous way too.
    const bool last_inline = d.is_never() && last_bucket_inline();
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].ready) {
      bucket& b = buckets_[next_bucket_++];
      const bool inline_here = last_inline && next_bucket_ == buckets_.size();
      try {
        launch(b, inline_here);
      } catch (...) {
        if (inline_here) drain_locked();  // the others may still write into the gradients
        throw;
      }
    }

    std::uint64_t copied = 0;
    for (auto& b : buckets_) {
      if (std::exchange(b.reduced_inline, false)) {
        if (!b.info.in_place) copied += copy_out(b);
        continue;
      }
      if (!b.work) continue;
      bool done = false;
      try {
        done = b.work.wait(d);
      } catch (...) {
        // Reductions still in flight would write into the gradients later (in place) or into
        // buffers the next step fills: let them end (the group's timeout bounds them) first.
        drain_locked();
        throw;
      }
      if (!done) {
        // Not drained: that would defeat the deadline. The next launch of a bucket waits for it.
        throw error(errc::timeout,
                    "the all-reduce of bucket " + std::to_string(b.index) + " (" + std::to_string(b.info.parameters.size()) +
                        " parameters, " + std::to_string(b.info.bytes) +
                        " bytes) was not done by the deadline; it may still write the gradients until the group's "
                        "timeout ends it",
                    context());
      }
      b.work = {};
      if (!b.info.in_place) copied += copy_out(b);
    }
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start);
    stats_.wait_last_step = waited;
    stats_.wait_total += waited;
    stats_.bytes_copied_last_step = copied + copied_in_;
    stats_.bytes_last_step = bytes_this_step_;
    stats_.bytes_total += bytes_this_step_;
    ++stats_.steps;

    if (missing_count > 0 && !options_.find_unused_parameters) {
      if (missing_count > 16) missing += ", and " + std::to_string(missing_count - 16) + " more";
      throw error(errc::invalid_argument,
                  std::to_string(missing_count) + " parameter(s) produced no gradient in this step (mark_ready was not called): " +
                      missing +
                      ". Mark them ready, or set data_parallel_options::find_unused_parameters to treat them as zero "
                      "gradient (this step used zero for them)",
                  context());
    }
  }

  /// For models without backward hooks: every gradient is final; reduce and wait.
  void synchronize() { synchronize(deadline::never()); }
  void synchronize(deadline d) {
    {
      std::lock_guard lock(mutex_);
      if (no_sync_depth_ == 0) {
        for (std::size_t k = params_.size(); k-- > 0;)
          if (!marked_[k]) mark_locked(k);
        launch_ready_locked(last_bucket_inline() && d.is_never());
      }
    }
    finish(d);
  }

  /// While the guard lives, mark_ready and finish communicate nothing; gradients accumulate locally.
  [[nodiscard]] no_sync_guard no_sync() {
    std::lock_guard lock(mutex_);
    if (marked_count_ > 0) {
      throw error(errc::invalid_argument,
                  "no_sync() entered in the middle of a step (" + std::to_string(marked_count_) +
                      " parameters already marked ready): enter it before the backward pass",
                  context());
    }
    ++no_sync_depth_;
    return no_sync_guard(*this);
  }

  /// Replaces the default all-reduce (avg) of every bucket. The hook gets the bucket and the group,
  /// returns something with wait(), and the bucket must hold the mean once that wait() returns.
  template <class Hook>
    requires std::invocable<Hook&, const bucket_view&, Group&> &&
             detail::waitable<std::invoke_result_t<Hook&, const bucket_view&, Group&>>
  void set_comm_hook(Hook hook) {
    std::lock_guard lock(mutex_);
    hook_ = [h = std::move(hook)](const bucket_view& b, Group& g) mutable -> detail::any_work { return detail::any_work(h(b, g)); };
  }
  void clear_comm_hook() {
    std::lock_guard lock(mutex_);
    hook_ = nullptr;
  }

  const std::vector<parameter_ref>& parameters() const noexcept { return params_; }
  std::vector<bucket_info> buckets() const {
    std::vector<bucket_info> out;
    out.reserve(buckets_.size());
    for (const auto& b : buckets_) out.push_back(b.info);
    return out;
  }
  data_parallel_stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  const data_parallel_options& options() const noexcept { return options_; }
  Params& model() noexcept { return *model_; }
  Group& group() noexcept { return *group_; }
  int rank() const { return static_cast<int>(group_->rank()); }
  int size() const { return static_cast<int>(group_->size()); }

 private:
  struct bucket {
    std::size_t index = 0;
    bucket_info info;
    std::vector<std::size_t> offsets;  // byte offset of info.parameters[j] in view
    std::span<std::byte> view;         // the gradients (in place) or the buffer
    std::shared_ptr<void> storage;     // owns the buffer when not in place
    std::vector<std::uint64_t> scratch;
    std::size_t pending = 0;
    bool ready = false;
    bool reduced_inline = false;  // this step's reduction already ran on the calling thread
    detail::any_work work;
  };

  error_context context() const { return {.rank = static_cast<int>(group_->rank()), .op = "distributed_data_parallel"}; }

  void check_local() {
    const auto space = detail::group_memory(*group_);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      if (p.value.size() != p.grad.size() || p.value.size() % size_of(p.type) != 0) {
        throw error(errc::invalid_argument,
                    describe_parameter(i, p.name) + ": value has " + std::to_string(p.value.size()) +
                        " bytes but its gradient has " + std::to_string(p.grad.size()) + " (" +
                        std::string(to_string(p.type)) + ")",
                    context());
      }
      if (p.memory != space) {
        throw error(errc::invalid_argument,
                    describe_parameter(i, p.name) + " is in " + std::string(to_string(p.memory)) +
                        " memory, but this group's backend works on " + std::string(to_string(space)) +
                        " memory: use a backend for that memory (nccl for device memory) or move the parameters",
                    context());
      }
    }
  }

  // --- shapes and dtypes across ranks ---------------------------------------------------

  static constexpr std::size_t max_dims = 8;
  static constexpr std::size_t name_words = 6;
  static constexpr std::size_t desc_words = 4 + max_dims + name_words;  // present, dtype, ndim, dims, extra, name

  std::vector<std::int64_t> descriptor(std::size_t i) const {
    std::vector<std::int64_t> d(desc_words, 0);
    if (i >= params_.size()) return d;
    const auto& p = params_[i];
    d[0] = 1;
    d[1] = static_cast<std::int64_t>(p.type);
    d[2] = static_cast<std::int64_t>(p.shape.size());
    std::uint64_t extra = 0xcbf29ce484222325ull;
    for (std::size_t k = 0; k < p.shape.size(); ++k) {
      if (k < max_dims) d[3 + k] = p.shape[k];
      else extra = detail::fnv1a(extra, static_cast<std::uint64_t>(p.shape[k]));
    }
    d[3 + max_dims] = static_cast<std::int64_t>(extra);
    const std::size_t n = std::min(p.name.size(), name_words * 8);
    std::memcpy(&d[4 + max_dims], p.name.data(), n);
    return d;
  }

  static std::string describe_descriptor(std::span<const std::int64_t> d) {
    std::string s = std::string(to_string(static_cast<dtype>(d[1]))) + " [";
    const auto ndim = static_cast<std::size_t>(d[2]);
    for (std::size_t k = 0; k < std::min(ndim, max_dims); ++k) s += (k ? ", " : "") + std::to_string(d[3 + k]);
    if (ndim > max_dims) s += ", ...";
    return s + "]";
  }
  static std::string descriptor_name(std::span<const std::int64_t> d) {
    std::string name(name_words * 8, '\0');
    std::memcpy(name.data(), &d[4 + max_dims], name.size());
    name.resize(std::strlen(name.c_str()));
    return name;
  }

  // Returns whether every rank copies the same buckets: group.allocate may be collective (shared
  // memory), so it is used only when every rank makes the same allocations in the same order.
  bool check_across_ranks() {
    const int p = static_cast<int>(group_->size());
    const int me = static_cast<int>(group_->rank());
    if (p <= 1) return true;
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto d = descriptor(i);
      for (std::size_t k = 0; k < 4 + max_dims; ++k) h = detail::fnv1a(h, static_cast<std::uint64_t>(d[k]));
    }
    std::uint64_t copies = 0xcbf29ce484222325ull;
    for (const auto& b : buckets_) copies = detail::fnv1a(copies, b.info.in_place ? 0 : b.index + 1);
    constexpr std::size_t w = 3;  // count, shape hash, copied-bucket hash
    const std::int64_t mine[w] = {static_cast<std::int64_t>(params_.size()), static_cast<std::int64_t>(h),
                                  static_cast<std::int64_t>(copies)};
    std::vector<std::int64_t> all(w * static_cast<std::size_t>(p));
    group_->all_gather(std::span<const std::int64_t>(mine, w), std::span<std::int64_t>(all));
    bool same = true, same_copies = true;
    std::int64_t max_count = 0;
    for (std::size_t r = 0; r < static_cast<std::size_t>(p); ++r) {
      same = same && all[w * r] == all[0] && all[w * r + 1] == all[1];
      same_copies = same_copies && all[w * r + 2] == all[2];
      max_count = std::max(max_count, all[w * r]);
    }
    if (same) return same_copies;

    // Every rank saw the difference: exchange the descriptors to name it on every rank.
    const auto m = static_cast<std::size_t>(max_count);
    std::vector<std::int64_t> local(m * desc_words);
    for (std::size_t i = 0; i < m; ++i) {
      const auto d = descriptor(i);
      std::copy(d.begin(), d.end(), local.begin() + static_cast<std::ptrdiff_t>(i * desc_words));
    }
    std::vector<std::int64_t> gathered(local.size() * static_cast<std::size_t>(p));
    group_->all_gather(std::span<const std::int64_t>(local), std::span<std::int64_t>(gathered));
    auto desc_of = [&](int r, std::size_t i) {
      return std::span<const std::int64_t>(gathered).subspan((static_cast<std::size_t>(r) * m + i) * desc_words, desc_words);
    };
    auto equal = [&](int a, int b, std::size_t i) {
      const auto x = desc_of(a, i), y = desc_of(b, i);
      return std::equal(x.begin(), x.begin() + 4 + max_dims, y.begin());
    };
    for (std::size_t i = 0; i < m; ++i) {
      int other = -1;
      for (int r = 0; r < p && other < 0; ++r)
        if (!equal(r, 0, i)) other = r;
      if (other < 0) continue;
      // Compare with rank 0 when this rank differs from it, else with the first rank that differs.
      if (!equal(me, 0, i)) other = 0;
      else
        for (int r = 0; r < p; ++r)
          if (!equal(r, me, i)) {
            other = r;
            break;
          }
      auto side = [&](int r) {
        const auto d = desc_of(r, i);
        if (d[0] == 0) return std::string("no parameter ") + std::to_string(i);
        const auto name = descriptor_name(d);
        return (name.empty() ? std::string() : "'" + name + "' ") + describe_descriptor(d);
      };
      const auto count_of = [&](int r) { return std::to_string(all[w * static_cast<std::size_t>(r)]); };
      throw error(errc::mismatch,
                  "the model differs across ranks at parameter " + std::to_string(i) + ": this rank (" + std::to_string(me) +
                      ") has " + side(me) + ", rank " + std::to_string(other) + " has " + side(other) + " (parameter counts: " +
                      count_of(me) + " here, " + count_of(other) + " on rank " + std::to_string(other) +
                      "). Every rank must build the same model",
                  context());
    }
    throw error(errc::internal, "parameter fingerprints differ across ranks but no parameter does", context());
  }

  // --- broadcast from rank 0 ------------------------------------------------------------

  void broadcast_values() {
    if (group_->size() <= 1) return;
    constexpr std::size_t pack_cap = std::size_t{64} << 20;
    const bool root = group_->rank() == 0;
    std::size_t i = 0;
    while (i < params_.size()) {
      // A run of same-dtype host parameters goes in one broadcast; big or device ones go alone.
      std::size_t j = i, bytes = 0;
      while (j < params_.size() && params_[j].type == params_[i].type && params_[j].memory == memory_space::host &&
             (j == i || bytes + params_[j].bytes() <= pack_cap))
        bytes += params_[j++].bytes();
      if (j == i) j = i + 1;
      visit_dtype(params_[i].type, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (j == i + 1) {
          group_->broadcast(params_[i].template values<T>(), 0);
          return;
        }
        std::vector<T> pack(bytes / sizeof(T));
        auto* out = reinterpret_cast<std::byte*>(pack.data());
        if (root)
          for (std::size_t k = i; k < j; ++k) out = copy_bytes(out, params_[k].value);
        group_->broadcast(std::span<T>(pack), 0);
        if (!root) {
          const auto* in = reinterpret_cast<const std::byte*>(pack.data());
          for (std::size_t k = i; k < j; ++k) {
            if (params_[k].bytes() > 0) std::memcpy(params_[k].value.data(), in, params_[k].bytes());
            in += params_[k].bytes();
          }
        }
      });
      i = j;
    }
  }

  static std::byte* copy_bytes(std::byte* out, std::span<const std::byte> in) {
    if (!in.empty()) std::memcpy(out, in.data(), in.size());
    return out + in.size();
  }

  // --- buckets ---------------------------------------------------------------------------

  void layout_buckets() {
    const auto assignment = assign_buckets(params_, options_.first_bucket_bytes, options_.bucket_cap_bytes);
    buckets_.resize(assignment.size());
    bucket_of_.assign(params_.size(), 0);
    marked_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < assignment.size(); ++b) {
      auto& bk = buckets_[b];
      bk.index = b;
      bk.info.parameters = assignment[b];
      bk.info.type = params_[assignment[b].front()].type;
      // Layout by ascending index, so a flat buffer in declaration order is already a bucket.
      std::vector<std::size_t> ascending(assignment[b].rbegin(), assignment[b].rend());
      std::size_t offset = 0;
      bool contiguous = true;
      std::vector<std::size_t> asc_offsets;
      for (std::size_t k = 0; k < ascending.size(); ++k) {
        const auto& p = params_[ascending[k]];
        asc_offsets.push_back(offset);
        if (k > 0 && p.grad.data() != params_[ascending[0]].grad.data() + offset) contiguous = false;
        offset += p.bytes();
        bucket_of_[ascending[k]] = b;
      }
      bk.info.bytes = offset;
      bk.offsets.assign(asc_offsets.rbegin(), asc_offsets.rend());
      bk.pending = ascending.size();
      bk.info.in_place = contiguous && (offset == 0 || params_[ascending[0]].grad.data() != nullptr);
      if (bk.info.in_place) bk.view = std::span<std::byte>(params_[ascending[0]].grad.data(), offset);
    }
    stats_.buckets = buckets_.size();
    stats_.in_place_buckets = static_cast<std::size_t>(
        std::count_if(buckets_.begin(), buckets_.end(), [](const bucket& b) { return b.info.in_place; }));
  }

  void allocate_buffers(bool use_group_allocate) {
    for (auto& bk : buckets_)
      if (!bk.info.in_place) allocate_buffer(bk, use_group_allocate);
  }

  void allocate_buffer(bucket& bk, bool use_group_allocate) {
    const bool device = on_device(bk);
    if (device && !detail::copies_memory<Group>) {
      throw error(errc::unavailable,
                  "bucket " + std::to_string(bk.index) +
                      ": its device-memory gradients are not one contiguous buffer in declaration order, and this group "
                      "has no copy_memory to fill a bucket buffer with them",
                  context());
    }
    visit_dtype(bk.info.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const std::size_t n = bk.info.bytes / sizeof(T);
      if constexpr (requires(Group& g) { g.template allocate<T>(n); }) {
        // Device buckets always come from the group: it is the one that knows the device.
        if (!use_group_allocate && !device) {
          auto owned = std::make_shared<std::vector<T>>(n);
          bk.view = std::as_writable_bytes(std::span<T>(*owned));
          bk.storage = std::move(owned);
          return;
        }
        using A = std::remove_cvref_t<decltype(group_->template allocate<T>(n))>;
        auto owned = std::shared_ptr<A>(new A(group_->template allocate<T>(n)));
        std::span<T> s = as_span<T>(*owned);
        if (s.size() < n) throw error(errc::internal, "group.allocate returned fewer elements than asked for", context());
        bk.view = std::as_writable_bytes(s.first(n));
        bk.storage = std::move(owned);
      } else {
        if (device) {
          throw error(errc::unavailable,
                      "bucket " + std::to_string(bk.index) + ": its device-memory gradients need a bucket buffer, and this group has no allocate<T>(n)",
                      context());
        }
        auto owned = std::make_shared<std::vector<T>>(n);
        bk.view = std::as_writable_bytes(std::span<T>(*owned));
        bk.storage = std::move(owned);
      }
    });
  }

  template <class T, class A>
  static std::span<T> as_span(A& a) {
    if constexpr (std::ranges::contiguous_range<A&>) {
      return std::span<T>(std::ranges::data(a), std::ranges::size(a));
    } else if constexpr (requires { a.span(); }) {
      return std::span<T>(a.span());
    } else if constexpr (requires { a.data(); a.size(); }) {
      return std::span<T>(a.data(), a.size());
    } else {
      return std::span<T>(a);
    }
  }

  void mark_locked(std::size_t i) {
    marked_[i] = 1;
    ++marked_count_;
    auto& b = buckets_[bucket_of_[i]];
    if (--b.pending == 0) b.ready = true;
  }

  // Whether finish() will reduce the last bucket on the calling thread (with no deadline).
  bool last_bucket_inline() const {
    if constexpr (requires(Group& g, std::span<float> s) { g.all_reduce(s, avg{}); }) {
      return options_.reduce_last_bucket_inline && !hook_ && group_->size() > 1;
    } else {
      return false;
    }
  }

  // Starts the ready buckets in order; with hold_last, not the last one (finish() reduces it).
  void launch_ready_locked(bool hold_last = false) {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].ready) {
      if (hold_last && next_bucket_ + 1 == buckets_.size()) return;
      launch(buckets_[next_bucket_++]);
    }
  }

  // Starts the bucket's reduction, or with blocking runs it to the end here (without a hook).
  void launch(bucket& b, bool blocking = false) {
    if (b.info.bytes == 0) return;  // same decision on every rank: shapes were checked
    // The average over one rank is the gradient itself; hooks still run (they may keep state).
    if (!hook_ && group_->size() == 1) return;
    if (b.work) {
      // Left in flight by a step that failed (e.g. a finish() deadline): it may still write here.
      auto stale = std::exchange(b.work, detail::any_work{});
      try {
        stale.wait();
      } catch (...) {  // that step's error was already reported to the caller
      }
    }
    if (!b.info.in_place) {
      for (std::size_t j = 0; j < b.info.parameters.size(); ++j) {
        const auto& g = params_[b.info.parameters[j]].grad;
        copy_gradient_bytes(b, b.view.data() + b.offsets[j], g.data(), g.size());
      }
      copied_in_ += b.info.bytes;
    }
    bucket_view view{b.index, b.info.type, b.view, b.info.parameters, static_cast<int>(group_->size()), &b.scratch};
    if (hook_) {
      b.work = hook_(view, *group_);
    } else if constexpr (detail::takes_call_records<Group>) {
      const std::size_t n = view.numel();
      const collective_call c{.op = collective::all_reduce, .type = b.info.type, .reduction = reduce_kind::avg, .in = b.view.data(), .in_count = n,
                              .out = b.view.data(), .out_count = n};
      if (blocking) {
        group_->call(c, false);
        b.reduced_inline = true;
      } else {
        b.work = group_->call(c, true);
      }
    } else if (blocking) {
      visit_dtype(b.info.type, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (requires { group_->all_reduce(view.as<T>(), avg{}); }) {
          group_->all_reduce(view.as<T>(), avg{});
          b.reduced_inline = true;
        } else {
          b.work = detail::any_work(group_->all_reduce_async(view.as<T>(), avg{}));
        }
      });
    } else {
      b.work = visit_dtype(b.info.type, [&](auto tag) -> detail::any_work {
        using T = typename decltype(tag)::type;
        return detail::any_work(group_->all_reduce_async(view.as<T>(), avg{}));
      });
    }
    ++stats_.all_reduces;
    bytes_this_step_ += b.info.bytes;
  }

  std::uint64_t copy_out(bucket& b) {
    for (std::size_t j = 0; j < b.info.parameters.size(); ++j) {
      const auto& g = params_[b.info.parameters[j]].grad;
      copy_gradient_bytes(b, g.data(), b.view.data() + b.offsets[j], g.size());
    }
    return b.info.bytes;
  }

  // Between gradients and a bucket buffer: memcpy on host, the group's copy_memory on the device.
  void copy_gradient_bytes(const bucket& b, std::byte* dst, const std::byte* src, std::size_t n) {
    if (n == 0) return;
    if constexpr (detail::copies_memory<Group>) {
      if (on_device(b)) {
        group_->copy_memory(dst, src, n);
        return;
      }
    }
    std::memcpy(dst, src, n);
  }
  // A bucket holds one memory space (assign_buckets groups by it): its first parameter's.
  bool on_device(const bucket& b) const { return params_[b.info.parameters.front()].memory != memory_space::host; }

  void zero_gradient(std::size_t k) {
    auto& p = params_[k];
    if (p.grad.empty()) return;
    if (p.memory != memory_space::host) {
      throw error(errc::unavailable,
                  describe_parameter(k, p.name) + " produced no gradient and is in device memory, where it cannot be zeroed here",
                  context());
    }
    std::memset(p.grad.data(), 0, p.grad.size());
  }

  void drain_locked() noexcept {
    for (auto& b : buckets_) {
      auto w = std::exchange(b.work, detail::any_work{});
      try {
        w.wait();
      } catch (...) {  // the first failure is the one reported
      }
    }
  }

  void reset_step_locked() {
    std::fill(marked_.begin(), marked_.end(), 0);
    marked_count_ = 0;
    next_bucket_ = 0;
    bytes_this_step_ = 0;
    copied_in_ = 0;
    for (auto& b : buckets_) {
      b.pending = b.info.parameters.size();
      b.ready = false;
      b.reduced_inline = false;
    }
  }

  Params* model_;
  Group* group_;
  data_parallel_options options_;
  std::vector<parameter_ref> params_;
  std::vector<bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<unsigned char> marked_;
  std::size_t marked_count_ = 0;
  std::size_t next_bucket_ = 0;
  int no_sync_depth_ = 0;
  std::uint64_t bytes_this_step_ = 0;
  std::uint64_t copied_in_ = 0;
  hook_type hook_;
  data_parallel_stats stats_;
  mutable std::mutex mutex_;
};

template <class Params, class Group>
distributed_data_parallel(Params&, Group&) -> distributed_data_parallel<Params, Group>;
template <class Params, class Group>
distributed_data_parallel(Params&, Group&, data_parallel_options) -> distributed_data_parallel<Params, Group>;

}  // namespace ddp
