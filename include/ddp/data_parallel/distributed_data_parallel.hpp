#pragma once
// distributed_data_parallel itself (what it does and why: ddp/data_parallel.hpp). Over 400 lines
// on purpose: one class template whose private members share its buckets, step state and mutex;
// cutting it further would mean a redesign, not a move.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel/any_work.hpp"
#include "ddp/data_parallel/bucket_plan.hpp"
#include "ddp/data_parallel/bucket_view.hpp"
#include "ddp/data_parallel/collective_group.hpp"
#include "ddp/data_parallel/group_traits.hpp"
#include "ddp/data_parallel/no_sync_guard.hpp"
#include "ddp/data_parallel/options.hpp"
#include "ddp/data_parallel/stats.hpp"
#include "ddp/data_parallel/waitable.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

namespace detail {

inline std::uint64_t fnv1a(std::uint64_t h, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace detail

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

  using no_sync_guard = ddp::no_sync_guard;

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
    return no_sync_guard(mutex_, no_sync_depth_);
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
    detail::bulk_copy(dst, src, n);
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
