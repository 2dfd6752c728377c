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
// With {.overlap_all_gather = true} step() returns with the parameters' all-gathers in flight,
// and the forward waits for each layer before it reads it:
//     net.wait_parameter(i);                          // before layer i's parameters are read
//
// Layout (ddp/data_parallel/shard_layout.hpp): assign_buckets' buckets, each laid out by
// ascending parameter index and padded with zeros to a multiple of the world size W, so that each
// rank owns an equal contiguous shard of every bucket. A rank keeps only its shards of the
// parameters (the master copy the optimizer steps, in the optimizer's value_type T), of the
// gradients (in T) and, through the optimizer, of its state: one flat buffer each, so the
// optimizer runs once per step over ~N/W elements. Padding is zero gradient on a zero parameter
// and is never copied out, so no divisibility rule reaches the caller.
//
// Mixed precision (DeepSpeed's fp32 master partitions): the parameters may be float16 or
// bfloat16 under an optimizer of float. The master shard is then float32, widened from the
// model's values at construction (after the broadcast); the optimizer steps it in float32 and
// step() rounds it to the parameters' dtype (to nearest even) before the all-gather, which moves
// the parameters' dtype. The gradients travel in options.reduce_dtype: by default the
// parameters' dtype (each reduce-scatter's result is widened into the float32 shard gradient),
// or float32 (each bucket of the model's gradients is widened into a float32 bucket buffer and
// reduced in float32, so the shard gradient is never rounded to the low dtype). All parameters
// share one dtype.
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
// With a float16 / bfloat16 reduce_dtype the mean over ranks is rounded to it once (the group
// adds half-precision data in float32), and stage 2 reduce-scatters with avg instead of sum (the
// sum of W float16 gradients overflows where their mean need not):
//   stage 1:  low((sum_r (sum_m g_rm)) / W) / k      (the model accumulates sum_m in its dtype)
//   stage 2:  (sum_m low((sum_r g_rm) / W)) / k      the accumulator in float32
// so with k = 1 both stages see the same low(sum_r g_r / W), widened.
// i.e. the mean over ranks and micro-steps: distributed_data_parallel + no_sync over k - 1
// micro-steps + a synchronized one, then dividing the gradients by k. Where every summation order
// gives the same floats (e.g. on the shared-memory transport, or exactly summable values), the
// parameters are bitwise those of that DDP run with the same optimizer over the full parameters.
//
// step() finishes a micro-step still open, divides, runs the optimizer on the shard, then
// all-gathers every bucket's updated shards (asynchronously, bucket after bucket, through the
// same buffers) into the parameters, in the order the forward reads them: the bucket holding
// parameter 0 first (buckets are in reduce order, which is reverse parameter order). By default
// the parameters are complete when step() returns. With options.overlap_all_gather the last
// all-gathers, one per buffer, are left in flight (the earlier ones were waited for to reuse
// their buffers, so the first layers are complete), so that the next forward can start on the
// first layers: a parameter keeps its value from before step() until wait_parameter(i) (which
// waits for the buckets up to parameter i's, oldest first) or wait_parameters(). Every other
// call of this wrapper that touches the parameters or the buffers (mark_ready, finish,
// synchronize, no_sync, step, the destructor) completes them first. The wrapper cannot see the
// caller read the model, hence the option is off by default. With one rank nothing is in flight.
//
// Memory per rank (stats()): optimizer state and master parameters over the shard (sum over
// buckets of ceil(n_b / W), at most N/W + #buckets), shard gradients (the same), and
// options.bucket_buffers communication buffers of the largest padded bucket (plus one shard each
// in stage 2, where the reduce-scatter lands before it is added, and wherever a shard is
// converted: a low reduce_dtype's result, the rounded parameters before the all-gather). The
// model's own gradients belong to the model: full size, as the backward pass writes them.
// With bf16 / fp16 parameters and AdamW, in bytes per rank for N parameters: the model's 2N
// values and 2N gradients, then a float32 master 4N/W, shard gradient 4N/W and moments 8N/W,
// i.e. 4N + 16N/W; DDP with an fp32 master copy (ddp/optim/master_weights.hpp) holds
// 4N + 4N + 4N + 8N = 20N.
//
// Device memory (the NCCL backend, through ddp::group or ddp::process_group<nccl_backend>): when
// the parameters are in device memory, so are the master shard, the shard gradients and the
// bucket buffers, allocated once at construction with the group's allocate<T>(n); the group's
// copy_memory moves bytes between them and the model, the collectives run on them, and the
// optimizer steps device spans (ddp::optim::cuda::sgd / adamw, on the default stream or a
// blocking one). Zeroing, stage 2's accumulation and the divisions are kernels on the legacy
// default stream, which this header cannot hold (it builds without CUDA):
// <ddp/data_parallel/sharded_cuda.hpp>, included in one .cu file of the program, installs them.
// Device parameters are of the optimizer's value_type, float or double (no float32 master over
// float16 / bfloat16 there yet). The results are those of the host path, bit for bit.
//
// Construction checks the parameters across ranks and broadcasts rank 0's values with
// distributed_data_parallel's own construction (same checks, same messages). All parameters in
// one memory space, and every parameter of the optimizer's value_type (or all float16 / all
// bfloat16 under a float optimizer, in host memory); mark_ready may be called from any thread
// (calls are serialized); finish(), step(), no_sync() and the waits belong to the training loop.
//
// Over 400 lines on purpose: one class template whose private members share its buffers, step
// state and mutex, as distributed_data_parallel's; the pure layout is apart (shard_layout.hpp).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/bulk_copy.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel/any_work.hpp"
#include "ddp/data_parallel/collective_group.hpp"
#include "ddp/data_parallel/distributed_data_parallel.hpp"
#include "ddp/data_parallel/group_traits.hpp"
#include "ddp/data_parallel/no_sync_guard.hpp"
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
  /// The dtype gradients are reduce-scattered in: unset, the parameters'; with float16 / bfloat16
  /// parameters under a float optimizer, dtype::float32 reduces in float32 (twice the bytes).
  std::optional<dtype> reduce_dtype;
  /// step() returns with the parameters' all-gathers in flight: the model's values are the old
  /// ones until wait_parameter(i) / wait_parameters() (or the next mark_ready, finish, no_sync,
  /// step). Off: step() waits for them, for callers that read the model right after it.
  bool overlap_all_gather = false;
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
  /// All-gathers still in flight when step() returned (overlap_all_gather), in total.
  std::uint64_t all_gathers_overlapped = 0;
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

/// The element operations sharded_data_parallel runs on device memory, on the current device's
/// legacy default stream (after the copies and kernels queued there, before the collectives the
/// NCCL backend orders after it). Set by <ddp/data_parallel/sharded_cuda.hpp>; this header holds
/// only the pointer, so that it builds without CUDA and reads the same in every translation unit.
struct sharded_device_ops {
  void (*zero)(void* data, std::size_t bytes);                                  // all bits clear
  void (*add)(dtype type, void* acc, const void* in, std::size_t n);            // acc[i] += in[i]
  void (*divide)(dtype type, void* data, std::size_t n, std::size_t divisor);   // data[i] /= T(divisor)
};
inline const sharded_device_ops* sharded_device = nullptr;

/// The group can hold shards in its own (device) memory: allocate<T>(n) and copy_memory.
template <class G, class T>
concept allocates_shards = copies_memory<G> && requires(G& g, std::size_t n) { g.template allocate<T>(n); };

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

  using no_sync_guard = ddp::no_sync_guard;

  /// The model, group and optimizer must outlive the wrapper (held by reference).
  sharded_data_parallel(Params& model, Group& group, Optimizer& optimizer, sharded_options options = {})
      : model_(&model), group_(&group), optimizer_(&optimizer), options_(options), params_(ddp::parameters(model)) {
    if (options_.stage != 1 && options_.stage != 2) {
      throw error(errc::invalid_argument, "stage must be 1 or 2, not " + std::to_string(options_.stage), context());
    }
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_bytes == 0) {
      throw error(errc::invalid_argument, "bucket_cap_bytes and first_bucket_bytes must be positive", context());
    }
    check_memory_space();
    check_and_broadcast();
    check_dtypes();
    world_ = static_cast<int>(group_->size());
    rank_ = static_cast<int>(group_->rank());
    layout_ = make_shard_layout(params_, world_, options_.first_bucket_bytes, options_.bucket_cap_bytes);
    const auto it = layout_.shard_numel.find(param_type_);
    const std::size_t shard = it == layout_.shard_numel.end() ? 0 : it->second;
    master_ = make_buffer(shard, master_owner_);
    shard_grads_ = make_buffer(shard, shard_grads_owner_);
    bucket_of_.assign(params_.size(), 0);
    marked_.assign(params_.size(), 0);
    state_.resize(layout_.buckets.size());
    // The forward's order: by each bucket's first (lowest) parameter.
    for (const auto& b : layout_.buckets) gather_order_.push_back(b.index);
    std::stable_sort(gather_order_.begin(), gather_order_.end(), [&](std::size_t x, std::size_t y) {
      const auto& px = layout_.buckets[x].parameters;
      const auto& py = layout_.buckets[y].parameters;
      return !px.empty() && (py.empty() || px.front() < py.front());
    });
    for (const auto& b : layout_.buckets) {
      for (std::size_t k : b.parameters) bucket_of_[k] = b.index;
      state_[b.index].pending = b.parameters.size();
      visit_storage(param_type_, [&](auto tag) {
        using P = typename decltype(tag)::type;
        for_each_owned(b, rank_, [&](std::size_t k, std::size_t from, std::size_t to, std::size_t n) {
          const P* src = params_[k].template values<P>().data() + from;
          T* dst = master_.data() + b.shard_offset + to;
          if constexpr (std::same_as<P, T>) copy_bytes(dst, src, n * sizeof(T));
          else std::transform(src, src + n, dst, [](P x) { return widen(x); });
        });
      });
    }
    // send: a padded bucket of gradients in reduce_dtype, or of parameters for the all-gather.
    // recv: one shard where a reduce-scatter lands before it is added or widened (stage 2, or a
    // reduce_dtype other than T), or where the master shard is rounded before the all-gather.
    const std::size_t send_bytes = layout_.largest_padded * std::max(size_of(reduce_type_), size_of(param_type_));
    std::size_t recv_bytes = 0;
    if (options_.stage == 2 || reduce_type_ != dtype_of<T>) recv_bytes = layout_.largest_shard * size_of(reduce_type_);
    if (param_type_ != dtype_of<T>) recv_bytes = std::max(recv_bytes, layout_.largest_shard * size_of(param_type_));
    std::size_t slots = options_.bucket_buffers == 0 ? layout_.buckets.size() : std::min(options_.bucket_buffers, layout_.buckets.size());
    slots_.resize(slots);
    for (auto& s : slots_) {
      s.send = std::as_writable_bytes(make_buffer(send_bytes / sizeof(T) + (send_bytes % sizeof(T) != 0), s.send_owner)).first(send_bytes);
      s.recv = std::as_writable_bytes(make_buffer(recv_bytes / sizeof(T) + (recv_bytes % sizeof(T) != 0), s.recv_owner)).first(recv_bytes);
    }
  }

  sharded_data_parallel(const sharded_data_parallel&) = delete;
  sharded_data_parallel& operator=(const sharded_data_parallel&) = delete;

  /// Completes the parameters' all-gathers still in flight (into the model), then waits for any
  /// other collective (they write into memory this object owns); never throws.
  ~sharded_data_parallel() {
    try {
      complete_gathers_locked();
    } catch (...) {  // drained: the parameters keep what they had
    }
    drain_locked();
  }

  /// The gradient of parameter i is final for this micro-step.
  void mark_ready(std::size_t i) {
    std::lock_guard lock(mutex_);
    if (i >= params_.size()) {
      throw error(errc::invalid_argument,
                  "mark_ready(" + std::to_string(i) + "): the model has " + std::to_string(params_.size()) + " parameters", context());
    }
    complete_gathers_locked();
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
    complete_gathers_locked();
    if (!communication_paused()) {
      for (std::size_t k = params_.size(); k-- > 0;)
        if (!marked_[k]) mark_locked(k);
    }
    finish_locked();
  }

  /// Finishes an open micro-step, runs the optimizer on this rank's shard with the mean gradient
  /// (see the top of this file) and all-gathers the parameters, first layers first: complete when
  /// it returns, or with options.overlap_all_gather once wait_parameter(i) / wait_parameters().
  void step() {
    std::lock_guard lock(mutex_);
    complete_gathers_locked();
    if (no_sync_depth_ > 0) throw error(errc::invalid_argument, "step() inside no_sync(): leave it for the last micro-step", context());
    if (marked_count_ > 0) finish_locked();
    if (options_.stage == 1 ? !reduced_ : micro_steps_ == 0) {
      throw error(errc::invalid_argument,
                  options_.stage == 1 ? "step() without a synchronized micro-step: the last finish() before step() must be outside no_sync()"
                                      : "step() without a micro-step: call finish() after the backward pass",
                  context());
    }
    if (options_.stage == 2 && world_ > 1 && reduce_type_ == dtype_of<T>) divide_shard_gradients(static_cast<std::size_t>(world_));
    if (micro_steps_ > 1) divide_shard_gradients(micro_steps_);
    optimizer_->step(master_, std::span<const T>(shard_grads_));
    try {
      visit_storage(param_type_, [&](auto tag) { gather_parameters<typename decltype(tag)::type>(); });
      if (options_.overlap_all_gather && world_ > 1) {
        stats_.all_gathers_overlapped += static_cast<std::uint64_t>(std::count_if(slots_.begin(), slots_.end(), holds_gather));
      } else {
        complete_all();
      }
    } catch (...) {
      drain_locked();
      reset_step();
      throw;
    }
    reset_step();
    ++stats_.steps;
  }

  /// Waits for the all-gathers step() left in flight (options.overlap_all_gather) and copies them
  /// into the parameters: every parameter has its updated value. Nothing to do otherwise.
  void wait_parameters() {
    std::lock_guard lock(mutex_);
    complete_gathers_locked();
  }

  /// Waits for the all-gather of parameter i's bucket and of the buckets issued before it (the
  /// earlier parameters', oldest first), not for the later ones: parameter i, and every parameter
  /// before it, has its updated value.
  void wait_parameter(std::size_t i) {
    std::lock_guard lock(mutex_);
    if (i >= params_.size()) {
      throw error(errc::invalid_argument,
                  "wait_parameter(" + std::to_string(i) + "): the model has " + std::to_string(params_.size()) + " parameters",
                  context());
    }
    const std::size_t bucket = bucket_of_[i];
    const auto holds = [&](const slot& s) { return s.job == job_kind::gather && s.bucket == bucket; };
    if (std::none_of(slots_.begin(), slots_.end(), holds)) return;  // done already, or an empty bucket
    try {
      for (std::size_t n = 0; n < slots_.size(); ++n) {  // round robin: next_slot_ holds the oldest
        slot& s = slots_[(next_slot_ + n) % slots_.size()];
        if (s.job != job_kind::gather) continue;
        const bool last = holds(s);
        complete(s);
        if (last) break;
      }
    } catch (...) {
      drain_locked();
      throw;
    }
  }

  /// While the guard lives, finish() ends a micro-step that step() will not follow: stage 1
  /// communicates nothing (the model's gradients accumulate), stage 2 reduce-scatters as always.
  [[nodiscard]] no_sync_guard no_sync() {
    std::lock_guard lock(mutex_);
    complete_gathers_locked();
    if (marked_count_ > 0) {
      throw error(errc::invalid_argument,
                  "no_sync() entered in the middle of a micro-step (" + std::to_string(marked_count_) +
                      " parameters already marked ready): enter it before the backward pass",
                  context());
    }
    ++no_sync_depth_;
    return no_sync_guard(mutex_, no_sync_depth_);
  }

  const std::vector<parameter_ref>& parameters() const noexcept { return params_; }
  /// The model's dtype (T, or float16 / bfloat16 over a float32 master) and the one gradients
  /// are reduce-scattered in.
  dtype parameter_dtype() const noexcept { return param_type_; }
  dtype reduce_dtype() const noexcept { return reduce_type_; }
  const shard_layout& layout() const noexcept { return layout_; }
  /// This rank's master parameters and shard gradients (bucket after bucket, see layout()), in the
  /// parameters' memory space.
  std::span<const T> shard_parameters() const noexcept { return master_; }
  std::span<const T> shard_gradients() const noexcept { return shard_grads_; }
  /// Writable, to restore a checkpoint's master shard when the model's parameters are of a lower
  /// precision (their rounded values cannot give it back); between steps, on every rank. The
  /// all-gathers step() left in flight read the master shard: they are completed first.
  std::span<T> shard_parameters() {
    std::lock_guard lock(mutex_);
    complete_gathers_locked();
    return master_;
  }
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
    for (const auto& sl : slots_) s.bucket_buffer_bytes += sl.send.size() + sl.recv.size();
    s.accumulation_bytes = options_.stage == 1 ? layout_.numel * size_of(param_type_) : s.shard_gradient_bytes;
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
    std::span<std::byte> send;  // a padded bucket: reduce_scatter's input, all_gather's output
    std::span<std::byte> recv;  // one shard: a reduce_scatter's output before it is added or widened,
                                // or the rounded parameters an all_gather sends
    std::shared_ptr<void> send_owner, recv_owner;
    detail::any_work work;
    job_kind job = job_kind::none;
    std::size_t bucket = 0;
  };
  // A slot holding an all-gather: after step() only those remain, the ones left in flight
  // (overlap_all_gather) until a wait or the next call completes them.
  static bool holds_gather(const slot& s) noexcept { return s.job == job_kind::gather; }
  struct bucket_state {
    std::size_t pending = 0;
    bool ready = false;
    bool accumulated = false;  // stage 2: the accumulator holds this step's sum for the bucket
  };

  error_context context() const { return {.rank = static_cast<int>(group_->rank()), .op = "sharded_data_parallel"}; }

  // f(std::type_identity<U>{}) for the element type `t` names among those this wrapper stores: T,
  // and float16 / bfloat16 under a float optimizer (check_dtypes admits no other).
  template <class F>
  static void visit_storage(dtype t, F&& f) {
    if constexpr (std::same_as<T, float>) {
      if (t == dtype::float16) return f(std::type_identity<float16>{});
      if (t == dtype::bfloat16) return f(std::type_identity<bfloat16>{});
    }
    f(std::type_identity<T>{});
  }
  template <class U>
  static T widen(U x) noexcept {
    if constexpr (half_precision<U>) return static_cast<float>(x);
    else return x;
  }
  template <class U>
  static U* as(std::span<std::byte> bytes) noexcept {
    return reinterpret_cast<U*>(bytes.data());
  }

  // n zeros of T in the parameters' memory: a std::vector on the host, the group's allocate<T>
  // on the device (collective where the group's is: every rank makes the same calls, in order).
  std::span<T> make_buffer(std::size_t n, std::shared_ptr<void>& owner) {
    if constexpr (detail::allocates_shards<Group, T>) {
      if (device_) {
        using A = std::remove_cvref_t<decltype(group_->template allocate<T>(n))>;
        auto owned = std::shared_ptr<A>(new A(group_->template allocate<T>(n)));
        std::span<T> s;
        if constexpr (std::ranges::contiguous_range<A&>) s = std::span<T>(std::ranges::data(*owned), std::ranges::size(*owned));
        else if constexpr (requires { owned->span(); }) s = std::span<T>(owned->span());
        else s = std::span<T>(owned->data(), owned->size());
        if (s.size() < n) throw error(errc::internal, "group.allocate returned fewer elements than asked for", context());
        s = s.first(n);
        zero_bytes(s.data(), s.size_bytes());
        owner = std::move(owned);
        return s;
      }
    }
    auto owned = std::make_shared<std::vector<T>>(n, T(0));
    const std::span<T> s(*owned);
    owner = std::move(owned);
    return s;
  }
  // Between the model and this wrapper's buffers: memcpy on the host, the group's copy_memory on
  // the device.
  void copy_bytes(void* dst, const void* src, std::size_t n) {
    if (n == 0) return;
    if constexpr (detail::copies_memory<Group>) {
      if (device_) {
        group_->copy_memory(dst, src, n);
        return;
      }
    }
    detail::bulk_copy(dst, src, n);
  }
  void zero_bytes(void* dst, std::size_t n) {
    if (n == 0) return;
    if (device_) detail::sharded_device->zero(dst, n);
    else std::memset(dst, 0, n);
  }
  // shard_grads_[i] = shard_grads_[i] / T(divisor), one rounded division each.
  void divide_shard_gradients(std::size_t divisor) {
    if (device_) return detail::sharded_device->divide(dtype_of<T>, shard_grads_.data(), shard_grads_.size(), divisor);
    const T d = static_cast<T>(divisor);
    for (auto& g : shard_grads_) g = g / d;
  }

  // One memory space for all parameters (the shard buffers are in one); device memory needs a
  // group that allocates and copies it and the kernels of sharded_cuda.hpp.
  void check_memory_space() {
    if (params_.empty()) return;
    const memory_space space = params_.front().memory;
    for (std::size_t i = 1; i < params_.size(); ++i) {
      if (params_[i].memory != space) {
        throw error(errc::invalid_argument,
                    describe_parameter(i, params_[i].name) + " is in " + std::string(to_string(params_[i].memory)) + " memory but " +
                        describe_parameter(0, params_.front().name) + " is in " + std::string(to_string(space)) +
                        " memory: every parameter must be in one memory space (the master shard is one buffer)",
                    context());
      }
    }
    if (space == memory_space::host) return;
    if constexpr (!detail::allocates_shards<Group, T>) {
      throw error(errc::unavailable,
                  "the parameters are in device memory and this group has no allocate<T>(n) and copy_memory to hold their "
                  "shards there: use a device backend (nccl, through ddp::group or ddp::process_group<ddp::nccl_backend>)",
                  context());
    }
    if constexpr (!std::same_as<T, float> && !std::same_as<T, double>) {
      throw error(errc::unavailable,
                  "the parameters are in device memory: sharded_data_parallel steps float or double shards there, not " +
                      std::string(to_string(dtype_of<T>)),
                  context());
    }
    if (detail::sharded_device == nullptr) {
      throw error(errc::unavailable,
                  "the parameters are in device memory: include <ddp/data_parallel/sharded_cuda.hpp> in a CUDA (.cu) file of "
                  "the program, which provides the kernels that zero, accumulate and divide the shards there",
                  context());
    }
    device_ = true;
  }

  // One dtype for all parameters: T, or float16 / bfloat16 under a float optimizer (a float32
  // master); reduce_dtype the parameters' or T.
  void check_dtypes() {
    param_type_ = params_.empty() ? dtype_of<T> : params_.front().type;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].type != param_type_) {
        throw error(errc::invalid_argument,
                    describe_parameter(i, params_[i].name) + " is " + std::string(to_string(params_[i].type)) + " but " +
                        describe_parameter(0, params_.front().name) + " is " + std::string(to_string(param_type_)) +
                        ": every parameter must be of one dtype (the master shard is one buffer)",
                    context());
      }
    }
    const bool low = param_type_ == dtype::float16 || param_type_ == dtype::bfloat16;
    if (param_type_ != dtype_of<T> && !(low && std::same_as<T, float>)) {
      throw error(errc::invalid_argument,
                  "the parameters are " + std::string(to_string(param_type_)) + " but the optimizer steps " +
                      std::string(to_string(dtype_of<T>)) +
                      ": every parameter must be of the optimizer's value_type, or float16 / bfloat16 under a float optimizer "
                      "(which then steps a float32 master copy)",
                  context());
    }
    if (device_ && param_type_ != dtype_of<T>) {
      throw error(errc::unavailable,
                  "the parameters are " + std::string(to_string(param_type_)) +
                      " in device memory: the float32 master over float16 / bfloat16 parameters is kept in host memory only; "
                      "use float parameters on the device, or host memory",
                  context());
    }
    reduce_type_ = options_.reduce_dtype.value_or(param_type_);
    if (reduce_type_ != param_type_ && reduce_type_ != dtype_of<T>) {
      throw error(errc::invalid_argument,
                  "reduce_dtype " + std::string(to_string(reduce_type_)) + ": gradients are reduced in the parameters' dtype (" +
                      std::string(to_string(param_type_)) + ") or the optimizer's (" + std::string(to_string(dtype_of<T>)) + ")",
                  context());
    }
  }

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
    visit_storage(reduce_type_, [&](auto tag) { launch_reduce<typename decltype(tag)::type>(b, s); });
    s.job = job_kind::reduce;
    s.bucket = b.index;
    ++stats_.reduce_scatters;
  }

  // Bucket b's gradients in R (the model's bytes, or widened to T), reduce-scattered into this
  // rank's shard gradient (stage 1 in T) or into the slot's shard buffer.
  template <class R>
  void launch_reduce(const shard_bucket& b, slot& s) {
    R* const send = as<R>(s.send);
    for (std::size_t j = 0; j < b.parameters.size(); ++j) {
      const parameter_ref& p = params_[b.parameters[j]];
      if (p.grad.empty()) continue;
      if (p.type == dtype_of<R>) {
        copy_bytes(send + b.offsets[j], p.grad.data(), p.grad.size());
      } else if constexpr (std::same_as<R, T>) {
        visit_storage(p.type, [&](auto tag) {
          const auto g = p.template grads<typename decltype(tag)::type>();
          std::transform(g.begin(), g.end(), send + b.offsets[j], [](auto x) { return widen(x); });
        });
      }
    }
    zero_bytes(send + b.numel, (b.padded - b.numel) * sizeof(R));
    const std::span<const R> in(send, b.padded);
    if (options_.stage == 2) {
      // Handed over: the model's gradients start the next micro-step from zero.
      for (std::size_t k : b.parameters) zero_bytes(params_[k].grad.data(), params_[k].grad.size());
    }
    const bool into_shard = options_.stage == 1 && std::same_as<R, T>;
    std::span<R> out;
    if constexpr (std::same_as<R, T>) {
      if (into_shard) out = std::span<R>(shard_grads_.data() + b.shard_offset, b.shard);
    }
    if (!into_shard) out = std::span<R>(as<R>(s.recv), b.shard);
    if (world_ == 1) copy_bytes(out.data(), in.data(), in.size_bytes());
    else if (options_.stage == 2 && std::same_as<R, T>) s.work = detail::any_work(group_->reduce_scatter_async(in, out, sum{}));
    else s.work = detail::any_work(group_->reduce_scatter_async(in, out, avg{}));
  }

  // Every bucket's master shard (rounded to P unless P is T) all-gathered into the slots' send
  // buffers; complete() copies each into the parameters.
  template <class P>
  void gather_parameters() {
    for (const std::size_t index : gather_order_) {
      const shard_bucket& b = layout_.buckets[index];
      if (b.numel == 0) continue;
      slot& s = acquire_slot();
      const T* const master = master_.data() + b.shard_offset;
      std::span<const P> mine;
      if constexpr (std::same_as<P, T>) {
        mine = std::span<const P>(master, b.shard);
      } else {
        P* const rounded = as<P>(s.recv);
        std::transform(master, master + b.shard, rounded, [](T x) { return P(x); });
        mine = std::span<const P>(rounded, b.shard);
      }
      const std::span<P> all(as<P>(s.send), b.padded);
      if (world_ == 1) copy_bytes(all.data(), mine.data(), mine.size_bytes());
      else s.work = detail::any_work(group_->all_gather_async(mine, all));
      s.job = job_kind::gather;
      s.bucket = b.index;
      ++stats_.all_gathers;
    }
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
      if (options_.stage == 1 && reduce_type_ == dtype_of<T>) return;  // reduced into the shard gradient itself
      visit_storage(reduce_type_, [&](auto tag) {
        using R = typename decltype(tag)::type;
        T* acc = shard_grads_.data() + b.shard_offset;
        const R* in = as<R>(s.recv);
        if (options_.stage == 1 || !std::exchange(state_[b.index].accumulated, true)) {
          if (device_) copy_bytes(acc, in, b.shard * sizeof(T));  // R is T on the device
          else std::transform(in, in + b.shard, acc, [](R x) { return widen(x); });
        } else if (device_) {
          detail::sharded_device->add(dtype_of<T>, acc, in, b.shard);
        } else {
          for (std::size_t i = 0; i < b.shard; ++i) acc[i] += widen(in[i]);
        }
      });
    } else {
      const std::size_t element = size_of(param_type_);
      for (std::size_t j = 0; j < b.parameters.size(); ++j) {
        const auto v = params_[b.parameters[j]].value;
        if (!v.empty()) copy_bytes(v.data(), s.send.data() + b.offsets[j] * element, v.size());
      }
    }
  }

  // The all-gathers step() left in flight, completed oldest first; on a failure every collective
  // is drained and the parameters keep what they had.
  void complete_gathers_locked() {
    if (std::none_of(slots_.begin(), slots_.end(), holds_gather)) return;
    try {
      complete_all();
    } catch (...) {
      drain_locked();
      throw;
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
    complete_gathers_locked();
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
      zero_bytes(params_[k].grad.data(), params_[k].grad.size());
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
  dtype param_type_ = dtype_of<T>;   // the model's parameters and the all-gather
  dtype reduce_type_ = dtype_of<T>;  // the reduce-scatter
  bool device_ = false;         // the parameters, and so every buffer below, are in device memory
  std::span<T> master_;         // this rank's shard of the parameters, stepped by the optimizer
  std::span<T> shard_grads_;    // this rank's shard of the gradients (stage 2: the accumulator)
  std::shared_ptr<void> master_owner_, shard_grads_owner_;
  std::vector<slot> slots_;
  std::size_t next_slot_ = 0;
  std::vector<bucket_state> state_;
  std::vector<std::size_t> gather_order_;  // bucket indices, the one holding parameter 0 first
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
