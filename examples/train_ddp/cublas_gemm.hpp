#pragma once
// cuBLAS GEMM policy for the CUDA build (row-major over column-major cuBLAS: C^T = op(B)^T op(A)^T).
#if !defined(__CUDACC__)
#error "cublas_gemm.hpp is for the CUDA build of train_ddp"
#endif

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "gemm.hpp"

namespace train {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct cublas_gemm {
  static constexpr const char* name = "cublas";
  std::shared_ptr<cublasContext> handle;

  cublas_gemm() {
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed (no usable GPU?)");
    // Deterministic results: no atomics-based split-K, plain FP32 math.
    cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH);
    handle.reset(h, [](cublasHandle_t p) { cublasDestroy(p); });
  }

  void operator()(trans ta, trans tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                  float beta, float* c, int ldc) const {
    const float alpha = 1.0f;
    const auto op = [](trans t) { return t == trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N; };
    const cublasStatus_t s =
        cublasSgemm(handle.get(), op(tb), op(ta), n, m, k, &alpha, b, ldb, a, lda, &beta, c, ldc);
    if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasSgemm failed with status " + std::to_string(int(s)));
  }
};

}  // namespace train
