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
//  - fast_gemm (CPU build): makes mlp<> run its fused host step (fast_step.hpp) for training;
//    its own GEMM calls (evaluation) go to the register-tiled host kernel when a dimension is
//    small (<= 16: no packing worth Eigen's), else to Eigen. Different bits from exact.
//  - cublas_gemm (CUDA build, in cublas_gemm.hpp): cuBLAS sgemm.

#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "torch_math.hpp"

#if !defined(__CUDACC__) && defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

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
// The host version of the same arithmetic: every output is still one fma chain over p = 0..k-1
// in order, starting from 0, then + beta*C, so the bits are those of the kernel; only the order
// in which outputs are computed changes.
//
// C is computed as rows x cols where the cols operand is packed into a zero-padded [k x cols8]
// block (unit stride, whole vectors) and the rows operand is read one scalar at a time. Either
// op(A) gives the rows and op(B) the cols, or, when the other way round wastes fewer vector lanes
// (n = 2 or 10 in the tutorial), op(B)^T gives the rows and op(A)^T the cols: fma(x, y, acc) is
// exact in its product, so fma(b, a, acc) == fma(a, b, acc) and the bits do not change.
struct gemm_operand {  // element (r, p) at data[r * rs + p * ps]
  const float* data;
  std::size_t rs, ps;
  float operator()(std::size_t r, std::size_t p) const { return data[r * rs + p * ps]; }
};

struct gemm_result {  // C(r, col) at c[r * rs + col * cs]; C = acc + beta * C, or acc when beta is 0
  float* c;
  std::size_t rs, cs;
  float beta;
  // The rn x jn corner of a tile that was computed into acc[4][16].
  void store(std::size_t r0, std::size_t c0, std::size_t rn, std::size_t jn, const float (*acc)[16]) const {
    for (std::size_t r = 0; r < rn; ++r) {
      float* o = c + (r0 + r) * rs + c0 * cs;
      for (std::size_t j = 0; j < jn; ++j) o[j * cs] = beta == 0.0f ? acc[r][j] : acc[r][j] + beta * o[j * cs];
    }
  }
};

// One tile: rows r0..r0+3 of `a` (indices past `rows` clamped: computed, never stored) times the
// packed columns [c0, c0 + 8 * V) of q (row stride qs), k terms each, stored to the first
// min(4, rows - r0) x min(8 * V, cols - c0) outputs.
#if defined(__AVX__) && defined(__FMA__)
template <int V>
inline void exact_tile(gemm_operand a, std::size_t rows, std::size_t r0, const float* q, std::size_t qs, std::size_t c0,
                       std::size_t cols, std::size_t k, const gemm_result& out) {
  __m256 acc[4][V];
  for (auto& row : acc)
    for (auto& v : row) v = _mm256_setzero_ps();
  const float* ar[4];
  for (std::size_t r = 0; r < 4; ++r) ar[r] = a.data + std::min(r0 + r, rows - 1) * a.rs;
  for (std::size_t p = 0; p < k; ++p) {
    __m256 y[V];
    for (int v = 0; v < V; ++v) y[v] = _mm256_loadu_ps(q + p * qs + c0 + 8 * std::size_t(v));
    for (int r = 0; r < 4; ++r) {
      const __m256 x = _mm256_set1_ps(ar[r][p * a.ps]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(x, y[v], acc[r][v]);
    }
  }
  const std::size_t rn = std::min<std::size_t>(4, rows - r0), jn = std::min<std::size_t>(8 * V, cols - c0);
  if (out.cs == 1 && jn == 8 * V) {  // whole rows of vectors straight from the registers
    const __m256 beta = _mm256_set1_ps(out.beta);
    for (std::size_t r = 0; r < rn; ++r) {
      float* o = out.c + (r0 + r) * out.rs + c0;
      for (int v = 0; v < V; ++v) {
        const __m256 res = out.beta == 0.0f ? acc[r][v] : _mm256_add_ps(acc[r][v], _mm256_mul_ps(beta, _mm256_loadu_ps(o + 8 * v)));
        _mm256_storeu_ps(o + 8 * v, res);
      }
    }
    return;
  }
  float tile[4][16];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(tile[r] + 8 * v, acc[r][v]);
  out.store(r0, c0, rn, jn, tile);
}
#else
// Without -mfma: the FMA clone makes fmaf one instruction (the default clone calls libm's, which
// is exact too). Not under the sanitizers: the clones' ifunc resolver runs while the dynamic
// loader relocates, before a sanitizer's runtime is up, and crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
#define TRAIN_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define TRAIN_FMA_CLONES
#endif
TRAIN_FMA_CLONES inline void exact_tile_any(int width, gemm_operand a, std::size_t rows, std::size_t r0, const float* q,
                                            std::size_t qs, std::size_t c0, std::size_t k, float (*acc)[16]) {
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < width; ++j) acc[r][j] = 0.0f;
  for (std::size_t p = 0; p < k; ++p) {
    const float* y = q + p * qs + c0;
    for (std::size_t r = 0; r < 4; ++r) {
      const float x = a(std::min(r0 + r, rows - 1), p);
      for (int j = 0; j < width; ++j) acc[r][j] = fmaf(x, y[j], acc[r][j]);
    }
  }
}
template <int V>
inline void exact_tile(gemm_operand a, std::size_t rows, std::size_t r0, const float* q, std::size_t qs, std::size_t c0,
                       std::size_t cols, std::size_t k, const gemm_result& out) {
  float tile[4][16];
  exact_tile_any(8 * V, a, rows, r0, q, qs, c0, k, tile);
  out.store(r0, c0, std::min<std::size_t>(4, rows - r0), std::min<std::size_t>(8 * V, cols - c0), tile);
}
#endif

inline void exact_gemm_host(bool ta, bool tb, int m_, int n_, int k_, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc) {
  const std::size_t m = std::size_t(m_), n = std::size_t(n_), k = std::size_t(k_);
  if (m == 0 || n == 0) return;
  const auto round8 = [](std::size_t x) { return (x + 7) / 8 * 8; };
  const auto round4 = [](std::size_t x) { return (x + 3) / 4 * 4; };
  const gemm_operand opa{a, ta ? 1 : std::size_t(lda), ta ? std::size_t(lda) : 1};  // op(A)(i, p)
  const gemm_operand opb_t{b, tb ? std::size_t(ldb) : 1, tb ? 1 : std::size_t(ldb)};  // op(B)(p, j) as (j, p)
  // Cost of an orientation: vector fmas, plus one per element when the cols operand needs packing.
  const auto cost = [&](std::size_t rows, std::size_t cols, const gemm_operand& cols_of) {
    return round4(rows) * round8(cols) / 8 * k + (cols_of.rs == 1 && cols % 8 == 0 ? 0 : k * cols);
  };
  const bool swap = cost(n, m, opa) < cost(m, n, opb_t);
  const gemm_operand rows_of = swap ? opb_t : opa, cols_of = swap ? opa : opb_t;  // cols_of(col, p)
  const std::size_t rows = swap ? n : m, cols = swap ? m : n;
  const gemm_result out{c, swap ? 1 : std::size_t(ldc), swap ? std::size_t(ldc) : 1, beta};

  // The cols operand as [k x cols8], zero-padded, unless it is already laid out that way.
  const std::size_t cols8 = round8(cols);
  const float* q = cols_of.data;
  std::size_t qs = cols_of.ps;
  if (!(cols_of.rs == 1 && cols % 8 == 0)) {
    thread_local std::vector<float> packed;
    packed.assign(k * cols8, 0.0f);
    for (std::size_t p = 0; p < k; ++p)
      for (std::size_t j = 0; j < cols; ++j) packed[p * cols8 + j] = cols_of(j, p);
    q = packed.data();
    qs = cols8;
  }

  for (std::size_t r0 = 0; r0 < rows; r0 += 4) {
    std::size_t c0 = 0;
    for (; c0 + 16 <= cols8; c0 += 16) exact_tile<2>(rows_of, rows, r0, q, qs, c0, cols, k, out);
    if (c0 < cols8) exact_tile<1>(rows_of, rows, r0, q, qs, c0, cols, k, out);
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

#if !defined(__CUDACC__)
/// The fast CPU policy (--gemm fast): mlp<> sees fused_host_step and trains with the fused step of
/// fast_step.hpp; the remaining GEMMs (evaluation's forward) dispatch on their smallest dimension.
struct fast_gemm {
  static constexpr const char* name = "fast";
  static constexpr bool fused_host_step = true;
  void operator()(trans ta, trans tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                  float beta, float* c, int ldc) const {
#if defined(TRAIN_HAVE_EIGEN)
    if (std::min({m, n, k}) > 16) return eigen_gemm{}(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
#endif
    detail::exact_gemm_host(ta == trans::yes, tb == trans::yes, m, n, k, a, lda, b, ldb, beta, c, ldc);
  }
};
#endif

}  // namespace train
