#pragma once
// GEMM policies for the tutorial MLP. Row-major, BLAS-like:
//   C[m x n] = op(A)[m x k] * op(B)[k x n] + beta * C      (beta is 0 or 1 here)
// with op(X) = X or X^T. A policy is any type with that call operator; mlp<> takes it as a
// template parameter, so the model code is written once for every build.
//
//  - exact_gemm: each element is one fused multiply-add chain over k, in order, then + beta*C:
//    the summation order of the BLAS sgemm kernel PyTorch calls for these tiny shapes, so the
//    CPU build reproduces PyTorch's bits. Runs through thrust::for_each, hence on the host
//    (CPP system) or on the GPU (CUDA system) with the same bits.
//  - eigen_gemm (CPU build): Eigen::Map over the buffers; fast for large shapes, different bits.
//  - cublas_gemm (CUDA build, in cublas_gemm.hpp): cuBLAS sgemm.

#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "torch_math.hpp"

#if !defined(__CUDACC__) && __has_include(<Eigen/Core>)
#include <Eigen/Core>
#define TRAIN_HAVE_EIGEN 1
#endif

namespace train {

/// The type of thrust::device: the device system's policy (CPP in the CPU build, CUDA in the CUDA build).
using device_policy = std::remove_cv_t<std::remove_reference_t<decltype(thrust::device)>>;

enum class trans : bool { no = false, yes = true };

namespace detail {
struct exact_gemm_kernel {
  bool ta, tb;
  int n, k, lda, ldb, ldc;
  float beta;
  const float* a;
  const float* b;
  float* c;
  TRAIN_HD void operator()(long e) const {
    const long i = e / n, j = e % n;
    float acc = 0.0f;
    for (int p = 0; p < k; ++p) {
      const float x = ta ? a[p * lda + i] : a[i * lda + p];
      const float y = tb ? b[j * ldb + p] : b[p * ldb + j];
      acc = fmaf(x, y, acc);
    }
    float& out = c[i * ldc + j];
    out = beta == 0.0f ? acc : acc + beta * out;
  }
};

#if !defined(__CUDACC__)
// The host version of the same arithmetic, vectorized across the n outputs of a row: lane j
// still runs its own fma chain over p = 0..k-1 in order, so the bits are those of the kernel.
// The FMA clone makes fmaf one instruction (the default clone calls libm's, which is exact too);
// without it each fmaf is a library call and this GEMM dominates the tutorial's step time.
// Not when -mfma already applies, nor under the sanitizers: the clones' ifunc resolver runs
// while the dynamic loader relocates, before a sanitizer's runtime is up, and crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__FMA__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
#define TRAIN_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define TRAIN_FMA_CLONES
#endif
TRAIN_FMA_CLONES inline void exact_gemm_host(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b,
                                             int ldb, float beta, float* c, int ldc) {
  thread_local std::vector<float> acc_buffer, bt_buffer;
  acc_buffer.resize(static_cast<std::size_t>(n));
  float* acc = acc_buffer.data();
  // op(B) as a contiguous [k x n] block, so the inner loop is unit-stride.
  const float* bp = b;
  int ldbp = ldb;
  if (tb) {
    bt_buffer.resize(static_cast<std::size_t>(k) * static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j)
      for (int p = 0; p < k; ++p) bt_buffer[static_cast<std::size_t>(p) * n + j] = b[static_cast<std::size_t>(j) * ldb + p];
    bp = bt_buffer.data();
    ldbp = n;
  }
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) acc[j] = 0.0f;
    for (int p = 0; p < k; ++p) {
      const float x = ta ? a[static_cast<std::size_t>(p) * lda + i] : a[static_cast<std::size_t>(i) * lda + p];
      const float* row = bp + static_cast<std::size_t>(p) * ldbp;
      for (int j = 0; j < n; ++j) acc[j] = fmaf(x, row[j], acc[j]);
    }
    float* out = c + static_cast<std::size_t>(i) * ldc;
    if (beta == 0.0f) {
      for (int j = 0; j < n; ++j) out[j] = acc[j];
    } else {
      for (int j = 0; j < n; ++j) out[j] = acc[j] + beta * out[j];
    }
  }
}
#endif
}  // namespace detail

/// The summation order of PyTorch's CPU sgemm for the tutorial's shapes. `Policy` is a thrust
/// execution policy (thrust::host, thrust::device).
template <class Policy>
struct exact_gemm {
  Policy policy{};
  static constexpr const char* name = "exact";
  void operator()(trans ta, trans tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                  float beta, float* c, int ldc) const {
#if !defined(__CUDACC__)
    // Host memory in a host-only build: the vectorized loop, same bits as the kernel.
    detail::exact_gemm_host(ta == trans::yes, tb == trans::yes, m, n, k, a, lda, b, ldb, beta, c, ldc);
#else
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(long(m) * n),
                     detail::exact_gemm_kernel{ta == trans::yes, tb == trans::yes, n, k, lda, ldb, ldc, beta, a, b, c});
#endif
  }
};

#if defined(TRAIN_HAVE_EIGEN)
/// Eigen's GEMM over the raw (host) buffers, no copies.
struct eigen_gemm {
  static constexpr const char* name = "eigen";
  void operator()(trans ta, trans tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                  float beta, float* c, int ldc) const {
    using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using stride = Eigen::OuterStride<>;
    using cmap = Eigen::Map<const mat, 0, stride>;
    Eigen::Map<mat, 0, stride> C(c, m, n, stride(ldc));
    // A stored as [m x k] (no) or [k x m] (yes); likewise B.
    const cmap A(a, ta == trans::yes ? k : m, ta == trans::yes ? m : k, stride(lda));
    const cmap B(b, tb == trans::yes ? n : k, tb == trans::yes ? k : n, stride(ldb));
    if (beta == 0.0f) C.setZero();
    if (ta == trans::no && tb == trans::no) C.noalias() += A * B;
    else if (ta == trans::no) C.noalias() += A * B.transpose();
    else if (tb == trans::no) C.noalias() += A.transpose() * B;
    else C.noalias() += A.transpose() * B.transpose();
  }
};
#endif

}  // namespace train
