#pragma once
// train_ddp's --report: one JSON object, written by rank 0.

#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch_math.hpp"

namespace train {

/// Peak resident set size of this process in bytes (getrusage's ru_maxrss is in KiB on Linux).
inline std::int64_t peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

struct report {
  std::string dataset = "tutorial";
  std::string build;  // "cpu" or "cuda"
  std::string backend, gemm;
  int world_size = 1;
  bool simulated = false;
  int epochs = 0;
  long batch_size = 0, samples = 0;
  int features = 0, hidden = 0, classes = 0;
  double lr = 0;
  std::string lr_scaling = "none";
  int warmup_epochs = 0;
  long base_batch = 0, global_batch = 0;
  double peak_lr = 0;  // the lr after warmup (lr when --lr-scaling none)
  std::vector<std::vector<double>> epoch_loss_sums_by_rank;
  std::vector<std::string> printed_lines;
  std::vector<float> step_losses_rank0;
  double train_loop_seconds = 0;
  // Rank 0's training loop split up: forward, backward and SGD (compute); the bucket all-reduces
  // from start to end (communication, mostly overlapped with backward); what finish() waited for
  // after backward (exposed communication).
  long steps = 0;
  double compute_seconds = 0, communication_seconds = 0, exposed_communication_seconds = 0;
  double samples_processed = 0;  // over all ranks, padding included (what the ranks computed)
  std::vector<std::int64_t> peak_rss_bytes_by_rank;
  std::int64_t peak_device_memory_bytes = -1;  // CUDA build only
  long eval_samples = 0, eval_correct = 0;  // the final model over the training data (digits: its training split)
  double eval_loss_sum = 0;
  std::vector<float> final_params;  // flat, named_parameters() order
  // --dataset digits: after every epoch, over the held-out split (each sample once).
  long heldout_samples = 0;
  std::vector<double> heldout_accuracy_by_epoch, heldout_loss_by_epoch;
  // --checkpoint-dir: the step this run resumed from (-1: it started from step 0), the checkpoints it saved.
  bool checkpointing = false;
  long resumed_from_step = -1;
  int resumed_from_world_size = 0;  // the world size that saved the checkpoint resumed (0: none)
  std::vector<long> checkpoints_saved;
  // The step (optimizer.hpp): --optimizer, its options, --clip, --zero, and the optimizer state
  // and gradient-shard bytes each rank kept (ZeRO: its shard; DDP: the whole model).
  std::string optimizer = "sgd";
  double momentum = 0, weight_decay = 0, clip = 0;
  int zero = 0;
  std::vector<std::int64_t> optimizer_state_bytes_by_rank;
  // --precision (precision.hpp): fp16's loss scale after the last step and the steps it skipped.
  std::string precision = "fp32";
  double final_loss_scale = 1.0;
  std::int64_t skipped_steps = 0;
};

namespace detail {
inline std::string num(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}
inline std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}
template <class T, class F>
std::string list(const std::vector<T>& v, F f) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + f(v[i]);
  return out + "]";
}
}  // namespace detail

inline std::string to_json(const report& r) {
  using namespace detail;
  const auto d = [](double v) { return num(v); };
  const auto i64 = [](std::int64_t v) { return std::to_string(v); };
  std::string s = "{\n";
  s += "  \"dataset\": " + quoted(r.dataset) + ",\n";
  s += "  \"build\": " + quoted(r.build) + ",\n";
  s += "  \"backend\": " + quoted(r.backend) + ",\n";
  s += "  \"gemm\": " + quoted(r.gemm) + ",\n";
  s += "  \"world_size\": " + std::to_string(r.world_size) + ",\n";
  s += "  \"simulated\": " + std::string(r.simulated ? "true" : "false") + ",\n";
  s += "  \"epochs\": " + std::to_string(r.epochs) + ",\n";
  s += "  \"batch_size\": " + std::to_string(r.batch_size) + ",\n";
  s += "  \"samples\": " + std::to_string(r.samples) + ",\n";
  s += "  \"features\": " + std::to_string(r.features) + ",\n";
  s += "  \"hidden\": " + std::to_string(r.hidden) + ",\n";
  s += "  \"classes\": " + std::to_string(r.classes) + ",\n";
  s += "  \"lr\": " + num(r.lr) + ",\n";
  s += "  \"lr_scaling\": " + quoted(r.lr_scaling) + ",\n";
  s += "  \"warmup_epochs\": " + std::to_string(r.warmup_epochs) + ",\n";
  s += "  \"base_batch\": " + std::to_string(r.base_batch) + ",\n";
  s += "  \"global_batch\": " + std::to_string(r.global_batch) + ",\n";
  s += "  \"peak_lr\": " + num(r.peak_lr) + ",\n";
  s += "  \"optimizer\": " + quoted(r.optimizer) + ",\n";
  s += "  \"momentum\": " + num(r.momentum) + ",\n";
  s += "  \"weight_decay\": " + num(r.weight_decay) + ",\n";
  s += "  \"clip\": " + num(r.clip) + ",\n";
  s += "  \"zero\": " + std::to_string(r.zero) + ",\n";
  s += "  \"precision\": " + quoted(r.precision) + ",\n";
  s += "  \"final_loss_scale\": " + num(r.final_loss_scale) + ",\n";
  s += "  \"skipped_steps\": " + std::to_string(r.skipped_steps) + ",\n";
  if (!r.optimizer_state_bytes_by_rank.empty())
    s += "  \"optimizer_state_bytes_by_rank\": " + list(r.optimizer_state_bytes_by_rank, i64) + ",\n";
  s += "  \"printed_lines\": " + list(r.printed_lines, quoted) + ",\n";
  s += "  \"epoch_loss_sums_by_rank\": " +
       list(r.epoch_loss_sums_by_rank, [&](const std::vector<double>& v) { return list(v, d); }) + ",\n";
  s += "  \"step_losses_rank0\": " + list(r.step_losses_rank0, [](float v) { return num(v); }) + ",\n";
  s += "  \"train_loop_seconds\": " + num(r.train_loop_seconds) + ",\n";
  s += "  \"steps\": " + std::to_string(r.steps) + ",\n";
  s += "  \"compute_seconds\": " + num(r.compute_seconds) + ",\n";
  s += "  \"communication_seconds\": " + num(r.communication_seconds) + ",\n";
  s += "  \"exposed_communication_seconds\": " + num(r.exposed_communication_seconds) + ",\n";
  s += "  \"throughput_samples_per_s\": " + num(r.train_loop_seconds > 0 ? r.samples_processed / r.train_loop_seconds : 0) + ",\n";
  s += "  \"peak_rss_bytes_by_rank\": " + list(r.peak_rss_bytes_by_rank, i64) + ",\n";
  if (r.peak_device_memory_bytes >= 0) s += "  \"peak_device_memory_bytes\": " + i64(r.peak_device_memory_bytes) + ",\n";
  s += "  \"eval_samples\": " + std::to_string(r.eval_samples) + ",\n";
  s += "  \"final_accuracy\": " + num(r.eval_samples ? double(r.eval_correct) / double(r.eval_samples) : 0) + ",\n";
  s += "  \"final_mean_loss\": " + num(r.eval_samples ? r.eval_loss_sum / double(r.eval_samples) : 0) + ",\n";
  if (r.heldout_samples > 0 && !r.heldout_accuracy_by_epoch.empty()) {
    s += "  \"heldout_samples\": " + std::to_string(r.heldout_samples) + ",\n";
    s += "  \"heldout_accuracy_by_epoch\": " + list(r.heldout_accuracy_by_epoch, d) + ",\n";
    s += "  \"heldout_loss_by_epoch\": " + list(r.heldout_loss_by_epoch, d) + ",\n";
    s += "  \"heldout_accuracy\": " + num(r.heldout_accuracy_by_epoch.back()) + ",\n";
    s += "  \"heldout_mean_loss\": " + num(r.heldout_loss_by_epoch.back()) + ",\n";
  }
  if (r.checkpointing) {
    s += "  \"resumed\": " + std::string(r.resumed_from_step >= 0 ? "true" : "false") + ",\n";
    s += "  \"resumed_from_step\": " + (r.resumed_from_step >= 0 ? std::to_string(r.resumed_from_step) : "null") + ",\n";
    s += "  \"resumed_from_world_size\": " + (r.resumed_from_step >= 0 ? std::to_string(r.resumed_from_world_size) : "null") + ",\n";
    s += "  \"checkpoints_saved\": " + list(r.checkpoints_saved, [](long v) { return std::to_string(v); }) + ",\n";
  }
  s += "  \"final_params_bits\": " +
       list(r.final_params, [](float v) { return std::to_string(to_bits(v)); }) + "\n";
  return s + "}\n";
}

inline void write_report(const std::string& path, const report& r) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write the report to '" + path + "'");
  const std::string text = to_json(r);
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("writing the report to '" + path + "' failed");
}

}  // namespace train
