// A std::string is a contiguous range of char, which no collective takes.
// expect-error: the elements of a collective's buffer must be one of float, double, ddp::float16
#include <ddp/group.hpp>
#include <string>

void f(ddp::group& g) {
  std::string s = "hello";
  g.broadcast(s, 0);
}
