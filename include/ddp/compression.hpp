#pragma once
// Gradient compression hooks for distributed_data_parallel: fp16_compress and bf16_compress, and
// their opposite for half-precision models, reduce_in_float32.
//
//   net.set_comm_hook(ddp::fp16_compress);
//
// Each float32 / float64 bucket is divided by the world size and rounded to half precision,
// all-reduced with sum in half precision (half the bytes on the wire), and widened back into
// the bucket. Dividing before compressing, as PyTorch's fp16_compress_hook does, keeps the sum
// of p gradients inside float16's range (65504) where a sum-then-divide could overflow.
// Precision: each rank's contribution is rounded once (relative error <= 2^-11 for float16,
// 2^-8 for bfloat16), plus whatever rounding the backend's half-precision sum does.
// Buckets that are already half precision, or integers, get the plain average. Host buckets
// only: with a device-memory group (nccl) the hook is errc::unavailable.
//
//   net.set_comm_hook(ddp::reduce_in_float32);   // a float16 / bfloat16 model
//
// Each float16 / bfloat16 bucket is widened into float32 scratch (bucket_view::scratch), all-
// reduced with avg in float32 and rounded back into the bucket (to nearest even): the mean is
// rounded once, whatever the backend does with half-precision data (the ring backend already
// adds it in float32 and rounds once, so there the values are the default's; the wire carries
// twice the bytes). Other buckets get the plain average. To keep the mean in float32 past the
// bucket, reduce an fp32 master gradient instead (ddp/optim/master_weights.hpp).

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/data_parallel.hpp"

namespace ddp {

namespace detail {

/// The work of an all-reduce through a scratch buffer of another element type: when the inner one
/// is done, converts the scratch into the bucket (once) through float (widening after a compressed
/// all-reduce, rounding to nearest even after a widened one).
template <class From, class To, class Work>
class convert_on_completion_work {
 public:
  convert_on_completion_work(Work inner, std::span<const From> scratch, std::span<To> out)
      : state_(std::make_shared<state>(state{std::move(inner), scratch, out, false})) {}

  void wait() {
    state_->inner.wait();
    convert();
  }
  bool wait(deadline d) {
    if constexpr (deadline_waitable<Work>) {
      if (!state_->inner.wait(d)) return false;
    } else {
      state_->inner.wait();
    }
    convert();
    return true;
  }
  bool is_completed() const {
    if constexpr (completion_queryable<Work>) {
      return state_->done || state_->inner.is_completed();
    } else {
      return state_->done;
    }
  }

 private:
  struct state {
    Work inner;
    std::span<const From> scratch;
    std::span<To> out;
    bool done;
  };
  void convert() {
    if (state_->done) return;
    for (std::size_t i = 0; i < state_->out.size(); ++i) state_->out[i] = static_cast<To>(static_cast<float>(state_->scratch[i]));
    state_->done = true;
  }
  std::shared_ptr<state> state_;
};

/// The hooks convert on the host: a device bucket is refused, naming the hook and what it does.
template <collective_group G>
void require_host_bucket(const bucket_view& b, G& group, const char* hook) {
  if (group_memory(group) != memory_space::host) {
    // The conversion loops run on the host; a device bucket would need a kernel.
    throw error(errc::unavailable,
                std::string(hook) + " on the host, but bucket " + std::to_string(b.index) +
                    " is in device memory: with a device backend (nccl) keep the default averaging or write a hook that "
                    "converts on the device",
                {.rank = static_cast<int>(group.rank()), .op = "distributed_data_parallel"});
  }
}

/// The buckets a hook leaves alone: the average, as without a hook.
template <collective_group G>
any_work plain_average(const bucket_view& b, G& group) {
  return visit_dtype(b.type, [&](auto tag) -> any_work {
    using T = typename decltype(tag)::type;
    return any_work(group.all_reduce_async(b.as<T>(), avg{}));
  });
}

template <class Half>
struct compress_hook {
  template <collective_group G>
  any_work operator()(const bucket_view& b, G& group) const {
    require_host_bucket(b, group, "fp16_compress / bf16_compress round");
    if (b.type == dtype::float32) return compressed<float>(b, group);
    if (b.type == dtype::float64) return compressed<double>(b, group);
    return plain_average(b, group);
  }

 private:
  template <class T, class G>
  static any_work compressed(const bucket_view& b, G& group) {
    const auto grads = b.as<T>();
    const auto bytes = b.scratch(grads.size() * sizeof(Half));
    const std::span<Half> half(reinterpret_cast<Half*>(bytes.data()), grads.size());
    const T scale = static_cast<T>(1) / static_cast<T>(b.world_size);
    for (std::size_t i = 0; i < grads.size(); ++i) half[i] = Half(static_cast<float>(grads[i] * scale));
    auto inner = group.all_reduce_async(half, sum{});
    return any_work(convert_on_completion_work<Half, T, decltype(inner)>(std::move(inner), half, grads));
  }
};

struct float32_reduce_hook {
  template <collective_group G>
  any_work operator()(const bucket_view& b, G& group) const {
    require_host_bucket(b, group, "reduce_in_float32 widens");
    if (b.type == dtype::float16) return widened<float16>(b, group);
    if (b.type == dtype::bfloat16) return widened<bfloat16>(b, group);
    return plain_average(b, group);
  }

 private:
  template <class Half, class G>
  static any_work widened(const bucket_view& b, G& group) {
    const auto grads = b.as<Half>();
    const auto bytes = b.scratch(grads.size() * sizeof(float));
    const std::span<float> wide(reinterpret_cast<float*>(bytes.data()), grads.size());
    for (std::size_t i = 0; i < grads.size(); ++i) wide[i] = static_cast<float>(grads[i]);
    auto inner = group.all_reduce_async(wide, avg{});
    return any_work(convert_on_completion_work<float, Half, decltype(inner)>(std::move(inner), wide, grads));
  }
};

}  // namespace detail

/// Hooks for distributed_data_parallel::set_comm_hook.
inline constexpr detail::compress_hook<float16> fp16_compress{};
inline constexpr detail::compress_hook<bfloat16> bf16_compress{};
inline constexpr detail::float32_reduce_hook reduce_in_float32{};

}  // namespace ddp
