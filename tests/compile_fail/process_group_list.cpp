// The same check on a process_group<B> (the range forms are shared with ddp::group).
// expect-error: this range is not contiguous
#include <ddp/group.hpp>
#include <deque>

#include "minimal_backend.hpp"

void f(ddp::process_group<minimal_backend>& g) {
  std::deque<double> d(4, 1.0);
  g.reduce(d, 0, ddp::max{});
}
