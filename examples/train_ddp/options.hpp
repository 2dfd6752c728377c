#pragma once
// train_ddp's command line (CLI11). Every default is the PyTorch tutorial's value; --dataset
// digits has its own defaults (digits_defaults) for the options it does not fix from the data.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

// Where examples/data is (set by CMake to the source tree): --dataset digits reads digits.csv there.
#if !defined(TRAIN_DDP_DATA_DIR)
#define TRAIN_DDP_DATA_DIR "examples/data"
#endif

namespace train {

struct options {
  std::string dataset = "tutorial";  // tutorial (random data, the PyTorch tutorial) | digits (examples/data)
  std::string data = TRAIN_DDP_DATA_DIR "/digits.csv";
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
  // Large-batch rule (Goyal et al. 2017): the lr grows with the global batch (batch x world size)
  // relative to base_batch, reached by a linear ramp from lr over warmup_epochs.
  std::string lr_scaling = "none";  // none | linear
  int warmup_epochs = 0;
  long base_batch = 0;  // the global batch --lr was chosen for; 0: --batch-size (one rank's batch)
  // Checkpoints (ddp/checkpoint.hpp): with a directory, the run resumes from its newest complete
  // checkpoint, saves every N steps (0: only when preempted) and on SIGUSR1/SIGTERM saves at the
  // next step boundary and exits with ddp::preemption::requeue_exit_code (75).
  std::string checkpoint_dir;
  long checkpoint_every = 0;
  int keep = 3;            // complete checkpoints kept (0: all)
  bool no_resume = false;  // start from step 0 even when the directory holds a checkpoint
  // A checkpoint of another world size resumes at the start of its interrupted epoch (checkpoint.hpp).
  bool allow_world_size_change = false;
  std::string init_params;  // raw little-endian float32 values in the model's flat order (the report's final_params_bits)
  int first_epoch = 1;      // the epoch (as printed) a run without a checkpoint starts with
  long max_steps = 0;       // > 0: stop after this many steps in all (the epoch in progress prints no line)
  // The step after the gradients are averaged (optimizer.hpp). sgd with no momentum, no weight
  // decay, no clipping and --zero 0 is the tutorial's plain SGD (the model's own update).
  std::string optimizer = "sgd";       // sgd | adamw (torch.optim's, foreach=False)
  double momentum = 0;                 // sgd
  std::optional<double> weight_decay;  // none: the optimizer's torch default (sgd 0, adamw 0.01)
  double clip = 0;                     // > 0: clip_grad_norm_ to this global norm before each step
  int zero = 0;                        // 0: DDP; 1, 2: sharded_data_parallel (ZeRO stage 1 or 2)
  // Parameters and gradients stored in bfloat16 / float16 over a float32 master (precision.hpp).
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  double loss_scale = 65536.0;     // fp16: the grad scaler's initial scale (torch.amp.GradScaler's init_scale)
};

/// Whether the run uses the tutorial's plain SGD step (the model's own update kernel).
inline bool plain_sgd(const options& o) {
  return o.optimizer == "sgd" && o.momentum == 0 && o.weight_decay.value_or(0) == 0 && o.clip == 0 && o.zero == 0 &&
         o.precision == "fp32";
}

/// --dataset digits: the values that reach >= 0.9 held-out accuracy at every world size of the
/// strong-scaling report (examples/train_ddp/README.md, "Digits"). Applied to options not given.
struct digits_defaults {
  static constexpr int epochs = 10;
  static constexpr double lr = 0.1;
  static constexpr int hidden = 64;
  static constexpr int warmup_epochs = 2;
};

inline options parse_options(int argc, char** argv) {
  options o;
  CLI::App app{"train_ddp: the PyTorch DDP tutorial job (MLP 10-32-2, 1024 samples, SGD) on ddp"};
  app.option_defaults()->always_capture_default();
  app.add_option("--dataset", o.dataset,
                 "tutorial (random features and labels) or digits (UCI handwritten digits, 1437 train / 360 held out, "
                 "MLP 64-hidden-10; defaults --epochs 10 --lr 0.1 --hidden 64 --warmup-epochs 2)")
      ->check(CLI::IsMember({"tutorial", "digits"}));
  app.add_option("--data", o.data, "the digits CSV (examples/data/digits.csv)");
  auto* epochs = app.add_option("--epochs", o.epochs, "passes over the data")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", o.batch_size, "samples per step and rank (the last partial batch is kept)")
      ->check(CLI::PositiveNumber);
  auto* lr = app.add_option("--lr", o.lr, "SGD learning rate (the base lr of --lr-scaling)")->check(CLI::NonNegativeNumber);
  auto* samples = app.add_option("--samples", o.samples, "dataset size")->check(CLI::PositiveNumber);
  auto* features = app.add_option("--features", o.features, "input width")->check(CLI::PositiveNumber);
  auto* hidden = app.add_option("--hidden", o.hidden, "hidden width")->check(CLI::PositiveNumber);
  auto* classes = app.add_option("--classes", o.classes, "output classes")->check(CLI::Range(2, 1 << 20));
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
                 "run the job at these world sizes (e.g. 1,2,4), strong and weak scaling (digits: each without and "
                 "with --lr-scaling linear), and write the report to --report PREFIX (.md, .csv, .png)");
  app.add_option("--lr-scaling", o.lr_scaling,
                 "large-batch rule: none, or linear (lr x global batch / --base-batch, Goyal et al. 2017)")
      ->check(CLI::IsMember({"none", "linear"}));
  auto* warmup = app.add_option("--warmup-epochs", o.warmup_epochs,
                                "with --lr-scaling linear: ramp the lr linearly, step by step, from --lr to the scaled "
                                "lr over this many epochs")
                     ->check(CLI::NonNegativeNumber);
  app.add_option("--base-batch", o.base_batch,
                 "the global batch --lr was chosen for (0: --batch-size, so the linear rule scales by the world size)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "save checkpoints under DIR/step-N/ and resume from the newest complete one there; SIGUSR1 or "
                 "SIGTERM saves at the next step and exits with code 75 (requeue)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "with --checkpoint-dir: save every N steps (0: only when preempted)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--keep", o.keep, "with --checkpoint-dir: complete checkpoints to keep (0: all)")->check(CLI::NonNegativeNumber);
  app.add_flag("--no-resume", o.no_resume, "with --checkpoint-dir: start from step 0 even if DIR holds a checkpoint");
  app.add_flag("--allow-world-size-change", o.allow_world_size_change,
               "with --checkpoint-dir: resume a checkpoint saved with another world size (its parameters; the "
               "interrupted epoch restarts at its first batch; per-rank loss sums start anew)");
  app.add_option("--init-params", o.init_params,
                 "start from these parameters: raw little-endian float32, the model's flat order (a report's "
                 "final_params_bits); overrides --init-seed");
  app.add_option("--first-epoch", o.first_epoch,
                 "start with this epoch (1 = the first) when not resuming: its sampler order, its lr schedule step")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-steps", o.max_steps, "stop after this many steps in all (0: no limit)")->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer", o.optimizer, "sgd or adamw (torch.optim.SGD / AdamW, foreach=False)")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::NonNegativeNumber);
  double weight_decay = 0;
  auto* wd = app.add_option("--weight-decay", weight_decay, "weight decay (default: the optimizer's, sgd 0, adamw 0.01)")
                 ->check(CLI::NonNegativeNumber);
  app.add_option("--clip", o.clip, "clip the gradients to this global norm before each step (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--zero", o.zero,
                 "0: DDP (every rank keeps the optimizer state); 1: ZeRO-1 (optimizer state sharded); 2: ZeRO-2 "
                 "(gradients sharded too)")
      ->check(CLI::Range(0, 2));
  app.add_option("--precision", o.precision,
                 "fp32, or bf16 / fp16: parameters and gradients stored in bfloat16 / float16, averaged in float32, a "
                 "float32 master stepped (fp16 with a dynamic loss scale)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  auto* loss_scale = app.add_option("--loss-scale", o.loss_scale, "with --precision fp16: the initial loss scale (GradScaler's init_scale)")
                         ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
    if (wd->count() > 0) o.weight_decay = weight_decay;
    if (o.momentum > 0 && o.optimizer != "sgd") throw CLI::ValidationError("--momentum", "is an sgd option");
    if (o.checkpoint_dir.empty() && (o.checkpoint_every > 0 || o.no_resume || o.allow_world_size_change))
      throw CLI::ValidationError("--checkpoint-every/--no-resume/--allow-world-size-change", "need --checkpoint-dir");
    if (o.simulate_world > 0 && (o.first_epoch != 1 || o.max_steps > 0))
      throw CLI::ValidationError("--first-epoch/--max-steps", "are not supported with --simulate-world");
    if (!o.checkpoint_dir.empty() && o.simulate_world > 0)
      throw CLI::ValidationError("--checkpoint-dir", "is not supported with --simulate-world");
    if (!plain_sgd(o) && o.simulate_world > 0)
      throw CLI::ValidationError("--optimizer/--momentum/--weight-decay/--clip/--zero/--precision",
                                 "are not supported with --simulate-world");
    if (loss_scale->count() > 0 && o.precision != "fp16") throw CLI::ValidationError("--loss-scale", "needs --precision fp16");
    if (o.precision != "fp32" && !o.scaling.empty())
      throw CLI::ValidationError("--precision", "is not supported with --scaling");
    if (o.dataset == "digits") {
      // The data fixes these; a value given anyway would be silently wrong.
      for (const auto* fixed : {samples, features, classes})
        if (fixed->count() > 0) throw CLI::ValidationError(fixed->get_name(), "is fixed by --dataset digits");
      if (epochs->count() == 0) o.epochs = digits_defaults::epochs;
      if (lr->count() == 0) o.lr = digits_defaults::lr;
      if (hidden->count() == 0) o.hidden = digits_defaults::hidden;
      if (warmup->count() == 0) o.warmup_epochs = digits_defaults::warmup_epochs;
      o.features = 64;
      o.classes = 10;
    }
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (init->count() > 0) o.init_seed = init_seed;
  return o;
}

}  // namespace train
