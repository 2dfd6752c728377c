#pragma once
// libtorch adapter: DDP for the PyTorch C++ frontend (torch::nn::Module), and libtorch tensors as
// collective buffers. CMake target ddp::libtorch (exists when CMake finds libtorch:
// cmake/ddpLibtorch.cmake).
//
//   auto group = ddp::init_process_group();                 // torchrun / ddprun / srun / mpirun
//   auto model = torch::nn::Sequential(...);
//   ddp::torch_data_parallel net{*model, group};            // checks shapes, broadcasts rank 0
//   torch::optim::SGD opt(model->parameters(), 0.01);
//   for (...) {
//     net.zero_grad();                                       // in place (not set_to_none)
//     loss_fn(model->forward(x), y).backward();              // bucket all-reduces overlap backward
//     net.finish();                                          // gradients are now the mean over ranks
//     opt.step();
//   }
//
// How it maps onto distributed_data_parallel, and why:
//  - Parameters are model.named_parameters() (requires_grad ones only), in that order on every
//    rank. Each must be a contiguous (dense, row-major) tensor of a ddp dtype: float32, float64,
//    float16, bfloat16, int32, int64, uint8. CPU tensors are host memory; CUDA tensors are marked
//    device memory (reduced by a device backend such as nccl, whose collectives follow the
//    compute stream of nccl_options: give it PyTorch's current stream when that is not the
//    default one; a host backend refuses them with an error naming the parameter). Nothing here
//    needs CUDA headers. examples/libtorch_ddp --device cuda uses this path; it is compiled in
//    CI, and runs where a GPU is (tests/device/run.sh).
//  - Gradients are materialised at construction and then stay where they are: ddp lists raw
//    spans once. By default (gradient_as_bucket_view) every gradient shares the storage of one
//    flat buffer per dtype and device, in declaration order, so each bucket is a slice of it and
//    is reduced in place with no copy (PyTorch's gradient_as_bucket_view=True). They are not
//    autograd views of it: libtorch's Optimizer::zero_grad calls detach_() on every .grad.
//  - autograd accumulates into an existing .grad in place (AccumulateGrad: grad += new), so the
//    memory survives backward. libtorch's zero_grad() defaults to set_to_none=true, which drops
//    .grad; the next backward then creates a new tensor elsewhere. Use net.zero_grad() (zeroes in
//    place), or module.zero_grad(false) / optimizer.zero_grad(false). If a gradient was dropped
//    anyway, the hook copies the new one into the registered memory and makes .grad point back
//    at it (one extra copy per parameter for that step; results are the same).
//  - mark_ready(i) comes from a post-accumulate-grad hook on each parameter (the C++ side of
//    Tensor.register_post_accumulate_grad_hook): it runs after AccumulateGrad has written .grad,
//    so the gradient is final. Tensor::register_hook runs before accumulation and would start
//    the all-reduce on a gradient that is about to change. libtorch keeps one such hook per
//    tensor: this wrapper replaces any other and removes its own in its destructor.
//  - The wrapper must outlive every backward that involves the model's parameters, and a step
//    is backward(s) then finish(), as with distributed_data_parallel (no_sync() for accumulation).
//
// A tensor as a collective buffer: ddp::tensor_span<float>(t) is a std::span over a contiguous
// CPU tensor of that dtype (an error otherwise), and ddp::visit_tensor(t, f) calls f with a span of
// the tensor's own dtype:
//
//   group.all_reduce(ddp::tensor_span<float>(t), ddp::sum{});
//   ddp::visit_tensor(t, [&](auto s) { group.broadcast(s, 0); });

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

namespace detail {

/// The ddp dtype of a libtorch scalar type, or false when ddp has none.
inline bool torch_to_dtype(c10::ScalarType s, dtype& out) noexcept {
  switch (s) {
    case c10::ScalarType::Float: out = dtype::float32; return true;
    case c10::ScalarType::Double: out = dtype::float64; return true;
    case c10::ScalarType::Half: out = dtype::float16; return true;
    case c10::ScalarType::BFloat16: out = dtype::bfloat16; return true;
    case c10::ScalarType::Int: out = dtype::int32; return true;
    case c10::ScalarType::Long: out = dtype::int64; return true;
    case c10::ScalarType::Byte: out = dtype::uint8; return true;
    default: return false;
  }
}

inline dtype torch_dtype_or_throw(const at::Tensor& t, const std::string& what) {
  dtype d{};
  if (!torch_to_dtype(t.scalar_type(), d)) {
    throw error(errc::invalid_argument, what + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                                            ", which ddp does not reduce (float32, float64, float16, bfloat16, int32, int64, uint8)");
  }
  return d;
}

inline std::vector<std::int64_t> torch_shape(const at::Tensor& t) {
  const auto s = t.sizes();
  return {s.begin(), s.end()};
}

inline std::span<std::byte> torch_bytes(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.numel()) * t.element_size()};
}

}  // namespace detail

/// A span over a contiguous CPU tensor whose dtype is T's (errc::invalid_argument otherwise).
template <dtype_like T>
std::span<T> tensor_span(const at::Tensor& t) {
  dtype d{};
  if (!t.defined()) throw error(errc::invalid_argument, "tensor_span: undefined tensor");
  if (!detail::torch_to_dtype(t.scalar_type(), d) || d != dtype_of<T>) {
    throw error(errc::invalid_argument, "tensor_span<" + std::string(to_string(dtype_of<T>)) + ">: the tensor holds " +
                                            std::string(c10::toString(t.scalar_type())));
  }
  if (!t.device().is_cpu()) {
    throw error(errc::invalid_argument, "tensor_span: the tensor is on " + t.device().str() +
                                            "; pass CPU tensors (a device backend takes device memory through its own API)");
  }
  if (!t.is_contiguous()) throw error(errc::invalid_argument, "tensor_span: the tensor is not contiguous (call .contiguous())");
  return {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
}

/// f(std::span<T>) with T the tensor's dtype (contiguous CPU tensors of a ddp dtype).
template <class F>
decltype(auto) visit_tensor(const at::Tensor& t, F&& f) {
  if (!t.defined()) throw error(errc::invalid_argument, "visit_tensor: undefined tensor");
  const dtype d = detail::torch_dtype_or_throw(t, "visit_tensor: the tensor");
  return visit_dtype(d, [&](auto tag) -> decltype(auto) {
    using T = typename decltype(tag)::type;
    return f(tensor_span<T>(t));
  });
}

struct torch_data_parallel_options {
  data_parallel_options ddp{};
  /// Gradients share one flat buffer per dtype and device: buckets are reduced in place.
  bool gradient_as_bucket_view = true;
  /// Also list parameters with requires_grad() == false (they are then never marked ready:
  /// set ddp.find_unused_parameters).
  bool include_frozen = false;
};

/// DDP over a torch::nn::Module's parameters; Group is ddp::group, ddp::process_group or your own.
template <class Group>
class torch_data_parallel {
 public:
  torch_data_parallel(torch::nn::Module& module, Group& group, torch_data_parallel_options options = {})
      : params_(collect(module, options)), grads_(materialise(params_, options.gradient_as_bucket_view)),
        refs_(make_refs(params_, grads_)), net_(refs_, group, options.ddp) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].tensor.requires_grad()) continue;
      torch::autograd::impl::set_post_acc_grad_hooks(params_[i].tensor, std::make_unique<hook>(this, i));
      hooked_.push_back(i);
    }
  }
  torch_data_parallel(const torch_data_parallel&) = delete;
  torch_data_parallel& operator=(const torch_data_parallel&) = delete;
  ~torch_data_parallel() {
    for (auto i : hooked_) torch::autograd::impl::set_post_acc_grad_hooks(params_[i].tensor, nullptr);
  }

  /// Zeroes every gradient in place (what module.zero_grad(false) does).
  void zero_grad() {
    restore_grads(false);
    torch::NoGradGuard no_grad;
    for (auto& g : grads_) g.zero_();
  }

  /// After backward: waits for the bucket all-reduces; every .grad is then the mean over ranks.
  void finish() {
    net_.finish();
    restore_grads(false);
  }
  void finish(deadline d) {
    net_.finish(d);
    restore_grads(false);
  }
  /// For a backward that ran without the hooks' overlap (or none): reduce everything now.
  void synchronize() {
    restore_grads(true);
    net_.synchronize();
  }
  [[nodiscard]] auto no_sync() { return net_.no_sync(); }

  /// The wrapped distributed_data_parallel (stats, comm hooks).
  distributed_data_parallel<std::vector<parameter_ref>, Group>& ddp() noexcept { return net_; }
  /// The parameters, in ddp's order (named_parameters() order).
  std::size_t size() const noexcept { return params_.size(); }
  const std::string& name(std::size_t i) const { return params_.at(i).name; }
  const at::Tensor& parameter(std::size_t i) const { return params_.at(i).tensor; }
  /// The gradient memory ddp reduces for parameter i (what .grad is after finish()).
  const at::Tensor& gradient(std::size_t i) const { return grads_.at(i); }

 private:
  struct named {
    std::string name;
    at::Tensor tensor;
  };

  struct hook final : torch::autograd::PostAccumulateGradHook {
    hook(torch_data_parallel* o, std::size_t i) : owner(o), index(i) {}
    void operator()(const torch::autograd::Variable& /*tensor*/) override {
      owner->adopt(index);
      owner->net_.mark_ready(index);
    }
    torch_data_parallel* owner;
    std::size_t index;
  };

  static std::vector<named> collect(torch::nn::Module& module, const torch_data_parallel_options& o) {
    std::vector<named> out;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      if (!o.include_frozen && !item.value().requires_grad()) continue;
      out.push_back({item.key(), item.value()});
    }
    return out;
  }

  // One flat gradient buffer per (dtype, device), parameters in declaration order; or a gradient
  // of each parameter's own (an existing one is kept where it is already dense and contiguous).
  static std::vector<at::Tensor> materialise(std::vector<named>& params, bool flat) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const std::string what = describe_parameter(i, p.name);
      (void)detail::torch_dtype_or_throw(p.tensor, what);
      if (!p.tensor.is_contiguous() || p.tensor.layout() != c10::kStrided) {
        throw error(errc::invalid_argument, what + " is not a dense contiguous tensor: ddp reduces flat memory");
      }
    }
    std::vector<bool> done(params.size(), false);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (done[i]) continue;
      std::vector<std::size_t> group;
      if (flat) {
        for (std::size_t j = i; j < params.size(); ++j)
          if (!done[j] && params[j].tensor.scalar_type() == params[i].tensor.scalar_type() &&
              params[j].tensor.device() == params[i].tensor.device())
            group.push_back(j);
      } else {
        group.push_back(i);
      }
      std::int64_t total = 0;
      for (auto j : group) total += params[j].tensor.numel();
      const auto buffer = at::zeros({total}, params[i].tensor.options().requires_grad(false));
      std::int64_t offset = 0;
      for (auto j : group) {
        auto& p = params[j];
        // Shares the buffer's storage without being an autograd view of it: libtorch's
        // Optimizer::zero_grad calls detach_() on every .grad, which a view refuses.
        auto g = at::empty({0}, buffer.options());
        g.set_(buffer.storage(), offset, p.tensor.sizes(), p.tensor.strides());
        offset += p.tensor.numel();
        if (p.tensor.grad().defined()) g.copy_(p.tensor.grad());  // keep a gradient already accumulated
        p.tensor.mutable_grad() = g;
        grads[j] = g;
        done[j] = true;
      }
    }
    return grads;
  }

  static std::vector<parameter_ref> make_refs(const std::vector<named>& params, const std::vector<at::Tensor>& grads) {
    std::vector<parameter_ref> out;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& t = params[i].tensor;
      out.push_back(parameter_ref{params[i].name, detail::torch_shape(t), detail::torch_dtype_or_throw(t, params[i].name),
                                  t.device().is_cpu() ? memory_space::host : memory_space::device,
                                  detail::torch_bytes(t), detail::torch_bytes(grads[i])});
    }
    return out;
  }

  // .grad is not the registered memory (zero_grad(set_to_none=true), or assigned by the user):
  // bring its values into the registered memory and point .grad back at it.
  void adopt(std::size_t i, bool copy = true) {
    auto& p = params_[i].tensor;
    const auto& g = p.grad();
    if (g.defined() && g.data_ptr() == grads_[i].data_ptr() && g.sizes() == grads_[i].sizes()) return;
    torch::NoGradGuard no_grad;
    if (copy) {
      if (g.defined()) {
        grads_[i].copy_(g);
      } else {
        grads_[i].zero_();
      }
    }
    p.mutable_grad() = grads_[i];
  }

  // After finish() the registered memory holds the result: .grad is only pointed back at it.
  void restore_grads(bool copy) {
    for (std::size_t i = 0; i < params_.size(); ++i) adopt(i, copy);
  }

  std::vector<named> params_;
  std::vector<at::Tensor> grads_;
  std::vector<parameter_ref> refs_;
  distributed_data_parallel<std::vector<parameter_ref>, Group> net_;
  std::vector<std::size_t> hooked_;
};

template <class Group>
torch_data_parallel(torch::nn::Module&, Group&) -> torch_data_parallel<Group>;
template <class Group>
torch_data_parallel(torch::nn::Module&, Group&, torch_data_parallel_options) -> torch_data_parallel<Group>;

}  // namespace ddp
