#pragma once
// bucket_view: one bucket as a comm hook (set_comm_hook) sees it. Apart from the wrapper so that
// a hook is written against this type alone.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

/// One bucket as a communication hook sees it.
struct bucket_view {
  std::size_t index = 0;                     // 0 = the first bucket to be reduced
  dtype type = dtype::float32;
  std::span<std::byte> data;                 // the gradients, by ascending parameter index
  std::span<const std::size_t> parameters;   // the parameters in it (assignment order: descending)
  int world_size = 1;

  std::size_t numel() const noexcept { return data.size() / size_of(type); }
  template <dtype_like T>
  std::span<T> as() const {
    if (dtype_of<T> != type) {
      throw error(errc::invalid_argument, "bucket " + std::to_string(index) + " holds " + std::string(to_string(type)) +
                                              ", not " + std::string(to_string(dtype_of<T>)));
    }
    return {reinterpret_cast<T*>(data.data()), data.size() / sizeof(T)};
  }
  /// Memory that lives as long as the wrapper, one region per bucket (8-byte aligned), so a hook
  /// does not allocate every step. Valid until this bucket's next reduction.
  std::span<std::byte> scratch(std::size_t bytes) const {
    if (scratch_ == nullptr) throw error(errc::internal, "bucket_view without scratch storage");
    if (scratch_->size() * sizeof(std::uint64_t) < bytes) scratch_->resize((bytes + 7) / 8);
    return {reinterpret_cast<std::byte*>(scratch_->data()), bytes};
  }

  std::vector<std::uint64_t>* scratch_ = nullptr;  // owned by the wrapper
};

}  // namespace ddp
