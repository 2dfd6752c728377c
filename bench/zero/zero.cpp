// ddp_bench_zero: what ZeRO (sharded_data_parallel, stages 1 and 2) keeps per rank and what a step
// costs, against distributed_data_parallel with the full optimizer on every rank.
//
//   ddp_bench_zero [--worlds 2,4] [--optimizers adamw,sgd] [--model IN,HIDDEN,LAYERS,OUT]
//                  [--steps 10] [--warmup 2] [--repeat 3] [--micro-steps 1] [--bucket-cap-mb 25]
//                  [--compute-ms 0] [--report FILE.md] [--csv FILE.csv]
//
// The model is a list of parameters shaped like an MLP: Linear(IN, HIDDEN), LAYERS - 2 times
// Linear(HIDDEN, HIDDEN), Linear(HIDDEN, OUT), each a weight and a bias (the defaults:
// 4096,1536,10,1000, 26.7 M float32 values), stored as one flat value buffer and one flat gradient
// buffer in declaration order, as train_ddp stores its model: DDP reduces such buckets in place
// (its strongest case: no bucket buffers, no copies) and its optimizer runs once over the whole
// span. There is no forward pass: a fake backward writes each gradient (a constant per tensor,
// step and rank: memory traffic like a backward's output, no arithmetic) in reverse parameter
// order and marks it ready after writing it, as autograd's hooks would; --compute-ms spins that
// long per backward, spread over the tensors by size, to stand in for the arithmetic.
//
// Modes, each with AdamW (torch's defaults, lr 1e-3) and SGD (momentum 0.9):
//  - ddp:   distributed_data_parallel, finish(), then the optimizer over all parameters;
//  - zero1: sharded_data_parallel stage 1 (optimizer state and master parameters sharded);
//  - zero2: stage 2 (the accumulated gradients sharded too).
// With --micro-steps K the first K - 1 backward passes run under no_sync() (accumulation: later
// passes add to the gradients, the first overwrites them, as after zero_grad(set_to_none)).
//
// Every (world size, optimizer, mode) is its own job of this binary started by ddp::launch (p
// processes over the ring backend's shared-memory transport), so that each process's peak RSS
// (VmHWM) belongs to one configuration. Jobs are interleaved: per repetition and (world,
// optimizer) the three modes run back to back, the order rotating with the repetition, so that a
// slow phase of the machine hits all modes alike. In a job every step starts at a barrier (not
// timed); a step's time is its slowest rank's, from the barrier to the end of the optimizer step
// (backward, synchronization, optimizer, ZeRO's all-gather); --warmup steps are not timed.
//
// What each memory column is (bytes per rank, the largest over the ranks):
//  - optimizer state: what the optimizer's state() holds (exp_avg + exp_avg_sq; momentum_buffer);
//  - wrapper gradients: the gradient shard sharded_data_parallel owns (stats().shard_gradient_bytes;
//    DDP keeps none of its own);
//  - gradients kept: the gradient bytes that live across micro-steps until the optimizer reads
//    them. DDP: the model's gradients (no_sync accumulates in them, the all-reduce averages them
//    in place). Stage 1: the model's gradients (they still accumulate) plus the wrapper's shard
//    gradient. Stage 2: the wrapper's shard accumulator alone (stats().accumulation_bytes): the
//    model's buffer only carries the current backward's gradients until their bucket is handed
//    over, which zeroes them, so a model could release it bucket by bucket;
//  - the model's own gradient buffer exists in every mode (the fake backward writes it), so it is
//    in every process's RSS; it is reported once, above the table;
//  - master parameters: the shard the optimizer steps (DDP: none, it steps the model's values);
//  - communication buffers: DDP's bucket buffers (none here: in place), the wrapper's;
//  - peak RSS: VmHWM of /proc/self/status at the end of the job.
// The checks (a measurement, never the exit code): stage 1 and 2 optimizer state / DDP's <=
// 1.01 / W, stage 2 gradients kept / DDP's <= 1.01 / W; step time / DDP's <= 1.05, the median of
// the per-repetition ratios.
//
// Output: progress lines on stderr, the Markdown table on stdout and in --report, every job in --csv.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/bench_table.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/init.hpp"
#include "ddp/launch.hpp"
#include "ddp/optim/adamw.hpp"
#include "ddp/optim/sgd.hpp"
#include "ddp/parameters.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct model_shape {
  int in = 4096, hidden = 1536, layers = 10, out = 1000;
};

struct options {
  std::vector<int> worlds{2, 4};
  std::vector<std::string> optimizers{"adamw", "sgd"};
  model_shape shape;
  int steps = 10;
  int warmup = 2;
  int repeat = 3;
  int micro_steps = 1;
  int bucket_cap_mb = 25;
  double compute_ms = 0;
  std::string report, csv;
  // Set by the driver for the jobs it launches.
  std::string worker_mode;  // empty: this process is the driver
  std::string worker_optimizer;
  std::string worker_out;
};

const std::vector<std::string> all_modes{"ddp", "zero1", "zero2"};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: ddp_bench_zero [--worlds 2,4] [--optimizers adamw,sgd] [--model IN,HIDDEN,LAYERS,OUT]\n"
               "       [--steps N] [--warmup N] [--repeat R] [--micro-steps K] [--bucket-cap-mb MB] [--compute-ms MS]\n"
               "       [--report FILE.md] [--csv FILE.csv]\n",
               why.c_str());
  std::exit(2);
}

int to_int(const std::string& flag, const std::string& v) {
  const auto x = ddp::bench::parse_int(v, 0, 1'000'000'000);
  if (!x) usage(flag + " " + v + ": expected a non-negative integer");
  return *x;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--worlds") {
      o.worlds.clear();
      for (const auto& w : ddp::bench::split_commas(value())) o.worlds.push_back(to_int(a, w));
    } else if (a == "--optimizers") o.optimizers = ddp::bench::split_commas(value());
    else if (a == "--model") {
      const auto parts = ddp::bench::split_commas(value());
      if (parts.size() != 4) usage("--model expects IN,HIDDEN,LAYERS,OUT");
      o.shape = {to_int(a, parts[0]), to_int(a, parts[1]), to_int(a, parts[2]), to_int(a, parts[3])};
    } else if (a == "--steps") o.steps = to_int(a, value());
    else if (a == "--warmup") o.warmup = to_int(a, value());
    else if (a == "--repeat") o.repeat = to_int(a, value());
    else if (a == "--micro-steps") o.micro_steps = to_int(a, value());
    else if (a == "--bucket-cap-mb") o.bucket_cap_mb = to_int(a, value());
    else if (a == "--compute-ms") o.compute_ms = std::strtod(value().c_str(), nullptr);
    else if (a == "--report") o.report = value();
    else if (a == "--csv") o.csv = value();
    else if (a == "--worker-mode") o.worker_mode = value();
    else if (a == "--worker-optimizer") o.worker_optimizer = value();
    else if (a == "--worker-out") o.worker_out = value();
    else if (a == "--help" || a == "-h") usage("ddp_bench_zero: ZeRO-1/2 memory per rank and step time against DDP");
    else usage("unknown flag " + a);
  }
  if (o.worlds.empty()) usage("--worlds: at least one world size");
  for (int w : o.worlds)
    if (w < 2 || w > 64) usage("--worlds: each must be 2..64");
  for (const auto& name : o.optimizers)
    if (name != "adamw" && name != "sgd") usage("--optimizers " + name + ": expected adamw or sgd");
  if (o.optimizers.empty()) usage("--optimizers: at least one");
  if (o.shape.in < 1 || o.shape.hidden < 1 || o.shape.layers < 2 || o.shape.out < 1) usage("--model: sizes >= 1, LAYERS >= 2");
  if (o.steps < 1 || o.repeat < 1 || o.micro_steps < 1) usage("--steps, --repeat and --micro-steps must be at least 1");
  if (o.bucket_cap_mb < 1) usage("--bucket-cap-mb must be at least 1");
  if (!(o.compute_ms >= 0)) usage("--compute-ms must be >= 0");
  return o;
}

// --- the model -------------------------------------------------------------------------

/// An MLP's parameters without the arithmetic: one flat buffer of values and one of gradients,
/// each tensor a slice of them in declaration order.
struct flat_model {
  struct tensor {
    std::string name;
    std::vector<std::int64_t> shape;
    std::size_t offset = 0, numel = 0;
  };
  std::vector<tensor> tensors;
  std::vector<float> values, grads;

  explicit flat_model(const model_shape& s) {
    std::size_t offset = 0;
    auto add = [&](std::string name, std::vector<std::int64_t> shape) {
      std::size_t n = 1;
      for (auto d : shape) n *= static_cast<std::size_t>(d);
      tensors.push_back({std::move(name), std::move(shape), offset, n});
      offset += n;
    };
    for (int l = 0; l < s.layers; ++l) {
      const int in = l == 0 ? s.in : s.hidden;
      const int out = l + 1 == s.layers ? s.out : s.hidden;
      add("layer" + std::to_string(l) + ".weight", {out, in});
      add("layer" + std::to_string(l) + ".bias", {out});
    }
    values.resize(offset);
    grads.assign(offset, 0.0f);
    // Small values that differ by tensor and element (rank 0's are broadcast at construction).
    for (std::size_t i = 0; i < offset; ++i) values[i] = 0.01f * static_cast<float>(static_cast<int>(i % 201) - 100) / 100.0f;
  }
  std::size_t numel() const { return values.size(); }
  std::span<float> value(std::size_t k) { return std::span<float>(values).subspan(tensors[k].offset, tensors[k].numel); }
  std::span<float> grad(std::size_t k) { return std::span<float>(grads).subspan(tensors[k].offset, tensors[k].numel); }

  friend std::vector<ddp::parameter_ref> parameters(flat_model& m) {
    std::vector<ddp::parameter_ref> out;
    for (std::size_t k = 0; k < m.tensors.size(); ++k)
      out.push_back(ddp::make_parameter(m.value(k), m.grad(k), m.tensors[k].shape, m.tensors[k].name));
    return out;
  }
};

std::size_t model_numel(const model_shape& s) {
  std::size_t n = 0;
  for (int l = 0; l < s.layers; ++l) {
    const auto in = static_cast<std::size_t>(l == 0 ? s.in : s.hidden);
    const auto out = static_cast<std::size_t>(l + 1 == s.layers ? s.out : s.hidden);
    n += out * in + out;
  }
  return n;
}

/// Bytes in the optimizer's state() buffers: the same count for the full and the sharded optimizer.
template <class Optimizer>
std::uint64_t state_bytes(const Optimizer& opt) {
  const auto& s = opt.state();
  std::uint64_t n = 0;
  if constexpr (requires { s.momentum_buffer; }) n += s.momentum_buffer.size() * sizeof(float);
  if constexpr (requires { s.exp_avg; }) n += (s.exp_avg.size() + s.exp_avg_sq.size() + s.max_exp_avg_sq.size()) * sizeof(float);
  return n;
}

/// This process's peak resident set (VmHWM), in bytes.
std::uint64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  return 0;
}

// --- the worker: one configuration ------------------------------------------------------

/// What a job reports: memory per rank (the largest over the ranks) and its steps' times.
struct job_result {
  std::uint64_t optimizer_state = 0, wrapper_gradients = 0, gradients_kept = 0, model_gradients = 0, master = 0, comm_buffers = 0,
                peak_rss = 0;
  std::size_t buckets = 0;
  double checksum = 0;           // sum of rank 0's parameters at the end: equal modes, equal values
  std::vector<double> step_ms;   // the slowest rank's, per timed step
};

/// Spins for `ms` milliseconds: the backward's arithmetic, without touching memory.
void spin(double ms) {
  if (ms <= 0) return;
  const auto until = clock_type::now() + std::chrono::duration<double, std::milli>(ms);
  while (clock_type::now() < until) {
  }
}

template <class Optimizer>
job_result run_mode(const options& o, const std::string& mode, Optimizer opt, ddp::group& group) {
  flat_model model(o.shape);
  const int rank = group.rank();
  const double total = static_cast<double>(model.numel());
  // Backward: the gradients in reverse parameter order, each marked ready once written.
  auto backward = [&](int step, int micro, auto&& mark_ready) {
    for (std::size_t k = model.tensors.size(); k-- > 0;) {
      spin(o.compute_ms * static_cast<double>(model.tensors[k].numel) / total);
      const float g = 1e-3f * static_cast<float>(1 + (rank + static_cast<int>(k) + step) % 5);
      auto grad = model.grad(k);
      if (micro == 0) std::fill(grad.begin(), grad.end(), g);
      else
        for (auto& x : grad) x += g;
      mark_ready(k);
    }
  };

  job_result r;
  std::vector<double> mine;
  auto timed_loop = [&](auto&& one_step) {
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      group.barrier();
      const auto t0 = clock_type::now();
      one_step(s);
      const auto t1 = clock_type::now();
      if (s >= o.warmup) mine.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  };

  const std::size_t cap = static_cast<std::size_t>(o.bucket_cap_mb) << 20;
  if (mode == "ddp") {
    ddp::data_parallel_options dpo;
    dpo.bucket_cap_bytes = cap;
    ddp::distributed_data_parallel net{model, group, dpo};
    timed_loop([&](int s) {
      for (int m = 0; m < o.micro_steps; ++m) {
        auto guard = m + 1 < o.micro_steps ? std::optional(net.no_sync()) : std::nullopt;
        backward(s, m, [&](std::size_t k) { net.mark_ready(k); });
        net.finish();
      }
      if (o.micro_steps > 1) {
        const float k = static_cast<float>(o.micro_steps);
        for (auto& g : model.grads) g /= k;
      }
      opt.step(std::span<float>(model.values), std::span<const float>(model.grads));
    });
    r.optimizer_state = state_bytes(opt);
    r.gradients_kept = model.numel() * sizeof(float);
    for (const auto& b : net.buckets())
      if (!b.in_place) r.comm_buffers += b.bytes;
    r.buckets = net.buckets().size();
  } else {
    ddp::sharded_options so;
    so.stage = mode == "zero1" ? 1 : 2;
    so.bucket_cap_bytes = cap;
    ddp::sharded_data_parallel net{model, group, opt, so};
    timed_loop([&](int s) {
      for (int m = 0; m < o.micro_steps; ++m) {
        auto guard = m + 1 < o.micro_steps ? std::optional(net.no_sync()) : std::nullopt;
        backward(s, m, [&](std::size_t k) { net.mark_ready(k); });
        net.finish();
      }
      net.step();
    });
    const auto st = net.stats();
    r.optimizer_state = state_bytes(opt);
    r.wrapper_gradients = st.shard_gradient_bytes;
    // accumulation_bytes: stage 1 the model's gradients, stage 2 the shard accumulator itself.
    r.gradients_kept = st.accumulation_bytes + (so.stage == 1 ? st.shard_gradient_bytes : 0);
    r.master = st.master_parameter_bytes;
    r.comm_buffers = st.bucket_buffer_bytes;
    r.buckets = st.buckets;
  }
  r.model_gradients = model.numel() * sizeof(float);
  r.peak_rss = peak_rss_bytes();
  for (float v : model.values) r.checksum += v;

  // The largest of each figure over the ranks; the slowest rank per step.
  std::vector<std::int64_t> bytes;
  for (auto* field : {&r.optimizer_state, &r.wrapper_gradients, &r.gradients_kept, &r.master, &r.comm_buffers, &r.peak_rss})
    bytes.push_back(static_cast<std::int64_t>(*field));
  group.all_reduce(std::span<std::int64_t>(bytes), ddp::max{});
  std::size_t i = 0;
  for (auto* field : {&r.optimizer_state, &r.wrapper_gradients, &r.gradients_kept, &r.master, &r.comm_buffers, &r.peak_rss})
    *field = static_cast<std::uint64_t>(bytes[i++]);
  group.all_reduce(std::span<double>(mine), ddp::max{});
  r.step_ms = mine;
  return r;
}

int run_worker(const options& o) {
  ddp::group group = ddp::init_process_group("shm");
  const job_result r = o.worker_optimizer == "adamw"
                           ? run_mode(o, o.worker_mode, ddp::optim::adamw<float>{{.lr = 1e-3}}, group)
                           : run_mode(o, o.worker_mode, ddp::optim::sgd<float>{{.lr = 1e-3, .momentum = 0.9}}, group);
  group.barrier();
  if (group.rank() == 0) {
    std::ofstream out(o.worker_out);
    out.precision(17);
    out << r.optimizer_state << ' ' << r.wrapper_gradients << ' ' << r.gradients_kept << ' ' << r.model_gradients << ' ' << r.master << ' ' << r.comm_buffers
        << ' ' << r.peak_rss << ' ' << r.buckets << ' ' << r.checksum << ' ' << r.step_ms.size();
    for (double t : r.step_ms) out << ' ' << t;
    out << '\n';
    if (!out) throw std::runtime_error("cannot write " + o.worker_out);
  }
  return 0;
}

// --- the driver: launches the jobs, builds the table -----------------------------------

struct config {
  int world = 2;
  std::string optimizer, mode;
  std::string label() const { return "W=" + std::to_string(world) + " " + optimizer + " " + mode; }
};

job_result run_job(const config& c, int argc, char** argv, const std::string& out_path) {
  std::vector<std::string> args(argv, argv + argc);
  args[0] = std::filesystem::read_symlink("/proc/self/exe").string();
  args.insert(args.end(), {"--worker-mode", c.mode, "--worker-optimizer", c.optimizer, "--worker-out", out_path});
  ddp::launch_options lo;
  lo.nproc_per_node = c.world;
  lo.standalone = true;
  lo.master_port = 0;
  lo.name = "ddp_bench_zero";
  std::filesystem::remove(out_path);
  const auto result = ddp::launch(lo, args);
  if (!result.ok()) throw std::runtime_error("the " + c.label() + " job failed (exit code " + std::to_string(result.exit_code) + ")");
  std::ifstream in(out_path);
  job_result r;
  std::size_t n = 0;
  if (!(in >> r.optimizer_state >> r.wrapper_gradients >> r.gradients_kept >> r.model_gradients >> r.master >> r.comm_buffers >> r.peak_rss >> r.buckets >>
        r.checksum >> n))
    throw std::runtime_error("the " + c.label() + " job wrote no results to " + out_path);
  r.step_ms.resize(n);
  for (auto& t : r.step_ms) in >> t;
  std::filesystem::remove(out_path);
  return r;
}

std::string fixed(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

std::string mib(std::uint64_t bytes) { return fixed(static_cast<double>(bytes) / (1 << 20), 1); }

/// The p-th percentile (0..100) by linear interpolation.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double x = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto i = static_cast<std::size_t>(x);
  const double f = x - static_cast<double>(i);
  return i + 1 < v.size() ? v[i] * (1 - f) + v[i + 1] * f : v[i];
}

int run_driver(const options& o, int argc, char** argv) {
  const std::string out_path =
      (std::filesystem::temp_directory_path() / ("ddp_bench_zero_" + std::to_string(::getpid()) + ".txt")).string();
  std::vector<config> configs;
  for (int w : o.worlds)
    for (const auto& opt : o.optimizers)
      for (const auto& mode : all_modes) configs.push_back({w, opt, mode});
  const std::size_t modes = all_modes.size();

  // runs[config][repetition]
  std::vector<std::vector<job_result>> runs(configs.size());
  const std::size_t jobs = configs.size() * static_cast<std::size_t>(o.repeat);
  std::size_t done = 0;
  for (int rep = 0; rep < o.repeat; ++rep)
    for (std::size_t group = 0; group < configs.size(); group += modes)
      for (std::size_t k = 0; k < modes; ++k) {
        const std::size_t c = group + (k + static_cast<std::size_t>(rep)) % modes;
        const auto t0 = clock_type::now();
        job_result r = run_job(configs[c], argc, argv, out_path);
        const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
        std::fprintf(stderr, "[%zu/%zu] %-16s repetition %d: %8.1f ms/step (median of %zu), peak RSS %s MiB, %.1f s\n", ++done, jobs,
                     configs[c].label().c_str(), rep + 1, ddp::bench::median(r.step_ms), r.step_ms.size(), mib(r.peak_rss).c_str(), secs);
        runs[c].push_back(std::move(r));
      }

  const std::size_t numel = model_numel(o.shape);
  std::ostringstream md;
  md << "ZeRO against DDP: bytes per rank (the largest over the ranks) and time per step (slowest rank), ring backend over shm.\n"
     << "- model: Linear(" << o.shape.in << ", " << o.shape.hidden << "), " << (o.shape.layers - 2) << " x Linear(" << o.shape.hidden << ", "
     << o.shape.hidden << "), Linear(" << o.shape.hidden << ", " << o.shape.out << "): " << 2 * o.shape.layers << " tensors, " << numel
     << " float32 parameters; the model's own gradient buffer (" << mib(numel * sizeof(float))
     << " MiB) is in every row's RSS\n"
     << "- " << o.steps << " timed steps after " << o.warmup << " warm-up, " << o.micro_steps << " micro-step(s) per step, "
     << o.repeat << " repetition(s) interleaved; bucket cap " << o.bucket_cap_mb << " MiB; fake backward";
  if (o.compute_ms > 0) md << " + " << fixed(o.compute_ms, 1) << " ms of spinning";
  md << "\n- step ms: median over every timed step of every repetition [10th-90th percentile]; / DDP: median over the repetitions of "
        "(the job's median / the same repetition's DDP median), "
        "[the smallest-the largest of those ratios]\n"
     << "- checks: memory = optimizer state / DDP's <= 1.01/W (stage 2 also gradients kept / DDP's <= 1.01/W); time = step / DDP's "
        "<= 1.05\n\n";
  md << "| W | optimizer | mode | optimizer state MiB | / DDP | wrapper gradients MiB | gradients kept MiB | / DDP | master params MiB | comm buffers MiB | "
        "opt + grads / DDP | peak RSS MiB | step ms [p10-p90] | / DDP [per repetition] | memory check | time check |\n";
  md << "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |\n";
  std::ostringstream csv;
  csv << "world,optimizer,mode,repetition,optimizer_state_bytes,wrapper_gradient_bytes,gradients_kept_bytes,model_gradient_bytes,master_bytes,"
         "comm_buffer_bytes,peak_rss_bytes,buckets,checksum,step_ms_median,step_ms_p10,step_ms_p90,steps\n";
  std::vector<std::string> mismatches;
  for (std::size_t c = 0; c < configs.size(); ++c) {
    const auto& cfg = configs[c];
    const auto& base = runs[c - c % modes];  // this world and optimizer's DDP jobs
    const auto& mine = runs[c];
    const job_result& r = mine.front();
    const job_result& d = base.front();
    std::vector<double> steps, ratios;
    std::uint64_t rss = 0;
    for (int rep = 0; rep < o.repeat; ++rep) {
      const auto& x = mine[static_cast<std::size_t>(rep)];
      steps.insert(steps.end(), x.step_ms.begin(), x.step_ms.end());
      ratios.push_back(ddp::bench::median(x.step_ms) / ddp::bench::median(base[static_cast<std::size_t>(rep)].step_ms));
      rss = std::max(rss, x.peak_rss);
      csv << cfg.world << ',' << cfg.optimizer << ',' << cfg.mode << ',' << rep + 1 << ',' << x.optimizer_state << ',' << x.wrapper_gradients << ',' << x.gradients_kept
          << ',' << x.model_gradients << ',' << x.master << ',' << x.comm_buffers << ',' << x.peak_rss << ',' << x.buckets << ','
          << fixed(x.checksum, 6) << ',' << fixed(ddp::bench::median(x.step_ms), 4) << ',' << fixed(percentile(x.step_ms, 10), 4) << ','
          << fixed(percentile(x.step_ms, 90), 4) << ',' << x.step_ms.size() << '\n';
      const double ref = base[static_cast<std::size_t>(rep)].checksum;
      if (std::fabs(x.checksum - ref) > 1e-6 * std::max(1.0, std::fabs(ref)))
        mismatches.push_back(cfg.label() + " repetition " + std::to_string(rep + 1) + ": " + fixed(x.checksum, 6) + " against DDP's " +
                             fixed(ref, 6));
    }
    const auto ratio = [](std::uint64_t a, std::uint64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b); };
    const double opt_ratio = ratio(r.optimizer_state, d.optimizer_state);
    const double grad_ratio = ratio(r.gradients_kept, d.gradients_kept);
    const double sum_ratio = ratio(r.optimizer_state + r.gradients_kept, d.optimizer_state + d.gradients_kept);
    const double time_ratio = ddp::bench::median(ratios);
    const double bound = 1.01 / cfg.world;
    std::string memory_check = "-", time_check = "-";
    if (cfg.mode != "ddp") {
      const bool ok = opt_ratio <= bound && (cfg.mode == "zero1" || grad_ratio <= bound);
      memory_check = std::string(ok ? "PASS" : "FAIL") + " (<= " + fixed(bound, 4) + ")";
      time_check = std::string(time_ratio <= 1.05 ? "PASS" : "FAIL");
    }
    md << "| " << cfg.world << " | " << cfg.optimizer << " | " << cfg.mode << " | " << mib(r.optimizer_state) << " | " << fixed(opt_ratio, 4)
       << " | " << mib(r.wrapper_gradients) << " | " << mib(r.gradients_kept) << " | " << fixed(grad_ratio, 4) << " | " << mib(r.master) << " | " << mib(r.comm_buffers) << " | "
       << fixed(sum_ratio, 4) << " | " << mib(rss) << " | " << fixed(ddp::bench::median(steps), 1) << " [" << fixed(percentile(steps, 10), 1)
       << "-" << fixed(percentile(steps, 90), 1) << "] | " << fixed(time_ratio, 3) << " ["
       << fixed(*std::min_element(ratios.begin(), ratios.end()), 2) << "-" << fixed(*std::max_element(ratios.begin(), ratios.end()), 2)
       << "] | " << memory_check << " | " << time_check << " |\n";
  }
  if (mismatches.empty()) {
    md << "\nParameters after the last step: every mode's sum equals DDP's (within 1e-6 relative) in every repetition.\n";
  } else {
    md << "\nWarning: parameters after the last step differ from DDP's:\n";
    for (const auto& m : mismatches) md << "- " << m << '\n';
  }

  std::fputs(md.str().c_str(), stdout);
  std::fflush(stdout);
  auto write = [](const std::string& path, const std::string& text) {
    if (path.empty()) return;
    std::ofstream f(path);
    f << text;
    if (!f) throw std::runtime_error("cannot write " + path);
  };
  write(o.report, md.str());
  write(o.csv, csv.str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    return o.worker_mode.empty() ? run_driver(o, argc, argv) : run_worker(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_zero: %s\n", e.what());
    return 1;
  }
}
