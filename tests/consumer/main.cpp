// A consumer of the installed / fetched package: a small training program on the public API
// (a world of one: no launcher variables), checked against values computed here by hand. The
// FetchContent build compiles it with -Wall -Wextra -Wpedantic -Wshadow -Werror, ddp's headers
// not marked SYSTEM, so a warning from them fails the build.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <span>
#include <vector>

namespace app {

struct linear_model {
  std::vector<float> weight = std::vector<float>(8, 0.5f), weight_grad = std::vector<float>(8, 0.0f);
  std::vector<float> bias = std::vector<float>(2, 0.0f), bias_grad = std::vector<float>(2, 0.0f);
};

// Found by ADL: ddp lists the model's parameters through this.
std::vector<ddp::parameter_ref> parameters(linear_model& m) {
  return {ddp::make_parameter(m.weight, m.weight_grad, "weight"), ddp::make_parameter(m.bias, m.bias_grad, "bias")};
}

}  // namespace app

int main() {
  ddp::store::hash_store store;
  store.set_string("answer", "42");
  if (store.get_string("answer") != "42") return 1;
  if (ddp::float16(1.5f).bits != 0x3e00) return 2;

  auto group = ddp::init_process_group("ring");
  if (group.rank() != 0 || group.size() != 1) return 3;
  std::vector<float> values{1.0f, 2.0f, 3.0f};
  group.all_reduce(std::span(values), ddp::avg{});
  if (values[2] != 3.0f) return 4;

  app::linear_model model;
  ddp::distributed_data_parallel net{model, group};
  ddp::distributed_sampler sampler{10, group.size(), group.rank(), {.shuffle = true, .seed = 0}};
  std::size_t seen = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto batch : sampler.batches(4)) {
      seen += batch.size();
      for (auto& g : model.weight_grad) g = 1.0f;
      for (auto& g : model.bias_grad) g = 2.0f;
      net.synchronize();
      for (std::size_t i = 0; i < model.weight.size(); ++i) model.weight[i] -= 0.25f * model.weight_grad[i];
    }
  }
  // 2 epochs x 3 batches (4, 4, 2 samples) of one step each: 0.5 - 6 x 0.25.
  if (seen != 20 || model.weight[0] != -1.0f) return 5;
  std::printf("ddp %d consumer ok\n", DDP_VERSION);
  return 0;
}
