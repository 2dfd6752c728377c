// libtorch_ddp: PyTorch's DDP tutorial job in libtorch's C++ frontend, data-parallel with ddp.
//
//   ddprun --standalone --nproc-per-node=2 libtorch_ddp --init-seed 0
//   torchrun --no-python --standalone --nproc-per-node=2 libtorch_ddp --init-seed 0
//   srun -n 2 libtorch_ddp --init-seed 0        mpirun -n 2 libtorch_ddp --init-seed 0
//
// The model, data, sampler, optimizer and loss are the tutorial's (bench/torch/train_ddp_cpu.py):
// nn::Sequential(Linear(10, 32), ReLU(), Linear(32, 2)), 1024 samples from a generator seeded 42,
// DistributedSampler(shuffle, seed 0) with set_epoch, batch 32, SGD(lr 0.01), CrossEntropyLoss,
// 3 epochs. Rank 0 prints `Epoch N: Rank 0 local loss sum = X.XXXX` after each epoch. The kernels
// are PyTorch's own, so with --init-seed 0 the lines (and, on the same CPU, the bits) are
// PyTorch's. --report FILE (rank 0) writes JSON with the lines, step losses, final parameters'
// float bits and the training-loop time, as train_ddp's and train_ddp_cpu.py's reports do.
//
// --device cuda (the CUDA build: -DDDP_LIBTORCH_CUDA=ON with CUDA and NCCL) trains on GPU
// LOCAL_RANK with the nccl backend, which orders its collectives after PyTorch's default stream
// (the legacy stream, nccl_options::compute_stream); data and initial weights are drawn on the CPU
// as above, then moved, so every rank starts from the same bits.

#include <ddp/adapters/libtorch.hpp>
#include <ddp/ddp.hpp>
#if defined(DDP_LIBTORCH_EXAMPLE_CUDA)
#include <ddp/nccl.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

struct options {
  int epochs = 3;
  std::int64_t batch_size = 32;
  double lr = 0.01;
  std::int64_t samples = 1024, features = 10, hidden = 32, classes = 2;
  std::uint64_t data_seed = 42;
  std::int64_t sampler_seed = 0;
  std::optional<std::uint64_t> init_seed;
  std::string backend;  // ring on the CPU, nccl on CUDA
  std::string device = "cpu";
  std::string report;
};

[[noreturn]] void usage(const char* bad) {
  std::fprintf(stderr,
               "libtorch_ddp: bad argument '%s'\nusage: libtorch_ddp [--init-seed S] [--epochs 3] [--batch-size 32] "
               "[--lr 0.01] [--samples 1024] [--features 10] [--hidden 32] [--classes 2] [--data-seed 42] "
               "[--sampler-seed 0] [--backend ring|tcp|shm|nccl] [--device cpu|cuda] [--report FILE]\n",
               bad);
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(argv[i]);
    const char* v = argv[++i];
    char* end = nullptr;
    auto integer = [&] {
      const long long x = std::strtoll(v, &end, 10);
      if (*end != '\0' || x < 0) usage(v);
      return x;
    };
    if (a == "--init-seed") o.init_seed = std::uint64_t(integer());
    else if (a == "--epochs") o.epochs = int(integer());
    else if (a == "--batch-size") o.batch_size = integer();
    else if (a == "--samples") o.samples = integer();
    else if (a == "--features") o.features = integer();
    else if (a == "--hidden") o.hidden = integer();
    else if (a == "--classes") o.classes = integer();
    else if (a == "--data-seed") o.data_seed = std::uint64_t(integer());
    else if (a == "--sampler-seed") o.sampler_seed = integer();
    else if (a == "--backend") o.backend = v;
    else if (a == "--device") {
      o.device = v;
      if (o.device != "cpu" && o.device != "cuda") usage(v);
    }
    else if (a == "--report") o.report = v;
    else if (a == "--lr") {
      o.lr = std::strtod(v, &end);
      if (*end != '\0') usage(v);
    } else {
      usage(argv[i - 1]);
    }
  }
  return o;
}

std::uint32_t bits(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

void write_report(const std::string& path, int world, const std::vector<std::string>& lines,
                  const std::vector<std::vector<double>>& sums, const std::vector<float>& steps, double loop_seconds,
                  double samples_processed, const std::vector<float>& params) {
  std::ofstream f(path);
  f << "{\n \"build\": \"libtorch-" << TORCH_VERSION << "\",\n \"world_size\": " << world << ",\n \"printed_lines\": [";
  for (std::size_t i = 0; i < lines.size(); ++i) f << (i ? ", " : "") << '"' << lines[i] << '"';
  f << "],\n \"epoch_loss_sums_by_rank\": [";
  char b[64];
  for (std::size_t r = 0; r < sums.size(); ++r) {
    f << (r ? ", " : "") << '[';
    for (std::size_t e = 0; e < sums[r].size(); ++e) {
      std::snprintf(b, sizeof b, "%.17g", sums[r][e]);
      f << (e ? ", " : "") << b;
    }
    f << ']';
  }
  f << "],\n \"step_losses_rank0\": [";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::snprintf(b, sizeof b, "%.9g", double(steps[i]));
    f << (i ? ", " : "") << b;
  }
  std::snprintf(b, sizeof b, "%.9g", loop_seconds);
  f << "],\n \"train_loop_seconds\": " << b;
  std::snprintf(b, sizeof b, "%.9g", samples_processed / loop_seconds);
  f << ",\n \"throughput_samples_per_s\": " << b << ",\n \"steps\": " << steps.size() << ",\n \"final_params_bits\": [";
  for (std::size_t i = 0; i < params.size(); ++i) f << (i ? ", " : "") << bits(params[i]);
  f << "]\n}\n";
}

int run(const options& o) {
  const bool cuda = o.device == "cuda";
#if !defined(DDP_LIBTORCH_EXAMPLE_CUDA)
  if (cuda) throw std::runtime_error("--device cuda needs the CUDA build (cmake -DDDP_LIBTORCH_CUDA=ON, with CUDA and NCCL)");
#endif
  if (cuda && !torch::cuda::is_available()) throw std::runtime_error("--device cuda: PyTorch sees no CUDA device");
  // The launcher's variables, or a world of one.
  auto group = ddp::init_process_group(o.backend.empty() ? (cuda ? "nccl" : "ring") : o.backend);
  const int rank = group.rank(), world = group.size();
  const torch::Device device =
      cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ddp::launch_environment::from_environment().local_rank)) : torch::kCPU;
  torch::set_num_threads(1);  // one core per rank, as the tutorial under torchrun (OMP_NUM_THREADS=1)

  if (o.init_seed) torch::manual_seed(*o.init_seed);  // identical initial weights on every rank
  // The layers one statement each: the order of a call's arguments is unspecified (GCC builds
  // the last first), and the initial weights depend on the order of the draws.
  torch::nn::Linear fc1(o.features, o.hidden);
  torch::nn::Linear fc2(o.hidden, o.classes);
  torch::nn::Sequential model(fc1, torch::nn::ReLU(), fc2);
  model->to(device);
  ddp::torch_data_parallel net{*model, group};  // checks shapes across ranks, broadcasts rank 0's values

  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.data_seed);
  const auto x = torch::randn({o.samples, o.features}, gen).to(device);
  const auto y = torch::randint(0, o.classes, {o.samples}, gen).to(device);

  ddp::distributed_sampler sampler{o.samples, world, rank, ddp::sampler_options{.shuffle = true, .seed = o.sampler_seed}};
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(o.lr));
  torch::nn::CrossEntropyLoss loss_fn;

  std::vector<std::string> lines;
  std::vector<double> sums;
  std::vector<float> steps;
  double processed = 0;
  group.barrier();  // time the loop, not the rendezvous
  const auto t0 = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    double total = 0;  // a Python float, as the tutorial's total_loss
    for (const auto batch : sampler.batches(o.batch_size)) {
      const auto idx =
          torch::from_blob(const_cast<std::int64_t*>(batch.data()), {std::int64_t(batch.size())}, torch::kLong).to(device);
      net.zero_grad();  // in place: ddp keeps the gradients' memory (not zero_grad()'s set_to_none)
      auto loss = loss_fn(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
      loss.backward();  // each parameter's hook marks it ready: bucket all-reduces overlap backward
      net.finish();     // gradients are now the mean over ranks
      opt.step();
      const float l = loss.item<float>();
      total += l;
      if (rank == 0) steps.push_back(l);
      processed += double(batch.size());
    }
    sums.push_back(total);
    if (rank == 0) {
      char b[96];
      std::snprintf(b, sizeof b, "Epoch %d: Rank 0 local loss sum = %.4f", epoch + 1, total);
      lines.emplace_back(b);
      std::printf("%s\n", b);
      std::fflush(stdout);
    }
  }
  group.barrier();
  const double loop = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<double> all_sums(sums.size() * std::size_t(world));
  group.all_gather(std::span<const double>(sums), std::span<double>(all_sums));
  std::vector<double> total_processed{processed};
  group.all_reduce(std::span<double>(total_processed), ddp::sum{});
  if (rank == 0 && !o.report.empty()) {
    std::vector<std::vector<double>> by_rank;
    for (int r = 0; r < world; ++r)
      by_rank.emplace_back(all_sums.begin() + std::ptrdiff_t(r) * std::ptrdiff_t(sums.size()),
                           all_sums.begin() + std::ptrdiff_t(r + 1) * std::ptrdiff_t(sums.size()));
    std::vector<float> params;
    for (const auto& p : model->parameters()) {
      const auto c = p.detach().to(torch::kCPU).contiguous();
      params.insert(params.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    write_report(o.report, world, lines, by_rank, steps, loop, total_processed[0], params);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_ddp: %s\n", e.what());
    return 1;
  }
}
