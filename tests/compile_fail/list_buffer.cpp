// A std::list is not contiguous. This case includes <ddp/ddp.hpp>, as a program does: its line
// count is the one a user sees.
// expect-error: a collective's buffer must be a contiguous range (std::vector, std::array, std::span
// expect-error: this range is not contiguous
#include <ddp/ddp.hpp>
#include <list>

void f(ddp::group& g) {
  std::list<float> l(4, 1.0f);
  g.all_reduce(l, ddp::sum{});
}
