#pragma once
// The tutorial's model, nn.Sequential(nn.Linear(in, hidden), nn.ReLU(), nn.Linear(hidden, out)),
// with mean cross-entropy and SGD, written once over Thrust and a GEMM policy:
//  - CPU build: THRUST_DEVICE_SYSTEM=CPP, so thrust::device_vector is host memory and every
//    thrust call runs on the host; GEMM = exact_gemm or eigen_gemm, or fast_gemm, with which
//    training runs the fused host step of fast_step.hpp instead of the operations below.
//  - CUDA build: the same code with Thrust's CUDA system; GEMM = cublas_gemm or exact_gemm.
// The elementwise work, the softmax-cross-entropy and the reductions follow PyTorch's CPU
// kernels operation for operation (torch_math.hpp), so with the exact GEMM the losses and
// parameters are PyTorch's bit for bit.
//
// Parameters live in one flat buffer in named_parameters() order (0.weight [hidden, in],
// 0.bias [hidden], 2.weight [out, hidden], 2.bias [out]), and the gradients in a second one
// with the same layout: DDP reduces them in place, with no copy.

#include <thrust/copy.h>
#include <thrust/count.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/host_vector.h>
#include <thrust/iterator/counting_iterator.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fast_step.hpp"
#include "gemm.hpp"
#include "torch_math.hpp"

namespace train {

/// Features [n, in] row-major and labels [n], in the device system's memory.
struct dataset {
  thrust::device_vector<float> features;
  thrust::device_vector<std::int64_t> labels;
  long n = 0;
  int in = 0;
  long size() const { return n; }
};

/// One tensor of the flat parameter buffer.
struct tensor_slot {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t offset = 0, numel = 0;
};

struct eval_result {
  long correct = 0;
  long count = 0;
  double loss_sum = 0;  // sum of per-sample cross-entropy, in double
};

namespace kernels {

// Elementwise work over a [rows x cols] matrix is written as f(r, c). The host build runs it as
// two nested loops (a division per element for (r, c) costs as much as the work itself at these
// sizes); the CUDA build flattens it to one thread per element.
template <class F>
struct flat_2d {
  F f;
  int cols;
  TRAIN_HD void operator()(long e) const { f(e / cols, int(e % cols)); }
};
template <class F>
void for_each_2d(long rows, int cols, F f) {
#if defined(__CUDACC__)
  thrust::for_each(thrust::device, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows * cols),
                   flat_2d<F>{f, cols});
#else
  for (long r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) f(r, c);
#endif
}

struct gather_rows {
  const float* features;
  const std::int64_t* index;
  float* x;
  int d;
  TRAIN_HD void operator()(long b, int j) const { x[b * d + j] = features[index[b] * d + j]; }
};

struct gather_labels {
  const std::int64_t* labels;
  const std::int64_t* index;
  std::int64_t* y;
  TRAIN_HD void operator()(long b) const { y[b] = labels[index[b]]; }
};

struct broadcast_bias {  // out[b, j] = bias[j]: addmm's `self` expanded into the output first
  const float* bias;
  float* out;
  int n;
  TRAIN_HD void operator()(long b, int j) const { out[b * n + j] = bias[j]; }
};

struct relu {
  const float* in;
  float* out;
  TRAIN_HD void operator()(long e) const { out[e] = in[e] > 0.0f ? in[e] : 0.0f; }
};

// _vec_log_softmax_lastdim for rows shorter than one vector: max, sum of exp(x - max) in lane
// order, Sleef log, then (x - max) - log(sum).
struct log_softmax_rows {
  const float* z;
  float* out;
  int c;
  TRAIN_HD void operator()(long b) const {
    const float* row = z + b * c;
    float m = row[0];
    for (int j = 1; j < c; ++j) m = row[j] > m ? row[j] : m;
    float sum = torch_expf(row[0] - m);
    for (int j = 1; j < c; ++j) sum = sum + torch_expf(row[j] - m);
    const float log_sum = torch_logf(sum);
    for (int j = 0; j < c; ++j) out[b * c + j] = (row[j] - m) - log_sum;
  }
};

struct pick_target {  // -log p[b, y[b]] is summed later; this picks log p[b, y[b]]
  const float* lp;
  const std::int64_t* y;
  float* out;
  int c;
  TRAIN_HD void operator()(long b) const { out[b] = lp[b * c + y[b]]; }
};

// nll_loss backward (grad -1/total_weight at the target) through log_softmax backward:
// grad_in = g - exp(out) * sum(g), the product fused as GCC contracts ATen's vector code.
struct cross_entropy_backward {
  const float* lp;
  const std::int64_t* y;
  float* dz;
  int c;
  float g_target;  // -(1 / batch)
  TRAIN_HD void operator()(long b) const {
    float s = y[b] == 0 ? g_target : 0.0f;  // sum(grad) over the row, in lane order
    for (int j = 1; j < c; ++j) s = s + (j == y[b] ? g_target : 0.0f);
    for (int j = 0; j < c; ++j) {
      const float g = j == y[b] ? g_target : 0.0f;
      dz[b * c + j] = fmaf(-torch_expf(lp[b * c + j]), s, g);
    }
  }
};

struct column_sums {  // bias gradient: grad.sum(0) in SumKernel's order
  const float* m;
  float* out;
  long rows;
  int cols;
  struct load {
    const float* col;
    int stride;
    TRAIN_HD float operator()(long r) const { return col[r * stride]; }
  };
  TRAIN_HD void operator()(long j) const { out[j] = torch_column_sum(rows, load{m + j, cols}); }

#if !defined(__CUDACC__) && defined(__GNUC__)
  // The host sums neighbouring columns at once, one vector lane each (as wide as the target's
  // vectors: a wider vector returned by value would change the ABI).
#if defined(__AVX__)
  static constexpr int width = 8;
  typedef float lanes __attribute__((vector_size(32)));
#else
  static constexpr int width = 4;
  typedef float lanes __attribute__((vector_size(16)));
#endif
  struct load8 {
    const float* col;
    int stride;
    lanes operator()(long r) const {
      lanes v;
      std::memcpy(&v, col + r * stride, sizeof v);
      return v;
    }
  };
  void all() const {
    int j = 0;
    for (; j + width <= cols; j += width) {
      const lanes s = torch_column_sum(rows, load8{m + j, cols});
      std::memcpy(out + j, &s, sizeof s);
    }
    for (; j < cols; ++j) (*this)(j);
  }
#else
  void all() const { thrust::for_each(thrust::device, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(cols), *this); }
#endif
};

struct relu_backward {  // threshold_backward(grad, relu_output, 0)
  const float* h;
  float* d;
  TRAIN_HD void operator()(long e) const { d[e] = h[e] > 0.0f ? d[e] : 0.0f; }  // a select, so the host vectorizes it
};

struct sgd_update {  // add_(grad, alpha=-lr): one rounding
  float* p;
  const float* g;
  float minus_lr;
  TRAIN_HD void operator()(long e) const { p[e] = fmaf(g[e], minus_lr, p[e]); }
};

struct argmax_hits {
  const float* z;
  const std::int64_t* y;
  int c;
  TRAIN_HD bool operator()(long b) const {
    int best = 0;  // first maximum wins, as torch.argmax
    for (int j = 1; j < c; ++j)
      if (z[b * c + j] > z[b * c + best]) best = j;
    return best == y[b];
  }
};

}  // namespace kernels

/// A GEMM policy that asks for the fused host training step (fast_step.hpp) instead of the
/// operation-by-operation one: fast_gemm, in the CPU build.
template <class Gemm>
concept fused_host_step = requires { requires Gemm::fused_host_step; };

template <class Gemm>
class mlp {
 public:
  mlp(int in, int hidden, int out, Gemm gemm = {}) : in_(in), hidden_(hidden), out_(out), gemm_(gemm) {
    if (in < 1 || hidden < 1 || out < 2) throw std::invalid_argument("mlp: need in >= 1, hidden >= 1, out >= 2");
    const std::size_t w1 = std::size_t(hidden) * in, w2 = std::size_t(out) * hidden;
    slots_ = {{"0.weight", {hidden, in}, 0, w1},
              {"0.bias", {hidden}, w1, std::size_t(hidden)},
              {"2.weight", {out, hidden}, w1 + hidden, w2},
              {"2.bias", {out}, w1 + hidden + w2, std::size_t(out)}};
    values_.resize(w1 + hidden + w2 + out, 0.0f);
    grads_.resize(values_.size(), 0.0f);
  }

  int in() const { return in_; }
  int hidden() const { return hidden_; }
  int out() const { return out_; }
  const std::vector<tensor_slot>& slots() const { return slots_; }
  std::size_t numel() const { return values_.size(); }

  thrust::device_vector<float>& values() { return values_; }
  thrust::device_vector<float>& grads() { return grads_; }
  float* value_data() { return thrust::raw_pointer_cast(values_.data()); }
  float* grad_data() { return thrust::raw_pointer_cast(grads_.data()); }

  /// Copies host values (flat, named_parameters() order) in.
  void set_values(std::span<const float> host) {
    if (host.size() != values_.size()) throw std::invalid_argument("mlp::set_values: wrong size");
    thrust::copy(host.begin(), host.end(), values_.begin());
  }
  std::vector<float> host_values() const {
    std::vector<float> out(values_.size());
    thrust::copy(values_.begin(), values_.end(), out.begin());
    return out;
  }
  std::vector<float> host_grads() const {
    std::vector<float> out(grads_.size());
    thrust::copy(grads_.begin(), grads_.end(), out.begin());
    return out;
  }

  /// zero_grad(); loss = cross_entropy(model(x[batch]), y[batch]); loss.backward().
  /// Gradients are overwritten. ready(i) is called as soon as parameter i's gradient is final
  /// (2.bias, 2.weight, 0.bias, 0.weight: autograd's order), for DDP's overlapped buckets.
  /// Returns loss.item().
  template <class Ready>
  float forward_backward(const dataset& data, std::span<const std::int64_t> batch, Ready&& ready) {
    const long b = static_cast<long>(batch.size());
    if (b == 0) throw std::invalid_argument("mlp::forward_backward: empty batch");
    reserve(b);
    thrust::copy(batch.begin(), batch.end(), index_.begin());
    gather(data, b);
#if !defined(__CUDACC__)
    if constexpr (fused_host_step<Gemm>) {
      fused_forward_backward(b);
      const float loss = loss_item(b);
      for (int i : {3, 2, 1, 0}) ready(i);
      return loss;
    }
#endif
    forward(b);
    const float loss = loss_item(b);

    const auto pol = thrust::device;
    const float* w2 = value_data() + slots_[2].offset;
    float* g = grad_data();
    thrust::for_each(pol, count(0), count(b),
                     kernels::cross_entropy_backward{ptr(lp_), ptr(y_), ptr(dz2_), out_, -(1.0f / float(b))});
    // 2.weight: grad^T.mm(h); 2.bias: grad.sum(0); input grad: grad.mm(W2)
    gemm_(trans::yes, trans::no, out_, hidden_, int(b), ptr(dz2_), out_, ptr(h1_), hidden_, 0.0f, g + slots_[2].offset,
          hidden_);
    kernels::column_sums{ptr(dz2_), g + slots_[3].offset, b, out_}.all();
    ready(3);
    ready(2);
    gemm_(trans::no, trans::no, int(b), hidden_, out_, ptr(dz2_), out_, w2, hidden_, 0.0f, ptr(dh_), hidden_);
    thrust::for_each(pol, count(0), count(b * hidden_), kernels::relu_backward{ptr(h1_), ptr(dh_)});
    gemm_(trans::yes, trans::no, hidden_, in_, int(b), ptr(dh_), hidden_, ptr(x_), in_, 0.0f, g + slots_[0].offset, in_);
    kernels::column_sums{ptr(dh_), g + slots_[1].offset, b, hidden_}.all();
    ready(1);
    ready(0);
    return loss;
  }
  float forward_backward(const dataset& data, std::span<const std::int64_t> batch) {
    return forward_backward(data, batch, [](int) {});
  }

  /// optimizer.step() of SGD(lr), no momentum: p = fma(grad, -lr, p).
  void sgd_step(double lr) {
    thrust::for_each(thrust::device, count(0), count(long(values_.size())),
                     kernels::sgd_update{value_data(), grad_data(), static_cast<float>(-lr)});
  }

  /// Accuracy and summed loss over samples [first, first + stride * k) with the given stride:
  /// each sample once (no sampler padding), in chunks so memory stays bounded.
  eval_result evaluate(const dataset& data, long first = 0, long stride = 1, long chunk = 4096) {
    eval_result r;
    std::vector<std::int64_t> idx;
    for (long start = first; start < data.n;) {
      idx.clear();
      for (long i = start; i < data.n && long(idx.size()) < chunk; i += stride) idx.push_back(i);
      start = idx.back() + stride;
      const long b = long(idx.size());
      reserve(b);
      thrust::copy(idx.begin(), idx.end(), index_.begin());
      gather(data, b);
#if !defined(__CUDACC__)
      if constexpr (fused_host_step<Gemm>) {
        fast::logits(fused_args(b));
        thrust::for_each(thrust::device, count(0), count(b), kernels::log_softmax_rows{ptr(z2_), ptr(lp_), out_});
      } else {
        forward(b);
      }
#else
      forward(b);
#endif
      r.correct += thrust::count_if(thrust::device, count(0), count(b), kernels::argmax_hits{ptr(z2_), ptr(y_), out_});
      thrust::for_each(thrust::device, count(0), count(b), kernels::pick_target{ptr(lp_), ptr(y_), ptr(picked_), out_});
      std::vector<float> host(static_cast<std::size_t>(b));
      thrust::copy(picked_.begin(), picked_.begin() + b, host.begin());
      for (float v : host) r.loss_sum -= double(v);
      r.count += b;
    }
    return r;
  }

  /// Bytes of activations and parameters this model holds (for the memory report).
  std::size_t buffer_bytes() const {
    return sizeof(float) * (values_.size() + grads_.size() + x_.size() + z1_.size() + h1_.size() + z2_.size() +
                            lp_.size() + dz2_.size() + dh_.size() + picked_.size()) +
           sizeof(std::int64_t) * (index_.size() + y_.size());
  }

 private:
  static thrust::counting_iterator<long> count(long i) { return thrust::counting_iterator<long>(i); }
  template <class T>
  static T* ptr(thrust::device_vector<T>& v) {
    return thrust::raw_pointer_cast(v.data());
  }

  void reserve(long b) {
    if (long(index_.size()) >= b) return;
    index_.resize(b);
    y_.resize(b);
    picked_.resize(b);
    x_.resize(std::size_t(b) * in_);
    if constexpr (!fused_host_step<Gemm>) {  // the fused step keeps its activations in a few rows of scratch
      z1_.resize(std::size_t(b) * hidden_);
      h1_.resize(std::size_t(b) * hidden_);
      dh_.resize(std::size_t(b) * hidden_);
    }
    z2_.resize(std::size_t(b) * out_);
    lp_.resize(std::size_t(b) * out_);
    dz2_.resize(std::size_t(b) * out_);
  }

  void gather(const dataset& data, long b) {
    if (data.in != in_) throw std::invalid_argument("mlp: dataset has " + std::to_string(data.in) + " features, model " +
                                                    std::to_string(in_));
    kernels::for_each_2d(b, in_, kernels::gather_rows{thrust::raw_pointer_cast(data.features.data()), ptr(index_), ptr(x_), in_});
    thrust::for_each(thrust::device, count(0), count(b),
                     kernels::gather_labels{thrust::raw_pointer_cast(data.labels.data()), ptr(index_), ptr(y_)});
  }

  // addmm(bias, x, W^T) twice with a ReLU between, then log_softmax.
  void forward(long b) {
    const auto pol = thrust::device;
    const float* v = value_data();
    kernels::for_each_2d(b, hidden_, kernels::broadcast_bias{v + slots_[1].offset, ptr(z1_), hidden_});
    gemm_(trans::no, trans::yes, int(b), hidden_, in_, ptr(x_), in_, v + slots_[0].offset, in_, 1.0f, ptr(z1_), hidden_);
    thrust::for_each(pol, count(0), count(b * hidden_), kernels::relu{ptr(z1_), ptr(h1_)});
    kernels::for_each_2d(b, out_, kernels::broadcast_bias{v + slots_[3].offset, ptr(z2_), out_});
    gemm_(trans::no, trans::yes, int(b), out_, hidden_, ptr(h1_), hidden_, v + slots_[2].offset, hidden_, 1.0f, ptr(z2_),
          out_);
    thrust::for_each(pol, count(0), count(b), kernels::log_softmax_rows{ptr(z2_), ptr(lp_), out_});
  }

#if !defined(__CUDACC__)
  // The whole step in one pass over the batch (fast_step.hpp); the row loss is the exact path's.
  fast::step_args fused_args(long b) {
    float* v = value_data();
    float* g = grad_data();
    return {b,
            in_,
            hidden_,
            out_,
            ptr(x_),
            v + slots_[0].offset,
            v + slots_[1].offset,
            v + slots_[2].offset,
            v + slots_[3].offset,
            g + slots_[0].offset,
            g + slots_[1].offset,
            g + slots_[2].offset,
            g + slots_[3].offset,
            ptr(z2_),
            ptr(dz2_)};
  }
  void fused_forward_backward(long b) {
    const fast::step_args a = fused_args(b);
    const kernels::log_softmax_rows log_softmax{ptr(z2_), ptr(lp_), out_};
    const kernels::cross_entropy_backward ce_backward{ptr(lp_), ptr(y_), ptr(dz2_), out_, -(1.0f / float(b))};
    fast::step(a, [&](long r) {
      log_softmax(r);
      ce_backward(r);
    });
  }
#endif

  // nll_loss(mean): the cascade sum runs on the host over the b picked values, which is the
  // device-to-host transfer loss.item() makes anyway.
  float loss_item(long b) {
    thrust::for_each(thrust::device, count(0), count(b), kernels::pick_target{ptr(lp_), ptr(y_), ptr(picked_), out_});
    host_picked_.resize(static_cast<std::size_t>(b));
    thrust::copy(picked_.begin(), picked_.begin() + b, host_picked_.begin());
    const float sum = torch_nll_sum(b, host_load{host_picked_.data()});
    return sum / static_cast<float>(b);
  }

  struct host_load {
    const float* p;
    TRAIN_HD float operator()(long i) const { return p[i]; }
  };

  int in_, hidden_, out_;
  Gemm gemm_;
  std::vector<tensor_slot> slots_;
  thrust::device_vector<float> values_, grads_;
  thrust::device_vector<std::int64_t> index_, y_;
  thrust::device_vector<float> x_, z1_, h1_, z2_, lp_, dz2_, dh_, picked_;
  std::vector<float> host_picked_;
};

}  // namespace train
