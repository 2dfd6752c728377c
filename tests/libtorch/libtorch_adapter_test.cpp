// <ddp/adapters/libtorch.hpp> at W ranks: run under a launcher (ddprun --nproc-per-node=2 ...),
// or alone as a world of one. Exits 0 when every check passed, 1 otherwise (each failure named).
//
// Checks: tensors as collective buffers (tensor_span, visit_tensor, every dtype); DDP over a
// torch::nn::Module with float32 and float64 parameters: gradients are the exact mean of every
// rank's (recomputed locally from every rank's inputs), the first bucket's all-reduce starts
// during backward (the post-accumulate-grad hooks), .grad stays in the registered memory even
// after an optimizer's zero_grad() (set_to_none), no_sync() accumulation, and an unused parameter
// is an error naming it.

#include <ddp/adapters/libtorch.hpp>
#include <ddp/ddp.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace {

int failures = 0;
int rank_ = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: FAIL: %s\n", rank_, what.c_str());
    ++failures;
  }
}

// A float32 Linear and a float64 scale: two dtypes, so two flat gradient buffers.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 3));
    scale = register_parameter("scale", torch::ones({3}, torch::kFloat64));
    unused = register_parameter("unused", torch::zeros({2}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x).to(torch::kFloat64) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale, unused;
};
TORCH_MODULE(TinyNet);

torch::Tensor input_of(int r, int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(std::uint64_t(100 * step + r));
  return torch::randn({4, 6}, g);
}

// The gradients of one step computed here for every rank's input, then averaged in rank order.
std::vector<torch::Tensor> expected_mean(TinyNet& model, int world, int step) {
  TinyNet copy;
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < model->parameters().size(); ++i) copy->parameters()[i].copy_(model->parameters()[i]);
  }
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    copy->zero_grad();
    copy->forward(input_of(r, step)).sum().backward();
    const auto params = copy->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto g = params[i].grad().defined() ? params[i].grad() : torch::zeros_like(params[i]);
      if (r == 0) sum.push_back(g.clone());
      else sum[i] += g;
    }
  }
  for (auto& s : sum) s /= world;
  return sum;
}

void test_collectives(ddp::group& group) {
  const int w = group.size();
  for (auto type : {torch::kFloat32, torch::kFloat64, torch::kFloat16, torch::kBFloat16, torch::kInt32, torch::kInt64, torch::kUInt8}) {
    auto t = torch::full({5}, group.rank() + 1, torch::TensorOptions().dtype(type));
    ddp::visit_tensor(t, [&](auto s) { group.all_reduce(s, ddp::sum{}); });
    check(t.to(torch::kFloat64).eq(double(w * (w + 1) / 2)).all().item<bool>(),
          std::string("visit_tensor all_reduce ") + c10::toString(type));
  }
  auto f = torch::arange(8, torch::kFloat32) * (group.rank() + 1);
  group.broadcast(ddp::tensor_span<float>(f), 0);
  check(f.equal(torch::arange(8, torch::kFloat32)), "tensor_span broadcast");
  bool threw = false;
  try {
    (void)ddp::tensor_span<double>(f);
  } catch (const ddp::error&) {
    threw = true;
  }
  check(threw, "tensor_span of the wrong dtype is an error");
  threw = false;
  try {
    (void)ddp::tensor_span<float>(torch::zeros({4, 4}).t());
  } catch (const ddp::error&) {
    threw = true;
  }
  check(threw, "tensor_span of a non-contiguous tensor is an error");
}

void test_ddp(ddp::group& group) {
  const int w = group.size();
  torch::manual_seed(group.rank());  // different initial weights: DDP must broadcast rank 0's
  TinyNet model;
  ddp::torch_data_parallel_options o;
  // Parameters: scale, unused, fc.weight, fc.bias (a module's own before its children's). With a
  // first bucket of 8 bytes, fc.bias is a bucket of its own, the first to be reduced: it starts
  // during backward (the bucket holding 'unused' waits for finish()).
  o.ddp.first_bucket_bytes = 8;
  o.ddp.find_unused_parameters = true;
  ddp::torch_data_parallel ddpnet{*model, group, o};
  check(ddpnet.size() == 4, "four parameters listed");
  {
    auto w0 = model->fc->weight.clone();
    group.broadcast(ddp::tensor_span<float>(w0), 0);
    check(w0.equal(model->fc->weight), "initial weights broadcast from rank 0");
  }
  torch::optim::SGD opt(model->parameters(), 0.1);
  std::vector<const void*> registered;
  for (std::size_t i = 0; i < ddpnet.size(); ++i) registered.push_back(ddpnet.gradient(i).data_ptr());

  for (int step = 0; step < 4; ++step) {
    const auto expected = expected_mean(model, w, step);
    if (step == 2) opt.zero_grad();  // set_to_none: the hooks bring .grad back to ddp's memory
    else ddpnet.zero_grad();
    model->forward(input_of(group.rank(), step)).sum().backward();
    if (w > 1) check(ddpnet.ddp().stats().all_reduces > 0, "a bucket all-reduce started during backward (step " + std::to_string(step) + ")");
    ddpnet.finish();
    for (std::size_t i = 0; i < ddpnet.size(); ++i) {
      const auto g = model->parameters()[i].grad();
      check(g.defined() && g.data_ptr() == registered[i], "step " + std::to_string(step) + ": .grad of " + ddpnet.name(i) + " is ddp's memory");
      check(g.defined() && g.equal(expected[i]), "step " + std::to_string(step) + ": .grad of " + ddpnet.name(i) + " is the mean over ranks");
    }
    opt.step();
  }

  // no_sync: two local backward passes accumulate, the synchronized step averages the sums.
  {
    const auto e1 = expected_mean(model, w, 10);
    const auto e2 = expected_mean(model, w, 11);
    ddpnet.zero_grad();
    {
      auto guard = ddpnet.no_sync();
      model->forward(input_of(group.rank(), 10)).sum().backward();
      ddpnet.finish();
    }
    model->forward(input_of(group.rank(), 11)).sum().backward();
    ddpnet.finish();
    for (std::size_t i = 0; i < ddpnet.size(); ++i)
      check(model->parameters()[i].grad().allclose(e1[i] + e2[i], 1e-5, 1e-6), "no_sync accumulation of " + ddpnet.name(i));
  }
}

void test_unused_is_an_error(ddp::group& group) {
  TinyNet model;
  ddp::torch_data_parallel ddpnet{*model, group};
  ddpnet.zero_grad();
  model->forward(input_of(group.rank(), 0)).sum().backward();
  std::string message;
  try {
    ddpnet.finish();
  } catch (const ddp::error& e) {
    message = e.what();
  }
  check(message.find("'unused'") != std::string::npos, "an unused parameter is named: " + message);
}

}  // namespace

int main() {
  try {
    auto group = ddp::init_process_group();
    rank_ = group.rank();
    torch::set_num_threads(1);
    test_collectives(group);
    test_ddp(group);
    test_unused_is_an_error(group);
    group.barrier();
    if (failures == 0) std::printf("rank %d of %d: all checks passed\n", group.rank(), group.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: exception: %s\n", rank_, e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
