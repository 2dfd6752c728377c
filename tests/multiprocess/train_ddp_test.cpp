// examples/train_ddp against PyTorch: with --init-seed 0, the printed lines must be the golden
// torch 2.15 lines (tests/data/training.json) for world sizes 1 and 2, and the step losses and final
// parameters are compared bit for bit (reported; required exact where this port is known exact).
// The binary runs as a real child process (and, for W = 2, as two real ranks over the ring backend).
// --dataset digits against tests/data/digits_golden.json (real torch 2.15 on a CPU whose MKL rounds
// differently from the Xeon this port follows): printed lines equal, numbers within tolerances.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <signal.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "scripts/launch_worker.hpp"
#include "support/multiprocess.hpp"
#include "support/skip.hpp"

namespace {

using nlohmann::json;

#if defined(TRAIN_DDP_EXE)
const std::string exe = TRAIN_DDP_EXE;  // set by examples/train_ddp/CMakeLists.txt
#else
const std::string exe;
#endif
#if defined(DDPRUN_EXE)
const std::string ddprun_exe = DDPRUN_EXE;  // set by tools/ddprun/CMakeLists.txt
#else
const std::string ddprun_exe;
#endif

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return json::parse(in);
}

const json& golden() {
  static const json g = read_json(std::string(DDP_TEST_DATA_DIR) + "/training.json");
  return g;
}

// golden()["W<world>_simulated"] (the key built by appending: GCC 12's -Wstringop-overflow
// misfires on "W" + std::to_string(world) once inlined).
const json& golden_run(int world) {
  std::string key = "W";
  key += std::to_string(world);
  key += "_simulated";
  return golden()[key];
}

std::string numbered(std::string tag, std::size_t i) {
  tag += std::to_string(i);
  return tag;
}

struct run_output {
  std::string output;
  json report;
};

// Runs train_ddp with args (one child process, which may launch its own ranks), 120 s deadline.
run_output run_train(std::vector<std::string> args, const std::string& tag) {
  const std::string report = std::string(DDP_TEST_BINARY_DIR) + "/train_ddp_" + tag + "_" + std::to_string(::getpid()) + ".json";
  args.insert(args.begin(), exe);
  args.push_back("--report");
  args.push_back(report);
  auto result = ddp::test::run_ranks(
      1,
      [&](int) {
        ::unsetenv("RANK");  // the job decides its own world
        ::unsetenv("WORLD_SIZE");
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        ::execv(exe.c_str(), argv.data());
        throw std::runtime_error("execv " + exe + ": " + std::strerror(errno));
      },
      std::chrono::seconds(120));
  INFO(result.describe());
  REQUIRE(result.ok());
  run_output out{result.ranks[0].output, read_json(report)};
  std::remove(report.c_str());
  return out;
}

std::vector<std::string> epoch_lines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string l; std::getline(in, l);)
    if (l.rfind("Epoch ", 0) == 0) lines.push_back(l);
  return lines;
}

std::uint32_t hex_bits(const std::string& h) {  // struct.pack('<f', x).hex()
  std::uint32_t u = 0;
  for (int i = 3; i >= 0; --i) u = (u << 8) | std::uint32_t(std::stoul(h.substr(std::size_t(2 * i), 2), nullptr, 16));
  return u;
}

float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

long ulp_distance(std::uint32_t a, std::uint32_t b) {  // on the monotone integer line of floats
  const auto key = [](std::uint32_t u) { return (u & 0x80000000u) ? -long(u & 0x7fffffffu) : long(u); };
  return std::labs(key(a) - key(b));
}

struct comparison {
  long steps = 0, steps_exact = 0, step_max_ulp = 0;
  long params = 0, params_exact = 0, param_max_ulp = 0;
};

// Checks one run against W<world>_simulated and returns the bit-level comparison.
comparison check_against_golden(const run_output& run, int world) {
  const json& g = golden_run(world);
  const auto lines = epoch_lines(run.output);
  INFO(run.output);
  REQUIRE(lines == g["tutorial_print_lines"].get<std::vector<std::string>>());
  CHECK(run.report["world_size"].get<int>() == world);

  comparison c;
  // Step losses: the golden float32 bits against what rank 0 computed, step for step.
  const auto& mine = run.report["step_losses_rank0"];
  std::vector<std::uint32_t> want;
  for (const auto& epoch : g["step_losses_by_rank"][0])
    for (const auto& h : epoch["hex"]) want.push_back(hex_bits(h.get<std::string>()));
  REQUIRE(mine.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const float got = mine[i].get<float>();
    std::uint32_t got_bits;
    std::memcpy(&got_bits, &got, sizeof got);
    const long u = ulp_distance(got_bits, want[i]);
    ++c.steps;
    c.steps_exact += u == 0;
    c.step_max_ulp = std::max(c.step_max_ulp, u);
    CHECK(std::fabs(double(got) - double(bits_float(want[i]))) <= 1e-6);
  }
  // Epoch sums (doubles) to well within the printed precision.
  const auto sums = run.report["epoch_loss_sums_by_rank"][0].get<std::vector<double>>();
  const auto want_sums = g["epoch_loss_sums_by_rank"][0].get<std::vector<double>>();
  REQUIRE(sums.size() == want_sums.size());
  for (std::size_t e = 0; e < sums.size(); ++e) CHECK(std::fabs(sums[e] - want_sums[e]) < 1e-5);
  // Final parameters, in named_parameters() order.
  const auto bits = run.report["final_params_bits"].get<std::vector<std::uint32_t>>();
  std::vector<std::uint32_t> want_params;
  for (const char* name : {"0.weight", "0.bias", "2.weight", "2.bias"})
    for (const auto& h : g["final_params"][name]["hex"]) want_params.push_back(hex_bits(h.get<std::string>()));
  REQUIRE(bits.size() == want_params.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    const long u = ulp_distance(bits[i], want_params[i]);
    ++c.params;
    c.params_exact += u == 0;
    c.param_max_ulp = std::max(c.param_max_ulp, u);
  }
  WARN("W=" << world << ": step losses bit-identical " << c.steps_exact << "/" << c.steps << " (max " << c.step_max_ulp
            << " ulp); final parameters bit-identical " << c.params_exact << "/" << c.params << " (max "
            << c.param_max_ulp << " ulp)");
  CHECK(c.param_max_ulp <= 16);
  // Exact evaluation saw every sample once.
  CHECK(run.report["eval_samples"].get<long>() == 1024);
  const double acc = run.report["final_accuracy"].get<double>();
  CHECK(acc > 0.3);
  CHECK(acc < 0.8);
  return c;
}

// --dataset digits: tests/data/digits_golden.json (tests/scripts/make_digits_golden.py).
const json& digits_golden() {
  static const json g = read_json(std::string(DDP_TEST_DATA_DIR) + "/digits_golden.json");
  return g;
}

struct digits_comparison {
  long steps = 0, steps_exact = 0;
  double step_max_rel = 0, sum_max_abs = 0;
  long params = 0, params_exact = 0;
  double param_max_abs = 0;
};

// One digits run against the golden simulation `name` (the torchrun/gloo run printed the same
// lines: checked here too). Not bit for bit: the golden's torch ran on a CPU where MKL's sgemm
// rounds some products differently from the one exact_gemm follows (the golden's
// meta.tutorial_W1_vs_training_json: that machine's torch differs from training.json from the
// tutorial's first step on). What is required: the printed lines (4 decimals) equal; step losses
// within 1e-5 relative (measured <= 1.1e-6); epoch loss sums within 2e-5 (measured <= 1.4e-6);
// final parameters within 1e-5 (measured <= 4.8e-7); held-out accuracy after the default epochs
// >= 0.9, over all 360 held-out samples.
digits_comparison check_digits(const run_output& run, const std::string& name) {
  const json& g = digits_golden()["simulated"][name];
  const auto want_lines = g["printed_lines"].get<std::vector<std::string>>();
  REQUIRE(digits_golden()["torchrun_gloo"][name]["printed_lines"].get<std::vector<std::string>>() == want_lines);
  INFO(run.output);
  CHECK(epoch_lines(run.output) == want_lines);
  CHECK(run.report["world_size"].get<int>() == g["world_size"].get<int>());
  CHECK(run.report["dataset"].get<std::string>() == "digits");
  CHECK(run.report["peak_lr"].get<double>() == g["peak_lr"].get<double>());

  digits_comparison c;
  std::vector<float> want;
  for (const auto& epoch : g["step_losses_rank0"])
    for (const auto& h : epoch["hex"]) want.push_back(bits_float(hex_bits(h.get<std::string>())));
  const auto& mine = run.report["step_losses_rank0"];
  REQUIRE(mine.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const float got = mine[i].get<float>();
    ++c.steps;
    c.steps_exact += got == want[i];
    c.step_max_rel = std::max(c.step_max_rel, std::fabs(double(got) - double(want[i])) / std::fabs(double(want[i])));
  }
  CHECK(c.step_max_rel <= 1e-5);
  const auto sums = run.report["epoch_loss_sums_by_rank"][0].get<std::vector<double>>();
  const auto want_sums = g["epoch_loss_sums_by_rank"][0].get<std::vector<double>>();
  REQUIRE(sums.size() == want_sums.size());
  for (std::size_t e = 0; e < sums.size(); ++e) c.sum_max_abs = std::max(c.sum_max_abs, std::fabs(sums[e] - want_sums[e]));
  CHECK(c.sum_max_abs <= 2e-5);

  const auto bits = run.report["final_params_bits"].get<std::vector<std::uint32_t>>();
  std::vector<std::uint32_t> want_params;
  for (const char* tensor : {"0.weight", "0.bias", "2.weight", "2.bias"}) {
    const std::string h = g["final_params"][tensor]["hex"].get<std::string>();
    for (std::size_t i = 0; i + 8 <= h.size(); i += 8) want_params.push_back(hex_bits(h.substr(i, 8)));
  }
  REQUIRE(bits.size() == want_params.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    ++c.params;
    c.params_exact += bits[i] == want_params[i];
    c.param_max_abs = std::max(c.param_max_abs, std::fabs(double(bits_float(bits[i])) - double(bits_float(want_params[i]))));
  }
  CHECK(c.param_max_abs <= 1e-5);

  CHECK(run.report["heldout_samples"].get<long>() == 360);
  CHECK(run.report["heldout_accuracy"].get<double>() >= 0.9);
  CHECK(run.report["heldout_accuracy_by_epoch"].size() == g["heldout_accuracy_by_epoch"].size());
  WARN("digits " << name << ": held-out accuracy " << run.report["heldout_accuracy"].get<double>()
                 << "; step losses bit-identical " << c.steps_exact << "/" << c.steps << " (max rel "
                 << c.step_max_rel << "); epoch sums max |diff| " << c.sum_max_abs << "; final parameters bit-identical "
                 << c.params_exact << "/" << c.params << " (max |diff| " << c.param_max_abs << ")");
  return c;
}

std::vector<std::string> digits_args(const std::string& name) {
  return digits_golden()["simulated"][name]["args"].get<std::vector<std::string>>();
}

void require_binary() {
  if (exe.empty() || ::access(exe.c_str(), X_OK) != 0)
    ddp::test::skip("the train_ddp binary was not built (examples off, or CLI11/Thrust missing)");  // exits 77
}

void require_launcher_and_binary() {
  require_binary();
  if (ddprun_exe.empty() || ::access(ddprun_exe.c_str(), X_OK) != 0) ddp::test::skip("the ddprun binary was not built (tools off)");  // exits 77
}

}  // namespace

TEST_CASE("ddprun --standalone --nnodes=1 --nproc-per-node=2 train_ddp --init-seed 0 prints PyTorch's lines") {
  require_launcher_and_binary();
  ddp::test::child_process p({ddprun_exe, "--standalone", "--nnodes=1", "--nproc-per-node=2", exe, "--init-seed", "0"});
  const int code = p.wait(std::chrono::seconds(120));
  INFO("stdout:\n" << p.out_text << "stderr:\n" << p.err_text);
  CHECK(code == 0);
  CHECK(epoch_lines(p.out_text) == golden_run(2)["tutorial_print_lines"].get<std::vector<std::string>>());
}

TEST_CASE("ddprun: a train_ddp rank killed mid-run ends the job within 5 s, named, with no process left") {
  require_launcher_and_binary();
  // A job of many epochs: it is still training when a rank is killed.
  ddp::test::child_process p({ddprun_exe, "--standalone", "--nnodes=1", "--nproc-per-node=2", exe, "--samples", "65536",
                              "--hidden", "256", "--batch-size", "256", "--epochs", "100000"});
  REQUIRE(p.wait_for_output("Epoch 1: Rank 0 local loss sum = ", 1, std::chrono::seconds(120)));
  const auto workers = ddp::test::children_by_rank(p.pid(), 2, std::chrono::seconds(10));
  REQUIRE(workers.size() == 2);
  const auto killed_at = std::chrono::steady_clock::now();
  REQUIRE(::kill(workers.at(1), SIGKILL) == 0);
  const int code = p.wait(std::chrono::seconds(60));
  const auto took = std::chrono::steady_clock::now() - killed_at;
  INFO("stderr:\n" << p.err_text);
  CHECK(code != 0);
  CHECK(took < std::chrono::seconds(5));
  CHECK_THAT(p.err_text, Catch::Contains("ddprun: rank 1 (local 1, pid " + std::to_string(workers.at(1)) + ") was killed by signal 9"));
  CHECK(ddp::test::survivors({workers.at(0), workers.at(1)}, std::chrono::seconds(5)).empty());
}

TEST_CASE("train_ddp --init-seed 0 at world size 1 prints PyTorch's lines") {
  require_binary();
  const auto run = run_train({"--init-seed", "0"}, "w1");
  const auto c = check_against_golden(run, 1);
  CHECK(run.report["simulated"].get<bool>() == false);
  CHECK(c.steps_exact >= 90);  // measured: 91/96, the first difference in epoch 3
}

TEST_CASE("train_ddp --init-seed 0 as two real ranks prints PyTorch's lines, bit for bit") {
  require_binary();
  const auto run = run_train({"--init-seed", "0", "--nproc-per-node", "2"}, "w2");
  const auto c = check_against_golden(run, 2);
  // Rank-order averaging of two gradients is exact, so the real run equals the simulation.
  CHECK(c.steps_exact == c.steps);
  CHECK(c.params_exact == c.params);
  const auto rss = run.report["peak_rss_bytes_by_rank"].get<std::vector<std::int64_t>>();
  CHECK(rss.size() == 2);
}

TEST_CASE("train_ddp --simulate-world 2 (one process) equals PyTorch's W=2 simulation") {
  require_binary();
  const auto run = run_train({"--init-seed", "0", "--simulate-world", "2"}, "sim2");
  const auto c = check_against_golden(run, 2);
  CHECK(run.report["simulated"].get<bool>() == true);
  CHECK(c.steps_exact == c.steps);
  CHECK(c.params_exact == c.params);
}

TEST_CASE("train_ddp without --init-seed trains from random weights") {
  require_binary();
  const auto run = run_train({"--nproc-per-node", "2", "--epochs", "1"}, "random");
  const auto lines = epoch_lines(run.output);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] != golden()["W2_simulated"]["tutorial_print_lines"][0].get<std::string>());
  // Cross-entropy of a 2-class model near its random start: about ln 2 per sample, 16 steps.
  const double sum = run.report["epoch_loss_sums_by_rank"][0][0].get<double>();
  CHECK(sum > 16 * 0.5);
  CHECK(sum < 16 * 1.5);
}

// --gemm fast (the fused host step) is not bit-exact: its losses must stay within 1e-4 relative of
// a reference, step by step: PyTorch's golden losses for the tutorial job, and for other shapes
// the exact path (which the tests above hold to PyTorch's bits).
void check_close_losses(const json& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i << ": " << got[i].get<double>() << " vs " << want[i]);
    CHECK(std::fabs(got[i].get<double>() - want[i]) <= 1e-4 * std::fabs(want[i]));
  }
}

std::vector<double> golden_step_losses(int world) {
  std::vector<double> out;
  for (const auto& epoch : golden_run(world)["step_losses_by_rank"][0])
    for (const auto& h : epoch["hex"]) out.push_back(double(bits_float(hex_bits(h.get<std::string>()))));
  return out;
}

TEST_CASE("train_ddp --gemm fast stays within 1e-4 of PyTorch's losses") {
  require_binary();
  for (int world : {1, 2}) {
    INFO("W=" << world);
    const auto run = run_train({"--init-seed", "0", "--gemm", "fast", "--nproc-per-node", std::to_string(world)},
                               numbered("fast_w", std::size_t(world)));
    CHECK(run.report["gemm"].get<std::string>() == "fast");
    CHECK(run.report["world_size"].get<int>() == world);
    check_close_losses(run.report["step_losses_rank0"], golden_step_losses(world));
    const auto want_lines = golden_run(world)["tutorial_print_lines"].get<std::vector<std::string>>();
    CHECK(epoch_lines(run.output).size() == want_lines.size());
    CHECK(run.report["eval_samples"].get<long>() == 1024);
  }
}

TEST_CASE("train_ddp --gemm fast matches the exact path on ragged and compute-bound shapes") {
  require_binary();
  // Batch and hidden sizes that are not multiples of the 8-row blocks or 8/16-column tiles (the
  // last batch is partial too), more than 2 classes, and the compute-bound job's shapes.
  const std::vector<std::vector<std::string>> shapes{
      {"--samples", "300", "--batch-size", "27", "--features", "5", "--hidden", "37", "--classes", "3", "--epochs", "2"},
      {"--samples", "2048", "--batch-size", "256", "--hidden", "1024", "--epochs", "1"}};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto args = shapes[i];
    args.insert(args.end(), {"--init-seed", "0"});
    const auto exact = run_train(args, numbered("exact_shape", i));
    args.insert(args.end(), {"--gemm", "fast"});
    const auto fast = run_train(args, numbered("fast_shape", i));
    INFO("shape " << i);
    check_close_losses(fast.report["step_losses_rank0"], exact.report["step_losses_rank0"].get<std::vector<double>>());
    const double want = exact.report["final_mean_loss"].get<double>(), got = fast.report["final_mean_loss"].get<double>();
    CHECK(std::fabs(got - want) <= 1e-4 * std::fabs(want));
  }
}

TEST_CASE("train_ddp rejects a bad option with a message") {
  require_binary();
  auto result = ddp::test::run_ranks(
      1,
      [](int) {
        std::vector<std::string> args{exe, "--epochs", "zero"};
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        ::execv(exe.c_str(), argv.data());
        throw std::runtime_error("execv failed");
      },
      std::chrono::seconds(30));
  REQUIRE(result.ranks.size() == 1);
  CHECK(result.ranks[0].exit_code != 0);
  CHECK(result.ranks[0].output.find("--epochs") != std::string::npos);
}

TEST_CASE("train_ddp --dataset digits, strong scaling at W = 1, 2, 4 (real ranks): PyTorch's lines, >= 0.9 held out") {
  require_binary();
  // Global batch 32 at every world size: per-rank batch 32 / W, the other options at their defaults.
  for (const auto& [name, world] : std::vector<std::pair<std::string, int>>{{"W1_b32", 1}, {"W2_b16", 2}, {"W4_b8", 4}}) {
    INFO(name);
    auto args = digits_args(name);
    args.insert(args.end(), {"--nproc-per-node", std::to_string(world)});
    const auto run = run_train(args, "digits_" + name);
    CHECK(run.report["simulated"].get<bool>() == false);
    check_digits(run, name);
  }
}

TEST_CASE("train_ddp --dataset digits --simulate-world equals the real ranks; the linear rule with warmup as PyTorch") {
  require_binary();
  for (const auto& [name, world] : std::vector<std::pair<std::string, int>>{{"W4_b8", 4}, {"W4_b32_linear", 4}}) {
    INFO(name);
    auto args = digits_args(name);
    args.insert(args.end(), {"--simulate-world", std::to_string(world)});
    const auto sim = run_train(args, "digits_sim_" + name);
    CHECK(sim.report["simulated"].get<bool>() == true);
    const auto c = check_digits(sim, name);
    if (name == "W4_b8") continue;  // its real run is in the test above
    args.resize(args.size() - 2);
    args.insert(args.end(), {"--nproc-per-node", std::to_string(world)});
    const auto real = run_train(args, "digits_real_" + name);
    check_digits(real, name);
    // The ring backend sums the ranks' gradients in rank order, as the simulation does.
    CHECK(real.report["step_losses_rank0"] == sim.report["step_losses_rank0"]);
    CHECK(real.report["final_params_bits"] == sim.report["final_params_bits"]);
    CHECK(c.steps == 120);
  }
}

TEST_CASE("train_ddp --dataset digits rejects the options the data fixes") {
  require_binary();
  for (const char* option : {"--features", "--classes", "--samples"}) {
    INFO(option);
    ddp::test::child_process p({exe, "--dataset", "digits", option, "12"});
    CHECK(p.wait(std::chrono::seconds(30)) != 0);
    CHECK_THAT(p.err_text + p.out_text, Catch::Contains("fixed by --dataset digits"));
  }
}

// --optimizer / --clip / --zero against tests/data/zero_golden.json: real torch 2.15 running DDP +
// ZeroRedundancyOptimizer on gloo (tests/scripts/make_zero_golden.py). Tolerances: AdamW's
// parameters are within ddp::optim::adamw_param_ulp_bound ulps of torch per step (torch's MKL
// sqrt, ddp/optim/adamw.hpp), and AdamW moves every parameter by about lr per step whatever its
// gradient, so those ulps add up over the run: final parameters within 1e-5 absolute (3e-6 seen);
// the clipped runs' norms differ from torch's in the last bits (ddp/optim/clip.hpp, and the sharded
// norm sums in double). Step losses within 1e-5 (1.2e-7 seen); printed sums within 1e-4.
namespace zero_golden {

const json& data() {
  static const json g = read_json(std::string(DDP_TEST_DATA_DIR) + "/zero_golden.json");
  return g;
}

double printed_sum(const std::string& line) { return std::stod(line.substr(line.rfind('=') + 1)); }

void check_against_torch(const run_output& run, const json& want) {
  const auto lines = epoch_lines(run.output);
  const auto& want_lines = want["printed_lines"];
  REQUIRE(lines.size() == want_lines.size());
  for (std::size_t i = 0; i < lines.size(); ++i) {
    INFO(lines[i] << " vs torch's " << want_lines[i].get<std::string>());
    CHECK(std::abs(printed_sum(lines[i]) - printed_sum(want_lines[i].get<std::string>())) <= 1e-4);
  }
  const auto& losses = run.report["step_losses_rank0"];
  const auto& want_losses = want["step_losses_rank0"];
  REQUIRE(losses.size() == want_losses.size());
  double worst_loss = 0, worst_param = 0;
  for (std::size_t i = 0; i < losses.size(); ++i)
    worst_loss = std::max(worst_loss, std::abs(losses[i].get<double>() - want_losses[i].get<double>()));
  const auto& params = run.report["final_params_bits"];
  const auto& want_params = want["final_params_bits"];
  REQUIRE(params.size() == want_params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    worst_param = std::max(worst_param, double(std::abs(bits_float(params[i].get<std::uint32_t>()) -
                                                        bits_float(want_params[i].get<std::uint32_t>()))));
  std::printf("  largest difference from torch: step loss %.3g, final parameter %.3g\n", worst_loss, worst_param);
  CHECK(worst_loss <= 1e-5);
  CHECK(worst_param <= 1e-5);
}

}  // namespace zero_golden

TEST_CASE("train_ddp --optimizer/--clip with --zero 0, 1, 2 (real ranks) stays with PyTorch's ZeroRedundancyOptimizer") {
  require_binary();
  for (const auto& [name, want] : zero_golden::data().items()) {
    if (name == "meta") continue;
    const int world = want["world_size"].get<int>();
    if (want["clip"].get<double>() > 0) REQUIRE(want["clipped_steps_rank0"].get<int>() > 0);  // the golden run clips
    std::optional<json> zero0_params;
    for (const char* zero : {"0", "1", "2"}) {
      INFO(name << " --zero " << zero);
      std::printf("%s --zero %s\n", name.c_str(), zero);
      std::vector<std::string> args{"--init-seed", "0", "--nproc-per-node", std::to_string(world), "--zero", zero};
      for (const auto& o : want["options"]) args.push_back(o.get<std::string>());
      const auto run = run_train(args, "zero_" + name + "_" + zero);
      CHECK(run.report["zero"].get<int>() == std::stoi(zero));
      zero_golden::check_against_torch(run, want);
      // Without clipping the update is elementwise and shm sums in rank order: ZeRO is DDP bit for bit.
      if (want["clip"].get<double>() == 0) {
        if (!zero0_params) zero0_params = run.report["final_params_bits"];
        CHECK(run.report["final_params_bits"] == *zero0_params);
      }
      // ZeRO keeps 1/W of DDP's optimizer state (W | the padded shard sizes round up per bucket).
      const auto& state = run.report["optimizer_state_bytes_by_rank"];
      REQUIRE(state.size() == std::size_t(world));
      if (std::string(zero) != "0") {
        const double full = double(want["final_params_bits"].size()) * 4 * (want["optimizer"] == "adamw" ? 2 : 1);
        for (const auto& s : state) CHECK(s.get<double>() <= full / world + 64);
      }
    }
  }
}

// --precision bf16 / fp16 against tests/data/precision_golden.json: real torch running the same
// mixed precision written out (tests/scripts/make_precision_golden.py: parameters and gradients
// rounded to the low type, averaged in float32 by a DDP comm hook on gloo, a float32 master,
// torch.amp.GradScaler for fp16 starting at 2^24 so that the first steps overflow and back off).
// At W = 2 the sum of two ranks is exact in either order and the rounding to the low type absorbs
// AdamW's last-bit differences: lines and parameters equal torch's bit for bit. At W = 3 gloo adds
// in another order, and AdamW moves every parameter by about lr per step whatever the gradient's
// size, so a last-bit difference can move a parameter by a few ulps of float16: final parameters
// within 5e-4 (1.2e-4 seen), step losses within 5e-5 (6.4e-6 seen), printed sums within 1e-4. The
// float32 run of the same job (kept in the golden file) is more than ten times that bound away,
// so the test tells mixed precision from float32.
namespace precision_golden {

double largest_difference(const json& params, const json& want) {
  REQUIRE(params.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    worst = std::max(worst, double(std::abs(bits_float(params[i].get<std::uint32_t>()) - bits_float(want[i].get<std::uint32_t>()))));
  return worst;
}

constexpr double param_bound = 5e-4;

void check_within_bounds(const run_output& run, const json& want) {
  const auto lines = epoch_lines(run.output);
  const auto want_lines = want["printed_lines"].get<std::vector<std::string>>();
  REQUIRE(lines.size() == want_lines.size());
  for (std::size_t i = 0; i < lines.size(); ++i) {
    INFO(lines[i] << " vs torch's " << want_lines[i]);
    CHECK(std::abs(zero_golden::printed_sum(lines[i]) - zero_golden::printed_sum(want_lines[i])) <= 1e-4);
  }
  const auto& losses = run.report["step_losses_rank0"];
  const auto& want_losses = want["step_losses_rank0"];
  REQUIRE(losses.size() == want_losses.size());
  double worst_loss = 0;
  for (std::size_t i = 0; i < losses.size(); ++i)
    worst_loss = std::max(worst_loss, std::abs(losses[i].get<double>() - want_losses[i].get<double>()));
  const double worst_param = largest_difference(run.report["final_params_bits"], want["final_params_bits"]);
  std::printf("  largest difference from torch: step loss %.3g, final parameter %.3g\n", worst_loss, worst_param);
  CHECK(worst_loss <= 5e-5);
  CHECK(worst_param <= param_bound);
}

}  // namespace precision_golden

TEST_CASE("train_ddp --precision bf16 and fp16 with --zero 0, 1, 2 (real ranks) equal torch's mixed precision") {
  require_binary();
  const json golden = read_json(std::string(DDP_TEST_DATA_DIR) + "/precision_golden.json");
  for (const auto& [name, want] : golden.items()) {
    if (name == "meta") continue;
    const int world = want["world_size"].get<int>();
    if (want["precision"] == "fp16") REQUIRE(want["skipped_steps"].get<int>() > 0);  // the golden run overflows and backs off
    REQUIRE(precision_golden::largest_difference(want["fp32_final_params_bits"], want["final_params_bits"]) >
            10 * precision_golden::param_bound);
    for (const char* zero : {"0", "1", "2"}) {
      INFO(name << " --zero " << zero);
      std::printf("%s --zero %s\n", name.c_str(), zero);
      std::vector<std::string> args{"--init-seed", "0", "--nproc-per-node", std::to_string(world), "--zero", zero};
      for (const auto& o : want["options"]) args.push_back(o.get<std::string>());
      const auto run = run_train(args, "precision_" + name + "_" + zero);
      CHECK(run.report["precision"] == want["precision"]);
      CHECK(run.report["skipped_steps"] == want["skipped_steps"]);
      CHECK(run.report["final_loss_scale"].get<double>() == want["final_loss_scale"].get<double>());
      if (world == 2) {
        CHECK(epoch_lines(run.output) == want["printed_lines"].get<std::vector<std::string>>());
        CHECK(run.report["final_params_bits"] == want["final_params_bits"]);
      } else {
        precision_golden::check_within_bounds(run, want);
      }
    }
  }
}

TEST_CASE("train_ddp rejects --optimizer options where they are not supported, with a message") {
  require_binary();
  for (const auto& args : std::vector<std::vector<std::string>>{{"--zero", "1", "--simulate-world", "2"},
                                                                {"--optimizer", "adamw", "--momentum", "0.9"},
                                                                {"--precision", "bf16", "--simulate-world", "2"},
                                                                {"--loss-scale", "1024"}}) {
    std::vector<std::string> full{exe};
    full.insert(full.end(), args.begin(), args.end());
    ddp::test::child_process p(full);
    CHECK(p.wait(std::chrono::seconds(30)) != 0);
    const std::string text = p.err_text + p.out_text;
    INFO(text);
    CHECK((text.find("not supported") != std::string::npos || text.find("is an sgd option") != std::string::npos ||
           text.find("needs --precision fp16") != std::string::npos));
  }
}

TEST_CASE("train_ddp --optimizer adamw --zero 1 and 2 at world size 1 equal --zero 0 bit for bit") {
  require_binary();
  std::optional<json> zero0;
  for (const char* zero : {"0", "1", "2"}) {
    INFO("--zero " << zero);
    const auto run = run_train({"--init-seed", "0", "--optimizer", "adamw", "--zero", zero}, std::string("zero_w1_") + zero);
    CHECK(run.report["world_size"].get<int>() == 1);
    if (!zero0) zero0 = run.report["final_params_bits"];
    CHECK(run.report["final_params_bits"] == *zero0);
    CHECK(run.report["step_losses_rank0"].size() == 96);
  }
}

// The optimizer's state in the checkpoint: a run stopped after 20 steps (--max-steps, a checkpoint
// every 10) and resumed continues as if never stopped, bit for bit, with AdamW's moments and step
// count (its bias correction) and SGD's momentum, replicated (--zero 0) or as each rank's shard;
// with --precision also the float32 master (not the model's rounded values) and the loss scale.
TEST_CASE("train_ddp --optimizer with --checkpoint-dir: stopped and resumed equals the run without a stop, bit for bit") {
  require_binary();
  struct config {
    std::vector<std::string> args;
    const char* tag;
  };
  for (const auto& c : std::vector<config>{{{"--optimizer", "adamw", "--zero", "0"}, "adamw0"},
                                           {{"--optimizer", "adamw", "--zero", "2"}, "adamw2"},
                                           {{"--optimizer", "sgd", "--momentum", "0.9", "--zero", "1", "--clip", "0.1"}, "sgd1"},
                                           // and the float32 master and the loss scale (its growth tracker,
                                           // its backoffs: 2^24 overflows on the first steps)
                                           {{"--precision", "fp16", "--loss-scale", "16777216", "--optimizer", "adamw", "--zero", "0"}, "fp16_0"},
                                           {{"--precision", "bf16", "--optimizer", "sgd", "--momentum", "0.9", "--zero", "2"}, "bf16_2"}}) {
    INFO(c.tag);
    std::vector<std::string> base{"--init-seed", "0", "--nproc-per-node", "2"};
    base.insert(base.end(), c.args.begin(), c.args.end());
    const auto whole = run_train(base, std::string("ckpt_whole_") + c.tag);
    const std::string dir = std::string(DDP_TEST_BINARY_DIR) + "/train_ddp_optimizer_ckpt_" + c.tag + "_" + std::to_string(::getpid());
    auto first = base;
    first.insert(first.end(), {"--checkpoint-dir", dir, "--checkpoint-every", "10", "--max-steps", "20"});
    run_train(first, std::string("ckpt_first_") + c.tag);
    auto second = base;
    second.insert(second.end(), {"--checkpoint-dir", dir});
    const auto resumed = run_train(second, std::string("ckpt_resumed_") + c.tag);
    std::filesystem::remove_all(dir);
    CHECK(resumed.report["resumed_from_step"].get<long>() == 20);
    CHECK(resumed.report["final_params_bits"] == whole.report["final_params_bits"]);
    CHECK(resumed.report["epoch_loss_sums_by_rank"] == whole.report["epoch_loss_sums_by_rank"]);
  }
}

TEST_CASE("train_ddp --zero 1: a checkpoint of 2 ranks does not resume with 3, with a message naming both") {
  require_binary();
  const std::string dir = std::string(DDP_TEST_BINARY_DIR) + "/train_ddp_zero_resize_" + std::to_string(::getpid());
  run_train({"--init-seed", "0", "--nproc-per-node", "2", "--optimizer", "adamw", "--zero", "1", "--checkpoint-dir", dir,
             "--checkpoint-every", "5", "--max-steps", "5"},
            "zero_resize_first");
  ddp::test::child_process p({exe, "--init-seed", "0", "--nproc-per-node", "3", "--optimizer", "adamw", "--zero", "1",
                              "--checkpoint-dir", dir, "--allow-world-size-change"});
  CHECK(p.wait(std::chrono::seconds(60)) != 0);
  std::filesystem::remove_all(dir);
  const std::string text = p.err_text + p.out_text;
  INFO(text);
  CHECK(text.find("shard of the optimizer state") != std::string::npos);
  CHECK(text.find("resume it with 2 ranks") != std::string::npos);
}
