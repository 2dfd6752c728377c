// all_reduce writes its buffer: a const variable cannot receive the result.
// expect-error: one element must be a non-const variable
#include <ddp/group.hpp>

void f(ddp::group& g) {
  const float loss = 1.0f;
  g.all_reduce(loss, ddp::avg{});
}
