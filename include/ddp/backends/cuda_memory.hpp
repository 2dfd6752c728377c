#pragma once
// CUDA memory for the device backends: checked CUDA calls, an owning device buffer, and the test
// of whether the device can address a pointer (host memory goes through staging).
//
//   ddp::device_buffer<float> b(n);          // cudaMalloc'd on the current device, freed on destruction
//   ddp::detail::device_addressable(p)       // device or managed memory: NCCL may take it as is

#if !__has_include(<cuda_runtime.h>)
#error "<ddp/backends/cuda_memory.hpp> needs the CUDA runtime: link the CMake target ddp::nccl (or CUDA::cudart)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

namespace detail {

/// Throws errc::cuda naming the call, the error's name and its text.
inline void cuda_check(cudaError_t code, const char* call, const error_context& context = {}) {
  if (code == cudaSuccess) return;
  error_context c = context;
  c.backend_code = static_cast<int>(code);
  throw error(errc::cuda, std::string(call) + " failed: " + cudaGetErrorName(code) + ": " + cudaGetErrorString(code), std::move(c));
}

/// Whether kernels and NCCL can use p as it is: device or managed memory. Pageable host memory
/// (and pinned host memory, which NCCL does not promise to take) is not.
inline bool device_addressable(const void* p) noexcept {
  if (p == nullptr) return true;  // an empty range: nothing is read or written
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();  // older runtimes report unregistered host memory as an error
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

}  // namespace detail

/// n elements of device memory on the device current at construction (cudaMalloc), freed on
/// destruction. What nccl_backend::allocate returns; contents are uninitialized.
template <dtype_like T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    detail::cuda_check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    memory_.reset(static_cast<T*>(p));
  }

  T* data() noexcept { return memory_.get(); }
  const T* data() const noexcept { return memory_.get(); }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::span<T> span() noexcept { return {data(), size_}; }
  std::span<const T> span() const noexcept { return {data(), size_}; }
  /// Device memory is this rank's own: never shared with the other ranks' processes.
  static constexpr bool shared() noexcept { return false; }

 private:
  struct free_device_memory {
    void operator()(T* p) const noexcept { cudaFree(p); }
  };
  std::unique_ptr<T, free_device_memory> memory_;
  std::size_t size_ = 0;
};

}  // namespace ddp
