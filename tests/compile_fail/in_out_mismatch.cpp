// in and out of different element types.
// expect-error: the in and out of a collective must have the same element type
#include <ddp/group.hpp>
#include <vector>

void f(ddp::group& g) {
  std::vector<float> in(4);
  std::vector<double> out(4 * static_cast<std::size_t>(g.size()));
  g.all_gather(in, out);
}
