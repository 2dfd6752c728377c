// A file of a larger program that runs collectives on a ddp::group it is handed, and never calls
// init_process_group: it must not compile the ring backend.
// expect: no ring backend
#include <ddp/ddp.hpp>

#include <span>
#include <vector>

void average_gradients(ddp::group& group, std::vector<float>& grad) { group.all_reduce(std::span(grad), ddp::avg{}); }
