// ddp_bench_nccl: float32 sum all-reduce on device memory, ncclAllReduce called directly ("nccl")
// next to the same all-reduce through ddp::process_group<ddp::nccl_backend> ("ddp"), sizes
// 4 B .. 64 MiB doubling, in the nccl-tests columns (busbw = algbw * 2(p-1)/p). The ratio
// ddp busbw / nccl busbw is what the wrapper costs (goal: >= 0.95 from 64 KiB up).
//
//   ddp_bench_nccl [--np N] [--rounds R] [--timeout S] [--no-collective-check] [--check] [--out-of-place]
//                  [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] [--csv] [--system NAME]
//
// Ranks: forks --np processes (default 1), rank r on device r; rendezvous through a file_store in
// a temporary directory. The parent never touches CUDA (a CUDA context does not survive fork) and
// kills the ranks after --timeout seconds (default 600). Each rank builds two communicators: the
// ddp group (nccl_backend) and its own ncclComm_t (ncclCommInitRank, its own stream), whose
// unique id rank 0 publishes through the same store under another key.
//
// Method: ddp's all_reduce is blocking (it returns when the stream work is complete), so the raw
// side synchronizes after each call too (ncclAllReduce + cudaStreamSynchronize): both sides are
// timed the same way, host wall clock around N synchronized calls, and the difference is the
// wrapper's cost per call (including its per-call fingerprint all-reduce, which
// --no-collective-check turns off). A size runs R rounds (default 5); each round times both sides,
// alternating which goes first, so machine noise lands on both alike. A round's time is the
// slowest rank's mean per call; the table shows the median over rounds. With one rank busbw is 0,
// so the ratio is nccl time / ddp time (the same number busbw gives for p > 1).
//
// In place by default (DDP's use). --out-of-place reads one buffer and writes another on both
// sides (nccl-tests' first columns): with one rank NCCL's in-place all-reduce moves nothing and
// returns at once, so only the out-of-place sweep (a device copy) shows data moving there.
//
// --check verifies one all-reduce of each side per size against p (p + 1) / 2 (rank r
// contributes r + 1), read back to the host. Progress goes to stderr, the table (or --csv rows,
// system "nccl" and "ddp") to stdout from rank 0.
//
// Exit status: 0 done, 1 a check or a rank failed, 2 bad flags or fewer visible devices than
// --np, 77 no CUDA device visible (SKIPPED).
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/bench_table.hpp"
#include "ddp/backends/nccl.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"

namespace {

constexpr int exit_failed = 1;
constexpr int exit_usage = 2;
constexpr int exit_skipped = 77;
constexpr std::size_t wrapper_goal_from_bytes = std::size_t{64} << 10;
constexpr double wrapper_goal_ratio = 0.95;

struct options {
  ddp::bench::sweep_options sweep;
  int np = 1;
  int rounds = 5;
  int timeout_s = 600;
  bool collective_check = true;  // nccl_options::check_collectives of the ddp side
  bool check = false;
  bool out_of_place = false;
};

using ddp::detail::cuda_check;
using ddp::detail::nccl_check;
template <class T>
using device_array = ddp::device_buffer<T>;

// The benchmark's own communicator and stream: NCCL with no ddp layer in between.
class raw_nccl {
 public:
  raw_nccl(ddp::store::store& store, int rank, int size) {
    // ddp's backend publishes its own id under "ddp/nccl/unique_id".
    const ncclUniqueId id = ddp::detail::share_unique_id(store, rank, "bench/nccl/raw_unique_id", [] {
      ncclUniqueId made{};
      nccl_check(ncclGetUniqueId(&made), "ncclGetUniqueId");
      return made;
    });
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    nccl_check(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
  }
  ~raw_nccl() {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  raw_nccl(const raw_nccl&) = delete;
  raw_nccl& operator=(const raw_nccl&) = delete;

  void all_reduce(void* data, std::size_t count, ncclDataType_t type, ncclRedOp_t op) { all_reduce(data, data, count, type, op); }
  void all_reduce(const void* in, void* out, std::size_t count, ncclDataType_t type, ncclRedOp_t op) {
    nccl_check(ncclAllReduce(in, out, count, type, op, comm_, stream_), "ncclAllReduce", comm_);
  }
  void synchronize() { cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

// cudaMemcpy from pageable memory may return before the data reaches the device, and the raw
// stream is not ordered after the legacy stream: synchronize the device before NCCL reads it.
void upload(float* device, const std::vector<float>& host, std::size_t count) {
  cuda_check(cudaMemcpy(device, host.data(), count * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

using ddp_group = ddp::process_group<ddp::nccl_backend>;

struct rank_state {
  const options& o;
  int rank;
  int size;
  ddp_group& group;
  raw_nccl& raw;
  device_array<float>& raw_buffer;
  device_array<float>& ddp_buffer;
  float* raw_output;  // raw_buffer's data in place, another buffer out of place
  float* ddp_output;
  device_array<double>& scratch;  // the barrier's element, then the per-size results to reduce
};

// Every rank leaves together, so a timed block starts at the same moment everywhere.
void barrier(rank_state& s) {
  s.raw.all_reduce(s.scratch.data(), 1, ncclFloat64, ncclMax);
  s.raw.synchronize();
}

// Seconds per call, this rank's mean over `iters` synchronized calls of one side.
template <class Call>
double time_calls(rank_state& s, int iters, Call&& call) {
  barrier(s);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
}

// One all-reduce of rank + 1 everywhere must give p (p + 1) / 2; returns 1 on a mismatch.
template <class Call>
int check_side(rank_state& s, const char* side, float* input, float* output, std::size_t count, Call&& call, std::vector<float>& host) {
  std::fill_n(host.begin(), count, static_cast<float>(s.rank + 1));
  upload(input, host, count);
  if (output != input) cuda_check(cudaMemset(output, 0, count * sizeof(float)), "cudaMemset");  // a sum left behind would pass
  call();
  cuda_check(cudaMemcpy(host.data(), output, count * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  const float want = static_cast<float>(s.size * (s.size + 1) / 2);
  int failures = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (host[i] != want) {
      std::fprintf(stderr, "rank %d: %s check failed at %zu bytes, element %zu: %g != %g\n", s.rank, side, count * sizeof(float), i,
                   static_cast<double>(host[i]), static_cast<double>(want));
      failures = 1;
      break;
    }
  }
  std::fill_n(host.begin(), count, 0.0f);  // zeros again: timing runs stay finite
  upload(input, host, count);
  return failures;
}

void print_table_header(const options& o, int p) {
  if (o.sweep.csv) {
    ddp::bench::print_header(o.sweep, p, "");
    return;
  }
  std::printf("# float32 sum all-reduce %s, %d ranks: ncclAllReduce called directly (nccl) vs ddp::process_group<nccl_backend> (ddp%s)\n",
              o.out_of_place ? "out of place" : "in place", p, o.collective_check ? ", collective check on" : ", collective check off");
  std::printf("# every call synchronized; time: median over %d rounds of the slowest rank's mean per call\n", o.rounds);
  if (p == 1) std::printf("# 1 rank: busbw is 0, so ratio = nccl time / ddp time\n");
  else std::printf("# ratio = ddp busbw / nccl busbw\n");
  std::printf("%12s %12s %8s %14s %16s %14s %16s %8s\n", "size(B)", "count", "type", "nccl time(us)", "nccl busbw(GB/s)", "ddp time(us)",
              "ddp busbw(GB/s)", "ratio");
  std::fflush(stdout);
}

double busbw(std::size_t bytes, double seconds, int p) { return static_cast<double>(bytes) / seconds / 1e9 * 2.0 * (p - 1) / p; }

void print_table_row(const options& o, int p, std::size_t bytes, double raw_s, double ddp_s) {
  if (o.sweep.csv) {
    ddp::bench::sweep_options as = o.sweep;
    as.system = "nccl";
    ddp::bench::print_row(as, p, bytes, raw_s);
    ddp::bench::print_row(o.sweep, p, bytes, ddp_s);
    return;
  }
  std::printf("%12zu %12zu %8s %14.2f %16.3f %14.2f %16.3f %8.3f\n", bytes, bytes / 4, "float", raw_s * 1e6, busbw(bytes, raw_s, p),
              ddp_s * 1e6, busbw(bytes, ddp_s, p), raw_s / ddp_s);
  std::fflush(stdout);
}

int sweep(rank_state& s) {
  const options& o = s.o;
  const std::size_t max_count = std::max<std::size_t>(o.sweep.max_bytes / 4, 1);
  std::vector<float> host(max_count, 0.0f);
  upload(s.raw_buffer.data(), host, max_count);
  upload(s.ddp_buffer.data(), host, max_count);
  if (s.rank == 0) print_table_header(o, s.size);

  int failed_sizes = 0;
  double worst_ratio = 0;
  std::size_t worst_bytes = 0;
  for (std::size_t bytes : ddp::bench::sizes(o.sweep)) {
    const std::size_t count = bytes / 4;
    auto raw_call = [&] {
      s.raw.all_reduce(s.raw_buffer.data(), s.raw_output, count, ncclFloat32, ncclSum);
      s.raw.synchronize();
    };
    auto ddp_call = [&] {
      const std::span<float> out(s.ddp_output, count);
      if (s.o.out_of_place) s.group.all_reduce(std::span<const float>(s.ddp_buffer.data(), count), out, ddp::sum{});
      else s.group.all_reduce(out, ddp::sum{});
    };
    const int iters = ddp::bench::iterations_for(bytes, o.sweep.iters);
    if (s.rank == 0) std::fprintf(stderr, "ddp_bench_nccl: %zu bytes, %d rounds of %d calls per side\n", bytes, o.rounds, iters);

    const int warmup = ddp::bench::warmup_for(bytes, o.sweep);
    for (int i = 0; i < warmup; ++i) raw_call();
    for (int i = 0; i < warmup; ++i) ddp_call();
    // results: [raw per round..., ddp per round..., check failures], reduced with max over ranks.
    std::vector<double> results(2 * static_cast<std::size_t>(o.rounds) + 1, 0.0);
    for (int round = 0; round < o.rounds; ++round) {
      const bool raw_first = round % 2 == 0;
      double& raw_time = results[static_cast<std::size_t>(round)];
      double& ddp_time = results[static_cast<std::size_t>(o.rounds + round)];
      if (raw_first) raw_time = time_calls(s, iters, raw_call);
      ddp_time = time_calls(s, iters, ddp_call);
      if (!raw_first) raw_time = time_calls(s, iters, raw_call);
    }
    if (o.check) {
      results.back() = check_side(s, "nccl", s.raw_buffer.data(), s.raw_output, count, raw_call, host) +
                       check_side(s, "ddp", s.ddp_buffer.data(), s.ddp_output, count, ddp_call, host);
    }
    cuda_check(cudaMemcpy(s.scratch.data(), results.data(), results.size() * sizeof(double), cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    s.raw.all_reduce(s.scratch.data(), results.size(), ncclFloat64, ncclMax);
    s.raw.synchronize();
    cuda_check(cudaMemcpy(results.data(), s.scratch.data(), results.size() * sizeof(double), cudaMemcpyDeviceToHost), "cudaMemcpy");

    const auto rounds = results.begin();
    const double raw_s = ddp::bench::median(std::vector<double>(rounds, rounds + o.rounds));
    const double ddp_s = ddp::bench::median(std::vector<double>(rounds + o.rounds, rounds + 2 * o.rounds));
    if (results.back() > 0) ++failed_sizes;
    const double ratio = raw_s / ddp_s;
    if (bytes >= wrapper_goal_from_bytes && (worst_bytes == 0 || ratio < worst_ratio)) {
      worst_ratio = ratio;
      worst_bytes = bytes;
    }
    if (s.rank == 0) print_table_row(o, s.size, bytes, raw_s, ddp_s);
  }

  if (s.rank == 0) {
    // With --csv the summary goes to stderr, so stdout stays one CSV table.
    std::FILE* summary = o.sweep.csv ? stderr : stdout;
    if (worst_bytes == 0) {
      std::fprintf(summary, "wrapper cost: ratio >= %.2f at every size >= 64 KiB: n/a (no size >= 64 KiB in the sweep)\n", wrapper_goal_ratio);
    } else {
      std::fprintf(summary, "wrapper cost: ratio >= %.2f at every size >= 64 KiB: %s (worst %.3f at %zu bytes)\n", wrapper_goal_ratio,
                   worst_ratio >= wrapper_goal_ratio ? "yes" : "no", worst_ratio, worst_bytes);
    }
    if (o.check) std::fprintf(summary, "check: %s\n", failed_sizes == 0 ? "every size correct on both sides" : (std::to_string(failed_sizes) + " size(s) failed").c_str());
    std::fflush(summary);
  }
  return failed_sizes == 0 ? 0 : exit_failed;
}

// One rank, in its own process. Returns the process's exit status.
int run_rank(int rank, const options& o, const std::string& store_path) {
  int devices = 0;
  if (const cudaError_t code = cudaGetDeviceCount(&devices); code != cudaSuccess || devices == 0) {
    if (rank == 0) {
      std::fprintf(stderr, "SKIPPED: no CUDA device visible (%s)\n",
                   code != cudaSuccess ? cudaGetErrorString(code) : "cudaGetDeviceCount found 0 devices");
    }
    return exit_skipped;
  }
  if (o.np > devices) {
    if (rank == 0) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      std::fprintf(stderr, "ddp_bench_nccl: --np %d needs %d CUDA devices (one per rank), but only %d are visible (CUDA_VISIBLE_DEVICES=%s)\n",
                   o.np, o.np, devices, visible != nullptr ? visible : "unset");
    }
    return exit_usage;
  }
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");

  ddp::store::file_store store(store_path);
  ddp::nccl_options nccl_options;
  nccl_options.local_rank = rank;
  nccl_options.check_collectives = o.collective_check;
  ddp_group group(ddp::nccl_backend(store, rank, o.np, nccl_options));
  raw_nccl raw(store, rank, o.np);

  const std::size_t max_count = std::max<std::size_t>(o.sweep.max_bytes / 4, 1);
  device_array<float> raw_buffer(max_count);
  device_array<float> ddp_buffer(max_count);
  device_array<float> raw_output(o.out_of_place ? max_count : 0);
  device_array<float> ddp_output(o.out_of_place ? max_count : 0);
  device_array<double> scratch(2 * static_cast<std::size_t>(o.rounds) + 1);
  cuda_check(cudaMemset(scratch.data(), 0, sizeof(double)), "cudaMemset");  // the barrier reduces element 0
  rank_state state{o,          rank,          o.np, group, raw, raw_buffer, ddp_buffer,
                   o.out_of_place ? raw_output.data() : raw_buffer.data(), o.out_of_place ? ddp_output.data() : ddp_buffer.data(), scratch};
  return sweep(state);
}

void print_usage(std::FILE* to) {
  std::fprintf(to,
               "usage: ddp_bench_nccl [--np N] [--rounds R] [--timeout S] [--no-collective-check] [--check] [--out-of-place]\n"
               "                      [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] [--csv] [--system NAME]\n"
               "  --np N                 ranks, one per GPU (default 1)\n"
               "  --rounds R             rounds per size, both sides timed in each, alternating order (default 5)\n"
               "  --timeout S            kill the ranks after S seconds (default 600)\n"
               "  --no-collective-check  ddp side without its per-call fingerprint all-reduce\n"
               "  --check                verify one all-reduce per size and side against p(p+1)/2\n"
               "  --out-of-place         read one buffer, write another (default: in place, as DDP does)\n"
               "  --min-bytes B          smallest size (default 4); sizes double up to --max-bytes\n"
               "  --max-bytes B          largest size (default 67108864)\n"
               "  --iters N              calls per timed block, scaled by size: x100 below 64 KiB, x10 below 1 MiB, fewer from 1 MiB (default 20)\n"
               "  --warmup N             untimed calls per side and size (default 5)\n"
               "  --csv                  CSV rows, systems \"nccl\" and NAME (--system, default \"ddp\")\n"
               "exit status: 0 done, 1 a check or rank failed, 2 bad flags or too few GPUs, 77 no GPU visible (skipped)\n");
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ddp_bench_nccl: %s\n", why.c_str());
  print_usage(stderr);
  std::exit(exit_usage);
}

int parse_positive(const std::string& flag, const std::string& text) {
  const auto value = ddp::bench::parse_int(text, 1, 1000000);
  if (!value) usage(flag + " " + text + ": expected a positive integer");
  return *value;
}

options parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      print_usage(stdout);
      std::exit(0);
    }
  }
  options o;
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, o.sweep, rest)) std::exit(exit_usage);
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const std::string& flag = rest[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= rest.size()) usage(flag + " needs a value");
      return rest[++i];
    };
    if (flag == "--np") o.np = parse_positive(flag, value());
    else if (flag == "--rounds") o.rounds = parse_positive(flag, value());
    else if (flag == "--timeout") o.timeout_s = parse_positive(flag, value());
    else if (flag == "--no-collective-check") o.collective_check = false;
    else if (flag == "--check") o.check = true;
    else if (flag == "--out-of-place") o.out_of_place = true;
    else usage("unknown flag " + flag);
  }
  if (o.np > 64) usage("--np must be 1..64");
  if (o.rounds > 1000) usage("--rounds must be 1..1000");
  return o;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "stopped (status " + std::to_string(status) + ")";
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);

  // The store lives in a fresh temporary directory, removed when the ranks are done.
  std::string dir_template = (std::filesystem::temp_directory_path() / "ddp_bench_nccl_XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    std::perror("ddp_bench_nccl: mkdtemp");
    return exit_failed;
  }
  const std::string dir = dir_template;
  const std::string store_path = dir + "/store";
  auto remove_temporaries = [&] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  };

  std::fflush(nullptr);  // the children must not inherit buffered output
  std::vector<pid_t> pids;
  for (int r = 0; r < o.np; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("ddp_bench_nccl: fork");
      for (pid_t started : pids) ::kill(started, SIGKILL);
      for (pid_t started : pids) ::waitpid(started, nullptr, 0);
      remove_temporaries();
      return exit_failed;
    }
    if (pid == 0) {
      int code = exit_failed;
      try {
        code = run_rank(r, o, store_path);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ddp_bench_nccl: rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }

  // Wait with a deadline; once a rank has failed, the others get a short grace period (they may
  // be blocked in NCCL waiting for it) and are then killed.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::seconds(o.timeout_s);
  constexpr auto grace = std::chrono::seconds(10);
  auto kill_at = deadline;
  std::vector<int> statuses(pids.size(), -1);
  std::size_t running = pids.size();
  bool timed_out = false;
  while (running > 0) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (statuses[r] != -1) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      statuses[r] = status;
      --running;
      const bool clean = WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == exit_skipped);
      if (!clean) kill_at = std::min(kill_at, clock::now() + grace);
    }
    if (running > 0 && clock::now() >= kill_at) {
      timed_out = clock::now() >= deadline;
      for (std::size_t r = 0; r < pids.size(); ++r)
        if (statuses[r] == -1) ::kill(pids[r], SIGKILL);
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (statuses[r] == -1) {
          ::waitpid(pids[r], &statuses[r], 0);
          --running;
        }
      }
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  remove_temporaries();

  if (timed_out) std::fprintf(stderr, "ddp_bench_nccl: not done within --timeout %d s; the remaining ranks were killed\n", o.timeout_s);
  // Every rank agreeing on a status (0, 1, 2 or 77) is the answer; anything else is a failure.
  const int first = statuses[0];
  const bool agreed = std::all_of(statuses.begin(), statuses.end(), [&](int s) { return s == first; });
  if (!timed_out && agreed && WIFEXITED(first)) return WEXITSTATUS(first);
  for (std::size_t r = 0; r < pids.size(); ++r) {
    if (!(WIFEXITED(statuses[r]) && WEXITSTATUS(statuses[r]) == 0))
      std::fprintf(stderr, "ddp_bench_nccl: rank %zu (pid %d) %s\n", r, static_cast<int>(pids[r]), describe_status(statuses[r]).c_str());
  }
  return exit_failed;
}
