// A backend that declares the extended signatures but whose all_reduce takes no deadline is told
// the form it needs (before, it silently lost its deadlines and the watchdog's grace).
// expect-error: capabilities.deadlines: the backend needs all_reduce(std::span<T>, Op, const ddp::collective_desc&, ddp::deadline)
#include <ddp/process_group.hpp>

#include "minimal_backend.hpp"

struct no_deadline_backend : minimal_backend {
  static constexpr ddp::backend_capabilities capabilities{.deadlines = true};
  template <ddp::dtype_like T>
  void broadcast(std::span<T>, int, const ddp::collective_desc&, ddp::deadline) {}
  using minimal_backend::broadcast;
};

void f(ddp::process_group<no_deadline_backend>& g) { g.barrier(); }
