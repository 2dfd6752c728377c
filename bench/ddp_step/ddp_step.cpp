// ddp_bench_ddp_step: the overhead of DDP's gradient synchronization on a training step.
//
//   ddp_bench_ddp_step [--np 2] [--transports shm,tcp] [--models tutorial,wide] [--steps 30]
//                      [--warmup 5] [--repeat 1] [--wide IN,HIDDEN,OUT,BATCH] [--gemm exact|eigen]
//                      [--no-single] [--report FILE.md] [--csv FILE.csv]
//
// Models (examples/train_ddp/mlp.hpp, Thrust's CPP system, SGD without momentum):
//  - tutorial: Linear(10, 32)-ReLU-Linear(32, 2), batch 32, 418 parameters; GEMM --gemm
//    (default exact: train_ddp's default, PyTorch's summation order);
//  - wide: Linear(4096, 4096)-ReLU-Linear(4096, 10), batch 8, 16.8 M parameters (64 MiB of
//    float32 gradients), Eigen GEMM; --wide changes the shape. A step is ~65 ms on one core of
//    the 2-core development VM: 4096 x 4096 is the layer, the batch keeps the step short.
// A step is forward + backward + optimizer step, timed three ways, interleaved (the order
// rotates every round):
//  - synced: backward marks each gradient ready (bucket all-reduces start as in train_ddp),
//    finish() waits for them: the gradients are the mean over ranks;
//  - local: the same calls inside net.no_sync(): nothing is communicated;
//  - no DDP: forward_backward without the ready callback and no finish() at all.
// Each configuration runs as its own job of this binary started by ddp::launch (like torchrun
// --standalone): p = 1 (a world of one: DDP skips the all-reduce unless a hook is set), then p = --np
// for each transport of the ring backend. Before each timed step the ranks meet at a barrier
// (not timed); a step's time is the slowest rank's. After --warmup rounds, --steps rounds are
// timed; the table has the medians (with --repeat R, the median over the R jobs of each
// configuration's medians, the jobs interleaved). "all-reduce" is the time the group spent
// in all_reduce during a synced step (the last bucket's on the calling thread in finish(), any
// others on the communication thread), its share is that over the synced step time; "overhead" is synced - local. The CSV adds the parts of the step
// (forward + backward, SGD step) and the time finish() waited. Gradients are the model's own
// flat buffer, reduced in place (user memory, not group.allocate's shared memory).
//
// Output: the Markdown table on stdout (and in --report), CSV in --csv; progress on stderr when
// it is a terminal.
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
#include <map>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/bench_table.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/init.hpp"
#include "ddp/launch.hpp"
#include "ddp/parameters.hpp"
#include "ddp/random.hpp"
#include "mlp.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct model_spec {
  std::string name;
  int in = 0, hidden = 0, out = 0;
  long batch = 0;
};

struct options {
  int np = 2;
  std::vector<std::string> transports{"shm", "tcp"};
  std::vector<std::string> models{"tutorial", "wide"};
  int steps = 30;
  int warmup = 5;
  int repeat = 1;
  bool single = true;
  model_spec tutorial{"tutorial", 10, 32, 2, 32};
  model_spec wide{"wide", 4096, 4096, 10, 8};
  std::string gemm = "exact";
  double lr = 0.01;
  std::string report, csv;
  // Set by the driver for the jobs it launches.
  std::string worker_backend;  // empty: this process is the driver
  std::string worker_out;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: ddp_bench_ddp_step [--np N] [--transports shm,tcp] [--models tutorial,wide] [--steps N]\n"
               "       [--warmup N] [--repeat R] [--wide IN,HIDDEN,OUT,BATCH] [--gemm exact|eigen] [--lr X]\n"
               "       [--no-single] [--report FILE.md] [--csv FILE.csv]\n",
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
    if (a == "--np") o.np = to_int(a, value());
    else if (a == "--transports") o.transports = ddp::bench::split_commas(value());
    else if (a == "--models") o.models = ddp::bench::split_commas(value());
    else if (a == "--steps") o.steps = to_int(a, value());
    else if (a == "--warmup") o.warmup = to_int(a, value());
    else if (a == "--repeat") o.repeat = to_int(a, value());
    else if (a == "--no-single") o.single = false;
    else if (a == "--gemm") o.gemm = value();
    else if (a == "--lr") o.lr = std::strtod(value().c_str(), nullptr);
    else if (a == "--report") o.report = value();
    else if (a == "--csv") o.csv = value();
    else if (a == "--wide") {
      const auto parts = ddp::bench::split_commas(value());
      if (parts.size() != 4) usage("--wide expects IN,HIDDEN,OUT,BATCH");
      o.wide.in = to_int(a, parts[0]);
      o.wide.hidden = to_int(a, parts[1]);
      o.wide.out = to_int(a, parts[2]);
      o.wide.batch = to_int(a, parts[3]);
    } else if (a == "--worker") o.worker_backend = value();
    else if (a == "--worker-out") o.worker_out = value();
    else if (a == "--help" || a == "-h") usage("ddp_bench_ddp_step: time per DDP step with and without gradient synchronization");
    else usage("unknown flag " + a);
  }
  if (o.np < 2 || o.np > 64) usage("--np must be 2..64");
  if (o.steps < 1 || o.repeat < 1) usage("--steps and --repeat must be at least 1");
  for (const auto& t : o.transports)
    if (t != "shm" && t != "tcp" && t != "ring") usage("--transports " + t + ": expected shm, tcp or ring");
  for (const auto& m : o.models)
    if (m != "tutorial" && m != "wide") usage("--models " + m + ": expected tutorial or wide");
  if (o.gemm != "exact" && o.gemm != "eigen") usage("--gemm " + o.gemm + ": expected exact or eigen");
  if (o.wide.in < 1 || o.wide.hidden < 1 || o.wide.out < 2 || o.wide.batch < 1) usage("--wide: need IN, HIDDEN >= 1, OUT >= 2, BATCH >= 1");
  return o;
}

bool progress_on() { return ::isatty(STDERR_FILENO) == 1; }

// --- the worker: one configuration, every model ----------------------------------------

/// The model's flat buffers as DDP's parameters (reduced in place, no copy), as in train_ddp.
struct flat_params {
  std::span<float> values, grads;
  const std::vector<train::tensor_slot>* slots = nullptr;
};

std::vector<ddp::parameter_ref> parameters(flat_params& p) {
  std::vector<ddp::parameter_ref> out;
  for (const auto& s : *p.slots)
    out.push_back(ddp::make_parameter(p.values.subspan(s.offset, s.numel), p.grads.subspan(s.offset, s.numel), s.shape, s.name));
  return out;
}

/// What rank 0 reports for one model: medians over the timed steps of the slowest rank.
struct measurement {
  std::string model;
  std::size_t params = 0;
  std::size_t buckets = 0;
  int world = 1;
  double local_ms = 0, plain_ms = 0, synced_ms = 0, all_reduce_ms = 0, finish_wait_ms = 0;
  // Parts of the step (CSV only): forward + backward (synced: with the bucket launches), SGD step.
  double synced_backward_ms = 0, local_backward_ms = 0, synced_optimizer_ms = 0, local_optimizer_ms = 0;
  bool finite = true;
};

enum class mode { synced, local, plain };

template <class Gemm>
measurement measure(const model_spec& m, Gemm gemm, ddp::group& group, const options& o) {
  const int rank = group.rank(), world = group.size();
  const bool progress = rank == 0 && progress_on();
  train::mlp<Gemm> model(m.in, m.hidden, m.out, gemm);
  {
    ddp::torch_generator g{std::uint64_t(1000 + rank)};  // DDP's broadcast makes the replicas equal
    const auto l1 = ddp::torch_linear_init(m.hidden, m.in, g);
    const auto l2 = ddp::torch_linear_init(m.out, m.hidden, g);
    std::vector<float> v;
    for (const auto* part : {&l1.weight, &l1.bias, &l2.weight, &l2.bias}) v.insert(v.end(), part->begin(), part->end());
    model.set_values(v);
  }
  train::dataset data;
  {
    const long n = 4 * m.batch;  // four batches, cycled
    ddp::torch_generator g{std::uint64_t(2000 + rank)};
    const auto x = ddp::randn(std::int64_t(n) * m.in, g);
    const auto y = ddp::randint(0, m.out, n, g);
    data.features = thrust::device_vector<float>(x.begin(), x.end());
    data.labels = thrust::device_vector<std::int64_t>(y.begin(), y.end());
    data.n = n;
    data.in = m.in;
  }
  flat_params params{{model.value_data(), model.numel()}, {model.grad_data(), model.numel()}, &model.slots()};
  ddp::distributed_data_parallel net{params, group};

  std::vector<std::int64_t> batch(static_cast<std::size_t>(m.batch));
  long next = 0;
  float loss = 0;
  const auto ready = [&](int i) { net.mark_ready(static_cast<std::size_t>(i)); };
  struct sample {
    double seconds = 0, backward = 0, optimizer = 0, all_reduce = 0, finish_wait = 0;
  };
  auto step = [&](mode md) {
    for (auto& b : batch) b = next++ % data.n;
    group.barrier();  // every rank starts the step together; not timed
    const auto comm_before = group.stats()[ddp::collective::all_reduce].time;
    const auto t0 = clock_type::now();
    clock_type::time_point backward_done;
    if (md == mode::synced) {
      loss = model.forward_backward(data, batch, ready);
      backward_done = clock_type::now();
      net.finish();
    } else if (md == mode::local) {
      auto guard = net.no_sync();
      loss = model.forward_backward(data, batch, ready);
      backward_done = clock_type::now();
      net.finish();
    } else {
      loss = model.forward_backward(data, batch);
      backward_done = clock_type::now();
    }
    const auto synchronized = clock_type::now();
    model.sgd_step(o.lr);
    const auto t1 = clock_type::now();
    const auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
    sample s;
    s.seconds = secs(t1 - t0);
    s.backward = secs(backward_done - t0);
    s.optimizer = secs(t1 - synchronized);
    s.all_reduce = secs(group.stats()[ddp::collective::all_reduce].time - comm_before);
    if (md == mode::synced) s.finish_wait = secs(net.stats().wait_last_step);
    return s;
  };

  constexpr mode order[3] = {mode::synced, mode::local, mode::plain};
  struct series {
    std::vector<double> seconds, backward, optimizer, all_reduce, finish_wait;
  } timed[3];
  const int rounds = o.warmup + o.steps;
  for (int r = 0; r < rounds; ++r) {
    if (progress) std::fprintf(stderr, "\r  %-8s %s step %d/%d   ", m.name.c_str(), r < o.warmup ? "warmup" : "timed ", r + 1, rounds);
    for (int k = 0; k < 3; ++k) {
      const mode md = order[(r + k) % 3];
      const sample s = step(md);
      if (r < o.warmup) continue;
      auto& t = timed[static_cast<int>(md)];
      t.seconds.push_back(s.seconds);
      t.backward.push_back(s.backward);
      t.optimizer.push_back(s.optimizer);
      t.all_reduce.push_back(s.all_reduce);
      t.finish_wait.push_back(s.finish_wait);
    }
  }
  if (progress) std::fprintf(stderr, "\r%60s\r", "");

  // The slowest rank's time of each step, then the median over the steps.
  auto slowest_median = [&](const std::vector<double>& mine) {
    std::vector<double> all(mine.size() * static_cast<std::size_t>(world));
    group.all_gather(std::span<const double>(mine), std::span<double>(all));
    std::vector<double> per_step(mine.size(), 0.0);
    for (int r = 0; r < world; ++r)
      for (std::size_t i = 0; i < mine.size(); ++i) per_step[i] = std::max(per_step[i], all[static_cast<std::size_t>(r) * mine.size() + i]);
    return 1e3 * ddp::bench::median(per_step);
  };
  const auto& synced = timed[static_cast<int>(mode::synced)];
  const auto& local = timed[static_cast<int>(mode::local)];
  measurement out;
  out.model = m.name;
  out.params = model.numel();
  out.buckets = net.buckets().size();
  out.world = world;
  out.synced_ms = slowest_median(synced.seconds);
  out.local_ms = slowest_median(local.seconds);
  out.plain_ms = slowest_median(timed[static_cast<int>(mode::plain)].seconds);
  out.all_reduce_ms = slowest_median(synced.all_reduce);
  out.finish_wait_ms = slowest_median(synced.finish_wait);
  out.synced_backward_ms = slowest_median(synced.backward);
  out.local_backward_ms = slowest_median(local.backward);
  out.synced_optimizer_ms = slowest_median(synced.optimizer);
  out.local_optimizer_ms = slowest_median(local.optimizer);
  std::vector<std::int64_t> finite{std::isfinite(loss) ? 1 : 0};
  group.all_reduce(std::span<std::int64_t>(finite), ddp::min{});
  out.finite = finite[0] == 1;
  return out;
}

int run_worker(const options& o) {
  ddp::group group = ddp::init_process_group(o.worker_backend);
  std::vector<measurement> results;
  for (const auto& name : o.models) {
    if (name == "tutorial") {
      if (o.gemm == "exact") results.push_back(measure(o.tutorial, train::exact_gemm<train::device_policy>{}, group, o));
      else results.push_back(measure(o.tutorial, train::eigen_gemm{}, group, o));
    } else {
      results.push_back(measure(o.wide, train::eigen_gemm{}, group, o));
    }
  }
  group.barrier();
  if (group.rank() == 0) {
    std::ofstream out(o.worker_out);
    for (const auto& r : results)
      out << r.model << ' ' << r.params << ' ' << r.buckets << ' ' << r.world << ' ' << r.local_ms << ' ' << r.plain_ms << ' '
          << r.synced_ms << ' ' << r.all_reduce_ms << ' ' << r.finish_wait_ms << ' ' << r.synced_backward_ms << ' ' << r.local_backward_ms
          << ' ' << r.synced_optimizer_ms << ' ' << r.local_optimizer_ms << ' ' << (r.finite ? 1 : 0) << '\n';
    if (!out) throw std::runtime_error("cannot write " + o.worker_out);
  }
  return 0;
}

// --- the driver: launches the configurations, builds the table ---------------------------

struct config {
  std::string label;    // "p=1", "p=2 shm"
  std::string backend;  // init_process_group's name
  int nproc = 1;
};

std::vector<measurement> run_job(const config& c, const options& o, int argc, char** argv, const std::string& out_path) {
  std::vector<std::string> args(argv, argv + argc);
  args[0] = std::filesystem::read_symlink("/proc/self/exe").string();
  args.insert(args.end(), {"--worker", c.backend, "--worker-out", out_path});
  ddp::launch_options lo;
  lo.nproc_per_node = c.nproc;
  lo.standalone = true;
  lo.master_port = 0;
  lo.name = "ddp_bench_ddp_step";
  std::filesystem::remove(out_path);
  const auto result = ddp::launch(lo, args);
  if (!result.ok()) throw std::runtime_error("the " + c.label + " job failed (exit code " + std::to_string(result.exit_code) + ")");
  std::ifstream in(out_path);
  std::vector<measurement> rows;
  measurement m;
  int finite = 1;
  while (in >> m.model >> m.params >> m.buckets >> m.world >> m.local_ms >> m.plain_ms >> m.synced_ms >> m.all_reduce_ms >>
         m.finish_wait_ms >> m.synced_backward_ms >> m.local_backward_ms >> m.synced_optimizer_ms >> m.local_optimizer_ms >> finite) {
    m.finite = finite == 1;
    rows.push_back(m);
  }
  std::filesystem::remove(out_path);
  if (rows.size() != o.models.size()) throw std::runtime_error("the " + c.label + " job wrote no results to " + out_path);
  return rows;
}

std::string fixed(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

/// Milliseconds with three significant digits or so: 0.0412, 1.23, 45.6.
std::string ms(double v) {
  const double a = std::fabs(v);
  return fixed(v, a < 0.1 ? 4 : a < 1 ? 3 : a < 10 ? 2 : 1);
}

std::string describe(const model_spec& m) {
  return "Linear(" + std::to_string(m.in) + ", " + std::to_string(m.hidden) + ")-ReLU-Linear(" + std::to_string(m.hidden) + ", " +
         std::to_string(m.out) + "), batch " + std::to_string(m.batch);
}

int run_driver(const options& o, int argc, char** argv) {
  std::vector<config> configs;
  if (o.single) configs.push_back({"p=1", "ring", 1});
  for (const auto& t : o.transports) configs.push_back({"p=" + std::to_string(o.np) + " " + t, t, o.np});
  const std::string out_path =
      (std::filesystem::temp_directory_path() / ("ddp_bench_ddp_step_" + std::to_string(::getpid()) + ".txt")).string();

  // runs[config][repeat] = that job's rows, by model.
  std::vector<std::vector<std::vector<measurement>>> runs(configs.size());
  for (int rep = 0; rep < o.repeat; ++rep)
    for (std::size_t c = 0; c < configs.size(); ++c) {
      if (progress_on()) std::fprintf(stderr, "ddp_bench_ddp_step: %s, run %d/%d\n", configs[c].label.c_str(), rep + 1, o.repeat);
      runs[c].push_back(run_job(configs[c], o, argc, argv, out_path));
    }

  struct row {
    config cfg;
    measurement m;  // medians over the repeats, field by field
  };
  std::vector<row> rows;
  for (std::size_t k = 0; k < o.models.size(); ++k)
    for (std::size_t c = 0; c < configs.size(); ++c) {
      row r{configs[c], runs[c][0][k]};
      auto med = [&](double measurement::*field) {
        std::vector<double> v;
        for (const auto& run : runs[c]) v.push_back(run[k].*field);
        return ddp::bench::median(v);
      };
      r.m.local_ms = med(&measurement::local_ms);
      r.m.plain_ms = med(&measurement::plain_ms);
      r.m.synced_ms = med(&measurement::synced_ms);
      r.m.all_reduce_ms = med(&measurement::all_reduce_ms);
      r.m.finish_wait_ms = med(&measurement::finish_wait_ms);
      r.m.synced_backward_ms = med(&measurement::synced_backward_ms);
      r.m.local_backward_ms = med(&measurement::local_backward_ms);
      r.m.synced_optimizer_ms = med(&measurement::synced_optimizer_ms);
      r.m.local_optimizer_ms = med(&measurement::local_optimizer_ms);
      for (const auto& run : runs[c]) r.m.finite = r.m.finite && run[k].finite;
      rows.push_back(r);
    }

  std::ostringstream md;
  md << "DDP step overhead: forward + backward + SGD step, median ms per step (slowest rank), " << o.steps << " timed steps after "
     << o.warmup << " warm-up rounds, " << o.repeat << (o.repeat == 1 ? " run" : " runs (median)") << "; ring backend.\n";
  for (const auto& name : o.models) {
    const model_spec& m = name == "tutorial" ? o.tutorial : o.wide;
    md << "- " << name << ": " << describe(m) << ", " << (name == "tutorial" ? o.gemm : std::string("eigen")) << " GEMM\n";
  }
  md << "\n| model | params | p | transport | buckets | ms/step local (no_sync) | ms/step no DDP | ms/step synced | "
        "synced / local | overhead ms | all-reduce ms | all-reduce share |\n";
  md << "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  std::ostringstream csv;
  csv << "model,params,world,transport,buckets,local_ms,no_ddp_ms,synced_ms,ratio_synced_local,all_reduce_ms,all_reduce_share,"
         "finish_wait_ms,synced_backward_ms,local_backward_ms,synced_optimizer_ms,local_optimizer_ms,steps,warmup,repeat\n";
  bool all_finite = true;
  for (const auto& r : rows) {
    const auto& m = r.m;
    const std::string transport = r.cfg.nproc == 1 ? "-" : r.cfg.backend;
    const double ratio = m.local_ms > 0 ? m.synced_ms / m.local_ms : 0;
    const double share = m.synced_ms > 0 ? m.all_reduce_ms / m.synced_ms : 0;
    md << "| " << m.model << " | " << m.params << " | " << m.world << " | " << transport << " | " << m.buckets << " | " << ms(m.local_ms)
       << " | " << ms(m.plain_ms) << " | " << ms(m.synced_ms) << " | " << fixed(ratio, 2) << "x | " << ms(m.synced_ms - m.local_ms)
       << " | " << ms(m.all_reduce_ms) << " | " << fixed(100 * share, 1) << " % |\n";
    csv << m.model << ',' << m.params << ',' << m.world << ',' << transport << ',' << m.buckets << ',' << fixed(m.local_ms, 5) << ','
        << fixed(m.plain_ms, 5) << ',' << fixed(m.synced_ms, 5) << ',' << fixed(ratio, 4) << ',' << fixed(m.all_reduce_ms, 5) << ','
        << fixed(share, 4) << ',' << fixed(m.finish_wait_ms, 5) << ',' << fixed(m.synced_backward_ms, 5) << ','
        << fixed(m.local_backward_ms, 5) << ',' << fixed(m.synced_optimizer_ms, 5) << ',' << fixed(m.local_optimizer_ms, 5) << ',' << o.steps << ',' << o.warmup << ',' << o.repeat << '\n';
    all_finite = all_finite && m.finite;
  }
  if (!all_finite) md << "\nWarning: a loss was not finite at the end of a run; times may include NaN/denormal arithmetic.\n";

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
    return o.worker_backend.empty() ? run_driver(o, argc, argv) : run_worker(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_ddp_step: %s\n", e.what());
    return 1;
  }
}
