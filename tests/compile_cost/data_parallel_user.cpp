// A training file that wraps its model in distributed_data_parallel over a ddp::group it is
// handed, and never calls init_process_group: it must not compile the ring backend.
// expect: no ring backend
#include <ddp/ddp.hpp>

#include <vector>

struct linear_model {
  std::vector<float> w = std::vector<float>(4), dw = std::vector<float>(4);
};
std::vector<ddp::parameter_ref> parameters(linear_model& m) { return {ddp::make_parameter(m.w, m.dw, "w")}; }

void train_step(ddp::group& group, linear_model& m) {
  ddp::distributed_data_parallel net{m, group};
  net.mark_ready(0);
  net.finish();
}
