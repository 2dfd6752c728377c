#pragma once
// Thrust adapter: thrust::host_vector and thrust::device_vector are ddp tensors.
//
// host_vector is host memory. device_vector is marked memory_space::device when Thrust's device
// system is CUDA (so a host backend such as ring refuses it with an error naming the parameter,
// and the nccl backend takes it); with the CPP, OMP or TBB device systems (a CPU-only build,
// e.g. Debian's libthrust-dev) its memory is ordinary host memory and it is marked host.

#if !__has_include(<thrust/host_vector.h>)
#error "ddp/adapters/thrust.hpp needs Thrust: the CUDA toolkit's CCCL, or apt-get install libthrust-dev"
#endif

#include <thrust/device_vector.h>
#include <thrust/host_vector.h>

#include <cstdint>
#include <span>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

namespace detail {
template <class V, memory_space M>
struct thrust_tensor_traits {
  using element_type = typename V::value_type;
  static constexpr memory_space memory = M;
  static std::span<element_type> span(V& v) { return {thrust::raw_pointer_cast(v.data()), v.size()}; }
  static std::vector<std::int64_t> shape(V& v) { return {static_cast<std::int64_t>(v.size())}; }
};
inline constexpr memory_space thrust_device_memory =
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
    memory_space::device;
#else
    memory_space::host;
#endif
}  // namespace detail

template <class T, class A>
  requires dtype_like<T>
struct tensor_traits<thrust::host_vector<T, A>> : detail::thrust_tensor_traits<thrust::host_vector<T, A>, memory_space::host> {};

template <class T, class A>
  requires dtype_like<T>
struct tensor_traits<thrust::device_vector<T, A>>
    : detail::thrust_tensor_traits<thrust::device_vector<T, A>, detail::thrust_device_memory> {};

}  // namespace ddp
