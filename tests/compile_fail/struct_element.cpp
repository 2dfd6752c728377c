// A range of structs: its elements are no collective element type.
// expect-error: the elements of a collective's buffer must be one of float, double, ddp::float16
#include <ddp/group.hpp>
#include <vector>

struct point {
  float x, y;
};

void f(ddp::group& g) {
  std::vector<point> points(8);
  g.all_reduce(points, ddp::sum{});
}
