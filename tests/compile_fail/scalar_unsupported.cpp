// One variable of a type no collective takes (char is not uint8_t).
// expect-error: or one variable of one of those types; this argument is neither
#include <ddp/group.hpp>

void f(ddp::group& g) {
  char c = 'x';
  g.all_reduce(c);
}
