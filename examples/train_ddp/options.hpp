#pragma once
// train_ddp's command line (CLI11). Every default is the PyTorch tutorial's value.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

namespace train {

struct options {
  int epochs = 3;
  long batch_size = 32;
  double lr = 0.01;
  long samples = 1024;
  int features = 10;
  int hidden = 32;
  int classes = 2;
  std::uint64_t data_seed = 42;
  std::int64_t sampler_seed = 0;
#if defined(__CUDACC__) && defined(DDP_HAS_NCCL)
  std::string backend = "nccl";  // the CUDA build reduces device memory, as PyTorch's GPU tutorial does
#else
  std::string backend = "ring";
#endif
  std::optional<std::uint64_t> init_seed;  // none: random weights, made equal by DDP's broadcast
  std::string report;                      // JSON report path (rank 0 writes it)
  int nproc_per_node = 1;                  // > 1 and RANK unset: relaunch as N ranks
  std::string gemm = "exact";              // exact (PyTorch's bits) | eigen (CPU) | fast (CPU) | cublas (CUDA)
  int simulate_world = 0;                  // > 0: one process, W replicas, averaged in rank order
  std::string scaling;                     // "1,2,4": the scaling report (scaling.hpp) instead of one run
};

inline options parse_options(int argc, char** argv) {
  options o;
  CLI::App app{"train_ddp: the PyTorch DDP tutorial job (MLP 10-32-2, 1024 samples, SGD) on ddp"};
  app.option_defaults()->always_capture_default();
  app.add_option("--epochs", o.epochs, "passes over the data")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", o.batch_size, "samples per step and rank (the last partial batch is kept)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "SGD learning rate")->check(CLI::NonNegativeNumber);
  app.add_option("--samples", o.samples, "dataset size")->check(CLI::PositiveNumber);
  app.add_option("--features", o.features, "input width")->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden, "hidden width")->check(CLI::PositiveNumber);
  app.add_option("--classes", o.classes, "output classes")->check(CLI::Range(2, 1 << 20));
  app.add_option("--data-seed", o.data_seed, "seed of the dataset generator (torch.Generator().manual_seed)");
  app.add_option("--sampler-seed", o.sampler_seed, "DistributedSampler seed");
  app.add_option("--backend", o.backend, "process group backend: ring (shm on one host, tcp across), tcp, shm, nccl, mpi");
  std::uint64_t init_seed = 0;
  auto* init = app.add_option("--init-seed", init_seed,
                              "initialize the weights as torch.manual_seed(S) + the two nn.Linear constructors");
  app.add_option("--report", o.report, "write a JSON report to this file (rank 0)");
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "ranks to launch on this host when RANK is not set (ddp::launch, like torchrun --standalone)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--gemm", o.gemm, "GEMM policy: exact (PyTorch's summation order), eigen (CPU), fast (CPU: fused step), cublas (CUDA)");
  app.add_option("--simulate-world", o.simulate_world,
                 "run W replicas in this one process and average their gradients in rank order (no communication)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--scaling", o.scaling,
                 "run the job at these world sizes (e.g. 1,2,4), strong and weak scaling, and write the report to "
                 "--report PREFIX (.md, .csv, .png)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (init->count() > 0) o.init_seed = init_seed;
  return o;
}

}  // namespace train
