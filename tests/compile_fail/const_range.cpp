// broadcast writes its buffer: a const vector cannot receive the result.
// expect-error: so it must not be a const range or a span of const elements
#include <ddp/group.hpp>
#include <vector>

void f(ddp::group& g) {
  const std::vector<std::int32_t> v(4);
  g.broadcast(v, 0);
}
