// train_ddp: PyTorch's DDP tutorial job in C++ on ddp. One source for the CPU build (Thrust's
// CPP system + exact or Eigen GEMM) and the CUDA build (train_ddp.cu includes this file:
// Thrust on CUDA + cuBLAS or the exact GEMM on the device).
//
//   train_ddp                                   world of one (or whatever torchrun/srun/mpirun set)
//   train_ddp --nproc-per-node 2                two ranks on this host (ddp::launch, like torchrun --standalone)
//   train_ddp --init-seed 0                     torch.manual_seed(0) weights: PyTorch's printed lines
//   train_ddp --simulate-world 2                two replicas in one process (no communication)
//   train_ddp --dataset digits                  real data (examples/data/digits.csv), held-out accuracy
//   train_ddp --checkpoint-dir ckpt --checkpoint-every 10   save, resume, preemption (README: Checkpoints)
//   train_ddp --optimizer adamw --clip 1 --zero 2           AdamW, clipping, ZeRO-2 (README: Optimizers)
//
// Rank 0 prints `Epoch N: Rank 0 local loss sum = X.XXXX` after each epoch, as the tutorial does;
// with --dataset digits also `Epoch N: held-out accuracy A.AAAA loss L.LLLL`.

#include <chrono>
#include <cstdint>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ddp/checkpoint.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/init.hpp"
#include "ddp/launch.hpp"
#include "ddp/parameters.hpp"
#include "ddp/random.hpp"
#include "ddp/sampler.hpp"
#include "flat_params.hpp"
#include "mlp.hpp"
#include "optimizer.hpp"
#include "options.hpp"
#include "precision.hpp"
#include "report.hpp"
#include "scaling.hpp"

#if defined(__CUDACC__)
#include "cublas_gemm.hpp"
#include "ddp/data_parallel/sharded_cuda.hpp"  // --zero on device memory: the shard's element kernels
#endif
#if defined(DDP_HAS_MPI)
#include "ddp/mpi.hpp"  // registers --backend mpi
#endif
#if defined(__CUDACC__) && defined(DDP_HAS_NCCL)
#include "ddp/nccl.hpp"  // registers --backend nccl: gradients reduced in device memory
#endif

namespace train {

#if defined(__CUDACC__)
inline constexpr bool cuda_build = true;
#else
inline constexpr bool cuda_build = false;
#endif

/// The tutorial's data: g = torch.Generator().manual_seed(seed); x = torch.randn(n, d, generator=g);
/// y = torch.randint(0, classes, (n,), generator=g).
inline dataset make_dataset(const options& o) {
  ddp::torch_generator g{o.data_seed};
  const std::vector<float> x = ddp::randn(std::int64_t(o.samples) * o.features, g);
  const std::vector<std::int64_t> y = ddp::randint(0, o.classes, o.samples, g);
  dataset d;
  d.features = thrust::device_vector<float>(x.begin(), x.end());
  d.labels = thrust::device_vector<std::int64_t>(y.begin(), y.end());
  d.n = o.samples;
  d.in = o.features;
  return d;
}

/// The data a run trains on, and the split it is evaluated on after every epoch (digits; the
/// tutorial has none: heldout.n == 0).
struct job_data {
  dataset train, heldout;
};

/// examples/data/digits.csv (tools/make_digits.py): `#` comments, a header, then rows
/// `split,index,label,p0,...,p63` with split train | heldout. Features are pixel / 16 in float32
/// (exact: a power of two), as bench/torch/train_ddp_cpu.py divides them.
inline job_data load_digits(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--dataset digits: cannot read '" + path + "' (see --data)");
  std::vector<float> x[2];
  std::vector<std::int64_t> y[2];
  bool header = true;
  long line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.empty() || line[0] == '#') continue;
    if (header) {  // split,index,label,p0,...
      header = false;
      continue;
    }
    const auto bad = [&] { return std::runtime_error(path + ":" + std::to_string(line_number) + ": expected split,index,label,64 pixels"); };
    const auto comma = line.find(',');
    const std::string split = line.substr(0, comma);
    if (comma == std::string::npos || (split != "train" && split != "heldout")) throw bad();
    const int part = split == "train" ? 0 : 1;
    const char* p = line.c_str() + comma + 1;
    long values[66];
    for (int i = 0; i < 66; ++i) {
      char* end = nullptr;
      values[i] = std::strtol(p, &end, 10);
      if (end == p || (i < 65 ? *end != ',' : *end != '\0' && *end != '\r')) throw bad();
      p = end + 1;
    }
    if (values[1] < 0 || values[1] > 9) throw bad();
    y[part].push_back(values[1]);
    for (int i = 2; i < 66; ++i) {
      if (values[i] < 0 || values[i] > 16) throw bad();
      x[part].push_back(float(values[i]) / 16.0f);
    }
  }
  job_data d;
  for (int part = 0; part < 2; ++part) {
    dataset& s = part == 0 ? d.train : d.heldout;
    if (y[part].empty()) throw std::runtime_error(path + ": no " + (part == 0 ? "train" : "heldout") + " rows");
    s.features = thrust::device_vector<float>(x[part].begin(), x[part].end());
    s.labels = thrust::device_vector<std::int64_t>(y[part].begin(), y[part].end());
    s.n = long(y[part].size());
    s.in = 64;
  }
  return d;
}

inline job_data make_data(const options& o) {
  if (o.dataset == "digits") return load_digits(o.data);
  job_data d;
  d.train = make_dataset(o);
  return d;
}

/// The lr of step t (t = 0, 1, ... over the whole run). --lr-scaling none: --lr. linear (Goyal et
/// al. 2017): peak = lr x (global batch / base batch), reached from lr by a linear ramp over the
/// first warmup_epochs x steps-per-epoch steps. Double, in the order bench/torch/train_ddp_cpu.py
/// computes it, so both hand SGD the same float.
struct lr_schedule {
  double base = 0, peak = 0;
  long warmup_steps = 0;
  double at(long t) const { return t < warmup_steps ? base + (peak - base) * double(t) / double(warmup_steps) : peak; }
};

inline long base_batch(const options& o) { return o.base_batch > 0 ? o.base_batch : o.batch_size; }

inline lr_schedule make_schedule(const options& o, int world, const ddp::distributed_sampler& sampler) {
  const long steps_per_epoch = long((sampler.num_samples() + o.batch_size - 1) / o.batch_size);
  const double peak = o.lr_scaling == "linear" ? o.lr * (double(o.batch_size * world) / double(base_batch(o))) : o.lr;
  return {o.lr, peak, long(o.warmup_epochs) * steps_per_epoch};
}

/// torch.manual_seed(S); nn.Linear(features, hidden); nn.Linear(hidden, classes), flattened in
/// named_parameters() order. Without --init-seed, a seed from std::random_device: every rank draws
/// its own, and DDP's broadcast from rank 0 makes the replicas equal.
inline std::vector<float> initial_values(const options& o) {
  std::uint64_t seed = 0;
  if (o.init_seed) {
    seed = *o.init_seed;
  } else {
    std::random_device rd;
    seed = (std::uint64_t(rd()) << 32) | rd();
  }
  ddp::torch_generator g{seed};
  const auto l1 = ddp::torch_linear_init(o.hidden, o.features, g);
  const auto l2 = ddp::torch_linear_init(o.classes, o.hidden, g);
  std::vector<float> v;
  for (const auto* part : {&l1.weight, &l1.bias, &l2.weight, &l2.bias}) v.insert(v.end(), part->begin(), part->end());
  if (!o.init_params.empty()) {  // --init-params: the same layout, values from the file
    std::ifstream in(o.init_params, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.is_open() || bytes.size() != v.size() * sizeof(float))
      throw ddp::error(ddp::errc::invalid_argument,
                       "--init-params " + o.init_params + ": " + std::to_string(bytes.size()) + " bytes, the model has " +
                           std::to_string(v.size()) + " float32 values (" + std::to_string(v.size() * sizeof(float)) +
                           " bytes)");
    std::memcpy(v.data(), bytes.data(), bytes.size());  // little-endian, as the hosts ddp runs on
  }
  return v;
}

struct device_memory_probe {
  std::int64_t peak = -1;
  void sample() {
#if defined(__CUDACC__)
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) peak = std::max<std::int64_t>(peak, std::int64_t(total - free));
#endif
  }
};

inline std::string epoch_line(int epoch, double total) {
  char b[96];
  std::snprintf(b, sizeof b, "Epoch %d: Rank 0 local loss sum = %.4f", epoch + 1, total);
  return b;
}

inline std::string heldout_line(int epoch, const eval_result& e) {
  char b[96];
  std::snprintf(b, sizeof b, "Epoch %d: held-out accuracy %.4f loss %.4f", epoch + 1,
                double(e.correct) / double(e.count), e.loss_sum / double(e.count));
  return b;
}

inline report base_report(const options& o, const char* gemm_name, const job_data& data, int world) {
  report r;
  r.dataset = o.dataset;
  r.build = cuda_build ? "cuda" : "cpu";
  r.backend = o.simulate_world > 0 ? "simulated" : o.backend;
  r.gemm = gemm_name;
  r.epochs = o.epochs;
  r.batch_size = o.batch_size;
  r.samples = o.samples;
  r.features = o.features;
  r.hidden = o.hidden;
  r.classes = o.classes;
  r.lr = o.lr;
  r.samples = data.train.n;
  r.heldout_samples = data.heldout.n;
  r.lr_scaling = o.lr_scaling;
  r.warmup_epochs = o.warmup_epochs;
  r.base_batch = base_batch(o);
  r.global_batch = o.batch_size * world;
  r.optimizer = o.optimizer;
  r.momentum = o.momentum;
  r.weight_decay = o.weight_decay.value_or(o.optimizer == "adamw" ? ddp::optim::adamw_options{}.weight_decay : 0.0);
  r.clip = o.clip;
  r.zero = o.zero;
  r.precision = o.precision;
  return r;
}

/// Rank 0's line after an epoch's held-out evaluation, kept in the report too.
inline void note_heldout(report& rep, int epoch, const eval_result& e, bool print) {
  rep.heldout_accuracy_by_epoch.push_back(double(e.correct) / double(e.count));
  rep.heldout_loss_by_epoch.push_back(e.loss_sum / double(e.count));
  rep.heldout_samples = e.count;
  if (!print) return;
  rep.printed_lines.push_back(heldout_line(epoch, e));
  std::printf("%s\n", rep.printed_lines.back().c_str());
  std::fflush(stdout);
}

/// What --checkpoint-dir saves besides the parameters: everything a resumed run needs to print
/// the lines and write the report an uninterrupted run would (its own loss sums, rank 0's step
/// losses and printed lines, the epoch in progress's partial sum). Per rank: each rank's sums differ.
struct resumable {
  std::vector<float> values;  // host copy of the parameters (the model may live on the device)
  std::vector<float> grads;   // unused; parameter_refs come in (value, grad) pairs
  std::vector<double> totals;  // finished epochs' loss sums
  std::vector<double> partial{0.0};  // the epoch in progress
  std::vector<std::uint8_t> lines;   // rank 0's printed lines, '\n'-terminated
  std::vector<double> samples_processed{0.0};
  std::vector<std::int64_t> heldout_samples{0};
  optimizer_snapshot optimizer;  // --optimizer/--zero runs (plain SGD keeps no state)
  precision_snapshot precision;  // --precision bf16 / fp16: the float32 master and the loss scale
};

/// The options a resumed run must share with the run that saved (the others, such as --epochs,
/// --backend or --init-seed, may change); kept in the checkpoint's metadata.
inline std::string checkpoint_config(const options& o) {
  char b[512];
  std::snprintf(b, sizeof b,
                "dataset=%s samples=%ld features=%d hidden=%d classes=%d batch_size=%ld lr=%.17g data_seed=%llu "
                "sampler_seed=%lld lr_scaling=%s warmup_epochs=%d base_batch=%ld",
                o.dataset.c_str(), o.samples, o.features, o.hidden, o.classes, o.batch_size, o.lr,
                static_cast<unsigned long long>(o.data_seed), static_cast<long long>(o.sampler_seed), o.lr_scaling.c_str(),
                o.warmup_epochs, o.base_batch);
  std::string config = b;
  if (!plain_sgd(o)) {  // the optimizer's state is only valid for the same optimizer, and its layout for the same --zero
    std::snprintf(b, sizeof b, " optimizer=%s momentum=%.17g weight_decay=%.17g clip=%.17g zero=%d", o.optimizer.c_str(),
                  o.momentum, o.weight_decay.value_or(-1), o.clip, o.zero);
    config += b;
  }
  if (o.precision != "fp32") {  // the master and the scale belong to this precision
    std::snprintf(b, sizeof b, " precision=%s loss_scale=%.17g", o.precision.c_str(), o.loss_scale);
    config += b;
  }
  return config;
}

template <class Model>
ddp::checkpoint::state checkpoint_state(const options& o, const Model& model, resumable& r, report& rep) {
  namespace ck = ddp::checkpoint;
  ck::state st;
  flat_params<float> host{r.values, r.grads, &model.slots(), ddp::memory_space::host};
  st.add_parameters(parameters(host));
  st.add_vector("train.epoch_loss_sums", r.totals, ck::scope::per_rank);
  st.add("train.epoch_loss_sum_so_far", std::span(r.partial), {}, ck::scope::per_rank);
  st.add_vector("train.step_losses_rank0", rep.step_losses_rank0, ck::scope::per_rank);
  st.add_vector("train.printed_lines", r.lines, ck::scope::per_rank);
  st.add_vector("train.heldout_accuracy_by_epoch", rep.heldout_accuracy_by_epoch, ck::scope::per_rank);
  st.add_vector("train.heldout_loss_by_epoch", rep.heldout_loss_by_epoch, ck::scope::per_rank);
  st.add("train.samples_processed", std::span(r.samples_processed), {}, ck::scope::per_rank);
  st.add("train.heldout_samples", std::span(r.heldout_samples), {}, ck::scope::per_rank);
  if (!plain_sgd(o)) {
    // DDP: every rank's optimizer state is the same. ZeRO: each rank's shard of it, in the shard
    // layout of this world size (a checkpoint resumes it at the same world size only).
    const auto where = o.zero > 0 ? ck::scope::per_rank : ck::scope::replicated;
    st.add_vector("optimizer.step", r.optimizer.step, where);
    st.add_vector("optimizer.momentum_buffer", r.optimizer.momentum_buffer, where);
    st.add_vector("optimizer.exp_avg", r.optimizer.exp_avg, where);
    st.add_vector("optimizer.exp_avg_sq", r.optimizer.exp_avg_sq, where);
    st.add_vector("optimizer.max_exp_avg_sq", r.optimizer.max_exp_avg_sq, where);
  }
  if (o.precision != "fp32") {  // the master is laid out as the optimizer's state
    st.add_vector("precision.master", r.precision.master, o.zero > 0 ? ck::scope::per_rank : ck::scope::replicated);
    st.add_vector("precision.loss_scale", r.precision.loss_scale);
    st.add_vector("precision.growth_tracker", r.precision.growth_tracker);
  }
  st.metadata["train_ddp.config"] = checkpoint_config(o);
  return st;
}

/// --simulate-world W: W replicas in this process; after each step every gradient becomes
/// (g_0 + ... + g_{W-1}) / W in float32, summed in rank order (what the golden simulation does).
template <class Gemm>
int run_simulation(const options& o, Gemm gemm) {
  const int w = o.simulate_world;
  const job_data all = make_data(o);
  const dataset& data = all.train;
  const std::vector<float> init = initial_values(o);
  std::vector<mlp<Gemm>> replicas;
  std::vector<ddp::distributed_sampler> samplers;
  for (int r = 0; r < w; ++r) {
    replicas.emplace_back(o.features, o.hidden, o.classes, gemm);
    replicas.back().set_values(init);
    samplers.emplace_back(data.n, w, r, ddp::sampler_options{.shuffle = true, .seed = o.sampler_seed});
  }
  report rep = base_report(o, Gemm::name, all, w);
  rep.world_size = w;
  rep.simulated = true;
  const lr_schedule lr = make_schedule(o, w, samplers[0]);
  rep.peak_lr = lr.peak;
  long step = 0;
  double eval_seconds = 0;
  rep.epoch_loss_sums_by_rank.assign(std::size_t(w), {});
  std::vector<float> sum(replicas[0].numel()), g(sum.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    std::vector<ddp::index_batches> passes;
    for (auto& s : samplers) {
      s.set_epoch(epoch);
      passes.push_back(s.batches(o.batch_size));
    }
    std::vector<ddp::index_batches::iterator> it;
    for (auto& p : passes) it.push_back(p.begin());
    std::vector<double> totals(std::size_t(w), 0.0);
    for (; it[0] != passes[0].end();) {
      for (int r = 0; r < w; ++r) {
        const auto batch = *it[std::size_t(r)];
        const float loss = replicas[std::size_t(r)].forward_backward(data, batch);
        totals[std::size_t(r)] += loss;
        if (r == 0) rep.step_losses_rank0.push_back(loss);
        rep.samples_processed += double(batch.size());
        ++it[std::size_t(r)];
        thrust::copy(replicas[std::size_t(r)].grads().begin(), replicas[std::size_t(r)].grads().end(),
                     r == 0 ? sum.begin() : g.begin());
        if (r > 0)
          for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
      }
      for (auto& v : sum) v /= float(w);
      const double step_lr = lr.at(step++);
      for (auto& m : replicas) {
        thrust::copy(sum.begin(), sum.end(), m.grads().begin());
        m.sgd_step(step_lr);
      }
    }
    for (int r = 0; r < w; ++r) rep.epoch_loss_sums_by_rank[std::size_t(r)].push_back(totals[std::size_t(r)]);
    rep.printed_lines.push_back(epoch_line(epoch, totals[0]));
    std::printf("%s\n", rep.printed_lines.back().c_str());
    std::fflush(stdout);
    if (all.heldout.n > 0) {  // rank r's share r, r + W, ..., summed in rank order as the ring backend does
      const auto e0 = std::chrono::steady_clock::now();
      eval_result e;
      for (int r = 0; r < w; ++r) {
        const eval_result part = replicas[0].evaluate(all.heldout, r, w);
        e.correct += part.correct;
        e.count += part.count;
        e.loss_sum += part.loss_sum;
      }
      note_heldout(rep, epoch, e, true);
      eval_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    }
  }
  rep.train_loop_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - eval_seconds;
  const eval_result e = replicas[0].evaluate(data);
  rep.eval_samples = e.count;
  rep.eval_correct = e.correct;
  rep.eval_loss_sum = e.loss_sum;
  rep.peak_rss_bytes_by_rank = {peak_rss_bytes()};
  rep.final_params = replicas[0].host_values();
  if (!o.report.empty()) write_report(o.report, rep);
  return 0;
}

template <class Gemm>
int run_distributed(const options& o, Gemm gemm) {
  // Installed before the rendezvous: a SIGTERM that early must not kill the rank outright.
  const bool checkpointing = !o.checkpoint_dir.empty();
  std::optional<ddp::preemption> preempt;
  if (checkpointing) preempt.emplace();
  ddp::group group = ddp::init_process_group(o.backend);
  const int rank = group.rank(), world = group.size();
  device_memory_probe probe;
  const job_data all = make_data(o);
  const dataset& data = all.train;
  mlp<Gemm> model(o.features, o.hidden, o.classes, gemm);
  model.set_values(initial_values(o));

  // DDP reduces the model's own gradient buffer in place when the backend works where the model
  // lives (CPU build; CUDA build with nccl). A CUDA model with a host-memory backend (ring, mpi)
  // goes through host mirrors, copied each step.
  const bool host_mirrors = cuda_build && group.memory() == ddp::memory_space::host;
  std::vector<float> host_values, host_grads;
  flat_params<float> params{{}, {}, &model.slots(), cuda_build && !host_mirrors ? ddp::memory_space::device : ddp::memory_space::host};
  if (host_mirrors) {
    host_values = model.host_values();
    host_grads.assign(host_values.size(), 0.0f);
    params.values = host_values;
    params.grads = host_grads;
  } else {
    params.values = {model.value_data(), model.numel()};
    params.grads = {model.grad_data(), model.numel()};
  }
  // --zero 0: DDP, then the step on every rank; --zero 1, 2: the sharded wrapper steps this rank's
  // shard (the optimizer and the sharded clip inside amp_shard_optimizer, its scaler off; on device
  // memory, nccl, device_shard_step) and all-gathers the parameters. Either construction checks
  // shapes on every rank and broadcasts rank 0.
  const bool plain = plain_sgd(o);
  const bool on_device = params.memory != ddp::memory_space::host;
  const bool mixed = o.precision != "fp32";
  if (mixed && cuda_build)
    throw ddp::error(ddp::errc::config, "--precision " + o.precision + ": the CUDA build's model computes in float32 on the "
                                        "device; --precision runs in the CPU build");
  chosen_optimizer optimizer{o};
#if defined(__CUDACC__)
  std::optional<chosen_device_optimizer> device_optimizer;
  if (!plain && on_device) device_optimizer.emplace(o);
#endif
  ddp::optim::grad_scaler no_loss_scaling{{.enabled = false}};
  ddp::optim::amp_shard_optimizer shard_step{optimizer, group, no_loss_scaling, {.max_norm = o.clip}};
  std::optional<ddp::distributed_data_parallel<flat_params<float>, ddp::group>> replicated;
  std::optional<ddp::sharded_data_parallel<flat_params<float>, ddp::group, decltype(shard_step)>> sharded;
#if defined(__CUDACC__)
  std::optional<device_shard_step<ddp::group>> device_shard;
  std::optional<ddp::sharded_data_parallel<flat_params<float>, ddp::group, device_shard_step<ddp::group>>> device_sharded;
#endif
  const auto with_sharded = [&](auto&& f) {  // the sharded wrapper of this run (--zero 1, 2)
#if defined(__CUDACC__)
    if (device_sharded) return f(*device_sharded);
#endif
    return f(*sharded);
  };
  // --precision bf16 / fp16: rounds the model's parameters, builds its own wrapper for --zero.
  std::optional<mixed_precision> mixed_step;
  // The sharded wrapper copies its master shard from the parameters when it is built: after a
  // resume has loaded them (below).
  if (o.zero == 0 && !mixed) replicated.emplace(params, group);
  const auto mark_ready = [&](std::size_t i) {
    replicated ? replicated->mark_ready(i) : with_sharded([&](auto& w) { w.mark_ready(i); });
  };
  if (host_mirrors) model.set_values(host_values);
  // The optimizer that the checkpoints save and load (the host one, or the device one of nccl).
  const auto save_optimizer = [&](optimizer_snapshot& out) {
#if defined(__CUDACC__)
    if (device_optimizer) return device_optimizer->save_to(out);
#endif
    optimizer.save_to(out);
  };
  const auto load_optimizer = [&](const optimizer_snapshot& in) {
#if defined(__CUDACC__)
    if (device_optimizer) return device_optimizer->load_from(in);
#endif
    optimizer.load_from(in);
  };

  ddp::distributed_sampler sampler{data.n, world, rank, ddp::sampler_options{.shuffle = true, .seed = o.sampler_seed}};
  report rep = base_report(o, Gemm::name, all, world);
  rep.world_size = world;
  const lr_schedule lr = make_schedule(o, world, sampler);
  rep.peak_lr = lr.peak;
  long step = 0;
  double eval_seconds = 0;
  std::chrono::nanoseconds eval_communication{0};
  std::vector<double> totals;

  // Resume: rank 0 picks the newest complete checkpoint and tells the others which.
  rep.checkpointing = checkpointing;
  // --first-epoch: that epoch's sampler order, and the step count (lr schedule) it starts with.
  int start_epoch = o.first_epoch - 1;
  // (Counted, not iterated: the sampler warns when one epoch is iterated twice.)
  step = long(start_epoch) * long((sampler.num_samples() + o.batch_size - 1) / o.batch_size);
  std::int64_t start_batch = 0;
  double start_partial = 0;
  resumable saved;
  if (checkpointing && !o.no_resume) {
    std::vector<std::int64_t> found{-1, 0};  // step, the world size that saved it
    if (rank == 0)
      if (const auto c = ddp::checkpoint::latest(o.checkpoint_dir)) found = {c->step, c->world_size};
    group.broadcast(std::span<std::int64_t>(found), 0);
    if (found[0] >= 0) {
      const auto path = ddp::checkpoint::step_path(o.checkpoint_dir, found[0]);
      const bool resized = found[1] != world;
      if (resized && !o.allow_world_size_change)
        throw ddp::error(ddp::errc::config, "checkpoint " + path.string() + " was saved by " + std::to_string(found[1]) +
                                                " ranks, this job has " + std::to_string(world) +
                                                " (--allow-world-size-change resumes it at the start of its interrupted "
                                                "epoch; or pass --no-resume)");
      if (resized && o.zero > 0)
        throw ddp::error(ddp::errc::config, "checkpoint " + path.string() + " holds each of its " + std::to_string(found[1]) +
                                                " ranks' shard of the optimizer state (--zero " + std::to_string(o.zero) +
                                                "): resume it with " + std::to_string(found[1]) + " ranks (or pass --no-resume)");
      // The linear rule's lr depends on the world size and its warmup on the step count per epoch.
      if (resized && o.lr_scaling != "none")
        throw ddp::error(ddp::errc::config, "--allow-world-size-change: not with --lr-scaling " + o.lr_scaling +
                                                " (its schedule depends on the world size)");
      saved.values.assign(model.numel(), 0.0f);
      saved.grads.assign(model.numel(), 0.0f);
      auto st = checkpoint_state(o, model, saved, rep);
      const auto got = ddp::checkpoint::load(path, rank, world, st, {.allow_world_size_change = o.allow_world_size_change});
      const auto config = got.metadata.find("train_ddp.config");
      if (config == got.metadata.end() || config->second != checkpoint_config(o))
        throw ddp::error(ddp::errc::config, "checkpoint " + path.string() + " was written with other options:\n  saved: " +
                                                (config == got.metadata.end() ? std::string("(none)") : config->second) +
                                                "\n  now:   " + checkpoint_config(o) + "\n(or pass --no-resume)");
      model.set_values(saved.values);
      if (host_mirrors) std::copy(saved.values.begin(), saved.values.end(), host_values.begin());
      if (!plain) load_optimizer(saved.optimizer);
      if (got.world_size_changed && rank == 0) {
        // Per-rank records were not loaded. Rank 0's log (its lines, step losses, held-out
        // results) is the job's: read from the saved rank 0. Loss sums restart at this epoch.
        namespace ck = ddp::checkpoint;
        ck::state log;
        log.add_vector("train.step_losses_rank0", rep.step_losses_rank0, ck::scope::per_rank);
        log.add_vector("train.printed_lines", saved.lines, ck::scope::per_rank);
        log.add_vector("train.heldout_accuracy_by_epoch", rep.heldout_accuracy_by_epoch, ck::scope::per_rank);
        log.add_vector("train.heldout_loss_by_epoch", rep.heldout_loss_by_epoch, ck::scope::per_rank);
        ck::load(path, 0, got.world_size, log);
      }
      totals = saved.totals;
      for (std::size_t a = 0, b = 0; b < saved.lines.size(); ++b)
        if (saved.lines[b] == '\n') {
          rep.printed_lines.emplace_back(saved.lines.begin() + std::ptrdiff_t(a), saved.lines.begin() + std::ptrdiff_t(b));
          a = b + 1;
        }
      rep.samples_processed = saved.samples_processed[0];
      rep.heldout_samples = long(saved.heldout_samples[0]);
      step = long(got.step);
      start_epoch = int(got.sampler.epoch);
      start_batch = got.sampler.batches_done;
      start_partial = saved.partial[0];
      rep.resumed_from_step = step;
      rep.resumed_from_world_size = got.world_size;
      if (rank == 0 && got.world_size_changed)
        std::fprintf(stderr,
                     "train_ddp: world size %d -> %d: checkpoint %s (step %ld, epoch %d with %lld batches done) resumes at "
                     "the start of epoch %d\n",
                     got.world_size, world, path.c_str(), step, int(got.saved_sampler.epoch) + 1,
                     static_cast<long long>(got.saved_sampler.batches_done), start_epoch + 1);
      if (rank == 0)
        std::fprintf(stderr, "train_ddp: resumed from checkpoint %s (step %ld: epoch %d, batch %lld)\n", path.c_str(), step,
                     start_epoch + 1, static_cast<long long>(start_batch));
    } else if (rank == 0) {
      std::fprintf(stderr, "train_ddp: no complete checkpoint in %s, starting from step 0\n", o.checkpoint_dir.c_str());
    }
  }
  // Saves this step (every rank, same step): the parameters and what the report and lines need.
  const auto save_checkpoint = [&](int epoch, std::int64_t batches_done, double partial) {
    resumable now;
    now.values = model.host_values();
    now.grads.assign(now.values.size(), 0.0f);
    now.totals = totals;
    now.partial = {partial};
    for (const auto& line : rep.printed_lines) {
      now.lines.insert(now.lines.end(), line.begin(), line.end());
      now.lines.push_back('\n');
    }
    now.samples_processed = {rep.samples_processed};
    now.heldout_samples = {rep.heldout_samples};
    if (!plain) save_optimizer(now.optimizer);
    if (mixed_step) now.precision = mixed_step->snapshot();
    auto st = checkpoint_state(o, model, now, rep);
    st.sampler = {.seed = o.sampler_seed, .epoch = epoch, .batches_done = batches_done};
    st.metadata["step"] = std::to_string(step);
    ddp::checkpoint::save(group, o.checkpoint_dir, step, st, {.keep = o.keep});
    rep.checkpoints_saved.push_back(step);
  };
  if (o.zero > 0 && !mixed && !on_device) {
    sharded.emplace(params, group, shard_step, ddp::sharded_options{.stage = o.zero});
    if (host_mirrors) model.set_values(host_values);
  }
#if defined(__CUDACC__)
  if (o.zero > 0 && on_device) {
    device_shard.emplace(*device_optimizer, group, o.clip);
    device_sharded.emplace(params, group, *device_shard, ddp::sharded_options{.stage = o.zero});
  }
#endif
  if (mixed) {
    mixed_step.emplace(o, group, optimizer, model.slots(), params.values);
    if (rep.resumed_from_step >= 0) mixed_step->restore(saved.precision);
  }
  probe.sample();
  group.barrier();  // time the loop, not the rendezvous
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  const auto comm_before = group.stats()[ddp::collective::all_reduce].time;
  const auto t0 = clock::now();
  // At a step boundary: the ranks agree on a preemption; saves when asked to or every N steps.
  // True: preempted, checkpoint saved, the run must exit with requeue_exit_code.
  const auto checkpoint_point = [&](int epoch, std::int64_t batches_done, double partial) {
    // Every rank takes the same decision at the same step: the flag is all-reduced.
    const bool stop = preempt->agreed(group);
    if (stop || (o.checkpoint_every > 0 && step % o.checkpoint_every == 0)) save_checkpoint(epoch, batches_done, partial);
    if (stop && rank == 0)
      std::fprintf(stderr, "train_ddp: preempted: saved checkpoint %s; exiting with %d (requeue)\n",
                   ddp::checkpoint::step_path(o.checkpoint_dir, step).c_str(), ddp::preemption::requeue_exit_code);
    return stop;
  };
  const auto at_max_steps = [&] { return o.max_steps > 0 && step >= o.max_steps; };
  for (int epoch = start_epoch; epoch < o.epochs && !at_max_steps(); ++epoch) {
    sampler.set_epoch(epoch);
    const std::int64_t first_batch = epoch == start_epoch ? start_batch : 0;
    double total_loss = epoch == start_epoch ? start_partial : 0;
    std::int64_t batches_done = first_batch;
    const auto batches = sampler.batches_from(o.batch_size, first_batch);
    const std::int64_t epoch_batches = first_batch + std::int64_t(batches.size());
    for (const auto batch : batches) {
      float loss = 0;
      const auto step_start = clock::now();
      clock::time_point backward_done;
      if (mixed_step) {
        loss = model.forward_backward(data, batch);  // the reduction is in mixed_step->step(), below
        backward_done = clock::now();
      } else if (host_mirrors) {
        loss = model.forward_backward(data, batch);
        backward_done = clock::now();
        thrust::copy(model.grads().begin(), model.grads().end(), host_grads.begin());
        if (replicated) {
          replicated->synchronize();
        } else {
          for (std::size_t i = 0; i < model.slots().size(); ++i) sharded->mark_ready(i);
          sharded->finish();
        }
        if (plain) thrust::copy(host_grads.begin(), host_grads.end(), model.grads().begin());
      } else {
        loss = model.forward_backward(data, batch, [&](int i) { mark_ready(std::size_t(i)); });
        backward_done = clock::now();
        // Waits for the bucket reductions: the gradients (ZeRO: this rank's shard) are the mean over ranks.
        replicated ? replicated->finish() : with_sharded([](auto& w) { w.finish(); });
      }
      const auto synchronized = clock::now();
      const double step_lr = lr.at(step++);
      if (plain) {
        model.sgd_step(step_lr);
      } else {
        optimizer.set_lr(step_lr);
#if defined(__CUDACC__)
        if (device_optimizer) device_optimizer->set_lr(step_lr);
#endif
        if (mixed_step) {
          mixed_step->step(params.grads, params.values);
        } else if (o.zero > 0) {
          with_sharded([](auto& w) { w.step(); });  // the shard's clip and step, then the parameters are complete again
        } else if (!on_device) {
          step_replicated(optimizer, o.clip, model.slots(), params.values, params.grads);
        } else {
#if defined(__CUDACC__)
          step_replicated_on_device(*device_optimizer, o.clip, params.values, params.grads);
#endif
        }
        if (host_mirrors) model.set_values(host_values);
      }
      rep.compute_seconds += seconds(backward_done - step_start) + seconds(clock::now() - synchronized);
      rep.exposed_communication_seconds += seconds(synchronized - backward_done);
      ++rep.steps;
      total_loss += loss;
      if (rank == 0) rep.step_losses_rank0.push_back(loss);
      rep.samples_processed += double(batch.size());
      ++batches_done;
      // The epoch's last step is a checkpoint point after the epoch's end (below).
      if (batches_done == epoch_batches) break;
      if (checkpointing && checkpoint_point(epoch, batches_done, total_loss)) return ddp::preemption::requeue_exit_code;
      if (at_max_steps()) break;
    }
    if (batches_done < epoch_batches) break;  // --max-steps within the epoch: no line for it
    totals.push_back(total_loss);
    probe.sample();
    if (rank == 0) {
      rep.printed_lines.push_back(epoch_line(epoch, total_loss));
      std::printf("%s\n", rep.printed_lines.back().c_str());
      std::fflush(stdout);
    }
    if (all.heldout.n > 0) {  // every held-out sample once: rank r takes r, r + W, ...
      const auto e0 = clock::now();
      const auto comm0 = group.stats()[ddp::collective::all_reduce].time;
      const eval_result mine = model.evaluate(all.heldout, rank, world);
      std::vector<std::int64_t> hits{mine.correct, mine.count};
      std::vector<double> loss{mine.loss_sum};
      group.all_reduce(std::span<std::int64_t>(hits), ddp::sum{});
      group.all_reduce(std::span<double>(loss), ddp::sum{});
      note_heldout(rep, epoch, eval_result{long(hits[0]), long(hits[1]), loss[0]}, rank == 0);
      eval_seconds += seconds(clock::now() - e0);
      eval_communication += group.stats()[ddp::collective::all_reduce].time - comm0;
    }
    // The epoch's last step, after its line and held-out evaluation: saved as the next epoch's
    // start, so a resume (and an elastic one, which restarts an interrupted epoch) repeats nothing.
    // An epoch resumed with all its batches done took no step here, and has no point.
    if (checkpointing && first_batch < epoch_batches && checkpoint_point(epoch + 1, 0, 0.0))
      return ddp::preemption::requeue_exit_code;
  }
  // Loop and communication time are the training's: the held-out evaluations are taken out.
  rep.communication_seconds = seconds(group.stats()[ddp::collective::all_reduce].time - comm_before - eval_communication);
  group.barrier();
  rep.train_loop_seconds = seconds(clock::now() - t0) - eval_seconds;

  // Exact evaluation: rank r takes samples r, r + W, ...: every sample exactly once.
  const eval_result e = model.evaluate(data, rank, world);
  std::vector<std::int64_t> counts{e.correct, e.count};
  std::vector<double> loss_sum{e.loss_sum};
  group.all_reduce(std::span<std::int64_t>(counts), ddp::sum{});
  group.all_reduce(std::span<double>(loss_sum), ddp::sum{});
  std::vector<double> processed{rep.samples_processed};
  group.all_reduce(std::span<double>(processed), ddp::sum{});

  std::vector<double> all_totals(totals.size() * std::size_t(world));
  group.all_gather(std::span<const double>(totals), std::span<double>(all_totals));
  std::uint64_t state_bytes = optimizer.state_bytes();
#if defined(__CUDACC__)
  if (device_optimizer) state_bytes = device_optimizer->state_bytes();
#endif
  const std::vector<std::int64_t> mine{peak_rss_bytes(), probe.peak, std::int64_t(state_bytes)};
  std::vector<std::int64_t> memory(3 * std::size_t(world));
  group.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(memory));

  if (rank == 0 && !o.report.empty()) {
    rep.eval_correct = counts[0];
    rep.eval_samples = counts[1];
    rep.eval_loss_sum = loss_sum[0];
    rep.samples_processed = processed[0];
    for (int r = 0; r < world; ++r) {
      rep.epoch_loss_sums_by_rank.emplace_back(all_totals.begin() + std::ptrdiff_t(r * totals.size()),
                                               all_totals.begin() + std::ptrdiff_t((r + 1) * totals.size()));
      rep.peak_rss_bytes_by_rank.push_back(memory[3 * std::size_t(r)]);
      rep.peak_device_memory_bytes = std::max(rep.peak_device_memory_bytes, memory[3 * std::size_t(r) + 1]);
      if (!plain) rep.optimizer_state_bytes_by_rank.push_back(memory[3 * std::size_t(r) + 2]);
    }
    rep.final_params = model.host_values();
    if (mixed_step) {
      rep.final_loss_scale = mixed_step->loss_scale();
      rep.skipped_steps = mixed_step->skipped_steps();
    }
    write_report(o.report, rep);
  }
  return 0;
}

template <class Gemm>
int run(const options& o, Gemm gemm) {
  return o.simulate_world > 0 ? run_simulation(o, gemm) : run_distributed(o, gemm);
}

inline int run_with_gemm(const options& o) {
  if (o.gemm == "exact") return run(o, exact_gemm<device_policy>{});
#if defined(__CUDACC__)
  if (o.gemm == "cublas") return run(o, cublas_gemm{});
  throw std::invalid_argument("--gemm " + o.gemm + ": this CUDA build has exact and cublas");
#elif defined(TRAIN_HAVE_EIGEN)
  if (o.gemm == "eigen") return run(o, eigen_gemm{});
  if (o.gemm == "fast") return run(o, fast_gemm{});
  throw std::invalid_argument("--gemm " + o.gemm + ": this CPU build has exact, eigen and fast");
#else
  if (o.gemm == "fast") return run(o, fast_gemm{});
  throw std::invalid_argument("--gemm " + o.gemm + ": this build has exact and fast (Eigen was not found)");
#endif
}

}  // namespace train

int main(int argc, char** argv) {
  try {
    const train::options o = train::parse_options(argc, argv);
    const bool launched = std::getenv("RANK") != nullptr;  // a rank of a job, not the command a user typed
    if (!o.scaling.empty() && !launched) return train::run_scaling(o, argc, argv);
    if (o.nproc_per_node > 1 && o.simulate_world == 0 && !launched) {
      // Like `torchrun --standalone --nproc-per-node N train_ddp ...`: N copies of this binary.
      std::vector<std::string> args(argv, argv + argc);
      args[0] = std::filesystem::read_symlink("/proc/self/exe").string();
      return ddp::launch(train::local_launch(o.nproc_per_node), args).exit_code;
    }
#if defined(__CUDACC__)
    if (const char* lr = std::getenv("LOCAL_RANK")) {
      int devices = 0;
      if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) cudaSetDevice(std::atoi(lr) % devices);
    }
#endif
    return train::run_with_gemm(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_ddp: %s\n", e.what());
    return 1;
  }
}
