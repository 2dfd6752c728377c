// The (in, out) collectives take ranges only.
// expect-error: the in and out of a collective must be contiguous ranges
#include <ddp/group.hpp>
#include <vector>

void f(ddp::group& g) {
  float mine = 1.0f;
  std::vector<float> all(static_cast<std::size_t>(g.size()));
  g.all_gather(mine, all);
}
