// A backend that declares takes_call_records must have the run() that takes them.
// expect-error: the backend declares takes_call_records but has no run(const ddp::collective_call&, const ddp::collective_desc&, ddp::deadline)
#include <ddp/process_group.hpp>

#include "minimal_backend.hpp"

struct record_backend : minimal_backend {
  static constexpr bool takes_call_records = true;
  void run(const ddp::collective_call&) {}
};

void f(ddp::process_group<record_backend>& g) { g.barrier(); }
