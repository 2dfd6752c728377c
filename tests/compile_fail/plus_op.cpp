// std::plus<> is not a ddp reduction (it has no kind a backend can map).
// expect-error: a collective's reduction must be ddp::sum, ddp::avg, ddp::min, ddp::max, ddp::prod or a type modelling ddp::reduce_op
#include <ddp/group.hpp>
#include <functional>
#include <vector>

void f(ddp::group& g) {
  std::vector<float> v(4);
  g.all_reduce(v, std::plus<>{});
}
