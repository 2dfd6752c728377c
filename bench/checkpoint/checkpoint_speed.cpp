// ddp_bench_checkpoint: how fast ddp::checkpoint saves and loads a large state, against what the
// disk takes from dd in the same run.
//
//   ddp_bench_checkpoint [--dir DIR] [--bytes 1073741824] [--repeat 1]
//
// Rows: W = 1 (the state in replicated.safetensors, written by rank 0), W = 2 replicated (the
// same file; rank 1 writes only its small per-rank file) and W = 2 sharded (each rank holds half
// the state as per-rank tensors, as ZeRO's optimizer shards will: two files written at once).
// Each row is a job of this binary started by ddp::launch (ring backend over shared memory).
// Save: from a barrier to save()'s return (files written, fsynced, renamed, DONE durable). Load:
// load() of the same checkpoint after its files are dropped from the page cache
// (posix_fadvise DONTNEED on each; they are clean after the fsync), so it reads the disk; the
// loaded values are checked. dd: `dd if=/dev/zero of=DIR/x bs=1M count=N conv=fsync` for the
// same number of bytes, run just before each row. GB/s are 10^9 bytes per second, as dd's.
// With --repeat R each figure is the median of R runs.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/checkpoint.hpp"
#include "ddp/init.hpp"
#include "ddp/launch.hpp"

namespace {

namespace fs = std::filesystem;
namespace ck = ddp::checkpoint;
using clock_type = std::chrono::steady_clock;

struct options {
  fs::path dir = ".";
  std::size_t bytes = std::size_t{1} << 30;
  int repeat = 1;
  // Set by the driver for the jobs it launches.
  std::string worker_layout;  // replicated | sharded
  std::string worker_out;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") o.dir = value();
    else if (a == "--bytes") o.bytes = std::stoull(value());
    else if (a == "--repeat") o.repeat = std::max(1, std::stoi(value()));
    else if (a == "--worker") o.worker_layout = value();
    else if (a == "--worker-out") o.worker_out = value();
    else throw std::invalid_argument("unknown argument " + a + " (--dir DIR --bytes N --repeat R)");
  }
  if (o.bytes < 8 * 1024 || o.bytes % (8 * 1024) != 0) throw std::invalid_argument("--bytes: a multiple of 8 KiB");
  return o;
}

float pattern(std::size_t i, int rank) { return float((i * 2654435761u + std::size_t(rank)) % 65521u); }

void drop_from_page_cache(const fs::path& dir) {
  for (const auto& f : fs::directory_iterator(dir)) {
    const int fd = ::open(f.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// One rank: saves its state once per repetition into a fresh directory, loads it back, checks it.
int run_worker(const options& o) {
  ddp::group group = ddp::init_process_group("ring");
  const int rank = group.rank(), world = group.size();
  const bool sharded = o.worker_layout == "sharded";
  const std::size_t mine = (sharded ? o.bytes / std::size_t(world) : o.bytes) / sizeof(float);
  std::vector<float> values(mine);
  for (std::size_t i = 0; i < mine; ++i) values[i] = pattern(i, sharded ? rank : 0);
  std::vector<std::int64_t> tag{rank};  // every rank has a file of its own
  const auto state_over = [&] {
    ck::state st;
    st.add("state", std::span(values), {}, sharded ? ck::scope::per_rank : ck::scope::replicated);
    st.add("rank", std::span(tag), {}, ck::scope::per_rank);
    return st;
  };
  const auto seconds = [](clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); };
  std::vector<double> saves, loads;
  for (int r = 0; r < o.repeat; ++r) {
    const fs::path dir = o.dir / ("run-" + std::to_string(r));
    auto st = state_over();
    group.barrier();
    auto t0 = clock_type::now();
    const auto path = ck::save(group, dir, 1, st);
    saves.push_back(seconds(t0));
    if (rank == 0) drop_from_page_cache(path);
    std::fill(values.begin(), values.end(), 0.0f);
    group.barrier();
    t0 = clock_type::now();
    auto into = state_over();
    ck::load(path, rank, world, into);
    group.barrier();
    loads.push_back(seconds(t0));
    for (std::size_t i = 0; i < mine; ++i)
      if (values[i] != pattern(i, sharded ? rank : 0))
        throw std::runtime_error("rank " + std::to_string(rank) + ": loaded value " + std::to_string(i) + " differs");
    group.barrier();
    if (rank == 0) fs::remove_all(dir);
  }
  if (rank == 0) {
    std::ofstream out(o.worker_out);
    for (std::size_t i = 0; i < saves.size(); ++i) out << saves[i] << ' ' << loads[i] << '\n';
    if (!out) throw std::runtime_error("cannot write " + o.worker_out);
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// dd's fsynced write of `bytes` into dir: seconds, from dd's own report ("..., 1.23 s, ...").
double dd_seconds(const fs::path& dir, std::size_t bytes) {
  const fs::path target = dir / "dd.out";
  const std::string cmd = "dd if=/dev/zero of='" + target.string() + "' bs=1M count=" + std::to_string(bytes >> 20) +
                          (bytes % (1 << 20) ? " iflag=count_bytes" : "") + " conv=fsync 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run dd");
  std::string text;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) text += buf;
  const int rc = ::pclose(p);
  fs::remove(target);
  const auto comma = text.rfind(" s, ");
  const auto start = comma == std::string::npos ? comma : text.rfind(", ", comma);
  if (rc != 0 || start == std::string::npos) throw std::runtime_error("dd failed: " + text);
  return std::stod(text.substr(start + 2, comma - start - 2));
}

struct row {
  int world;
  std::string layout;
};

int run_driver(const options& o, int argc, char** argv) {
  const fs::path work = fs::absolute(o.dir) / ("ddp_checkpoint_speed." + std::to_string(::getpid()));
  fs::create_directories(work);
  std::printf("ddp_bench_checkpoint: %zu bytes in %s, median of %d\n", o.bytes, work.c_str(), o.repeat);
  std::printf("| W | layout     |      bytes | save s | load s | save GB/s | load GB/s | dd GB/s | save / dd |\n");
  std::printf("|---|------------|------------|--------|--------|-----------|-----------|---------|-----------|\n");
  int code = 0;
  try {
    for (const row& r : {row{1, "replicated"}, row{2, "replicated"}, row{2, "sharded"}}) {
      std::vector<double> dds;
      for (int i = 0; i < o.repeat; ++i) dds.push_back(dd_seconds(work, o.bytes));
      std::vector<std::string> args(argv, argv + argc);
      args[0] = fs::read_symlink("/proc/self/exe").string();
      const fs::path out = work / "result.txt";
      args.insert(args.end(), {"--dir", work.string(), "--worker", r.layout, "--worker-out", out.string()});
      ddp::launch_options lo;
      lo.nproc_per_node = r.world;
      lo.standalone = true;
      lo.master_port = 0;
      lo.name = "ddp_bench_checkpoint";
      const auto result = ddp::launch(lo, args);
      if (!result.ok()) throw std::runtime_error("the W = " + std::to_string(r.world) + " " + r.layout + " job failed");
      std::ifstream in(out);
      std::vector<double> saves, loads;
      for (double s = 0, l = 0; in >> s >> l;) saves.push_back(s), loads.push_back(l);
      if (saves.empty()) throw std::runtime_error("the job wrote no results");
      const double save = median(saves), load = median(loads), dd = median(dds), gb = double(o.bytes) / 1e9;
      std::printf("| %d | %-10s | %10zu | %6.2f | %6.2f | %9.2f | %9.2f | %7.2f | %9.2f |\n", r.world, r.layout.c_str(),
                  o.bytes, save, load, gb / save, gb / load, gb / dd, dd / save);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_checkpoint: %s\n", e.what());
    code = 1;
  }
  fs::remove_all(work);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    return o.worker_layout.empty() ? run_driver(o, argc, argv) : run_worker(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_checkpoint: %s\n", e.what());
    return 1;
  }
}
