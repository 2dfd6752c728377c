#pragma once
// The device element operations of ddp/data_parallel/sharded_data_parallel.hpp: with this header
// included in one .cu file of a program, sharded_data_parallel takes parameters in device memory
// (over the NCCL backend) and zeroes the padding, accumulates stage 2's reduce-scattered shards
// and divides the shard gradients by W and by the micro-steps on the device.
//
// Why a header of its own: sharded_data_parallel.hpp must build without the CUDA toolkit, and its
// code must read the same in every translation unit of a program. So it holds only a pointer to
// these operations (detail::sharded_device), and this header sets it when the program starts, as
// ddp/checkpoint/cuda.hpp does for checkpoints.
//
// Same bits as the host path: each element is one addition or one division, through CUDA's
// explicitly rounded intrinsics (__fadd_rn, __fdiv_rn, and the double ones), which round to
// nearest as the host's operators do and are never fused or approximated.
//
// Ordering: everything runs on the legacy default stream of the current device (the group's, set
// by its allocate and copy_memory), after the copies queued there, and the NCCL backend orders its
// collectives after that stream (nccl_options::compute_stream, by default; a blocking stream given
// there waits for it too, a non-blocking one does not). Nothing here waits for the device.

#if !defined(__CUDACC__)
#error "<ddp/data_parallel/sharded_cuda.hpp> defines CUDA kernels: include it in a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>

#include "ddp/backends/cuda_memory.hpp"
#include "ddp/core/error.hpp"
#include "ddp/data_parallel/sharded_data_parallel.hpp"

namespace ddp::detail {

namespace sharded_cuda {

constexpr unsigned threads_per_block = 256;
constexpr std::size_t max_blocks = 4096;  // the kernels stride over the rest

inline unsigned blocks_for(std::size_t n) {
  return static_cast<unsigned>(std::min(max_blocks, (n + threads_per_block - 1) / threads_per_block));
}

__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }

template <class T>
__global__ void add_kernel(T* acc, const T* in, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(blockDim.x) * gridDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) acc[i] = add_rn(acc[i], in[i]);
}

template <class T>
__global__ void divide_kernel(T* data, std::size_t n, T divisor) {
  const std::size_t stride = static_cast<std::size_t>(blockDim.x) * gridDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) data[i] = div_rn(data[i], divisor);
}

inline void launched(const char* kernel) { cuda_check(cudaGetLastError(), kernel, {.op = "sharded_data_parallel"}); }

inline void zero(void* data, std::size_t bytes) {
  if (bytes == 0) return;
  cuda_check(cudaMemsetAsync(data, 0, bytes, cudaStreamLegacy), "cudaMemsetAsync", {.op = "sharded_data_parallel"});
}

inline void unsupported(dtype type) {
  throw error(errc::unavailable, "sharded_data_parallel on device memory: no kernels for " + std::string(to_string(type)) + " (float and double)",
              {.op = "sharded_data_parallel"});
}

inline void add(dtype type, void* acc, const void* in, std::size_t n) {
  if (n == 0) return;
  if (type == dtype::float32) {
    add_kernel<<<blocks_for(n), threads_per_block, 0, cudaStreamLegacy>>>(static_cast<float*>(acc), static_cast<const float*>(in), n);
  } else if (type == dtype::float64) {
    add_kernel<<<blocks_for(n), threads_per_block, 0, cudaStreamLegacy>>>(static_cast<double*>(acc), static_cast<const double*>(in), n);
  } else {
    unsupported(type);
  }
  launched("add_kernel");
}

// The divisor converted to T on the host, as the host path's static_cast<T>(divisor).
inline void divide(dtype type, void* data, std::size_t n, std::size_t divisor) {
  if (n == 0) return;
  if (type == dtype::float32) {
    divide_kernel<<<blocks_for(n), threads_per_block, 0, cudaStreamLegacy>>>(static_cast<float*>(data), n, static_cast<float>(divisor));
  } else if (type == dtype::float64) {
    divide_kernel<<<blocks_for(n), threads_per_block, 0, cudaStreamLegacy>>>(static_cast<double*>(data), n, static_cast<double>(divisor));
  } else {
    unsupported(type);
  }
  launched("divide_kernel");
}

}  // namespace sharded_cuda

inline constexpr sharded_device_ops cuda_sharded_device_ops{
    .zero = &sharded_cuda::zero, .add = &sharded_cuda::add, .divide = &sharded_cuda::divide};

// Set before main: a program that includes this header anywhere shards device parameters.
inline const bool cuda_sharded_device_installed = (sharded_device = &cuda_sharded_device_ops, true);

}  // namespace ddp::detail
