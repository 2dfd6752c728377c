#pragma once
// train_ddp --scaling 1,2[,4] --report PREFIX: the same job at each world size, on this host,
// in two series:
//   strong  the dataset and global batch fixed (per-rank batch = batch / N):
//           speedup = T1 / TN, efficiency = speedup / N;
//   weak    the per-rank batch fixed (global batch = batch x N) and the samples per rank too
//           (tutorial: dataset = samples x N; digits: a real data set does not grow, so its
//           weak runs take 1/N of the steps per epoch at N times the batch):
//           efficiency = X_N / (N X_1) with X the throughput (samples/s over all ranks; = T1 / TN
//           when the work per rank is fixed), scaled speedup = N x efficiency.
// With --dataset digits each series runs twice, without and with the linear scaling rule
// (--lr-scaling linear, --warmup-epochs as given), and the report adds the held-out accuracy:
// the rule changes nothing under strong scaling (the global batch is --base-batch), and under
// weak scaling it is what keeps the accuracy of the bigger global batch.
// Each run is this binary launched as N ranks (ddp::launch, as --nproc-per-node does) writing
// its JSON report; this process times the whole job (launch to exit) and writes PREFIX.md (a
// table), PREFIX.csv, and PREFIX.png when gnuplot is installed.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "ddp/launch.hpp"
#include "options.hpp"

namespace train {

struct scaling_row {
  std::string series;  // "strong" | "weak", + "+linear" for the runs with the scaling rule (digits)
  int ranks = 1;
  long batch_per_rank = 0, samples = 0, global_batch = 0;
  double peak_lr = 0, heldout_loss = 0, heldout_accuracy = 0;
  double loop_s = 0, job_s = 0, throughput = 0, speedup = 0, efficiency = 0;
  double peak_rss_mib = 0, peak_device_mib = -1;
  double final_loss = 0, accuracy = 0;
  double compute_ms = 0, comm_ms = 0, exposed_ms = 0;  // per step, rank 0
};

/// N ranks of this binary on this host, like `torchrun --standalone --nproc-per-node N`.
inline ddp::launch_options local_launch(int nproc_per_node) {
  ddp::launch_options lo;
  lo.nproc_per_node = nproc_per_node;
  lo.standalone = true;
  lo.master_port = 0;
  lo.name = "train_ddp";
  return lo;
}

namespace detail {

// Reads the numbers train_ddp's own report writes (report.hpp): `"key": value` and `"key": [a, b]`.
inline double json_number(const std::string& text, const std::string& key, double fallback = 0) {
  const auto at = text.find("\"" + key + "\": ");
  if (at == std::string::npos) return fallback;
  return std::strtod(text.c_str() + at + key.size() + 4, nullptr);
}

inline double json_max_of_array(const std::string& text, const std::string& key) {
  const auto at = text.find("\"" + key + "\": [");
  if (at == std::string::npos) return 0;
  const char* p = text.c_str() + at + key.size() + 5;
  double best = 0;
  while (*p != ']' && *p != '\0') {
    char* end = nullptr;
    best = std::max(best, std::strtod(p, &end));
    if (end == p) break;
    p = end;
    while (*p == ',' || *p == ' ') ++p;
  }
  return best;
}

inline std::vector<int> parse_world_sizes(const std::string& list) {
  std::vector<int> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 1024) {
      throw std::invalid_argument("--scaling " + list + ": expected world sizes like 1,2,4 (each 1..1024)");
    }
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw std::invalid_argument("--scaling: no world sizes given");
  return out;
}

// The command line of one run: this binary's arguments without the scaling ones, plus the run's.
// --base-batch is the report's --batch-size, so the linear rule scales by global batch / that.
// The digits runs get no --samples (the data fixes it).
inline std::vector<std::string> run_arguments(int argc, char** argv, const options& o, long batch, long samples,
                                              const std::string& lr_scaling, const std::string& report) {
  std::vector<std::string> args{std::filesystem::read_symlink("/proc/self/exe").string()};
  const std::vector<std::string> dropped{"--scaling", "--report", "--nproc-per-node", "--nproc_per_node", "--batch-size",
                                         "--samples", "--lr-scaling", "--base-batch"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    if (std::find(dropped.begin(), dropped.end(), name) != dropped.end()) {
      if (eq == std::string::npos) ++i;  // "--flag value"
      continue;
    }
    args.push_back(a);
  }
  for (const auto& a : {std::string("--batch-size"), std::to_string(batch), std::string("--report"), report,
                        std::string("--lr-scaling"), lr_scaling, std::string("--base-batch"),
                        std::to_string(o.base_batch > 0 ? o.base_batch : o.batch_size)})
    args.push_back(a);
  if (o.dataset != "digits")
    for (const auto& a : {std::string("--samples"), std::to_string(samples)}) args.push_back(a);
  return args;
}

inline std::string fixed(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

// Writes PREFIX.csv, PREFIX.md and (with gnuplot) PREFIX.png; returns the Markdown table.
inline std::string write_outputs(const std::string& prefix, const std::vector<scaling_row>& rows, const options& o,
                                 const std::vector<std::string>& series) {
  const bool digits = o.dataset == "digits";
  {
    std::ofstream csv(prefix + ".csv");
    csv << "series,ranks,batch_per_rank,samples,train_loop_s,whole_job_s,throughput_samples_per_s,speedup,efficiency,"
           "peak_rss_mib_per_rank,peak_device_mib,final_mean_loss,final_accuracy,compute_ms_per_step,"
           "communication_ms_per_step,exposed_communication_ms_per_step"
        << (digits ? ",global_batch,peak_lr,heldout_mean_loss,heldout_accuracy" : "") << "\n";
    for (const auto& r : rows) {
      csv << r.series << ',' << r.ranks << ',' << r.batch_per_rank << ',' << r.samples << ',' << r.loop_s << ','
          << r.job_s << ',' << r.throughput << ',' << r.speedup << ',' << r.efficiency << ',' << r.peak_rss_mib << ','
          << r.peak_device_mib << ',' << r.final_loss << ',' << r.accuracy << ',' << r.compute_ms << ',' << r.comm_ms
          << ',' << r.exposed_ms;
      if (digits) csv << ',' << r.global_batch << ',' << r.peak_lr << ',' << r.heldout_loss << ',' << r.heldout_accuracy;
      csv << '\n';
    }
  }
  const bool device = rows.front().peak_device_mib >= 0;
  const std::string header =
      std::string("| series | ranks | batch/rank |") + (digits ? " global batch | peak lr |" : " samples |") +
      " loop s | whole job s | samples/s | speedup | efficiency | peak RSS MiB/rank |" + (device ? " device MiB |" : "") +
      (digits ? " held-out loss | held-out accuracy |" : " final loss | accuracy |") +
      " compute ms/step | comm ms/step | exposed ms/step |";
  const auto columns = static_cast<std::size_t>(std::count(header.begin(), header.end(), '|') - 1);
  std::ostringstream md;
  md << "# train_ddp scaling: " << (digits ? "digits, " : "") << "MLP " << o.features << "-" << o.hidden << "-"
     << o.classes << ", " << o.epochs << " epochs, backend " << o.backend << ", gemm " << o.gemm << "\n\n";
  if (digits) {
    md << "strong: the " << rows.front().samples << " training samples and global batch " << o.batch_size
       << " fixed (per-rank batch = batch / N); speedup = T1/TN, efficiency = speedup/N.  \n"
       << "weak: per-rank batch " << o.batch_size << " fixed, global batch " << o.batch_size
       << " x N, the same training samples (an epoch has 1/N of the steps); efficiency = X_N / (N X_1) with X the "
          "samples/s, speedup = N x efficiency.  \n"
       << "+linear: the linear scaling rule (Goyal et al. 2017): lr = " << o.lr << " x global batch / "
       << (o.base_batch > 0 ? o.base_batch : o.batch_size) << ", reached by a linear ramp from " << o.lr << " over "
       << o.warmup_epochs << " epochs; it leaves strong scaling unchanged (global batch fixed).  \n"
       << "T = training loop (held-out evaluations excluded); whole job = launch to exit of all ranks. Held-out: "
          "the final model's loss and accuracy over the held-out split, each sample once. Per step (rank 0): compute = "
          "forward + backward + SGD, comm = bucket all-reduces start to end, exposed = what finish() waited for after "
          "backward.\n\n";
  } else {
    md << "strong: " << o.samples << " samples and global batch " << o.batch_size
       << " fixed (per-rank batch = batch / N); speedup = T1/TN, efficiency = speedup/N.  \n"
       << "weak: per-rank batch " << o.batch_size << " and " << o.samples
       << " samples per rank fixed; efficiency = T1/TN, speedup = N x T1/TN (scaled).  \n"
       << "T = training loop; whole job = launch to exit of all ranks. Loss and accuracy: the final model over the "
          "whole dataset, each sample once. Per step (rank 0): compute = forward + backward + SGD, comm = bucket "
          "all-reduces start to end, exposed = what finish() waited for after backward.\n\n";
  }
  md << header << "\n|";
  for (std::size_t c = 0; c < columns; ++c) md << " --- |";
  md << "\n";
  for (const auto& r : rows) {
    md << "| " << r.series << " | " << r.ranks << " | " << r.batch_per_rank << " | "
       << (digits ? std::to_string(r.global_batch) + " | " + fixed(r.peak_lr, 3) : std::to_string(r.samples)) << " | "
       << fixed(r.loop_s, 4) << " | " << fixed(r.job_s, 3) << " | " << fixed(r.throughput, 0) << " | "
       << fixed(r.speedup, 2) << " | " << fixed(r.efficiency, 2) << " | " << fixed(r.peak_rss_mib, 1) << " | "
       << (r.peak_device_mib >= 0 ? fixed(r.peak_device_mib, 1) + " | " : "")
       << fixed(digits ? r.heldout_loss : r.final_loss, 4) << " | " << fixed(digits ? r.heldout_accuracy : r.accuracy, 4)
       << " | " << fixed(r.compute_ms, 3) << " | " << fixed(r.comm_ms, 3) << " | " << fixed(r.exposed_ms, 3) << " |\n";
  }
  const std::string table = md.str();
  std::ofstream(prefix + ".md") << table;

  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr, "train_ddp --scaling: gnuplot not installed, no plot (apt-get install gnuplot-nox)\n");
    return table;
  }
  const std::string script = prefix + ".gp";
  {
    // One line per series in each panel; digits adds a third panel, held-out accuracy per world size.
    std::string names;
    for (const auto& s : series) names += (names.empty() ? "" : " ") + s;
    const auto panel = [&](int column) {
      return "plot for [s in '" + names + "'] '" + prefix + ".csv' skip 1 using 2:(strcol(1) eq s ? $" +
             std::to_string(column) + " : 1/0) with linespoints lw 2 title s";
    };
    std::ofstream gp(script);
    gp << "set terminal pngcairo size " << (digits ? 1650 : 1100) << ",450 noenhanced\nset output '" << prefix
       << ".png'\nset datafile separator ','\nset key top left\nset grid\nset multiplot layout 1," << (digits ? 3 : 2)
       << " title 'train_ddp scaling (" << (digits ? "digits, " : "") << "MLP " << o.features << "-" << o.hidden << "-"
       << o.classes << ")'\n"
       << "set xlabel 'ranks'\nset ylabel 'samples/s'\nset xtics 1\n"
       << panel(7) << "\n"
       << "set ylabel 'efficiency'\nset yrange [0:1.2]\n"
       << panel(9) << ", 1 with lines dt 2 title 'ideal'\n";
    if (digits) {
      gp << "set ylabel 'held-out accuracy'\nset yrange [0.8:1]\nset key bottom left\n"
         << panel(20) << ", 0.9 with lines dt 2 title '0.9'\n";
    }
    gp << "unset multiplot\n";
  }
  if (std::system(("gnuplot '" + script + "'").c_str()) != 0) {
    std::fprintf(stderr, "train_ddp --scaling: gnuplot failed on %s\n", script.c_str());
  } else {
    std::filesystem::remove(script);
  }
  return table;
}

}  // namespace detail

inline int run_scaling(const options& o, int argc, char** argv) {
  const std::vector<int> worlds = detail::parse_world_sizes(o.scaling);
  const std::string prefix = o.report.empty() ? "scaling" : o.report;
  const auto run_dir = std::filesystem::temp_directory_path() / ("train_ddp_scaling_" + std::to_string(::getpid()));
  std::filesystem::create_directories(run_dir);
  struct series_spec {
    std::string name;
    bool strong;
    std::string lr_scaling;
  };
  std::vector<series_spec> specs;
  if (o.dataset == "digits") {
    specs = {{"strong", true, "none"}, {"strong+linear", true, "linear"}, {"weak", false, "none"}, {"weak+linear", false, "linear"}};
  } else {
    specs = {{"strong", true, o.lr_scaling}, {"weak", false, o.lr_scaling}};
  }
  std::vector<std::string> series;
  for (const auto& s : specs) series.push_back(s.name);
  std::vector<scaling_row> rows;
  const std::size_t total = specs.size() * worlds.size();
  for (const auto& spec : specs) {
    double t0 = 0, x0 = 0;
    for (const int n : worlds) {
      scaling_row row;
      row.series = spec.name;
      row.ranks = n;
      row.batch_per_rank = spec.strong ? std::max(1L, o.batch_size / n) : o.batch_size;
      row.samples = spec.strong ? o.samples : o.samples * n;
      if (spec.strong && o.batch_size % n != 0) {
        std::fprintf(stderr, "train_ddp --scaling: batch %ld is not a multiple of %d ranks; per-rank batch %ld\n",
                     o.batch_size, n, row.batch_per_rank);
      }
      std::fprintf(stderr, "train_ddp --scaling: [%zu/%zu] %s scaling, %d rank(s), batch %ld per rank\n", rows.size() + 1,
                   total, spec.name.c_str(), n, row.batch_per_rank);
      std::fflush(stderr);
      const std::string report_path = (run_dir / (spec.name + "-" + std::to_string(n) + ".json")).string();
      const auto start = std::chrono::steady_clock::now();
      const auto result = ddp::launch(
          local_launch(n), detail::run_arguments(argc, argv, o, row.batch_per_rank, row.samples, spec.lr_scaling, report_path));
      row.job_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (result.exit_code != 0) {
        std::filesystem::remove_all(run_dir);
        throw std::runtime_error("the " + spec.name + " run with " + std::to_string(n) + " rank(s) failed (exit code " +
                                 std::to_string(result.exit_code) + ")");
      }
      std::ifstream in(report_path);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      row.samples = long(detail::json_number(text, "samples", double(row.samples)));
      row.loop_s = detail::json_number(text, "train_loop_seconds");
      row.throughput = detail::json_number(text, "throughput_samples_per_s");
      row.peak_rss_mib = detail::json_max_of_array(text, "peak_rss_bytes_by_rank") / (1024.0 * 1024.0);
      const double device = detail::json_number(text, "peak_device_memory_bytes", -1);
      row.peak_device_mib = device >= 0 ? device / (1024.0 * 1024.0) : -1;
      row.final_loss = detail::json_number(text, "final_mean_loss");
      row.accuracy = detail::json_number(text, "final_accuracy");
      row.global_batch = long(detail::json_number(text, "global_batch"));
      row.peak_lr = detail::json_number(text, "peak_lr");
      row.heldout_loss = detail::json_number(text, "heldout_mean_loss");
      row.heldout_accuracy = detail::json_number(text, "heldout_accuracy");
      const double steps = std::max(1.0, detail::json_number(text, "steps"));
      row.compute_ms = 1e3 * detail::json_number(text, "compute_seconds") / steps;
      row.comm_ms = 1e3 * detail::json_number(text, "communication_seconds") / steps;
      row.exposed_ms = 1e3 * detail::json_number(text, "exposed_communication_seconds") / steps;
      // The baseline is the first world size n0 (normally 1): strong speedup = n0 x T0 / TN; weak
      // efficiency = n0 X_N / (N X_0).
      if (n == worlds.front()) {
        t0 = row.loop_s;
        x0 = row.throughput;
      }
      if (spec.strong) {
        row.speedup = worlds.front() * t0 / row.loop_s;
        row.efficiency = row.speedup / n;
      } else {
        row.efficiency = worlds.front() * row.throughput / (n * x0);
        row.speedup = n * row.efficiency;
      }
      rows.push_back(row);
    }
  }
  std::filesystem::remove_all(run_dir);
  std::printf("%s", detail::write_outputs(prefix, rows, o, series).c_str());
  std::fprintf(stderr, "train_ddp --scaling: wrote %s.md, %s.csv%s\n", prefix.c_str(), prefix.c_str(),
               std::filesystem::exists(prefix + ".png") ? (", " + prefix + ".png").c_str() : "");
  return 0;
}

}  // namespace train
