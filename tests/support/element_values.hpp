#pragma once
// Test values of every collective element type, made from and read back as double: half
// precision goes through float (its only conversion), the others convert directly.
#include "ddp/core/dtype.hpp"

namespace ddp::test {

template <class T>
T to(double v) {
  if constexpr (ddp::half_precision<T>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

template <class T>
double from(T v) {
  if constexpr (ddp::half_precision<T>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

}  // namespace ddp::test
