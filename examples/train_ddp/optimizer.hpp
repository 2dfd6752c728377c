#pragma once
// train_ddp's --optimizer, --momentum, --weight-decay and --clip: the step that follows the
// gradient average, with ddp::optim's optimizers (torch.optim.SGD / AdamW with foreach=False, and
// torch.nn.utils.clip_grad_norm_), over the model's flat float32 parameters: on the host, or in
// the CUDA build with a device-memory backend (nccl) on the device (ddp/optim/cuda.hpp: the same
// bits as the host optimizers; the clip's norm there is one device reduction over all gradients,
// not torch's norm of per-tensor norms, so it may differ from torch's in the last bits).
//
// --zero 0 steps the full parameters on every rank after distributed_data_parallel's finish();
// --zero 1 and 2 hand this optimizer to sharded_data_parallel, which steps each rank's shard. The
// clip is then the sharded one (one all-reduce of the shard's squared norm), as torch's would be
// over the same gradients, within the bounds stated in ddp/optim/distributed.hpp.

#include <cstdint>
#include <span>
#include <type_traits>
#include <variant>
#include <vector>

#include "ddp/optim.hpp"
#include "options.hpp"

#if defined(__CUDACC__)

#include <thrust/device_vector.h>

#include "ddp/backends/cuda_memory.hpp"
#include "ddp/optim/cuda.hpp"
#endif

namespace train {

/// What a checkpoint keeps of the optimizer: torch's state["step"] and its buffers (empty when the
/// optimizer has none; with --zero 1 and 2, this rank's shard of them).
struct optimizer_snapshot {
  std::vector<std::int64_t> step{0};
  std::vector<float> momentum_buffer, exp_avg, exp_avg_sq, max_exp_avg_sq;
};

/// SGD or AdamW by --optimizer (host or device classes of the same interface), stepped with the
/// lr of each step (set_lr).
template <class Sgd, class AdamW>
class optimizer_choice {
 public:
  using value_type = float;

  explicit optimizer_choice(const options& o) : optimizer_(make(o)) {}

  void set_lr(double lr) {
    std::visit([&](auto& opt) { opt.set_lr(lr); }, optimizer_);
  }
  void step(std::span<float> params, std::span<const float> grads) {
    std::visit([&](auto& opt) { opt.step(params, grads); }, optimizer_);
  }
  void save_to(optimizer_snapshot& out) const {
    std::visit(
        [&](const auto& opt) {
          const auto st = opt.state();
          out.step = {st.step};
          if constexpr (requires { st.momentum_buffer; }) {
            out.momentum_buffer = st.momentum_buffer;
          } else {
            out.exp_avg = st.exp_avg;
            out.exp_avg_sq = st.exp_avg_sq;
            out.max_exp_avg_sq = st.max_exp_avg_sq;
          }
        },
        optimizer_);
  }
  void load_from(const optimizer_snapshot& in) {
    std::visit(
        [&](auto& opt) {
          typename std::remove_cvref_t<decltype(opt)>::state_type st;
          st.step = in.step.empty() ? 0 : in.step.front();
          if constexpr (requires { st.momentum_buffer; }) {
            st.momentum_buffer = in.momentum_buffer;
          } else {
            st.exp_avg = in.exp_avg;
            st.exp_avg_sq = in.exp_avg_sq;
            st.max_exp_avg_sq = in.max_exp_avg_sq;
          }
          opt.load_state(st);
        },
        optimizer_);
  }

  /// The bytes of state this rank keeps (sharded_stats counts them; the report prints them).
  std::uint64_t state_bytes() const {
    return std::visit(
        [](const auto& opt) -> std::uint64_t {
          const auto& s = opt.state();
          std::uint64_t n = 0;
          if constexpr (requires { s.momentum_buffer; }) n += s.momentum_buffer.size();
          if constexpr (requires { s.exp_avg; }) n += s.exp_avg.size() + s.exp_avg_sq.size() + s.max_exp_avg_sq.size();
          return n * sizeof(float);
        },
        optimizer_);
  }

 private:
  using variant = std::variant<Sgd, AdamW>;
  static variant make(const options& o) {
    if (o.optimizer == "adamw") {
      ddp::optim::adamw_options a{.lr = o.lr};
      if (o.weight_decay) a.weight_decay = *o.weight_decay;
      return variant(std::in_place_type<AdamW>, a);
    }
    return variant(std::in_place_type<Sgd>,
                   ddp::optim::sgd_options{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay.value_or(0)});
  }
  variant optimizer_;
};

using chosen_optimizer = optimizer_choice<ddp::optim::sgd<float>, ddp::optim::adamw<float>>;

/// The full-parameter step of --zero 0 (every rank holds the same averaged gradients): clip with
/// torch's algorithm over the model's tensors (one span each, as torch's norm of norms needs), no
/// communication, then the optimizer.
template <class Slots>
void step_replicated(chosen_optimizer& opt, double clip, const Slots& slots, std::span<float> values, std::span<float> grads) {
  if (clip > 0) {
    std::vector<std::span<float>> tensors;
    for (const auto& s : slots) tensors.push_back(grads.subspan(s.offset, s.numel));
    ddp::optim::clip_grad_norm(tensors, clip);
  }
  opt.step(values, grads);
}

#if defined(__CUDACC__)
using chosen_device_optimizer = optimizer_choice<ddp::optim::cuda::sgd<float>, ddp::optim::cuda::adamw<float>>;

/// step_replicated on device memory (CUDA build, nccl): the clip's norm is one device reduction.
inline void step_replicated_on_device(chosen_device_optimizer& opt, double clip, std::span<float> values, std::span<float> grads) {
  if (clip > 0) ddp::optim::cuda::clip_grad_norm(std::vector<std::span<float>>{grads}, clip);
  opt.step(values, grads);
}

/// --zero 1 and 2 on device memory (CUDA build, nccl): sharded_data_parallel hands this rank's
/// device shard to this step, which clips it with the global norm (ddp::optim::cuda::clip_grad_norm's
/// sharded form: one all-reduce of the squared norm in double) and steps it with the device
/// optimizer. The shard gradient arrives read-only, so a clip works on a device copy.
template <class Group>
class device_shard_step {
 public:
  using value_type = float;

  /// The optimizer and group must outlive this object (held by reference).
  device_shard_step(chosen_device_optimizer& inner, Group& group, double clip) : inner_(&inner), group_(&group), clip_(clip) {}

  void step(std::span<float> params, std::span<const float> grads) {
    if (clip_ <= 0) return inner_->step(params, grads);
    if (grads_.size() != grads.size()) grads_.resize(grads.size());
    const std::span<float> mine(thrust::raw_pointer_cast(grads_.data()), grads.size());
    ddp::detail::cuda_check(cudaMemcpy(mine.data(), grads.data(), grads.size_bytes(), cudaMemcpyDeviceToDevice),
                            "train_ddp: cudaMemcpy of the shard gradient");
    ddp::optim::cuda::clip_grad_norm(*group_, std::vector<std::span<float>>{mine}, clip_, ddp::optim::grad_layout::sharded);
    inner_->step(params, std::span<const float>(mine));
  }

  /// The wrapped optimizer's state bytes (sharded_stats counts them).
  std::uint64_t state_bytes() const { return inner_->state_bytes(); }

 private:
  chosen_device_optimizer* inner_;
  Group* group_;
  double clip_;
  thrust::device_vector<float> grads_;
};
#endif

}  // namespace train
