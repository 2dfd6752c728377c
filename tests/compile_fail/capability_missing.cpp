// A backend that declares a capability it does not have (here all_gather, misspelt as
// all_gather_into) is told which member with which signature, instead of falling back silently.
// expect-error: capabilities.all_gather: the backend needs all_gather(std::span<const T>, std::span<T>)
#include <ddp/process_group.hpp>

#include "minimal_backend.hpp"

struct near_miss_backend : minimal_backend {
  static constexpr ddp::backend_capabilities capabilities{.all_gather = true};
  template <ddp::dtype_like T>
  void all_gather_into(std::span<const T>, std::span<T>) {}
};

void f(ddp::process_group<near_miss_backend>& g) { g.barrier(); }
