#pragma once
// sharded_data_parallel: ZeRO stage 1 and 2 (torch's ZeroRedundancyOptimizer, and DeepSpeed's
// gradient partitioning) over any parameter container.
//
//   ddp::optim::adamw<float> opt{{.lr = 1e-3}};
//   ddp::sharded_data_parallel net{model, group, opt, {.stage = 2}};
//   for (...) {
//     for (int m = 0; m < k; ++m) {                  // k micro-steps of gradient accumulation
//       auto guard = m + 1 < k ? std::optional(net.no_sync()) : std::nullopt;
//       backward(model, [&](std::size_t i) { net.mark_ready(i); });
//       net.finish();                                 // ends the micro-step
//     }
//     net.step();   // optimizer on this rank's shard, then the parameters are complete again
//   }
//
// Layout (ddp/data_parallel/shard_layout.hpp): assign_buckets' buckets, each laid out by
// ascending parameter index and padded with zeros to a multiple of the world size W, so that each
// rank owns an equal contiguous shard of every bucket. A rank keeps only its shards of the
// parameters (the master copy the optimizer steps, in the parameters' dtype for now), of the
// gradients and, through the optimizer, of its state: one flat buffer each, so the optimizer runs
// once per step over ~N/W elements. Padding is zero gradient on a zero parameter and is never
// copied out, so no divisibility rule reaches the caller.
//
// Stage 1: the model's gradients stay full size (no_sync accumulates in them, as with
//   distributed_data_parallel). When a bucket's last gradient is marked ready (buckets start in
//   order, as in DDP, so every rank issues the same collectives in the same order), it is copied
//   into a bucket buffer and reduce_scatter_async(avg) into this rank's shard gradient starts.
//   Under no_sync() nothing is communicated.
// Stage 2: every micro-step's buckets are reduce-scattered (sum), under no_sync() too, and added
//   into the shard-gradient accumulator; once a bucket is handed over its parameters' gradients
//   are zeroed, so the model's gradients never hold more than one micro-step and no rank ever
//   holds the accumulated unsharded gradient.
//
// The gradient the optimizer sees, both stages, with k = the micro-steps since the last step()
// (finish() calls, inside no_sync() too) and g_rm rank r's gradient of micro-step m:
//   stage 1:  (sum_r (sum_m g_rm)) / W / k     reduce_scatter(avg) of the accumulated gradients
//   stage 2:  (sum_m (sum_r g_rm)) / W / k     the sums as the group adds them; the accumulator in
//                                              micro-step order; each "/" one rounded division in T,
//                                              "/ k" only when k > 1
// i.e. the mean over ranks and micro-steps: distributed_data_parallel + no_sync over k - 1
// micro-steps + a synchronized one, then dividing the gradients by k. Where every summation order
// gives the same floats (e.g. on the shared-memory transport, or exactly summable values), the
// parameters are bitwise those of that DDP run with the same optimizer over the full parameters.
//
// step() finishes a micro-step still open, divides, runs the optimizer on the shard, then
// all-gathers every bucket's updated shards (asynchronously, bucket after bucket, through the
// same buffers) into the parameters: they are complete when step() returns.
//
// Memory per rank (stats()): optimizer state and master parameters over the shard (sum over
// buckets of ceil(n_b / W), at most N/W + #buckets), shard gradients (the same), and
// options.bucket_buffers communication buffers of the largest padded bucket (plus one shard each
// in stage 2, where the reduce-scatter lands before it is added). The model's own gradients
// belong to the model: full size, as the backward pass writes them.
//
// Construction checks the parameters across ranks and broadcasts rank 0's values with
// distributed_data_parallel's own construction (same checks, same messages). Host memory, and
// every parameter of the optimizer's value_type; mark_ready may be called from any thread (calls
// are serialized); finish(), step() and no_sync() belong to the training loop.
//
// Over 400 lines on purpose: one class template whose private members share its buffers, step
// state and mutex, as distributed_data_parallel's; the pure layout is apart (shard_layout.hpp).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel/any_work.hpp"
#include "ddp/data_parallel/collective_group.hpp"
#include "ddp/data_parallel/distributed_data_parallel.hpp"
#include "ddp/data_parallel/options.hpp"
#include "ddp/data_parallel/shard_layout.hpp"
#include "ddp/data_parallel/waitable.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

struct sharded_options {
  /// 1: shard the optimizer state; 2: and the gradients (accumulated reduce-scattered).
  int stage = 1;
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Communication buffers (each the largest padded bucket) that buckets take turns in; a bucket
  /// that finds all of them in flight waits for the oldest. 0: one per bucket (never waits).
  std::size_t bucket_buffers = 2;
  /// Broadcast parameter values from rank 0 at construction.
  bool broadcast_parameters = true;
  /// Parameters not marked ready by finish() count as zero gradient instead of being an error.
  bool find_unused_parameters = false;
};

/// What one rank holds and has done; bytes are this rank's.
struct sharded_stats {
  int stage = 1;
  int world_size = 1;
  std::size_t buckets = 0;
  std::size_t numel = 0;                      // elements of all parameters
  std::size_t padded_numel = 0;               // the buckets padded to multiples of the world size
  std::size_t shard_numel = 0;                // this rank's share of padded_numel
  std::uint64_t optimizer_state_bytes = 0;    // what the optimizer's state() holds
  std::uint64_t master_parameter_bytes = 0;   // the shard of parameters the optimizer steps
  std::uint64_t shard_gradient_bytes = 0;     // the shard of gradients (stage 2: the accumulator)
  std::uint64_t bucket_buffer_bytes = 0;      // communication buffers
  /// Bytes holding gradients across micro-steps: stage 1 the model's full gradients, stage 2 the
  /// shard accumulator alone.
  std::uint64_t accumulation_bytes = 0;
  std::uint64_t steps = 0;                    // step() calls finished
  std::uint64_t micro_steps = 0;              // finish() calls, in total
  std::uint64_t reduce_scatters = 0;
  std::uint64_t all_gathers = 0;
};

namespace detail {

template <class G>
concept sharded_reduce_scatter = requires(G& g, std::span<const float> in, std::span<float> out) {
  { g.reduce_scatter_async(in, out, avg{}) } -> waitable;
  { g.reduce_scatter_async(in, out, sum{}) } -> waitable;
};
template <class G>
concept sharded_all_gather = requires(G& g, std::span<const float> in, std::span<float> out) {
  { g.all_gather_async(in, out) } -> waitable;
};
template <class O>
concept shard_optimizer = requires { typename O::value_type; } && dtype_like<typename O::value_type> &&
                          requires(O& o, std::span<typename O::value_type> p, std::span<const typename O::value_type> g) { o.step(p, g); };

/// Bytes of an optimizer's state: o.state_bytes() when it has one, else the buffers of the
/// shipped optimizers' state() (momentum_buffer; exp_avg, exp_avg_sq, max_exp_avg_sq), else 0.
template <class O>
std::uint64_t optimizer_state_bytes(const O& o) {
  if constexpr (requires { { o.state_bytes() } -> std::convertible_to<std::uint64_t>; }) {
    return o.state_bytes();
  } else if constexpr (requires { o.state(); }) {
    const auto& s = o.state();
    std::uint64_t n = 0;
    auto add = [&](const auto& v) { n += v.size() * sizeof(typename std::remove_cvref_t<decltype(v)>::value_type); };
    if constexpr (requires { s.momentum_buffer.size(); }) add(s.momentum_buffer);
    if constexpr (requires { s.exp_avg.size(); }) add(s.exp_avg);
    if constexpr (requires { s.exp_avg_sq.size(); }) add(s.exp_avg_sq);
    if constexpr (requires { s.max_exp_avg_sq.size(); }) add(s.max_exp_avg_sq);
    return n;
  } else {
    return 0;
  }
}

}  // namespace detail

template <class Params, class Group, class Optimizer>
class sharded_data_parallel {
  static_assert(parameter_container<Params>,
                "ddp::sharded_data_parallel: the model type is not a ddp::parameter_container (see ddp/parameters.hpp)");
  static_assert(collective_group<Group>,
                "ddp::sharded_data_parallel: the group type lacks rank(), size(), broadcast(span, root), all_gather(in, out) or "
                "all_reduce_async(span, op) (construction checks and broadcasts the parameters with them)");
  static_assert(detail::sharded_reduce_scatter<Group>,
                "ddp::sharded_data_parallel: the group type lacks reduce_scatter_async(span<const T> in, span<T> out, op) "
                "for ddp::avg and ddp::sum, returning a waitable work");
  static_assert(detail::sharded_all_gather<Group>,
                "ddp::sharded_data_parallel: the group type lacks all_gather_async(span<const T> in, span<T> out) returning a "
                "waitable work");
  static_assert(detail::shard_optimizer<Optimizer>,
                "ddp::sharded_data_parallel: the optimizer type needs a value_type (a dtype) and step(std::span<value_type> "
                "params, std::span<const value_type> grads), as ddp::optim::sgd and ddp::optim::adamw have");

 public:
  using value_type = typename Optimizer::value_type;
  using T = value_type;

  class no_sync_guard {
   public:
    explicit no_sync_guard(sharded_data_parallel& owner) : owner_(&owner) {}
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
    sharded_data_parallel* owner_;
  };

  /// The model, group and optimizer must outlive the wrapper (held by reference).
  sharded_data_parallel(Params& model, Group& group, Optimizer& optimizer, sharded_options options = {})
      : model_(&model), group_(&group), optimizer_(&optimizer), options_(options), params_(ddp::parameters(model)) {
    if (options_.stage != 1 && options_.stage != 2) {
      throw error(errc::invalid_argument, "stage must be 1 or 2, not " + std::to_string(options_.stage), context());
    }
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_bytes == 0) {
      throw error(errc::invalid_argument, "bucket_cap_bytes and first_bucket_bytes must be positive", context());
    }
    check_and_broadcast();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].memory != memory_space::host) {
        throw error(errc::unavailable,
                    describe_parameter(i, params_[i].name) + " is in " + std::string(to_string(params_[i].memory)) +
                        " memory: sharded_data_parallel copies and steps shards on the host for now",
                    context());
      }
      if (params_[i].type != dtype_of<T>) {
        throw error(errc::invalid_argument,
                    describe_parameter(i, params_[i].name) + " is " + std::string(to_string(params_[i].type)) +
                        " but the optimizer steps " + std::string(to_string(dtype_of<T>)) +
                        ": every parameter must be of the optimizer's value_type",
                    context());
      }
    }
    world_ = static_cast<int>(group_->size());
    rank_ = static_cast<int>(group_->rank());
    layout_ = make_shard_layout(params_, world_, options_.first_bucket_bytes, options_.bucket_cap_bytes);
    const auto it = layout_.shard_numel.find(dtype_of<T>);
    const std::size_t shard = it == layout_.shard_numel.end() ? 0 : it->second;
    master_.assign(shard, T(0));
    shard_grads_.assign(shard, T(0));
    bucket_of_.assign(params_.size(), 0);
    marked_.assign(params_.size(), 0);
    state_.resize(layout_.buckets.size());
    for (const auto& b : layout_.buckets) {
      for (std::size_t k : b.parameters) bucket_of_[k] = b.index;
      state_[b.index].pending = b.parameters.size();
      for_each_owned(b, rank_, [&](std::size_t k, std::size_t from, std::size_t to, std::size_t n) {
        std::memcpy(master_.data() + b.shard_offset + to, params_[k].template values<T>().data() + from, n * sizeof(T));
      });
    }
    std::size_t slots = options_.bucket_buffers == 0 ? layout_.buckets.size() : std::min(options_.bucket_buffers, layout_.buckets.size());
    slots_.resize(slots);
    for (auto& s : slots_) {
      s.send.assign(layout_.largest_padded, T(0));
      if (options_.stage == 2) s.recv.assign(layout_.largest_shard, T(0));
    }
  }

  sharded_data_parallel(const sharded_data_parallel&) = delete;
  sharded_data_parallel& operator=(const sharded_data_parallel&) = delete;

  /// Waits for collectives still in flight (they write into memory this object owns); never throws.
  ~sharded_data_parallel() { drain_locked(); }

  /// The gradient of parameter i is final for this micro-step.
  void mark_ready(std::size_t i) {
    std::lock_guard lock(mutex_);
    if (i >= params_.size()) {
      throw error(errc::invalid_argument,
                  "mark_ready(" + std::to_string(i) + "): the model has " + std::to_string(params_.size()) + " parameters", context());
    }
    if (communication_paused()) return;
    if (marked_[i]) {
      throw error(errc::invalid_argument,
                  describe_parameter(i, params_[i].name) + " was marked ready twice in one micro-step (call finish() once per micro-step)",
                  context());
    }
    mark_locked(i);
    launch_ready_locked();
  }

  /// Ends a micro-step: starts what is left and waits for it. Stage 1 under no_sync(): counts
  /// the micro-step and communicates nothing. Call it once per backward pass, inside no_sync()
  /// too: it counts the micro-steps the gradients are divided by.
  void finish() {
    std::lock_guard lock(mutex_);
    finish_locked();
  }

  /// For models without backward hooks: every gradient is final; finish().
  void synchronize() {
    std::lock_guard lock(mutex_);
    if (!communication_paused()) {
      for (std::size_t k = params_.size(); k-- > 0;)
        if (!marked_[k]) mark_locked(k);
    }
    finish_locked();
  }

  /// Finishes an open micro-step, runs the optimizer on this rank's shard with the mean gradient
  /// (see the top of this file) and all-gathers the parameters: complete when it returns.
  void step() {
    std::lock_guard lock(mutex_);
    if (no_sync_depth_ > 0) throw error(errc::invalid_argument, "step() inside no_sync(): leave it for the last micro-step", context());
    if (marked_count_ > 0) finish_locked();
    if (options_.stage == 1 ? !reduced_ : micro_steps_ == 0) {
      throw error(errc::invalid_argument,
                  options_.stage == 1 ? "step() without a synchronized micro-step: the last finish() before step() must be outside no_sync()"
                                      : "step() without a micro-step: call finish() after the backward pass",
                  context());
    }
    if (options_.stage == 2 && world_ > 1) {
      const T w = static_cast<T>(world_);
      for (auto& g : shard_grads_) g = g / w;
    }
    if (micro_steps_ > 1) {
      const T k = static_cast<T>(micro_steps_);
      for (auto& g : shard_grads_) g = g / k;
    }
    optimizer_->step(std::span<T>(master_), std::span<const T>(shard_grads_));
    try {
      for (const auto& b : layout_.buckets) {
        if (b.numel == 0) continue;
        slot& s = acquire_slot();
        const std::span<const T> mine(master_.data() + b.shard_offset, b.shard);
        const std::span<T> all(s.send.data(), b.padded);
        if (world_ == 1) std::copy(mine.begin(), mine.end(), all.begin());
        else s.work = detail::any_work(group_->all_gather_async(mine, all));
        s.job = job_kind::gather;
        s.bucket = b.index;
        ++stats_.all_gathers;
      }
      complete_all();
    } catch (...) {
      drain_locked();
      reset_step();
      throw;
    }
    reset_step();
    ++stats_.steps;
  }

  /// While the guard lives, finish() ends a micro-step that step() will not follow: stage 1
  /// communicates nothing (the model's gradients accumulate), stage 2 reduce-scatters as always.
  [[nodiscard]] no_sync_guard no_sync() {
    std::lock_guard lock(mutex_);
    if (marked_count_ > 0) {
      throw error(errc::invalid_argument,
                  "no_sync() entered in the middle of a micro-step (" + std::to_string(marked_count_) +
                      " parameters already marked ready): enter it before the backward pass",
                  context());
    }
    ++no_sync_depth_;
    return no_sync_guard(*this);
  }

  const std::vector<parameter_ref>& parameters() const noexcept { return params_; }
  const shard_layout& layout() const noexcept { return layout_; }
  /// This rank's master parameters and shard gradients (bucket after bucket, see layout()).
  std::span<const T> shard_parameters() const noexcept { return master_; }
  std::span<const T> shard_gradients() const noexcept { return shard_grads_; }
  sharded_stats stats() const {
    std::lock_guard lock(mutex_);
    sharded_stats s = stats_;
    s.stage = options_.stage;
    s.world_size = world_;
    s.buckets = layout_.buckets.size();
    s.numel = layout_.numel;
    s.padded_numel = layout_.padded;
    s.shard_numel = master_.size();
    s.optimizer_state_bytes = detail::optimizer_state_bytes(*optimizer_);
    s.master_parameter_bytes = master_.size() * sizeof(T);
    s.shard_gradient_bytes = shard_grads_.size() * sizeof(T);
    for (const auto& sl : slots_) s.bucket_buffer_bytes += (sl.send.size() + sl.recv.size()) * sizeof(T);
    s.accumulation_bytes = options_.stage == 1 ? layout_.numel * sizeof(T) : s.shard_gradient_bytes;
    return s;
  }
  const sharded_options& options() const noexcept { return options_; }
  Params& model() noexcept { return *model_; }
  Group& group() noexcept { return *group_; }
  Optimizer& optimizer() noexcept { return *optimizer_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_; }

 private:
  enum class job_kind { none, reduce, gather };
  struct slot {
    std::vector<T> send;  // a padded bucket: reduce_scatter's input, all_gather's output
    std::vector<T> recv;  // stage 2: one shard, the reduce_scatter's output before it is added
    detail::any_work work;
    job_kind job = job_kind::none;
    std::size_t bucket = 0;
  };
  struct bucket_state {
    std::size_t pending = 0;
    bool ready = false;
    bool accumulated = false;  // stage 2: the accumulator holds this step's sum for the bucket
  };

  error_context context() const { return {.rank = static_cast<int>(group_->rank()), .op = "sharded_data_parallel"}; }

  // distributed_data_parallel's construction is exactly the check this needs (count, shapes,
  // dtypes, memory space across ranks, naming the first difference) and the broadcast; one
  // bucket so that it makes at most one buffer, freed at once.
  void check_and_broadcast() {
    data_parallel_options o;
    o.bucket_cap_bytes = o.first_bucket_bytes = std::numeric_limits<std::size_t>::max() / 2;
    o.broadcast_parameters = options_.broadcast_parameters;
    try {
      distributed_data_parallel<Params, Group> check(*model_, *group_, o);
    } catch (const error& e) {
      throw error(e.code(), e.message(), context());
    }
  }

  bool communication_paused() const { return options_.stage == 1 && no_sync_depth_ > 0; }

  void mark_locked(std::size_t i) {
    marked_[i] = 1;
    ++marked_count_;
    auto& st = state_[bucket_of_[i]];
    if (--st.pending == 0) st.ready = true;
  }

  void launch_ready_locked() {
    while (next_bucket_ < state_.size() && state_[next_bucket_].ready) {
      try {
        launch(layout_.buckets[next_bucket_++]);
      } catch (...) {
        drain_locked();
        throw;
      }
    }
  }

  void launch(const shard_bucket& b) {
    if (b.numel == 0) return;  // the same on every rank: shapes were checked
    slot& s = acquire_slot();
    T* const send = s.send.data();
    for (std::size_t j = 0; j < b.parameters.size(); ++j) {
      const auto g = params_[b.parameters[j]].template grads<T>();
      if (!g.empty()) std::memcpy(send + b.offsets[j], g.data(), g.size_bytes());
    }
    std::fill(send + b.numel, send + b.padded, T(0));
    const std::span<const T> in(send, b.padded);
    if (options_.stage == 1) {
      const std::span<T> out(shard_grads_.data() + b.shard_offset, b.shard);
      if (world_ == 1) std::copy(in.begin(), in.end(), out.begin());
      else s.work = detail::any_work(group_->reduce_scatter_async(in, out, avg{}));
    } else {
      // Handed over: the model's gradients start the next micro-step from zero.
      for (std::size_t k : b.parameters) {
        const auto g = params_[k].grad;
        if (!g.empty()) std::memset(g.data(), 0, g.size());
      }
      const std::span<T> out(s.recv.data(), b.shard);
      if (world_ == 1) std::copy(in.begin(), in.end(), out.begin());
      else s.work = detail::any_work(group_->reduce_scatter_async(in, out, sum{}));
    }
    s.job = job_kind::reduce;
    s.bucket = b.index;
    ++stats_.reduce_scatters;
  }

  // The next buffer in turn, once what it held is done (buffers are used round robin, so that is
  // the oldest collective in flight).
  slot& acquire_slot() {
    slot& s = slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % slots_.size();
    complete(s);
    return s;
  }

  void complete(slot& s) {
    if (s.job == job_kind::none) return;
    auto w = std::exchange(s.work, detail::any_work{});
    const job_kind job = std::exchange(s.job, job_kind::none);
    w.wait();
    const shard_bucket& b = layout_.buckets[s.bucket];
    if (job == job_kind::reduce) {
      if (options_.stage == 2) {
        T* acc = shard_grads_.data() + b.shard_offset;
        const T* in = s.recv.data();
        if (!std::exchange(state_[b.index].accumulated, true)) std::copy(in, in + b.shard, acc);
        else
          for (std::size_t i = 0; i < b.shard; ++i) acc[i] += in[i];
      }
    } else {
      for (std::size_t j = 0; j < b.parameters.size(); ++j) {
        const auto v = params_[b.parameters[j]].template values<T>();
        if (!v.empty()) std::memcpy(v.data(), s.send.data() + b.offsets[j], v.size_bytes());
      }
    }
  }

  // Waits for every buffer in turn, oldest first.
  void complete_all() {
    for (std::size_t n = 0; n < slots_.size(); ++n) {
      complete(slots_[next_slot_]);
      next_slot_ = (next_slot_ + 1) % slots_.size();
    }
  }

  void finish_locked() {
    if (communication_paused()) {
      ++micro_steps_;
      ++stats_.micro_steps;
      return;
    }
    if (options_.stage == 1 && reduced_) {
      throw error(errc::invalid_argument,
                  "a second synchronized micro-step before step(): in stage 1 accumulate under no_sync() and finish the last "
                  "micro-step outside it",
                  context());
    }
    struct reset_on_exit {
      sharded_data_parallel* self;
      ~reset_on_exit() { self->reset_micro_step(); }
    } reset{this};

    std::string missing;
    std::size_t missing_count = 0;
    for (std::size_t k = params_.size(); k-- > 0;) {
      if (marked_[k]) continue;
      // Peers are waiting for this rank's buckets: take part with a zero gradient either way.
      const auto g = params_[k].grad;
      if (!g.empty()) std::memset(g.data(), 0, g.size());
      if (missing_count < 16) missing += (missing.empty() ? "" : ", ") + describe_parameter(k, params_[k].name);
      ++missing_count;
      mark_locked(k);
    }
    launch_ready_locked();
    try {
      complete_all();
    } catch (...) {
      drain_locked();
      throw;
    }
    ++micro_steps_;
    ++stats_.micro_steps;
    if (options_.stage == 1) reduced_ = true;
    if (missing_count > 0 && !options_.find_unused_parameters) {
      if (missing_count > 16) missing += ", and " + std::to_string(missing_count - 16) + " more";
      throw error(errc::invalid_argument,
                  std::to_string(missing_count) + " parameter(s) produced no gradient in this micro-step (mark_ready was not called): " +
                      missing + ". Mark them ready, or set sharded_options::find_unused_parameters to treat them as zero gradient "
                                "(this micro-step used zero for them)",
                  context());
    }
  }

  void drain_locked() noexcept {
    for (auto& s : slots_) {
      auto w = std::exchange(s.work, detail::any_work{});
      s.job = job_kind::none;
      try {
        w.wait();
      } catch (...) {  // the first failure is the one reported
      }
    }
  }

  void reset_micro_step() {
    std::fill(marked_.begin(), marked_.end(), 0);
    marked_count_ = 0;
    next_bucket_ = 0;
    for (std::size_t b = 0; b < state_.size(); ++b) {
      state_[b].pending = layout_.buckets[b].parameters.size();
      state_[b].ready = false;
    }
  }

  void reset_step() {
    micro_steps_ = 0;
    reduced_ = false;
    for (auto& st : state_) st.accumulated = false;
  }

  Params* model_;
  Group* group_;
  Optimizer* optimizer_;
  sharded_options options_;
  std::vector<parameter_ref> params_;
  int world_ = 1;
  int rank_ = 0;
  shard_layout layout_;
  std::vector<T> master_;       // this rank's shard of the parameters, stepped by the optimizer
  std::vector<T> shard_grads_;  // this rank's shard of the gradients (stage 2: the accumulator)
  std::vector<slot> slots_;
  std::size_t next_slot_ = 0;
  std::vector<bucket_state> state_;
  std::vector<std::size_t> bucket_of_;
  std::vector<unsigned char> marked_;
  std::size_t marked_count_ = 0;
  std::size_t next_bucket_ = 0;
  std::size_t micro_steps_ = 0;  // finish() calls since the last step()
  bool reduced_ = false;         // stage 1: this step's gradients were reduce-scattered
  int no_sync_depth_ = 0;
  sharded_stats stats_;
  mutable std::mutex mutex_;
};

template <class Params, class Group, class Optimizer>
sharded_data_parallel(Params&, Group&, Optimizer&) -> sharded_data_parallel<Params, Group, Optimizer>;
template <class Params, class Group, class Optimizer>
sharded_data_parallel(Params&, Group&, Optimizer&, sharded_options) -> sharded_data_parallel<Params, Group, Optimizer>;

}  // namespace ddp
