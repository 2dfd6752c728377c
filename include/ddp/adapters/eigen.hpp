#pragma once
// Eigen adapter: Eigen::Matrix / Eigen::Array objects (and unit-stride Eigen::Map of them) are
// ddp tensors, so (value, grad) pairs of them are parameters:
//
//   std::vector<std::pair<Eigen::MatrixXf, Eigen::MatrixXf>> layers = ...;
//   ddp::distributed_data_parallel net{layers, group};
//
// Shape: {rows, cols} for matrices, {size} for compile-time vectors. The memory order is Eigen's
// (column-major by default); the shape only names the parameter in messages and cross-rank
// checks, so ranks must agree on the storage order too (they do when they run the same code).
// Strided maps are not contiguous and are rejected at compile time.

#if __has_include(<Eigen/Core>)
#include <Eigen/Core>
#elif __has_include(<eigen3/Eigen/Core>)
#include <eigen3/Eigen/Core>
#else
#error "ddp/adapters/eigen.hpp needs Eigen 3.4: apt-get install libeigen3-dev, and link Eigen3::Eigen"
#endif

#include <cstdint>
#include <span>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/parameters.hpp"

namespace ddp {

namespace detail {
template <class M>
struct eigen_tensor_traits {
  using element_type = typename M::Scalar;
  static constexpr memory_space memory = memory_space::host;
  template <class X>
  static std::span<element_type> span(X& m) {
    return {m.data(), static_cast<std::size_t>(m.size())};
  }
  template <class X>
  static std::vector<std::int64_t> shape(X& m) {
    if constexpr (M::IsVectorAtCompileTime) {
      return {static_cast<std::int64_t>(m.size())};
    } else {
      return {static_cast<std::int64_t>(m.rows()), static_cast<std::int64_t>(m.cols())};
    }
  }
};
}  // namespace detail

template <class S, int R, int C, int O, int MR, int MC>
  requires dtype_like<S>
struct tensor_traits<Eigen::Matrix<S, R, C, O, MR, MC>> : detail::eigen_tensor_traits<Eigen::Matrix<S, R, C, O, MR, MC>> {};

template <class S, int R, int C, int O, int MR, int MC>
  requires dtype_like<S>
struct tensor_traits<Eigen::Array<S, R, C, O, MR, MC>> : detail::eigen_tensor_traits<Eigen::Array<S, R, C, O, MR, MC>> {};

/// Maps with the default (unit inner, packed outer) stride are contiguous.
template <class Plain, int Options>
  requires dtype_like<typename Plain::Scalar>
struct tensor_traits<Eigen::Map<Plain, Options, Eigen::Stride<0, 0>>>
    : detail::eigen_tensor_traits<Eigen::Map<Plain, Options, Eigen::Stride<0, 0>>> {};

}  // namespace ddp
