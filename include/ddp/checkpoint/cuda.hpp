#pragma once
// Device memory for ddp/checkpoint.hpp: parameters in CUDA device (or managed) memory are saved
// and loaded like host ones, in the same file format.
//
// Why a header of its own: checkpoint.hpp must build without the CUDA toolkit (std + POSIX), and
// its code must read the same in every translation unit of a program (one that includes CUDA and
// one that does not would otherwise hold two different definitions of the same inline function).
// So checkpoint.hpp only holds a pointer to the copy functions (detail::device_copier), and this
// header sets it when the program starts. checkpoint.hpp includes this header itself where the
// CUDA build is on (DDP_HAS_NCCL, defined by the ddp::nccl target, which links cudart); a CUDA
// program without NCCL includes it once, in any file, and links CUDA::cudart.
//
// How the bytes move: save() builds each file in host memory before writing it (its CRC-32 goes
// into index.json), so a device tensor is copied with cudaMemcpy straight into its place in that
// buffer, and load() copies from its place in the file's bytes, which load() reads whole anyway.
// Neither needs a staging buffer, so device memory costs no host memory beyond what a host tensor
// of that size costs.
//
// Ordering: save() waits for the tensor's device (cudaDeviceSynchronize) before copying, so
// values still being written by kernels on any stream are saved as they end; load() waits after
// copying, so the values are in place for work on any stream once load() returns. cudaMemcpy
// with cudaMemcpyDefault finds each pointer's device, whichever device is current.

#if !__has_include(<cuda_runtime.h>)
#error "<ddp/checkpoint/cuda.hpp> needs the CUDA runtime: link the CMake target ddp::nccl (or CUDA::cudart)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <string>

#include "ddp/checkpoint.hpp"

namespace ddp::checkpoint::detail {

/// Throws errc::cuda naming the tensor, the call and CUDA's error.
inline void cuda_checked(cudaError_t code, const char* call, const std::string& tensor, const char* op) {
  if (code == cudaSuccess) return;
  throw error(errc::cuda,
              "checkpoint: tensor '" + tensor + "': " + call + " failed: " + cudaGetErrorName(code) + ": " +
                  cudaGetErrorString(code),
              {.op = op, .backend_code = static_cast<int>(code)});
}

/// Makes `p`'s device current while it lives (device memory of another device than the current
/// one), and the previous one current again after.
class device_of_pointer {
 public:
  device_of_pointer(const void* p, const std::string& tensor, const char* op) {
    cuda_checked(cudaGetDevice(&previous_), "cudaGetDevice", tensor, op);
    cudaPointerAttributes a{};
    cuda_checked(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes", tensor, op);
    if (a.type == cudaMemoryTypeDevice && a.device >= 0 && a.device != previous_) {
      cuda_checked(cudaSetDevice(a.device), "cudaSetDevice", tensor, op);
      switched_ = true;
    }
  }
  ~device_of_pointer() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  device_of_pointer(const device_of_pointer&) = delete;
  device_of_pointer& operator=(const device_of_pointer&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

inline void cuda_to_host(std::span<std::byte> host, std::span<const std::byte> device, const std::string& tensor) {
  if (host.empty()) return;
  const device_of_pointer on(device.data(), tensor, "checkpoint.save");
  cuda_checked(cudaDeviceSynchronize(), "cudaDeviceSynchronize", tensor, "checkpoint.save");
  cuda_checked(cudaMemcpy(host.data(), device.data(), host.size(), cudaMemcpyDefault), "cudaMemcpy (device to host)",
               tensor, "checkpoint.save");
}

inline void cuda_to_device(std::span<std::byte> device, std::span<const std::byte> host, const std::string& tensor) {
  if (host.empty()) return;
  const device_of_pointer on(device.data(), tensor, "checkpoint.load");
  cuda_checked(cudaMemcpy(device.data(), host.data(), host.size(), cudaMemcpyDefault), "cudaMemcpy (host to device)",
               tensor, "checkpoint.load");
  cuda_checked(cudaDeviceSynchronize(), "cudaDeviceSynchronize", tensor, "checkpoint.load");
}

inline constexpr device_copy cuda_device_copy{.to_host = &cuda_to_host, .to_device = &cuda_to_device};

// Set before main: a program that includes this header anywhere saves and loads device memory.
inline const bool cuda_device_copy_installed = (device_copier = &cuda_device_copy, true);

}  // namespace ddp::checkpoint::detail
