// A lambda as the reduction, on a std::span (the span overloads reject it, the check names it).
// expect-error: a collective's reduction must be ddp::sum, ddp::avg, ddp::min, ddp::max, ddp::prod
#include <ddp/group.hpp>
#include <span>
#include <vector>

#include "minimal_backend.hpp"

void f(ddp::process_group<minimal_backend>& g, std::span<const float> in, std::span<float> out) {
  g.reduce_scatter(in, out, [](float a, float b) { return a + b; });
}
