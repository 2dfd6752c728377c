#pragma once
// The least a ddp::backend has, so that the process_group cases need not parse a real backend
// (they only compile, with -fsyntax-only).
#include <ddp/core/concepts.hpp>
#include <span>

struct minimal_backend {
  static constexpr ddp::memory_space memory = ddp::memory_space::host;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <ddp::dtype_like T, class Op>
  void all_reduce(std::span<T>, Op) {}
  template <ddp::dtype_like T>
  void broadcast(std::span<T>, int) {}
  void abort() noexcept {}
};
